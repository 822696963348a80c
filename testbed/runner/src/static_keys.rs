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
    Ok(StaticKeyPin {
        _fds: fds,
        cgroup: dir,
    })
}
