//! One VM's cgroup: `vmhost/<name>` under every hierarchy its limits need, filled with the
//! limits before any process joins, removed when dropped (also when creation fails midway).
//!
//! The `vmhost` parent is shared by all VMs of the host and stays in place (like libvirt's
//! `machine.slice`): removing it would race with another VM creating its own child.

use std::path::{Path, PathBuf};
use std::time::Duration;

use vmhost_topology::cpulist;

use crate::error::CgroupError;
use crate::fsio;
use crate::hierarchy::{detect, CgroupVersion, Controller, ControllerMount, Hierarchy};
use crate::limits::{hugetlb_size_name, Limits};

/// The cgroup all VMs' cgroups live under, in every hierarchy.
pub const PARENT: &str = "vmhost";

/// How long removal retries while the kernel still counts exiting tasks.
const REMOVE_RETRY: Duration = Duration::from_millis(1000);

/// One directory of the VM's cgroup: its leaf in one hierarchy.
#[derive(Debug, Clone)]
pub(crate) struct Dir {
    pub(crate) mount: ControllerMount,
    pub(crate) controllers: Vec<Controller>,
    pub(crate) path: PathBuf,
}

impl Dir {
    pub(crate) fn v1(&self) -> bool {
        self.mount.version == CgroupVersion::V1
    }
}

/// A VM's cgroup (RAII): created with its limits, removed on drop.
#[derive(Debug)]
pub struct Cgroup {
    name: String,
    hierarchy: Hierarchy,
    pub(crate) dirs: Vec<Dir>,
    limits: Limits,
    notes: Vec<String>,
    /// Where this process was, per entry of `dirs`, before [`Cgroup::add_self`].
    self_origin: Vec<PathBuf>,
    removed: bool,
}

impl Cgroup {
    /// Creates `vmhost/<name>` in the host's hierarchies ([`detect`]) with `limits`.
    pub fn create(name: &str, limits: &Limits) -> Result<Cgroup, CgroupError> {
        Cgroup::create_in(&detect()?, name, limits)
    }

    /// Creates `vmhost/<name>` under the hierarchies of `hierarchy` with `limits`.
    ///
    /// cpuset and memory are required; hugetlb is used when the limits hold hugepages and the
    /// controller exists (otherwise [`Cgroup::notes`] says it is not enforced). A leftover
    /// cgroup of the same name without processes (a VMM that was killed) is replaced; one with
    /// processes is an error. On error everything created so far is removed.
    pub fn create_in(
        hierarchy: &Hierarchy,
        name: &str,
        limits: &Limits,
    ) -> Result<Cgroup, CgroupError> {
        validate_name(name)?;
        let mut cg = Cgroup {
            name: name.to_string(),
            hierarchy: hierarchy.clone(),
            dirs: Vec::new(),
            limits: limits.clone(),
            notes: Vec::new(),
            self_origin: Vec::new(),
            removed: false,
        };
        let mut wanted = vec![Controller::Cpuset, Controller::Memory];
        if !limits.hugetlb.is_empty() {
            if hierarchy.controller(Controller::Hugetlb).is_ok() {
                wanted.push(Controller::Hugetlb);
            } else {
                cg.notes.push("the hugetlb cgroup controller is not available: hugepages are bounded by the pool only".into());
                cg.limits.hugetlb.clear();
            }
        }
        if hierarchy.hugetlb_charged_to_memory() {
            let huge: u64 = cg.limits.hugetlb.iter().map(|(_, b)| b).sum();
            if let Some(m) = cg.limits.memory_max_bytes.as_mut() {
                *m += huge;
                cg.notes.push(format!("cgroup2 is mounted with memory_hugetlb_accounting: the memory limit includes the {huge} bytes of hugepages"));
            }
        }
        // One directory per hierarchy, in the order of first use (cpuset first).
        let mut plan: Vec<(ControllerMount, Vec<Controller>)> = Vec::new();
        for c in wanted {
            let m = hierarchy.controller(c)?;
            match plan.iter_mut().find(|(pm, _)| pm.mount == m.mount) {
                Some((_, cs)) => cs.push(c),
                None => plan.push((m.clone(), vec![c])),
            }
        }
        for (mount, controllers) in plan {
            // On error `cg` drops here and removes the directories made so far.
            cg.make_dir(mount, controllers)?;
        }
        Ok(cg)
    }

    /// Makes the leaf in one hierarchy (after preparing the parent) and writes its limits.
    fn make_dir(
        &mut self,
        mount: ControllerMount,
        controllers: Vec<Controller>,
    ) -> Result<(), CgroupError> {
        let parent = mount.mount.join(PARENT);
        mkdir_exist_ok(&parent)?;
        match mount.version {
            CgroupVersion::V1 if controllers.contains(&Controller::Cpuset) => {
                widen_v1_cpuset(&mount.mount, &parent, &self.limits)?;
            }
            CgroupVersion::V1 => {}
            CgroupVersion::V2 => {
                enable_controllers(&mount.mount, &controllers)?;
                enable_controllers(&parent, &controllers)?;
            }
        }
        let path = parent.join(&self.name);
        if path.exists() {
            replace_stale(&path)?;
        }
        std::fs::create_dir(&path).map_err(|source| CgroupError::Create {
            path: path.clone(),
            source,
        })?;
        let dir = Dir {
            mount,
            controllers,
            path,
        };
        self.dirs.push(dir.clone());
        for c in &dir.controllers {
            match c {
                Controller::Cpuset => self.write_cpuset(&dir, &parent)?,
                Controller::Memory => write_memory(&dir, self.limits.memory_max_bytes)?,
                Controller::Hugetlb => write_hugetlb(&dir, &self.limits.hugetlb)?,
            }
        }
        Ok(())
    }

    /// Writes cpuset.cpus and cpuset.mems. Empty lists inherit: v2 leaves the files empty,
    /// v1 (where an empty cpuset admits no task) copies the parent's.
    fn write_cpuset(&mut self, dir: &Dir, parent: &Path) -> Result<(), CgroupError> {
        for (file, is_cpus) in [("cpuset.cpus", true), ("cpuset.mems", false)] {
            let want = if is_cpus {
                &mut self.limits.cpus
            } else {
                &mut self.limits.mems
            };
            if want.is_empty() {
                if !dir.v1() {
                    continue;
                }
                *want = read_list(&parent.join(file))?;
            }
            fsio::write(&dir.path.join(file), &cpulist::format(want))?;
        }
        Ok(())
    }

    /// Rewrites `cpuset.cpus` (e.g. to narrow the set after a wider start-up phase). The
    /// process's threads must already be pinned inside `cpus`.
    pub fn set_cpus(&mut self, cpus: &[u32]) -> Result<(), CgroupError> {
        if let Some(d) = self
            .dirs
            .iter()
            .find(|d| d.controllers.contains(&Controller::Cpuset))
        {
            fsio::write(&d.path.join("cpuset.cpus"), &cpulist::format(cpus))?;
        }
        self.limits.cpus = cpus.to_vec();
        Ok(())
    }

    /// Moves process `pid` (all its threads) into the cgroup, hierarchy by hierarchy.
    ///
    /// Memory the process already has stays charged where it was: add the VMM before it
    /// allocates guest RAM.
    pub fn add_process(&self, pid: u32) -> Result<(), CgroupError> {
        for d in &self.dirs {
            move_pid(pid, &d.path)?;
        }
        Ok(())
    }

    /// Moves this process into the cgroup; [`Drop`] moves it back out before removing it.
    pub fn add_self(&mut self) -> Result<(), CgroupError> {
        let mut origin = Vec::new();
        for d in &self.dirs {
            let c = d.controllers[0];
            origin.push(self.hierarchy.current_dir(&d.mount, c, None)?);
        }
        self.self_origin = origin;
        self.add_process(std::process::id())
    }

    /// The VM name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The limits as written (empty cpus/mems resolved to the parent's on v1; the memory limit
    /// widened by the hugepages under `memory_hugetlb_accounting`; hugetlb cleared without the
    /// controller).
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// What differs from the requested limits, and why.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// The cgroup directory that holds controller `c`, if this cgroup uses it.
    pub fn dir(&self, c: Controller) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|d| d.controllers.contains(&c))
            .map(|d| d.path.as_path())
    }

    pub(crate) fn dir_entry(&self, c: Controller) -> Option<&Dir> {
        self.dirs.iter().find(|d| d.controllers.contains(&c))
    }

    /// Where this process was in the hierarchy of `c` before [`Cgroup::add_self`], while it is
    /// still inside.
    pub(crate) fn self_origin(&self, c: Controller) -> Option<&Path> {
        let i = self.dirs.iter().position(|d| d.controllers.contains(&c))?;
        let origin = self.self_origin.get(i)?;
        fsio::procs(&self.dirs[i].path)
            .contains(&std::process::id())
            .then_some(origin.as_path())
    }

    /// Processes in the cgroup (from the first hierarchy's `cgroup.procs`).
    pub fn processes(&self) -> Vec<u32> {
        self.dirs
            .first()
            .map(|d| fsio::procs(&d.path))
            .unwrap_or_default()
    }

    /// Removes the cgroup now, reporting what could not be removed (drop does the same and
    /// logs instead).
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.remove_inner()
    }

    fn remove_inner(&mut self) -> Result<(), CgroupError> {
        if self.removed {
            return Ok(());
        }
        self.removed = true;
        let me = std::process::id();
        let mut first_err = None;
        for (i, d) in self.dirs.iter().enumerate() {
            if !self.self_origin.is_empty() && fsio::procs(&d.path).contains(&me) {
                let back = &self.self_origin[i];
                if move_pid(me, back).is_err() {
                    // The origin is gone: the hierarchy's root always exists.
                    let _ = move_pid(me, &d.mount.mount);
                }
            }
        }
        for d in self.dirs.iter().rev() {
            if let Err(e) = rmdir_retry(&d.path) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = self.remove_inner() {
            tracing::warn!(error = %e, "cgroup of VM {} left behind", self.name);
        }
    }
}

/// Checks that `name` is a DNS label (what Kubernetes allows for VM names, and a safe
/// directory name).
pub fn validate_name(name: &str) -> Result<(), CgroupError> {
    let bad = |reason| {
        Err(CgroupError::InvalidName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > 63 {
        return bad("longer than 63 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return bad("characters other than a-z, 0-9 and '-'");
    }
    if name.starts_with('-') || name.ends_with('-') {
        return bad("starts or ends with '-'");
    }
    Ok(())
}

fn mkdir_exist_ok(path: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(path) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(CgroupError::Create {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// A leftover leaf: removed when empty, an error while it holds processes.
fn replace_stale(path: &Path) -> Result<(), CgroupError> {
    let pids = fsio::procs(path);
    if !pids.is_empty() {
        return Err(CgroupError::InUse {
            path: path.to_path_buf(),
            pids,
        });
    }
    tracing::info!("removing leftover cgroup {}", path.display());
    rmdir_retry(path)
}

/// v1: a new cgroup's cpuset is empty and admits no task; the shared parent gets the whole
/// set of its own parent when it does not yet cover what the VM needs.
fn widen_v1_cpuset(root: &Path, parent: &Path, limits: &Limits) -> Result<(), CgroupError> {
    for (file, want) in [("cpuset.cpus", &limits.cpus), ("cpuset.mems", &limits.mems)] {
        let have = read_list(&parent.join(file))?;
        if have.is_empty() || !want.iter().all(|x| have.contains(x)) {
            let all = read_list(&root.join(file))?;
            fsio::write(&parent.join(file), &cpulist::format(&all))?;
        }
    }
    Ok(())
}

/// v2: enables `controllers` for the children of `dir` (cgroup.subtree_control).
fn enable_controllers(dir: &Path, controllers: &[Controller]) -> Result<(), CgroupError> {
    let file = dir.join("cgroup.subtree_control");
    let current = std::fs::read_to_string(&file).unwrap_or_default();
    for c in controllers {
        if current.split_whitespace().any(|x| x == c.name()) {
            continue;
        }
        fsio::write_raw(&file, &format!("+{}", c.name())).map_err(|source| {
            CgroupError::EnableController {
                file: file.clone(),
                controller: c.name(),
                source,
            }
        })?;
    }
    Ok(())
}

fn write_memory(dir: &Dir, max: Option<u64>) -> Result<(), CgroupError> {
    let Some(max) = max else {
        return Ok(());
    };
    let v = max.to_string();
    if dir.v1() {
        fsio::write(&dir.path.join("memory.limit_in_bytes"), &v)?;
        // With swap accounting, memory+swap at the same limit means no swap at all.
        let memsw = dir.path.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            fsio::write(&memsw, &v)?;
        }
    } else {
        fsio::write(&dir.path.join("memory.max"), &v)?;
        let swap = dir.path.join("memory.swap.max");
        if swap.exists() {
            fsio::write(&swap, "0")?;
        }
    }
    Ok(())
}

/// Writes the fault-time limit and, where the kernel has it (5.7+), the reservation limit: a
/// mapping beyond it fails at `mmap` (ENOMEM) instead of a SIGBUS at first touch.
fn write_hugetlb(dir: &Dir, hugetlb: &[(u64, u64)]) -> Result<(), CgroupError> {
    let (max, rsvd) = if dir.v1() {
        ("limit_in_bytes", "rsvd.limit_in_bytes")
    } else {
        ("max", "rsvd.max")
    };
    for &(page, bytes) in hugetlb {
        let size = hugetlb_size_name(page);
        let file = dir.path.join(format!("hugetlb.{size}.{max}"));
        if !file.exists() && !cfg!(test) {
            return Err(CgroupError::InvalidLimits {
                reason: format!(
                    "{} does not exist: the kernel has no {size} hugepages",
                    file.display()
                ),
            });
        }
        fsio::write(&file, &bytes.to_string())?;
        let file = dir.path.join(format!("hugetlb.{size}.{rsvd}"));
        if file.exists() {
            fsio::write(&file, &bytes.to_string())?;
        }
    }
    Ok(())
}

pub(crate) fn read_list(file: &Path) -> Result<Vec<u32>, CgroupError> {
    let text = fsio::read(file)?;
    cpulist::parse(&text).map_err(|_| CgroupError::Parse {
        file: file.to_path_buf(),
        content: text,
        expected: "a cpu/node list such as 0-3,8",
    })
}

fn move_pid(pid: u32, dir: &Path) -> Result<(), CgroupError> {
    let file = dir.join("cgroup.procs");
    fsio::write_raw(&file, &pid.to_string()).map_err(|source| CgroupError::AddProcess {
        pid,
        file,
        source,
    })
}

/// `rmdir` with retries while the kernel still counts tasks that are exiting (EBUSY).
fn rmdir_retry(path: &Path) -> Result<(), CgroupError> {
    let start = std::time::Instant::now();
    loop {
        match fsio::rmdir(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && start.elapsed() < REMOVE_RETRY => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(source) => {
                return Err(CgroupError::Remove {
                    path: path.to_path_buf(),
                    pids: fsio::procs(path),
                    source,
                })
            }
        }
    }
}
