//! Helpers for the end-to-end tests: run the real `vmhost` binary.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Path of the repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs vmhost with `args` from the repository root.
pub fn vmhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

/// stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs vmhost and parses its stdout as JSON.
pub fn vmhost_json(args: &[&str]) -> (i32, serde_json::Value) {
    let o = vmhost(args);
    let v = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            stdout(&o),
            stderr(&o)
        )
    });
    (o.status.code().unwrap(), v)
}

/// Runs `vmhost --json --config <spec>` with a spec and run directory of its own (under a temp
/// directory named after `name`); returns (exit status, JSON on stdout, stdout+stderr for
/// assertion messages).
pub fn run_vm(name: &str, spec: &str) -> (i32, serde_json::Value, String) {
    let dir = std::env::temp_dir().join(format!("vmhost-run-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vm.toml");
    std::fs::write(&path, spec).unwrap();
    let run_dir = dir.join("run");
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--json",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--config",
            path.to_str().unwrap(),
        ])
        .current_dir(root())
        .output()
        .unwrap();
    let j = serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
    (
        o.status.code().unwrap_or(-1),
        j,
        format!("stdout:\n{}\nstderr:\n{}", stdout(&o), stderr(&o)),
    )
}

/// `vmhost ctl --api-socket <sock> <cmd>`: exit status and the JSON on stdout (`Null` when
/// there is none).
pub fn ctl(sock: &std::path::Path, cmd: &str) -> (i32, serde_json::Value) {
    let o = vmhost(&["ctl", "--api-socket", sock.to_str().unwrap(), cmd]);
    let v = serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
    (o.status.code().unwrap(), v)
}

/// Starts `vmhost --run-dir <d>/run --api-socket <d>/api.sock <extra> --config <spec>` (stdin
/// closed, stdout to `stdout`, stderr piped) and waits until its API reports the VM running.
pub fn start_with_api(
    d: &std::path::Path,
    spec: &std::path::Path,
    extra: &[&str],
    stdout: std::process::Stdio,
) -> (std::process::Child, PathBuf) {
    start_with_api_env(d, spec, extra, stdout, &[])
}

/// [`start_with_api`] with the environment variables `env` set for vmhost.
pub fn start_with_api_env(
    d: &std::path::Path,
    spec: &std::path::Path,
    extra: &[&str],
    stdout: std::process::Stdio,
    env: &[(&str, &str)],
) -> (std::process::Child, PathBuf) {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let sock = d.join("api.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--api-socket", sock.to_str().unwrap()])
        .args(extra)
        .args(["--config", spec.to_str().unwrap()])
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while ctl(&sock, "info").1["state"] != "running" {
        assert!(Instant::now() < deadline, "the VM never reported running");
        std::thread::sleep(Duration::from_millis(20));
    }
    (child, sock)
}

/// The `idle` payload's RAM pattern check on vCPU 0, from `GET /vm`:
/// `(ram_checked, ram_errors)` (pages verified, pages found wrong).
pub fn ram_check(sock: &std::path::Path) -> (u64, u64) {
    let p = &ctl(sock, "info").1["payload"][0];
    (
        p["ram_checked"].as_u64().unwrap_or(0),
        p["ram_errors"].as_u64().unwrap_or(u64::MAX),
    )
}

/// Waits (polling the API) until vCPU 0 of the `idle` VM at `sock` has verified a full pass of
/// its RAM pattern after `from` pages checked, every page found right; returns the count.
pub fn ram_pass(sock: &std::path::Path, from: u64) -> u64 {
    use std::time::{Duration, Instant};
    use vmhost_vcpu::payload::ramcheck::PAGES;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (checked, errors) = ram_check(sock);
        assert_eq!(
            errors, 0,
            "the guest found {errors} RAM pattern pages wrong"
        );
        if checked >= from + PAGES {
            return checked;
        }
        assert!(
            Instant::now() < deadline,
            "the guest checked {checked} RAM pattern pages, not a pass past {from}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An output as text: exit status, stdout, stderr.
pub fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        stdout(o),
        stderr(o)
    )
}

/// The idle payload's `(tsc_start, ticks)` of vCPU 0, from `GET /vm`.
pub fn progress(sock: &Path) -> (u64, u64) {
    let (_, info) = ctl(sock, "info");
    let p = &info["payload"][0];
    (
        p["tsc_start"].as_u64().unwrap_or(0),
        p["ticks"].as_u64().unwrap_or(0),
    )
}

/// Waits (polling the API) until vCPU 0's tick count passes `past`.
pub fn ticks_pass(sock: &Path, past: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, t) = progress(sock);
        if t > past {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "ticks stay at {t}, not past {past}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `text` without ANSI colour sequences (`ESC [ ... m`): vmhost's log lines as a test reads them.
pub fn plain(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// Waits for `child` to exit and returns its status; after `secs` it kills it and panics with
/// `why()`. Only a hang guard: the end awaited is an event (the process exits), not a duration.
pub fn wait_exit(
    child: &mut std::process::Child,
    secs: u64,
    why: impl Fn() -> String,
) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{}", why());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
