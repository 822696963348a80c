//! `vmhost --config vm.toml`: spec → plan → guest memory → VM → run → report.
//!
//! The main thread becomes the VMM's control thread: it is pinned to the emulator PUs before
//! anything else starts, so every thread it spawns (signal thread, emulator thread) inherits
//! that placement; vCPU threads pin themselves to their own PUs before their vCPU is created.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use vmhost_api::ServerLimits;
use vmhost_config::VmSpec;
use vmhost_memory::{Audit, GuestMemory, PrefaultTiming};
use vmhost_plan::Plan;

use crate::background::Background;
use crate::control::Control;
use crate::enforce::Enforcement;
use crate::output::placement_table;
use crate::signals::StopSignals;
use crate::timeline::{now_ns, Timeline};

mod memory;
use memory::{ready_memory, settle_memory, stopped_before_start, ReadyMemory};
use vmhost_vcpu::{
    pin_current_thread_to_emulator, AfterStart, RunReport, StartHook, StartSteps, ThreadPlacement,
    UnknownAccessPolicy, Vm, VmHandle, VmOptions, VmShell, VmState,
};

/// Run-time settings from the command line.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Keep running when the guest touches an unknown port or unmapped memory.
    pub ignore_unknown: bool,
    /// Mask CPU features a nested, emulating KVM cannot run (Linux guests on such hosts).
    pub mask_nested_cpuid: bool,
    /// JSON output.
    pub json: bool,
    /// Serve the control API on this Unix socket.
    pub api_socket: Option<PathBuf>,
    /// Enforce the envelope in this cgroup (under `vmhost/`).
    pub cgroup: Option<String>,
    /// Replace the cgroup's memory limit (testing aid).
    pub cgroup_memory_limit: Option<u64>,
    /// The ledger's run directory (released on the memory-limit exit path).
    pub run_dir: PathBuf,
    /// When guest RAM is faulted in: before the guest starts, or while it boots.
    pub prefault: PrefaultTiming,
    /// The spec as written: with an API socket, `PUT /vm/snapshot` can snapshot the VM.
    pub spec_source: Option<crate::snapshot::SpecSource>,
}

/// What `vmhost --json` prints.
#[derive(Debug, Serialize)]
struct RunOutput<'a> {
    plan: &'a Plan,
    /// When guest RAM was faulted in (`before-start` or `background`).
    prefault: PrefaultTiming,
    audit: &'a Audit,
    start: Vec<ThreadPlacement>,
    timeline: Timeline,
    overhead: crate::overhead::MeasuredOverhead,
    report: &'a RunReport,
    exit_code: u8,
}

/// How the VM starts.
pub enum Start {
    /// Booted from the plan (`vmhost --config F`).
    Boot,
    /// Continued from a snapshot (`vmhost restore DIR`).
    Restore {
        /// The checked snapshot.
        restored: Box<crate::restore::Restored>,
        /// `--same-distances`: refuse host nodes not as far apart as the guest's cells.
        same_distances: bool,
        /// The steps from the snapshot's check to the VM's memory ready.
        steps: crate::timeline::StepClock,
    },
    /// Received from a live migration's source (`vmhost receive`).
    Incoming(Box<crate::migrate::target::Incoming>),
}

impl Start {
    /// Marks the end of `step` of a restore's work up to its memory, or of a migration
    /// target's up to its receivers (nothing for a boot).
    pub fn mark_step(&self, step: &'static str) {
        match self {
            Start::Boot => {}
            Start::Restore { steps, .. } => steps.mark(step),
            Start::Incoming(inc) => inc.mark(step),
        }
    }
}

/// Runs the VM of `plan` and returns the process exit status. A restore takes the same path:
/// only its memory is loaded from the snapshot and its VM continues instead of booting.
pub fn run(
    spec: &VmSpec,
    plan: &Plan,
    admission: &crate::vms::Admission,
    opts: &RunOptions,
    mut timeline: Timeline,
    mut start: Start,
) -> Result<u8> {
    let sec_at_start = crate::overhead::sec_page_tables();
    let (enforcement, signals) = prepare(plan, opts)?;
    start.mark_step("cgroup and threads");
    // The handle the VM answers through, before the VM exists.
    let handle = VmHandle::unbuilt(plan.vcpus.len());
    let ready = ready_memory(
        (spec, plan, admission),
        (&enforcement, &signals),
        opts,
        &handle,
        &mut start,
    )?;
    let ReadyMemory {
        mut memory,
        shell,
        early,
        mut api,
    } = match ready {
        Ok(ready) => ready,
        Err(stopped) => return Ok(stopped_before_start(plan, &stopped)),
    };
    // A migration target: the guest's state is here; the source is paused until the commit.
    let resume =
        matches!(start, Start::Incoming(_)).then(|| Arc::new(crate::timeline::StepClock::start()));
    let (background, audit) = settle(
        (plan, admission, opts),
        (&mut memory, early),
        &enforcement,
        &start,
        &mut timeline,
        resume.as_deref(),
    )?;
    let Built {
        started,
        after_start,
        regions,
        mut vm,
        arrival,
    } = build_vm(
        (plan, admission, opts),
        (memory, shell, start),
        (&background, &audit),
        &handle,
        &mut timeline,
        &resume,
    )?;
    after_start.set(once_running(plan, arrival, background.clone()));
    if api.is_none() {
        let view = ApiView::new(spec, plan, &audit, &handle, regions);
        api = serve_api(view, enforcement.as_ref(), opts)?;
        mark_resume(resume.as_deref(), "API");
    }
    signals.attach(vm.stop_handle());
    if let Some(bg) = &background {
        bg.attach(vm.stop_handle());
    }
    let report = vm.run()?;
    let overhead = crate::overhead::measure(plan, sec_at_start);
    drop(api);
    // Cancels and joins a background prefault still running.
    drop(vm);
    drop(enforcement);
    let ended = Ended {
        report,
        audit,
        overhead,
        started,
    };
    finish(plan, opts, ended, background.as_ref(), timeline)
}

/// Marks the end of `step` of a migration target's resume (nothing for other starts).
fn mark_resume(resume: Option<&crate::timeline::StepClock>, step: &'static str) {
    if let Some(r) = resume {
        r.mark(step);
    }
}

/// Guest RAM settled ([`settle_memory`]): the background prefault started or the cgroup
/// narrowed, the ledger told and the residency audited; then the step marked, and a restore's
/// time to its memory ready told.
fn settle(
    (plan, admission, opts): (&Plan, &crate::vms::Admission, &RunOptions),
    (memory, early): (&mut GuestMemory, Option<Audit>),
    enforcement: &Option<Arc<Enforcement>>,
    start: &Start,
    timeline: &mut Timeline,
    resume: Option<&crate::timeline::StepClock>,
) -> Result<(Option<Background>, Audit)> {
    let audited_early = early.is_some();
    let (background, audit) =
        settle_memory(memory, plan, enforcement, admission, early, opts, timeline)?;
    mark_resume(
        resume,
        if audited_early {
            "cgroup narrowed"
        } else {
            "ledger and audit"
        },
    );
    if let (Start::Restore { steps, .. }, false) = (start, opts.json) {
        steps.mark("ledger and audit");
        let (total, steps) = steps.steps();
        eprintln!(
            "vmhost: restore: memory ready {total:.1} ms after the snapshot's check: {steps}"
        );
    }
    Ok((background, audit))
}

/// The VM ([`build_vm`]) and what the run keeps beside it.
struct Built {
    /// Where the threads were and when the vCPUs became runnable, from the start hook.
    started: Arc<Mutex<(Vec<ThreadPlacement>, u64)>>,
    /// The work to run once the guest runs, to be set ([`once_running`]).
    after_start: AfterStart,
    /// Guest RAM's regions, for the control API.
    regions: Vec<vmhost_memory::MappedRegion>,
    vm: Vm,
    /// A migration target's arrival, committed.
    arrival: Option<crate::migrate::target::Arrival>,
}

/// The VM built on the ready memory ([`create_vm`]: booted, or continued from the snapshot's
/// or the migration's state), with its options ([`vm_options`]) and the handle; then a
/// migration target's commit ([`commit`]).
fn build_vm(
    (plan, admission, opts): (&Plan, &crate::vms::Admission, &RunOptions),
    (memory, shell, start): (GuestMemory, Option<VmShell>, Start),
    (background, audit): (&Option<Background>, &Audit),
    handle: &VmHandle,
    timeline: &mut Timeline,
    resume: &Option<Arc<crate::timeline::StepClock>>,
) -> Result<Built> {
    let started: Arc<Mutex<(Vec<ThreadPlacement>, u64)>> = Arc::default();
    let final_audit = background.is_none().then(|| audit.clone());
    let (mut options, after_start) = vm_options(plan, opts, final_audit, &started, resume.clone());
    options.handle = Some(handle.clone());
    let regions = memory.regions().to_vec();
    let restoring = matches!(start, Start::Restore { .. });
    let (vm, incoming) = create_vm(plan, memory, options, start, shell)?;
    timeline.vm_created_ns = now_ns();
    if restoring && !opts.json {
        eprintln!("vmhost: restore: {}", crate::restore::timing(timeline));
    }
    mark_resume(resume.as_deref(), "VM built");
    let arrival = incoming
        .map(|inc| commit(inc, handle, plan, audit, admission, opts))
        .transpose()?;
    if arrival.is_some() {
        mark_resume(resume.as_deref(), "commit");
    }
    Ok(Built {
        started,
        after_start,
        regions,
        vm,
        arrival,
    })
}

/// What runs on the main thread once the guest runs: a background prefault's workers let go,
/// the watch for KVM's worker thread (it appears at the first `KVM_RUN`), then a migration
/// target's ledger hand-over and report; none of it in a migration target's pause.
fn once_running(
    plan: &Plan,
    arrival: Option<crate::migrate::target::Arrival>,
    background: Option<Background>,
) -> Box<vmhost_vcpu::AfterStartFn> {
    let kvm_workers = kvm_worker_watch(plan);
    Box::new(move |started| {
        // A background prefault's workers, held back while the VM was built and its kernel
        // loaded; a run that ended before the guest started cancels them instead.
        if let Some(bg) = background {
            bg.go();
        }
        if let (true, Some(watch)) = (started, kvm_workers) {
            watch.start();
        }
        if let Some(arrival) = arrival {
            arrival.finish();
        }
    })
}

/// Before guest memory: pins the VMM thread to the emulator PUs, enters the cgroup, starts
/// the signal thread and the diagnostics writer.
fn prepare(plan: &Plan, opts: &RunOptions) -> Result<(Option<Arc<Enforcement>>, StopSignals)> {
    // The stop signals are blocked since `main` (see `signals`): one that came during setup
    // is still pending, and the signal thread takes it.
    pin_current_thread_to_emulator(plan).context("pinning the VMM thread to the emulator PUs")?;
    let enforcement = enter_cgroup(plan, opts)?;
    // After the pinning: the signal thread inherits the emulator PUs.
    let signals = StopSignals::start().context("starting the signal thread")?;
    // From here on a vCPU or I/O thread that logs never blocks on stderr.
    if let Err(e) = crate::logging::start_writer() {
        eprintln!(
            "vmhost: warning: cannot start the diagnostics writer ({e}); writing them directly"
        );
    }
    Ok((enforcement, signals))
}

/// A migration target's commit point, once its VM is built: refused when the VM was stopped
/// (through the API, which a target serves while the guest arrives) meanwhile, so that the
/// source keeps the guest. The ledger hand-over and the report follow once the guest runs.
fn commit(
    inc: Box<crate::migrate::target::Incoming>,
    handle: &VmHandle,
    plan: &Plan,
    audit: &Audit,
    admission: &crate::vms::Admission,
    opts: &RunOptions,
) -> Result<crate::migrate::target::Arrival> {
    if handle.state() == VmState::Stopped {
        bail!("the VM was stopped before the migration committed: the source keeps the guest");
    }
    inc.commit(plan, audit, admission, opts.json)
}

/// Enters the cgroup `--cgroup` names. Before any thread starts: on cgroup v2 entering forks
/// the VMM off a supervisor, which needs a single-threaded process (a stop signal meanwhile
/// stays pending).
fn enter_cgroup(plan: &Plan, opts: &RunOptions) -> Result<Option<Arc<Enforcement>>> {
    let Some(name) = &opts.cgroup else {
        return Ok(None);
    };
    Ok(Some(Enforcement::enter(
        name,
        plan,
        opts.cgroup_memory_limit,
        (opts.run_dir.clone(), plan.name.clone()),
        opts.api_socket.clone(),
    )?))
}

/// The VM's settings: the unknown-access policy, the start hook that prints the placement
/// table and records when the vCPUs became runnable (on a migration target, after the line
/// of `resume`: where the time since the guest's state arrived went), the scratch directory;
/// and the work run once the guest runs, to be set ([`once_running`]).
fn vm_options(
    plan: &Plan,
    opts: &RunOptions,
    audit: Option<Audit>,
    started: &Arc<Mutex<(Vec<ThreadPlacement>, u64)>>,
    resume: Option<Arc<crate::timeline::StepClock>>,
) -> (VmOptions, AfterStart) {
    let hook = {
        let (plan, started, json) = (plan.clone(), Arc::clone(started), opts.json);
        StartHook(Arc::new(
            move |threads: &[ThreadPlacement], steps: &StartSteps| {
                if let (Some(r), false) = (&resume, json) {
                    r.mark_at("emulator thread", steps.emulator);
                    r.mark_at("vCPU threads", steps.spawned);
                    r.mark_at("pinned and placement read", steps.placed);
                    r.mark_at("vCPUs created and loaded", steps.set_up);
                    let (total, steps) = r.steps();
                    eprintln!(
                        "vmhost: receive: the guest runs again {total:.1} ms after its state \
                         arrived: {steps}"
                    );
                }
                if !json {
                    print!("{}", placement_table(&plan, audit.as_ref(), threads));
                }
                if let Ok(mut s) = started.lock() {
                    *s = (threads.to_vec(), now_ns());
                }
            },
        ))
    };
    let after_start = AfterStart::default();
    let options = VmOptions {
        // Auto: payloads stop on unknown accesses, Linux guests (which probe) ignore them.
        unknown_access: if opts.ignore_unknown {
            UnknownAccessPolicy::Ignore
        } else {
            UnknownAccessPolicy::Auto
        },
        mask_for_nested_emulation: opts.mask_nested_cpuid,
        on_start: Some(hook),
        // Scratch images (empty disks, cloud-init seeds) beside the ledger, in a directory only
        // root may write, never under a predictable name in the world-writable /tmp.
        device_dir: Some(opts.run_dir.clone()),
        filter_calling_thread: true,
        after_start: Some(after_start.clone()),
        ..Default::default()
    };
    (options, after_start)
}

/// Boots the VM, or builds it to continue from the snapshot's or the migration's state; an
/// incoming migration is handed back for its commit.
fn create_vm(
    plan: &Plan,
    memory: GuestMemory,
    options: VmOptions,
    start: Start,
    shell: Option<VmShell>,
) -> Result<(Vm, Option<Box<crate::migrate::target::Incoming>>)> {
    match start {
        Start::Boot => Ok((Vm::new(plan, memory, options)?, None)),
        Start::Restore { restored: r, .. } => Ok((
            crate::vmstate::restore(shell, plan, memory, options, r.saved)
                .context("continuing the VM from the snapshot's state")?,
            None,
        )),
        Start::Incoming(mut inc) => {
            let saved = inc.take_saved()?;
            let vm = crate::vmstate::restore(shell, plan, memory, options, saved)
                .context("continuing the VM from the migration's state")?;
            Ok((vm, Some(inc)))
        }
    }
}

/// What a run left to report.
struct Ended {
    report: RunReport,
    audit: Audit,
    overhead: crate::overhead::MeasuredOverhead,
    started: Arc<Mutex<(Vec<ThreadPlacement>, u64)>>,
}

/// Prints the report (text or JSON) and returns the exit status.
fn finish(
    plan: &Plan,
    opts: &RunOptions,
    ended: Ended,
    background: Option<&Background>,
    mut timeline: Timeline,
) -> Result<u8> {
    let mut code = exit_code(&ended.report);
    // Migrated: the guest runs on at the target. A guest stopped by `ctl snapshot --stop`
    // moved on to its snapshot (a Linux guest's stop would otherwise be 130). Both ends are
    // orderly: exit 0.
    let migrated = crate::migrate::source::MIGRATED.load(std::sync::atomic::Ordering::SeqCst);
    if migrated {
        eprintln!(
            "vmhost: VM {}: migrated; it runs on at the target",
            plan.name
        );
    }
    if migrated
        || (ended.report.status == vmhost_vcpu::RunStatus::Stopped
            && crate::snapshot::stopped_by_snapshot())
    {
        code = 0;
    }
    let mut audit = ended.audit;
    if let Some(outcome) = background.map(Background::outcome) {
        timeline.memory_ready_ns = outcome.done_ns;
        audit = outcome.audit.unwrap_or(audit);
        if outcome.error.is_some() {
            code = 1;
        }
    }
    if opts.json {
        let (start, runnable) = ended.started.lock().map(|s| s.clone()).unwrap_or_default();
        timeline.vcpus_runnable_ns = runnable;
        let out = RunOutput {
            plan,
            prefault: opts.prefault,
            audit: &audit,
            start,
            timeline,
            overhead: ended.overhead,
            report: &ended.report,
            exit_code: code,
        };
        print_bounded(format!("{}\n", serde_json::to_string_pretty(&out)?));
    } else {
        print_bounded(ended.report.render_text());
    }
    Ok(code)
}

/// Serves the control API when `--api-socket` asks for it; the limit exit removes its socket.
fn serve_api(
    view: ApiView<'_>,
    enforcement: Option<&Arc<Enforcement>>,
    opts: &RunOptions,
) -> Result<Option<vmhost_api::ApiServer>> {
    let Some(path) = &opts.api_socket else {
        return Ok(None);
    };
    let ApiView {
        spec,
        plan,
        audit,
        handle,
        regions,
    } = view;
    // Started here, on the main thread: the API thread's filter lets it start no thread.
    let source = |spec: &crate::snapshot::SpecSource| crate::snapshot::Source {
        spec: spec.absolute(),
        plan: plan.clone(),
        regions: regions.clone(),
        handle: handle.clone(),
        stop: handle.stop_handle(),
    };
    let (jobs, migrations) = match &opts.spec_source {
        Some(spec) => (
            Some(
                crate::snapshot::start_jobs(source(spec))
                    .context("starting the snapshot job thread")?,
            ),
            Some(
                crate::migrate::source::start_jobs(source(spec))
                    .context("starting the migration job thread")?,
            ),
        ),
        None => (None, None),
    };
    let control = Control::new(
        spec.clone(),
        plan.clone(),
        audit.clone(),
        handle.clone(),
        handle.stop_handle(),
        enforcement.cloned(),
    )
    .context("starting the control API's grace-period timer")?
    .with_snapshots(jobs)
    .with_migrations(migrations);
    let server = vmhost_api::serve(path, Arc::new(control), ServerLimits::default(), None)
        .with_context(|| format!("serving the control API on {}", path.display()))?;
    if let Some(e) = enforcement {
        e.remove_at_limit_exit(path.clone());
    }
    Ok(Some(server))
}

/// What the control API shows and acts on: the VM (through its handle, which may come before
/// the VM itself), its spec, plan, residency audit and guest RAM.
struct ApiView<'a> {
    spec: &'a VmSpec,
    plan: &'a Plan,
    audit: &'a Audit,
    handle: &'a VmHandle,
    regions: Vec<vmhost_memory::MappedRegion>,
}

impl<'a> ApiView<'a> {
    fn new(
        spec: &'a VmSpec,
        plan: &'a Plan,
        audit: &'a Audit,
        handle: &'a VmHandle,
        regions: Vec<vmhost_memory::MappedRegion>,
    ) -> Self {
        ApiView {
            spec,
            plan,
            audit,
            handle,
            regions,
        }
    }
}

/// How long the final report may wait for stdout.
const STDOUT_TIMEOUT: Duration = Duration::from_millis(300);

/// Prints `text` to stdout, waiting at most [`STDOUT_TIMEOUT`]: when nobody reads stdout (a
/// full pipe the guest's serial output filled), the report is given up rather than keeping
/// the stopped VM's process alive; the blocked writer ends with the process.
fn print_bounded(text: String) {
    let (done_tx, done) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("vmhost-out".into())
        .spawn(move || {
            vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Output);
            let mut out = std::io::stdout().lock();
            let ok = out.write_all(text.as_bytes()).and_then(|()| out.flush());
            let _ = done_tx.send(ok);
        });
    if let Err(e) = spawned {
        eprintln!("vmhost: warning: cannot start the output thread ({e}); no report");
        return;
    }
    match done.recv_timeout(STDOUT_TIMEOUT) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("vmhost: warning: cannot print the report: {e}"),
        Err(_) => eprintln!(
            "vmhost: warning: stdout has not been read for {STDOUT_TIMEOUT:?}; the report is not printed"
        ),
    }
}

/// Whether KVM's worker on kernel `release` (`/proc/sys/kernel/osrelease`) is one of the VM
/// process's threads, which the watch can see and move: from Linux 6.12/6.13 it is a
/// `vhost_task` of the process; before, a kernel thread outside it, and watching for it only
/// took the emulator PUs from the serial console and a just-migrated guest (an unreadable
/// release is watched).
fn kvm_worker_is_a_process_thread(release: &str) -> bool {
    let mut parts = release.trim().split(['.', '-']);
    let mut number = || parts.next().and_then(|p| p.parse::<u32>().ok());
    match (number(), number()) {
        (Some(major), Some(minor)) => (major, minor) >= (6, 12),
        _ => true,
    }
}

/// Maps a run's outcome to vmhost's exit statuses (the report's own mapping).
fn exit_code(report: &RunReport) -> u8 {
    u8::try_from(report.exit_code()).unwrap_or(1)
}

/// The watch that moves KVM's per-VM worker threads (`kvm-nx-lpage-recovery`, created by the
/// kernel at the first `KVM_RUN` with the affinity of the vCPU thread that ran it) onto the
/// emulator PUs, so that with dedicated placement nothing but the vCPU runs on a vCPU's PU;
/// `None` when there is nothing to move. Started once the guest is released (no worker exists
/// before), it looks every 2 ms for one second: at 20 ms a placement read right after the
/// start found the worker still on the vCPU's PU
/// (`io_threads_share_the_isolated_emulator_pu_never_a_vcpu_pu`). Started before the release,
/// its scans of `/proc` shared the emulator PUs with the vCPUs' set-up, inside a migration
/// target's pause.
fn kvm_worker_watch(plan: &Plan) -> Option<KvmWorkerWatch> {
    if !plan.vcpus.iter().any(|v| v.host_cpu.is_some()) || plan.emulator.host_cpus.is_empty() {
        return None;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    kvm_worker_is_a_process_thread(&release).then(|| KvmWorkerWatch {
        emulator: plan.emulator.host_cpus.clone(),
    })
}

/// The emulator PUs KVM's worker thread is moved to ([`kvm_worker_watch`]).
struct KvmWorkerWatch {
    emulator: Vec<u32>,
}

impl KvmWorkerWatch {
    /// Starts the `vmhost-kvmpin` thread, once the guest runs.
    fn start(self) {
        let emulator = self.emulator;
        let spawned = std::thread::Builder::new()
            .name("vmhost-kvmpin".into())
            .spawn(move || {
                vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::KvmPin);
                // KVM starts one such worker per VM, at the first KVM_RUN: stop once it is moved.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
                while std::time::Instant::now() < deadline {
                    let workers: Vec<_> = vmhost_vcpu::thread_placements()
                        .unwrap_or_default()
                        .into_iter()
                        .filter(|t| t.name.starts_with("kvm-"))
                        .collect();
                    for t in workers.iter().filter(|t| t.cpus_allowed != emulator) {
                        if let Err(e) = vmhost_topology::affinity::set_thread(t.tid, &emulator) {
                            tracing::warn!(tid = t.tid, error = %e, "cannot move a KVM worker thread");
                        }
                    }
                    if !workers.is_empty() {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the KVM worker pinning thread");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::kvm_worker_is_a_process_thread as watched;

    #[test]
    fn the_kvm_worker_is_watched_from_linux_6_12_and_when_unknown() {
        assert!(!watched("6.1.0-57-amd64\n"));
        assert!(!watched("5.15.0-91-generic"));
        assert!(!watched("6.11.9"));
        assert!(watched("6.12.0"));
        assert!(watched("6.18.44-fc-v1098"));
        assert!(watched("7.0"));
        assert!(watched(""));
        assert!(watched("weird"));
    }
}
