//! A raw disk image file: opened read-write or read-only, with the page cache (`writeback`)
//! or without it (`none`, O_DIRECT). Requests go straight between the file and guest memory
//! (`preadv`/`pwritev`), except O_DIRECT ones that are not whole aligned blocks: those take
//! aligned bounce buffers. When the spec leaves the
//! mode out (`auto`), O_DIRECT is used where the image's file system takes it and the image is
//! whole 4 KiB blocks, and the page cache otherwise — KubeVirt's rule: tmpfs before Linux 6.6,
//! for one, refuses O_DIRECT, and a generated seed in `/tmp` lands there.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::iov::{GuestDst, GuestSrc};
use crate::sys::{AlignedBuf, DIRECT_ALIGN};

/// Bytes per virtio-blk sector.
pub const SECTOR_SIZE: u64 = 512;

/// How the host caches the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// O_DIRECT: no host page cache; the image size must be a multiple of 4 KiB.
    None,
    /// Through the host page cache; FLUSH makes writes durable.
    #[default]
    Writeback,
    /// O_DIRECT if the file system supports it and the size is whole 4 KiB blocks, else the
    /// page cache.
    Auto,
}

/// Why an image could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// open(2) failed.
    #[error("cannot open disk image {path}")]
    Open {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The path is not a regular file or a block device.
    #[error("disk image {path} is a {kind}, not a regular file or block device")]
    NotAnImage {
        /// The image.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// O_DIRECT needs whole 4 KiB blocks.
    #[error("disk image {path}: cache mode none needs a size that is a multiple of 4096 bytes, it is {size}")]
    DirectUnaligned {
        /// The image.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// Cache mode none on a file system without O_DIRECT (open(2) said EINVAL).
    #[error("disk image {path}: its file system does not support O_DIRECT (cache mode none); use cache writeback, leave cache out, or move the image")]
    DirectUnsupported {
        /// The image.
        path: PathBuf,
    },
    /// A bounce buffer could not be allocated.
    #[error("cannot allocate an I/O buffer")]
    Buffer(#[source] io::Error),
}

/// An open image.
pub struct DiskImage {
    file: File,
    size: u64,
    direct: bool,
    scratch: AlignedBuf,
}

impl std::fmt::Debug for DiskImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskImage")
            .field("size", &self.size)
            .field("direct", &self.direct)
            .finish_non_exhaustive()
    }
}

impl DiskImage {
    /// Opens `path`; `read_only` opens it O_RDONLY. The type is checked on the open
    /// descriptor (fstat), as the kernel loader does, and the open never blocks (O_NONBLOCK:
    /// a FIFO is refused at once, and a path swapped after a check cannot slip through).
    pub fn open(path: &Path, read_only: bool, cache: CacheMode) -> Result<Self, DiskError> {
        let (file, size, direct) = open_with_cache(path, read_only, cache)?;
        if direct && size % DIRECT_ALIGN as u64 != 0 {
            return Err(DiskError::DirectUnaligned {
                path: path.to_path_buf(),
                size,
            });
        }
        let scratch = AlignedBuf::new(DIRECT_ALIGN).map_err(DiskError::Buffer)?;
        Ok(DiskImage {
            file,
            size,
            direct,
            scratch,
        })
    }

    /// Size in bytes when opened.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the image bypasses the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Reads `buf.len()` bytes at `offset`; `buf` must come from an [`AlignedBuf`] when direct.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if !self.direct || aligned(offset, buf) {
            return self.file.read_exact_at(buf, offset);
        }
        let (_, skip, _) = self.read_window(offset, buf.len())?;
        buf.copy_from_slice(&self.scratch.as_mut_slice()[skip..skip + buf.len()]);
        Ok(())
    }

    /// Writes `buf` at `offset`; unaligned direct writes read, modify and write whole blocks.
    pub fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        if !self.direct || aligned(offset, buf) {
            return self.file.write_all_at(buf, offset);
        }
        let (start, skip, len) = self.read_window(offset, buf.len())?;
        let scratch = &mut self.scratch.as_mut_slice()[..len];
        scratch[skip..skip + buf.len()].copy_from_slice(buf);
        self.file.write_all_at(scratch, start)
    }

    /// Reads the whole blocks around `n` bytes at `offset` into the scratch buffer (for
    /// unaligned direct I/O): their start offset, where `offset` lies in them, and their length.
    fn read_window(&mut self, offset: u64, n: usize) -> io::Result<(u64, usize, usize)> {
        let (start, end) = widen(offset, n)?;
        self.grow_scratch(end - start)?;
        let len = to_usize(end - start)?;
        self.file
            .read_exact_at(&mut self.scratch.as_mut_slice()[..len], start)?;
        Ok((start, to_usize(offset - start)?, len))
    }

    /// Whether a vectored request at `offset` can go to the file as it is: always through the
    /// page cache; with O_DIRECT only if `offset` and every buffer's address and length are
    /// multiples of [`DIRECT_ALIGN`] (`buffers_aligned(DIRECT_ALIGN)`), else it takes the
    /// bounce path ([`DiskImage::read_at`], [`DiskImage::write_at`]).
    pub fn takes_vectored(&self, offset: u64, buffers_aligned: impl FnOnce(usize) -> bool) -> bool {
        vectored_ok(self.direct, offset, buffers_aligned)
    }

    /// `preadv` of all of `dst` at `offset` (see [`DiskImage::takes_vectored`]).
    pub fn read_vectored_at(&self, offset: u64, dst: &mut GuestDst<'_>) -> io::Result<()> {
        dst.read_exact_at(&self.file, offset)
    }

    /// `pwritev` of all of `src` at `offset` (see [`DiskImage::takes_vectored`]).
    pub fn write_vectored_at(&self, offset: u64, src: &mut GuestSrc<'_>) -> io::Result<()> {
        src.write_all_at(&self.file, offset)
    }

    /// `fdatasync(2)`: makes written data durable.
    pub fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn grow_scratch(&mut self, len: u64) -> io::Result<()> {
        let len = to_usize(len)?;
        if self.scratch.len() < len {
            self.scratch = AlignedBuf::new(len)?;
        }
        Ok(())
    }
}

/// Opens `path` for `cache`: the file, its size and whether it is O_DIRECT.
fn open_with_cache(
    path: &Path,
    read_only: bool,
    cache: CacheMode,
) -> Result<(File, u64, bool), DiskError> {
    let open_err = |source| DiskError::Open {
        path: path.to_path_buf(),
        source,
    };
    let open = |direct: bool| -> io::Result<(File, u64)> {
        let mut opts = OpenOptions::new();
        opts.read(true).write(!read_only);
        // O_NONBLOCK: opening a FIFO read-only would wait for a writer. Regular files and
        // block devices ignore it.
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        opts.custom_flags(flags | if direct { libc::O_DIRECT } else { 0 });
        let file = opts.open(path)?;
        let size = file_size(&file)?;
        Ok((file, size))
    };
    let fail = |e: io::Error| match e.raw_os_error() {
        Some(libc::EISDIR) => DiskError::NotAnImage {
            path: path.to_path_buf(),
            kind: "directory",
        },
        _ => open_err(e),
    };
    // Opened without O_DIRECT, checked on the descriptor.
    let plain = || {
        let (f, n) = open(false).map_err(fail)?;
        image(path, f, n, false)
    };
    let einval = |e: &io::Error| e.raw_os_error() == Some(libc::EINVAL);
    match cache {
        CacheMode::Writeback => plain(),
        CacheMode::None => match open(true) {
            Ok((f, n)) => image(path, f, n, true),
            // A FIFO or a directory refuses O_DIRECT too: say what it is.
            Err(e) if einval(&e) => plain().and(Err(DiskError::DirectUnsupported {
                path: path.to_path_buf(),
            })),
            Err(e) => Err(fail(e)),
        },
        CacheMode::Auto => match open(true) {
            Ok((f, n)) if n % DIRECT_ALIGN as u64 == 0 => image(path, f, n, true),
            Ok((f, n)) => image(path, f, n, true).and_then(|_| plain()),
            Err(e) if einval(&e) => plain(),
            Err(e) => Err(fail(e)),
        },
    }
}

/// `file` (opened at `path`) when fstat says it is a regular file or a block device.
fn image(path: &Path, file: File, size: u64, direct: bool) -> Result<(File, u64, bool), DiskError> {
    let kind = file
        .metadata()
        .map_err(|source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        })?
        .file_type();
    let what = if kind.is_file() || kind.is_block_device() {
        return Ok((file, size, direct));
    } else if kind.is_dir() {
        "directory"
    } else if kind.is_fifo() {
        "FIFO"
    } else if kind.is_socket() {
        "socket"
    } else if kind.is_char_device() {
        "character device"
    } else {
        "special file"
    };
    Err(DiskError::NotAnImage {
        path: path.to_path_buf(),
        kind: what,
    })
}

/// Size of a regular file or a block device.
fn file_size(file: &File) -> io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.file_type().is_block_device() {
        let mut f = file;
        return f.seek(SeekFrom::End(0));
    }
    Ok(meta.len())
}

/// [`DiskImage::takes_vectored`] for an image that is O_DIRECT or not.
pub(crate) fn vectored_ok(
    direct: bool,
    offset: u64,
    buffers_aligned: impl FnOnce(usize) -> bool,
) -> bool {
    !direct || (offset % DIRECT_ALIGN as u64 == 0 && buffers_aligned(DIRECT_ALIGN))
}

fn aligned(offset: u64, buf: &[u8]) -> bool {
    let a = DIRECT_ALIGN as u64;
    offset % a == 0 && buf.len() as u64 % a == 0 && buf.as_ptr() as usize % DIRECT_ALIGN == 0
}

/// The block-aligned range that covers `len` bytes at `offset`.
fn widen(offset: u64, len: usize) -> io::Result<(u64, u64)> {
    let a = DIRECT_ALIGN as u64;
    let end = offset
        .checked_add(len as u64)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "offset overflow"))?;
    Ok((offset / a * a, end.div_ceil(a) * a))
}

fn to_usize(v: u64) -> io::Result<usize> {
    usize::try_from(v).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "length overflow"))
}
