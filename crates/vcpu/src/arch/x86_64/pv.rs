//! What a Linux guest needs from CPUID to know it runs on KVM, and an XSAVE leaf it can trust.
//!
//! - **Hypervisor leaves.** Leaf 1 ECX bit 31 ("hypervisor") tells the kernel to look at
//!   0x4000_0000; there `KVMKVMKVM` and leaf 0x4000_0001 (the paravirtual features exactly as
//!   `KVM_GET_SUPPORTED_CPUID` lists them: kvmclock, async PF, PV EOI, ...) come from KVM.
//!   `KVM_GET_SUPPORTED_CPUID` does not set the hypervisor bit itself, so without it a kernel
//!   says "Booting paravirtualized kernel on bare hardware", finds no kvmclock and must
//!   calibrate its TSC against a PIT.
//! - **TSC frequency.** Leaf 0x4000_0010 (the timing leaf hypervisors share): EAX = TSC kHz
//!   (`KVM_GET_TSC_KHZ`), EBX = local APIC timer kHz (KVM's APIC bus runs at 1 GHz); 0x4000_0000
//!   EAX then names 0x4000_0010 as the highest leaf. kvmclock gives a Linux guest the same rate.
//! - **Leaf 0xD (XSAVE).** Only the state components whose feature the guest is offered stay
//!   (AVX needs leaf 1 AVX, AVX-512 leaf 7 AVX512F, ...): sub-leaf 0 EAX/EDX, the sub-leaves of
//!   the dropped components removed, and sub-leaf 0 EBX/ECX set to the size of the XSAVE area
//!   for every offered user component, computed from the sub-leaves that remain (as QEMU does).
//!   Without XSAVE in leaf 1 the whole leaf goes.
//!
//!   KVM rewrites sub-leaf 0 EBX (the size for the components enabled in XCR0) from the
//!   vCPU's XCR0 at `KVM_SET_CPUID2` and when CR4.OSXSAVE or an XCR0 bit beyond x87/SSE/AVX
//!   changes, but not when only AVX is switched on: a kernel that enables AVX then reads the
//!   x87+SSE size (576) and warns `XSAVE consistency problem: size 832 != kernel_size 576`
//!   (QEMU's guests do too, in the emulated host). [`prime_xsave`] therefore sets XCR0 to
//!   every offered user component before the vCPU's CPUID is set a second time, so EBX holds
//!   the size of what the kernel will enable.

use kvm_bindings::kvm_cpuid_entry2;

/// Leaf 1 ECX: running under a hypervisor.
pub const HYPERVISOR_BIT: u32 = 1 << 31;
/// KVM's signature leaf.
pub const KVM_SIGNATURE_LEAF: u32 = 0x4000_0000;
/// The timing leaf: TSC and APIC timer frequencies in kHz.
pub const TIMING_LEAF: u32 = 0x4000_0010;
/// KVM's local APIC bus (timer) frequency in kHz: 1 GHz.
pub const APIC_BUS_KHZ: u32 = 1_000_000;
/// Size of the legacy XSAVE region plus its header: where extended components start.
const XSAVE_LEGACY_AND_HEADER: u32 = 512 + 64;
/// Leaf 1 ECX: XSAVE.
const XSAVE_BIT: u32 = 1 << 26;

/// Sets the hypervisor bit in leaf 1 and keeps KVM's own paravirtual leaves.
pub fn mark_hypervisor(entries: &mut [kvm_cpuid_entry2]) {
    if let Some(e) = entries.iter_mut().find(|e| e.function == 1) {
        e.ecx |= HYPERVISOR_BIT;
    }
}

/// Adds (or replaces) the timing leaf with `tsc_khz` and raises 0x4000_0000 EAX to cover it.
/// Does nothing when KVM's signature leaf is absent (no paravirtual leaves to extend).
pub fn set_timing_leaf(entries: &mut Vec<kvm_cpuid_entry2>, tsc_khz: u32) {
    let Some(sig) = entries
        .iter_mut()
        .find(|e| e.function == KVM_SIGNATURE_LEAF)
    else {
        return;
    };
    sig.eax = sig.eax.max(TIMING_LEAF);
    entries.retain(|e| e.function != TIMING_LEAF);
    entries.push(kvm_cpuid_entry2 {
        function: TIMING_LEAF,
        eax: tsc_khz,
        ebx: APIC_BUS_KHZ,
        ..Default::default()
    });
}

/// The feature that gates XSAVE state component `bit`, as (leaf, subleaf, register, bit);
/// `None` for components no feature bit gates (x87, SSE) or none the guest can use.
fn component_feature(bit: u32) -> Option<(u32, usize, u32)> {
    // Registers: 1 EBX, 2 ECX, 3 EDX; leaf 1 and leaf 7.0.
    match bit {
        2 => Some((1, 2, 28)),       // AVX
        3 | 4 => Some((7, 1, 14)),   // MPX
        5..=7 => Some((7, 1, 16)),   // AVX-512F
        9 => Some((7, 2, 3)),        // PKU
        17 | 18 => Some((7, 3, 24)), // AMX-TILE
        _ => None,
    }
}

fn reg(e: &kvm_cpuid_entry2, r: usize) -> u32 {
    match r {
        0 => e.eax,
        1 => e.ebx,
        2 => e.ecx,
        _ => e.edx,
    }
}

/// Makes leaf 0xD agree with the features offered (see the module docs).
pub fn normalize_xsave(entries: &mut Vec<kvm_cpuid_entry2>) {
    let leaf1_ecx = entries
        .iter()
        .find(|e| e.function == 1)
        .map_or(0, |e| e.ecx);
    if leaf1_ecx & XSAVE_BIT == 0 {
        entries.retain(|e| e.function != 0xD);
        return;
    }
    let offered = |bit: u32| match component_feature(bit) {
        None => bit < 2,
        Some((leaf, r, b)) => entries
            .iter()
            .find(|e| e.function == leaf && e.index == 0)
            .is_some_and(|e| reg(e, r) & (1 << b) != 0),
    };
    let Some(sub0) = entries.iter().find(|e| e.function == 0xD && e.index == 0) else {
        return;
    };
    let supported = u64::from(sub0.eax) | (u64::from(sub0.edx) << 32);
    let keep: u64 = (0..64)
        .filter(|&b| supported & (1 << b) != 0 && offered(b))
        .fold(0, |m, b| m | (1 << b));
    entries.retain(|e| e.function != 0xD || e.index < 2 || keep & (1 << e.index) != 0);
    let size = entries
        .iter()
        .filter(|e| e.function == 0xD && e.index >= 2 && e.index < 64 && e.eax != 0)
        // Supervisor components (ECX bit 0) live only in the compacted format.
        .filter(|e| e.ecx & 1 == 0)
        .map(|e| e.ebx.saturating_add(e.eax))
        .fold(XSAVE_LEGACY_AND_HEADER, u32::max);
    if let Some(sub0) = entries
        .iter_mut()
        .find(|e| e.function == 0xD && e.index == 0)
    {
        sub0.eax = u32::try_from(keep & 0xffff_ffff).unwrap_or(0);
        sub0.edx = u32::try_from(keep >> 32).unwrap_or(0);
        sub0.ebx = size;
        sub0.ecx = size;
    }
}

/// The XCR0 value that enables every user state component sub-leaf 0 offers (`None`: no
/// XSAVE).
pub fn offered_xcr0(entries: &[kvm_cpuid_entry2]) -> Option<u64> {
    let xsave = entries
        .iter()
        .any(|e| e.function == 1 && e.ecx & XSAVE_BIT != 0);
    let sub0 = entries.iter().find(|e| e.function == 0xD && e.index == 0)?;
    let mask = u64::from(sub0.eax) | (u64::from(sub0.edx) << 32);
    // x87 must be set; AMX (17, 18) needs the process's permission first: left out.
    (xsave && mask & 1 != 0).then_some(mask & !((1 << 17) | (1 << 18)))
}

/// Sets the vCPU's XCR0 to [`offered_xcr0`] and its CPUID again, so KVM's sub-leaf 0 EBX
/// says the size of what the guest kernel will enable (see the module docs). A refusal is
/// logged and the vCPU keeps KVM's value (as under QEMU): the guest still boots.
pub fn prime_xsave(fd: &kvm_ioctls::VcpuFd, cpuid: &kvm_bindings::CpuId, vcpu: u32) {
    let Some(xcr0) = offered_xcr0(cpuid.as_slice()) else {
        return;
    };
    let mut xcrs = kvm_bindings::kvm_xcrs {
        nr_xcrs: 1,
        ..Default::default()
    };
    xcrs.xcrs[0].xcr = 0;
    xcrs.xcrs[0].value = xcr0;
    let r = fd.set_xcrs(&xcrs).and_then(|()| fd.set_cpuid2(cpuid));
    if let Err(e) = r {
        tracing::warn!(vcpu, xcr0 = format_args!("{xcr0:#x}"), error = %e,
            "cannot pre-set XCR0: the guest may see a stale XSAVE size in CPUID leaf 0xD");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32, edx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        }
    }

    /// What the emulated host's KVM offers: x87, SSE, AVX (at 576, 256 bytes) and PKRU.
    fn supported(leaf1_ecx: u32) -> Vec<kvm_cpuid_entry2> {
        vec![
            e(1, 0, 0, 0, leaf1_ecx, 0),
            e(7, 0, 0, 0, 1 << 3, 0),
            e(0xD, 0, 0x207, 0x240, 0x988, 0),
            e(0xD, 1, 0x1, 0, 0, 0),
            e(0xD, 2, 0x100, 0x240, 0, 0),
            e(0xD, 9, 0x8, 0x980, 0, 0),
            e(0x4000_0000, 0, 0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x4d),
        ]
    }

    fn sub(v: &[kvm_cpuid_entry2], i: u32) -> Option<kvm_cpuid_entry2> {
        v.iter()
            .copied()
            .find(|e| e.function == 0xD && e.index == i)
    }

    #[test]
    fn leaf_0xd_sizes_cover_exactly_the_offered_components() {
        let mut v = supported(XSAVE_BIT | (1 << 28));
        normalize_xsave(&mut v);
        let s0 = sub(&v, 0).unwrap();
        assert_eq!((s0.eax, s0.edx), (0x207, 0));
        assert_eq!((s0.ebx, s0.ecx), (0x988, 0x988), "PKRU ends at 0x980 + 8");
        assert!(sub(&v, 2).is_some() && sub(&v, 9).is_some());
    }

    #[test]
    fn components_without_their_feature_bit_are_dropped() {
        // No AVX in leaf 1, no PKU in leaf 7: only x87 and SSE remain, at 576 bytes.
        let mut v = supported(XSAVE_BIT);
        v[1].ecx = 0;
        normalize_xsave(&mut v);
        let s0 = sub(&v, 0).unwrap();
        assert_eq!((s0.eax, s0.ebx, s0.ecx), (0x3, 576, 576));
        assert!(sub(&v, 2).is_none() && sub(&v, 9).is_none());
        assert!(sub(&v, 1).is_some(), "sub-leaf 1 (XSAVEOPT, ...) stays");
    }

    #[test]
    fn offered_xcr0_is_sub_leaf_0_without_amx() {
        let mut v = supported(XSAVE_BIT | (1 << 28));
        normalize_xsave(&mut v);
        assert_eq!(offered_xcr0(&v), Some(0x207));
        v.iter_mut()
            .filter(|e| e.function == 0xD && e.index == 0)
            .for_each(|e| e.eax |= 3 << 17);
        assert_eq!(offered_xcr0(&v), Some(0x207));
        assert_eq!(offered_xcr0(&supported(0)), None, "no XSAVE bit");
    }

    #[test]
    fn no_xsave_no_leaf_0xd() {
        let mut v = supported(1 << 28);
        normalize_xsave(&mut v);
        assert!(v.iter().all(|e| e.function != 0xD));
    }

    #[test]
    fn hypervisor_bit_and_timing_leaf() {
        let mut v = supported(0);
        mark_hypervisor(&mut v);
        assert_ne!(v[0].ecx & HYPERVISOR_BIT, 0);
        set_timing_leaf(&mut v, 2_445_000);
        set_timing_leaf(&mut v, 2_445_001);
        let sig = v.iter().find(|e| e.function == KVM_SIGNATURE_LEAF).unwrap();
        assert_eq!(sig.eax, TIMING_LEAF);
        let t: Vec<_> = v.iter().filter(|e| e.function == TIMING_LEAF).collect();
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].eax, t[0].ebx), (2_445_001, APIC_BUS_KHZ));
    }

    #[test]
    fn no_timing_leaf_without_kvm_leaves() {
        let mut v = vec![e(1, 0, 0, 0, 0, 0)];
        set_timing_leaf(&mut v, 1000);
        assert_eq!(v.len(), 1);
    }
}
