//! Guest RAM for the run: allocated, bound and prefaulted per the plan, and filled from a
//! snapshot's memory files or a migration's rounds, the prefault beside the loaders or the
//! receivers; then the ledger told and the residency read back.

use std::sync::Arc;

use anyhow::{Context, Result};
use vmhost_config::{BootSpec, Payload, VmSpec};
use vmhost_memory::{
    Audit, GuestMemory, MemoryError, MemoryOptions, PrefaultError, PrefaultTiming,
};
use vmhost_plan::Plan;
use vmhost_vcpu::{VmHandle, VmShell};

use super::{serve_api, ApiView, RunOptions, Start};
use crate::background::Background;
use crate::enforce::{Enforcement, EXIT_LIMIT};
use crate::signals::{StopSignals, EXIT_INTERRUPTED};
use crate::timeline::{now_ns, Timeline};

/// Guest RAM ready for the VM, and what a migration target made while its rounds arrived.
pub(super) struct ReadyMemory {
    pub(super) memory: GuestMemory,
    /// A migration target's VM shell ([`fill_memory`]).
    pub(super) shell: Option<VmShell>,
    /// A migration target's residency audit, read while the rounds arrived.
    pub(super) early: Option<Audit>,
    /// A migration target's control API, served then.
    pub(super) api: Option<vmhost_api::ApiServer>,
}

/// Guest RAM allocated, bound, prefaulted and filled from the snapshot or the migration;
/// `Err(Stopped)` when a stop signal cancelled the prefault.
pub(super) fn ready_memory(
    (spec, plan, admission): (&VmSpec, &Plan, &crate::vms::Admission),
    (enforcement, signals): (&Option<Arc<Enforcement>>, &StopSignals),
    opts: &RunOptions,
    handle: &VmHandle,
    start: &mut Start,
) -> Result<Result<ReadyMemory, Stopped>> {
    // A migration target prefaults its RAM while the rounds arrive, a restore while its
    // memory files load: allocated and bound here, faulted in beside the receivers or the
    // loaders.
    let beside = !matches!(start, Start::Boot) && opts.prefault == PrefaultTiming::BeforeStart;
    let timing = match beside {
        true => PrefaultTiming::Background,
        false => opts.prefault,
    };
    let mut memory = match guest_memory(plan, enforcement.as_deref(), signals, timing)? {
        Ok(memory) => memory,
        Err(stopped) => return Ok(Err(stopped)),
    };
    start.mark_step("memory bound");
    // A boot, a start whose prefault is done or left to the background, or a restore whose
    // prefault runs beside its loaders; a migration target's is below.
    if !beside || matches!(start, Start::Restore { .. }) {
        let prefault = || match beside {
            true => prefault_now(&memory, enforcement.as_deref()),
            false => Ok(Ok(None)),
        };
        let (shell, done) = fill_memory(&memory, plan, start, opts, prefault)?;
        match done {
            Some(Ok(Some(done))) => memory.mark_prefaulted(done),
            Some(Err(stopped)) => return Ok(Err(stopped)),
            Some(Ok(None)) | None => {}
        }
        let (early, api) = (None, None);
        return Ok(Ok(ReadyMemory {
            memory,
            shell,
            early,
            api,
        }));
    }
    let (shell, (done, audit), api) = target_memory(
        (spec, plan, admission),
        &memory,
        handle,
        start,
        (enforcement, opts),
    )?;
    if let Some(done) = done {
        memory.mark_prefaulted(done);
    }
    let early = Some(audit);
    Ok(Ok(ReadyMemory {
        memory,
        shell,
        early,
        api,
    }))
}

/// What a migration target did to its RAM while the rounds arrived: the prefault's outcome
/// and time (`None`: nothing was deferred), and the residency audit read after it.
type EarlyMemory = (Option<(vmhost_memory::PrefaultStats, f64)>, Audit);

/// A migration target's RAM prefaulted (`--prefault before-start`), recorded in the ledger
/// and audited while the rounds arrive, and its API served then: the pages do not move when
/// the rounds write them, and the source pauses only after the last round, so none of this
/// holds the rounds back or is in the guest's downtime. An API socket that cannot be served
/// fails the move before the commit (the source runs on). The VM's shell, the prefault's
/// outcome and time with the audit, and the API.
fn target_memory(
    (spec, plan, admission): (&VmSpec, &Plan, &crate::vms::Admission),
    memory: &GuestMemory,
    handle: &VmHandle,
    start: &mut Start,
    (enforcement, opts): (&Option<Arc<Enforcement>>, &RunOptions),
) -> Result<(Option<VmShell>, EarlyMemory, Option<vmhost_api::ApiServer>)> {
    let (shell, early) = fill_memory(memory, plan, start, opts, || {
        let done = memory.prefault_deferred()?;
        let audit = taken(memory, admission)?;
        let view = ApiView::new(spec, plan, &audit, handle, memory.regions().to_vec());
        let api = serve_api(view, enforcement.as_ref(), opts)?;
        Ok((done, audit, api))
    })?;
    let (done, audit, api) = early.context("the rounds ended before the memory was ready")?;
    Ok((shell, (done, audit), api))
}

/// After guest RAM is filled (or, for a boot, allocated): starts the background prefault
/// that `--prefault background` deferred, or else narrows the cgroup's cpuset to the envelope
/// (after a migration target's rounds: its receivers run on their cells' nodes, outside the
/// envelope's PUs); then the ledger entry and the residency audit ([`taken`]) unless they
/// were done `early`.
pub(super) fn settle_memory(
    memory: &mut GuestMemory,
    plan: &Plan,
    enforcement: &Option<Arc<Enforcement>>,
    admission: &crate::vms::Admission,
    early: Option<Audit>,
    opts: &RunOptions,
    timeline: &mut Timeline,
) -> Result<(Option<Background>, Audit)> {
    let background = Background::start(memory, plan, enforcement.as_ref(), !opts.json)
        .context("starting the background prefault")?;
    if background.is_none() {
        if let Some(e) = enforcement {
            e.narrow_after_prefault()?;
        }
        timeline.memory_ready_ns = now_ns();
    }
    let audit = match early {
        Some(audit) => audit,
        None => taken(memory, admission)?,
    };
    Ok((background, audit))
}

/// Guest RAM allocated: the ledger told that its pages are taken, and their residency read
/// back. With a background prefault still running the audit shows the layout and what is
/// faulted in so far; the report's audit is then the one read when the prefault ended.
fn taken(memory: &GuestMemory, admission: &crate::vms::Admission) -> Result<Audit> {
    admission.running()?;
    memory.audit().context("auditing guest memory residency")
}

/// Fills guest memory from the snapshot or the migration source before the VM exists. A
/// migration target builds its VM's shell meanwhile, on another thread ([`VmShell`]: the KVM
/// VM, memslots, irqchip, CPUID), so that only the state is loaded while the source is paused.
///
/// A migration target runs `meanwhile` on this thread while the rounds arrive, a restore while
/// its memory files load, and returns its result; a boot does not run it.
fn fill_memory<T>(
    memory: &GuestMemory,
    plan: &Plan,
    start: &mut Start,
    opts: &RunOptions,
    meanwhile: impl FnOnce() -> Result<T>,
) -> Result<(Option<VmShell>, Option<T>)> {
    match start {
        Start::Boot => Ok((None, None)),
        // The memory files are checked as they load, before `/dev/kvm` is opened for the
        // host check: a damaged one is refused before either. `meanwhile` runs on this thread
        // as they load (by a short-lived coordinator thread, `vmhost-load`, whose workers
        // install their own filters, as `vmhost-shell` below).
        Start::Restore {
            restored: r, steps, ..
        } => {
            let r: &crate::restore::Restored = r;
            let early = std::thread::scope(|scope| {
                let load = std::thread::Builder::new()
                    .name("vmhost-load".into())
                    .spawn_scoped(scope, || {
                        crate::restore::load_memory(memory, plan, r, opts.json)
                    })
                    .context("starting the thread that loads the snapshot's memory")?;
                let early = meanwhile();
                load.join().map_err(|_| {
                    anyhow::anyhow!("the thread that loads the snapshot's memory panicked")
                })??;
                early
            })?;
            steps.mark("loaded and prefaulted");
            crate::restore::check_this_host(r)?;
            steps.mark("host checked");
            Ok((None, Some(early)))
        }
        Start::Incoming(inc) => std::thread::scope(|scope| {
            let shell = std::thread::Builder::new()
                .name("vmhost-shell".into())
                .spawn_scoped(scope, || {
                    VmShell::build(plan, memory, opts.mask_nested_cpuid)
                })
                .context("starting the thread that builds the VM")?;
            let received = inc
                .receive(memory, plan, meanwhile)
                .context("receiving the migrating VM");
            if !opts.json {
                eprintln!("vmhost: receive: {}", inc.arriving_line());
            }
            let shell = shell
                .join()
                .map_err(|_| anyhow::anyhow!("the thread that builds the VM panicked"))?;
            let early = received?;
            let shell = shell.context("building the VM for the incoming guest")?;
            Ok((shell, Some(early)))
        }),
    }
}

/// A prefault a stop signal cancelled: how far it got.
pub(super) struct Stopped {
    done: u64,
    total: u64,
}

/// The prefault [`guest_memory`] deferred, done now: its outcome and time (`None`: nothing
/// was deferred), or `Err(Stopped)` when a stop signal cancelled it.
fn prefault_now(
    memory: &GuestMemory,
    enforcement: Option<&Enforcement>,
) -> Result<Result<Option<(vmhost_memory::PrefaultStats, f64)>, Stopped>> {
    memory
        .prefault_deferred()
        .map_or_else(|e| memory_failure(e, enforcement), |done| Ok(Ok(done)))
}

/// Allocates, binds and prefaults the guest memory; `Err(Stopped)` when a stop signal
/// cancelled the prefault. A failure at the envelope's memory limit is exit status 5 with the
/// limit named.
fn guest_memory(
    plan: &Plan,
    enforcement: Option<&Enforcement>,
    signals: &StopSignals,
    timing: PrefaultTiming,
) -> Result<Result<GuestMemory, Stopped>> {
    let mut options = MemoryOptions {
        timing,
        ..MemoryOptions::default()
    };
    options.prefault.cancel = Some(signals.cancel_flag());
    GuestMemory::new(plan, &options).map_or_else(|e| memory_failure(e, enforcement), |m| Ok(Ok(m)))
}

/// A guest memory error: `Ok(Err(Stopped))` for a prefault a stop signal cancelled; exit
/// status 5 with the limit named at the envelope's memory limit; else the error.
fn memory_failure<T>(
    e: MemoryError,
    enforcement: Option<&Enforcement>,
) -> Result<Result<T, Stopped>> {
    if let MemoryError::Prefault {
        source: PrefaultError::Cancelled { done, total },
        ..
    } = e
    {
        return Ok(Err(Stopped { done, total }));
    }
    if let Some(msg) = enforcement.and_then(Enforcement::limit_reached) {
        let err = anyhow::Error::new(e).context(msg.clone());
        return Err(err.context(crate::Exit {
            code: EXIT_LIMIT,
            message: msg,
        }));
    }
    Err(e.into())
}

/// Reports a VM stopped by a signal while its memory was set up; its exit status: what
/// stopping it right after the start would give (an idle VM's normal end is a stop; any other
/// payload was interrupted).
pub(super) fn stopped_before_start(plan: &Plan, stopped: &Stopped) -> u8 {
    eprintln!(
        "vmhost: VM {}: stopped by a signal while its guest memory was set up \
         ({} of {} MiB faulted in)",
        plan.name,
        stopped.done >> 20,
        stopped.total >> 20
    );
    match plan.boot {
        BootSpec::Payload {
            payload: Payload::Idle,
        } => 0,
        _ => EXIT_INTERRUPTED,
    }
}
