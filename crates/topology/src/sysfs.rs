//! Reading the kernel's view of CPUs, hugepages and node distances from sysfs.
//!
//! Every reader takes the sysfs root (`/sys` on a live host) so that tests can point it at a
//! fake tree. Files that do not exist on kernels without NUMA or hugetlb support read as
//! "nothing there", not as errors.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use crate::{cpulist, error::TopologyError, model::HugepagePool};

/// The live sysfs mount.
pub(crate) const ROOT: &str = "/sys";

/// A sysfs tree rooted at `root` (normally [`ROOT`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sysfs<'a> {
    /// The directory that plays `/sys`.
    pub root: &'a Path,
}

impl Sysfs<'_> {
    /// The online CPUs (`devices/system/cpu/online`); `None` when the file does not exist.
    pub fn online_cpus(&self) -> Result<Option<Vec<u32>>, TopologyError> {
        self.cpulist(&self.root.join("devices/system/cpu/online"))
    }

    /// The hugepage sizes the kernel supports (`kernel/mm/hugepages/hugepages-<kB>kB`), bytes,
    /// ascending. Empty when the kernel has no hugetlb support.
    pub fn hugepage_sizes(&self) -> Result<Vec<u64>, TopologyError> {
        Ok(pool_dirs(&self.root.join("kernel/mm/hugepages"))?
            .into_iter()
            .map(|(size, _)| size)
            .collect())
    }

    /// The hugepage pools of node `node` (`devices/system/node/nodeN/hugepages/...`), ascending by
    /// size. A kernel without NUMA support has no `nodeN` directories: then, and only for
    /// `single_node` hosts, the global pools (`kernel/mm/hugepages`) are the node's pools.
    pub fn node_hugepages(
        &self,
        node: u32,
        single_node: bool,
    ) -> Result<Vec<HugepagePool>, TopologyError> {
        let node_dir = self.root.join(format!("devices/system/node/node{node}"));
        let dir = if node_dir.is_dir() {
            node_dir.join("hugepages")
        } else if single_node {
            self.root.join("kernel/mm/hugepages")
        } else {
            return Ok(Vec::new());
        };
        pool_dirs(&dir)?
            .into_iter()
            .map(|(page_size_bytes, pool)| {
                Ok(HugepagePool {
                    page_size_bytes,
                    total: read_number(&pool.join("nr_hugepages"))?,
                    free: read_number(&pool.join("free_hugepages"))?,
                })
            })
            .collect()
    }

    /// The distance matrix of `nodes` from `devices/system/node/nodeN/distance` (whose columns
    /// follow `devices/system/node/online`). `None` when a file is missing or does not cover
    /// every node.
    pub fn node_distances(&self, nodes: &[u32]) -> Result<Option<Vec<Vec<u32>>>, TopologyError> {
        let base = self.root.join("devices/system/node");
        let Some(columns) = self.cpulist(&base.join("online"))? else {
            return Ok(None);
        };
        let mut matrix = Vec::with_capacity(nodes.len());
        for &from in nodes {
            let path = base.join(format!("node{from}/distance"));
            let Some(text) = read_optional(&path)? else {
                return Ok(None);
            };
            let values = text
                .split_whitespace()
                .map(|v| v.parse::<u32>().map_err(|_| number_error(&path, &text)))
                .collect::<Result<Vec<u32>, _>>()?;
            let mut row = Vec::with_capacity(nodes.len());
            for to in nodes {
                let Some(d) = columns
                    .iter()
                    .position(|c| c == to)
                    .and_then(|i| values.get(i))
                else {
                    return Ok(None);
                };
                row.push(*d);
            }
            matrix.push(row);
        }
        Ok(Some(matrix))
    }

    /// A cpulist file; `None` when it does not exist.
    fn cpulist(&self, path: &Path) -> Result<Option<Vec<u32>>, TopologyError> {
        let Some(text) = read_optional(path)? else {
            return Ok(None);
        };
        cpulist::parse(&text)
            .map(Some)
            .map_err(|source| TopologyError::ParseSysfsCpuList {
                path: path.to_owned(),
                source,
            })
    }
}

/// The page size in bytes of a `hugepages-<kB>kB` directory name.
pub(crate) fn pool_dir_size(name: &str) -> Option<u64> {
    let kb: u64 = name
        .strip_prefix("hugepages-")?
        .strip_suffix("kB")?
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// The `hugepages-<kB>kB` subdirectories of `dir` with their page sizes, ascending by size.
/// A missing `dir` has none.
fn pool_dirs(dir: &Path) -> Result<Vec<(u64, PathBuf)>, TopologyError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(TopologyError::ReadSysfs {
                path: dir.to_owned(),
                source,
            })
        }
    };
    let mut pools = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| TopologyError::ReadSysfs {
            path: dir.to_owned(),
            source,
        })?;
        if let Some(size) = entry.file_name().to_str().and_then(pool_dir_size) {
            pools.push((size, entry.path()));
        }
    }
    pools.sort();
    Ok(pools)
}

/// A file holding one decimal number.
fn read_number(path: &Path) -> Result<u64, TopologyError> {
    let text = fs::read_to_string(path).map_err(|source| TopologyError::ReadSysfs {
        path: path.to_owned(),
        source,
    })?;
    text.trim().parse().map_err(|_| number_error(path, &text))
}

/// The error for a file that should hold numbers.
pub(crate) fn number_error(path: &Path, text: &str) -> TopologyError {
    TopologyError::ParseSysfsNumber {
        path: path.to_owned(),
        text: text.trim().to_owned(),
    }
}

/// A file's text, or `None` when it does not exist.
pub(crate) fn read_optional(path: &Path) -> Result<Option<String>, TopologyError> {
    match fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TopologyError::ReadSysfs {
            path: path.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs tree in a fresh temporary directory, removed on drop.
    struct FakeSys(PathBuf);

    impl FakeSys {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("vmhost-topology-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
        fn write(&self, rel: &str, text: &str) {
            let path = self.0.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        fn sysfs(&self) -> Sysfs<'_> {
            Sysfs { root: &self.0 }
        }
    }

    impl Drop for FakeSys {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn pool_dir_names() {
        assert_eq!(pool_dir_size("hugepages-2048kB"), Some(2 << 20));
        assert_eq!(pool_dir_size("hugepages-1048576kB"), Some(1 << 30));
        assert_eq!(pool_dir_size("hugepages-2048"), None);
        assert_eq!(pool_dir_size("hugepages"), None);
    }

    #[test]
    fn reads_two_node_tree() {
        let fake = FakeSys::new("two-node");
        fake.write("devices/system/cpu/online", "0-3\n");
        fake.write("devices/system/node/online", "0-1\n");
        fake.write("devices/system/node/node0/distance", "10 21\n");
        fake.write("devices/system/node/node1/distance", "21 10\n");
        for (node, nr, free) in [(0, "8\n", "6\n"), (1, "0\n", "0\n")] {
            let base = format!("devices/system/node/node{node}/hugepages/hugepages-2048kB");
            fake.write(&format!("{base}/nr_hugepages"), nr);
            fake.write(&format!("{base}/free_hugepages"), free);
        }
        fake.write(
            "kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages",
            "0\n",
        );
        fake.write("kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "8\n");
        let sys = fake.sysfs();
        assert_eq!(sys.online_cpus().unwrap(), Some(vec![0, 1, 2, 3]));
        assert_eq!(sys.hugepage_sizes().unwrap(), [2 << 20, 1 << 30]);
        assert_eq!(
            sys.node_hugepages(0, false).unwrap(),
            [HugepagePool {
                page_size_bytes: 2 << 20,
                total: 8,
                free: 6
            }]
        );
        assert_eq!(sys.node_hugepages(7, false).unwrap(), []);
        assert_eq!(
            sys.node_distances(&[0, 1]).unwrap(),
            Some(vec![vec![10, 21], vec![21, 10]])
        );
        assert_eq!(sys.node_distances(&[0, 2]).unwrap(), None);
    }

    #[test]
    fn kernel_without_numa_uses_global_pools_for_single_node() {
        let fake = FakeSys::new("no-numa");
        fake.write("kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "4\n");
        fake.write("kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "3\n");
        let sys = fake.sysfs();
        assert_eq!(sys.online_cpus().unwrap(), None);
        assert_eq!(sys.node_distances(&[0]).unwrap(), None);
        assert_eq!(
            sys.node_hugepages(0, true).unwrap(),
            [HugepagePool {
                page_size_bytes: 2 << 20,
                total: 4,
                free: 3
            }]
        );
        assert_eq!(sys.node_hugepages(0, false).unwrap(), []);
    }

    #[test]
    fn garbage_is_reported_with_path_and_text() {
        let fake = FakeSys::new("garbage");
        fake.write("devices/system/cpu/online", "zero\n");
        fake.write(
            "devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages",
            "many\n",
        );
        let sys = fake.sysfs();
        let e = sys.online_cpus().unwrap_err();
        assert!(
            matches!(e, TopologyError::ParseSysfsCpuList { ref path, .. } if path.ends_with("cpu/online")),
            "{e:?}"
        );
        let e = sys.node_hugepages(0, true).unwrap_err();
        assert!(e.to_string().contains("\"many\""), "{e}");
        assert!(e.to_string().contains("nr_hugepages"), "{e}");
    }
}
