//! The seam between the binary and the vCPU crate's saved VM state
//! ([`vmhost_vcpu::persist::SavedVm`], record kind 16 of a snapshot's `state` file, as JSON):
//! capture of a paused VM, the compatibility check of this host, and building a VM that
//! continues from it. Beside it, record kind 17 ([`GuestRecord`]): the guest's topology as
//! it has seen it, which a restore keeps.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use vmhost_plan::{GuestIdentity, Plan};
use vmhost_vcpu::persist::SavedVm;
use vmhost_vcpu::{GuestRam, Vm, VmHandle, VmOptions};

/// A decoded VM state.
pub type Saved = SavedVm;

/// Captures the state of the paused VM of `handle`, as the JSON of record kind 16.
pub fn capture(handle: &VmHandle) -> Result<Vec<u8>> {
    let saved = handle.capture()?;
    serde_json::to_vec(&saved).context("encoding the VM state as JSON")
}

/// Decodes record kind 16.
pub fn decode(bytes: &[u8]) -> Result<Saved> {
    Ok(serde_json::from_slice(bytes)?)
}

/// Whether this host can run `saved` (TSC frequency, CPUID); before the VM is created.
pub fn check_target(saved: &Saved) -> Result<()> {
    Ok(vmhost_vcpu::persist::check_target(saved)?)
}

/// Builds the VM of `plan` on `ram` (which holds the saved RAM) to continue from `saved`, on
/// `shell` when it was built ahead over `ram`.
pub fn restore(
    shell: Option<vmhost_vcpu::VmShell>,
    plan: &Plan,
    ram: impl GuestRam,
    options: VmOptions,
    saved: Saved,
) -> Result<Vm> {
    Ok(Vm::restore_on(shell, plan, ram, options, saved)?)
}

/// Record kind 17 of a snapshot's `state` file (JSON): what the guest has seen of its topology
/// ([`Plan::guest_identity`] of the plan it ran under) and, per guest cell, the host node its
/// memory was bound to there (`None`: unbound or spread over nodes), for the restore report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestRecord {
    /// The guest's CPU topology, APIC IDs, cells, page size and distances.
    pub identity: GuestIdentity,
    /// Host node of each guest cell (by cell number) on the host the snapshot was taken on.
    pub source_nodes: Vec<Option<u32>>,
}

impl GuestRecord {
    /// The record of the VM that runs under `plan`.
    pub fn of(plan: &Plan) -> GuestRecord {
        let mut cells: Vec<_> = plan.guest_cells.iter().collect();
        cells.sort_by_key(|c| c.cell);
        GuestRecord {
            identity: plan.guest_identity(),
            source_nodes: cells.iter().map(|c| c.host_node).collect(),
        }
    }

    /// Encodes record kind 17.
    pub fn encode(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).context("encoding the guest identity as JSON")
    }

    /// Decodes record kind 17.
    pub fn decode(bytes: &[u8]) -> Result<GuestRecord> {
        Ok(serde_json::from_slice(bytes)?)
    }
}
