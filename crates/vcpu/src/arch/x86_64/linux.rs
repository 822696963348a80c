//! KVM register state of a Linux guest's vCPUs: the boot vCPU's entry state from
//! [`vmhost_boot::CpuState`] (PVH or the 64-bit boot protocol), the FPU reset values, and the
//! local APIC's LINT0/LINT1 wiring that every vCPU needs with the in-kernel irqchip.
//!
//! Application processors get only the LINT wiring: they stay in KVM's "wait for INIT/SIPI"
//! state until Linux starts them.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_regs, kvm_segment, kvm_sregs};
use kvm_ioctls::VcpuFd;
use vmhost_boot::cpu::{DescriptorTable, Segment};
use vmhost_boot::CpuState;

/// Offset of the LVT LINT0 register in the local APIC page.
const APIC_LVT0: usize = 0x350;
/// Offset of the LVT LINT1 register.
const APIC_LVT1: usize = 0x360;
/// Delivery mode field of an LVT entry (bits 10:8).
const DELIVERY_MODE_MASK: u32 = 0x700;
/// Delivery mode ExtINT (the 8259's INTR).
const MODE_EXTINT: u32 = 0x700;
/// Delivery mode NMI.
const MODE_NMI: u32 = 0x400;
/// FPU control word after `FNINIT`.
const FPU_FCW: u16 = 0x37f;
/// MXCSR after reset.
const MXCSR_RESET: u32 = 0x1f80;

/// A failed vCPU ioctl: its name and the cause.
pub type IoctlError = (&'static str, kvm_ioctls::Error);

/// Wires LINT0 as ExtINT and LINT1 as NMI, as firmware leaves them on a PC.
pub fn set_lint(fd: &VcpuFd) -> Result<(), IoctlError> {
    let mut lapic = fd.get_lapic().map_err(|e| ("KVM_GET_LAPIC", e))?;
    for (reg, mode) in [(APIC_LVT0, MODE_EXTINT), (APIC_LVT1, MODE_NMI)] {
        let v = lapic_reg(&lapic, reg);
        set_lapic_reg(&mut lapic, reg, (v & !DELIVERY_MODE_MASK) | mode);
    }
    fd.set_lapic(&lapic).map_err(|e| ("KVM_SET_LAPIC", e))
}

fn lapic_reg(lapic: &kvm_lapic_state, off: usize) -> u32 {
    let b = |i: usize| lapic.regs[off + i].to_ne_bytes()[0];
    u32::from_le_bytes([b(0), b(1), b(2), b(3)])
}

fn set_lapic_reg(lapic: &mut kvm_lapic_state, off: usize, v: u32) {
    for (i, byte) in v.to_le_bytes().into_iter().enumerate() {
        lapic.regs[off + i] = std::ffi::c_char::from_ne_bytes([byte]);
    }
}

/// Loads `state` into the boot vCPU: special registers, general registers and a reset FPU.
pub fn set_boot_state(fd: &VcpuFd, state: &CpuState) -> Result<(), IoctlError> {
    let mut sregs = fd.get_sregs().map_err(|e| ("KVM_GET_SREGS", e))?;
    apply_sregs(&mut sregs, state);
    fd.set_sregs(&sregs).map_err(|e| ("KVM_SET_SREGS", e))?;
    fd.set_regs(&regs(state)).map_err(|e| ("KVM_SET_REGS", e))?;
    let fpu = kvm_fpu {
        fcw: FPU_FCW,
        mxcsr: MXCSR_RESET,
        ..Default::default()
    };
    fd.set_fpu(&fpu).map_err(|e| ("KVM_SET_FPU", e))
}

/// The general registers of `state` (everything it does not name is zero).
pub fn regs(state: &CpuState) -> kvm_regs {
    let r = &state.regs;
    kvm_regs {
        rip: r.rip,
        rsp: r.rsp,
        rflags: r.rflags,
        rsi: r.rsi,
        rbx: r.rbx,
        ..Default::default()
    }
}

/// Overwrites the control registers, EFER, segments and descriptor tables of `sregs` with
/// those of `state`.
pub fn apply_sregs(sregs: &mut kvm_sregs, state: &CpuState) {
    let s = &state.sregs;
    sregs.cr0 = s.cr0;
    sregs.cr3 = s.cr3;
    sregs.cr4 = s.cr4;
    sregs.efer = s.efer;
    sregs.cs = segment(&s.cs);
    let data = segment(&s.data);
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.tr = segment(&s.tr);
    (sregs.gdt.base, sregs.gdt.limit) = table(&s.gdt);
    (sregs.idt.base, sregs.idt.limit) = table(&s.idt);
}

fn table(t: &DescriptorTable) -> (u64, u16) {
    (t.base, t.limit)
}

fn segment(s: &Segment) -> kvm_segment {
    kvm_segment {
        base: s.base,
        limit: s.limit,
        selector: s.selector,
        type_: s.type_,
        present: s.present,
        dpl: s.dpl,
        db: s.db,
        s: s.s,
        l: s.l,
        g: s.g,
        avl: s.avl,
        unusable: u8::from(s.present == 0),
        padding: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pvh_state_converts_to_kvm_registers() {
        let state = CpuState::pvh(0x100_0850, 0x6000);
        let mut sregs = kvm_sregs::default();
        apply_sregs(&mut sregs, &state);
        assert_eq!((sregs.cr0, sregs.cr4, sregs.efer), (0x11, 0, 0));
        assert_eq!((sregs.cs.selector, sregs.cs.db, sregs.cs.l), (0x08, 1, 0));
        assert_eq!(sregs.cs.limit, 0xffff_ffff);
        assert_eq!((sregs.ss.selector, sregs.ds.type_), (0x18, 3));
        assert_eq!(
            (sregs.tr.selector, sregs.tr.type_, sregs.tr.s),
            (0x20, 0xb, 0)
        );
        assert_eq!(sregs.gdt.limit, 39);
        assert_eq!(sregs.idt.limit, 0);
        let r = regs(&state);
        assert_eq!((r.rip, r.rbx, r.rflags), (0x100_0850, 0x6000, 2));
    }

    #[test]
    fn lvt_registers_round_trip() {
        let mut lapic = kvm_lapic_state::default();
        set_lapic_reg(&mut lapic, APIC_LVT0, 0x0001_0000 | MODE_EXTINT);
        assert_eq!(lapic_reg(&lapic, APIC_LVT0), 0x0001_0700);
        assert_eq!(lapic_reg(&lapic, APIC_LVT1), 0);
    }
}
