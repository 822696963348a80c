//! The host envelope: guest memory plus the VMM's overhead, term by term, and the CPUs.
//!
//! Two overhead models:
//! - [`OverheadModel::Vmhost`]: vmhost's own costs (one VMM process, no libvirt); constants
//!   documented in `docs/overhead.md`, to be calibrated by measurement.
//! - [`OverheadModel::Kubevirt`]: KubeVirt's amd64 `GetMemoryOverhead` arithmetic, reproduced
//!   exactly for the fields vmhost supports.

use std::collections::BTreeMap;

use vmhost_config::VmSpec;

use crate::model::{Envelope, HugepageDemand, OverheadModel};

const MI: u64 = 1 << 20;

/// vmhost: fixed private memory of the VMM process (heap, stacks of its own threads, page
/// tables of its own mappings). Measured 1.1–1.7 MiB (release) and 1.7–2.4 MiB (debug build)
/// over the calibration matrix (`tests/calibration.rs`, `docs/overhead.md`).
pub const VMHOST_FIXED: u64 = 5 * MI / 2;
/// vmhost: private memory per vCPU (its thread's stack in use, `kvm_run` page). Measured
/// about 40 KiB per vCPU.
pub const VMHOST_PER_VCPU: u64 = 64 << 10;
/// vmhost: bytes of page table per backing page of guest RAM, in each of the two tables that
/// map it: the VMM's own page tables and KVM's second-level tables. Measured 8 bytes per 4 KiB
/// page each (`VmPTE` and `SecPageTables` both grow by guest RAM / 512).
pub const VMHOST_PTE_BYTES: u64 = 8;

/// KubeVirt's fixed per-VMI process terms (name, bytes), amd64.
pub const KUBEVIRT_FIXED: [(&str, u64); 6] = [
    ("virt_launcher_monitor", 25 * MI),
    ("virt_launcher", 100 * MI),
    ("virtlogd", 25 * MI),
    ("virtqemud", 40 * MI),
    ("qemu", 50 * MI),
    ("iothread", 8 * MI),
];

/// Computes the overhead terms of `spec` under `model`; `ratio` is KubeVirt's
/// `additionalGuestMemoryOverheadRatio` (applied last, in both models).
pub fn overhead_terms(
    spec: &VmSpec,
    model: OverheadModel,
    ratio: Option<f64>,
) -> BTreeMap<String, u64> {
    let mut terms = BTreeMap::new();
    match model {
        OverheadModel::Vmhost => vmhost_terms(spec, &mut terms),
        OverheadModel::Kubevirt => kubevirt_terms(spec, &mut terms),
    }
    if let Some(r) = ratio {
        let sum: u64 = terms.values().sum();
        terms.insert("overhead_ratio".to_string(), ratio_addition(sum, r));
    }
    terms
}

fn vmhost_terms(spec: &VmSpec, terms: &mut BTreeMap<String, u64>) {
    let page = spec
        .memory
        .hugepages
        .as_ref()
        .map_or(4096, |h| h.page_size_bytes);
    let entries = spec.memory.guest_bytes.div_ceil(page);
    let tables = (entries * VMHOST_PTE_BYTES).div_ceil(4096) * 4096;
    terms.insert("kvm_page_tables".into(), tables);
    terms.insert("vmm_page_tables".into(), tables);
    terms.insert("vmm_process".into(), VMHOST_FIXED);
    terms.insert("vcpus".into(), VMHOST_PER_VCPU * u64::from(spec.vcpus()));
    if spec.memory.added_overhead_bytes > 0 {
        terms.insert("added_overhead".into(), spec.memory.added_overhead_bytes);
    }
}

fn kubevirt_terms(spec: &VmSpec, terms: &mut BTreeMap<String, u64>) {
    // Page tables: only resources.requests.memory, rounded up to kB, / 512.
    let req = spec.resources.requests.memory_bytes.unwrap_or(0);
    terms.insert("page_tables".into(), req.div_ceil(1000) * 1000 / 512);
    for (name, bytes) in KUBEVIRT_FIXED {
        terms.insert(name.into(), bytes);
    }
    terms.insert("vcpus".into(), 8 * MI * u64::from(kubevirt_vcpus(spec)));
    if spec.autoattach_graphics_device {
        terms.insert("video_ram".into(), 32 * MI);
    }
    if spec.cpu.dedicated_cpu_placement || guaranteed_qos(spec) {
        terms.insert("dedicated_cpu_or_guaranteed_qos".into(), 100 * MI);
    }
    if spec.memory.added_overhead_bytes > 0 {
        terms.insert("added_overhead".into(), spec.memory.added_overhead_bytes);
    }
}

/// KubeVirt's vCPU count: the topology when given, else the CPU limit, else the request,
/// rounded up; at least 1.
fn kubevirt_vcpus(spec: &VmSpec) -> u32 {
    if spec.cpu.topology_given {
        return spec.vcpus();
    }
    let r = &spec.resources;
    let millis = r.limits.cpu_millis.or(r.requests.cpu_millis).unwrap_or(0);
    u32::try_from(millis.div_ceil(1000))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// Guaranteed QoS as Kubernetes derives it: memory and CPU requests equal their limits
/// (a request left out defaults to its limit), CPU non-zero.
pub fn guaranteed_qos(spec: &VmSpec) -> bool {
    let r = &spec.resources;
    let equal = |req: Option<u64>, lim: Option<u64>| match (req, lim) {
        (Some(a), Some(b)) => a == b && a > 0,
        (None, Some(b)) => b > 0,
        _ => false,
    };
    equal(r.requests.memory_bytes, r.limits.memory_bytes)
        && equal(r.requests.cpu_millis, r.limits.cpu_millis)
}

/// KubeVirt's `MultiplyMemory`: `trunc(ceil(O / 1000) × (r − 1.0)) × 1000`, in IEEE doubles.
pub fn ratio_addition(overhead: u64, ratio: f64) -> u64 {
    #[allow(clippy::cast_precision_loss)]
    let kilo = overhead.div_ceil(1000) as f64;
    let add = kilo * (ratio - 1.0);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let add = add.max(0.0) as u64; // Go's int64() truncates toward zero.
    add * 1000
}

/// Builds the envelope from the overhead terms, the spec and the hugepage demand.
pub fn envelope(
    spec: &VmSpec,
    model: OverheadModel,
    ratio: Option<f64>,
    hugepages: Vec<HugepageDemand>,
) -> Envelope {
    let terms = overhead_terms(spec, model, ratio);
    let overhead: u64 = terms.values().sum();
    let guest = spec.memory.guest_bytes;
    let req = spec.resources.requests.memory_bytes.unwrap_or(guest);
    let memory_request_bytes = if spec.memory.hugepages.is_some() {
        overhead + req.saturating_sub(guest)
    } else {
        req + overhead
    };
    let memory_limit_bytes = if spec.cpu.dedicated_cpu_placement {
        Some(memory_request_bytes)
    } else {
        spec.resources.limits.memory_bytes.map(|lim| {
            if spec.memory.hugepages.is_some() {
                overhead + lim.saturating_sub(guest)
            } else {
                lim + overhead
            }
        })
    };
    let vcpus = spec.vcpus();
    let (cpus, dedicated_cpus) = if spec.cpu.dedicated_cpu_placement {
        let n = vcpus + spec.cpu.emulator_pus();
        (f64::from(n), n)
    } else {
        // KubeVirt: the CPU request, else vCPUs / cpuAllocationRatio (10).
        let millis = spec
            .resources
            .requests
            .cpu_millis
            .unwrap_or(u64::from(vcpus) * 100);
        #[allow(clippy::cast_precision_loss)]
        (millis as f64 / 1000.0, 0)
    };
    Envelope {
        overhead_model: model,
        guest_memory_bytes: guest,
        overhead_bytes: overhead,
        overhead_terms: terms,
        memory_request_bytes,
        memory_limit_bytes,
        cpus,
        dedicated_cpus,
        hugepages,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_config::from_toml_str;

    fn spec(text: &str) -> VmSpec {
        from_toml_str(text, "t.toml").unwrap().spec
    }

    #[test]
    fn kubevirt_page_tables_match_reference_values() {
        let s = spec("[resources.requests]\nmemory = \"1Gi\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Kubevirt, None)["page_tables"],
            2_097_152
        );
        let s = spec("[resources.requests]\nmemory = \"2Mi\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Kubevirt, None)["page_tables"],
            4097
        );
    }

    #[test]
    fn kubevirt_page_tables_ignore_guest_memory() {
        let s = spec("[memory]\nguest = \"8Gi\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Kubevirt, None)["page_tables"],
            0
        );
    }

    #[test]
    fn kubevirt_total_for_plain_vm() {
        // 1Gi request, 2 vCPUs, graphics attached, not dedicated:
        // 2097152 + 248Mi + 16Mi + 32Mi.
        let s = spec("[cpu]\ncores = 2\n[resources.requests]\nmemory = \"1Gi\"\n");
        let t = overhead_terms(&s, OverheadModel::Kubevirt, None);
        assert_eq!(t.values().sum::<u64>(), 2_097_152 + (248 + 16 + 32) * MI);
        assert!(!t.contains_key("dedicated_cpu_or_guaranteed_qos"));
    }

    #[test]
    fn kubevirt_dedicated_and_qos_and_no_graphics() {
        let s = spec(
            "[cpu]\ncores = 4\ndedicated_cpu_placement = true\n[memory]\nguest = \"1Gi\"\n\
             [devices]\nautoattach_graphics_device = false\n[memory.reserved_overhead]\nadded_overhead = \"10Mi\"\n",
        );
        let t = overhead_terms(&s, OverheadModel::Kubevirt, None);
        assert_eq!(t["dedicated_cpu_or_guaranteed_qos"], 100 * MI);
        assert_eq!(t["vcpus"], 32 * MI);
        assert_eq!(t["added_overhead"], 10 * MI);
        assert!(!t.contains_key("video_ram"));
        let q = spec("[resources.limits]\nmemory = \"1Gi\"\ncpu = 2\n");
        assert!(guaranteed_qos(&q));
        let q =
            spec("[resources.limits]\nmemory = \"1Gi\"\n[resources.requests]\nmemory = \"1Gi\"\n");
        assert!(!guaranteed_qos(&q), "no CPU limit is not Guaranteed");
    }

    #[test]
    fn kubevirt_vcpus_from_cpu_limit() {
        let s = spec("[memory]\nguest = \"1Gi\"\n[resources.limits]\ncpu = \"2500m\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Kubevirt, None)["vcpus"],
            24 * MI
        );
    }

    #[test]
    fn ratio_is_applied_in_doubles_like_go() {
        // O = 300Mi = 314572800 B -> 314573 kB; x 0.2 = 62914.6 -> 62914 kB.
        assert_eq!(ratio_addition(314_572_800, 1.2), 62_914_000);
        assert_eq!(ratio_addition(1000, 1.0), 0);
        // 1.2 - 1.0 is 0.19999999999999996 in doubles: 5 kB * that = 0.99999.. -> 0.
        assert_eq!(ratio_addition(5000, 1.2), 0);
    }

    #[test]
    fn vmhost_page_tables_follow_backing_page_size() {
        let s = spec("[memory]\nguest = \"1Gi\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Vmhost, None)["kvm_page_tables"],
            2 * MI
        );
        let s = spec("[memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"2Mi\" }\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Vmhost, None)["kvm_page_tables"],
            4096
        );
    }

    #[test]
    fn envelope_memory_and_cpus() {
        let s = spec("[cpu]\ncores = 4\n[memory]\nguest = \"1Gi\"\n");
        let e = envelope(&s, OverheadModel::Vmhost, None, vec![]);
        assert_eq!(e.memory_request_bytes, (1 << 30) + e.overhead_bytes);
        assert!((e.cpus - 0.4).abs() < 1e-9);
        assert_eq!(e.dedicated_cpus, 0);
        let s = spec(
            "[cpu]\ncores = 2\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
             [memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"2Mi\" }\n",
        );
        let e = envelope(&s, OverheadModel::Vmhost, None, vec![]);
        assert_eq!(e.memory_request_bytes, e.overhead_bytes);
        assert_eq!(e.memory_limit_bytes, Some(e.overhead_bytes));
        assert_eq!(e.dedicated_cpus, 3);
    }
}
