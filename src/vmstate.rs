//! The seam between the binary and the vCPU crate's saved VM state
//! ([`vmhost_vcpu::persist::SavedVm`], record kind 16 of a snapshot's `state` file, as JSON):
//! capture of a paused VM, the compatibility check of this host, and building a VM that
//! continues from it.

use anyhow::{Context, Result};
use vmhost_plan::Plan;
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

/// Builds the VM of `plan` on `ram` (which holds the saved RAM) to continue from `saved`.
pub fn restore(plan: &Plan, ram: impl GuestRam, options: VmOptions, saved: Saved) -> Result<Vm> {
    Ok(Vm::restore(plan, ram, options, saved)?)
}
