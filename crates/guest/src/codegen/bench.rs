//! The `numa-bench` ring-3 body (see [`crate::bench`]).

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use super::asm::Asm;
use super::emit_rdtsc;
use crate::bench::{LOADS_PER_ITER, STREAM_STEP};
use crate::mailbox::off;

/// Emits the ring-3 body. In: RSI = mailbox. Fills `chase_cycles`, `stream_cycles`, `sink` of
/// each bench slot.
pub fn emit(a: &mut Asm) -> Result<(), IcedError> {
    let mut cell_loop = a.create_label();
    let mut end = a.create_label();
    a.mov(r8, qword_ptr(rsi + off::BENCH_COUNT))?;
    a.lea(r9, qword_ptr(rsi + off::BENCH))?;
    emit_rdtsc(a)?;
    a.mov(qword_ptr(rsi + off::TSC_START), rax)?;
    a.set_label(&mut cell_loop)?;
    a.test(r8, r8)?;
    a.jz(end)?;
    emit_chase(a)?;
    emit_stream(a)?;
    a.add(r9, i32::try_from(off::BENCH_SLOT).unwrap_or(64))?;
    a.dec(r8)?;
    a.jmp(cell_loop)?;
    a.set_label(&mut end)?;
    emit_rdtsc(a)?;
    a.mov(qword_ptr(rsi + off::TSC_END), rax)
}

/// Chase: RBX walks the chain; R14 holds the start TSC. In: R9 = slot.
fn emit_chase(a: &mut Asm) -> Result<(), IcedError> {
    use off::bench::*;
    let mut chase = a.create_label();
    let mut done = a.create_label();
    a.mov(rbx, qword_ptr(r9 + CHAIN_START))?;
    a.mov(rcx, qword_ptr(r9 + CHASE_ITERS))?;
    emit_rdtsc(a)?;
    a.mov(r14, rax)?;
    a.test(rcx, rcx)?;
    a.jz(done)?;
    a.align_label(&mut chase)?;
    for _ in 0..LOADS_PER_ITER {
        a.mov(rbx, qword_ptr(rbx))?;
    }
    a.dec(rcx)?;
    a.jnz(chase)?;
    a.set_label(&mut done)?;
    emit_rdtsc(a)?;
    a.sub(rax, r14)?;
    a.mov(qword_ptr(r9 + CHASE_CYCLES), rax)?;
    a.mov(qword_ptr(r9 + SINK), rbx)
}

/// Stream: four accumulators (RBX, R11, R12, R15) over 128 bytes per iteration. In: R9 = slot.
fn emit_stream(a: &mut Asm) -> Result<(), IcedError> {
    use off::bench::*;
    let mut pass = a.create_label();
    let mut stream = a.create_label();
    let mut done = a.create_label();
    a.mov(r13, qword_ptr(r9 + STREAM_PASSES))?;
    for r in [r11, r12, r15] {
        a.xor(r, r)?;
    }
    emit_rdtsc(a)?;
    a.mov(r14, rax)?;
    a.set_label(&mut pass)?;
    a.test(r13, r13)?;
    a.jz(done)?;
    a.mov(rdi, qword_ptr(r9 + STREAM_BASE))?;
    a.mov(r10, qword_ptr(r9 + STREAM_LEN))?;
    a.align_label(&mut stream)?;
    let accs = [rbx, r11, r12, r15];
    for k in 0..(STREAM_STEP / 8) {
        a.add(accs[as_index(k % 4)], qword_ptr(rdi + 8 * k))?;
    }
    a.add(rdi, i32::try_from(STREAM_STEP).unwrap_or(128))?;
    a.sub(r10, i32::try_from(STREAM_STEP).unwrap_or(128))?;
    a.jnz(stream)?;
    a.dec(r13)?;
    a.jmp(pass)?;
    a.set_label(&mut done)?;
    emit_rdtsc(a)?;
    a.sub(rax, r14)?;
    a.mov(qword_ptr(r9 + STREAM_CYCLES), rax)?;
    for r in [r11, r12, r15] {
        a.xor(rbx, r)?;
    }
    a.xor(qword_ptr(r9 + SINK), rbx)
}

fn as_index(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}
