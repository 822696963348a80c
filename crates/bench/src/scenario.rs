//! The placement scenarios compared in one run, and the plans they run: copies of the VM's
//! plan with the vCPU pinning or the memory policy changed, or the reason a scenario cannot
//! run on this host.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;
use vmhost_config::{BootSpec, Payload};
use vmhost_memory::PolicyOverride;
use vmhost_plan::Plan;
use vmhost_topology::HostTopology;

/// A placement scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scenario {
    /// The plan: vCPUs on their dedicated PUs, memory bound to each cell's node.
    Pinned,
    /// The same memory, vCPU threads unpinned (floating over every allowed PU).
    Floating,
    /// vCPUs pinned, memory bound to another node than the one holding them.
    Remote,
    /// vCPUs pinned, memory interleaved (`MPOL_INTERLEAVE`) across every host node.
    Interleave,
}

impl Scenario {
    /// Every scenario, in report order.
    pub const ALL: [Scenario; 4] = [
        Scenario::Pinned,
        Scenario::Floating,
        Scenario::Remote,
        Scenario::Interleave,
    ];

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Pinned => "pinned",
            Scenario::Floating => "floating",
            Scenario::Remote => "remote",
            Scenario::Interleave => "interleave",
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not a scenario.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown scenario {0:?} (scenarios: pinned, floating, remote, interleave)")]
pub struct UnknownScenario(pub String);

impl FromStr for Scenario {
    type Err = UnknownScenario;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scenario::ALL
            .into_iter()
            .find(|sc| sc.name() == s.trim())
            .ok_or_else(|| UnknownScenario(s.to_string()))
    }
}

/// A scenario ready to run: its plan and memory policy.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioSetup {
    /// Which scenario.
    pub scenario: Scenario,
    /// The plan the VM (and the host baseline) runs with.
    pub plan: Plan,
    /// The memory policy used instead of binding each cell to its node.
    pub policy: Option<PolicyOverride>,
    /// What the scenario changes, in words.
    pub description: String,
}

impl ScenarioSetup {
    /// The PUs each vCPU thread (and its host-baseline twin) may run on, by vCPU index.
    pub fn thread_cpus(&self) -> Vec<Vec<u32>> {
        self.plan
            .vcpus
            .iter()
            .map(|v| {
                v.host_cpu
                    .map_or_else(|| self.plan.floating_cpus.clone(), |c| vec![c])
            })
            .collect()
    }

    /// The memory policy each cell should show in `numa_maps`, by cell (policy-string form;
    /// empty for a cell bound per part, whose regions each show their own node).
    pub fn expected_policies(&self) -> Vec<(u32, String)> {
        self.plan
            .guest_cells
            .iter()
            .map(|c| {
                let p = match (&self.policy, c.host_node) {
                    (Some(p), _) => p.policy_string(),
                    (None, Some(n)) => format!("bind:{n}"),
                    // Bound per part (`spans`): each region's own binding, from the audit.
                    (None, None) => String::new(),
                };
                (c.cell, p)
            })
            .collect()
    }
}

/// Copies `plan` for a scenario run: its own name (memfd names) and the `numa-bench` payload.
fn base(plan: &Plan, scenario: Scenario) -> Plan {
    let mut p = plan.clone();
    p.name = format!("{}-{scenario}", plan.name);
    p.boot = BootSpec::Payload {
        payload: Payload::NumaBench,
    };
    p
}

fn needs_nodes(host: &HostTopology) -> Result<(), String> {
    match host.nodes.len() {
        n if n >= 2 => Ok(()),
        n => Err(format!("needs ≥ 2 NUMA nodes, host has {n}")),
    }
}

/// The setup of `scenario` for `plan` on `host`, or why it is skipped.
pub fn setup(
    scenario: Scenario,
    plan: &Plan,
    host: &HostTopology,
) -> Result<ScenarioSetup, String> {
    let mut p = base(plan, scenario);
    let (policy, description) = match scenario {
        Scenario::Pinned => {
            if p.vcpus.iter().any(|v| v.host_cpu.is_none()) {
                return Err(
                    "the plan does not pin vCPUs (set cpu.dedicated_cpu_placement = true)".into(),
                );
            }
            (
                None,
                "vCPUs on their planned PUs, memory bound to each cell's node".to_string(),
            )
        }
        Scenario::Floating => {
            for v in &mut p.vcpus {
                v.host_cpu = None;
                v.host_node = None;
            }
            p.floating_cpus = host.allowed_cpus.clone();
            let cpus = vmhost_topology::cpulist::format(&p.floating_cpus);
            (None, format!("vCPU threads unpinned (float over PUs {cpus}), memory bound to each cell's node"))
        }
        Scenario::Remote => {
            needs_nodes(host)?;
            move_cells_remote(&mut p, host)?;
            (
                None,
                "vCPUs on their planned PUs, memory bound to another node (the farthest)"
                    .to_string(),
            )
        }
        Scenario::Interleave => {
            needs_nodes(host)?;
            let nodes: Vec<u32> = host.nodes.iter().map(|n| n.os_index).collect();
            return Ok(interleave_setup(plan, nodes));
        }
    };
    Ok(ScenarioSetup {
        scenario,
        plan: p,
        policy,
        description,
    })
}

/// The `interleave` setup over `nodes` (the scenario uses every host node; a single node
/// works too, which is how it is tested on one-node hosts).
pub fn interleave_setup(plan: &Plan, nodes: Vec<u32>) -> ScenarioSetup {
    let policy = PolicyOverride::Interleave(nodes);
    let description = format!(
        "vCPUs on their planned PUs, memory interleaved page by page ({})",
        policy.policy_string()
    );
    ScenarioSetup {
        scenario: Scenario::Interleave,
        plan: base(plan, Scenario::Interleave),
        policy: Some(policy),
        description,
    }
}

/// Binds every cell to the node farthest from its own (ties: the lowest index).
fn move_cells_remote(p: &mut Plan, host: &HostTopology) -> Result<(), String> {
    for c in &mut p.guest_cells {
        let Some(home) = c.host_node else {
            return Err(format!("guest cell {} is not bound to a host node", c.cell));
        };
        let far = host
            .nodes
            .iter()
            .filter(|n| n.os_index != home)
            .max_by_key(|n| {
                (
                    host.distance(home, n.os_index),
                    std::cmp::Reverse(n.os_index),
                )
            })
            .ok_or_else(|| format!("no other node than node{home}"))?;
        c.host_node = Some(far.os_index);
        c.prefault_cpus = far
            .cpus
            .iter()
            .copied()
            .filter(|x| host.allowed_cpus.contains(x))
            .collect();
    }
    p.refresh_memory_demand();
    Ok(())
}

/// The plan the host baseline allocates for a setup: the same cells, nodes, backing and
/// policy, each cell `ws` bytes (the working set only). A cell bound per node (`spans`) keeps
/// the node of its largest part, where the guest's working set lies (`payload::bench` runs in
/// the cell's largest region).
pub fn baseline_plan(setup: &ScenarioSetup, ws: u64) -> Plan {
    let mut p = setup.plan.clone();
    p.name = format!("{}-host", setup.plan.name);
    for c in &mut p.guest_cells {
        c.memory_bytes = ws;
        if let Some(largest) = c.spans.iter().max_by_key(|s| s.memory_bytes).cloned() {
            c.host_node = Some(largest.host_node);
            c.prefault_cpus = largest.prefault_cpus;
            c.spans.clear();
        }
    }
    p.refresh_memory_demand();
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_plan::{plan, PlanOptions};
    use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg};

    fn two_node_plan() -> (Plan, HostTopology) {
        let spec = vmhost_config::from_toml_str(
            "name = \"b\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\n\
             [memory]\nguest = \"256Mi\"\nhugepages = { page_size = \"2Mi\" }\n\
             [boot]\npayload = \"numa-bench\"\n",
            "b.toml",
        )
        .unwrap()
        .spec;
        let mut host = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
        apply_hugepages(
            &mut host,
            &parse_hugepages_arg("node0:2Mi=512,node1:2Mi=512").unwrap(),
        )
        .unwrap();
        let plan = plan(&spec, &host, &PlanOptions::default())
            .into_result()
            .unwrap();
        (plan, host)
    }

    /// Broke in the emulated 2-node host: the baseline of a cell whose memory spans nodes
    /// kept the full per-node parts while the cell shrank to the working set, so the memory
    /// crate refused it ("its per-node parts hold … bytes, the cell …").
    #[test]
    fn baseline_of_a_spanning_cell_is_the_largest_part_s_node() {
        let spec = vmhost_config::from_toml_str(
            "name = \"s\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\n\
             [memory]\nguest = \"256Mi\"\nhugepages = { page_size = \"2Mi\" }\n\
             [boot]\npayload = \"numa-bench\"\n",
            "s.toml",
        )
        .unwrap()
        .spec;
        let mut host = load_synthetic("package:2 numa:1 core:4 pu:2").unwrap();
        let pools = parse_hugepages_arg("node0:2Mi=80,node1:2Mi=48").unwrap();
        apply_hugepages(&mut host, &pools).unwrap();
        let plan = plan(&spec, &host, &PlanOptions::default())
            .into_result()
            .unwrap();
        assert_eq!(plan.guest_cells[0].spans.len(), 2, "{:?}", plan.guest_cells);
        let pinned = setup(Scenario::Pinned, &plan, &host).unwrap();
        let base = baseline_plan(&pinned, 16 << 20);
        let cell = &base.guest_cells[0];
        assert!(cell.spans.is_empty());
        assert_eq!(
            cell.host_node,
            Some(0),
            "node0 holds the larger part (160Mi)"
        );
        assert_eq!(cell.memory_bytes, 16 << 20);
        assert_eq!(
            base.envelope.hugepages.iter().map(|h| h.count).sum::<u64>(),
            8
        );
        assert_eq!(pinned.expected_policies(), vec![(0, String::new())]);
    }

    #[test]
    fn scenario_names_round_trip() {
        for s in Scenario::ALL {
            assert_eq!(s.name().parse::<Scenario>().unwrap(), s);
        }
        let err = "numa".parse::<Scenario>().unwrap_err();
        assert!(err.to_string().contains("pinned, floating"), "{err}");
    }

    #[test]
    fn pinned_is_the_plan_and_floating_unpins() {
        let (plan, host) = two_node_plan();
        let pinned = setup(Scenario::Pinned, &plan, &host).unwrap();
        assert_eq!(pinned.plan.vcpus, plan.vcpus);
        assert_eq!(pinned.policy, None);
        assert_eq!(pinned.expected_policies(), vec![(0, "bind:0".to_string())]);
        let planned: Vec<Vec<u32>> = plan
            .vcpus
            .iter()
            .map(|v| vec![v.host_cpu.unwrap()])
            .collect();
        assert_eq!(pinned.thread_cpus(), planned);
        let floating = setup(Scenario::Floating, &plan, &host).unwrap();
        assert!(floating.plan.vcpus.iter().all(|v| v.host_cpu.is_none()));
        assert_eq!(floating.plan.floating_cpus, host.allowed_cpus);
        assert_eq!(floating.plan.guest_cells, plan.guest_cells);
        assert_eq!(floating.thread_cpus()[1], host.allowed_cpus);
        assert_eq!(floating.plan.name, "b-floating");
    }

    #[test]
    fn remote_binds_memory_to_the_other_node() {
        let (plan, host) = two_node_plan();
        let remote = setup(Scenario::Remote, &plan, &host).unwrap();
        assert_eq!(remote.plan.guest_cells[0].host_node, Some(1));
        assert_eq!(remote.plan.guest_cells[0].prefault_cpus, host.nodes[1].cpus);
        assert_eq!(remote.plan.vcpus, plan.vcpus, "vCPUs stay on node0");
        assert_eq!(remote.expected_policies(), vec![(0, "bind:1".to_string())]);
        assert_eq!(remote.plan.envelope.hugepages[0].node, Some(1));
        assert_eq!(remote.plan.envelope.hugepages[0].count, 128);
    }

    #[test]
    fn interleave_spans_every_node() {
        let (plan, host) = two_node_plan();
        let s = setup(Scenario::Interleave, &plan, &host).unwrap();
        assert_eq!(s.policy, Some(PolicyOverride::Interleave(vec![0, 1])));
        assert_eq!(
            s.expected_policies(),
            vec![(0, "interleave:0,1".to_string())]
        );
        assert_eq!(s.plan.vcpus, plan.vcpus);
    }

    #[test]
    fn one_node_hosts_skip_remote_and_interleave_with_the_reason() {
        let (plan, _) = two_node_plan();
        let host = load_synthetic("package:1 numa:1 core:2 pu:1").unwrap();
        for s in [Scenario::Remote, Scenario::Interleave] {
            assert_eq!(
                setup(s, &plan, &host).unwrap_err(),
                "needs ≥ 2 NUMA nodes, host has 1"
            );
        }
    }

    #[test]
    fn unpinned_plans_skip_pinned() {
        let (mut plan, host) = two_node_plan();
        plan.vcpus[0].host_cpu = None;
        let err = setup(Scenario::Pinned, &plan, &host).unwrap_err();
        assert!(err.contains("dedicated_cpu_placement"), "{err}");
    }

    #[test]
    fn baseline_takes_the_working_set_per_cell() {
        let (plan, host) = two_node_plan();
        let s = setup(Scenario::Remote, &plan, &host).unwrap();
        let b = baseline_plan(&s, 64 << 20);
        assert_eq!(b.guest_cells[0].memory_bytes, 64 << 20);
        assert_eq!(b.guest_cells[0].host_node, Some(1));
        assert_eq!(b.envelope.hugepages[0].count, 32);
        assert_eq!(b.name, "b-remote-host");
    }
}
