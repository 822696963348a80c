//! The boot vCPU's initial state for each Linux entry, as plain data.
//!
//! This module owns the boot GDT, the empty IDT and the identity page tables below 1 MiB (see
//! [`crate::addrs`]), and computes the register and segment values the vCPU code loads with
//! `KVM_SET_REGS` / `KVM_SET_SREGS` on the boot vCPU (vCPU 0). No KVM types are used here; the
//! field names follow `kvm_regs`, `kvm_sregs` and `kvm_segment`.
//!
//! - **PVH** ([`CpuState::pvh`]): 32-bit protected mode, paging off (`cr0` = PE|ET), `cr4` = 0,
//!   `efer` = 0; flat 32-bit code in CS (selector 0x08), flat data in DS/ES/FS/GS/SS (0x18), a
//!   busy 32-bit TSS in TR (0x20); `ebx` = the `hvm_start_info` address; `eip` = the ELF note's
//!   entry; `eflags` = 0x2 (interrupts off).
//! - **Linux 64-bit boot protocol** ([`CpuState::linux64`]): long mode with paging
//!   (`cr0` = PE|MP|ET|NE|WP|AM|PG, `cr4` = PAE, `efer` = LME|LMA), `cr3` = [`PML4_ADDR`] whose
//!   tables identity-map the low 4 GiB with 2 MiB pages; 64-bit code in CS (`__BOOT_CS` =
//!   0x10), flat data in DS/ES/FS/GS/SS (`__BOOT_DS` = 0x18), TSS in TR; `rsi` = the zero page;
//!   `rip` = the 64-bit entry; `rsp` = [`BOOT_STACK_TOP`]; `rflags` = 0x2.
//!
//! In both modes the GDT register points at [`BOOT_GDT_ADDR`] and the IDT register at an empty
//! IDT. Application processors are not set up here: Linux starts them itself with INIT/SIPI, so
//! they stay in KVM's initial "wait for SIPI" state.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError};

use crate::acpi::{RESET_PORT, RESET_VALUE};
use crate::addrs::{
    BOOT_GDT_ADDR, BOOT_IDT_ADDR, BOOT_STACK_TOP, PDPT_ADDR, PD_ADDR, PML4_ADDR, RESET_VECTOR,
};

/// Selector of the flat 32-bit code segment (PVH entry).
pub const CODE32_SELECTOR: u16 = 0x08;
/// Selector of the 64-bit code segment (`__BOOT_CS`).
pub const CODE64_SELECTOR: u16 = 0x10;
/// Selector of the flat data segment (`__BOOT_DS`).
pub const DATA_SELECTOR: u16 = 0x18;
/// Selector of the TSS.
pub const TSS_SELECTOR: u16 = 0x20;

/// The boot GDT: null, code32, code64, data, TSS (descriptors in the hardware format).
pub const BOOT_GDT: [u64; 5] = [
    0,
    gdt_entry(0xc09b, 0, 0xfffff), // flat 32-bit code, execute/read, accessed
    gdt_entry(0xa09b, 0, 0xfffff), // 64-bit code (L=1), execute/read, accessed
    gdt_entry(0xc093, 0, 0xfffff), // flat data, read/write, accessed
    gdt_entry(0x008b, 0, 0x67),    // busy 32-bit TSS
];

/// GDTR limit of [`BOOT_GDT`].
const GDT_LIMIT: u16 = 5 * 8 - 1;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_AM: u64 = 1 << 18;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// RFLAGS with only the always-one bit set (interrupts disabled).
const RFLAGS_RESERVED: u64 = 0x2;
/// Page-table entry bits: present, writable.
const PTE_P_RW: u64 = 0x3;
/// Page-directory entry bit: 2 MiB page.
const PDE_PS: u64 = 0x80;
/// Page directories mapped (1 GiB each).
const PD_COUNT: u64 = 4;

/// Why the boot GDT or page tables cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum CpuSetupError {
    /// Writing the GDT or IDT failed.
    #[error("cannot write the boot GDT/IDT at {addr:#x}")]
    WriteGdt {
        /// Guest-physical address.
        addr: u64,
        /// The cause.
        #[source]
        source: GuestMemoryError,
    },
    /// Writing the reset vector's stub failed.
    #[error("cannot write the reset vector's stub at {addr:#x}")]
    WriteResetStub {
        /// Guest-physical address.
        addr: u64,
        /// The cause.
        #[source]
        source: GuestMemoryError,
    },
    /// Writing a page table failed.
    #[error("cannot write the boot page table at {addr:#x}")]
    WritePageTable {
        /// Guest-physical address.
        addr: u64,
        /// The cause.
        #[source]
        source: GuestMemoryError,
    },
}

/// A segment register, as `kvm_segment` holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Segment {
    /// Base address.
    pub base: u64,
    /// Limit in bytes (already scaled by granularity).
    pub limit: u32,
    /// Selector.
    pub selector: u16,
    /// Descriptor type (4 bits).
    pub type_: u8,
    /// Present.
    pub present: u8,
    /// Privilege level.
    pub dpl: u8,
    /// Default operation size (1 = 32-bit).
    pub db: u8,
    /// Code/data (1) or system (0) descriptor.
    pub s: u8,
    /// 64-bit code segment.
    pub l: u8,
    /// Granularity (1 = 4 KiB units).
    pub g: u8,
    /// Available for software.
    pub avl: u8,
}

impl Segment {
    /// The segment a selector loads from `BOOT_GDT`.
    // Every value is masked to its field's width before the cast.
    #[allow(clippy::cast_possible_truncation)]
    pub fn from_gdt(selector: u16) -> Self {
        let e = BOOT_GDT[usize::from(selector >> 3)];
        let bits = |shift: u32, mask: u64| ((e >> shift) & mask) as u8;
        let raw_limit = ((e & 0xffff) | ((e >> 32) & 0xf_0000)) as u32;
        let g = bits(55, 1);
        Segment {
            base: ((e >> 16) & 0xff_ffff) | ((e >> 32) & 0xff00_0000),
            limit: if g == 1 {
                (raw_limit << 12) | 0xfff
            } else {
                raw_limit
            },
            selector,
            type_: bits(40, 0xf),
            s: bits(44, 1),
            dpl: bits(45, 3),
            present: bits(47, 1),
            avl: bits(52, 1),
            l: bits(53, 1),
            db: bits(54, 1),
            g,
        }
    }
}

/// A descriptor-table register (GDTR / IDTR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorTable {
    /// Guest-physical (= linear) base.
    pub base: u64,
    /// Limit (size - 1).
    pub limit: u16,
}

/// General-purpose registers of the boot vCPU (everything else is zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GeneralRegs {
    /// Instruction pointer: the kernel entry.
    pub rip: u64,
    /// Stack pointer.
    pub rsp: u64,
    /// Flags.
    pub rflags: u64,
    /// Zero page address (64-bit entry), else 0.
    pub rsi: u64,
    /// `hvm_start_info` address (PVH entry), else 0.
    pub rbx: u64,
}

/// Control registers, EFER, segments and descriptor tables of the boot vCPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SystemRegs {
    /// CR0.
    pub cr0: u64,
    /// CR3 (page-table root; 0 with paging off).
    pub cr3: u64,
    /// CR4.
    pub cr4: u64,
    /// IA32_EFER.
    pub efer: u64,
    /// CS.
    pub cs: Segment,
    /// DS, ES, FS, GS and SS.
    pub data: Segment,
    /// TR.
    pub tr: Segment,
    /// GDTR.
    pub gdt: DescriptorTable,
    /// IDTR.
    pub idt: DescriptorTable,
}

/// Everything the vCPU code sets on the boot vCPU before its first `KVM_RUN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuState {
    /// General-purpose registers.
    pub regs: GeneralRegs,
    /// System registers.
    pub sregs: SystemRegs,
}

impl CpuState {
    /// State at a PVH entry: 32-bit protected mode, paging off, `ebx` = `start_info`.
    pub fn pvh(entry: u64, start_info: u64) -> Self {
        CpuState {
            regs: GeneralRegs {
                rip: entry,
                rsp: BOOT_STACK_TOP,
                rflags: RFLAGS_RESERVED,
                rsi: 0,
                rbx: start_info,
            },
            sregs: SystemRegs {
                cr0: CR0_PE | CR0_ET,
                cr3: 0,
                cr4: 0,
                efer: 0,
                cs: Segment::from_gdt(CODE32_SELECTOR),
                data: Segment::from_gdt(DATA_SELECTOR),
                tr: Segment::from_gdt(TSS_SELECTOR),
                gdt: gdtr(),
                idt: idtr(),
            },
        }
    }

    /// State at the Linux 64-bit boot protocol entry: long mode, identity paging, `rsi` = zero
    /// page.
    pub fn linux64(entry: u64, zero_page: u64) -> Self {
        CpuState {
            regs: GeneralRegs {
                rip: entry,
                rsp: BOOT_STACK_TOP,
                rflags: RFLAGS_RESERVED,
                rsi: zero_page,
                rbx: 0,
            },
            sregs: SystemRegs {
                cr0: CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_AM | CR0_PG,
                cr3: PML4_ADDR,
                cr4: CR4_PAE,
                efer: EFER_LME | EFER_LMA,
                cs: Segment::from_gdt(CODE64_SELECTOR),
                data: Segment::from_gdt(DATA_SELECTOR),
                tr: Segment::from_gdt(TSS_SELECTOR),
                gdt: gdtr(),
                idt: idtr(),
            },
        }
    }
}

fn gdtr() -> DescriptorTable {
    DescriptorTable {
        base: BOOT_GDT_ADDR,
        limit: GDT_LIMIT,
    }
}

fn idtr() -> DescriptorTable {
    DescriptorTable {
        base: BOOT_IDT_ADDR,
        limit: 0,
    }
}

/// Real-mode code at the reset vector, in place of a BIOS: write [`RESET_VALUE`] to the FADT's
/// reset register, then halt. Linux reboots through the BIOS (`reboot=b`, jumping to F000:FFF0
/// in real mode) by default on a hardware-reduced ACPI platform without EFI (its reboot type
/// becomes EFI, then BIOS once EFI is found missing); without this stub it would run whatever
/// the BIOS area holds, forever.
///
/// `mov al, RESET_VALUE; mov dx, RESET_PORT; out dx, al; cli; 1: hlt; jmp 1b; nop`
pub const RESET_STUB: [u8; 11] = {
    let port = RESET_PORT.to_le_bytes();
    [
        0xb0,
        RESET_VALUE,
        0xba,
        port[0],
        port[1],
        0xee,
        0xfa,
        0xf4,
        0xeb,
        0xfd,
        0x90,
    ]
};

/// Writes the boot GDT, the empty IDT, the identity page tables (low 4 GiB, 2 MiB pages) and
/// the reset vector's stub ([`RESET_STUB`]).
pub fn write_boot_tables<M: GuestMemoryBackend>(mem: &M) -> Result<(), CpuSetupError> {
    let gdt_err = |addr: u64| move |source| CpuSetupError::WriteGdt { addr, source };
    for (i, e) in BOOT_GDT.iter().enumerate() {
        let addr = BOOT_GDT_ADDR + 8 * i as u64;
        mem.write_obj(*e, GuestAddress(addr))
            .map_err(gdt_err(addr))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_ADDR))
        .map_err(gdt_err(BOOT_IDT_ADDR))?;

    let pt_err = |addr: u64| move |source| CpuSetupError::WritePageTable { addr, source };
    mem.write_obj(PDPT_ADDR | PTE_P_RW, GuestAddress(PML4_ADDR))
        .map_err(pt_err(PML4_ADDR))?;
    for d in 0..PD_COUNT {
        let pd = PD_ADDR + d * 0x1000;
        let at = PDPT_ADDR + d * 8;
        mem.write_obj(pd | PTE_P_RW, GuestAddress(at))
            .map_err(pt_err(at))?;
        let entries: Vec<u8> = (0..512u64)
            .flat_map(|i| (((d * 512 + i) << 21) | PDE_PS | PTE_P_RW).to_le_bytes())
            .collect();
        mem.write_slice(&entries, GuestAddress(pd))
            .map_err(pt_err(pd))?;
    }
    mem.write_slice(&RESET_STUB, GuestAddress(RESET_VECTOR))
        .map_err(|source| CpuSetupError::WriteResetStub {
            addr: RESET_VECTOR,
            source,
        })?;
    Ok(())
}

/// A GDT descriptor from access/flags bits (`0xF0FF` mask: flags in 15:12, access in 7:0),
/// base and limit (20 bits).
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let base = base as u64;
    let limit = limit as u64;
    let flags = flags as u64;
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0x0000_ffff)
        | ((limit & 0x000f_0000) << 32)
        | ((flags & 0x0000_f0ff) << 40)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_memory::GuestMemoryMmap;

    #[test]
    fn gdt_segments_decode_to_flat_segments() {
        let cs32 = Segment::from_gdt(CODE32_SELECTOR);
        assert_eq!((cs32.base, cs32.limit, cs32.type_), (0, 0xffff_ffff, 0xb));
        assert_eq!(
            (cs32.db, cs32.l, cs32.s, cs32.present, cs32.g),
            (1, 0, 1, 1, 1)
        );
        let cs64 = Segment::from_gdt(CODE64_SELECTOR);
        assert_eq!((cs64.db, cs64.l, cs64.type_), (0, 1, 0xb));
        let ds = Segment::from_gdt(DATA_SELECTOR);
        assert_eq!(
            (ds.type_, ds.db, ds.limit, ds.selector),
            (0x3, 1, 0xffff_ffff, 0x18)
        );
        let tr = Segment::from_gdt(TSS_SELECTOR);
        assert_eq!((tr.type_, tr.s, tr.limit, tr.g), (0xb, 0, 0x67, 0));
    }

    #[test]
    fn entry_states_follow_the_protocols() {
        let p = CpuState::pvh(0x100_0850, 0x6000);
        assert_eq!(
            (p.regs.rip, p.regs.rbx, p.regs.rflags),
            (0x100_0850, 0x6000, 2)
        );
        assert_eq!((p.sregs.cr0 & CR0_PG, p.sregs.efer, p.sregs.cr4), (0, 0, 0));
        assert_eq!(p.sregs.cs.selector, CODE32_SELECTOR);
        let l = CpuState::linux64(0x100_0200, 0x7000);
        assert_eq!((l.regs.rsi, l.regs.rbx), (0x7000, 0));
        assert_eq!(l.sregs.cr0, 0x8005_0033);
        assert_eq!(
            (l.sregs.cr3, l.sregs.cr4, l.sregs.efer),
            (PML4_ADDR, 0x20, 0x500)
        );
        assert_eq!(l.sregs.cs.selector, 0x10);
        assert_eq!(l.sregs.data.selector, 0x18);
        assert_eq!(l.sregs.gdt.limit, 39);
    }

    #[test]
    fn page_tables_identity_map_the_low_4gib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_boot_tables(&mem).unwrap();
        let mut stub = [0u8; RESET_STUB.len()];
        mem.read_slice(&mut stub, GuestAddress(RESET_VECTOR))
            .unwrap();
        assert_eq!(stub, RESET_STUB, "the reset vector's stub");
        // mov al, 1; mov dx, 0x602; out dx, al.
        assert_eq!(&stub[..6], &[0xb0, 0x01, 0xba, 0x02, 0x06, 0xee]);
        let read = |a: u64| mem.read_obj::<u64>(GuestAddress(a)).unwrap();
        assert_eq!(read(PML4_ADDR), PDPT_ADDR | 3);
        assert_eq!(read(PDPT_ADDR + 3 * 8), (PD_ADDR + 0x3000) | 3);
        // Walk 0xC020_0000 (PDPT 3, PD index 1).
        let pd = read(PDPT_ADDR + 3 * 8) & !0xfff;
        assert_eq!(read(pd + 8), 0xc020_0000 | 0x83);
        assert_eq!(read(BOOT_GDT_ADDR + 0x10), BOOT_GDT[2]);
        assert_eq!(BOOT_GDT[2], 0x00af_9b00_0000_ffff);
    }

    #[test]
    fn writing_without_low_memory_fails_with_the_address() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 1 << 20)]).unwrap();
        let err = write_boot_tables(&mem).unwrap_err();
        assert!(
            matches!(err, CpuSetupError::WriteGdt { addr: 0x500, .. }),
            "{err:?}"
        );
    }
}
