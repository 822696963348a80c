//! The benchmark's loop: for each repeat, each scenario's VM run and its host baseline run,
//! back to back (their order alternating between repeats, so drift on a noisy host hits both
//! alike); then the per vCPU × cell statistics.

use std::time::Duration;

use vmhost_memory::{MemoryOptions, Progress};
use vmhost_plan::{Backing, Plan};
use vmhost_topology::HostTopology;
use vmhost_vcpu::payload::bench::LINE;
use vmhost_vcpu::BenchOptions;

use crate::guest::{self, cell_policies, GuestRun};
use crate::host::{self, ThreadResult};
use crate::kernel::calibrate_tsc_khz;
use crate::report::{
    BenchReport, CellPolicy, Compared, Entry, Readback, ScenarioReport, ThreadCpus,
};
use crate::scenario::{self, baseline_plan, Scenario, ScenarioSetup};
use crate::sizing::{self, LLC_MULTIPLE};
use crate::stats::Spread;
use crate::BenchError;

/// Settings of [`run`](crate::run).
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// The VM's plan on this host (any payload: the benchmark runs `numa-bench`).
    pub plan: Plan,
    /// This host (nodes, distances, allowed PUs).
    pub host: HostTopology,
    /// Scenarios to compare, in report order.
    pub scenarios: Vec<Scenario>,
    /// Runs per scenario (guest and host each).
    pub repeat: u32,
    /// Working set per cell (default: 4× the LLC, in whole pages).
    pub working_set_bytes: Option<u64>,
    /// Laps of the chase over the working set.
    pub chase_laps: u32,
    /// Passes of the stream over the working set.
    pub stream_passes: u32,
    /// Guest and baseline memory settings (the scenario sets the policy).
    pub memory: MemoryOptions,
}

impl BenchArgs {
    /// Defaults: every scenario, 5 runs, 4× LLC, 1 chase lap, 16 stream passes, no progress bar.
    pub fn new(plan: Plan, host: HostTopology) -> BenchArgs {
        let mut memory = MemoryOptions::default();
        memory.prefault.progress = Progress::Hidden;
        BenchArgs {
            plan,
            host,
            scenarios: Scenario::ALL.to_vec(),
            repeat: 5,
            working_set_bytes: None,
            chase_laps: 1,
            stream_passes: 16,
            memory,
        }
    }
}

/// A scenario to run, or why it is skipped.
pub type Planned = Result<ScenarioSetup, (Scenario, String)>;

/// The scenarios of `args` set up on its host.
pub fn plan_scenarios(args: &BenchArgs) -> Vec<Planned> {
    let mut seen = Vec::new();
    args.scenarios
        .iter()
        .filter(|s| {
            let new = !seen.contains(*s);
            seen.push(**s);
            new
        })
        .map(|&s| scenario::setup(s, &args.plan, &args.host).map_err(|reason| (s, reason)))
        .collect()
}

/// The sizes a run uses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub llc: Option<u64>,
    pub ws: u64,
    pub bench: BenchOptions,
}

pub(crate) fn sizes(requested: Option<u64>, page: u64, laps: u32, passes: u32) -> Sizes {
    let llc = sizing::llc_bytes();
    let ws = sizing::working_set(requested, llc, page);
    let bench = BenchOptions {
        working_set_bytes: Some(ws),
        chase_loads: Some(ws / LINE * u64::from(laps.max(1))),
        stream_passes: Some(passes.max(1)),
    };
    Sizes { llc, ws, bench }
}

/// One host-baseline run of a scenario.
struct HostRun {
    threads: Vec<ThreadResult>,
    policies: Vec<CellPolicy>,
}

fn host_run(setup: &ScenarioSetup, args: &BenchArgs, sz: &Sizes) -> Result<HostRun, BenchError> {
    let name = setup.scenario.to_string();
    let plan = baseline_plan(setup, sz.ws);
    let mut opts = args.memory.clone();
    opts.policy_override = setup.policy.clone();
    let mem = host::allocate(&name, &plan, &opts, &sz.bench, setup.plan.vcpus.len())?;
    let audit = mem.mem.audit().map_err(|source| BenchError::Audit {
        scenario: name,
        side: "host baseline",
        source,
    })?;
    let policies = cell_policies(&audit, &setup.expected_policies());
    let threads = host::run_threads(&mem, &setup.thread_cpus())?;
    Ok(HostRun { threads, policies })
}

/// Every run: per repeat, per scenario, the VM and the host baseline back to back, their order
/// alternating between repeats.
#[expect(clippy::type_complexity, reason = "two parallel per-scenario lists")]
fn measure(
    args: &BenchArgs,
    setups: &[&ScenarioSetup],
    sz: &Sizes,
) -> Result<(Vec<Vec<GuestRun>>, Vec<Vec<HostRun>>), BenchError> {
    let mut guest_runs: Vec<Vec<GuestRun>> = vec![Vec::new(); setups.len()];
    let mut host_runs: Vec<Vec<HostRun>> = setups.iter().map(|_| Vec::new()).collect();
    for r in 0..args.repeat {
        for (i, setup) in setups.iter().enumerate() {
            tracing::info!(
                "bench numa: {} run {}/{}",
                setup.scenario,
                r + 1,
                args.repeat
            );
            if r % 2 == 0 {
                guest_runs[i].push(guest::run_once(setup, &args.memory, &sz.bench, r + 1)?);
                host_runs[i].push(host_run(setup, args, sz)?);
            } else {
                host_runs[i].push(host_run(setup, args, sz)?);
                guest_runs[i].push(guest::run_once(setup, &args.memory, &sz.bench, r + 1)?);
            }
        }
    }
    Ok((guest_runs, host_runs))
}

/// Runs the planned scenarios (see [`plan_scenarios`]) and reports.
pub fn run_planned(args: &BenchArgs, planned: Vec<Planned>) -> Result<BenchReport, BenchError> {
    if planned.is_empty() {
        return Err(BenchError::NoScenarios);
    }
    if args.repeat == 0 {
        return Err(BenchError::NoRepeats);
    }
    let page = args.plan.backing.page_size_bytes();
    let sz = sizes(
        args.working_set_bytes,
        page,
        args.chase_laps,
        args.stream_passes,
    );
    sizing::check_cells(&args.plan, sz.ws, sz.llc)?;
    let calibrated = calibrate_tsc_khz(Duration::from_millis(100));
    let setups: Vec<&ScenarioSetup> = planned.iter().filter_map(|p| p.as_ref().ok()).collect();
    let (guest_runs, host_runs) = measure(args, &setups, &sz)?;
    let tsc_khz = guest_runs
        .iter()
        .flatten()
        .map(|g| g.tsc_khz)
        .find(|k| *k > 0)
        .unwrap_or(calibrated);
    let mut notes = Vec::new();
    let mut scenarios = Vec::new();
    let mut k = 0;
    for p in &planned {
        match p {
            Err((scenario, reason)) => scenarios.push(ScenarioReport {
                scenario: *scenario,
                skipped: Some(reason.clone()),
                description: String::new(),
                readback: None,
                entries: Vec::new(),
            }),
            Ok(setup) => {
                let report = scenario_report(setup, &guest_runs[k], &host_runs[k], tsc_khz);
                check_claims(setup, &guest_runs[k], &sz, &mut notes);
                if report.readback.as_ref().is_some_and(|r| !r.all_match()) {
                    notes.push(format!(
                        "{}: the placement read back differs from the plan",
                        setup.scenario
                    ));
                }
                scenarios.push(report);
                k += 1;
            }
        }
    }
    if let Some(llc) = sz.llc.filter(|l| sz.ws < LLC_MULTIPLE * l) {
        notes.push(format!(
            "working set below {LLC_MULTIPLE}× the {} LLC: part of the chase hits the cache",
            vmhost_config::format_bytes(llc)
        ));
    }
    Ok(BenchReport {
        vm: args.plan.name.clone(),
        vcpus: args.plan.vcpus.len(),
        cells: args.plan.guest_cells.len(),
        host_nodes: args.host.nodes.iter().map(|n| n.os_index).collect(),
        page_size_bytes: page,
        hugepages: matches!(args.plan.backing, Backing::Hugetlb { .. }),
        llc_bytes: sz.llc,
        working_set_bytes: sz.ws,
        chase_loads: sz.bench.chase_loads.unwrap_or(0),
        stream_passes: sz.bench.stream_passes.unwrap_or(1),
        repeat: args.repeat,
        tsc_khz,
        tsc_khz_calibrated: calibrated,
        scenarios,
        notes,
    })
}

/// Notes any vCPU whose reported loads or bytes differ from what the run asked for.
fn check_claims(setup: &ScenarioSetup, runs: &[GuestRun], sz: &Sizes, notes: &mut Vec<String>) {
    let loads = sz.bench.chase_loads.unwrap_or(0);
    let bytes = sz.ws * u64::from(sz.bench.stream_passes.unwrap_or(1));
    if runs
        .iter()
        .flat_map(|r| &r.samples)
        .any(|s| (s.loads, s.bytes) != (loads, bytes))
    {
        notes.push(format!(
            "{}: a vCPU reported other loads/bytes than the {loads} loads and {bytes} bytes asked for",
            setup.scenario
        ));
    }
}

/// Latency (ns, lower is better) or bandwidth (GB/s, higher is better) of paired runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Latency,
    Bandwidth,
}

/// One metric of paired guest and host runs (`(ns, GB/s)` each).
fn compared(g: &[(f64, f64)], h: &[(f64, f64)], metric: Metric) -> Compared {
    let pick = |v: &(f64, f64)| match metric {
        Metric::Latency => v.0,
        Metric::Bandwidth => v.1,
    };
    let guest_runs: Vec<f64> = g.iter().map(pick).collect();
    let host_runs: Vec<f64> = h.iter().map(pick).collect();
    let (guest, host) = (Spread::of(&guest_runs), Spread::of(&host_runs));
    // Guest performance / host performance, run by run (runs are paired).
    let ratio: Vec<f64> = guest_runs
        .iter()
        .zip(&host_runs)
        .map(|(g, h)| match metric {
            Metric::Latency => h / g,
            Metric::Bandwidth => g / h,
        })
        .collect();
    Compared {
        guest,
        host,
        ratio: Spread::of(&ratio),
        guest_runs,
        host_runs,
    }
}

fn scenario_report(
    setup: &ScenarioSetup,
    guest: &[GuestRun],
    host: &[HostRun],
    tsc_khz: u32,
) -> ScenarioReport {
    let mut cells: Vec<u32> = setup.plan.guest_cells.iter().map(|c| c.cell).collect();
    cells.sort_unstable();
    let mut entries = Vec::new();
    for (i, v) in setup.plan.vcpus.iter().enumerate() {
        for &cell in &cells {
            let g: Vec<(f64, f64)> = guest
                .iter()
                .filter_map(|r| {
                    r.samples
                        .iter()
                        .find(|s| s.vcpu == v.vcpu && s.cell == cell)
                })
                .map(|s| (s.ns, s.gbps))
                .collect();
            let h: Vec<(f64, f64)> = host
                .iter()
                .filter_map(|r| r.threads.get(i)?.cells.iter().find(|c| c.cell == cell))
                .map(|c| host::convert(c, tsc_khz))
                .collect();
            entries.push(Entry {
                vcpu: v.vcpu,
                host_cpu: v.host_cpu,
                cell,
                latency_ns: compared(&g, &h, Metric::Latency),
                bandwidth_gb_per_s: compared(&g, &h, Metric::Bandwidth),
            });
        }
    }
    ScenarioReport {
        scenario: setup.scenario,
        skipped: None,
        description: setup.description.clone(),
        readback: readback(setup, guest.first(), host.first()),
        entries,
    }
}

fn readback(setup: &ScenarioSetup, g: Option<&GuestRun>, h: Option<&HostRun>) -> Option<Readback> {
    let (g, h) = (g?, h?);
    let expected = setup.thread_cpus();
    let mut vcpu_threads = g.threads.clone();
    vcpu_threads.sort_by_key(|t| t.vcpu);
    let host_threads = h
        .threads
        .iter()
        .zip(&setup.plan.vcpus)
        .zip(expected)
        .map(|((t, v), expected)| ThreadCpus {
            vcpu: v.vcpu,
            expected,
            cpus_allowed: t.cpus_allowed.clone(),
        })
        .collect();
    Some(Readback {
        guest_memory: g.policies.clone(),
        host_memory: h.policies.clone(),
        vcpu_threads,
        host_threads,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_guest_performance_over_host_run_by_run() {
        // (ns, GB/s) per run: the guest is 10% slower in latency, 20% faster in bandwidth.
        let g = [(110.0, 12.0), (220.0, 24.0), (330.0, 6.0)];
        let h = [(100.0, 10.0), (200.0, 20.0), (300.0, 5.0)];
        let lat = compared(&g, &h, Metric::Latency);
        assert_eq!(lat.guest_runs, vec![110.0, 220.0, 330.0]);
        assert!((lat.ratio.median - 100.0 / 110.0).abs() < 1e-12);
        assert_eq!(lat.ratio.runs, 3);
        let bw = compared(&g, &h, Metric::Bandwidth);
        assert!((bw.ratio.min - 1.2).abs() < 1e-12 && (bw.ratio.max - 1.2).abs() < 1e-12);
        assert_eq!(bw.host.max, 20.0);
    }
}
