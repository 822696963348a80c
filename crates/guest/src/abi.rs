//! The ring-3 ABI of the boot area and the fixed addresses of the fault test payloads.
//!
//! The VMM writes a GDT with these selectors (vmhost-vcpu's `arch::boot`); the guest's ring-0
//! prologue `iretq`s to ring 3 with them.

/// Ring-3 64-bit code segment selector (GDT entry 3, RPL 3).
pub const USER_CS: u16 = 0x18 | 3;
/// Ring-3 data segment selector (GDT entry 4, RPL 3).
pub const USER_DS: u16 = 0x20 | 3;
/// RFLAGS for ring 3: reserved bit 1, IOPL 3, IF clear. (A nested host's `iretq` may drop IOPL
/// to 0; `out` from ring 3 is then allowed by the TSS I/O permission bitmap instead.)
pub const USER_RFLAGS: u64 = 0x3002;

/// GPA inside the MMIO hole (mapped by the page tables, backed by no memslot) that the
/// unmapped-memory test payload writes.
pub const UNMAPPED_GPA: u64 = 0xD000_0000;
/// A canonical virtual address that no page table maps (the page-fault test payload).
pub const UNMAPPED_VA: u64 = 1 << 46;
/// The port the unknown-port test payload writes.
pub const UNKNOWN_PORT: u16 = 0x5a5a;

/// IDT vectors the boot area describes: the 32 exceptions, then [`TICK_VECTOR`] and
/// [`SPURIOUS_VECTOR`].
pub const IDT_VECTORS: usize = 34;
/// The `idle` payload's LAPIC timer interrupt: each one increments the mailbox's `ticks`.
pub const TICK_VECTOR: u32 = 32;
/// The LAPIC's spurious-interrupt vector (its handler just returns).
pub const SPURIOUS_VECTOR: u32 = 33;
/// The `idle` payload's LAPIC timer period in timer counts (divide by 1): 10 ms at KVM's
/// 1 GHz APIC bus clock.
pub const TICK_COUNT: u32 = 10_000_000;
