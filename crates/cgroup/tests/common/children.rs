//! What a re-executed test binary does as a child, by mode (`CHILD_VAR`). Each child talks to
//! its parent in `@`-prefixed lines on stdout and waits for go-aheads on stdin.

use std::sync::{Arc, Mutex};

use vmhost_cgroup::{Cgroup, Limits};

use super::{tell_parent, wait_parent, MIB, PAGE_2M};

/// Runs the child mode named by `CHILD_VAR`, if set, and exits; returns when not a child.
pub fn child_main() {
    let Ok(mode) = std::env::var(super::CHILD_VAR) else {
        return;
    };
    let parts: Vec<&str> = mode.split(':').collect();
    match parts.as_slice() {
        ["wait"] => {
            tell_parent("ready");
            while wait_parent().is_some() {}
        }
        ["alloc", bytes] => {
            tell_parent("ready");
            wait_parent();
            let _keep = touch(bytes.parse().unwrap());
            tell_parent("allocated");
            while wait_parent().is_some() {}
        }
        ["hugetlb"] => hugetlb(),
        ["self", name] => add_self_and_back(name),
        ["self-oom", name, limit, bytes] => {
            self_oom(name, limit.parse().unwrap(), bytes.parse().unwrap())
        }
        _ => panic!("unknown child mode {mode:?}"),
    }
    std::process::exit(0);
}

/// Allocates `bytes` in 1 MiB blocks, writing every byte (every page is faulted in).
fn touch(bytes: u64) -> Vec<Vec<u8>> {
    (0..bytes / MIB)
        .map(|_| vec![1u8; usize::try_from(MIB).unwrap()])
        .collect()
}

/// This process's cpuset and memory cgroup paths.
fn my_cgroups() -> String {
    std::fs::read_to_string("/proc/self/cgroup")
        .unwrap()
        .lines()
        .filter(|l| l.contains(":cpuset:") || l.contains(":memory:"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn add_self_and_back(name: &str) {
    let limits = Limits {
        memory_max_bytes: Some(256 * MIB),
        ..Limits::default()
    };
    let mut cg = Cgroup::create(name, &limits).unwrap();
    tell_parent(&format!("before {}", my_cgroups()));
    cg.add_self().unwrap();
    tell_parent(&format!("inside {}", my_cgroups()));
    drop(cg);
    tell_parent(&format!("after {}", my_cgroups()));
}

/// The VMM's own arrangement: it creates its cgroup, joins it, watches the limit, and when the
/// limit is reached prints the message, removes the cgroup and exits 3.
fn self_oom(name: &str, limit: u64, bytes: u64) {
    let limits = Limits {
        memory_max_bytes: Some(limit),
        ..Limits::default()
    };
    let mut cg = Cgroup::create(name, &limits).unwrap();
    cg.add_self().unwrap();
    let watch = cg.oom_watch().unwrap();
    let slot = Arc::new(Mutex::new(Some(cg)));
    let held = Arc::clone(&slot);
    let vm = name.to_string();
    watch
        .spawn(move |ev| {
            eprintln!("vmhost: stopping VM {vm}: {ev}");
            let cg = held.lock().unwrap().take();
            if let Some(cg) = cg {
                if let Err(e) = cg.remove() {
                    eprintln!("vmhost: {e}");
                }
            }
            std::process::exit(3);
        })
        .unwrap();
    tell_parent("ready");
    let _keep = touch(bytes);
    tell_parent("allocated");
    drop(slot);
}

/// memfd hugetlb in steps the parent drives: map 2 pages, touch them, then try to map 3 more.
fn hugetlb() {
    tell_parent("ready");
    wait_parent();
    let a = map_memfd(2);
    tell_parent(&format!("mapped {}", a.is_ok()));
    wait_parent();
    let p = a.unwrap();
    for i in 0..2 {
        // SAFETY: `p` maps 2 hugepages read-write (map_memfd), so offset i × 2 MiB for i < 2
        // is inside the mapping; nothing else references that memory.
        unsafe { p.add(i * 2 * 1024 * 1024).write_volatile(1) };
    }
    tell_parent("touched");
    wait_parent();
    match map_memfd(3) {
        Ok(_) => tell_parent("more ok"),
        Err(e) => tell_parent(&format!("more err {}", e.raw_os_error().unwrap_or(0))),
    }
    while wait_parent().is_some() {}
}

/// A shared mapping of a new `MFD_HUGETLB` memfd of `pages` 2 MiB pages (kept until exit).
fn map_memfd(pages: u64) -> std::io::Result<*mut u8> {
    let len = usize::try_from(pages * PAGE_2M).unwrap();
    // SAFETY: the name is a NUL-terminated literal that outlives the call.
    let fd = unsafe { libc::memfd_create(c"vmhost-test".as_ptr(), libc::MFD_HUGETLB) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is the memfd just created and still open.
    if unsafe { libc::ftruncate(fd, libc::off_t::try_from(len).unwrap()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new shared mapping at an address the kernel picks (NULL hint), over `fd`,
    // which is open and `len` bytes long; it aliases no Rust object.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p.cast())
}
