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
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3;

use crate::container::{ContainerError, Header, Reader, Record, RecordKind, Writer};
use crate::pages::PageError;

/// The name of the state file.
pub const STATE_FILE: &str = "state";
/// The most memory cells a snapshot holds.
pub const MAX_CELLS: u32 = 1024;

/// A file of the snapshot other than `state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileName {
    /// `spec`.
    Spec,
    /// `plan`.
    Plan,
    /// `memory-cell<N>`.
    MemoryCell(u32),
}

impl std::fmt::Display for FileName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileName::Spec => f.write_str("spec"),
            FileName::Plan => f.write_str("plan"),
            FileName::MemoryCell(n) => write!(f, "memory-cell{n}"),
        }
    }
}

impl FileName {
    /// Parses a file name as written by [`Display`](std::fmt::Display) (no other spelling).
    pub fn parse(name: &str) -> Option<FileName> {
        match name {
            "spec" => Some(FileName::Spec),
            "plan" => Some(FileName::Plan),
            _ => {
                let n = name.strip_prefix("memory-cell")?;
                let cell: u32 = n.parse().ok()?;
                (cell < MAX_CELLS && n == cell.to_string()).then_some(FileName::MemoryCell(cell))
            }
        }
    }
}

/// A manifest entry: a file and what its bytes must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManifestEntry {
    /// The file.
    pub name: FileName,
    /// Its length in bytes.
    pub len: u64,
    /// The digest of its bytes.
    pub digest: FileDigest,
}

/// The digest of a snapshot file's bytes, as its manifest lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileDigest {
    /// XXH3-128, canonical (big-endian) bytes, as `xxhsum -H2` prints them. Written now.
    Xxh3([u8; 16]),
    /// SHA-256: the manifests of snapshots written before XXH3 (still read).
    Sha256([u8; 32]),
}

impl FileDigest {
    fn bytes(&self) -> &[u8] {
        match self {
            FileDigest::Xxh3(b) => b,
            FileDigest::Sha256(b) => b,
        }
    }
}

impl std::fmt::Display for FileDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            FileDigest::Xxh3(_) => "XXH3-128",
            FileDigest::Sha256(_) => "SHA-256",
        };
        write!(f, "{name} {}", hex(self.bytes()))
    }
}

/// A digest being computed, of the kind a manifest asks for.
enum Hasher {
    Xxh3(Box<Xxh3>),
    Sha256(Sha256),
}

impl Hasher {
    /// A hasher of the kind of `like` (its value is not used).
    fn like(like: &FileDigest) -> Hasher {
        match like {
            FileDigest::Xxh3(_) => Hasher::Xxh3(Box::default()),
            FileDigest::Sha256(_) => Hasher::Sha256(Sha256::new()),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Xxh3(h) => h.update(bytes),
            Hasher::Sha256(h) => h.update(bytes),
        }
    }

    fn finish(self) -> FileDigest {
        match self {
            Hasher::Xxh3(h) => FileDigest::Xxh3(h.digest128().to_be_bytes()),
            Hasher::Sha256(h) => FileDigest::Sha256(h.finalize().into()),
        }
    }
}

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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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

/// Checks that `files` holds spec, plan and memory cells 0..n, each once.
fn check_complete(files: &[ManifestEntry]) -> Result<(), String> {
    for (i, f) in files.iter().enumerate() {
        if files[..i].iter().any(|g| g.name == f.name) {
            return Err(format!("{} is listed twice", f.name));
        }
    }
    for need in [FileName::Spec, FileName::Plan, FileName::MemoryCell(0)] {
        if !files.iter().any(|f| f.name == need) {
            return Err(format!("{need} is missing"));
        }
    }
    let cells = files
        .iter()
        .filter(|f| matches!(f.name, FileName::MemoryCell(_)))
        .count();
    for n in 0..cells {
        let name = FileName::MemoryCell(u32::try_from(n).unwrap_or(u32::MAX));
        if !files.iter().any(|f| f.name == name) {
            return Err(format!(
                "{name} is missing (cells are numbered from 0 without gaps)"
            ));
        }
    }
    Ok(())
}

/// `count u32 | (name length u8 | name | length u64 | digest) × count`, the digest XXH3-128
/// (16 bytes) in a [`RecordKind::MANIFEST_XXH3`], SHA-256 (32 bytes) in a
/// [`RecordKind::MANIFEST`]; every entry's of the same kind.
fn encode_manifest(files: &[ManifestEntry]) -> Vec<u8> {
    let mut out = Vec::new();
    // At most 2 + MAX_CELLS entries: SnapshotWriter::write_file and decode_manifest.
    let count = u32::try_from(files.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&count.to_le_bytes());
    for f in files {
        let name = f.name.to_string();
        // File names are at most 21 bytes ("memory-cell" and a u32).
        out.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&f.len.to_le_bytes());
        out.extend_from_slice(f.digest.bytes());
    }
    out
}

/// Decodes the manifest record `kind` ([`RecordKind::MANIFEST_XXH3`] or
/// [`RecordKind::MANIFEST`]).
fn decode_manifest(kind: RecordKind, payload: &[u8]) -> Result<Vec<ManifestEntry>, String> {
    let mut rest = payload;
    let mut take = |n: usize| -> Result<&[u8], String> {
        if rest.len() < n {
            return Err(format!("it ends {} bytes early", n - rest.len()));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
    let count = u32::from_le_bytes(take(4)?.try_into().unwrap_or_default());
    if count > MAX_CELLS + 2 {
        return Err(format!("it lists {count} files; at most {}", MAX_CELLS + 2));
    }
    let mut files = Vec::new();
    for _ in 0..count {
        let len = usize::from(take(1)?[0]);
        let raw = take(len)?;
        let name = std::str::from_utf8(raw)
            .ok()
            .and_then(FileName::parse)
            .ok_or_else(|| {
                format!(
                    "it lists an unknown file {:?}",
                    String::from_utf8_lossy(raw)
                )
            })?;
        let len = u64_at(take(8)?);
        let digest = if kind == RecordKind::MANIFEST_XXH3 {
            let mut d = [0u8; 16];
            d.copy_from_slice(take(16)?);
            FileDigest::Xxh3(d)
        } else {
            let mut d = [0u8; 32];
            d.copy_from_slice(take(32)?);
            FileDigest::Sha256(d)
        };
        files.push(ManifestEntry { name, len, digest });
    }
    if !rest.is_empty() {
        return Err("bytes follow its last entry".to_string());
    }
    check_complete(&files)?;
    Ok(files)
}

/// Reads a whole container file, checking every record; returns its first record.
fn verify_container(path: &Path) -> Result<Option<Record>, DirError> {
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
fn verify_listed(
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
fn hash_file(path: &Path, mut hash: Hasher) -> Result<(u64, FileDigest), DirError> {
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

/// Checks that `dir` holds exactly `state` and the listed files.
fn check_listing(dir: &Path, files: &[ManifestEntry]) -> Result<(), DirError> {
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

#[cfg(test)]
mod tests {
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
