//! A run directory prepared by another user is refused before anything is written in it: the
//! run directory and `vms/` must be real directories (no symlinks), owned by this user and not
//! writable by group or others. The tests run as root (as CI does) and hand the directories to
//! `nobody` (uid 65534) with `chown`.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::Path;

use vmhost_ledger::{Ledger, LedgerError};

const NOBODY: u32 = 65534;

fn set_mode(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn a_run_directory_owned_by_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let vms = run.join("vms");
    fs::create_dir_all(&vms).unwrap();
    fs::write(run.join("ledger.lock"), b"").unwrap();
    let outside = dir.path().join("outside");
    fs::write(&outside, b"precious").unwrap();
    // Where an admitted VM's temporary entry file would be written.
    symlink(&outside, vms.join(".vm.1.2.json.tmp")).unwrap();
    for p in [&run, &vms, &run.join("ledger.lock")] {
        std::os::unix::fs::chown(p, Some(NOBODY), Some(NOBODY))
            .expect("chown needs root (the tests run as root, as CI does)");
    }
    set_mode(&run, 0o700);
    set_mode(&vms, 0o700);

    let err = Ledger::open(&run).unwrap_err();
    assert!(
        matches!(err, LedgerError::NotPrivate { owner: NOBODY, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&run.display().to_string()), "{msg}");
    assert!(msg.contains("owned by uid 65534"), "{msg}");
    assert!(msg.contains("chown"), "{msg}");
    assert_eq!(fs::read(&outside).unwrap(), b"precious");
    assert_eq!(fs::metadata(&run).unwrap().uid(), NOBODY);
}

#[test]
fn a_vms_directory_owned_by_another_user_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let vms = run.join("vms");
    fs::create_dir_all(&vms).unwrap();
    std::os::unix::fs::chown(&vms, Some(NOBODY), Some(NOBODY)).unwrap();
    set_mode(&vms, 0o700);
    let err = Ledger::open(&run).unwrap_err();
    assert!(
        matches!(err, LedgerError::NotPrivate { owner: NOBODY, .. }),
        "{err:?}"
    );
    assert!(
        err.to_string().contains(&vms.display().to_string()),
        "{err}"
    );
}

#[test]
fn a_vms_symlink_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    fs::create_dir(&run).unwrap();
    let outside = dir.path().join("elsewhere");
    fs::create_dir(&outside).unwrap();
    set_mode(&outside, 0o755);
    symlink(&outside, run.join("vms")).unwrap();
    let err = Ledger::open(&run).unwrap_err();
    assert!(matches!(err, LedgerError::OpenDir { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(&run.join("vms").display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("not a symlink"), "{msg}");
    // Not narrowed through the link, nothing created there.
    assert_eq!(fs::metadata(&outside).unwrap().mode() & 0o777, 0o755);
    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
}

#[test]
fn a_shared_writable_run_directory_without_a_ledger_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    fs::create_dir(&run).unwrap();
    set_mode(&run, 0o1777);
    let err = Ledger::open(&run).unwrap_err();
    assert!(
        matches!(err, LedgerError::NotPrivate { mode: 0o1777, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("mode 1777"), "{err}");
    assert!(!run.join("vms").exists());
}
