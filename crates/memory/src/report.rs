//! The `vmhost memory` report: allocate, bind, prefault, audit, release, each step timed.
//!
//! This module owns [`run_report`] and the [`MemoryReport`] it returns, which serializes to
//! JSON and renders as text with `Display`.

use std::fmt;
use std::time::Instant;

use serde::Serialize;
use vmhost_config::format_bytes;
use vmhost_plan::{Backing, Plan};

use crate::{
    Admission, Audit, GuestLayout, GuestMemory, MemoryError, MemoryOptions, PrefaultStats,
};

/// A timed step of setting guest memory up and down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Re-checking the plan against the live host.
    Admission,
    /// Creating and mapping the backing files (hugepages are reserved here).
    Allocate,
    /// `mbind` of every mapping.
    Bind,
    /// Faulting every page in.
    Prefault,
    /// Reading back residency.
    Audit,
    /// Unmapping and closing everything.
    Release,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Admission => "admission",
            Step::Allocate => "allocate",
            Step::Bind => "bind",
            Step::Prefault => "prefault",
            Step::Audit => "audit",
            Step::Release => "release",
        })
    }
}

/// How long a step took.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StepTime {
    /// The step.
    pub step: Step,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// Everything `vmhost memory` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryReport {
    /// VM name.
    pub vm: String,
    /// Guest RAM in bytes.
    pub memory_bytes: u64,
    /// The backing used.
    pub backing: Backing,
    /// Guest-physical layout.
    pub layout: GuestLayout,
    /// Pools the plan was admitted against.
    pub admission: Admission,
    /// What prefaulting did.
    pub prefault: PrefaultStats,
    /// Prefault rate in GiB/s.
    pub prefault_gib_per_s: f64,
    /// Residency audit.
    pub audit: Audit,
    /// True when the audit found no violation.
    pub clean: bool,
    /// Per-step wall-clock times, in order.
    pub timings: Vec<StepTime>,
}

/// Allocates, binds and prefaults the plan's guest memory, audits it, releases it, and
/// reports what happened with the time of each step.
///
/// An audit with violations is still a report (`clean == false`); errors are reserved for
/// steps that could not run.
pub fn run_report(plan: &Plan, opts: &MemoryOptions) -> Result<MemoryReport, MemoryError> {
    let mem = GuestMemory::new(plan, opts)?;
    let mut timings = mem.timings().to_vec();
    let start = Instant::now();
    let audit = mem.audit().map_err(|source| MemoryError::Audit {
        vm: plan.name.clone(),
        source,
    })?;
    timings.push(StepTime {
        step: Step::Audit,
        seconds: start.elapsed().as_secs_f64(),
    });
    let layout = mem.layout().clone();
    let admission = mem.admission().clone();
    let prefault = mem.prefault_stats().clone();
    let start = Instant::now();
    drop(mem);
    timings.push(StepTime {
        step: Step::Release,
        seconds: start.elapsed().as_secs_f64(),
    });
    let memory_bytes = layout.ram_bytes();
    let prefault_secs = timings
        .iter()
        .find(|t| t.step == Step::Prefault)
        .map_or(0.0, |t| t.seconds);
    let prefault_gib_per_s = if prefault_secs > 0.0 {
        memory_bytes as f64 / (1u64 << 30) as f64 / prefault_secs
    } else {
        0.0
    };
    Ok(MemoryReport {
        vm: plan.name.clone(),
        memory_bytes,
        backing: plan.backing.clone(),
        layout,
        admission,
        prefault,
        prefault_gib_per_s,
        clean: audit.is_clean(),
        audit,
        timings,
    })
}

fn node_name(node: Option<u32>) -> String {
    node.map_or_else(|| "any node".to_string(), |n| format!("node{n}"))
}

fn nodes_name(nodes: &[u32]) -> String {
    match nodes {
        [] => "any node".to_string(),
        [n] => format!("node{n}"),
        _ => {
            let list: Vec<String> = nodes.iter().map(u32::to_string).collect();
            format!("nodes {}", list.join(","))
        }
    }
}

fn backing_text(b: &Backing) -> String {
    match b {
        Backing::Hugetlb {
            page_size_bytes,
            hugetlbfs: None,
        } => {
            format!("{} hugepages (memfd)", format_bytes(*page_size_bytes))
        }
        Backing::Hugetlb {
            page_size_bytes,
            hugetlbfs: Some(p),
        } => {
            format!(
                "{} hugepages (hugetlbfs {})",
                format_bytes(*page_size_bytes),
                p.display()
            )
        }
        Backing::Anonymous => "anonymous shared memory (THP requested)".to_string(),
    }
}

impl MemoryReport {
    fn fmt_audit(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "audit: {}",
            if self.clean { "clean" } else { "VIOLATIONS" }
        )?;
        for r in &self.audit.regions {
            let nodes: Vec<String> = r
                .pages_by_node
                .iter()
                .map(|(n, p)| format!("N{n}={p}"))
                .collect();
            writeln!(
                f,
                "  cell {} GPA {:#x}: {} pages of {}, {} -> {:.1}% on {}, policy {}",
                r.cell,
                r.gpa,
                r.pages,
                format_bytes(r.page_size_bytes),
                nodes.join(" "),
                100.0 * r.fraction_on_node(),
                nodes_name(&r.allowed_nodes),
                r.policy
            )?;
            if let Some(nm) = &r.numa_maps {
                let nodes: Vec<String> = nm
                    .pages_by_node
                    .iter()
                    .map(|(n, p)| format!("N{n}={p}"))
                    .collect();
                writeln!(
                    f,
                    "    numa_maps: {}{} {} kernelpagesize {}",
                    nm.policy,
                    if nm.huge { " huge" } else { "" },
                    nodes.join(" "),
                    format_bytes(nm.kernel_page_size_bytes)
                )?;
            }
            for v in &r.violations {
                writeln!(f, "    violation: {v}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "VM {}: {} of guest memory in {}",
            self.vm,
            format_bytes(self.memory_bytes),
            backing_text(&self.backing)
        )?;
        writeln!(f, "layout:")?;
        for r in &self.layout.regions {
            writeln!(
                f,
                "  cell {} on {}: GPA {:#x}..{:#x} ({}, file offset {:#x})",
                r.cell,
                node_name(r.host_node),
                r.gpa,
                r.gpa + r.size_bytes,
                format_bytes(r.size_bytes),
                r.file_offset
            )?;
        }
        writeln!(
            f,
            "  MMIO hole: {:#x}..{:#x}",
            self.layout.mmio_hole_start, self.layout.mmio_hole_end
        )?;
        for p in &self.admission.pools {
            writeln!(
                f,
                "pool {} {}: needed {}, free {}, reserved host-wide {}",
                node_name(p.node),
                format_bytes(p.page_size_bytes),
                p.needed,
                p.free,
                p.reserved
            )?;
        }
        for c in &self.prefault.cells {
            let cpus = if c.cpus.is_empty() {
                "unpinned".to_string()
            } else {
                format!("pinned to CPUs {:?}", c.cpus)
            };
            writeln!(
                f,
                "prefault cell {}: {} worker(s) {}, {}",
                c.cell, c.threads, cpus, self.prefault.method
            )?;
        }
        self.fmt_audit(f)?;
        writeln!(f, "timings:")?;
        for t in &self.timings {
            write!(
                f,
                "  {:<10} {:>10.3} ms",
                t.step.to_string(),
                t.seconds * 1e3
            )?;
            if t.step == Step::Prefault {
                write!(f, "  ({:.2} GiB/s)", self.prefault_gib_per_s)?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::plan;

    #[test]
    fn anonymous_report_is_clean_and_renders() {
        let plan = plan(
            "test",
            &[(Some(0), 4 << 20), (Some(0), 2 << 20)],
            Backing::Anonymous,
        );
        let r = run_report(&plan, &MemoryOptions::default()).unwrap();
        assert!(r.clean, "{r}");
        let steps: Vec<Step> = r.timings.iter().map(|t| t.step).collect();
        assert_eq!(
            steps,
            vec![
                Step::Admission,
                Step::Allocate,
                Step::Bind,
                Step::Prefault,
                Step::Audit,
                Step::Release
            ]
        );
        assert_eq!(r.memory_bytes, 6 << 20);
        let text = r.to_string();
        assert!(
            text.contains("VM test: 6Mi of guest memory in anonymous shared memory"),
            "{text}"
        );
        assert!(
            text.contains("cell 1 on node0: GPA 0x400000..0x600000"),
            "{text}"
        );
        assert!(text.contains("audit: clean"), "{text}");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["timings"][3]["step"], "prefault");
        assert_eq!(json["audit"]["regions"][1]["pages_by_node"]["0"], 512);
    }
}
