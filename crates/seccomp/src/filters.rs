//! The allow-lists, one per [`ThreadKind`], derived from what each thread does after its
//! filter is installed (docs/security.md, "Syscall filters", says how they were measured).
//!
//! Every list starts from [`BASE`] (memory, locks, clocks, stderr, the end of the thread); the
//! parts shared by several kinds ([`READ_FILES`], [`CLOSE`], [`KICK`], [`CLEAN_UP`], [`SPAWN`])
//! are named once. `ioctl` is allowed only with the request numbers named, checked on the low
//! 32 bits of the second argument (the kernel's `unsigned int cmd`); `mmap` and `mprotect`
//! never with `PROT_EXEC`.

use libc::*;
use seccompiler::{BackendError, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};

use crate::ThreadKind;

/// A condition on an allowed call's arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Any arguments.
    Any,
    /// Argument `arg` (low 32 bits) is one of `values`: `ioctl` requests, `fcntl` commands,
    /// the signal of `kill`.
    OneOf {
        /// The argument's index (0-based).
        arg: u8,
        /// The allowed values.
        values: &'static [u64],
    },
    /// Argument `arg` has no `PROT_EXEC` bit: `mmap` and `mprotect` never make executable
    /// memory once a thread is filtered.
    NoExec {
        /// The index of the `prot` argument.
        arg: u8,
    },
}

impl Rule {
    /// seccompiler's rules: none for `Any` (the call number alone matches), else one rule per
    /// allowed value (any of them allows the call).
    pub(crate) fn compile(&self) -> Result<Vec<SeccompRule>, BackendError> {
        let cond = |arg, op, value| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value);
        match *self {
            Rule::Any => Ok(Vec::new()),
            Rule::OneOf { arg, values } => values
                .iter()
                .map(|&v| SeccompRule::new(vec![cond(arg, SeccompCmpOp::Eq, v)?]))
                .collect(),
            Rule::NoExec { arg } => Ok(vec![SeccompRule::new(vec![cond(
                arg,
                SeccompCmpOp::MaskedEq(PROT_EXEC as u64),
                0,
            )?])?]),
        }
    }
}

/// `ioctl` with one of `requests`.
const fn ioctl(requests: &'static [u64]) -> (i64, Rule) {
    (
        SYS_ioctl,
        Rule::OneOf {
            arg: 1,
            values: requests,
        },
    )
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
/// `KVM_KVMCLOCK_CTRL`: a vCPU resumed after a pause tells its guest's kvmclock it was
/// stopped, so the guest's soft-lockup and RCU-stall detectors do not take the pause for a
/// hang.
pub const KVM_KVMCLOCK_CTRL: u64 = ioc(0, KVMIO, 0xad, 0);
/// `KVM_GET_REGS` (`struct kvm_regs`, 144 bytes): the RIP of a fault or internal error.
pub const KVM_GET_REGS: u64 = ioc(IOC_READ, KVMIO, 0x81, 144);
/// `KVM_TRANSLATE` (`struct kvm_translation`, 24 bytes): the code bytes at an internal error.
pub const KVM_TRANSLATE: u64 = ioc(IOC_READ | IOC_WRITE, KVMIO, 0x85, 24);
/// `KVM_GET_VCPU_EVENTS` (`struct kvm_vcpu_events`, 64 bytes): a triple fault's exception.
pub const KVM_GET_VCPU_EVENTS: u64 = ioc(IOC_READ, KVMIO, 0x9f, 64);
/// A vCPU's state saved by its own thread while parked for a capture (`VcpuState::save`):
/// `KVM_GET_MP_STATE` (`struct kvm_mp_state`, 4 bytes), `KVM_GET_SREGS` (312),
/// `KVM_GET_XSAVE` and `KVM_GET_XSAVE2` (`struct kvm_xsave`, 4096), `KVM_GET_XCRS` (392),
/// `KVM_GET_DEBUGREGS` (128), `KVM_GET_LAPIC` (1024), `KVM_GET_TSC_KHZ`, `KVM_GET_MSRS`
/// (`struct kvm_msrs` header, 8); with [`KVM_GET_REGS`] and [`KVM_GET_VCPU_EVENTS`].
pub const KVM_VCPU_STATE_GETS: [u64; 9] = [
    ioc(IOC_READ, KVMIO, 0x98, 4),
    ioc(IOC_READ, KVMIO, 0x83, 312),
    ioc(IOC_READ, KVMIO, 0xa4, 4096),
    ioc(IOC_READ, KVMIO, 0xcf, 4096),
    ioc(IOC_READ, KVMIO, 0xa6, 392),
    ioc(IOC_READ, KVMIO, 0xa1, 128),
    ioc(IOC_READ, KVMIO, 0x8e, 1024),
    ioc(0, KVMIO, 0xa3, 0),
    ioc(IOC_READ | IOC_WRITE, KVMIO, 0x88, 8),
];
/// The VM's state saved by the thread that captures it (`VmState::save`): `KVM_GET_IRQCHIP`
/// (`struct kvm_irqchip`, 520 bytes), `KVM_GET_PIT2` (`struct kvm_pit_state2`, 112),
/// `KVM_GET_CLOCK` (`struct kvm_clock_data`, 48).
pub const KVM_VM_STATE_GETS: [u64; 3] = [
    ioc(IOC_READ | IOC_WRITE, KVMIO, 0x62, 520),
    ioc(IOC_READ, KVMIO, 0x9f, 112),
    ioc(IOC_READ, KVMIO, 0x7c, 48),
];
/// `KVM_SIGNAL_MSI` (`struct kvm_msi`, 32 bytes): a virtio-pci function's MSI-X message,
/// sent by whichever thread completes the device's work (its I/O thread, a vCPU in a register
/// access, the VMM resuming a restored VM).
pub const KVM_SIGNAL_MSI: u64 = ioc(IOC_WRITE, KVMIO, 0xa5, 32);
/// `KVM_SET_GSI_ROUTING` (`struct kvm_irq_routing`, 8 bytes): a split irqchip's I/O APIC
/// routes, installed when the guest programs a redirection entry (a vCPU's MMIO access).
pub const KVM_SET_GSI_ROUTING: u64 = ioc(IOC_WRITE, KVMIO, 0x6a, 8);
/// `KVM_IRQ_LINE` (`struct kvm_irq_level`, 8 bytes): the ACPI power button (GED).
pub const KVM_IRQ_LINE: u64 = ioc(IOC_WRITE, KVMIO, 0x61, 8);
/// `KVM_GET_DIRTY_LOG` (`struct kvm_dirty_log`, 16 bytes): a memslot's dirty pages, read and
/// cleared (live migration).
pub const KVM_GET_DIRTY_LOG: u64 = ioc(IOC_WRITE, KVMIO, 0x42, 16);
/// `KVM_SET_USER_MEMORY_REGION` (`struct kvm_userspace_memory_region`, 32 bytes): a RAM
/// memslot registered again with or without `KVM_MEM_LOG_DIRTY_PAGES`.
pub const KVM_SET_USER_MEMORY_REGION: u64 = ioc(IOC_WRITE, KVMIO, 0x46, 32);
/// `TUNSETOFFLOAD`: a virtio-net device tells its tap which offloads the guest accepted, at
/// DRIVER_OK and at a reset (both written by a vCPU).
pub const TUNSETOFFLOAD: u64 = ioc(IOC_WRITE, b'T' as u64, 208, 4);
const VHOSTIO: u64 = 0xaf;
/// The vhost-vsock back end's start at DRIVER_OK (on the vCPU that writes it): features, the
/// memory table, each ring's size, base, addresses and eventfds, then running.
pub const VHOST_SET_FEATURES: u64 = ioc(IOC_WRITE, VHOSTIO, 0x00, 8);
/// `VHOST_SET_MEM_TABLE` (`struct vhost_memory` header, 8 bytes).
pub const VHOST_SET_MEM_TABLE: u64 = ioc(IOC_WRITE, VHOSTIO, 0x03, 8);
/// `VHOST_SET_VRING_NUM` (`struct vhost_vring_state`).
pub const VHOST_SET_VRING_NUM: u64 = ioc(IOC_WRITE, VHOSTIO, 0x10, 8);
/// `VHOST_SET_VRING_ADDR` (`struct vhost_vring_addr`, 40 bytes).
pub const VHOST_SET_VRING_ADDR: u64 = ioc(IOC_WRITE, VHOSTIO, 0x11, 40);
/// `VHOST_SET_VRING_BASE` (`struct vhost_vring_state`).
pub const VHOST_SET_VRING_BASE: u64 = ioc(IOC_WRITE, VHOSTIO, 0x12, 8);
/// `VHOST_SET_VRING_KICK` (`struct vhost_vring_file`).
pub const VHOST_SET_VRING_KICK: u64 = ioc(IOC_WRITE, VHOSTIO, 0x20, 8);
/// `VHOST_SET_VRING_CALL` (`struct vhost_vring_file`).
pub const VHOST_SET_VRING_CALL: u64 = ioc(IOC_WRITE, VHOSTIO, 0x21, 8);
/// `VHOST_VSOCK_SET_RUNNING` (an int): started at DRIVER_OK, stopped at a reset or teardown.
pub const VHOST_VSOCK_SET_RUNNING: u64 = ioc(IOC_WRITE, VHOSTIO, 0x61, 4);
/// `FIONBIO`: std's `set_nonblocking` on a socket (the vsock device's host connections).
pub const FIONBIO_REQ: u64 = 0x5421;
/// `TCSETS` (`tcsetattr(TCSANOW)`): the terminal's mode restored.
pub const TCSETS_REQ: u64 = 0x5402;
/// `TCGETS`: glibc's `tcsetattr` reads the mode back after setting it.
pub const TCGETS_REQ: u64 = 0x5401;

/// `fcntl(fd, F_GETFD)`: debug builds of std check that a descriptor is open before closing
/// it; `close` comes with it.
const CLOSE: [(i64, Rule); 2] = [
    (SYS_close, Rule::Any),
    (
        SYS_fcntl,
        Rule::OneOf {
            arg: 1,
            values: &[F_GETFD as u64],
        },
    ),
];

/// What every thread may do: allocate and free memory (glibc's malloc: `brk`, `mmap`,
/// `mremap`, `madvise`, `munmap`; `mprotect` to grow a heap, never to make code), wait on
/// locks, read clocks (when the vDSO cannot), write to stderr, and end (`rt_sigprocmask`,
/// `sigaltstack`, `exit`).
const BASE: &[(i64, Rule)] = &[
    (SYS_futex, Rule::Any),
    // Spinning locks give way (seen on the main thread while a VM on 1 GiB pages stopped).
    (SYS_sched_yield, Rule::Any),
    (SYS_write, Rule::Any),
    (SYS_brk, Rule::Any),
    (SYS_mmap, Rule::NoExec { arg: 2 }),
    (SYS_mprotect, Rule::NoExec { arg: 2 }),
    (SYS_mremap, Rule::Any),
    (SYS_madvise, Rule::Any),
    (SYS_munmap, Rule::Any),
    (SYS_clock_gettime, Rule::Any),
    (SYS_rt_sigprocmask, Rule::Any),
    (SYS_sigaltstack, Rule::Any),
    (SYS_exit, Rule::Any),
];

/// What a filtered thread needs to start another thread that then installs its own filter:
/// the new thread's first calls run under its creator's filter.
const SPAWN: &[(i64, Rule)] = &[
    (SYS_clone3, Rule::Any),
    (SYS_set_robust_list, Rule::Any),
    (SYS_rseq, Rule::Any),
    (SYS_prctl, Rule::Any),
    (SYS_gettid, Rule::Any),
    // std's stack guard set-up at a thread's start (`pthread_getattr_np`).
    (SYS_sched_getaffinity, Rule::Any),
    (SYS_seccomp, Rule::Any),
];

/// Reading files and `/proc`: `std::fs::read_to_string`, `read_dir`, `Path::exists`.
const READ_FILES: &[(i64, Rule)] = &[
    (SYS_openat, Rule::Any),
    (SYS_read, Rule::Any),
    (SYS_statx, Rule::Any),
    (SYS_newfstatat, Rule::Any),
    (SYS_getdents64, Rule::Any),
];

/// Kicking vCPU threads out of `KVM_RUN` (`pthread_kill`: `getpid`, `tgkill`).
const KICK: &[(i64, Rule)] = &[(SYS_getpid, Rule::Any), (SYS_tgkill, Rule::Any)];

/// Releasing the ledger entry and removing the cgroup, the API socket and scratch images.
const CLEAN_UP: &[(i64, Rule)] = &[
    (SYS_flock, Rule::Any),
    (SYS_unlink, Rule::Any),
    (SYS_rmdir, Rule::Any),
    // `kill(pid, 0)`: is a ledger entry's process alive?
    (
        SYS_kill,
        Rule::OneOf {
            arg: 1,
            values: &[0],
        },
    ),
    (SYS_clock_nanosleep, Rule::Any),
];

const VCPU: &[&[(i64, Rule)]] = &[
    &[
        ioctl(&[
            KVM_RUN,
            KVM_GET_REGS,
            KVM_TRANSLATE,
            KVM_GET_VCPU_EVENTS,
            // Resumed after a pause: the guest's kvmclock told it was stopped.
            KVM_KVMCLOCK_CTRL,
            // A capture: the vCPU thread saves its own state while parked.
            KVM_VCPU_STATE_GETS[0],
            KVM_VCPU_STATE_GETS[1],
            KVM_VCPU_STATE_GETS[2],
            KVM_VCPU_STATE_GETS[3],
            KVM_VCPU_STATE_GETS[4],
            KVM_VCPU_STATE_GETS[5],
            KVM_VCPU_STATE_GETS[6],
            KVM_VCPU_STATE_GETS[7],
            KVM_VCPU_STATE_GETS[8],
            // Device status writes: a virtio-net tap's offloads, the vhost-vsock start/stop.
            TUNSETOFFLOAD,
            VHOST_SET_FEATURES,
            VHOST_SET_MEM_TABLE,
            VHOST_SET_VRING_NUM,
            VHOST_SET_VRING_ADDR,
            VHOST_SET_VRING_BASE,
            VHOST_SET_VRING_KICK,
            VHOST_SET_VRING_CALL,
            VHOST_VSOCK_SET_RUNNING,
            // A virtio-pci queue served, or a pending MSI-X vector unmasked, in an access.
            KVM_SIGNAL_MSI,
            // A split irqchip's I/O APIC entry written (docs/devices.md, "Split irqchip").
            KVM_SET_GSI_ROUTING,
        ]),
        // The kick signal's handler returns.
        (SYS_rt_sigreturn, Rule::Any),
        // A guest's MMIO access to a virtio transport that its I/O thread holds: the vCPU
        // polls the lock with a growing sleep (`devices::bus`, at most `LOCK_POLL_MAX`).
        // Seen in the emulated host (`vsock_linux_guest_echo_both_ways`, 2026-12-02).
        (SYS_clock_nanosleep, Rule::Any),
    ],
    // The vCPU's own file descriptor, closed when the thread ends.
    &CLOSE,
];

const EMULATOR: &[&[(i64, Rule)]] = &[KICK];

/// A snapshot or migration record goes out as one vectored write of its header, payload,
/// checksum and MAC (`vmhost_persist::container::Writer`).
const WRITE_RECORDS: &[(i64, Rule)] = &[(SYS_writev, Rule::Any)];

const VMM: &[&[(i64, Rule)]] = &[
    READ_FILES,
    // A migration target's answer and commit.
    WRITE_RECORDS,
    &CLOSE,
    CLEAN_UP,
    KICK,
    // The `vmhost-out` report writer.
    SPAWN,
    &[
        (SYS_exit_group, Rule::Any),
        // A running vhost-vsock device stopped when the devices are dropped; a capture (the
        // VM's irqchip, PIT and clock) made from this thread.
        ioctl(&[
            VHOST_VSOCK_SET_RUNNING,
            KVM_VM_STATE_GETS[0],
            KVM_VM_STATE_GETS[1],
            KVM_VM_STATE_GETS[2],
            // A restored virtio-pci function's pending MSI-X messages.
            KVM_SIGNAL_MSI,
        ]),
    ],
];

const API: &[&[(i64, Rule)]] = &[
    &[
        (SYS_epoll_wait, Rule::Any),
        (SYS_epoll_ctl, Rule::Any),
        (SYS_accept4, Rule::Any),
        (SYS_recvfrom, Rule::Any),
        (SYS_sendto, Rule::Any),
        (SYS_shutdown, Rule::Any),
        // The socket file, removed when the server stops.
        (SYS_unlink, Rule::Any),
        // The power button; a capture (the VM's irqchip, PIT and clock) started by a request.
        ioctl(&[
            KVM_IRQ_LINE,
            KVM_VM_STATE_GETS[0],
            KVM_VM_STATE_GETS[1],
            KVM_VM_STATE_GETS[2],
        ]),
    ],
    // `GET /vm/placement` and `/vm/resources` read `/proc` and the cgroup.
    READ_FILES,
    &CLOSE,
    // Pause and resume.
    KICK,
];

/// The stop signals' thread: waits for them, names the sender (`/proc/PID/comm`) and kicks
/// the vCPUs.
const SIGNAL: &[&[(i64, Rule)]] = &[
    &[(SYS_rt_sigtimedwait, Rule::Any)],
    KICK,
    READ_FILES,
    &CLOSE,
];

/// `PrefaultOptions::on_progress` hooks run here too (a test's slows the prefault down).
/// The snapshot job: kicks the vCPUs to pause (and a stop), reads the VM's irqchip, PIT and
/// clock, creates the directory and its files (`mkdir`, `openat`, `write`, `fsync`), reads
/// which guest pages are resident (`mincore`), and removes an unfinished snapshot.
const SNAPSHOT: &[&[(i64, Rule)]] = &[
    READ_FILES,
    WRITE_RECORDS,
    &CLOSE,
    CLEAN_UP,
    KICK,
    &[
        (SYS_mkdir, Rule::Any),
        (SYS_mkdirat, Rule::Any),
        (SYS_fsync, Rule::Any),
        (SYS_mincore, Rule::Any),
        (SYS_unlinkat, Rule::Any),
        ioctl(&[
            KVM_VM_STATE_GETS[0],
            KVM_VM_STATE_GETS[1],
            KVM_VM_STATE_GETS[2],
        ]),
    ],
];

/// A restore's memory loader: reads its cell's file (already open) and closes it.
const LOADER: &[&[(i64, Rule)]] = &[READ_FILES, &CLOSE];

const PREFAULT: &[&[(i64, Rule)]] = &[&[(SYS_clock_nanosleep, Rule::Any)]];

const SERIAL: &[&[(i64, Rule)]] = &[];

/// The diagnostics writer: nothing beyond [`BASE`] (it waits on its buffer's lock and
/// condition variable, `futex`, and writes stderr, `write`).
const DIAG: &[&[(i64, Rule)]] = &[];

const STDIN: &[&[(i64, Rule)]] = &[&[
    (SYS_poll, Rule::Any),
    (SYS_read, Rule::Any),
    (SYS_clock_nanosleep, Rule::Any),
    // The terminal's mode restored when the thread ends.
    ioctl(&[TCSETS_REQ, TCGETS_REQ]),
]];

const OOM_WATCH: &[&[(i64, Rule)]] = &[
    &[
        (SYS_poll, Rule::Any),
        (SYS_pread64, Rule::Any),
        // The limit's exit: the terminal restored, then `exit(5)`.
        ioctl(&[TCSETS_REQ, TCGETS_REQ]),
        (SYS_exit_group, Rule::Any),
        // Its report names this process; the cgroup is left by moving this pid out.
        (SYS_getpid, Rule::Any),
        // `Ledger::open` (its directories exist: `mkdir` fails with EEXIST).
        (SYS_mkdir, Rule::Any),
    ],
    READ_FILES,
    &CLOSE,
    CLEAN_UP,
];

const KVMPIN: &[&[(i64, Rule)]] = &[
    READ_FILES,
    &CLOSE,
    &[
        (SYS_sched_setaffinity, Rule::Any),
        (SYS_clock_nanosleep, Rule::Any),
    ],
];

const GRACE: &[&[(i64, Rule)]] = &[&[(SYS_clock_nanosleep, Rule::Any)], KICK];

const OUTPUT: &[&[(i64, Rule)]] = &[];

const DEVICE_IO: &[&[(i64, Rule)]] = &[
    &[
        (SYS_epoll_wait, Rule::Any),
        // Queue and stop eventfds.
        (SYS_read, Rule::Any),
        // virtio-net frames straight between the tap and guest memory.
        (SYS_readv, Rule::Any),
        (SYS_writev, Rule::Any),
        // Disk images: `preadv`/`pwritev` straight into and out of guest memory,
        // `read_exact_at`/`write_all_at` of the bounce path (O_DIRECT requests that are not
        // whole aligned blocks), FLUSH.
        (SYS_preadv, Rule::Any),
        (SYS_pwritev, Rule::Any),
        (SYS_pread64, Rule::Any),
        (SYS_pwrite64, Rule::Any),
        (SYS_fdatasync, Rule::Any),
        // virtio-rng.
        (SYS_getrandom, Rule::Any),
        // virtio-vsock's Unix sockets: host connections accepted and made non-blocking,
        // guest connections to `<socket>_<port>`, stream bytes, half closes, its epoll.
        (SYS_accept4, Rule::Any),
        (SYS_socket, Rule::Any),
        (SYS_connect, Rule::Any),
        (SYS_recvfrom, Rule::Any),
        (SYS_sendto, Rule::Any),
        (SYS_shutdown, Rule::Any),
        (SYS_epoll_ctl, Rule::Any),
        // `<socket>_<port>` is checked (owner and type, std's `symlink_metadata`: `statx`)
        // before a guest connection is forwarded to it.
        (SYS_statx, Rule::Any),
        // The last reference to a device can be the I/O thread's: the vsock socket file is
        // removed and a vhost-vsock device stopped when it drops it.
        (SYS_unlink, Rule::Any),
        // A virtio-pci queue's MSI-X message.
        ioctl(&[FIONBIO_REQ, VHOST_VSOCK_SET_RUNNING, KVM_SIGNAL_MSI]),
    ],
    // Its epoll and eventfds, closed when the thread ends.
    &CLOSE,
];

const SUPERVISOR: &[&[(i64, Rule)]] = &[
    &[
        (SYS_wait4, Rule::Any),
        (SYS_rt_sigtimedwait, Rule::Any),
        // `memory.events`, read at offset 0: was the VMM OOM-killed?
        (SYS_pread64, Rule::Any),
        // Stop signals forwarded to the VMM as SIGTERM; `kill(pid, 0)` for the ledger.
        (
            SYS_kill,
            Rule::OneOf {
                arg: 1,
                values: &[0, SIGTERM as u64],
            },
        ),
        // The cgroup is left by moving this pid out; `Ledger::open` (`mkdir`: EEXIST).
        (SYS_getpid, Rule::Any),
        (SYS_mkdir, Rule::Any),
        ioctl(&[TCSETS_REQ, TCGETS_REQ]),
        (SYS_exit_group, Rule::Any),
    ],
    READ_FILES,
    &CLOSE,
    &[
        (SYS_flock, Rule::Any),
        (SYS_unlink, Rule::Any),
        (SYS_rmdir, Rule::Any),
        (SYS_clock_nanosleep, Rule::Any),
    ],
];

/// The background prefault's coordinator after its workers: the audit reads `/proc` and the
/// memory policy (`get_mempolicy`, `move_pages`), prints, narrows the cgroup's cpuset (a
/// write to a file it opens), and stops the VM if the prefault failed.
const PREFAULT_AUDIT: &[&[(i64, Rule)]] = &[
    READ_FILES,
    &CLOSE,
    KICK,
    &[
        (SYS_get_mempolicy, Rule::Any),
        (SYS_move_pages, Rule::Any),
        (SYS_lseek, Rule::Any),
    ],
];

/// A migration target's page receiver: reads its stream (`recvfrom`), closes the control
/// connection when it fails (`shutdown`), and the test hook's `abort` (`gettid`, `tgkill`).
const RECEIVER: &[&[(i64, Rule)]] = &[
    KICK,
    &CLOSE,
    &[
        (SYS_read, Rule::Any),
        (SYS_recvfrom, Rule::Any),
        (SYS_shutdown, Rule::Any),
        (SYS_gettid, Rule::Any),
    ],
];

/// The migration sender (`vmhost-mig`, and its per-cell senders `mig-c<cell>`, started under
/// it; `gettid` of [`SPAWN`] also serves the test hook's `abort`): the dirty log, pause and
/// resume (kicks), reading the
/// key file and `/proc/cpuinfo`, its connection to the target (Unix or TCP: `socket`,
/// `connect`, `TCP_NODELAY`, the handshake's nonce, stream bytes, the close), the resident
/// pages of guest RAM (`mincore`) and the capture of the VM's irqchip, PIT and clock.
const MIGRATION: &[&[(i64, Rule)]] = &[
    KICK,
    WRITE_RECORDS,
    // One sender thread per guest cell and round (`mig-c<cell>`, under this filter).
    SPAWN,
    READ_FILES,
    &CLOSE,
    &[
        (SYS_socket, Rule::Any),
        (SYS_connect, Rule::Any),
        (SYS_setsockopt, Rule::Any),
        // The handshake's nonce: `getrandom`, which first polls `/dev/random` once to wait
        // for the entropy pool when it cannot tell it is ready.
        (SYS_getrandom, Rule::Any),
        (SYS_poll, Rule::Any),
        (SYS_recvfrom, Rule::Any),
        (SYS_sendto, Rule::Any),
        (SYS_shutdown, Rule::Any),
        (SYS_mincore, Rule::Any),
        // The dirty log (start, read and clear, stop) and the capture, in one `ioctl` rule.
        ioctl(&[
            KVM_GET_DIRTY_LOG,
            KVM_SET_USER_MEMORY_REGION,
            KVM_VM_STATE_GETS[0],
            KVM_VM_STATE_GETS[1],
            KVM_VM_STATE_GETS[2],
        ]),
    ],
];

/// The rules of `kind`: [`BASE`] and its own parts, sorted by call number, one entry per call.
pub(crate) fn rules(kind: ThreadKind) -> &'static [(i64, Rule)] {
    use std::sync::OnceLock;
    static ALL: OnceLock<Vec<Vec<(i64, Rule)>>> = OnceLock::new();
    let all = ALL.get_or_init(|| ThreadKind::ALL.iter().map(|&k| merged(k)).collect());
    ThreadKind::ALL
        .iter()
        .position(|&k| k == kind)
        .and_then(|i| all.get(i))
        .map_or(&[], Vec::as_slice)
}

/// [`BASE`] and `kind`'s parts; a call listed twice keeps its first rule (the parts never
/// list one call with two different rules: `merged_lists_have_one_rule_per_call` checks).
fn merged(kind: ThreadKind) -> Vec<(i64, Rule)> {
    let mut v: Vec<(i64, Rule)> = BASE.to_vec();
    for part in parts(kind) {
        v.extend_from_slice(part);
    }
    v.sort_by_key(|(nr, _)| *nr);
    v.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
    v
}

pub(crate) fn parts(kind: ThreadKind) -> &'static [&'static [(i64, Rule)]] {
    match kind {
        ThreadKind::Vmm => VMM,
        ThreadKind::Vcpu => VCPU,
        ThreadKind::Emulator => EMULATOR,
        ThreadKind::Api => API,
        ThreadKind::Signal => SIGNAL,
        ThreadKind::Prefault => PREFAULT,
        ThreadKind::Serial => SERIAL,
        ThreadKind::Diag => DIAG,
        ThreadKind::Stdin => STDIN,
        ThreadKind::OomWatch => OOM_WATCH,
        ThreadKind::KvmPin => KVMPIN,
        ThreadKind::Grace => GRACE,
        ThreadKind::Output => OUTPUT,
        ThreadKind::DeviceIo => DEVICE_IO,
        ThreadKind::Supervisor => SUPERVISOR,
        ThreadKind::PrefaultAudit => PREFAULT_AUDIT,
        ThreadKind::Snapshot => SNAPSHOT,
        ThreadKind::Loader => LOADER,
        ThreadKind::Receiver => RECEIVER,
        ThreadKind::Migration => MIGRATION,
    }
}
