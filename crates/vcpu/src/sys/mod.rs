//! Thin wrappers over the raw calls this crate makes outside kvm-ioctls (CPU affinity is
//! `vmhost_topology::affinity`, re-exported here): thread ids, the real-time signal that kicks a vCPU thread out of `KVM_RUN`, and the terminal calls
//! of the serial console's input (`poll`, `read`, termios), and a RAM memslot's dirty-log flag.
//!
//! Everything `unsafe` in the crate that is not a KVM call lives here (the memslot registration
//! in `vm.rs` and the `kvm_run` pointer in `vcpu.rs` are the exceptions, next to their data).

#[cfg(test)]
pub use vmhost_topology::affinity::current_thread as current_affinity;
pub use vmhost_topology::affinity::pin_current_thread;

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, Once};

use libc::{c_int, c_void, siginfo_t};

/// The kernel thread id of the calling thread.
///
/// The raw system call, not glibc's `gettid()` wrapper: the standard library declares that
/// wrapper as a weak symbol, and in a static link (see docs/dependencies.md) a weak reference
/// does not pull it out of `libc.a`, which would leave a null function pointer.
pub fn gettid() -> i32 {
    // SAFETY: SYS_gettid takes no arguments, has no preconditions and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    i32::try_from(tid).unwrap_or(i32::MAX)
}

/// Keeps transparent huge pages out of `len` bytes at `addr` (`MADV_NOHUGEPAGE`), a mapping
/// of this process not yet touched: a kernel whose THP mode is `always` would otherwise back
/// a 2 MiB-aligned anonymous mapping of 2 MiB with one huge page at its first write, 2 MiB of
/// resident memory for a few KiB used. A kernel without THP refuses the advice (`EINVAL`),
/// and has no huge page to keep out.
pub fn no_transparent_huge_pages(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: madvise only changes the kernel's paging advice for the range; the caller's
    // mapping stays valid whatever the outcome, and no memory is read or written.
    if unsafe { libc::madvise(addr.cast::<c_void>(), len, libc::MADV_NOHUGEPAGE) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Nanoseconds on `CLOCK_MONOTONIC` (0 if the clock cannot be read).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call, and
    // CLOCK_MONOTONIC is always available on Linux.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Makes the calling thread SCHED_FIFO at `priority` (realtime vCPUs, `cpu.realtime`).
pub fn set_current_thread_fifo(priority: i32) -> io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: pid 0 names the calling thread; `param` is a valid sched_param for the call.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The scheduling policy of the calling thread (`SCHED_OTHER`, `SCHED_FIFO`, …).
#[cfg(test)]
pub fn current_thread_policy() -> io::Result<c_int> {
    // SAFETY: pid 0 names the calling thread; the call only reads its policy.
    let rc = unsafe { libc::sched_getscheduler(0) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// The pthread handle of the calling thread.
pub fn pthread_self() -> libc::pthread_t {
    // SAFETY: pthread_self has no preconditions and cannot fail.
    unsafe { libc::pthread_self() }
}

/// The real-time signal that kicks vCPU threads out of `KVM_RUN` (`SIGRTMIN`).
pub fn kick_signal() -> c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

thread_local! {
    /// The calling vCPU thread's `immediate_exit` byte, for its own kick handler; null when the
    /// thread has none (before its vCPU runs, after its `kvm_run` is gone, any other thread).
    /// Const-initialised and without a destructor: reading it is a plain thread-local load,
    /// safe in a signal handler.
    static KICK_TARGET: Cell<*const AtomicU8> = const { Cell::new(std::ptr::null()) };
}

extern "C" fn on_kick(_num: c_int, _info: *mut siginfo_t, _ctx: *mut c_void) {
    // Runs on the kicked vCPU thread itself (as in Firecracker and Cloud Hypervisor): no other
    // thread ever writes this vCPU's kvm_run. Delivery alone makes a running KVM_RUN return
    // EINTR; setting `immediate_exit` also stops one the thread was about to enter.
    let target = KICK_TARGET.with(Cell::get);
    if !target.is_null() {
        // SAFETY: a non-null target is this thread's kvm_run `immediate_exit` byte, registered
        // by `KickTarget::set` and cleared by its drop before the mapping goes away; the
        // access is atomic, and only this thread (here or in its run loop) touches it.
        unsafe { (*target).store(1, Ordering::SeqCst) };
    }
}

/// The calling thread's kick target while it lives: the kick handler sets `immediate_exit`
/// through it. Drop it before the `kvm_run` mapping it points into.
pub struct KickTarget(());

impl KickTarget {
    /// Registers `immediate_exit` for the calling thread's kick handler.
    ///
    /// # Safety
    ///
    /// `immediate_exit` must point into the calling thread's own live `kvm_run` mapping and
    /// stay valid until the returned guard is dropped, on this thread.
    pub unsafe fn set(immediate_exit: *const AtomicU8) -> KickTarget {
        KICK_TARGET.with(|t| t.set(immediate_exit));
        KickTarget(())
    }
}

impl Drop for KickTarget {
    fn drop(&mut self) {
        KICK_TARGET.with(|t| t.set(std::ptr::null()));
    }
}

static KICK_HANDLER: Once = Once::new();

/// Installs the kick handler once per process, without `SA_RESTART`, and unblocks the
/// kick signal in the calling thread.
pub fn prepare_kick_signal() -> io::Result<()> {
    let mut result = Ok(());
    KICK_HANDLER.call_once(|| {
        result = vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick)
            .map_err(|e| io::Error::from_raw_os_error(e.errno()));
    });
    result?;
    set_signal_mask(&[kick_signal()], libc::SIG_UNBLOCK)
}

/// Blocks (`SIG_BLOCK`) or unblocks (`SIG_UNBLOCK`) `signals` in the calling thread.
pub fn set_signal_mask(signals: &[c_int], how: c_int) -> io::Result<()> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before any other use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t owned by this frame.
    unsafe { libc::sigemptyset(&mut set) };
    for &s in signals {
        // SAFETY: `set` was initialised by sigemptyset; an invalid number fails with EINVAL.
        if unsafe { libc::sigaddset(&mut set, s) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: `set` is initialised; a null old-set pointer is allowed.
    let rc = unsafe { libc::pthread_sigmask(how, &set, std::ptr::null_mut()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Waits for one of `signals` (which the caller has blocked) and returns its number.
pub fn wait_signal(signals: &[c_int]) -> io::Result<c_int> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before any other use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t owned by this frame.
    unsafe { libc::sigemptyset(&mut set) };
    for &s in signals {
        // SAFETY: `set` was initialised by sigemptyset.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    let mut sig: c_int = 0;
    // SAFETY: `set` is initialised and `sig` is a valid place for the result.
    let rc = unsafe { libc::sigwait(&set, &mut sig) };
    if rc == 0 {
        Ok(sig)
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Sends the kick signal to `thread`.
///
/// # Safety
///
/// `thread` must be a thread of this process that has not been joined or detached-and-exited:
/// POSIX leaves `pthread_kill` on a dead thread's handle undefined.
pub unsafe fn kick_thread(thread: libc::pthread_t) -> io::Result<()> {
    // SAFETY: the caller guarantees `thread` is alive (see above).
    let rc = unsafe { libc::pthread_kill(thread, kick_signal()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Waits up to `timeout` for `fd` to become readable; true when it is (or has hung up).
pub fn poll_readable(fd: c_int, timeout: std::time::Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
    // SAFETY: `p` is one valid pollfd owned by this frame and the count passed is 1.
    let rc = unsafe { libc::poll(&mut p, 1, ms) };
    match rc {
        0 => Ok(false),
        r if r > 0 => Ok(true),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

/// One `read` from `fd` into `buf`.
pub fn read_fd(fd: c_int, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the whole call.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast::<c_void>(), buf.len()) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// A terminal switched to non-canonical input without echo (signal keys kept); the previous
/// mode comes back on drop, or from [`restore_terminal`] on a path that ends the process
/// without running destructors.
pub struct RawTerminal {
    fd: c_int,
    saved: libc::termios,
}

/// The mode of the terminal a [`RawTerminal`] changed, while it is changed.
static SAVED_TERMINAL: Mutex<Option<(c_int, libc::termios)>> = Mutex::new(None);

impl RawTerminal {
    /// Switches the terminal on `fd`.
    pub fn enter(fd: c_int) -> io::Result<RawTerminal> {
        // SAFETY: termios is plain data; tcgetattr fills it before any use.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid termios owned by this frame.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut raw = saved;
        raw.c_lflag &= !(libc::ICANON | libc::ECHO);
        raw.c_iflag &= !libc::ICRNL;
        raw.c_cc[libc::VMIN] = 1;
        raw.c_cc[libc::VTIME] = 0;
        *crate::control::lock(&SAVED_TERMINAL) = Some((fd, saved));
        // SAFETY: `raw` is an initialised termios copied from the terminal's own.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            let err = io::Error::last_os_error();
            *crate::control::lock(&SAVED_TERMINAL) = None;
            return Err(err);
        }
        Ok(RawTerminal { fd, saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        *crate::control::lock(&SAVED_TERMINAL) = None;
        // SAFETY: `saved` is the termios tcgetattr returned for this terminal.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

/// Puts a terminal the serial console switched to raw input back in its previous mode; does
/// nothing when none is switched. For exits that skip destructors (`std::process::exit`).
pub fn restore_terminal() {
    if let Some((fd, saved)) = crate::control::lock(&SAVED_TERMINAL).take() {
        // SAFETY: `saved` is the termios tcgetattr returned for the terminal on `fd`.
        unsafe { libc::tcsetattr(fd, libc::TCSANOW, &saved) };
    }
}

/// `KVM_GET_XSAVE2` into a buffer of `entries` extra 32-bit words past the legacy 4 KiB
/// `kvm_xsave` region; `entries` comes from `KVM_CHECK_EXTENSION(KVM_CAP_XSAVE2)`.
pub fn get_xsave2(
    fd: &kvm_ioctls::VcpuFd,
    entries: usize,
) -> Result<kvm_bindings::Xsave, kvm_ioctls::Error> {
    let mut xsave =
        kvm_bindings::Xsave::new(entries).map_err(|_| kvm_ioctls::Error::new(libc::E2BIG))?;
    // SAFETY: `xsave` was allocated with `entries` words past the legacy region, the size
    // KVM_CHECK_EXTENSION(KVM_CAP_XSAVE2) reported for this VM, so the kernel writes inside it.
    unsafe { fd.get_xsave2(&mut xsave) }?;
    Ok(xsave)
}

/// `KVM_SET_XSAVE` of the legacy `region` followed by `words`, through a buffer at least as
/// large as the VM's XSAVE2 size.
///
/// `xsave_bytes` is the VM's `KVM_CHECK_EXTENSION(KVM_CAP_XSAVE2)` value (0 without XSAVE2);
/// a smaller buffer is refused with `EINVAL` instead of letting the kernel read past it.
pub fn set_xsave2(
    fd: &kvm_ioctls::VcpuFd,
    region: kvm_bindings::kvm_xsave,
    words: &[u32],
    xsave_bytes: usize,
) -> Result<(), kvm_ioctls::Error> {
    let einval = || kvm_ioctls::Error::new(libc::EINVAL);
    let have = std::mem::size_of::<kvm_bindings::kvm_xsave>() + std::mem::size_of_val(words);
    if have < xsave_bytes {
        return Err(einval());
    }
    let mut xsave = kvm_bindings::Xsave::new(words.len()).map_err(|_| einval())?;
    // SAFETY: only the fixed `xsave` region of the header is written; the length field the
    // wrapper keeps for its `words.len()` entries is left as it is.
    unsafe { xsave.as_mut_fam_struct() }.xsave = region;
    xsave.as_mut_slice().copy_from_slice(words);
    // SAFETY: the buffer holds at least the `xsave_bytes` KVM copies in for this VM (checked
    // above), so the kernel reads only inside it.
    unsafe { fd.set_xsave2(&xsave) }
}

/// Registers RAM memslot `slot` again over `region`, with `flags` (`KVM_MEM_LOG_DIRTY_PAGES`
/// or 0): dirty logging on or off. Only for a slot `setup::register_memslots` registered over
/// this same region, so KVM sees an unchanged slot, guest range and host range and changes
/// only the flags (`KVM_MR_FLAGS_ONLY`).
pub(crate) fn set_memslot_flags(
    fd: &kvm_ioctls::VmFd,
    slot: u32,
    region: &vmhost_memory::GuestRegionMmap,
    flags: u32,
) -> Result<(), kvm_ioctls::Error> {
    use vm_memory::GuestMemoryRegion;
    let mem = kvm_bindings::kvm_userspace_memory_region {
        slot,
        flags,
        guest_phys_addr: region.start_addr().0,
        memory_size: region.len(),
        userspace_addr: region.as_ptr() as u64,
    };
    // SAFETY: the slot, guest range and host range are those `register_memslots` registered
    // (the caller passes the same region of the VM's RAM), so the kernel takes no new
    // reference to any memory: it only changes the slot's flags. The invariant of that first
    // registration still holds: the mapping (owned by the `Vm`'s RAM, and here borrowed)
    // outlives the VM fd, which the `Vm` closes first.
    unsafe { fd.set_user_memory_region(mem) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pipe_polls_readable_once_written() {
        let mut fds = [0 as c_int; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let short = std::time::Duration::from_millis(1);
        assert!(!poll_readable(fds[0], short).unwrap());
        // SAFETY: fds[1] is the pipe's open write end; the buffer is one valid byte.
        assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
        assert!(poll_readable(fds[0], short).unwrap());
        let mut b = [0u8; 4];
        assert_eq!(read_fd(fds[0], &mut b).unwrap(), 1);
        assert_eq!(b[0], b'x');
        assert!(
            RawTerminal::enter(fds[0]).is_err(),
            "a pipe is not a terminal"
        );
        for fd in fds {
            // SAFETY: both descriptors are open and owned by this test.
            unsafe { libc::close(fd) };
        }
    }

    #[test]
    fn fifo_policy_reads_back_from_the_kernel_and_proc() {
        std::thread::spawn(|| {
            assert_eq!(current_thread_policy().unwrap(), libc::SCHED_OTHER);
            if let Err(e) = set_current_thread_fifo(1) {
                // Without CAP_SYS_NICE or RLIMIT_RTPRIO the kernel refuses: say so loudly.
                panic!("SCHED_FIFO refused ({e}); realtime vCPUs need CAP_SYS_NICE");
            }
            assert_eq!(current_thread_policy().unwrap(), libc::SCHED_FIFO);
            // /proc/thread-self/stat field 41 is the policy (1 = SCHED_FIFO), field 40 the
            // rt_priority.
            let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
            let after = &stat[stat.rfind(')').unwrap() + 2..];
            let fields: Vec<&str> = after.split(' ').collect();
            assert_eq!((fields[40 - 3], fields[41 - 3]), ("1", "1"), "{stat}");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn restore_terminal_undoes_raw_mode_without_the_guard() {
        let (mut master, mut slave) = (0 as c_int, 0 as c_int);
        // SAFETY: both out-pointers are valid; null name, termios and winsize are allowed.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "openpty: {}", io::Error::last_os_error());
        let lflag = |fd| {
            // SAFETY: termios is plain data filled by tcgetattr.
            let mut t: libc::termios = unsafe { std::mem::zeroed() };
            // SAFETY: `fd` is an open terminal and `t` a valid termios.
            assert_eq!(unsafe { libc::tcgetattr(fd, &mut t) }, 0);
            t.c_lflag
        };
        assert_ne!(lflag(slave) & libc::ICANON, 0);
        let raw = RawTerminal::enter(slave).unwrap();
        assert_eq!(lflag(slave) & libc::ICANON, 0);
        // What `std::process::exit` does to the guard: nothing.
        std::mem::forget(raw);
        restore_terminal();
        assert_ne!(lflag(slave) & libc::ICANON, 0, "canonical mode is back");
        for fd in [master, slave] {
            // SAFETY: both descriptors are open and owned by this test.
            unsafe { libc::close(fd) };
        }
    }

    #[test]
    fn empty_cpu_list_is_rejected() {
        let err = pin_current_thread(&[]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn affinity_round_trips_in_a_scratch_thread() {
        std::thread::spawn(|| {
            let all = current_affinity().unwrap();
            let first = all[0];
            pin_current_thread(&[first]).unwrap();
            assert_eq!(current_affinity().unwrap(), vec![first]);
        })
        .join()
        .unwrap();
    }
}

vmm_sys_util::ioctl_iow_nr!(
    KVM_SIGNAL_MSI,
    kvm_bindings::KVMIO,
    0xa5,
    kvm_bindings::kvm_msi
);

/// A second descriptor of the VM `vm` (for the threads that send MSI-X messages).
pub fn dup_vm_fd(vm: &impl std::os::fd::AsRawFd) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: F_DUPFD_CLOEXEC only reads the descriptor number; a closed one fails (EBADF).
    let fd = unsafe { libc::fcntl(vm.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by fcntl and nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// `KVM_SIGNAL_MSI` on the VM descriptor `vm`: the message `data` to `address`. A message the
/// guest's interrupt controller blocked (the ioctl's 0) is not an error: the guest masked it.
pub fn signal_msi(vm: &std::os::fd::OwnedFd, address: u64, data: u32) -> io::Result<()> {
    let msi = kvm_bindings::kvm_msi {
        address_lo: (address & 0xffff_ffff) as u32,
        address_hi: (address >> 32) as u32,
        data,
        ..Default::default()
    };
    // SAFETY: `vm` is an open KVM VM descriptor; `msi` is a valid kvm_msi that the kernel only
    // reads during the call, as KVM_SIGNAL_MSI's _IOW direction and size say.
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vm, KVM_SIGNAL_MSI(), &msi) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

vmm_sys_util::ioctl_iow_nr!(
    KVM_SET_GSI_ROUTING,
    kvm_bindings::KVMIO,
    0x6a,
    kvm_bindings::kvm_irq_routing
);

/// `KVM_SET_GSI_ROUTING` on the VM descriptor `vm`: the whole routing table becomes one MSI
/// route per `(gsi, address, data)` (a split irqchip's I/O APIC pins; GSIs with no route
/// deliver nothing).
pub fn set_msi_routes(vm: &std::os::fd::OwnedFd, routes: &[(u32, u64, u32)]) -> io::Result<()> {
    let mut table = kvm_bindings::KvmIrqRouting::new(routes.len())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{e:?}")))?;
    for (entry, &(gsi, address, data)) in table.as_mut_slice().iter_mut().zip(routes) {
        entry.gsi = gsi;
        entry.type_ = kvm_bindings::KVM_IRQ_ROUTING_MSI;
        entry.u.msi = kvm_bindings::kvm_irq_routing_msi {
            address_lo: (address & 0xffff_ffff) as u32,
            address_hi: (address >> 32) as u32,
            data,
            ..Default::default()
        };
    }
    // SAFETY: `vm` is an open KVM VM descriptor; the wrapper holds a kvm_irq_routing header
    // whose `nr` is the number of entries allocated right after it, which the kernel reads
    // (and only reads) during the call.
    let r = unsafe {
        vmm_sys_util::ioctl::ioctl_with_ref(vm, KVM_SET_GSI_ROUTING(), table.as_fam_struct_ref())
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
