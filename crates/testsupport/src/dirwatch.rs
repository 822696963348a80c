//! An inotify watch on one directory: which names were created in it and which had their
//! attributes (mode, owner) changed, in order. Events are queued by the kernel when the
//! change happens, so reading them after the operation under test is event-based, not timed.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::Read;
use std::os::fd::FromRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What happened to a name in the watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirEvent {
    /// Created (also by `bind`, `link`, `mkdir`) or moved in.
    Created(OsString),
    /// Mode, owner or times changed (`chmod`, `chown`, …).
    Attrib(OsString),
}

/// A non-blocking inotify watch on a directory; events are read with [`DirWatch::events`].
#[derive(Debug)]
pub struct DirWatch {
    file: File,
}

impl DirWatch {
    /// Watches `dir` for creations and attribute changes of the names in it.
    pub fn new(dir: &Path) -> DirWatch {
        // SAFETY: inotify_init1 takes no pointers; the result is checked.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(
            fd >= 0,
            "inotify_init1: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` is a new descriptor this function owns from here on.
        let file = unsafe { File::from_raw_fd(fd) };
        let c = CString::new(dir.as_os_str().as_bytes()).unwrap();
        let mask = libc::IN_CREATE | libc::IN_MOVED_TO | libc::IN_ATTRIB;
        // SAFETY: `c` is a NUL-terminated path that outlives the call; `fd` is open.
        let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), mask) };
        assert!(
            wd >= 0,
            "inotify_add_watch: {}",
            std::io::Error::last_os_error()
        );
        DirWatch { file }
    }

    /// The events queued so far (about names in the directory; the directory's own are left
    /// out).
    pub fn events(&mut self) -> Vec<DirEvent> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut out = Vec::new();
        loop {
            let n = match self.file.read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return out,
                Err(e) => panic!("read inotify: {e}"),
            };
            let mut at = 0;
            while at + 16 <= n {
                let mask = u32::from_ne_bytes(buf[at + 4..at + 8].try_into().unwrap());
                let len = u32::from_ne_bytes(buf[at + 12..at + 16].try_into().unwrap()) as usize;
                let raw = &buf[at + 16..at + 16 + len];
                let name = raw.split(|&b| b == 0).next().unwrap_or(&[]);
                at += 16 + len;
                if name.is_empty() {
                    continue;
                }
                let name = OsStr::from_bytes(name).to_os_string();
                if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                    out.push(DirEvent::Created(name));
                } else if mask & libc::IN_ATTRIB != 0 {
                    out.push(DirEvent::Attrib(name));
                }
            }
        }
    }
}
