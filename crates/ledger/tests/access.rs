//! Other local users and stuck holders: the run directory, `vms/` and the lock file keep
//! other users out, and a lock held too long fails the operation naming its holder instead of
//! blocking it forever.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use vmhost_ledger::{Ledger, LedgerError};

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn the_lock_file_and_run_directory_keep_other_users_out() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    Ledger::open(&run).unwrap();
    assert_eq!(mode(&run), 0o700);
    assert_eq!(mode(&run.join("vms")), 0o700);
    assert_eq!(mode(&run.join("ledger.lock")), 0o600);
}

#[test]
fn a_world_readable_ledger_from_before_is_narrowed_to_its_owner() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    fs::create_dir_all(run.join("vms")).unwrap();
    fs::write(run.join("ledger.lock"), b"").unwrap();
    for (p, m) in [("", 0o755), ("vms", 0o755), ("ledger.lock", 0o644)] {
        fs::set_permissions(run.join(p), fs::Permissions::from_mode(m)).unwrap();
    }
    Ledger::open(&run).unwrap();
    assert_eq!(mode(&run), 0o700);
    assert_eq!(mode(&run.join("vms")), 0o700);
    assert_eq!(mode(&run.join("ledger.lock")), 0o600);
}

#[test]
fn a_lock_held_too_long_times_out_naming_its_holder() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let ledger = Ledger::open(&run)
        .unwrap()
        .with_lock_timeout(Duration::from_millis(300));
    // Another open file description holding a shared lock, as a stuck `vmhost ps` would.
    let held = fs::File::open(run.join("ledger.lock")).unwrap();
    // SAFETY: `held` owns an open descriptor; flock touches no memory.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_SH) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(ledger.gc()));
    let result = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the ledger operation blocked instead of timing out");
    let err = result.unwrap_err();
    assert!(matches!(err, LedgerError::LockTimeout { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("process {}", std::process::id())),
        "{msg}"
    );
    drop(held);
}

/// The wait's marker: it raises SIGUSR1 in the waiting thread, as a SIGTERM from outside would
/// arrive while a start waits for the lock.
fn signal_the_waiter(_: &Path, holder: &str) {
    assert!(holder.starts_with("process "), "{holder}");
    // SAFETY: pthread_self names the calling thread, which exists; SIGUSR1 is blocked there.
    let rc = unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGUSR1) };
    assert_eq!(rc, 0);
}

#[test]
fn a_signal_ends_the_wait_for_the_lock_as_interrupted() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    Ledger::open(&run).unwrap();
    let held = fs::File::open(run.join("ledger.lock")).unwrap();
    // SAFETY: `held` owns an open descriptor; flock touches no memory.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: an all-zero sigset_t is valid for sigemptyset; `set` is initialised before
        // sigaddset and pthread_sigmask, which only change this thread's mask.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR1);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        let wait = vmhost_ledger::LockWait {
            interrupt: vec![libc::SIGUSR1],
            on_wait: Some(signal_the_waiter),
            ..Default::default()
        };
        tx.send(Ledger::open_with(&run, wait).map(|_| ()))
    });
    // Without the signal the wait would last the 30 s timeout.
    let result = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the signal did not end the wait for the lock");
    let err = result.unwrap_err();
    assert!(
        matches!(err, LedgerError::Interrupted { signal, .. } if signal == libc::SIGUSR1),
        "{err:?}"
    );
    assert!(err.to_string().contains("interrupted by signal"), "{err}");
    drop(held);
}
