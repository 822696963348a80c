//! Reading and writing cgroup interface files, with the file and value in every error.
//!
//! cgroup files exist as soon as the kernel creates the directory; writes never create them.
//! Unit tests run against a plain temporary directory standing in for a cgroup2 mount, where
//! nothing creates the files: under `cfg(test)` writes create them (appending, so a test sees
//! every write) and removal deletes them.

use std::io::{self, Write};
use std::path::Path;

use crate::error::CgroupError;

/// Reads a whole cgroup file.
pub(crate) fn read(file: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(file).map_err(|source| CgroupError::Read {
        file: file.to_path_buf(),
        source,
    })
}

/// Reads a cgroup file holding one number (`max` or a value ≥ 2^62 reads as `None`, unlimited).
pub(crate) fn read_limit(file: &Path) -> Result<Option<u64>, CgroupError> {
    let text = read(file)?;
    let t = text.trim();
    if t == "max" {
        return Ok(None);
    }
    let v: u64 = t.parse().map_err(|_| CgroupError::Parse {
        file: file.to_path_buf(),
        content: text.clone(),
        expected: "a number of bytes or `max`",
    })?;
    // v1 writes "unlimited" as PAGE_COUNTER_MAX * PAGE_SIZE (0x7FFFFFFFFFFFF000 on x86_64).
    Ok((v < 1 << 62).then_some(v))
}

/// Writes `value` to a cgroup file in a single `write(2)` (the kernel parses each write whole).
pub(crate) fn write_raw(file: &Path, value: &str) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(cfg!(test))
        .append(cfg!(test))
        .open(file)?;
    f.write_all(value.as_bytes())
}

/// Writes `value` to a cgroup file.
pub(crate) fn write(file: &Path, value: &str) -> Result<(), CgroupError> {
    write_raw(file, value).map_err(|source| CgroupError::Write {
        file: file.to_path_buf(),
        value: value.to_string(),
        source,
    })
}

/// Removes a cgroup directory (`rmdir`: the kernel removes the interface files with it).
pub(crate) fn rmdir(dir: &Path) -> io::Result<()> {
    if cfg!(test) {
        return std::fs::remove_dir_all(dir);
    }
    std::fs::remove_dir(dir)
}

/// The processes listed in a cgroup's `cgroup.procs` (empty when the cgroup is gone).
pub(crate) fn procs(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}
