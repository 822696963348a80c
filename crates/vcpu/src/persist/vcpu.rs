//! One vCPU's state: capture from and restore into a `VcpuFd`, in the orders Firecracker and
//! Cloud Hypervisor document (see [`VcpuState::save`] and [`VcpuState::restore`]).

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use super::raw::{from_bytes, to_bytes};
use super::{ioctl, PersistError};
use crate::sys;

/// `IA32_TSC`.
pub const MSR_IA32_TSC: u32 = 0x10;
/// `IA32_TSC_DEADLINE`: restored after `IA32_TSC` and after the LAPIC, or the armed timer is
/// lost (KVM reads the LAPIC's timer mode and the TSC to arm it).
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// MSRs saved on top of `KVM_GET_MSR_INDEX_LIST`, which leaves out the MTRRs and PAT that a
/// guest (and vmhost's own boot state, `arch::msrs`) sets: PAT, the MTRR default type, the
/// variable ranges 0x200-0x20f and the fixed ranges.
fn extra_msrs() -> impl Iterator<Item = u32> {
    [0x277, 0x2ff, 0x250, 0x258, 0x259]
        .into_iter()
        .chain(0x200..=0x20f)
        .chain(0x268..=0x26f)
}

/// What a VM's vCPUs save, probed once per VM: the MSRs to try and the XSAVE buffer size.
#[derive(Debug, Clone)]
pub struct VcpuStateLayout {
    /// The MSRs tried on save, ascending (so `IA32_TSC` comes before `IA32_TSC_DEADLINE`).
    pub msrs: Vec<u32>,
    /// `KVM_CHECK_EXTENSION(KVM_CAP_XSAVE2)`: bytes of XSAVE state; 0 without XSAVE2.
    pub xsave_bytes: usize,
}

impl VcpuStateLayout {
    /// Probes `kvm` and `vm` (an ordinary VM: XSAVE2's size is per VM).
    pub fn probe(kvm: &Kvm, vm: &VmFd) -> Result<Self, PersistError> {
        let list = kvm
            .get_msr_index_list()
            .map_err(ioctl("MSR list", "KVM_GET_MSR_INDEX_LIST"))?;
        let mut msrs: Vec<u32> = list
            .as_slice()
            .iter()
            .copied()
            .chain(extra_msrs())
            .collect();
        msrs.sort_unstable();
        msrs.dedup();
        let xsave_bytes = usize::try_from(vm.check_extension_int(Cap::Xsave2)).unwrap_or(0);
        Ok(Self { msrs, xsave_bytes })
    }

    /// Extra 32-bit words past the legacy 4 KiB `kvm_xsave` region.
    fn xsave_extra_words(&self) -> usize {
        self.xsave_bytes
            .saturating_sub(std::mem::size_of::<kvm_xsave>())
            .div_ceil(std::mem::size_of::<u32>())
    }
}

/// One MSR and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsrEntry {
    /// The MSR's index.
    pub index: u32,
    /// Its value.
    pub data: u64,
}

/// One CPUID leaf as the vCPU was given it (`KVM_SET_CPUID2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuidEntry {
    /// Leaf (EAX in).
    pub function: u32,
    /// Subleaf (ECX in).
    pub index: u32,
    /// KVM's `KVM_CPUID_FLAG_*`.
    pub flags: u32,
    /// EAX, EBX, ECX, EDX out.
    pub regs: [u32; 4],
}

/// One vCPU's complete state. Raw KVM structs are held as their bytes (see `persist`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuState {
    /// The CPUID the VMM gave the vCPU, restored first.
    pub cpuid: Vec<CpuidEntry>,
    /// `kvm_regs`.
    pub regs: Vec<u8>,
    /// `kvm_sregs`.
    pub sregs: Vec<u8>,
    /// The `kvm_xsave` region followed by any XSAVE2 words past it.
    pub xsave: Vec<u8>,
    /// `kvm_xcrs`.
    pub xcrs: Vec<u8>,
    /// `kvm_debugregs`.
    pub debug_regs: Vec<u8>,
    /// `kvm_lapic_state` (needs the in-kernel irqchip).
    pub lapic: Vec<u8>,
    /// The MSRs KVM could read, ascending by index.
    pub msrs: Vec<MsrEntry>,
    /// `kvm_vcpu_events`: pending exceptions, interrupts, NMIs, SMM.
    pub events: Vec<u8>,
    /// `KVM_MP_STATE_*`.
    pub mp_state: u32,
    /// `KVM_GET_TSC_KHZ`: the guest's TSC frequency.
    pub tsc_khz: u32,
}

impl VcpuState {
    /// Captures `fd`'s state. The VM's vCPUs must all be out of `KVM_RUN` (see `persist`).
    ///
    /// `cpuid` is the CPUID the VMM gave the vCPU with `KVM_SET_CPUID2`. It is taken from the
    /// caller, not read back with `KVM_GET_CPUID2`: on a nested KVM (these hosts) that returns
    /// the host's raw leaves rather than what was set.
    ///
    /// Order (Firecracker's): MP state first, since `KVM_GET_MP_STATE` lets the LAPIC accept
    /// pending INIT/SIPI events and may change state read later; the vCPU events last, since
    /// the other GETs may still move a pending event into them.
    pub fn save(
        fd: &VcpuFd,
        layout: &VcpuStateLayout,
        cpuid: &CpuId,
    ) -> Result<Self, PersistError> {
        let mp_state = fd
            .get_mp_state()
            .map_err(ioctl("MP state", "KVM_GET_MP_STATE"))?
            .mp_state;
        let regs = fd.get_regs().map_err(ioctl("registers", "KVM_GET_REGS"))?;
        let sregs = fd
            .get_sregs()
            .map_err(ioctl("special registers", "KVM_GET_SREGS"))?;
        let xsave = save_xsave(fd, layout)?;
        let xcrs = fd.get_xcrs().map_err(ioctl("XCRs", "KVM_GET_XCRS"))?;
        let debug_regs = fd
            .get_debug_regs()
            .map_err(ioctl("debug registers", "KVM_GET_DEBUGREGS"))?;
        let lapic = fd.get_lapic().map_err(ioctl("LAPIC", "KVM_GET_LAPIC"))?;
        let tsc_khz = fd
            .get_tsc_khz()
            .map_err(ioctl("TSC frequency", "KVM_GET_TSC_KHZ"))?;
        let msrs = read_msrs(fd, &layout.msrs)?;
        let events = fd
            .get_vcpu_events()
            .map_err(ioctl("vCPU events", "KVM_GET_VCPU_EVENTS"))?;
        Ok(Self {
            cpuid: cpuid.as_slice().iter().map(CpuidEntry::from).collect(),
            regs: to_bytes(&regs),
            sregs: to_bytes(&sregs),
            xsave,
            xcrs: to_bytes(&xcrs),
            debug_regs: to_bytes(&debug_regs),
            lapic: to_bytes(&lapic),
            msrs,
            events: to_bytes(&events),
            mp_state,
            tsc_khz,
        })
    }

    /// Loads the state into `fd`, a fresh vCPU of a VM with the in-kernel irqchip whose
    /// [`VmState`](super::VmState) is restored already.
    ///
    /// Order: CPUID first (KVM checks later state against it); registers, then special
    /// registers (which carry the APIC base), XSAVE (the FPU and SSE state included), XCRs and debug registers; the LAPIC
    /// after the special registers; the MSRs after the LAPIC (`IA32_TSC_DEADLINE` arms only
    /// in a LAPIC in TSC-deadline mode, and after `IA32_TSC`); the vCPU events after the
    /// registers (`KVM_SET_REGS` drops a pending exception); the MP state last
    /// (`KVM_SET_MP_STATE` checks a latched INIT against the SMM state the events restore).
    pub fn restore(&self, fd: &VcpuFd, layout: &VcpuStateLayout) -> Result<(), PersistError> {
        // The TSC rate first: KVM converts the `IA32_TSC` the MSRs restore at it. A rate
        // other than this host's is scaled (`KVM_CAP_TSC_CONTROL`) or, within KVM's
        // tolerance, taken as is (`tsc_match` refused anything else before the VM existed).
        let host_khz = fd
            .get_tsc_khz()
            .map_err(ioctl("TSC rate", "KVM_GET_TSC_KHZ"))?;
        if self.tsc_khz != 0 && self.tsc_khz != host_khz {
            fd.set_tsc_khz(self.tsc_khz)
                .map_err(ioctl("TSC rate", "KVM_SET_TSC_KHZ"))?;
        }
        let cpuid = self.kvm_cpuid()?;
        fd.set_cpuid2(&cpuid)
            .map_err(ioctl("CPUID", "KVM_SET_CPUID2"))?;
        fd.set_regs(&from_bytes::<kvm_regs>("registers", &self.regs)?)
            .map_err(ioctl("registers", "KVM_SET_REGS"))?;
        fd.set_sregs(&from_bytes::<kvm_sregs>("special registers", &self.sregs)?)
            .map_err(ioctl("special registers", "KVM_SET_SREGS"))?;
        restore_xsave(fd, layout, &self.xsave)?;
        fd.set_xcrs(&from_bytes::<kvm_xcrs>("XCRs", &self.xcrs)?)
            .map_err(ioctl("XCRs", "KVM_SET_XCRS"))?;
        fd.set_debug_regs(&from_bytes::<kvm_debugregs>(
            "debug registers",
            &self.debug_regs,
        )?)
        .map_err(ioctl("debug registers", "KVM_SET_DEBUGREGS"))?;
        fd.set_lapic(&from_bytes::<kvm_lapic_state>("LAPIC", &self.lapic)?)
            .map_err(ioctl("LAPIC", "KVM_SET_LAPIC"))?;
        write_msrs(fd, &self.msrs)?;
        fd.set_vcpu_events(&from_bytes::<kvm_vcpu_events>("vCPU events", &self.events)?)
            .map_err(ioctl("vCPU events", "KVM_SET_VCPU_EVENTS"))?;
        fd.set_mp_state(kvm_mp_state {
            mp_state: self.mp_state,
        })
        .map_err(ioctl("MP state", "KVM_SET_MP_STATE"))?;
        Ok(())
    }

    /// A saved MSR's value.
    pub fn msr(&self, index: u32) -> Option<u64> {
        self.msrs.iter().find(|m| m.index == index).map(|m| m.data)
    }

    /// The saved general-purpose registers.
    pub fn kvm_regs(&self) -> Result<kvm_regs, PersistError> {
        from_bytes("registers", &self.regs)
    }

    /// The saved LAPIC registers.
    pub fn kvm_lapic(&self) -> Result<kvm_lapic_state, PersistError> {
        from_bytes("LAPIC", &self.lapic)
    }

    pub(crate) fn kvm_cpuid(&self) -> Result<CpuId, PersistError> {
        let entries: Vec<kvm_cpuid_entry2> = self.cpuid.iter().map(|e| e.to_kvm()).collect();
        CpuId::from_entries(&entries).map_err(|_| PersistError::TooLong {
            piece: "CPUID",
            len: entries.len(),
        })
    }
}

impl From<&kvm_cpuid_entry2> for CpuidEntry {
    fn from(e: &kvm_cpuid_entry2) -> Self {
        Self {
            function: e.function,
            index: e.index,
            flags: e.flags,
            regs: [e.eax, e.ebx, e.ecx, e.edx],
        }
    }
}

impl CpuidEntry {
    fn to_kvm(self) -> kvm_cpuid_entry2 {
        let [eax, ebx, ecx, edx] = self.regs;
        kvm_cpuid_entry2 {
            function: self.function,
            index: self.index,
            flags: self.flags,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }
}

fn save_xsave(fd: &VcpuFd, layout: &VcpuStateLayout) -> Result<Vec<u8>, PersistError> {
    if layout.xsave_bytes <= std::mem::size_of::<kvm_xsave>() {
        let x = fd.get_xsave().map_err(ioctl("XSAVE", "KVM_GET_XSAVE"))?;
        return Ok(to_bytes(&x));
    }
    let x = sys::get_xsave2(fd, layout.xsave_extra_words())
        .map_err(ioctl("XSAVE", "KVM_GET_XSAVE2"))?;
    let fam = x.as_fam_struct_ref();
    let mut bytes = to_bytes(&fam.xsave);
    bytes.extend(x.as_slice().iter().flat_map(|w| w.to_ne_bytes()));
    Ok(bytes)
}

/// Restores XSAVE through the XSAVE2-sized buffer, padded with zeros up to the target VM's
/// size: components past the saved length are then in their initial state (their XSTATE_BV
/// bits are clear in a state saved by a VM that had no room for them).
fn restore_xsave(fd: &VcpuFd, layout: &VcpuStateLayout, saved: &[u8]) -> Result<(), PersistError> {
    let legacy = std::mem::size_of::<kvm_xsave>();
    let (head, tail) = saved.split_at(legacy.min(saved.len()));
    let region = from_bytes::<kvm_xsave>("XSAVE", head)?;
    if tail.len() % 4 != 0 {
        return Err(PersistError::Size {
            piece: "XSAVE",
            found: saved.len(),
            expected: legacy + tail.len().next_multiple_of(4),
        });
    }
    let mut words: Vec<u32> = tail
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    words.resize(words.len().max(layout.xsave_extra_words()), 0);
    sys::set_xsave2(fd, region, &words, layout.xsave_bytes).map_err(ioctl("XSAVE", "KVM_SET_XSAVE"))
}

/// Reads `indices` in chunks KVM takes. `KVM_GET_MSRS` stops at the first MSR it cannot read
/// and returns how many it read: that MSR is left out (this vCPU model does not have it) and
/// the read goes on after it.
fn read_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<MsrEntry>, PersistError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let mut msrs = msr_list(chunk.iter().map(|&index| (index, 0)))?;
        let read = fd
            .get_msrs(&mut msrs)
            .map_err(ioctl("MSRs", "KVM_GET_MSRS"))?;
        out.extend(msrs.as_slice()[..read].iter().map(|e| MsrEntry {
            index: e.index,
            data: e.data,
        }));
        if let Some(skipped) = chunk.get(read) {
            tracing::debug!(
                msr = format_args!("{skipped:#x}"),
                "MSR not readable; not saved"
            );
            rest = &rest[read + 1..];
        } else {
            rest = &rest[read..];
        }
    }
    Ok(out)
}

/// Writes the saved MSRs in their order. An MSR KVM refuses is accepted only when the target
/// vCPU already holds the saved value: host-determined, read-only MSRs such as
/// `IA32_ARCH_CAPABILITIES` (0x10a, listed but not settable on some hosts) then need no
/// write; a refused MSR with another value is [`PersistError::MsrRefused`].
fn write_msrs(fd: &VcpuFd, saved: &[MsrEntry]) -> Result<(), PersistError> {
    let mut rest = saved;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let msrs = msr_list(chunk.iter().map(|m| (m.index, m.data)))?;
        let written = fd.set_msrs(&msrs).map_err(ioctl("MSRs", "KVM_SET_MSRS"))?;
        let Some(refused) = chunk.get(written) else {
            rest = &rest[written..];
            continue;
        };
        let target = read_msrs(fd, &[refused.index])?.first().map(|m| m.data);
        if target != Some(refused.data) {
            return Err(PersistError::MsrRefused {
                index: refused.index,
                saved: refused.data,
                target,
            });
        }
        tracing::debug!(
            msr = format_args!("{:#x}", refused.index),
            "read-only MSR matches"
        );
        rest = &rest[written + 1..];
    }
    Ok(())
}

fn msr_list(entries: impl Iterator<Item = (u32, u64)>) -> Result<Msrs, PersistError> {
    let entries: Vec<kvm_msr_entry> = entries
        .map(|(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    Msrs::from_entries(&entries).map_err(|_| PersistError::TooLong {
        piece: "MSRs",
        len: entries.len(),
    })
}
