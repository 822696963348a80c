//! Per-vCPU CPUID, built from KVM's supported set.
//!
//! Each vCPU gets its APIC ID and topology leaves describing the spec's sockets × cores ×
//! threads, with x86's APIC ID field widths (thread bits = ⌈log2 threads⌉, core bits =
//! ⌈log2 cores⌉, the same arithmetic the planner used for `apic_id`): leaf 0x1, 0x4/0xB/0x1F on
//! Intel, 0xB/0x8000_0008/0x8000_001D/0x8000_001E on AMD. Feature bits the host itself lacks are
//! masked, and the KVM "realtime" hint (exclusive vCPU PUs) is set in leaf 0x4000_0001 EDX.
//!
//! On this nested host `cpuid` in guest ring 3 returns the host's raw values: only ring 0 sees
//! what is set here, so the guest reads these leaves in its ring-0 prologue.

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX};
use serde::Serialize;
use vmhost_config::CpuTopology;
use vmhost_plan::VcpuPlacement;

use super::pv;

/// `KVM_HINTS_REALTIME`: bit 0 of leaf 0x4000_0001 EDX (vCPUs never preempted).
pub const KVM_HINTS_REALTIME: u32 = 1;

/// Why a vCPU's CPUID cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum CpuidError {
    /// An entry could not be added to the CPUID list.
    #[error("vCPU {vcpu}: cannot add CPUID leaf {leaf:#x}.{subleaf} (the list is full)")]
    Push {
        /// vCPU index.
        vcpu: u32,
        /// Leaf.
        leaf: u32,
        /// Subleaf.
        subleaf: u32,
    },
    /// The APIC ID does not fit the topology's field widths.
    #[error("vCPU {vcpu}: APIC ID {apic_id:#x} is not socket {socket} core {core} thread {thread} of {topology:?}")]
    ApicId {
        /// vCPU index.
        vcpu: u32,
        /// Its APIC ID.
        apic_id: u32,
        /// Socket.
        socket: u32,
        /// Core.
        core: u32,
        /// Thread.
        thread: u32,
        /// Guest topology.
        topology: CpuTopology,
    },
}

/// CPU vendor, from leaf 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Vendor {
    /// GenuineIntel.
    Intel,
    /// AuthenticAMD or HygonGenuine.
    Amd,
    /// Anything else: only the common leaves are set.
    Other,
}

/// One CPUID result as the guest saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CpuidResult {
    /// Leaf (EAX in).
    pub leaf: u32,
    /// Subleaf (ECX in).
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

/// APIC ID field widths of a topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApicWidths {
    /// Bits of the thread field.
    pub thread_bits: u32,
    /// Bits of the core field.
    pub core_bits: u32,
}

impl ApicWidths {
    /// ⌈log2 threads⌉ and ⌈log2 cores⌉.
    pub fn of(t: &CpuTopology) -> Self {
        let bits = |n: u32| n.max(1).next_power_of_two().trailing_zeros();
        ApicWidths {
            thread_bits: bits(t.threads),
            core_bits: bits(t.cores),
        }
    }

    /// Bits below the package field.
    pub fn package_shift(&self) -> u32 {
        self.thread_bits + self.core_bits
    }

    /// The APIC ID of (socket, core, thread).
    pub fn apic_id(&self, socket: u32, core: u32, thread: u32) -> u32 {
        (socket << self.package_shift()) | (core << self.thread_bits) | thread
    }
}

/// The vendor named by leaf 0 of `cpuid`.
pub fn vendor(cpuid: &CpuId) -> Vendor {
    let Some(e) = cpuid.as_slice().iter().find(|e| e.function == 0) else {
        return Vendor::Other;
    };
    let mut name = [0u8; 12];
    name[..4].copy_from_slice(&e.ebx.to_le_bytes());
    name[4..8].copy_from_slice(&e.edx.to_le_bytes());
    name[8..].copy_from_slice(&e.ecx.to_le_bytes());
    match &name {
        b"GenuineIntel" => Vendor::Intel,
        b"AuthenticAMD" | b"HygonGenuine" => Vendor::Amd,
        _ => Vendor::Other,
    }
}

/// The host's raw CPUID (what the process itself sees).
pub fn host_cpuid(leaf: u32, subleaf: u32) -> [u32; 4] {
    // SAFETY: every x86_64 CPU implements `cpuid`; the intrinsic only reads registers. (It is a
    // safe function on newer compilers, hence the allow.)
    #[allow(unused_unsafe)]
    let r = unsafe { std::arch::x86_64::__cpuid_count(leaf, subleaf) };
    [r.eax, r.ebx, r.ecx, r.edx]
}

/// Everything a vCPU's CPUID depends on besides KVM's supported set.
#[derive(Debug, Clone, Copy)]
pub struct CpuidInputs<'a> {
    /// Guest topology.
    pub topology: CpuTopology,
    /// The vCPU's placement (APIC ID, socket, core, thread).
    pub vcpu: &'a VcpuPlacement,
    /// Set the KVM realtime hint: only when the vCPU PUs are exclusive
    /// ([`vmhost_plan::Plan::vcpu_pus_exclusive`]).
    pub realtime_hint: bool,
}

/// Builds vCPU `inputs.vcpu`'s CPUID from `supported` (KVM_GET_SUPPORTED_CPUID), masking
/// features that `host` (raw CPUID of the host) lacks.
pub fn vcpu_cpuid(
    supported: &CpuId,
    inputs: &CpuidInputs<'_>,
    host: &dyn Fn(u32, u32) -> [u32; 4],
) -> Result<CpuId, CpuidError> {
    let v = inputs.vcpu;
    let t = inputs.topology;
    let w = ApicWidths::of(&t);
    if w.apic_id(v.socket, v.core, v.thread) != v.apic_id {
        return Err(CpuidError::ApicId {
            vcpu: v.vcpu,
            apic_id: v.apic_id,
            socket: v.socket,
            core: v.core,
            thread: v.thread,
            topology: t,
        });
    }
    let vendor = vendor(supported);
    let mut entries: Vec<kvm_cpuid_entry2> = supported.as_slice().to_vec();
    mask_host_features(&mut entries, host);
    pv::mark_hypervisor(&mut entries);
    pv::normalize_xsave(&mut entries);
    let logical = t.cores * t.threads;
    for e in entries.iter_mut() {
        match e.function {
            0x1 => {
                let addressable = (1u32 << w.package_shift()).min(255);
                e.ebx = (e.ebx & 0xffff) | (addressable << 16) | ((v.apic_id & 0xff) << 24);
                e.edx = if addressable > 1 {
                    e.edx | 1 << 28
                } else {
                    e.edx & !(1 << 28)
                };
            }
            0x4 if vendor == Vendor::Intel => intel_cache_sharing(e, w),
            0x8000_0008 if vendor == Vendor::Amd => {
                e.ecx = (e.ecx & !0xf0ff) | (w.package_shift() << 12) | ((logical - 1) & 0xff);
            }
            0x8000_001D if vendor == Vendor::Amd && e.eax & 0x1f != 0 => {
                let level = (e.eax >> 5) & 7;
                let sharing = if level <= 2 { t.threads } else { logical };
                e.eax = (e.eax & !(0xfff << 14)) | (((sharing - 1) & 0xfff) << 14);
            }
            0x8000_001E if vendor == Vendor::Amd => {
                e.eax = v.apic_id;
                e.ebx = ((t.threads - 1) << 8) | (v.core & 0xff);
                e.ecx = v.socket & 0xff;
                e.edx = 0;
            }
            0x4000_0001 => {
                e.edx = if inputs.realtime_hint {
                    e.edx | KVM_HINTS_REALTIME
                } else {
                    e.edx & !KVM_HINTS_REALTIME
                };
            }
            _ => {}
        }
    }
    for leaf in [0xB, 0x1F] {
        let present = entries.iter().any(|e| e.function == leaf);
        if present && (leaf == 0xB || vendor == Vendor::Intel) {
            entries.retain(|e| e.function != leaf);
            entries.extend(extended_topology(leaf, &t, w, v.apic_id));
        }
    }
    to_cpuid(v.vcpu, entries)
}

/// A `CpuId` holding `entries`.
fn to_cpuid(vcpu: u32, entries: Vec<kvm_cpuid_entry2>) -> Result<CpuId, CpuidError> {
    let mut out = CpuId::new(0).map_err(|_| CpuidError::Push {
        vcpu,
        leaf: 0,
        subleaf: 0,
    })?;
    for e in entries {
        out.push(e).map_err(|_| CpuidError::Push {
            vcpu,
            leaf: e.function,
            subleaf: e.index,
        })?;
    }
    Ok(out)
}

/// Leaf 1 ECX bit 24: the local APIC timer's TSC-deadline mode.
pub const TSC_DEADLINE_BIT: u32 = 1 << 24;

/// Sets the TSC-deadline bit in leaf 1 of `cpuid` (KVM has `KVM_CAP_TSC_DEADLINE_TIMER`).
pub fn offer_tsc_deadline(cpuid: &mut CpuId) {
    for e in cpuid.as_mut_slice().iter_mut().filter(|e| e.function == 1) {
        e.ecx |= TSC_DEADLINE_BIT;
    }
}

/// Leaf 0xD made to agree again with the features left in `cpuid` (after a mask such as
/// [`super::mask_for_nested_emulation`]).
pub fn renormalize_xsave(vcpu: u32, cpuid: &CpuId) -> Result<CpuId, CpuidError> {
    let mut entries = cpuid.as_slice().to_vec();
    pv::normalize_xsave(&mut entries);
    to_cpuid(vcpu, entries)
}

/// `cpuid` with the timing leaf 0x4000_0010 giving `tsc_khz` (see [`pv`]).
pub fn with_tsc_khz(vcpu: u32, cpuid: &CpuId, tsc_khz: u32) -> Result<CpuId, CpuidError> {
    let mut entries = cpuid.as_slice().to_vec();
    pv::set_timing_leaf(&mut entries, tsc_khz);
    to_cpuid(vcpu, entries)
}

fn intel_cache_sharing(e: &mut kvm_cpuid_entry2, w: ApicWidths) {
    if e.eax & 0x1f == 0 {
        return;
    }
    let level = (e.eax >> 5) & 7;
    let sharing_bits = if level <= 2 {
        w.thread_bits
    } else {
        w.package_shift()
    };
    let cores_field = ((1u32 << w.core_bits) - 1) & 0x3f;
    let sharing_field = ((1u32 << sharing_bits) - 1) & 0xfff;
    e.eax = (e.eax & 0x3fff) | (sharing_field << 14) | (cores_field << 26);
}

/// Leaf 0xB / 0x1F: SMT level, core level, then the invalid terminator.
fn extended_topology(
    leaf: u32,
    t: &CpuTopology,
    w: ApicWidths,
    apic_id: u32,
) -> [kvm_cpuid_entry2; 3] {
    let entry = |index: u32, eax: u32, ebx: u32, level_type: u32| kvm_cpuid_entry2 {
        function: leaf,
        index,
        flags: KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
        eax,
        ebx,
        ecx: (level_type << 8) | index,
        edx: apic_id,
        ..Default::default()
    };
    [
        entry(0, w.thread_bits, t.threads, 1),
        entry(1, w.package_shift(), t.threads * t.cores, 2),
        entry(2, 0, 0, 0),
    ]
}

/// Bits KVM provides whether or not the host CPU has them (emulated or paravirtual).
fn kvm_provided(leaf: u32, reg: usize) -> u32 {
    match (leaf, reg) {
        // ECX: x2APIC (21), TSC deadline (24), hypervisor (31).
        (0x1, 2) => (1 << 21) | (1 << 24) | (1 << 31),
        _ => 0,
    }
}

/// ANDs the feature leaves with the host's raw CPUID, keeping what KVM itself provides.
fn mask_host_features(entries: &mut [kvm_cpuid_entry2], host: &dyn Fn(u32, u32) -> [u32; 4]) {
    const FEATURE_LEAVES: [(u32, u32, &[usize]); 3] = [
        (0x1, 0, &[2, 3]),
        (0x7, 0, &[1, 2, 3]),
        (0x8000_0001, 0, &[2, 3]),
    ];
    for (leaf, sub, regs) in FEATURE_LEAVES {
        let Some(e) = entries
            .iter_mut()
            .find(|e| e.function == leaf && e.index == sub)
        else {
            continue;
        };
        let h = host(leaf, sub);
        for &r in regs {
            let reg = match r {
                1 => &mut e.ebx,
                2 => &mut e.ecx,
                _ => &mut e.edx,
            };
            *reg &= h[r] | kvm_provided(leaf, r);
        }
    }
}

/// The (leaf, subleaf) pairs the guest reads in ring 0 and reports, for what `cpuid` holds.
pub fn reported_leaves(cpuid: &CpuId) -> Vec<(u32, u32)> {
    let mut want: Vec<(u32, u32)> = vec![(0, 0), (1, 0), (0xB, 0), (0xB, 1), (0xB, 2)];
    match vendor(cpuid) {
        Vendor::Intel => {
            want.extend((0..4).map(|s| (4, s)));
            want.extend((0..3).map(|s| (0x1F, s)));
        }
        Vendor::Amd => want.extend([(0x8000_0001, 0), (0x8000_0008, 0), (0x8000_001E, 0)]),
        Vendor::Other => {}
    }
    want.extend([(0x4000_0000, 0), (0x4000_0001, 0)]);
    let has = |leaf: u32, sub: u32| {
        cpuid.as_slice().iter().any(|e| {
            e.function == leaf && (e.index == sub || e.flags & KVM_CPUID_FLAG_SIGNIFCANT_INDEX == 0)
        })
    };
    want.into_iter().filter(|&(l, s)| has(l, s)).collect()
}

/// The topology a guest derives from the CPUID leaves it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DecodedTopology {
    /// x2APIC ID (leaf 0xB EDX, else 0x8000_001E EAX, else leaf 1 EBX bits 31:24).
    pub apic_id: u32,
    /// Logical processors per core.
    pub threads_per_core: u32,
    /// Logical processors per package.
    pub logical_per_package: u32,
    /// Package (socket) number.
    pub package: u32,
    /// Core number within the package.
    pub core: u32,
    /// Thread number within the core.
    pub thread: u32,
    /// The KVM realtime hint is set.
    pub realtime_hint: bool,
}

/// Decodes what a guest would conclude from `results`; `None` when no topology leaf is there.
pub fn decode_topology(results: &[CpuidResult]) -> Option<DecodedTopology> {
    let get = |leaf: u32, sub: u32| results.iter().find(|r| r.leaf == leaf && r.subleaf == sub);
    let realtime_hint = get(0x4000_0001, 0).is_some_and(|r| r.edx & KVM_HINTS_REALTIME != 0);
    let leaf1 = get(1, 0)?;
    let (apic_id, smt_shift, pkg_shift, threads_per_core, logical) = if let (Some(s0), Some(s1)) =
        (get(0xB, 0), get(0xB, 1)).filter_pair(|a, b| a.ebx != 0 && b.ebx != 0)
    {
        (
            s0.edx,
            s0.eax & 0x1f,
            s1.eax & 0x1f,
            s0.ebx & 0xffff,
            s1.ebx & 0xffff,
        )
    } else if let (Some(n8), Some(n1e)) = (get(0x8000_0008, 0), get(0x8000_001E, 0)) {
        let tpc = ((n1e.ebx >> 8) & 0xff) + 1;
        let shift = (n8.ecx >> 12) & 0xf;
        (
            n1e.eax,
            tpc.next_power_of_two().trailing_zeros(),
            shift,
            tpc,
            (n8.ecx & 0xff) + 1,
        )
    } else {
        let n = (leaf1.ebx >> 16) & 0xff;
        (
            leaf1.ebx >> 24,
            0,
            n.max(1).next_power_of_two().trailing_zeros(),
            1,
            n.max(1),
        )
    };
    let core_mask = (1u32 << (pkg_shift - smt_shift)) - 1;
    Some(DecodedTopology {
        apic_id,
        threads_per_core,
        logical_per_package: logical,
        package: apic_id >> pkg_shift,
        core: (apic_id >> smt_shift) & core_mask,
        thread: apic_id & ((1u32 << smt_shift) - 1),
        realtime_hint,
    })
}

trait FilterPair<T> {
    fn filter_pair(self, f: impl Fn(&T, &T) -> bool) -> (Option<T>, Option<T>);
}

impl<T: Copy> FilterPair<T> for (Option<T>, Option<T>) {
    fn filter_pair(self, f: impl Fn(&T, &T) -> bool) -> (Option<T>, Option<T>) {
        match self {
            (Some(a), Some(b)) if f(&a, &b) => (Some(a), Some(b)),
            _ => (None, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32, regs: [u32; 4]) -> kvm_cpuid_entry2 {
        let [eax, ebx, ecx, edx] = regs;
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }

    fn vendor_regs(name: &[u8; 12]) -> [u32; 4] {
        let w = |i: usize| u32::from_le_bytes(name[i..i + 4].try_into().unwrap());
        [0x20, w(0), w(8), w(4)]
    }

    fn supported(vendor: &[u8; 12]) -> CpuId {
        let mut entries = vec![
            entry(0, 0, vendor_regs(vendor)),
            entry(
                1,
                0,
                [0x00a2_0f12, 0x0000_0800, 0xfef8_3203 | 1 << 31, 0x178b_fbff],
            ),
            entry(4, 0, [0x0000_0121, 0, 0, 0]),
            entry(4, 3, [0x0000_0163, 0, 0, 0]),
            entry(7, 0, [0, 0xffff_ffff, 0xffff_ffff, 0xffff_ffff]),
            entry(0xB, 0, [1, 2, 0x100, 3]),
            entry(
                0x4000_0000,
                0,
                [0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x4d],
            ),
            entry(0x4000_0001, 0, [0x0100_07fb, 0, 0, 0]),
            entry(0x8000_0001, 0, [0, 0, 0xffff_ffff, 0xffff_ffff]),
            entry(0x8000_0008, 0, [0x3030, 0, 0x0001_0000, 0]),
            entry(0x8000_001D, 0, [0x121, 0, 0, 0]),
            entry(0x8000_001D, 3, [0x163, 0, 0, 0]),
            entry(0x8000_001E, 0, [0, 0, 0, 0]),
        ];
        entries[5].flags = KVM_CPUID_FLAG_SIGNIFCANT_INDEX;
        CpuId::from_entries(&entries).unwrap()
    }

    fn placement(t: &CpuTopology, socket: u32, core: u32, thread: u32) -> VcpuPlacement {
        VcpuPlacement {
            vcpu: 5,
            socket,
            core,
            thread,
            apic_id: ApicWidths::of(t).apic_id(socket, core, thread),
            guest_cell: 0,
            host_cpu: None,
            host_node: None,
        }
    }

    /// What the guest would read: the entries themselves, as results.
    fn results(c: &CpuId) -> Vec<CpuidResult> {
        reported_leaves(c)
            .into_iter()
            .filter_map(|(leaf, subleaf)| {
                let e = c
                    .as_slice()
                    .iter()
                    .find(|e| e.function == leaf && e.index == subleaf)?;
                Some(CpuidResult {
                    leaf,
                    subleaf,
                    eax: e.eax,
                    ebx: e.ebx,
                    ecx: e.ecx,
                    edx: e.edx,
                })
            })
            .collect()
    }

    const ALL_HOST: fn(u32, u32) -> [u32; 4] = |_, _| [u32::MAX; 4];

    #[test]
    fn widths_follow_x86_rules() {
        let t = CpuTopology {
            sockets: 2,
            cores: 3,
            threads: 2,
        };
        let w = ApicWidths::of(&t);
        assert_eq!((w.thread_bits, w.core_bits), (1, 2));
        assert_eq!(w.apic_id(1, 2, 1), 0b1101);
        assert_eq!(
            ApicWidths::of(&CpuTopology {
                sockets: 1,
                cores: 1,
                threads: 1
            })
            .package_shift(),
            0
        );
    }

    #[test]
    fn amd_leaves_describe_two_sockets_of_four_cores_of_two_threads() {
        let t = CpuTopology {
            sockets: 2,
            cores: 4,
            threads: 2,
        };
        let v = placement(&t, 1, 2, 1);
        let c = vcpu_cpuid(
            &supported(b"AuthenticAMD"),
            &CpuidInputs {
                topology: t,
                vcpu: &v,
                realtime_hint: false,
            },
            &ALL_HOST,
        )
        .unwrap();
        let r = results(&c);
        let d = decode_topology(&r).unwrap();
        assert_eq!(d.apic_id, v.apic_id);
        assert_eq!((d.package, d.core, d.thread), (1, 2, 1));
        assert_eq!((d.threads_per_core, d.logical_per_package), (2, 8));
        assert!(!d.realtime_hint);
        let e1e = r.iter().find(|r| r.leaf == 0x8000_001E).unwrap();
        assert_eq!((e1e.eax, e1e.ebx, e1e.ecx), (v.apic_id, (1 << 8) | 2, 1));
        let e8 = r.iter().find(|r| r.leaf == 0x8000_0008).unwrap();
        assert_eq!(e8.ecx, 0x0001_0000 | (3 << 12) | 7);
        let l3 = c
            .as_slice()
            .iter()
            .find(|e| e.function == 0x8000_001D && e.index == 3)
            .unwrap();
        assert_eq!((l3.eax >> 14) & 0xfff, 7);
        let leaf1 = r.iter().find(|r| r.leaf == 1).unwrap();
        assert_eq!(leaf1.ebx >> 24, v.apic_id);
        assert_eq!((leaf1.ebx >> 16) & 0xff, 8);
        assert_ne!(leaf1.edx & (1 << 28), 0);
        // Without leaf 0xB the AMD leaves alone give the same answer.
        let no_b: Vec<_> = r.iter().copied().filter(|r| r.leaf != 0xB).collect();
        assert_eq!(decode_topology(&no_b), Some(d));
    }

    #[test]
    fn intel_leaves_and_realtime_hint() {
        let t = CpuTopology {
            sockets: 1,
            cores: 2,
            threads: 1,
        };
        let v = placement(&t, 0, 1, 0);
        let c = vcpu_cpuid(
            &supported(b"GenuineIntel"),
            &CpuidInputs {
                topology: t,
                vcpu: &v,
                realtime_hint: true,
            },
            &ALL_HOST,
        )
        .unwrap();
        let d = decode_topology(&results(&c)).unwrap();
        assert_eq!((d.apic_id, d.package, d.core, d.thread), (1, 0, 1, 0));
        assert_eq!((d.threads_per_core, d.logical_per_package), (1, 2));
        assert!(d.realtime_hint);
        let l1 = c
            .as_slice()
            .iter()
            .find(|e| e.function == 4 && e.index == 0)
            .unwrap();
        assert_eq!((l1.eax >> 26, (l1.eax >> 14) & 0xfff), (1, 0));
        let l3 = c
            .as_slice()
            .iter()
            .find(|e| e.function == 4 && e.index == 3)
            .unwrap();
        assert_eq!((l3.eax >> 26, (l3.eax >> 14) & 0xfff), (1, 1));
        // The AMD-only leaf is left alone on Intel.
        let e1e = c
            .as_slice()
            .iter()
            .find(|e| e.function == 0x8000_001E)
            .unwrap();
        assert_eq!(e1e.eax, 0);
    }

    #[test]
    fn features_the_host_lacks_are_masked_but_kvm_bits_stay() {
        let t = CpuTopology {
            sockets: 1,
            cores: 1,
            threads: 1,
        };
        let v = placement(&t, 0, 0, 0);
        let host = |leaf: u32, _sub: u32| {
            if leaf == 7 {
                [0, 0x0000_00ff, 0, 0]
            } else {
                [0; 4]
            }
        };
        let c = vcpu_cpuid(
            &supported(b"AuthenticAMD"),
            &CpuidInputs {
                topology: t,
                vcpu: &v,
                realtime_hint: false,
            },
            &host,
        )
        .unwrap();
        let get = |l: u32| *c.as_slice().iter().find(|e| e.function == l).unwrap();
        assert_eq!(get(7).ebx, 0xff);
        assert_eq!(get(7).edx, 0);
        // The supported set has x2APIC and hypervisor but no TSC deadline: both are kept.
        assert_eq!(get(1).ecx, (1 << 31) | (1 << 21));
        assert_eq!(get(1).edx & (1 << 28), 0, "one logical CPU: no HTT");
    }

    #[test]
    fn tsc_deadline_is_offered_and_survives_the_host_mask() {
        let mut s = supported(b"AuthenticAMD");
        offer_tsc_deadline(&mut s);
        let t = CpuTopology {
            sockets: 1,
            cores: 1,
            threads: 1,
        };
        let v = placement(&t, 0, 0, 0);
        let inputs = CpuidInputs {
            topology: t,
            vcpu: &v,
            realtime_hint: false,
        };
        let none = |_: u32, _: u32| [0u32; 4];
        let c = vcpu_cpuid(&s, &inputs, &none).unwrap();
        let leaf1 = c.as_slice().iter().find(|e| e.function == 1).unwrap();
        assert_ne!(leaf1.ecx & TSC_DEADLINE_BIT, 0);
    }

    #[test]
    fn a_wrong_apic_id_is_rejected() {
        let t = CpuTopology {
            sockets: 1,
            cores: 3,
            threads: 1,
        };
        let mut v = placement(&t, 0, 2, 0);
        v.apic_id = 7;
        let err = vcpu_cpuid(
            &supported(b"AuthenticAMD"),
            &CpuidInputs {
                topology: t,
                vcpu: &v,
                realtime_hint: false,
            },
            &ALL_HOST,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                CpuidError::ApicId {
                    vcpu: 5,
                    apic_id: 7,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn the_host_vendor_is_recognised() {
        let [_, b, c, d] = host_cpuid(0, 0);
        let mut name = Vec::new();
        for r in [b, d, c] {
            name.extend(r.to_le_bytes());
        }
        let expect = match &name[..] {
            b"GenuineIntel" => Vendor::Intel,
            b"AuthenticAMD" | b"HygonGenuine" => Vendor::Amd,
            _ => Vendor::Other,
        };
        let c = CpuId::from_entries(&[entry(0, 0, [0x10, b, c, d])]).unwrap();
        assert_eq!(vendor(&c), expect);
    }
}
