//! The cgroup v2 path against a fake cgroup2 tree in a temporary directory: which files are
//! written with what, and in which cgroups controllers are enabled. These hosts have no v2
//! cpuset or memory controller, so this is all the v2 cpuset/memory testing there is; it
//! checks vmhost's side, not the kernel's semantics.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::limits::Limits;
use crate::{Cgroup, CgroupError, Controller, Hierarchy, Layout, OomWait};

struct Fake {
    root: PathBuf,
    hierarchy: Hierarchy,
}

impl Fake {
    fn new(tag: &str, mount_opts: &str) -> Fake {
        let root = std::env::temp_dir().join(format!("vmhost-cgv2-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(
            root.join("cgroup.controllers"),
            "cpuset cpu io memory hugetlb pids\n",
        )
        .unwrap();
        let mountinfo = format!(
            "30 1 0:26 / {} rw,nosuid - cgroup2 cgroup2 {mount_opts}\n",
            root.display()
        );
        let hierarchy = Hierarchy::from_mountinfo(&mountinfo).unwrap();
        assert_eq!(hierarchy.layout, Layout::Unified);
        Fake { root, hierarchy }
    }

    fn read(&self, rel: &str) -> String {
        std::fs::read_to_string(self.root.join(rel)).unwrap_or_default()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn limits() -> Limits {
    Limits::from_plan(&crate::testutil::plan())
}

#[test]
fn v2_writes_limits_in_the_leaf_and_enables_controllers_above_it() {
    let fake = Fake::new("write", "rw");
    let cg = Cgroup::create_in(&fake.hierarchy, "vm-a", &limits()).unwrap();
    let leaf = fake.root.join("vmhost/vm-a");
    assert_eq!(cg.dir(Controller::Memory), Some(leaf.as_path()));
    assert_eq!(cg.dir(Controller::Hugetlb), Some(leaf.as_path()));
    for dir in ["", "vmhost/"] {
        let sc = fake.read(&format!("{dir}cgroup.subtree_control"));
        assert_eq!(sc, "+cpuset+memory+hugetlb", "{dir}cgroup.subtree_control");
    }
    assert_eq!(fake.read("vmhost/vm-a/cpuset.cpus"), "0-2");
    assert_eq!(fake.read("vmhost/vm-a/cpuset.mems"), "0");
    assert_eq!(
        fake.read("vmhost/vm-a/memory.max"),
        (9u64 << 20).to_string()
    );
    assert_eq!(
        fake.read("vmhost/vm-a/hugetlb.2MB.max"),
        (64u64 << 20).to_string()
    );
    assert_eq!(cg.read_back().unwrap(), limits());
    assert!(cg.notes().is_empty());
    drop(cg);
    assert!(!leaf.exists(), "leaf removed on drop");
    assert!(fake.root.join("vmhost").exists(), "the shared parent stays");
}

#[test]
fn v2_unbound_memory_inherits_the_parents_nodes() {
    let fake = Fake::new("inherit", "rw");
    let mut l = limits();
    l.mems.clear();
    let cg = Cgroup::create_in(&fake.hierarchy, "vm-b", &l).unwrap();
    assert!(!fake.root.join("vmhost/vm-b/cpuset.mems").exists());
    assert!(cg.limits().mems.is_empty());
}

#[test]
fn v2_hugetlb_accounted_to_memory_widens_the_memory_limit() {
    let fake = Fake::new("acct", "rw,memory_hugetlb_accounting");
    let cg = Cgroup::create_in(&fake.hierarchy, "vm-c", &limits()).unwrap();
    let want = (9u64 << 20) + (64 << 20);
    assert_eq!(cg.limits().memory_max_bytes, Some(want));
    assert_eq!(fake.read("vmhost/vm-c/memory.max"), want.to_string());
    assert!(cg.notes()[0].contains("memory_hugetlb_accounting"));
}

#[test]
fn v2_leftover_cgroup_is_replaced_unless_it_holds_processes() {
    let fake = Fake::new("stale", "rw");
    let leaf = fake.root.join("vmhost/vm-d");
    std::fs::create_dir_all(&leaf).unwrap();
    std::fs::write(leaf.join("cgroup.procs"), "4242\n").unwrap();
    let err = Cgroup::create_in(&fake.hierarchy, "vm-d", &limits()).unwrap_err();
    assert!(
        matches!(&err, CgroupError::InUse { pids, .. } if pids == &[4242]),
        "{err}"
    );
    assert!(
        err.to_string().contains("a VM of this name is running"),
        "{err}"
    );
    std::fs::write(leaf.join("cgroup.procs"), "").unwrap();
    let cg = Cgroup::create_in(&fake.hierarchy, "vm-d", &limits()).unwrap();
    assert_eq!(cg.read_back().unwrap(), limits());
}

#[test]
fn v2_oom_watch_reports_new_oom_counts_and_ends_on_removal() {
    let fake = Fake::new("oom", "rw");
    let cg = Cgroup::create_in(&fake.hierarchy, "vm-e", &limits()).unwrap();
    let leaf = fake.root.join("vmhost/vm-e");
    let events = |oom: u32| format!("low 0\nhigh 0\nmax 3\noom {oom}\noom_kill {oom}\n");
    std::fs::write(leaf.join("memory.events"), events(0)).unwrap();
    std::fs::write(leaf.join("memory.current"), "9437184\n").unwrap();
    let mut watch = cg.oom_watch().unwrap();
    let short = Some(Duration::from_millis(50));
    assert_eq!(watch.wait(short).unwrap(), OomWait::TimedOut);
    std::fs::write(leaf.join("memory.events"), events(1)).unwrap();
    let OomWait::Limit(ev) = watch.wait(Some(Duration::from_secs(5))).unwrap() else {
        panic!("no event");
    };
    assert_eq!(ev.limit_bytes, Some(9 << 20));
    assert_eq!(ev.usage_bytes, Some(9 << 20));
    assert_eq!(ev.oom_kills, 1);
    let msg = ev.to_string();
    assert!(
        msg.starts_with("memory limit 9437184 bytes (9.0 MiB) reached"),
        "{msg}"
    );
    assert!(msg.contains("killed 1 process"), "{msg}");
    assert_eq!(
        watch.wait(short).unwrap(),
        OomWait::TimedOut,
        "reported once"
    );
    drop(cg);
    assert_eq!(watch.wait(None).unwrap(), OomWait::Removed);
}

#[test]
fn names_are_dns_labels() {
    for bad in ["", "Vm", "a_b", "-a", "a-", "../x", &"a".repeat(64)] {
        assert!(crate::validate_name(bad).is_err(), "{bad:?}");
    }
    for good in ["a", "vm-1", &"a".repeat(63)] {
        crate::validate_name(good).unwrap();
    }
    let fake = Fake::new("name", "rw");
    let err = Cgroup::create_in(&fake.hierarchy, "../../etc", &limits()).unwrap_err();
    assert!(err.to_string().contains("DNS label"), "{err}");
    assert!(!Path::new(&fake.root).join("vmhost").exists());
}
