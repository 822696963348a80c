//! Controlling a running VM: the stop flag, pause and resume, the per-vCPU kick targets, the
//! start gate, the VM's lifecycle state, and the handles other threads use ([`StopHandle`] for
//! the binary's SIGINT/SIGTERM handling, [`VmHandle`] for a control API).
//!
//! A kick sends a vCPU's thread the kick signal; the thread's own handler sets
//! `immediate_exit` in its `kvm_run` page (no other thread writes it). A vCPU inside `KVM_RUN`
//! returns `EINTR` on the signal; one about to enter returns at once because its handler set
//! `immediate_exit`; one between runs sees the flag that caused the kick. The kick slot is
//! cleared under its lock before the thread exits, so a kick never signals a dead thread.
//!
//! A stop sets the stop flag, then kicks every vCPU; none enters the guest again. A pause sets
//! the pause request, then kicks every vCPU; each one parks at the top of its run loop (guest
//! state stays in KVM, nothing is lost) until [`VmHandle::resume`] or a stop. [`VmHandle::pause`]
//! returns once every vCPU still running has parked.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::VmFd;
use serde::Serialize;

use crate::dirty::DirtyLog;
use crate::persist::{PersistError, VcpuState};
use crate::snapshot::CaptureError;
use crate::sys;

/// How long [`VmHandle::pause`] waits for every vCPU to park.
pub const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the VM is stopping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// [`StopHandle::stop`] (SIGINT/SIGTERM in the binary).
    Requested,
    /// A vCPU failed (guest fault, or an unknown access under the `stop` policy).
    GuestFailure,
    /// The guest powered off or rebooted.
    GuestEnded,
}

/// Where a VM is in its life, as [`VmHandle::state`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Created; [`crate::Vm::run`] has not started the guest yet.
    Created,
    /// The guest runs.
    Running,
    /// Every vCPU is parked outside `KVM_RUN` by [`VmHandle::pause`].
    Paused,
    /// A stop was requested or the guest ended: the vCPUs are leaving or gone.
    Stopped,
}

/// Why a pause or resume was refused.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The VM is not in a state the operation applies to.
    #[error("cannot {op} a VM that is {state:?}")]
    State {
        /// `pause` or `resume`.
        op: &'static str,
        /// The state it was in.
        state: VmState,
    },
    /// Not every vCPU parked in time; the pause was withdrawn and the VM keeps running.
    #[error("only {parked} of {active} vCPUs parked within {timeout:?}; the VM keeps running")]
    PauseTimeout {
        /// vCPUs parked.
        parked: usize,
        /// vCPUs in their run loop.
        active: usize,
        /// How long it waited.
        timeout: Duration,
    },
    /// The guest has no power button (a built-in payload).
    #[error("this guest has no ACPI power button (only Linux guests have one)")]
    NoPowerButton,
    /// Raising the power button's interrupt failed.
    #[error("cannot raise the power button's interrupt (GSI {gsi})")]
    PowerButton {
        /// The Generic Event Device's GSI.
        gsi: u32,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// Where to kick one vCPU thread: its pthread handle, valid while registered (the thread
/// deregisters before it exits).
pub(crate) struct Kick {
    pub thread: libc::pthread_t,
}

/// Run phase, pause bookkeeping and thread ids, under one lock.
struct Lifecycle {
    started: bool,
    ended: bool,
    pause_requested: bool,
    /// vCPU threads in their run loop (registered).
    active: usize,
    /// Of those, parked.
    parked: usize,
    tids: Vec<Option<i32>>,
    /// A capture in progress: parked vCPUs save their state into it.
    save: Option<SaveJob>,
}

/// One capture: each parked vCPU thread saves its own state into its slot.
struct SaveJob {
    /// Tells this capture's results from a later one's.
    id: u64,
    results: Vec<Option<Result<VcpuState, PersistError>>>,
}

/// State shared by the VM, its vCPU threads, the emulator thread and the handles.
pub(crate) struct Control {
    stop: AtomicBool,
    reason: Mutex<Option<StopReason>>,
    kicks: Vec<Mutex<Option<Kick>>>,
    ready: AtomicUsize,
    life: Mutex<Lifecycle>,
    changed: Condvar,
    /// A Linux guest's VM, to raise the power button's interrupt (weak: the `Vm` owns it).
    power_button: Mutex<Option<Weak<VmFd>>>,
    /// What a capture reads besides the vCPUs (set when the VM is built).
    pub(crate) snapshot: Mutex<Option<crate::snapshot::Source>>,
    /// Numbers capture jobs.
    save_ids: AtomicUsize,
    /// The VM's dirty page log (live migration), set once the VM is built (weak: the `Vm`
    /// owns it, and with it a reference to the guest RAM).
    dirty: OnceLock<Weak<DirtyLog>>,
    /// The guest's TSC rate in kHz (`KVM_GET_TSC_KHZ` of its vCPUs once set up; 0 before).
    tsc_khz: AtomicU32,
    /// Called once, by the first stop request ([`StopHandle::on_stop`]).
    on_stop: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
}

/// Locks `m`; a panicking holder leaves plain data behind, so keep going with it.
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Control {
    pub fn new(vcpus: usize) -> Self {
        Control {
            stop: AtomicBool::new(false),
            reason: Mutex::new(None),
            kicks: (0..vcpus).map(|_| Mutex::new(None)).collect(),
            ready: AtomicUsize::new(0),
            life: Mutex::new(Lifecycle {
                started: false,
                ended: false,
                pause_requested: false,
                active: 0,
                parked: 0,
                tids: vec![None; vcpus],
                save: None,
            }),
            changed: Condvar::new(),
            power_button: Mutex::new(None),
            snapshot: Mutex::new(None),
            save_ids: AtomicUsize::new(0),
            dirty: OnceLock::new(),
            tsc_khz: AtomicU32::new(0),
            on_stop: Mutex::new(Vec::new()),
        }
    }

    /// The number of vCPUs this control was made for.
    pub fn vcpus(&self) -> usize {
        self.kicks.len()
    }

    /// Records the guest's TSC rate once its vCPUs are set up.
    pub fn set_tsc_khz(&self, khz: u32) {
        self.tsc_khz.store(khz, Ordering::Relaxed);
    }

    /// Gives the handles the VM's dirty page log (once; a second call is ignored).
    pub fn set_dirty_log(&self, log: &Arc<DirtyLog>) {
        let _ = self.dirty.set(Arc::downgrade(log));
    }

    /// The VM's dirty page log, once set.
    pub fn dirty_log(&self) -> Option<&Weak<DirtyLog>> {
        self.dirty.get()
    }

    /// Gives the VM a power button: its Generic Event Device's interrupt on `vm`.
    pub fn set_power_button(&self, vm: &Arc<VmFd>) {
        *lock(&self.power_button) = Some(Arc::downgrade(vm));
    }

    /// Presses the power button: an edge on the Generic Event Device's GSI, which the guest's
    /// ACPI `_EVT` turns into a power button notification.
    fn press_power_button(&self) -> Result<(), ControlError> {
        let state = self.state();
        if state == VmState::Stopped {
            return Err(ControlError::State {
                op: "press the power button of",
                state,
            });
        }
        let vm = lock(&self.power_button)
            .as_ref()
            .and_then(Weak::upgrade)
            .ok_or(ControlError::NoPowerButton)?;
        let gsi = vmhost_boot::GED_GSI;
        let err = |source| ControlError::PowerButton { gsi, source };
        vm.set_irq_line(gsi, true).map_err(err)?;
        vm.set_irq_line(gsi, false).map_err(err)
    }

    pub fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    pub fn reason(&self) -> Option<StopReason> {
        *lock(&self.reason)
    }

    /// Sets the flag (the first reason wins), wakes parked vCPUs and kicks every registered one.
    pub fn request_stop(&self, reason: StopReason) {
        lock(&self.reason).get_or_insert(reason);
        self.stop.store(true, Ordering::SeqCst);
        // Parked vCPUs check the flag under this lock: notifying under it loses no wakeup.
        {
            let _life = lock(&self.life);
            self.changed.notify_all();
        }
        self.kick_all();
        let hooks = std::mem::take(&mut *lock(&self.on_stop));
        for hook in hooks {
            hook();
        }
    }

    /// Runs `hook` at the first stop request, or now if one was made.
    fn on_stop(&self, hook: Box<dyn FnOnce() + Send>) {
        {
            let mut hooks = lock(&self.on_stop);
            // Under the lock: `request_stop` sets the flag before it takes the hooks.
            if !self.stop.load(Ordering::SeqCst) {
                hooks.push(hook);
                return;
            }
        }
        hook();
    }

    /// Signals every registered vCPU thread (its handler sets its own `immediate_exit`).
    fn kick_all(&self) {
        for (vcpu, slot) in self.kicks.iter().enumerate() {
            let guard = lock(slot);
            if let Some(k) = guard.as_ref() {
                // SAFETY: the thread deregisters under this lock before it exits, so it is alive.
                if let Err(e) = unsafe { sys::kick_thread(k.thread) } {
                    tracing::warn!(vcpu, error = %e, "cannot signal vCPU thread");
                }
            }
        }
    }

    /// Registers the calling vCPU thread; the registration ends when the guard drops.
    pub fn register(&self, vcpu: usize) -> KickRegistration<'_> {
        *lock(&self.kicks[vcpu]) = Some(Kick {
            thread: sys::pthread_self(),
        });
        lock(&self.life).active += 1;
        KickRegistration {
            control: self,
            vcpu,
        }
    }

    pub fn mark_ready(&self) -> usize {
        self.ready.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub fn ready(&self) -> usize {
        self.ready.load(Ordering::SeqCst)
    }

    /// Records (or, with `None`, forgets) the kernel thread id of vCPU `vcpu`.
    pub fn set_tid(&self, vcpu: usize, tid: Option<i32>) {
        if let Some(slot) = lock(&self.life).tids.get_mut(vcpu) {
            *slot = tid;
        }
    }

    /// The guest starts running (the start gate opens).
    pub fn mark_started(&self) {
        lock(&self.life).started = true;
    }

    /// The run is over: every vCPU thread has been joined (or never started).
    pub fn mark_ended(&self) {
        let mut l = lock(&self.life);
        l.ended = true;
        l.pause_requested = false;
        self.changed.notify_all();
    }

    fn state_of(&self, l: &Lifecycle) -> VmState {
        if l.ended || self.stop_requested() {
            VmState::Stopped
        } else if !l.started {
            VmState::Created
        } else if l.pause_requested && l.parked == l.active {
            VmState::Paused
        } else {
            VmState::Running
        }
    }

    pub fn state(&self) -> VmState {
        self.state_of(&lock(&self.life))
    }

    /// Whether a pause is requested (a vCPU thread completes its last exit before it parks).
    pub fn pause_requested(&self) -> bool {
        lock(&self.life).pause_requested
    }

    /// Called by vCPU thread `vcpu` at the top of its run loop: while a pause is requested
    /// (and no stop), waits parked; while parked it answers a capture ([`Control::save_vcpus`])
    /// by calling `save` on its own thread. Returns true when it parked.
    pub fn park_if_paused(
        &self,
        vcpu: usize,
        save: &mut dyn FnMut() -> Result<VcpuState, PersistError>,
    ) -> bool {
        let mut l = lock(&self.life);
        if !l.pause_requested || self.stop_requested() {
            return false;
        }
        l.parked += 1;
        self.changed.notify_all();
        while l.pause_requested && !self.stop_requested() {
            let job = l
                .save
                .as_ref()
                .filter(|j| j.results.get(vcpu).is_some_and(Option::is_none))
                .map(|j| j.id);
            if let Some(id) = job {
                drop(l);
                let result = save();
                l = lock(&self.life);
                if let Some(j) = l.save.as_mut().filter(|j| j.id == id) {
                    j.results[vcpu] = Some(result);
                }
                self.changed.notify_all();
                continue;
            }
            l = self.changed.wait(l).unwrap_or_else(PoisonError::into_inner);
        }
        l.parked -= 1;
        true
    }

    /// Has every vCPU thread, parked by a pause, save its own state, and returns the states by
    /// vCPU index. Refused unless the VM is paused with every vCPU still in its run loop; gives
    /// up after `timeout` or when the VM stops meanwhile.
    pub fn save_vcpus(&self, timeout: Duration) -> Result<Vec<VcpuState>, CaptureError> {
        let mut l = lock(&self.life);
        let state = self.state_of(&l);
        if state != VmState::Paused {
            return Err(CaptureError::NotPaused { state });
        }
        if let Some(vcpu) = l.tids.iter().position(Option::is_none) {
            return Err(CaptureError::VcpuGone { vcpu });
        }
        if l.active != self.kicks.len() {
            return Err(CaptureError::VcpuGone { vcpu: l.active });
        }
        if l.save.is_some() {
            return Err(CaptureError::InProgress);
        }
        let id = self.save_ids.fetch_add(1, Ordering::SeqCst) as u64;
        l.save = Some(SaveJob {
            id,
            results: (0..self.kicks.len()).map(|_| None).collect(),
        });
        self.changed.notify_all();
        let deadline = Instant::now() + timeout;
        loop {
            let done = l
                .save
                .as_ref()
                .is_some_and(|j| j.id == id && j.results.iter().all(Option::is_some));
            if done {
                let job = l.save.take().map_or_else(Vec::new, |j| j.results);
                return job
                    .into_iter()
                    .enumerate()
                    .map(|(vcpu, r)| match r {
                        Some(Ok(s)) => Ok(s),
                        Some(Err(source)) => Err(CaptureError::Vcpu { vcpu, source }),
                        None => Err(CaptureError::VcpuGone { vcpu }),
                    })
                    .collect();
            }
            let now = Instant::now();
            let state = self.state_of(&l);
            if state != VmState::Paused || now >= deadline {
                l.save = None;
                return Err(if now >= deadline {
                    CaptureError::Timeout { timeout }
                } else {
                    CaptureError::NotPaused { state }
                });
            }
            l = self
                .changed
                .wait_timeout(l, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Requests a pause, kicks every vCPU and waits up to `timeout` for all running ones to
    /// park. On timeout the request is withdrawn.
    pub fn pause(&self, timeout: Duration) -> Result<(), ControlError> {
        {
            let mut l = lock(&self.life);
            match self.state_of(&l) {
                VmState::Running => l.pause_requested = true,
                VmState::Paused => return Ok(()),
                state => return Err(ControlError::State { op: "pause", state }),
            }
        }
        self.kick_all();
        let deadline = Instant::now() + timeout;
        let mut l = lock(&self.life);
        loop {
            match self.state_of(&l) {
                VmState::Paused => return Ok(()),
                VmState::Running => {}
                state => return Err(ControlError::State { op: "pause", state }),
            }
            let now = Instant::now();
            if now >= deadline {
                l.pause_requested = false;
                self.changed.notify_all();
                return Err(ControlError::PauseTimeout {
                    parked: l.parked,
                    active: l.active,
                    timeout,
                });
            }
            l = self
                .changed
                .wait_timeout(l, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Lets parked vCPUs run again.
    pub fn resume(&self) -> Result<(), ControlError> {
        let mut l = lock(&self.life);
        let state = self.state_of(&l);
        if state == VmState::Stopped || !l.pause_requested {
            return Err(ControlError::State {
                op: "resume",
                state,
            });
        }
        l.pause_requested = false;
        self.changed.notify_all();
        Ok(())
    }

    /// `(vCPU index, kernel thread id)` of every live vCPU thread.
    pub fn vcpu_threads(&self) -> Vec<(u32, i32)> {
        lock(&self.life)
            .tids
            .iter()
            .enumerate()
            .filter_map(|(i, t)| Some((u32::try_from(i).ok()?, (*t)?)))
            .collect()
    }
}

/// Deregisters a vCPU's kick target on drop.
pub(crate) struct KickRegistration<'a> {
    control: &'a Control,
    vcpu: usize,
}

impl Drop for KickRegistration<'_> {
    fn drop(&mut self) {
        *lock(&self.control.kicks[self.vcpu]) = None;
        let mut l = lock(&self.control.life);
        l.active -= 1;
        self.control.changed.notify_all();
    }
}

/// Stops a VM from any thread (not from a signal handler: it takes locks). Cheap to clone.
#[derive(Clone)]
pub struct StopHandle(pub(crate) Arc<Control>);

impl std::fmt::Debug for StopHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StopHandle")
            .field("stop_requested", &self.stop_requested())
            .finish()
    }
}

impl StopHandle {
    /// Asks the VM to stop: every vCPU is kicked out of `KVM_RUN` and not resumed.
    /// Idempotent; returns at once (the run returns when all threads are joined).
    pub fn stop(&self) {
        self.0.request_stop(StopReason::Requested);
    }

    /// True once a stop was requested (by this handle, a guest failure or the guest's end).
    pub fn stop_requested(&self) -> bool {
        self.0.stop_requested()
    }

    /// Runs `hook` once, on the thread that makes the first stop request (a vCPU's or the
    /// emulator's at the guest's end, a signal's, the API's), right after the vCPUs are kicked;
    /// at once when a stop was already requested. For work the VM's end makes pointless, such
    /// as a background prefault: it must not block.
    pub fn on_stop(&self, hook: impl FnOnce() + Send + 'static) {
        self.0.on_stop(Box::new(hook));
    }

    /// vCPUs whose payload has reported in (the `Ready` doorbell of `halt` and `idle`).
    pub fn ready_vcpus(&self) -> usize {
        self.0.ready()
    }
}

/// Controls a VM from another thread while [`crate::Vm::run`] blocks: stop, pause, resume,
/// state and the vCPU threads. Cheap to clone; from [`crate::Vm::handle`].
#[derive(Clone)]
pub struct VmHandle(pub(crate) Arc<Control>);

impl std::fmt::Debug for VmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmHandle")
            .field("state", &self.state())
            .finish()
    }
}

impl VmHandle {
    /// A handle for a VM of `vcpus` vCPUs that is not built yet: give it to the VM through
    /// [`crate::VmOptions::handle`]. Until then the VM is `Created`: a pause or a capture is
    /// refused, and a stop is kept (the VM, once built, ends at once).
    pub fn unbuilt(vcpus: usize) -> VmHandle {
        VmHandle(Arc::new(Control::new(vcpus)))
    }

    /// Stops the VM (see [`StopHandle::stop`]); a paused VM stops too.
    pub fn stop(&self) {
        self.0.request_stop(StopReason::Requested);
    }

    /// Kicks every vCPU out of `KVM_RUN` and parks it; returns when every vCPU still running
    /// is parked (at most [`PAUSE_TIMEOUT`], after which the pause is withdrawn). Guest state
    /// stays in KVM; pausing is not a failure and a paused VM can still be stopped. Pausing a
    /// paused VM does nothing.
    pub fn pause(&self) -> Result<(), ControlError> {
        self.0.pause(PAUSE_TIMEOUT)
    }

    /// Lets a paused VM run again (and a Linux guest's device I/O threads, if a capture
    /// quiesced them).
    pub fn resume(&self) -> Result<(), ControlError> {
        let source = lock(&self.0.snapshot).clone();
        if let Some(s) = source.filter(|_| self.state() == VmState::Paused) {
            s.resume_devices();
        }
        self.0.resume()
    }

    /// The VM's state now.
    pub fn state(&self) -> VmState {
        self.0.state()
    }

    /// `(vCPU index, kernel thread id)` of every vCPU thread alive now, by index.
    pub fn vcpu_threads(&self) -> Vec<(u32, i32)> {
        self.0.vcpu_threads()
    }

    /// The guest's TSC rate in kHz, as its vCPUs run it (0 until they are set up): what a
    /// migration's hello tells the target.
    pub fn tsc_khz(&self) -> u32 {
        self.0.tsc_khz.load(Ordering::Relaxed)
    }

    /// Presses the guest's ACPI power button (Linux guests): the guest decides what to do,
    /// normally power off. Refused for payloads and for a stopped VM.
    pub fn press_power_button(&self) -> Result<(), ControlError> {
        self.0.press_power_button()
    }

    /// True when the guest has an ACPI power button (a Linux guest).
    pub fn has_power_button(&self) -> bool {
        lock(&self.0.power_button).is_some()
    }

    /// A stop-only handle to the same VM.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(Arc::clone(&self.0))
    }
}

/// The signals that stop a VM in order: SIGINT, SIGTERM, SIGHUP (the terminal went away) and
/// SIGQUIT. Their default actions would end the process with no clean-up.
pub const STOP_SIGNALS: [libc::c_int; 4] =
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// Calls [`StopHandle::stop`] when the process gets one of [`STOP_SIGNALS`].
///
/// Blocks them in the calling thread and starts a `vmhost-sig` thread that waits for them.
/// Call it from `main` before any other thread starts (threads inherit the mask; a thread
/// started earlier would still take the default action).
pub fn stop_on_signals(handle: StopHandle) -> std::io::Result<JoinHandle<()>> {
    let signals = STOP_SIGNALS;
    sys::set_signal_mask(&signals, libc::SIG_BLOCK)?;
    std::thread::Builder::new()
        .name("vmhost-sig".into())
        .spawn(move || {
            vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Signal);
            loop {
                match sys::wait_signal(&signals) {
                    Ok(sig) => {
                        tracing::info!(signal = sig, "stopping the VM");
                        handle.stop();
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "sigwait failed; signals no longer stop the VM");
                        return;
                    }
                }
            }
        })
}

/// Holds vCPU threads between their setup and the start of the run; counts the vCPU threads
/// that are pinned (their placement can be read back while they load their state).
pub(crate) struct Gate {
    state: Mutex<Option<bool>>,
    cv: Condvar,
    pinned: Mutex<usize>,
    pinned_cv: Condvar,
}

impl Gate {
    pub fn new() -> Self {
        Gate {
            state: Mutex::new(None),
            cv: Condvar::new(),
            pinned: Mutex::new(0),
            pinned_cv: Condvar::new(),
        }
    }

    /// A vCPU thread's promise to count itself pinned once ([`Pinned::now`], or when dropped:
    /// a thread that failed or panicked before its pinning is counted too, so that
    /// [`Gate::wait_pinned`] never waits for it).
    pub fn pinned_guard(&self) -> Pinned<'_> {
        Pinned {
            gate: self,
            done: false,
        }
    }

    /// Waits until `n` vCPU threads have counted themselves pinned.
    pub fn wait_pinned(&self, n: usize) {
        let mut count = lock(&self.pinned);
        while *count < n {
            count = self
                .pinned_cv
                .wait(count)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Releases the waiters: `true` to run, `false` to abort.
    pub fn open(&self, go: bool) {
        *lock(&self.state) = Some(go);
        self.cv.notify_all();
    }

    /// Waits for [`Gate::open`]; returns its argument.
    pub fn wait(&self) -> bool {
        let mut s = lock(&self.state);
        loop {
            if let Some(go) = *s {
                return go;
            }
            s = self.cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// See [`Gate::pinned_guard`].
pub(crate) struct Pinned<'a> {
    gate: &'a Gate,
    done: bool,
}

impl Pinned<'_> {
    /// Counts the thread pinned (once).
    pub fn now(&mut self) {
        if !self.done {
            self.done = true;
            *lock(&self.gate.pinned) += 1;
            self.gate.pinned_cv.notify_all();
        }
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        self.now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU8;

    /// A hook registered before the stop runs once, at the first request, on the requesting
    /// thread; one registered after it runs at once; later requests run none again.
    #[test]
    fn stop_hooks_run_once_at_the_first_stop_or_at_once_after_it() {
        let c = Arc::new(Control::new(1));
        let handle = StopHandle(Arc::clone(&c));
        let ran = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&ran);
        handle.on_stop(move || {
            r.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 0, "not before a stop");
        std::thread::spawn(move || handle.stop()).join().unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        c.request_stop(StopReason::GuestEnded);
        assert_eq!(ran.load(Ordering::SeqCst), 1, "once");
        let r = Arc::clone(&ran);
        StopHandle(Arc::clone(&c)).on_stop(move || {
            r.fetch_add(10, Ordering::SeqCst);
        });
        assert_eq!(ran.load(Ordering::SeqCst), 11, "after the stop: at once");
    }

    /// `wait_pinned` returns once every thread counted itself: pinned, failed before its
    /// pinning (the guard dropped), or panicked (the guard dropped in the unwinding), each
    /// once however often `now` is called.
    #[test]
    fn every_vcpu_thread_counts_as_pinned_once_whatever_its_fate() {
        let gate = Arc::new(Gate::new());
        let threads: Vec<_> = (0..3)
            .map(|i| {
                let gate = Arc::clone(&gate);
                std::thread::spawn(move || {
                    let mut pinned = gate.pinned_guard();
                    match i {
                        0 => {
                            pinned.now();
                            pinned.now();
                        }
                        1 => drop(pinned),
                        _ => panic!("a vCPU thread that panics before its pinning"),
                    }
                })
            })
            .collect();
        gate.wait_pinned(3);
        let panicked = threads.into_iter().filter_map(|t| t.join().err()).count();
        assert_eq!(panicked, 1);
        assert_eq!(*lock(&gate.pinned), 3, "each thread once");
    }

    #[test]
    fn first_reason_wins_and_unregistered_slots_are_skipped() {
        let c = Control::new(2);
        assert!(!c.stop_requested());
        c.request_stop(StopReason::GuestFailure);
        c.request_stop(StopReason::Requested);
        assert!(c.stop_requested());
        assert_eq!(c.reason(), Some(StopReason::GuestFailure));
    }

    #[test]
    fn immediate_exit_is_set_by_the_kicked_thread_itself_not_by_the_kicker() {
        sys::prepare_kick_signal().unwrap();
        let c = Arc::new(Control::new(1));
        let flag = Arc::new(AtomicU8::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let t = {
            let (c, flag) = (Arc::clone(&c), Arc::clone(&flag));
            std::thread::spawn(move || {
                sys::prepare_kick_signal().unwrap();
                // SAFETY: `flag` outlives the guard, which drops on this thread.
                let target = unsafe { sys::KickTarget::set(Arc::as_ptr(&flag)) };
                // Hold the kick pending: its handler cannot run on this thread yet.
                sys::set_signal_mask(&[sys::kick_signal()], libc::SIG_BLOCK).unwrap();
                let reg = c.register(0);
                tx.send(()).unwrap();
                go_rx.recv().unwrap();
                // The pending kick is delivered here, to this thread's handler.
                sys::set_signal_mask(&[sys::kick_signal()], libc::SIG_UNBLOCK).unwrap();
                let seen = flag.load(Ordering::SeqCst);
                drop(reg);
                drop(target);
                seen
            })
        };
        rx.recv().unwrap();
        StopHandle(Arc::clone(&c)).stop();
        assert_eq!(
            flag.load(Ordering::SeqCst),
            0,
            "the kicker wrote the vCPU's immediate_exit from another thread"
        );
        go_tx.send(()).unwrap();
        assert_eq!(t.join().unwrap(), 1, "the vCPU thread's own handler set it");
        assert!(lock(&c.kicks[0]).is_none());
    }

    /// A vCPU state that says which vCPU saved it (`mp_state`) and on which thread
    /// (`tsc_khz` = the saving thread's id).
    fn fake_state(vcpu: usize) -> VcpuState {
        VcpuState {
            cpuid: Vec::new(),
            regs: Vec::new(),
            sregs: Vec::new(),
            xsave: Vec::new(),
            xcrs: Vec::new(),
            debug_regs: Vec::new(),
            lapic: Vec::new(),
            msrs: Vec::new(),
            events: Vec::new(),
            mp_state: u32::try_from(vcpu).unwrap(),
            tsc_khz: u32::try_from(sys::gettid()).unwrap(),
        }
    }

    #[test]
    fn each_parked_vcpu_saves_its_own_state_on_its_own_thread() {
        let c = Arc::new(Control::new(2));
        c.mark_started();
        let (_, threads) = fake_vcpus(&c, 2);
        let err = c.save_vcpus(Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(
                err,
                CaptureError::NotPaused {
                    state: VmState::Running
                }
            ),
            "{err}"
        );
        c.pause(Duration::from_secs(5)).unwrap();
        let tids = c.vcpu_threads();
        for _ in 0..2 {
            let states = c.save_vcpus(Duration::from_secs(5)).unwrap();
            assert_eq!(states.len(), 2);
            for (i, s) in states.iter().enumerate() {
                assert_eq!(s.mp_state as usize, i, "vCPU {i}'s slot");
                assert_eq!(
                    i64::from(s.tsc_khz),
                    i64::from(tids[i].1),
                    "saved on vcpu{i}'s thread"
                );
            }
        }
        assert_eq!(c.state(), VmState::Paused, "still paused");
        c.request_stop(StopReason::Requested);
        for t in threads {
            t.join().unwrap();
        }
        let err = c.save_vcpus(Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(
                err,
                CaptureError::NotPaused {
                    state: VmState::Stopped
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_capture_with_a_vcpu_that_has_ended_names_it() {
        let c = Arc::new(Control::new(2));
        c.mark_started();
        // vCPU 1's thread has ended (or never started); vCPU 0 runs and parks.
        let (_, threads) = fake_vcpus(&c, 1);
        c.pause(Duration::from_secs(5)).unwrap();
        let err = c.save_vcpus(Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, CaptureError::VcpuGone { vcpu: 1 }), "{err}");
        assert_eq!(c.state(), VmState::Paused);
        c.request_stop(StopReason::Requested);
        for t in threads {
            t.join().unwrap();
        }
    }

    /// `n` fake vCPU threads that register and loop on `park_if_paused` until a stop, counting
    /// their iterations; parked, they answer a capture with [`fake_state`].
    fn fake_vcpus(
        c: &Arc<Control>,
        n: usize,
    ) -> (Vec<Arc<AtomicUsize>>, Vec<std::thread::JoinHandle<()>>) {
        sys::prepare_kick_signal().unwrap();
        let counters: Vec<Arc<AtomicUsize>> = (0..n).map(|_| Arc::default()).collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let threads = counters
            .iter()
            .enumerate()
            .map(|(i, count)| {
                let (c, count, tx) = (Arc::clone(c), Arc::clone(count), tx.clone());
                std::thread::spawn(move || {
                    sys::prepare_kick_signal().unwrap();
                    c.set_tid(i, Some(sys::gettid()));
                    let reg = c.register(i);
                    tx.send(()).unwrap();
                    while !c.stop_requested() {
                        c.park_if_paused(i, &mut || Ok(fake_state(i)));
                        count.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    drop(reg);
                    c.set_tid(i, None);
                })
            })
            .collect();
        for _ in 0..n {
            rx.recv().unwrap();
        }
        (counters, threads)
    }

    #[test]
    fn pause_parks_every_registered_thread_until_resume_or_stop() {
        let c = Arc::new(Control::new(2));
        assert_eq!(c.state(), VmState::Created);
        c.mark_started();
        let (counters, threads) = fake_vcpus(&c, 2);
        assert_eq!(c.vcpu_threads().len(), 2);
        c.pause(Duration::from_secs(5)).unwrap();
        assert_eq!(c.state(), VmState::Paused);
        let frozen: Vec<usize> = counters.iter().map(|n| n.load(Ordering::SeqCst)).collect();
        std::thread::sleep(Duration::from_millis(20));
        let still: Vec<usize> = counters.iter().map(|n| n.load(Ordering::SeqCst)).collect();
        assert_eq!(frozen, still, "parked threads make no progress");
        c.resume().unwrap();
        assert_eq!(c.state(), VmState::Running);
        c.pause(Duration::from_secs(5)).unwrap();
        c.request_stop(StopReason::Requested);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(c.state(), VmState::Stopped);
        assert!(c.vcpu_threads().is_empty());
        assert!(matches!(
            c.resume(),
            Err(ControlError::State {
                state: VmState::Stopped,
                ..
            })
        ));
    }

    #[test]
    fn a_pause_nobody_answers_times_out_and_is_withdrawn() {
        let c = Control::new(1);
        c.mark_started();
        // Registered but never parking: a thread stuck outside its run loop.
        let flag = Arc::new(AtomicU8::new(0));
        sys::prepare_kick_signal().unwrap();
        // SAFETY: `flag` outlives the guard, dropped on this thread below.
        let target = unsafe { sys::KickTarget::set(Arc::as_ptr(&flag)) };
        let reg = c.register(0);
        let err = c.pause(Duration::from_millis(50)).unwrap_err();
        assert!(
            matches!(
                err,
                ControlError::PauseTimeout {
                    parked: 0,
                    active: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(c.state(), VmState::Running);
        assert_eq!(flag.load(Ordering::SeqCst), 1, "the thread was kicked");
        drop(reg);
        drop(target);
        c.mark_ended();
        assert_eq!(c.state(), VmState::Stopped);
    }

    #[test]
    fn gate_releases_waiters_with_the_verdict() {
        let g = Arc::new(Gate::new());
        let w = {
            let g = Arc::clone(&g);
            std::thread::spawn(move || g.wait())
        };
        g.open(false);
        assert!(!w.join().unwrap());
        assert!(!g.wait(), "a late waiter gets the same verdict");
    }

    #[test]
    fn ready_vcpus_are_counted() {
        let handle = StopHandle(Arc::new(Control::new(2)));
        assert_eq!(handle.0.mark_ready(), 1);
        assert_eq!(handle.0.mark_ready(), 2);
        assert_eq!(handle.ready_vcpus(), 2);
        assert!(!handle.stop_requested());
        assert!(format!("{handle:?}").contains("stop_requested: false"));
    }
}
