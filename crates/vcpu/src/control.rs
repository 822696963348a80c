//! Stopping a running VM: the stop flag, the per-vCPU kick targets, the start gate, and the
//! [`StopHandle`] the binary triggers from its SIGINT/SIGTERM handling.
//!
//! A stop sets the flag, then for every vCPU still registered sets `immediate_exit` in its
//! `kvm_run` page and sends its thread the kick signal. A vCPU inside `KVM_RUN` returns `EINTR`
//! on the signal; one about to enter returns at once because `immediate_exit` is set; one
//! between runs sees the flag. The kick slot is cleared under its lock before the vCPU's
//! `kvm_run` page is unmapped and before its thread exits, so a kick never touches either after
//! they are gone.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use crate::sys;

/// Why the VM is stopping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// [`StopHandle::stop`] (SIGINT/SIGTERM in the binary).
    Requested,
    /// A vCPU failed (guest fault, or an unknown access under the `stop` policy).
    GuestFailure,
}

/// Where to kick one vCPU thread.
pub(crate) struct Kick {
    pub thread: libc::pthread_t,
    pub immediate_exit: *const AtomicU8,
}

// SAFETY: `Kick` is only used under its slot's mutex; the pointer targets the vCPU's kvm_run
// mapping, which stays mapped while the kick is registered (the vCPU thread deregisters before
// dropping its VcpuFd), and the pthread handle is valid while registered (deregistered before
// the thread exits). Both may be used from any thread.
unsafe impl Send for Kick {}

/// State shared by the VM, its vCPU threads, the emulator thread and stop handles.
pub(crate) struct Control {
    stop: AtomicBool,
    reason: Mutex<Option<StopReason>>,
    kicks: Vec<Mutex<Option<Kick>>>,
    ready: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking holder leaves plain data behind: keep going with it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Control {
    pub fn new(vcpus: usize) -> Self {
        Control {
            stop: AtomicBool::new(false),
            reason: Mutex::new(None),
            kicks: (0..vcpus).map(|_| Mutex::new(None)).collect(),
            ready: AtomicUsize::new(0),
        }
    }

    pub fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    pub fn reason(&self) -> Option<StopReason> {
        *lock(&self.reason)
    }

    /// Sets the flag (the first reason wins) and kicks every registered vCPU.
    pub fn request_stop(&self, reason: StopReason) {
        lock(&self.reason).get_or_insert(reason);
        self.stop.store(true, Ordering::SeqCst);
        for (vcpu, slot) in self.kicks.iter().enumerate() {
            let guard = lock(slot);
            if let Some(k) = guard.as_ref() {
                // SAFETY: the pointer is valid while the kick is registered, and we hold the
                // slot's lock (see `Kick`).
                unsafe { (*k.immediate_exit).store(1, Ordering::SeqCst) };
                // SAFETY: the thread deregisters under this lock before it exits, so it is alive.
                if let Err(e) = unsafe { sys::kick_thread(k.thread) } {
                    tracing::warn!(vcpu, error = %e, "cannot signal vCPU thread");
                }
            }
        }
    }

    /// Registers the calling vCPU thread; the registration ends when the guard drops.
    pub fn register(&self, vcpu: usize, immediate_exit: *const AtomicU8) -> KickRegistration<'_> {
        *lock(&self.kicks[vcpu]) = Some(Kick {
            thread: sys::pthread_self(),
            immediate_exit,
        });
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
}

/// Deregisters a vCPU's kick target on drop.
pub(crate) struct KickRegistration<'a> {
    control: &'a Control,
    vcpu: usize,
}

impl Drop for KickRegistration<'_> {
    fn drop(&mut self) {
        *lock(&self.control.kicks[self.vcpu]) = None;
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

    /// True once a stop was requested (by this handle or by a guest failure).
    pub fn stop_requested(&self) -> bool {
        self.0.stop_requested()
    }

    /// vCPUs whose payload has reported in (the `Ready` doorbell of `halt` and `idle`).
    pub fn ready_vcpus(&self) -> usize {
        self.0.ready()
    }
}

/// Calls [`StopHandle::stop`] when the process gets SIGINT or SIGTERM.
///
/// Blocks both signals in the calling thread and starts a `vmhost-sig` thread that waits for
/// them. Call it from `main` before any other thread starts (threads inherit the mask; a thread
/// started earlier would still take the default action).
pub fn stop_on_signals(handle: StopHandle) -> std::io::Result<JoinHandle<()>> {
    let signals = [libc::SIGINT, libc::SIGTERM];
    sys::set_signal_mask(&signals, libc::SIG_BLOCK)?;
    std::thread::Builder::new()
        .name("vmhost-sig".into())
        .spawn(move || loop {
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
        })
}

/// Holds vCPU threads between their setup and the start of the run.
pub(crate) struct Gate {
    state: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Gate {
    pub fn new() -> Self {
        Gate {
            state: Mutex::new(None),
            cv: Condvar::new(),
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_registered_thread_gets_immediate_exit_and_the_signal() {
        sys::prepare_kick_signal().unwrap();
        let c = Arc::new(Control::new(1));
        let flag = Arc::new(AtomicU8::new(0));
        let (tx, rx) = std::sync::mpsc::channel();
        let t = {
            let (c, flag) = (Arc::clone(&c), Arc::clone(&flag));
            std::thread::spawn(move || {
                sys::prepare_kick_signal().unwrap();
                let reg = c.register(0, Arc::as_ptr(&flag));
                tx.send(()).unwrap();
                while !c.stop_requested() {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                drop(reg);
            })
        };
        rx.recv().unwrap();
        StopHandle(Arc::clone(&c)).stop();
        t.join().unwrap();
        assert_eq!(flag.load(Ordering::SeqCst), 1);
        assert!(lock(&c.kicks[0]).is_none());
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
