//! The migration reports: source and target placement side by side (vCPU → PU → node,
//! emulator PUs, cell → node), the target's node topology, memory overhead and CPU set (the
//! fields KubeVirt's migration status shows), the rounds, and the target's residency audit.

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::Value;
use vmhost_memory::Audit;
use vmhost_plan::Plan;

use super::target::Received;

/// What the target reports at the commit point (stderr; stdout keeps the run's report).
#[derive(Serialize)]
pub struct TargetReport<'a> {
    /// The source's plan, as it sent it.
    pub source_plan: &'a Value,
    /// The target's plan.
    pub target_plan: &'a Plan,
    /// The rounds received.
    pub rounds: &'a [Received],
    /// Bytes of guest memory written.
    pub bytes_received: u64,
    /// Seconds from the hello to the commit.
    pub seconds: f64,
    /// The target's residency audit.
    pub audit: &'a Audit,
    /// The guest's TSC rate and how this host keeps it (absent: the source did not say).
    pub tsc: Option<&'a super::target::TscKept>,
}

impl TargetReport<'_> {
    /// The report as text, or one JSON line with `json`.
    pub fn render(&self, json: bool) -> String {
        if json {
            let v = serde_json::json!({ "migration": self });
            return format!("{v}\n");
        }
        let target = serde_json::to_value(self.target_plan).unwrap_or_default();
        let mut s = String::from("vmhost: receive: migration committed; the guest resumes here\n");
        s.push_str(&side_by_side(self.source_plan, &target));
        for r in self.rounds {
            let _ = writeln!(
                s,
                "  round {} cell {}{}: {} KiB",
                r.round,
                r.cell,
                if r.last { " (final, paused)" } else { "" },
                r.bytes >> 10
            );
        }
        if let Some(t) = self.tsc {
            let _ = writeln!(
                s,
                "  TSC: the guest's {} kHz, this host's {} kHz: {}",
                t.guest_khz, t.host_khz, t.how
            );
        }
        let _ = writeln!(
            s,
            "  {} MiB received in {:.3} s; residency audit: {}",
            self.bytes_received >> 20,
            self.seconds,
            if self.audit.is_clean() {
                "every page on its node"
            } else {
                "PAGES OFF THEIR NODE"
            }
        );
        s
    }
}

/// Source and target placement side by side, from the plans' JSON (either may be absent).
pub fn side_by_side(source: &Value, target: &Value) -> String {
    let mut s = String::from("  placement            source               target\n");
    let vcpus = |p: &Value| p["vcpus"].as_array().cloned().unwrap_or_default();
    let (sv, tv) = (vcpus(source), vcpus(target));
    for i in 0..sv.len().max(tv.len()) {
        let pu = |v: &[Value]| {
            v.get(i).map_or("-".to_string(), |x| {
                format!("PU {} node {}", show(&x["host_cpu"]), show(&x["host_node"]))
            })
        };
        let _ = writeln!(s, "  vCPU {i:<15} {:<20} {}", pu(&sv), pu(&tv));
    }
    let emu = |p: &Value| show(&p["emulator"]["host_cpus"]);
    let _ = writeln!(
        s,
        "  emulator PUs         {:<20} {}",
        emu(source),
        emu(target)
    );
    let cells = |p: &Value| p["guest_cells"].as_array().cloned().unwrap_or_default();
    let (sc, tc) = (cells(source), cells(target));
    for i in 0..sc.len().max(tc.len()) {
        let node = |c: &[Value]| {
            c.get(i)
                .map_or("-".into(), |x| format!("node {}", show(&x["host_node"])))
        };
        let _ = writeln!(s, "  cell {i:<15} {:<20} {}", node(&sc), node(&tc));
    }
    let env = |p: &Value, f: &str| show(&p["envelope"][f]);
    let _ = writeln!(
        s,
        "  overhead bytes       {:<20} {}",
        env(source, "overhead_bytes"),
        env(target, "overhead_bytes")
    );
    s
}

fn show(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::Array(a) => a.iter().map(show).collect::<Vec<_>>().join(","),
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}
