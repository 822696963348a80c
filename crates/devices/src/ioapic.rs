//! The I/O APIC of a VM with a split irqchip (`boot.irqchip = "split"`): the 82093AA register
//! window the guest programs, in user space, while KVM keeps the local APICs.
//!
//! It does not know KVM. Each unmasked redirection entry becomes an MSI route for its pin's GSI
//! ([`Ioapic::routes`]), which the VMM installs with `KVM_SET_GSI_ROUTING`: a device's irqfd on
//! that GSI (COM1's on GSI 4) then reaches the destination LAPIC in the kernel, with no exit.
//! A masked pin has no route, so its edges are dropped, as a real I/O APIC drops a masked
//! edge-triggered interrupt. The VM's sources are edges (irqfd pulses, the power button's
//! `KVM_IRQ_LINE` pulse), so no line stays asserted and the remote IRR bit stays clear: a level
//! entry's end of interrupt (`KVM_EXIT_IOAPIC_EOI`) has nothing to deliver again.
//!
//! ```
//! use vmhost_devices::ioapic::{Ioapic, IOREGSEL, IOWIN};
//!
//! let mut chip = Ioapic::new();
//! // Pin 4 (COM1): vector 0x24, fixed delivery, physical destination APIC 1, edge, unmasked.
//! assert!(!chip.write(IOREGSEL, 0x10 + 2 * 4 + 1));
//! assert!(!chip.write(IOWIN, 1 << 24)); // still masked: no route yet
//! chip.write(IOREGSEL, 0x10 + 2 * 4);
//! assert!(chip.write(IOWIN, 0x24)); // unmasked: the routes changed
//! let routes = chip.routes();
//! assert_eq!(routes.len(), 1);
//! assert_eq!((routes[0].gsi, routes[0].address, routes[0].data), (4, 0xfee0_1000, 0x24));
//! ```

use serde::{Deserialize, Serialize};

/// The highest redirection entry.
const MAX_ENTRY: u32 = 23;
/// Pins (and redirection entries): GSIs 0-23, as the MADT's I/O APIC with GSI base 0 says.
pub const IOAPIC_PINS: usize = MAX_ENTRY as usize + 1;
/// Offset of the register select register in the window.
pub const IOREGSEL: u64 = 0x00;
/// Offset of the data window.
pub const IOWIN: u64 = 0x10;
/// Bytes of the window (one page at the MADT's address).
pub const IOAPIC_WINDOW: u64 = 0x1000;
/// Version register: version 0x11 (an 82093AA, no EOI register), highest entry 23.
const VERSION: u32 = 0x11 | (MAX_ENTRY << 16);
/// Registers: ID, version, arbitration ID, then two per redirection entry.
const REG_ID: u32 = 0x00;
const REG_VERSION: u32 = 0x01;
const REG_ARB: u32 = 0x02;
const REG_TABLE: u32 = 0x10;
/// The ID register's writable bits (APIC ID 27:24).
const ID_MASK: u32 = 0x0f00_0000;
/// Redirection entry bits.
const RTE_MASKED: u64 = 1 << 16;
const RTE_LEVEL: u64 = 1 << 15;
const RTE_REMOTE_IRR: u64 = 1 << 14;
const RTE_DELIVERY_STATUS: u64 = 1 << 12;
const RTE_DEST_LOGICAL: u64 = 1 << 11;
/// Bits the guest cannot write: delivery status and remote IRR (read-only), and the
/// reserved bits 17-55.
const RTE_WRITABLE: u64 = !(RTE_REMOTE_IRR | RTE_DELIVERY_STATUS | 0x00ff_ffff_fffe_0000);
/// Delivery modes with no MSI equivalent here: ExtINT (an 8259, which this VM has none of)
/// and the reserved 3.
const DELIVERY_EXTINT: u64 = 7;
const DELIVERY_LOWEST: u64 = 1;
/// An MSI's address base (the LAPICs' window).
const MSI_ADDRESS_BASE: u64 = 0xfee0_0000;

/// One pin's message: what KVM delivers when the pin's GSI fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsiRoute {
    /// The pin (GSI).
    pub gsi: u32,
    /// MSI address (destination and its mode, the redirection hint for lowest priority).
    pub address: u64,
    /// MSI data (vector, delivery mode, trigger mode).
    pub data: u32,
}

/// The guest-visible registers; also the state that moves with the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoapicState {
    /// The ID register.
    pub id: u32,
    /// The register select register.
    pub select: u32,
    /// The redirection entries, [`IOAPIC_PINS`] of them.
    pub table: Vec<u64>,
}

/// A restored state that is not an I/O APIC's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the saved I/O APIC has {found} redirection entries, not {IOAPIC_PINS}")]
pub struct IoapicStateError {
    /// Entries in the saved state.
    pub found: usize,
}

/// The register window (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ioapic {
    id: u32,
    select: u32,
    table: [u64; IOAPIC_PINS],
}

impl Default for Ioapic {
    fn default() -> Self {
        Self::new()
    }
}

impl Ioapic {
    /// After reset: every entry masked.
    pub fn new() -> Self {
        Ioapic {
            id: 0,
            select: 0,
            table: [RTE_MASKED; IOAPIC_PINS],
        }
    }

    /// A 32-bit guest read at `offset` in the window; other widths and offsets read as 0.
    pub fn read(&self, offset: u64) -> u32 {
        match offset {
            IOREGSEL => self.select,
            IOWIN => self.register(self.select),
            _ => 0,
        }
    }

    /// A 32-bit guest write at `offset`; true when it changed a redirection entry's message
    /// or mask, so [`Ioapic::routes`] changed.
    pub fn write(&mut self, offset: u64, value: u32) -> bool {
        match offset {
            IOREGSEL => {
                self.select = value & 0xff;
                false
            }
            IOWIN => self.set_register(self.select, value),
            _ => false,
        }
    }

    fn register(&self, reg: u32) -> u32 {
        match reg {
            REG_ID => self.id,
            REG_VERSION => VERSION,
            REG_ARB => self.id,
            _ => match entry_of(reg) {
                Some((pin, high)) => {
                    let (low_half, high_half) = halves(self.table[pin]);
                    if high {
                        high_half
                    } else {
                        low_half
                    }
                }
                None => 0,
            },
        }
    }

    fn set_register(&mut self, reg: u32, value: u32) -> bool {
        if reg == REG_ID {
            self.id = value & ID_MASK;
            return false;
        }
        let Some((pin, high)) = entry_of(reg) else {
            return false;
        };
        let old = self.table[pin];
        let written = if high {
            (old & 0xffff_ffff) | (u64::from(value) << 32)
        } else {
            (old & !0xffff_ffff) | u64::from(value)
        };
        let new = (old & !RTE_WRITABLE) | (written & RTE_WRITABLE);
        self.table[pin] = new;
        route_of(0, old) != route_of(0, new)
    }

    /// The MSI route of every unmasked pin whose delivery mode has one.
    pub fn routes(&self) -> Vec<MsiRoute> {
        (0u32..)
            .zip(self.table.iter())
            .filter_map(|(gsi, &rte)| route_of(gsi, rte))
            .collect()
    }

    /// The state that moves with the VM.
    pub fn save(&self) -> IoapicState {
        IoapicState {
            id: self.id,
            select: self.select,
            table: self.table.to_vec(),
        }
    }

    /// The chip as `state` left it (the read-only bits cleared, as at a fresh start).
    pub fn restore(state: &IoapicState) -> Result<Self, IoapicStateError> {
        let table: [u64; IOAPIC_PINS] =
            state
                .table
                .as_slice()
                .try_into()
                .map_err(|_| IoapicStateError {
                    found: state.table.len(),
                })?;
        Ok(Ioapic {
            id: state.id & ID_MASK,
            select: state.select & 0xff,
            table: table.map(|rte| rte & RTE_WRITABLE),
        })
    }
}

/// The low and high 32 bits of an entry.
fn halves(rte: u64) -> (u32, u32) {
    let b = rte.to_le_bytes();
    (
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    )
}

/// The redirection entry (and its high half) a register index names.
fn entry_of(reg: u32) -> Option<(usize, bool)> {
    let index = usize::try_from(reg.checked_sub(REG_TABLE)?).ok()?;
    let pin = index / 2;
    (pin < IOAPIC_PINS).then_some((pin, index % 2 == 1))
}

/// The MSI an unmasked entry sends (Intel SDM vol. 3, "Message Signalled Interrupts": the
/// destination in address bits 19:12, its mode in bit 2, the redirection hint in bit 3; the
/// vector, delivery mode and trigger mode in the data, with "assert" for a level message).
fn route_of(gsi: u32, rte: u64) -> Option<MsiRoute> {
    let (low, high) = halves(rte);
    let delivery = (low >> 8) & 0x7;
    if rte & RTE_MASKED != 0 || u64::from(delivery) == DELIVERY_EXTINT || delivery == 3 {
        return None;
    }
    let dest = u64::from(high >> 24);
    let logical = u64::from(rte & RTE_DEST_LOGICAL != 0);
    let hint = u64::from(u64::from(delivery) == DELIVERY_LOWEST);
    let address = MSI_ADDRESS_BASE | (dest << 12) | (hint << 3) | (logical << 2);
    let mut data = (low & 0xff) | (delivery << 8);
    if rte & RTE_LEVEL != 0 {
        data |= (1 << 15) | (1 << 14);
    }
    Some(MsiRoute { gsi, address, data })
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test values are built in range
mod tests {
    use super::*;

    fn program(chip: &mut Ioapic, pin: u32, rte: u64) -> (bool, bool) {
        chip.write(IOREGSEL, REG_TABLE + 2 * pin + 1);
        let high = chip.write(IOWIN, (rte >> 32) as u32);
        chip.write(IOREGSEL, REG_TABLE + 2 * pin);
        (high, chip.write(IOWIN, rte as u32))
    }

    fn entry(chip: &Ioapic, pin: u32) -> u64 {
        let mut c = chip.clone();
        c.write(IOREGSEL, REG_TABLE + 2 * pin);
        let low = u64::from(c.read(IOWIN));
        c.write(IOREGSEL, REG_TABLE + 2 * pin + 1);
        low | (u64::from(c.read(IOWIN)) << 32)
    }

    #[test]
    fn reset_state_is_all_masked_and_version_names_24_entries() {
        let mut chip = Ioapic::new();
        assert!(chip.routes().is_empty());
        chip.write(IOREGSEL, REG_VERSION);
        assert_eq!(chip.read(IOWIN), 0x0017_0011);
        for pin in 0..24 {
            assert_eq!(entry(&chip, pin), RTE_MASKED, "pin {pin}");
        }
        chip.write(IOREGSEL, REG_TABLE + 48);
        assert_eq!(chip.read(IOWIN), 0, "no entry 24");
        assert!(!chip.write(IOWIN, 0x30));
    }

    #[test]
    fn id_register_keeps_only_its_apic_id_bits() {
        let mut chip = Ioapic::new();
        chip.write(IOREGSEL, REG_ID);
        chip.write(IOWIN, 0xffff_ffff);
        assert_eq!(chip.read(IOWIN), ID_MASK);
        chip.write(IOREGSEL, REG_ARB);
        assert_eq!(chip.read(IOWIN), ID_MASK);
        chip.write(IOREGSEL, REG_VERSION);
        chip.write(IOWIN, 0);
        assert_eq!(chip.read(IOWIN), VERSION, "version is read-only");
    }

    #[test]
    fn unmasked_entries_become_msi_routes() {
        let mut chip = Ioapic::new();
        // Pin 4: vector 0x31, fixed, physical dest 3, edge.
        assert_eq!(program(&mut chip, 4, (3 << 56) | 0x31), (false, true));
        // Pin 9: vector 0x41, lowest priority, logical dest 0x0f, level, active low.
        let level = (0x0f << 56) | RTE_LEVEL | (1 << 13) | RTE_DEST_LOGICAL | (1 << 8) | 0x41;
        program(&mut chip, 9, level);
        // Pin 2: ExtINT has no message.
        program(&mut chip, 2, 7 << 8);
        assert_eq!(
            chip.routes(),
            vec![
                MsiRoute {
                    gsi: 4,
                    address: 0xfee0_3000,
                    data: 0x31
                },
                MsiRoute {
                    gsi: 9,
                    address: 0xfee0_f00c,
                    data: 0xc141
                },
            ]
        );
        // Masking pin 4 removes its route; the same write again changes nothing.
        chip.write(IOREGSEL, REG_TABLE + 8);
        assert!(chip.write(IOWIN, 0x31 | RTE_MASKED as u32));
        assert!(!chip.write(IOWIN, 0x31 | RTE_MASKED as u32));
        assert_eq!(chip.routes().len(), 1);
        // The polarity bit alone does not change the message.
        chip.write(IOREGSEL, REG_TABLE + 18);
        assert!(!chip.write(IOWIN, (level as u32) & !(1 << 13)));
    }

    #[test]
    fn read_only_and_reserved_bits_are_not_written() {
        let mut chip = Ioapic::new();
        program(&mut chip, 1, u64::MAX);
        let rte = entry(&chip, 1);
        assert_eq!(rte & (RTE_REMOTE_IRR | RTE_DELIVERY_STATUS), 0);
        assert_eq!(rte & 0x00ff_ffff_fffe_0000, 0);
        assert_eq!(rte, RTE_WRITABLE);
    }

    #[test]
    fn other_offsets_and_registers_read_zero() {
        let mut chip = Ioapic::new();
        assert_eq!(chip.read(0x20), 0);
        assert!(!chip.write(0x40, 0x31), "version 0x11 has no EOI register");
        chip.write(IOREGSEL, 0x3ff);
        assert_eq!(chip.read(IOREGSEL), 0xff, "select is 8 bits");
        assert_eq!(chip.read(IOWIN), 0);
    }

    #[test]
    fn state_round_trips_and_a_short_table_is_refused() {
        let mut chip = Ioapic::new();
        program(&mut chip, 4, (1 << 56) | 0x24);
        chip.write(IOREGSEL, REG_ID);
        chip.write(IOWIN, 2 << 24);
        let state = chip.save();
        let back = Ioapic::restore(&state).expect("restore");
        assert_eq!(back, chip);
        assert_eq!(back.routes(), chip.routes());
        let short = IoapicState {
            table: vec![0; 23],
            ..state
        };
        assert_eq!(Ioapic::restore(&short), Err(IoapicStateError { found: 23 }));
    }
}
