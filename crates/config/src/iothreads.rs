//! Device I/O threads: `io_threads_policy`, `io_threads.supplemental_pool_thread_count` and
//! `devices.disks[].dedicated_io_thread` ([`RawSpec`] → [`IoThreadsSpec`]).
//!
//! KubeVirt's admission rules (`vmi-create-admitter.go` `validateIOThreadsPolicy`,
//! `storage/admitters/disks.go`): the policy is one of `shared`, `auto`, `supplementalPool`;
//! `supplementalPool` needs a thread count of at least 1; a dedicated I/O thread needs a
//! virtio disk. How many threads that gives, and where they run, is the planner's business.

use serde::Serialize;

use crate::spec::RawSpec;
use crate::validate::Checker;
use crate::MAX_VCPUS;

/// KubeVirt's `spec.domain.ioThreadsPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum IoThreadsPolicy {
    /// One shared I/O thread, plus one per dedicated disk.
    Shared,
    /// A pool sized by the vCPUs (2 per requested CPU; 1 with an isolated emulator thread),
    /// plus one per dedicated disk.
    Auto,
    /// `io_threads.supplemental_pool_thread_count` threads that serve every disk; with
    /// dedicated placement each gets a PU of its own.
    SupplementalPool,
}

impl IoThreadsPolicy {
    /// The spec's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            IoThreadsPolicy::Shared => "shared",
            IoThreadsPolicy::Auto => "auto",
            IoThreadsPolicy::SupplementalPool => "supplementalPool",
        }
    }
}

/// The I/O thread settings, resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct IoThreadsSpec {
    /// The policy as written (`None`: absent, KubeVirt's "no IOThreads" unless a disk asks for
    /// a dedicated one).
    pub policy: Option<IoThreadsPolicy>,
    /// Threads of the supplemental pool (0 unless the policy is `supplementalPool`).
    pub supplemental_pool_thread_count: u32,
    /// Names of the disks with `dedicated_io_thread = true`, in spec order.
    pub dedicated_disks: Vec<String>,
}

impl IoThreadsSpec {
    /// PUs the supplemental pool adds to a dedicated VM (KubeVirt adds
    /// `supplementalPoolThreadCount` to the CPU requests and limits).
    pub fn supplemental_pus(&self) -> u32 {
        self.supplemental_pool_thread_count
    }

    /// Whether the disk `name` has an I/O thread of its own.
    pub fn is_dedicated(&self, name: &str) -> bool {
        self.dedicated_disks.iter().any(|d| d == name)
    }
}

impl crate::VmSpec {
    /// PUs the supplemental I/O thread pool holds: `supplemental_pool_thread_count` with
    /// dedicated placement (KubeVirt adds them to the dedicated CPU requests and pins each
    /// pool thread to a PU of its own), else 0.
    pub fn io_pus(&self) -> u32 {
        if self.cpu.dedicated_cpu_placement {
            self.io_threads.supplemental_pus()
        } else {
            0
        }
    }

    /// PUs of the isolated emulator thread: 0 without isolation; 2 with even parity when the
    /// vCPUs plus the supplemental pool's PUs are even in number (KubeVirt pins the pool
    /// before the emulator, so its PUs count towards the parity); else 1.
    pub fn emulator_pus(&self) -> u32 {
        let cpu = &self.cpu;
        if !cpu.isolate_emulator_thread {
            0
        } else if cpu.emulator_even_parity && (cpu.topology.vcpus() + self.io_pus()) % 2 == 0 {
            2
        } else {
            1
        }
    }
}

/// Checks and resolves the I/O thread settings of `raw`.
pub(crate) fn check_io_threads(c: &mut Checker<'_>, raw: &RawSpec) -> IoThreadsSpec {
    let policy = match raw.io_threads_policy.as_deref() {
        None => None,
        Some("shared") => Some(IoThreadsPolicy::Shared),
        Some("auto") => Some(IoThreadsPolicy::Auto),
        Some("supplementalPool") => Some(IoThreadsPolicy::SupplementalPool),
        Some(other) => {
            c.fail(
                "io_threads_policy",
                format!("{other:?}"),
                "is not an I/O thread policy",
                "use \"shared\", \"auto\" or \"supplementalPool\" (KubeVirt's spelling)",
            );
            None
        }
    };
    let count = raw
        .io_threads
        .as_ref()
        .and_then(|t| t.supplemental_pool_thread_count);
    let field = "io_threads.supplemental_pool_thread_count";
    let supplemental = policy == Some(IoThreadsPolicy::SupplementalPool);
    match count {
        None if supplemental => c.fail(
            field,
            "(absent)",
            "the supplementalPool policy needs the number of its threads",
            "set io_threads.supplemental_pool_thread_count to 1 or more",
        ),
        Some(0) if supplemental => c.fail(
            field,
            0,
            "the supplementalPool policy needs at least one thread",
            "set it to 1 or more",
        ),
        Some(n) if supplemental && n > MAX_VCPUS => c.fail(
            field,
            n,
            &format!("is more than {MAX_VCPUS} threads"),
            "use fewer threads; each takes a PU with dedicated placement",
        ),
        Some(n) if !supplemental => c.fail(
            field,
            n,
            "applies only to the supplementalPool policy (KubeVirt would reserve CPUs for threads that do not exist)",
            "set io_threads_policy = \"supplementalPool\" or remove the count",
        ),
        _ => {}
    }
    let mut dedicated_disks = Vec::new();
    for (i, disk) in raw.devices.disks.iter().enumerate() {
        if !disk.dedicated_io_thread {
            continue;
        }
        let bus = disk.bus.as_deref().unwrap_or("virtio");
        if bus != "virtio" {
            c.fail(
                &format!("devices.disks[{i}].dedicated_io_thread"),
                true,
                &format!("IOThreads are not supported for disks on a {bus} bus (KubeVirt's rule)"),
                "remove dedicated_io_thread or use bus = \"virtio\"",
            );
        }
        dedicated_disks.push(disk.name.clone());
    }
    IoThreadsSpec {
        policy,
        supplemental_pool_thread_count: if supplemental { count.unwrap_or(0) } else { 0 },
        dedicated_disks,
    }
}

#[cfg(test)]
#[path = "iothreads_tests.rs"]
mod tests;
