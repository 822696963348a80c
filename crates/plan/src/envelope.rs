//! The host envelope: guest memory plus the VMM's overhead, term by term, and the CPUs.
//!
//! Two overhead models:
//! - [`OverheadModel::Vmhost`]: vmhost's own costs (one VMM process, no libvirt); constants
//!   documented in `docs/overhead.md`, to be calibrated by measurement.
//! - [`OverheadModel::Kubevirt`]: KubeVirt's amd64 `GetMemoryOverhead` arithmetic, reproduced
//!   exactly for the fields vmhost supports.
//!
//! Every sum and product is checked: a size that does not fit 64 bits is a [`SizeOverflow`]
//! naming the field it came from, never a wrapped (or, in debug builds, panicking) number.
//! Validated specs keep every byte quantity at or below `vmhost_config::MAX_MEMORY_BYTES`, so
//! only extreme command-line values (`--overhead-ratio`) can reach it.

use std::collections::BTreeMap;

use vmhost_config::VmSpec;

use crate::model::{Envelope, HugepageDemand, OverheadModel};

const MI: u64 = 1 << 20;

/// A size computed from the spec or the command line does not fit 64 bits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {what} does not fit in 64 bits; fix: use a smaller {field}")]
pub struct SizeOverflow {
    /// The spec field or option the size comes from (`memory.guest`, `--overhead-ratio`).
    pub field: &'static str,
    /// What was being computed.
    pub what: &'static str,
}

/// `a + b`, or the overflow named after `field`.
fn add(a: u64, b: u64, field: &'static str, what: &'static str) -> Result<u64, SizeOverflow> {
    a.checked_add(b).ok_or(SizeOverflow { field, what })
}

/// `a × b`, or the overflow named after `field`.
fn mul(a: u64, b: u64, field: &'static str, what: &'static str) -> Result<u64, SizeOverflow> {
    a.checked_mul(b).ok_or(SizeOverflow { field, what })
}

/// The sum of the terms; each term is named after the field it comes from.
fn sum_terms(terms: &BTreeMap<String, u64>) -> Result<u64, SizeOverflow> {
    terms.iter().try_fold(0u64, |acc, (name, v)| {
        add(acc, *v, term_field(name), "the sum of the overhead terms")
    })
}

/// The spec field or option behind an overhead term, for messages.
fn term_field(term: &str) -> &'static str {
    match term {
        "added_overhead" => "memory.reserved_overhead.added_overhead",
        "overhead_ratio" => "--overhead-ratio",
        "page_tables" => "resources.requests.memory",
        "kvm_page_tables" | "vmm_page_tables" => "memory.guest",
        "io_threads" => "io_threads",
        "virtio_blk" | "virtio_net" | "virtio_rng" => "devices",
        _ => "cpu.sockets",
    }
}

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

/// vmhost: private memory per device I/O thread (its stack in use and its epoll event
/// buffer), taken as the vCPU thread's term until calibrated separately.
pub const VMHOST_PER_IO_THREAD: u64 = 64 << 10;
/// vmhost: the largest virtio-blk request (`seg_max` 254 × `size_max` 128 KiB,
/// `vmhost_devices::block::BLOCK_MAX_REQUEST`): a disk's request buffer grows to it.
pub const VIRTIO_BLK_MAX_REQUEST: u64 = 254 * 128 * 1024;
/// vmhost: O_DIRECT alignment (`vmhost_devices::sys::DIRECT_ALIGN`).
pub const DIRECT_ALIGN: u64 = 4096;
/// vmhost: the largest frame a virtio-net device buffers, with its 12-byte header
/// (`vmhost_devices::net::MAX_FRAME`); each NIC has one receive and one transmit buffer.
pub const VIRTIO_NET_MAX_FRAME: u64 = 12 + 65_550;
/// vmhost: a virtio-rng device's buffer (`vmhost_devices::rng::RNG_MAX_REQUEST`).
pub const VIRTIO_RNG_BUFFER: u64 = 64 * 1024;

/// vmhost: the most host memory one disk's buffers take: the request buffer and, with
/// `cache = "none"`, the scratch buffer that unaligned direct I/O widens to whole 4 KiB blocks
/// (a request plus a block on each side; one block with `writeback`). A cache left out may turn
/// out to be `none` when the image is opened, so it is counted as `none`.
pub fn virtio_blk_bytes(cache: vmhost_config::DiskCache) -> u64 {
    let scratch = match cache {
        vmhost_config::DiskCache::None | vmhost_config::DiskCache::Auto => {
            VIRTIO_BLK_MAX_REQUEST + 2 * DIRECT_ALIGN
        }
        vmhost_config::DiskCache::Writeback => DIRECT_ALIGN,
    };
    VIRTIO_BLK_MAX_REQUEST + scratch
}

/// KubeVirt's fixed per-VMI process terms (name, bytes), amd64. The `iothread` term is
/// KubeVirt's "static overhead for IOThread": one 8Mi whatever the policy and the number of
/// IOThreads (`hypervisorbackend.go`: `overhead.Add(resource.MustParse("8Mi"))`), and KubeVirt
/// adds no term for virtio disks, NICs or entropy.
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
) -> Result<BTreeMap<String, u64>, SizeOverflow> {
    let mut terms = BTreeMap::new();
    match model {
        OverheadModel::Vmhost => vmhost_terms(spec, &mut terms)?,
        OverheadModel::Kubevirt => kubevirt_terms(spec, &mut terms)?,
    }
    if let Some(r) = ratio {
        let sum = sum_terms(&terms)?;
        terms.insert("overhead_ratio".to_string(), ratio_addition(sum, r)?);
    }
    Ok(terms)
}

fn vmhost_terms(spec: &VmSpec, terms: &mut BTreeMap<String, u64>) -> Result<(), SizeOverflow> {
    let page = spec
        .memory
        .hugepages
        .as_ref()
        .map_or(4096, |h| h.page_size_bytes);
    let entries = spec.memory.guest_bytes.div_ceil(page);
    let what = "the page-table estimate";
    let tables = mul(
        mul(entries, VMHOST_PTE_BYTES, "memory.guest", what)?.div_ceil(4096),
        4096,
        "memory.guest",
        what,
    )?;
    terms.insert("kvm_page_tables".into(), tables);
    terms.insert("vmm_page_tables".into(), tables);
    terms.insert("vmm_process".into(), VMHOST_FIXED);
    let vcpus = mul(
        VMHOST_PER_VCPU,
        u64::from(spec.vcpus()),
        "cpu.sockets",
        "the vCPU term",
    )?;
    terms.insert("vcpus".into(), vcpus);
    device_terms(spec, terms)?;
    if spec.memory.added_overhead_bytes > 0 {
        terms.insert("added_overhead".into(), spec.memory.added_overhead_bytes);
    }
    Ok(())
}

/// vmhost's device terms: each I/O thread, and each device's buffers at their largest.
fn device_terms(spec: &VmSpec, terms: &mut BTreeMap<String, u64>) -> Result<(), SizeOverflow> {
    let plan = crate::devices::DevicePlan::new(spec.devices.clone());
    let threads = crate::iothreads::assign(spec, &plan.slots).len() as u64;
    let what = "the I/O thread term";
    if threads > 0 {
        let bytes = mul(VMHOST_PER_IO_THREAD, threads, "io_threads", what)?;
        terms.insert("io_threads".into(), bytes);
    }
    let disks = spec
        .devices
        .disks
        .iter()
        .map(|d| virtio_blk_bytes(d.cache))
        .sum::<u64>();
    if disks > 0 {
        terms.insert("virtio_blk".into(), disks);
    }
    let nics = spec.devices.interfaces.len() as u64;
    if nics > 0 {
        let per_nic = (2 * VIRTIO_NET_MAX_FRAME).div_ceil(4096) * 4096;
        terms.insert("virtio_net".into(), per_nic * nics);
    }
    if spec.devices.rng {
        terms.insert("virtio_rng".into(), VIRTIO_RNG_BUFFER);
    }
    Ok(())
}

fn kubevirt_terms(spec: &VmSpec, terms: &mut BTreeMap<String, u64>) -> Result<(), SizeOverflow> {
    // Page tables: only resources.requests.memory, rounded up to kB, / 512.
    let req = spec.resources.requests.memory_bytes.unwrap_or(0);
    let kb = mul(
        req.div_ceil(1000),
        1000,
        "resources.requests.memory",
        "the page-table term",
    )?;
    terms.insert("page_tables".into(), kb / 512);
    for (name, bytes) in KUBEVIRT_FIXED {
        terms.insert(name.into(), bytes);
    }
    let vcpus = u64::from(kubevirt_vcpus(spec));
    terms.insert(
        "vcpus".into(),
        mul(8 * MI, vcpus, "cpu.sockets", "the vCPU term")?,
    );
    if spec.autoattach_graphics_device {
        terms.insert("video_ram".into(), 32 * MI);
    }
    if spec.cpu.dedicated_cpu_placement || guaranteed_qos(spec) {
        terms.insert("dedicated_cpu_or_guaranteed_qos".into(), 100 * MI);
    }
    if spec.memory.added_overhead_bytes > 0 {
        terms.insert("added_overhead".into(), spec.memory.added_overhead_bytes);
    }
    Ok(())
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
/// A product beyond 64 bits (or a ratio that is not a finite number) is an overflow of
/// `--overhead-ratio`.
pub fn ratio_addition(overhead: u64, ratio: f64) -> Result<u64, SizeOverflow> {
    let overflow = SizeOverflow {
        field: "--overhead-ratio",
        what: "the overhead times the ratio",
    };
    #[allow(clippy::cast_precision_loss)]
    let kilo = overhead.div_ceil(1000) as f64;
    let add = kilo * (ratio - 1.0);
    // 2^64 is exactly representable; anything at or above it (or NaN) does not fit.
    #[allow(clippy::cast_precision_loss)]
    if add.is_nan() || add >= u64::MAX as f64 {
        return Err(overflow);
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let add = add.max(0.0) as u64; // Go's int64() truncates toward zero.
    add.checked_mul(1000).ok_or(overflow)
}

/// Builds the envelope from the overhead terms, the spec and the hugepage demand.
pub fn envelope(
    spec: &VmSpec,
    model: OverheadModel,
    ratio: Option<f64>,
    hugepages: Vec<HugepageDemand>,
) -> Result<Envelope, SizeOverflow> {
    let terms = overhead_terms(spec, model, ratio)?;
    let overhead = sum_terms(&terms)?;
    let guest = spec.memory.guest_bytes;
    // Hugepage-backed guest RAM is not in the memory request: only what the request (or the
    // limit) exceeds the guest by.
    let beyond_guest = |bytes: u64| {
        if spec.memory.hugepages.is_some() {
            bytes.saturating_sub(guest)
        } else {
            bytes
        }
    };
    let req = spec.resources.requests.memory_bytes.unwrap_or(guest);
    let memory_request_bytes = add(
        overhead,
        beyond_guest(req),
        "resources.requests.memory",
        "the memory request plus the overhead",
    )?;
    let memory_limit_bytes = if spec.cpu.dedicated_cpu_placement {
        Some(memory_request_bytes)
    } else {
        spec.resources
            .limits
            .memory_bytes
            .map(|lim| {
                add(
                    overhead,
                    beyond_guest(lim),
                    "resources.limits.memory",
                    "the memory limit plus the overhead",
                )
            })
            .transpose()?
    };
    let vcpus = spec.vcpus();
    let (cpus, dedicated_cpus) = if spec.cpu.dedicated_cpu_placement {
        // KubeVirt: vCPUs + supplementalPoolThreadCount (+ the isolated emulator's PUs).
        let n = vcpus + spec.io_pus() + spec.emulator_pus();
        (f64::from(n), n)
    } else {
        // KubeVirt: the CPU request, else (vCPUs + supplementalPoolThreadCount) /
        // cpuAllocationRatio (10).
        let pool = spec.io_threads.supplemental_pool_thread_count;
        let millis = spec
            .resources
            .requests
            .cpu_millis
            .unwrap_or((u64::from(vcpus) + u64::from(pool)) * 100);
        #[allow(clippy::cast_precision_loss)]
        (millis as f64 / 1000.0, 0)
    };
    Ok(Envelope {
        overhead_model: model,
        guest_memory_bytes: guest,
        overhead_bytes: overhead,
        overhead_terms: terms,
        memory_request_bytes,
        memory_limit_bytes,
        cpus,
        dedicated_cpus,
        hugepages,
    })
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
            overhead_terms(&s, OverheadModel::Kubevirt, None).unwrap()["page_tables"],
            2_097_152
        );
        let s = spec("[resources.requests]\nmemory = \"2Mi\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Kubevirt, None).unwrap()["page_tables"],
            4097
        );
    }

    #[test]
    fn kubevirt_page_tables_ignore_guest_memory() {
        let s = spec("[memory]\nguest = \"8Gi\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Kubevirt, None).unwrap()["page_tables"],
            0
        );
    }

    #[test]
    fn kubevirt_total_for_plain_vm() {
        // 1Gi request, 2 vCPUs, graphics attached, not dedicated:
        // 2097152 + 248Mi + 16Mi + 32Mi.
        let s = spec("[cpu]\ncores = 2\n[resources.requests]\nmemory = \"1Gi\"\n");
        let t = overhead_terms(&s, OverheadModel::Kubevirt, None).unwrap();
        assert_eq!(t.values().sum::<u64>(), 2_097_152 + (248 + 16 + 32) * MI);
        assert!(!t.contains_key("dedicated_cpu_or_guaranteed_qos"));
    }

    #[test]
    fn kubevirt_dedicated_and_qos_and_no_graphics() {
        let s = spec(
            "[cpu]\ncores = 4\ndedicated_cpu_placement = true\n[memory]\nguest = \"1Gi\"\n\
             [devices]\nautoattach_graphics_device = false\n[memory.reserved_overhead]\nadded_overhead = \"10Mi\"\n",
        );
        let t = overhead_terms(&s, OverheadModel::Kubevirt, None).unwrap();
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
            overhead_terms(&s, OverheadModel::Kubevirt, None).unwrap()["vcpus"],
            24 * MI
        );
    }

    #[test]
    fn ratio_is_applied_in_doubles_like_go() {
        // O = 300Mi = 314572800 B -> 314573 kB; x 0.2 = 62914.6 -> 62914 kB.
        assert_eq!(ratio_addition(314_572_800, 1.2), Ok(62_914_000));
        assert_eq!(ratio_addition(1000, 1.0), Ok(0));
        // 1.2 - 1.0 is 0.19999999999999996 in doubles: 5 kB * that = 0.99999.. -> 0.
        assert_eq!(ratio_addition(5000, 1.2), Ok(0));
    }

    #[test]
    fn a_ratio_beyond_64_bits_is_an_overflow_of_the_option_not_a_wrap() {
        let s = spec("[memory]\nguest = \"1Gi\"\n");
        for ratio in [1e300, f64::INFINITY, f64::NAN, 2e16] {
            let err = envelope(&s, OverheadModel::Vmhost, Some(ratio), vec![]).unwrap_err();
            assert_eq!(err.field, "--overhead-ratio", "{ratio}");
        }
        assert!(envelope(&s, OverheadModel::Vmhost, Some(1e6), vec![]).is_ok());
    }

    #[test]
    fn vmhost_page_tables_follow_backing_page_size() {
        let s = spec("[memory]\nguest = \"1Gi\"\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Vmhost, None).unwrap()["kvm_page_tables"],
            2 * MI
        );
        let s = spec("[memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"2Mi\" }\n");
        assert_eq!(
            overhead_terms(&s, OverheadModel::Vmhost, None).unwrap()["kvm_page_tables"],
            4096
        );
    }

    #[test]
    fn envelope_memory_and_cpus() {
        let s = spec("[cpu]\ncores = 4\n[memory]\nguest = \"1Gi\"\n");
        let e = envelope(&s, OverheadModel::Vmhost, None, vec![]).unwrap();
        assert_eq!(e.memory_request_bytes, (1 << 30) + e.overhead_bytes);
        assert!((e.cpus - 0.4).abs() < 1e-9);
        assert_eq!(e.dedicated_cpus, 0);
        let s = spec(
            "[cpu]\ncores = 2\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
             [memory]\nguest = \"1Gi\"\nhugepages = { page_size = \"2Mi\" }\n",
        );
        let e = envelope(&s, OverheadModel::Vmhost, None, vec![]).unwrap();
        assert_eq!(e.memory_request_bytes, e.overhead_bytes);
        assert_eq!(e.memory_limit_bytes, Some(e.overhead_bytes));
        assert_eq!(e.dedicated_cpus, 3);
    }
}
