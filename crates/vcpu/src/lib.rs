//! vmhost's VM and vCPUs: a KVM VM created on `/dev/kvm` from a [`vmhost_plan::Plan`], with one
//! pinned thread per vCPU, CPUID describing the planned topology, and built-in guest payloads
//! that run in 64-bit ring 3 and report through a mailbox page.
//!
//! The split follows Firecracker's `vstate`: [`vm`] owns the VM (memslots, irqchip, boot area),
//! [`vcpu`] one vCPU thread and its exits, the emulator thread (`vmhost-emu`) the event loop
//! that starts, stops and joins them. Architecture specifics sit in [`arch`], payloads in
//! [`payload`], raw calls in `sys`.
//!
//! Flow: spec → plan → guest memory → [`Vm::new`] → [`Vm::run`] → [`RunReport`]. Stopping
//! early: [`Vm::stop_handle`] (or [`stop_on_signals`] for SIGINT/SIGTERM). Placement audit:
//! [`thread_placements`]; the binary's main thread: [`pin_current_thread_to_emulator`].
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
mod emulator;
pub mod payload;
pub mod placement;
pub mod report;
mod sys;
pub mod vcpu;
pub mod vm;

pub use arch::{decode_topology, CpuidResult, DecodedTopology};
pub use control::{stop_on_signals, StopHandle};
pub use payload::bench::BenchOptions;
pub use payload::{CellBench, PayloadKind, PayloadResult, TouchResult};
pub use placement::{
    current_tid, pin_current_thread_to_emulator, render_placements, thread_placements,
    PlacementError, ThreadPlacement,
};
pub use report::{RunReport, RunStatus, VcpuOutcome, VcpuReport};
pub use vcpu::{UnknownAccessPolicy, VcpuError};
pub use vm::{GuestRam, StartHook, Vm, VmError, VmOptions};

#[doc(hidden)]
pub use payload::FaultPayload;
