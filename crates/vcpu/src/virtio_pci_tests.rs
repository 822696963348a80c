//! virtio-pci on a real KVM VM: the configuration space over the mechanism #1 ports, the
//! driver's setup through BAR 0, a guest's 2-byte doorbell served through the ioeventfd, and
//! the queue's MSI-X message delivered by `KVM_SIGNAL_MSI` into the vCPU's LAPIC (its IRR, as
//! KVM reports it).
#![allow(clippy::cast_possible_truncation)] // test addresses below 4 GiB
use kvm_ioctls::{Kvm, VcpuExit};
use vm_memory::{Bytes, GuestAddress};

use super::tests::{AVAIL, BASE, BUF, CODE, DESC, USED};
use super::*;
/// The vector the queue's MSI-X message carries (fixed delivery to APIC ID 0).
const VECTOR: u32 = 0x31;

fn config_read(att: &VirtioAttachment, device: u32, register: u32) -> u32 {
    let address = 0x8000_0000 | (device << 11) | register;
    assert!(att.pio_write(0xcf8, &address.to_le_bytes()));
    let mut b = [0u8; 4];
    assert!(att.pio_read(0xcfc, &mut b));
    u32::from_le_bytes(b)
}

fn config_write16(att: &VirtioAttachment, device: u32, register: u32, value: u16) {
    let address = 0x8000_0000 | (device << 11) | (register & !3);
    assert!(att.pio_write(0xcf8, &address.to_le_bytes()));
    let port = 0xcfc + (register & 3) as u16;
    assert!(att.pio_write(port, &value.to_le_bytes()));
}

fn bar_write(att: &VirtioAttachment, offset: u64, bytes: &[u8]) {
    assert!(att.mmio_write(BASE + offset, bytes));
}

fn bar_read8(att: &VirtioAttachment, offset: u64) -> u8 {
    let mut b = [0u8; 1];
    assert!(att.mmio_read(BASE + offset, &mut b));
    b[0]
}

/// The capability of `id` in device 1's list, following the pointers from 0x34.
fn find_cap(att: &VirtioAttachment, id: u32, cfg_type: Option<u32>) -> u32 {
    let mut at = config_read(att, 1, 0x34) & 0xff;
    while at != 0 {
        let head = config_read(att, 1, at);
        if head & 0xff == id && cfg_type.is_none_or(|t| (head >> 24) & 0xff == t) {
            return at;
        }
        at = (head >> 8) & 0xff;
    }
    panic!("no capability {id:#x}");
}

/// The driver's setup of virtio-rng's queue 0 with MSI-X vector 0 (address 0xfee00000, data
/// [`VECTOR`]), from the host side, in the order Linux's virtio_pci_modern does it.
fn driver_setup(att: &VirtioAttachment) {
    bar_write(att, 0x14, &[1]);
    bar_write(att, 0x14, &[3]);
    bar_write(att, 0x08, &1u32.to_le_bytes());
    bar_write(att, 0x0c, &1u32.to_le_bytes()); // VIRTIO_F_VERSION_1 (bit 32)
    bar_write(att, 0x14, &[11]);
    assert_eq!(bar_read8(att, 0x14), 11, "FEATURES_OK kept");
    // MSI-X on with the function masked, vector 0 programmed and unmasked, then unmasked.
    let msix = find_cap(att, 0x11, None);
    config_write16(att, 1, msix + 2, 0xc000);
    bar_write(att, 0x800, &0xfee0_0000u32.to_le_bytes());
    bar_write(att, 0x804, &0u32.to_le_bytes());
    bar_write(att, 0x808, &VECTOR.to_le_bytes());
    bar_write(att, 0x80c, &0u32.to_le_bytes());
    config_write16(att, 1, msix + 2, 0x8000);
    bar_write(att, 0x16, &0u16.to_le_bytes());
    bar_write(att, 0x18, &16u16.to_le_bytes());
    bar_write(att, 0x1a, &0u16.to_le_bytes());
    let mut v = [0u8; 2];
    assert!(att.mmio_read(BASE + 0x1a, &mut v));
    assert_eq!(u16::from_le_bytes(v), 0, "queue 0 took vector 0");
    for (offset, addr) in [(0x20, DESC), (0x28, AVAIL), (0x30, USED)] {
        bar_write(att, offset, &(addr as u32).to_le_bytes());
        bar_write(att, offset + 4, &0u32.to_le_bytes());
    }
    bar_write(att, 0x1c, &1u16.to_le_bytes());
    bar_write(att, 0x14, &[15]);
    assert_eq!(bar_read8(att, 0x14), 15, "DRIVER_OK");
}

fn irr_has(lapic: &kvm_bindings::kvm_lapic_state, vector: u32) -> bool {
    let at = 0x200 + (vector / 32) as usize * 0x10;
    let word = u32::from_le_bytes([
        lapic.regs[at] as u8,
        lapic.regs[at + 1] as u8,
        lapic.regs[at + 2] as u8,
        lapic.regs[at + 3] as u8,
    ]);
    word & (1 << (vector % 32)) != 0
}

/// A KVM VM with 2 MiB of RAM and virtio-rng attached as a virtio-pci function.
struct Rig {
    kvm: Kvm,
    mem: GuestMemoryMmap,
    vm: VmFd,
    dir: tempfile::TempDir,
    plan: DevicePlan,
    att: VirtioAttachment,
}

/// The [`Rig`] of test `name`; `None` when the test may not use KVM here.
fn rig(name: &str) -> Option<Rig> {
    if !vmhost_testsupport::need_kvm(name) {
        return None;
    }
    let kvm = Kvm::new().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
    let vm = super::tests::vm_with(&kvm, &mem);
    let dir = tempfile::tempdir().unwrap();
    let plan = super::tests::rng_plan();
    let att = attach(&vm, &plan, Transport::Pci, "t", &mem, dir.path()).unwrap();
    Some(Rig {
        kvm,
        mem,
        vm,
        dir,
        plan,
        att,
    })
}

#[test]
fn a_pci_queue_interrupts_with_an_msix_message() {
    let Some(Rig { mem, vm, att, .. }) = rig("a_pci_queue_interrupts_with_an_msix_message") else {
        return;
    };
    // The bus: a host bridge at 00:00.0, virtio-rng (type 4) at 00:01.0, nothing at 00:02.0.
    assert_eq!(config_read(&att, 0, 0x08) >> 8, 0x06_00_00);
    assert_eq!(config_read(&att, 1, 0x00), 0x1044_1af4);
    assert_eq!(config_read(&att, 2, 0x00), 0xffff_ffff);
    assert_eq!(
        config_read(&att, 1, 0x10),
        BASE as u32,
        "BAR 0 at the slot's base"
    );
    let common = find_cap(&att, 0x09, Some(1));
    assert_eq!(
        config_read(&att, 1, common + 8),
        0,
        "common configuration at BAR offset 0"
    );
    driver_setup(&att);

    let mut vcpu = vm.create_vcpu(0).unwrap();
    let mut lapic = vcpu.get_lapic().unwrap();
    lapic.regs[0xf1] |= 1; // SVR bit 8: the LAPIC is software-enabled
    vcpu.set_lapic(&lapic).unwrap();
    super::tests::post_writable(&mem, 0, BUF, 64, 0);
    // mov ax, 0; mov [0xd0000050], ax (the 2-byte doorbell); out 0x80, al; hlt
    let code = [
        0x66, 0xb8, 0, 0, 0x66, 0xa3, 0x50, 0x00, 0x00, 0xd0, 0xe6, 0x80, 0xf4,
    ];
    mem.write_slice(&code, GuestAddress(CODE)).unwrap();
    super::tests::protected_mode(&vcpu, CODE);
    match vcpu.run().unwrap() {
        VcpuExit::IoOut(0x80, _) => {}
        other => {
            panic!("expected the guest's out 0x80 (the doorbell in the kernel), got {other:?}")
        }
    }
    let used = || mem.read_obj::<u16>(GuestAddress(USED + 2)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut delivered = false;
    while std::time::Instant::now() < deadline {
        delivered = used() == 1 && irr_has(&vcpu.get_lapic().unwrap(), VECTOR);
        if delivered {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(used(), 1, "the I/O thread used the buffer");
    assert!(
        delivered,
        "vector {VECTOR:#x} is pending in the LAPIC's IRR"
    );
    assert_eq!(bar_read8(&att, 0x40), 0, "with MSI-X the ISR stays clear");
}

/// A virtio-pci function saved with its MSI-X set up and a buffer waiting, carried as JSON and
/// attached to a second KVM VM: its configuration space, vector table and queue vector come
/// back; the waiting buffer is served on resume, and its message waits until the restored
/// VM's vCPUs are loaded (`raise_restored_interrupts`), then lands in the LAPIC. The saved
/// state is refused by a virtio-mmio attachment.
#[test]
fn a_pci_function_is_restored_with_its_vectors() {
    let Some(Rig {
        kvm,
        mem,
        dir,
        plan,
        att,
        ..
    }) = rig("a_pci_function_is_restored_with_its_vectors")
    else {
        return;
    };
    driver_setup(&att);
    super::tests::post_writable(&mem, 0, BUF, 64, 0);
    let saved = att.save().unwrap();
    let pci = saved[0]
        .pci
        .as_ref()
        .expect("a virtio-pci slot carries its function");
    assert!(pci.msix.enabled);
    assert_eq!(pci.msix.queue_vectors, [0]);
    assert_eq!(pci.msix.entries[0].data, VECTOR);
    let json = serde_json::to_string(&saved).unwrap();
    let saved: Vec<VirtioSlotState> = serde_json::from_str(&json).unwrap();

    let target_vm = super::tests::vm_with(&kvm, &mem);
    let vcpu = target_vm.create_vcpu(0).unwrap();
    let mut lapic = vcpu.get_lapic().unwrap();
    lapic.regs[0xf1] |= 1;
    vcpu.set_lapic(&lapic).unwrap();
    let restored = attach_restored(
        &target_vm,
        &plan,
        Transport::Pci,
        "t2",
        &mem,
        dir.path(),
        &saved,
    )
    .unwrap();
    assert_eq!(config_read(&restored, 1, 0x10), BASE as u32);
    let msix = find_cap(&restored, 0x11, None);
    assert_eq!(
        config_read(&restored, 1, msix) >> 16 & 0xc000,
        0x8000,
        "MSI-X on"
    );
    let mut v = [0u8; 2];
    assert!(restored.mmio_read(BASE + 0x1a, &mut v));
    assert_eq!(u16::from_le_bytes(v), 0, "queue 0's vector");
    restored.resume_restored();
    assert_eq!(mem.read_obj::<u16>(GuestAddress(USED + 2)).unwrap(), 1);
    assert!(
        !irr_has(&vcpu.get_lapic().unwrap(), VECTOR),
        "held until the vCPUs are loaded"
    );
    assert_eq!(restored.raise_restored_interrupts(), 1);
    assert!(irr_has(&vcpu.get_lapic().unwrap(), VECTOR));
    drop(vcpu);

    let mmio_vm = super::tests::vm_with(&kvm, &mem);
    let err = attach_restored(
        &mmio_vm,
        &plan,
        Transport::Mmio,
        "t3",
        &mem,
        dir.path(),
        &saved,
    )
    .unwrap_err();
    let chain = format!("{err:?}");
    assert!(chain.contains("Transport"), "{chain}");
    att.resume_io();
}
