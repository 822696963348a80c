//! Building a VM before it runs: what every guest needs (the KVM VM with its irqchip and PIT,
//! memslots, per-vCPU CPUID) and what a built-in payload needs on top (boot area, code,
//! mailboxes). Linux guests are prepared in [`crate::linux`].

use std::ops::Range;
use std::sync::Arc;

use kvm_bindings::{
    kvm_enable_cap, kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_CAP_SPLIT_IRQCHIP,
    KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmhost_config::Irqchip;
use vmhost_devices::ioapic::IOAPIC_PINS;
use vmhost_memory::GuestLayout;
use vmhost_memory::GuestMemoryMmap;
use vmhost_plan::{Plan, VcpuPlacement};

use crate::arch::boot::CODE_BYTES;
use crate::arch::cpuid::{self, CpuidInputs};
use crate::arch::{mask_for_nested_emulation, BootError, BootLayout};
use crate::payload::bench;
use crate::payload::{self, program, MailboxInputs, PayloadError, PayloadKind};
use crate::vcpu::{VcpuConfig, VcpuStart};
use crate::vm::{kvm_err, Guest, GuestRam, Prepared, VmError, VmOptions};
use vmhost_guest::{EntryPoints, CODE_ALIGN};

/// Where KVM's real-mode TSS goes on Intel (three pages, inside the MMIO hole).
const TSS_ADDR: usize = 0xfffb_d000;
/// Seed of the benchmark's chain shuffle (fixed: runs are comparable).
const BENCH_SEED: u64 = 0x766d_686f_7374;
/// The boot area must end below the IOAPIC.
const BOOT_LIMIT: u64 = 0xfec0_0000;

/// Opens KVM and creates the VM (without its interrupt controller: [`create_irqchip`] comes
/// after the memslots).
pub(crate) fn open_vm(plan: &Plan) -> Result<(Kvm, VmFd), VmError> {
    let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
    if !kvm.check_extension(Cap::ImmediateExit) {
        return Err(VmError::MissingCap {
            cap: "KVM_CAP_IMMEDIATE_EXIT",
        });
    }
    let max = kvm.get_max_vcpu_id();
    if let Some(v) = plan
        .vcpus
        .iter()
        .find(|v| usize::try_from(v.apic_id).map_or(true, |id| id >= max))
    {
        return Err(VmError::VcpuId {
            vcpu: v.vcpu,
            apic_id: v.apic_id,
            max,
        });
    }
    let fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
    if kvm.check_extension(Cap::SetTssAddr) {
        fd.set_tss_address(TSS_ADDR)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
    }
    Ok((kvm, fd))
}

/// The interrupt controllers, before any vCPU. `Kernel`: KVM's in-kernel irqchip (PIC,
/// IOAPIC, LAPICs) and PIT. `Split`: only the LAPICs are KVM's (`KVM_CAP_SPLIT_IRQCHIP` with
/// the I/O APIC's 24 pins as routable GSIs; the I/O APIC is vmhost's, and there is no PIC and
/// no PIT). Created after the memslots, as Firecracker does: registering 64 MiB with the
/// in-kernel irqchip already there took 4.2 ms in vmhost (6.75 ms in a bare-ioctl probe),
/// 0.16 ms before it (docs/benchmarks.md, "Start -> exit on the CI host").
pub(crate) fn create_irqchip(fd: &VmFd, irqchip: Irqchip) -> Result<(), VmError> {
    if irqchip == Irqchip::Split {
        let mut cap = kvm_enable_cap {
            cap: KVM_CAP_SPLIT_IRQCHIP,
            ..Default::default()
        };
        cap.args[0] = IOAPIC_PINS as u64;
        return fd
            .enable_cap(&cap)
            .map_err(kvm_err("KVM_ENABLE_CAP(KVM_CAP_SPLIT_IRQCHIP)"));
    }
    fd.create_irq_chip()
        .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    fd.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;
    Ok(())
}

/// One memslot per RAM region, then one per region of `extra` (the payload boot area).
pub(crate) fn register_memslots(
    fd: &VmFd,
    ram: &GuestMemoryMmap,
    extra: Option<&GuestMemoryMmap>,
) -> Result<(), VmError> {
    let extra = extra.into_iter().flat_map(|m| m.iter());
    for (slot, region) in (0u32..).zip(ram.iter().chain(extra)) {
        let gpa = region.start_addr().0;
        let size = region.len();
        let err = |source| VmError::Memslot {
            slot,
            gpa,
            size,
            source,
        };
        let host = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .map_err(|_| err(kvm_ioctls::Error::new(libc::EFAULT)))?;
        let mem = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: host as u64,
        };
        // SAFETY: `host..host + size` is a live mapping owned by a GuestMemoryMmap that the Vm
        // keeps (its RAM, or the boot area in its guest) until after the VM fd, declared first,
        // is closed; the slots do not overlap because the RAM regions and the boot area are
        // disjoint. A `VmShell` holds the fd without the RAM, but no vCPU exists until
        // `Vm::restore_on` has checked that the RAM it is given, and keeps, maps exactly
        // these ranges.
        unsafe { fd.set_user_memory_region(mem) }.map_err(err)?;
    }
    Ok(())
}

/// Each vCPU's CPUID: the planned topology, the host's features, and with `nested` what an
/// emulated ring 0 cannot run masked.
pub(crate) fn vcpu_cpuids(kvm: &Kvm, plan: &Plan, nested: bool) -> Result<Vec<CpuId>, VmError> {
    let mut supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    // KVM emulates the TSC-deadline LAPIC timer on any host but leaves the bit out of its
    // supported set: the VMM offers it when KVM has the capability (KVM's API documentation).
    if kvm.check_extension(Cap::TscDeadlineTimer) {
        cpuid::offer_tsc_deadline(&mut supported);
    }
    plan_cpuids(&supported, plan, nested)
}

/// [`vcpu_cpuids`] from a given supported set. The KVM realtime hint is set only when the
/// plan's vCPU PUs are exclusive ([`Plan::vcpu_pus_exclusive`]).
fn plan_cpuids(supported: &CpuId, plan: &Plan, nested: bool) -> Result<Vec<CpuId>, VmError> {
    let realtime_hint = plan.vcpu_pus_exclusive();
    plan.vcpus
        .iter()
        .map(|v| {
            let inputs = CpuidInputs {
                topology: plan.guest_topology,
                vcpu: v,
                realtime_hint,
            };
            let mut c = cpuid::vcpu_cpuid(supported, &inputs, &cpuid::host_cpuid)
                .map_err(VmError::Cpuid)?;
            if nested {
                mask_for_nested_emulation(&mut c);
                c = cpuid::renormalize_xsave(v.vcpu, &c).map_err(VmError::Cpuid)?;
            }
            Ok(c)
        })
        .collect()
}

/// vCPU `v`'s SCHED_FIFO priority when the plan's realtime mask holds it.
pub(crate) fn vcpu_fifo(plan: &Plan, v: &VcpuPlacement) -> Option<i32> {
    plan.realtime
        .as_ref()
        .filter(|rt| rt.vcpus.contains(&v.vcpu))
        .map(|rt| rt.priority)
}

/// The PUs vCPU `v`'s thread is pinned to: its own, or the plan's floating set.
pub(crate) fn vcpu_cpus(plan: &Plan, v: &VcpuPlacement) -> Vec<u32> {
    v.host_cpu
        .map_or_else(|| plan.floating_cpus.clone(), |c| vec![c])
}

/// Prepares a built-in payload: KVM VM, boot area, memslots, payload data, per-vCPU CPUID
/// and mailbox.
pub(crate) fn prepare_payload(
    plan: &Plan,
    ram: &dyn GuestRam,
    options: &VmOptions,
    kind: PayloadKind,
) -> Result<Prepared, VmError> {
    let (kvm, fd) = open_vm(plan)?;
    let layout = ram.guest_layout();
    let (boot, boot_mem, entry_points) = build_boot_area(layout, plan.vcpus.len(), kind)?;
    register_memslots(&fd, ram.guest_memory(), Some(&boot_mem))?;
    if kind.needs_irqchip() {
        create_irqchip(&fd, Irqchip::Kernel)?;
    }
    let (chains, bench_cells) = if kind == PayloadKind::NumaBench {
        let chains = bench::prepare(
            ram.guest_memory(),
            layout,
            &options.bench,
            BENCH_SEED,
            plan.vcpus.len(),
        )
        .map_err(|source| VmError::Payload { vcpu: None, source })?;
        let mut cells: Vec<u32> = layout.regions.iter().map(|r| r.cell).collect();
        cells.dedup();
        (chains, cells)
    } else {
        (Vec::new(), Vec::new())
    };
    let inputs = MailboxInputs {
        plan,
        layout,
        boot: &boot,
        user_entry: entry_points.user_entry,
        bench: &chains,
    };
    let cpuids = vcpu_cpuids(&kvm, plan, options.mask_for_nested_emulation)?;
    let mut configs = Vec::with_capacity(plan.vcpus.len());
    for (i, (v, cpuid)) in plan.vcpus.iter().zip(cpuids).enumerate() {
        let payload_err = |source| VmError::Payload {
            vcpu: Some(i),
            source,
        };
        let mut m = payload::initial_mailbox(&inputs, i).map_err(payload_err)?;
        payload::set_cpuid_requests(&mut m, &cpuid::reported_leaves(&cpuid));
        payload::write_mailbox(&boot_mem, &m).map_err(payload_err)?;
        configs.push(VcpuConfig {
            index: i,
            kvm_id: v.apic_id,
            cpus: vcpu_cpus(plan, v),
            fifo_priority: vcpu_fifo(plan, v),
            cpuid,
            start: VcpuStart::Payload {
                entry: entry_points.entry,
                make_runnable: kind.needs_irqchip(),
            },
        });
    }
    let guest = Guest::Payload {
        kind,
        boot: Arc::new(boot),
        boot_mem,
        bench_cells,
    };
    Ok(Prepared {
        kvm,
        fd,
        guest,
        configs,
    })
}

/// Lays out and fills the boot area in the MMIO hole: tables, code, mailboxes come later.
fn build_boot_area(
    layout: &GuestLayout,
    vcpus: usize,
    kind: PayloadKind,
) -> Result<(BootLayout, GuestMemoryMmap, EntryPoints), VmError> {
    let hole = layout.mmio_hole();
    if hole.end <= hole.start || hole.start >= BOOT_LIMIT {
        return Err(VmError::NoHole { hole });
    }
    // Identity-map RAM and the whole hole (boot area included): guest MMIO accesses then reach
    // the VMM as MMIO exits instead of page faults.
    let mut mapped: Vec<Range<u64>> = layout.regions.iter().map(|r| r.gpa_range()).collect();
    mapped.push(hole.clone());
    let boot = BootLayout::new(hole.start, BOOT_LIMIT.min(hole.end), vcpus, &mapped)
        .map_err(VmError::Boot)?;
    if boot.range().contains(&program::UNMAPPED_GPA) {
        return Err(VmError::NoHole { hole });
    }
    let program = program::image(kind);
    let entry_points = program.entry_points_at(boot.code).ok_or(VmError::Payload {
        vcpu: None,
        source: PayloadError::CodeAddress {
            kind,
            gpa: boot.code,
            align: CODE_ALIGN,
        },
    })?;
    if program.code.len() as u64 > CODE_BYTES {
        let source = PayloadError::CodeTooLarge {
            kind,
            bytes: program.code.len(),
            max: CODE_BYTES,
        };
        return Err(VmError::Payload { vcpu: None, source });
    }
    let boot_mem = boot.build(&entry_points.handlers).map_err(VmError::Boot)?;
    boot_mem
        .write_slice(program.code, GuestAddress(boot.code))
        .map_err(|source| {
            VmError::Boot(BootError::Write {
                gpa: boot.code,
                source,
            })
        })?;
    Ok((boot, boot_mem, entry_points))
}

#[cfg(test)]
mod tests {
    use kvm_bindings::kvm_cpuid_entry2;

    use super::*;

    fn supported() -> CpuId {
        let e = |function, eax, ebx, ecx, edx| kvm_cpuid_entry2 {
            function,
            eax,
            ebx,
            ecx,
            edx,
            ..Default::default()
        };
        // "GenuineIntel", leaf 1, and the KVM leaves.
        CpuId::from_entries(&[
            e(0, 1, 0x756e_6547, 0x6c65_746e, 0x4965_6e69),
            e(1, 0x000a_0f12, 0, 0, 0),
            e(0x4000_0000, 0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x4d),
            e(0x4000_0001, 0x0100_07fb, 0, 0, 0),
        ])
        .expect("a small CPUID")
    }

    fn hint(toml_cpu: &str) -> Vec<bool> {
        let spec = vmhost_config::from_toml_str(
            &format!("[cpu]\ncores = 2\n{toml_cpu}\n[memory]\nguest = \"64Mi\"\n"),
            "t.toml",
        )
        .expect("valid spec")
        .spec;
        let host = vmhost_topology::load_synthetic("package:1 numa:1 core:4 pu:1").expect("host");
        let plan = vmhost_plan::plan(&spec, &host, &Default::default())
            .into_result()
            .expect("fits");
        plan_cpuids(&supported(), &plan, false)
            .expect("cpuid")
            .iter()
            .map(|c| {
                let leaf = c.as_slice().iter().find(|e| e.function == 0x4000_0001);
                leaf.is_some_and(|e| e.edx & cpuid::KVM_HINTS_REALTIME != 0)
            })
            .collect()
    }

    #[test]
    fn realtime_mask_gives_fifo_to_the_masked_vcpus_only() {
        let spec = vmhost_config::from_toml_str(
            "[cpu]\ncores = 3\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\n\
             realtime = { mask = \"0,2\" }\n[memory]\nguest = \"64Mi\"\n",
            "t.toml",
        )
        .expect("valid spec")
        .spec;
        let host = vmhost_topology::load_synthetic("package:1 numa:1 core:4 pu:1").expect("host");
        let plan = vmhost_plan::plan(&spec, &host, &Default::default())
            .into_result()
            .expect("fits");
        let fifo: Vec<Option<i32>> = plan.vcpus.iter().map(|v| vcpu_fifo(&plan, v)).collect();
        assert_eq!(fifo, vec![Some(1), None, Some(1)]);
        // The realtime VM's vCPU PUs are exclusive, so the guest gets the KVM realtime hint.
        assert!(plan_cpuids(&supported(), &plan, false)
            .expect("cpuid")
            .iter()
            .all(|c| c
                .as_slice()
                .iter()
                .any(|e| e.function == 0x4000_0001 && e.edx & cpuid::KVM_HINTS_REALTIME != 0)));
    }

    #[test]
    fn realtime_hint_needs_an_isolated_emulator_not_just_dedicated_pus() {
        assert_eq!(hint("dedicated_cpu_placement = true"), vec![false, false]);
        assert_eq!(
            hint("dedicated_cpu_placement = true\nisolate_emulator_thread = true"),
            vec![true, true]
        );
        assert_eq!(hint(""), vec![false, false]);
    }
}
