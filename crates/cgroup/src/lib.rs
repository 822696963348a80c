//! vmhost-cgroup: the VM's host envelope, enforced. Each VMM process runs in a cgroup of its
//! own, `vmhost/<name>`, whose limits come from the plan ([`Limits::from_plan`]):
//!
//! - cpuset: the PUs the plan gives the VM (dedicated vCPU PUs and emulator PUs, or the PUs a
//!   shared VM floats over) and the host nodes its guest cells are bound to;
//! - memory: the envelope's memory limit (guest RAM + overhead for anonymous guest RAM, the
//!   overhead alone for hugepage-backed guest RAM, which the hugetlb controller bounds);
//! - hugetlb: count × page size per page size, where the controller exists.
//!
//! [`detect`] finds where each controller lives: cgroup v2 (unified), v1 (one hierarchy per
//! controller) or hybrid (v1 hierarchies plus a cgroup2 mount holding the rest: these hosts,
//! where cpuset and memory are v1 and hugetlb is only on the cgroup2 mount).
//! [`Cgroup::create`] makes the directories, writes the limits, and on drop moves this process
//! back out and removes them (also when creation fails midway). [`Cgroup::oom_watch`] reports
//! a reached memory limit as an [`OomEvent`] whose message tells the user what to raise.
//!
//! Measured on these hosts (Linux 6.18, hybrid: cpuset and memory on v1, hugetlb only on the
//! cgroup2 mount at `/sys/fs/cgroup/unified`), by this crate's tests:
//!
//! - memfd `MFD_HUGETLB` guest RAM is charged to the hugetlb controller twice over: the
//!   reservation (`hugetlb.2MB.rsvd.current`) at `mmap` of a shared mapping, the pages
//!   (`hugetlb.2MB.current`) at first touch, each to the cgroup of the task doing it. The memory
//!   controller sees none of it. With `hugetlb.<size>.rsvd.max` set, a mapping beyond the limit
//!   fails at `mmap` with ENOMEM (no SIGBUS at first touch), so the VMM learns at setup.
//! - On v2 the same holds unless cgroup2 is mounted with `memory_hugetlb_accounting` (6.6+),
//!   which charges hugetlb to memory as well; [`Cgroup::create`] then widens the memory limit by
//!   the hugepages (from the kernel docs: not run here).
//! - A task that joins a v1 cpuset whose `cpuset.cpus` or `cpuset.mems` is empty fails with
//!   ENOSPC; a CPU the host lacks fails with ERANGE, one outside the parent's set with EINVAL.
//! - Memory a process had before joining stays charged to its old cgroup: add the VMM (or have
//!   it add itself) before it allocates guest RAM.
//! - At the v1 limit with the OOM killer disabled, the faulting task waits (state D, killable);
//!   SIGTERM ends it with status SIGTERM; `oom_kill` stays 0.
//!
//! Not run: the v2 cpuset and memory controllers (no such host here). That path is tested
//! against a fake directory tree (which files get which values, where controllers are enabled),
//! not against the kernel.
//!
//! The cpuset holds only the plan's PUs: threads the VMM pins elsewhere (e.g. prefault workers
//! on other PUs of a node) are confined to the intersection, and pinning to PUs wholly outside
//! fails with EINVAL.
#![warn(missing_docs)]

mod cgroup;
mod error;
mod fsio;
mod hierarchy;
mod limits;
mod oom;
mod readback;
mod sys;
#[cfg(test)]
mod testutil;
#[cfg(test)]
mod v2_tests;

pub use cgroup::{validate_name, Cgroup, PARENT};
pub use error::CgroupError;
pub use hierarchy::{detect, CgroupVersion, Controller, ControllerMount, Hierarchy, Layout};
pub use limits::{hugetlb_size_name, Limits, PAGE_BYTES};
pub use oom::{OomEvent, OomWait, OomWatch};
