//! The debug port 0x80 as a boot-progress marker, after Cloud Hypervisor's: a guest writes one
//! byte whose range names the boot phase, and the VMM timestamps the first write of each
//! phase on `CLOCK_MONOTONIC` (comparable with a clock read by whoever spawned the VMM).
//!
//! | value | phase |
//! |---|---|
//! | 0x00-0x1f | firmware |
//! | 0x20-0x3f | bootloader |
//! | 0x40-0x5f | kernel |
//! | 0x60-0x7f | user space (e.g. `/init` writes 0x60 through `/dev/port`) |
//!
//! Other values are ignored: Linux's `io_delay` writes whatever is in AL to port 0x80 when it
//! is not on KVM (on KVM it is a no-op).

use std::sync::OnceLock;

use serde::Serialize;

/// The debug port.
pub const DEBUG_PORT: u16 = 0x80;

/// A boot phase a marker names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BootPhase {
    /// 0x00-0x1f.
    Firmware,
    /// 0x20-0x3f.
    Bootloader,
    /// 0x40-0x5f.
    Kernel,
    /// 0x60-0x7f.
    Userspace,
}

impl BootPhase {
    /// The phase a written value names, if any.
    pub fn of(value: u8) -> Option<BootPhase> {
        match value {
            0x00..=0x1f => Some(BootPhase::Firmware),
            0x20..=0x3f => Some(BootPhase::Bootloader),
            0x40..=0x5f => Some(BootPhase::Kernel),
            0x60..=0x7f => Some(BootPhase::Userspace),
            _ => None,
        }
    }

    const ALL: [BootPhase; 4] = [
        BootPhase::Firmware,
        BootPhase::Bootloader,
        BootPhase::Kernel,
        BootPhase::Userspace,
    ];

    fn index(self) -> usize {
        match self {
            BootPhase::Firmware => 0,
            BootPhase::Bootloader => 1,
            BootPhase::Kernel => 2,
            BootPhase::Userspace => 3,
        }
    }
}

/// One phase's first marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BootMark {
    /// The phase.
    pub phase: BootPhase,
    /// The byte written.
    pub value: u8,
    /// When the VMM saw it (`CLOCK_MONOTONIC` nanoseconds).
    pub monotonic_ns: u64,
}

/// The first marker of each phase.
#[derive(Debug, Default)]
pub struct BootMarks {
    first: [OnceLock<BootMark>; 4],
}

impl BootMarks {
    /// Records a write of `value` to the debug port at `monotonic_ns`.
    pub fn record(&self, value: u8, monotonic_ns: u64) {
        if let Some(phase) = BootPhase::of(value) {
            self.first[phase.index()].get_or_init(|| BootMark {
                phase,
                value,
                monotonic_ns,
            });
        }
    }

    /// The phases seen, in phase order.
    pub fn marks(&self) -> Vec<BootMark> {
        BootPhase::ALL
            .iter()
            .filter_map(|p| self.first[p.index()].get().copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_write_of_each_phase_is_kept() {
        let m = BootMarks::default();
        m.record(0x60, 100);
        m.record(0x61, 200);
        m.record(0x41, 50);
        m.record(0xff, 10);
        let marks = m.marks();
        assert_eq!(marks.len(), 2);
        assert_eq!(
            (marks[0].phase, marks[0].value, marks[0].monotonic_ns),
            (BootPhase::Kernel, 0x41, 50)
        );
        assert_eq!(
            (marks[1].phase, marks[1].value, marks[1].monotonic_ns),
            (BootPhase::Userspace, 0x60, 100)
        );
    }
}
