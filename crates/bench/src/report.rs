//! What `vmhost bench numa` reports: per scenario, per vCPU × guest cell, guest and host
//! latency and bandwidth with their spread and the guest/host ratio, and what was read back
//! from the kernel to prove the scenario's placement. Serializes to JSON; `Display` renders
//! the terminal tables.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;
use vmhost_config::format_bytes;

use crate::matrix::{render_side_by_side, Better, Matrices, Matrix};
use crate::scenario::Scenario;
use crate::stats::Spread;

/// The target guest/host ratio with hugepage backing.
pub const TARGET_RATIO: f64 = 0.95;

/// A cell's memory policy, planned and read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CellPolicy {
    /// Guest cell.
    pub cell: u32,
    /// The policy the scenario sets (`bind:0`, `interleave:0,1`).
    pub expected: String,
    /// The policy `/proc/self/numa_maps` shows for the cell's memory.
    pub numa_maps: String,
    /// Pages per node, per `numa_maps`.
    pub pages_by_node: BTreeMap<u32, u64>,
    /// True when `numa_maps` and `get_mempolicy` both show the expected policy and no page
    /// sits off the policy's nodes.
    pub matches: bool,
}

/// Where a thread was allowed to run, planned and read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ThreadCpus {
    /// vCPU index (the host-baseline thread standing in for it).
    pub vcpu: u32,
    /// PUs the scenario allows.
    pub expected: Vec<u32>,
    /// PUs the kernel allows (`Cpus_allowed_list` / `sched_getaffinity`).
    pub cpus_allowed: Vec<u32>,
}

/// The placement a scenario really got, read back during its first run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Readback {
    /// Guest memory, per cell.
    pub guest_memory: Vec<CellPolicy>,
    /// Host-baseline memory, per cell.
    pub host_memory: Vec<CellPolicy>,
    /// vCPU threads, from `/proc/self/task/*/status` when they started.
    pub vcpu_threads: Vec<ThreadCpus>,
    /// Host-baseline threads, from `sched_getaffinity` after pinning.
    pub host_threads: Vec<ThreadCpus>,
}

impl Readback {
    /// True when every policy and every thread's PUs are as the scenario planned.
    pub fn all_match(&self) -> bool {
        self.guest_memory
            .iter()
            .chain(&self.host_memory)
            .all(|p| p.matches)
            && self
                .vcpu_threads
                .iter()
                .chain(&self.host_threads)
                .all(|t| t.expected == t.cpus_allowed)
    }
}

/// One number measured in the guest and on the host, and their ratio.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Compared {
    /// In the guest.
    pub guest: Spread,
    /// Natively on the host, same PUs, same memory placement.
    pub host: Spread,
    /// Guest performance / host performance, run by run (guest and host runs are paired):
    /// host ns ÷ guest ns for latency, guest GB/s ÷ host GB/s for bandwidth. 1.0 = native.
    pub ratio: Spread,
    /// Every guest value, in run order.
    pub guest_runs: Vec<f64>,
    /// Every host value, in run order (run `i` was paired with guest run `i`).
    pub host_runs: Vec<f64>,
}

/// One vCPU × guest cell of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Entry {
    /// vCPU index.
    pub vcpu: u32,
    /// The PU it is pinned to (`None`: floating).
    pub host_cpu: Option<u32>,
    /// Guest cell.
    pub cell: u32,
    /// Mean latency of a dependent load, ns.
    pub latency_ns: Compared,
    /// Sequential read bandwidth, GB/s (10⁹ bytes/s).
    pub bandwidth_gb_per_s: Compared,
}

/// One scenario's results, or why it was skipped.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioReport {
    /// The scenario.
    pub scenario: Scenario,
    /// Why it did not run (`None`: it ran).
    pub skipped: Option<String>,
    /// What the scenario changes.
    pub description: String,
    /// The placement read back (first run).
    pub readback: Option<Readback>,
    /// Per vCPU × cell, vCPU-major.
    pub entries: Vec<Entry>,
}

/// The whole benchmark.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchReport {
    /// VM name.
    pub vm: String,
    /// vCPUs.
    pub vcpus: usize,
    /// Guest cells.
    pub cells: usize,
    /// Host NUMA nodes.
    pub host_nodes: Vec<u32>,
    /// Backing page size.
    pub page_size_bytes: u64,
    /// True for hugetlb backing (the ratio target applies).
    pub hugepages: bool,
    /// The host's last-level cache (`None`: unreadable).
    pub llc_bytes: Option<u64>,
    /// Working set per cell.
    pub working_set_bytes: u64,
    /// Dependent loads per chase.
    pub chase_loads: u64,
    /// Passes of each stream.
    pub stream_passes: u32,
    /// Runs per number.
    pub repeat: u32,
    /// TSC rate used for both sides (KVM_GET_TSC_KHZ when a VM ran).
    pub tsc_khz: u32,
    /// TSC rate measured against the monotonic clock (a cross-check).
    pub tsc_khz_calibrated: u32,
    /// Per scenario.
    pub scenarios: Vec<ScenarioReport>,
    /// Remarks (working set below 4× LLC, audit violations, ...).
    pub notes: Vec<String>,
}

/// Picks one spread from an entry.
type Getter = fn(&Entry) -> Spread;

fn cpu_label(host_cpu: Option<u32>) -> String {
    host_cpu.map_or_else(|| "float".to_string(), |c| format!("PU{c}"))
}

impl ScenarioReport {
    /// The spreads `f` picks from each entry, by vCPU row and cell column.
    fn grid(&self, rows: &[u32], cols: &[u32], f: Getter) -> Vec<Vec<Option<Spread>>> {
        rows.iter()
            .map(|v| {
                cols.iter()
                    .map(|c| {
                        self.entries
                            .iter()
                            .find(|e| e.vcpu == *v && e.cell == *c)
                            .map(f)
                    })
                    .collect()
            })
            .collect()
    }

    /// The six matrices (latency and bandwidth × guest, host, ratio); empty when skipped.
    pub fn matrices(&self) -> Vec<Matrix> {
        let mut rows: Vec<(u32, Option<u32>)> =
            self.entries.iter().map(|e| (e.vcpu, e.host_cpu)).collect();
        rows.dedup();
        let mut cols: Vec<u32> = self.entries.iter().map(|e| e.cell).collect();
        cols.sort_unstable();
        cols.dedup();
        let policy = |cell: u32| {
            self.readback
                .as_ref()
                .and_then(|r| r.guest_memory.iter().find(|p| p.cell == cell))
                .map_or_else(String::new, |p| format!(" {}", p.expected))
        };
        let col_labels: Vec<String> = cols
            .iter()
            .map(|c| format!("cell{c}{}", policy(*c)))
            .collect();
        let row_labels: Vec<String> = rows
            .iter()
            .map(|(v, c)| format!("vcpu{v} {}", cpu_label(*c)))
            .collect();
        let vcpus: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let kinds: [(&str, &str, &str, Better, usize, Getter); 6] = [
            ("latency", "guest", " (ns)", Better::Lower, 1, |e| {
                e.latency_ns.guest
            }),
            ("latency", "host", " (ns)", Better::Lower, 1, |e| {
                e.latency_ns.host
            }),
            (
                "latency",
                "ratio",
                " (host ns / guest ns)",
                Better::Ratio,
                3,
                |e| e.latency_ns.ratio,
            ),
            ("bandwidth", "guest", " (GB/s)", Better::Higher, 2, |e| {
                e.bandwidth_gb_per_s.guest
            }),
            ("bandwidth", "host", " (GB/s)", Better::Higher, 2, |e| {
                e.bandwidth_gb_per_s.host
            }),
            (
                "bandwidth",
                "ratio",
                " (guest / host GB/s)",
                Better::Ratio,
                3,
                |e| e.bandwidth_gb_per_s.ratio,
            ),
        ];
        if self.entries.is_empty() {
            return Vec::new();
        }
        kinds
            .into_iter()
            .map(|(metric, short, unit, better, decimals, f)| Matrix {
                title: format!("{}: {metric}, {short}{unit}", self.scenario),
                short: short.to_string(),
                rows: row_labels.clone(),
                cols: col_labels.clone(),
                values: self.grid(&vcpus, &cols, f),
                decimals,
                better,
            })
            .collect()
    }

    /// The median latency and bandwidth ratios over all entries (the median of medians).
    pub fn median_ratios(&self) -> Option<(f64, f64)> {
        if self.entries.is_empty() {
            return None;
        }
        let lat: Vec<f64> = self
            .entries
            .iter()
            .map(|e| e.latency_ns.ratio.median)
            .collect();
        let bw: Vec<f64> = self
            .entries
            .iter()
            .map(|e| e.bandwidth_gb_per_s.ratio.median)
            .collect();
        Some((Spread::of(&lat).median, Spread::of(&bw).median))
    }
}

impl Matrices for BenchReport {
    fn heading(&self) -> String {
        format!(
            "vmhost bench numa: VM {}, {} vCPUs × {} cells, working set {} per cell, {} runs (median [min–max])",
            self.vm,
            self.vcpus,
            self.cells,
            format_bytes(self.working_set_bytes),
            self.repeat
        )
    }

    fn matrices(&self) -> Vec<Matrix> {
        self.scenarios
            .iter()
            .flat_map(ScenarioReport::matrices)
            .collect()
    }
}

fn fmt_readback(f: &mut fmt::Formatter<'_>, r: &Readback) -> fmt::Result {
    let ok = |b: bool| if b { "ok" } else { "MISMATCH" };
    for (side, list) in [
        ("guest memory", &r.guest_memory),
        ("host memory", &r.host_memory),
    ] {
        for p in list {
            let nodes: Vec<String> = p
                .pages_by_node
                .iter()
                .map(|(n, c)| format!("N{n}={c}"))
                .collect();
            writeln!(
                f,
                "  read back: {side} cell{}: numa_maps {} {} (expected {}) {}",
                p.cell,
                p.numa_maps,
                nodes.join(" "),
                p.expected,
                ok(p.matches)
            )?;
        }
    }
    for (side, list) in [
        ("vCPU thread", &r.vcpu_threads),
        ("host thread", &r.host_threads),
    ] {
        for t in list {
            writeln!(
                f,
                "  read back: {side} {}: PUs {} (expected {}) {}",
                t.vcpu,
                vmhost_topology::cpulist::format(&t.cpus_allowed),
                vmhost_topology::cpulist::format(&t.expected),
                ok(t.expected == t.cpus_allowed)
            )?;
        }
    }
    Ok(())
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self.host_nodes.iter().map(u32::to_string).collect();
        writeln!(
            f,
            "NUMA locality benchmark: VM {}, {} vCPUs, {} guest cell(s); host nodes {}",
            self.vm,
            self.vcpus,
            self.cells,
            nodes.join(",")
        )?;
        writeln!(
            f,
            "memory: {} pages; working set {} per cell (LLC {}); chase {} dependent loads; stream {} passes",
            format_bytes(self.page_size_bytes),
            format_bytes(self.working_set_bytes),
            self.llc_bytes.map_or_else(|| "unknown".to_string(), format_bytes),
            self.chase_loads,
            self.stream_passes
        )?;
        writeln!(
            f,
            "{} runs per number, guest and host runs interleaved; median [min–max]; TSC {:.1} MHz (calibrated {:.1} MHz)",
            self.repeat,
            f64::from(self.tsc_khz) / 1e3,
            f64::from(self.tsc_khz_calibrated) / 1e3
        )?;
        writeln!(
            f,
            "ratio = guest performance / host: latency host ns ÷ guest ns, bandwidth guest ÷ host GB/s (1.000 = native)"
        )?;
        for s in &self.scenarios {
            writeln!(f)?;
            if let Some(reason) = &s.skipped {
                writeln!(f, "== {}: skipped ({reason})", s.scenario)?;
                continue;
            }
            writeln!(f, "== {}: {}", s.scenario, s.description)?;
            if let Some(r) = &s.readback {
                fmt_readback(f, r)?;
            }
            let m = s.matrices();
            if m.len() == 6 {
                f.write_str(&render_side_by_side("latency (ns)", &[&m[0], &m[1], &m[2]]))?;
                f.write_str(&render_side_by_side(
                    "bandwidth (GB/s)",
                    &[&m[3], &m[4], &m[5]],
                ))?;
            }
        }
        self.fmt_summary(f)
    }
}

impl BenchReport {
    fn fmt_summary(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "\nsummary: guest/host ratios (median over vCPU × cell of the paired-run medians):"
        )?;
        for s in &self.scenarios {
            let Some((lat, bw)) = s.median_ratios() else {
                writeln!(f, "  {:<11} skipped", s.scenario.name())?;
                continue;
            };
            let verdict = if !self.hugepages {
                "(the target applies to hugepage backing)"
            } else if lat >= TARGET_RATIO && bw >= TARGET_RATIO {
                "target ≥ 0.95 met"
            } else {
                "target ≥ 0.95 NOT met"
            };
            writeln!(
                f,
                "  {:<11} latency {lat:.3}  bandwidth {bw:.3}  {verdict}",
                s.scenario.name()
            )?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        Ok(())
    }
}
