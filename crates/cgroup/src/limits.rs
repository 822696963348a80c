//! The limits a VM's cgroup enforces, derived from its plan: CPUs and memory nodes (cpuset),
//! ordinary memory (memory) and hugepages per page size (hugetlb).
//!
//! What the memory limit covers depends on the backing. hugetlb pages are charged to the
//! hugetlb controller only, never to the memory controller (cgroup v1 always; cgroup v2 unless
//! the cgroup2 mount has `memory_hugetlb_accounting`, Linux 6.6+). So for hugepage-backed guest
//! RAM the memory limit is the overhead alone and the guest RAM is bounded by the hugetlb limit;
//! for anonymous guest RAM the memory limit is guest RAM plus overhead. The plan's envelope
//! already says exactly this (`memory_limit_bytes`); [`Limits::from_plan`] takes it as is.

use std::collections::BTreeMap;

use vmhost_plan::Plan;

/// Bytes per page the memory controller counts in (limits are whole pages).
pub const PAGE_BYTES: u64 = 4096;

/// What a VM's cgroup enforces.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Limits {
    /// Host PUs the VMM's threads may run on (ascending). Empty: all the parent allows.
    pub cpus: Vec<u32>,
    /// Host NUMA nodes the VMM may allocate from (ascending). Empty: all the parent allows.
    pub mems: Vec<u32>,
    /// Ordinary memory limit in bytes (a multiple of [`PAGE_BYTES`]); `None`: unlimited.
    pub memory_max_bytes: Option<u64>,
    /// hugetlb limit per page size: `(page size, bytes)`, ascending by page size.
    pub hugetlb: Vec<(u64, u64)>,
}

impl Limits {
    /// The limits of `plan`:
    ///
    /// - `cpus`: the dedicated vCPU PUs ∪ the emulator PUs; a VM with floating vCPUs adds
    ///   `floating_cpus` (all the PUs it may use);
    /// - `mems`: the host nodes of the guest cells; empty (all nodes the parent allows) when
    ///   any cell is unbound;
    /// - `memory_max_bytes`: the envelope's memory limit, rounded up to whole 4 KiB pages (the
    ///   unit the kernel counts in);
    /// - `hugetlb`: count × page size, summed over nodes, per page size.
    ///
    /// ```
    /// use vmhost_cgroup::Limits;
    /// use vmhost_plan::{plan, PlanOptions};
    /// use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg};
    ///
    /// let spec = vmhost_config::from_toml_str(
    ///     "[cpu]\ncores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
    ///      [memory]\nguest = \"64Mi\"\nhugepages = { page_size = \"2Mi\" }\n",
    ///     "vm.toml",
    /// )
    /// .unwrap()
    /// .spec;
    /// let mut host = load_synthetic("package:1 numa:1 core:2 pu:1").unwrap();
    /// apply_hugepages(&mut host, &parse_hugepages_arg("node0:2Mi=64").unwrap()).unwrap();
    /// let plan = plan(&spec, &host, &PlanOptions::default()).into_result().unwrap();
    /// let limits = Limits::from_plan(&plan);
    /// assert_eq!(limits.cpus, [0, 1]); // one vCPU PU and the emulator's
    /// assert_eq!(limits.mems, [0]);
    /// assert_eq!(limits.memory_max_bytes, plan.envelope.memory_limit_bytes); // overhead only
    /// assert_eq!(limits.hugetlb, [(2 << 20, 64 << 20)]); // the guest RAM
    /// ```
    pub fn from_plan(plan: &Plan) -> Limits {
        let mut cpus: Vec<u32> = plan.vcpus.iter().filter_map(|v| v.host_cpu).collect();
        cpus.extend(&plan.emulator.host_cpus);
        for t in &plan.devices.io_threads {
            cpus.extend(&t.host_cpus);
        }
        if plan.vcpus.iter().any(|v| v.host_cpu.is_none()) {
            cpus.extend(&plan.floating_cpus);
        }
        cpus.sort_unstable();
        cpus.dedup();
        let bound: Option<Vec<u32>> = plan.guest_cells.iter().map(|c| c.host_node).collect();
        let mut mems = bound.unwrap_or_default();
        mems.sort_unstable();
        mems.dedup();
        let mut hugetlb = BTreeMap::<u64, u64>::new();
        for d in &plan.envelope.hugepages {
            *hugetlb.entry(d.page_size_bytes).or_default() += d.count * d.page_size_bytes;
        }
        Limits {
            cpus,
            mems,
            memory_max_bytes: plan
                .envelope
                .memory_limit_bytes
                .map(|b| b.div_ceil(PAGE_BYTES) * PAGE_BYTES),
            hugetlb: hugetlb.into_iter().filter(|&(_, b)| b > 0).collect(),
        }
    }

    /// The hugetlb limit for `page_size_bytes`, if any.
    pub fn hugetlb_bytes(&self, page_size_bytes: u64) -> Option<u64> {
        self.hugetlb
            .iter()
            .find(|(p, _)| *p == page_size_bytes)
            .map(|(_, b)| *b)
    }
}

/// The kernel's name for a hugepage size in hugetlb controller files (`2MB`, `1GB`, `64KB`).
pub fn hugetlb_size_name(page_size_bytes: u64) -> String {
    const K: u64 = 1 << 10;
    const M: u64 = 1 << 20;
    const G: u64 = 1 << 30;
    if page_size_bytes >= G {
        format!("{}GB", page_size_bytes / G)
    } else if page_size_bytes >= M {
        format!("{}MB", page_size_bytes / M)
    } else {
        format!("{}KB", page_size_bytes / K)
    }
}

/// The page size of a hugetlb controller file name part (`2MB` → 2 MiB).
pub(crate) fn parse_hugetlb_size_name(name: &str) -> Option<u64> {
    let (num, unit) = name.split_at(name.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = num.parse().ok()?;
    let shift = match unit {
        "KB" => 10,
        "MB" => 20,
        "GB" => 30,
        _ => return None,
    };
    Some(n << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugetlb_size_names_match_the_kernel() {
        for (bytes, name) in [(2 << 20, "2MB"), (1 << 30, "1GB"), (64 << 10, "64KB")] {
            assert_eq!(hugetlb_size_name(bytes), name);
            assert_eq!(parse_hugetlb_size_name(name), Some(bytes));
        }
        assert_eq!(parse_hugetlb_size_name("numa_stat"), None);
    }

    #[test]
    fn shared_vm_floats_over_its_cpus_and_unbound_memory_inherits_nodes() {
        let mut plan = crate::testutil::plan();
        for v in &mut plan.vcpus {
            v.host_cpu = None;
            v.host_node = None;
        }
        plan.floating_cpus = vec![0, 1, 2, 3];
        plan.emulator.host_cpus = vec![0, 1, 2, 3];
        plan.guest_cells[0].host_node = None;
        plan.envelope.memory_limit_bytes = Some(100_000_000);
        plan.envelope.hugepages.clear();
        let l = Limits::from_plan(&plan);
        assert_eq!(l.cpus, [0, 1, 2, 3]);
        assert!(l.mems.is_empty());
        assert_eq!(l.memory_max_bytes, Some(100_003_840));
        assert!(l.hugetlb.is_empty());
    }

    #[test]
    fn the_cpuset_holds_every_io_threads_pus() {
        let mut plan = crate::testutil::plan();
        let before = Limits::from_plan(&plan).cpus;
        assert!(!before.contains(&7));
        plan.devices.io_threads = vec![vmhost_plan::iothreads::IoThreadPlan {
            index: 0,
            name: "vmhost-io-0".into(),
            role: vmhost_plan::iothreads::IoThreadRole::SupplementalPool,
            devices: vec![],
            host_cpus: vec![7],
            exclusive: true,
        }];
        let mut want = before;
        want.push(7);
        want.sort_unstable();
        assert_eq!(Limits::from_plan(&plan).cpus, want);
    }

    #[test]
    fn hugetlb_sums_over_nodes_per_size() {
        let mut plan = crate::testutil::plan();
        plan.envelope.hugepages = vec![
            vmhost_plan::HugepageDemand {
                node: Some(0),
                page_size_bytes: 1 << 30,
                count: 2,
            },
            vmhost_plan::HugepageDemand {
                node: Some(1),
                page_size_bytes: 1 << 30,
                count: 3,
            },
        ];
        assert_eq!(Limits::from_plan(&plan).hugetlb, [(1 << 30, 5 << 30)]);
    }
}
