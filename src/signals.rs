//! The stop signals of the run path (`vmhost_vcpu::STOP_SIGNALS`: SIGINT, SIGTERM, SIGHUP,
//! SIGQUIT), from the first instruction of the run to its end.
//!
//! They are blocked before any other thread starts, and one `vmhost-sig` thread waits for them.
//! A signal sets the cancel flag, which stops a prefault in progress (setup ends at once, in
//! order: cgroup and ledger entry released), and stops the VM once it exists: a signal that
//! arrives before the VM is attached stops it as soon as it is.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use vmhost_vcpu::{StopHandle, STOP_SIGNALS};

/// The run's stop signals; see the module docs.
pub struct StopSignals {
    requested: Arc<AtomicBool>,
    vm: Arc<Mutex<Option<StopHandle>>>,
}

impl StopSignals {
    /// Blocks the stop signals in the calling thread (threads started later inherit the mask)
    /// and starts the `vmhost-sig` thread. Call it before any other thread starts.
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
                            Ok(sig) => {
                                tracing::info!(signal = sig, "stopping the VM");
                                requested.store(true, Ordering::SeqCst);
                                if let Some(h) = vm.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
                                    h.stop();
                                }
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
