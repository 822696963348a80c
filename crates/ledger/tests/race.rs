//! Many VMs starting at the same moment, as threads of this process and as separate processes
//! (this test binary re-executed as a worker): no PU is given twice.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{dedicated, host, planner};
use vmhost_ledger::{AdmitError, Ledger};

const WORKER_ENV: &str = "VMHOST_LEDGER_RACE_WORKER";
const N: usize = 6;
const REJECTION: &str = "dedicated placement needs 1 PUs";

fn wait_for(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One VM start: waits for `ctl/go`, admits a 1-vCPU dedicated VM on a 2-PU host; returns
/// "ok PU" or "err MESSAGE".
fn start_vm(run_dir: &Path, ctl: &Path, name: &str) -> String {
    let ledger = Ledger::open(run_dir).unwrap();
    let (spec, host) = (dedicated(name, 1), host("package:1 numa:1 core:2 pu:1"));
    wait_for(&ctl.join("go"));
    match ledger.admit(name, std::process::id(), None, planner(&spec, &host)) {
        Ok(a) => format!("ok {}", a.entry.vcpu_pus[0].unwrap()),
        Err(AdmitError::Plan(rejection)) => format!("err {rejection}"),
        Err(e) => panic!("{name}: ledger error: {e}"),
    }
}

/// The worker side: does nothing unless re-executed by the race test.
#[test]
fn race_worker() {
    let Ok(name) = std::env::var(WORKER_ENV) else {
        return;
    };
    let run_dir = PathBuf::from(std::env::var("RACE_RUN_DIR").unwrap());
    let ctl = PathBuf::from(std::env::var("RACE_CTL").unwrap());
    let result = start_vm(&run_dir, &ctl, &name);
    let tmp = ctl.join(format!(".{name}"));
    std::fs::write(&tmp, result).unwrap();
    std::fs::rename(&tmp, ctl.join(format!("{name}.result"))).unwrap();
    // Stay alive (holding the entry) until the test has looked at the ledger.
    wait_for(&ctl.join("done"));
}

struct Workers(Vec<std::process::Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn vms_starting_at_once_as_threads_and_processes_never_share_a_pu() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, ctl) = (dir.path().join("run"), dir.path().join("ctl"));
    std::fs::create_dir_all(&ctl).unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut workers = Workers(Vec::new());
    for i in 0..N {
        let child = Command::new(&exe)
            .args([
                "--exact",
                "race_worker",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(WORKER_ENV, format!("proc-{i}"))
            .env("RACE_RUN_DIR", &run_dir)
            .env("RACE_CTL", &ctl)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        workers.0.push(child);
    }
    let mut results: Vec<(String, String)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..N)
            .map(|i| {
                let (run_dir, ctl) = (&run_dir, &ctl);
                let name = format!("thread-{i}");
                s.spawn(move || (name.clone(), start_vm(run_dir, ctl, &name)))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(ctl.join("go"), "").unwrap();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for i in 0..N {
        let name = format!("proc-{i}");
        let path = ctl.join(format!("{name}.result"));
        wait_for(&path);
        results.push((name, std::fs::read_to_string(path).unwrap()));
    }

    let won: Vec<u32> = results
        .iter()
        .filter_map(|(_, r)| r.strip_prefix("ok ").map(|pu| pu.parse().unwrap()))
        .collect();
    assert_eq!(won.len(), 2, "{results:#?}");
    assert_eq!(
        won.iter().copied().collect::<BTreeSet<_>>(),
        BTreeSet::from([0, 1])
    );
    for (name, r) in results.iter().filter(|(_, r)| !r.starts_with("ok ")) {
        assert!(
            r.starts_with("err ") && r.contains(REJECTION),
            "{name}: {r}"
        );
    }
    let live = Ledger::open(&run_dir).unwrap().list().unwrap().entries;
    assert_eq!(live.len(), 2);
    assert!(live
        .iter()
        .all(|l| l.liveness == vmhost_ledger::Liveness::Alive));

    std::fs::write(ctl.join("done"), "").unwrap();
    for c in &mut workers.0 {
        assert!(c.wait().unwrap().success());
    }
}
