//! The allow-lists, one per [`ThreadKind`], derived from what each thread does after its
//! filter is installed (docs/security.md, "Syscall filters", says how they were measured).
//!
//! Every list holds what a Rust thread needs to end (`futex`, `madvise`, `munmap`,
//! `sigaltstack`, `rt_sigprocmask`, `exit`) and `write` (log lines on stderr, and the SIGSYS report).
//! `ioctl` is allowed only with the request numbers named, checked on the low 32 bits of the
//! second argument (the kernel's `unsigned int cmd`).

use libc::*;
use seccompiler::{BackendError, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

use crate::ThreadKind;

/// A condition on an allowed call's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Any arguments.
    Any,
    /// `ioctl` with one of these requests.
    Ioctl(&'static [u64]),
}

impl Rule {
    /// seccompiler's rules: none for `Any` (the call number alone matches), else one rule per
    /// allowed value.
    pub(crate) fn compile(&self) -> Result<Vec<SeccompRule>, BackendError> {
        match self {
            Rule::Any => Ok(Vec::new()),
            Rule::Ioctl(requests) => requests
                .iter()
                .map(|&r| {
                    SeccompRule::new(vec![SeccompCondition::new(
                        1,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::Eq,
                        r,
                    )?])
                })
                .collect(),
        }
    }
}

/// `_IOC(dir, type, nr, size)` of Linux's `asm-generic/ioctl.h`.
const fn ioc(dir: u64, ty: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (ty << 8) | nr
}
const KVMIO: u64 = 0xae;
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

/// `KVM_RUN`.
pub const KVM_RUN: u64 = ioc(0, KVMIO, 0x80, 0);
/// `KVM_GET_REGS` (`struct kvm_regs`, 144 bytes).
pub const KVM_GET_REGS: u64 = ioc(IOC_READ, KVMIO, 0x81, 144);
/// `KVM_GET_SREGS` (`struct kvm_sregs`, 312 bytes).
pub const KVM_GET_SREGS: u64 = ioc(IOC_READ, KVMIO, 0x83, 312);
/// `KVM_GET_VCPU_EVENTS` (`struct kvm_vcpu_events`, 64 bytes).
pub const KVM_GET_VCPU_EVENTS: u64 = ioc(IOC_READ, KVMIO, 0x9f, 64);
/// `KVM_IRQ_LINE` (`struct kvm_irq_level`, 8 bytes): the GED, serial and virtio interrupts.
pub const KVM_IRQ_LINE: u64 = ioc(IOC_WRITE, KVMIO, 0x61, 8);
/// `TCGETS`.
pub const TCGETS_REQ: u64 = 0x5401;
/// `TCSETS`.
pub const TCSETS_REQ: u64 = 0x5402;
/// `FIONBIO`.
pub const FIONBIO_REQ: u64 = 0x5421;

/// The end of any Rust thread, and stderr.
const THREAD_END: &[(i64, Rule)] = &[
    (SYS_futex, Rule::Any),
    (SYS_write, Rule::Any),
    (SYS_madvise, Rule::Any),
    (SYS_munmap, Rule::Any),
    (SYS_sigaltstack, Rule::Any),
    (SYS_rt_sigprocmask, Rule::Any),
    (SYS_exit, Rule::Any),
];

const VCPU: &[(i64, Rule)] = &[
    (
        SYS_ioctl,
        Rule::Ioctl(&[
            KVM_RUN,
            KVM_GET_REGS,
            KVM_GET_SREGS,
            KVM_GET_VCPU_EVENTS,
            KVM_IRQ_LINE,
        ]),
    ),
    (SYS_rt_sigreturn, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
    (SYS_mmap, Rule::Any),
    (SYS_mprotect, Rule::Any),
];

const EMULATOR: &[(i64, Rule)] = &[
    (SYS_clock_gettime, Rule::Any),
    (SYS_tgkill, Rule::Any),
    (SYS_mmap, Rule::Any),
    (SYS_mprotect, Rule::Any),
];

const VMM: &[(i64, Rule)] = &[
    (SYS_read, Rule::Any),
    (SYS_close, Rule::Any),
    (SYS_openat, Rule::Any),
    (SYS_fstat, Rule::Any),
    (SYS_statx, Rule::Any),
    (SYS_lseek, Rule::Any),
    (SYS_getdents64, Rule::Any),
    (SYS_mmap, Rule::Any),
    (SYS_mprotect, Rule::Any),
    (SYS_brk, Rule::Any),
    (SYS_mremap, Rule::Any),
    (SYS_clone3, Rule::Any),
    (SYS_sched_getaffinity, Rule::Any),
    (SYS_unlink, Rule::Any),
    (SYS_unlinkat, Rule::Any),
    (SYS_rmdir, Rule::Any),
    (SYS_flock, Rule::Any),
    (SYS_fsync, Rule::Any),
    (SYS_rename, Rule::Any),
    (SYS_ftruncate, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
    (SYS_clock_nanosleep, Rule::Any),
    (SYS_tgkill, Rule::Any),
    (SYS_getpid, Rule::Any),
    (SYS_ioctl, Rule::Ioctl(&[TCGETS_REQ, TCSETS_REQ])),
    (SYS_exit_group, Rule::Any),
];

const API: &[(i64, Rule)] = &[
    (SYS_epoll_wait, Rule::Any),
    (SYS_epoll_ctl, Rule::Any),
    (SYS_accept4, Rule::Any),
    (SYS_read, Rule::Any),
    (SYS_recvfrom, Rule::Any),
    (SYS_sendto, Rule::Any),
    (SYS_writev, Rule::Any),
    (SYS_close, Rule::Any),
    (SYS_openat, Rule::Any),
    (SYS_fstat, Rule::Any),
    (SYS_statx, Rule::Any),
    (SYS_lseek, Rule::Any),
    (SYS_getdents64, Rule::Any),
    (SYS_mmap, Rule::Any),
    (SYS_mprotect, Rule::Any),
    (SYS_getsockopt, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
    (SYS_tgkill, Rule::Any),
    (SYS_clone3, Rule::Any),
    (SYS_sched_getaffinity, Rule::Any),
    (SYS_getrandom, Rule::Any),
    (SYS_ioctl, Rule::Ioctl(&[FIONBIO_REQ])),
];

const SIGNAL: &[(i64, Rule)] = &[
    (SYS_rt_sigtimedwait, Rule::Any),
    (SYS_tgkill, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
];

const PREFAULT: &[(i64, Rule)] = &[
    (SYS_mmap, Rule::Any),
    (SYS_mprotect, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
];

const SERIAL: &[(i64, Rule)] = &[(SYS_clock_gettime, Rule::Any)];

const STDIN: &[(i64, Rule)] = &[
    (SYS_read, Rule::Any),
    (SYS_poll, Rule::Any),
    (SYS_ppoll, Rule::Any),
    (SYS_ioctl, Rule::Ioctl(&[KVM_IRQ_LINE])),
];

const OOM_WATCH: &[(i64, Rule)] = &[
    (SYS_read, Rule::Any),
    (SYS_poll, Rule::Any),
    (SYS_ppoll, Rule::Any),
    (SYS_openat, Rule::Any),
    (SYS_close, Rule::Any),
    (SYS_fstat, Rule::Any),
    (SYS_statx, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
    (SYS_clock_nanosleep, Rule::Any),
    (SYS_unlink, Rule::Any),
    (SYS_rmdir, Rule::Any),
    (SYS_flock, Rule::Any),
    (SYS_exit_group, Rule::Any),
];

const KVMPIN: &[(i64, Rule)] = &[
    (SYS_openat, Rule::Any),
    (SYS_read, Rule::Any),
    (SYS_close, Rule::Any),
    (SYS_fstat, Rule::Any),
    (SYS_statx, Rule::Any),
    (SYS_getdents64, Rule::Any),
    (SYS_sched_setaffinity, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
    (SYS_clock_nanosleep, Rule::Any),
];

const GRACE: &[(i64, Rule)] = &[
    (SYS_clock_gettime, Rule::Any),
    (SYS_clock_nanosleep, Rule::Any),
    (SYS_tgkill, Rule::Any),
];

const OUTPUT: &[(i64, Rule)] = &[];

const DEVICE_IO: &[(i64, Rule)] = &[
    (SYS_epoll_wait, Rule::Any),
    (SYS_epoll_ctl, Rule::Any),
    (SYS_read, Rule::Any),
    (SYS_pread64, Rule::Any),
    (SYS_pwrite64, Rule::Any),
    (SYS_preadv, Rule::Any),
    (SYS_pwritev, Rule::Any),
    (SYS_readv, Rule::Any),
    (SYS_writev, Rule::Any),
    (SYS_fdatasync, Rule::Any),
    (SYS_getrandom, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
    (SYS_mmap, Rule::Any),
    (SYS_mprotect, Rule::Any),
];

const SUPERVISOR: &[(i64, Rule)] = &[
    (SYS_wait4, Rule::Any),
    (SYS_waitid, Rule::Any),
    (SYS_rt_sigtimedwait, Rule::Any),
    (SYS_kill, Rule::Any),
    (SYS_read, Rule::Any),
    (SYS_openat, Rule::Any),
    (SYS_close, Rule::Any),
    (SYS_fstat, Rule::Any),
    (SYS_statx, Rule::Any),
    (SYS_unlink, Rule::Any),
    (SYS_rmdir, Rule::Any),
    (SYS_flock, Rule::Any),
    (SYS_ioctl, Rule::Ioctl(&[TCSETS_REQ])),
    (SYS_exit_group, Rule::Any),
];

/// The rules of `kind`: its own list and [`THREAD_END`].
pub(crate) fn rules(kind: ThreadKind) -> &'static [(i64, Rule)] {
    use std::sync::OnceLock;
    static ALL: OnceLock<Vec<Vec<(i64, Rule)>>> = OnceLock::new();
    let all = ALL.get_or_init(|| {
        ThreadKind::ALL
            .iter()
            .map(|&k| {
                let mut v: Vec<(i64, Rule)> = THREAD_END.to_vec();
                v.extend_from_slice(own(k));
                v.sort_by_key(|(nr, _)| *nr);
                v
            })
            .collect()
    });
    let i = ThreadKind::ALL
        .iter()
        .position(|&k| k == kind)
        .unwrap_or_default();
    all.get(i).map_or(&[], Vec::as_slice)
}

fn own(kind: ThreadKind) -> &'static [(i64, Rule)] {
    match kind {
        ThreadKind::Vmm => VMM,
        ThreadKind::Vcpu => VCPU,
        ThreadKind::Emulator => EMULATOR,
        ThreadKind::Api => API,
        ThreadKind::Signal => SIGNAL,
        ThreadKind::Prefault => PREFAULT,
        ThreadKind::Serial => SERIAL,
        ThreadKind::Stdin => STDIN,
        ThreadKind::OomWatch => OOM_WATCH,
        ThreadKind::KvmPin => KVMPIN,
        ThreadKind::Grace => GRACE,
        ThreadKind::Output => OUTPUT,
        ThreadKind::DeviceIo => DEVICE_IO,
        ThreadKind::Supervisor => SUPERVISOR,
    }
}
