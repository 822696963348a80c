//! Loading the test kernel (bzImage and vmlinux) and an initramfs from a file whose reads
//! return less than asked and sometimes fail with `EINTR`, as a 9p mount's may (issue 23): the
//! bytes in guest memory must equal the file's.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{Bytes, GuestAddress, ReadVolatile, VolatileMemoryError, VolatileSlice};
use vmhost_memory::GuestMemoryMmap;

use super::image::{self, le32, le64};
use super::{load_initrd, load_kernel, low_ram_end, sparse};
use crate::testutil::{guest_memory, layout_of, two_cell_plan};

/// What successive reads may return at most, in turn; every fourth read fails with `EINTR`
/// before reading anything. 262120 is what one 9p read carries with `msize=262144`.
const CHUNKS: [usize; 3] = [4093, 1, 262_120];

/// A real file whose `read` and `read_volatile` return at most the next of [`CHUNKS`] bytes,
/// or `EINTR`.
struct ShortReads {
    file: File,
    calls: usize,
    short: usize,
}

impl ShortReads {
    fn open(path: &Path) -> Self {
        ShortReads {
            file: File::open(path).unwrap(),
            calls: 0,
            short: 0,
        }
    }

    /// The most the next read may return, or `None` for an `EINTR`.
    fn next(&mut self, want: usize) -> Option<usize> {
        self.calls += 1;
        let i = self.calls % (CHUNKS.len() + 1);
        let cap = *CHUNKS.get(i)?;
        if cap < want {
            self.short += 1;
        }
        Some(cap.min(want))
    }
}

impl Read for ShortReads {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self
            .next(buf.len())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINTR))?;
        self.file.read(&mut buf[..n])
    }
}

impl ReadVolatile for ShortReads {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let n = self.next(buf.len()).ok_or_else(|| {
            VolatileMemoryError::IOError(io::Error::from_raw_os_error(libc::EINTR))
        })?;
        self.file.read_volatile(&mut buf.subslice(0, n)?)
    }
}

impl Seek for ShortReads {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        self.file.seek(to)
    }
}

fn kernel(name: &str) -> Option<PathBuf> {
    vmhost_testsupport::test_kernel_file(name)
}

fn guest_bytes(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
    v
}

/// Loads `path` through [`ShortReads`] into 2 x 128 MiB of guest memory; returns the memory
/// and how many reads came back short.
fn load_short(path: &Path) -> (GuestMemoryMmap, super::KernelLoaderResult, usize) {
    let layout = layout_of(&two_cell_plan(128 << 20));
    let mem = guest_memory(&layout);
    let probe = image::probe(path, &mut File::open(path).unwrap()).unwrap();
    let mut src = ShortReads::open(path);
    let (loaded, _) = load_kernel(&mem, path, &mut src, &probe, low_ram_end(&layout))
        .unwrap_or_else(|e| panic!("loading {} through short reads: {e:?}", path.display()));
    (mem, loaded, src.short)
}

#[test]
fn a_bzimage_loads_whole_through_short_reads() {
    let Some(path) = kernel("bzImage") else {
        return;
    };
    let file = std::fs::read(&path).unwrap();
    let (mem, loaded, short) = load_short(&path);
    assert!(short > 0, "the source never read short");
    let setup = (usize::from(file[0x1f1]).max(4) + 1) * 512;
    let payload = &file[setup..];
    assert_eq!(
        loaded.kernel_end - loaded.kernel_load.0,
        payload.len() as u64
    );
    assert!(
        guest_bytes(&mem, loaded.kernel_load.0, payload.len()) == payload,
        "the protected-mode kernel in guest memory differs from the file's"
    );
    let hdr = loaded.setup_header.unwrap();
    let (magic, init_size) = (hdr.header, hdr.init_size);
    assert_eq!(magic, le32(&file, 0x202), "setup header magic");
    assert_eq!(init_size, le32(&file, 0x260), "setup header init_size");
}

#[test]
fn a_vmlinux_loads_whole_through_short_reads() {
    let Some(path) = kernel("vmlinux") else {
        return;
    };
    let file = std::fs::read(&path).unwrap();
    let holes = sparse::nobits_file_ranges(&mut File::open(&path).unwrap()).unwrap();
    let (mem, loaded, short) = load_short(&path);
    assert!(short > 0, "the source never read short");
    let (phoff, phnum) = (le64(&file, 32), usize::from(image::le16(&file, 56)));
    let mut segments = 0;
    for i in 0..phnum {
        let ph = &file[usize::try_from(phoff).unwrap() + i * 56..][..56];
        if le32(ph, 0) != 1 {
            continue;
        }
        let (offset, paddr, filesz) = (le64(ph, 8), le64(ph, 24), le64(ph, 32));
        // The file's bytes, with the .bss ranges zero (they are not copied; RAM is new).
        let mut want =
            file[usize::try_from(offset).unwrap()..][..usize::try_from(filesz).unwrap()].to_vec();
        for h in &holes {
            let (s, e) = (h.start.max(offset), h.end.min(offset + filesz));
            if s < e {
                want[usize::try_from(s - offset).unwrap()..usize::try_from(e - offset).unwrap()]
                    .fill(0);
            }
        }
        assert!(
            guest_bytes(&mem, paddr, want.len()) == want,
            "PT_LOAD {i} at {paddr:#x} differs from the file's bytes"
        );
        segments += 1;
    }
    assert!(segments >= 2, "{segments} PT_LOAD segments checked");
    assert_eq!(loaded.kernel_load.0, 0x100_0000);
}

#[test]
fn an_initrd_loads_whole_through_short_reads() {
    let Some(kernel_path) = kernel("bzImage") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("initrd.img");
    // 3 MiB + 123 bytes, no period that divides the read sizes.
    let bytes: Vec<u8> = (0..(3 << 20) + 123u32)
        .map(|i| u8::try_from(i % 251).unwrap())
        .collect();
    std::fs::write(&path, &bytes).unwrap();
    let layout = layout_of(&two_cell_plan(128 << 20));
    let mem = guest_memory(&layout);
    let probe = image::probe(&kernel_path, &mut File::open(&kernel_path).unwrap()).unwrap();
    let mut src = ShortReads::open(&path);
    let range = load_initrd(
        &mem,
        &path,
        &mut src,
        bytes.len() as u64,
        0x400_0000,
        &probe,
        low_ram_end(&layout),
    )
    .unwrap_or_else(|e| panic!("loading the initrd through short reads: {e:?}"));
    assert!(src.short > 0, "the source never read short");
    assert_eq!(range, 0x400_0000..0x400_0000 + bytes.len() as u64);
    assert!(
        guest_bytes(&mem, range.start, bytes.len()) == bytes,
        "the initrd in guest memory differs from the file"
    );
}

/// The status flags of `file`'s open file description, as the kernel reports them.
fn fd_flags(file: &File) -> i32 {
    use std::os::fd::AsRawFd;
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", file.as_raw_fd())).unwrap();
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .unwrap_or_else(|| panic!("no flags line in fdinfo: {info}"));
    i32::from_str_radix(flags.trim(), 8).unwrap()
}

/// The root cause on 9p: vmhost opened images with `O_NONBLOCK` (so a FIFO cannot block the
/// start), and a non-blocking read of a 9p file returns one server reply at most. The file
/// handed to the loaders must read in blocking mode.
#[test]
fn images_are_read_in_blocking_mode() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("initrd.img");
    std::fs::write(&path, b"070701").unwrap();
    let file = super::open_initrd(&path).unwrap().1;
    assert_eq!(
        fd_flags(&file) & libc::O_NONBLOCK,
        0,
        "the initramfs is still open with O_NONBLOCK"
    );
    let file = super::open_regular(&path, "kernel image", "kernel")
        .unwrap_or_else(|_| panic!("open {}", path.display()));
    assert_eq!(
        fd_flags(&file) & libc::O_NONBLOCK,
        0,
        "the kernel image is still open with O_NONBLOCK"
    );
}
