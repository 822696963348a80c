//! The source side of a live migration: the job behind `PUT /vm/migrate` and `vmhost ctl …
//! migrate`, on its own thread (`vmhost-mig`, started with the control API on the emulator PUs
//! and with its own syscall filter).
//!
//! connect → handshake → `Hello` → the target's `Answer` → dirty log on → round 0 (every
//! resident non-zero page of each cell) → dirty rounds until [`Convergence`] says the final
//! round fits `--max-downtime` (or gives up after `--timeout`) → pause → final dirty round →
//! capture → `VM_STATE` → the target's `Commit` (the commit point) → the VM ends, exit 0.
//! Any failure before the commit point cancels: the dirty log stops, a VM this job paused
//! resumes, and the guest runs on here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;
use vmhost_api::{ControlError, MigrateRequest};
use vmhost_memory::{DirtyBitmap, MappedRegion};
use vmhost_persist::auth::{AuthKey, Role};
use vmhost_persist::container::RecordKind;
use vmhost_persist::migration::{self as msg, Answer, Commit, Hello, Round, RoundEnd};
use vmhost_persist::precopy::{Convergence, Decision, PrecopyLimits, RoundStats};
use vmhost_vcpu::VmState;

use super::wire::{Channel, Endpoint, Stream};
use crate::jobs::{Job, JobState, JobStatus, Report, Shared, Then};
use crate::snapshot::Source;

/// `--timeout`'s default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long one read or write on a connection may wait for a target that hangs (the answer,
/// a full socket buffer, the commit) before the migration is cancelled.
const PEER_WAIT: Duration = Duration::from_secs(60);

/// Set once the target committed: the source's run ends with exit status 0.
pub static MIGRATED: AtomicBool = AtomicBool::new(false);

/// One pre-copy round, as the source measured it.
#[derive(Debug, Clone, Serialize)]
pub struct RoundReport {
    /// The round (0: every resident non-zero page).
    pub round: u32,
    /// Whether the guest was paused (the final round).
    pub last: bool,
    /// Bytes of guest memory sent.
    pub bytes: u64,
    /// Seconds it took.
    pub seconds: f64,
    /// Bytes dirty when it ended (the next round's work).
    pub dirty_bytes_after: u64,
    /// The downtime a final round would then have cost, ms.
    pub estimated_downtime_ms: Option<f64>,
    /// Where the cells' senders spent their time (summed over the cells).
    pub senders: SenderTime,
}

/// Seconds of a round's page senders, summed over the cells: copying guest memory out
/// (`mincore` and the reads), sealing records (the tag: Poly1305 from format 3), writing them to the
/// socket (a copy, or a wait for room), and the whole (the rest: finding zero pages and
/// encoding runs).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct SenderTime {
    /// Copying guest memory out.
    pub copy: f64,
    /// Checksums and MACs.
    pub seal: f64,
    /// Socket writes.
    pub write: f64,
    /// Everything the senders did.
    pub total: f64,
    /// Page records written (each one vectored write).
    pub records: u64,
}

impl SenderTime {
    fn add(&mut self, o: SenderTime) {
        self.copy += o.copy;
        self.seal += o.seal;
        self.write += o.write;
        self.total += o.total;
        self.records += o.records;
    }
}

/// `GET /vm/migrate`: the source's report (KubeVirt's migration status fields in
/// docs/migration.md).
#[derive(Debug, Clone, Serialize)]
pub struct Progress {
    /// State, phase (`connect`, `hello`, `streams`, `precopy`, `pause`, `state`,
    /// `final-round`, `commit`, `resume`, `done`), seconds since the start, the
    /// error, and when each phase began.
    #[serde(flatten)]
    pub status: JobStatus,
    /// Where the target listens.
    pub to: String,
    /// The rounds so far.
    pub rounds: Vec<RoundReport>,
    /// Guest memory bytes sent so far.
    pub bytes_sent: u64,
    /// From pause to the target's commit, ms.
    pub downtime_ms: Option<f64>,
    /// The source's placement (its plan).
    pub source_plan: Value,
    /// The target's placement (its plan), once it accepted.
    pub target_plan: Value,
    /// The target's residency audit, once it committed.
    pub target_audit: Value,
}

impl Report for Progress {
    fn status(&self) -> &JobStatus {
        &self.status
    }
    fn status_mut(&mut self) -> &mut JobStatus {
        &mut self.status
    }
    fn set_bytes(&mut self, bytes: u64) {
        self.bytes_sent = bytes;
    }
}

/// The migration jobs of one VM (`vmhost-mig`).
pub type Jobs = crate::jobs::Jobs<MigrationJob>;

/// A migration job of one VM.
pub struct MigrationJob(pub Source);

/// Starts the `vmhost-mig` thread, idle until a job is requested.
pub fn start_jobs(source: Source) -> std::io::Result<Jobs> {
    Jobs::start(
        "vmhost-mig",
        vmhost_seccomp::ThreadKind::Migration,
        MigrationJob(source),
    )
}

/// `PUT /vm/migrate`: queues the job unless one is running or has moved the VM; its first
/// progress report.
pub fn request(
    jobs: &Jobs,
    req: MigrateRequest,
    plan: &vmhost_plan::Plan,
) -> Result<Value, ControlError> {
    let first = Progress {
        status: JobStatus::queued(),
        to: req.to.clone(),
        rounds: Vec::new(),
        bytes_sent: 0,
        downtime_ms: None,
        source_plan: serde_json::to_value(plan).unwrap_or_default(),
        target_plan: Value::Null,
        target_audit: Value::Null,
    };
    jobs.request(req, first, |p| {
        (p.state() != JobState::Failed)
            .then(|| "a migration job is running or has moved the VM; poll GET /vm/migrate".into())
    })
}

impl Job for MigrationJob {
    type Request = MigrateRequest;
    type Progress = Progress;

    fn run(&mut self, req: &MigrateRequest, shared: &Shared<Progress>) -> Result<()> {
        run_job(&self.0, req, shared)
    }

    fn then(&mut self, req: &MigrateRequest, outcome: &Result<()>) -> Then {
        match outcome {
            Ok(()) => {
                MIGRATED.store(true, Ordering::SeqCst);
                Then::EndVm { last: true }
            }
            Err(e) => {
                tracing::warn!(to = %req.to, error = %format!("{e:#}"), "migration failed; the VM runs on here");
                Then::RunOn
            }
        }
    }

    fn end_vm(&mut self, req: &MigrateRequest) {
        tracing::info!(to = %req.to, "migrated: the VM ends here");
        self.0.stop.stop();
    }
}

/// One job: the connection, the target's answer, pre-copy, the switch; on a failure before
/// the commit point the guest runs on here.
fn run_job(source: &Source, req: &MigrateRequest, shared: &Shared<Progress>) -> Result<()> {
    let was_running = match source.handle.state() {
        VmState::Running => true,
        VmState::Paused => false,
        s => bail!("the VM is {s:?}: only a running or paused VM can migrate"),
    };
    let key = AuthKey::load(&req.auth_key)
        .with_context(|| format!("reading the key {}", req.auth_key.display()))?;
    let to: Endpoint = req.to.parse().map_err(anyhow::Error::msg)?;
    shared.set_phase("connect");
    let stream = Stream::connect(&to)?;
    stream.set_timeouts(PEER_WAIT)?;
    let mut ch = Channel::open(stream, &key, Role::Source, &msg::SOURCE_READS)?;
    shared.set_phase("hello");
    ch.send(RecordKind::MIG_HELLO, &msg::encode(&hello(source)?))?;
    // KVM's dirty log starts while the target checks, plans and admits: round 0 sends every
    // page anyway, so a page the guest writes from now on is at worst sent twice.
    source
        .handle
        .start_dirty_log()
        .context("starting the dirty log")?;
    let mut cells = Vec::new();
    let mut paused = false;
    let moved = move_vm(
        source,
        req,
        (&mut ch, &mut cells),
        (&to, &key),
        shared,
        &mut paused,
    );
    if let Err(e) = source.handle.stop_dirty_log() {
        tracing::warn!(error = %e, "cannot stop the dirty log");
    }
    if moved.is_err() {
        let reason = moved
            .as_ref()
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        // On the control connection and on every page stream (best effort: a stream that
        // failed mid-record stays broken): the target's receivers end with the reason, not
        // with a stream cut short.
        let cancel = msg::encode(&msg::Cancel { reason });
        let _ = ch.send(RecordKind::MIG_CANCEL, &cancel);
        ch.close();
        for (_, c) in &mut cells {
            let _ = c.send(RecordKind::MIG_CANCEL, &cancel);
            c.close();
        }
        if paused && was_running {
            shared.set_phase("resume");
            source.handle.resume().context("resuming the vCPUs")?;
        }
    }
    moved
}

/// The target's answer, the page streams (into `cells`), the rounds and the switch.
fn move_vm(
    source: &Source,
    req: &MigrateRequest,
    (ch, cells): (&mut Channel, &mut Vec<(u32, Channel)>),
    (to, key): (&Endpoint, &AuthKey),
    shared: &Shared<Progress>,
    paused: &mut bool,
) -> Result<()> {
    let answer = ch.recv("the target's answer")?;
    match expect::<Answer>(&answer, RecordKind::MIG_ANSWER, "answer")? {
        Answer::Refused { reason } => bail!("the target refused the VM: {reason}"),
        Answer::Accepted { placement } => shared.update(|p| p.target_plan = placement),
    }
    let limits = PrecopyLimits {
        max_downtime: req.max_downtime_ms.map_or(
            vmhost_persist::precopy::DEFAULT_MAX_DOWNTIME,
            Duration::from_millis,
        ),
        timeout: req.timeout_s.map_or(DEFAULT_TIMEOUT, Duration::from_secs),
    };
    shared.set_phase("streams");
    *cells = open_cells(to, key, &source.plan)?;
    migrate(source, ch, cells, limits, shared, paused)
}

/// The opening message: the spec, the guest identity, the source's plan, CPU and TSC rate.
fn hello(source: &Source) -> Result<Hello> {
    Ok(Hello {
        protocol: msg::PROTOCOL_VERSION,
        vmhost_version: env!("CARGO_PKG_VERSION").into(),
        spec: serde_json::to_value(&source.spec)?,
        identity: serde_json::to_value(source.plan.guest_identity())?,
        source_plan: serde_json::to_value(&source.plan)?,
        tsc_khz: source.handle.tsc_khz(),
        cpu_vendor: super::cpu_vendor(),
        same_distances: false,
    })
}

/// Opens one authenticated page stream per guest cell, each announcing its cell.
fn open_cells(
    to: &Endpoint,
    key: &AuthKey,
    plan: &vmhost_plan::Plan,
) -> Result<Vec<(u32, Channel)>> {
    cells(plan)
        .into_iter()
        .map(|cell| {
            let stream = Stream::connect(to)?;
            stream.set_timeouts(PEER_WAIT)?;
            let mut ch = Channel::open(stream, key, Role::Source, &msg::SOURCE_READS)
                .with_context(|| format!("opening the page stream of cell {cell}"))?;
            ch.send(
                RecordKind::MIG_CELL,
                &msg::encode(&msg::CellStream { cell }),
            )?;
            Ok((cell, ch))
        })
        .collect()
}

/// Decodes `rec` as a message of `kind`; a cancel from the peer is an error with its reason.
pub(super) fn expect<T: serde::de::DeserializeOwned>(
    rec: &vmhost_persist::Record,
    kind: RecordKind,
    what: &str,
) -> Result<T> {
    if rec.kind == RecordKind::MIG_CANCEL {
        let c: msg::Cancel = msg::decode("cancel", &rec.payload).map_err(anyhow::Error::msg)?;
        return Err(super::PeerCancelled(c.reason).into());
    }
    if rec.kind != kind {
        bail!(
            "the peer sent a {} record where the {what} belongs",
            rec.kind
        );
    }
    msg::decode(what, &rec.payload).map_err(anyhow::Error::msg)
}

/// Pre-copy, the pause, the final round, the state and the commit.
fn migrate(
    source: &Source,
    ch: &mut Channel,
    cells: &mut [(u32, Channel)],
    limits: PrecopyLimits,
    shared: &Shared<Progress>,
    paused: &mut bool,
) -> Result<()> {
    shared.set_phase("precopy");
    let (round, mut dirty) = precopy(source, cells, limits, shared)?;
    super::test_hook(round, "source");
    shared.set_phase("pause");
    let paused_at = Instant::now();
    if source.handle.state() == VmState::Running {
        source.handle.pause().context("pausing the vCPUs")?;
        *paused = true;
    }
    // The state first: the capture quiesces the devices, whose requests still in flight
    // complete and write guest RAM (a disk read's data, a used ring, a received frame) after
    // the vCPUs paused. Those writes are in the dirty log the final round takes after it; a
    // capture after the final round would leave them out of the target's RAM.
    shared.set_phase("state");
    let state = crate::vmstate::capture(&source.handle).context("capturing the VM's state")?;
    shared.set_phase("final-round");
    for d in &mut dirty {
        d.union(&source.handle.take_dirty(d.cell())?);
    }
    let started = Instant::now();
    let (bytes, time) = send_round(source, cells, round, Some(&dirty), true, &shared.bytes)?;
    record_round(
        shared,
        round,
        true,
        (bytes, time),
        started.elapsed(),
        0,
        None,
    );
    ch.send(RecordKind::VM_STATE, &state)?;
    shared.set_phase("commit");
    let rec = ch.recv("the target's commit")?;
    let commit: Commit = expect(&rec, RecordKind::MIG_COMMIT, "commit")?;
    let downtime = paused_at.elapsed().as_secs_f64() * 1000.0;
    shared.update(|p| {
        p.downtime_ms = Some(downtime);
        p.target_audit = commit.audit;
    });
    Ok(())
}

/// Round 0 and the dirty rounds with the guest running, until the convergence estimate
/// allows the final round. Returns the final round's number and the pages dirty since the
/// last round.
fn precopy(
    source: &Source,
    cells: &mut [(u32, Channel)],
    limits: PrecopyLimits,
    shared: &Shared<Progress>,
) -> Result<(u32, Vec<DirtyBitmap>)> {
    let mut conv = Convergence::new(limits);
    let mut dirty: Option<Vec<DirtyBitmap>> = None;
    for round in 0u32.. {
        super::test_hook(round, "source");
        let started = Instant::now();
        let (bytes, time) =
            send_round(source, cells, round, dirty.as_deref(), false, &shared.bytes)?;
        let maps = take_all(source)?;
        // What the next round would send: the dirty 4 KiB pages, on hugepages too.
        let dirty_bytes: u64 = maps.iter().map(|m| m.dirty_bytes()).sum();
        let elapsed = started.elapsed();
        let decision = conv.record(RoundStats {
            bytes_sent: bytes,
            elapsed,
            dirty_bytes,
        });
        let estimate = match decision {
            Decision::Continue { estimated_downtime } => estimated_downtime,
            Decision::FinalRound { estimated_downtime } => Some(estimated_downtime),
            Decision::GiveUp {
                estimated_downtime, ..
            } => estimated_downtime,
        };
        record_round(
            shared,
            round,
            false,
            (bytes, time),
            elapsed,
            dirty_bytes,
            estimate,
        );
        match decision {
            Decision::Continue { .. } => dirty = Some(maps),
            Decision::FinalRound { .. } => return Ok((round + 1, maps)),
            Decision::GiveUp { rounds, .. } => bail!(
                "pre-copy did not converge: after {rounds} rounds in {:.1} s, {dirty_bytes} bytes \
                 stay dirty, more than --max-downtime {} ms allows; the VM runs on here \
                 (raise --max-downtime or --timeout, or migrate when the guest writes less)",
                conv.elapsed().as_secs_f64(),
                limits.max_downtime.as_millis()
            ),
        }
    }
    bail!("too many pre-copy rounds")
}

/// The dirty pages of every cell since the last take.
fn take_all(source: &Source) -> Result<Vec<DirtyBitmap>> {
    cells(&source.plan)
        .into_iter()
        .map(|c| Ok(source.handle.take_dirty(c)?))
        .collect()
}

fn cells(plan: &vmhost_plan::Plan) -> Vec<u32> {
    let mut cells: Vec<u32> = plan.guest_cells.iter().map(|c| c.cell).collect();
    cells.sort_unstable();
    cells.dedup();
    cells
}

fn record_round(
    shared: &Shared<Progress>,
    round: u32,
    last: bool,
    (bytes, senders): (u64, SenderTime),
    elapsed: Duration,
    dirty_bytes_after: u64,
    estimate: Option<Duration>,
) {
    shared.update(|p| {
        p.rounds.push(RoundReport {
            round,
            last,
            bytes,
            seconds: elapsed.as_secs_f64(),
            dirty_bytes_after,
            estimated_downtime_ms: estimate.map(|d| d.as_secs_f64() * 1000.0),
            senders,
        })
    });
}

/// Sends one round of every cell, each on its own stream by its own thread (`mig-c<cell>`,
/// under this thread's filter and on its PUs, the emulator PUs): all resident non-zero pages
/// (`dirty` None), else the pages `dirty` marks. Returns the bytes sent and where the senders'
/// time went.
fn send_round(
    source: &Source,
    cells: &mut [(u32, Channel)],
    round: u32,
    dirty: Option<&[DirtyBitmap]>,
    last: bool,
    total: &AtomicU64,
) -> Result<(u64, SenderTime)> {
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (cell, ch) in cells.iter_mut() {
            let cell = *cell;
            let map = dirty.and_then(|d| d.iter().find(|m| m.cell() == cell));
            let regions = &source.regions[..];
            let head = Round { round, cell, last };
            let h = std::thread::Builder::new()
                .name(format!("mig-c{cell}"))
                .spawn_scoped(scope, move || send_cell(regions, ch, head, map, total))
                .with_context(|| format!("starting the sender of cell {cell}"))?;
            handles.push(h);
        }
        let (mut sent, mut time) = (0u64, SenderTime::default());
        let mut first_err = None;
        for h in handles {
            match h.join() {
                Ok(Ok((n, t))) => {
                    sent += n;
                    time.add(t);
                }
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(anyhow::anyhow!("a page sender panicked"));
                }
            }
        }
        first_err.map_or(Ok((sent, time)), Err)
    })
}

/// One cell's round on its stream: the round's head, its page runs, its end.
fn send_cell(
    regions: &[MappedRegion],
    ch: &mut Channel,
    head: Round,
    dirty: Option<&DirtyBitmap>,
    total: &AtomicU64,
) -> Result<(u64, SenderTime)> {
    let (round, cell) = (head.round, head.cell);
    ch.send(RecordKind::MIG_ROUND, &msg::encode(&head))?;
    let (before, records) = (ch.writer().timing(), ch.writer().records());
    let cell_saved = match dirty {
        Some(map) => vmhost_memory::cells::save_cell_dirty(regions, cell, ch.writer(), map),
        None => vmhost_memory::cells::save_cell(regions, cell, ch.writer(), |_, _| false),
    }
    .with_context(|| format!("sending cell {cell} (round {round})"))?;
    let after = ch.writer().timing();
    let time = SenderTime {
        copy: cell_saved.copy_seconds,
        seal: (after.sealing - before.sealing).as_secs_f64(),
        write: (after.writing - before.writing).as_secs_f64(),
        total: cell_saved.seconds,
        records: ch.writer().records() - records,
    };
    let saved = cell_saved.bytes;
    total.fetch_add(saved, Ordering::Relaxed);
    let end = RoundEnd {
        round,
        cell,
        bytes: saved,
    };
    ch.send(RecordKind::MIG_ROUND_END, &msg::encode(&end))?;
    Ok((saved, time))
}
