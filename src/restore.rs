//! `vmhost restore DIR [--config F] [run options]`: a VM continued from a snapshot.
//!
//! The order (docs/migration.md, "Restore"): the snapshot directory is checked
//! ([`Snapshot::open_for_restore`]: the state file, spec and plan whole, the memory files'
//! lengths) and its spec and state decoded before anything else, so a truncated or
//! wrong-version snapshot, a damaged state, spec or plan, or a `--config` whose spec differs,
//! is refused with exit status 2 before `/dev/kvm` is opened or anything is allocated; so is a
//! spec that contradicts the guest's saved identity (record kind 17) and a Linux guest whose
//! disk images are missing or resized (`vmhost_devices::persist::check_restorable`). Then the
//! normal start path runs (`main::start_vm`, [`crate::run::run`]): the spec is planned on this
//! host as it is now through admission and the ledger, keeping the guest's identity
//! (`vmhost_plan::plan_for_guest`: same cells, vCPUs and memory per cell, page size, APIC IDs,
//! on whichever nodes have room; [`placement_report`] says where each cell went), the guest
//! memory is allocated per the new plan and [`load_memory`] fills it with one pinned worker
//! per cell, checking every record (its XXH64, CRC-64 before format 5) as it goes: the memory files are read once, into
//! guest RAM, and a damaged one is refused with exit status 2 before `/dev/kvm` is opened,
//! everything allocated for it released. Then [`check_this_host`] checks CPUID and TSC, and
//! the VM continues from the saved state instead of booting.

use std::fs::{File, OpenOptions};
use std::io::BufReader;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;
use vmhost_config::LoadedSpec;
use vmhost_memory::GuestMemory;
use vmhost_persist::container::RecordKind;
use vmhost_persist::dir::{FileName, Snapshot};
use vmhost_plan::Plan;

use crate::snapshot::SpecSource;
use crate::vmstate::GuestRecord;
use crate::{Exit, EXIT_INVALID};

/// A checked snapshot and its decoded VM state.
pub struct Restored {
    /// The snapshot directory, checked but for its memory files' bytes (their load checks
    /// them).
    pub snapshot: Snapshot,
    /// The VM state (record kind 16).
    pub saved: crate::vmstate::Saved,
    /// The guest's topology, which the restore's plan keeps (record kind 17).
    pub guest: GuestRecord,
    /// How long the directory check ([`Snapshot::open_for_restore`]) took.
    pub checked_in: std::time::Duration,
}

/// An invalid-input refusal (exit status 2) naming the snapshot.
fn refuse(dir: &Path, what: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::new(Exit {
        code: EXIT_INVALID,
        message: format!("restore {}: {what}", dir.display()),
    })
}

/// The error and its causes on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Checks the snapshot in `dir` and decodes its spec and state; with `config`, checks that
/// its spec is the snapshot's. Opens no `/dev/kvm` and allocates no guest memory. Returns the
/// spec to run, its text, and the snapshot.
pub fn prepare(dir: &Path, config: Option<&Path>) -> Result<(LoadedSpec, SpecSource, Restored)> {
    let t = std::time::Instant::now();
    let snapshot = Snapshot::open_for_restore(dir).map_err(|e| refuse(dir, chain(&e)))?;
    let checked_in = t.elapsed();
    let raw = snapshot
        .read_single(FileName::Spec, RecordKind::SPEC)
        .map_err(|e| refuse(dir, chain(&e)))?;
    let source: SpecSource = serde_json::from_slice(&raw)
        .map_err(|e| refuse(dir, format!("its spec file does not hold a spec: {e}")))?;
    let saved_spec = source
        .load()
        .map_err(|e| refuse(dir, format!("its spec is not valid: {}", chain(&e))))?;
    let (loaded, source) = match config {
        None => (saved_spec, source),
        Some(path) => {
            let given = SpecSource::read(path)?;
            let loaded = given.load()?;
            check_same_spec(dir, path, &saved_spec, &loaded)?;
            (loaded, given)
        }
    };
    let (saved, guest) = read_state(&snapshot)?;
    check_guest(dir, &loaded, &guest)?;
    if let Some(devices) = &saved.devices {
        vmhost_devices::persist::check_restorable(devices).map_err(|e| {
            refuse(
                dir,
                format!("its devices cannot be restored here: {}", chain(&e)),
            )
        })?;
    }
    let restored = Restored {
        snapshot,
        saved,
        guest,
        checked_in,
    };
    Ok((loaded, source, restored))
}

/// Decodes the state file's VM state (kind 16) and guest identity (kind 17).
fn read_state(snapshot: &Snapshot) -> Result<(crate::vmstate::Saved, GuestRecord)> {
    let dir = snapshot.dir();
    let kinds = [RecordKind::VM_STATE, RecordKind::GUEST_IDENTITY];
    let records = snapshot
        .read_state_records(&kinds)
        .map_err(|e| refuse(dir, chain(&e)))?;
    let find = |kind: RecordKind| {
        records
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, payload)| payload.as_slice())
            .ok_or_else(|| {
                refuse(
                    dir,
                    format!("its state file holds no {kind} record: take the snapshot again with this vmhost"),
                )
            })
    };
    let saved = crate::vmstate::decode(find(RecordKind::VM_STATE)?)
        .map_err(|e| refuse(dir, format!("its VM state cannot be read: {e:#}")))?;
    let guest = GuestRecord::decode(find(RecordKind::GUEST_IDENTITY)?)
        .map_err(|e| refuse(dir, format!("its guest identity cannot be read: {e:#}")))?;
    Ok((saved, guest))
}

/// Refuses a spec that contradicts the guest the snapshot holds (its CPU topology and APIC
/// IDs, memory, page size, cells), naming each field; before anything is planned.
fn check_guest(dir: &Path, spec: &LoadedSpec, guest: &GuestRecord) -> Result<()> {
    let reasons = vmhost_plan::check_identity(&spec.spec, &guest.identity);
    if reasons.is_empty() {
        return Ok(());
    }
    let all: Vec<String> = reasons.iter().map(ToString::to_string).collect();
    Err(refuse(
        dir,
        format!(
            "the spec contradicts the guest the snapshot holds: {}",
            all.join("; ")
        ),
    ))
}

/// Where each guest cell went on this host beside where it was when the snapshot was taken,
/// and the pairs of cells whose host distance now differs from what the guest was told: the
/// lines of the restore report.
pub fn placement_report(plan: &Plan, r: &Restored) -> Vec<String> {
    let node =
        |n: Option<u32>| n.map_or_else(|| "no single node".to_string(), |n| format!("node{n}"));
    let mut out = Vec::new();
    let mut cells: Vec<_> = plan.guest_cells.iter().collect();
    cells.sort_by_key(|c| c.cell);
    for c in cells {
        let before = usize::try_from(c.cell)
            .ok()
            .and_then(|i| r.guest.source_nodes.get(i).copied())
            .flatten();
        out.push(format!(
            "guest cell {} ({} vCPUs, {} MiB): {} in the snapshot, {} now",
            c.cell,
            c.vcpus.len(),
            c.memory_bytes >> 20,
            node(before),
            node(c.host_node)
        ));
    }
    for d in &plan.distances.diff {
        out.push(format!("the guest keeps the distances it was told; {d}"));
    }
    out
}

/// Refuses a `--config` whose resolved spec differs from the snapshot's, naming the first
/// field that differs.
fn check_same_spec(dir: &Path, path: &Path, saved: &LoadedSpec, given: &LoadedSpec) -> Result<()> {
    let a = serde_json::to_value(&saved.spec)?;
    let b = serde_json::to_value(&given.spec)?;
    match first_difference(&a, &b, String::new()) {
        None => Ok(()),
        Some((field, want, got)) => Err(refuse(
            dir,
            format!(
                "--config {} is not the snapshot's spec: `{field}` is {got} there and {want} in \
                 the snapshot (restore without --config to use the snapshot's)",
                path.display()
            ),
        )),
    }
}

/// The first path (`cpu.cores`, `devices.disks[0].path`) where `a` and `b` differ, with both
/// values.
pub fn first_difference(a: &Value, b: &Value, at: String) -> Option<(String, Value, Value)> {
    let join = |key: &str| {
        if at.is_empty() {
            key.to_string()
        } else {
            format!("{at}.{key}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let (va, vb) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                first_difference(va, vb, join(k))
            })
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (va, vb))| first_difference(va, vb, format!("{at}[{i}]"))),
        _ if a == b => None,
        _ => Some((at, a.clone(), b.clone())),
    }
}

/// Whether this host can run the saved vCPUs (TSC frequency, CPUID features); before the VM
/// is created. A refusal is exit status 2.
pub fn check_this_host(r: &Restored) -> Result<()> {
    crate::vmstate::check_target(&r.saved).map_err(|e| {
        refuse(
            r.snapshot.dir(),
            format!("this host cannot run its vCPUs: {e:#}"),
        )
    })
}

/// Fills `memory` (allocated and bound per `plan`) from the snapshot's memory files, one
/// worker per cell pinned to the cell's node PUs; reports each cell on stderr (not with
/// `--json`).
pub fn load_memory(memory: &GuestMemory, plan: &Plan, r: &Restored, json: bool) -> Result<()> {
    let dir = r.snapshot.dir();
    let mut files = Vec::new();
    for cell in 0..r.snapshot.cells() {
        let path = dir.join(FileName::MemoryCell(cell).to_string());
        let file: File = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        files.push((cell, BufReader::new(file)));
    }
    let loaded = memory
        .load_cells(plan, files)
        .map_err(|e| match damaged(&e) {
            Some(cell) => refuse(
                dir,
                format!(
                    "its memory file {} is damaged: {}",
                    FileName::MemoryCell(cell),
                    chain(&e)
                ),
            ),
            None => anyhow::Error::new(e)
                .context(format!("loading guest memory from {}", dir.display())),
        })?;
    if !json {
        eprintln!(
            "vmhost: restore: the snapshot's state, spec and plan checked against its manifest, \
             and its memory files' lengths, in {:.3} s",
            r.checked_in.as_secs_f64()
        );
        for c in &loaded {
            eprintln!(
                "vmhost: restore: cell {} loaded and checked (a checksum per record): {} MiB in \
                 {:.3} s by a worker on PUs {:?}",
                c.cell,
                c.bytes >> 20,
                c.seconds,
                c.cpus
            );
        }
    }
    Ok(())
}

/// The cell whose memory file a load error found damaged: a record or page run that does not
/// check or decode (not a read the host failed).
fn damaged(e: &vmhost_memory::CellIoError) -> Option<u32> {
    use vmhost_memory::CellIoError as E;
    use vmhost_persist::container::ContainerError;
    match e {
        E::Pages { cell, .. } => Some(*cell),
        E::Record {
            source: ContainerError::Read { .. },
            ..
        } => None,
        E::Record { cell, .. } => Some(*cell),
        _ => None,
    }
}

/// Where a restore's time went before the guest was released, from `main`: checking the
/// snapshot (its state, spec and plan read whole, its memory files' lengths), the host's
/// topology, the plan and ledger, the memory (allocated, bound, prefaulted, loaded and
/// checked) and the VM (created, state restored).
pub fn timing(t: &crate::timeline::Timeline) -> String {
    let s = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e9;
    // A background prefault sets `memory_ready_ns` only when it ends.
    let memory = match t.memory_ready_ns {
        0 => t.vm_created_ns,
        ns => ns.min(t.vm_created_ns),
    };
    format!(
        "ready {:.3} s after start: snapshot checked {:.3} s, host read {:.3} s, admitted {:.3} s, \
         memory loaded {:.3} s, VM restored {:.3} s",
        s(t.main_ns, t.vm_created_ns),
        s(t.main_ns, t.spec_loaded_ns),
        s(t.spec_loaded_ns, t.host_discovered_ns),
        s(t.host_discovered_ns, t.admitted_ns),
        s(t.admitted_ns, memory),
        s(memory, t.vm_created_ns),
    )
}

#[cfg(test)]
mod tests {
    use super::first_difference;
    use serde_json::json;

    #[test]
    fn the_first_differing_field_is_named() {
        let a = json!({"name": "a", "cpu": {"cores": 1, "threads": 1}, "disks": [{"path": "x"}]});
        let b = json!({"name": "a", "cpu": {"cores": 2, "threads": 1}, "disks": [{"path": "y"}]});
        assert_eq!(
            first_difference(&a, &b, String::new()),
            Some(("cpu.cores".into(), json!(1), json!(2)))
        );
        let c = json!({"name": "a", "cpu": {"cores": 1, "threads": 1}, "disks": [{"path": "y"}]});
        assert_eq!(
            first_difference(&a, &c, String::new()).map(|d| d.0),
            Some("disks[0].path".into())
        );
        assert_eq!(first_difference(&a, &a, String::new()), None);
    }
}
