//! The limits this process's cgroups put on the host memory it may use: the memory nodes its
//! cpuset allows (`cpuset.mems.effective`; v1 `cpuset.effective_mems`) and, per hugepage size,
//! the fewest pages its cgroup or any ancestor still lets it take (`hugetlb.<size>.max` minus
//! `hugetlb.<size>.current`; v1 `hugetlb.<size>.limit_in_bytes` minus `usage_in_bytes`).
//!
//! Inside a Kubernetes pod these are the pod's share of the node: the host's pools and nodes
//! are the node's, the cgroup says what the pod may take of them.
//!
//! A file that does not exist (the controller is not enabled there) means no limit; a file that
//! exists but cannot be read or parsed is an error naming it, never a silent "unlimited".

use std::path::{Path, PathBuf};

use crate::{
    cpulist,
    error::TopologyError,
    model::{AllowedMems, HugetlbLimit},
    sysfs::{number_error, read_optional},
};

/// This process's cgroup membership file on a live host.
pub(crate) const MEMBERSHIP: &str = "/proc/self/cgroup";
/// The cgroup mount on a live host.
pub(crate) const MOUNT: &str = "/sys/fs/cgroup";

/// A limit of at least this many bytes is none: cgroup v1 reads "unlimited" as
/// `PAGE_COUNTER_MAX` pages (about 2^63 bytes).
const UNLIMITED_BYTES: u64 = 1 << 62;

/// The cgroup view of a process: its membership file and the mount they are under (normally
/// [`MEMBERSHIP`] and [`MOUNT`]; tests point them at a fake tree).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cgroups<'a> {
    /// The file that plays `/proc/self/cgroup`.
    pub membership: &'a Path,
    /// The directory that plays `/sys/fs/cgroup`.
    pub mount: &'a Path,
}

/// One controller's hierarchy and this process's place in it.
struct Hierarchy {
    /// The hierarchy's mount directory.
    root: PathBuf,
    /// The process's cgroup path in it (`/kubepods/pod…/…`).
    path: String,
    /// True for a cgroup v1 hierarchy (other file names).
    v1: bool,
}

impl Hierarchy {
    /// The cgroup directories from the process's own up to the root, with their paths.
    fn lineage(&self) -> Vec<(String, PathBuf)> {
        let mut out = Vec::new();
        let mut path = self.path.trim_end_matches('/').to_owned();
        loop {
            let dir = self.root.join(path.trim_start_matches('/'));
            let name = if path.is_empty() {
                "/".to_owned()
            } else {
                path.clone()
            };
            out.push((name, dir));
            match path.rfind('/') {
                Some(i) if !path.is_empty() => path.truncate(i),
                _ => return out,
            }
        }
    }
}

impl Cgroups<'_> {
    /// The hierarchy that holds `controller` for this process: its v1 hierarchy when it has
    /// one, else the unified (v2) hierarchy. `None` when the process is in no cgroup.
    fn hierarchy(&self, controller: &str) -> Result<Option<Hierarchy>, TopologyError> {
        let Some(text) = read_optional(self.membership)? else {
            return Ok(None);
        };
        for line in text.lines() {
            let mut fields = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            if controllers.split(',').any(|c| c == controller) {
                return Ok(Some(Hierarchy {
                    root: self.mount.join(controllers),
                    path: path.to_owned(),
                    v1: true,
                }));
            }
        }
        let Some(path) = text.lines().find_map(|l| l.strip_prefix("0::")) else {
            return Ok(None);
        };
        // A pure v2 host mounts the unified hierarchy at the mount itself; a hybrid one below it.
        let root = if self.mount.join("cgroup.controllers").exists() {
            self.mount.to_owned()
        } else {
            self.mount.join("unified")
        };
        Ok(Some(Hierarchy {
            root,
            path: path.trim().to_owned(),
            v1: false,
        }))
    }

    /// The memory nodes the process's cpuset allows: the nearest cgroup, from its own up, that
    /// has the effective-mems file. `None` without a cpuset controller.
    pub fn allowed_mems(&self) -> Result<Option<AllowedMems>, TopologyError> {
        let Some(h) = self.hierarchy("cpuset")? else {
            return Ok(None);
        };
        let file = if h.v1 {
            "cpuset.effective_mems"
        } else {
            "cpuset.mems.effective"
        };
        for (cgroup, dir) in h.lineage() {
            let path = dir.join(file);
            let Some(text) = read_optional(&path)? else {
                continue;
            };
            let nodes =
                cpulist::parse(&text).map_err(|source| TopologyError::ParseSysfsCpuList {
                    path: path.clone(),
                    source,
                })?;
            return Ok(Some(AllowedMems {
                nodes,
                cgroup,
                file: path.display().to_string(),
            }));
        }
        Ok(None)
    }

    /// Per page size in `sizes`, the tightest hugetlb limit of the process's cgroup and its
    /// ancestors; sizes no cgroup limits have no entry.
    pub fn hugetlb_limits(&self, sizes: &[u64]) -> Result<Vec<HugetlbLimit>, TopologyError> {
        let Some(h) = self.hierarchy("hugetlb")? else {
            return Ok(Vec::new());
        };
        let lineage = h.lineage();
        let mut limits = Vec::new();
        for &size in sizes {
            let name = size_name(size);
            let (max, current) = if h.v1 {
                ("limit_in_bytes", "usage_in_bytes")
            } else {
                ("max", "current")
            };
            let mut tightest: Option<HugetlbLimit> = None;
            for (cgroup, dir) in &lineage {
                let max_path = dir.join(format!("hugetlb.{name}.{max}"));
                let Some(limit_bytes) = read_limit(&max_path)? else {
                    continue;
                };
                let usage_path = dir.join(format!("hugetlb.{name}.{current}"));
                let usage_bytes = read_limit(&usage_path)?.unwrap_or(0);
                let pages = limit_bytes.saturating_sub(usage_bytes) / size;
                if tightest.as_ref().is_none_or(|t| pages < t.pages) {
                    tightest = Some(HugetlbLimit {
                        page_size_bytes: size,
                        pages,
                        cgroup: cgroup.clone(),
                        file: max_path.display().to_string(),
                        limit_bytes,
                        usage_bytes,
                    });
                }
            }
            limits.extend(tightest);
        }
        Ok(limits)
    }
}

/// The kernel's name of a hugepage size in hugetlb cgroup files: `2MB`, `1GB`, `64KB`.
pub(crate) fn size_name(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{}GB", b >> 30),
        b if b >= 1 << 20 => format!("{}MB", b >> 20),
        b => format!("{}KB", b >> 10),
    }
}

/// A limit or usage file in bytes: `None` when it does not exist or says `max` (or v1's
/// "unlimited", [`UNLIMITED_BYTES`] and more).
fn read_limit(path: &Path) -> Result<Option<u64>, TopologyError> {
    let Some(text) = read_optional(path)? else {
        return Ok(None);
    };
    let text = text.trim();
    if text == "max" {
        return Ok(None);
    }
    let bytes: u64 = text.parse().map_err(|_| number_error(path, text))?;
    Ok((bytes < UNLIMITED_BYTES).then_some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const MI2: u64 = 2 << 20;
    const GI1: u64 = 1 << 30;

    /// A fake `/proc/self/cgroup` and cgroup mount in a fresh temporary directory.
    struct Fake(PathBuf);

    impl Fake {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("vmhost-cgroup-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("mnt")).unwrap();
            Self(dir)
        }
        fn write(&self, rel: &str, text: &str) {
            let path = self.0.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        fn cgroups(&self) -> Cgroups<'_> {
            Cgroups {
                membership: Box::leak(self.0.join("self-cgroup").into_boxed_path()),
                mount: Box::leak(self.0.join("mnt").into_boxed_path()),
            }
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// A v2 pod: `/kubepods/pod1/ctr`, cpuset only on the pod, hugetlb limits on the pod and on
    /// `/kubepods` (the tighter one wins, per size).
    fn v2_pod(name: &str) -> Fake {
        let f = Fake::new(name);
        f.write("self-cgroup", "0::/kubepods/pod1/ctr\n");
        f.write("mnt/cgroup.controllers", "cpuset memory hugetlb\n");
        f.write("mnt/cpuset.mems.effective", "0-1\n");
        f.write("mnt/kubepods/pod1/cpuset.mems.effective", "1\n");
        f.write("mnt/kubepods/pod1/ctr/cgroup.procs", "");
        // The pod: 20 MiB of 2 MiB pages, 4 MiB used → 8 pages; 1 GiB pages unlimited.
        f.write("mnt/kubepods/pod1/hugetlb.2MB.max", "20971520\n");
        f.write("mnt/kubepods/pod1/hugetlb.2MB.current", "4194304\n");
        f.write("mnt/kubepods/pod1/hugetlb.1GB.max", "max\n");
        f.write("mnt/kubepods/pod1/hugetlb.1GB.current", "0\n");
        // Its parent: room for 100 2 MiB pages and 1 GiB page.
        f.write("mnt/kubepods/hugetlb.2MB.max", "209715200\n");
        f.write("mnt/kubepods/hugetlb.2MB.current", "0\n");
        f.write("mnt/kubepods/hugetlb.1GB.max", "2147483648\n");
        f.write("mnt/kubepods/hugetlb.1GB.current", "1073741824\n");
        f
    }

    #[test]
    fn v2_pod_mems_and_tightest_hugetlb_limit_of_the_lineage() {
        let f = v2_pod("v2");
        let cg = f.cgroups();
        let mems = cg.allowed_mems().unwrap().unwrap();
        assert_eq!(mems.nodes, [1]);
        assert_eq!(mems.cgroup, "/kubepods/pod1");
        assert!(mems.file.ends_with("kubepods/pod1/cpuset.mems.effective"));
        let limits = cg.hugetlb_limits(&[MI2, GI1]).unwrap();
        assert_eq!(limits.len(), 2);
        assert_eq!(
            (limits[0].page_size_bytes, limits[0].pages),
            (MI2, 8),
            "{limits:?}"
        );
        assert_eq!(limits[0].cgroup, "/kubepods/pod1");
        assert!(limits[0].file.ends_with("pod1/hugetlb.2MB.max"));
        assert_eq!(
            (limits[0].limit_bytes, limits[0].usage_bytes),
            (20 << 20, 4 << 20)
        );
        assert_eq!((limits[1].page_size_bytes, limits[1].pages), (GI1, 1));
        assert_eq!(limits[1].cgroup, "/kubepods");
    }

    #[test]
    fn missing_files_mean_no_limit() {
        let f = Fake::new("none");
        let cg = f.cgroups();
        assert!(cg.allowed_mems().unwrap().is_none(), "no membership file");
        assert!(cg.hugetlb_limits(&[MI2]).unwrap().is_empty());
        f.write("self-cgroup", "0::/a\n");
        f.write("mnt/cgroup.controllers", "memory\n");
        f.write("mnt/a/cgroup.procs", "");
        assert!(cg.allowed_mems().unwrap().is_none(), "no cpuset controller");
        assert!(cg.hugetlb_limits(&[MI2, GI1]).unwrap().is_empty());
        f.write("mnt/a/hugetlb.2MB.max", "max\n");
        assert!(cg.hugetlb_limits(&[MI2]).unwrap().is_empty(), "max");
    }

    #[test]
    fn v1_hierarchies_use_their_own_mounts_and_names() {
        let f = Fake::new("v1");
        f.write(
            "self-cgroup",
            "5:hugetlb:/job\n3:cpuset:/job\n1:cpu,cpuacct:/\n0::/\n",
        );
        f.write("mnt/cpuset/job/cpuset.effective_mems", "0\n");
        f.write("mnt/hugetlb/job/hugetlb.2MB.limit_in_bytes", "8388608\n");
        f.write("mnt/hugetlb/job/hugetlb.2MB.usage_in_bytes", "2097152\n");
        // v1's root reads "unlimited" as a huge number: no limit.
        f.write(
            "mnt/hugetlb/hugetlb.2MB.limit_in_bytes",
            "9223372036854771712\n",
        );
        f.write("mnt/hugetlb/hugetlb.2MB.usage_in_bytes", "2097152\n");
        f.write(
            "mnt/hugetlb/hugetlb.1GB.limit_in_bytes",
            "9223372036854771712\n",
        );
        let cg = f.cgroups();
        let mems = cg.allowed_mems().unwrap().unwrap();
        assert_eq!((mems.nodes, mems.cgroup.as_str()), (vec![0], "/job"));
        let limits = cg.hugetlb_limits(&[MI2, GI1]).unwrap();
        assert_eq!(limits.len(), 1, "{limits:?}");
        assert_eq!((limits[0].pages, limits[0].cgroup.as_str()), (3, "/job"));
    }

    #[test]
    fn unreadable_or_garbled_files_are_errors_naming_the_file() {
        let f = v2_pod("bad");
        f.write("mnt/kubepods/hugetlb.2MB.max", "lots\n");
        let e = f.cgroups().hugetlb_limits(&[MI2]).unwrap_err();
        assert!(e.to_string().contains("kubepods/hugetlb.2MB.max"), "{e}");
        assert!(e.to_string().contains("\"lots\""), "{e}");
        // A directory where the file should be cannot be read: an error, not "unlimited".
        let f = v2_pod("unreadable");
        let file = f.0.join("mnt/kubepods/pod1/hugetlb.2MB.max");
        fs::remove_file(&file).unwrap();
        fs::create_dir(&file).unwrap();
        let e = f.cgroups().hugetlb_limits(&[MI2]).unwrap_err();
        assert!(
            matches!(e, TopologyError::ReadSysfs { ref path, .. } if *path == file),
            "{e:?}"
        );
        let mems = f.0.join("mnt/kubepods/pod1/cpuset.mems.effective");
        fs::remove_file(&mems).unwrap();
        fs::create_dir(&mems).unwrap();
        let e = f.cgroups().allowed_mems().unwrap_err();
        assert!(e.to_string().contains("cpuset.mems.effective"), "{e}");
    }

    #[test]
    fn hybrid_hosts_read_v2_below_the_mount() {
        let f = Fake::new("hybrid");
        f.write("self-cgroup", "4:memory:/x\n0::/svc\n");
        f.write("mnt/unified/svc/hugetlb.2MB.max", "4194304\n");
        let limits = f.cgroups().hugetlb_limits(&[MI2]).unwrap();
        assert_eq!((limits[0].pages, limits[0].cgroup.as_str()), (2, "/svc"));
    }

    #[test]
    fn kernel_size_names() {
        assert_eq!(size_name(MI2), "2MB");
        assert_eq!(size_name(GI1), "1GB");
        assert_eq!(size_name(64 << 10), "64KB");
        assert_eq!(size_name(32 << 20), "32MB");
    }
}
