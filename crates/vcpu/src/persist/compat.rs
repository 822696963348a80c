//! Whether a saved vCPU can run on a target host: checked before the target VM is created.

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Cap, Kvm};

use super::{CpuidEntry, VcpuState};

/// A saved state the target host cannot run.
#[derive(Debug, thiserror::Error)]
pub enum CompatError {
    /// The guest's TSC ran at another frequency than this host's, further apart than this
    /// host's KVM takes without scaling (no `KVM_CAP_TSC_CONTROL`): a guest's TSC changing
    /// rate breaks its clocks.
    #[error(
        "the guest's TSC runs at {saved_khz} kHz, this host's at {target_khz} kHz ({ppm} ppm \
         apart): this host's KVM cannot scale a TSC (no KVM_CAP_TSC_CONTROL) and takes a rate \
         within {tolerance_ppm} ppm of its own only (kvm.tsc_tolerance_ppm): move the guest to \
         a host with TSC scaling or the same TSC frequency"
    )]
    TscKhz {
        /// The guest's `tsc_khz`.
        saved_khz: u32,
        /// The target's `KVM_GET_TSC_KHZ`.
        target_khz: u32,
        /// How far apart, in parts per million of the target's rate.
        ppm: u64,
        /// The target KVM's tolerance.
        tolerance_ppm: u32,
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
    /// `KVM_CAP_TSC_CONTROL`: KVM scales a vCPU's TSC to the rate `KVM_SET_TSC_KHZ` gives.
    pub tsc_scaling: bool,
    /// How far a rate set with `KVM_SET_TSC_KHZ` may be from the host's without scaling
    /// (`/sys/module/kvm/parameters/tsc_tolerance_ppm`; KVM's default when unreadable).
    pub tsc_tolerance_ppm: u32,
}

/// KVM's default `tsc_tolerance_ppm`.
pub const KVM_TSC_TOLERANCE_PPM: u32 = 250;

/// How a guest's TSC rate is kept on a target host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TscMatch {
    /// The target runs the same rate.
    Same,
    /// KVM scales the vCPUs' TSC to the guest's rate (`KVM_CAP_TSC_CONTROL`).
    Scaled,
    /// No scaling, and the rates are within KVM's tolerance: KVM takes the guest's rate and
    /// runs the host's; the guest's clock drifts by at most this much (parts per million),
    /// which NTP in the guest corrects (it slews up to 500 ppm).
    WithinTolerance {
        /// How far apart, in parts per million of the target's rate.
        ppm: u64,
    },
}

impl std::fmt::Display for TscMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TscMatch::Same => write!(f, "the same rate"),
            TscMatch::Scaled => write!(f, "scaled by KVM (KVM_CAP_TSC_CONTROL)"),
            TscMatch::WithinTolerance { ppm } => write!(
                f,
                "{ppm} ppm apart, within KVM's tolerance (no TSC scaling here): the guest's \
                 clock may drift by that much until NTP corrects it"
            ),
        }
    }
}

/// Whether a guest whose TSC ran at `saved_khz` can run on a host with `caps`, and how.
pub fn tsc_match(saved_khz: u32, caps: &TargetCaps) -> Result<TscMatch, CompatError> {
    if saved_khz == caps.tsc_khz {
        return Ok(TscMatch::Same);
    }
    if caps.tsc_scaling {
        return Ok(TscMatch::Scaled);
    }
    let diff = u64::from(saved_khz.abs_diff(caps.tsc_khz));
    // Rounded up: 250.4 ppm is beyond a 250 ppm tolerance.
    let ppm = (diff * 1_000_000).div_ceil(u64::from(caps.tsc_khz.max(1)));
    if ppm <= u64::from(caps.tsc_tolerance_ppm) {
        Ok(TscMatch::WithinTolerance { ppm })
    } else {
        Err(CompatError::TscKhz {
            saved_khz,
            target_khz: caps.tsc_khz,
            ppm,
            tolerance_ppm: caps.tsc_tolerance_ppm,
        })
    }
}

/// KVM's `tsc_tolerance_ppm` module parameter, or its default.
fn tsc_tolerance_ppm() -> u32 {
    std::fs::read_to_string("/sys/module/kvm/parameters/tsc_tolerance_ppm")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(KVM_TSC_TOLERANCE_PPM)
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
    /// The throwaway VM is closed on a thread of its own (`vmhost-probe-end`): its teardown
    /// (the VM's worker thread, SRCU grace periods) took 33–55 ms in the emulated host,
    /// against 24–46 ms to create it, and none of it need hold the caller back.
    pub fn probe(kvm: &Kvm) -> Result<Self, CompatError> {
        let probe = |what| move |source| CompatError::Probe { what, source };
        let supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(probe("KVM_GET_SUPPORTED_CPUID"))?;
        let vm = kvm.create_vm().map_err(probe("KVM_CREATE_VM"))?;
        let vcpu = vm.create_vcpu(0).map_err(probe("KVM_CREATE_VCPU"))?;
        let tsc_khz = vcpu.get_tsc_khz().map_err(probe("KVM_GET_TSC_KHZ"))?;
        // A thread that cannot start drops its closure, and so the VM, here.
        let _ = std::thread::Builder::new()
            .name("vmhost-probe-end".into())
            .spawn(move || drop((vcpu, vm)));
        Ok(Self {
            tsc_khz,
            supported: supported.as_slice().iter().map(CpuidEntry::from).collect(),
            tsc_deadline: kvm.check_extension(Cap::TscDeadlineTimer),
            tsc_scaling: kvm.check_extension(Cap::TscControl),
            tsc_tolerance_ppm: tsc_tolerance_ppm(),
        })
    }

    /// [`TargetCaps::probe`] of this host's `/dev/kvm`.
    pub fn of_this_host() -> Result<Self, CompatError> {
        let kvm = Kvm::new().map_err(|source| CompatError::Probe {
            what: "opening /dev/kvm",
            source,
        })?;
        Self::probe(&kvm)
    }
}

impl VcpuState {
    /// Refuses a state the target cannot run: a TSC rate it can neither scale to nor take
    /// within its tolerance ([`tsc_match`]), or CPUID feature bits (leaves 1, 7.0, 7.1,
    /// 0xd.1, 0x8000_0001) the target's KVM does not support.
    pub fn check_compatible(&self, target: &TargetCaps) -> Result<(), CompatError> {
        tsc_match(self.tsc_khz, target)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(khz: u32, scaling: bool) -> TargetCaps {
        TargetCaps {
            tsc_khz: khz,
            supported: Vec::new(),
            tsc_deadline: false,
            tsc_scaling: scaling,
            tsc_tolerance_ppm: KVM_TSC_TOLERANCE_PPM,
        }
    }

    #[test]
    fn the_tsc_rule_same_scaled_within_and_beyond_kvms_tolerance() {
        let host = caps(2_000_000, false);
        assert_eq!(tsc_match(2_000_000, &host).unwrap(), TscMatch::Same);
        // 250 ppm of 2 GHz is 500 kHz: the boundary is taken, one kHz further is not.
        assert_eq!(
            tsc_match(2_000_500, &host).unwrap(),
            TscMatch::WithinTolerance { ppm: 250 }
        );
        assert_eq!(
            tsc_match(1_999_500, &host).unwrap(),
            TscMatch::WithinTolerance { ppm: 250 }
        );
        let err = tsc_match(2_000_501, &host).unwrap_err();
        assert!(
            matches!(
                err,
                CompatError::TscKhz {
                    saved_khz: 2_000_501,
                    target_khz: 2_000_000,
                    ppm: 251,
                    tolerance_ppm: 250
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("251 ppm"), "{err}");
        // With KVM_CAP_TSC_CONTROL any rate is scaled.
        assert_eq!(
            tsc_match(3_000_000, &caps(2_000_000, true)).unwrap(),
            TscMatch::Scaled
        );
        // An administrator's wider tolerance is honoured.
        let wide = TargetCaps {
            tsc_tolerance_ppm: 1000,
            ..host
        };
        assert!(matches!(
            tsc_match(2_002_000, &wide),
            Ok(TscMatch::WithinTolerance { ppm: 1000 })
        ));
    }
}
