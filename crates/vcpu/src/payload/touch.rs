//! `touch`: every vCPU writes every byte of every page of its own guest cell.
//!
//! This follows the wording literally: when a cell has several vCPUs, each of them
//! writes the whole cell (the pages are not split between them), so per-vCPU bytes equal the
//! cell's size and concurrent vCPUs of one cell share its bandwidth; whichever vCPU writes a
//! page first pays its first-touch fault. Every 8-byte word of a 4 KiB page at GPA `p` gets
//! [`pattern`]`(p)`, so the host can check afterwards that the guest wrote every page.
//! The loop runs in ring 3 (`rep stosq`, native speed here) and is timed with `rdtsc`.

use iced_x86::code_asm::*;
use iced_x86::IcedError;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::asm::Asm;
use super::mailbox::off;
use super::program::emit_rdtsc;

/// High bits of the touch pattern ("touch" in ASCII).
pub const TOUCH_TAG: u64 = 0x0068_6375_6f74_0000 << 8;
/// Granularity of the pattern.
pub const TOUCH_PAGE: u64 = 4096;

/// The word the guest writes throughout the 4 KiB page at `page_gpa`.
pub fn pattern(page_gpa: u64) -> u64 {
    page_gpa ^ TOUCH_TAG
}

/// Emits the ring-3 body. In: RSI = mailbox. Writes `tsc_start`, `tsc_end`, `touch_bytes`.
pub fn emit(a: &mut Asm) -> Result<(), IcedError> {
    let mut range_loop = a.create_label();
    let mut page_loop = a.create_label();
    let mut end = a.create_label();
    a.xor(r12d, r12d)?;
    a.mov(r11, TOUCH_TAG)?;
    a.mov(r8, qword_ptr(rsi + off::N_RANGES))?;
    a.lea(r9, qword_ptr(rsi + off::RANGES))?;
    emit_rdtsc(a)?;
    a.mov(r14, rax)?;
    a.set_label(&mut range_loop)?;
    a.test(r8, r8)?;
    a.jz(end)?;
    a.mov(rdi, qword_ptr(r9))?;
    a.mov(r10, qword_ptr(r9 + 8))?;
    a.add(r9, 16)?;
    a.dec(r8)?;
    a.align_label(&mut page_loop)?;
    a.test(r10, r10)?;
    a.jz(range_loop)?;
    a.mov(rax, rdi)?;
    a.xor(rax, r11)?;
    a.mov(ecx, 512)?;
    a.rep().stosq()?;
    a.sub(r10, 4096)?;
    a.add(r12, 4096)?;
    a.jmp(page_loop)?;
    a.set_label(&mut end)?;
    emit_rdtsc(a)?;
    a.mov(qword_ptr(rsi + off::TSC_START), r14)?;
    a.mov(qword_ptr(rsi + off::TSC_END), rax)?;
    a.mov(qword_ptr(rsi + off::TOUCH_BYTES), r12)
}

/// The first 4 KiB page in `gpa..gpa + len` whose words are not all [`pattern`], if any.
pub fn first_untouched(memory: &GuestMemoryMmap, gpa: u64, len: u64) -> Option<u64> {
    let mut buf = [0u8; 4096];
    let mut page = gpa;
    while page < gpa + len {
        if memory.read_slice(&mut buf, GuestAddress(page)).is_err() {
            return Some(page);
        }
        let want = pattern(page).to_le_bytes();
        if !buf.chunks_exact(8).all(|w| w == want) {
            return Some(page);
        }
        page += TOUCH_PAGE;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_differs_per_page_and_spells_touch() {
        assert_ne!(pattern(0), pattern(4096));
        assert_eq!(&TOUCH_TAG.to_le_bytes()[3..8], b"touch");
    }

    #[test]
    fn untouched_pages_are_found() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 * 4096)]).unwrap();
        for p in 0..4u64 {
            for w in 0..512u64 {
                mem.write_obj(pattern(p * 4096), GuestAddress(p * 4096 + 8 * w))
                    .unwrap();
            }
        }
        assert_eq!(first_untouched(&mem, 0, 4 * 4096), None);
        mem.write_obj(0u64, GuestAddress(2 * 4096 + 4000)).unwrap();
        assert_eq!(first_untouched(&mem, 0, 4 * 4096), Some(2 * 4096));
        assert_eq!(first_untouched(&mem, 0, 5 * 4096), Some(2 * 4096));
        assert_eq!(first_untouched(&mem, 3 * 4096, 2 * 4096), Some(4 * 4096));
    }
}
