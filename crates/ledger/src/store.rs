//! The run directory on disk: the lock file, scanning `vms/`, atomic writes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::entry::{decode, FileKey};
use crate::sys::{self, Probe};
use crate::{Entry, LedgerError, Liveness, LockWait};

/// The lock file name in the run directory.
pub(crate) const LOCK_FILE: &str = "ledger.lock";
/// The entry directory name in the run directory.
pub(crate) const VMS_DIR: &str = "vms";

/// The mode of the lock file: other users cannot open it, so they cannot hold the lock.
pub(crate) const LOCK_MODE: u32 = 0o600;
/// The mode of the run directory and `vms/`.
pub(crate) const DIR_MODE: u32 = 0o700;
/// How often a waiting operation retries the lock.
const LOCK_POLL: Duration = Duration::from_millis(20);

/// A held `flock`; released when dropped (the descriptor is closed).
pub(crate) struct Locked {
    _file: File,
}

/// Creates `dir` (and missing parents) with [`DIR_MODE`].
pub(crate) fn create_dir(dir: &Path) -> Result<(), LedgerError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|source| LedgerError::CreateDir {
            path: dir.to_owned(),
            source,
        })
}

/// Opens directory `path` without following a symlink (`O_DIRECTORY|O_NOFOLLOW`) and checks,
/// on the open descriptor, that it belongs to this process's effective user; with `narrow` a
/// mode granting anything to group or others is narrowed to [`DIR_MODE`] first (a run
/// directory made by an older vmhost, or by hand). A directory still writable by group or
/// others, or owned by another user, is refused: whoever can write it could plant symlinks or
/// files the ledger would then write through or read.
pub(crate) fn check_private_dir(path: &Path, narrow: bool) -> Result<(), LedgerError> {
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| LedgerError::OpenDir {
            path: path.to_owned(),
            source,
        })?;
    let stat = |d: &File| {
        d.metadata().map_err(|source| LedgerError::OpenDir {
            path: path.to_owned(),
            source,
        })
    };
    let mut meta = stat(&dir)?;
    let euid = sys::euid();
    if meta.uid() == euid && narrow && meta.mode() & 0o077 != 0 {
        dir.set_permissions(fs::Permissions::from_mode(DIR_MODE))
            .map_err(|source| LedgerError::Permissions {
                path: path.to_owned(),
                mode: DIR_MODE,
                source,
            })?;
        meta = stat(&dir)?;
    }
    if meta.uid() != euid || meta.mode() & 0o022 != 0 {
        return Err(LedgerError::NotPrivate {
            path: path.to_owned(),
            owner: meta.uid(),
            mode: meta.mode() & 0o7777,
            euid,
        });
    }
    Ok(())
}

/// Narrows the open `file` at `path` to `mode` when it grants anything to group or others.
pub(crate) fn restrict(path: &Path, file: &File, mode: u32) -> Result<(), LedgerError> {
    let err = |source| LedgerError::Permissions {
        path: path.to_owned(),
        mode,
        source,
    };
    let meta = file.metadata().map_err(err)?;
    if meta.mode() & 0o077 == 0 {
        return Ok(());
    }
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(err)
}

/// Opens `path` (creating it, mode [`LOCK_MODE`], when `create`) and locks it, exclusively or
/// shared, waiting as `wait` says; on timeout the error names the holder when `/proc/locks`
/// shows it.
///
/// Every operation opens its own descriptor: `flock` locks belong to the open file
/// description, so two threads sharing one descriptor would not exclude each other.
pub(crate) fn lock(
    path: &Path,
    exclusive: bool,
    create: bool,
    wait: &LockWait,
) -> Result<Locked, LedgerError> {
    let file = OpenOptions::new()
        .read(true)
        .write(create)
        .create(create)
        .truncate(false)
        .mode(LOCK_MODE)
        .open(path)
        .map_err(|source| LedgerError::OpenLock {
            path: path.to_owned(),
            source,
        })?;
    if create {
        restrict(path, &file, LOCK_MODE)?;
    }
    let start = Instant::now();
    let mut announced = false;
    loop {
        let locked = sys::try_flock(&file, exclusive).map_err(|source| LedgerError::Lock {
            path: path.to_owned(),
            source,
        })?;
        if locked {
            return Ok(Locked { _file: file });
        }
        let waited = start.elapsed();
        if waited >= wait.timeout {
            return Err(LedgerError::LockTimeout {
                path: path.to_owned(),
                waited,
                holder: holder(&file),
            });
        }
        if let Some(announce) = wait.on_wait.filter(|_| !announced) {
            announce(path, &holder(&file));
            announced = true;
        }
        if let Some(signal) = sys::pause(&wait.interrupt, LOCK_POLL.min(wait.timeout - waited)) {
            return Err(LedgerError::Interrupted {
                path: path.to_owned(),
                signal,
            });
        }
    }
}

/// Who holds the lock on `file`, from `/proc/locks`: `process 4242 (vmhost)`.
fn holder(file: &File) -> String {
    file.metadata()
        .ok()
        .and_then(|m| sys::flock_holder(m.dev(), m.ino()))
        .map_or_else(
            || "another process".to_string(),
            |(pid, comm)| format!("process {pid} ({comm})"),
        )
}

/// One file of `vms/` as scanned.
pub(crate) struct Scanned {
    pub path: PathBuf,
    pub key: Option<FileKey>,
    pub liveness: Liveness,
    pub entry: Result<Entry, String>,
}

/// The liveness of the process an entry file names.
pub(crate) fn liveness(key: Option<&FileKey>) -> Liveness {
    let Some(key) = key else {
        return Liveness::Unknown;
    };
    match sys::probe(key.pid) {
        Probe::Running { start_ticks } if start_ticks == key.start_ticks => Liveness::Alive,
        Probe::Running { .. } => Liveness::PidReused,
        Probe::Gone => Liveness::Exited,
        // The process exists but cannot be inspected: assume it is the VM.
        Probe::Unknown => Liveness::Alive,
    }
}

/// Reads every entry file in `dir`. With `clean_temps` (only under the exclusive lock, when no
/// writer can be mid-write) leftover temporary files of interrupted writes are removed.
pub(crate) fn scan(dir: &Path, clean_temps: bool) -> Result<Vec<Scanned>, LedgerError> {
    let read_dir = |source| LedgerError::ReadDir {
        path: dir.to_owned(),
        source,
    };
    let mut out = Vec::new();
    let mut names = Vec::new();
    for item in fs::read_dir(dir).map_err(read_dir)? {
        let item = item.map_err(read_dir)?;
        names.push(item.file_name());
    }
    names.sort();
    for os_name in names {
        let path = dir.join(&os_name);
        let file_name = os_name.to_string_lossy();
        if file_name.starts_with('.') && file_name.ends_with(".tmp") {
            if clean_temps {
                remove(&path)?;
            }
            continue;
        }
        if !file_name.ends_with(".json") {
            continue;
        }
        let key = FileKey::parse(&file_name);
        let text = match fs::read(&path) {
            Ok(bytes) => bytes,
            // Removed between listing and reading (only possible without the lock).
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(LedgerError::Read { path, source }),
        };
        let entry = match (&key, String::from_utf8(text)) {
            (None, _) => Err("the file name is not <name>.<pid>.<start>.json".to_owned()),
            (Some(_), Err(_)) => Err("the file is not UTF-8 text (garbage)".to_owned()),
            (Some(key), Ok(text)) => decode(&text).and_then(|e| matches_key(e, key)),
        };
        out.push(Scanned {
            liveness: liveness(key.as_ref()),
            path,
            key,
            entry,
        });
    }
    Ok(out)
}

fn matches_key(entry: Entry, key: &FileKey) -> Result<Entry, String> {
    if entry.name == key.name && entry.pid == key.pid && entry.proc_start_ticks == key.start_ticks {
        Ok(entry)
    } else {
        Err(format!(
            "the content (VM {}, pid {}, start {}) does not match the file name",
            entry.name, entry.pid, entry.proc_start_ticks
        ))
    }
}

/// Writes `dir/file_name` atomically: a temporary file in the same directory, `fsync`, rename
/// over the target, `fsync` of the directory. Readers see the old content or the new one.
///
/// The temporary file is created new (`O_EXCL|O_NOFOLLOW`, mode 0600) after a stale one of the
/// same name is unlinked (unlinking a symlink removes the link, never its target): nothing is
/// ever written through a symlink or into a file someone else opened first.
pub(crate) fn write_atomic(dir: &Path, file_name: &str, bytes: &[u8]) -> Result<(), LedgerError> {
    let tmp = dir.join(format!(".{file_name}.tmp"));
    let target = dir.join(file_name);
    remove(&tmp)?;
    let result = write_then_rename(&tmp, &target, bytes);
    if result.is_err() {
        // Best effort: the next exclusive scan removes it anyway.
        let _ = fs::remove_file(&tmp);
    }
    result?;
    let dir_err = |source| LedgerError::Write {
        path: dir.to_owned(),
        source,
    };
    File::open(dir).and_then(|d| d.sync_all()).map_err(dir_err)
}

fn write_then_rename(tmp: &Path, target: &Path, bytes: &[u8]) -> Result<(), LedgerError> {
    let on = |path: &Path| {
        let path = path.to_owned();
        move |source| LedgerError::Write { path, source }
    };
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(tmp)
        .map_err(on(tmp))?;
    file.write_all(bytes).map_err(on(tmp))?;
    file.sync_all().map_err(on(tmp))?;
    drop(file);
    fs::rename(tmp, target).map_err(on(target))
}

/// Removes an entry (or temporary) file; a file already gone is not an error.
pub(crate) fn remove(path: &Path) -> Result<(), LedgerError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(LedgerError::Remove {
            path: path.to_owned(),
            source,
        }),
    }
}
