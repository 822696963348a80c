//! The target's page streams: one authenticated connection per guest cell, accepted after the
//! answer, each read by its own worker (`recv-c<cell>`) pinned to the PUs of the node(s) the
//! target's plan gives that cell, so each cell's pages are written from its node while the
//! main thread waits for the state on the control connection. A worker that fails closes the
//! control connection and the main thread's failure closes every page stream, so no side
//! waits for a peer that will not come.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use vmhost_memory::{GuestMemory, MappedRegion};
use vmhost_persist::auth::{AuthKey, Role};
use vmhost_persist::container::{Record, RecordKind};
use vmhost_persist::migration::{self as msg, CellStream, Round, RoundEnd};
use vmhost_plan::Plan;

use super::source::expect;
use super::target::Received;
use super::wire::{Channel, Listener, Stream};

/// How long the target waits for each page stream once it accepted the VM.
const CELL_STREAM_WAIT: Duration = Duration::from_secs(10);
/// How long a page stream may stay silent (a read) or full (a write) before it fails.
const PEER_WAIT: Duration = Duration::from_secs(60);

/// Accepts one page stream per cell of `plan` (a connection without the key is refused and
/// logged); fails when one does not come within [`CELL_STREAM_WAIT`].
pub fn accept_cells(
    listener: &Listener,
    key: &AuthKey,
    plan: &Plan,
) -> Result<Vec<(u32, Channel)>> {
    let mut want: Vec<u32> = plan.guest_cells.iter().map(|c| c.cell).collect();
    want.sort_unstable();
    want.dedup();
    listener.set_accept_timeout(CELL_STREAM_WAIT)?;
    let mut got: BTreeMap<u32, Channel> = BTreeMap::new();
    while got.len() < want.len() {
        let (stream, peer) = listener.accept().with_context(|| {
            format!(
                "waiting for the source's page streams ({} of {} came)",
                got.len(),
                want.len()
            )
        })?;
        let mut ch = match Channel::open(stream, key, Role::Target, &msg::CELL_READS) {
            Ok(ch) => ch,
            Err(e) => {
                eprintln!("vmhost: receive: refused a connection on {peer}: {e:#}");
                continue;
            }
        };
        // A source that hangs mid-copy ends the migration instead of holding the pages.
        ch.stream().set_timeouts(PEER_WAIT)?;
        let rec = ch.recv("a page stream's cell")?;
        let cs: CellStream = expect(&rec, RecordKind::MIG_CELL, "cell stream")?;
        if !want.contains(&cs.cell) || got.contains_key(&cs.cell) {
            bail!(
                "the source opened a page stream for cell {} (the guest has cells {want:?})",
                cs.cell
            );
        }
        got.insert(cs.cell, ch);
    }
    Ok(got.into_iter().collect())
}

/// Receives every cell's rounds on its stream, by pinned workers; meanwhile this thread runs
/// `meanwhile` (the target's work that need not hold the rounds back), then `await_state`,
/// which reads the control connection (`control`). The rounds received and what `meanwhile`
/// returned. A `meanwhile` that fails closes every connection, so the receivers and the
/// source end, and is the error.
pub fn receive_all<T>(
    memory: &GuestMemory,
    plan: &Plan,
    cells: Vec<(u32, Channel)>,
    control: &Stream,
    meanwhile: impl FnOnce() -> Result<T>,
    await_state: impl FnOnce() -> Result<()>,
) -> Result<(Vec<Received>, T)> {
    let page_streams: Vec<Stream> = cells.iter().map(|(_, c)| c.stream()).collect();
    let regions = memory.regions();
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (cell, ch) in cells {
            let cpus = vmhost_memory::cells::loader_cpus(plan, cell);
            let control = control.clone();
            let h = std::thread::Builder::new()
                .name(format!("recv-c{cell}"))
                .spawn_scoped(scope, move || {
                    let r = receive_cell(regions, cell, ch, &cpus);
                    if r.is_err() {
                        control.shutdown();
                    }
                    r
                });
            match h {
                Ok(h) => handles.push(h),
                Err(e) => {
                    page_streams.iter().for_each(Stream::shutdown);
                    return Err(anyhow!(e).context(format!("starting the receiver of cell {cell}")));
                }
            }
        }
        let early = meanwhile();
        let state = match &early {
            Ok(_) => await_state(),
            Err(_) => {
                control.shutdown();
                Ok(())
            }
        };
        if state.is_err() || early.is_err() {
            page_streams.iter().for_each(Stream::shutdown);
        }
        let mut rounds = Vec::new();
        let mut first_err = None;
        for h in handles {
            match h.join() {
                Ok(Ok(mut r)) => rounds.append(&mut r),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(anyhow!("a page receiver panicked"));
                }
            }
        }
        // This side's own failure first; then the source's cancel says most; then a worker's
        // own error says more than the control connection it closed.
        let early = early?;
        match (first_err, state) {
            (_, Err(e)) if e.is::<super::PeerCancelled>() => Err(e),
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(())) => Ok((rounds, early)),
        }
    })
}

/// One cell's stream until its final round ended, written into guest RAM from the cell's
/// node PUs.
fn receive_cell(
    regions: &[MappedRegion],
    cell: u32,
    mut ch: Channel,
    cpus: &[u32],
) -> Result<Vec<Received>> {
    if !cpus.is_empty() {
        vmhost_topology::affinity::pin_current_thread(cpus)
            .with_context(|| format!("pinning the receiver of cell {cell} to PUs {cpus:?}"))?;
    }
    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Receiver);
    let mut rounds = Vec::new();
    let mut current: Option<(Round, u64)> = None;
    loop {
        let rec = ch.recv("the next round of the cell's pages")?;
        match rec.kind {
            RecordKind::MIG_ROUND => {
                let r: Round = expect(&rec, RecordKind::MIG_ROUND, "round")?;
                super::test_hook(r.round, "target");
                if r.cell != cell {
                    bail!(
                        "the page stream of cell {cell} carries a round of cell {}",
                        r.cell
                    );
                }
                current = Some((r, 0));
            }
            RecordKind::PAGES => {
                let (r, bytes) = current
                    .as_mut()
                    .context("the source sent pages outside a round")?;
                *bytes += vmhost_memory::cells::load_run(regions, cell, &rec.payload)
                    .with_context(|| format!("writing round {} of cell {cell}", r.round))?;
                ch.recycle(rec.payload);
            }
            RecordKind::MIG_ROUND_END => {
                let done = end_round(&rec, current.take())?;
                let last = done.last;
                rounds.push(done);
                if last {
                    return Ok(rounds);
                }
            }
            _ => {
                expect::<Round>(&rec, RecordKind::MIG_ROUND, "round")?;
            }
        }
    }
}

fn end_round(rec: &Record, current: Option<(Round, u64)>) -> Result<Received> {
    let end: RoundEnd = expect(rec, RecordKind::MIG_ROUND_END, "round end")?;
    let (r, bytes) = current.context("the source ended a round it never began")?;
    if end.round != r.round || end.cell != r.cell || end.bytes != bytes {
        bail!(
            "round {} of cell {}: the source says it sent {} bytes, {bytes} arrived",
            end.round,
            end.cell,
            end.bytes
        );
    }
    Ok(Received {
        round: r.round,
        cell: r.cell,
        last: r.last,
        bytes,
    })
}
