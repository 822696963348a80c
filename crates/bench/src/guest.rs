//! One run of a scenario's VM: guest memory with the scenario's policy, audited; the
//! `numa-bench` payload on every vCPU; the per vCPU × cell results and the vCPU threads'
//! PUs read back.

use vmhost_memory::policy::normalize_numa_maps_policy;
use vmhost_memory::{Audit, GuestMemory, MemoryOptions};
use vmhost_vcpu::{BenchOptions, PayloadResult, RunReport, RunStatus, Vm, VmOptions};

use crate::report::{CellPolicy, ThreadCpus};
use crate::scenario::ScenarioSetup;
use crate::BenchError;

/// One vCPU × cell measurement of one run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// vCPU index.
    pub vcpu: u32,
    /// Guest cell.
    pub cell: u32,
    /// ns per dependent load.
    pub ns: f64,
    /// GB/s.
    pub gbps: f64,
    /// Dependent loads the vCPU says it chased.
    pub loads: u64,
    /// Bytes it says it streamed.
    pub bytes: u64,
}

/// What one guest run gave.
#[derive(Debug, Clone)]
pub struct GuestRun {
    /// Per vCPU × cell.
    pub samples: Vec<Sample>,
    /// The guest memory's policy per cell, read back.
    pub policies: Vec<CellPolicy>,
    /// The vCPU threads' PUs, read back.
    pub threads: Vec<ThreadCpus>,
    /// KVM's TSC rate.
    pub tsc_khz: u32,
}

/// The per-cell policies of an audit, against the scenario's expectations (an empty or
/// missing expectation: the region's own binding from the plan).
pub fn cell_policies(audit: &Audit, expected: &[(u32, String)]) -> Vec<CellPolicy> {
    audit
        .regions
        .iter()
        .map(|r| {
            // No policy for the cell: its regions are bound per node as the plan says.
            let want = expected
                .iter()
                .find(|(c, p)| *c == r.cell && !p.is_empty())
                .map_or_else(|| r.expected_policy.clone(), |(_, p)| p.clone());
            let nm = r.numa_maps.as_ref();
            let numa_maps =
                nm.map_or_else(|| "(no numa_maps line)".to_string(), |n| n.policy.clone());
            CellPolicy {
                cell: r.cell,
                matches: normalize_numa_maps_policy(&numa_maps) == want
                    && r.policy == want
                    && r.fraction_on_node() == 1.0,
                expected: want,
                numa_maps,
                pages_by_node: nm.map(|n| n.pages_by_node.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

/// Every vCPU's results (`cells` per vCPU, or an error naming the vCPU that has fewer).
fn samples(
    report: &RunReport,
    cells: usize,
    name: &str,
    run: u32,
) -> Result<Vec<Sample>, BenchError> {
    let mut samples = Vec::new();
    for v in &report.vcpus {
        let got = match &v.result {
            PayloadResult::NumaBench(c) => c.as_slice(),
            _ => &[],
        };
        if got.len() != cells {
            return Err(BenchError::MissingResults {
                scenario: name.to_string(),
                run,
                vcpu: v.vcpu,
                expected: cells,
                got: got.len(),
            });
        }
        for c in got {
            samples.push(Sample {
                vcpu: v.vcpu,
                cell: c.cell,
                ns: c.chase_ns,
                gbps: c.stream_gb_per_s,
                loads: c.chase_loads,
                bytes: c.stream_bytes,
            });
        }
    }
    Ok(samples)
}

/// Runs the scenario's VM once (`run` is 1-based, for messages).
pub fn run_once(
    setup: &ScenarioSetup,
    mem_opts: &MemoryOptions,
    bench: &BenchOptions,
    run: u32,
) -> Result<GuestRun, BenchError> {
    let name = setup.scenario.to_string();
    let mut opts = mem_opts.clone();
    opts.policy_override = setup.policy.clone();
    let mem = GuestMemory::new(&setup.plan, &opts).map_err(|source| BenchError::Memory {
        scenario: name.clone(),
        side: "guest",
        source,
    })?;
    let audit = mem.audit().map_err(|source| BenchError::Audit {
        scenario: name.clone(),
        side: "guest",
        source,
    })?;
    let policies = cell_policies(&audit, &setup.expected_policies());
    let vm_err = |source| BenchError::Vm {
        scenario: name.clone(),
        run,
        source: Box::new(source),
    };
    let options = VmOptions {
        bench: *bench,
        ..VmOptions::default()
    };
    let mut vm = Vm::new(&setup.plan, mem, options).map_err(vm_err)?;
    let report = vm.run().map_err(vm_err)?;
    drop(vm);
    if report.status != RunStatus::Completed {
        let failures: Vec<String> = report
            .failures()
            .map(|(v, o)| format!("vCPU {v}: {o}"))
            .collect();
        return Err(BenchError::GuestFailed {
            scenario: name,
            run,
            detail: format!("{:?}; {}", report.status, failures.join("; ")),
        });
    }
    let samples = samples(&report, setup.plan.guest_cells.len(), &name, run)?;
    let expected = setup.thread_cpus();
    let threads = report
        .placements
        .iter()
        .filter_map(|p| {
            let v = p.vcpu_index()?;
            Some(ThreadCpus {
                vcpu: v,
                expected: expected.get(usize::try_from(v).ok()?)?.clone(),
                cpus_allowed: p.cpus_allowed.clone(),
            })
        })
        .collect();
    Ok(GuestRun {
        samples,
        policies,
        threads,
        tsc_khz: report.tsc_khz,
    })
}
