//! The device I/O threads in the live placement views: each planned `vmhost-io-<n>` thread
//! next to what `/proc` shows for it (tid, allowed PUs, last PU), with deviations flagged.

use serde_json::{json, Value};
use vmhost_plan::iothreads::{device_label, IoThreadPlan, IO_THREAD_PREFIX};
use vmhost_plan::Plan;
use vmhost_topology::cpulist;
use vmhost_vcpu::ThreadPlacement;

/// Whether `t` is a device I/O thread.
pub fn is_io_thread(t: &ThreadPlacement) -> bool {
    t.name.starts_with(IO_THREAD_PREFIX)
}

/// Whether the plan's devices (and so their I/O threads) are attached: Linux guests only.
fn attached(plan: &Plan) -> bool {
    !matches!(plan.boot, vmhost_config::BootSpec::Payload { .. })
}

/// What is wrong with the live thread of `planned`, if anything.
fn deviation(
    plan: &Plan,
    planned: &IoThreadPlan,
    live: Option<&ThreadPlacement>,
) -> Option<String> {
    let Some(t) = live else {
        return attached(plan).then(|| "no thread".to_string());
    };
    let vcpu_pus: Vec<u32> = plan.vcpus.iter().filter_map(|v| v.host_cpu).collect();
    let on_vcpus: Vec<u32> = t
        .cpus_allowed
        .iter()
        .copied()
        .filter(|c| vcpu_pus.contains(c))
        .collect();
    if !on_vcpus.is_empty() {
        return Some(format!("allowed on vCPU PUs {on_vcpus:?}"));
    }
    (t.cpus_allowed != planned.host_cpus).then(|| {
        format!(
            "allowed on {:?}, the plan says {:?}",
            t.cpus_allowed, planned.host_cpus
        )
    })
}

/// `GET /vm/placement`'s `io_threads`: one entry per planned I/O thread.
pub fn io_threads_view(plan: &Plan, threads: &[ThreadPlacement]) -> Vec<Value> {
    plan.devices
        .io_threads
        .iter()
        .map(|p| {
            let live = threads.iter().find(|t| t.name == p.name);
            let devices: Vec<String> = p
                .devices
                .iter()
                .map(|&i| device_label(&plan.devices, i))
                .collect();
            json!({
                "name": p.name,
                "role": p.role.as_str(),
                "devices": devices,
                "planned_cpus": p.host_cpus,
                "exclusive": p.exclusive,
                "started": live.is_some(),
                "thread": live.map(|t| json!({
                    "tid": t.tid, "cpus_allowed": t.cpus_allowed, "last_cpu": t.last_cpu,
                })),
                "deviation": deviation(plan, p, live),
            })
        })
        .collect()
}

/// The start table's suffix for an I/O thread: its planned PUs and devices.
pub fn planned_suffix(plan: &Plan, t: &ThreadPlacement) -> Option<String> {
    let p = plan.devices.io_threads.iter().find(|p| p.name == t.name)?;
    let devices: Vec<String> = p
        .devices
        .iter()
        .map(|&i| device_label(&plan.devices, i))
        .collect();
    Some(format!(
        "  planned PUs {} ({}: {})",
        cpulist::format(&p.host_cpus),
        p.role.as_str(),
        devices.join(", ")
    ))
}
