//! Unit tests of the admission re-check, on fake sysfs trees.

use super::*;
use crate::testutil;

/// A fake sysfs tree in a fresh temporary directory, removed on drop.
struct FakeSys(PathBuf);

impl FakeSys {
    fn new(tag: &str) -> FakeSys {
        let dir = std::env::temp_dir().join(format!("vmhost-memory-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        FakeSys(dir)
    }

    fn write(&self, rel: &str, text: &str) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// One node with `free` 2 MiB pages, `resv` reserved host-wide.
    fn one_node(tag: &str, free: u64, resv: u64) -> FakeSys {
        let s = FakeSys::new(tag);
        s.write(
            "devices/system/node/node0/hugepages/hugepages-2048kB/free_hugepages",
            &format!("{free}\n"),
        );
        s.write(
            "kernel/mm/hugepages/hugepages-2048kB/free_hugepages",
            &format!("{free}\n"),
        );
        s.write(
            "kernel/mm/hugepages/hugepages-2048kB/resv_hugepages",
            &format!("{resv}\n"),
        );
        s.write(
            "kernel/mm/hugepages/hugepages-1048576kB/free_hugepages",
            "0\n",
        );
        s.write(
            "kernel/mm/transparent_hugepage/shmem_enabled",
            "always within_size advise [never] deny force\n",
        );
        s
    }

    fn host(&self) -> HostState {
        HostState::with_root(&self.0)
    }
}

impl Drop for FakeSys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const MIB2: u64 = 2 << 20;

#[test]
fn reads_nodes_sizes_and_thp_setting() {
    let s = FakeSys::one_node("read", 10, 0);
    assert_eq!(s.host().nodes(), vec![0]);
    assert_eq!(s.host().page_sizes(), vec![MIB2, 1 << 30]);
    assert_eq!(s.host().shmem_thp().as_deref(), Some("never"));
}

#[test]
fn admits_a_plan_that_fits() {
    let s = FakeSys::one_node("fits", 10, 0);
    let plan = testutil::plan(
        "test",
        &[(Some(0), 8 * MIB2)],
        Backing::Hugetlb {
            page_size_bytes: MIB2,
            hugetlbfs: None,
        },
    );
    let adm = check_admission(&plan, &s.host()).unwrap();
    assert_eq!(
        adm.pools,
        vec![PoolCheck {
            node: Some(0),
            page_size_bytes: MIB2,
            needed: 8,
            free: 10,
            reserved: 0
        }]
    );
}

#[test]
fn reserved_pages_are_not_available() {
    // 10 free but 4 of them promised to another mapping: 6 available, 8 needed.
    let s = FakeSys::one_node("resv", 10, 4);
    let plan = testutil::plan(
        "test",
        &[(Some(0), 8 * MIB2)],
        Backing::Hugetlb {
            page_size_bytes: MIB2,
            hugetlbfs: None,
        },
    );
    let err = check_admission(&plan, &s.host()).unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::HostShort {
                free: 10,
                reserved: 4,
                needed: 8,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("6 2Mi hugepages available"),
        "{err}"
    );
}

#[test]
fn node_short_names_node_and_counts() {
    let s = FakeSys::one_node("short", 3, 0);
    let plan = testutil::plan(
        "test",
        &[(Some(0), 8 * MIB2)],
        Backing::Hugetlb {
            page_size_bytes: MIB2,
            hugetlbfs: None,
        },
    );
    let err = check_admission(&plan, &s.host()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "node0 has 3 free 2Mi hugepages, the plan needs 8"
    );
}

#[test]
fn shape_errors() {
    let s = FakeSys::one_node("shape", 100, 0);
    let hp = Backing::Hugetlb {
        page_size_bytes: MIB2,
        hugetlbfs: None,
    };
    let err = check_admission(
        &testutil::plan("test", &[(Some(0), MIB2 + 4096)], hp.clone()),
        &s.host(),
    )
    .unwrap_err();
    assert!(
        matches!(err, AdmissionError::NotPageMultiple { cell: 0, .. }),
        "{err:?}"
    );
    let err = check_admission(&testutil::plan("test", &[], hp.clone()), &s.host()).unwrap_err();
    assert!(matches!(err, AdmissionError::NoCells));
    let err = check_admission(
        &testutil::plan("test", &[(Some(0), 0)], hp.clone()),
        &s.host(),
    )
    .unwrap_err();
    assert!(matches!(err, AdmissionError::EmptyCell { cell: 0 }));
    let mut plan = testutil::plan("test", &[(Some(0), MIB2), (Some(0), MIB2)], hp.clone());
    plan.guest_cells[1].cell = 0;
    let err = check_admission(&plan, &s.host()).unwrap_err();
    assert!(matches!(err, AdmissionError::DuplicateCell { cell: 0 }));
    let err =
        check_admission(&testutil::plan("test", &[(Some(5), MIB2)], hp), &s.host()).unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::NodeMissing {
                cell: 0,
                node: 5,
                ..
            }
        ),
        "{err:?}"
    );
    let odd = Backing::Hugetlb {
        page_size_bytes: 16 << 20,
        hugetlbfs: None,
    };
    let err = check_admission(
        &testutil::plan("test", &[(Some(0), 16 << 20)], odd),
        &s.host(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "the host kernel has no 16Mi hugepages (sizes: 2Mi, 1Gi)"
    );
}

#[test]
fn anonymous_backing_needs_no_pool() {
    let s = FakeSys::one_node("anon", 0, 0);
    let plan = testutil::plan("test", &[(Some(0), 1 << 20)], Backing::Anonymous);
    assert_eq!(
        check_admission(&plan, &s.host()).unwrap(),
        Admission::default()
    );
}

#[test]
fn unreadable_counter_is_an_error_with_its_path() {
    let s = FakeSys::new("unreadable");
    s.write("devices/system/node/node0/online", "1");
    s.write(
        "kernel/mm/hugepages/hugepages-2048kB/free_hugepages",
        "many\n",
    );
    let plan = testutil::plan(
        "test",
        &[(Some(0), MIB2)],
        Backing::Hugetlb {
            page_size_bytes: MIB2,
            hugetlbfs: None,
        },
    );
    let err = check_admission(&plan, &s.host()).unwrap_err();
    assert!(matches!(err, AdmissionError::ReadPool { .. }), "{err:?}");
    s.write("kernel/mm/hugepages/hugepages-2048kB/resv_hugepages", "x");
    let err = check_admission(&plan, &s.host()).unwrap_err();
    assert!(matches!(err, AdmissionError::ParsePool { .. }), "{err:?}");
}

#[test]
fn hugetlbfs_check_rejects_other_filesystems() {
    let err = check_hugetlbfs(Path::new("/proc"), MIB2).unwrap_err();
    assert!(
        matches!(err, AdmissionError::NotHugetlbfs { f_type: 0x9fa0, .. }),
        "{err:?}"
    );
    let err = check_hugetlbfs(Path::new("/no/such/mount"), MIB2).unwrap_err();
    assert!(matches!(err, AdmissionError::Statfs { .. }), "{err:?}");
}
