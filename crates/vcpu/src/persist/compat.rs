//! Whether a saved vCPU can run on a target host: checked before the target VM is created.

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Cap, Kvm};

use super::{CpuidEntry, VcpuState};

/// A saved state the target host cannot run.
#[derive(Debug, thiserror::Error)]
pub enum CompatError {
    /// The guest's TSC ran at another frequency; this host cannot scale it (no
    /// `KVM_CAP_TSC_CONTROL` use yet), and a guest's TSC changing rate breaks its clocks.
    #[error(
        "the saved vCPU's TSC runs at {saved_khz} kHz, this host's at {target_khz} kHz: restore \
         on a host with the same TSC frequency"
    )]
    TscKhz {
        /// Saved `tsc_khz`.
        saved_khz: u32,
        /// The target's `KVM_GET_TSC_KHZ`.
        target_khz: u32,
    },
    /// The saved CPUID has feature bits the target KVM cannot give.
    #[error(
        "the saved vCPU's CPUID leaf {leaf:#x}.{subleaf} {reg} has features {missing:#010x} \
         this host's KVM does not support (KVM_GET_SUPPORTED_CPUID): restore on a host with \
         the same CPU model"
    )]
    CpuidFeature {
        /// Leaf.
        leaf: u32,
        /// Subleaf.
        subleaf: u32,
        /// The register ("eax", "ebx", "ecx" or "edx").
        reg: &'static str,
        /// The missing bits.
        missing: u32,
    },
    /// Probing the target failed.
    #[error("probing this host's KVM failed: {what}")]
    Probe {
        /// The ioctl.
        what: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// What a target host's KVM can give a vCPU.
#[derive(Debug, Clone)]
pub struct TargetCaps {
    /// The TSC frequency a vCPU gets (`KVM_GET_TSC_KHZ` of a probe vCPU).
    pub tsc_khz: u32,
    /// `KVM_GET_SUPPORTED_CPUID`.
    pub supported: Vec<CpuidEntry>,
    /// `KVM_CAP_TSC_DEADLINE_TIMER`: KVM emulates the TSC-deadline timer, which
    /// `KVM_GET_SUPPORTED_CPUID` does not list.
    pub tsc_deadline: bool,
}

/// The feature registers compared: (leaf, subleaf, register index, name).
const FEATURE_REGS: [(u32, u32, usize, &str); 9] = [
    (0x1, 0, 2, "ecx"),
    (0x1, 0, 3, "edx"),
    (0x7, 0, 1, "ebx"),
    (0x7, 0, 2, "ecx"),
    (0x7, 0, 3, "edx"),
    (0x7, 1, 0, "eax"),
    (0xd, 1, 0, "eax"),
    (0x8000_0001, 0, 2, "ecx"),
    (0x8000_0001, 0, 3, "edx"),
];

/// Leaf 1 ECX: TSC-deadline timer (bit 24) and hypervisor present (bit 31), which KVM gives
/// without listing them as supported.
const LEAF1_ECX_TSC_DEADLINE: u32 = 1 << 24;
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 EDX bit 28 (HTT): a topology bit the VMM sets for a package of several logical
/// CPUs (`arch::cpuid`), not a feature KVM supplies; `KVM_GET_SUPPORTED_CPUID` may leave it out.
const LEAF1_EDX_HTT: u32 = 1 << 28;

impl TargetCaps {
    /// Probes this host's KVM. Creates a throwaway VM and vCPU for `KVM_GET_TSC_KHZ`; the
    /// VM that will run the guest is created only after [`VcpuState::check_compatible`].
    pub fn probe(kvm: &Kvm) -> Result<Self, CompatError> {
        let probe = |what| move |source| CompatError::Probe { what, source };
        let supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(probe("KVM_GET_SUPPORTED_CPUID"))?;
        let vm = kvm.create_vm().map_err(probe("KVM_CREATE_VM"))?;
        let vcpu = vm.create_vcpu(0).map_err(probe("KVM_CREATE_VCPU"))?;
        let tsc_khz = vcpu.get_tsc_khz().map_err(probe("KVM_GET_TSC_KHZ"))?;
        Ok(Self {
            tsc_khz,
            supported: supported.as_slice().iter().map(CpuidEntry::from).collect(),
            tsc_deadline: kvm.check_extension(Cap::TscDeadlineTimer),
        })
    }
}

impl VcpuState {
    /// Refuses a state the target cannot run: a different TSC frequency, or CPUID feature
    /// bits (leaves 1, 7.0, 7.1, 0xd.1, 0x8000_0001) the target's KVM does not support.
    pub fn check_compatible(&self, target: &TargetCaps) -> Result<(), CompatError> {
        if self.tsc_khz != target.tsc_khz {
            return Err(CompatError::TscKhz {
                saved_khz: self.tsc_khz,
                target_khz: target.tsc_khz,
            });
        }
        for (leaf, subleaf, reg, name) in FEATURE_REGS {
            let find = |entries: &[CpuidEntry]| {
                entries
                    .iter()
                    .find(|e| e.function == leaf && e.index == subleaf)
                    .map_or(0, |e| e.regs[reg])
            };
            let mut allowed = find(&target.supported);
            if (leaf, reg) == (0x1, 3) {
                allowed |= LEAF1_EDX_HTT;
            }
            if (leaf, reg) == (0x1, 2) {
                allowed |= LEAF1_ECX_HYPERVISOR;
                if target.tsc_deadline {
                    allowed |= LEAF1_ECX_TSC_DEADLINE;
                }
            }
            let missing = find(&self.cpuid) & !allowed;
            if missing != 0 {
                return Err(CompatError::CpuidFeature {
                    leaf,
                    subleaf,
                    reg: name,
                    missing,
                });
            }
        }
        Ok(())
    }
}
