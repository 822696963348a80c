//! Helpers shared by the ledger's integration tests: specs, synthetic hosts, a planner closure
//! and child processes that stand in for VMs.
#![allow(dead_code, clippy::unwrap_used)]

use std::process::{Child, Command, Stdio};

use vmhost_config::VmSpec;
use vmhost_ledger::Held;
use vmhost_plan::{plan, Plan, PlanOptions, Rejection};
use vmhost_topology::HostTopology;

/// A VM spec; `extra_cpu` goes into the `[cpu]` table, `memory` is the whole `[memory]` table.
pub fn spec(name: &str, extra_cpu: &str, memory: &str) -> VmSpec {
    let text = format!("name = \"{name}\"\n[cpu]\n{extra_cpu}\n[memory]\n{memory}\n");
    vmhost_config::from_toml_str(&text, "test.toml")
        .unwrap()
        .spec
}

/// A dedicated VM with `vcpus` cores and 64 MiB of anonymous memory.
pub fn dedicated(name: &str, vcpus: u32) -> VmSpec {
    spec(
        name,
        &format!("cores = {vcpus}\ndedicated_cpu_placement = true"),
        "guest = \"64Mi\"",
    )
}

/// A shared (floating) VM with one vCPU.
pub fn shared(name: &str) -> VmSpec {
    spec(name, "cores = 1", "guest = \"64Mi\"")
}

/// A synthetic host (`"package:1 numa:1 core:2 pu:1"`…).
pub fn host(desc: &str) -> HostTopology {
    vmhost_topology::load_synthetic(desc).unwrap()
}

/// The planner closure `vmhost` passes to `admit`.
pub fn planner<'a>(
    spec: &'a VmSpec,
    host: &'a HostTopology,
) -> impl FnOnce(&Held) -> Result<Plan, Rejection> + 'a {
    move |held| {
        let opts = PlanOptions {
            held_cpus: held.cpus.clone(),
            ..PlanOptions::default()
        };
        plan(spec, host, &opts).into_result()
    }
}

/// A child process standing in for a VM; SIGKILLed and reaped on drop.
pub struct Proc(pub Child);

impl Proc {
    pub fn sleep() -> Proc {
        Proc(
            Command::new("sleep")
                .arg("600")
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// SIGKILL without reaping: the process stays a zombie until [`Proc::reap`].
    pub fn kill(&mut self) {
        self.0.kill().unwrap();
        // Wait until the kernel has made it a zombie.
        for _ in 0..500 {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()));
            if stat.map_or(true, |s| {
                s.rsplit(')').next().unwrap().trim().starts_with('Z')
            }) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("process {} did not die", self.pid());
    }

    pub fn reap(&mut self) {
        let _ = self.0.kill();
        self.0.wait().unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.reap();
    }
}
