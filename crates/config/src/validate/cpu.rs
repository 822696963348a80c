//! The CPU rules: the guest topology (as written, or KubeVirt's from the CPU resources), at
//! most [`MAX_VCPUS`] vCPUs, dedicated placement and what needs it (an isolated emulator
//! thread, NUMA passthrough, realtime vCPUs); and the resolved [`CpuSpec`].

use serde::Serialize;

use super::{Checker, Resources};
use crate::spec::{RawCpu, RawRealtime, RawSpec};

/// The most vCPUs a KVM VM may have here (`KVM_CAP_MAX_VCPUS` on current kernels).
pub const MAX_VCPUS: u32 = 1024;

/// The guest CPU topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CpuTopology {
    /// Sockets.
    pub sockets: u32,
    /// Cores per socket.
    pub cores: u32,
    /// Threads per core.
    pub threads: u32,
}

impl CpuTopology {
    /// sockets × cores × threads.
    pub fn vcpus(&self) -> u32 {
        self.sockets * self.cores * self.threads
    }
}

/// Resolved CPU settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CpuSpec {
    /// Guest topology.
    pub topology: CpuTopology,
    /// True when the topology came from `cpu.{sockets,cores,threads}` (KubeVirt then ignores
    /// CPU resources for the vCPU count).
    pub topology_given: bool,
    /// Pin each vCPU to a PU of its own.
    pub dedicated_cpu_placement: bool,
    /// Give the emulator thread a PU of its own.
    pub isolate_emulator_thread: bool,
    /// Mirror host NUMA nodes as guest cells.
    pub numa_passthrough: bool,
    /// CPU model, if given.
    pub model: Option<String>,
    /// The isolated emulator completes the VM's PUs to an even number (a second PU when the
    /// vCPUs are even in number).
    pub emulator_even_parity: bool,
    /// vCPUs that run SCHED_FIFO (`cpu.realtime`), ascending; `None` without realtime.
    pub realtime_vcpus: Option<Vec<u32>>,
}

impl CpuSpec {
    /// PUs of the isolated emulator thread: 0 without isolation, 2 with even parity and an
    /// even number of vCPUs (KubeVirt's rule), else 1.
    pub fn emulator_pus(&self) -> u32 {
        if !self.isolate_emulator_thread {
            0
        } else if self.emulator_even_parity && self.topology.vcpus() % 2 == 0 {
            2
        } else {
            1
        }
    }
}

/// The CPU settings: the guest topology, the placement rules and the realtime vCPUs.
pub(super) fn check_cpu(c: &mut Checker<'_>, raw: &RawSpec, res: &Resources) -> CpuSpec {
    let default = Default::default();
    let cpu = raw.cpu.as_ref().unwrap_or(&default);
    let (topology, topology_given) = guest_topology(c, raw, cpu, res);
    let numa_passthrough = cpu
        .numa
        .as_ref()
        .is_some_and(|n| n.guest_mapping_passthrough);
    check_placement(c, cpu, res, numa_passthrough);
    let realtime_vcpus = cpu
        .realtime
        .as_ref()
        .and_then(|rt| check_realtime(c, cpu, rt, topology.vcpus()));
    CpuSpec {
        topology,
        topology_given,
        dedicated_cpu_placement: cpu.dedicated_cpu_placement,
        isolate_emulator_thread: cpu.isolate_emulator_thread,
        numa_passthrough,
        model: cpu.model.clone(),
        emulator_even_parity: cpu.emulator_thread_complete_to_even_parity,
        realtime_vcpus,
    }
}

/// The guest topology, and whether `cpu.{sockets,cores,threads}` gave it (a factor left out
/// is 1); else KubeVirt's from the CPU resources ([`topology_from_resources`]). At most
/// [`MAX_VCPUS`] vCPUs ([`cap_vcpus`]).
fn guest_topology(
    c: &mut Checker<'_>,
    raw: &RawSpec,
    cpu: &RawCpu,
    res: &Resources,
) -> (CpuTopology, bool) {
    let factors = [cpu.sockets, cpu.cores, cpu.threads].map(|f| f.unwrap_or(0));
    let topology_given = factors.iter().any(|&f| f > 0);
    let topology = if topology_given {
        let [s, co, t] = factors.map(|f| f.max(1));
        CpuTopology {
            sockets: s,
            cores: co,
            threads: t,
        }
    } else {
        topology_from_resources(c, raw, cpu, res)
    };
    (cap_vcpus(c, topology, topology_given), topology_given)
}

/// Without a topology (factors written only as 0 are refused): one socket per CPU of the CPU
/// limit, else of the request, rounded up (one without either).
fn topology_from_resources(
    c: &mut Checker<'_>,
    raw: &RawSpec,
    cpu: &RawCpu,
    res: &Resources,
) -> CpuTopology {
    if raw.cpu.is_some()
        && [cpu.sockets, cpu.cores, cpu.threads]
            .iter()
            .any(Option::is_some)
    {
        c.fail(
            "cpu.sockets",
            0,
            "sockets × cores × threads must be at least 1",
            "set cpu.sockets, cpu.cores and cpu.threads to 1 or more",
        );
    }
    // KubeVirt: the CPU limit, else the request, rounded up; at least 1; as sockets.
    let millis = res
        .limits
        .cpu_millis
        .or(res.requests.cpu_millis)
        .unwrap_or(1000);
    let n = u32::try_from(millis.div_ceil(1000))
        .unwrap_or(u32::MAX)
        .max(1);
    CpuTopology {
        sockets: n,
        cores: 1,
        threads: 1,
    }
}

/// `topology`, or one vCPU in its place when it has more than [`MAX_VCPUS`] (a broken rule).
fn cap_vcpus(c: &mut Checker<'_>, topology: CpuTopology, topology_given: bool) -> CpuTopology {
    let vcpus =
        u64::from(topology.sockets) * u64::from(topology.cores) * u64::from(topology.threads);
    let mut topology = topology;
    if vcpus > u64::from(MAX_VCPUS) {
        c.fail(
            if topology_given {
                "cpu.sockets"
            } else {
                "resources.limits.cpu"
            },
            format!("{vcpus} vCPUs"),
            &format!("a KVM VM holds at most {MAX_VCPUS} vCPUs"),
            "lower cpu.sockets, cpu.cores or cpu.threads",
        );
        topology = CpuTopology {
            sockets: 1,
            cores: 1,
            threads: 1,
        };
    }
    topology
}

/// An isolated emulator thread and NUMA passthrough need dedicated CPU placement, and
/// dedicated placement needs whole CPUs.
fn check_placement(c: &mut Checker<'_>, cpu: &RawCpu, res: &Resources, numa_passthrough: bool) {
    if cpu.isolate_emulator_thread && !cpu.dedicated_cpu_placement {
        c.fail(
            "cpu.isolate_emulator_thread",
            true,
            "an isolated emulator thread needs dedicated CPU placement",
            "set cpu.dedicated_cpu_placement = true, or drop isolate_emulator_thread",
        );
    }
    if numa_passthrough && !cpu.dedicated_cpu_placement {
        c.fail(
            "cpu.numa.guest_mapping_passthrough",
            true,
            "NUMA passthrough needs dedicated CPU placement",
            "set cpu.dedicated_cpu_placement = true",
        );
    }
    if cpu.dedicated_cpu_placement {
        if let Some(m) = res.limits.cpu_millis.or(res.requests.cpu_millis) {
            if m % 1000 != 0 {
                c.fail(
                    "resources.requests.cpu",
                    format!("{m}m"),
                    "dedicated CPU placement needs whole CPUs",
                    "use a whole number of CPUs or drop the CPU request",
                );
            }
        }
    }
}

/// `cpu.realtime`: exclusive vCPU PUs (dedicated placement and an isolated emulator), and a
/// mask of existing vCPUs.
fn check_realtime(
    c: &mut Checker<'_>,
    cpu: &RawCpu,
    rt: &RawRealtime,
    vcpus: u32,
) -> Option<Vec<u32>> {
    if !cpu.dedicated_cpu_placement || !cpu.isolate_emulator_thread {
        c.fail(
            "cpu.realtime",
            "(set)",
            "realtime vCPUs need PUs nothing else runs on: dedicated CPU placement and an isolated emulator thread",
            "set cpu.dedicated_cpu_placement = true and cpu.isolate_emulator_thread = true",
        );
    }
    let Some(mask) = rt.mask.as_deref() else {
        return Some((0..vcpus).collect());
    };
    match crate::vcpumask::parse(mask, vcpus) {
        Ok(list) if !list.is_empty() => Some(list),
        Ok(_) => {
            c.fail(
                "cpu.realtime.mask",
                format!("{mask:?}"),
                "selects no vCPU",
                "name at least one vCPU, e.g. \"0\", or drop the mask for all vCPUs",
            );
            None
        }
        Err(why) => {
            c.fail(
                "cpu.realtime.mask",
                format!("{mask:?}"),
                &why,
                format!(
                    "write a vCPU list within 0-{}, e.g. \"0-1,^1\"",
                    vcpus.saturating_sub(1)
                ),
            );
            None
        }
    }
}
