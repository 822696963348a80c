//! The cloud-init NoCloud seed: a small FAT12 volume labelled `cidata` holding `meta-data`,
//! `user-data` and, when given, `network-config`, written by hand (no mkfs, no crate).
//!
//! Layout, all in 512-byte sectors and aligned to 4 KiB so the image also works with
//! `cache = "none"`: 8 reserved sectors (the boot sector with the BIOS parameter block),
//! two FATs, a 128-entry root directory (8 sectors: the volume label, then each file as
//! VFAT long-name entries plus its 8.3 entry), then the data area in 4 KiB clusters, each file
//! in consecutive clusters.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::sys;

/// Bytes per sector.
const SECTOR: usize = 512;
/// Sectors per cluster (4 KiB clusters).
const CLUSTER_SECTORS: usize = 8;
const CLUSTER: usize = SECTOR * CLUSTER_SECTORS;
const RESERVED_SECTORS: usize = 8;
const ROOT_ENTRIES: usize = 128;
const ROOT_SECTORS: usize = ROOT_ENTRIES * 32 / SECTOR;
/// FAT12 cannot address more clusters than this.
const FAT12_MAX_CLUSTERS: usize = 4084;
/// Largest file on the seed.
pub const SEED_FILE_MAX: usize = 4 << 20;
/// The volume label cloud-init looks for.
pub const SEED_LABEL: &str = "cidata";

/// Why a seed could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// A file is larger than [`SEED_FILE_MAX`].
    #[error("cloud-init {file} is {len} bytes; the seed holds at most {SEED_FILE_MAX} per file")]
    TooLarge {
        /// `user-data`, `meta-data` or `network-config`.
        file: &'static str,
        /// Its length.
        len: usize,
    },
    /// Something that is not a seed of ours is where the seed goes.
    #[error("cannot write the cloud-init seed {path}: a {kind} owned by uid {owner} is in its place (the seed is created new, never written through a symlink or into another user's file); remove it and check who else writes to the run directory")]
    InTheWay {
        /// The image path.
        path: PathBuf,
        /// `symlink`, `file` or `special file`.
        kind: &'static str,
        /// Its owner.
        owner: u32,
    },
    /// The image could not be written.
    #[error("cannot write the cloud-init seed {path}")]
    Write {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What goes on a NoCloud seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoCloudSeed {
    /// `instance-id` in `meta-data` (cloud-init re-runs per-instance steps when it changes).
    pub instance_id: String,
    /// `local-hostname` in `meta-data`.
    pub hostname: String,
    /// `user-data`, verbatim.
    pub user_data: String,
    /// `network-config`, verbatim, if any.
    pub network_config: Option<String>,
}

impl NoCloudSeed {
    /// The files of the seed, in directory order.
    fn files(&self) -> Vec<(&'static str, &'static [u8; 11], Vec<u8>)> {
        let meta = format!(
            "instance-id: {}\nlocal-hostname: {}\n",
            self.instance_id, self.hostname
        );
        let mut files = vec![
            ("meta-data", b"META-D~1   ", meta.into_bytes()),
            (
                "user-data",
                b"USER-D~1   ",
                self.user_data.clone().into_bytes(),
            ),
        ];
        if let Some(n) = &self.network_config {
            files.push(("network-config", b"NETWOR~1   ", n.clone().into_bytes()));
        }
        files
    }

    /// The seed image in memory.
    ///
    /// ```
    /// use vmhost_devices::seed::NoCloudSeed;
    /// let seed = NoCloudSeed {
    ///     instance_id: "web".into(),
    ///     hostname: "web".into(),
    ///     user_data: "#cloud-config\n".into(),
    ///     network_config: None,
    /// };
    /// let img = seed.build().unwrap();
    /// assert_eq!(img.len() % 4096, 0);
    /// assert_eq!(&img[510..512], &[0x55, 0xaa]);
    /// assert_eq!(&img[43..54], b"cidata     ");
    /// ```
    pub fn build(&self) -> Result<Vec<u8>, SeedError> {
        let files = self.files();
        for (name, _, data) in &files {
            if data.len() > SEED_FILE_MAX {
                return Err(SeedError::TooLarge {
                    file: name,
                    len: data.len(),
                });
            }
        }
        let used: usize = files
            .iter()
            .map(|(_, _, d)| d.len().div_ceil(CLUSTER))
            .sum();
        // A little room beyond the files; well below FAT12's limit (3 x 4 MiB = 3,072).
        let clusters = (used + 16).min(FAT12_MAX_CLUSTERS);
        let fat_sectors = ((clusters + 2) * 3).div_ceil(2).div_ceil(SECTOR);
        let fat_sectors = fat_sectors.div_ceil(CLUSTER_SECTORS) * CLUSTER_SECTORS;
        let layout = Layout {
            fat_sectors,
            clusters,
        };
        let mut img = vec![0u8; layout.total_sectors() * SECTOR];
        layout.boot_sector(&mut img[..SECTOR]);
        let mut fat = Fat12::new(clusters);
        let mut dir = vec![0u8; ROOT_SECTORS * SECTOR];
        label_entry(&mut dir[..32]);
        let mut next_cluster = 2usize;
        let mut slot = 1usize;
        for (name, short, data) in &files {
            let n = data.len().div_ceil(CLUSTER);
            let first = if n == 0 { 0 } else { next_cluster };
            for c in next_cluster..next_cluster + n {
                fat.set(
                    c,
                    if c + 1 < next_cluster + n {
                        c + 1
                    } else {
                        0xfff
                    },
                );
            }
            let at = layout.cluster_offset(next_cluster);
            img[at..at + data.len()].copy_from_slice(data);
            next_cluster += n;
            slot = file_entries(&mut dir, slot, name, short, first, data.len());
        }
        let fat_bytes = fat.bytes();
        for copy in 0..2 {
            let at = (RESERVED_SECTORS + copy * fat_sectors) * SECTOR;
            img[at..at + fat_bytes.len()].copy_from_slice(&fat_bytes);
        }
        let root = layout.root_offset();
        img[root..root + dir.len()].copy_from_slice(&dir);
        Ok(img)
    }

    /// Writes the seed image to `path`, created new (`O_EXCL|O_NOFOLLOW`, mode 0600). A stale
    /// seed of an earlier run (a regular file of this user) is replaced; anything else at
    /// `path` (a symlink, another user's file) is refused, never written through.
    pub fn write_to(&self, path: &Path) -> Result<(), SeedError> {
        let img = self.build()?;
        let write = |source| SeedError::Write {
            path: path.to_path_buf(),
            source,
        };
        remove_stale(path)?;
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(write)?;
        file.write_all(&img).map_err(write)
    }
}

/// Removes a seed left by an earlier run at `path`: only a regular file of this user.
fn remove_stale(path: &Path) -> Result<(), SeedError> {
    let write = |source| SeedError::Write {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(write(e)),
    };
    let kind = if meta.file_type().is_symlink() {
        "symlink"
    } else if meta.file_type().is_file() {
        "file"
    } else {
        "special file"
    };
    if kind != "file" || meta.uid() != sys::euid() {
        return Err(SeedError::InTheWay {
            path: path.to_path_buf(),
            kind,
            owner: meta.uid(),
        });
    }
    std::fs::remove_file(path).map_err(write)
}

struct Layout {
    fat_sectors: usize,
    clusters: usize,
}

impl Layout {
    fn root_offset(&self) -> usize {
        (RESERVED_SECTORS + 2 * self.fat_sectors) * SECTOR
    }

    fn cluster_offset(&self, cluster: usize) -> usize {
        self.root_offset() + ROOT_SECTORS * SECTOR + (cluster - 2) * CLUSTER
    }

    fn total_sectors(&self) -> usize {
        RESERVED_SECTORS + 2 * self.fat_sectors + ROOT_SECTORS + self.clusters * CLUSTER_SECTORS
    }

    /// The boot sector: a jump, the BIOS parameter block and the extended boot record.
    fn boot_sector(&self, s: &mut [u8]) {
        let total = self.total_sectors();
        s[..3].copy_from_slice(&[0xeb, 0x3c, 0x90]);
        s[3..11].copy_from_slice(b"VMHOST  ");
        put16(s, 11, SECTOR);
        put(s, 13, CLUSTER_SECTORS, 1);
        put16(s, 14, RESERVED_SECTORS);
        s[16] = 2; // FATs
        put16(s, 17, ROOT_ENTRIES);
        if total < 0x1_0000 {
            put16(s, 19, total);
        } else {
            put32(s, 32, total);
        }
        s[21] = 0xf8; // fixed disk
        put16(s, 22, self.fat_sectors);
        put16(s, 24, 32); // sectors per track
        put16(s, 26, 64); // heads
        s[36] = 0x80; // drive number
        s[38] = 0x29; // extended boot signature
        s[39..43].copy_from_slice(&0x5345_4544u32.to_le_bytes()); // volume id
        s[43..54].copy_from_slice(&padded_label());
        s[54..62].copy_from_slice(b"FAT12   ");
        s[510] = 0x55;
        s[511] = 0xaa;
    }
}

fn padded_label() -> [u8; 11] {
    let mut l = [b' '; 11];
    l[..SEED_LABEL.len()].copy_from_slice(SEED_LABEL.as_bytes());
    l
}

fn put16(s: &mut [u8], at: usize, v: usize) {
    put(s, at, v, 2);
}

fn put32(s: &mut [u8], at: usize, v: usize) {
    put(s, at, v, 4);
}

/// Stores the low `width` bytes of `v`, little endian; every field written here is bounded
/// by the layout (at most 3 files of 4 MiB), so nothing is cut off.
fn put(s: &mut [u8], at: usize, v: usize, width: usize) {
    debug_assert!(
        width == 8 || (v as u64) >> (8 * width) == 0,
        "{v} does not fit"
    );
    s[at..at + width].copy_from_slice(&(v as u64).to_le_bytes()[..width]);
}

/// The 12-bit file allocation table.
struct Fat12 {
    entries: Vec<u16>,
}

impl Fat12 {
    fn new(clusters: usize) -> Self {
        let mut entries = vec![0u16; clusters + 2];
        entries[0] = 0xff8; // media descriptor
        entries[1] = 0xfff;
        Fat12 { entries }
    }

    fn set(&mut self, cluster: usize, next: usize) {
        self.entries[cluster] = u16::try_from(next & 0xfff).unwrap_or(0xfff);
    }

    /// Two entries pack into three bytes.
    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.entries.len() * 3 / 2 + 2);
        for pair in self.entries.chunks(2) {
            let a = pair[0];
            let b = pair.get(1).copied().unwrap_or(0);
            let [a_lo, a_hi] = a.to_le_bytes();
            let [b_lo, b_hi] = b.to_le_bytes();
            out.push(a_lo);
            out.push((a_hi & 0x0f) | (b_lo << 4));
            out.push((b_lo >> 4) | (b_hi << 4));
        }
        out
    }
}

/// The volume-label directory entry (what blkid reports as LABEL).
fn label_entry(e: &mut [u8]) {
    e[..11].copy_from_slice(&padded_label());
    e[11] = 0x08;
}

/// Writes the long-name entries and the 8.3 entry of one file from directory slot `slot`;
/// returns the next free slot.
fn file_entries(
    dir: &mut [u8],
    mut slot: usize,
    name: &str,
    short: &[u8; 11],
    first_cluster: usize,
    len: usize,
) -> usize {
    let sum = short.iter().fold(0u8, |s, &b| {
        ((s & 1) << 7).wrapping_add(s >> 1).wrapping_add(b)
    });
    let units: Vec<u16> = name.encode_utf16().collect();
    let parts = units.len().div_ceil(13);
    for part in (0..parts).rev() {
        let e = &mut dir[slot * 32..slot * 32 + 32];
        let order = u8::try_from(part + 1).unwrap_or(0x1f);
        e[0] = order | if part + 1 == parts { 0x40 } else { 0 };
        e[11] = 0x0f;
        e[13] = sum;
        let offsets = [1, 3, 5, 7, 9, 14, 16, 18, 20, 22, 24, 28, 30];
        for (i, &off) in offsets.iter().enumerate() {
            let u = match units.get(part * 13 + i) {
                Some(&u) => u,
                None if part * 13 + i == units.len() => 0,
                None => 0xffff,
            };
            e[off..off + 2].copy_from_slice(&u.to_le_bytes());
        }
        slot += 1;
    }
    let e = &mut dir[slot * 32..slot * 32 + 32];
    e[..11].copy_from_slice(short);
    e[11] = 0x20; // archive
    put16(e, 26, first_cluster);
    put32(e, 28, len);
    slot + 1
}

#[cfg(test)]
#[path = "seed_tests.rs"]
mod tests;
