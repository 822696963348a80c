//! Tiny PVH "kernels" built in tests (vCPU and end-to-end tests): an ELF64 with a Xen PVH entry note and a few 32-bit
//! instructions at the entry.

/// Where the fake kernel is loaded (and entered).
pub const LOAD: u64 = 0x100_0000;

/// `mov dx, port; mov al, value; out dx, al`.
pub fn out8(port: u16, value: u8) -> Vec<u8> {
    let [lo, hi] = port.to_le_bytes();
    vec![0x66, 0xba, lo, hi, 0xb0, value, 0xee]
}

/// A minimal ELF64 x86-64 executable: `code` at physical [`LOAD`], with a Xen PVH entry note
/// pointing at it.
pub fn pvh_elf(code: &[u8]) -> Vec<u8> {
    let mut note = Vec::new();
    for v in [4u32, 4, 18] {
        note.extend_from_slice(&v.to_le_bytes()); // namesz, descsz, XEN_ELFNOTE_PHYS32_ENTRY
    }
    note.extend_from_slice(b"Xen\0");
    note.extend_from_slice(
        &u32::try_from(LOAD)
            .expect("LOAD is below 4 GiB")
            .to_le_bytes(),
    );
    let phdr = |p_type: u32, offset: u64, paddr: u64, size: u64| {
        let mut p = Vec::new();
        p.extend_from_slice(&p_type.to_le_bytes());
        p.extend_from_slice(&5u32.to_le_bytes());
        for v in [offset, paddr, paddr, size, size, 4] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p
    };
    let mut b = vec![0u8; 64];
    b[..4].copy_from_slice(b"\x7fELF");
    (b[4], b[5], b[6]) = (2, 1, 1);
    b[16..18].copy_from_slice(&2u16.to_le_bytes());
    b[18..20].copy_from_slice(&62u16.to_le_bytes());
    b[20..24].copy_from_slice(&1u32.to_le_bytes());
    b[24..32].copy_from_slice(&LOAD.to_le_bytes());
    b[32..40].copy_from_slice(&64u64.to_le_bytes());
    b[52..54].copy_from_slice(&64u16.to_le_bytes());
    b[54..56].copy_from_slice(&56u16.to_le_bytes());
    b[56..58].copy_from_slice(&2u16.to_le_bytes());
    let note_off = 64 + 2 * 56;
    let code_off = note_off + note.len() as u64;
    b.extend(phdr(1, code_off, LOAD, code.len() as u64));
    b.extend(phdr(4, note_off, 0, note.len() as u64));
    b.extend(note);
    b.extend_from_slice(code);
    b
}
