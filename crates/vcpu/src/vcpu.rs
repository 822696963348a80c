//! One vCPU thread: pinned first, then the vCPU is created and configured in that thread, then
//! it runs the guest and handles exits until the payload ends, the guest fails, or a stop.
//!
//! Exits handled here: the doorbell port (the payload's one `out`), HLT, shutdown (triple
//! fault), failed entry, and accesses to ports or guest-physical memory nothing handles, which
//! the [`UnknownAccessPolicy`] either ignores (reads return all ones) or turns into the vCPU's
//! end. Nothing here panics on a guest's behaviour: every outcome is a [`VcpuOutcome`].

use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;

use kvm_bindings::{kvm_mp_state, CpuId, KVM_MP_STATE_RUNNABLE};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};
use serde::Serialize;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::arch::BootLayout;
use crate::control::{Control, Gate};
use crate::payload::mailbox::{Doorbell, Mailbox, DOORBELL_PORT};
use crate::report::VcpuOutcome;
use crate::sys;

/// What to do when the guest touches a port or guest-physical address nothing handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownAccessPolicy {
    /// Log it, return all ones for reads, let the guest go on.
    Ignore,
    /// Log it and stop the VM (the run ends as a guest failure).
    #[default]
    Stop,
}

/// Why a vCPU could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// `sched_setaffinity` failed.
    #[error("vCPU {vcpu}: cannot pin its thread to PUs {cpus:?}")]
    Pin {
        /// vCPU index.
        vcpu: u32,
        /// The PUs.
        cpus: Vec<u32>,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kick signal could not be installed.
    #[error("vCPU {vcpu}: cannot install the kick signal handler")]
    Signal {
        /// vCPU index.
        vcpu: u32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A KVM vCPU ioctl failed.
    #[error("vCPU {vcpu}: {op} failed")]
    Kvm {
        /// vCPU index.
        vcpu: u32,
        /// The ioctl.
        op: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The mailbox could not be read or written.
    #[error("vCPU {vcpu}: cannot access its mailbox at GPA {gpa:#x}")]
    Mailbox {
        /// vCPU index.
        vcpu: u32,
        /// Mailbox GPA.
        gpa: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// Everything one vCPU thread needs, prepared by the VM.
pub(crate) struct VcpuConfig {
    /// vCPU index.
    pub index: usize,
    /// KVM vcpu id (the APIC ID).
    pub kvm_id: u32,
    /// PUs to pin to (empty: leave the inherited mask).
    pub cpus: Vec<u32>,
    /// Its CPUID.
    pub cpuid: CpuId,
    /// Ring-0 entry point.
    pub entry: u64,
    /// Set the MP state to runnable (needed with the in-kernel irqchip for vCPUs other than
    /// the BSP, which start waiting for INIT/SIPI).
    pub make_runnable: bool,
}

/// Shared by all vCPU threads of a VM.
#[derive(Clone)]
pub(crate) struct VcpuContext {
    pub vm: Arc<VmFd>,
    pub boot: Arc<BootLayout>,
    pub boot_mem: GuestMemoryMmap,
    pub control: Arc<Control>,
    pub gate: Arc<Gate>,
    pub events: Sender<Event>,
    pub policy: UnknownAccessPolicy,
}

/// What vCPU threads tell the emulator thread.
pub(crate) enum Event {
    /// Setup finished (the TSC rate on success).
    Setup {
        vcpu: usize,
        result: Result<u32, VcpuError>,
    },
    /// The guest rang the doorbell with Ready.
    Ready { vcpu: usize, at: Instant },
    /// The vCPU ended.
    Finished {
        vcpu: usize,
        outcome: VcpuOutcome,
        exits: u64,
        ignored: u64,
        at: Instant,
    },
}

/// Body of the `vcpu<N>` thread.
pub(crate) fn thread_main(cfg: VcpuConfig, ctx: VcpuContext) {
    let vcpu = cfg.index;
    let (mut fd, tsc_khz) = match setup(&cfg, &ctx) {
        Ok(v) => v,
        Err(e) => {
            let _ = ctx.events.send(Event::Setup {
                vcpu,
                result: Err(e),
            });
            return;
        }
    };
    let _ = ctx.events.send(Event::Setup {
        vcpu,
        result: Ok(tsc_khz),
    });
    let mut stats = Stats::default();
    let outcome = if ctx.gate.wait() {
        // A pointer into this vCPU's kvm_run mapping, valid while `fd` lives; AtomicU8 has
        // the layout of u8, and every access through it is atomic.
        let ie = addr_of_mut!(fd.get_kvm_run().immediate_exit)
            .cast::<AtomicU8>()
            .cast_const();
        // Declared after `fd`, so dropped (deregistered) before `fd` unmaps kvm_run.
        let _kick = ctx.control.register(vcpu, ie);
        run_loop(&mut fd, &cfg, &ctx, ie, &mut stats)
    } else {
        VcpuOutcome::NotStarted
    };
    let _ = ctx.events.send(Event::Finished {
        vcpu,
        outcome,
        exits: stats.exits,
        ignored: stats.ignored,
        at: Instant::now(),
    });
}

fn setup(cfg: &VcpuConfig, ctx: &VcpuContext) -> Result<(VcpuFd, u32), VcpuError> {
    let vcpu = u32::try_from(cfg.index).unwrap_or(u32::MAX);
    if !cfg.cpus.is_empty() {
        sys::pin_current_thread(&cfg.cpus).map_err(|source| VcpuError::Pin {
            vcpu,
            cpus: cfg.cpus.clone(),
            source,
        })?;
    }
    sys::prepare_kick_signal().map_err(|source| VcpuError::Signal { vcpu, source })?;
    let kvm = |op: &'static str| move |source| VcpuError::Kvm { vcpu, op, source };
    let fd = ctx
        .vm
        .create_vcpu(u64::from(cfg.kvm_id))
        .map_err(kvm("KVM_CREATE_VCPU"))?;
    fd.set_cpuid2(&cfg.cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
    let mut sregs = fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
    ctx.boot.configure_sregs(&mut sregs, cfg.index);
    fd.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))?;
    fd.set_regs(&ctx.boot.initial_regs(cfg.index, cfg.entry))
        .map_err(kvm("KVM_SET_REGS"))?;
    if cfg.make_runnable {
        fd.set_mp_state(kvm_mp_state {
            mp_state: KVM_MP_STATE_RUNNABLE,
        })
        .map_err(kvm("KVM_SET_MP_STATE"))?;
    }
    let tsc_khz = fd.get_tsc_khz().map_err(kvm("KVM_GET_TSC_KHZ"))?;
    let gpa = ctx.boot.mailbox(cfg.index) + std::mem::offset_of!(Mailbox, tsc_khz) as u64;
    ctx.boot_mem
        .write_obj(u64::from(tsc_khz), GuestAddress(gpa))
        .map_err(|source| VcpuError::Mailbox { vcpu, gpa, source })?;
    Ok((fd, tsc_khz))
}

#[derive(Default)]
struct Stats {
    exits: u64,
    ignored: u64,
}

/// A KVM exit with its data copied out of `kvm_run`.
enum Exit {
    PortOut { port: u16, first: u8, size: usize },
    PortIn { port: u16, size: usize },
    Mmio { gpa: u64, write: bool, size: usize },
    Hlt,
    Shutdown,
    FailEntry(u64),
    Interrupted,
    Other(String),
}

fn next_exit(fd: &mut VcpuFd) -> Result<Exit, kvm_ioctls::Error> {
    Ok(match fd.run()? {
        VcpuExit::IoOut(port, data) => Exit::PortOut {
            port,
            first: data.first().copied().unwrap_or(0),
            size: data.len(),
        },
        VcpuExit::IoIn(port, data) => {
            data.fill(0xff);
            Exit::PortIn {
                port,
                size: data.len(),
            }
        }
        VcpuExit::MmioRead(gpa, data) => {
            data.fill(0xff);
            Exit::Mmio {
                gpa,
                write: false,
                size: data.len(),
            }
        }
        VcpuExit::MmioWrite(gpa, data) => Exit::Mmio {
            gpa,
            write: true,
            size: data.len(),
        },
        VcpuExit::Hlt => Exit::Hlt,
        VcpuExit::Shutdown => Exit::Shutdown,
        VcpuExit::FailEntry(reason, _cpu) => Exit::FailEntry(reason),
        VcpuExit::Intr => Exit::Interrupted,
        other => Exit::Other(format!("{other:?}")),
    })
}

fn run_loop(
    fd: &mut VcpuFd,
    cfg: &VcpuConfig,
    ctx: &VcpuContext,
    ie: *const AtomicU8,
    stats: &mut Stats,
) -> VcpuOutcome {
    let vcpu = cfg.index;
    loop {
        if ctx.control.stop_requested() {
            return VcpuOutcome::Stopped;
        }
        let exit = match next_exit(fd) {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR => Exit::Interrupted,
            Err(e) if e.errno() == libc::EAGAIN => continue,
            Err(e) => {
                let what = format!("KVM_RUN failed: {e}");
                tracing::error!(vcpu, %what, "vCPU stopped");
                return VcpuOutcome::Unexpected { what };
            }
        };
        stats.exits += 1;
        match handle_exit(exit, vcpu, ctx, fd, ie) {
            Step::Continue => {}
            Step::End(outcome) => return outcome,
            Step::Unknown(access) => {
                log_unknown(vcpu, &access, ctx.policy, stats.ignored);
                match ctx.policy {
                    UnknownAccessPolicy::Stop => return access,
                    UnknownAccessPolicy::Ignore => stats.ignored += 1,
                }
            }
        }
    }
}

/// What the run loop does after an exit.
enum Step {
    /// Re-enter the guest.
    Continue,
    /// The vCPU is done.
    End(VcpuOutcome),
    /// An access nothing handles: up to the policy.
    Unknown(VcpuOutcome),
}

fn handle_exit(
    exit: Exit,
    vcpu: usize,
    ctx: &VcpuContext,
    fd: &VcpuFd,
    ie: *const AtomicU8,
) -> Step {
    match exit {
        Exit::PortOut {
            port: DOORBELL_PORT,
            first,
            size: 1,
        } => match Doorbell::from_byte(first) {
            Some(Doorbell::Ready) => {
                ctx.control.mark_ready();
                let _ = ctx.events.send(Event::Ready {
                    vcpu,
                    at: Instant::now(),
                });
                Step::Continue
            }
            Some(Doorbell::Done) => Step::End(VcpuOutcome::Done),
            Some(Doorbell::Fault) => Step::End(fault_outcome(vcpu, ctx)),
            None => Step::Unknown(VcpuOutcome::UnknownPort {
                port: DOORBELL_PORT,
                write: true,
                size: 1,
            }),
        },
        Exit::PortOut { port, size, .. } => Step::Unknown(VcpuOutcome::UnknownPort {
            port,
            write: true,
            size,
        }),
        Exit::PortIn { port, size } => Step::Unknown(VcpuOutcome::UnknownPort {
            port,
            write: false,
            size,
        }),
        Exit::Mmio { gpa, write, size } => {
            Step::Unknown(VcpuOutcome::UnknownMmio { gpa, write, size })
        }
        Exit::Hlt => Step::End(VcpuOutcome::Halted),
        Exit::Shutdown => Step::End(shutdown_outcome(vcpu, fd)),
        Exit::FailEntry(reason) => {
            tracing::error!(
                vcpu,
                reason = format_args!("{reason:#x}"),
                "vCPU entry failed"
            );
            Step::End(VcpuOutcome::EntryFailed { reason })
        }
        Exit::Interrupted => {
            // A kick: the stop it announces is seen at the top of the loop. Clearing it here
            // is safe against a racing stop, which sets the flag before `immediate_exit`.
            // SAFETY: `ie` points into this vCPU's kvm_run mapping, live while `fd` is.
            unsafe { (*ie).store(0, Ordering::SeqCst) };
            Step::Continue
        }
        Exit::Other(what) => {
            tracing::error!(vcpu, exit = %what, "unexpected vCPU exit");
            Step::End(VcpuOutcome::Unexpected { what })
        }
    }
}

fn log_unknown(
    vcpu: usize,
    access: &VcpuOutcome,
    policy: UnknownAccessPolicy,
    ignored_so_far: u64,
) {
    const LOGGED: u64 = 16;
    if policy == UnknownAccessPolicy::Ignore && ignored_so_far >= LOGGED {
        return;
    }
    match *access {
        VcpuOutcome::UnknownPort { port, write, size } => {
            tracing::warn!(
                vcpu,
                port = format_args!("{port:#x}"),
                write,
                size,
                ?policy,
                "guest accessed an unknown I/O port"
            );
        }
        VcpuOutcome::UnknownMmio { gpa, write, size } => {
            tracing::warn!(
                vcpu,
                gpa = format_args!("{gpa:#x}"),
                write,
                size,
                ?policy,
                "guest accessed unmapped guest-physical memory"
            );
        }
        _ => {}
    }
}

fn fault_outcome(vcpu: usize, ctx: &VcpuContext) -> VcpuOutcome {
    let gpa = ctx.boot.mailbox(vcpu);
    match ctx.boot_mem.read_obj::<Mailbox>(GuestAddress(gpa)) {
        Ok(m) => {
            let f = m.fault;
            let vector = u8::try_from(f.vector).unwrap_or(u8::MAX);
            let ring = u8::try_from(f.cs & 3).unwrap_or(0);
            tracing::error!(
                vcpu,
                vector,
                error_code = format_args!("{:#x}", f.error_code),
                rip = format_args!("{:#x}", f.rip),
                cr2 = format_args!("{:#x}", f.cr2),
                rflags = format_args!("{:#x}", f.rflags),
                ring,
                "guest exception"
            );
            VcpuOutcome::Exception {
                vector,
                error_code: f.error_code,
                rip: f.rip,
                ring,
                cr2: f.cr2,
            }
        }
        Err(e) => VcpuOutcome::Unexpected {
            what: format!("fault doorbell, but the mailbox at {gpa:#x} is unreadable: {e}"),
        },
    }
}

fn shutdown_outcome(vcpu: usize, fd: &VcpuFd) -> VcpuOutcome {
    let vector = fd
        .get_vcpu_events()
        .ok()
        .filter(|ev| {
            ev.exception.injected != 0 || ev.exception.pending != 0 || ev.exception.nr != 0
        })
        .map(|ev| ev.exception.nr);
    let rip = fd.get_regs().map(|r| r.rip).unwrap_or(0);
    tracing::error!(
        vcpu,
        ?vector,
        rip = format_args!("{rip:#x}"),
        "guest shut down (triple fault)"
    );
    VcpuOutcome::Shutdown { vector, rip }
}
