//! The snapshot directory: its files, how they are created, and the check before a restore.
//!
//! ```text
//! DIR/                 mode 0700, created by the snapshot (never an existing directory)
//!   spec               container: one SPEC record (the spec as the user wrote it)
//!   plan               container: one PLAN record (the plan the VM ran under)
//!   memory-cell<N>     container: PAGES records of guest cell N (N = 0, 1, …), zero and
//!                      untouched pages left out
//!   state              container: a MANIFEST record first, then the VM's state records;
//!                      written last, so a directory without it is an unfinished snapshot
//! ```
//!
//! Every file is created mode 0600 with `O_CREAT|O_EXCL|O_NOFOLLOW`: nothing is overwritten and
//! no symbolic link is followed. The manifest lists each other file with its length and the
//! digest of its bytes: XXH3-128 ([`RecordKind::MANIFEST_XXH3`], written now) or SHA-256
//! ([`RecordKind::MANIFEST`], snapshots written before; still read). The digest finds damage
//! and swapped files; it is not a signature (whoever can change a file can change the
//! manifest beside it, so SHA-256 proved no more), and XXH3 checks several times faster where
//! the CPU has no SHA instructions. (Not a CRC: every record of a file ends with the CRC of
//! its own bytes, and a CRC run over data followed by that data's CRC ends in a constant, so
//! the CRC of a whole file would depend only on its record lengths.) [`Snapshot::open`]
//! checks the whole directory before the caller allocates anything: no file missing, none
//! extra, no link, every length and digest right, every file a well-formed container of a
//! version this vmhost reads.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::container::{ContainerError, Header, Reader, RecordKind, Writer};
use crate::pages::PageError;

mod manifest;
mod verify;

use manifest::{check_complete, decode_manifest, encode_manifest, Hasher};
pub use manifest::{FileDigest, FileName, ManifestEntry};
use verify::{check_listing, verify_container, verify_listed};

/// The name of the state file.
pub const STATE_FILE: &str = "state";
/// The most memory cells a snapshot holds.
pub const MAX_CELLS: u32 = 1024;

/// An error from the code that fills a file with records.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// A record could not be written.
    #[error(transparent)]
    Container(#[from] ContainerError),
    /// Pages could not be written.
    #[error(transparent)]
    Pages(#[from] PageError),
    /// The caller's own step failed (e.g. reading the guest memory it writes).
    #[error(transparent)]
    Caller(Box<dyn std::error::Error + Send + Sync>),
}

/// Why a snapshot directory could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// The directory could not be created.
    #[error(
        "cannot create the snapshot directory {path} (it must not exist yet: choose a new path)"
    )]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A file could not be created.
    #[error("cannot create the snapshot file {path}")]
    CreateFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A file could not be written.
    #[error("cannot write the snapshot file {path}")]
    WriteFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: FillError,
    },
    /// A file was written twice, or the snapshot lacks a file.
    #[error("the snapshot in {dir} is incomplete or inconsistent: {why}")]
    Incomplete {
        /// The directory.
        dir: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A file or the directory could not be opened or listed.
    #[error("cannot open {path} (a snapshot's files are regular files, not links)")]
    Open {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A file is not a well-formed container.
    #[error("the snapshot file {path} is damaged")]
    Damaged {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: ContainerError,
    },
    /// The manifest is malformed.
    #[error("the manifest in {path} is malformed: {why}")]
    Manifest {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A file's length or digest differs from the manifest's.
    #[error("the snapshot file {path} is not the one the snapshot wrote: {len} bytes with {digest}, the manifest says {want_len} bytes with {want_digest}")]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// Its digest.
        digest: FileDigest,
        /// The manifest's length.
        want_len: u64,
        /// The manifest's digest.
        want_digest: FileDigest,
    },
    /// A memory file's length differs from the manifest's ([`Snapshot::open_for_restore`]).
    #[error("the snapshot file {path} is not the one the snapshot wrote: {len} bytes, the manifest says {want_len} bytes")]
    WrongLength {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
        /// The manifest's length.
        want_len: u64,
    },
}

/// A file being written, its digest computed as it goes.
pub struct ChecksumFile {
    out: BufWriter<File>,
    hash: Hasher,
    len: u64,
}

impl Write for ChecksumFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.out.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// Creates `path` mode 0600, refusing an existing file or a link.
fn create_file(path: &Path) -> Result<File, DirError> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| DirError::CreateFile {
            path: path.to_path_buf(),
            source,
        })
}

/// Opens `path` for reading without following a link, and checks it is a regular file.
fn open_regular(path: &Path) -> Result<File, DirError> {
    let open_err = |source| DirError::Open {
        path: path.to_path_buf(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(open_err)?;
    if !file.metadata().map_err(open_err)?.is_file() {
        return Err(open_err(io::Error::other("not a regular file")));
    }
    Ok(file)
}

/// Writes a snapshot directory: [`create`](Self::create), one
/// [`write_file`](Self::write_file) per file, then [`commit`](Self::commit).
pub struct SnapshotWriter {
    dir: PathBuf,
    vmhost_version: String,
    files: Vec<ManifestEntry>,
}

impl SnapshotWriter {
    /// Creates the directory `dir` (mode 0700); it must not exist.
    pub fn create(dir: &Path, vmhost_version: &str) -> Result<Self, DirError> {
        fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .map_err(|source| DirError::CreateDir {
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(SnapshotWriter {
            dir: dir.to_path_buf(),
            vmhost_version: vmhost_version.to_string(),
            files: Vec::new(),
        })
    }

    /// Creates the file `name` and fills it with the records `fill` writes.
    pub fn write_file(
        &mut self,
        name: FileName,
        fill: impl FnOnce(&mut Writer<ChecksumFile>) -> Result<(), FillError>,
    ) -> Result<(), DirError> {
        if matches!(name, FileName::MemoryCell(n) if n >= MAX_CELLS) {
            let why = format!("{name}: a snapshot holds at most {MAX_CELLS} cells");
            return Err(DirError::Incomplete {
                dir: self.dir.clone(),
                why,
            });
        }
        if self.files.iter().any(|f| f.name == name) {
            let why = format!("{name} written twice");
            return Err(DirError::Incomplete {
                dir: self.dir.clone(),
                why,
            });
        }
        let path = self.dir.join(name.to_string());
        let out = self.fill(&path, fill)?;
        self.files.push(ManifestEntry {
            name,
            len: out.len,
            digest: out.hash.finish(),
        });
        Ok(())
    }

    /// Creates the file `name` holding the one record `kind` with `payload` (the spec, the
    /// plan).
    pub fn write_single(
        &mut self,
        name: FileName,
        kind: RecordKind,
        payload: &[u8],
    ) -> Result<(), DirError> {
        self.write_file(name, |w| Ok(w.write_record(kind, payload)?))
    }

    /// The directory being written.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn fill(
        &self,
        path: &Path,
        fill: impl FnOnce(&mut Writer<ChecksumFile>) -> Result<(), FillError>,
    ) -> Result<ChecksumFile, DirError> {
        let file = create_file(path)?;
        let out = ChecksumFile {
            out: BufWriter::new(file),
            hash: Hasher::like(&FileDigest::Xxh3([0; 16])),
            len: 0,
        };
        let write_err = |source: FillError| DirError::WriteFile {
            path: path.to_path_buf(),
            source,
        };
        let mut w = Writer::new(out, &self.vmhost_version).map_err(|e| write_err(e.into()))?;
        fill(&mut w).map_err(write_err)?;
        let out = w.finish().map_err(|e| write_err(e.into()))?;
        let file = out.out.get_ref();
        file.sync_all().map_err(|e| {
            write_err(
                ContainerError::Write {
                    offset: out.len,
                    source: e,
                }
                .into(),
            )
        })?;
        Ok(out)
    }

    /// Writes the `state` file (the manifest, then the records `fill` writes) once `spec`,
    /// `plan` and `memory-cell0` … `memory-cell<N>` are written, and syncs the directory.
    pub fn commit(
        self,
        fill: impl FnOnce(&mut Writer<ChecksumFile>) -> Result<(), FillError>,
    ) -> Result<PathBuf, DirError> {
        check_complete(&self.files).map_err(|why| DirError::Incomplete {
            dir: self.dir.clone(),
            why,
        })?;
        let manifest = encode_manifest(&self.files);
        let path = self.dir.join(STATE_FILE);
        self.fill(&path, |w| {
            w.write_record(RecordKind::MANIFEST_XXH3, &manifest)?;
            fill(w)
        })?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| DirError::Open {
                path: self.dir.clone(),
                source,
            })?;
        Ok(self.dir)
    }
}

/// A snapshot directory whose files have all been checked.
#[derive(Debug)]
pub struct Snapshot {
    dir: PathBuf,
    header: Header,
    files: Vec<ManifestEntry>,
}

impl Snapshot {
    /// Checks the snapshot in `dir` whole: the state file (container well-formed, every
    /// record's CRC) and its manifest, that the directory holds nothing else, then every
    /// listed file (no link, length and digest as the manifest says; several files at once).
    /// A listed file that matches its entry is the file the snapshot wrote, records and CRCs
    /// included, and is read once; one that does not is read again record by record, so that
    /// the error names the damaged record when there is one. Allocates at most one record at
    /// a time per file.
    pub fn open(dir: &Path) -> Result<Snapshot, DirError> {
        Self::open_checking(dir, true)
    }

    /// [`open`](Self::open) for a restore, which reads the memory files once, into guest RAM:
    /// the state file and every other file are checked whole, the memory files for their
    /// length (and that they are regular files) only. Their bytes are checked as they are
    /// loaded: every record's checksum, the end record's count, nothing after it
    /// ([`crate::container::Reader`]). A load that fails has found a damaged file; the caller
    /// releases what it allocated for it.
    pub fn open_for_restore(dir: &Path) -> Result<Snapshot, DirError> {
        Self::open_checking(dir, false)
    }

    fn open_checking(dir: &Path, memory_digests: bool) -> Result<Snapshot, DirError> {
        let state = dir.join(STATE_FILE);
        let first = verify_container(&state)?;
        let bad = |why: String| DirError::Manifest {
            path: state.clone(),
            why,
        };
        let manifest = first
            .filter(|r| matches!(r.kind, RecordKind::MANIFEST_XXH3 | RecordKind::MANIFEST))
            .ok_or_else(|| bad("the state file does not start with a manifest record".into()))?;
        let files = decode_manifest(manifest.kind, &manifest.payload).map_err(bad)?;
        check_listing(dir, &files)?;
        verify_listed(dir, &files, memory_digests)?;
        let header = Reader::any_kind(open_regular(&state)?)
            .map_err(|source| DirError::Damaged {
                path: state.clone(),
                source,
            })?
            .header()
            .clone();
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            header,
            files,
        })
    }

    /// The header of the state file (format and vmhost version of the snapshot).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The files the manifest lists.
    pub fn files(&self) -> &[ManifestEntry] {
        &self.files
    }

    /// The number of memory cells.
    pub fn cells(&self) -> u32 {
        let n = self
            .files
            .iter()
            .filter(|f| matches!(f.name, FileName::MemoryCell(_)));
        u32::try_from(n.count()).unwrap_or(u32::MAX)
    }

    /// Opens the file `name` for reading its records of the `known` kinds.
    pub fn open_file(
        &self,
        name: FileName,
        known: &[RecordKind],
    ) -> Result<Reader<BufReader<File>>, DirError> {
        self.reader(&self.dir.join(name.to_string()), known)
    }

    /// Opens the state file; its first record is the manifest, which the caller skips.
    pub fn open_state(&self, known: &[RecordKind]) -> Result<Reader<BufReader<File>>, DirError> {
        let mut known = known.to_vec();
        known.extend([RecordKind::MANIFEST_XXH3, RecordKind::MANIFEST]);
        self.reader(&self.dir.join(STATE_FILE), &known)
    }

    /// The payload of the one record of kind `kind` in the file `name` (the spec, the plan).
    pub fn read_single(&self, name: FileName, kind: RecordKind) -> Result<Vec<u8>, DirError> {
        let path = self.dir.join(name.to_string());
        let reader = self.open_file(name, &[kind])?;
        first_of_kind(reader, kind, &path)
    }

    /// The payload of the first record of kind `kind` in the state file (after the manifest).
    pub fn read_state(&self, kind: RecordKind) -> Result<Vec<u8>, DirError> {
        let path = self.dir.join(STATE_FILE);
        let reader = self.open_state(&[kind])?;
        first_of_kind(reader, kind, &path)
    }

    /// The payloads of the state file's records of the `known` kinds, by kind, in file order
    /// (the manifest left out). A mandatory record of another kind is refused.
    pub fn read_state_records(
        &self,
        known: &[RecordKind],
    ) -> Result<Vec<(RecordKind, Vec<u8>)>, DirError> {
        let path = self.dir.join(STATE_FILE);
        let mut reader = self.open_state(known)?;
        let mut out = Vec::new();
        while let Some(rec) = reader.next_record().map_err(|source| DirError::Damaged {
            path: path.clone(),
            source,
        })? {
            if known.contains(&rec.kind) {
                out.push((rec.kind, rec.payload));
            }
        }
        Ok(out)
    }

    /// The snapshot's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn reader(
        &self,
        path: &Path,
        known: &[RecordKind],
    ) -> Result<Reader<BufReader<File>>, DirError> {
        let file = BufReader::new(open_regular(path)?);
        Reader::new(file, known).map_err(|source| DirError::Damaged {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Reads records until the first of kind `kind`; its payload.
fn first_of_kind(
    mut reader: Reader<BufReader<File>>,
    kind: RecordKind,
    path: &Path,
) -> Result<Vec<u8>, DirError> {
    let damaged = |source| DirError::Damaged {
        path: path.to_path_buf(),
        source,
    };
    while let Some(rec) = reader.next_record().map_err(damaged)? {
        if rec.kind == kind {
            return Ok(rec.payload);
        }
    }
    Err(DirError::Incomplete {
        dir: path.parent().unwrap_or(path).to_path_buf(),
        why: format!("{} holds no {kind} record", path.display()),
    })
}

/// Removes an unfinished snapshot in `dir`: the files a snapshot writes (`state`, `spec`,
/// `plan`, `memory-cell<N>`), then the directory itself, which must then be empty (anything
/// else in it is left alone and the directory stays). For the cleanup after a failed snapshot.
pub fn remove_unfinished(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let ours = name == STATE_FILE || FileName::parse(&name).is_some();
        if ours && entry.file_type()?.is_file() {
            fs::remove_file(entry.path())?;
        }
    }
    fs::remove_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::verify::hash_file;
    use super::*;

    /// The digest of `bytes` as a snapshot file's manifest entry would list it.
    fn xxh3_of(bytes: &[u8]) -> FileDigest {
        let mut h = Hasher::like(&FileDigest::Xxh3([0; 16]));
        h.update(bytes);
        h.finish()
    }

    #[test]
    fn the_manifest_digest_is_xxh3_128_as_xxhsum_prints_it() {
        // `printf '' | xxhsum -H2` and `printf 'vmhost snapshot' | xxhsum -H2` (xxHash 0.8).
        assert_eq!(
            xxh3_of(b"").to_string(),
            "XXH3-128 99aa06d3014798d86001c324468d497f"
        );
        // In pieces, as a file is written and read.
        let mut h = Hasher::like(&FileDigest::Xxh3([0; 16]));
        h.update(b"vmhost ");
        h.update(b"snapshot");
        assert_eq!(
            h.finish().to_string(),
            "XXH3-128 6258fe1dce050d398fb5b4753a03d6e1"
        );
    }

    /// A one-cell snapshot in `root/snap` as this vmhost writes it.
    fn write_snapshot(root: &Path) -> PathBuf {
        let mut w = SnapshotWriter::create(&root.join("snap"), "0.1.0").expect("create");
        w.write_single(FileName::Spec, RecordKind::SPEC, b"name: a\n")
            .expect("spec");
        w.write_single(FileName::Plan, RecordKind::PLAN, b"{}")
            .expect("plan");
        w.write_single(FileName::MemoryCell(0), RecordKind::PAGES, b"pages")
            .expect("cell");
        w.commit(|f| Ok(f.write_record(RecordKind::VM_STATE, b"state")?))
            .expect("commit")
    }

    /// Rewrites `dir`'s state file as a vmhost before XXH3 wrote it: a SHA-256 manifest.
    fn rewrite_with_sha256_manifest(dir: &Path) {
        let files: Vec<ManifestEntry> = [FileName::Spec, FileName::Plan, FileName::MemoryCell(0)]
            .into_iter()
            .map(|name| {
                let path = dir.join(name.to_string());
                let (len, digest) =
                    hash_file(&path, Hasher::like(&FileDigest::Sha256([0; 32]))).expect("hash");
                ManifestEntry { name, len, digest }
            })
            .collect();
        let state = dir.join(STATE_FILE);
        fs::remove_file(&state).expect("rm state");
        let mut w = Writer::new(create_file(&state).expect("create"), "0.1.0").expect("writer");
        w.write_record(RecordKind::MANIFEST, &encode_manifest(&files))
            .expect("manifest");
        w.write_record(RecordKind::VM_STATE, b"state")
            .expect("state");
        w.finish().expect("finish");
    }

    #[test]
    fn a_snapshot_lists_xxh3_digests_that_match_its_files() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = write_snapshot(root.path());
        let snap = Snapshot::open(&dir).expect("open");
        let mut state = snap.open_state(&[RecordKind::VM_STATE]).expect("state");
        let first = state.next_record().expect("record").expect("manifest");
        assert_eq!(first.kind, RecordKind::MANIFEST_XXH3);
        for f in snap.files() {
            let bytes = fs::read(dir.join(f.name.to_string())).expect("read");
            assert_eq!(
                (f.len, f.digest),
                (bytes.len() as u64, xxh3_of(&bytes)),
                "{}",
                f.name
            );
        }
    }

    #[test]
    fn a_snapshot_with_a_sha256_manifest_still_opens_and_its_digests_are_checked() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = write_snapshot(root.path());
        rewrite_with_sha256_manifest(&dir);
        let snap = Snapshot::open(&dir).expect("a SHA-256 manifest reads");
        assert!(snap
            .files()
            .iter()
            .all(|f| matches!(f.digest, FileDigest::Sha256(_))));
        assert_eq!(
            snap.read_state(RecordKind::VM_STATE).expect("state"),
            b"state"
        );
        // The spec swapped for the plan (both valid containers): the SHA-256 tells them apart.
        fs::remove_file(dir.join("spec")).expect("rm");
        fs::copy(dir.join("plan"), dir.join("spec")).expect("copy");
        let err = Snapshot::open(&dir).expect_err("swapped");
        assert!(matches!(err, DirError::Mismatch { .. }), "{err:?}");
        assert!(err.to_string().contains("with SHA-256 "), "{err}");
    }

    /// A memory file with a flipped byte passes the restore's open (its length is right) and
    /// fails its load, naming the damaged record; the full open refuses it at once. A memory
    /// file of another length fails both opens.
    #[test]
    fn a_restore_open_leaves_the_memory_bytes_to_their_load() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = write_snapshot(root.path());
        let cell = dir.join("memory-cell0");
        let mut bytes = fs::read(&cell).expect("read");
        let good = bytes.clone();
        let payload = bytes
            .windows(5)
            .position(|w| w == b"pages")
            .expect("the payload");
        bytes[payload] ^= 0x40;
        fs::write(&cell, &bytes).expect("write");
        let err = Snapshot::open(&dir).expect_err("a flipped byte");
        assert!(
            matches!(
                err,
                DirError::Damaged {
                    source: ContainerError::RecordChecksum { .. },
                    ..
                }
            ),
            "{err:?}"
        );
        let snap = Snapshot::open_for_restore(&dir).expect("lengths match");
        let mut load = snap
            .open_file(FileName::MemoryCell(0), &[RecordKind::PAGES])
            .expect("open");
        let err = load.next_record().expect_err("the damaged record");
        assert!(
            matches!(err, ContainerError::RecordChecksum { .. }),
            "{err:?}"
        );
        fs::write(&cell, &good[..good.len() - 1]).expect("truncate");
        let err = Snapshot::open_for_restore(&dir).expect_err("one byte short");
        assert!(
            matches!(err, DirError::WrongLength { len, want_len, .. } if len + 1 == want_len),
            "{err:?}"
        );
        assert!(err.to_string().contains("memory-cell0"), "{err}");
    }
}
