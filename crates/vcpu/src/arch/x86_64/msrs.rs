//! The model-specific registers a Linux guest's vCPUs start with, as Firecracker and Cloud
//! Hypervisor set them: the SYSENTER/SYSCALL MSRs cleared, fast string operations enabled in
//! `IA32_MISC_ENABLE`, and the MTRRs enabled with write-back as the default memory type (with
//! MTRRs off, a kernel treats all memory as uncached until it sets them up, and some disable
//! PAT). Every vCPU gets them, application processors too: Linux does not rewrite them on the
//! way up.

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;

use super::linux::IoctlError;

/// `IA32_SYSENTER_CS`.
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// `IA32_SYSENTER_ESP`.
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// `IA32_SYSENTER_EIP`.
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// `IA32_MISC_ENABLE`.
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// `IA32_MTRR_DEF_TYPE`.
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// `STAR`.
pub const MSR_STAR: u32 = 0xc000_0081;
/// `LSTAR`.
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// `CSTAR`.
pub const MSR_CSTAR: u32 = 0xc000_0083;
/// `SFMASK` (`SYSCALL_MASK`).
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// `KERNEL_GS_BASE`.
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
/// `IA32_MISC_ENABLE` bit 0: fast string operations.
pub const MISC_ENABLE_FAST_STRING: u64 = 1;
/// `IA32_MTRR_DEF_TYPE`: MTRRs enabled (bit 11) and default type write-back (6).
pub const MTRR_ENABLED_WRITE_BACK: u64 = (1 << 11) | 6;

/// The boot MSRs and their values.
pub fn boot_msrs() -> [(u32, u64); 10] {
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLED_WRITE_BACK),
    ]
}

/// Writes [`boot_msrs`] into `fd`; KVM must accept every one.
pub fn set_boot_msrs(fd: &VcpuFd) -> Result<(), IoctlError> {
    let entries: Vec<kvm_msr_entry> = boot_msrs()
        .into_iter()
        .map(|(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries).map_err(|_| {
        (
            "KVM_SET_MSRS (building the list)",
            kvm_ioctls::Error::new(libc::E2BIG),
        )
    })?;
    let written = fd.set_msrs(&msrs).map_err(|e| ("KVM_SET_MSRS", e))?;
    if written != entries.len() {
        // KVM stops at the first MSR it refuses and returns how many it wrote.
        let refused = entries.get(written).map_or(0, |e| e.index);
        tracing::error!(msr = format_args!("{refused:#x}"), "KVM refused a boot MSR");
        return Err(("KVM_SET_MSRS", kvm_ioctls::Error::new(libc::EINVAL)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtrrs_enabled_write_back_and_fast_strings() {
        let m = boot_msrs();
        let get = |i: u32| m.iter().find(|(idx, _)| *idx == i).map(|(_, v)| *v);
        assert_eq!(get(MSR_MTRR_DEF_TYPE), Some(0x806));
        assert_eq!(get(MSR_IA32_MISC_ENABLE), Some(1));
        assert_eq!(get(MSR_LSTAR), Some(0));
    }
}
