//! Device I/O threads: how many there are, which virtio device each serves, and the PUs they
//! run on. KubeVirt's rules (`pkg/virt-launcher/virtwrap/converter/iothreads/iothreads.go`,
//! `storage/disk.go` `assignDiskIOThread`, `vcpu/vcpu.go` `FormatDomainIOThreadPin`):
//!
//! - No policy and no dedicated disk: KubeVirt gives QEMU no IOThread. vmhost has no main
//!   loop that could serve devices, so its devices get one shared thread, as with `shared`.
//! - `shared` (pool limit 1) and `auto` (limit 2 × the CPU request, else the CPU limit, else 1,
//!   rounded up; 1 with dedicated CPUs and an isolated emulator): one thread per disk without
//!   a dedicated thread, cut to `limit − dedicated` (at least 1) when the disks exceed the
//!   limit, plus one thread per `dedicated_io_thread` disk. Disks go round-robin over the
//!   shared threads in spec order; dedicated disks get theirs in order.
//! - `supplementalPool`: `supplemental_pool_thread_count` threads, every disk served by the
//!   pool (QEMU spreads a disk's queues over it; vmhost's virtio-blk has one queue, so disks
//!   go round-robin over the pool).
//! - Devices QEMU serves from its main loop (NICs, entropy) go to the first shared thread;
//!   when KubeVirt's count leaves no shared thread, vmhost adds one for them.
//!
//! Where they run ([`place`]): never on a vCPU's PU. Shared placement: over the floating PUs,
//! like the emulator. Dedicated placement: the supplemental pool on PUs of its own (taken with
//! the vCPUs, before the emulator, as KubeVirt does); otherwise on the isolated emulator's PUs
//! (KubeVirt pins the IOThread to the emulator's PU), or, without an isolated emulator, on the
//! host's PUs that no dedicated VM holds (KubeVirt would pin them to vCPU PUs).

use serde::Serialize;
use vmhost_config::{IoThreadsPolicy, VmSpec};

use crate::devices::{DevicePlan, VirtioKind, VirtioSlot};
use crate::model::Reason;

/// Name prefix of the I/O threads (`vmhost-io-0`, `vmhost-io-1`, …).
pub const IO_THREAD_PREFIX: &str = "vmhost-io-";

/// What an I/O thread is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IoThreadRole {
    /// A shared (`shared`/`auto`) thread: disks round-robin, NICs and entropy.
    Shared,
    /// One `dedicated_io_thread` disk.
    Dedicated,
    /// A thread of the supplemental pool.
    SupplementalPool,
}

/// One device I/O thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IoThreadPlan {
    /// Thread number (0..).
    pub index: u32,
    /// Thread name (`vmhost-io-<index>`).
    pub name: String,
    /// What it is for.
    pub role: IoThreadRole,
    /// The devices it serves: indexes into [`crate::devices::DevicePlan::slots`].
    pub devices: Vec<usize>,
    /// PUs it is pinned to.
    pub host_cpus: Vec<u32>,
    /// True when `host_cpus` are held for this thread alone (the supplemental pool with
    /// dedicated placement).
    pub exclusive: bool,
}

/// KubeVirt's `GetIOThreadsCountType`: (all IOThreads, shared ones); (0, 0) when the VMI has
/// no IOThreads (no policy and no dedicated disk).
pub fn kubevirt_count(spec: &VmSpec) -> (u32, u32) {
    let io = &spec.io_threads;
    if io.policy.is_none() && io.dedicated_disks.is_empty() {
        return (0, 0);
    }
    if io.policy == Some(IoThreadsPolicy::SupplementalPool) {
        return (io.supplemental_pool_thread_count, 0);
    }
    let disks = &spec.devices.disks;
    let dedicated = count(disks.iter().filter(|d| io.is_dedicated(&d.name)).count());
    let mut auto = count(disks.len()).saturating_sub(dedicated);
    let limit = pool_limit(spec);
    if auto + dedicated > limit {
        // "We need at least one shared thread."
        auto = limit.saturating_sub(dedicated).max(1);
    }
    (auto + dedicated, auto)
}

/// KubeVirt's `getThreadPoolLimit`.
fn pool_limit(spec: &VmSpec) -> u32 {
    match spec.io_threads.policy {
        Some(IoThreadsPolicy::Auto) => {
            if spec.cpu.dedicated_cpu_placement && spec.cpu.isolate_emulator_thread {
                return 1;
            }
            let r = &spec.resources;
            // `req.Value()`: whole CPUs, rounded up.
            let cpus = r
                .requests
                .cpu_millis
                .or(r.limits.cpu_millis)
                .map_or(1, |m| count_u64(m.div_ceil(1000)));
            cpus.saturating_mul(2)
        }
        _ => 1,
    }
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn count_u64(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The I/O threads of `spec` with the devices each serves (`slots`, the plan's virtio
/// slots); PUs are left empty for [`place`]. Empty when the VM has no device and no
/// supplemental pool.
pub fn assign(spec: &VmSpec, slots: &[VirtioSlot]) -> Vec<IoThreadPlan> {
    let io = &spec.io_threads;
    let pool = io.policy == Some(IoThreadsPolicy::SupplementalPool);
    let (total, auto) = kubevirt_count(spec);
    let dedicated_disk = |i: usize| {
        !pool
            && spec
                .devices
                .disks
                .get(i)
                .is_some_and(|d| io.is_dedicated(&d.name))
    };
    let needs_shared = slots.iter().any(|s| match s.device {
        VirtioKind::Disk(i) => !dedicated_disk(i),
        _ => true,
    });
    let shared = if auto == 0 && !pool && needs_shared {
        1
    } else if pool {
        total
    } else {
        auto
    };
    let dedicated = if pool { 0 } else { total - auto };
    let role = |i: u32| match () {
        () if i >= shared => IoThreadRole::Dedicated,
        () if pool => IoThreadRole::SupplementalPool,
        () => IoThreadRole::Shared,
    };
    let mut threads: Vec<IoThreadPlan> = (0..shared + dedicated)
        .map(|index| IoThreadPlan {
            index,
            name: format!("{IO_THREAD_PREFIX}{index}"),
            role: role(index),
            devices: Vec::new(),
            host_cpus: Vec::new(),
            exclusive: false,
        })
        .collect();
    let (mut next_shared, mut next_dedicated) = (0usize, shared as usize);
    for (slot, s) in slots.iter().enumerate() {
        let thread = match s.device {
            VirtioKind::Disk(i) if dedicated_disk(i) => {
                next_dedicated += 1;
                next_dedicated - 1
            }
            VirtioKind::Disk(_) => {
                next_shared += 1;
                (next_shared - 1) % (shared.max(1) as usize)
            }
            _ => 0,
        };
        if let Some(t) = threads.get_mut(thread) {
            t.devices.push(slot);
        }
    }
    threads
}

/// The device plan of `spec`: slots, I/O threads and, when the CPUs were placed (`reasons`
/// empty), their PUs. `free`: the host's PUs left after the VM's dedicated ones.
pub(crate) fn device_plan(
    spec: &VmSpec,
    emulator: &crate::EmulatorPlacement,
    io_pool: &[u32],
    free: &crate::placement::FreePus,
    reasons: &mut Vec<Reason>,
    notes: &mut Vec<String>,
) -> DevicePlan {
    let mut devices = DevicePlan::new(spec.devices.clone());
    devices.io_threads = assign(spec, &devices.slots);
    if reasons.is_empty() {
        let spare = free.remaining();
        let pus = &emulator.host_cpus;
        reasons.extend(place(
            spec,
            &mut devices.io_threads,
            pus,
            io_pool,
            &spare,
            notes,
        ));
    }
    devices
}

/// Where the I/O threads run. `vcpu_pus`: the VM's pinned vCPU PUs; `emulator`: the
/// emulator's PUs (the floating PUs with shared placement); `pool_pus`: the supplemental
/// pool's own PUs (dedicated placement); `spare`: the host's PUs no dedicated VM (this one
/// included) holds. A refusal when the threads would have to share a vCPU's PU.
pub fn place(
    spec: &VmSpec,
    threads: &mut [IoThreadPlan],
    emulator: &[u32],
    pool_pus: &[u32],
    spare: &[u32],
    notes: &mut Vec<String>,
) -> Option<Reason> {
    if threads.is_empty() {
        return None;
    }
    let cpu = &spec.cpu;
    if !pool_pus.is_empty() {
        for (t, pu) in threads.iter_mut().zip(pool_pus) {
            t.host_cpus = vec![*pu];
            t.exclusive = true;
        }
        return None;
    }
    let (pus, why) = if !cpu.dedicated_cpu_placement {
        (emulator, "float with the emulator thread")
    } else if cpu.isolate_emulator_thread {
        (emulator, "share the isolated emulator thread's PUs")
    } else {
        (
            spare,
            "run on the PUs no dedicated VM holds: they never share a vCPU's PU (KubeVirt would pin them to vCPU PUs without an isolated emulator)",
        )
    };
    if pus.is_empty() && cpu.dedicated_cpu_placement && !cpu.isolate_emulator_thread {
        return Some(Reason::Cpus {
            needed: 1,
            available: 0,
            detail: format!(
                "{} I/O thread(s) that never run on vCPU PUs, and the emulator thread is not isolated; set cpu.isolate_emulator_thread, io_threads_policy = \"supplementalPool\", or free a PU",
                threads.len()
            ),
        });
    }
    for t in threads.iter_mut() {
        t.host_cpus = pus.to_vec();
    }
    notes.push(format!(
        "{} I/O thread(s) {why}: PUs {}",
        threads.len(),
        vmhost_topology::cpulist::format(pus)
    ));
    None
}

/// What slot `slot` of `d` holds, for people: `disk a`, `interface n`, `rng`.
pub fn device_label(d: &crate::devices::DevicePlan, slot: usize) -> String {
    match d.slots.get(slot).map(|s| s.device) {
        Some(VirtioKind::Disk(i)) => format!(
            "disk {}",
            d.spec.disks.get(i).map_or("?", |x| x.name.as_str())
        ),
        Some(VirtioKind::Net(i)) => format!(
            "interface {}",
            d.spec.interfaces.get(i).map_or("?", |x| x.name.as_str())
        ),
        Some(other) => format!("{other:?}").to_lowercase(),
        None => format!("slot {slot}"),
    }
}

impl IoThreadRole {
    /// The role in words (`shared`, `dedicated`, `supplemental pool`).
    pub fn as_str(self) -> &'static str {
        match self {
            IoThreadRole::Shared => "shared",
            IoThreadRole::Dedicated => "dedicated",
            IoThreadRole::SupplementalPool => "supplemental pool",
        }
    }
}

/// The `vmhost plan` lines: each I/O thread, its PUs and its devices.
pub(crate) fn render(s: &mut String, d: &crate::devices::DevicePlan) {
    use std::fmt::Write as _;
    if d.io_threads.is_empty() {
        return;
    }
    let _ = writeln!(s, "\n  I/O threads:");
    for t in &d.io_threads {
        let devices: Vec<String> = t.devices.iter().map(|&i| device_label(d, i)).collect();
        let role = t.role.as_str();
        let _ = writeln!(
            s,
            "    {:<13} {:<17} PUs {:<10}{} devices: {}",
            t.name,
            role,
            if t.host_cpus.is_empty() {
                "-".to_string()
            } else {
                vmhost_topology::cpulist::format(&t.host_cpus)
            },
            if t.exclusive { " (own)" } else { "" },
            if devices.is_empty() {
                "none".to_string()
            } else {
                devices.join(", ")
            }
        );
    }
}

#[cfg(test)]
#[path = "iothreads_tests.rs"]
mod tests;
