#![allow(clippy::cast_possible_truncation)] // test data: small known values
use std::path::Path;

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::testutil::{clear_dirty, dirty_pages, memory, TestQueue, DATA, F_NEXT, F_WRITE, SPLIT};

const HDR: u64 = DATA;
const BUF: u64 = DATA + 0x1000;
const STATUS: u64 = DATA + 0x80_0000;

/// An image of `sectors` sectors whose byte i is (i * 7 + i / 512) as u8.
fn image(dir: &Path, sectors: u64) -> std::path::PathBuf {
    let path = dir.join("disk.img");
    let data: Vec<u8> = (0..sectors * 512)
        .map(|i| (i * 7 + i / 512) as u8)
        .collect();
    std::fs::write(&path, data).unwrap();
    path
}

fn block(path: &Path, read_only: bool, cache: CacheMode) -> Block {
    Block::new(&BlockConfig {
        path: path.to_path_buf(),
        read_only,
        cache,
        serial: "vmhost-disk-0".into(),
    })
    .unwrap()
}

fn header(mem: &GuestMemoryMmap, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&kind.to_le_bytes());
    h[8..].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GuestAddress(HDR)).unwrap();
}

fn status(mem: &GuestMemoryMmap) -> u32 {
    u32::from(mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
}

/// Runs one request made of `bufs` and returns (status, used length).
fn run(blk: &mut Block, mem: &GuestMemoryMmap, bufs: &[(u64, u32, bool)]) -> (u32, u32) {
    let mut q = TestQueue::new(mem, 0, 256);
    let mut queue = q.queue();
    mem.write_obj(0xeeu8, GuestAddress(STATUS)).unwrap();
    q.post(bufs);
    assert!(blk.process_queue(0, &mut queue, mem).unwrap());
    (status(mem), q.used(0).1)
}

fn read_req(blk: &mut Block, mem: &GuestMemoryMmap, sector: u64, len: u32) -> (u32, u32) {
    header(mem, VIRTIO_BLK_T_IN, sector);
    run(
        blk,
        mem,
        &[(HDR, 16, false), (BUF, len, true), (STATUS, 1, true)],
    )
}

fn write_req(blk: &mut Block, mem: &GuestMemoryMmap, sector: u64, data: &[u8]) -> (u32, u32) {
    header(mem, VIRTIO_BLK_T_OUT, sector);
    mem.write_slice(data, GuestAddress(BUF)).unwrap();
    let len = u32::try_from(data.len()).unwrap();
    run(
        blk,
        mem,
        &[(HDR, 16, false), (BUF, len, false), (STATUS, 1, true)],
    )
}

fn check_reads_match_the_image(cache: CacheMode) {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 64);
    let file = std::fs::read(&path).unwrap();
    let mut blk = block(&path, false, cache);
    let mem = memory();
    for (sector, len) in [(0u64, 512u32), (3, 4096), (1, 512 * 9), (56, 4096)] {
        assert_eq!(
            read_req(&mut blk, &mem, sector, len),
            (VIRTIO_BLK_S_OK, len + 1)
        );
        let mut got = vec![0u8; len as usize];
        mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
        let at = (sector * 512) as usize;
        assert_eq!(
            got,
            file[at..at + len as usize],
            "sector {sector} len {len}"
        );
    }
    assert_eq!(blk.stats().reads, 4);
}

/// A read lands in guest memory behind vm-memory's back (`preadv`, or the bounce buffer with
/// O_DIRECT): its buffer pages, the status byte and the used ring must be dirty for live
/// migration, and nothing else.
fn check_a_read_marks_exactly_the_pages_it_wrote(cache: CacheMode) {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 64);
    let mut blk = block(&path, false, cache);
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 256);
    let mut queue = q.queue();
    header(&mem, VIRTIO_BLK_T_IN, 2);
    q.post(&[
        (HDR, 16, false),
        (BUF + 512, 3 * 4096, true),
        (STATUS, 1, true),
    ]);
    let used = virtio_queue::QueueT::used_ring(&queue);
    clear_dirty(&mem);
    assert!(blk.process_queue(0, &mut queue, &mem).unwrap());
    assert_eq!(status(&mem), VIRTIO_BLK_S_OK);
    // The used ring of 256 entries: flags, idx, 256 x 8 bytes, avail_event.
    let used_end = used + 4 + 8 * 256 + 2;
    let mut want: Vec<u64> = (used / 4096..used_end.div_ceil(4096))
        .chain((BUF / 4096)..=((BUF + 512 + 3 * 4096 - 1) / 4096))
        .chain([STATUS / 4096])
        .map(|p| p * 4096)
        .collect();
    want.sort_unstable();
    want.dedup();
    assert_eq!(dirty_pages(&mem), want, "{cache:?}");
}

#[test]
fn a_read_marks_exactly_the_pages_it_wrote_writeback() {
    check_a_read_marks_exactly_the_pages_it_wrote(CacheMode::Writeback);
}

#[test]
fn a_read_marks_exactly_the_pages_it_wrote_o_direct() {
    check_a_read_marks_exactly_the_pages_it_wrote(CacheMode::None);
}

#[test]
fn reads_match_the_image_byte_for_byte_writeback() {
    check_reads_match_the_image(CacheMode::Writeback);
}

#[test]
fn reads_match_the_image_byte_for_byte_direct() {
    check_reads_match_the_image(CacheMode::None);
}

fn check_writes_land_in_the_image(cache: CacheMode) {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 64);
    let mut expect = std::fs::read(&path).unwrap();
    let mut blk = block(&path, false, cache);
    let mem = memory();
    // Unaligned to 4 KiB on purpose (sector 5, 3 sectors): the direct path reads, modifies
    // and writes whole blocks.
    let data: Vec<u8> = (0..1536u32).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    assert_eq!(write_req(&mut blk, &mem, 5, &data), (VIRTIO_BLK_S_OK, 1));
    expect[5 * 512..5 * 512 + 1536].copy_from_slice(&data);
    header(&mem, VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(
        run(&mut blk, &mem, &[(HDR, 16, false), (STATUS, 1, true)]).0,
        VIRTIO_BLK_S_OK
    );
    assert_eq!(std::fs::read(&path).unwrap(), expect);
    assert_eq!(blk.stats().writes, 1);
    assert_eq!(blk.stats().flushes, 1);
}

#[test]
fn writes_land_in_the_image_writeback() {
    check_writes_land_in_the_image(CacheMode::Writeback);
}

#[test]
fn writes_land_in_the_image_direct() {
    check_writes_land_in_the_image(CacheMode::None);
}

#[test]
fn a_read_only_disk_refuses_writes_with_ioerr_and_offers_ro() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 8);
    let before = std::fs::read(&path).unwrap();
    let mut blk = block(&path, true, CacheMode::Writeback);
    assert_ne!(blk.features() & (1 << VIRTIO_BLK_F_RO), 0);
    let mem = memory();
    assert_eq!(
        write_req(&mut blk, &mem, 0, &[0xab; 512]).0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(blk.stats().errors, 1);
    assert_eq!(read_req(&mut blk, &mem, 0, 512).0, VIRTIO_BLK_S_OK);
}

#[test]
fn requests_past_the_end_or_not_whole_sectors_get_ioerr() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 8);
    let mut blk = block(&path, false, CacheMode::Writeback);
    let mem = memory();
    assert_eq!(read_req(&mut blk, &mem, 7, 1024).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(
        read_req(&mut blk, &mem, u64::MAX / 256, 512).0,
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(read_req(&mut blk, &mem, 0, 100).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(read_req(&mut blk, &mem, 7, 512).0, VIRTIO_BLK_S_OK);
}

#[test]
fn get_id_returns_the_serial_and_unknown_types_are_unsupported() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 8);
    let mut blk = block(&path, false, CacheMode::Writeback);
    let mem = memory();
    header(&mem, VIRTIO_BLK_T_GET_ID, 0);
    let bufs = [(HDR, 16, false), (BUF, 20, true), (STATUS, 1, true)];
    assert_eq!(run(&mut blk, &mem, &bufs), (VIRTIO_BLK_S_OK, 21));
    let mut id = [0u8; 20];
    mem.read_slice(&mut id, GuestAddress(BUF)).unwrap();
    assert_eq!(&id[..13], b"vmhost-disk-0");
    assert_eq!(id[13..], [0; 7]);
    header(&mem, VIRTIO_BLK_T_DISCARD, 0);
    assert_eq!(
        run(&mut blk, &mem, &[(HDR, 16, false), (STATUS, 1, true)]).0,
        VIRTIO_BLK_S_UNSUPP
    );
}

#[test]
fn config_space_carries_capacity_and_limits() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 24);
    let blk = block(&path, false, CacheMode::Writeback);
    let c = blk.config();
    assert_eq!(c[..8], 24u64.to_le_bytes());
    assert_eq!(c[8..12], BLOCK_SIZE_MAX.to_le_bytes());
    assert_eq!(c[12..16], BLOCK_SEG_MAX.to_le_bytes());
    assert_eq!(blk.features() & (1 << VIRTIO_BLK_F_RO), 0);
    assert_ne!(blk.features() & (1 << VIRTIO_BLK_F_FLUSH), 0);
}

#[test]
fn cache_none_refuses_an_image_that_is_not_whole_pages() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 3);
    let err = Block::new(&BlockConfig {
        path,
        read_only: false,
        cache: CacheMode::None,
        serial: String::new(),
    })
    .unwrap_err();
    assert!(matches!(
        err,
        BlockError::Image(DiskError::DirectUnaligned { size: 1536, .. })
    ));
}

/// A ramfs mount (a file system without O_DIRECT, like tmpfs before Linux 6.6), unmounted on
/// drop. Needs root, as the tap tests do.
struct Ramfs(tempfile::TempDir);

impl Ramfs {
    fn mount() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "ramfs", "ramfs"])
            .arg(dir.path())
            .status()
            .expect("mount(8) is missing");
        assert!(status.success(), "mount -t ramfs needs root: {status}");
        Ramfs(dir)
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

/// Regression: the cloud-init seed (cache left out, so O_DIRECT) failed to open with EINVAL
/// in the emulated host, whose /tmp is a tmpfs without O_DIRECT (Linux 6.1). Left out, the
/// cache falls back to the page cache there; `none` asked for explicitly is a clear error.
#[test]
fn cache_auto_falls_back_to_the_page_cache_without_o_direct() {
    let fs = Ramfs::mount();
    let path = fs.0.path().join("seed.img");
    std::fs::write(&path, vec![7u8; 8192]).unwrap();
    let err = DiskImage::open(&path, false, CacheMode::None).unwrap_err();
    assert!(
        matches!(err, DiskError::DirectUnsupported { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("use cache writeback"), "{err}");
    let mut auto = DiskImage::open(&path, false, CacheMode::Auto).unwrap();
    assert!(!auto.is_direct());
    let mut buf = [0u8; 512];
    auto.read_at(512, &mut buf).unwrap();
    assert_eq!(buf, [7u8; 512]);
    // Where O_DIRECT works, auto uses it for whole 4 KiB blocks and not for odd sizes.
    let dir = tempfile::tempdir().unwrap();
    let whole = image(dir.path(), 16);
    assert!(DiskImage::open(&whole, true, CacheMode::Auto)
        .unwrap()
        .is_direct());
    let odd = image(dir.path(), 3);
    assert!(!DiskImage::open(&odd, true, CacheMode::Auto)
        .unwrap()
        .is_direct());
}

#[test]
fn a_directory_or_fifo_is_not_an_image() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for (path, kind) in [(dir.path().to_path_buf(), "directory"), (fifo, "FIFO")] {
        let err = DiskImage::open(&path, false, CacheMode::Writeback).unwrap_err();
        assert!(
            matches!(err, DiskError::NotAnImage { kind: k, .. } if k == kind),
            "{err:?}"
        );
    }
}

/// A FIFO opened read-only would wait for a writer: the open never blocks (O_NONBLOCK) and the
/// descriptor's type (fstat) refuses it, in every cache mode. The open runs on a thread and is
/// awaited with a bound, so a regression fails instead of hanging the suite.
#[test]
fn a_fifo_is_refused_at_once_on_its_descriptor_in_every_cache_mode() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for cache in [CacheMode::Writeback, CacheMode::None, CacheMode::Auto] {
        for read_only in [true, false] {
            let (tx, rx) = std::sync::mpsc::channel();
            let path = fifo.clone();
            std::thread::spawn(move || {
                tx.send(DiskImage::open(&path, read_only, cache).map(|_| ()))
            });
            let result = rx
                .recv_timeout(std::time::Duration::from_secs(30))
                .expect("opening a FIFO blocked");
            let err = result.unwrap_err();
            assert!(
                matches!(err, DiskError::NotAnImage { kind: "FIFO", .. }),
                "{cache:?} read_only {read_only}: {err:?}"
            );
            assert!(err.to_string().contains(fifo.to_str().unwrap()), "{err}");
        }
    }
}

/// A path that is a regular image when looked at and a FIFO when opened (swapped at the
/// moment of the `openat`, held there with a seccomp user notification, so the order is
/// deterministic): the open must not block and the FIFO must be refused. A check of the path
/// followed by a blocking open would pass the image and then wait forever for a writer.
#[test]
fn an_image_swapped_for_a_fifo_at_the_open_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::write(&path, vec![0u8; 4096]).unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);

    let (fd_tx, fd_rx) = std::sync::mpsc::channel();
    let (tx, rx) = std::sync::mpsc::channel();
    let opener = path.clone();
    std::thread::spawn(move || {
        fd_tx.send(notify_on_openat()).unwrap();
        tx.send(DiskImage::open(&opener, true, CacheMode::Writeback).map(|_| ()))
            .unwrap();
    });
    let listener: std::os::fd::OwnedFd = fd_rx.recv().unwrap();
    // SAFETY: seccomp_notif is plain integers; all zeroes is valid (and required by RECV).
    let mut req: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: `req` is the struct the request's size names and outlives the call; the
    // listener fd is open.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&listener),
            libc::SECCOMP_IOCTL_NOTIF_RECV,
            std::ptr::from_mut(&mut req),
        )
    };
    assert_eq!(rc, 0, "NOTIF_RECV: {}", std::io::Error::last_os_error());
    assert_eq!(i64::from(req.data.nr), libc::SYS_openat);
    std::fs::rename(&fifo, &path).unwrap();
    let mut resp = libc::seccomp_notif_resp {
        id: req.id,
        val: 0,
        error: 0,
        flags: libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32,
    };
    // SAFETY: as above, with the response struct.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&listener),
            libc::SECCOMP_IOCTL_NOTIF_SEND,
            std::ptr::from_mut(&mut resp),
        )
    };
    assert_eq!(rc, 0, "NOTIF_SEND: {}", std::io::Error::last_os_error());
    // Later openat calls of that thread, if any, now fail with ENOSYS instead of waiting.
    drop(listener);
    let result = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the open blocked on the FIFO swapped in");
    let err = result.unwrap_err();
    assert!(
        matches!(err, DiskError::NotAnImage { kind: "FIFO", .. }),
        "{err:?}"
    );
}

/// Installs, on the calling thread only, a seccomp filter that hands each `openat` to the
/// returned listener (user notification) and allows everything else.
fn notify_on_openat() -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    let stmt = |code: u16, k: u32, jt: u8, jf: u8| libc::sock_filter { code, jt, jf, k };
    let nr = u32::try_from(libc::SYS_openat).unwrap();
    let mut prog = [
        stmt(0x20, 0, 0, 0),                            // ld [nr]
        stmt(0x15, nr, 0, 1),                           // jeq openat
        stmt(0x06, libc::SECCOMP_RET_USER_NOTIF, 0, 0), // ret notify
        stmt(0x06, libc::SECCOMP_RET_ALLOW, 0, 0),      // ret allow
    ];
    let fprog = libc::sock_fprog {
        len: 4,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) takes no pointers and affects only this thread.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    assert_eq!(rc, 0);
    // SAFETY: `fprog` points at `prog`, four valid instructions, both outliving the call; the
    // filter applies to this thread only (no TSYNC).
    let fd = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            std::ptr::from_ref(&fprog),
        )
    };
    assert!(fd >= 0, "seccomp: {}", std::io::Error::last_os_error());
    // SAFETY: the new listener descriptor is owned here from now on.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(i32::try_from(fd).unwrap()) }
}

/// Runs a malformed request and returns the device error.
fn malformed(bufs: &[(u64, u32, bool)]) -> DeviceError {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 8);
    let mut blk = block(&path, false, CacheMode::Writeback);
    let mem = memory();
    header(&mem, VIRTIO_BLK_T_IN, 0);
    let mut q = TestQueue::new(&mem, 0, 256);
    let mut queue = q.queue();
    q.post(bufs);
    let err = blk.process_queue(0, &mut queue, &mem).unwrap_err();
    assert_eq!(q.used_idx(), 0);
    err
}

fn is_chain(err: &DeviceError, f: impl Fn(&ChainError) -> bool) -> bool {
    matches!(err, DeviceError::Chain { queue: 0, source } if f(source))
}

#[test]
fn malformed_header_in_a_writable_buffer() {
    let err = malformed(&[(HDR, 16, true), (STATUS, 1, true)]);
    assert!(
        is_chain(&err, |e| matches!(e, ChainError::Direction { .. })),
        "{err:?}"
    );
}

#[test]
fn malformed_no_status_byte() {
    let err = malformed(&[(HDR, 16, false), (BUF, 512, false)]);
    assert!(
        is_chain(&err, |e| matches!(e, ChainError::Direction { .. })),
        "{err:?}"
    );
}

#[test]
fn malformed_readable_after_writable() {
    let err = malformed(&[
        (HDR, 16, false),
        (BUF, 512, true),
        (BUF, 16, false),
        (STATUS, 1, true),
    ]);
    assert!(
        is_chain(&err, |e| matches!(
            e,
            ChainError::ReadableAfterWritable { .. }
        )),
        "{err:?}"
    );
}

#[test]
fn malformed_buffer_outside_guest_memory() {
    let far = crate::testutil::MEM_SIZE as u64 - 256;
    let err = malformed(&[(HDR, 16, false), (far, 512, true), (STATUS, 1, true)]);
    assert!(
        is_chain(&err, |e| matches!(e, ChainError::OutOfRange { .. })),
        "{err:?}"
    );
    let err = malformed(&[
        (HDR, 16, false),
        (u64::MAX - 16, 512, true),
        (STATUS, 1, true),
    ]);
    assert!(
        is_chain(&err, |e| matches!(e, ChainError::OutOfRange { .. })),
        "{err:?}"
    );
}

#[test]
fn malformed_oversized_request() {
    // 33 writable MiB (the same guest MiB, 33 times) against a 31.75 MiB limit.
    let mut bufs = vec![(HDR, 16, false)];
    bufs.extend(std::iter::repeat_n((BUF, 1 << 20, true), 33));
    bufs.push((STATUS, 1, true));
    let err = malformed(&bufs);
    assert!(
        is_chain(&err, |e| matches!(e, ChainError::Oversized { .. })),
        "{err:?}"
    );
}

#[test]
fn malformed_too_many_segments_through_an_indirect_table() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 8);
    let mut blk = block(&path, false, CacheMode::Writeback);
    let mem = memory();
    // An indirect table of seg_max + 3 descriptors: header, seg_max + 1 data, status.
    let table = DATA + 0x40_0000;
    let n = BLOCK_SEG_MAX as u16 + 3;
    for i in 0..n {
        let (addr, len, flags) = match i {
            0 => (HDR, 16, F_NEXT),
            i if i == n - 1 => (STATUS, 1, F_WRITE),
            i => (BUF + u64::from(i) * 512, 512, F_WRITE | F_NEXT),
        };
        let d = virtio_queue::desc::split::Descriptor::new(addr, len, flags, i + 1);
        mem.write_obj(d, GuestAddress(table + u64::from(i) * 16))
            .unwrap();
    }
    let mut q = TestQueue::new(&mem, 0, 256);
    let mut queue = q.queue();
    let indirect = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
    q.post_raw(&[(table, u32::from(n) * 16, indirect, 0)], 0);
    let err = blk.process_queue(0, &mut queue, &mem).unwrap_err();
    let segments = |e: &ChainError| {
        matches!(
            e,
            ChainError::Oversized {
                what: "segments",
                ..
            }
        )
    };
    assert!(is_chain(&err, segments), "{err:?}");
}

#[test]
fn malformed_descriptor_loop_and_next_past_the_table() {
    for (descs, why) in [
        (
            vec![(HDR, 16, F_NEXT, 1), (BUF, 512, F_WRITE | F_NEXT, 0)],
            "loop",
        ),
        (vec![(HDR, 16, F_NEXT, 300)], "next index past the table"),
        (vec![(HDR, 16, F_NEXT, 0)], "self loop"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = image(dir.path(), 8);
        let mut blk = block(&path, false, CacheMode::Writeback);
        let mem = memory();
        let mut q = TestQueue::new(&mem, 0, 256);
        let mut queue = q.queue();
        q.post_raw(&descs, 0);
        let err = blk.process_queue(0, &mut queue, &mem).unwrap_err();
        assert!(
            is_chain(&err, |e| matches!(e, ChainError::Broken { .. })),
            "{why}: {err:?}"
        );
    }
}

#[test]
fn malformed_indirect_table_outside_guest_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 8);
    let mut blk = block(&path, false, CacheMode::Writeback);
    let mem = memory();
    let mut q = TestQueue::new(&mem, 0, 256);
    let mut queue = q.queue();
    let indirect = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
    q.post_raw(&[(u64::from(u32::MAX) << 8, 64, indirect, 0)], 0);
    let err = blk.process_queue(0, &mut queue, &mem).unwrap_err();
    assert!(
        is_chain(&err, |e| matches!(e, ChainError::Broken { .. })),
        "{err:?}"
    );
}

/// (address, length) data buffers for the tests below, against [`memory_two_regions`].
type Bufs = &'static [(u64, u32)];

/// 16 KiB in whole 4 KiB pages, over three descriptors, the middle one across the regions.
const ALIGNED: Bufs = &[
    (SPLIT - 0x2000, 0x1000),
    (SPLIT - 0x1000, 0x2000),
    (SPLIT + 0x3000, 0x1000),
];
/// 3 KiB in sectors that are not whole pages, the first one across the regions.
const UNALIGNED: Bufs = &[(SPLIT - 0x200, 0x400), (SPLIT + 0x10200, 0x800)];

fn data_request(kind: u32, bufs: Bufs) -> Vec<(u64, u32, bool)> {
    let mut chain = vec![(HDR, 16, false)];
    let writable = kind == VIRTIO_BLK_T_IN;
    chain.extend(bufs.iter().map(|&(a, l)| (a, l, writable)));
    chain.push((STATUS, 1, true));
    chain
}

fn total(bufs: Bufs) -> usize {
    bufs.iter().map(|&(_, l)| l as usize).sum()
}

/// The bytes of `bufs` in guest memory, in order.
fn gather(mem: &GuestMemoryMmap, bufs: Bufs) -> Vec<u8> {
    let mut out = Vec::new();
    for &(addr, len) in bufs {
        let mut b = vec![0u8; len as usize];
        mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        out.extend(b);
    }
    out
}

/// Reads and writes whose data buffers span several descriptors and both memory regions land
/// byte for byte; with O_DIRECT, only requests that are not whole aligned pages bounce.
fn check_vectored_requests(cache: CacheMode) {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 128);
    let mut expect = std::fs::read(&path).unwrap();
    let mut blk = block(&path, false, cache);
    let direct = blk.cache_mode() == "none";
    assert_eq!(direct, cache == CacheMode::None);
    let mem = crate::testutil::memory_two_regions();
    let mut bounced = 0;
    // (sector, buffers, bounces with O_DIRECT)
    let cases: [(u64, Bufs, bool); 4] = [
        (8, ALIGNED, false),
        (3, ALIGNED, true),
        (16, UNALIGNED, true),
        (1, UNALIGNED, true),
    ];
    for (i, &(sector, bufs, bounces)) in cases.iter().enumerate() {
        let at = sector as usize * 512;
        let len = total(bufs);
        // Read: the guest's buffers get the image's bytes.
        for &(addr, l) in bufs {
            mem.write_slice(&vec![0xcc; l as usize], GuestAddress(addr))
                .unwrap();
        }
        header(&mem, VIRTIO_BLK_T_IN, sector);
        let got = run(&mut blk, &mem, &data_request(VIRTIO_BLK_T_IN, bufs));
        assert_eq!(got, (VIRTIO_BLK_S_OK, len as u32 + 1), "read {i}");
        assert_eq!(gather(&mem, bufs), expect[at..at + len], "read {i}");
        // Write: new bytes from the guest's buffers land in the image.
        let data: Vec<u8> = (0..len).map(|j| (j * 13 + i * 41) as u8 ^ 0xa5).collect();
        let mut done = 0;
        for &(addr, l) in bufs {
            let l = l as usize;
            mem.write_slice(&data[done..done + l], GuestAddress(addr))
                .unwrap();
            done += l;
        }
        header(&mem, VIRTIO_BLK_T_OUT, sector);
        let got = run(&mut blk, &mem, &data_request(VIRTIO_BLK_T_OUT, bufs));
        assert_eq!(got, (VIRTIO_BLK_S_OK, 1), "write {i}");
        expect[at..at + len].copy_from_slice(&data);
        assert_eq!(std::fs::read(&path).unwrap(), expect, "write {i}");
        if direct && bounces {
            bounced += 2;
        }
        assert_eq!(blk.stats().bounced, bounced, "request {i}");
    }
    assert_eq!(blk.stats().reads, 4);
    assert_eq!(blk.stats().writes, 4);
    assert_eq!(blk.stats().errors, 0);
}

#[test]
fn vectored_requests_across_descriptors_and_regions_writeback() {
    check_vectored_requests(CacheMode::Writeback);
}

#[test]
fn vectored_requests_across_descriptors_and_regions_direct() {
    check_vectored_requests(CacheMode::None);
}

#[test]
fn o_direct_takes_the_vectored_path_only_for_whole_aligned_blocks() {
    use crate::disk::vectored_ok;
    let all = |_| true;
    let none = |_| false;
    assert!(
        vectored_ok(false, 512, none),
        "the page cache takes anything"
    );
    assert!(vectored_ok(true, 8192, all));
    assert!(!vectored_ok(true, 8192, none), "an unaligned buffer");
    assert!(!vectored_ok(true, 512, all), "an unaligned offset");
    let mut asked = 0;
    vectored_ok(true, 0, |a| {
        asked = a;
        true
    });
    assert_eq!(asked, crate::sys::DIRECT_ALIGN);
}

/// A read past the end of a file that shrank after it was opened: preadv hits the end of the
/// file, the request gets IOERR instead of looping.
#[test]
fn a_read_past_the_end_of_a_shrunk_image_is_ioerr() {
    let dir = tempfile::tempdir().unwrap();
    let path = image(dir.path(), 16);
    let mut blk = block(&path, false, CacheMode::Writeback);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let mem = memory();
    assert_eq!(read_req(&mut blk, &mem, 4, 4096).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(read_req(&mut blk, &mem, 0, 4096).0, VIRTIO_BLK_S_OK);
    assert_eq!(blk.stats().errors, 1);
}
