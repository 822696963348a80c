//! Which cgroup hierarchies this host has and where: cgroup v2 (one unified hierarchy), v1 (one
//! hierarchy per controller or controller group), or hybrid (v1 controllers plus a cgroup2 mount
//! that holds the controllers no v1 hierarchy took).
//!
//! Read from `/proc/self/mountinfo`; the v2 mount's `cgroup.controllers` says which controllers
//! it offers. A controller bound to a v1 hierarchy never appears in the v2 one, so each
//! controller has at most one home.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::CgroupError;
use crate::fsio;

/// A cgroup controller vmhost uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Controller {
    /// CPUs and memory nodes.
    Cpuset,
    /// Ordinary (non-hugetlb) memory.
    Memory,
    /// Hugepages, per page size.
    Hugetlb,
}

impl Controller {
    /// The kernel's name of the controller.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Cpuset => "cpuset",
            Controller::Memory => "memory",
            Controller::Hugetlb => "hugetlb",
        }
    }

    fn from_name(name: &str) -> Option<Controller> {
        match name {
            "cpuset" => Some(Controller::Cpuset),
            "memory" => Some(Controller::Memory),
            "hugetlb" => Some(Controller::Hugetlb),
            _ => None,
        }
    }
}

impl fmt::Display for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// cgroup interface version of one hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CgroupVersion {
    /// Legacy per-controller hierarchies (`cgroup` file system).
    V1,
    /// The unified hierarchy (`cgroup2` file system).
    V2,
}

/// How the host's cgroups are laid out, as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Only cgroup v2.
    Unified,
    /// Only cgroup v1 hierarchies.
    Legacy,
    /// v1 hierarchies and a cgroup2 mount.
    Hybrid,
}

/// Where one controller lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerMount {
    /// Interface version of its hierarchy.
    pub version: CgroupVersion,
    /// Mount point of the hierarchy (the root cgroup as this process sees it).
    pub mount: PathBuf,
    /// The hierarchy's root as mounted (the `root` field of mountinfo; `/` outside cgroup
    /// namespaces).
    pub mount_root: String,
}

/// The cgroup hierarchies of this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// Controllers vmhost uses, by home.
    pub controllers: BTreeMap<Controller, ControllerMount>,
    /// The cgroup2 mount, if any.
    pub unified: Option<PathBuf>,
    /// True when the cgroup2 mount has `memory_hugetlb_accounting` (Linux 6.6+): hugetlb pages
    /// are then charged to the memory controller too.
    pub memory_hugetlb_accounting: bool,
    /// Overall layout.
    pub layout: Layout,
}

/// One cgroup mount parsed from mountinfo.
struct MountLine {
    root: String,
    point: PathBuf,
    fstype: String,
    superopts: Vec<String>,
}

/// Detects the running host's cgroup layout from `/proc/self/mountinfo`.
pub fn detect() -> Result<Hierarchy, CgroupError> {
    let path = Path::new("/proc/self/mountinfo");
    let text = std::fs::read_to_string(path).map_err(|source| CgroupError::ReadProc {
        path: path.to_path_buf(),
        source,
    })?;
    Hierarchy::from_mountinfo(&text)
}

impl Hierarchy {
    /// Parses mountinfo text; reads `cgroup.controllers` of the cgroup2 mount it names (so a
    /// temporary directory can stand in for `/sys/fs/cgroup` in tests).
    pub fn from_mountinfo(text: &str) -> Result<Hierarchy, CgroupError> {
        let mounts: Vec<MountLine> = text.lines().filter_map(parse_line).collect();
        let mut controllers = BTreeMap::new();
        let mut unified = None;
        let mut accounting = false;
        let mut has_v1 = false;
        for m in &mounts {
            if m.fstype == "cgroup" {
                has_v1 = true;
                for opt in &m.superopts {
                    if let Some(c) = Controller::from_name(opt) {
                        controllers.entry(c).or_insert_with(|| ControllerMount {
                            version: CgroupVersion::V1,
                            mount: m.point.clone(),
                            mount_root: m.root.clone(),
                        });
                    }
                }
            }
        }
        if let Some(m) = mounts.iter().find(|m| m.fstype == "cgroup2") {
            unified = Some(m.point.clone());
            accounting = m.superopts.iter().any(|o| o == "memory_hugetlb_accounting");
            let file = m.point.join("cgroup.controllers");
            let offered = fsio::read(&file)?;
            for c in offered.split_whitespace().filter_map(Controller::from_name) {
                controllers.entry(c).or_insert_with(|| ControllerMount {
                    version: CgroupVersion::V2,
                    mount: m.point.clone(),
                    mount_root: m.root.clone(),
                });
            }
        }
        let layout = match (has_v1, unified.is_some()) {
            (false, false) => return Err(CgroupError::NotMounted),
            (false, true) => Layout::Unified,
            (true, false) => Layout::Legacy,
            (true, true) => Layout::Hybrid,
        };
        Ok(Hierarchy {
            controllers,
            unified,
            memory_hugetlb_accounting: accounting,
            layout,
        })
    }

    /// Where `c` lives, or why it is unavailable.
    pub fn controller(&self, c: Controller) -> Result<&ControllerMount, CgroupError> {
        self.controllers
            .get(&c)
            .ok_or_else(|| CgroupError::ControllerMissing {
                controller: c.name(),
                unified: self.unified.clone(),
                hint: match c {
                    Controller::Cpuset => "on cgroup v1 mount it (`mkdir -p /sys/fs/cgroup/cpuset && mount -t cgroup -o cpuset cgroup /sys/fs/cgroup/cpuset`); on v2 enable it in the parent's cgroup.subtree_control",
                    Controller::Memory => "on cgroup v1 mount it (`mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory`); on v2 boot without cgroup_disable=memory",
                    Controller::Hugetlb => "the kernel needs CONFIG_CGROUP_HUGETLB; on cgroup v1 mount it (`mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb`)",
                },
            })
    }

    /// True when hugetlb pages are charged to the memory controller as well (cgroup2's
    /// `memory_hugetlb_accounting` with the memory controller on v2); never on v1.
    pub fn hugetlb_charged_to_memory(&self) -> bool {
        self.memory_hugetlb_accounting
            && self
                .controllers
                .get(&Controller::Memory)
                .is_some_and(|m| m.version == CgroupVersion::V2)
    }

    /// The cgroup directory of process `pid` (or this process when `None`) in the hierarchy
    /// of `mount`, from `/proc/<pid>/cgroup`.
    pub fn current_dir(
        &self,
        mount: &ControllerMount,
        controller: Controller,
        pid: Option<u32>,
    ) -> Result<PathBuf, CgroupError> {
        let path = match pid {
            Some(p) => PathBuf::from(format!("/proc/{p}/cgroup")),
            None => PathBuf::from("/proc/self/cgroup"),
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|source| CgroupError::ReadProc { path, source })?;
        let rel = proc_cgroup_path(&text, mount.version, controller).unwrap_or("/");
        Ok(resolve(&mount.mount, &mount.mount_root, rel))
    }
}

/// Parses one mountinfo line: `id parent maj:min root point opts [optional...] - fstype src superopts`.
fn parse_line(line: &str) -> Option<MountLine> {
    let (left, right) = line.split_once(" - ")?;
    let mut l = left.split(' ');
    let root = unescape(l.nth(3)?);
    let point = PathBuf::from(unescape(l.next()?));
    let mut r = right.split(' ');
    let fstype = r.next()?.to_string();
    if fstype != "cgroup" && fstype != "cgroup2" {
        return None;
    }
    let superopts = r
        .nth(1)
        .unwrap_or("")
        .split(',')
        .map(str::to_string)
        .collect();
    Some(MountLine {
        root,
        point,
        fstype,
        superopts,
    })
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b.get(i + 1..i + 4).and_then(|d| {
            let s = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(s, 8).ok()
        });
        match (b[i], oct) {
            (b'\\', Some(v)) => {
                out.push(v);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The path of `controller` in `/proc/<pid>/cgroup` text (`hier:ctrl,ctrl:path` lines; v2 is
/// `0::path`).
fn proc_cgroup_path(text: &str, version: CgroupVersion, controller: Controller) -> Option<&str> {
    text.lines().find_map(|line| {
        let mut f = line.splitn(3, ':');
        let (id, ctrls, path) = (f.next()?, f.next()?, f.next()?);
        let hit = match version {
            CgroupVersion::V2 => id == "0" && ctrls.is_empty(),
            CgroupVersion::V1 => ctrls.split(',').any(|c| c == controller.name()),
        };
        hit.then_some(path)
    })
}

/// Joins a `/proc/<pid>/cgroup` path to the mount point, removing the mount's own root.
fn resolve(mount: &Path, mount_root: &str, rel: &str) -> PathBuf {
    let inner = rel
        .strip_prefix(mount_root)
        .filter(|_| mount_root != "/")
        .unwrap_or(rel);
    let inner = inner.trim_start_matches('/');
    if inner.is_empty() {
        mount.to_path_buf()
    } else {
        mount.join(inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THIS_HOST: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / UNIFIED rw,relatime - cgroup2 cgroup2 rw
";

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vmhost-cgroup-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn hybrid_v1_controllers_and_hugetlb_on_unified() {
        let d = tmp("hybrid");
        std::fs::write(d.join("cgroup.controllers"), "hugetlb\n").unwrap();
        let text = THIS_HOST.replace("UNIFIED", d.to_str().unwrap());
        let h = Hierarchy::from_mountinfo(&text).unwrap();
        assert_eq!(h.layout, Layout::Hybrid);
        let cpuset = h.controller(Controller::Cpuset).unwrap();
        assert_eq!(cpuset.version, CgroupVersion::V1);
        assert_eq!(cpuset.mount, Path::new("/sys/fs/cgroup/cpuset"));
        let hugetlb = h.controller(Controller::Hugetlb).unwrap();
        assert_eq!(hugetlb.version, CgroupVersion::V2);
        assert_eq!(hugetlb.mount, d);
        assert!(!h.hugetlb_charged_to_memory());
    }

    #[test]
    fn unified_with_hugetlb_accounting() {
        let d = tmp("unified");
        std::fs::write(
            d.join("cgroup.controllers"),
            "cpuset cpu io memory hugetlb pids\n",
        )
        .unwrap();
        let text = format!(
            "30 1 0:26 / {} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_hugetlb_accounting\n",
            d.display()
        );
        let h = Hierarchy::from_mountinfo(&text).unwrap();
        assert_eq!(h.layout, Layout::Unified);
        assert!(h
            .controllers
            .values()
            .all(|m| m.version == CgroupVersion::V2));
        assert_eq!(h.controllers.len(), 3);
        assert!(h.hugetlb_charged_to_memory());
    }

    #[test]
    fn missing_controller_says_what_to_mount() {
        let h = Hierarchy::from_mountinfo(
            "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
        )
        .unwrap();
        let msg = h.controller(Controller::Cpuset).unwrap_err().to_string();
        assert!(
            msg.contains("`cpuset` controller is not available"),
            "{msg}"
        );
        assert!(msg.contains("mount -t cgroup -o cpuset"), "{msg}");
        assert!(matches!(
            Hierarchy::from_mountinfo("1 0 0:1 / / rw - ext4 /dev/vda rw\n"),
            Err(CgroupError::NotMounted)
        ));
    }

    #[test]
    fn proc_cgroup_paths_resolve_under_the_mount() {
        let text = "4:memory:/process_api/abc\n3:cpuset:/\n0::/user.slice/x.scope\n";
        assert_eq!(
            proc_cgroup_path(text, CgroupVersion::V1, Controller::Memory),
            Some("/process_api/abc")
        );
        assert_eq!(
            proc_cgroup_path(text, CgroupVersion::V2, Controller::Memory),
            Some("/user.slice/x.scope")
        );
        let m = Path::new("/sys/fs/cgroup/memory");
        assert_eq!(
            resolve(m, "/", "/process_api/abc"),
            m.join("process_api/abc")
        );
        assert_eq!(resolve(m, "/", "/"), m);
        assert_eq!(resolve(m, "/ns", "/ns/a"), m.join("a"));
        assert_eq!(unescape("/mnt/a\\040b"), "/mnt/a b");
    }
}
