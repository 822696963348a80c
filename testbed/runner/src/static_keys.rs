//! Holds the emulated host's kernel static keys that VM and cgroup churn toggles, so that its
//! kernel text is not rewritten while the tests run.
//!
//! Every KVM VM the tests start and stop flips static keys in the emulated host's kernel: the
//! scheduler's `preempt_notifier_key` (KVM_CREATE_VM / VM release; its branch sites are in
//! `finish_task_switch` and `__schedule`), KVM's `kvm_has_noapic_vcpu` and `apic_sw_disabled`
//! (vCPUs without / with an in-kernel LAPIC), and the cgroups the cgroup tests create and remove
//! flip `cpusets_enabled_key` and `memcg_sockets_enabled_key`. A flip is `text_poke_bp`: INT3 over live kernel code on every
//! CPU, cross-modified while the other CPUs run it. QEMU 7.2's multi-threaded TCG sometimes
//! livelocks there: a kept monitor dump of a frozen 4-node host had one CPU in `exc_int3` and
//! two at `finish_task_switch+0x9f`, which is the 5-byte jump-label site at 0x...dcfff, across
//! a page boundary, that a kprobe on `text_poke_queue` saw rewritten at every VM start and stop.
//!
//! A static key's text changes only when its count goes between 0 and 1. So for the whole
//! suite this process keeps one VM with a vCPU and no irqchip, one VM with an in-kernel irqchip
//! and a never-run vCPU (its LAPIC stays software-disabled), and one empty cgroup with the
//! cpuset and memory controllers. The
//! keys are flipped once, before the first test, and never again. The tests' VMs are unchanged:
//! what this removes is an emulator hazard, not anything vmhost does.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

/// `_IO(KVMIO, 0x01)`.
const KVM_CREATE_VM: libc::c_ulong = 0xae01;
/// `_IO(KVMIO, 0x41)`.
const KVM_CREATE_VCPU: libc::c_ulong = 0xae41;
/// `_IO(KVMIO, 0x60)`.
const KVM_CREATE_IRQCHIP: libc::c_ulong = 0xae60;

/// The cgroup (cpuset and memory controllers) kept for the whole suite.
const CGROUP_PIN: &str = "/sys/fs/cgroup/testbed-static-keys";

/// The held VMs and cgroup; dropped (closed, removed) at the end of the suite.
pub struct StaticKeyPin {
    _fds: Vec<OwnedFd>,
    cgroup: PathBuf,
}

impl Drop for StaticKeyPin {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

/// One KVM ioctl without an argument (all those used here); returns its non-negative result.
fn kvm_ioctl(fd: &impl AsRawFd, request: libc::c_ulong) -> Result<i32, String> {
    // SAFETY: KVM_CREATE_VM (type 0), KVM_CREATE_VCPU (id 0) and KVM_CREATE_IRQCHIP take an
    // integer argument, here 0; no memory is passed to the kernel.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), request, 0) };
    if ret < 0 {
        return Err(format!(
            "KVM ioctl {request:#x}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(ret)
}

/// A KVM ioctl that creates an object and returns its file descriptor.
fn ioctl_fd(fd: &impl AsRawFd, request: libc::c_ulong) -> Result<OwnedFd, String> {
    let raw = kvm_ioctl(fd, request)?;
    // SAFETY: `raw` is a descriptor the kernel just returned to us, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Creates the VMs and the cgroup that hold the keys; see the module documentation.
pub fn hold() -> Result<StaticKeyPin, String> {
    let kvm = File::open("/dev/kvm").map_err(|e| format!("/dev/kvm: {e}"))?;
    let mut fds = Vec::new();
    // preempt_notifier_key + kvm_has_noapic_vcpu.
    let plain = ioctl_fd(&kvm, KVM_CREATE_VM)?;
    fds.push(ioctl_fd(&plain, KVM_CREATE_VCPU)?);
    fds.push(plain);
    // apic_sw_disabled (a LAPIC is software-disabled from creation until the guest enables it).
    let irqchip = ioctl_fd(&kvm, KVM_CREATE_VM)?;
    kvm_ioctl(&irqchip, KVM_CREATE_IRQCHIP)?;
    fds.push(ioctl_fd(&irqchip, KVM_CREATE_VCPU)?);
    fds.push(irqchip);
    // cpusets_enabled_key and memcg_sockets_enabled_key: one cgroup besides the root with the
    // cpuset and memory controllers.
    crate::host::write("/sys/fs/cgroup/cgroup.subtree_control", "+cpuset +memory")?;
    let dir = PathBuf::from(CGROUP_PIN);
    if !dir.exists() {
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    }
    flip_network_once_keys()?;
    Ok(StaticKeyPin {
        _fds: fds,
        cgroup: dir,
    })
}

/// Uses, once, what the network stack keys with `DO_ONCE` / `net_get_random_once`: the
/// secrets of TCP sequence numbers and ephemeral ports, the socket hash tables' secret and the
/// flow dissector's hash seed. Each such key's sites are rewritten by a kworker right after
/// its first use (`once_deferred`). A 4-node migration test that was the first to connect to
/// a guest over TCP recorded 11 such rewrites while its guest ran (`diagnose::TextPokes`:
/// `secure_tcp_seq_and_ts_off`, `__inet_hash_connect`, `inet_ehashfn`, `__skb_get_hash`, …).
/// Here they happen before any test: a TCP connection with data each way on IPv4 and IPv6
/// loopback, and a frame sent out through a tap (tun picks its queue by the flow hash). Then this waits
/// until no rewrite has come for half a second (at most 10 s), watching them with the same
/// kprobe.
fn flip_network_once_keys() -> Result<(), String> {
    let pokes = crate::diagnose::TextPokes::start();
    for addr in ["127.0.0.1:0", "[::1]:0"] {
        // IPv6 may be off in the emulated host's kernel: then there is nothing to flip.
        let Ok(listener) = std::net::TcpListener::bind(addr) else {
            continue;
        };
        let to = listener.local_addr().map_err(|e| e.to_string())?;
        let mut out = std::net::TcpStream::connect(to).map_err(|e| format!("{to}: {e}"))?;
        let (mut inn, _) = listener.accept().map_err(|e| format!("{to}: {e}"))?;
        let mut byte = [0u8; 1];
        std::io::Write::write_all(&mut out, b"x").map_err(|e| e.to_string())?;
        std::io::Read::read_exact(&mut inn, &mut byte).map_err(|e| e.to_string())?;
        std::io::Write::write_all(&mut inn, b"y").map_err(|e| e.to_string())?;
        std::io::Read::read_exact(&mut out, &mut byte).map_err(|e| e.to_string())?;
    }
    tap_frame()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut last = (pokes.count(), std::time::Instant::now());
    while std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = pokes.count();
        if now != last.0 {
            last = (now, std::time::Instant::now());
        } else if last.1.elapsed() >= std::time::Duration::from_millis(500) {
            break;
        }
    }
    println!(
        "testbed: the network's once-only keys flipped before the tests: {}",
        pokes.summary()
    );
    Ok(())
}

/// `TUNSETIFF`: `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// Sends one broadcast Ethernet frame out through a new two-queue tap (`tbkeys0`, gone when
/// its descriptors close), from an `AF_PACKET` socket: tun picks the frame's queue by its flow
/// hash (`tun_automq_select_queue` → `__skb_get_hash_symmetric`), the flow dissector's
/// once-only seed. (A single-queue tap is never asked: `netdev_core_pick_tx` skips the choice.)
fn tap_frame() -> Result<(), String> {
    // Two queues: tun picks a transmit queue (by the hash) only when it has more than one.
    let queues = [tap_queue()?, tap_queue()?];
    crate::host::run_tool(&["ip", "link", "set", "tbkeys0", "up"])?;
    // SAFETY: if_nametoindex reads the NUL-terminated name, a static string.
    let index = unsafe { libc::if_nametoindex(c"tbkeys0".as_ptr()) };
    if index == 0 {
        return Err(format!("tbkeys0: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: socket(2) with constant arguments; the descriptor is owned below.
    let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if raw < 0 {
        return Err(format!(
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: `raw` is a descriptor the kernel just returned, owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    // Broadcast destination, a locally administered source, EtherType IPv4, a zero payload.
    let mut frame = [0u8; 60];
    frame[..6].fill(0xff);
    frame[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0x7b, 0x01]);
    frame[12..14].copy_from_slice(&[0x08, 0x00]);
    // SAFETY: an all-zero sockaddr_ll is valid; the fields are set below.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = u16::try_from(libc::AF_PACKET).map_err(|e| e.to_string())?;
    to.sll_ifindex = i32::try_from(index).map_err(|e| e.to_string())?;
    to.sll_halen = 6;
    to.sll_addr[..6].fill(0xff);
    let len = u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).map_err(|e| e.to_string())?;
    // SAFETY: `frame` and `to` outlive the call; `len` is `to`'s size.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            std::ptr::addr_of!(to).cast(),
            len,
        )
    };
    if sent < 0 {
        return Err(format!(
            "sending a frame on tbkeys0: {}",
            std::io::Error::last_os_error()
        ));
    }
    drop(queues);
    Ok(())
}

/// One queue of the multi-queue tap `tbkeys0` (created by the first).
fn tap_queue() -> Result<std::fs::File, String> {
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|e| format!("/dev/net/tun: {e}"))?;
    // struct ifreq: the name (16 bytes), then the flags (a short) in the union.
    let mut ifr = [0u8; 40];
    ifr[..7].copy_from_slice(b"tbkeys0");
    let flags = u16::try_from(libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_MULTI_QUEUE)
        .map_err(|e| e.to_string())?;
    ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads a struct ifreq (40 bytes here) from `ifr`, which outlives the
    // call, and writes the chosen name back into it.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } < 0 {
        return Err(format!("TUNSETIFF: {}", std::io::Error::last_os_error()));
    }
    Ok(tun)
}
