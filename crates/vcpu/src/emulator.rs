//! The emulator thread, `vmhost-emu`: pinned to the plan's emulator PUs, it starts the vCPU
//! threads, opens the start gate once all of them are pinned and configured (reading thread
//! placement back from `/proc` at that moment), then runs the event loop: it takes what leaves
//! the vCPU threads (ready doorbells, ends), stops the whole VM when one vCPU fails or the guest
//! powers off or reboots, joins every thread and reads each vCPU's results from its mailbox
//! (payloads) or the serial console's statistics (Linux guests).

use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crate::control::{Control, Gate, StopReason};
use crate::devices::debugport::{BootMarks, BootPhase};
use crate::devices::serial::SerialStats;
use crate::payload::{self, PayloadKind, PayloadResult};
use crate::placement::thread_placements;
use crate::report::{BootReport, LinuxEntry, RunReport, RunStatus, VcpuOutcome, VcpuReport};
use crate::sys;
use crate::vcpu::{thread_main, Event, GuestCtx, VcpuConfig, VcpuContext};
use crate::vm::VmError;

/// Per-vCPU facts the report needs.
#[derive(Debug, Clone)]
pub(crate) struct VcpuMeta {
    pub vcpu: u32,
    pub apic_id: u32,
    pub host_cpu: Option<u32>,
    pub guest_cell: u32,
}

/// What the guest is, for the report.
pub(crate) enum RunGuest {
    /// A built-in payload; `bench_cells` are the guest cells in benchmark order.
    Payload {
        kind: PayloadKind,
        bench_cells: Vec<u32>,
    },
    /// A Linux kernel.
    Linux {
        entry: LinuxEntry,
        image: String,
        serial: Arc<SerialStats>,
        marks: Arc<BootMarks>,
    },
}

/// What the emulator thread runs.
pub(crate) struct EmulatorInput {
    pub vm_name: String,
    pub guest: RunGuest,
    pub emulator_cpus: Vec<u32>,
    pub configs: Vec<VcpuConfig>,
    pub meta: Vec<VcpuMeta>,
    pub ctx: VcpuContext,
    pub run_start: Instant,
    pub vm_setup_seconds: f64,
    pub on_start: Option<crate::vm::StartHook>,
    /// Told once this thread's syscall filter is in (every vCPU's is too by then); dropped
    /// unsent when the run ends before. The VMM thread installs its own filter after it.
    pub filtered: mpsc::Sender<()>,
}

struct Tally {
    outcome: Option<VcpuOutcome>,
    exits: u64,
    ignored: u64,
    first_doorbell: Option<Instant>,
    end: Option<Instant>,
}

/// Body of the `vmhost-emu` thread.
pub(crate) fn run(input: EmulatorInput, rx: Receiver<Event>) -> Result<RunReport, VmError> {
    pin_emulator(&input.emulator_cpus, &input.ctx.control)?;
    let n = input.configs.len();
    let gate = Arc::clone(&input.ctx.gate);
    let emulator = Instant::now();
    let (threads, spawn_error) = spawn_vcpus(input.configs, &input.ctx);
    let spawned = Instant::now();
    // Only the vCPU threads hold senders now: `recv` fails if they all die.
    let ctx = input.ctx;
    drop(ctx.events);
    let SetUp {
        threads,
        placements,
        placed,
        tsc_khz,
    } = set_up(threads, spawn_error, &gate, &rx, &ctx.control)?;
    ctx.control.set_tsc_khz(tsc_khz);
    raise_restored_interrupts(&input.guest, &ctx.guest);
    let vcpu_setup_seconds = input.run_start.elapsed().as_secs_f64();
    let steps = crate::vm::StartSteps {
        emulator,
        spawned,
        placed,
        set_up: Instant::now(),
    };
    if let Some(hook) = &input.on_start {
        (hook.0)(&placements, &steps);
    }
    let start = Instant::now();
    ctx.control.mark_started();
    gate.open(true);
    // Every vCPU thread is started and placement is read back: the rest is the event loop,
    // joins and mailbox reads.
    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Emulator);
    let _ = input.filtered.send(());
    let tallies = event_loop(&rx, n, &ctx.control);
    let panicked = join_all(threads);
    ctx.control.mark_ended();
    if let Some(vcpu) = panicked {
        return Err(VmError::VcpuPanicked { vcpu });
    }
    let run_seconds = start.elapsed().as_secs_f64();
    let clock = Clock { start, run_seconds };
    let vcpus = vcpu_reports(
        &ctx.guest,
        &input.guest,
        tallies,
        input.meta,
        &clock,
        tsc_khz,
    )?;
    let (payload, boot, startup_seconds) = boot_report(&input.guest, &vcpus, &clock);
    Ok(RunReport {
        vm: input.vm_name,
        payload,
        boot,
        status: run_status(&vcpus, ctx.control.reason()),
        vcpus,
        placements,
        tsc_khz,
        vm_setup_seconds: input.vm_setup_seconds,
        vcpu_setup_seconds,
        startup_seconds,
        run_seconds,
    })
}

/// Pins this thread to the emulator PUs (none: it is not pinned); a failure ends the run.
fn pin_emulator(cpus: &[u32], control: &Control) -> Result<(), VmError> {
    if !cpus.is_empty() {
        if let Err(source) = sys::pin_current_thread(cpus) {
            control.mark_ended();
            return Err(VmError::PinEmulator {
                cpus: cpus.to_vec(),
                source,
            });
        }
    }
    Ok(())
}

/// The vCPU threads, pinned and their vCPUs set up ([`set_up`]).
struct SetUp {
    threads: Vec<JoinHandle<()>>,
    /// Every thread's placement, read back once the vCPU threads were pinned.
    placements: Vec<crate::ThreadPlacement>,
    /// When it was read.
    placed: Instant,
    /// The guest TSC rate the vCPUs report.
    tsc_khz: u32,
}

/// Waits for every vCPU thread to be pinned, reads the placement back while they create their
/// vCPUs and load their state, then waits for their setup. When a thread did not start
/// (`spawn_error`) or a setup failed, the gate opens for the threads to end, they are joined
/// and the run ends with the error.
fn set_up(
    threads: Vec<JoinHandle<()>>,
    spawn_error: Option<VmError>,
    gate: &Gate,
    rx: &Receiver<Event>,
    control: &Control,
) -> Result<SetUp, VmError> {
    // Every vCPU thread pinned: the placement is read back while they create their vCPUs
    // and load their state (a migration target's pause holds both).
    gate.wait_pinned(threads.len());
    let placements = read_placements();
    let placed = Instant::now();
    let setup = wait_setup(rx, threads.len());
    let tsc_khz = match (spawn_error, setup) {
        (None, Ok(tsc)) => tsc,
        (Some(e), _) | (None, Err(e)) => {
            gate.open(false);
            join_all(threads);
            control.mark_ended();
            return Err(e);
        }
    };
    Ok(SetUp {
        threads,
        placements,
        placed,
        tsc_khz,
    })
}

/// Every thread's placement, or none (logged) when `/proc` cannot be read.
fn read_placements() -> Vec<crate::ThreadPlacement> {
    thread_placements().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot read thread placement back");
        Vec::new()
    })
}

/// Starts one `vcpu<N>` thread per config; stops at the first failure to start one.
fn spawn_vcpus(
    configs: Vec<VcpuConfig>,
    ctx: &VcpuContext,
) -> (Vec<JoinHandle<()>>, Option<VmError>) {
    let mut threads = Vec::with_capacity(configs.len());
    for cfg in configs {
        let vcpu = cfg.index;
        let ctx = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("vcpu{vcpu}"))
            .spawn(move || thread_main(cfg, ctx));
        match spawned {
            Ok(t) => threads.push(t),
            Err(source) => return (threads, Some(VmError::SpawnVcpu { vcpu, source })),
        }
    }
    (threads, None)
}

/// When the run started and how long it took.
struct Clock {
    start: Instant,
    run_seconds: f64,
}

impl Clock {
    fn since(&self, t: Option<Instant>) -> Option<f64> {
        t.map(|t| t.saturating_duration_since(self.start).as_secs_f64())
    }
}

/// The report's payload, boot description and start-up time.
fn boot_report(
    guest: &RunGuest,
    vcpus: &[VcpuReport],
    clock: &Clock,
) -> (Option<PayloadKind>, BootReport, f64) {
    match guest {
        RunGuest::Payload { kind, .. } => {
            let startup = vcpus
                .iter()
                .map(|v| v.first_doorbell_seconds.unwrap_or(v.seconds))
                .fold(0.0, f64::max);
            (Some(*kind), BootReport::Payload { payload: *kind }, startup)
        }
        RunGuest::Linux {
            entry,
            image,
            serial,
            marks,
        } => {
            let first = clock.since(serial.first_byte());
            let markers = marks.marks();
            // The run's start on CLOCK_MONOTONIC, to place the markers on the run's clock.
            let elapsed = u64::try_from(clock.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let start_ns = crate::sys::monotonic_ns().saturating_sub(elapsed);
            let userspace_seconds = markers
                .iter()
                .find(|m| m.phase == BootPhase::Userspace)
                .map(|m| m.monotonic_ns.saturating_sub(start_ns) as f64 / 1e9);
            let boot = BootReport::Linux {
                entry: *entry,
                image: image.clone(),
                first_serial_byte_seconds: first,
                serial_bytes: serial.bytes(),
                markers,
                userspace_seconds,
            };
            (None, boot, first.unwrap_or(clock.run_seconds))
        }
    }
}

/// Each vCPU's report, from its tally and, for payloads, its mailbox.
fn vcpu_reports(
    ctx: &GuestCtx,
    guest: &RunGuest,
    tallies: Vec<Tally>,
    meta: Vec<VcpuMeta>,
    clock: &Clock,
    tsc_khz: u32,
) -> Result<Vec<VcpuReport>, VmError> {
    let mut vcpus = Vec::with_capacity(tallies.len());
    for (i, (t, meta)) in tallies.into_iter().zip(meta).enumerate() {
        let mut outcome = t.outcome.unwrap_or(VcpuOutcome::NotStarted);
        let (cpuid, result) = match (ctx, guest) {
            (GuestCtx::Payload { boot, boot_mem }, RunGuest::Payload { kind, bench_cells }) => {
                let m = payload::read_mailbox(boot_mem, boot.mailbox(i)).map_err(|source| {
                    VmError::Payload {
                        vcpu: Some(i),
                        source,
                    }
                })?;
                tracing::debug!(vcpu = i, status = m.status, "mailbox");
                let result = if outcome == VcpuOutcome::Done {
                    match payload::collect(*kind, &m, meta.guest_cell, bench_cells, tsc_khz) {
                        Ok(r) => r,
                        Err(e) => {
                            tracing::error!(vcpu = i, error = %e, "implausible payload results");
                            outcome = VcpuOutcome::Unexpected {
                                what: e.to_string(),
                            };
                            PayloadResult::None
                        }
                    }
                } else {
                    PayloadResult::None
                };
                (payload::cpuid_results(&m), result)
            }
            _ => (Vec::new(), PayloadResult::None),
        };
        vcpus.push(VcpuReport {
            vcpu: meta.vcpu,
            apic_id: meta.apic_id,
            host_cpu: meta.host_cpu,
            guest_cell: meta.guest_cell,
            outcome,
            cpuid,
            result,
            exits: t.exits,
            ignored_accesses: t.ignored,
            first_doorbell_seconds: clock.since(t.first_doorbell),
            seconds: clock.since(t.end).unwrap_or(clock.run_seconds),
        });
    }
    Ok(vcpus)
}

/// Waits for every vCPU's setup; the first error wins. Returns the TSC rate.
fn wait_setup(rx: &Receiver<Event>, n: usize) -> Result<u32, VmError> {
    let mut tsc = 0;
    let mut first_err = None;
    for _ in 0..n {
        match rx.recv() {
            Ok(Event::Setup {
                result: Ok(khz), ..
            }) => tsc = khz,
            Ok(Event::Setup {
                vcpu,
                result: Err(source),
            }) => {
                first_err.get_or_insert(VmError::Vcpu { vcpu, source });
            }
            Ok(_) => {}
            Err(_) => {
                first_err.get_or_insert(VmError::VcpuPanicked { vcpu: usize::MAX });
                break;
            }
        }
    }
    first_err.map_or(Ok(tsc), Err)
}

fn event_loop(rx: &Receiver<Event>, n: usize, control: &Control) -> Vec<Tally> {
    let mut tallies: Vec<Tally> = (0..n)
        .map(|_| Tally {
            outcome: None,
            exits: 0,
            ignored: 0,
            first_doorbell: None,
            end: None,
        })
        .collect();
    let mut finished = 0;
    while finished < n {
        let Ok(event) = rx.recv() else {
            break; // every vCPU thread is gone; missing outcomes stay None
        };
        match event {
            Event::Setup { .. } => {}
            Event::Ready { vcpu, at } => {
                tallies[vcpu].first_doorbell.get_or_insert(at);
                tracing::debug!(vcpu, "guest ready");
            }
            Event::Finished {
                vcpu,
                outcome,
                exits,
                ignored,
                at,
            } => {
                if outcome.is_failure() {
                    tracing::error!(vcpu, %outcome, "vCPU failed: stopping the VM");
                    control.request_stop(StopReason::GuestFailure);
                } else if outcome.ends_vm() {
                    tracing::info!(vcpu, %outcome, "the guest ended: stopping the VM");
                    control.request_stop(StopReason::GuestEnded);
                } else {
                    tracing::debug!(vcpu, %outcome, "vCPU ended");
                }
                let t = &mut tallies[vcpu];
                if outcome == VcpuOutcome::Done {
                    t.first_doorbell.get_or_insert(at);
                }
                (t.outcome, t.exits, t.ignored, t.end) = (Some(outcome), exits, ignored, Some(at));
                finished += 1;
            }
        }
    }
    tallies
}

/// Joins every thread; returns the index of one that panicked, if any.
fn join_all(threads: Vec<JoinHandle<()>>) -> Option<usize> {
    let mut panicked = None;
    for (i, t) in threads.into_iter().enumerate() {
        if t.join().is_err() {
            panicked.get_or_insert(i);
        }
    }
    panicked
}

fn run_status(vcpus: &[VcpuReport], reason: Option<StopReason>) -> RunStatus {
    if vcpus.iter().any(|v| v.outcome.is_failure()) || reason == Some(StopReason::GuestFailure) {
        RunStatus::GuestFailed
    } else if vcpus.iter().any(|v| v.outcome == VcpuOutcome::PoweredOff) {
        RunStatus::PoweredOff
    } else if vcpus.iter().any(|v| v.outcome.ends_vm()) {
        RunStatus::Rebooted
    } else if vcpus
        .iter()
        .all(|v| matches!(v.outcome, VcpuOutcome::Done | VcpuOutcome::Halted))
    {
        RunStatus::Completed
    } else {
        RunStatus::Stopped
    }
}

/// A restored Linux guest, every vCPU created and loaded, the gate still shut: its UART's and
/// its virtio devices' pending interrupts are raised again. Raised earlier (the restore of
/// the devices), they went to an irqchip about to be overwritten by the saved one, or with no
/// vCPU to deliver an edge to.
fn raise_restored_interrupts(run: &RunGuest, guest: &GuestCtx) {
    if let (
        RunGuest::Linux {
            entry: LinuxEntry::Restored,
            ..
        },
        GuestCtx::Linux { devices, .. },
    ) = (run, guest)
    {
        let raised = devices.raise_restored_interrupts();
        if raised > 0 {
            tracing::debug!(
                raised,
                "raised the restored devices' pending interrupts again"
            );
        }
    }
}

/// A fresh event channel and start gate for one run.
pub(crate) fn channel() -> (mpsc::Sender<Event>, Receiver<Event>, Arc<Gate>) {
    let (tx, rx) = mpsc::channel();
    (tx, rx, Arc::new(Gate::new()))
}
