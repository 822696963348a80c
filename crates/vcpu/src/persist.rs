//! The state that moves with a running VM (issue 22's foundation): every vCPU's
//! [`VcpuState`] and the VM's [`VmState`], captured from and restored into KVM, in the
//! Firecracker style (`vstate` + `persist.rs`: the state lives with its owner).
//!
//! The state types are plain serde data: integers, vectors, and the raw KVM structs as their
//! bytes (the zerocopy views kvm-bindings gives them). They know no file or stream format; the
//! snapshot and migration formats carry them. Each raw struct is checked against its size when
//! it is decoded, so a corrupt or foreign state is an error, never a misread struct.
//!
//! Rules a caller keeps (`docs/design.md`, "State that moves"):
//! - Save and restore only while no vCPU of the VM is inside `KVM_RUN`, and after each vCPU
//!   has left its last `KVM_RUN` through `immediate_exit` (an `EINTR` exit), so that KVM has
//!   completed a pending port or MMIO access and the saved RIP is past it.
//! - Before creating the target VM, [`VcpuState::check_compatible`] with the target's
//!   [`TargetCaps`]: a different TSC frequency or a CPUID feature the target KVM cannot give
//!   is refused there.
//! - On the target: create the VM, its irqchip and PIT and the memslots, restore [`VmState`]
//!   (it needs no vCPU: `Vm::restore` loads it before the vCPU threads create their vCPUs),
//!   then each [`VcpuState`] on a fresh vCPU, then run. A restore that fails leaves the target
//!   partly loaded: discard that VM, never run it.
//!
//! [`SavedVm`] gathers a whole VM's state; `VmHandle::capture` and `Vm::restore` move it out
//! of and into a running VM, [`check_target`] checks a host first.

mod compat;
mod raw;
mod saved;
mod vcpu;
mod vm;

pub use compat::{tsc_match, CompatError, TargetCaps, TscMatch, KVM_TSC_TOLERANCE_PPM};
pub use saved::{check_target, DevicesState, SavedPayload, SavedVm};
pub use vcpu::{
    CpuidEntry, MsrEntry, VcpuState, VcpuStateLayout, MSR_IA32_TSC, MSR_IA32_TSC_DEADLINE,
};
pub use vm::VmState;

/// A failed capture or restore, naming the piece of state and the ioctl.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// A KVM ioctl failed.
    #[error("{ioctl} failed for the {piece}")]
    Ioctl {
        /// The piece of state (e.g. "special registers").
        piece: &'static str,
        /// The ioctl (e.g. "KVM_SET_SREGS").
        ioctl: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A saved raw KVM struct does not have the size of the struct it is decoded into.
    #[error(
        "the saved {piece} is {found} bytes, KVM's struct is {expected}: the state is corrupt \
         or was written by an incompatible vmhost; take the snapshot again"
    )]
    Size {
        /// The piece of state.
        piece: &'static str,
        /// Bytes in the saved state.
        found: usize,
        /// Bytes the struct has.
        expected: usize,
    },
    /// The target KVM refused an MSR and holds a different value for it, so the guest would
    /// see the MSR change across the move.
    #[error(
        "KVM_SET_MSRS refused MSR {index:#x} (saved {saved:#x}, the target vCPU has {t}): this \
         host cannot give the guest the value it had; restore on a host with the same CPU model",
        t = target.map_or_else(|| "no readable value".to_owned(), |v| format!("{v:#x}"))
    )]
    MsrRefused {
        /// The MSR.
        index: u32,
        /// Its saved value.
        saved: u64,
        /// The value the target vCPU holds, if it can read the MSR at all.
        target: Option<u64>,
    },
    /// A saved irqchip holds another chip than its place in the state says.
    #[error("the saved {piece} holds irqchip {found}: the state is corrupt")]
    WrongChip {
        /// The piece of state.
        piece: &'static str,
        /// The chip id found.
        found: u32,
    },
    /// The saved VM state was taken with the other irqchip than the VM is built with.
    #[error(
        "the saved VM state {} KVM's in-kernel PIC, IOAPIC and PIT but the VM has boot.irqchip \
         {irqchip:?}: restore with the spec the VM ran with",
        if *saved_in_kernel { "holds" } else { "holds no" }
    )]
    Irqchip {
        /// Whether the saved state holds the in-kernel chips.
        saved_in_kernel: bool,
        /// The VM's.
        irqchip: vmhost_config::Irqchip,
    },
    /// A list for KVM (MSRs, CPUID, XSAVE) is larger than KVM takes.
    #[error("the saved {piece} has {len} entries, more than KVM takes")]
    TooLong {
        /// The piece of state.
        piece: &'static str,
        /// Its entries.
        len: usize,
    },
}

/// `map_err` helper: an ioctl error on a piece of state.
fn ioctl(piece: &'static str, ioctl: &'static str) -> impl Fn(kvm_ioctls::Error) -> PersistError {
    move |source| PersistError::Ioctl {
        piece,
        ioctl,
        source,
    }
}
