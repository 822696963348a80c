//! The check of a snapshot directory before a restore ([`super::Snapshot::open`]): the
//! directory holds exactly the state file and the files its manifest lists, every listed file
//! is a regular file of the listed length and digest (several checked at once), and a file that
//! differs is read record by record so that the error names a damaged record.

use std::fs;
use std::io::{self, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::manifest::{FileDigest, FileName, Hasher, ManifestEntry};
use super::{open_regular, DirError, STATE_FILE};
use crate::container::{ContainerError, Reader, Record};

/// Reads a whole container file, checking every record; returns its first record.
pub(super) fn verify_container(path: &Path) -> Result<Option<Record>, DirError> {
    let damaged = |source| DirError::Damaged {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = Reader::any_kind(BufReader::new(open_regular(path)?)).map_err(damaged)?;
    let first = reader.next_record().map_err(damaged)?;
    while reader.next_record().map_err(damaged)?.is_some() {}
    reader.expect_eof().map_err(damaged)?;
    Ok(first)
}

/// Checks every listed file against its manifest entry ([`Snapshot::open`]), on up to one
/// thread per CPU; the first failing file in manifest order is the error. Memory files are
/// checked for their length and type only unless `memory_digests`.
///
/// [`Snapshot::open`]: super::Snapshot::open
pub(super) fn verify_listed(
    dir: &Path,
    files: &[ManifestEntry],
    memory_digests: bool,
) -> Result<(), DirError> {
    let workers = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(files.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let results: Vec<(usize, Result<(), DirError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(f) = files.get(i) else { break out };
                        let path = dir.join(f.name.to_string());
                        let memory = matches!(f.name, FileName::MemoryCell(_));
                        out.push((
                            i,
                            if memory && !memory_digests {
                                verify_length(&path, f)
                            } else {
                                verify_entry(&path, f)
                            },
                        ));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut results = results;
    results.sort_by_key(|(i, _)| *i);
    if results.len() != files.len() {
        // A worker panicked: its files are unchecked.
        return Err(DirError::Manifest {
            path: dir.join(STATE_FILE),
            why: "a file could not be checked (its checker failed)".into(),
        });
    }
    results.into_iter().try_for_each(|(_, r)| r)
}

/// One listed file: a raw pass for its length and digest; on a mismatch, the container read
/// record by record (a damaged record is named), else the mismatch.
fn verify_entry(path: &Path, f: &ManifestEntry) -> Result<(), DirError> {
    let (len, digest) = hash_file(path, Hasher::like(&f.digest))?;
    if (len, digest) == (f.len, f.digest) {
        return Ok(());
    }
    verify_container(path)?;
    Err(DirError::Mismatch {
        path: path.to_path_buf(),
        len,
        digest,
        want_len: f.len,
        want_digest: f.digest,
    })
}

/// One listed file whose bytes its reader checks record by record: a regular file, not a
/// link, of the manifest's length.
fn verify_length(path: &Path, f: &ManifestEntry) -> Result<(), DirError> {
    let file = open_regular(path)?;
    let len = file
        .metadata()
        .map_err(|source| DirError::Open {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    if len != f.len {
        return Err(DirError::WrongLength {
            path: path.to_path_buf(),
            len,
            want_len: f.len,
        });
    }
    Ok(())
}

/// The length and digest (of `hash`'s kind) of the regular file at `path`.
pub(super) fn hash_file(path: &Path, mut hash: Hasher) -> Result<(u64, FileDigest), DirError> {
    let mut file = open_regular(path)?;
    let mut len = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                hash.update(&buf[..n]);
                len += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                let path = path.to_path_buf();
                let source = ContainerError::Read {
                    offset: len,
                    source,
                };
                return Err(DirError::Damaged { path, source });
            }
        }
    }
    Ok((len, hash.finish()))
}

/// Checks that `dir` holds exactly `state` and the listed files.
pub(super) fn check_listing(dir: &Path, files: &[ManifestEntry]) -> Result<(), DirError> {
    let open_err = |source| DirError::Open {
        path: dir.to_path_buf(),
        source,
    };
    let mut seen = 0;
    for entry in fs::read_dir(dir).map_err(open_err)? {
        let name = entry.map_err(open_err)?.file_name();
        let name = name.to_string_lossy();
        let listed = FileName::parse(&name).is_some_and(|n| files.iter().any(|f| f.name == n));
        if name != STATE_FILE && !listed {
            let why = format!("it holds {name:?}, which the manifest does not list");
            return Err(DirError::Incomplete {
                dir: dir.to_path_buf(),
                why,
            });
        }
        seen += usize::from(listed);
    }
    if seen != files.len() {
        let missing = files
            .iter()
            .find(|f| !dir.join(f.name.to_string()).exists())
            .map_or_else(|| "a listed file".to_string(), |f| f.name.to_string());
        let why = format!("{missing} is missing");
        return Err(DirError::Incomplete {
            dir: dir.to_path_buf(),
            why,
        });
    }
    Ok(())
}
