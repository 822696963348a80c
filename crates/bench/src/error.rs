//! Why the benchmark could not run: one variant per failing operation, with the scenario,
//! run, cell or PU concerned.

use std::path::PathBuf;

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The guest-physical layout of the plan could not be made.
    #[error("cannot lay out the VM's guest memory")]
    Layout {
        /// The cause.
        #[source]
        source: vmhost_memory::LayoutError,
    },
    /// A guest cell cannot hold the working set in one piece.
    #[error(
        "guest cell {cell} has {largest} bytes of RAM in one piece, the benchmark's working set is \
         {working_set} bytes (4× the {llc} last-level cache, in whole pages): set memory.guest to \
         at least {guest_needed}"
    )]
    CellTooSmall {
        /// Cell.
        cell: u32,
        /// Its largest RAM region.
        largest: u64,
        /// Working set per cell.
        working_set: u64,
        /// The LLC size, formatted.
        llc: String,
        /// The `memory.guest` that would do, formatted.
        guest_needed: String,
    },
    /// No scenario was asked for.
    #[error("no scenario to run")]
    NoScenarios,
    /// A repeat count of zero.
    #[error("--repeat must be at least 1")]
    NoRepeats,
    /// Guest memory, or the host baseline's memory, could not be set up.
    #[error("{scenario}: cannot set up the {side} memory")]
    Memory {
        /// Scenario (or `host-only node<N>`).
        scenario: String,
        /// `guest` or `host baseline`.
        side: &'static str,
        /// The cause.
        #[source]
        source: vmhost_memory::MemoryError,
    },
    /// The residency audit failed.
    #[error("{scenario}: cannot audit the {side} memory")]
    Audit {
        /// Scenario.
        scenario: String,
        /// `guest` or `host baseline`.
        side: &'static str,
        /// The cause.
        #[source]
        source: vmhost_memory::AuditError,
    },
    /// The VM could not be created or run.
    #[error("{scenario}: run {run}: the VM failed")]
    Vm {
        /// Scenario.
        scenario: String,
        /// Run (1-based).
        run: u32,
        /// The cause (boxed: a `VmError` is large).
        #[source]
        source: Box<vmhost_vcpu::VmError>,
    },
    /// The guest did not complete its payload.
    #[error("{scenario}: run {run}: the guest did not complete: {detail}")]
    GuestFailed {
        /// Scenario.
        scenario: String,
        /// Run (1-based).
        run: u32,
        /// Status and failed vCPUs.
        detail: String,
    },
    /// A vCPU reported no (or incomplete) benchmark results.
    #[error("{scenario}: run {run}: vCPU {vcpu} reported {got} of {expected} cell results")]
    MissingResults {
        /// Scenario.
        scenario: String,
        /// Run (1-based).
        run: u32,
        /// vCPU index.
        vcpu: u32,
        /// Cells expected.
        expected: usize,
        /// Cells reported.
        got: usize,
    },
    /// The host baseline's chains could not be built.
    #[error("{scenario}: cannot build the host baseline's pointer chains")]
    Chain {
        /// Scenario.
        scenario: String,
        /// The cause.
        #[source]
        source: vmhost_vcpu::payload::PayloadError,
    },
    /// Host baseline memory could not be read or written.
    #[error("{scenario}: cannot access host baseline memory at offset GPA {gpa:#x}")]
    Access {
        /// Scenario.
        scenario: String,
        /// The layout address.
        gpa: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// A chain link points outside its working set (a bug).
    #[error(
        "{scenario}: chain link at GPA {gpa:#x} points to {target:#x}, outside its working set"
    )]
    BadLink {
        /// Scenario.
        scenario: String,
        /// Where the link is.
        gpa: u64,
        /// What it holds.
        target: u64,
    },
    /// A host baseline thread could not be started.
    #[error("cannot start host baseline thread {thread}")]
    Spawn {
        /// Thread index.
        thread: usize,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A host baseline thread could not be pinned.
    #[error("cannot pin host baseline thread {thread} to PUs {cpus:?}")]
    Pin {
        /// Thread index.
        thread: usize,
        /// The PUs.
        cpus: Vec<u32>,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A host baseline thread panicked (a bug).
    #[error("host baseline thread {thread} panicked")]
    ThreadPanicked {
        /// Thread index.
        thread: usize,
    },
    /// The host has no PU or node to measure.
    #[error("the host has no allowed PU or no NUMA node to measure")]
    NothingToMeasure,
    /// The SVG file could not be written.
    #[error("cannot write the SVG heatmaps to {path}")]
    WriteSvg {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}
