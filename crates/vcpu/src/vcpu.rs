//! One vCPU thread: pinned first, then the vCPU is created and configured in that thread, then
//! it runs the guest and handles exits (the `exits` module) until the payload ends, the guest
//! fails, powers off or reboots, or a stop. A pause parks it between two `KVM_RUN`s.
//!
//! How a vCPU starts: a built-in payload's vCPUs enter 64-bit mode on the boot
//! area directly; a Linux guest's boot vCPU gets the kernel's entry state
//! ([`vmhost_boot::LinuxBoot::cpu_state`]) and the others stay in KVM's wait-for-INIT/SIPI state
//! until the kernel starts them.

use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Instant;

use kvm_bindings::{kvm_mp_state, CpuId, KVM_MP_STATE_RUNNABLE};
use kvm_ioctls::{VcpuFd, VmFd};
use serde::Serialize;
use vm_memory::{Bytes, GuestAddress};
use vmhost_boot::CpuState;
use vmhost_memory::GuestMemoryMmap;

use crate::arch::{self, BootLayout};
use crate::control::{Control, Gate};
use crate::devices::LinuxDevices;
use crate::exits::{handle_exit, next_exit, Exit, Step};
use crate::payload::mailbox::Mailbox;
use crate::persist::{PersistError, VcpuState, VcpuStateLayout};
use crate::report::VcpuOutcome;
use crate::sys;
use crate::unknown::UnknownLog;

/// What to do when the guest touches a port or guest-physical address nothing handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownAccessPolicy {
    /// [`UnknownAccessPolicy::Stop`] for built-in payloads, [`UnknownAccessPolicy::Ignore`] for
    /// Linux guests (real kernels probe ports that may not exist).
    #[default]
    Auto,
    /// Log it (once per port or 4 KiB page, bounded and rate-limited: [`crate::unknown`]),
    /// return all ones for reads, let the guest go on.
    Ignore,
    /// Log it and stop the VM (the run ends as a guest failure).
    Stop,
}

impl UnknownAccessPolicy {
    /// The policy in force for a guest: `Auto` resolved by the guest kind.
    pub fn resolve(self, linux: bool) -> UnknownAccessPolicy {
        match (self, linux) {
            (UnknownAccessPolicy::Auto, true) => UnknownAccessPolicy::Ignore,
            (UnknownAccessPolicy::Auto, false) => UnknownAccessPolicy::Stop,
            (p, _) => p,
        }
    }
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
    /// `sched_setscheduler(SCHED_FIFO)` failed (realtime vCPUs need CAP_SYS_NICE).
    #[error("vCPU {vcpu}: cannot make its thread SCHED_FIFO at priority {priority} (cpu.realtime needs CAP_SYS_NICE or RLIMIT_RTPRIO)")]
    Realtime {
        /// vCPU index.
        vcpu: u32,
        /// The priority.
        priority: i32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The vCPU thread's syscall filter could not be installed.
    #[error("vCPU {vcpu}: cannot install its syscall filter")]
    Seccomp {
        /// vCPU index.
        vcpu: u32,
        /// The cause.
        #[source]
        source: vmhost_seccomp::SeccompError,
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
    /// Its CPUID could not be completed.
    #[error("vCPU {vcpu}: cannot complete its CPUID")]
    Cpuid {
        /// vCPU index.
        vcpu: u32,
        /// The cause.
        #[source]
        source: arch::CpuidError,
    },
    /// The saved state could not be loaded into the vCPU.
    #[error("vCPU {vcpu}: cannot load its saved state")]
    Restore {
        /// vCPU index.
        vcpu: u32,
        /// The cause.
        #[source]
        source: PersistError,
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

/// How a vCPU starts.
#[derive(Debug, Clone)]
pub(crate) enum VcpuStart {
    /// A built-in payload's vCPU: 64-bit mode on the boot area, at `entry`; `make_runnable`
    /// with the in-kernel irqchip (vCPUs other than the BSP would wait for INIT/SIPI).
    Payload { entry: u64, make_runnable: bool },
    /// A Linux guest's boot vCPU, at the kernel's entry.
    LinuxBoot(Box<CpuState>),
    /// A Linux guest's application processor: left waiting for INIT/SIPI.
    LinuxWaitForSipi,
    /// A restored vCPU: its saved state is loaded instead (CPUID included).
    Restore(Box<VcpuState>),
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
    /// SCHED_FIFO priority when the vCPU is realtime (the plan's realtime mask).
    pub fifo_priority: Option<i32>,
    /// How it starts.
    pub start: VcpuStart,
}

/// What the guest runs, as the vCPU threads see it.
#[derive(Clone)]
pub(crate) enum GuestCtx {
    /// A built-in payload: its boot area (tables, code, mailboxes).
    Payload {
        boot: Arc<BootLayout>,
        boot_mem: GuestMemoryMmap,
    },
    /// A Linux guest: its port-I/O devices, and its RAM (to show the instruction at a failure).
    Linux {
        devices: Arc<LinuxDevices>,
        ram: GuestMemoryMmap,
    },
}

/// Shared by all vCPU threads of a VM.
#[derive(Clone)]
pub(crate) struct VcpuContext {
    pub vm: Arc<VmFd>,
    pub guest: GuestCtx,
    pub control: Arc<Control>,
    pub gate: Arc<Gate>,
    pub events: Sender<Event>,
    /// The resolved policy (never `Auto`).
    pub policy: UnknownAccessPolicy,
    /// What each vCPU saves (MSR list, XSAVE size), probed once for the VM.
    pub layout: Arc<VcpuStateLayout>,
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
    ctx.control.set_tid(vcpu, Some(sys::gettid()));
    let gate = Arc::clone(&ctx.gate);
    let mut pinned = gate.pinned_guard();
    // The filter goes in once the vCPU is created and configured (KVM_CREATE_VCPU, the
    // kvm_run mapping, CPUID, registers, pinning, the kick signal's handler).
    let filtered = setup(&cfg, &ctx, &mut pinned).and_then(|v| {
        vmhost_seccomp::install_current(vmhost_seccomp::ThreadKind::Vcpu).map_err(|source| {
            VcpuError::Seccomp {
                vcpu: u32::try_from(vcpu).unwrap_or(u32::MAX),
                source,
            }
        })?;
        Ok(v)
    });
    let (mut fd, tsc_khz, cpuid) = match filtered {
        Ok(v) => v,
        Err(e) => {
            ctx.control.set_tid(vcpu, None);
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
        // Declared after `fd`, so dropped (cleared) before `fd` unmaps kvm_run.
        // SAFETY: `ie` points into this thread's own kvm_run mapping, which lives as long as
        // `fd`; the guard is dropped on this thread, before `fd`.
        let _target = unsafe { sys::KickTarget::set(ie) };
        let _kick = ctx.control.register(vcpu);
        run_loop(&mut fd, vcpu, &ctx, ie, &cpuid, &mut stats)
    } else {
        VcpuOutcome::NotStarted
    };
    ctx.control.set_tid(vcpu, None);
    let _ = ctx.events.send(Event::Finished {
        vcpu,
        outcome,
        exits: stats.exits,
        ignored: stats.ignored,
        at: Instant::now(),
    });
}

/// Pins the thread, creates the vCPU and gives it its start state; returns it with its TSC
/// rate and the CPUID it was given (which a capture saves).
fn setup(
    cfg: &VcpuConfig,
    ctx: &VcpuContext,
    pinned: &mut crate::control::Pinned<'_>,
) -> Result<(VcpuFd, u32, CpuId), VcpuError> {
    let vcpu = u32::try_from(cfg.index).unwrap_or(u32::MAX);
    if !cfg.cpus.is_empty() {
        sys::pin_current_thread(&cfg.cpus).map_err(|source| VcpuError::Pin {
            vcpu,
            cpus: cfg.cpus.clone(),
            source,
        })?;
    }
    if let Some(priority) = cfg.fifo_priority {
        sys::set_current_thread_fifo(priority).map_err(|source| VcpuError::Realtime {
            vcpu,
            priority,
            source,
        })?;
    }
    // The emulator thread reads the threads' placement back while this one goes on.
    pinned.now();
    sys::prepare_kick_signal().map_err(|source| VcpuError::Signal { vcpu, source })?;
    let kvm = |op: &'static str| move |source| VcpuError::Kvm { vcpu, op, source };
    let fd = ctx
        .vm
        .create_vcpu(u64::from(cfg.kvm_id))
        .map_err(kvm("KVM_CREATE_VCPU"))?;
    let tsc_khz = fd.get_tsc_khz().map_err(kvm("KVM_GET_TSC_KHZ"))?;
    if let VcpuStart::Restore(state) = &cfg.start {
        // The saved state carries the CPUID and the payload's mailbox its TSC rate.
        let restore = |source| VcpuError::Restore { vcpu, source };
        state.restore(&fd, &ctx.layout).map_err(restore)?;
        let cpuid = state.kvm_cpuid().map_err(restore)?;
        // The guest's rate, as KVM now runs it.
        let tsc_khz = fd.get_tsc_khz().map_err(kvm("KVM_GET_TSC_KHZ"))?;
        return Ok((fd, tsc_khz, cpuid));
    }
    let cpuid = arch::cpuid::with_tsc_khz(vcpu, &cfg.cpuid, tsc_khz)
        .map_err(|source| VcpuError::Cpuid { vcpu, source })?;
    fd.set_cpuid2(&cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
    if matches!(ctx.guest, GuestCtx::Linux { .. }) {
        arch::pv::prime_xsave(&fd, &cpuid, vcpu);
    }
    set_start_state(cfg, ctx, &fd)?;
    if let GuestCtx::Payload { boot, boot_mem } = &ctx.guest {
        let gpa = boot.mailbox(cfg.index) + std::mem::offset_of!(Mailbox, tsc_khz) as u64;
        boot_mem
            .write_obj(u64::from(tsc_khz), GuestAddress(gpa))
            .map_err(|source| VcpuError::Mailbox { vcpu, gpa, source })?;
    }
    Ok((fd, tsc_khz, cpuid))
}

/// Registers and MP state of a vCPU that boots (not of a restored one).
fn set_start_state(cfg: &VcpuConfig, ctx: &VcpuContext, fd: &VcpuFd) -> Result<(), VcpuError> {
    let vcpu = u32::try_from(cfg.index).unwrap_or(u32::MAX);
    let kvm = |op: &'static str| move |source| VcpuError::Kvm { vcpu, op, source };
    let ioctl = |(op, source): arch::linux::IoctlError| VcpuError::Kvm { vcpu, op, source };
    match (&cfg.start, &ctx.guest) {
        (
            VcpuStart::Payload {
                entry,
                make_runnable,
            },
            GuestCtx::Payload { boot, .. },
        ) => {
            let mut sregs = fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
            boot.configure_sregs(&mut sregs, cfg.index);
            fd.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))?;
            fd.set_regs(&boot.initial_regs(cfg.index, *entry))
                .map_err(kvm("KVM_SET_REGS"))?;
            if *make_runnable {
                fd.set_mp_state(kvm_mp_state {
                    mp_state: KVM_MP_STATE_RUNNABLE,
                })
                .map_err(kvm("KVM_SET_MP_STATE"))?;
            }
        }
        (VcpuStart::LinuxBoot(state), _) => {
            arch::linux::set_lint(fd).map_err(ioctl)?;
            arch::msrs::set_boot_msrs(fd).map_err(ioctl)?;
            arch::linux::set_boot_state(fd, state).map_err(ioctl)?;
        }
        _ => {
            arch::linux::set_lint(fd).map_err(ioctl)?;
            arch::msrs::set_boot_msrs(fd).map_err(ioctl)?;
        }
    }
    Ok(())
}

/// After a pause, before the vCPU runs again: `KVM_KVMCLOCK_CTRL` sets the "guest stopped"
/// flag in the guest's kvmclock page, which Linux's soft-lockup and RCU-stall detectors check
/// before they report a CPU stuck. Without it a guest paused for longer than their thresholds
/// (20 s and 21 s by default) reports a soft lockup and an RCU stall when it resumes, since
/// its clock ran on while it was paused. KVM refuses it (`EINVAL`) for a guest that has not
/// enabled kvmclock (the built-in payloads): nothing to tell.
fn tell_guest_it_was_paused(fd: &VcpuFd, vcpu: usize) {
    match fd.kvmclock_ctrl() {
        Ok(()) => {}
        Err(e) if e.errno() == libc::EINVAL => {}
        Err(e) => tracing::warn!(vcpu, error = %e, "KVM_KVMCLOCK_CTRL after a pause failed"),
    }
}

/// Exits counted for the report.
#[derive(Default)]
struct Stats {
    exits: u64,
    ignored: u64,
}

fn run_loop(
    fd: &mut VcpuFd,
    vcpu: usize,
    ctx: &VcpuContext,
    ie: *const AtomicU8,
    cpuid: &CpuId,
    stats: &mut Stats,
) -> VcpuOutcome {
    let devices = match &ctx.guest {
        GuestCtx::Linux { devices, .. } => Some(Arc::clone(devices)),
        GuestCtx::Payload { .. } => None,
    };
    let mut unknown = UnknownLog::default();
    // Whether KVM holds no exit for completion: it finishes an I/O, MMIO or MSR exit only at
    // the next KVM_RUN (RIP past an OUT; an IN's or an MMIO read's data into the registers).
    let mut completed = true;
    loop {
        let pausing = ctx.control.pause_requested();
        if pausing && !completed {
            // Before this thread parks and a capture saves its registers: KVM_RUN once with
            // `immediate_exit` set completes the exit and returns EINTR without running the
            // guest (KVM API, KVM_RUN). Saved before it, the target would run the OUT again
            // (a console byte twice) or lose an IN's byte.
            // SAFETY: `ie` points into this vCPU's kvm_run mapping, live while `fd` is.
            unsafe { (*ie).store(1, Ordering::SeqCst) };
        } else if pausing {
            let mut save = || VcpuState::save(fd, &ctx.layout, cpuid);
            if ctx.control.park_if_paused(vcpu, &mut save) {
                // A pause kick may have left `immediate_exit` set; a stop arriving after this
                // store sets it again, and is seen below or makes KVM_RUN return at once.
                // SAFETY: `ie` points into this vCPU's kvm_run mapping, live while `fd` is.
                unsafe { (*ie).store(0, Ordering::SeqCst) };
                if !ctx.control.stop_requested() {
                    tell_guest_it_was_paused(fd, vcpu);
                }
            }
        }
        if ctx.control.stop_requested() {
            return VcpuOutcome::Stopped;
        }
        let stopping = || ctx.control.stop_requested();
        let run = next_exit(fd, devices.as_deref(), &stopping);
        completed = matches!(&run, Err(e) if e.errno() == libc::EINTR);
        let exit = match run {
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
                unknown.note(vcpu, &access, ctx.policy, Instant::now());
                match ctx.policy {
                    UnknownAccessPolicy::Ignore => stats.ignored += 1,
                    _ => return access,
                }
            }
        }
    }
}
