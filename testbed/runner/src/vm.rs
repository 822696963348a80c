//! Driving the real `vmhost` binary: specs written to files, runs with a time limit, VMs left
//! running in the background with a control socket, and the clean-up between tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long any one vmhost command may take inside the emulated host.
const COMMAND_LIMIT: Duration = Duration::from_secs(120);

/// What the runner does now (the last step any thread began), for the watchdog's report.
static STEP: Mutex<String> = Mutex::new(String::new());

/// Records the step the runner begins, with the host's uptime.
pub fn set_step(step: &str) {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap_or_default();
    let since = uptime.split_whitespace().next().unwrap_or("?");
    *STEP.lock().unwrap_or_else(|p| p.into_inner()) = format!("{step} (since uptime {since} s)");
}

/// The step [`set_step`] recorded last.
pub fn step() -> String {
    STEP.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The finished run of a vmhost command.
#[derive(Debug)]
pub struct Output {
    /// Exit status (`-1` when killed by a signal).
    pub code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl Output {
    /// Parses standard output as JSON.
    pub fn json(&self) -> Result<Value, String> {
        serde_json::from_str(&self.stdout)
            .map_err(|e| format!("vmhost printed no JSON ({e}); stderr: {}", self.stderr))
    }

    /// Fails unless the exit status is `want`, quoting stderr.
    pub fn expect_code(&self, want: i32) -> Result<&Self, String> {
        if self.code == want {
            Ok(self)
        } else {
            Err(format!(
                "vmhost exited {} (want {want}); stderr: {}",
                self.code,
                self.stderr.trim()
            ))
        }
    }
}

/// A VM running in the background.
#[derive(Debug)]
pub struct Running {
    /// The vmhost process id (what was started, signalled and waited for).
    pub pid: u32,
    /// The process that runs the vCPUs: `pid` itself, or its child when vmhost supervises
    /// the VMM from outside a cgroup v2 envelope (`--cgroup`).
    pub vmm: u32,
    /// Its control socket.
    pub socket: PathBuf,
    err: PathBuf,
}

/// The test environment: the vmhost binary, a work directory, a run directory for the ledger
/// and every background process a test started (killed by [`Env::cleanup`]).
#[derive(Debug)]
pub struct Env {
    vmhost: PathBuf,
    /// Scratch directory for specs and logs.
    pub work: PathBuf,
    /// The ledger's run directory.
    pub run_dir: PathBuf,
    /// Every VM a test started in the background, with its name.
    children: Mutex<Vec<(String, Child)>>,
    /// Cgroup directories a test created, removed at clean-up.
    pub cgroups: Mutex<Vec<PathBuf>>,
}

impl Env {
    /// Checks the host has what every test needs (no test may skip).
    pub fn new(vmhost: &str) -> Result<Self, String> {
        let vmhost =
            std::fs::canonicalize(vmhost).map_err(|e| format!("vmhost binary {vmhost}: {e}"))?;
        if !Path::new("/dev/kvm").exists() {
            return Err("/dev/kvm is missing: kvm_amd did not load (see the serial log)".into());
        }
        let work = PathBuf::from("/tmp/testbed");
        let run_dir = work.join("run");
        // Private (0700): the ledger refuses a run directory others can write.
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(&run_dir)
            .map_err(|e| format!("create {}: {e}", run_dir.display()))?;
        Ok(Env {
            vmhost,
            work,
            run_dir,
            children: Mutex::new(Vec::new()),
            cgroups: Mutex::new(Vec::new()),
        })
    }

    /// Writes a spec file named `<name>.toml` and returns its path.
    pub fn spec(&self, name: &str, toml: &str) -> Result<PathBuf, String> {
        let path = self.work.join(format!("{name}.toml"));
        std::fs::write(&path, toml).map_err(|e| format!("write {}: {e}", path.display()))?;
        Ok(path)
    }

    /// The vmhost binary the suite runs.
    pub fn vmhost(&self) -> &Path {
        &self.vmhost
    }

    /// A vmhost command with the shared run directory.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.vmhost);
        c.arg("--run-dir").arg(&self.run_dir).args(args);
        c
    }

    /// Runs vmhost to completion (at most two minutes).
    pub fn run(&self, args: &[&str]) -> Result<Output, String> {
        run_command(self.command(args), &format!("vmhost {}", args.join(" ")))
    }

    /// Runs `vmhost plan --json --config SPEC` and returns the plan.
    pub fn plan(&self, spec: &Path) -> Result<Value, String> {
        let spec = spec.to_string_lossy();
        self.run(&["plan", "--json", "--config", &spec])?.json()
    }

    /// Starts a VM in the background with a control socket and waits until its API says
    /// `running` (every vCPU thread set up and pinned) and its `vcpus` vCPU threads are found.
    pub fn start(&self, name: &str, cmd: Command, vcpus: usize) -> Result<Running, String> {
        self.start_watching(name, cmd, vcpus, &mut |_| false)
    }

    /// [`Env::start`], calling `watch(pid)` at every poll while the VM starts up (to catch
    /// short-lived threads such as the prefault workers). While `watch` returns true the
    /// runner polls every 2 ms and asks the API for the state only every 50th time.
    pub fn start_watching(
        &self,
        name: &str,
        cmd: Command,
        vcpus: usize,
        watch: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Running, String> {
        set_step(&format!("starting VM {name}"));
        let (mut child, mut vm) = self.spawn_child(name, cmd)?;
        let pid = vm.pid;
        set_step(&format!("waiting for VM {name} (pid {pid}) to run"));
        let deadline = Instant::now() + COMMAND_LIMIT;
        let mut polls = 0u32;
        loop {
            let fast = watch(pid);
            polls = polls.wrapping_add(1);
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "VM {name} ended before it was ready ({status}); stderr: {}",
                    vm.stderr()
                ));
            }
            let has_vcpus = |p: u32| {
                crate::host::threads(p)
                    .map(|t| t.iter().filter(|t| t.name.starts_with("vcpu")).count() == vcpus)
                    .unwrap_or(false)
            };
            // Running (in the API) means every vCPU thread is set up and pinned.
            let ask = !fast || polls % 50 == 0;
            if ask && vm.socket.exists() && self.state(&vm).as_deref() == Some("running") {
                if let Some(vmm) = std::iter::once(pid)
                    .chain(crate::host::children(pid))
                    .find(|&p| has_vcpus(p))
                {
                    vm.vmm = vmm;
                    break;
                }
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(format!(
                    "VM {name} not ready within {COMMAND_LIMIT:?}; stderr: {}",
                    vm.stderr()
                ));
            }
            std::thread::sleep(Duration::from_millis(if fast { 2 } else { 100 }));
        }
        self.lock_children().push((name.to_string(), child));
        Ok(vm)
    }

    /// Starts `cmd` with an API socket (`<name>.sock`), stdout in `<name>.out` and stderr in
    /// `<name>.err` under the work directory.
    fn spawn_child(&self, name: &str, mut cmd: Command) -> Result<(Child, Running), String> {
        let socket = self.work.join(format!("{name}.sock"));
        let out = self.work.join(format!("{name}.out"));
        let err = self.work.join(format!("{name}.err"));
        let _ = std::fs::remove_file(&socket);
        let file =
            |p: &Path| std::fs::File::create(p).map_err(|e| format!("create {}: {e}", p.display()));
        cmd.arg("--api-socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(file(&out)?)
            .stderr(file(&err)?);
        let child = cmd.spawn().map_err(|e| format!("spawn vmhost: {e}"))?;
        let pid = child.id();
        let vm = Running {
            pid,
            vmm: pid,
            socket,
            err,
        };
        Ok((child, vm))
    }

    /// Starts `cmd` in the background as [`Env::start`] does, without waiting for a VM (a
    /// `vmhost receive` has none until one arrives); [`Env::wait`] and [`Env::cleanup`] know it.
    pub fn spawn(&self, name: &str, cmd: Command) -> Result<Running, String> {
        let (child, vm) = self.spawn_child(name, cmd)?;
        self.lock_children().push((name.to_string(), child));
        Ok(vm)
    }

    /// The VM's state from its control API (`GET /vm`), if it answers.
    fn state(&self, vm: &Running) -> Option<String> {
        let sock = vm.socket.to_string_lossy().to_string();
        let out = self.run(&["ctl", "--api-socket", &sock, "info"]).ok()?;
        let info = out.json().ok()?;
        info["state"].as_str().map(str::to_string)
    }

    /// Asks a running VM to stop through its control API and waits for its exit status.
    pub fn shutdown(&self, vm: &Running) -> Result<i32, String> {
        let sock = vm.socket.to_string_lossy().to_string();
        self.run(&["ctl", "--api-socket", &sock, "shutdown"])?
            .expect_code(0)?;
        self.wait(vm.pid)
    }

    /// Asks a running VM to stop and fails unless it exits 0.
    pub fn shutdown_ok(&self, vm: &Running) -> Result<(), String> {
        let code = self.shutdown(vm)?;
        if code != 0 {
            return Err(format!(
                "exit {code} after shutdown; stderr: {}",
                vm.stderr()
            ));
        }
        Ok(())
    }

    /// Waits for a background VM to end and returns its exit status.
    pub fn wait(&self, pid: u32) -> Result<i32, String> {
        set_step(&format!("waiting for pid {pid} to end"));
        let deadline = Instant::now() + COMMAND_LIMIT;
        loop {
            {
                let mut children = self.lock_children();
                if let Some(i) = children.iter().position(|(_, c)| c.id() == pid) {
                    if let Ok(Some(status)) = children[i].1.try_wait() {
                        // Already reaped: wait() returns the status try_wait saw.
                        let _ = children.remove(i).1.wait();
                        return Ok(status.code().unwrap_or(-1));
                    }
                } else {
                    return Err(format!("pid {pid} is not a VM of this test"));
                }
            }
            if Instant::now() > deadline {
                return Err(format!("pid {pid} did not end within {COMMAND_LIMIT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends `signal` to a background VM.
    pub fn signal(&self, pid: u32, signal: i32) -> Result<(), String> {
        let pid = libc::pid_t::try_from(pid).map_err(|e| e.to_string())?;
        // SAFETY: kill(2) only sends a signal; `pid` is a child this runner started and has
        // not reaped yet (it is still in `children`), so the pid cannot have been reused.
        let r = unsafe { libc::kill(pid, signal) };
        if r != 0 {
            return Err(format!("kill {pid}: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Ends every background VM and every other `vmhost` process a test left, and removes
    /// the cgroups it created. `Err` names each leftover that had to be killed or removed:
    /// the test that left it fails.
    pub fn cleanup(&self) -> Result<(), String> {
        set_step("cleaning up after the test");
        let mut leaked = Vec::new();
        for (name, mut c) in std::mem::take(&mut *self.lock_children()) {
            if let Ok(None) = c.try_wait() {
                leaked.push(format!("VM {name} (vmhost pid {}) still running", c.id()));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        // What the test started some other way, or what a killed supervisor left (its VMM).
        for (pid, cmdline) in crate::host::processes_of(&self.vmhost) {
            leaked.push(format!("vmhost pid {pid} still running ({cmdline})"));
            crate::host::kill_and_reap(pid);
        }
        let cgroups = std::mem::take(&mut *self.cgroups.lock().unwrap_or_else(|p| p.into_inner()));
        for dir in cgroups.iter().rev() {
            match std::fs::remove_dir(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    leaked.push(format!("cgroup {} not removable: {e}", dir.display()));
                }
                _ => {}
            }
        }
        if leaked.is_empty() {
            Ok(())
        } else {
            Err(leaked.join("; "))
        }
    }

    fn lock_children(&self) -> std::sync::MutexGuard<'_, Vec<(String, Child)>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Running {
    /// What the VM printed on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Has the vmhost process ended? Nothing waits for it before the test does, so an ended
    /// one is a zombie (`Z` in `/proc/<pid>/stat`), or gone.
    pub fn ended(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).map_or(true, |stat| {
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
    }
}

/// Runs a command to completion within [`COMMAND_LIMIT`], capturing its output.
pub fn run_command(cmd: Command, what: &str) -> Result<Output, String> {
    run_command_for(cmd, what, COMMAND_LIMIT)
}

/// [`run_command`] within `limit`; a command that does not finish is killed and its stderr
/// so far is in the error.
pub fn run_command_for(mut cmd: Command, what: &str, limit: Duration) -> Result<Output, String> {
    // A tag no other command of this runner has, whichever thread runs it.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = std::env::temp_dir();
    let tag = format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let (out_path, err_path) = (
        dir.join(format!("cmd-{tag}.out")),
        dir.join(format!("cmd-{tag}.err")),
    );
    let file =
        |p: &Path| std::fs::File::create(p).map_err(|e| format!("create {}: {e}", p.display()));
    cmd.stdin(Stdio::null())
        .stdout(file(&out_path)?)
        .stderr(file(&err_path)?);
    set_step(&format!("spawning {what}"));
    let mut child = cmd.spawn().map_err(|e| format!("{what}: spawn: {e}"))?;
    set_step(&format!("running {what} (pid {})", child.id()));
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                let err = std::fs::read_to_string(&err_path).unwrap_or_default();
                let _ = (
                    std::fs::remove_file(&out_path),
                    std::fs::remove_file(&err_path),
                );
                return Err(format!(
                    "{what}: did not finish within {limit:?}; stderr: {err}"
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("{what}: wait: {e}")),
        }
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = (
        std::fs::remove_file(&out_path),
        std::fs::remove_file(&err_path),
    );
    Ok(Output {
        code: status.code().unwrap_or(-1),
        stdout,
        stderr,
    })
}

/// A dedicated-placement spec with 2 MiB hugepages and the built-in `payload`.
pub fn dedicated_spec(
    name: &str,
    sockets: u32,
    cores: u32,
    extra_cpu: &str,
    memory: &str,
    payload: &str,
) -> String {
    format!(
        "name = \"{name}\"\n[cpu]\nsockets = {sockets}\ncores = {cores}\nthreads = 1\n\
         dedicated_cpu_placement = true\n{extra_cpu}\n\
         [memory]\nguest = \"{memory}\"\nhugepages = {{ page_size = \"2Mi\" }}\n\
         [devices]\nautoattach_graphics_device = false\n[boot]\npayload = \"{payload}\"\n"
    )
}

/// The JSON value at a `/`-separated path, or an error naming the path.
pub fn at<'a>(v: &'a Value, path: &str) -> Result<&'a Value, String> {
    v.pointer(path)
        .ok_or_else(|| format!("no {path} in vmhost's JSON"))
}

/// A JSON array of integers.
pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect()
        })
        .unwrap_or_default()
}

/// A JSON number that must be a `u32` (a PU, a node), or an error naming `what`.
pub fn num(v: &Value, what: &str) -> Result<u32, String> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| format!("{what} is {v}, not a PU or node number"))
}

/// A JSON number as `u32`, if it is one.
pub fn opt_num(v: &Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// `METHOD uri` with no body on a vmhost API socket (HTTP/1.1, one request per connection):
/// the body of a 2xx answer; any other answer is an error naming it.
pub(crate) fn api_call(sock: &Path, method: &str, uri: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let what = format!("{method} {uri}");
    let mut s = std::os::unix::net::UnixStream::connect(sock)
        .map_err(|e| format!("{}: {e}", sock.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "{what} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    .map_err(|e| format!("{what}: {e}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .map_err(|e| format!("{what}: {e}"))?;
    crate::ensure!(answer.starts_with("HTTP/1.1 2"), "{what}: {answer}");
    Ok(answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string()))
}

#[cfg(test)]
mod cleanup_tests {
    use super::*;

    /// An environment whose "vmhost" is a private copy of `sleep`: only the processes this
    /// test starts from it can match, never anyone else's.
    /// Starts the copied binary. The copy was just written: a thread of this test binary
    /// that forks meanwhile (another test spawning a child) holds the copy's write descriptor
    /// until its child execs, and exec then fails with ETXTBSY; that race is retried.
    fn spawn_copy(bin: &Path, arg: &str) -> std::process::Child {
        for _ in 0..100 {
            match Command::new(bin).arg(arg).spawn() {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                other => return other.unwrap(),
            }
        }
        panic!("{} stays busy (ETXTBSY)", bin.display());
    }

    fn env_with_private_binary(dir: &Path) -> Env {
        let bin = dir.join("vmhost-under-test");
        std::fs::copy("/bin/sleep", &bin).unwrap();
        Env {
            vmhost: std::fs::canonicalize(&bin).unwrap(),
            work: dir.to_path_buf(),
            run_dir: dir.join("run"),
            children: Mutex::new(Vec::new()),
            cgroups: Mutex::new(Vec::new()),
        }
    }

    #[test]
    fn cleanup_fails_naming_a_leaked_vm_and_an_untracked_vmhost() {
        let dir = std::env::temp_dir().join(format!("testbed-cleanup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let env = env_with_private_binary(&dir);
        assert_eq!(env.cleanup(), Ok(()), "nothing started, nothing leaked");

        let tracked = spawn_copy(&env.vmhost, "600");
        let tracked_pid = tracked.id();
        env.lock_children().push(("leaky".into(), tracked));
        // Started some other way (as a supervisor's orphaned VMM would be).
        let mut untracked = spawn_copy(&env.vmhost, "601");
        let untracked_pid = untracked.id();
        let why = env.cleanup().unwrap_err();
        assert!(
            why.contains(&format!(
                "VM leaky (vmhost pid {tracked_pid}) still running"
            )),
            "{why}"
        );
        assert!(
            why.contains(&format!("vmhost pid {untracked_pid} still running")),
            "{why}"
        );
        // The untracked one was SIGKILLed by cleanup(): reaping it shows the signal.
        let status = untracked.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        assert!(crate::host::processes_of(&env.vmhost).is_empty());
        assert_eq!(env.cleanup(), Ok(()), "the second clean-up finds nothing");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A test that passes but leaves a VM running fails, naming it (`run_one` is what the
    /// runner calls for every test).
    #[test]
    fn a_passing_test_that_leaks_a_vm_fails() {
        let dir = std::env::temp_dir().join(format!("testbed-leak-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let env = env_with_private_binary(&dir);
        fn leaks(env: &Env) -> crate::Outcome {
            let child = spawn_copy(&env.vmhost, "602");
            env.lock_children().push(("forgotten".into(), child));
            Ok(())
        }
        let outcome = crate::run_one(&env, leaks);
        let why = outcome.unwrap_err();
        assert!(why.starts_with("it left behind VM forgotten"), "{why}");
        assert_eq!(crate::run_one(&env, |_| Ok(())), Ok(()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
