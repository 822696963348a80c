//! Helpers for the real-cgroup tests: plans for this host, child processes (this test binary
//! re-executed in a mode chosen by an environment variable), and checks that a cgroup's
//! directories are gone.
#![allow(dead_code, clippy::unwrap_used)]

pub mod children;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};

use vmhost_plan::{plan, Plan, PlanOptions};

/// Environment variable that turns the re-executed test binary into a child.
pub const CHILD_VAR: &str = "VMHOST_CGROUP_TEST_CHILD";
pub const MIB: u64 = 1 << 20;
pub const PAGE_2M: u64 = 2 << 20;

/// Fails with instructions unless this is a root process on a host with cgroup v1 cpuset and
/// memory (what these tests are about).
pub fn need_v1_root(test: &str) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "{test} creates cgroups and needs root");
    let h = vmhost_cgroup::detect().unwrap();
    for c in [
        vmhost_cgroup::Controller::Cpuset,
        vmhost_cgroup::Controller::Memory,
    ] {
        let m = h.controller(c).unwrap_or_else(|e| panic!("{test}: {e}"));
        assert_eq!(
            m.version,
            vmhost_cgroup::CgroupVersion::V1,
            "{test} is the cgroup v1 test"
        );
    }
}

/// A name no other test (or test run) uses.
pub fn unique(tag: &str) -> String {
    format!("t-{tag}-{}", std::process::id())
}

/// Plans `toml` against the live host.
pub fn plan_for(toml: &str) -> Plan {
    let spec = vmhost_config::from_toml_str(toml, "test.toml")
        .unwrap()
        .spec;
    let host = vmhost_topology::discover().unwrap();
    plan(&spec, &host, &PlanOptions::default())
        .into_result()
        .unwrap()
}

/// The VM's directories in every hierarchy that could hold them.
pub fn leaf_dirs(name: &str) -> Vec<PathBuf> {
    ["cpuset", "memory", "unified", "hugetlb"]
        .iter()
        .map(|h| PathBuf::from(format!("/sys/fs/cgroup/{h}/vmhost/{name}")))
        .collect()
}

pub fn assert_gone(name: &str) {
    for d in leaf_dirs(name) {
        assert!(!d.exists(), "{} was left behind", d.display());
    }
}

/// A child process: this binary re-executed in `mode`; killed on drop if still running.
pub struct Kid {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub out: BufReader<ChildStdout>,
}

impl Kid {
    pub fn spawn(mode: &str) -> Kid {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD_VAR, mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let out = BufReader::new(child.stdout.take().unwrap());
        Kid { child, stdin, out }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn say(&mut self, line: &str) {
        let s = self.stdin.as_mut().unwrap();
        writeln!(s, "{line}").unwrap();
        s.flush().unwrap();
    }

    /// The next line the child printed with `@` (the test harness prints its own lines too),
    /// from after the `@`.
    pub fn hear(&mut self) -> String {
        loop {
            let mut line = String::new();
            assert_ne!(
                self.out.read_line(&mut line).unwrap(),
                0,
                "child closed stdout"
            );
            // The harness's "test child_entry ... " may precede the first line on its line.
            if let Some((_, l)) = line.trim_end().split_once('@') {
                return l.to_string();
            }
        }
    }

    pub fn signal(&self, sig: i32) {
        let pid = libc::pid_t::try_from(self.pid()).unwrap();
        // SAFETY: kill takes no pointers; `pid` is our unreaped child, so it names no other
        // process.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    }

    /// Waits up to `secs` for the child to end by itself; kills it and panics after that.
    pub fn wait_within(&mut self, secs: u64, what: &str) -> ExitStatus {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            if std::time::Instant::now() > end {
                let _ = self.child.kill();
                panic!("{what}: the child did not end within {secs} s");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// The child's stderr, once it has ended.
    pub fn stderr(&mut self) -> String {
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            std::io::Read::read_to_string(&mut e, &mut err).unwrap();
        }
        err
    }

    /// Closes stdin and waits; returns the status and the child's stderr.
    pub fn finish(mut self) -> (ExitStatus, String) {
        drop(self.stdin.take());
        let mut err = String::new();
        let stderr = self.child.stderr.take();
        let status = self.child.wait().unwrap();
        if let Some(mut e) = stderr {
            std::io::Read::read_to_string(&mut e, &mut err).unwrap();
        }
        (status, err)
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The scheduler state letter of each thread of `pid` (`D`: waiting in the kernel).
pub fn thread_states(pid: u32) -> String {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .filter_map(|s| s.rsplit_once(") ").and_then(|(_, r)| r.chars().next()))
        .collect()
}

/// How a child ended, in words for assertion messages.
pub fn describe(status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "unknown".into(),
    }
}

/// Reads one line from stdin (the parent's go-ahead); `None` at EOF.
pub fn wait_parent() -> Option<String> {
    let mut line = String::new();
    match std::io::stdin().read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(line.trim().to_string()),
    }
}

/// Prints a protocol line for the parent.
pub fn tell_parent(line: &str) {
    let mut o = std::io::stdout().lock();
    writeln!(o, "@{line}").unwrap();
    o.flush().unwrap();
}
