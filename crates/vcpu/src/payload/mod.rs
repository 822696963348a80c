//! Built-in guest payloads: what each kind runs, the parameters the VMM puts in each vCPU's
//! mailbox, and how results are read back.
//!
//! Every payload starts the same way: a few ring-0 instructions read the CPUID leaves the VMM
//! listed (ring 0 is emulated on this nested host, ring 3 is native, and only ring 0 sees the
//! CPUID set with `KVM_SET_CPUID2`), then the heavy work drops to ring 3 with `iretq`.
//! Results go to the mailbox; one `out` to [`mailbox::DOORBELL_PORT`] tells the VMM.
//!
//! | kind | ring 3 work | ends with |
//! |---|---|---|
//! | `touch` | [`touch`] | Done |
//! | `numa-bench` | [`bench`](mod@bench) | Done |
//! | `halt` | none | Ready, then HLT (exits: no in-kernel irqchip) |
//! | `idle` | none | Ready, then HLT with interrupts on, waiting in the kernel until stopped (in-kernel irqchip); counts its 10 ms LAPIC timer ticks in the mailbox and checks its RAM pattern on each ([`vmhost_guest::ramcheck`]) |
//!
//! Hidden test payloads ([`FaultPayload`]) fault on purpose.
//!
//! The programs and the mailbox layout are defined in [`vmhost_guest`]; this crate's build
//! script generates the machine code there ([`program`]), so the VMM only copies bytes.

pub mod bench;
pub mod program;
pub mod touch;

pub use vmhost_guest::mailbox;
pub use vmhost_guest::ramcheck;
#[doc(hidden)]
pub use vmhost_guest::FaultPayload;
pub use vmhost_guest::PayloadKind;

use serde::Serialize;
use vm_memory::{Bytes, GuestAddress};
use vmhost_config::Payload;
use vmhost_memory::GuestLayout;
use vmhost_memory::GuestMemoryMmap;
use vmhost_plan::Plan;

use crate::arch::{BootLayout, CpuidResult};
use mailbox::{BenchSlot, CpuidSlot, GpaRange, Mailbox, MAX_CPUID, MAX_RANGES};

/// Why a payload cannot be prepared or read back.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    /// The boot area's code address does not suit the program.
    #[error(
        "the {kind:?} payload cannot run at GPA {gpa:#x} (it needs a {align}-byte aligned address)"
    )]
    CodeAddress {
        /// Payload.
        kind: PayloadKind,
        /// The address.
        gpa: u64,
        /// The alignment the program needs.
        align: u64,
    },
    /// The code does not fit the space the boot area reserves.
    #[error("the {kind:?} payload is {bytes} bytes, the boot area holds {max}")]
    CodeTooLarge {
        /// Payload.
        kind: PayloadKind,
        /// Code size.
        bytes: usize,
        /// Space.
        max: u64,
    },
    /// A cell has more GPA ranges than a mailbox holds.
    #[error("guest cell {cell} has {ranges} RAM ranges, a mailbox holds {max}")]
    TooManyRanges {
        /// Cell.
        cell: u32,
        /// Its ranges.
        ranges: usize,
        /// The limit.
        max: usize,
    },
    /// More guest cells than the benchmark table holds.
    #[error("{cells} guest cells, the benchmark handles at most {max}")]
    TooManyCells {
        /// Cells.
        cells: usize,
        /// The limit.
        max: usize,
    },
    /// A cell is too small for the benchmark.
    #[error("guest cell {cell} ({bytes} bytes) is too small for the benchmark")]
    CellTooSmall {
        /// Cell.
        cell: u32,
        /// Its largest region.
        bytes: u64,
    },
    /// Figures the guest wrote to its mailbox give a product beyond 64 bits: the guest
    /// misbehaved (its own code never writes such values).
    #[error("mailbox of vCPU {vcpu}: {field} = {a} × {b} does not fit in 64 bits (the guest wrote implausible figures)")]
    Implausible {
        /// The vCPU (as its mailbox says).
        vcpu: u64,
        /// The figure computed (`bench.chase_loads`, `bench.stream_bytes`).
        field: &'static str,
        /// First factor as the guest wrote it.
        a: u64,
        /// Second factor.
        b: u64,
    },
    /// Guest memory could not be written or read.
    #[error("cannot access guest memory at GPA {gpa:#x}")]
    Write {
        /// Where.
        gpa: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// The built-in program a spec's `boot.payload` names.
pub fn kind_of(payload: Payload) -> PayloadKind {
    match payload {
        Payload::Touch => PayloadKind::Touch,
        Payload::NumaBench => PayloadKind::NumaBench,
        Payload::Halt => PayloadKind::Halt,
        Payload::Idle => PayloadKind::Idle,
    }
}

/// Per-VM inputs the mailboxes are filled from.
pub struct MailboxInputs<'a> {
    /// The plan.
    pub plan: &'a Plan,
    /// Guest RAM layout.
    pub layout: &'a GuestLayout,
    /// Boot area.
    pub boot: &'a BootLayout,
    /// Ring-3 entry.
    pub user_entry: u64,
    /// Benchmark chains (numa-bench only).
    pub bench: &'a [bench::CellChain],
}

/// The mailbox of vCPU `i` before it runs (the CPUID list is added per vCPU later).
pub fn initial_mailbox(inputs: &MailboxInputs<'_>, i: usize) -> Result<Mailbox, PayloadError> {
    let v = &inputs.plan.vcpus[i];
    let mut m = Mailbox::new(v.vcpu, inputs.boot.mailbox(i));
    m.user_rsp = inputs.boot.user_stack_top(i);
    m.user_entry = inputs.user_entry;
    let ranges: Vec<GpaRange> = inputs
        .layout
        .cell_regions(v.guest_cell)
        .map(|r| GpaRange {
            gpa: r.gpa,
            len: r.size_bytes,
        })
        .collect();
    if ranges.len() > MAX_RANGES {
        return Err(PayloadError::TooManyRanges {
            cell: v.guest_cell,
            ranges: ranges.len(),
            max: MAX_RANGES,
        });
    }
    m.ranges[..ranges.len()].copy_from_slice(&ranges);
    m.n_ranges = ranges.len() as u64;
    // `idle`'s RAM pattern, in the cell's first range, a slot per vCPU of the cell.
    let rank = inputs.plan.vcpus[..i]
        .iter()
        .filter(|o| o.guest_cell == v.guest_cell)
        .count() as u64;
    if let Some((base, stride)) = ranges
        .first()
        .and_then(|r| ramcheck::placement(r.gpa, r.len, rank))
    {
        m.ram_base = base;
        m.ram_stride = stride;
    }
    for (slot, chain) in m.bench.iter_mut().zip(inputs.bench) {
        *slot = BenchSlot {
            chain_start: chain
                .starts
                .get(i)
                .copied()
                .unwrap_or(chain.slot.chain_start),
            ..chain.slot
        };
    }
    m.bench_count = inputs.bench.len().min(m.bench.len()) as u64;
    Ok(m)
}

/// Lists the CPUID leaves to read in `m` (at most [`MAX_CPUID`]).
pub fn set_cpuid_requests(m: &mut Mailbox, leaves: &[(u32, u32)]) {
    let n = leaves.len().min(MAX_CPUID);
    for (slot, &(leaf, subleaf)) in m.cpuid.iter_mut().zip(&leaves[..n]) {
        *slot = CpuidSlot {
            leaf,
            subleaf,
            ..Default::default()
        };
    }
    m.cpuid_count = n as u64;
}

/// Writes a mailbox into the boot area.
pub fn write_mailbox(mem: &GuestMemoryMmap, m: &Mailbox) -> Result<(), PayloadError> {
    mem.write_obj(*m, GuestAddress(m.self_gpa))
        .map_err(|source| PayloadError::Write {
            gpa: m.self_gpa,
            source,
        })
}

/// Reads a mailbox back.
pub fn read_mailbox(mem: &GuestMemoryMmap, gpa: u64) -> Result<Mailbox, PayloadError> {
    mem.read_obj(GuestAddress(gpa))
        .map_err(|source| PayloadError::Write { gpa, source })
}

/// The CPUID results the guest wrote.
pub fn cpuid_results(m: &Mailbox) -> Vec<CpuidResult> {
    let n = usize::try_from(m.cpuid_count).unwrap_or(0).min(MAX_CPUID);
    m.cpuid[..n]
        .iter()
        .map(|s| CpuidResult {
            leaf: s.leaf,
            subleaf: s.subleaf,
            eax: s.eax,
            ebx: s.ebx,
            ecx: s.ecx,
            edx: s.edx,
        })
        .collect()
}

/// What one vCPU's payload measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PayloadResult {
    /// Nothing to report (halt, idle, test payloads, or the vCPU did not finish).
    None,
    /// `touch`.
    Touch(TouchResult),
    /// `numa-bench`, one entry per guest cell.
    NumaBench(Vec<CellBench>),
}

/// `touch` on one vCPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TouchResult {
    /// Guest cell written.
    pub cell: u32,
    /// Bytes written.
    pub bytes: u64,
    /// Seconds (TSC cycles / TSC rate).
    pub seconds: f64,
    /// Bytes per second / 1e9.
    pub gb_per_s: f64,
}

/// `numa-bench` from one vCPU to one guest cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellBench {
    /// Guest cell measured.
    pub cell: u32,
    /// Working set (chain and stream) in bytes.
    pub working_set_bytes: u64,
    /// Dependent loads chased.
    pub chase_loads: u64,
    /// Mean latency per load, ns.
    pub chase_ns: f64,
    /// Bytes read by the stream.
    pub stream_bytes: u64,
    /// Stream bandwidth, GB/s.
    pub stream_gb_per_s: f64,
}

/// Seconds for `cycles` at `tsc_khz` (0 when the rate is unknown).
pub fn cycles_to_secs(cycles: u64, tsc_khz: u32) -> f64 {
    if tsc_khz == 0 {
        return 0.0;
    }
    cycles as f64 / (f64::from(tsc_khz) * 1e3)
}

fn rate(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// Reads what a finished vCPU's payload measured. The mailbox is guest memory: every product
/// of its figures is checked, and one beyond 64 bits is a [`PayloadError::Implausible`].
pub fn collect(
    kind: PayloadKind,
    m: &Mailbox,
    cell: u32,
    cells: &[u32],
    tsc_khz: u32,
) -> Result<PayloadResult, PayloadError> {
    Ok(match kind {
        PayloadKind::Touch => {
            let seconds = cycles_to_secs(m.tsc_end.saturating_sub(m.tsc_start), tsc_khz);
            PayloadResult::Touch(TouchResult {
                cell,
                bytes: m.touch_bytes,
                seconds,
                gb_per_s: rate(m.touch_bytes, seconds),
            })
        }
        PayloadKind::NumaBench => {
            let n = usize::try_from(m.bench_count)
                .unwrap_or(0)
                .min(m.bench.len());
            let product = |field, a: u64, b: u64| {
                a.checked_mul(b).ok_or(PayloadError::Implausible {
                    vcpu: m.vcpu,
                    field,
                    a,
                    b,
                })
            };
            let mut per_cell = Vec::with_capacity(n);
            for (s, &cell) in m.bench[..n].iter().zip(cells) {
                let loads = product("bench.chase_loads", s.chase_iters, bench::LOADS_PER_ITER)?;
                let stream_bytes = product("bench.stream_bytes", s.stream_len, s.stream_passes)?;
                let chase_secs = cycles_to_secs(s.chase_cycles, tsc_khz);
                per_cell.push(CellBench {
                    cell,
                    working_set_bytes: s.stream_len,
                    chase_loads: loads,
                    chase_ns: if loads > 0 {
                        chase_secs * 1e9 / loads as f64
                    } else {
                        0.0
                    },
                    stream_bytes,
                    stream_gb_per_s: rate(stream_bytes, cycles_to_secs(s.stream_cycles, tsc_khz)),
                });
            }
            PayloadResult::NumaBench(per_cell)
        }
        _ => PayloadResult::None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touch_and_bench_results_are_converted_with_the_tsc_rate() {
        let mut m = Mailbox::new(0, 0);
        m.tsc_start = 1_000;
        m.tsc_end = 1_000 + 2_000_000; // 1 ms at 2 GHz
        m.touch_bytes = 4 << 20;
        let PayloadResult::Touch(t) = collect(PayloadKind::Touch, &m, 3, &[], 2_000_000).unwrap()
        else {
            panic!()
        };
        assert_eq!(t.cell, 3);
        assert!((t.seconds - 1e-3).abs() < 1e-12);
        assert!((t.gb_per_s - 4.194304).abs() < 1e-9);
        m.bench_count = 1;
        m.bench[0] = BenchSlot {
            chase_iters: 1000,
            chase_cycles: 8000 * 200,
            stream_len: 1 << 20,
            stream_passes: 2,
            stream_cycles: 2_000_000,
            ..Default::default()
        };
        let PayloadResult::NumaBench(b) =
            collect(PayloadKind::NumaBench, &m, 0, &[7], 2_000_000).unwrap()
        else {
            panic!()
        };
        assert_eq!(b[0].cell, 7);
        assert_eq!(b[0].chase_loads, 8000);
        assert!((b[0].chase_ns - 100.0).abs() < 1e-9);
        assert_eq!(b[0].stream_bytes, 2 << 20);
        assert_eq!(
            collect(PayloadKind::Halt, &m, 0, &[], 1).unwrap(),
            PayloadResult::None
        );
        assert_eq!(cycles_to_secs(5, 0), 0.0);
    }

    /// The guest owns its mailbox: figures whose product wraps used to panic the VMM (debug)
    /// or report a wrapped count (release).
    #[test]
    fn mailbox_figures_whose_product_overflows_are_a_guest_error_not_a_panic() {
        let mut m = Mailbox::new(2, 0);
        m.bench_count = 1;
        m.bench[0] = BenchSlot {
            chase_iters: u64::MAX / 2,
            stream_len: 1 << 20,
            stream_passes: 1,
            ..Default::default()
        };
        let err = collect(PayloadKind::NumaBench, &m, 0, &[0], 1).unwrap_err();
        assert!(
            matches!(
                err,
                PayloadError::Implausible {
                    vcpu: 2,
                    field: "bench.chase_loads",
                    ..
                }
            ),
            "{err}"
        );
        m.bench[0].chase_iters = 1;
        m.bench[0].stream_passes = u64::MAX;
        let err = collect(PayloadKind::NumaBench, &m, 0, &[0], 1).unwrap_err();
        assert!(err.to_string().contains("bench.stream_bytes"), "{err}");
    }

    #[test]
    fn spec_payloads_map_to_their_programs() {
        assert_eq!(kind_of(Payload::Touch), PayloadKind::Touch);
        assert_eq!(kind_of(Payload::NumaBench), PayloadKind::NumaBench);
        assert_eq!(kind_of(Payload::Halt), PayloadKind::Halt);
        assert_eq!(kind_of(Payload::Idle), PayloadKind::Idle);
    }
}
