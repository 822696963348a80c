//! vCPU and VM state on real `/dev/kvm`: a guest counting in memory and in a register is
//! stopped, its state saved and serialized, and a fresh VM with a copy of its memory continues
//! exactly where it stopped; the compatibility check refuses what the host cannot run.

mod common;

use common::*;
use kvm_bindings::{
    kvm_irqchip, kvm_pit_config, kvm_userspace_memory_region, KVM_IRQCHIP_IOAPIC,
    KVM_MAX_CPUID_ENTRIES, KVM_MP_STATE_RUNNABLE, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmhost_config::Irqchip;
use vmhost_memory::GuestMemoryMmap;
use vmhost_vcpu::arch::{BootLayout, USER_CS, USER_RFLAGS};
use vmhost_vcpu::persist::{
    CompatError, PersistError, TargetCaps, VcpuState, VcpuStateLayout, VmState,
    MSR_IA32_TSC_DEADLINE,
};
use zerocopy::{FromBytes, IntoBytes};

const MEM: usize = 0x10000;
const CODE: u64 = 0x1000;
const COUNTER: u64 = 0x3000;
const PORT: u16 = 0x10;
/// The vCPU id (not 0, so that the LAPIC ID and MP state are not KVM's defaults).
const VCPU: u64 = 1;

/// Real mode: `inc dword [0x3000]; inc ebx; mov al, bl; out 0x10, al; jmp back`.
const LOOP: [u8; 13] = [
    0x66, 0xff, 0x06, 0x00, 0x30, 0x66, 0x43, 0x88, 0xd8, 0xe6, 0x10, 0xeb, 0xf3,
];
/// `kvm_irqchip` bytes: the IOAPIC's redirection entry 5 (chip id and pad, then 24 bytes of
/// IOAPIC header, then 8 bytes per entry).
const IOAPIC_ENTRY5: usize = 8 + 24 + 5 * 8;
/// Masked, vector 0x35.
const ENTRY5_VALUE: u64 = (1 << 16) | 0x35;
/// The source's XMM0, which only XSAVE carries over.
const XMM0: [u8; 16] = [0xa5; 16];

struct Guest {
    // The fds drop before the memory they map.
    vcpu: VcpuFd,
    vm: VmFd,
    /// Guest RAM at 0, then (long mode) the boot area: one region each, one memslot each.
    mems: Vec<GuestMemoryMmap>,
}

/// A VM with an in-kernel irqchip and PIT, `mems` as its memslots, and vCPU [`VCPU`].
fn guest(kvm: &Kvm, mems: Vec<GuestMemoryMmap>) -> Guest {
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    vm.create_irq_chip().expect("KVM_CREATE_IRQCHIP");
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).expect("KVM_CREATE_PIT2");
    for (slot, region) in (0u32..).zip(mems.iter().flat_map(|m| m.iter())) {
        let gpa = region.start_addr();
        let host = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .expect("host address");
        let slot = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: gpa.0,
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the region is a live mapping of `mems`, which `Guest` keeps until after the
        // VM fd is closed (field order); the regions do not overlap.
        unsafe { vm.set_user_memory_region(slot) }.expect("memslot");
    }
    let vcpu = vm.create_vcpu(VCPU).expect("KVM_CREATE_VCPU");
    Guest { vcpu, vm, mems }
}

/// A copy of guest memory, region by region, as a restore gets it.
fn copy_of(mems: &[GuestMemoryMmap]) -> Vec<GuestMemoryMmap> {
    mems.iter()
        .map(|m| {
            let ranges: Vec<_> = m
                .iter()
                .map(|r| (r.start_addr(), usize::try_from(r.len()).expect("size")))
                .collect();
            let copy = GuestMemoryMmap::from_ranges(&ranges).expect("memory");
            for &(start, len) in &ranges {
                let mut bytes = vec![0u8; len];
                m.read_slice(&mut bytes, start).expect("read");
                copy.write_slice(&bytes, start).expect("write");
            }
            copy
        })
        .collect()
}

/// Fresh guest RAM.
fn blank() -> Vec<GuestMemoryMmap> {
    vec![GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("memory")]
}

/// The source guest at the top of its loop, its LAPIC timer armed in TSC-deadline mode and its
/// IOAPIC and PIT programmed, so that every piece of state differs from a fresh VM's.
fn source(kvm: &Kvm) -> Guest {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("memory");
    mem.write_slice(&LOOP, GuestAddress(CODE)).expect("code");
    let g = guest(kvm, vec![mem]);
    g.vcpu.set_cpuid2(&supported(kvm)).expect("KVM_SET_CPUID2");
    let mut sregs = g.vcpu.get_sregs().expect("sregs");
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    g.vcpu.set_sregs(&sregs).expect("sregs");
    let mut regs = g.vcpu.get_regs().expect("regs");
    (regs.rip, regs.rflags, regs.rbx) = (CODE, 2, 0);
    g.vcpu.set_regs(&regs).expect("regs");
    g.vcpu
        .set_mp_state(kvm_bindings::kvm_mp_state {
            mp_state: KVM_MP_STATE_RUNNABLE,
        })
        .expect("runnable");
    let mut lapic = g.vcpu.get_lapic().expect("lapic");
    let lvtt = 0x320;
    // TSC-deadline mode (bits 17-18 = 2), masked, vector 0xec.
    let value: u32 = (2 << 17) | (1 << 16) | 0xec;
    for (i, b) in value.to_le_bytes().into_iter().enumerate() {
        lapic.regs[lvtt + i] = b as i8;
    }
    g.vcpu.set_lapic(&lapic).expect("lapic");
    let far = 1u64 << 60;
    let msrs = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: MSR_IA32_TSC_DEADLINE,
        data: far,
        ..Default::default()
    }])
    .expect("msrs");
    assert_eq!(g.vcpu.set_msrs(&msrs).expect("deadline"), 1);
    set_xmm0(kvm, &g.vcpu);
    program_vm_devices(&g.vm);
    g
}

/// Puts [`XMM0`] into the vCPU's XSAVE state (with its SSE bit in XSTATE_BV: `KVM_SET_FPU`
/// alone leaves that bit clear, and the guest would see XMM0 in its initial state).
fn set_xmm0(kvm: &Kvm, vcpu: &VcpuFd) {
    let size = kvm.check_extension_int(kvm_ioctls::Cap::Xsave2);
    let legacy = std::mem::size_of::<kvm_bindings::kvm_xsave>();
    assert!(
        usize::try_from(size).unwrap_or(0) <= legacy,
        "XSAVE2 size {size}"
    );
    let mut bytes = vcpu.get_xsave().expect("KVM_GET_XSAVE").as_bytes().to_vec();
    bytes[XMM0_AT..XMM0_AT + 16].copy_from_slice(&XMM0);
    bytes[XSTATE_BV_AT] |= 0b11;
    let xsave = kvm_bindings::kvm_xsave::read_from_bytes(&bytes).expect("xsave");
    // SAFETY: KVM copies in at most its XSAVE size, which is not above the 4 KiB of
    // `kvm_xsave` (asserted above).
    unsafe { vcpu.set_xsave(&xsave) }.expect("KVM_SET_XSAVE");
}

/// XMM0 in the legacy XSAVE region, and XSTATE_BV in its header.
const XMM0_AT: usize = 160;
const XSTATE_BV_AT: usize = 512;

fn xmm0(vcpu: &VcpuFd) -> [u8; 16] {
    let x = vcpu.get_xsave().expect("KVM_GET_XSAVE");
    let mut r = [0; 16];
    r.copy_from_slice(&x.as_bytes()[XMM0_AT..XMM0_AT + 16]);
    r
}

/// The CPUID a vCPU is given. (On this nested KVM, leaf 1's APIC ID follows the host CPU the
/// caller runs on, so two calls may differ there; no test compares them.)
fn supported(kvm: &Kvm) -> kvm_bindings::CpuId {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .expect("KVM_GET_SUPPORTED_CPUID")
}

fn program_vm_devices(vm: &VmFd) {
    let mut chip = kvm_irqchip {
        chip_id: KVM_IRQCHIP_IOAPIC,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip).expect("get ioapic");
    let mut bytes = chip.as_bytes().to_vec();
    bytes[IOAPIC_ENTRY5..IOAPIC_ENTRY5 + 8].copy_from_slice(&ENTRY5_VALUE.to_le_bytes());
    let chip = kvm_irqchip::read_from_bytes(&bytes).expect("chip");
    vm.set_irqchip(&chip).expect("set ioapic");
    let mut pit = vm.get_pit2().expect("pit");
    pit.channels[0].count = 0x1234;
    pit.channels[0].mode = 2;
    vm.set_pit2(&pit).expect("set pit");
}

/// 64-bit ring 3: `inc qword [0x3000]; inc rbx; mov al, bl; out 0x10, al; jmp back`, then a
/// `hlt` the exception handlers point at.
const LOOP64: [u8; 18] = [
    0x48, 0xff, 0x04, 0x25, 0x00, 0x30, 0x00, 0x00, 0x48, 0xff, 0xc3, 0x88, 0xd8, 0xe6, 0x10, 0xeb,
    0xef, 0xf4,
];
/// Where the boot area (page tables, GDT, IDT, TSS, code) sits: above RAM, 2 MiB aligned.
const BOOT_BASE: u64 = 4 << 20;

/// A source guest in 64-bit long mode with paging, running [`LOOP64`] in ring 3 (natively on
/// this nested KVM), laid out by the crate's own boot area.
fn long_mode_source(kvm: &Kvm) -> Guest {
    let ram = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).expect("memory");
    let ram_range = 0..MEM as u64;
    let boot = BootLayout::new(BOOT_BASE, 1 << 30, 1, std::slice::from_ref(&ram_range))
        .expect("boot layout");
    let hlt = boot.code + LOOP64.len() as u64 - 1;
    let area = boot
        .build(&[hlt; vmhost_guest::abi::IDT_VECTORS])
        .expect("boot area");
    area.write_slice(&LOOP64, GuestAddress(boot.code))
        .expect("code");
    let g = guest(kvm, vec![ram, area]);
    g.vcpu.set_cpuid2(&supported(kvm)).expect("KVM_SET_CPUID2");
    let mut sregs = g.vcpu.get_sregs().expect("sregs");
    boot.configure_sregs(&mut sregs, 0);
    sregs.cs = kvm_bindings::kvm_segment {
        selector: USER_CS,
        dpl: 3,
        ..sregs.cs
    };
    sregs.ss = sregs.ds;
    g.vcpu.set_sregs(&sregs).expect("sregs");
    let mut regs = boot.initial_regs(0, boot.code);
    regs.rflags = USER_RFLAGS;
    g.vcpu.set_regs(&regs).expect("regs");
    g.vcpu
        .set_mp_state(kvm_bindings::kvm_mp_state {
            mp_state: KVM_MP_STATE_RUNNABLE,
        })
        .expect("runnable");
    g
}

/// Runs `g` until it has written `n` values to [`PORT`]; returns them.
fn run_outs(g: &mut Guest, n: usize) -> Vec<u8> {
    let mut seen = Vec::with_capacity(n);
    while seen.len() < n {
        match g.vcpu.run().expect("KVM_RUN") {
            VcpuExit::IoOut(PORT, data) => seen.push(data[0]),
            other => panic!("unexpected exit {other:?}"),
        }
    }
    seen
}

/// Leaves `KVM_RUN` the way a pause does: with `immediate_exit`, so KVM completes the pending
/// `out` and the saved RIP is past it.
fn complete_pending_io(g: &mut Guest) {
    g.vcpu.set_kvm_immediate_exit(1);
    let err = g.vcpu.run().expect_err("immediate exit");
    assert_eq!(err.errno(), libc::EINTR);
    g.vcpu.set_kvm_immediate_exit(0);
}

/// The xAPIC ID: the top byte of the ID register at 0x20.
fn lapic_id(lapic: &kvm_bindings::kvm_lapic_state) -> u64 {
    lapic.regs[0x23].to_ne_bytes()[0].into()
}

fn counter(mem: &GuestMemoryMmap) -> u32 {
    mem.read_obj(GuestAddress(COUNTER)).expect("counter")
}

#[test]
fn a_saved_guest_continues_in_a_fresh_vm_exactly_where_it_stopped() {
    if !kvm_available("a_saved_guest_continues_in_a_fresh_vm_exactly_where_it_stopped") {
        return;
    }
    let _cpus = lock_cpus();
    let kvm = Kvm::new().expect("/dev/kvm");
    let mut src = source(&kvm);
    let layout = VcpuStateLayout::probe(&kvm, &src.vm).expect("layout");
    assert_eq!(run_outs(&mut src, 50), (1..=50).collect::<Vec<u8>>());
    complete_pending_io(&mut src);

    let vcpu_state = VcpuState::save(&src.vcpu, &layout, &supported(&kvm)).expect("save vCPU");
    let vm_state = VmState::save(&src.vm, Irqchip::Kernel).expect("save VM");
    let saved_regs = src.vcpu.get_regs().expect("regs");
    let copy = copy_of(&src.mems);
    assert_eq!(counter(&src.mems[0]), 50);
    println!(
        "saved {} of {} MSRs tried, {} bytes of XSAVE, TSC {} kHz",
        vcpu_state.msrs.len(),
        layout.msrs.len(),
        vcpu_state.xsave.len(),
        vcpu_state.tsc_khz
    );
    assert_eq!(vcpu_state.msr(MSR_IA32_TSC_DEADLINE), Some(1 << 60));

    let json = serde_json::to_string(&(&vcpu_state, &vm_state)).expect("serialize");
    println!("vCPU + VM state: {} bytes of JSON", json.len());
    let (vcpu_state, vm_state): (VcpuState, VmState) =
        serde_json::from_str(&json).expect("deserialize");
    vcpu_state
        .check_compatible(&TargetCaps::probe(&kvm).expect("probe"))
        .expect("this host runs its own state");
    // What the source does next is what the copy must do.
    let expected = run_outs(&mut src, 20);

    let mut dst = guest(&kvm, copy);
    vm_state
        .restore(&dst.vm, Irqchip::Kernel)
        .expect("restore VM");
    vcpu_state
        .restore(&dst.vcpu, &layout)
        .expect("restore vCPU");

    assert_eq!(dst.vcpu.get_regs().expect("regs"), saved_regs);
    assert_eq!(
        dst.vcpu.get_mp_state().expect("mp").mp_state,
        KVM_MP_STATE_RUNNABLE,
        "a fresh vCPU 1 waits for INIT/SIPI; the saved one was running"
    );
    assert_eq!(xmm0(&dst.vcpu), XMM0);
    let lapic = dst.vcpu.get_lapic().expect("lapic");
    assert_eq!(lapic_id(&lapic), VCPU);
    let again = VcpuState::save(&dst.vcpu, &layout, &supported(&kvm)).expect("save the copy");
    assert_eq!(again.msr(MSR_IA32_TSC_DEADLINE), Some(1 << 60));
    for (what, a, b) in [
        ("sregs", &again.sregs, &vcpu_state.sregs),
        ("xsave", &again.xsave, &vcpu_state.xsave),
        ("xcrs", &again.xcrs, &vcpu_state.xcrs),
        ("debug", &again.debug_regs, &vcpu_state.debug_regs),
        ("events", &again.events, &vcpu_state.events),
    ] {
        assert!(a == b, "{what} differs after restore");
    }

    assert_eq!(run_outs(&mut dst, 20), expected);
    assert_eq!(counter(&dst.mems[0]), 70, "the counter went on from 50");
}

#[test]
fn a_ring3_long_mode_guest_continues_in_a_fresh_vm() {
    if !kvm_available("a_ring3_long_mode_guest_continues_in_a_fresh_vm") {
        return;
    }
    let _cpus = lock_cpus();
    let kvm = Kvm::new().expect("/dev/kvm");
    let mut src = long_mode_source(&kvm);
    let layout = VcpuStateLayout::probe(&kvm, &src.vm).expect("layout");
    let first: Vec<u8> = (1..=1000u32).map(|i| i.to_le_bytes()[0]).collect();
    assert_eq!(run_outs(&mut src, 1000), first);
    complete_pending_io(&mut src);
    let sregs = src.vcpu.get_sregs().expect("sregs");
    assert_eq!(
        (sregs.cs.dpl, sregs.efer & 0x500),
        (3, 0x500),
        "ring 3, long mode"
    );
    let state = VcpuState::save(&src.vcpu, &layout, &supported(&kvm)).expect("save vCPU");
    let vm_state = VmState::save(&src.vm, Irqchip::Kernel).expect("save VM");
    let saved_regs = src.vcpu.get_regs().expect("regs");
    let copy = copy_of(&src.mems);
    let expected = run_outs(&mut src, 300);

    let json = serde_json::to_vec(&state).expect("serialize");
    let state: VcpuState = serde_json::from_slice(&json).expect("deserialize");
    let mut dst = guest(&kvm, copy);
    vm_state
        .restore(&dst.vm, Irqchip::Kernel)
        .expect("restore VM");
    state.restore(&dst.vcpu, &layout).expect("restore vCPU");
    assert_eq!(dst.vcpu.get_regs().expect("regs"), saved_regs);
    assert_eq!(dst.vcpu.get_sregs().expect("sregs"), sregs);
    assert_eq!(run_outs(&mut dst, 300), expected);
    assert_eq!(counter(&dst.mems[0]), 1300, "the counter went on from 1000");
    assert_eq!(dst.vcpu.get_regs().expect("regs").rbx, 1300);
}

#[test]
fn vm_state_round_trips_and_the_clock_neither_jumps_back_nor_forward() {
    if !kvm_available("vm_state_round_trips_and_the_clock_neither_jumps_back_nor_forward") {
        return;
    }
    let _cpus = lock_cpus();
    let kvm = Kvm::new().expect("/dev/kvm");
    let src = source(&kvm);
    let saved = VmState::save(&src.vm, Irqchip::Kernel).expect("save");
    let dst = guest(&kvm, blank());
    let fresh = VmState::save(&dst.vm, Irqchip::Kernel).expect("fresh");
    assert_ne!(
        fresh.ioapic, saved.ioapic,
        "the source's IOAPIC was programmed"
    );

    println!(
        "kvmclock {} ns, flags {:#x} (TSC_STABLE {:#x}, REALTIME {:#x})",
        saved.clock_ns,
        saved.clock_flags,
        kvm_bindings::KVM_CLOCK_TSC_STABLE,
        kvm_bindings::KVM_CLOCK_REALTIME
    );
    let before_set = std::time::Instant::now();
    saved.restore(&dst.vm, Irqchip::Kernel).expect("restore");
    let got = VmState::save(&dst.vm, Irqchip::Kernel).expect("save again");
    let bound = u64::try_from(before_set.elapsed().as_nanos()).expect("ns");

    assert_eq!(got.pic_master, saved.pic_master);
    assert_eq!(got.pic_slave, saved.pic_slave);
    assert_eq!(got.ioapic, saved.ioapic);
    assert_eq!(
        got.ioapic[IOAPIC_ENTRY5..IOAPIC_ENTRY5 + 8],
        ENTRY5_VALUE.to_le_bytes()
    );
    let pit = |s: &VmState| {
        let mut p = kvm_bindings::kvm_pit_state2::read_from_bytes(&s.pit).expect("pit");
        // KVM stamps the load time with its own clock on every set.
        p.channels.iter_mut().for_each(|c| c.count_load_time = 0);
        p
    };
    assert_eq!(pit(&got), pit(&saved));
    assert_eq!(
        (pit(&got).channels[0].count, pit(&got).channels[0].mode),
        (0x1234, 2)
    );
    assert!(got.clock_ns >= saved.clock_ns, "kvmclock went backwards");
    assert!(
        got.clock_ns - saved.clock_ns <= bound,
        "kvmclock advanced by {} ns, more than the {bound} ns since it was set: it jumped by \
         the pause",
        got.clock_ns - saved.clock_ns
    );
}

#[test]
fn a_state_from_another_tsc_rate_or_cpu_is_refused_before_a_vm_exists() {
    if !kvm_available("a_state_from_another_tsc_rate_or_cpu_is_refused_before_a_vm_exists") {
        return;
    }
    let _cpus = lock_cpus();
    let kvm = Kvm::new().expect("/dev/kvm");
    let src = source(&kvm);
    let layout = VcpuStateLayout::probe(&kvm, &src.vm).expect("layout");
    let state = VcpuState::save(&src.vcpu, &layout, &supported(&kvm)).expect("save");
    let target = TargetCaps::probe(&kvm).expect("probe");
    state
        .check_compatible(&target)
        .expect("compatible with itself");

    // 100 MHz faster: scaled where KVM can, refused where it cannot (far beyond its
    // tolerance), naming both rates.
    let mut faster = state.clone();
    faster.tsc_khz += 100_000;
    println!(
        "this host: {} kHz, TSC scaling {}, tolerance {} ppm",
        target.tsc_khz, target.tsc_scaling, target.tsc_tolerance_ppm
    );
    if target.tsc_scaling {
        faster.check_compatible(&target).expect("KVM scales it");
    } else {
        let err = faster.check_compatible(&target).unwrap_err();
        assert!(
            matches!(err, CompatError::TscKhz { saved_khz, target_khz, ppm, .. }
                if saved_khz == target.tsc_khz + 100_000 && target_khz == target.tsc_khz
                    && ppm > 250),
            "{err}"
        );
        assert!(err.to_string().contains("KVM_CAP_TSC_CONTROL"), "{err}");
    }
    // Within KVM's tolerance: taken either way.
    let mut near = state.clone();
    near.tsc_khz += target.tsc_khz / 10_000; // 100 ppm
    near.check_compatible(&target).expect("100 ppm apart");

    // A leaf 7 EBX feature this KVM does not offer.
    let supported = target
        .supported
        .iter()
        .find(|e| e.function == 7 && e.index == 0)
        .map_or(0, |e| e.regs[1]);
    let bit = (0..32).map(|b| 1u32 << b).find(|b| supported & b == 0);
    let bit = bit.expect("some leaf 7 EBX bit is unsupported");
    let mut alien = state.clone();
    let leaf7 = alien
        .cpuid
        .iter_mut()
        .find(|e| e.function == 7 && e.index == 0)
        .expect("leaf 7 saved");
    leaf7.regs[1] |= bit;
    let err = alien.check_compatible(&target).unwrap_err();
    assert!(
        matches!(err, CompatError::CpuidFeature { leaf: 7, subleaf: 0, reg: "ebx", missing }
            if missing == bit),
        "{err}"
    );
    println!("{err}");
}

/// `IA32_ARCH_CAPABILITIES`: listed by `KVM_GET_MSR_INDEX_LIST`, but on these hosts KVM takes
/// only the value the vCPU already has (host facts).
const MSR_ARCH_CAPABILITIES: u32 = 0x10a;

#[test]
fn an_unreadable_msr_is_left_out_and_a_refused_one_must_already_match() {
    if !kvm_available("an_unreadable_msr_is_left_out_and_a_refused_one_must_already_match") {
        return;
    }
    let _cpus = lock_cpus();
    let kvm = Kvm::new().expect("/dev/kvm");
    let src = source(&kvm);
    let mut layout = VcpuStateLayout::probe(&kvm, &src.vm).expect("layout");
    assert!(
        layout.msrs.contains(&MSR_ARCH_CAPABILITIES),
        "{:x?}",
        layout.msrs
    );
    // An MSR no x86 CPU has, in the middle of the list: KVM_GET_MSRS stops there.
    let bogus = 0x0000_2fff;
    let at = layout.msrs.partition_point(|&m| m < bogus);
    layout.msrs.insert(at, bogus);
    let state = VcpuState::save(&src.vcpu, &layout, &supported(&kvm)).expect("save");
    assert_eq!(state.msr(bogus), None);
    assert_eq!(state.msrs.len(), layout.msrs.len() - 1, "all others saved");
    let after = layout.msrs[at + 1];
    assert!(state.msr(after).is_some(), "{after:#x} after the bogus one");

    // Restoring the state as it is works (its ARCH_CAPABILITIES is the target's).
    let fresh = || guest(&kvm, blank());
    let dst = fresh();
    state.restore(&dst.vcpu, &layout).expect("restore");
    // One from a host whose ARCH_CAPABILITIES differs: the guest may not see it change.
    let theirs = state.msr(MSR_ARCH_CAPABILITIES).expect("saved") ^ 1;
    let mut foreign = state.clone();
    for m in foreign
        .msrs
        .iter_mut()
        .filter(|m| m.index == MSR_ARCH_CAPABILITIES)
    {
        m.data = theirs;
    }
    let dst = fresh();
    match foreign.restore(&dst.vcpu, &layout) {
        Err(PersistError::MsrRefused {
            index,
            saved,
            target,
        }) => {
            assert_eq!((index, saved), (MSR_ARCH_CAPABILITIES, theirs));
            assert_eq!(target, Some(theirs ^ 1), "the target's own value");
            let err = foreign.restore(&fresh().vcpu, &layout).unwrap_err();
            println!("refused as expected: {err}");
            assert!(err.to_string().contains("MSR 0x10a"), "{err}");
        }
        Ok(()) => {
            // A KVM that takes the value must then hold it.
            let again = VcpuState::save(&dst.vcpu, &layout, &supported(&kvm)).expect("save");
            assert_eq!(again.msr(MSR_ARCH_CAPABILITIES), Some(theirs));
            println!("this KVM set ARCH_CAPABILITIES to {theirs:#x}");
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn xsave_past_the_legacy_region_round_trips_and_a_torn_one_is_refused() {
    if !kvm_available("xsave_past_the_legacy_region_round_trips_and_a_torn_one_is_refused") {
        return;
    }
    let _cpus = lock_cpus();
    let kvm = Kvm::new().expect("/dev/kvm");
    let src = source(&kvm);
    let mut layout = VcpuStateLayout::probe(&kvm, &src.vm).expect("layout");
    println!("KVM_CAP_XSAVE2: {} bytes", layout.xsave_bytes);
    assert_eq!(xmm0(&src.vcpu), XMM0);
    // The XSAVE2 path with a buffer larger than this KVM needs: it fills what it has.
    let legacy = std::mem::size_of::<kvm_bindings::kvm_xsave>();
    layout.xsave_bytes = layout.xsave_bytes.max(legacy) + 256;
    let state = VcpuState::save(&src.vcpu, &layout, &supported(&kvm)).expect("save");
    assert_eq!(state.xsave.len(), layout.xsave_bytes);
    let fresh = || guest(&kvm, blank());
    let dst = fresh();
    state.restore(&dst.vcpu, &layout).expect("restore");
    let back = dst.vcpu.get_xsave().expect("KVM_GET_XSAVE");
    assert!(back.as_bytes() == &state.xsave[..legacy], "XSAVE differs");

    let mut torn = state.clone();
    torn.xsave.truncate(legacy - 1);
    let err = torn.restore(&fresh().vcpu, &layout).unwrap_err();
    assert!(
        matches!(err, PersistError::Size { piece: "XSAVE", found, .. } if found == legacy - 1),
        "{err}"
    );
    // A state from a VM with less XSAVE room than the target's is padded with zeros: the
    // components it had no room for start in their initial state.
    let mut short = state.clone();
    short.xsave.truncate(legacy);
    layout.xsave_bytes += 64;
    let dst = fresh();
    short.restore(&dst.vcpu, &layout).expect("padded restore");
    let back = dst.vcpu.get_xsave().expect("KVM_GET_XSAVE");
    assert!(back.as_bytes() == &state.xsave[..legacy], "XSAVE differs");
}

/// With a split irqchip the VM state is kvmclock alone (the I/O APIC is a device's): it
/// restores into a split VM, and a state of the other irqchip is refused either way.
#[test]
fn a_split_irqchip_vm_state_is_the_clock_and_refuses_the_other_irqchip() {
    if !kvm_available("a_split_irqchip_vm_state_is_the_clock_and_refuses_the_other_irqchip") {
        return;
    }
    let kvm = Kvm::new().expect("/dev/kvm");
    let split = || {
        let vm = kvm.create_vm().expect("VM");
        let mut cap = kvm_bindings::kvm_enable_cap {
            cap: kvm_bindings::KVM_CAP_SPLIT_IRQCHIP,
            ..Default::default()
        };
        cap.args[0] = 24;
        vm.enable_cap(&cap).expect("split irqchip");
        vm
    };
    let (a, b) = (split(), split());
    let saved = VmState::save(&a, Irqchip::Split).expect("save");
    assert!(saved.pic_master.is_empty() && saved.ioapic.is_empty() && saved.pit.is_empty());
    saved.restore(&b, Irqchip::Split).expect("restore");
    let got = VmState::save(&b, Irqchip::Split).expect("save again");
    assert!(
        got.clock_ns >= saved.clock_ns,
        "the clock goes on from the saved value"
    );
    let err = saved.restore(&b, Irqchip::Kernel).unwrap_err();
    assert!(err.to_string().contains("boot.irqchip"), "{err}");
    let kernel = kvm.create_vm().expect("VM");
    kernel.create_irq_chip().expect("irqchip");
    kernel
        .create_pit2(kvm_bindings::kvm_pit_config::default())
        .expect("PIT");
    let full = VmState::save(&kernel, Irqchip::Kernel).expect("save");
    assert!(full.restore(&b, Irqchip::Split).is_err());
}
