//! `vmhost bench numa --host-only`: the host's own latency/bandwidth matrix, MLC-style: every
//! allowed PU (or one per core) × every node, one thread at a time (idle latency), with the
//! same kernels, chains and memory setup as the VM baseline.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Serialize;
use vmhost_config::format_bytes;
use vmhost_memory::{MemoryOptions, Progress};
use vmhost_plan::{Backing, GuestCell, Plan};
use vmhost_topology::HostTopology;

use crate::guest::cell_policies;
use crate::host;
use crate::kernel::calibrate_tsc_khz;
use crate::matrix::{render_side_by_side, Better, Matrices, Matrix};
use crate::report::CellPolicy;
use crate::runner::sizes;
use crate::stats::Spread;
use crate::BenchError;

/// Settings of [`host_only`].
#[derive(Debug, Clone)]
pub struct HostOnlyArgs {
    /// This host.
    pub host: HostTopology,
    /// Measure from the first allowed PU of each core only (default: every allowed PU).
    pub one_per_core: bool,
    /// Runs per number.
    pub repeat: u32,
    /// Working set per node (default: 4× the LLC, in whole pages).
    pub working_set_bytes: Option<u64>,
    /// Memory backing (default: 2 MiB hugetlb memfd).
    pub backing: Backing,
    /// Laps of the chase.
    pub chase_laps: u32,
    /// Passes of the stream.
    pub stream_passes: u32,
    /// Memory settings.
    pub memory: MemoryOptions,
}

impl HostOnlyArgs {
    /// Defaults: every allowed PU, 5 runs, 4× LLC of 2 MiB hugepages, 1 lap, 16 passes.
    pub fn new(host: HostTopology) -> HostOnlyArgs {
        let mut memory = MemoryOptions::default();
        memory.prefault.progress = Progress::Hidden;
        HostOnlyArgs {
            host,
            one_per_core: false,
            repeat: 5,
            working_set_bytes: None,
            backing: Backing::Hugetlb {
                page_size_bytes: 2 << 20,
                hugetlbfs: None,
            },
            chase_laps: 1,
            stream_passes: 16,
            memory,
        }
    }
}

/// One PU × node of the host matrix.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostEntry {
    /// The PU the thread ran on.
    pub pu: u32,
    /// The node its memory was bound to.
    pub node: u32,
    /// ns per dependent load.
    pub latency_ns: Spread,
    /// GB/s.
    pub bandwidth_gb_per_s: Spread,
}

/// The host's latency/bandwidth matrix.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostReport {
    /// PUs measured (rows).
    pub pus: Vec<u32>,
    /// Nodes (columns).
    pub nodes: Vec<u32>,
    /// Backing page size.
    pub page_size_bytes: u64,
    /// The LLC.
    pub llc_bytes: Option<u64>,
    /// Working set per node.
    pub working_set_bytes: u64,
    /// Runs per number.
    pub repeat: u32,
    /// TSC rate (calibrated against the monotonic clock).
    pub tsc_khz: u32,
    /// Each node's memory policy, read back (first run).
    pub policies: Vec<CellPolicy>,
    /// PU-major.
    pub entries: Vec<HostEntry>,
}

/// A one-cell memory plan of `ws` bytes bound to `node`.
fn node_plan(host: &HostTopology, node: u32, ws: u64, backing: &Backing) -> Plan {
    let prefault_cpus = host
        .node(node)
        .map(|n| {
            n.cpus
                .iter()
                .copied()
                .filter(|c| host.allowed_cpus.contains(c))
                .collect()
        })
        .unwrap_or_default();
    Plan::memory_only(
        format!("bench-host-node{node}"),
        vec![GuestCell {
            cell: 0,
            host_node: Some(node),
            vcpus: Vec::new(),
            memory_bytes: ws,
            prefault_cpus,
            distances: vec![10],
            spans: vec![],
        }],
        backing.clone(),
    )
}

/// The PUs to measure from.
fn pus(args: &HostOnlyArgs) -> Vec<u32> {
    let h = &args.host;
    if !args.one_per_core {
        return h.allowed_cpus.clone();
    }
    let mut out: Vec<u32> = h
        .cores
        .iter()
        .filter_map(|c| c.pus.iter().copied().find(|p| h.allowed_cpus.contains(p)))
        .collect();
    out.sort_unstable();
    out
}

/// Measures every selected PU × every node, `repeat` times.
pub fn host_only(args: &HostOnlyArgs) -> Result<HostReport, BenchError> {
    if args.repeat == 0 {
        return Err(BenchError::NoRepeats);
    }
    let pus = pus(args);
    let nodes: Vec<u32> = args.host.nodes.iter().map(|n| n.os_index).collect();
    if pus.is_empty() || nodes.is_empty() {
        return Err(BenchError::NothingToMeasure);
    }
    let page = args.backing.page_size_bytes();
    let sz = sizes(
        args.working_set_bytes,
        page,
        args.chase_laps,
        args.stream_passes,
    );
    let tsc_khz = calibrate_tsc_khz(Duration::from_millis(100));
    let mut samples: BTreeMap<(u32, u32), Vec<(f64, f64)>> = BTreeMap::new();
    let mut policies = Vec::new();
    for r in 0..args.repeat {
        for &node in &nodes {
            tracing::info!(
                "bench numa --host-only: node{node} run {}/{}",
                r + 1,
                args.repeat
            );
            let what = format!("host-only node{node}");
            let plan = node_plan(&args.host, node, sz.ws, &args.backing);
            let mem = host::allocate(&what, &plan, &args.memory, &sz.bench, 1)?;
            if r == 0 {
                let audit = mem.mem.audit().map_err(|source| BenchError::Audit {
                    scenario: what,
                    side: "host",
                    source,
                })?;
                let mut p = cell_policies(&audit, &[(0, format!("bind:{node}"))]);
                p.iter_mut().for_each(|p| p.cell = node);
                policies.extend(p);
            }
            for &pu in &pus {
                let t = host::run_threads(&mem, &[vec![pu]])?;
                if let Some(c) = t.first().and_then(|t| t.cells.first()) {
                    samples
                        .entry((pu, node))
                        .or_default()
                        .push(host::convert(c, tsc_khz));
                }
            }
        }
    }
    let entries = samples
        .into_iter()
        .map(|((pu, node), v)| HostEntry {
            pu,
            node,
            latency_ns: Spread::of(&v.iter().map(|x| x.0).collect::<Vec<_>>()),
            bandwidth_gb_per_s: Spread::of(&v.iter().map(|x| x.1).collect::<Vec<_>>()),
        })
        .collect();
    Ok(HostReport {
        pus,
        nodes,
        page_size_bytes: page,
        llc_bytes: sz.llc,
        working_set_bytes: sz.ws,
        repeat: args.repeat,
        tsc_khz,
        policies,
        entries,
    })
}

impl Matrices for HostReport {
    fn heading(&self) -> String {
        format!(
            "vmhost bench numa --host-only: {} PUs × {} nodes, working set {}, {} runs (median [min–max])",
            self.pus.len(),
            self.nodes.len(),
            format_bytes(self.working_set_bytes),
            self.repeat
        )
    }

    fn matrices(&self) -> Vec<Matrix> {
        let rows: Vec<String> = self.pus.iter().map(|p| format!("PU{p}")).collect();
        let cols: Vec<String> = self.nodes.iter().map(|n| format!("node{n}")).collect();
        let pick = |f: fn(&HostEntry) -> Spread| -> Vec<Vec<Option<Spread>>> {
            self.pus
                .iter()
                .map(|p| {
                    self.nodes
                        .iter()
                        .map(|n| {
                            self.entries
                                .iter()
                                .find(|e| e.pu == *p && e.node == *n)
                                .map(f)
                        })
                        .collect()
                })
                .collect()
        };
        vec![
            Matrix {
                title: "host: latency (ns)".into(),
                short: "latency".into(),
                rows: rows.clone(),
                cols: cols.clone(),
                values: pick(|e| e.latency_ns),
                decimals: 1,
                better: Better::Lower,
            },
            Matrix {
                title: "host: bandwidth (GB/s)".into(),
                short: "bandwidth".into(),
                rows,
                cols,
                values: pick(|e| e.bandwidth_gb_per_s),
                decimals: 2,
                better: Better::Higher,
            },
        ]
    }
}

impl fmt::Display for HostReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.heading())?;
        writeln!(
            f,
            "memory: {} pages bound to each node; LLC {}; TSC {:.1} MHz; one thread at a time",
            format_bytes(self.page_size_bytes),
            self.llc_bytes
                .map_or_else(|| "unknown".to_string(), format_bytes),
            f64::from(self.tsc_khz) / 1e3
        )?;
        for p in &self.policies {
            writeln!(
                f,
                "  read back: node{} memory numa_maps {} (expected {}) {}",
                p.cell,
                p.numa_maps,
                p.expected,
                if p.matches { "ok" } else { "MISMATCH" }
            )?;
        }
        let m = self.matrices();
        for m in &m {
            f.write_str(&render_side_by_side(&m.title, &[m]))?;
        }
        Ok(())
    }
}
