//! The guest's path to the user-space I/O APIC of a split irqchip
//! (`vmhost_devices::ioapic::Ioapic`, the window at 0xfec00000): any sequence of register
//! selects, reads and writes at any offset of the window, then the state saved and restored.
//!
//! Invariants: the version register never changes; a write reports a change exactly when the
//! routes changed; every route is an unmasked entry's, for a GSI below 24, with an address in
//! the LAPICs' window; a saved state restores to the same registers and routes; nothing
//! panics.
//!
//! Input: `n × (op, offset, value 0-3)`: op bit 0 read/write, offset byte × 4 within 0x40.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmhost_devices::ioapic::{Ioapic, IOAPIC_PINS, IOREGSEL, IOWIN};

fuzz_target!(|data: &[u8]| {
    let mut chip = Ioapic::new();
    chip.write(IOREGSEL, 1);
    let version = chip.read(IOWIN);
    for op in data.chunks_exact(6) {
        let offset = u64::from(op[1] & 0x0f) * 4;
        let value = u32::from_le_bytes([op[2], op[3], op[4], op[5]]);
        if op[0] & 1 == 0 {
            let _ = chip.read(offset);
            continue;
        }
        let before = chip.routes();
        let changed = chip.write(offset, value);
        let after = chip.routes();
        assert_eq!(changed, before != after, "write {offset:#x} = {value:#x}");
        for r in &after {
            assert!((r.gsi as usize) < IOAPIC_PINS);
            assert_eq!(r.address & 0xfff0_0000, 0xfee0_0000, "{r:?}");
        }
    }
    let select = chip.read(IOREGSEL);
    chip.write(IOREGSEL, 1);
    assert_eq!(chip.read(IOWIN), version, "the version register changed");
    chip.write(IOREGSEL, select);
    let back = Ioapic::restore(&chip.save()).expect("a saved state restores");
    assert_eq!(back, chip);
    assert_eq!(back.routes(), chip.routes());
});
