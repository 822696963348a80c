//! Reading a VM's cgroup back: the limits the kernel holds (for tests and the control API) and
//! the memory counters (usage, peak, hugepages in use).

use std::path::Path;

use crate::cgroup::{read_list, Cgroup, Dir};
use crate::error::CgroupError;
use crate::fsio;
use crate::hierarchy::Controller;
use crate::limits::{hugetlb_size_name, parse_hugetlb_size_name, Limits};

impl Cgroup {
    /// The limits as the kernel holds them, read from the cgroup files.
    pub fn read_back(&self) -> Result<Limits, CgroupError> {
        let mut l = Limits::default();
        if let Some(d) = self.dir_entry(Controller::Cpuset) {
            l.cpus = read_list(&d.path.join("cpuset.cpus"))?;
            l.mems = read_list(&d.path.join("cpuset.mems"))?;
        }
        if let Some(d) = self.dir_entry(Controller::Memory) {
            let file = if d.v1() {
                "memory.limit_in_bytes"
            } else {
                "memory.max"
            };
            l.memory_max_bytes = fsio::read_limit(&d.path.join(file))?;
        }
        if let Some(d) = self.dir_entry(Controller::Hugetlb) {
            l.hugetlb = read_hugetlb_limits(d)?;
        }
        Ok(l)
    }

    /// Ordinary memory charged to the cgroup now (v1 `memory.usage_in_bytes`, v2
    /// `memory.current`).
    pub fn memory_usage_bytes(&self) -> Result<u64, CgroupError> {
        let d = self.memory_dir()?;
        let file = if d.v1() {
            "memory.usage_in_bytes"
        } else {
            "memory.current"
        };
        read_u64(&d.path.join(file))
    }

    /// True when the memory limit refused a charge at least once: v2 `memory.events` `max` or
    /// `oom` > 0, v1 `memory.failcnt` > 0. A THP-sized charge can be refused well below the
    /// limit, so this is what tells a refused allocation from other failures.
    pub fn memory_limit_hit(&self) -> Result<bool, CgroupError> {
        let d = self.memory_dir()?;
        if d.v1() {
            return read_u64(&d.path.join("memory.failcnt")).map(|n| n > 0);
        }
        let file = d.path.join("memory.events");
        let text = std::fs::read_to_string(&file).map_err(|source| CgroupError::Read {
            file: file.clone(),
            source,
        })?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(' '))
            .any(|(k, v)| {
                matches!(k, "max" | "oom" | "oom_kill")
                    && v.trim().parse::<u64>().is_ok_and(|n| n > 0)
            }))
    }

    /// The highest memory usage since creation (v1 `memory.max_usage_in_bytes`; v2
    /// `memory.peak`, Linux 5.19+); `None` when the kernel does not keep it.
    pub fn memory_peak_bytes(&self) -> Result<Option<u64>, CgroupError> {
        let d = self.memory_dir()?;
        let file = d.path.join(if d.v1() {
            "memory.max_usage_in_bytes"
        } else {
            "memory.peak"
        });
        if !file.exists() {
            return Ok(None);
        }
        read_u64(&file).map(Some)
    }

    /// Hugepage bytes of `page_size_bytes` in use (faulted in) by the cgroup; `None` without
    /// the hugetlb controller.
    pub fn hugetlb_usage_bytes(&self, page_size_bytes: u64) -> Result<Option<u64>, CgroupError> {
        let Some(d) = self.dir_entry(Controller::Hugetlb) else {
            return Ok(None);
        };
        let size = hugetlb_size_name(page_size_bytes);
        let suffix = if d.v1() { "usage_in_bytes" } else { "current" };
        read_u64(&d.path.join(format!("hugetlb.{size}.{suffix}"))).map(Some)
    }

    /// Hugepage bytes of `page_size_bytes` reserved by the cgroup's mappings (charged at
    /// `mmap`); `None` without the hugetlb controller or reservation accounting (< 5.7).
    pub fn hugetlb_reserved_bytes(&self, page_size_bytes: u64) -> Result<Option<u64>, CgroupError> {
        let Some(d) = self.dir_entry(Controller::Hugetlb) else {
            return Ok(None);
        };
        let size = hugetlb_size_name(page_size_bytes);
        let suffix = if d.v1() {
            "rsvd.usage_in_bytes"
        } else {
            "rsvd.current"
        };
        let file = d.path.join(format!("hugetlb.{size}.{suffix}"));
        if !file.exists() {
            return Ok(None);
        }
        read_u64(&file).map(Some)
    }

    fn memory_dir(&self) -> Result<&Dir, CgroupError> {
        self.dir_entry(Controller::Memory)
            .ok_or(CgroupError::ControllerMissing {
                controller: "memory",
                unified: None,
                hint: "this cgroup was created without it",
            })
    }
}

/// Every page size with a limit: `hugetlb.<size>.max` (v2) / `.limit_in_bytes` (v1), not the
/// reservation files.
fn read_hugetlb_limits(d: &Dir) -> Result<Vec<(u64, u64)>, CgroupError> {
    let suffix = if d.v1() { ".limit_in_bytes" } else { ".max" };
    let entries = std::fs::read_dir(&d.path).map_err(|source| CgroupError::Read {
        file: d.path.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(size) = name
            .to_str()
            .and_then(|n| n.strip_prefix("hugetlb."))
            .and_then(|n| n.strip_suffix(suffix))
            .and_then(parse_hugetlb_size_name)
        else {
            continue;
        };
        if let Some(bytes) = fsio::read_limit(&e.path())? {
            out.push((size, bytes));
        }
    }
    out.sort_unstable();
    Ok(out)
}

fn read_u64(file: &Path) -> Result<u64, CgroupError> {
    let text = fsio::read(file)?;
    text.trim().parse().map_err(|_| CgroupError::Parse {
        file: file.to_path_buf(),
        content: text,
        expected: "a number",
    })
}
