//! `--prefault background`: guest RAM faulted in while the guest boots.
//!
//! The memory crate runs the pinned workers on a `vmhost-prefault` thread
//! ([`vmhost_memory::background`]); this module gives it what the run does at the end of a
//! prefault: narrow the cgroup's cpuset to the envelope (the workers needed the node's PUs),
//! print the residency read back, keep the audit for the report, and stop the VM with exit
//! status 1 when the prefault failed (a guest whose RAM cannot be faulted in would fail on its
//! own later, with a worse message).

use std::sync::{Arc, Mutex, OnceLock};

use anyhow::Result;
use vmhost_memory::{Audit, GuestMemory, MemoryError, PrefaultError, StartGate};
use vmhost_plan::Plan;
use vmhost_vcpu::StopHandle;

use crate::enforce::Enforcement;
use crate::timeline::now_ns;

/// How a background prefault ended, as the run reports it.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    /// When it ended (`CLOCK_MONOTONIC` ns; 0: it had not ended when the VM stopped).
    pub done_ns: u64,
    /// Residency read back at its end.
    pub audit: Option<Audit>,
    /// Why it failed (not for a cancellation by the VM's end).
    pub error: Option<String>,
}

/// A started background prefault: its outcome, and the VM to stop if it fails.
#[derive(Debug, Clone, Default)]
pub struct Background {
    outcome: Arc<Mutex<Outcome>>,
    stop: Arc<OnceLock<StopHandle>>,
    gate: StartGate,
}

impl Background {
    /// Starts the prefault `memory` deferred, its workers held back until [`Background::go`];
    /// `None` when it prefaulted before the start.
    pub fn start(
        memory: &mut GuestMemory,
        plan: &Plan,
        enforcement: Option<&Arc<Enforcement>>,
        print: bool,
    ) -> Result<Option<Background>> {
        let bg = Background::default();
        let (outcome, stop) = (Arc::clone(&bg.outcome), Arc::clone(&bg.stop));
        let (name, plan, enforcement) = (plan.name.clone(), plan.clone(), enforcement.cloned());
        let started = memory.start_background_prefault_at(
            Box::new(move |result| {
                let mut out = Outcome {
                    done_ns: now_ns(),
                    ..Outcome::default()
                };
                match result {
                    Ok(done) => {
                        if let Some(Err(e)) =
                            enforcement.as_ref().map(|e| e.narrow_after_prefault())
                        {
                            out.error = Some(format!("{e:#}"));
                        }
                        if print {
                            print!(
                                "VM {name}: guest RAM prefaulted in the background in {:.3} s\n{}",
                                done.seconds,
                                crate::output::residency_table(&plan, &done.audit)
                            );
                        }
                        out.audit = Some(done.audit);
                    }
                    Err(MemoryError::Prefault {
                        source: PrefaultError::Cancelled { .. },
                        ..
                    }) => out.done_ns = 0,
                    Err(e) => {
                        let chain: Vec<String> =
                            std::iter::successors(Some(&e as &dyn std::error::Error), |e| {
                                e.source()
                            })
                            .map(ToString::to_string)
                            .collect();
                        out.error = Some(chain.join(": "));
                    }
                }
                let failed = out.error.clone();
                if let Ok(mut slot) = outcome.lock() {
                    *slot = out;
                }
                // After the slot is written: `attach` sets the handle first and reads the slot
                // after, so one of the two sees the other.
                if let Some(why) = failed {
                    eprintln!("vmhost: VM {name}: background prefault failed, stopping: {why}");
                    if let Some(stop) = stop.get() {
                        stop.stop();
                    }
                }
            }),
            bg.gate.clone(),
        )?;
        Ok(started.then_some(bg))
    }

    /// Lets the workers go: the run calls it once the guest runs, so that the VM's creation
    /// and the kernel's loading have the node's CPUs to themselves (docs/benchmarks.md).
    pub fn go(&self) {
        self.gate.open();
    }

    /// The VM to stop if the prefault fails (set once the VM exists).
    pub fn attach(&self, stop: StopHandle) {
        let _ = self.stop.set(stop.clone());
        // The guest's end (or any stop) cancels the workers at once: the exit need not wait
        // for RAM nobody will use to be faulted in.
        let gate = self.gate.clone();
        stop.on_stop(move || gate.cancel());
        if self.outcome().error.is_some() {
            stop.stop();
        }
    }

    /// The outcome so far.
    pub fn outcome(&self) -> Outcome {
        self.outcome.lock().map(|o| o.clone()).unwrap_or_default()
    }
}
