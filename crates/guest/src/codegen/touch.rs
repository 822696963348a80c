//! The `touch` ring-3 body (see [`crate::touch`]).

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use super::asm::Asm;
use super::emit_rdtsc;
use crate::mailbox::off;
use crate::touch::TOUCH_TAG;

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
