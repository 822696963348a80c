//! A guest that prints without end into a pipe nobody reads: its vCPU must never block on the
//! output, so SIGTERM still stops the VM at once. (Before the fix the vCPU thread sat in
//! `write_all` on the full pipe, under the UART lock, and the VM never stopped.)
//!
//! Its own test binary: it blocks SIGINT/SIGTERM in the calling thread, which only threads
//! started afterwards inherit.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::pvh::{out8, pvh_elf};
use common::*;
use vmhost_memory::{GuestLayout, MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_vcpu::{
    stop_on_signals, thread_placements, ConsoleInput, RunStatus, SerialOut, Vm, VmOptions,
};

#[test]
fn sigterm_stops_a_guest_printing_into_a_pipe_nobody_reads() {
    if !kvm_available("sigterm_stops_a_guest_printing_into_a_pipe_nobody_reads") {
        return;
    }
    let _cpus = lock_cpus();
    // `out 0x3f8, 'x'` forever: 7 bytes, then `jmp` back 9 bytes.
    let mut code = out8(0x3f8, b'x');
    code.extend_from_slice(&[0xeb, 0xf7]);
    let dir = std::env::temp_dir().join(format!("vmhost-chatty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kernel = dir.join("kernel.elf");
    std::fs::write(&kernel, pvh_elf(&code)).unwrap();
    let plan = plan_toml(&format!(
        "name = \"chatty\"\n[cpu]\ncores = 1\n[memory]\nguest = \"64Mi\"\n[boot]\nkernel = \"{}\"\n",
        kernel.display()
    ));
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // One page of pipe buffer, so the guest fills it at once.
    // SAFETY: fcntl on the pipe's open write end; F_SETPIPE_SZ takes an int argument.
    assert!(unsafe { libc::fcntl(fds[1], libc::F_SETPIPE_SZ, 4096) } >= 4096);
    // SAFETY: both descriptors were just created and are owned by nothing else.
    let (read_end, write_end) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    let layout = GuestLayout::from_plan(&plan, MMIO_HOLE_START..MMIO_HOLE_END).unwrap();
    let mem = layout.anonymous_memory().unwrap();
    let options = VmOptions {
        serial_out: Some(SerialOut(Arc::new(Mutex::new(write_end)))),
        console_input: ConsoleInput::None,
        ..Default::default()
    };
    let mut vm = Vm::new(&plan, (mem, layout), options).unwrap();
    let stop = vm.stop_handle();
    stop_on_signals(stop.clone()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let report = vm.run();
        let _ = tx.send(report.map(|r| r.status));
    });
    // The event the old code hung on: the pipe is full, so the next write would block.
    wait_until_full(&read_end);
    let sig = thread_placements()
        .unwrap()
        .into_iter()
        .find(|t| t.name == "vmhost-sig")
        .expect("vmhost-sig thread");
    // SAFETY: tgkill only sends a signal; the target blocks SIGTERM and waits for it.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), sig.tid, libc::SIGTERM) };
    assert_eq!(rc, 0, "tgkill: {}", std::io::Error::last_os_error());
    // Only a hang guard: the stop is an event (`run` returns), not a duration.
    let status = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("SIGTERM did not stop a VM whose serial output nobody reads")
        .unwrap();
    assert_eq!(status, RunStatus::Stopped);
    drop(read_end);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Bytes waiting in the pipe `read_end` (`FIONREAD`).
fn bytes_in(read_end: &File) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD on an open pipe descriptor writes one int to `n`, which outlives the call.
    let rc = unsafe { libc::ioctl(read_end.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(rc, 0);
    usize::try_from(n).unwrap()
}

/// Waits until the guest's output filled the pipe: the serial thread blocks in its write.
fn wait_until_full(read_end: &File) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !serial_writer_blocked(std::process::id()) {
        assert!(Instant::now() < deadline, "the guest never filled the pipe");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(bytes_in(read_end) > 0);
}

/// True when `pid`'s `vmhost-serial` thread (the one that drains the guest's output into the
/// pipe) sleeps in `write(2)` on it: the pipe is full, the event the old code hung on (the
/// kernel's account, `/proc/PID/task/TID/syscall`).
fn serial_writer_blocked(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.filter_map(Result::ok).any(|t| {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let call = std::fs::read_to_string(t.path().join("syscall")).unwrap_or_default();
        comm.trim() == "vmhost-serial"
            && call.split_whitespace().next() == Some(&libc::SYS_write.to_string())
    })
}
