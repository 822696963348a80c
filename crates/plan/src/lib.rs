//! vmhost's planner: a pure function (VM spec, host topology) → [`Plan`], or the exact
//! [`Reason`]s why the host cannot hold the VM.
//!
//! Nothing here touches the host: the topology is data (discovered, loaded from hwloc XML or
//! synthetic), so the same function plans for this host, for a migration target
//! ([`check_target`]) and in tests.
//!
//! ```
//! use vmhost_config::from_toml_str;
//! use vmhost_plan::{plan, PlanOptions};
//! use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg};
//!
//! let spec = from_toml_str(
//!     "[cpu]\ncores = 4\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
//!      [memory]\nguest = \"4Gi\"\nhugepages = { page_size = \"1Gi\" }\n",
//!     "vm.toml",
//! )
//! .unwrap()
//! .spec;
//! let mut host = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
//! apply_hugepages(&mut host, &parse_hugepages_arg("node0:1Gi=8,node1:1Gi=8").unwrap()).unwrap();
//! let plan = plan(&spec, &host, &PlanOptions::default()).into_result().unwrap();
//! assert_eq!(plan.vcpus.len(), 4);
//! assert!(plan.vcpus.iter().all(|v| v.host_node == Some(0)));
//! assert!(!plan.emulator.host_cpus.iter().any(|e| plan.vcpus.iter().any(|v| v.host_cpu == Some(*e))));
//! assert_eq!(plan.envelope.hugepages[0].count, 4);
//! ```
#![warn(missing_docs)]

mod cellmap;
mod cells;
pub mod devices;
mod distance;
pub mod envelope;
mod guest;
pub mod iothreads;
mod memory;
mod model;
mod nodeset;
mod placement;
mod render;
mod target;

use std::collections::BTreeSet;

use serde::Serialize;
use vmhost_config::VmSpec;
use vmhost_topology::HostTopology;

pub use distance::{CellDistances, DistanceDiff};
pub use guest::{check_identity, plan_for_guest, GuestIdentity, IdentityCell, IdentityVcpu};
pub use model::*;
pub use render::render_text;
pub use target::{check_target, check_target_identity, source_identity, TargetCheck};

/// The planner's answer (the name the migration interfaces use for [`Outcome`]).
pub type PlanOutcome = Outcome;

/// Planner settings that are not part of the VM spec.
#[derive(Debug, Clone, Default)]
pub struct PlanOptions {
    /// Which overhead model computes the envelope.
    pub overhead_model: OverheadModel,
    /// KubeVirt's cluster-wide `additionalGuestMemoryOverheadRatio`, applied last.
    pub overhead_ratio: Option<f64>,
    /// PUs that other VMs on the host hold (dedicated placement must avoid them; shared VMs
    /// do not float over them).
    pub held_cpus: BTreeSet<u32>,
    /// Refuse a plan whose host nodes are not as far apart as the guest was told its cells
    /// are ([`Reason::Distances`]); otherwise the difference is only reported
    /// ([`Plan::distances`]). Matters for [`plan_for_guest`], where the guest's distances
    /// are given; a fresh plan gives the guest the host's distances.
    pub same_distances: bool,
}

/// The planner's answer: a plan, and the reasons it does not fit (empty when it fits).
///
/// When it does not fit, placements that could not be made are `None` / empty.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// True when the host can hold the VM as planned.
    pub fits: bool,
    /// Why not, one reason per shortfall, in words.
    pub reasons: Vec<String>,
    /// The same reasons, structured.
    pub reason_details: Vec<Reason>,
    /// The plan.
    #[serde(flatten)]
    pub plan: Plan,
}

/// A plan that does not fit, with its reasons.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the host cannot hold VM {}: {}", .plan.name, .reasons.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct Rejection {
    /// The partial plan (envelope complete, placement partial).
    pub plan: Box<Plan>,
    /// Why it does not fit.
    pub reasons: Vec<Reason>,
}

impl Outcome {
    /// The plan when it fits, else the rejection.
    pub fn into_result(self) -> Result<Plan, Rejection> {
        if self.reason_details.is_empty() {
            Ok(self.plan)
        } else {
            Err(Rejection {
                plan: Box::new(self.plan),
                reasons: self.reason_details,
            })
        }
    }
}

/// How a plan's note starts when its hugepages fell back to normal pages; the rest of the note
/// is why.
pub const HUGEPAGE_FALLBACK_NOTE: &str =
    "hugepages fell back to normal pages (memory.hugepages.fallback)";

/// Plans `spec` on `host`.
///
/// A spec whose hugepages may fall back (`memory.hugepages.fallback = "normal-pages"`) and
/// that the pools or the cgroup's hugetlb limit cannot hold is planned again on normal pages,
/// with a note naming what was short; any other reason keeps the refusal.
pub fn plan(spec: &VmSpec, host: &HostTopology, opts: &PlanOptions) -> Outcome {
    let outcome = plan_as_written(spec, host, opts);
    let may_fall_back = spec
        .memory
        .hugepages
        .as_ref()
        .is_some_and(|h| h.fallback_to_normal_pages);
    let only_pages_short = !outcome.reason_details.is_empty()
        && outcome.reason_details.iter().all(|r| {
            matches!(
                r,
                Reason::Hugepages { .. }
                    | Reason::PageSizeMissing { .. }
                    | Reason::HugetlbLimit { .. }
            )
        });
    if !(may_fall_back && only_pages_short) {
        return outcome;
    }
    let mut normal = spec.clone();
    normal.memory.hugepages = None;
    let mut fallback = plan_as_written(&normal, host, opts);
    fallback.plan.notes.insert(
        0,
        format!("{HUGEPAGE_FALLBACK_NOTE}: {}", outcome.reasons.join("; ")),
    );
    fallback
}

fn plan_as_written(spec: &VmSpec, host: &HostTopology, opts: &PlanOptions) -> Outcome {
    let mut reasons = Vec::new();
    let mut notes = Vec::new();
    let mut vcpus = cells::guest_vcpus(spec);
    let mut free = placement::FreePus::new(host, &opts.held_cpus);
    let (floating_cpus, emulator, io_pool) = if spec.cpu.dedicated_cpu_placement {
        let extra =
            cells::place_dedicated(spec, host, &mut free, &mut vcpus, &mut reasons, &mut notes);
        let io_pool = extra.io_pool.clone();
        let emulator = dedicated_emulator(spec, extra, &vcpus, &mut notes);
        (Vec::new(), emulator, io_pool)
    } else {
        let (float, emulator) = shared_cpus(host, opts, &mut reasons, &mut notes);
        (float, emulator, Vec::new())
    };
    let devices =
        iothreads::device_plan(spec, &emulator, &io_pool, &free, &mut reasons, &mut notes);
    let guest_cells = cells::guest_cells(
        spec,
        host,
        opts,
        &mut vcpus,
        &floating_cpus,
        &mut reasons,
        &mut notes,
    );
    let placed = Placed {
        vcpus,
        floating_cpus,
        emulator,
        devices,
        guest_cells,
    };
    assemble(spec, host, opts, placed, reasons, notes)
}

/// What the CPU and cell stages decided; [`assemble`] completes the plan around it.
pub(crate) struct Placed {
    pub vcpus: Vec<VcpuPlacement>,
    pub floating_cpus: Vec<u32>,
    pub emulator: EmulatorPlacement,
    pub devices: devices::DevicePlan,
    pub guest_cells: Vec<GuestCell>,
}

/// The emulator placement of a dedicated VM, from the PUs [`cells::place_dedicated`] (or the
/// guest-keeping placement) took for it.
pub(crate) fn dedicated_emulator(
    spec: &VmSpec,
    extra: cells::ExtraPus,
    vcpus: &[VcpuPlacement],
    notes: &mut Vec<String>,
) -> EmulatorPlacement {
    let emu = extra.emulator;
    let isolated = spec.cpu.isolate_emulator_thread;
    let host_cpus = if isolated {
        if emu.len() == 2 {
            notes.push(format!(
                "the isolated emulator thread gets PUs {} to complete the VM's PUs to an even number (EmulatorThreadCompleteToEvenParity)",
                vmhost_topology::cpulist::format(&emu)
            ));
        }
        emu
    } else {
        notes.push(
            "the emulator thread shares the vCPUs' PUs (isolate_emulator_thread is off)".into(),
        );
        sorted(vcpus.iter().filter_map(|v| v.host_cpu))
    };
    EmulatorPlacement {
        host_cpus,
        isolated,
    }
}

/// A shared VM: its vCPUs and emulator float over the PUs no dedicated VM holds.
pub(crate) fn shared_cpus(
    host: &HostTopology,
    opts: &PlanOptions,
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> (Vec<u32>, EmulatorPlacement) {
    let float: Vec<u32> = host
        .allowed_cpus
        .iter()
        .copied()
        .filter(|c| !opts.held_cpus.contains(c))
        .collect();
    notes.push(format!(
        "vCPU threads float over PUs {} (no dedicated placement)",
        vmhost_topology::cpulist::format(&float)
    ));
    if float.is_empty() {
        reasons.push(Reason::Cpus {
            needed: 1,
            available: 0,
            detail: "a shared VM needs at least one PU that no dedicated VM holds".into(),
        });
    }
    (
        float.clone(),
        EmulatorPlacement {
            host_cpus: float,
            isolated: false,
        },
    )
}

/// The stages after placement: backing, memory admission, envelope, realtime, the distance
/// report, and the outcome.
pub(crate) fn assemble(
    spec: &VmSpec,
    host: &HostTopology,
    opts: &PlanOptions,
    placed: Placed,
    mut reasons: Vec<Reason>,
    mut notes: Vec<String>,
) -> Outcome {
    let backing = backing(spec);
    let ram = spec.memory.guest_ram_bytes();
    if ram != spec.memory.guest_bytes {
        notes.push(format!(
            "guest memory {} bytes is not a whole number of 4Ki pages: the guest gets {} bytes ({} pages); the overhead uses the exact quantity",
            spec.memory.guest_bytes,
            ram,
            ram / 4096
        ));
    }
    let hugepages = cells::hugepage_demand(&placed.guest_cells, &backing);
    cells::admit_memory(
        host,
        &placed.guest_cells,
        &backing,
        &hugepages,
        &mut reasons,
    );
    if host.distances.assumed && host.nodes.len() > 1 {
        notes.push("the host gave no distance matrix: assumed 10 local / 20 remote".into());
    }
    let mut envelope = envelope::envelope(
        spec,
        opts.overhead_model,
        opts.overhead_ratio,
        hugepages.clone(),
    )
    .unwrap_or_else(|e| {
        reasons.push(Reason::Overflow {
            field: e.field.to_string(),
            detail: format!("{} does not fit in 64 bits; use a smaller value", e.what),
        });
        Envelope::guest_only(opts.overhead_model, spec.memory.guest_bytes, hugepages)
    });
    envelope.guest_memory_bytes = ram;
    let realtime = realtime_plan(spec, &placed.vcpus, &mut notes);
    payload_devices_note(spec, &mut notes);
    let distances = distance::CellDistances::of(host, &placed.guest_cells);
    if opts.same_distances && !distances.diff.is_empty() {
        reasons.push(Reason::Distances {
            pairs: distances.diff.clone(),
        });
    }
    let plan = Plan {
        name: spec.name.clone(),
        guest_topology: spec.cpu.topology,
        envelope,
        vcpus: placed.vcpus,
        floating_cpus: placed.floating_cpus,
        emulator: placed.emulator,
        guest_cells: placed.guest_cells,
        backing,
        boot: spec.boot.clone(),
        devices: placed.devices,
        realtime,
        distances,
        notes,
    };
    Outcome {
        fits: reasons.is_empty(),
        reasons: reasons.iter().map(ToString::to_string).collect(),
        reason_details: reasons,
        plan,
    }
}

impl Outcome {
    /// True when the plan failed on invalid input (a size overflow) rather than on this host.
    pub fn invalid_input(&self) -> bool {
        self.reason_details.iter().any(Reason::is_invalid_input)
    }
}

impl Rejection {
    /// True when the input is invalid (a size overflow) rather than too large for the host.
    pub fn invalid_input(&self) -> bool {
        self.reasons.iter().any(Reason::is_invalid_input)
    }
}

impl Envelope {
    /// The envelope of a plan whose sizes could not be computed: guest memory only.
    fn guest_only(
        overhead_model: OverheadModel,
        guest_memory_bytes: u64,
        hugepages: Vec<HugepageDemand>,
    ) -> Envelope {
        Envelope {
            overhead_model,
            guest_memory_bytes,
            overhead_bytes: 0,
            overhead_terms: Default::default(),
            memory_request_bytes: 0,
            memory_limit_bytes: None,
            cpus: 0.0,
            dedicated_cpus: 0,
            hugepages,
        }
    }
}

impl Plan {
    /// True when nothing of this VM but its own vCPU thread can run on each vCPU's PU: every
    /// vCPU is pinned to a PU of its own and the emulator thread (with the API, signal and
    /// other helper threads, which inherit its affinity) is isolated on other PUs.
    ///
    /// Only then may the guest be told that its vCPUs are never preempted
    /// (`KVM_HINTS_REALTIME`); see docs/placement.md ("The KVM realtime hint").
    pub fn vcpu_pus_exclusive(&self) -> bool {
        let pinned: BTreeSet<u32> = self.vcpus.iter().filter_map(|v| v.host_cpu).collect();
        !self.vcpus.is_empty()
            && pinned.len() == self.vcpus.len()
            && self.emulator.isolated
            && !self.emulator.host_cpus.is_empty()
            && !self.emulator.host_cpus.iter().any(|c| pinned.contains(c))
    }

    /// Recomputes `envelope.hugepages` (and `guest_memory_bytes`) from the guest cells, after
    /// a caller moved cells to other nodes or resized them (benchmark scenarios do).
    pub fn refresh_memory_demand(&mut self) {
        self.envelope.hugepages = cells::hugepage_demand(&self.guest_cells, &self.backing);
        self.envelope.guest_memory_bytes = self.guest_cells.iter().map(|c| c.memory_bytes).sum();
    }

    /// A plan that holds guest memory only: `guest_cells` as given, no vCPUs, an empty
    /// overhead. For tools that allocate memory exactly as a VM would without running one
    /// (host-side benchmark baselines, memory benchmarks, tests).
    ///
    /// ```
    /// use vmhost_plan::{Backing, GuestCell, Plan};
    /// let cell = GuestCell { cell: 0, host_node: Some(0), vcpus: vec![], memory_bytes: 64 << 20,
    ///     prefault_cpus: vec![], distances: vec![10], spans: vec![] };
    /// let plan = Plan::memory_only("baseline", vec![cell], Backing::Hugetlb { page_size_bytes: 2 << 20, hugetlbfs: None });
    /// assert_eq!(plan.envelope.hugepages[0].count, 32);
    /// assert!(plan.vcpus.is_empty());
    /// ```
    pub fn memory_only(
        name: impl Into<String>,
        guest_cells: Vec<GuestCell>,
        backing: Backing,
    ) -> Plan {
        let hugepages = cells::hugepage_demand(&guest_cells, &backing);
        let guest_memory_bytes = guest_cells.iter().map(|c| c.memory_bytes).sum();
        Plan {
            name: name.into(),
            guest_topology: vmhost_config::CpuTopology {
                sockets: 1,
                cores: 1,
                threads: 1,
            },
            envelope: Envelope {
                overhead_model: OverheadModel::default(),
                guest_memory_bytes,
                overhead_bytes: 0,
                overhead_terms: Default::default(),
                memory_request_bytes: 0,
                memory_limit_bytes: None,
                cpus: 0.0,
                dedicated_cpus: 0,
                hugepages,
            },
            vcpus: Vec::new(),
            floating_cpus: Vec::new(),
            emulator: EmulatorPlacement {
                host_cpus: Vec::new(),
                isolated: false,
            },
            guest_cells,
            backing,
            boot: vmhost_config::BootSpec::Payload {
                payload: vmhost_config::Payload::Touch,
            },
            devices: devices::DevicePlan::default(),
            realtime: None,
            distances: CellDistances::default(),
            notes: Vec::new(),
        }
    }
}

/// How guest RAM is backed, from the spec.
fn backing(spec: &VmSpec) -> Backing {
    match &spec.memory.hugepages {
        Some(h) => Backing::Hugetlb {
            page_size_bytes: h.page_size_bytes,
            hugetlbfs: h.hugetlbfs.clone(),
        },
        None => Backing::Anonymous,
    }
}

/// A built-in payload gets no virtio devices: say so when the spec has some.
fn payload_devices_note(spec: &VmSpec, notes: &mut Vec<String>) {
    if matches!(spec.boot, vmhost_config::BootSpec::Payload { .. })
        && (!spec.devices.disks.is_empty()
            || !spec.devices.interfaces.is_empty()
            || spec.devices.rng)
    {
        notes.push(
            "virtio devices are attached to Linux guests only: the built-in payload runs without them (and without their I/O threads)"
                .into(),
        );
    }
}

/// `cpu.realtime`: the masked vCPUs run SCHED_FIFO on their exclusive PUs.
fn realtime_plan(
    spec: &VmSpec,
    vcpus: &[VcpuPlacement],
    notes: &mut Vec<String>,
) -> Option<RealtimePlan> {
    let list = spec.cpu.realtime_vcpus.clone()?;
    notes.push(format!(
        "realtime: vCPUs {} run SCHED_FIFO at priority {} on their PUs",
        vmhost_topology::cpulist::format(&list),
        RealtimePlan::PRIORITY
    ));
    debug_assert!(list.iter().all(|&v| (v as usize) < vcpus.len()));
    Some(RealtimePlan {
        vcpus: list,
        priority: RealtimePlan::PRIORITY,
    })
}

fn sorted(it: impl Iterator<Item = u32>) -> Vec<u32> {
    let set: BTreeSet<u32> = it.collect();
    set.into_iter().collect()
}

#[cfg(test)]
mod guest_tests;
#[cfg(test)]
mod pod_tests;
#[cfg(test)]
mod tests;
