//! `discover()` against what the kernel reports in sysfs and procfs. Runs on any Linux host.

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns panic on bad host data too

mod common;

use std::{fs, path::Path};

use common::{all_pus, check_consistent};
use vmhost_topology::{
    cpulist, discover, refresh_live, HostTopology, HugepagePool, TopologySource,
};

fn read(path: impl AsRef<Path>) -> String {
    let path = path.as_ref();
    fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn sysfs_nodes() -> Vec<u32> {
    match fs::read_to_string("/sys/devices/system/node/online") {
        Ok(text) => cpulist::parse(&text).unwrap(),
        Err(_) => vec![0], // kernel without NUMA: hwloc reports one node 0
    }
}

fn proc_status_cpus_allowed() -> Vec<u32> {
    let status = read("/proc/self/status");
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .expect("Cpus_allowed_list in /proc/self/status");
    cpulist::parse(line).unwrap()
}

/// Per-node pools as sysfs shows them now.
fn sysfs_pools(nodes: &[u32]) -> Vec<Vec<HugepagePool>> {
    nodes
        .iter()
        .map(|n| {
            let dir = format!("/sys/devices/system/node/node{n}/hugepages");
            let mut pools: Vec<HugepagePool> = fs::read_dir(&dir)
                .map(|it| {
                    it.map(|e| e.unwrap().path())
                        .map(|p| {
                            let name = p.file_name().unwrap().to_str().unwrap();
                            let kb: u64 = name
                                .strip_prefix("hugepages-")
                                .and_then(|s| s.strip_suffix("kB"))
                                .unwrap()
                                .parse()
                                .unwrap();
                            HugepagePool {
                                page_size_bytes: kb * 1024,
                                total: read(p.join("nr_hugepages")).trim().parse().unwrap(),
                                free: read(p.join("free_hugepages")).trim().parse().unwrap(),
                            }
                        })
                        .collect()
                })
                .unwrap_or_default();
            pools.sort_by_key(|p| p.page_size_bytes);
            pools
        })
        .collect()
}

fn node_pools(t: &HostTopology) -> Vec<Vec<HugepagePool>> {
    t.nodes.iter().map(|n| n.hugepages.clone()).collect()
}

#[test]
fn nodes_and_cpus_match_sysfs() {
    let t = discover().unwrap();
    check_consistent(&t);
    assert_eq!(t.source, TopologySource::Live);
    let nodes = sysfs_nodes();
    assert_eq!(
        t.nodes.iter().map(|n| n.os_index).collect::<Vec<_>>(),
        nodes
    );
    for node in &t.nodes {
        let path = format!("/sys/devices/system/node/node{}/cpulist", node.os_index);
        if let Ok(text) = fs::read_to_string(&path) {
            assert_eq!(node.cpus, cpulist::parse(&text).unwrap(), "{path}");
        }
        assert!(node.memory_bytes > 0, "node {} memory", node.os_index);
    }
    let online = cpulist::parse(&read("/sys/devices/system/cpu/online")).unwrap();
    assert_eq!(t.online_cpus, online);
    assert_eq!(all_pus(&t), online, "every online CPU is a PU of some core");
}

#[test]
fn allowed_cpus_match_proc_status() {
    let t = discover().unwrap();
    let allowed: Vec<u32> = proc_status_cpus_allowed()
        .into_iter()
        .filter(|c| t.online_cpus.contains(c))
        .collect();
    assert_eq!(t.allowed_cpus, allowed);
}

#[test]
fn pinned_calling_thread_still_reports_the_process_mask() {
    let expected = discover().unwrap().allowed_cpus;
    let pinned_to = expected[0];
    let from_thread = std::thread::spawn(move || {
        // SAFETY: cpu_set_t is plain data, zeroed is its empty set; CPU_SET writes bit
        // `pinned_to` (< CPU_SETSIZE on this host) inside it; sched_setaffinity(0) reads exactly
        // size_of::<cpu_set_t>() bytes of it and only changes this spawned thread's mask.
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(pinned_to as usize, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        assert_eq!(
            rc,
            0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
        discover().unwrap().allowed_cpus
    })
    .join()
    .unwrap();
    assert_eq!(from_thread, expected);
}

/// A topology discovered earlier, whose pools have since gone stale (here: every count made
/// impossible), reads the kernel's pools again; the tree and the CPU sets stay as they were.
#[test]
fn refresh_live_reads_the_pools_again_and_keeps_the_tree() {
    let nodes = sysfs_nodes();
    let fresh = discover().unwrap();
    for _ in 0..20 {
        let mut stale = fresh.clone();
        for node in &mut stale.nodes {
            for pool in &mut node.hugepages {
                (pool.total, pool.free) = (u64::MAX, u64::MAX);
            }
        }
        stale.hugetlb_limits.clear();
        let before = sysfs_pools(&nodes);
        refresh_live(&mut stale).unwrap();
        let after = sysfs_pools(&nodes);
        if before != after {
            std::thread::sleep(std::time::Duration::from_millis(50));
            continue;
        }
        assert_eq!(node_pools(&stale), before);
        assert_eq!(stale.cores, fresh.cores);
        assert_eq!(stale.distances, fresh.distances);
        assert_eq!(stale.allowed_cpus, fresh.allowed_cpus);
        assert_eq!(stale.allowed_mems, discover().unwrap().allowed_mems);
        return;
    }
    panic!("hugepage pools in sysfs kept changing while refreshing");
}

#[test]
fn hugepages_match_sysfs() {
    let sizes: Vec<u64> = {
        let mut s: Vec<u64> = fs::read_dir("/sys/kernel/mm/hugepages")
            .map(|it| {
                it.map(|e| {
                    let name = e.unwrap().file_name().into_string().unwrap();
                    name["hugepages-".len()..name.len() - 2]
                        .parse::<u64>()
                        .unwrap()
                        * 1024
                })
                .collect()
            })
            .unwrap_or_default();
        s.sort_unstable();
        s
    };
    let nodes = sysfs_nodes();
    // Other processes (other test suites) may change the pools concurrently: accept a discovery
    // that sysfs showed identically just before and just after.
    for _ in 0..20 {
        let before = sysfs_pools(&nodes);
        let t = discover().unwrap();
        let after = sysfs_pools(&nodes);
        assert_eq!(t.hugepage_sizes, sizes);
        if before == after {
            assert_eq!(node_pools(&t), before);
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("hugepage pools in sysfs kept changing while discovering");
}

#[test]
fn distances_match_sysfs() {
    let t = discover().unwrap();
    let online = sysfs_nodes();
    for (i, from) in t.distances.nodes.iter().enumerate() {
        let path = format!("/sys/devices/system/node/node{from}/distance");
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        let row: Vec<u32> = text
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect();
        for (j, to) in t.distances.nodes.iter().enumerate() {
            let col = online.iter().position(|n| n == to).unwrap();
            assert_eq!(t.distances.matrix[i][j], row[col], "distance {from}->{to}");
        }
        assert!(
            !t.distances.assumed,
            "sysfs has {path}, so the matrix is not assumed"
        );
    }
}

#[test]
fn render_shows_the_live_host() {
    let t = discover().unwrap();
    let text = vmhost_topology::render_text(&t);
    assert!(text.starts_with("source: live host\n"), "{text}");
    assert!(
        text.contains(&format!("online cpus: {}", cpulist::format(&t.online_cpus))),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "allowed cpus: {}",
            cpulist::format(&t.allowed_cpus)
        )),
        "{text}"
    );
    for node in &t.nodes {
        assert!(
            text.contains(&format!(
                "node {}: cpus {}",
                node.os_index,
                cpulist::format(&node.cpus)
            )),
            "{text}"
        );
    }
}

#[test]
fn allowed_memory_nodes_match_proc_status() {
    let t = discover().unwrap();
    let status = read("/proc/self/status");
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Mems_allowed_list:"))
        .expect("Mems_allowed_list in /proc/self/status");
    let kernel = cpulist::parse(line).unwrap();
    let mems = t
        .allowed_mems
        .as_ref()
        .expect("a Linux process is in some cpuset: allowed_mems must be read");
    assert_eq!(mems.nodes, kernel, "{mems:?}");
    assert!(Path::new(&mems.file).is_file(), "{mems:?}");
    assert!(t
        .nodes
        .iter()
        .all(|n| t.node_allowed(n.os_index) == kernel.contains(&n.os_index)));
}
