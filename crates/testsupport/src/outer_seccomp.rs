//! Starting a command under an outer seccomp filter, as a container runtime's default profile
//! or systemd's `SystemCallFilter=` would: vmhost's threads then already run in seccomp mode 2
//! before vmhost installs its own filters.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes `cmd` start under a filter that allows every system call (one BPF instruction:
/// `ret SECCOMP_RET_ALLOW`), with `no_new_privs` set as an unprivileged runtime does.
pub fn allow_all(cmd: &mut Command) {
    // BPF_RET | BPF_K, SECCOMP_RET_ALLOW. Leaked: the program must outlive this call, and
    // fork copies it into the child, where the filter is installed.
    let insn: &'static mut [libc::sock_filter; 1] = Box::leak(Box::new([libc::sock_filter {
        code: 0x06,
        jt: 0,
        jf: 0,
        k: 0x7fff_0000,
    }]));
    let prog: &'static libc::sock_fprog = Box::leak(Box::new(libc::sock_fprog {
        len: 1,
        filter: insn.as_mut_ptr(),
    }));
    let prog_addr = std::ptr::from_ref(prog) as usize;
    // SAFETY: the closure runs in the child between fork and exec and only makes two prctl
    // calls (async-signal-safe, no allocation); `prog_addr` points at a leaked (never freed)
    // program, present at the same address in the child's copy of the address space.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                || libc::prctl(
                    libc::PR_SET_SECCOMP,
                    libc::SECCOMP_MODE_FILTER,
                    prog_addr as *const libc::sock_fprog,
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
