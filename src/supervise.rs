//! The supervisor that makes a cgroup v2 envelope breach a reported stop, not a silent kill.
//!
//! On cgroup v2 the kernel OOM-kills at `memory.max`; a VMM inside the cgroup cannot report
//! its own death. So before the VMM joins the cgroup, vmhost forks: the **child** becomes the
//! VMM (joins the cgroup, runs the VM, prints the results, releases its ledger entry as
//! usual); the **parent** stays outside the cgroup as a small supervisor. It forwards stop
//! signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT) to the VMM as SIGTERM and exits with the VMM's
//! status. When a signal killed the VMM, it restores the terminal, removes the API socket, the
//! ledger entry and the cgroup, and exits with [`EXIT_LIMIT`] and the limit message when the
//! cgroup's `memory.events` shows the OOM kill (128 + signal otherwise).
//!
//! The ledger entry keeps the supervisor's pid (admission happened before the fork), which
//! lives exactly as long as the VM. On cgroup v1 none of this is needed: the in-process watch
//! holds the OOM killer off and reports (see `enforce`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use vmhost_cgroup::Cgroup;

use crate::enforce::EXIT_LIMIT;
use crate::sys::{self, ChildEnd};

/// What the supervisor cleans up when the VMM is killed.
#[derive(Debug, Clone)]
pub struct Leftovers {
    /// The ledger's run directory and the VM's name.
    pub ledger: (PathBuf, String),
    /// The pid the ledger entry was admitted under (this process).
    pub ledger_pid: u32,
    /// The control API socket the VMM serves, if any.
    pub api_socket: Option<PathBuf>,
    /// The vsock device's Unix socket, if the VM has one.
    pub vsock_socket: Option<PathBuf>,
}

/// Forks the VMM off a supervisor. Returns the cgroup in the child (the VMM), which goes on
/// to join it; the parent supervises and exits the process with the VMM's status.
pub fn split(cg: Cgroup, leftovers: &Leftovers) -> Result<Cgroup> {
    let threads = sys::thread_count();
    if threads != 1 {
        bail!("cannot start the cgroup v2 supervisor: vmhost already runs {threads} threads");
    }
    let terminal = sys::save_terminal();
    let parent = libc::pid_t::try_from(std::process::id()).context("pid")?;
    match sys::fork().context("forking the VMM off its cgroup v2 supervisor")? {
        None => {
            // The VMM: stop (SIGTERM is a stop request) when the supervisor is gone.
            if !sys::stop_with_parent(parent, libc::SIGTERM) {
                bail!("the cgroup v2 supervisor ended before the VMM started");
            }
            Ok(cg)
        }
        Some(child) => supervise(child, cg, leftovers, terminal.as_ref()),
    }
}

fn supervise(
    child: libc::pid_t,
    cg: Cgroup,
    leftovers: &Leftovers,
    terminal: Option<&libc::termios>,
) -> ! {
    if let Err(e) = sys::block_supervisor_signals() {
        eprintln!("vmhost: warning: supervisor signal mask: {e}");
    }
    // The VMM child is forked: the supervisor only waits, forwards signals and cleans up.
    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Supervisor);
    let end = loop {
        if let Some(end) = sys::try_reap(child) {
            break end;
        }
        match sys::wait_supervisor_signal(200) {
            Some(s) if s != libc::SIGCHLD => sys::send(child, libc::SIGTERM),
            _ => {}
        }
    };
    let code = match end {
        ChildEnd::Exited(code) => {
            // The VMM cleaned up after itself; a cgroup it could not remove is removed here.
            let _ = cg.remove();
            code
        }
        ChildEnd::Killed(signal) => {
            if let Some(t) = terminal {
                sys::restore_terminal(t);
            }
            let event = cg.oom_kill_event();
            clean_up(leftovers);
            if let Err(e) = cg.remove() {
                eprintln!("vmhost: warning: {e}");
            }
            match event {
                Some(event) => {
                    eprintln!("vmhost: stopping VM {}: {event}", leftovers.ledger.1);
                    EXIT_LIMIT
                }
                None => {
                    eprintln!(
                        "vmhost: the VMM of VM {} (pid {child}) was killed by signal {signal}",
                        leftovers.ledger.1
                    );
                    u8::try_from(128 + signal).unwrap_or(1)
                }
            }
        }
    };
    std::process::exit(i32::from(code))
}

/// Removes what a killed VMM left: its API and vsock sockets and its ledger entry.
fn clean_up(l: &Leftovers) {
    for sock in [&l.api_socket, &l.vsock_socket] {
        if let Some(sock) = sock.as_deref().filter(|p| Path::new(p).exists()) {
            let _ = std::fs::remove_file(sock);
        }
    }
    match vmhost_ledger::Ledger::open(&l.ledger.0) {
        Ok(ledger) => {
            if let Err(e) = ledger.release(&l.ledger.1, l.ledger_pid) {
                eprintln!("vmhost: warning: releasing the ledger entry: {e}");
            }
        }
        Err(e) => eprintln!("vmhost: warning: opening the ledger: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clean-up after a killed VMM runs in the supervisor under its syscall filter (a call
    /// the filter lacks kills this test binary with SIGSYS and names the call): the socket and
    /// the ledger entry go.
    #[test]
    fn clean_up_runs_under_the_supervisor_filter() {
        let dir = std::env::temp_dir().join(format!("vmhost-supervise-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("api.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let vsock = dir.join("vm.vsock");
        let vsock_listener = std::os::unix::net::UnixListener::bind(&vsock).unwrap();
        let run_dir = dir.join("run");
        vmhost_ledger::Ledger::open(&run_dir).unwrap();
        let leftovers = Leftovers {
            ledger: (run_dir, "vm".into()),
            ledger_pid: std::process::id(),
            api_socket: Some(sock.clone()),
            vsock_socket: Some(vsock.clone()),
        };
        std::thread::Builder::new()
            .name("supervisor".into())
            .spawn(move || {
                vmhost_seccomp::install(
                    vmhost_seccomp::ThreadKind::Supervisor,
                    vmhost_seccomp::SeccompMode::On,
                )
                .unwrap();
                clean_up(&leftovers);
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(!sock.exists(), "the API socket is removed");
        assert!(!vsock.exists(), "the vsock socket is removed");
        drop((listener, vsock_listener));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
