//! A thin layer over iced-x86's `CodeAssembler` that can align labels.
//!
//! `code_asm` has no `.balign`: loop heads are aligned by assembling, measuring where each
//! aligned label landed, inserting NOP padding before it and assembling again until every
//! aligned label sits on its boundary (padding is multi-byte NOPs, never zeros: zero bytes would
//! execute as `add [rax], al`).

use std::ops::{Deref, DerefMut};

use iced_x86::code_asm::{CodeAssembler, CodeLabel};
use iced_x86::{BlockEncoderOptions, IcedError};

/// Why code could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum AsmError {
    /// iced-x86 rejected an instruction, a label or the block.
    #[error("iced-x86: {0}")]
    Iced(#[from] IcedError),
    /// Padding did not settle (a bug in the emitter).
    #[error("loop-head alignment did not converge")]
    Unaligned,
}

/// Boundary for loop heads: the alignment a program must be placed at for them to stay
/// aligned.
const LOOP_ALIGN: u64 = crate::CODE_ALIGN;

/// A `CodeAssembler` that records aligned labels.
pub struct Asm {
    a: CodeAssembler,
    pads: Vec<usize>,
    aligned: Vec<CodeLabel>,
}

impl Deref for Asm {
    type Target = CodeAssembler;
    fn deref(&self) -> &CodeAssembler {
        &self.a
    }
}

impl DerefMut for Asm {
    fn deref_mut(&mut self) -> &mut CodeAssembler {
        &mut self.a
    }
}

impl Asm {
    /// Pads to [`LOOP_ALIGN`] and binds `label` to the next instruction.
    pub fn align_label(&mut self, label: &mut CodeLabel) -> Result<(), IcedError> {
        let pad = self.pads.get(self.aligned.len()).copied().unwrap_or(0);
        if pad > 0 {
            self.a.nops_with_size(pad)?;
        }
        self.a.set_label(label)?;
        self.aligned.push(*label);
        Ok(())
    }
}

/// Code assembled at a fixed address, with the addresses of labels the emitter returned.
pub struct Assembled<T> {
    /// Machine code.
    pub code: Vec<u8>,
    /// What the emitter returned (labels to resolve with `ip_of`).
    pub labels: T,
    result: iced_x86::code_asm::CodeAssemblerResult,
}

impl<T> Assembled<T> {
    /// The address a label was bound to.
    pub fn ip_of(&self, label: &CodeLabel) -> Result<u64, IcedError> {
        self.result.label_ip(label)
    }
}

/// Runs `emit` and assembles its code at `ip`, re-running it with more padding until every
/// label bound with [`Asm::align_label`] is aligned.
pub fn assemble_aligned<T>(
    ip: u64,
    emit: impl Fn(&mut Asm) -> Result<T, IcedError>,
) -> Result<Assembled<T>, AsmError> {
    let mut pads: Vec<usize> = Vec::new();
    for _ in 0..32 {
        let mut asm = Asm {
            a: CodeAssembler::new(64)?,
            pads: pads.clone(),
            aligned: Vec::new(),
        };
        let labels = emit(&mut asm)?;
        let result = asm
            .a
            .assemble_options(ip, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)?;
        let mut stable = true;
        pads.resize(asm.aligned.len(), 0);
        for (pad, label) in pads.iter_mut().zip(&asm.aligned) {
            let miss = result.label_ip(label)? % LOOP_ALIGN;
            if miss != 0 {
                stable = false;
                // LOOP_ALIGN is 64: the extra padding always fits a usize.
                let extra = usize::try_from(LOOP_ALIGN - miss).unwrap_or(0);
                *pad = (*pad + extra) % usize::try_from(LOOP_ALIGN).unwrap_or(64);
            }
        }
        if stable {
            return Ok(Assembled {
                code: result.inner.code_buffer.clone(),
                labels,
                result,
            });
        }
    }
    Err(AsmError::Unaligned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::code_asm::*;

    #[test]
    fn loop_heads_land_on_64_byte_boundaries_padded_with_nops() {
        let out = assemble_aligned(0x1003, |a| {
            let mut heads = Vec::new();
            a.mov(rax, 0x1234_5678_9abc_def0u64)?;
            for _ in 0..3 {
                let mut head = a.create_label();
                a.align_label(&mut head)?;
                a.dec(rcx)?;
                a.jnz(head)?;
                a.mov(rbx, qword_ptr(rsi + 0x40))?;
                heads.push(head);
            }
            Ok(heads)
        })
        .unwrap();
        for h in &out.labels {
            assert_eq!(out.ip_of(h).unwrap() % 64, 0);
        }
        let mut d =
            iced_x86::Decoder::with_ip(64, &out.code, 0x1003, iced_x86::DecoderOptions::NONE);
        while d.can_decode() {
            let i = d.decode();
            assert!(!i.is_invalid());
            assert_ne!(
                i.mnemonic(),
                iced_x86::Mnemonic::Add,
                "padding decoded as add"
            );
        }
    }
}
