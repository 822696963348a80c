//! CPUID for guests whose ring 0 is emulated instruction by instruction, as on a nested host
//! whose KVM backend runs only ring 3 natively (see `docs/host-facts.md`).
//!
//! Such an emulator implements the instructions a kernel needs to boot, not every extension the
//! host CPU has. A kernel picks its code paths from CPUID: with `cx16` it runs `cmpxchg16b`, with
//! `xsave` it saves FPU state with `xsave`/`xrstor`, with `avx*` it uses vector code, with
//! `fsgsbase`/`pcid`/`invpcid`/`pku`/`la57` it runs the matching instructions and control-register
//! bits. [`mask_for_nested_emulation`] clears those leaves' bits, so the kernel takes the plain
//! paths (no `cmpxchg16b`, `fxsave`, scalar code). It moves the first unsupported instruction
//! later; it cannot remove instructions the kernel runs unconditionally (`int3` in its
//! self-test).
//!
//! Measured on this project's nested hosts: the ring-0 `cpuid` emulation there starts from the
//! host's raw values and takes only a few leaf-1 bits from `KVM_SET_CPUID2` (`cx16`, and KVM's
//! own x2APIC and TSC-deadline bits), besides the topology leaves. Clearing `cx16` works (Debian's
//! 6.1 kernel then stops at `xrstor64` instead of `cmpxchg16b`); XSAVE, AVX and UMIP stay
//! visible, so on such a host add `noxsave` to the kernel command line as well.

use kvm_bindings::CpuId;

/// One feature register: leaf, subleaf, register (0 EAX .. 3 EDX) and the bits to clear.
struct Mask {
    leaf: u32,
    subleaf: u32,
    reg: usize,
    bits: u32,
}

const fn bit(n: u32) -> u32 {
    1 << n
}

/// The bits cleared, grouped by register.
const MASKS: [Mask; 6] = [
    // Leaf 1 ECX: FMA, CX16, PCID, MOVBE, XSAVE, OSXSAVE, AVX, F16C, RDRAND.
    Mask {
        leaf: 1,
        subleaf: 0,
        reg: 2,
        bits: bit(12)
            | bit(13)
            | bit(17)
            | bit(22)
            | bit(26)
            | bit(27)
            | bit(28)
            | bit(29)
            | bit(30),
    },
    // Leaf 7.0 EBX: FSGSBASE, HLE, AVX2, INVPCID, RTM, AVX512 (F, DQ, IFMA, PF, ER, CD, BW,
    // VL), RDSEED, SHA, MPX, and PQM/PQE.
    Mask {
        leaf: 7,
        subleaf: 0,
        reg: 1,
        bits: bit(0)
            | bit(4)
            | bit(5)
            | bit(10)
            | bit(11)
            | bit(12)
            | bit(14)
            | bit(15)
            | bit(16)
            | bit(17)
            | bit(18)
            | bit(21)
            | bit(26)
            | bit(27)
            | bit(28)
            | bit(29)
            | bit(30)
            | bit(31),
    },
    // Leaf 7.0 ECX: AVX512 VBMI, UMIP, PKU, OSPKE, WAITPKG, VBMI2, CET-SS, GFNI, VAES,
    // VPCLMULQDQ, VNNI, BITALG, VPOPCNTDQ, LA57, RDPID, MOVDIRI, MOVDIR64B, ENQCMD.
    Mask {
        leaf: 7,
        subleaf: 0,
        reg: 2,
        bits: bit(1)
            | bit(2)
            | bit(3)
            | bit(4)
            | bit(5)
            | bit(6)
            | bit(7)
            | bit(8)
            | bit(9)
            | bit(10)
            | bit(11)
            | bit(12)
            | bit(14)
            | bit(16)
            | bit(22)
            | bit(27)
            | bit(28)
            | bit(29),
    },
    // Leaf 7.0 EDX: AVX512 4VNNIW/4FMAPS, FSRM, VP2INTERSECT, SERIALIZE, TSXLDTRK, PCONFIG,
    // CET-IBT, AMX, AVX512-FP16.
    Mask {
        leaf: 7,
        subleaf: 0,
        reg: 3,
        bits: bit(2)
            | bit(3)
            | bit(4)
            | bit(8)
            | bit(14)
            | bit(16)
            | bit(18)
            | bit(20)
            | bit(22)
            | bit(23)
            | bit(24)
            | bit(25),
    },
    // Leaf 7.1 EAX: AVX-VNNI, AVX512-BF16.
    Mask {
        leaf: 7,
        subleaf: 1,
        reg: 0,
        bits: bit(4) | bit(5),
    },
    // Leaf 0x8000_0001 ECX: XOP, FMA4, TBM.
    Mask {
        leaf: 0x8000_0001,
        subleaf: 0,
        reg: 2,
        bits: bit(11) | bit(16) | bit(21),
    },
];

/// Leaves dropped whole: XSAVE state components (0xD) and processor trace (0x14).
const DROPPED_LEAVES: [u32; 2] = [0xD, 0x14];

/// Clears the features listed in the module docs from every entry of `cpuid` and drops the
/// XSAVE and processor-trace leaves.
pub fn mask_for_nested_emulation(cpuid: &mut CpuId) {
    for e in cpuid.as_mut_slice() {
        if DROPPED_LEAVES.contains(&e.function) {
            (e.eax, e.ebx, e.ecx, e.edx) = (0, 0, 0, 0);
            continue;
        }
        for m in MASKS
            .iter()
            .filter(|m| m.leaf == e.function && m.subleaf == e.index)
        {
            let reg = match m.reg {
                0 => &mut e.eax,
                1 => &mut e.ebx,
                2 => &mut e.ecx,
                _ => &mut e.edx,
            };
            *reg &= !m.bits;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: u32::MAX,
            ebx: u32::MAX,
            ecx: u32::MAX,
            edx: u32::MAX,
            ..Default::default()
        }
    }

    #[test]
    fn cx16_xsave_and_avx_are_cleared_and_long_mode_stays() {
        let mut c = CpuId::from_entries(&[
            entry(1, 0),
            entry(7, 0),
            entry(0xD, 1),
            entry(0x8000_0001, 0),
        ])
        .unwrap();
        mask_for_nested_emulation(&mut c);
        let get = |l: u32| *c.as_slice().iter().find(|e| e.function == l).unwrap();
        let l1 = get(1);
        for b in [13, 26, 27, 28] {
            assert_eq!(l1.ecx & bit(b), 0, "leaf 1 ECX bit {b}");
        }
        assert_ne!(l1.ecx & bit(21), 0, "x2APIC stays");
        assert_eq!(l1.edx, u32::MAX, "leaf 1 EDX (FPU, SSE, ...) untouched");
        assert_eq!(get(7).ebx & bit(5), 0, "AVX2");
        assert_eq!(get(7).ecx & bit(16), 0, "LA57");
        assert_eq!(get(0xD).eax, 0);
        let ext = get(0x8000_0001);
        assert_ne!(ext.edx & bit(29), 0, "long mode stays");
    }
}
