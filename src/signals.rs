//! The stop signals of the run path (`vmhost_vcpu::STOP_SIGNALS`: SIGINT, SIGTERM, SIGHUP,
//! SIGQUIT), from the first instruction of `main` to the end of the run.
//!
//! `main` blocks them before anything else ([`block_at_start`]); the other commands unblock
//! them again ([`unblock_for_other_commands`]). Until the VM is admitted a signal stays
//! pending: each setup step ends with [`stop_if_requested`], and the wait for the ledger lock
//! takes it (`vmhost_ledger::LockWait::interrupt`); either ends the start with exit status
//! [`EXIT_INTERRUPTED`] before anything is allocated. From the run on, one `vmhost-sig` thread
//! waits for them (a signal still pending is taken at once). A signal sets the cancel flag,
//! which stops a prefault in progress (setup ends at once, in order: cgroup and ledger entry
//! released), and stops the VM once it exists: a signal that arrives before the VM is attached
//! stops it as soon as it is. The cgroup v2 supervisor forks with the mask in place: the
//! supervisor keeps a signal pending at the fork and forwards it; the VMM inherits the mask.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use vmhost_vcpu::{StopHandle, STOP_SIGNALS};

/// Exit status of a run interrupted by a stop signal.
pub const EXIT_INTERRUPTED: u8 = 130;

/// Blocks the stop signals; the first thing `main` does, before any other thread exists.
pub fn block_at_start() -> io::Result<()> {
    crate::sys::block_signals(&STOP_SIGNALS)
}

/// Gives the commands other than a run (plan, ps, ctl, bench, ...) the signals' default
/// action back; one that came meanwhile takes it now.
pub fn unblock_for_other_commands() -> io::Result<()> {
    crate::sys::unblock_signals(&STOP_SIGNALS)
}

/// The name of stop signal `sig` (its number for any other).
pub fn name(sig: libc::c_int) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGQUIT => "SIGQUIT".into(),
        other => format!("signal {other}"),
    }
}

/// The orderly end of a start that a stop signal interrupted during setup `step` (before the
/// VM holds anything): exit status [`EXIT_INTERRUPTED`], naming the signal and the step.
pub fn interrupted(sig: libc::c_int, step: &str) -> crate::Exit {
    crate::Exit {
        code: EXIT_INTERRUPTED,
        message: format!("stopped by {} {step}; nothing was started", name(sig)),
    }
}

/// Fails with [`interrupted`] when a stop signal is pending after setup `step`.
pub fn stop_if_requested(step: &str) -> Result<(), crate::Exit> {
    match crate::sys::pending_signal(&STOP_SIGNALS) {
        Some(sig) => Err(interrupted(sig, step)),
        None => Ok(()),
    }
}

/// The lock wait of a start: a stop signal ends it; a marker line on stderr says it began.
pub fn ledger_lock_wait() -> vmhost_ledger::LockWait {
    vmhost_ledger::LockWait {
        interrupt: STOP_SIGNALS.to_vec(),
        on_wait: Some(announce_lock_wait),
        ..Default::default()
    }
}

fn announce_lock_wait(path: &std::path::Path, holder: &str) {
    eprintln!(
        "vmhost: waiting for the ledger lock {} held by {holder} (up to {} s)",
        path.display(),
        vmhost_ledger::LOCK_TIMEOUT.as_secs()
    );
}

/// What the run prints when a stop signal arrives: the signal and who sent it.
fn stop_line(got: crate::sys::Received) -> String {
    let from = match got.pid {
        0 => "from the kernel".to_string(),
        pid => format!("from pid {pid}{}", comm(pid)),
    };
    format!("{} {from}: stopping the VM", name(got.signal))
}

/// ` (name)` of process `pid` from `/proc`, or nothing when it is gone or unreadable.
fn comm(pid: libc::pid_t) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| format!(" ({})", c.trim_end()))
        .unwrap_or_default()
}

/// The run's stop signals; see the module docs.
pub struct StopSignals {
    requested: Arc<AtomicBool>,
    vm: Arc<Mutex<Option<StopHandle>>>,
}

impl StopSignals {
    /// Starts the `vmhost-sig` thread. The stop signals are blocked (since `main`, and here
    /// again for safety) in every thread that exists.
    pub fn start() -> io::Result<StopSignals> {
        crate::sys::block_signals(&STOP_SIGNALS)?;
        let requested = Arc::new(AtomicBool::new(false));
        let vm: Arc<Mutex<Option<StopHandle>>> = Arc::default();
        {
            let (requested, vm) = (Arc::clone(&requested), Arc::clone(&vm));
            std::thread::Builder::new()
                .name("vmhost-sig".into())
                .spawn(move || {
                    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Signal);
                    loop {
                        match crate::sys::wait_signal(&STOP_SIGNALS) {
                            Ok(got) => {
                                requested.store(true, Ordering::SeqCst);
                                if let Some(h) = vm.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
                                    h.stop();
                                }
                                // After the stop, and through the log's writer, which drops
                                // rather than waits when nobody reads stderr: an operator (or
                                // a test) that finds the VM stopped learns who asked.
                                tracing::warn!("{}", stop_line(got));
                            }
                            Err(e) => {
                                eprintln!("vmhost: warning: sigwait failed ({e}); signals no longer stop the VM");
                                return;
                            }
                        }
                    }
                })?;
        }
        Ok(StopSignals { requested, vm })
    }

    /// The flag a signal sets (for `PrefaultOptions::cancel`).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.requested)
    }

    /// From now on a signal stops `vm`; one that came already stops it now.
    pub fn attach(&self, vm: StopHandle) {
        let mut slot = self.vm.lock().unwrap_or_else(PoisonError::into_inner);
        if self.requested.load(Ordering::SeqCst) {
            vm.stop();
        }
        *slot = Some(vm);
    }
}
