//! Syscall filters on the real `vmhost` binary (docs/security.md, "Syscall filters"): every
//! thread of a running VM with a virtio disk and rng, the control API and a serial console
//! runs in seccomp filter mode (`Seccomp: 2` in `/proc/<pid>/task/<tid>/status`), none with
//! `--seccomp off`, and a forbidden call on a vCPU thread kills vmhost with SIGSYS after it
//! names the thread and the call.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmhost_testsupport::pvh::pvh_elf;
use vmhost_testsupport::{lock_cpus, need_kvm};

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmhost-seccomp-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A PVH "kernel" that prints `up` on COM1 and then halts forever (interrupts off: the vCPU
/// sleeps in KVM), with a virtio disk (an empty scratch image) and a virtio-rng: the VM has
/// every kind of long-lived thread.
fn linux_spec(d: &Path) -> PathBuf {
    let mut code = vmhost_testsupport::pvh::out8(0x3f8, b'u');
    code.extend(vmhost_testsupport::pvh::out8(0x3f8, b'p'));
    code.extend(vmhost_testsupport::pvh::out8(0x3f8, b'\n'));
    code.extend_from_slice(&[0xf4, 0xeb, 0xfd]); // hlt; jmp hlt
    let kernel = d.join("kernel.elf");
    std::fs::write(&kernel, pvh_elf(&code)).unwrap();
    let spec = format!(
        "name = \"seccomp-vm\"\n[cpu]\ncores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
         [memory]\nguest = \"64Mi\"\n[[devices.disks]]\nname = \"scratch\"\n[devices.rng]\n\
         [[volumes]]\nname = \"scratch\"\nempty_disk = {{ capacity = \"4Mi\" }}\n[boot]\nkernel = \"{}\"\n",
        kernel.display()
    );
    let path = d.join("vm.toml");
    std::fs::write(&path, spec).unwrap();
    path
}

/// Thread name → `Seccomp:` values of vmhost's threads (KVM's own `kvm-*` workers, which the
/// kernel starts in the process, are left out: they run no vmhost code).
fn threads(pid: u32) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(task.join("comm")),
            std::fs::read_to_string(task.join("status")),
        ) else {
            continue; // the thread ended meanwhile
        };
        let name = comm.trim().to_owned();
        if name.starts_with("kvm-") {
            continue;
        }
        let mode = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .unwrap()
            .trim()
            .to_owned();
        out.entry(name).or_default().push(mode);
    }
    out
}

/// The threads a running Linux VM with devices, API and serial output has (`vmhost-kvmpin`
/// may have ended already; it is checked when it is there).
const EXPECTED: [&str; 9] = [
    "vmhost",
    "vmhost-sig",
    "vmhost-emu",
    "vcpu0",
    "vmhost-api",
    "vmhost-grace",
    "vmhost-io-0",
    "vmhost-serial",
    "vmhost-diag",
];

/// Waits until every expected thread is there and shows `want` (the main thread installs its
/// filter just after the guest starts), then returns what it saw.
fn settled(pid: u32, want: &str) -> BTreeMap<String, Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = threads(pid);
        let complete = EXPECTED.iter().all(|t| seen.contains_key(*t));
        if complete && seen.values().flatten().all(|m| m == want) {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "threads never all showed Seccomp: {want}: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stop(mut child: Child) -> (Option<i32>, String) {
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = std::mem::take(&mut child.stderr);
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    if let Some(mut e) = out {
        use std::io::Read;
        e.read_to_string(&mut stderr).unwrap();
    }
    (status.code(), stderr)
}

#[test]
fn every_thread_of_a_running_vm_is_filtered_and_the_vm_still_works() {
    let test = "every_thread_of_a_running_vm_is_filtered_and_the_vm_still_works";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("on");
    let spec = linux_spec(&d);
    let (child, sock) = common::start_with_api(&d, &spec, &[], Stdio::piped());
    let seen = settled(child.id(), "2");
    println!("threads (name: Seccomp per thread): {seen:?}");
    // The API thread serves every request under its filter, and so do the vCPU and emulator
    // threads a pause and a resume go through.
    for cmd in ["placement", "resources", "pause", "resume", "info"] {
        let (code, body) = common::ctl(&sock, cmd);
        assert_eq!(code, 0, "ctl {cmd}: {body}");
    }
    assert_eq!(common::ctl(&sock, "info").1["state"], "running");
    let after = threads(child.id());
    assert!(after.values().flatten().all(|m| m == "2"), "{after:?}");
    let (code, stderr) = stop(child);
    assert!(!stderr.contains("forbidden"), "{stderr}");
    assert_eq!(code, Some(130), "SIGTERM stops the VM in order: {stderr}");
    assert!(!sock.exists(), "the socket is removed at the stop");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A pseudo-terminal pair: (master, the slave opened as a file for vmhost's stdin).
fn pty() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    // SAFETY: posix_openpt returns a new descriptor or -1; it is owned by the File below.
    let master = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY) };
    assert!(
        master >= 0,
        "posix_openpt: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `master` is a descriptor nothing else owns.
    let master_file = unsafe { std::fs::File::from_raw_fd(master) };
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: grantpt/unlockpt take the master descriptor; ptsname_r writes at most
    // `name.len()` bytes into `name`.
    let ok = unsafe {
        libc::grantpt(master) == 0
            && libc::unlockpt(master) == 0
            && libc::ptsname_r(master, name.as_mut_ptr(), name.len()) == 0
    };
    assert!(ok, "pty set-up: {}", std::io::Error::last_os_error());
    // SAFETY: ptsname_r wrote a NUL-terminated path into `name`.
    let path = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) };
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path.to_str().unwrap())
        .unwrap();
    (master_file, slave)
}

/// With a terminal as stdin the console input thread runs too, filtered: it reads what is
/// typed, and restores the terminal's mode at the stop under its filter.
#[test]
fn the_console_input_thread_is_filtered_and_restores_the_terminal() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let test = "the_console_input_thread_is_filtered_and_restores_the_terminal";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("stdin");
    let spec = linux_spec(&d);
    let (mut master, slave) = pty();
    // SAFETY: an all-zero termios is valid storage for tcgetattr to fill.
    let mut before: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `slave` is an open terminal; `before` is writable.
    let got = unsafe { libc::tcgetattr(slave.as_raw_fd(), &mut before) };
    assert_eq!(got, 0);
    let sock = d.join("api.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--api-socket", sock.to_str().unwrap()])
        .args(["--config", spec.to_str().unwrap()])
        .stdin(slave.try_clone().unwrap())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen = threads(child.id());
        let filtered = |t: &str| seen.get(t).is_some_and(|m| m.iter().all(|m| m == "2"));
        if filtered("vmhost-stdin") && filtered("vmhost") {
            println!("threads (name: Seccomp per thread): {seen:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no filtered vmhost-stdin thread: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    master.write_all(b"typed\r").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let (code, stderr) = stop(child);
    assert!(!stderr.contains("forbidden"), "{stderr}");
    assert_eq!(code, Some(130), "{stderr}");
    // SAFETY: an all-zero termios is valid storage for tcgetattr to fill.
    let mut after: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: `slave` is still open; `after` is writable.
    let got = unsafe { libc::tcgetattr(slave.as_raw_fd(), &mut after) };
    assert_eq!(got, 0);
    assert_eq!(
        (after.c_lflag, after.c_iflag),
        (before.c_lflag, before.c_iflag),
        "the terminal's mode is restored"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn seccomp_off_leaves_every_thread_unfiltered() {
    let test = "seccomp_off_leaves_every_thread_unfiltered";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("off");
    let spec = linux_spec(&d);
    let (child, _sock) = common::start_with_api(&d, &spec, &["--seccomp", "off"], Stdio::piped());
    let seen = settled(child.id(), "0");
    println!("threads (name: Seccomp per thread): {seen:?}");
    let (code, stderr) = stop(child);
    assert_eq!(code, Some(130), "{stderr}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_forbidden_call_on_a_vcpu_thread_kills_vmhost_with_sigsys_naming_thread_and_call() {
    let test = "a_forbidden_call_on_a_vcpu_thread_kills_vmhost_with_sigsys_naming_thread_and_call";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("selftest");
    let spec = d.join("vm.toml");
    std::fs::write(
        &spec,
        // `halt` ends by itself: a self-test that failed to kill vmhost fails, not hangs.
        "name = \"seccomp-selftest\"\n[cpu]\ncores = 1\n[memory]\nguest = \"32Mi\"\n[boot]\npayload = \"halt\"\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args([
            "--run-dir",
            d.join("run").to_str().unwrap(),
            "--seccomp",
            "on",
        ])
        .args(["--config", spec.to_str().unwrap()])
        .env("VMHOST_SECCOMP_SELFTEST", "vcpu")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("seccomp"))
        .unwrap_or_else(|| panic!("no seccomp line: {stderr}"));
    assert!(
        line.starts_with("vmhost: seccomp: thread vcpu0 (tid ")
            && line.ends_with(
                ", vcpu filter) made the forbidden system call socket (41); SIGSYS kills the process"
            ),
        "{line}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// The diagnostics writer installs its own filter, and the `SIGSYS` line of a forbidden call
/// there reaches stderr directly (it never goes through the writer's buffer).
#[test]
fn a_forbidden_call_on_the_diagnostics_writer_kills_vmhost_with_sigsys_naming_it() {
    let test = "a_forbidden_call_on_the_diagnostics_writer_kills_vmhost_with_sigsys_naming_it";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("selftest-diag");
    let spec = d.join("vm.toml");
    std::fs::write(
        &spec,
        "name = \"seccomp-selftest-diag\"\n[cpu]\ncores = 1\n[memory]\nguest = \"32Mi\"\n[boot]\npayload = \"halt\"\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--seccomp", "on", "--config", spec.to_str().unwrap()])
        .env("VMHOST_SECCOMP_SELFTEST", "diag")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("seccomp"))
        .unwrap_or_else(|| panic!("no seccomp line: {stderr}"));
    assert!(
        line.starts_with("vmhost: seccomp: thread vmhost-diag (tid ")
            && line.ends_with(
                ", diag filter) made the forbidden system call socket (41); SIGSYS kills the process"
            ),
        "{line}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_bad_vmhost_seccomp_variable_is_refused_naming_it() {
    let o = Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(["plan", "--config", "configs/quickstart.toml"])
        .current_dir(common::root())
        .env("VMHOST_SECCOMP", "of")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        common::stderr(&o),
        "vmhost: VMHOST_SECCOMP = \"of\": not a seccomp mode; set it to on, log or off, or unset it\n"
    );
}

#[test]
fn a_bad_seccomp_mode_is_refused_naming_the_choices() {
    let o = common::vmhost(&["--seccomp", "maybe", "plan"]);
    assert_eq!(o.status.code(), Some(2));
    let e = common::stderr(&o);
    assert!(
        e.contains("--seccomp") && e.contains("maybe") && e.contains("on, log, off"),
        "{e}"
    );
}

/// vmhost started under an outer seccomp filter (here one that allows everything, as a
/// container runtime's default profile does for what vmhost calls) runs its VM to the end:
/// threads that are already in seccomp mode when vmhost installs its own filters must still
/// get every call they make onto vmhost's lists (a vCPU thread's first `HashMap` draws its
/// seeds with `getrandom`). It was killed with SIGSYS (exit 159) before.
#[test]
fn vmhost_under_an_outer_seccomp_filter_runs_its_vm() {
    let test = "vmhost_under_an_outer_seccomp_filter_runs_its_vm";
    if !need_kvm(test) {
        return;
    }
    let _cpus = lock_cpus();
    let d = dir("outer");
    let spec = linux_spec(&d);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmhost"));
    let api = d.join("api.sock");
    cmd.args(["--run-dir", d.join("run").to_str().unwrap()])
        .args(["--api-socket", api.to_str().unwrap()])
        .args(["--seccomp", "on", "--config", spec.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    vmhost_testsupport::outer_seccomp::allow_all(&mut cmd);
    let mut child = cmd.spawn().unwrap();
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    // Running: the guest printed `up` (its vCPU ran), every thread is filtered.
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut seen = Vec::new();
    for line in std::io::BufRead::lines(out).map_while(Result::ok) {
        let up = line.trim() == "up";
        seen.push(line);
        if up {
            break;
        }
    }
    assert_eq!(
        seen.last().map(|l| l.trim()),
        Some("up"),
        "the guest never printed `up` ({:?}): {seen:#?}",
        child.try_wait()
    );
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(status.contains("Seccomp:\t2"), "{status}");
    while Instant::now() < deadline && threads(pid).values().flatten().count() < 3 {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "vmhost ended: {:?}",
        child.wait()
    );
    // The control API answers (its thread is filtered too).
    assert_eq!(common::ctl(&api, "info").1["state"], "running");
    // SIGTERM: the orderly stop, exit 130.
    Command::new("kill").arg(pid.to_string()).status().unwrap();
    let output = child.wait_with_output().unwrap();
    assert_eq!(
        output.status.code(),
        Some(130),
        "{:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::remove_dir_all(&d).unwrap();
}
