//! vmhost's VM and vCPUs: a KVM VM created on `/dev/kvm` from a [`vmhost_plan::Plan`], with one
//! pinned thread per vCPU and CPUID describing the planned topology, that runs either a
//! built-in guest payload (64-bit ring 3, reporting through a mailbox page) or a Linux kernel
//! with ACPI tables describing the plan's CPUs and NUMA cells and a serial console.
//!
//! The split follows Firecracker's `vstate`: [`vm`] owns the VM (memslots, irqchip, boot area
//! or kernel, devices), [`vcpu`] one vCPU thread and `exits` its exits, the emulator thread
//! (`vmhost-emu`) the event loop that starts, stops and joins them. Architecture specifics sit
//! in [`arch`], payloads in [`payload`], a Linux guest's devices in [`devices`], the vCPU and VM
//! state that a snapshot or migration moves in [`persist`], raw calls in `sys`.
//!
//! Flow: spec → plan → guest memory → [`Vm::new`] → [`Vm::run`] → [`RunReport`]. Stopping
//! early: [`Vm::stop_handle`] (or [`stop_on_signals`] for SIGINT/SIGTERM); pausing, resuming
//! and the VM's state: [`Vm::handle`]. Snapshot and restore: [`VmHandle::capture`] (of a paused
//! VM) gives a [`persist::SavedVm`], [`Vm::restore`] builds a VM that continues from one. Live
//! migration's pre-copy: [`VmHandle::start_dirty_log`], [`VmHandle::take_dirty`] and
//! [`VmHandle::stop_dirty_log`] ([`dirty`]). Placement audit: [`thread_placements`]; the
//! binary's main thread: [`pin_current_thread_to_emulator`].
//!
//! A Linux guest's VM ends when the guest powers off (ACPI S5 through the FADT's sleep control
//! register) or reboots (FADT reset register, i8042 0xfe, port 0xcf9, or a triple fault):
//! [`RunStatus::PoweredOff`] / [`RunStatus::Rebooted`], exit status 0. A stop from outside
//! ends it as [`RunStatus::Stopped`].
//!
//! ```
//! use vmhost_memory::{GuestMemory, MemoryOptions};
//! use vmhost_plan::{plan, PlanOptions};
//! use vmhost_vcpu::{RunStatus, VcpuOutcome, Vm, VmOptions};
//!
//! if std::env::var("VMHOST_SKIP_KVM_TESTS").as_deref() == Ok("1") {
//!     println!("SKIP doc example: VMHOST_SKIP_KVM_TESTS=1");
//!     return;
//! }
//! let spec = vmhost_config::from_toml_str(
//!     "name = \"hello\"\n[cpu]\ncores = 1\n[memory]\nguest = \"16Mi\"\n[boot]\npayload = \"halt\"\n",
//!     "hello.toml",
//! )
//! .unwrap()
//! .spec;
//! let host = vmhost_topology::discover().unwrap();
//! let plan = plan(&spec, &host, &PlanOptions::default()).into_result().unwrap();
//! let memory = GuestMemory::new(&plan, &MemoryOptions::default()).unwrap();
//!
//! let mut vm = Vm::new(&plan, memory, VmOptions::default()).unwrap();
//! let report = vm.run().unwrap();
//! assert_eq!(report.status, RunStatus::Completed);
//! assert_eq!(report.vcpus[0].outcome, VcpuOutcome::Halted);
//! assert_eq!(report.exit_code(), 0);
//! // The guest read its CPUID in ring 0 and reported it in its mailbox.
//! assert!(report.vcpus[0].cpuid.iter().any(|r| r.leaf == 1));
//! println!("{}", report.render_text());
//! ```
#![warn(missing_docs)]

pub mod arch;
mod control;
pub mod devices;
pub mod dirty;
mod emulator;
mod exits;
mod linux;
pub mod payload;
pub mod persist;
pub mod placement;
pub mod report;
mod setup;
mod snapshot;
mod sys;
pub mod unknown;
pub mod vcpu;
pub mod virtio;
pub mod vm;

pub use arch::{decode_topology, CpuidResult, DecodedTopology};
pub use control::{
    stop_on_signals, ControlError, StopHandle, VmHandle, VmState, PAUSE_TIMEOUT, STOP_SIGNALS,
};
pub use devices::console::ConsoleInput;
pub use devices::legacy::RebootVia;
pub use devices::serial::SerialOut;
pub use dirty::DirtyLogError;
pub use payload::bench::BenchOptions;
pub use payload::{CellBench, PayloadKind, PayloadResult, TouchResult};
pub use placement::{
    current_tid, pin_current_thread_to_emulator, render_placements, thread_placements,
    PlacementError, ThreadPlacement,
};
pub use report::{BootReport, LinuxEntry, RunReport, RunStatus, VcpuOutcome, VcpuReport};
pub use snapshot::{CaptureError, VmShell};
pub use sys::restore_terminal;
pub use vcpu::{UnknownAccessPolicy, VcpuError};
pub use vm::{AfterStart, AfterStartFn, GuestRam, StartHook, StartSteps, Vm, VmError, VmOptions};
pub use vmhost_memory::DirtyBitmap;

#[doc(hidden)]
pub use payload::FaultPayload;
