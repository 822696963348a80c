//! The guest program generator: one code blob shared by every vCPU of a VM.
//!
//! ```text
//! entry (ring 0, emulated on nested hosts: kept short)
//!     read the CPUID leaves listed in the mailbox, write the results next to them
//!     halt:         doorbell Ready, then HLT forever (interrupts off)
//!     idle:         note the TSC, write the RAM pattern, start the LAPIC timer, doorbell Ready,
//!                   then HLT forever with interrupts on: each timer tick counts in the mailbox
//!     others:       iretq to ring 3 (CS 0x1b, SS 0x23, IOPL 3, IF 0)
//! user_entry (ring 3, native)
//!     the payload body (touch, numa-bench, a test fault), then doorbell Done
//! exception stubs 0..31 (ring 0)
//!     record vector, error code, RIP, CS, RFLAGS, RSP, CR2 in the mailbox; doorbell Fault; HLT
//! timer tick (vector 32) and spurious interrupt (33) handlers (ring 0)
//!     tick: count in the mailbox, rewrite one pattern page and verify a few, EOI;
//!     spurious: return
//! ```
//!
//! RSI holds the vCPU's mailbox address throughout (set by the VMM, preserved by iretq); the
//! exception stubs reach the mailbox through the GS base instead, since RSI is the guest's.
//! Every reference inside the program is RIP-relative and every other operand an immediate, so
//! the code runs wherever it is copied (at a [`crate::CODE_ALIGN`]-aligned address: loop heads
//! are aligned relative to the start); [`position_independent`] checks that.
//!
//! ```
//! use vmhost_guest::codegen::{assemble, position_independent};
//! use vmhost_guest::PayloadKind;
//!
//! let p = assemble(PayloadKind::Halt, 0x1000).unwrap();
//! assert_eq!(p.entry_points.entry, 0x1000);
//! assert!(position_independent(PayloadKind::Halt).unwrap());
//! ```

mod asm;
mod bench;
mod ramcheck;
mod touch;

use iced_x86::code_asm::*;
use iced_x86::IcedError;

pub use asm::AsmError;
use asm::{assemble_aligned, Asm};

use crate::abi::{
    IDT_VECTORS, SPURIOUS_VECTOR, TICK_COUNT, TICK_VECTOR, UNKNOWN_PORT, UNMAPPED_GPA, UNMAPPED_VA,
    USER_CS, USER_DS, USER_RFLAGS,
};
use crate::mailbox::{off, status, Doorbell, DOORBELL_PORT};
use crate::{EntryPoints, FaultPayload, PayloadKind, CODE_ALIGN};

/// Vectors for which the CPU pushes an error code.
const ERROR_CODE_VECTORS: [u64; 10] = [8, 10, 11, 12, 13, 14, 17, 21, 29, 30];

/// Assembled guest code and its entry points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    /// Machine code, assembled for the address given to [`assemble`].
    pub code: Vec<u8>,
    /// Entry points at that address.
    pub entry_points: EntryPoints,
}

impl Program {
    /// The entry points as offsets from `origin`, the address the program was assembled at
    /// (what a [`crate::ProgramImage`] stores).
    pub fn offsets(&self, origin: u64) -> EntryPoints {
        let e = &self.entry_points;
        EntryPoints {
            entry: e.entry - origin,
            user_entry: e.user_entry - origin,
            handlers: e.handlers.map(|h| h - origin),
        }
    }
}

struct Labels {
    entry: CodeLabel,
    user_entry: CodeLabel,
    handlers: Vec<CodeLabel>,
}

/// Assembles the program of `kind` at `ip`.
pub fn assemble(kind: PayloadKind, ip: u64) -> Result<Program, AsmError> {
    let out = assemble_aligned(ip, |a| {
        let mut entry = a.create_label();
        let mut user_entry = a.create_label();
        a.set_label(&mut entry)?;
        emit_cpuid_prologue(a)?;
        emit_ring0_tail(a, kind, user_entry)?;
        a.set_label(&mut user_entry)?;
        emit_ring3(a, kind)?;
        let mut handlers = emit_exception_stubs(a)?;
        handlers.extend(emit_interrupt_handlers(a)?);
        Ok(Labels {
            entry,
            user_entry,
            handlers,
        })
    })?;
    let mut handlers = [0u64; IDT_VECTORS];
    for (h, l) in handlers.iter_mut().zip(&out.labels.handlers) {
        *h = out.ip_of(l)?;
    }
    Ok(Program {
        entry_points: EntryPoints {
            entry: out.ip_of(&out.labels.entry)?,
            user_entry: out.ip_of(&out.labels.user_entry)?,
            handlers,
        },
        code: out.code,
    })
}

/// True when the program of `kind` is the same bytes, with the same entry offsets, assembled at
/// several [`CODE_ALIGN`]-aligned addresses far apart: it then runs wherever it is copied.
pub fn position_independent(kind: PayloadKind) -> Result<bool, AsmError> {
    const ORIGINS: [u64; 3] = [CODE_ALIGN, 0xC000_8000, 0x7fff_ffc0_0000];
    let first = assemble(kind, ORIGINS[0])?;
    for origin in &ORIGINS[1..] {
        let other = assemble(kind, *origin)?;
        if other.code != first.code || other.offsets(*origin) != first.offsets(ORIGINS[0]) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// RAX = TSC (serialised by LFENCE); clobbers RDX.
pub(crate) fn emit_rdtsc(a: &mut Asm) -> Result<(), IcedError> {
    a.lfence()?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)
}

/// One `out` of `code` to the doorbell port; clobbers RAX and RDX.
fn emit_doorbell(a: &mut Asm, code: Doorbell) -> Result<(), IcedError> {
    a.mov(edx, u32::from(DOORBELL_PORT))?;
    a.mov(al, code as u32)?;
    a.out(dx, al)
}

fn emit_cpuid_prologue(a: &mut Asm) -> Result<(), IcedError> {
    let mut next = a.create_label();
    let mut done = a.create_label();
    a.lea(rdi, qword_ptr(rsi + off::CPUID))?;
    a.mov(r8, qword_ptr(rsi + off::CPUID_COUNT))?;
    a.test(r8, r8)?;
    a.jz(done)?;
    a.set_label(&mut next)?;
    a.mov(eax, dword_ptr(rdi))?;
    a.mov(ecx, dword_ptr(rdi + 4))?;
    a.cpuid()?;
    a.mov(dword_ptr(rdi + 8), eax)?;
    a.mov(dword_ptr(rdi + 12), ebx)?;
    a.mov(dword_ptr(rdi + 16), ecx)?;
    a.mov(dword_ptr(rdi + 20), edx)?;
    a.add(rdi, i32::try_from(off::CPUID_SLOT).unwrap_or(24))?;
    a.dec(r8)?;
    a.jnz(next)?;
    a.set_label(&mut done)?;
    a.mov(
        qword_ptr(rsi + off::STATUS),
        i32::try_from(status::RING0_DONE).unwrap_or(1),
    )
}

fn emit_ring0_tail(a: &mut Asm, kind: PayloadKind, user_entry: CodeLabel) -> Result<(), IcedError> {
    if kind == PayloadKind::Idle {
        return emit_idle(a);
    }
    if kind == PayloadKind::Halt {
        emit_doorbell(a, Doorbell::Ready)?;
        // No in-kernel irqchip, so HLT exits to the VMM, which ends the vCPU.
        let mut halt = a.create_label();
        a.set_label(&mut halt)?;
        a.hlt()?;
        return a.jmp(halt);
    }
    if kind == PayloadKind::Fault(FaultPayload::TripleFault) {
        // An IDT with limit 0: the first exception cannot be delivered and escalates to a
        // triple fault (KVM_EXIT_SHUTDOWN).
        a.lidt(ptr(rsi + off::NULL_IDTR))?;
    }
    a.push(i32::from(USER_DS))?;
    a.push(qword_ptr(rsi + off::USER_RSP))?;
    a.push(i32::try_from(USER_RFLAGS).unwrap_or(0x3002))?;
    a.push(i32::from(USER_CS))?;
    a.lea(rax, ptr(user_entry))?;
    a.push(rax)?;
    a.iretq()
}

/// `wrmsr(msr, value)` for a 32-bit value; clobbers RAX, RCX, RDX.
fn emit_wrmsr(a: &mut Asm, msr: u32, value: u32) -> Result<(), IcedError> {
    a.mov(ecx, msr)?;
    a.mov(eax, value)?;
    a.xor(edx, edx)?;
    a.wrmsr()
}

/// `idle`: the TSC at start in `tsc_start` (written once: a restored guest keeps it), its RAM
/// pattern ([`crate::ramcheck`], seeded with that TSC), the LAPIC in x2APIC mode with a periodic timer on [`TICK_VECTOR`], doorbell Ready, then HLT
/// with interrupts on. The in-kernel irqchip keeps the vCPU in the kernel while halted; each
/// tick wakes it for a few instructions ([`emit_interrupt_handlers`]), until the VMM kicks the
/// vCPU thread to stop or pause it.
fn emit_idle(a: &mut Asm) -> Result<(), IcedError> {
    emit_rdtsc(a)?;
    a.mov(qword_ptr(rsi + off::TSC_START), rax)?;
    ramcheck::emit_fill(a)?;
    // IA32_APIC_BASE: global enable (bit 11) and x2APIC mode (bit 10).
    a.mov(ecx, 0x1bu32)?;
    a.rdmsr()?;
    a.or(eax, 0xc00)?;
    a.wrmsr()?;
    emit_wrmsr(a, 0x80f, 0x100 | SPURIOUS_VECTOR)?; // SVR: APIC software enable
    emit_wrmsr(a, 0x83e, 0xb)?; // timer divide by 1
    emit_wrmsr(a, 0x832, (1 << 17) | TICK_VECTOR)?; // LVT timer: periodic
    emit_wrmsr(a, 0x838, TICK_COUNT)?; // initial count: starts the timer
    emit_doorbell(a, Doorbell::Ready)?;
    a.sti()?;
    let mut halt = a.create_label();
    a.set_label(&mut halt)?;
    a.hlt()?;
    a.jmp(halt)
}

/// The timer tick handler (counts in the mailbox through GS, checks the RAM pattern, then EOI)
/// and the spurious interrupt handler (returns, no EOI); returns their labels in vector order.
fn emit_interrupt_handlers(a: &mut Asm) -> Result<Vec<CodeLabel>, IcedError> {
    const SAVED: [AsmRegister64; 10] = [rax, rcx, rdx, rdi, r8, r9, r10, r11, r12, r13];
    let mut tick = a.create_label();
    a.set_label(&mut tick)?;
    for r in SAVED {
        a.push(r)?;
    }
    a.inc(qword_ptr(off::TICKS).gs())?;
    ramcheck::emit_tick(a)?;
    emit_wrmsr(a, 0x80b, 0)?; // x2APIC EOI
    for r in SAVED.into_iter().rev() {
        a.pop(r)?;
    }
    a.iretq()?;
    let mut spurious = a.create_label();
    a.set_label(&mut spurious)?;
    a.iretq()?;
    Ok(vec![tick, spurious])
}

fn emit_ring3(a: &mut Asm, kind: PayloadKind) -> Result<(), IcedError> {
    a.mov(
        qword_ptr(rsi + off::STATUS),
        i32::try_from(status::RING3).unwrap_or(2),
    )?;
    match kind {
        PayloadKind::Touch => touch::emit(a)?,
        PayloadKind::NumaBench => bench::emit(a)?,
        PayloadKind::Halt | PayloadKind::Idle => {}
        PayloadKind::Fault(f) => emit_fault(a, f)?,
    }
    emit_doorbell(a, Doorbell::Done)?;
    // The VMM never resumes a vCPU after Done; if it did, this faults into the handlers.
    a.ud2()
}

fn emit_fault(a: &mut Asm, f: FaultPayload) -> Result<(), IcedError> {
    match f {
        FaultPayload::TripleFault => a.ud2(),
        FaultPayload::UnknownPort => {
            a.mov(edx, u32::from(UNKNOWN_PORT))?;
            a.mov(al, 0x42)?;
            a.out(dx, al)
        }
        FaultPayload::UnmappedMemory => {
            a.mov(rax, UNMAPPED_GPA)?;
            a.mov(qword_ptr(rax), 0x1234)
        }
        FaultPayload::PageFault => {
            a.mov(rax, UNMAPPED_VA)?;
            a.mov(qword_ptr(rax), 0x1234)
        }
    }
}

fn emit_exception_stubs(a: &mut Asm) -> Result<Vec<CodeLabel>, IcedError> {
    let mut common = a.create_label();
    let mut labels = Vec::with_capacity(32);
    for vector in 0..32u64 {
        let mut l = a.create_label();
        a.set_label(&mut l)?;
        if !ERROR_CODE_VECTORS.contains(&vector) {
            a.push(0)?;
        }
        a.push(i32::try_from(vector).unwrap_or(0))?;
        a.jmp(common)?;
        labels.push(l);
    }
    a.set_label(&mut common)?;
    let gs_slot = |o: u64| qword_ptr(o).gs();
    a.pop(rax)?;
    a.mov(gs_slot(off::FAULT_VECTOR), rax)?;
    a.pop(rax)?;
    a.mov(gs_slot(off::FAULT_ERROR), rax)?;
    for (i, field) in [
        off::FAULT_RIP,
        off::FAULT_CS,
        off::FAULT_RFLAGS,
        off::FAULT_RSP,
    ]
    .into_iter()
    .enumerate()
    {
        a.mov(rax, qword_ptr(rsp + 8 * i))?;
        a.mov(gs_slot(field), rax)?;
    }
    a.mov(rax, cr2)?;
    a.mov(gs_slot(off::FAULT_CR2), rax)?;
    emit_doorbell(a, Doorbell::Fault)?;
    let mut stay = a.create_label();
    a.set_label(&mut stay)?;
    a.hlt()?;
    a.jmp(stay)?;
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(p: &Program, ip: u64) -> Vec<iced_x86::Instruction> {
        let mut d = iced_x86::Decoder::with_ip(64, &p.code, ip, iced_x86::DecoderOptions::NONE);
        let mut v = Vec::new();
        while d.can_decode() {
            v.push(d.decode());
        }
        v
    }

    #[test]
    fn every_kind_assembles_with_entry_points_inside_the_code() {
        let ip = 0xC000_8000;
        for kind in PayloadKind::ALL {
            let p = assemble(kind, ip).unwrap();
            let e = &p.entry_points;
            let end = ip + p.code.len() as u64;
            assert_eq!(e.entry, ip);
            assert!((ip..end).contains(&e.user_entry), "{kind:?}");
            assert!(e.handlers.iter().all(|h| (ip..end).contains(h)), "{kind:?}");
            let ins = decode(&p, ip);
            assert!(ins.iter().all(|i| !i.is_invalid()), "{kind:?}");
        }
    }

    #[test]
    fn every_kind_is_position_independent() {
        for kind in PayloadKind::ALL {
            assert!(position_independent(kind).unwrap(), "{kind:?}");
        }
    }

    #[test]
    fn ring_zero_part_is_short() {
        // Ring 0 is emulated here (~1 M instr/s): everything up to iretq stays small.
        let ip = 0xC000_8000;
        let p = assemble(PayloadKind::Touch, ip).unwrap();
        let ins = decode(&p, ip);
        let upto = ins
            .iter()
            .position(|i| i.mnemonic() == iced_x86::Mnemonic::Iretq)
            .unwrap();
        assert!(upto < 30, "{upto} instructions before iretq");
    }
}
