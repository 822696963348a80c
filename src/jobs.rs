//! The control API's long jobs: a snapshot (`PUT /vm/snapshot`) and a migration
//! (`PUT /vm/migrate`). Each kind has one worker thread of its own, started with the API (so
//! the API thread never starts a thread) under its own syscall filter, idle until a `PUT`
//! queues a job; the `PUT` answers at once with the first progress report and `GET` polls it.
//! One job of a kind at a time. When a job ends the VM (a snapshot with `stop`, a migration
//! that committed), the worker first lets a poller read the result, for [`RESULT_GRACE`] at
//! most.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use serde_json::Value;
use vmhost_api::ControlError;
use vmhost_seccomp::ThreadKind;

/// How long a job that ends the VM waits for its result to be read.
pub const RESULT_GRACE: Duration = Duration::from_secs(5);

/// A job's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Running.
    Running,
    /// Ended well.
    Succeeded,
    /// Ended with an error.
    Failed,
}

/// What every job's report holds, flattened into it (`state`, `phase`, `seconds`, `error`).
#[derive(Debug, Clone, Serialize)]
pub struct JobStatus {
    /// The job's state.
    pub state: JobState,
    /// The step in progress or last done (`queued` first, `done` at a success).
    pub phase: String,
    /// Seconds since the job started.
    pub seconds: f64,
    /// Why it failed.
    pub error: Option<String>,
    /// When each step began, seconds since the start, in order (`queued` is not one).
    pub phases: Vec<PhaseMark>,
}

/// A step of a job and when it began.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseMark {
    /// The step.
    pub phase: String,
    /// Seconds since the job started.
    pub at: f64,
}

impl JobStatus {
    /// A job just queued.
    pub fn queued() -> Self {
        JobStatus {
            state: JobState::Running,
            phase: "queued".into(),
            seconds: 0.0,
            error: None,
            phases: Vec::new(),
        }
    }
}

/// A kind's progress report, as the runner keeps it.
pub trait Report: Serialize + Send + 'static {
    /// The fields every report has.
    fn status(&self) -> &JobStatus;
    /// The same, to change.
    fn status_mut(&mut self) -> &mut JobStatus;
    /// Bytes of guest memory moved so far (written or sent).
    fn set_bytes(&mut self, bytes: u64);

    /// The job's state.
    fn state(&self) -> JobState {
        self.status().state
    }
    /// Ends the report: [`JobState::Succeeded`] (phase `done`) or failed with `error`.
    fn finish(&mut self, error: Option<String>) {
        let s = self.status_mut();
        match error {
            None => {
                s.state = JobState::Succeeded;
                s.phase = "done".into();
            }
            Some(e) => {
                s.state = JobState::Failed;
                s.error = Some(e);
            }
        }
    }
    /// The live figures: bytes of guest memory moved so far, seconds since the start.
    fn set_counters(&mut self, bytes: u64, seconds: f64) {
        self.set_bytes(bytes);
        self.status_mut().seconds = seconds;
    }
    /// The step the job is in, begun `at` seconds after the start.
    fn set_phase(&mut self, phase: &str, at: f64) {
        let s = self.status_mut();
        s.phase = phase.to_string();
        s.phases.push(PhaseMark {
            phase: phase.to_string(),
            at,
        });
    }
}

/// What the runner does once a job ended.
pub enum Then {
    /// The VM runs on; the worker waits for the next job.
    RunOn,
    /// The VM ends: after the result was read (or [`RESULT_GRACE`]), [`Job::end_vm`] runs;
    /// with `last`, the worker then stops taking jobs.
    EndVm {
        /// No job can follow.
        last: bool,
    },
}

/// A kind of long job.
pub trait Job: Send + 'static {
    /// What a `PUT` asks for.
    type Request: Send + 'static;
    /// What `GET` reports.
    type Progress: Report;
    /// Does one job, reporting through `shared`.
    fn run(&mut self, req: &Self::Request, shared: &Shared<Self::Progress>) -> Result<()>;
    /// What follows the job's `outcome`.
    fn then(&mut self, req: &Self::Request, outcome: &Result<()>) -> Then;
    /// Ends the VM after a job whose [`Job::then`] said so.
    fn end_vm(&mut self, req: &Self::Request);
}

/// A job's report and counters, shared by the worker and the API.
pub struct Shared<P> {
    progress: Mutex<Option<(P, Instant)>>,
    /// Notified by a `GET` after the job ended: the result was read.
    read: Condvar,
    /// Bytes of guest memory moved so far (written by the job's threads).
    pub bytes: AtomicU64,
}

impl<P: Report> Shared<P> {
    fn new() -> Self {
        Shared {
            progress: Mutex::new(None),
            read: Condvar::new(),
            bytes: AtomicU64::new(0),
        }
    }

    /// Changes the running job's report.
    pub fn update(&self, f: impl FnOnce(&mut P)) {
        if let Some((p, _)) = lock(&self.progress).as_mut() {
            f(p);
        }
    }

    /// Sets the running job's step.
    pub fn set_phase(&self, phase: &str) {
        if let Some((p, started)) = lock(&self.progress).as_mut() {
            p.set_phase(phase, started.elapsed().as_secs_f64());
        }
    }

    /// Ends the report with the outcome; the lock stays held for the grace wait.
    fn finish(&self, outcome: &Result<()>) -> MutexGuard<'_, Option<(P, Instant)>> {
        let mut slot = lock(&self.progress);
        if let Some((p, started)) = slot.as_mut() {
            p.set_counters(
                self.bytes.load(Ordering::Relaxed),
                started.elapsed().as_secs_f64(),
            );
            p.finish(outcome.as_ref().err().map(|e| format!("{e:#}")));
        }
        slot
    }
}

/// The jobs of one kind for one VM.
pub struct Jobs<J: Job> {
    tx: Mutex<Sender<J::Request>>,
    shared: Arc<Shared<J::Progress>>,
}

impl<J: Job> Jobs<J> {
    /// Starts the worker thread `name` under the filter of `kind`, idle until a job comes.
    pub fn start(name: &str, kind: ThreadKind, mut job: J) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared::new());
        let for_thread = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                vmhost_seccomp::install_current_or_abort(kind);
                worker(&mut job, &rx, &for_thread);
            })?;
        Ok(Jobs {
            tx: Mutex::new(tx),
            shared,
        })
    }

    /// `PUT`: queues `req` with its first report unless `busy` says a job of this kind may
    /// not start now (the conflict names why); returns that first report.
    pub fn request(
        &self,
        req: J::Request,
        first: J::Progress,
        busy: impl FnOnce(&J::Progress) -> Option<String>,
    ) -> Result<Value, ControlError> {
        let mut slot = lock(&self.shared.progress);
        if let Some(why) = slot.as_ref().and_then(|(p, _)| busy(p)) {
            return Err(ControlError::Conflict(why));
        }
        self.shared.bytes.store(0, Ordering::Relaxed);
        if lock(&self.tx).send(req).is_err() {
            return Err(ControlError::Conflict(
                "the VM is stopping: no new job".into(),
            ));
        }
        let value = serde_json::to_value(&first).unwrap_or_default();
        *slot = Some((first, Instant::now()));
        Ok(value)
    }

    /// `GET`: the last job's report (`{"state": "none"}` before the first).
    pub fn progress(&self) -> Value {
        let mut slot = lock(&self.shared.progress);
        let Some((p, started)) = slot.as_mut() else {
            return serde_json::json!({"state": "none"});
        };
        if p.state() == JobState::Running {
            p.set_counters(
                self.shared.bytes.load(Ordering::Relaxed),
                started.elapsed().as_secs_f64(),
            );
        } else {
            self.shared.read.notify_all();
        }
        serde_json::to_value(&*p).unwrap_or_default()
    }
}

/// The worker thread: one job after the other until the VM ends or the API goes.
fn worker<J: Job>(job: &mut J, rx: &Receiver<J::Request>, shared: &Shared<J::Progress>) {
    while let Ok(req) = rx.recv() {
        let outcome = job.run(&req, shared);
        let slot = shared.finish(&outcome);
        match job.then(&req, &outcome) {
            Then::RunOn => {}
            Then::EndVm { last } => {
                // Let a poller read the result before the VM (and its API) ends.
                drop(shared.read.wait_timeout(slot, RESULT_GRACE));
                job.end_vm(&req);
                if last {
                    return;
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
