#![allow(clippy::cast_possible_truncation)] // test addresses below 4 GiB
use kvm_bindings::kvm_segment;
use kvm_ioctls::{Kvm, VcpuExit};
use vm_memory::{Bytes, GuestAddress};
use vmhost_config::DeviceSpec;

use super::*;
use crate::setup::register_memslots;

/// The first slot's base, and the guest addresses of the code, the rings and a buffer
/// (`virtio_pci_tests` uses them too).
pub(super) const BASE: u64 = 0xd000_0000;
pub(super) const CODE: u64 = 0x1000;
pub(super) const DESC: u64 = 0x2_0000;
pub(super) const AVAIL: u64 = 0x2_1000;
pub(super) const USED: u64 = 0x2_2000;
pub(super) const BUF: u64 = 0x10_0000;

fn flat(type_: u8, selector: u16) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        ..Default::default()
    }
}

/// Puts `vcpu` in flat 32-bit protected mode at `rip`.
pub(super) fn protected_mode(vcpu: &kvm_ioctls::VcpuFd, rip: u64) {
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs = flat(0xb, 0x8);
    for s in [
        &mut sregs.ds,
        &mut sregs.es,
        &mut sregs.ss,
        &mut sregs.fs,
        &mut sregs.gs,
    ] {
        *s = flat(0x3, 0x10);
    }
    sregs.cr0 |= 1;
    vcpu.set_sregs(&sregs).unwrap();
    let mut regs = vcpu.get_regs().unwrap();
    regs.rip = rip;
    regs.rflags = 2;
    vcpu.set_regs(&regs).unwrap();
}

fn reg(att: &VirtioAttachment, offset: u64, value: u32) {
    assert!(att.mmio_write(BASE + offset, &value.to_le_bytes()));
}

/// A driver's handshake from the host side: VERSION_1, one 16-entry queue, DRIVER_OK.
fn handshake(att: &VirtioAttachment) {
    for (offset, value) in [
        (0x70, 1),
        (0x70, 3),
        (0x24, 1),
        (0x20, 1),
        (0x70, 11),
        (0x30, 0),
        (0x38, 16),
        (0x80, DESC as u32),
        (0x90, AVAIL as u32),
        (0xa0, USED as u32),
        (0x44, 1),
        (0x70, 15),
    ] {
        reg(att, offset, value);
    }
    let mut status = [0u8; 4];
    assert!(att.mmio_read(BASE + 0x70, &mut status));
    assert_eq!(u32::from_le_bytes(status), 15);
}

/// A real guest writes `QueueNotify` and `InterruptACK`: KVM signals the ioeventfds without
/// an exit, the I/O thread serves virtio-rng's queue, and the used ring and the interrupt
/// status show it; the status read acknowledges (the ACK write never reaches vmhost).
#[test]
fn a_guest_queue_notify_reaches_the_device_through_the_ioeventfd() {
    if !vmhost_testsupport::need_kvm(
        "a_guest_queue_notify_reaches_the_device_through_the_ioeventfd",
    ) {
        return;
    }
    let kvm = Kvm::new().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
    let vm = vm_with(&kvm, &mem);
    let dir = tempfile::tempdir().unwrap();
    let plan = rng_plan();
    let att = attach(&vm, &plan, Transport::Mmio, "t", &mem, dir.path()).unwrap();
    let io = att.io_threads();
    assert_eq!(io.len(), 1, "a hand-made plan gets one I/O thread");
    assert_eq!(io[0].name, "vmhost-io-0");
    assert_eq!(io[0].device_bases, [BASE]);
    assert_eq!(att.describe(), ["rng: getrandom"]);
    handshake(&att);
    // One 64-byte device-writable buffer, made available.
    let desc: [u8; 16] = {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&BUF.to_le_bytes());
        d[8..12].copy_from_slice(&64u32.to_le_bytes());
        d[12..14].copy_from_slice(&2u16.to_le_bytes()); // VRING_DESC_F_WRITE
        d
    };
    mem.write_slice(&desc, GuestAddress(DESC)).unwrap();
    mem.write_slice(&[0, 0, 1, 0, 0, 0], GuestAddress(AVAIL))
        .unwrap();
    // mov eax, 0; mov [0xd0000050], eax; mov eax, 1; mov [0xd0000064], eax; out 0x80, al; hlt
    let code = [
        0xb8, 0, 0, 0, 0, 0xa3, 0x50, 0x00, 0x00, 0xd0, 0xb8, 1, 0, 0, 0, 0xa3, 0x64, 0x00, 0x00,
        0xd0, 0xe6, 0x80, 0xf4,
    ];
    mem.write_slice(&code, GuestAddress(CODE)).unwrap();
    let mut vcpu = vm.create_vcpu(0).unwrap();
    protected_mode(&vcpu, CODE);
    match vcpu.run().unwrap() {
        VcpuExit::IoOut(0x80, _) => {}
        other => panic!(
            "expected the guest's out 0x80 (QueueNotify and InterruptACK served in the kernel), \
             got {other:?}"
        ),
    }
    let used = || mem.read_obj::<u16>(GuestAddress(USED + 2)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while used() != 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(used(), 1, "the I/O thread used the buffer");
    assert_eq!(mem.read_obj::<u32>(GuestAddress(USED + 8)).unwrap(), 64);
    let mut bytes = [0u8; 64];
    mem.read_slice(&mut bytes, GuestAddress(BUF)).unwrap();
    assert!(
        bytes.iter().any(|&b| b != bytes[0]),
        "random bytes: {bytes:?}"
    );
    let mut isr = [0u8; 4];
    assert!(att.mmio_read(BASE + 0x60, &mut isr));
    assert_eq!(u32::from_le_bytes(isr), 1, "the queue interrupt was raised");
    assert!(att.mmio_read(BASE + 0x60, &mut isr));
    assert_eq!(
        u32::from_le_bytes(isr),
        0,
        "the status read acknowledged it"
    );
}

/// Writes descriptor `index` (a device-writable buffer of `len` bytes at `addr`) and makes
/// it available as ring entry `slot`.
pub(super) fn post_writable(mem: &GuestMemoryMmap, index: u16, addr: u64, len: u32, slot: u16) {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&2u16.to_le_bytes()); // VRING_DESC_F_WRITE
    mem.write_slice(&d, GuestAddress(DESC + 16 * u64::from(index)))
        .unwrap();
    mem.write_obj(index, GuestAddress(AVAIL + 4 + 2 * u64::from(slot)))
        .unwrap();
    mem.write_obj(slot + 1, GuestAddress(AVAIL + 2)).unwrap();
}

/// A plan with one device, virtio-rng.
pub(super) fn rng_plan() -> DevicePlan {
    DevicePlan::new(DeviceSpec {
        rng: true,
        ..DeviceSpec::default()
    })
}

/// A VM with an in-kernel irqchip and `mem` as its RAM.
pub(super) fn vm_with(kvm: &Kvm, mem: &GuestMemoryMmap) -> VmFd {
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    register_memslots(&vm, mem, None).unwrap();
    vm
}

/// The devices of one KVM VM are saved (I/O threads quiesced) with one buffer used and one
/// waiting, carried as JSON, and attached to a second KVM VM over a copy of its RAM: the
/// restored device has the saved registers and serves the waiting buffer on resume, in the
/// second VM's RAM only. A state for another set of devices is refused.
#[test]
fn devices_saved_from_one_vm_are_restored_into_another() {
    if !vmhost_testsupport::need_kvm("devices_saved_from_one_vm_are_restored_into_another") {
        return;
    }
    let kvm = Kvm::new().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
    let vm = vm_with(&kvm, &mem);
    let dir = tempfile::tempdir().unwrap();
    let plan = DevicePlan::new(DeviceSpec {
        rng: true,
        ..DeviceSpec::default()
    });
    let att = attach(&vm, &plan, Transport::Mmio, "t", &mem, dir.path()).unwrap();
    handshake(&att);
    post_writable(&mem, 0, BUF, 64, 0);
    reg(&att, 0x50, 0); // QueueNotify, served on this thread
    let used = |m: &GuestMemoryMmap| m.read_obj::<u16>(GuestAddress(USED + 2)).unwrap();
    assert_eq!(used(&mem), 1);
    post_writable(&mem, 1, BUF + 0x1000, 32, 1);

    let saved = att.save().unwrap();
    assert_eq!(saved.len(), 1);
    let q = saved[0].transport.queues[0];
    assert_eq!((q.next_avail, q.next_used, q.size), (1, 1, 16));
    assert_eq!(
        saved[0].transport.interrupt_status, 1,
        "not read by the driver yet"
    );
    let json = serde_json::to_string(&saved).unwrap();
    let saved: Vec<VirtioSlotState> = serde_json::from_str(&json).unwrap();

    let mut bytes = vec![0u8; 2 << 20];
    mem.read_slice(&mut bytes, GuestAddress(0)).unwrap();
    let target_mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
    target_mem.write_slice(&bytes, GuestAddress(0)).unwrap();
    let target_vm = vm_with(&kvm, &target_mem);
    let restored = attach_restored(
        &target_vm,
        &plan,
        Transport::Mmio,
        "t2",
        &target_mem,
        dir.path(),
        &saved,
    )
    .unwrap();
    let mut status = [0u8; 4];
    assert!(restored.mmio_read(BASE + 0x70, &mut status));
    assert_eq!(u32::from_le_bytes(status), 15, "DRIVER_OK restored");
    restored.resume_restored();
    assert_eq!(
        used(&target_mem),
        2,
        "the waiting buffer was served on the target"
    );
    assert_eq!(
        target_mem
            .read_obj::<[u32; 2]>(GuestAddress(USED + 4 + 8))
            .unwrap(),
        [1, 32]
    );
    let mut isr = [0u8; 4];
    assert!(restored.mmio_read(BASE + 0x60, &mut isr));
    assert_eq!(
        u32::from_le_bytes(isr),
        1,
        "the interrupt status carried over"
    );
    assert_eq!(used(&mem), 1, "the source did nothing after the save");
    att.resume_io();

    let none = DevicePlan::new(DeviceSpec::default());
    let other_vm = vm_with(&kvm, &target_mem);
    let err = attach_restored(
        &other_vm,
        &none,
        Transport::Mmio,
        "t3",
        &target_mem,
        dir.path(),
        &saved,
    )
    .unwrap_err();
    let chain = format!("{:?}", err);
    assert!(chain.contains("SlotCount"), "{chain}");
}

#[test]
fn a_missing_image_fails_attach_with_the_disk_named() {
    if !vmhost_testsupport::need_kvm("a_missing_image_fails_attach_with_the_disk_named") {
        return;
    }
    let kvm = Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk = vmhost_config::DiskSpec {
        name: "root".into(),
        source: vmhost_config::DiskSource::Image {
            path: dir.path().join("gone.img"),
            create_bytes: None,
        },
        read_only: false,
        cache: vmhost_config::DiskCache::Writeback,
        serial: "root".into(),
    };
    let plan = DevicePlan::new(DeviceSpec {
        disks: vec![disk],
        ..DeviceSpec::default()
    });
    let err = attach(&vm, &plan, Transport::Mmio, "t", &mem, dir.path()).unwrap_err();
    let chain = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    assert!(chain.contains("disk root"), "{chain}");
}

/// Plans `toml` on this host (the discovered topology).
fn plan_here(toml: &str) -> vmhost_plan::Plan {
    let spec = vmhost_config::from_toml_str(toml, "t.toml").unwrap().spec;
    let host = vmhost_topology::discover().unwrap();
    vmhost_plan::plan(&spec, &host, &vmhost_plan::PlanOptions::default())
        .into_result()
        .unwrap()
}

/// `Cpus_allowed_list` of thread `tid` of this process, expanded.
fn allowed(tid: i32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string();
    vmhost_topology::cpulist::parse(&list).unwrap()
}

/// Thread names (`comm`) of this process.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

const TWO_DISKS_RNG: &str = r#"
io_threads_policy = "shared"
[cpu]
cores = 1
[memory]
guest = "64Mi"
[devices]
rng = {}
[[devices.disks]]
name = "a"
[[devices.disks]]
name = "b"
dedicated_io_thread = true
[[volumes]]
name = "a"
empty_disk = { capacity = "1Mi" }
[[volumes]]
name = "b"
empty_disk = { capacity = "1Mi" }
"#;

#[test]
fn each_planned_io_thread_serves_its_devices_pinned_to_its_pus() {
    if !vmhost_testsupport::need_kvm("each_planned_io_thread_serves_its_devices_pinned_to_its_pus")
    {
        return;
    }
    let mut plan = plan_here(TWO_DISKS_RNG);
    // Pin each thread to one PU of this process's affinity, different where there are two.
    let mine = crate::sys::current_affinity().unwrap();
    for (i, t) in plan.devices.io_threads.iter_mut().enumerate() {
        t.host_cpus = vec![mine[i % mine.len()]];
    }
    let kvm = Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let att = attach(&vm, &plan.devices, Transport::Mmio, "t", &mem, dir.path()).unwrap();
    let io = att.io_threads();
    assert_eq!(io.len(), 2);
    let bases: Vec<u64> = plan.devices.slots.iter().map(|s| s.base).collect();
    assert_eq!(io[0].name, "vmhost-io-0");
    assert_eq!(io[0].device_bases, [bases[0], bases[2]], "disk a and rng");
    assert_eq!(io[1].name, "vmhost-io-1");
    assert_eq!(io[1].device_bases, [bases[1]], "the dedicated disk b");
    for (t, planned) in io.iter().zip(&plan.devices.io_threads) {
        assert_eq!(t.cpus, planned.host_cpus);
        assert_eq!(allowed(t.tid), planned.host_cpus, "{} read back", t.name);
        let comm = std::fs::read_to_string(format!("/proc/self/task/{}/comm", t.tid)).unwrap();
        assert_eq!(comm.trim(), t.name);
    }
    let tids: Vec<i32> = io.iter().map(|t| t.tid).collect();
    drop(att);
    for tid in tids {
        assert!(
            !std::path::Path::new(&format!("/proc/self/task/{tid}")).exists(),
            "I/O thread {tid} stopped with the attachment"
        );
    }
}

#[test]
fn an_io_thread_that_cannot_be_pinned_fails_attach_and_leaves_no_thread() {
    if !vmhost_testsupport::need_kvm(
        "an_io_thread_that_cannot_be_pinned_fails_attach_and_leaves_no_thread",
    ) {
        return;
    }
    let mut plan = plan_here(TWO_DISKS_RNG);
    plan.devices.io_threads[0].name = "vmhost-io-pinok".into();
    plan.devices.io_threads[1].name = "vmhost-io-nopin".into();
    // No machine here has PU 4000: sched_setaffinity refuses the set.
    plan.devices.io_threads[1].host_cpus = vec![4000];
    let kvm = Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let err = attach(&vm, &plan.devices, Transport::Mmio, "t", &mem, dir.path()).unwrap_err();
    assert!(
        matches!(&err, VirtioError::Pin { thread, cpus, .. } if thread == "vmhost-io-nopin" && cpus == &[4000]),
        "{err:?}"
    );
    let names = thread_names();
    assert!(
        !names
            .iter()
            .any(|n| n == "vmhost-io-pinok" || n == "vmhost-io-nopin"),
        "threads left behind: {names:?}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "scratch disks removed"
    );
}

/// The planner's per-device overhead terms use the devices' own buffer sizes.
#[test]
fn overhead_constants_match_the_devices() {
    use vmhost_plan::envelope::*;
    assert_eq!(
        VIRTIO_BLK_MAX_REQUEST,
        vmhost_devices::block::BLOCK_MAX_REQUEST
    );
    assert_eq!(VIRTIO_NET_MAX_FRAME, vmhost_devices::net::MAX_FRAME as u64);
    assert_eq!(
        VIRTIO_RNG_BUFFER,
        vmhost_devices::rng::RNG_MAX_REQUEST as u64
    );
    assert_eq!(DIRECT_ALIGN, vmhost_config::devices::DIRECT_BLOCK);
}

/// A Linux guest's devices — two disks, rng, COM1, the legacy ports — saved as one
/// `DevicesState` from one KVM VM and restored into another by `LinuxDevices::restore`: the
/// registers the guest wrote (UART scratch, CMOS index, the disk's DRIVER_OK) read back
/// there, and the per-run disks are not looked for by `check_restorable`.
#[test]
fn linux_devices_are_saved_and_restored_as_one_state() {
    use crate::devices::serial::{SerialConsole, SerialOut};
    use crate::devices::LinuxDevices;
    use vmhost_devices::persist::{check_restorable, DevicesState};

    if !vmhost_testsupport::need_kvm("linux_devices_are_saved_and_restored_as_one_state") {
        return;
    }
    let mut plan = plan_here(TWO_DISKS_RNG);
    let mine = crate::sys::current_affinity().unwrap();
    for (i, t) in plan.devices.io_threads.iter_mut().enumerate() {
        t.host_cpus = vec![mine[i % mine.len()]];
    }
    let kvm = Kvm::new().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
    let vm = vm_with(&kvm, &mem);
    let (dir, target_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let sink = || {
        Some(SerialOut(std::sync::Arc::new(std::sync::Mutex::new(
            std::io::sink(),
        ))))
    };
    let att = attach(&vm, &plan.devices, Transport::Mmio, "t", &mem, dir.path()).unwrap();
    handshake(&att);
    let source = LinuxDevices::new(SerialConsole::new(sink()).unwrap()).with_virtio(att);
    source.pio_write(0x3ff, &[0x77]); // UART scratch
    source.pio_write(0x70, &[0x0b]); // CMOS index: status B

    let state = source.save().unwrap();
    assert_eq!(state.virtio.len(), 3);
    assert_eq!(state.serial.as_ref().map(|s| s.scratch), Some(0x77));
    assert_eq!(state.legacy.map(|l| l.cmos_index), Some(0x0b));
    let state: DevicesState =
        serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
    check_restorable(&state).unwrap();

    let target_vm = vm_with(&kvm, &mem);
    let target =
        LinuxDevices::restore(&target_vm, &plan, &mem, sink(), target_dir.path(), &state).unwrap();
    target.resume_restored();
    let mut b = [0u8; 1];
    assert!(target.pio_read(0x3ff, &mut b));
    assert_eq!(b[0], 0x77, "UART scratch");
    assert!(target.pio_read(0x71, &mut b));
    assert_eq!(b[0], 0x02, "CMOS status B through the restored index");
    let mut status = [0u8; 4];
    let give_up = || false;
    assert_eq!(
        target.mmio_read(BASE + 0x70, &mut status, &give_up),
        vmhost_devices::bus::Access::Done
    );
    assert_eq!(u32::from_le_bytes(status), 15, "the first disk's DRIVER_OK");
    source.resume_io();
}
