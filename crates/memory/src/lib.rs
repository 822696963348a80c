//! vmhost's guest memory: from a [`Plan`] to guest RAM that is allocated, bound to the right
//! host NUMA node, faulted in there, laid out in guest-physical order, and audited.
//!
//! One backing file per guest cell: `memfd_create(MFD_HUGETLB)` by default, a file on a
//! hugetlbfs mount when the plan names one, or a plain memfd with transparent hugepages
//! requested for anonymous backing. Mappings are `MAP_SHARED`; hugepages are reserved when
//! mapped, so a short pool fails at start, not with a `SIGBUS` in a running guest.
//!
//! [`GuestMemory::new`] runs the steps in order, each timed:
//! 1. **admission** ([`host`]): the plan is re-checked against the live pools, the nodes and the
//!    hugetlbfs mount; bad input fails here, before anything is allocated;
//! 2. **allocate** ([`backing`]): backing files are created and mapped, reserving hugepages;
//! 3. **bind**: each mapping gets `mbind(MPOL_BIND, node)` before its first touch (or the
//!    [`PolicyOverride`] of [`MemoryOptions::policy_override`], e.g. `MPOL_INTERLEAVE`);
//! 4. **prefault** ([`prefault`]): pinned workers on each cell's node fault every page in —
//!    before `new` returns, or, with [`PrefaultTiming::Background`], on a thread started by
//!    [`GuestMemory::start_background_prefault`] while the guest boots ([`background`]).
//!
//! If a step fails, everything allocated so far is released before the error is returned (all
//! resources are owned values, dropped on the error path). [`GuestMemory::audit`] then reads
//! back where every page sits ([`audit`]); [`run_report`] does all of it plus the audit and the
//! release, for `vmhost memory`.
//!
//! ```
//! use vmhost_memory::{GuestMemory, MemoryOptions};
//! use vmhost_plan::Backing;
//! use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
//! # use std::collections::BTreeMap;
//! # use vmhost_config::{BootSpec, CpuTopology, Payload};
//! # use vmhost_plan::{EmulatorPlacement, Envelope, GuestCell, OverheadModel, Plan};
//! # let cell = GuestCell {
//! #     cell: 0, host_node: Some(0), vcpus: vec![0], memory_bytes: 16 << 20,
//! #     prefault_cpus: vec![], distances: vec![10], spans: vec![],
//! # };
//! # let plan = Plan {
//! #     name: "doc".into(),
//! #     guest_topology: CpuTopology { sockets: 1, cores: 1, threads: 1 },
//! #     envelope: Envelope {
//! #         overhead_model: OverheadModel::default(), guest_memory_bytes: 16 << 20,
//! #         overhead_bytes: 0, overhead_terms: BTreeMap::new(), memory_request_bytes: 0,
//! #         memory_limit_bytes: None, cpus: 1.0, dedicated_cpus: 0, hugepages: vec![],
//! #     },
//! #     vcpus: vec![], floating_cpus: vec![],
//! #     emulator: EmulatorPlacement { host_cpus: vec![], isolated: false },
//! #     guest_cells: vec![cell], backing: Backing::Anonymous,
//! #     boot: BootSpec::Payload { payload: Payload::Touch }, realtime: None, devices: Default::default(), distances: Default::default(), notes: vec![],
//! # };
//! // A one-cell plan bound to host node 0, anonymous backing (no hugepages needed here).
//! assert_eq!(plan.backing, Backing::Anonymous);
//! let mem = GuestMemory::new(&plan, &MemoryOptions::default()).unwrap();
//! assert_eq!(mem.memory().num_regions(), 1);
//! assert_eq!(mem.layout().ram_end(), 16 << 20);
//! mem.memory().write_obj(0xdead_beef_u32, GuestAddress(0x1000)).unwrap();
//!
//! let audit = mem.audit().unwrap();
//! assert!(audit.is_clean(), "{:?}", audit.violations().collect::<Vec<_>>());
//! assert_eq!(audit.regions[0].fraction_on_node(), 1.0);
//! assert_eq!(audit.regions[0].policy, "bind:0");
//! ```
#![warn(missing_docs)]

pub mod audit;
pub mod background;
pub mod backing;
pub mod cells;
pub mod dirty;
pub mod host;
pub mod layout;
pub mod load;
pub mod policy;
pub mod prefault;
mod report;
pub mod sys;
#[cfg(test)]
mod testutil;

use std::fs::File;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use vm_memory::GuestRegionCollectionError;
use vmhost_plan::{Backing, Plan};

pub use audit::{Audit, AuditError, RegionAudit, Violation};
pub use background::{BackgroundDone, OnDone, PrefaultTiming, StartGate};
pub use backing::{BackingError, MappedRegion};
pub use cells::{CellIoError, CellLoaded, CellSaved};
pub use dirty::{DirtyBitmap, DirtyRuns, DIRTY_PAGE_BYTES};
pub use host::{Admission, AdmissionError, HostState};
pub use layout::{GuestLayout, LayoutError, LayoutRegion, MMIO_HOLE_END, MMIO_HOLE_START};
pub use load::CellSource;
pub use policy::PolicyOverride;
pub use prefault::{
    PrefaultError, PrefaultMethod, PrefaultOptions, PrefaultStats, Progress, ProgressHook,
};
pub use report::{run_report, MemoryReport, Step, StepTime};

/// Guest RAM as vmhost maps it: vm-memory's mapping with a dirty bitmap per region
/// ([`AtomicBitmap`], one bit per host page). Every write the VMM makes through vm-memory (a
/// device filling a buffer, a used-ring update) sets its pages' bits, so live migration can
/// resend them: KVM's dirty log sees only the guest's own writes.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>;
/// One region of [`GuestMemoryMmap`].
pub type GuestRegionMmap = vm_memory::GuestRegionMmap<AtomicBitmap>;
pub use vm_memory::bitmap::AtomicBitmap;

/// Why guest memory could not be set up; each variant names the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The admission re-check failed: nothing was allocated.
    #[error("VM {vm}: guest memory does not fit this host now")]
    Admission {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: AdmissionError,
    },
    /// The guest-physical layout could not be made: nothing was allocated.
    #[error("VM {vm}: cannot lay out guest memory")]
    Layout {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: LayoutError,
    },
    /// Creating, mapping or binding a backing failed; what was allocated has been released.
    #[error("VM {vm}: cannot allocate guest memory")]
    Backing {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: BackingError,
    },
    /// Prefaulting failed; all guest memory has been released.
    #[error("VM {vm}: cannot prefault guest memory")]
    Prefault {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: PrefaultError,
    },
    /// vm-memory rejected the regions.
    #[error("VM {vm}: cannot assemble the guest memory regions")]
    Regions {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: GuestRegionCollectionError,
    },
    /// The residency audit failed.
    #[error("VM {vm}: cannot audit guest memory residency")]
    Audit {
        /// VM name.
        vm: String,
        /// The cause.
        #[source]
        source: AuditError,
    },
}

/// Settings of [`GuestMemory::new`].
#[derive(Debug, Clone)]
pub struct MemoryOptions {
    /// Prefault settings.
    pub prefault: PrefaultOptions,
    /// Whether [`GuestMemory::new`] prefaults, or leaves it to
    /// [`GuestMemory::start_background_prefault`] (default: before the start).
    pub timing: PrefaultTiming,
    /// Where the host's sysfs is read (default `/sys`).
    pub host: HostState,
    /// The guest-physical hole below 4 GiB kept free of RAM (default
    /// [`MMIO_HOLE_START`]..[`MMIO_HOLE_END`]); its bounds must be multiples of the page size.
    pub mmio_hole: Range<u64>,
    /// A memory policy for every cell instead of `MPOL_BIND` to the cell's node (default
    /// `None`); the audit then expects this policy and accepts pages on its nodes.
    pub policy_override: Option<PolicyOverride>,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            prefault: PrefaultOptions::default(),
            timing: PrefaultTiming::default(),
            host: HostState::default(),
            mmio_hole: MMIO_HOLE_START..MMIO_HOLE_END,
            policy_override: None,
        }
    }
}

/// Guest RAM of one VM: mapped, bound, prefaulted; released on drop.
#[derive(Debug)]
pub struct GuestMemory {
    // First: a background prefault is cancelled and joined before anything else goes.
    background: Option<background::BackgroundPrefault>,
    /// Set while a background prefault is still to be started.
    deferred: Option<PrefaultOptions>,
    name: String,
    memory: GuestMemoryMmap,
    layout: GuestLayout,
    regions: Vec<MappedRegion>,
    targets: Vec<background::OwnedTarget>,
    hugetlb: bool,
    policy: Option<PolicyOverride>,
    admission: Admission,
    prefault: PrefaultStats,
    timings: Vec<StepTime>,
}

fn timed<T>(timings: &mut Vec<StepTime>, step: Step, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    timings.push(StepTime {
        step,
        seconds: start.elapsed().as_secs_f64(),
    });
    out
}

/// Creates every cell's backing file and maps its layout regions (reserving hugepages).
fn allocate(plan: &Plan, layout: &GuestLayout) -> Result<Vec<MappedRegion>, BackingError> {
    let mut cells: Vec<_> = plan.guest_cells.iter().collect();
    cells.sort_by_key(|c| c.cell);
    let mut regions = Vec::with_capacity(layout.regions.len());
    for cell in cells {
        let file: Arc<File> = Arc::new(backing::create_file(
            &plan.name,
            cell.cell,
            cell.memory_bytes,
            &plan.backing,
        )?);
        for l in layout.cell_regions(cell.cell) {
            regions.push(backing::map_region(&file, *l, &plan.backing)?);
        }
    }
    regions.sort_by_key(|r| r.layout.gpa);
    Ok(regions)
}

/// The prefault targets of `regions`: one per cell, or per host-node part of a cell bound to
/// several nodes, each with its node's CPUs.
fn prefault_targets(plan: &Plan, regions: &[MappedRegion]) -> Vec<background::OwnedTarget> {
    let mut cells: Vec<_> = plan.guest_cells.iter().collect();
    cells.sort_by_key(|c| c.cell);
    let mut targets = Vec::with_capacity(cells.len());
    let mut at = 0;
    // Regions are in GPA order and cells are laid out in cell order, each cell's parts
    // (one per host node) in order, so each part's regions are the next run of the slice;
    // its workers run on its own node's CPUs.
    for c in cells {
        for part in c.memory_parts() {
            let n = regions[at..]
                .iter()
                .take_while(|r| r.layout.cell == c.cell && r.layout.host_node == part.host_node)
                .count();
            targets.push(background::OwnedTarget {
                cell: c.cell,
                regions: at..at + n,
                cpus: part.prefault_cpus.to_vec(),
            });
            at += n;
        }
    }
    targets
}

impl GuestMemory {
    /// Allocates, binds and prefaults the guest memory of `plan` (with
    /// [`PrefaultTiming::Background`]: allocates and binds; see
    /// [`start_background_prefault`](Self::start_background_prefault)).
    ///
    /// Fails before allocating anything when the plan does not fit the host as it is now
    /// (pools, nodes, page sizes, hugetlbfs mount, page multiples); on a later failure all
    /// memory allocated so far is released before returning.
    pub fn new(plan: &Plan, opts: &MemoryOptions) -> Result<GuestMemory, MemoryError> {
        let vm = || plan.name.clone();
        let mut timings = Vec::new();
        let admission = timed(&mut timings, Step::Admission, || {
            if let Some(policy) = &opts.policy_override {
                host::check_policy(policy, &opts.host)?;
            }
            host::check_admission(plan, &opts.host)
        })
        .map_err(|source| MemoryError::Admission { vm: vm(), source })?;
        let layout = GuestLayout::from_plan(plan, opts.mmio_hole.clone())
            .map_err(|source| MemoryError::Layout { vm: vm(), source })?;
        let regions = timed(&mut timings, Step::Allocate, || allocate(plan, &layout))
            .map_err(|source| MemoryError::Backing { vm: vm(), source })?;
        timed(&mut timings, Step::Bind, || {
            regions
                .iter()
                .try_for_each(|r| backing::apply_policy(r, opts.policy_override.as_ref()))
        })
        .map_err(|source| MemoryError::Backing { vm: vm(), source })?;
        let targets = prefault_targets(plan, &regions);
        let memory = GuestMemoryMmap::from_arc_regions(
            regions.iter().map(|r| Arc::clone(&r.region)).collect(),
        )
        .map_err(|source| MemoryError::Regions { vm: vm(), source })?;
        let mut guest = GuestMemory {
            background: None,
            deferred: Some(opts.prefault.clone()),
            name: plan.name.clone(),
            memory,
            layout,
            regions,
            targets,
            hugetlb: matches!(plan.backing, Backing::Hugetlb { .. }),
            policy: opts.policy_override.clone(),
            admission,
            prefault: PrefaultStats {
                method: opts.prefault.method,
                cells: Vec::new(),
            },
            timings,
        };
        if opts.timing == PrefaultTiming::BeforeStart {
            if let Some(done) = guest.prefault_deferred()? {
                guest.mark_prefaulted(done);
            }
        }
        Ok(guest)
    }

    /// Starts the prefault that [`PrefaultTiming::Background`] deferred, on a
    /// `vmhost-prefault` thread; `on_done` runs there with the outcome and the residency audit
    /// read right after it. Dropping the guest memory first cancels the workers and joins the
    /// thread (`on_done` then gets [`PrefaultError::Cancelled`]). Returns `Ok(false)` when
    /// there is nothing to start (the RAM was prefaulted by `new`, or this was called before).
    pub fn start_background_prefault(&mut self, on_done: OnDone) -> Result<bool, MemoryError> {
        let gate = StartGate::new();
        gate.open();
        self.start_background_prefault_at(on_done, gate)
    }

    /// Runs the prefault that [`PrefaultTiming::Background`] deferred here and now, with this
    /// thread's workers pinned to each cell's node, while other threads may be writing guest
    /// RAM: both prefault methods leave a page's bytes as they are (`MADV_POPULATE_WRITE`
    /// faults in only what is missing; the touch loop adds zero atomically). A migration
    /// target runs it beside the page receivers, so the rounds need not wait for the zeroing
    /// of RAM they will overwrite anyway. Returns what the workers did and how long it took;
    /// hand both to [`mark_prefaulted`](Self::mark_prefaulted). Nothing deferred: `None`.
    pub fn prefault_deferred(&self) -> Result<Option<(PrefaultStats, f64)>, MemoryError> {
        let Some(options) = &self.deferred else {
            return Ok(None);
        };
        let started = Instant::now();
        let borrowed = background::borrow_targets(&self.targets, &self.regions);
        let stats =
            prefault::prefault(&borrowed, options).map_err(|source| MemoryError::Prefault {
                vm: self.name.clone(),
                source,
            })?;
        Ok(Some((stats, started.elapsed().as_secs_f64())))
    }

    /// Records a [`prefault_deferred`](Self::prefault_deferred) that completed: the RAM now
    /// counts as prefaulted before the start (nothing is left for a background prefault).
    pub fn mark_prefaulted(&mut self, (stats, seconds): (PrefaultStats, f64)) {
        self.deferred = None;
        self.prefault = stats;
        self.timings.push(StepTime {
            step: Step::Prefault,
            seconds,
        });
    }

    /// [`start_background_prefault`](Self::start_background_prefault), with the workers held
    /// back until `gate` is opened (or the guest memory dropped).
    pub fn start_background_prefault_at(
        &mut self,
        on_done: OnDone,
        gate: StartGate,
    ) -> Result<bool, MemoryError> {
        let Some(options) = self.deferred.take() else {
            return Ok(false);
        };
        let job = background::Job {
            vm: self.name.clone(),
            regions: self.regions.clone(),
            targets: self.targets.clone(),
            options,
            hugetlb: self.hugetlb,
            policy: self.policy.clone(),
            gate,
        };
        let started = background::BackgroundPrefault::start(job, on_done).map_err(|source| {
            MemoryError::Prefault {
                vm: self.name.clone(),
                source: PrefaultError::Spawn { cell: 0, source },
            }
        })?;
        self.background = Some(started);
        Ok(true)
    }

    /// The guest RAM, one region per layout region (one KVM memslot each).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// The guest-physical layout, for e820 and ACPI SRAT.
    pub fn layout(&self) -> &GuestLayout {
        &self.layout
    }

    /// The mapped regions with their cells and nodes, in guest-physical order.
    pub fn regions(&self) -> &[MappedRegion] {
        &self.regions
    }

    /// The pools the plan was admitted against.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// What prefaulting did.
    pub fn prefault_stats(&self) -> &PrefaultStats {
        &self.prefault
    }

    /// Time taken by each step so far.
    pub fn timings(&self) -> &[StepTime] {
        &self.timings
    }

    /// The memory-policy override in force (`None`: each cell bound to its node).
    pub fn policy_override(&self) -> Option<&PolicyOverride> {
        self.policy.as_ref()
    }

    /// Writes guest cell `cell` as page runs on `out`, leaving out pages that were never
    /// faulted in (without faulting them in), all-zero pages, and pages `skip(offset in the
    /// cell, bytes)` rejects ([`cells::save_cell`]). Meant for a paused guest.
    pub fn save_cell<W: std::io::Write>(
        &self,
        cell: u32,
        out: &mut vmhost_persist::container::Writer<W>,
        skip: impl FnMut(u64, &[u8]) -> bool,
    ) -> Result<CellSaved, CellIoError> {
        cells::save_cell(&self.regions, cell, out, skip)
    }

    /// A live migration's dirty round of cell `cell`: the pages `dirty` marks, zero ones
    /// included ([`cells::save_cell_dirty`]).
    pub fn save_cell_dirty<W: std::io::Write>(
        &self,
        cell: u32,
        out: &mut vmhost_persist::container::Writer<W>,
        dirty: &DirtyBitmap,
    ) -> Result<CellSaved, CellIoError> {
        cells::save_cell_dirty(&self.regions, cell, out, dirty)
    }

    /// Loads every cell of `plan` (the plan this memory was made for) from its memory file,
    /// `(cell, reader)` for each, by one worker per cell pinned to the PUs of the cell's
    /// node(s), so the pages are written where the new plan put them ([`cells::load_cells`]).
    pub fn load_cells<R: load::CellSource>(
        &self,
        plan: &Plan,
        files: Vec<(u32, R)>,
    ) -> Result<Vec<CellLoaded>, CellIoError> {
        cells::load_cells(&self.regions, plan, files)
    }

    /// Reads back where every page of guest RAM sits, and the policy in force.
    pub fn audit(&self) -> Result<Audit, AuditError> {
        let regions: Vec<&MappedRegion> = self.regions.iter().collect();
        audit::audit_with_policy(&regions, self.hugetlb, self.policy.as_ref())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn guest_memory_can_move_to_the_vm_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<super::GuestMemory>();
        send_sync::<super::MemoryReport>();
    }
}
