//! vmhost's NUMA locality benchmark (`vmhost bench numa`): how close a VM's memory latency and
//! bandwidth come to the host's own, per vCPU × guest cell, and how placement changes them.
//!
//! For each scenario ([`Scenario`]: `pinned`, `floating`, `remote`, `interleave`) the VM runs
//! the guest `numa-bench` payload (a dependent-load pointer chase over a random cycle through
//! a working set ≥ 4× the last-level cache, and a sequential read stream, timed with `rdtsc`
//! in guest ring 3), and host threads pinned to the same PUs run the same kernels ([`kernel`])
//! over the same chains, on memory set up the same way (same page size, node and policy):
//! the physical limit. Guest and host runs alternate, `repeat` times; every number is a
//! median with its min and max ([`Spread`]). Scenarios the host cannot express (one NUMA
//! node) are reported as skipped with the reason. What each scenario configured is read back
//! from the kernel (`numa_maps`, thread affinities) and reported next to the numbers.
//!
//! Entry points: [`run`] ([`BenchArgs`] → [`BenchReport`]: JSON via serde, tables via
//! `Display`), [`host_only`] (an MLC-like PU × node matrix of the host), [`write_svg`]
//! (heatmaps of either report).
//!
//! ```no_run
//! use vmhost_bench::{run, write_svg, BenchArgs};
//! use vmhost_plan::{plan, PlanOptions};
//!
//! let spec = vmhost_config::load(std::path::Path::new("configs/numa-bench.toml")).unwrap().spec;
//! let host = vmhost_topology::discover().unwrap();
//! let plan = plan(&spec, &host, &PlanOptions::default()).into_result().unwrap();
//! let report = run(&BenchArgs::new(plan, host)).unwrap();
//! println!("{report}");
//! write_svg(&report, std::path::Path::new("numa.svg")).unwrap();
//! ```
#![warn(missing_docs)]

mod error;
mod guest;
pub mod host;
mod hostonly;
pub mod kernel;
mod matrix;
mod report;
mod runner;
pub mod scenario;
pub mod sizing;
mod stats;
mod svg;

pub use error::BenchError;
pub use hostonly::{host_only, HostEntry, HostOnlyArgs, HostReport};
pub use matrix::{Better, Matrices, Matrix};
pub use report::{
    BenchReport, CellPolicy, Compared, Entry, Readback, ScenarioReport, ThreadCpus, TARGET_RATIO,
};
pub use runner::{plan_scenarios, run_planned, BenchArgs, Planned};
pub use scenario::{Scenario, ScenarioSetup, UnknownScenario};
pub use stats::Spread;
pub use svg::{render_svg, write_svg};

/// Runs every scenario of `args` (skipping those this host cannot express) and reports.
pub fn run(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    run_planned(args, plan_scenarios(args))
}
