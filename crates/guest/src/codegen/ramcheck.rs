//! `idle`'s RAM pattern (see [`crate::ramcheck`]): the fill at its start and the check in its
//! timer tick handler.

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use super::asm::Asm;
use crate::mailbox::off;
use crate::ramcheck::{PAGES, PAGES_PER_TICK, TAG, WORDS, WORD_STRIDE};

// Immediates: the constants are small (asserted), so the casts keep their values.
const _: () = assert!(PAGES <= 1 << 16 && WORDS <= 1 << 16);
#[allow(clippy::cast_possible_truncation)]
const PAGE_MASK: u32 = (PAGES - 1) as u32;
#[allow(clippy::cast_possible_truncation)]
const TICK_MASK: u32 = (PAGES_PER_TICK - 1) as u32;
#[allow(clippy::cast_possible_truncation)]
const PAGES_IMM: i32 = PAGES as i32;
#[allow(clippy::cast_possible_truncation)]
const WORDS_IMM: i32 = WORDS as i32;
const WORD_SHIFT: u32 = WORD_STRIDE.trailing_zeros();

/// RAX = `word(seed, page, j)` with R8 = seed + TAG, `page` and `j` in registers; clobbers RDX.
fn emit_word(a: &mut Asm, page: AsmRegister64, j: AsmRegister64) -> Result<(), IcedError> {
    a.mov(rax, page)?;
    a.shl(rax, 32)?;
    a.add(rax, r8)?;
    a.mov(rdx, j)?;
    a.shl(rdx, 16)?;
    a.add(rax, rdx)
}

/// Ring 0, at the start, RSI = mailbox, interrupts off: writes every pattern page (nothing
/// when `ram_stride` is 0). Clobbers RAX, RCX, RDX, RDI, R8-R11.
pub fn emit_fill(a: &mut Asm) -> Result<(), IcedError> {
    let mut done = a.create_label();
    let mut page = a.create_label();
    let mut word = a.create_label();
    a.mov(rcx, qword_ptr(rsi + off::RAM_STRIDE))?;
    a.test(rcx, rcx)?;
    a.jz(done)?;
    a.mov(rdi, qword_ptr(rsi + off::RAM_BASE))?;
    a.mov(r8, qword_ptr(rsi + off::TSC_START))?;
    a.mov(rax, TAG)?;
    a.add(r8, rax)?;
    a.mov(r10, qword_ptr(rsi + off::TICKS))?;
    a.xor(r9d, r9d)?;
    a.set_label(&mut page)?;
    // The stamp: ticks - ((ticks - page) % PAGES).
    a.mov(rax, r10)?;
    a.sub(rax, r9)?;
    a.and(eax, PAGE_MASK)?;
    a.mov(rdx, r10)?;
    a.sub(rdx, rax)?;
    a.mov(qword_ptr(rdi), rdx)?;
    a.mov(r11d, 1u32)?;
    a.set_label(&mut word)?;
    emit_word(a, r9, r11)?;
    a.mov(rdx, r11)?;
    a.shl(rdx, WORD_SHIFT)?;
    a.mov(qword_ptr(rdi + rdx), rax)?;
    a.inc(r11)?;
    a.cmp(r11, WORDS_IMM)?;
    a.jb(word)?;
    a.add(rdi, rcx)?;
    a.inc(r9)?;
    a.cmp(r9, PAGES_IMM)?;
    a.jb(page)?;
    a.set_label(&mut done)
}

/// In the tick handler, after `ticks` counted, mailbox through GS: rewrites the stamp of page
/// `ticks % PAGES`, then verifies the next [`PAGES_PER_TICK`] pages. Clobbers RAX, RCX, RDX,
/// RDI, R8-R13 (the handler saves them).
pub fn emit_tick(a: &mut Asm) -> Result<(), IcedError> {
    let mb = |o: u64| qword_ptr(o).gs();
    let mut done = a.create_label();
    let mut page = a.create_label();
    let mut word = a.create_label();
    let mut bad = a.create_label();
    let mut next = a.create_label();
    a.mov(rcx, mb(off::RAM_STRIDE))?;
    a.test(rcx, rcx)?;
    a.jz(done)?;
    a.mov(rdi, mb(off::RAM_BASE))?;
    a.mov(r10, mb(off::TICKS))?;
    a.mov(rax, r10)?;
    a.and(eax, PAGE_MASK)?;
    a.imul_2(rax, rcx)?;
    a.mov(qword_ptr(rdi + rax), r10)?;
    a.mov(r8, mb(off::TSC_START))?;
    a.mov(rax, TAG)?;
    a.add(r8, rax)?;
    a.mov(r9, mb(off::RAM_CHECKED))?;
    a.set_label(&mut page)?;
    a.mov(r12, r9)?;
    a.and(r12d, PAGE_MASK)?;
    a.mov(r13, r12)?;
    a.imul_2(r13, rcx)?;
    a.add(r13, rdi)?;
    // The stamp s: s % PAGES == page and ticks - s < PAGES.
    a.mov(rax, qword_ptr(r13))?;
    a.mov(rdx, rax)?;
    a.and(edx, PAGE_MASK)?;
    a.cmp(rdx, r12)?;
    a.jne(bad)?;
    a.mov(rdx, r10)?;
    a.sub(rdx, rax)?;
    a.cmp(rdx, PAGES_IMM)?;
    a.jae(bad)?;
    a.mov(r11d, 1u32)?;
    a.set_label(&mut word)?;
    emit_word(a, r12, r11)?;
    a.mov(rdx, r11)?;
    a.shl(rdx, WORD_SHIFT)?;
    a.cmp(qword_ptr(r13 + rdx), rax)?;
    a.jne(bad)?;
    a.inc(r11)?;
    a.cmp(r11, WORDS_IMM)?;
    a.jb(word)?;
    a.jmp(next)?;
    a.set_label(&mut bad)?;
    a.inc(mb(off::RAM_ERRORS))?;
    a.set_label(&mut next)?;
    a.inc(r9)?;
    a.test(r9d, TICK_MASK)?;
    a.jnz(page)?;
    a.mov(mb(off::RAM_CHECKED), r9)?;
    a.set_label(&mut done)
}
