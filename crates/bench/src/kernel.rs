//! The host-native measuring kernels: the same instructions the guest's `numa-bench` payload
//! runs in ring 3 (its generator is in `vmhost_guest::codegen`), written as inline assembly so
//! the compiler cannot change their shape, and the TSC they are timed with.
//!
//! - chase: `lfence; rdtsc`, then a 64-byte-aligned loop of 8 dependent loads `p = *p`,
//!   `dec; jnz`, then `lfence; rdtsc`;
//! - stream: `lfence; rdtsc`, then per pass a 64-byte-aligned loop reading 128 bytes as 16
//!   sequential 64-bit `add`s into 4 accumulators, then `lfence; rdtsc`.
//!
//! This module owns the crate's `unsafe` code: the assembly and its contracts.

use std::time::{Duration, Instant};

/// Dependent loads per chase loop iteration (as the guest's `LOADS_PER_ITER`).
pub const LOADS_PER_ITER: u64 = vmhost_vcpu::payload::bench::LOADS_PER_ITER;
/// Bytes one stream loop iteration reads (as the guest's `STREAM_STEP`).
pub const STREAM_STEP: u64 = vmhost_vcpu::payload::bench::STREAM_STEP;

/// What a chase measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChaseOut {
    /// TSC cycles of the whole chase.
    pub cycles: u64,
    /// The address the chase ended on (the last load's value).
    pub end: u64,
}

/// What a stream measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamOut {
    /// TSC cycles of all passes.
    pub cycles: u64,
    /// The four accumulators: the wrapping sums of the words each one read.
    pub sums: [u64; 4],
}

/// Reads the TSC after earlier instructions completed (`lfence; rdtsc`), as the guest does.
pub fn rdtsc() -> u64 {
    let lo: u32;
    let hi: u32;
    // SAFETY: lfence and rdtsc only read the time-stamp counter into EDX:EAX (declared as
    // outputs); they touch no memory and no other register. rdtsc is allowed in user mode on
    // Linux (CR4.TSD is clear).
    unsafe {
        std::arch::asm!(
            "lfence",
            "rdtsc",
            out("eax") lo,
            out("edx") hi,
            options(nostack, nomem, preserves_flags),
        );
    }
    (u64::from(hi) << 32) | u64::from(lo)
}

/// The TSC rate in kHz, measured against the monotonic clock over `span` (0 when the
/// measurement makes no sense).
#[expect(
    clippy::cast_possible_truncation,
    reason = "the rate is checked to be within u32 range before the cast"
)]
pub fn calibrate_tsc_khz(span: Duration) -> u32 {
    let t0 = Instant::now();
    let c0 = rdtsc();
    while t0.elapsed() < span {
        std::hint::spin_loop();
    }
    let c1 = rdtsc();
    let secs = t0.elapsed().as_secs_f64();
    let khz = c1.wrapping_sub(c0) as f64 / secs / 1e3;
    if khz.is_finite() && khz > 0.0 && khz < f64::from(u32::MAX) {
        khz.round() as u32
    } else {
        0
    }
}

/// Follows the pointer chain from `start` for `iters` × [`LOADS_PER_ITER`] dependent loads.
///
/// # Safety
///
/// `start` and every address reached from it by loading the 8-byte word it points to, for
/// `iters * LOADS_PER_ITER` loads, must be 8-byte aligned, readable, and not written by anyone
/// during the call (a chain built by `vmhost_vcpu::payload::bench::prepare` and relocated
/// into a live mapping is).
pub unsafe fn chase(start: u64, iters: u64) -> ChaseOut {
    let cycles: u64;
    let mut p = start;
    // SAFETY: the caller guarantees every load `p = *p` reads a valid, aligned word of a
    // chain that nobody writes meanwhile; the block writes only the registers declared here
    // and no memory (`readonly`), and uses no stack.
    unsafe {
        std::arch::asm!(
            "lfence",
            "rdtsc",
            "shl rdx, 32",
            "or rax, rdx",
            "mov {t0}, rax",
            "test {n}, {n}",
            "jz 3f",
            ".p2align 6",
            "2:",
            "mov {p}, qword ptr [{p}]",
            "mov {p}, qword ptr [{p}]",
            "mov {p}, qword ptr [{p}]",
            "mov {p}, qword ptr [{p}]",
            "mov {p}, qword ptr [{p}]",
            "mov {p}, qword ptr [{p}]",
            "mov {p}, qword ptr [{p}]",
            "mov {p}, qword ptr [{p}]",
            "dec {n}",
            "jnz 2b",
            "3:",
            "lfence",
            "rdtsc",
            "shl rdx, 32",
            "or rax, rdx",
            "sub rax, {t0}",
            p = inout(reg) p,
            n = inout(reg) iters => _,
            t0 = out(reg) _,
            out("rax") cycles,
            out("rdx") _,
            options(nostack, readonly),
        );
    }
    ChaseOut { cycles, end: p }
}

/// Reads `[base, base + len)` sequentially `passes` times, 128 bytes per loop iteration.
///
/// # Safety
///
/// `len` must be a non-zero multiple of [`STREAM_STEP`] and `[base, base + len)` an 8-byte
/// aligned range that is readable for the whole call.
pub unsafe fn stream(base: u64, len: u64, passes: u64) -> StreamOut {
    let cycles: u64;
    let (mut a0, mut a1, mut a2, mut a3) = (0u64, 0u64, 0u64, 0u64);
    // SAFETY: the caller guarantees `[base, base + len)` is readable and `len` a non-zero
    // multiple of 128, so the inner loop reads exactly that range and terminates; the block
    // writes only the registers declared here and no memory (`readonly`), and uses no stack.
    unsafe {
        std::arch::asm!(
            "lfence",
            "rdtsc",
            "shl rdx, 32",
            "or rax, rdx",
            "mov {t0}, rax",
            "4:",
            "test {passes}, {passes}",
            "jz 6f",
            "mov {ptr}, {base}",
            "mov {rem}, {len}",
            ".p2align 6",
            "5:",
            "add {a0}, qword ptr [{ptr}]",
            "add {a1}, qword ptr [{ptr} + 8]",
            "add {a2}, qword ptr [{ptr} + 16]",
            "add {a3}, qword ptr [{ptr} + 24]",
            "add {a0}, qword ptr [{ptr} + 32]",
            "add {a1}, qword ptr [{ptr} + 40]",
            "add {a2}, qword ptr [{ptr} + 48]",
            "add {a3}, qword ptr [{ptr} + 56]",
            "add {a0}, qword ptr [{ptr} + 64]",
            "add {a1}, qword ptr [{ptr} + 72]",
            "add {a2}, qword ptr [{ptr} + 80]",
            "add {a3}, qword ptr [{ptr} + 88]",
            "add {a0}, qword ptr [{ptr} + 96]",
            "add {a1}, qword ptr [{ptr} + 104]",
            "add {a2}, qword ptr [{ptr} + 112]",
            "add {a3}, qword ptr [{ptr} + 120]",
            "add {ptr}, 128",
            "sub {rem}, 128",
            "jnz 5b",
            "dec {passes}",
            "jmp 4b",
            "6:",
            "lfence",
            "rdtsc",
            "shl rdx, 32",
            "or rax, rdx",
            "sub rax, {t0}",
            base = in(reg) base,
            len = in(reg) len,
            passes = inout(reg) passes => _,
            ptr = out(reg) _,
            rem = out(reg) _,
            a0 = inout(reg) a0,
            a1 = inout(reg) a1,
            a2 = inout(reg) a2,
            a3 = inout(reg) a3,
            t0 = out(reg) _,
            out("rax") cycles,
            out("rdx") _,
            options(nostack, readonly),
        );
    }
    StreamOut {
        cycles,
        sums: [a0, a1, a2, a3],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain over `lines` 64-byte lines of `buf`, in the order `order` (a cycle).
    fn link(buf: &mut [u64], order: &[usize]) -> u64 {
        let base = buf.as_ptr() as u64;
        for (k, &line) in order.iter().enumerate() {
            let next = order[(k + 1) % order.len()];
            buf[line * 8] = base + (next as u64) * 64;
        }
        base + order[0] as u64 * 64
    }

    #[test]
    fn chase_follows_the_chain_and_closes_after_one_lap() {
        let lines = 64usize;
        let mut buf = vec![0u64; lines * 8];
        // A cycle that jumps around: 0, 37, 10, 47, ... (37 is coprime with 64).
        let order: Vec<usize> = (0..lines).map(|k| (k * 37) % lines).collect();
        let start = link(&mut buf, &order);
        // SAFETY: `buf` holds a closed chain of aligned addresses inside itself, unchanged
        // during the call.
        let lap = unsafe { chase(start, lines as u64 / LOADS_PER_ITER) };
        assert_eq!(lap.end, start, "one lap of 64 loads returns to the start");
        // SAFETY: as above.
        let part = unsafe { chase(start, 1) };
        let eighth = buf.as_ptr() as u64 + order[8] as u64 * 64;
        assert_eq!(part.end, eighth, "8 loads walk 8 links");
        // SAFETY: as above; zero iterations load nothing.
        assert_eq!(unsafe { chase(start, 0) }.end, start);
    }

    #[test]
    fn stream_reads_every_word_once_per_pass() {
        let words = 1024usize; // 8 KiB = 64 iterations of 128 bytes
        let buf: Vec<u64> = (0..words as u64).collect();
        let base = buf.as_ptr() as u64;
        // SAFETY: `buf` is a live, aligned 8 KiB vector; 8 KiB is a multiple of 128.
        let out = unsafe { stream(base, (words * 8) as u64, 3) };
        let total: u64 = out.sums.iter().sum();
        let once: u64 = (0..words as u64).sum();
        assert_eq!(total, 3 * once, "each word read exactly once per pass");
        // Accumulator k sums the words at indexes ≡ k (mod 4).
        let a1: u64 = (0..words as u64).filter(|i| i % 4 == 1).sum();
        assert_eq!(out.sums[1], 3 * a1);
        // SAFETY: as above; zero passes read nothing.
        assert_eq!(unsafe { stream(base, 128, 0) }.sums, [0; 4]);
    }

    #[test]
    fn tsc_advances_and_calibrates() {
        let a = rdtsc();
        let khz = calibrate_tsc_khz(Duration::from_millis(20));
        assert!(rdtsc() > a);
        assert!(khz > 100_000, "{khz} kHz");
    }
}
