//! The manifest: the files a snapshot lists ([`FileName`]), each with its length and digest
//! ([`ManifestEntry`], [`FileDigest`]), the hashers that compute the digests, the check that
//! the list is complete, and the manifest record's encoding.

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3;

use super::MAX_CELLS;
use crate::container::RecordKind;

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
pub(super) enum Hasher {
    Xxh3(Box<Xxh3>),
    Sha256(Sha256),
}

impl Hasher {
    /// A hasher of the kind of `like` (its value is not used).
    pub(super) fn like(like: &FileDigest) -> Hasher {
        match like {
            FileDigest::Xxh3(_) => Hasher::Xxh3(Box::default()),
            FileDigest::Sha256(_) => Hasher::Sha256(Sha256::new()),
        }
    }

    pub(super) fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Xxh3(h) => h.update(bytes),
            Hasher::Sha256(h) => h.update(bytes),
        }
    }

    pub(super) fn finish(self) -> FileDigest {
        match self {
            Hasher::Xxh3(h) => FileDigest::Xxh3(h.digest128().to_be_bytes()),
            Hasher::Sha256(h) => FileDigest::Sha256(h.finalize().into()),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks that `files` holds spec, plan and memory cells 0..n, each once.
pub(super) fn check_complete(files: &[ManifestEntry]) -> Result<(), String> {
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
pub(super) fn encode_manifest(files: &[ManifestEntry]) -> Vec<u8> {
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
pub(super) fn decode_manifest(
    kind: RecordKind,
    payload: &[u8],
) -> Result<Vec<ManifestEntry>, String> {
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
