//! The VMM-owned boot area: identity-mapped page tables with 2 MiB pages, a GDT with ring-0
//! and ring-3 segments and one TSS per vCPU, an IDT for the 32 exception vectors and the
//! idle payload's timer and spurious interrupts, the guest code
//! and, per vCPU, a mailbox page and two small stacks; and the special registers that enter
//! 64-bit mode on it directly.
//!
//! The area is its own memslot in the MMIO hole (at the hole's start), so payloads may write
//! every byte of guest RAM without overwriting their own code or tables. For a guest that reads
//! a memory map it is reserved, never RAM.

use std::collections::BTreeMap;
use std::ops::Range;

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmhost_memory::GuestMemoryMmap;

/// 4 KiB.
pub const PAGE: u64 = 4096;
/// 2 MiB, the guest page size of the identity map.
pub const HUGE_PAGE: u64 = 2 << 20;
/// Bytes of code space reserved in the boot area.
pub const CODE_BYTES: u64 = 64 << 10;
/// Bytes per vCPU block: mailbox page, ring-0 stack page, two pages of ring-3 stack.
pub const VCPU_BLOCK: u64 = 4 * PAGE;
/// The most vCPUs a boot area holds (TSS selectors must stay below 64 KiB).
pub const MAX_VCPUS: usize = 4000;

/// Ring-0 64-bit code segment selector.
pub const KERNEL_CS: u16 = 0x08;
/// Ring-0 data segment selector.
pub const KERNEL_DS: u16 = 0x10;
// The ring-3 selectors and flags are the guest programs' ABI, defined with them.
pub use vmhost_guest::abi::{USER_CS, USER_DS, USER_RFLAGS};
const FIRST_TSS_SELECTOR: u16 = 0x28;
/// The 64-bit TSS proper; the I/O permission bitmap follows it.
const TSS_BYTES: usize = 104;
/// One bit per port, all clear (every port allowed from ring 3), then the 0xff terminator.
const IO_BITMAP_BYTES: usize = 65536 / 8 + 1;
/// TR limit: TSS plus bitmap, minus one.
const IO_BITMAP_OFFSET: u16 = 104;
const TSS_LIMIT: u32 = 104 + 8193 - 1;
const _: () = assert!(
    IO_BITMAP_OFFSET as usize == TSS_BYTES && TSS_LIMIT as usize == TSS_BYTES + IO_BITMAP_BYTES - 1
);
/// TSS and bitmap, rounded to pages.
const TSS_STRIDE: u64 = 3 * PAGE;
use vmhost_guest::abi::IDT_VECTORS;
#[allow(clippy::cast_possible_truncation)]
const IDT_LIMIT: u16 = (IDT_VECTORS * 16 - 1) as u16;
const _: () = assert!(IDT_LIMIT as usize == IDT_VECTORS * 16 - 1);

const PTE_PRESENT: u64 = 1;
const PTE_WRITE: u64 = 1 << 1;
const PTE_USER: u64 = 1 << 2;
const PTE_HUGE: u64 = 1 << 7;
const TABLE_FLAGS: u64 = PTE_PRESENT | PTE_WRITE | PTE_USER;

/// Why the boot area cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// More vCPUs than the GDT can hold TSS descriptors for.
    #[error("{vcpus} vCPUs: the boot area holds at most {max}")]
    TooManyVcpus {
        /// vCPUs asked for.
        vcpus: usize,
        /// The limit.
        max: usize,
    },
    /// A range to map lies beyond 4-level paging's 256 TiB.
    #[error("guest-physical address {gpa:#x} is beyond 4-level paging")]
    AddressSpace {
        /// The first address that cannot be mapped.
        gpa: u64,
    },
    /// The area does not fit in the MMIO hole.
    #[error("boot area of {size:#x} bytes at {base:#x} does not fit below {limit:#x}")]
    TooLarge {
        /// Area start.
        base: u64,
        /// Its size.
        size: u64,
        /// The end it must not cross.
        limit: u64,
    },
    /// The anonymous mapping of the area failed.
    #[error("cannot map the {size:#x}-byte boot area at GPA {base:#x}")]
    Allocate {
        /// Area start.
        base: u64,
        /// Its size.
        size: u64,
        /// The cause.
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
    /// A write into the area failed.
    #[error("cannot write the boot area at GPA {gpa:#x}")]
    Write {
        /// Where.
        gpa: u64,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// Where everything sits in the boot area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootLayout {
    /// First byte of the area (2 MiB aligned).
    pub base: u64,
    /// Size in bytes (a multiple of 2 MiB).
    pub size: u64,
    /// The page-table pages, PML4 first, as they are written from `base`.
    pub tables: Vec<[u64; 512]>,
    /// GDT address.
    pub gdt: u64,
    /// GDT limit (size - 1).
    pub gdt_limit: u16,
    /// IDT address.
    pub idt: u64,
    /// First TSS (one per vCPU, `TSS_STRIDE` apart).
    pub tss: u64,
    /// Guest code address (`CODE_BYTES` reserved).
    pub code: u64,
    /// First vCPU block.
    pub vcpu_blocks: u64,
    /// Number of vCPUs.
    pub vcpus: usize,
}

impl BootLayout {
    /// Lays out a boot area at `base` for `vcpus` vCPUs whose page tables identity-map `ranges`
    /// (and the area itself) with 2 MiB pages. `limit` is the address the area must end below.
    pub fn new(
        base: u64,
        limit: u64,
        vcpus: usize,
        ranges: &[Range<u64>],
    ) -> Result<Self, BootError> {
        if vcpus > MAX_VCPUS {
            return Err(BootError::TooManyVcpus {
                vcpus,
                max: MAX_VCPUS,
            });
        }
        let n = vcpus as u64;
        // Page tables need the area's own size; iterate once with a guess, then with the result.
        let mut size = HUGE_PAGE;
        loop {
            let mut all: Vec<Range<u64>> = ranges.to_vec();
            all.push(base..base + size);
            let tables = identity_map(base, &all)?;
            let pt_bytes = tables.len() as u64 * PAGE;
            let gdt = base + pt_bytes;
            let gdt_bytes = 8 * (5 + 2 * n);
            let idt = gdt + round_up(gdt_bytes, PAGE);
            let tss = idt + PAGE;
            let code = tss + round_up(n * TSS_STRIDE, PAGE);
            let vcpu_blocks = code + CODE_BYTES;
            let needed = round_up(vcpu_blocks + n * VCPU_BLOCK - base, HUGE_PAGE);
            if needed <= size {
                if base + size > limit {
                    return Err(BootError::TooLarge { base, size, limit });
                }
                let gdt_limit =
                    u16::try_from(gdt_bytes - 1).map_err(|_| BootError::TooManyVcpus {
                        vcpus,
                        max: MAX_VCPUS,
                    })?;
                return Ok(BootLayout {
                    base,
                    size,
                    tables,
                    gdt,
                    gdt_limit,
                    idt,
                    tss,
                    code,
                    vcpu_blocks,
                    vcpus,
                });
            }
            size = needed;
        }
    }

    /// The area as a GPA range.
    pub fn range(&self) -> Range<u64> {
        self.base..self.base + self.size
    }

    /// The PML4 address (CR3).
    pub fn pml4(&self) -> u64 {
        self.base
    }

    /// Mailbox page of vCPU `i`.
    pub fn mailbox(&self, i: usize) -> u64 {
        self.vcpu_blocks + i as u64 * VCPU_BLOCK
    }

    /// Top of vCPU `i`'s ring-0 stack (TSS RSP0 and the entry RSP).
    pub fn kernel_stack_top(&self, i: usize) -> u64 {
        self.mailbox(i) + 2 * PAGE
    }

    /// Top of vCPU `i`'s ring-3 stack.
    pub fn user_stack_top(&self, i: usize) -> u64 {
        self.mailbox(i) + VCPU_BLOCK
    }

    /// TSS of vCPU `i`.
    pub fn tss_of(&self, i: usize) -> u64 {
        self.tss + i as u64 * TSS_STRIDE
    }

    /// TSS selector of vCPU `i`.
    pub fn tss_selector(&self, i: usize) -> u16 {
        // MAX_VCPUS (4000) keeps 0x28 + 16 * i below 64 KiB.
        #[allow(clippy::cast_possible_truncation)]
        let i = i as u16;
        FIRST_TSS_SELECTOR + 16 * i
    }

    /// Allocates the area (anonymous memory) and writes tables, GDT, TSSs and an IDT whose
    /// gates point at `handlers[v]` for vector `v`.
    pub fn build(&self, handlers: &[u64; IDT_VECTORS]) -> Result<GuestMemoryMmap, BootError> {
        let size = usize::try_from(self.size).map_err(|_| BootError::TooLarge {
            base: self.base,
            size: self.size,
            limit: 0,
        })?;
        let mem =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(self.base), size)]).map_err(|source| {
                BootError::Allocate {
                    base: self.base,
                    size: self.size,
                    source,
                }
            })?;
        // Before the first write below: a few KiB of tables in a 2 MiB-aligned mapping that a
        // THP-`always` host would back with a whole huge page (docs/benchmarks.md).
        for region in mem.iter() {
            let len = usize::try_from(region.len()).unwrap_or(0);
            let _ = crate::sys::no_transparent_huge_pages(region.as_ptr(), len);
        }
        let write = |gpa: u64, bytes: &[u8]| {
            mem.write_slice(bytes, GuestAddress(gpa))
                .map_err(|source| BootError::Write { gpa, source })
        };
        for (i, table) in self.tables.iter().enumerate() {
            write(self.base + i as u64 * PAGE, &words_to_bytes(table))?;
        }
        write(self.gdt, &words_to_bytes(&self.gdt_entries()))?;
        let idt: Vec<u64> = handlers.iter().flat_map(|&h| idt_gate(h)).collect();
        write(self.idt, &words_to_bytes(&idt))?;
        for i in 0..self.vcpus {
            write(self.tss_of(i), &tss_bytes(self.kernel_stack_top(i)))?;
            write(self.tss_of(i) + u64::from(TSS_LIMIT), &[0xff])?;
        }
        Ok(mem)
    }

    fn gdt_entries(&self) -> Vec<u64> {
        let mut gdt = vec![
            0,
            0x00AF_9A00_0000_FFFF, // ring-0 code, L=1
            0x00CF_9200_0000_FFFF, // ring-0 data
            0x00AF_FA00_0000_FFFF, // ring-3 code, L=1, DPL 3
            0x00CF_F200_0000_FFFF, // ring-3 data, DPL 3
        ];
        for i in 0..self.vcpus {
            gdt.extend(tss_descriptor(self.tss_of(i)));
        }
        gdt
    }

    /// Special registers for vCPU `i`: long mode with paging, ring-0 code, the vCPU's TSS, GS
    /// based at its mailbox (the exception handlers find the mailbox through it).
    pub fn configure_sregs(&self, sregs: &mut kvm_sregs, i: usize) {
        let code = segment(KERNEL_CS, 0xb, 0, true);
        let data = segment(KERNEL_DS, 0x3, 0, false);
        let user_data = segment(USER_DS, 0x3, 3, false);
        sregs.cs = code;
        sregs.ss = data;
        sregs.ds = user_data;
        sregs.es = user_data;
        sregs.fs = user_data;
        sregs.gs = kvm_segment {
            base: self.mailbox(i),
            ..user_data
        };
        sregs.tr = kvm_segment {
            base: self.tss_of(i),
            limit: TSS_LIMIT,
            selector: self.tss_selector(i),
            type_: 0xb,
            present: 1,
            s: 0,
            ..Default::default()
        };
        sregs.ldt = kvm_segment {
            unusable: 1,
            type_: 0x2,
            present: 1,
            ..Default::default()
        };
        sregs.gdt.base = self.gdt;
        sregs.gdt.limit = self.gdt_limit;
        sregs.idt.base = self.idt;
        sregs.idt.limit = IDT_LIMIT;
        sregs.cr3 = self.pml4();
        sregs.cr4 = 0x20; // PAE
        sregs.cr0 = 0x8005_0033; // PG | AM | WP | NE | ET | MP | PE
        sregs.efer = 0x500; // LMA | LME
    }

    /// General registers for vCPU `i` entering at `rip` in ring 0: RSP on its ring-0 stack,
    /// RSI pointing at its mailbox, interrupts off.
    pub fn initial_regs(&self, i: usize, rip: u64) -> kvm_regs {
        kvm_regs {
            rip,
            rsp: self.kernel_stack_top(i),
            rsi: self.mailbox(i),
            rflags: 0x2,
            ..Default::default()
        }
    }
}

fn segment(selector: u16, type_: u8, dpl: u8, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

fn round_up(v: u64, align: u64) -> u64 {
    v.div_ceil(align) * align
}

fn words_to_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Page-table pages (PML4 first) identity-mapping every 2 MiB page that `ranges` touch, with
/// U/S set on every level so ring 3 may use them. Table pages are placed from `base` in order.
fn identity_map(base: u64, ranges: &[Range<u64>]) -> Result<Vec<[u64; 512]>, BootError> {
    const LIMIT: u64 = 1 << 48;
    let mut pages: Vec<[u64; 512]> = vec![[0; 512]];
    let mut pdpts: BTreeMap<u64, usize> = BTreeMap::new();
    let mut pds: BTreeMap<u64, usize> = BTreeMap::new();
    for r in ranges.iter().filter(|r| r.start < r.end) {
        if r.end > LIMIT {
            return Err(BootError::AddressSpace {
                gpa: r.start.max(LIMIT),
            });
        }
        let mut page = r.start / HUGE_PAGE * HUGE_PAGE;
        while page < r.end {
            let (l4, gib) = (page >> 39, page >> 30);
            let pdpt = *pdpts.entry(l4).or_insert_with(|| {
                pages.push([0; 512]);
                pages.len() - 1
            });
            let pd = *pds.entry(gib).or_insert_with(|| {
                pages.push([0; 512]);
                pages.len() - 1
            });
            let addr = |idx: usize| base + idx as u64 * PAGE;
            pages[0][(l4 & 511) as usize] = addr(pdpt) | TABLE_FLAGS;
            pages[pdpt][(gib & 511) as usize] = addr(pd) | TABLE_FLAGS;
            pages[pd][((page >> 21) & 511) as usize] = page | TABLE_FLAGS | PTE_HUGE;
            page += HUGE_PAGE;
        }
    }
    Ok(pages)
}

fn tss_descriptor(base: u64) -> [u64; 2] {
    let limit = u64::from(TSS_LIMIT);
    let low = (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | (0xb << 40) // 64-bit TSS, busy: TR is loaded with it through KVM_SET_SREGS
        | (1 << 47)
        | (((limit >> 16) & 0xf) << 48)
        | (((base >> 24) & 0xff) << 56);
    [low, base >> 32]
}

fn idt_gate(handler: u64) -> [u64; 2] {
    let low = (handler & 0xffff)
        | (u64::from(KERNEL_CS) << 16)
        | (0x8e << 40) // present, DPL 0, 64-bit interrupt gate
        | (((handler >> 16) & 0xffff) << 48);
    [low, handler >> 32]
}

fn tss_bytes(rsp0: u64) -> [u8; TSS_BYTES] {
    let mut t = [0u8; TSS_BYTES];
    t[4..12].copy_from_slice(&rsp0.to_le_bytes());
    // The I/O permission bitmap starts right after the TSS.
    t[102..104].copy_from_slice(&IO_BITMAP_OFFSET.to_le_bytes());
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0xC000_0000;
    const LIMIT: u64 = 0xFEC0_0000;

    fn walk(l: &BootLayout, va: u64) -> Option<u64> {
        let table =
            |addr: u64| &l.tables[usize::try_from(((addr & !0xfff) - l.base) / PAGE).unwrap()];
        let e4 = table(l.pml4())[((va >> 39) & 511) as usize];
        let e3 = table(e4 & !0xfff)[((va >> 30) & 511) as usize];
        if e4 & PTE_PRESENT == 0 || e3 & PTE_PRESENT == 0 {
            return None;
        }
        let e2 = table(e3 & !0xfff)[((va >> 21) & 511) as usize];
        (e2 & PTE_PRESENT != 0).then(|| {
            assert_eq!(
                e2 & (PTE_USER | PTE_HUGE | PTE_WRITE),
                PTE_USER | PTE_HUGE | PTE_WRITE
            );
            (e2 & !0x1f_ffff & !(1 << 63)) | (va & 0x1f_ffff)
        })
    }

    #[test]
    fn ram_and_area_are_identity_mapped_and_nothing_else() {
        let l = BootLayout::new(BASE, LIMIT, 2, &[0..(64 << 20), (4 << 30)..(5 << 30)]).unwrap();
        for va in [
            0,
            0x1234_5678 % (64 << 20),
            (64 << 20) - 8,
            4 << 30,
            (5 << 30) - 1,
            BASE,
            l.mailbox(1),
        ] {
            assert_eq!(walk(&l, va), Some(va), "{va:#x}");
        }
        assert_eq!(walk(&l, 64 << 20), None);
        assert_eq!(walk(&l, 1 << 30), None);
        assert_eq!(walk(&l, 5 << 30), None);
        // One PML4, one PDPT, PDs for GiB 0, 3 and 4.
        assert_eq!(l.tables.len(), 5);
    }

    /// The kernel's account of the built area's mapping: `nh` (no huge pages) in its
    /// `VmFlags` in `/proc/self/smaps`, whatever this host's THP mode.
    #[test]
    fn the_built_area_is_advised_against_transparent_huge_pages() {
        let l = BootLayout::new(BASE, LIMIT, 2, &[0..(64 << 20), 0..0]).unwrap();
        let mem = l.build(&[0u64; IDT_VECTORS]).unwrap();
        let start = mem.iter().next().unwrap().as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut lines = smaps
            .lines()
            .skip_while(|l| !l.starts_with(&format!("{start:x}-")));
        assert!(lines.next().is_some(), "no mapping at {start:#x} in smaps");
        let flags = lines
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .expect("VmFlags of the mapping");
        assert!(
            flags.split_whitespace().any(|f| f == "nh"),
            "VmFlags: {flags}"
        );
    }

    #[test]
    fn layout_is_ordered_and_sized() {
        let l = BootLayout::new(BASE, LIMIT, 16, &[0..(1 << 30), 0..0]).unwrap();
        assert!(l.gdt > l.base && l.idt > l.gdt && l.tss > l.idt && l.code > l.tss);
        assert!(l.vcpu_blocks >= l.code + CODE_BYTES);
        assert!(l.mailbox(15) + VCPU_BLOCK <= l.base + l.size);
        assert_eq!(l.size % HUGE_PAGE, 0);
        assert_eq!(l.gdt_limit as u64, 8 * (5 + 32) - 1);
        assert_eq!(l.tss_selector(1), 0x38);
        let big = BootLayout::new(BASE, LIMIT, 1000, &[0..(1 << 30), 0..0]).unwrap();
        assert!(big.mailbox(999) + VCPU_BLOCK <= big.base + big.size);
    }

    #[test]
    fn limits_are_enforced() {
        assert!(matches!(
            BootLayout::new(BASE, LIMIT, 5000, &[]),
            Err(BootError::TooManyVcpus { .. })
        ));
        assert!(matches!(
            BootLayout::new(BASE, BASE + 4096, 1, &[]),
            Err(BootError::TooLarge { .. })
        ));
        assert!(matches!(
            BootLayout::new(BASE, LIMIT, 1, &[0..(1 << 49), 0..0]),
            Err(BootError::AddressSpace { .. })
        ));
    }

    #[test]
    fn descriptors_encode_their_bases() {
        let [lo, hi] = tss_descriptor(0x1234_5678_9abc_def0);
        assert_eq!(hi, 0x1234_5678);
        assert_eq!((lo >> 16) & 0xff_ffff, 0xbc_def0);
        assert_eq!(lo >> 56, 0x9a);
        let [lo, hi] = idt_gate(0xffff_8000_c000_1234);
        assert_eq!(lo & 0xffff, 0x1234);
        assert_eq!(lo >> 48, 0xc000);
        assert_eq!(hi, 0xffff_8000);
        assert_eq!((lo >> 16) & 0xffff, u64::from(KERNEL_CS));
        let t = tss_bytes(0xC001_2000);
        assert_eq!(
            u64::from_le_bytes(t[4..12].try_into().unwrap()),
            0xC001_2000
        );
    }

    #[test]
    fn the_area_is_built_with_tables_and_gdt_in_place() {
        let l = BootLayout::new(BASE, LIMIT, 2, &[0..(2 << 20), 0..0]).unwrap();
        let mem = l.build(&[l.code; IDT_VECTORS]).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(l.pml4())).unwrap();
        assert_eq!(pml4, l.tables[0][0]);
        let user_cs: u64 = mem
            .read_obj(GuestAddress(l.gdt + u64::from(USER_CS & !3)))
            .unwrap();
        assert_eq!(user_cs, 0x00AF_FA00_0000_FFFF);
        let mut sregs = kvm_sregs::default();
        l.configure_sregs(&mut sregs, 1);
        assert_eq!(sregs.gs.base, l.mailbox(1));
        assert_eq!(sregs.tr.selector, l.tss_selector(1));
        assert_eq!(l.initial_regs(1, l.code).rsp, l.kernel_stack_top(1));
    }
}
