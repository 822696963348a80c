//! Prefaulting while the guest already runs.
//!
//! By default ([`PrefaultTiming::BeforeStart`]) [`GuestMemory::new`](crate::GuestMemory::new)
//! returns only once every page is faulted in on its node. With
//! [`PrefaultTiming::Background`] it returns after the bind step, and
//! [`GuestMemory::start_background_prefault`](crate::GuestMemory::start_background_prefault)
//! runs the same pinned workers on a `vmhost-prefault` thread while the VMM goes on (creating
//! the VM, loading the kernel, running the vCPUs);
//! [`start_background_prefault_at`](crate::GuestMemory::start_background_prefault_at) holds
//! them back until a [`StartGate`] opens (vmhost opens it once the guest runs). The guest's
//! own first touches and the workers' populate calls race harmlessly: both fault pages in
//! under the same `mbind` policy, and a populate call leaves pages that are already present
//! alone. When the workers are done the thread audits residency and hands both to the
//! caller's completion callback.
//!
//! The handle cancels the workers (after their chunk in progress) and joins the thread when it
//! is dropped, before the guest RAM can be unmapped: the thread holds its own references to
//! the mappings, so they stay valid while it runs either way.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use crate::audit::{self, Audit};
use crate::backing::MappedRegion;
use crate::policy::PolicyOverride;
use crate::prefault::{self, CellTarget, PrefaultOptions, PrefaultStats};
use crate::MemoryError;

/// The workers' chunk in the background: what a cancel waits for at most (one 2 MiB
/// hugepage's or 512 small pages' zeroing per worker, well under a millisecond).
const CHUNK_BYTES: u64 = 2 << 20;

/// When guest RAM is faulted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrefaultTiming {
    /// Every page before the guest's first instruction (the default): no fault ever happens
    /// in the running guest, at the price of the start-up time of zeroing all of its RAM.
    #[default]
    BeforeStart,
    /// Pinned workers fault the RAM in while the guest boots: a shorter start, and the same
    /// end state (every page present on its node, audited) once the workers are done.
    Background,
}

/// What the background prefault did, handed to the completion callback.
#[derive(Debug, Clone)]
pub struct BackgroundDone {
    /// What the workers did.
    pub stats: PrefaultStats,
    /// Residency read back right after the workers finished.
    pub audit: Audit,
    /// Seconds from the start of the background prefault to its end.
    pub seconds: f64,
}

/// The completion callback: the outcome of the prefault and its audit, or why it failed
/// (including [`PrefaultError::Cancelled`](crate::PrefaultError::Cancelled) when the handle
/// was dropped first).
pub type OnDone = Box<dyn FnOnce(Result<BackgroundDone, MemoryError>) + Send>;

/// Holds a background prefault's workers back until it is opened. A VMM opens it once its
/// guest runs, so that building the VM and loading the kernel (which fault their own pages
/// in) do not compete with the workers for the node's CPUs; the guest's boot then shares
/// them instead, as it would share them with its own first touches. Dropping the guest
/// memory cancels the prefault and opens the gate, so a VM that never started ends at once;
/// [`StartGate::cancel`] does the same from the VMM's side as soon as the guest has ended,
/// before the guest memory goes (its workers stop after their chunk in progress).
#[derive(Debug, Clone, Default)]
pub struct StartGate(Arc<(Mutex<bool>, Condvar)>, Arc<AtomicBool>);

impl StartGate {
    /// A closed gate.
    pub fn new() -> StartGate {
        StartGate::default()
    }

    /// Lets the workers go (again: a no-op).
    pub fn open(&self) {
        let (open, cv) = &*self.0;
        *open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        cv.notify_all();
    }

    /// Stops the prefault behind the gate (its outcome is then
    /// [`PrefaultError::Cancelled`](crate::PrefaultError::Cancelled)) and opens the gate: for
    /// a guest that has ended, whose RAM nobody will use.
    pub fn cancel(&self) {
        self.1.store(true, Ordering::SeqCst);
        self.open();
    }

    /// The flag [`StartGate::cancel`] sets.
    fn cancel_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.1)
    }

    /// Blocks until the gate is open.
    fn wait(&self) {
        let (open, cv) = &*self.0;
        let mut g = open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while !*g {
            g = cv
                .wait(g)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// One cell (or host-node part of a cell): its run of regions and the CPUs of its node.
#[derive(Debug, Clone)]
pub(crate) struct OwnedTarget {
    pub(crate) cell: u32,
    pub(crate) regions: std::ops::Range<usize>,
    pub(crate) cpus: Vec<u32>,
}

/// Borrowed prefault targets over `regions`.
pub(crate) fn borrow_targets<'a>(
    targets: &'a [OwnedTarget],
    regions: &'a [MappedRegion],
) -> Vec<CellTarget<'a>> {
    targets
        .iter()
        .map(|t| CellTarget {
            cell: t.cell,
            regions: &regions[t.regions.clone()],
            cpus: &t.cpus,
        })
        .collect()
}

/// What the background thread needs, owned.
pub(crate) struct Job {
    pub(crate) vm: String,
    pub(crate) regions: Vec<MappedRegion>,
    pub(crate) targets: Vec<OwnedTarget>,
    pub(crate) options: PrefaultOptions,
    pub(crate) hugetlb: bool,
    pub(crate) policy: Option<PolicyOverride>,
    /// Opened before the workers start (an open gate when the caller gave none).
    pub(crate) gate: StartGate,
}

/// A running background prefault; dropping it cancels and joins it.
#[derive(Debug)]
pub(crate) struct BackgroundPrefault {
    /// Holds the cancel flag the workers read.
    gate: StartGate,
    thread: Option<JoinHandle<()>>,
}

impl BackgroundPrefault {
    /// Starts the `vmhost-prefault` thread for `job`; `on_done` runs on it at the end. Its
    /// workers stop at the gate's cancel and take small chunks, so that a VM that ends while
    /// its RAM is still being faulted in waits for one chunk at most (a 64 MiB chunk is ~7 ms
    /// of zeroing here).
    pub(crate) fn start(mut job: Job, on_done: OnDone) -> Result<Self, std::io::Error> {
        job.options.cancel = Some(job.gate.cancel_flag());
        job.options.chunk_bytes = job.options.chunk_bytes.min(CHUNK_BYTES);
        let gate = job.gate.clone();
        let thread = std::thread::Builder::new()
            .name("vmhost-prefault".into())
            .spawn(move || {
                job.gate.wait();
                on_done(run(&job))
            })?;
        Ok(BackgroundPrefault {
            gate,
            thread: Some(thread),
        })
    }
}

fn run(job: &Job) -> Result<BackgroundDone, MemoryError> {
    let start = Instant::now();
    let targets = borrow_targets(&job.targets, &job.regions);
    let stats =
        prefault::prefault(&targets, &job.options).map_err(|source| MemoryError::Prefault {
            vm: job.vm.clone(),
            source,
        })?;
    let seconds = start.elapsed().as_secs_f64();
    // The workers are done (they were spawned unfiltered, each then installed its own): the
    // rest of this thread's life is the audit and the caller's report.
    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::PrefaultAudit);
    let regions: Vec<&MappedRegion> = job.regions.iter().collect();
    let audit =
        audit::audit_with_policy(&regions, job.hugetlb, job.policy.as_ref()).map_err(|source| {
            MemoryError::Audit {
                vm: job.vm.clone(),
                source,
            }
        })?;
    Ok(BackgroundDone {
        stats,
        audit,
        seconds,
    })
}

impl Drop for BackgroundPrefault {
    fn drop(&mut self) {
        // The flag first, then the gate: a thread still at the gate finds it set and ends at
        // once.
        self.gate.cancel();
        if let Some(thread) = self.thread.take() {
            // A panicking worker is reported by `prefault` itself; the thread has no value.
            let _ = thread.join();
        }
    }
}
