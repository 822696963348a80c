//! The seam between the binary and the vCPU crate's saved VM state (`SavedVm`, record kind
//! 16 of a snapshot's `state` file, as JSON): capture of a paused VM, the compatibility check
//! of this host, and building a VM that continues from it.
//!
//! Until `vmhost-vcpu` has `VmHandle::capture`, `persist::check_target` and `Vm::restore`
//! (helper branch mig-snapshot), each of these fails with [`NOT_BUILT`]; merging that branch
//! replaces the bodies below with one call each.

use anyhow::{bail, Result};
use vmhost_plan::Plan;
use vmhost_vcpu::{GuestRam, Vm, VmHandle, VmOptions};

/// The message while the vCPU crate lacks VM state capture and restore.
pub const NOT_BUILT: &str =
    "saving and restoring the VM's state (vCPUs, irqchip, clock) is not built into this vmhost yet";

/// A decoded VM state.
pub type Saved = serde_json::Value;

/// Captures the state of the paused VM of `handle`, as the JSON of record kind 16.
pub fn capture(handle: &VmHandle) -> Result<Vec<u8>> {
    let _ = handle;
    bail!(NOT_BUILT)
}

/// Decodes record kind 16.
pub fn decode(bytes: &[u8]) -> Result<Saved> {
    Ok(serde_json::from_slice(bytes)?)
}

/// Whether this host can run `saved` (TSC frequency, CPUID); before the VM is created.
pub fn check_target(saved: &Saved) -> Result<()> {
    let _ = saved;
    bail!(NOT_BUILT)
}

/// Builds the VM of `plan` on `ram` (which holds the saved RAM) to continue from `saved`.
pub fn restore(plan: &Plan, ram: impl GuestRam, options: VmOptions, saved: Saved) -> Result<Vm> {
    let _ = (plan, ram, options, saved);
    bail!(NOT_BUILT)
}
