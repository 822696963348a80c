//! The per-vCPU mailbox page: the guest's parameters in, its results out.
//!
//! One page per vCPU in the boot area. The VMM writes the parameters before the vCPU starts
//! (cell GPA ranges, benchmark chains, the CPUID leaves to read, stack and entry addresses);
//! the guest writes its results there and rings the doorbell port once. The guest code addresses
//! fields by their offsets in [`Mailbox`], so the layout is defined once, here.

use std::mem::offset_of;

use vm_memory::ByteValued;

/// The doorbell I/O port: one `out` of a [`Doorbell`] code.
pub const DOORBELL_PORT: u16 = 0x0f00;
/// `Mailbox::magic`.
pub const MAGIC: u64 = 0x786f_626c_6961_6d76; // "vmmailbox"-ish, little endian
/// GPA ranges per vCPU (a cell straddling the MMIO hole has two).
pub const MAX_RANGES: usize = 8;
/// CPUID leaves the ring-0 prologue reads.
pub const MAX_CPUID: usize = 32;
/// Guest cells the benchmark visits.
pub const MAX_BENCH_CELLS: usize = 16;

/// What a doorbell write says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Doorbell {
    /// Ring-0 prologue done (CPUID leaves written); the vCPU keeps running.
    Ready = 1,
    /// The payload finished; results are in the mailbox.
    Done = 2,
    /// An exception reached the guest's IDT; `Mailbox::fault` says which.
    Fault = 3,
}

impl Doorbell {
    /// The code from the byte written to the port.
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            1 => Some(Doorbell::Ready),
            2 => Some(Doorbell::Done),
            3 => Some(Doorbell::Fault),
            _ => None,
        }
    }
}

/// `Mailbox::status` values the guest writes on its way.
pub mod status {
    /// Ring-0 prologue finished.
    pub const RING0_DONE: u64 = 1;
    /// Ring 3 entered.
    pub const RING3: u64 = 2;
}

/// One guest-physical range.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpaRange {
    /// Start.
    pub gpa: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One CPUID leaf to read (in) and its result (out).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuidSlot {
    /// EAX in.
    pub leaf: u32,
    /// ECX in.
    pub subleaf: u32,
    /// EAX out.
    pub eax: u32,
    /// EBX out.
    pub ebx: u32,
    /// ECX out.
    pub ecx: u32,
    /// EDX out.
    pub edx: u32,
}

/// The benchmark's parameters and results for one guest cell.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BenchSlot {
    /// In: first cache line of the pointer-chase cycle.
    pub chain_start: u64,
    /// In: chase loop iterations (8 dependent loads each).
    pub chase_iters: u64,
    /// In: start of the sequential-read range.
    pub stream_base: u64,
    /// In: its length (a multiple of 128 bytes).
    pub stream_len: u64,
    /// In: passes over it.
    pub stream_passes: u64,
    /// Out: TSC cycles of the chase.
    pub chase_cycles: u64,
    /// Out: TSC cycles of the stream.
    pub stream_cycles: u64,
    /// Out: a value derived from every load, so none can be skipped.
    pub sink: u64,
}

/// What the exception handler records.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultInfo {
    /// Exception vector.
    pub vector: u64,
    /// Error code (0 for vectors without one).
    pub error_code: u64,
    /// Faulting RIP.
    pub rip: u64,
    /// CS at the fault (RPL = the ring).
    pub cs: u64,
    /// RFLAGS at the fault.
    pub rflags: u64,
    /// RSP at the fault.
    pub rsp: u64,
    /// CR2 (the address of a page fault).
    pub cr2: u64,
}

/// The mailbox page's layout.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Mailbox {
    /// In: [`MAGIC`].
    pub magic: u64,
    /// In: vCPU index.
    pub vcpu: u64,
    /// In: this page's GPA.
    pub self_gpa: u64,
    /// In: ring-3 stack top.
    pub user_rsp: u64,
    /// In: ring-3 entry point.
    pub user_entry: u64,
    /// In: TSC frequency in kHz (KVM_GET_TSC_KHZ).
    pub tsc_khz: u64,
    /// In: an IDTR image with limit 0 (for the triple-fault test payload).
    pub null_idtr: [u64; 2],
    /// Out: progress, see [`status`].
    pub status: u64,
    /// Out: TSC when the timed work started.
    pub tsc_start: u64,
    /// Out: TSC when it ended.
    pub tsc_end: u64,
    /// Out: bytes written by `touch`.
    pub touch_bytes: u64,
    /// Out: exception details.
    pub fault: FaultInfo,
    /// In: number of valid `ranges`.
    pub n_ranges: u64,
    /// In: the vCPU's cell's GPA ranges.
    pub ranges: [GpaRange; MAX_RANGES],
    /// In: number of valid `cpuid` slots.
    pub cpuid_count: u64,
    /// In/out: CPUID leaves.
    pub cpuid: [CpuidSlot; MAX_CPUID],
    /// In: number of valid `bench` slots.
    pub bench_count: u64,
    /// In/out: per-cell benchmark.
    pub bench: [BenchSlot; MAX_BENCH_CELLS],
    /// Out (`idle`): LAPIC timer ticks taken while idling, one per
    /// [`crate::abi::TICK_COUNT`] timer counts. `idle` also writes `tsc_start` once, at its
    /// start: with `ticks` it shows that a restored guest continued rather than started again.
    pub ticks: u64,
    /// In (`idle`): the first of its [`crate::ramcheck`] pattern pages (0: no pattern).
    pub ram_base: u64,
    /// In (`idle`): bytes between its pattern pages (0: no pattern).
    pub ram_stride: u64,
    /// Out (`idle`): pattern pages found wrong ([`crate::ramcheck`]).
    pub ram_errors: u64,
    /// Out (`idle`): pattern pages verified.
    pub ram_checked: u64,
}

const _: () = assert!(std::mem::size_of::<Mailbox>() <= 4096);
const _: () = assert!(std::mem::size_of::<Mailbox>() % 8 == 0);

// SAFETY: Mailbox is repr(C) and made only of u64/u32 fields and arrays of such structs, laid
// out without implicit padding (every field's offset is a multiple of its alignment and the
// struct sizes are multiples of 8, asserted above); every bit pattern is a valid value.
unsafe impl ByteValued for Mailbox {}

impl Mailbox {
    /// An empty mailbox for vCPU `vcpu` at `gpa`.
    pub fn new(vcpu: u32, gpa: u64) -> Self {
        Mailbox {
            magic: MAGIC,
            vcpu: u64::from(vcpu),
            self_gpa: gpa,
            user_rsp: 0,
            user_entry: 0,
            tsc_khz: 0,
            null_idtr: [0; 2],
            status: 0,
            tsc_start: 0,
            tsc_end: 0,
            touch_bytes: 0,
            fault: FaultInfo::default(),
            n_ranges: 0,
            ranges: [GpaRange::default(); MAX_RANGES],
            cpuid_count: 0,
            cpuid: [CpuidSlot::default(); MAX_CPUID],
            bench_count: 0,
            bench: [BenchSlot::default(); MAX_BENCH_CELLS],
            ticks: 0,
            ram_base: 0,
            ram_stride: 0,
            ram_errors: 0,
            ram_checked: 0,
        }
    }
}

/// Offsets the guest code uses, as displacements.
pub mod off {
    use super::*;

    macro_rules! offsets {
        ($($name:ident = $($field:ident).+;)*) => {
            $(
                #[doc = concat!("Offset of `", stringify!($($field).+), "`.")]
                pub const $name: u64 = offset_of!(Mailbox, $($field).+) as u64;
            )*
        };
    }

    offsets! {
        USER_RSP = user_rsp;
        USER_ENTRY = user_entry;
        NULL_IDTR = null_idtr;
        STATUS = status;
        TSC_START = tsc_start;
        TSC_END = tsc_end;
        TOUCH_BYTES = touch_bytes;
        FAULT_VECTOR = fault.vector;
        FAULT_ERROR = fault.error_code;
        FAULT_RIP = fault.rip;
        FAULT_CS = fault.cs;
        FAULT_RFLAGS = fault.rflags;
        FAULT_RSP = fault.rsp;
        FAULT_CR2 = fault.cr2;
        N_RANGES = n_ranges;
        RANGES = ranges;
        CPUID_COUNT = cpuid_count;
        CPUID = cpuid;
        BENCH_COUNT = bench_count;
        BENCH = bench;
        TICKS = ticks;
        RAM_BASE = ram_base;
        RAM_STRIDE = ram_stride;
        RAM_ERRORS = ram_errors;
        RAM_CHECKED = ram_checked;
    }

    /// Size of one [`CpuidSlot`].
    pub const CPUID_SLOT: u64 = std::mem::size_of::<CpuidSlot>() as u64;
    /// Size of one [`BenchSlot`].
    pub const BENCH_SLOT: u64 = std::mem::size_of::<BenchSlot>() as u64;
    /// Size of one [`GpaRange`].
    pub const RANGE: u64 = std::mem::size_of::<GpaRange>() as u64;

    /// Offsets inside a [`BenchSlot`].
    pub mod bench {
        use super::super::BenchSlot;
        use std::mem::offset_of;
        /// `chain_start`.
        pub const CHAIN_START: u64 = offset_of!(BenchSlot, chain_start) as u64;
        /// `chase_iters`.
        pub const CHASE_ITERS: u64 = offset_of!(BenchSlot, chase_iters) as u64;
        /// `stream_base`.
        pub const STREAM_BASE: u64 = offset_of!(BenchSlot, stream_base) as u64;
        /// `stream_len`.
        pub const STREAM_LEN: u64 = offset_of!(BenchSlot, stream_len) as u64;
        /// `stream_passes`.
        pub const STREAM_PASSES: u64 = offset_of!(BenchSlot, stream_passes) as u64;
        /// `chase_cycles`.
        pub const CHASE_CYCLES: u64 = offset_of!(BenchSlot, chase_cycles) as u64;
        /// `stream_cycles`.
        pub const STREAM_CYCLES: u64 = offset_of!(BenchSlot, stream_cycles) as u64;
        /// `sink`.
        pub const SINK: u64 = offset_of!(BenchSlot, sink) as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_packed_and_fits_a_page() {
        assert_eq!(off::CPUID_SLOT, 24);
        assert_eq!(off::BENCH_SLOT, 64);
        assert_eq!(off::RANGES, off::N_RANGES + 8);
        assert_eq!(off::CPUID, off::CPUID_COUNT + 8);
        assert_eq!(off::BENCH % 8, 0);
        assert_eq!(off::bench::SINK, 56);
        // The RAM pattern's fields follow `ticks`: older offsets are unchanged.
        assert_eq!(off::RAM_BASE, off::TICKS + 8);
        assert_eq!(off::RAM_CHECKED, off::TICKS + 32);
        let m = Mailbox::new(3, 0xC010_0000);
        assert_eq!(m.as_slice().len(), std::mem::size_of::<Mailbox>());
        assert_eq!(&m.as_slice()[8..16], &3u64.to_le_bytes());
    }

    #[test]
    fn doorbell_codes_round_trip() {
        for d in [Doorbell::Ready, Doorbell::Done, Doorbell::Fault] {
            assert_eq!(Doorbell::from_byte(d as u8), Some(d));
        }
        assert_eq!(Doorbell::from_byte(0x42), None);
    }
}
