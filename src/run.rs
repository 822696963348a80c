//! `vmhost --config vm.toml`: spec → plan → guest memory → VM → run → report.
//!
//! The main thread becomes the VMM's control thread: it is pinned to the emulator PUs before
//! anything else starts, so every thread it spawns (signal thread, emulator thread) inherits
//! that placement; vCPU threads pin themselves to their own PUs before their vCPU is created.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use serde::Serialize;
use vmhost_memory::{Audit, GuestMemory, MemoryOptions};
use vmhost_plan::Plan;
use vmhost_topology::cpulist;

use crate::timeline::{now_ns, Timeline};
use vmhost_vcpu::{
    pin_current_thread_to_emulator, stop_on_signals, RunReport, StartHook, ThreadPlacement,
    UnknownAccessPolicy, Vm, VmOptions,
};

/// Run-time settings from the command line.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Keep running when the guest touches an unknown port or unmapped memory.
    pub ignore_unknown: bool,
    /// JSON output.
    pub json: bool,
}

/// What `vmhost --json` prints.
#[derive(Debug, Serialize)]
struct RunOutput<'a> {
    plan: &'a Plan,
    audit: &'a Audit,
    start: Vec<ThreadPlacement>,
    timeline: Timeline,
    report: &'a RunReport,
    exit_code: u8,
}

/// Runs the VM of `plan` and returns the process exit status.
pub fn run(
    plan: &Plan,
    admission: &crate::vms::Admission,
    opts: RunOptions,
    mut timeline: Timeline,
) -> Result<u8> {
    pin_current_thread_to_emulator(plan).context("pinning the VMM thread to the emulator PUs")?;
    let memory = GuestMemory::new(plan, &MemoryOptions::default())?;
    admission.running()?;
    timeline.memory_ready_ns = now_ns();
    let audit = memory.audit().context("auditing guest memory residency")?;
    let started: Arc<Mutex<(Vec<ThreadPlacement>, u64)>> = Arc::default();
    let hook = {
        let (plan, audit, started, json) =
            (plan.clone(), audit.clone(), Arc::clone(&started), opts.json);
        StartHook(Arc::new(move |threads: &[ThreadPlacement]| {
            if !json {
                print!("{}", placement_table(&plan, &audit, threads));
            }
            if let Ok(mut s) = started.lock() {
                *s = (threads.to_vec(), now_ns());
            }
        }))
    };
    let options = VmOptions {
        unknown_access: if opts.ignore_unknown {
            UnknownAccessPolicy::Ignore
        } else {
            UnknownAccessPolicy::Stop
        },
        on_start: Some(hook),
        ..Default::default()
    };
    let mut vm = Vm::new(plan, memory, options)?;
    timeline.vm_created_ns = now_ns();
    stop_on_signals(vm.stop_handle()).context("installing the SIGINT/SIGTERM handler")?;
    let report = vm.run()?;
    drop(vm);
    let code = exit_code(&report);
    if opts.json {
        let (start, runnable) = started.lock().map(|s| s.clone()).unwrap_or_default();
        timeline.vcpus_runnable_ns = runnable;
        let out = RunOutput {
            plan,
            audit: &audit,
            start,
            timeline,
            report: &report,
            exit_code: code,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", report.render_text());
    }
    Ok(code)
}

/// Maps a run's outcome to vmhost's exit statuses (the report's own mapping).
fn exit_code(report: &RunReport) -> u8 {
    u8::try_from(report.exit_code()).unwrap_or(1)
}

/// The start-up table: vCPU → thread → PU → node, the other threads, guest cells → residency.
fn placement_table(plan: &Plan, audit: &Audit, threads: &[ThreadPlacement]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "VM {}: placement read back from /proc at start",
        plan.name
    );
    let _ = writeln!(s, "  vCPU  thread id  allowed PUs  planned PU  host node");
    for v in &plan.vcpus {
        let t = threads.iter().find(|t| t.vcpu_index() == Some(v.vcpu));
        let planned = v
            .host_cpu
            .map_or_else(|| "float".to_string(), |c| c.to_string());
        let node = v
            .host_node
            .map_or_else(|| "-".to_string(), |n| n.to_string());
        let (tid, allowed) = t.map_or(("?".to_string(), "?".to_string()), |t| {
            (t.tid.to_string(), t.cpus_allowed_list.clone())
        });
        let _ = writeln!(
            s,
            "  {:>4}  {:>9}  {:>11}  {:>10}  {:>9}",
            v.vcpu, tid, allowed, planned, node
        );
    }
    for t in threads.iter().filter(|t| t.vcpu_index().is_none()) {
        let _ = writeln!(
            s,
            "  thread {:<12} {:>9}  allowed PUs {}",
            t.name, t.tid, t.cpus_allowed_list
        );
    }
    let _ = writeln!(
        s,
        "  emulator PUs (plan): {}{}",
        cpulist::format(&plan.emulator.host_cpus),
        if plan.emulator.isolated {
            " (isolated)"
        } else {
            ""
        }
    );
    let _ = writeln!(s, "  cell  host node  memory     page   residency");
    for c in &plan.guest_cells {
        let regions: Vec<_> = audit.regions.iter().filter(|r| r.cell == c.cell).collect();
        let pages: u64 = regions.iter().map(|r| r.pages).sum();
        let by_node = regions.iter().flat_map(|r| r.pages_by_node.iter()).fold(
            std::collections::BTreeMap::<u32, u64>::new(),
            |mut m, (n, p)| {
                *m.entry(*n).or_default() += p;
                m
            },
        );
        let residency: Vec<String> = by_node
            .iter()
            .map(|(n, p)| {
                format!(
                    "node{n} {:.1}%",
                    100.0 * (*p as f64) / (pages.max(1) as f64)
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "  {:>4}  {:>9}  {:>9}  {:>5}   {}",
            c.cell,
            c.host_node
                .map_or_else(|| "-".to_string(), |n| n.to_string()),
            vmhost_config::format_bytes(c.memory_bytes),
            vmhost_config::format_bytes(plan.backing.page_size_bytes()),
            if residency.is_empty() {
                "not faulted in".to_string()
            } else {
                residency.join(", ")
            }
        );
    }
    for (cell, gpa, v) in audit.violations() {
        let _ = writeln!(s, "  VIOLATION cell {cell} GPA {gpa:#x}: {v}");
    }
    s
}
