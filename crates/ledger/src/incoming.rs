//! The target of a migration within one host: an incoming entry under the VM's name.
//!
//! VM names are unique per host, but while a VM migrates to another process of the same host
//! both processes hold resources: the source its PUs and pages, the target the ones it
//! reserves for the guest it receives. The target is admitted with
//! [`Ledger::admit_incoming`]: its entry has [`EntryRole::Incoming`], is planned against
//! everything live entries hold (the source's included) and counts against every later
//! admission like any entry. At the switch, [`Ledger::hand_over`] makes it the VM's entry and
//! removes the source's; a migration that fails calls [`Ledger::abort_incoming`]; a target
//! that dies is reclaimed like any dead entry (its file name carries its pid and start time).
//!
//! Crash safety of the hand-over: both files change under the exclusive lock, so no other
//! ledger operation sees a state in between. The incoming entry is rewritten first (atomic
//! rename), the source's removed second: a crash between leaves two VM entries of one name,
//! both counted (never too few), and the one whose process has gone is reclaimed; a live
//! source's is removed by its own [`Ledger::release`].

use std::path::PathBuf;

use vmhost_plan::Plan;

use crate::entry::{self, EntryRole};
use crate::{reclaim, store, AdmitError, Admitted, Entry, Held, Ledger, LedgerError};

/// The VM's entry after [`Ledger::hand_over`].
#[derive(Debug, Clone)]
pub struct HandedOver {
    /// The former incoming entry, now the VM's ([`EntryRole::Vm`]).
    pub entry: Entry,
    /// Its entry file.
    pub path: PathBuf,
    /// The entry files of the VM's previous process(es) that were removed (the source's).
    pub replaced: Vec<PathBuf>,
}

/// Refuses a name that a live entry holds: any entry for a VM being admitted, an incoming
/// entry for an incoming one (a live VM of that name is its source).
pub(crate) fn check_name_free(
    role: EntryRole,
    name: &str,
    live: &[Entry],
) -> Result<(), LedgerError> {
    let clash = live
        .iter()
        .find(|e| e.name == name && (role.is_vm() || e.role == EntryRole::Incoming));
    match clash {
        None => Ok(()),
        Some(e) if e.role == EntryRole::Incoming => Err(LedgerError::IncomingInUse {
            name: name.to_owned(),
            pid: e.pid,
        }),
        Some(e) => Err(LedgerError::NameInUse {
            name: name.to_owned(),
            pid: e.pid,
        }),
    }
}

impl Ledger {
    /// Admits process `pid` as the incoming target of a migration of VM `name` on this host
    /// (or, with no VM of that name here, on another host).
    ///
    /// As [`Ledger::admit`], except that a live VM entry of the same name (the source) is
    /// allowed and its PUs and pages count as held; a second live incoming entry for the name
    /// is refused with [`LedgerError::IncomingInUse`]. The entry has [`EntryRole::Incoming`]
    /// and state [`VmState::Starting`](crate::VmState::Starting) (its pages count as promised
    /// until [`Ledger::update_state`] records that the target allocated them).
    pub fn admit_incoming<E, F>(
        &self,
        name: &str,
        pid: u32,
        api_socket: Option<PathBuf>,
        planner: F,
    ) -> Result<Admitted, AdmitError<E>>
    where
        F: FnOnce(&Held) -> Result<Plan, E>,
    {
        self.admit_as(EntryRole::Incoming, name, pid, api_socket, planner)
    }

    /// The switch of a migration: the incoming entry of VM `name` run by `pid` becomes the VM's
    /// entry, and every other entry of that name (the source's) is removed, under one
    /// exclusive lock. Fails with [`LedgerError::NotIncoming`] when `pid` has no incoming entry
    /// for `name` (never admitted, aborted, reclaimed, or already handed over).
    pub fn hand_over(&self, name: &str, pid: u32) -> Result<HandedOver, LedgerError> {
        let _lock = self.lock(true, true)?;
        let (live, _) = reclaim(store::scan(&self.vms_dir, true)?, false)?;
        let mut entry = live
            .iter()
            .find(|e| e.name == name && e.pid == pid && e.role == EntryRole::Incoming)
            .cloned()
            .ok_or_else(|| LedgerError::NotIncoming {
                name: name.to_owned(),
                pid,
            })?;
        entry.role = EntryRole::Vm;
        let text = entry::encode(&entry).map_err(|source| LedgerError::Encode {
            name: name.to_owned(),
            source,
        })?;
        let file_name = entry.file_name();
        store::write_atomic(&self.vms_dir, &file_name, text.as_bytes())?;
        let mut replaced = Vec::new();
        for s in store::scan(&self.vms_dir, false)? {
            let ours = s.path.file_name().is_some_and(|f| *f == *file_name);
            if !ours && s.key.as_ref().is_some_and(|k| k.name == name) {
                store::remove(&s.path)?;
                replaced.push(s.path);
            }
        }
        Ok(HandedOver {
            path: self.vms_dir.join(file_name),
            entry,
            replaced,
        })
    }

    /// Releases the incoming entry of VM `name` run by `pid` (a migration that failed or was
    /// cancelled). Returns false when there is none; an entry already handed over is the
    /// VM's and is left alone (release it with [`Ledger::release`]).
    pub fn abort_incoming(&self, name: &str, pid: u32) -> Result<bool, LedgerError> {
        let _lock = self.lock(true, true)?;
        for s in store::scan(&self.vms_dir, true)? {
            let incoming = s
                .entry
                .as_ref()
                .is_ok_and(|e| e.name == name && e.pid == pid && e.role == EntryRole::Incoming);
            if incoming {
                store::remove(&s.path)?;
                return Ok(true);
            }
        }
        Ok(false)
    }
}
