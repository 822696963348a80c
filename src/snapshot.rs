//! The snapshot job behind `PUT /vm/snapshot` and `vmhost ctl … snapshot DIR [--stop]`.
//!
//! A long job on its own thread (`vmhost-snap`, started with the control API so that the API
//! thread never starts a thread): pause → capture the VM state → write `spec`, `plan`, one
//! `memory-cell<N>` per guest cell, and `state` last (the VM state, then the guest's identity
//! that a restore keeps) → resume, or with `stop` end the VM. A
//! failure resumes a VM that was running and removes the unfinished directory. The API
//! answers at once; `GET /vm/snapshot` reports [`Progress`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use vmhost_api::{ControlError, SnapshotRequest};
use vmhost_memory::{CellSaved, MappedRegion};
use vmhost_persist::container::RecordKind;
use vmhost_persist::dir::{FileName, FillError, SnapshotWriter};
use vmhost_plan::Plan;
use vmhost_vcpu::{StopHandle, VmHandle, VmState};

use crate::jobs::{Job, JobState, JobStatus, Report, Shared, Then};

/// Set when a snapshot with `stop` ended the VM (one VM per process): its run ends as
/// `Stopped`, which is exit status 0 here, as a guest that ended itself, not 130.
static STOPPED_BY_SNAPSHOT: AtomicBool = AtomicBool::new(false);

/// Whether a snapshot with `stop` ended this process's VM.
pub fn stopped_by_snapshot() -> bool {
    STOPPED_BY_SNAPSHOT.load(Ordering::SeqCst)
}

/// The spec as the user wrote it: the payload of a snapshot's `spec` record (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecSource {
    /// `toml` or `yaml` (KubeVirt).
    pub format: String,
    /// Where it was read from (relative boot paths resolve against its directory).
    pub origin: String,
    /// The text.
    pub text: String,
}

impl SpecSource {
    /// Reads `path` once (its format from its extension, as `vmhost_config::load` does).
    pub fn read(path: &Path) -> Result<Self, vmhost_config::ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| vmhost_config::ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
        let yaml = matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml")
        );
        Ok(SpecSource {
            format: if yaml { "yaml" } else { "toml" }.into(),
            origin: path.display().to_string(),
            text,
        })
    }

    /// Parses and resolves the spec, as `vmhost --config` would.
    pub fn load(&self) -> Result<vmhost_config::LoadedSpec, vmhost_config::ConfigError> {
        let mut loaded = match self.format.as_str() {
            "yaml" => vmhost_config::from_yaml_str(&self.text, &self.origin)?,
            _ => vmhost_config::from_toml_str(&self.text, &self.origin)?,
        };
        // The embedded quickstart has no file and no paths to resolve.
        if self.origin != EMBEDDED {
            if let Some(dir) = Path::new(&self.origin).parent() {
                loaded.spec.boot.resolve_paths(dir);
            }
        }
        Ok(loaded)
    }

    /// The embedded quickstart spec.
    pub fn embedded(text: &str) -> Self {
        SpecSource {
            format: "toml".into(),
            origin: EMBEDDED.into(),
            text: text.into(),
        }
    }

    /// This source with its origin made absolute, for a snapshot restored from any working
    /// directory.
    pub fn absolute(&self) -> Self {
        let mut out = self.clone();
        if self.origin != EMBEDDED {
            if let Ok(abs) = std::fs::canonicalize(&self.origin) {
                out.origin = abs.display().to_string();
            }
        }
        out
    }
}

/// The origin of the embedded quickstart spec.
const EMBEDDED: &str = "configs/quickstart.toml (embedded)";

/// What a snapshot is taken of; the job keeps it for the VM's life.
pub struct Source {
    /// The spec as written.
    pub spec: SpecSource,
    /// The plan the VM runs under.
    pub plan: Plan,
    /// The guest RAM's regions (clones sharing the mappings).
    pub regions: Vec<MappedRegion>,
    /// The VM.
    pub handle: VmHandle,
    /// Ends the VM (`stop`).
    pub stop: StopHandle,
}

/// `GET /vm/snapshot`.
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    /// State, phase (`pause`, `capture`, `spec`, `plan`, `memory-cell<N>`, `state`,
    /// `resume`, `stop`, `done`), seconds since the start, the error.
    #[serde(flatten)]
    pub status: JobStatus,
    /// The snapshot directory.
    pub dir: Option<PathBuf>,
    /// Whether the VM ends after the snapshot.
    pub stop: bool,
    /// Guest memory bytes written so far.
    pub bytes_written: u64,
    /// Each cell saved so far.
    pub cells: Vec<CellSaved>,
}

impl Report for Progress {
    fn status(&self) -> &JobStatus {
        &self.status
    }
    fn status_mut(&mut self) -> &mut JobStatus {
        &mut self.status
    }
    fn set_bytes(&mut self, bytes: u64) {
        self.bytes_written = bytes;
    }
}

/// The snapshot jobs of one VM (`vmhost-snap`).
pub type Jobs = crate::jobs::Jobs<SnapshotJob>;

/// A snapshot job of one VM.
pub struct SnapshotJob(pub Source);

/// Starts the `vmhost-snap` thread, idle until a job is requested.
pub fn start_jobs(source: Source) -> std::io::Result<Jobs> {
    Jobs::start(
        "vmhost-snap",
        vmhost_seccomp::ThreadKind::Snapshot,
        SnapshotJob(source),
    )
}

/// `PUT /vm/snapshot`: queues the job unless one is running; its first progress report.
pub fn request(jobs: &Jobs, req: SnapshotRequest) -> Result<Value, ControlError> {
    let first = Progress {
        status: JobStatus::queued(),
        dir: Some(req.dir.clone()),
        stop: req.stop,
        bytes_written: 0,
        cells: Vec::new(),
    };
    jobs.request(req, first, |p| {
        (p.state() == JobState::Running)
            .then(|| "a snapshot job is running; poll GET /vm/snapshot until it ends".into())
    })
}

impl Job for SnapshotJob {
    type Request = SnapshotRequest;
    type Progress = Progress;

    fn run(&mut self, req: &SnapshotRequest, shared: &Shared<Progress>) -> Result<()> {
        run_job(&self.0, req, shared)
    }

    fn then(&mut self, req: &SnapshotRequest, outcome: &Result<()>) -> Then {
        if outcome.is_ok() && req.stop {
            Then::EndVm { last: false }
        } else {
            Then::RunOn
        }
    }

    fn end_vm(&mut self, req: &SnapshotRequest) {
        tracing::info!(dir = %req.dir.display(), "snapshot taken: stopping the VM");
        STOPPED_BY_SNAPSHOT.store(true, Ordering::SeqCst);
        self.0.stop.stop();
    }
}

/// One job: pause, write, then resume or stop; on failure resume and clean up.
fn run_job(source: &Source, req: &SnapshotRequest, shared: &Shared<Progress>) -> Result<()> {
    let was_running = match source.handle.state() {
        VmState::Running => true,
        VmState::Paused => false,
        s => anyhow::bail!("the VM is {s:?}: only a running or paused VM can be snapshotted"),
    };
    shared.set_phase("pause");
    if was_running {
        source.handle.pause().context("pausing the vCPUs")?;
    }
    let mut created = false;
    let written = write_snapshot(source, req, shared, &mut created);
    if let Err(e) = &written {
        if created {
            if let Err(rm) = vmhost_persist::dir::remove_unfinished(&req.dir) {
                tracing::warn!(dir = %req.dir.display(), error = %rm, "cannot remove the unfinished snapshot");
            }
        }
        tracing::warn!(error = %format!("{e:#}"), "snapshot failed");
    }
    if was_running && (written.is_err() || !req.stop) {
        shared.set_phase("resume");
        source.handle.resume().context("resuming the vCPUs")?;
    }
    if written.is_ok() && req.stop {
        shared.set_phase("stop");
    }
    written
}

/// Captures the paused VM and writes the directory; `created` once the directory exists.
fn write_snapshot(
    source: &Source,
    req: &SnapshotRequest,
    shared: &Shared<Progress>,
    created: &mut bool,
) -> Result<()> {
    shared.set_phase("capture");
    let state = crate::vmstate::capture(&source.handle).context("capturing the VM's state")?;
    let guest = crate::vmstate::GuestRecord::of(&source.plan).encode()?;
    let mut w = SnapshotWriter::create(&req.dir, env!("CARGO_PKG_VERSION"))?;
    *created = true;
    shared.set_phase("spec");
    w.write_single(
        FileName::Spec,
        RecordKind::SPEC,
        &serde_json::to_vec(&source.spec)?,
    )?;
    shared.set_phase("plan");
    w.write_single(
        FileName::Plan,
        RecordKind::PLAN,
        &serde_json::to_vec(&source.plan)?,
    )?;
    let mut cells: Vec<u32> = source.plan.guest_cells.iter().map(|c| c.cell).collect();
    cells.sort_unstable();
    for cell in cells {
        let name = FileName::MemoryCell(cell);
        shared.set_phase(&name.to_string());
        let saved = save_cell(source, &mut w, cell, &shared.bytes)?;
        shared.update(|p| p.cells.push(saved));
    }
    shared.set_phase("state");
    w.commit(|out| {
        out.write_record(RecordKind::VM_STATE, &state)?;
        Ok(out.write_record(RecordKind::GUEST_IDENTITY, &guest)?)
    })?;
    Ok(())
}

/// Writes `memory-cell<cell>`, counting bytes into `bytes` as pages are kept.
fn save_cell(
    source: &Source,
    w: &mut SnapshotWriter,
    cell: u32,
    bytes: &AtomicU64,
) -> Result<CellSaved> {
    let mut saved = None;
    w.write_file(FileName::MemoryCell(cell), |out| {
        let count = |_: u64, page: &[u8]| {
            bytes.fetch_add(page.len() as u64, Ordering::Relaxed);
            false
        };
        let s = vmhost_memory::cells::save_cell(&source.regions, cell, out, count)
            .map_err(|e| FillError::Caller(Box::new(e)))?;
        saved = Some(s);
        Ok(())
    })?;
    saved.context("the cell was not written")
}
