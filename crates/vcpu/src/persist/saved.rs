//! A whole VM's saved state ([`SavedVm`]): what [`crate::VmHandle::capture`] returns and
//! [`crate::Vm::restore`] loads, and [`check_target`], run on a target host before any VM is
//! created there. Guest RAM is not in it: it travels in its own per-cell files or streams.

use serde::{Deserialize, Serialize};

use super::{CompatError, TargetCaps, VcpuState, VmState};
use crate::payload::PayloadKind;

/// A Linux guest's device state: `vmhost-devices`' aggregate (virtio transports and devices,
/// COM1, the legacy ports), filled by `LinuxDevices::save`.
pub use vmhost_devices::persist::DevicesState;

/// Everything a built-in payload needs besides guest RAM to continue: the per-vCPU blocks of
/// its VMM-owned boot area (mailbox, ring-0 stack, ring-3 stack), which are not RAM. The
/// rest of the boot area (page tables, GDT, IDT, TSSs, code) is rebuilt from the plan on
/// restore, byte for byte the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedPayload {
    /// The payload that ran.
    pub kind: PayloadKind,
    /// vCPU `i`'s block (`arch::boot::VCPU_BLOCK` bytes: its mailbox page first), by index.
    pub vcpu_blocks: Vec<Vec<u8>>,
}

/// A paused VM's state, without its RAM. Plain serde data: the snapshot and migration formats
/// (`vmhost-persist`) carry it (record kind 16, as JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedVm {
    /// The VM's irqchip, PIT and kvmclock.
    pub vm: VmState,
    /// Every vCPU's state, by vCPU index (the plan's order).
    pub vcpus: Vec<VcpuState>,
    /// A built-in payload's boot area state; `None` for a Linux guest.
    pub payload: Option<SavedPayload>,
    /// A Linux guest's devices; `None` for a payload.
    pub devices: Option<DevicesState>,
}

impl SavedVm {
    /// The APIC ID of each saved vCPU, read from its saved LAPIC's ID register (xAPIC format:
    /// KVM gives an x2APIC ID in the top byte too unless `KVM_CAP_X2APIC_API` is enabled,
    /// which vmhost does not do).
    pub fn apic_ids(&self) -> Result<Vec<u32>, super::PersistError> {
        self.vcpus
            .iter()
            .map(|v| {
                let lapic = v.kvm_lapic()?;
                let id = &lapic.regs[0x20..0x24];
                let word = u32::from_le_bytes([
                    id[0].to_ne_bytes()[0],
                    id[1].to_ne_bytes()[0],
                    id[2].to_ne_bytes()[0],
                    id[3].to_ne_bytes()[0],
                ]);
                Ok(word >> 24)
            })
            .collect()
    }
}

/// Whether this host can run `saved`: its TSC frequency and CPUID features, vCPU by vCPU
/// ([`VcpuState::check_compatible`] against [`TargetCaps::probe`]). Run it before the target
/// VM is created; it opens `/dev/kvm` and creates only a throwaway probe VM.
pub fn check_target(saved: &SavedVm) -> Result<(), CompatError> {
    saved.check_compatible(&TargetCaps::of_this_host()?)
}

impl SavedVm {
    /// [`check_target`] against `caps` probed earlier (a migration target probes at the
    /// hello, so that no probe VM is created while the guest is paused).
    pub fn check_compatible(&self, caps: &TargetCaps) -> Result<(), CompatError> {
        self.vcpus.iter().try_for_each(|v| v.check_compatible(caps))
    }
}
