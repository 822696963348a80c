//! The legacy PC ports a Linux guest pokes while it boots, reboots and powers off, other than
//! COM1 (see [`super::serial`]) and what KVM's in-kernel irqchip and PIT already handle (PIC
//! 0x20/0xa0, ELCR 0x4d0, PIT 0x40-0x43, speaker 0x61).
//!
//! | ports | what | reads | writes |
//! |---|---|---|---|
//! | 0x80 | debug port ([`super::debugport`]) | all ones | boot markers (in `LinuxDevices`) |
//! | 0x70, 0x71 | CMOS RTC ([`Cmos`]) | the host's UTC time in BCD, status A/B/D | index, ignored |
//! | 0x60, 0x64 | i8042 keyboard controller | 0 (no data, input buffer empty) | 0xfe to 0x64: reboot |
//! | 0x2f8, 0x3e8, 0x2e8 (+0..7) | COM2-COM4, absent | all ones | ignored |
//! | 0xcf8-0xcff | PCI configuration mechanism 1, no bus | all ones | ignored; 0xcf9 with bit 2: reboot |
//! | [`SLEEP_CONTROL_PORT`] | ACPI sleep control register | 0 | `SLP_EN` with `SLP_TYP` = S5: power-off |
//! | [`SLEEP_STATUS_PORT`] | ACPI sleep status register | 0 | ignored |
//! | [`RESET_PORT`] | ACPI reset register | 0 | [`RESET_VALUE`]: reboot |
//! | [`PVPANIC_PORT`] | pvpanic | the events supported (panicked, crash loaded) | panicked: the guest failed |
//!
//! With a split irqchip (`boot.irqchip = "split"`) KVM has no PIC and no PIT, and their ports
//! come here as absent devices ([`Legacy::without_pic_and_pit`]):
//!
//! | ports | what | reads | writes |
//! |---|---|---|---|
//! | 0x20, 0x21, 0xa0, 0xa1 | 8259 PICs, absent | all ones (Linux's probe then finds none) | ignored |
//! | 0x40-0x43 | 8254 PIT, absent | all ones | ignored |
//! | 0x61 | system control port B | 0 | ignored |
//! | 0x4d0, 0x4d1 | ELCR | 0 (every ISA IRQ edge) | ignored |
//!
//! The sleep and reset registers are the ones the FADT built by `vmhost_boot::build_acpi` names.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use vmhost_boot::{
    PVPANIC_CRASH_LOADED, PVPANIC_PANICKED, PVPANIC_PORT, RESET_PORT, RESET_VALUE, S5_SLEEP_TYPE,
    SLEEP_CONTROL_PORT, SLEEP_STATUS_PORT, SLP_EN, SLP_TYP_MASK,
};

/// How a guest asked to be rebooted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "via", rename_all = "snake_case")]
pub enum RebootVia {
    /// 0xfe written to the i8042 command port 0x64 (Linux's `reboot=k`, its default fallback).
    KeyboardController,
    /// The FADT reset register (Linux's `reboot=a`, its first choice).
    AcpiResetRegister,
    /// A reset through port 0xcf9 (Linux's `reboot=p`).
    ResetControl,
    /// `KVM_EXIT_SHUTDOWN`: a triple fault, which resets a PC (`reboot=t`, or a crash before the
    /// kernel has an IDT).
    TripleFault {
        /// Exception vector KVM last recorded, if any.
        vector: Option<u8>,
        /// Guest RIP.
        rip: u64,
    },
}

/// What a port write asks of the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortAction {
    /// Handled; the guest goes on.
    Handled,
    /// No device here.
    Unknown,
    /// The guest powers off.
    PowerOff,
    /// The guest reboots.
    Reboot(RebootVia),
    /// The guest kernel panicked (pvpanic "panicked" event).
    Panic,
}

/// i8042 command: pulse the CPU reset line.
const I8042_RESET: u8 = 0xfe;
/// Port 0xcf9 bit: reset CPU.
const CF9_RESET: u8 = 1 << 2;
const COM_PORTS: [u16; 3] = [0x2f8, 0x3e8, 0x2e8];

/// A minimal MC146818 CMOS RTC: the index register and read-only time and status registers.
#[derive(Debug, Default)]
pub struct Cmos {
    index: u8,
}

impl Cmos {
    /// CMOS register `reg` with the current UTC time in BCD, 24-hour mode.
    fn read(&self, now_secs: u64) -> u8 {
        let days = now_secs / 86_400;
        let secs = now_secs % 86_400;
        let (year, month, day) = civil_from_days(days);
        let bcd = |v: u64| {
            let v = u8::try_from(v % 100).unwrap_or(0);
            ((v / 10) << 4) | (v % 10)
        };
        match self.index & 0x7f {
            0x00 => bcd(secs % 60),
            0x02 => bcd(secs / 60 % 60),
            0x04 => bcd(secs / 3600),
            0x06 => bcd((days + 4) % 7 + 1), // 1970-01-01 was a Thursday (day 5 of 1..7)
            0x07 => bcd(day),
            0x08 => bcd(month),
            0x09 => bcd(year % 100),
            0x32 => bcd(year / 100),
            0x0a => 0x26, // divider on, 1024 Hz, update not in progress
            0x0b => 0x02, // 24-hour mode, BCD, no interrupts
            0x0d => 0x80, // battery good, time valid
            _ => 0,
        }
    }
}

/// Year, month (1-12) and day (1-31) of `days` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// The legacy ports' state.
#[derive(Debug, Default)]
pub struct Legacy {
    cmos: Cmos,
    /// The PIC, PIT, port B and ELCR ports are ours (a split irqchip).
    no_pic_pit: bool,
}

/// The ports of the PICs, the PIT, port B and the ELCR (KVM's with its in-kernel irqchip).
fn pic_pit_port(port: u16) -> bool {
    matches!(port, 0x20 | 0x21 | 0xa0 | 0xa1 | 0x61 | 0x4d0 | 0x4d1) || in_range(port, 0x40, 4)
}

fn in_range(port: u16, base: u16, len: u16) -> bool {
    port >= base && port - base < len
}

impl Legacy {
    /// The ports of a VM with a split irqchip: these, and the absent PIC and PIT.
    pub fn without_pic_and_pit() -> Self {
        Legacy {
            no_pic_pit: true,
            ..Legacy::default()
        }
    }

    fn serves(&self, port: u16) -> bool {
        Self::claims(port) || (self.no_pic_pit && pic_pit_port(port))
    }

    /// True when `port` is one of this module's ports (with KVM's PIC and PIT).
    pub fn claims(port: u16) -> bool {
        matches!(
            port,
            0x80 | 0x70
                | 0x71
                | 0x60
                | 0x64
                | SLEEP_CONTROL_PORT
                | SLEEP_STATUS_PORT
                | RESET_PORT
                | PVPANIC_PORT
        ) || in_range(port, 0xcf8, 8)
            || COM_PORTS.iter().any(|&b| in_range(port, b, 8))
    }

    /// The state that moves with the VM: the CMOS index (the power-off, reset and pvpanic
    /// ports keep nothing between writes).
    pub fn save(&self) -> vmhost_devices::persist::LegacyState {
        vmhost_devices::persist::LegacyState {
            cmos_index: self.cmos.index,
        }
    }

    /// Takes over a saved state.
    pub fn restore(&mut self, saved: &vmhost_devices::persist::LegacyState) {
        self.cmos.index = saved.cmos_index;
    }

    /// A read of `data.len()` bytes from `port`; false when the port is not ours.
    pub fn read(&mut self, port: u16, data: &mut [u8]) -> bool {
        if !self.serves(port) {
            return false;
        }
        let value = match port {
            0x71 => {
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                self.cmos.read(now)
            }
            0x60 | 0x64 | SLEEP_CONTROL_PORT | SLEEP_STATUS_PORT | RESET_PORT => 0,
            0x61 | 0x4d0 | 0x4d1 => 0,
            PVPANIC_PORT => PVPANIC_PANICKED | PVPANIC_CRASH_LOADED,
            _ => 0xff,
        };
        data.fill(value);
        true
    }

    /// A write of `data` to `port`.
    pub fn write(&mut self, port: u16, data: &[u8]) -> PortAction {
        if !self.serves(port) {
            return PortAction::Unknown;
        }
        let first = data.first().copied().unwrap_or(0);
        match port {
            0x70 => self.cmos.index = first,
            0x64 if first == I8042_RESET => {
                return PortAction::Reboot(RebootVia::KeyboardController)
            }
            0xcf9 if data.len() == 1 && first & CF9_RESET != 0 => {
                return PortAction::Reboot(RebootVia::ResetControl)
            }
            SLEEP_CONTROL_PORT
                if first & SLP_EN != 0 && (first & SLP_TYP_MASK) >> 2 == S5_SLEEP_TYPE =>
            {
                return PortAction::PowerOff
            }
            RESET_PORT if first == RESET_VALUE => {
                return PortAction::Reboot(RebootVia::AcpiResetRegister)
            }
            PVPANIC_PORT if first & PVPANIC_PANICKED != 0 => return PortAction::Panic,
            PVPANIC_PORT if first & PVPANIC_CRASH_LOADED != 0 => {
                tracing::warn!("the guest kernel crashed; its crash kernel takes over");
            }
            _ => {}
        }
        PortAction::Handled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pic_and_pit_ports_are_absent_devices_only_with_a_split_irqchip() {
        let mut kernel = Legacy::default();
        let mut split = Legacy::without_pic_and_pit();
        for port in [0x20, 0x21, 0xa0, 0xa1, 0x40, 0x43, 0x61, 0x4d0, 0x4d1] {
            let mut b = [0x5a];
            assert!(!kernel.read(port, &mut b), "{port:#x} is KVM's");
            assert_eq!(kernel.write(port, &[0]), PortAction::Unknown);
            assert!(split.read(port, &mut b), "{port:#x}");
            assert_eq!(split.write(port, &[0xfb]), PortAction::Handled);
        }
        // Linux's 8259 probe writes 0xfb to the master's mask and reads it back: all ones
        // mean no PIC.
        let mut imr = [0];
        split.read(0x21, &mut imr);
        assert_eq!(imr, [0xff]);
        let mut b = [0xff];
        split.read(0x61, &mut b);
        assert_eq!(b, [0]);
        assert!(!split.read(0x44, &mut b), "not a PIT port");
    }

    #[test]
    fn reboot_and_power_off_writes_are_recognised() {
        let mut l = Legacy::default();
        assert_eq!(
            l.write(0x64, &[0xfe]),
            PortAction::Reboot(RebootVia::KeyboardController)
        );
        assert_eq!(l.write(0x64, &[0xd1]), PortAction::Handled);
        let s5 = SLP_EN | (S5_SLEEP_TYPE << 2);
        assert_eq!(l.write(SLEEP_CONTROL_PORT, &[s5]), PortAction::PowerOff);
        assert_eq!(
            l.write(SLEEP_CONTROL_PORT, &[S5_SLEEP_TYPE << 2]),
            PortAction::Handled,
            "no SLP_EN"
        );
        assert_eq!(l.write(SLEEP_STATUS_PORT, &[0x80]), PortAction::Handled);
        assert_eq!(
            l.write(RESET_PORT, &[RESET_VALUE]),
            PortAction::Reboot(RebootVia::AcpiResetRegister)
        );
        assert_eq!(
            l.write(0xcf9, &[0x06]),
            PortAction::Reboot(RebootVia::ResetControl)
        );
        assert_eq!(l.write(0xcf8, &[0, 0, 0, 0x80]), PortAction::Handled);
        assert_eq!(l.write(0x1234, &[0]), PortAction::Unknown);
        assert_eq!(l.write(PVPANIC_PORT, &[1]), PortAction::Panic);
        assert_eq!(
            l.write(PVPANIC_PORT, &[2]),
            PortAction::Handled,
            "crash kernel loaded"
        );
        let mut b = [0u8; 1];
        assert!(l.read(PVPANIC_PORT, &mut b));
        assert_eq!(b, [3], "both events supported");
    }

    #[test]
    fn absent_devices_read_all_ones_and_the_keyboard_controller_is_idle() {
        let mut l = Legacy::default();
        let mut d = [0u8; 4];
        assert!(l.read(0xcfc, &mut d));
        assert_eq!(d, [0xff; 4]);
        let mut b = [0u8; 1];
        assert!(l.read(0x2fd, &mut b));
        assert_eq!(b, [0xff]);
        assert!(l.read(0x64, &mut b));
        assert_eq!(b, [0]);
        assert!(!l.read(0x3f8, &mut b), "COM1 is the serial device's");
    }

    #[test]
    fn legacy_state_round_trips() {
        let mut l = Legacy::default();
        assert_eq!(l.write(0x70, &[0x0b]), PortAction::Handled);
        let saved: vmhost_devices::persist::LegacyState =
            serde_json::from_str(&serde_json::to_string(&l.save()).unwrap()).unwrap();
        let mut r = Legacy::default();
        r.restore(&saved);
        let mut b = [0u8; 1];
        assert!(r.read(0x71, &mut b));
        assert_eq!(b[0], 0x02, "status B read through the restored index");
    }

    #[test]
    fn cmos_reads_the_time_in_bcd() {
        let mut c = Cmos::default();
        // 2026-11-29 13:45:07 UTC
        let t = 1_795_959_907;
        let read = |c: &mut Cmos, i: u8| {
            c.index = i;
            c.read(t)
        };
        assert_eq!(read(&mut c, 0x09), 0x26);
        assert_eq!(read(&mut c, 0x08), 0x11);
        assert_eq!(read(&mut c, 0x07), 0x29);
        assert_eq!(read(&mut c, 0x04), 0x13);
        assert_eq!(read(&mut c, 0x02), 0x45);
        assert_eq!(read(&mut c, 0x00), 0x07);
        assert_eq!(read(&mut c, 0x32), 0x20);
        assert_eq!(read(&mut c, 0x0a) & 0x80, 0, "update not in progress");
        assert_eq!(read(&mut c, 0x80), 0x07, "bit 7 (NMI mask) is ignored");
    }
}
