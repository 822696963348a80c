//! Where this process's threads may run and where they last ran, read back from `/proc`.
//!
//! This is the audit side of pinning: the vCPU and emulator threads pin themselves with
//! `sched_setaffinity`, and [`thread_placements`] proves it from `/proc/self/task/*/status`
//! (`Cpus_allowed_list`) and `/proc/self/task/*/stat` (field 39, the CPU the thread last ran on).

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;
use vmhost_plan::Plan;

use crate::sys;

/// Why threads could not be read back or pinned.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// A `/proc` file or directory could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A `/proc` file did not have the expected field.
    #[error("{path}: no parsable {field}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The field that was missing or malformed.
        field: &'static str,
    },
    /// The plan gives the emulator thread no PU.
    #[error("the plan gives the emulator thread no host PU")]
    NoEmulatorCpus,
    /// `sched_setaffinity` failed.
    #[error("cannot pin the calling thread to PUs {cpus:?}")]
    Pin {
        /// The PUs.
        cpus: Vec<u32>,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// One thread of this process, as `/proc` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ThreadPlacement {
    /// Kernel thread id.
    pub tid: i32,
    /// Thread name (`comm`, at most 15 bytes): `vcpu<N>`, `vmhost-emu`, ...
    pub name: String,
    /// `Cpus_allowed_list` as the kernel prints it (for example `0-1`).
    pub cpus_allowed_list: String,
    /// The same list, expanded.
    pub cpus_allowed: Vec<u32>,
    /// The CPU the thread last ran on (`stat` field 39).
    pub last_cpu: u32,
}

impl ThreadPlacement {
    /// The vCPU index when the thread is a vCPU thread (`vcpu<N>`).
    pub fn vcpu_index(&self) -> Option<u32> {
        self.name.strip_prefix("vcpu").and_then(|n| n.parse().ok())
    }
}

/// Every thread of this process with its allowed CPUs and the CPU it last ran on, by tid.
pub fn thread_placements() -> Result<Vec<ThreadPlacement>, PlacementError> {
    thread_placements_in(Path::new("/proc/self/task"))
}

fn thread_placements_in(task_dir: &Path) -> Result<Vec<ThreadPlacement>, PlacementError> {
    let read_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PlacementError::Read { path, source }
    };
    let mut out = Vec::new();
    for entry in fs::read_dir(task_dir).map_err(read_err(task_dir))? {
        let entry = entry.map_err(read_err(task_dir))?;
        let Some(tid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let status_path = entry.path().join("status");
        let stat_path = entry.path().join("stat");
        // A thread may exit between readdir and the reads: skip it rather than fail.
        let (Ok(status), Ok(stat)) = (
            fs::read_to_string(&status_path),
            fs::read_to_string(&stat_path),
        ) else {
            continue;
        };
        out.push(parse_thread(tid, &status, &status_path, &stat, &stat_path)?);
    }
    out.sort_by_key(|t| t.tid);
    Ok(out)
}

fn parse_thread(
    tid: i32,
    status: &str,
    status_path: &Path,
    stat: &str,
    stat_path: &Path,
) -> Result<ThreadPlacement, PlacementError> {
    let field = |name: &'static str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
            .map(|v| v.trim().to_string())
            .ok_or(PlacementError::Parse {
                path: status_path.to_path_buf(),
                field: name,
            })
    };
    let name = field("Name")?;
    let cpus_allowed_list = field("Cpus_allowed_list")?;
    let cpus_allowed = parse_cpu_list(&cpus_allowed_list).ok_or(PlacementError::Parse {
        path: status_path.to_path_buf(),
        field: "Cpus_allowed_list",
    })?;
    let last_cpu = parse_last_cpu(stat).ok_or(PlacementError::Parse {
        path: stat_path.to_path_buf(),
        field: "processor (field 39)",
    })?;
    Ok(ThreadPlacement {
        tid,
        name,
        cpus_allowed_list,
        cpus_allowed,
        last_cpu,
    })
}

/// Field 39 of `/proc/.../stat`. The name (field 2) is in parentheses and may hold spaces, so
/// fields are counted after the last `)`: the first field there is field 3.
fn parse_last_cpu(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(39 - 3)?.parse().ok()
}

/// Parses a kernel CPU list (`0-3,8,10-11`).
fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// The kernel thread id of the calling thread (to find it in [`thread_placements`]).
pub fn current_tid() -> i32 {
    sys::gettid()
}

/// Pins the calling thread (the binary's main thread, which becomes part of the emulator side)
/// to the plan's emulator PUs. Threads it spawns afterwards inherit the mask.
pub fn pin_current_thread_to_emulator(plan: &Plan) -> Result<(), PlacementError> {
    let cpus = &plan.emulator.host_cpus;
    if cpus.is_empty() {
        return Err(PlacementError::NoEmulatorCpus);
    }
    sys::pin_current_thread(cpus).map_err(|source| PlacementError::Pin {
        cpus: cpus.clone(),
        source,
    })
}

/// Renders placements as a table: tid, name, allowed CPUs, last CPU.
pub fn render_placements(threads: &[ThreadPlacement]) -> String {
    let mut s = String::from("  tid      thread           allowed    last-cpu\n");
    for t in threads {
        let _ = writeln!(
            s,
            "  {:<8} {:<16} {:<10} {}",
            t.tid, t.name, t.cpus_allowed_list, t.last_cpu
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("1\n"), Some(vec![1]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn last_cpu_is_field_39_even_with_spaces_in_the_name() {
        let mut fields: Vec<String> = (3..=52).map(|i| i.to_string()).collect();
        fields[39 - 3] = "7".into();
        let stat = format!("1234 (a (weird) name) {}", fields.join(" "));
        assert_eq!(parse_last_cpu(&stat), Some(7));
        assert_eq!(parse_last_cpu("1 (x) S 1 2"), None);
    }

    #[test]
    fn this_process_reads_back_with_the_calling_thread_present() {
        let me = sys::gettid();
        let all = thread_placements().unwrap();
        let t = all
            .iter()
            .find(|t| t.tid == me)
            .expect("calling thread listed");
        assert_eq!(t.cpus_allowed, sys::current_affinity().unwrap());
        assert!(t.cpus_allowed.contains(&t.last_cpu) || t.cpus_allowed.is_empty());
        assert!(render_placements(&all).contains(&me.to_string()));
        assert_eq!(
            ThreadPlacement {
                name: "vcpu12".into(),
                ..t.clone()
            }
            .vcpu_index(),
            Some(12)
        );
    }
}
