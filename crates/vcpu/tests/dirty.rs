//! Dirty page tracking on real KVM: the `touch` payload writes guest RAM in order while the
//! dirty log is on; `take_dirty` reports exactly the pages it wrote (read back from
//! `KVM_GET_DIRTY_LOG`), nothing while paused, the VMM's own writes through vm-memory, and the
//! guest keeps running after `stop_dirty_log` (after which KVM has no log for the slots).

mod common;

use std::ops::Range;

use common::*;
use vm_memory::{Bytes, GuestAddress};
use vmhost_memory::{DirtyBitmap, GuestLayout, GuestMemoryMmap, DIRTY_PAGE_BYTES};
use vmhost_memory::{MMIO_HOLE_END, MMIO_HOLE_START};
use vmhost_seccomp::{SeccompMode, ThreadKind};
use vmhost_vcpu::payload::{ramcheck, touch};
use vmhost_vcpu::{DirtyLogError, PayloadResult, RunStatus, Vm, VmHandle, VmOptions};

/// Guest RAM that is not prefaulted: `touch` pays a first-touch exit per page and runs long
/// enough to be paused midway.
fn cold_memory(plan: &vmhost_plan::Plan) -> (GuestMemoryMmap, GuestLayout) {
    let layout = GuestLayout::from_plan(plan, MMIO_HOLE_START..MMIO_HOLE_END).expect("layout");
    (
        layout.anonymous_memory().expect("anonymous guest RAM"),
        layout,
    )
}

/// How far `touch` (which writes its range in order, each page's words in order) has got: the
/// first page whose first word is not yet the pattern.
fn written_up_to(mem: &GuestMemoryMmap, gpa: u64, len: u64) -> u64 {
    let written = |page: u64| {
        mem.read_obj::<u64>(GuestAddress(page))
            .is_ok_and(|w| w == touch::pattern(page))
    };
    let (mut lo, mut hi) = (0, len / touch::TOUCH_PAGE);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if written(gpa + mid * touch::TOUCH_PAGE) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    gpa + lo * touch::TOUCH_PAGE
}

/// The dirty pages as byte ranges of the cell.
fn runs(d: &DirtyBitmap) -> Vec<Range<u64>> {
    d.runs().collect()
}

/// Where the next round's writes start after a pause at `first` (the first page whose first
/// word is unwritten): `first`, or the page before it when the pause caught the guest in the
/// middle of that page (its last word still unwritten), which the guest then finishes, so it is
/// written, and logged, again (seen in CI: round 2 began with that page).
fn resumes_at(mem: &GuestMemoryMmap, start: u64, first: u64) -> u64 {
    if first == start {
        return first;
    }
    let last = first - touch::TOUCH_PAGE;
    let finished = mem
        .read_obj::<u64>(GuestAddress(last + touch::TOUCH_PAGE - 8))
        .is_ok_and(|w| w == touch::pattern(last));
    if finished {
        first
    } else {
        last
    }
}

/// The dirty runs of the cell at guest-physical `cell` that are not one of the idle guest's
/// RAM pattern pages (`vmhost_guest::ramcheck`: it rewrites one of them on every tick).
fn runs_besides_pattern(
    d: &DirtyBitmap,
    handle: &VmHandle,
    vcpus: usize,
    cell: u64,
) -> Vec<Range<u64>> {
    let mut pattern = Vec::new();
    for m in (0..vcpus).filter_map(|i| handle.payload_mailbox(i)) {
        for k in 0..ramcheck::PAGES {
            let page = m.ram_base + k * m.ram_stride;
            if m.ram_stride != 0 && page >= cell {
                pattern.push(page - cell..page - cell + DIRTY_PAGE_BYTES);
            }
        }
    }
    runs(d)
        .into_iter()
        .filter(|r| !pattern.contains(r))
        .collect()
}

fn pause_or_panic(handle: &VmHandle) {
    handle.pause().expect("pause mid-run");
}

/// Asserts that `d` (cell 0, starting at guest-physical `cell.start`) holds exactly the pages
/// from `cell.end` up to `upto`, which the guest wrote, plus at most the page at `upto`: KVM
/// logs a page when it maps it writable for a faulting write, and the pause can kick the vCPU
/// out between that fault and the write itself (seen here: the page after the last written
/// one is in the log, its first word still unwritten).
fn written_exactly(d: &DirtyBitmap, cell: Range<u64>, upto: u64) {
    let (from, to) = (cell.end - cell.start, upto - cell.start);
    let got = runs(d);
    let (exact, in_flight) = (from..to, from..to + DIRTY_PAGE_BYTES);
    assert!(
        got == [exact] || got == [in_flight],
        "written {from:#x}..{to:#x}, dirty {got:x?}"
    );
}

#[test]
fn dirty_log_reports_exactly_the_pages_written_by_the_guest_and_the_vmm() {
    if !kvm_available("dirty_log_reports_exactly_the_pages_written_by_the_guest_and_the_vmm") {
        return;
    }
    let _cpus = lock_cpus();
    let plan = plan_toml(
        "name = \"dirty-touch\"\n[cpu]\ncores = 1\n[memory]\nguest = \"768Mi\"\n[boot]\npayload = \"touch\"\n",
    );
    let (mem, layout) = cold_memory(&plan);
    let probe = mem.clone();
    assert_eq!(layout.regions.len(), 1, "one region below the hole");
    let region = layout.regions[0];
    let (start, size) = (region.gpa, region.size_bytes);
    let progress = {
        let probe = probe.clone();
        move || written_up_to(&probe, start, size)
    };
    let mut vm = Vm::new(&plan, (mem, layout), VmOptions::default()).expect("VM");
    let handle = vm.handle();
    assert!(matches!(
        handle.take_dirty(0),
        Err(DirtyLogError::Off { slot: 0, .. })
    ));
    handle.start_dirty_log().expect("start the dirty log");
    assert!(handle.dirty_logging());
    assert!(matches!(
        handle.start_dirty_log(),
        Err(DirtyLogError::AlreadyOn { .. })
    ));
    assert!(matches!(
        handle.take_dirty(1),
        Err(DirtyLogError::NoCell { cell: 1, .. })
    ));
    let runner = std::thread::spawn(move || {
        let report = vm.run();
        (report, vm)
    });

    // Round 1: paused midway, the log holds exactly the pages written so far.
    assert!(
        wait_for(60, || progress() > start + (16 << 20)),
        "the guest starts writing"
    );
    pause_or_panic(&handle);
    let first = progress();
    assert!(
        first < start + size,
        "paused before the end (too fast to test)"
    );
    let d = handle.take_dirty(0).expect("take_dirty");
    assert_eq!((d.cell(), d.size_bytes()), (0, size));
    println!(
        "paused at {} MiB: {} dirty pages",
        (first - start) >> 20,
        d.dirty_pages()
    );
    written_exactly(&d, start..start, first);
    let resumed = resumes_at(&probe, start, first);

    // Paused, nothing written: the next read is empty.
    assert!(handle.take_dirty(0).expect("take_dirty").is_empty());

    // A VMM write through vm-memory (as a device's) far ahead of the guest, and one into a
    // page the guest already wrote: both reported, alone.
    let ahead = start + size - 3 * DIRTY_PAGE_BYTES;
    probe
        .write_obj(0x5a5a_u32, GuestAddress(ahead + 100))
        .expect("write");
    // Two words straddling pages 3 and 4, rewritten with the values the guest put there.
    let mut words = [0u8; 16];
    words[..8].copy_from_slice(&touch::pattern(start + 3 * DIRTY_PAGE_BYTES).to_le_bytes());
    words[8..].copy_from_slice(&touch::pattern(start + 4 * DIRTY_PAGE_BYTES).to_le_bytes());
    probe
        .write_slice(&words, GuestAddress(start + 4 * DIRTY_PAGE_BYTES - 8))
        .expect("write");
    let d = handle.take_dirty(0).expect("take_dirty");
    let p = DIRTY_PAGE_BYTES;
    assert_eq!(
        runs(&d),
        vec![3 * p..5 * p, ahead - start..ahead - start + p],
        "the VMM's writes"
    );
    assert!(handle.take_dirty(0).expect("take_dirty").is_empty());

    // Round 2: the guest goes on; the log holds what it wrote since round 1.
    handle.resume().expect("resume");
    assert!(
        wait_for(60, || progress() > first + (16 << 20)),
        "the guest goes on writing"
    );
    // The pause, the read and the stop on a thread under the migration sender's filter: the
    // ioctls they make are in its list (a call outside it would kill the test with SIGSYS).
    let mig = {
        let handle = handle.clone();
        std::thread::Builder::new()
            .name("vmhost-mig".into())
            .spawn(move || {
                vmhost_seccomp::install(ThreadKind::Migration, SeccompMode::On)
                    .expect("the migration filter");
                handle.pause().expect("pause mid-run");
                let second = progress();
                let d = handle.take_dirty(0).expect("take_dirty");
                handle.stop_dirty_log().expect("stop the dirty log");
                let off = handle.take_dirty(0);
                (second, d, off)
            })
            .expect("spawn")
    };
    let (second, d, off) = mig.join().expect("the migration thread");
    println!(
        "round 2: {} to {} MiB: {:x?}",
        (resumed - start) >> 20,
        (second - start) >> 20,
        runs(&d)
    );
    written_exactly(&d, start..resumed, second);

    // Stopped: KVM has no log for the slot any more, and the guest finishes normally.
    assert!(!handle.dirty_logging());
    assert!(
        matches!(off, Err(DirtyLogError::Off { slot: 0, .. })),
        "{off:?}"
    );
    handle.resume().expect("resume");
    let (report, vm) = runner.join().expect("runner");
    let report = report.expect("run");
    assert_eq!(
        report.status,
        RunStatus::Completed,
        "{}",
        report.render_text()
    );
    let PayloadResult::Touch(t) = &report.vcpus[0].result else {
        panic!("{:?}", report.vcpus[0].result)
    };
    assert_eq!(t.bytes, size);
    // The VMM's writes above were overwritten by the guest's pattern, like every page.
    assert_eq!(
        touch::first_untouched(vm.ram().guest_memory(), start, size),
        None
    );
    drop(vm);
    assert!(matches!(
        handle.start_dirty_log(),
        Err(DirtyLogError::VmGone)
    ));
}

/// Plans `toml` against a synthetic two-node host, then remaps it onto this one: vCPU `i` on
/// CPU `i % 2`, both cells on node 0, in 2 MiB hugepages (`hugepages`) or anonymous shared
/// memory. The guest still has two cells, each its own memslot and backing file.
fn two_cell_plan(toml: &str, hugepages: bool) -> vmhost_plan::Plan {
    let spec = vmhost_config::from_toml_str(toml, "dirty.toml")
        .expect("spec")
        .spec;
    let mut host = vmhost_topology::load_synthetic("package:2 numa:1 core:1 pu:1").expect("host");
    let pools = vmhost_topology::parse_hugepages_arg("node0:2Mi=64,node1:2Mi=64").expect("pools");
    vmhost_topology::apply_hugepages(&mut host, &pools).expect("pools");
    let mut plan = vmhost_plan::plan(&spec, &host, &Default::default())
        .into_result()
        .expect("plan");
    assert_eq!(plan.guest_cells.len(), 2, "{plan:#?}");
    for v in &mut plan.vcpus {
        v.host_cpu = Some(v.vcpu % 2);
        v.host_node = Some(0);
    }
    for c in &mut plan.guest_cells {
        c.host_node = Some(0);
        c.prefault_cpus = vec![0, 1];
    }
    plan.emulator.host_cpus = vec![0, 1];
    plan.floating_cpus.clear();
    let pages: u64 = plan.envelope.hugepages.iter().map(|d| d.count).sum();
    plan.envelope.hugepages.clear();
    if hugepages {
        plan.envelope.hugepages.push(vmhost_plan::HugepageDemand {
            node: Some(0),
            page_size_bytes: 2 << 20,
            count: pages,
        });
    } else {
        plan.backing = vmhost_plan::Backing::Anonymous;
    }
    plan
}

#[test]
fn take_dirty_maps_each_cells_memslot_and_sees_vmm_writes_while_the_guest_runs() {
    let test = "take_dirty_maps_each_cells_memslot_and_sees_vmm_writes_while_the_guest_runs";
    if !kvm_available(test) {
        return;
    }
    let _cpus = lock_cpus();
    check_two_cells("dirty-cells", false);
}

#[test]
fn take_dirty_reports_4k_pages_of_2m_hugepage_backed_cells() {
    let test = "take_dirty_reports_4k_pages_of_2m_hugepage_backed_cells";
    if !kvm_available(test) || !hugepages_wanted(test) {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_hugepages();
    require_2m_hugepages(test, 32);
    check_two_cells("dirty-huge", true);
}

/// An idle two-cell guest (64 MiB, 32 MiB per cell) with the dirty log on: VMM writes show in
/// their own cell at their offset, at 4 KiB granularity whatever the backing page size.
fn check_two_cells(name: &str, hugepages: bool) {
    let toml = format!(
        "name = \"{name}\"\n[cpu]\ncores = 2\ndedicated_cpu_placement = true\n\
         numa = {{ guest_mapping_passthrough = true }}\n\
         [memory]\nguest = \"64Mi\"\nhugepages = {{ page_size = \"2Mi\" }}\n\
         [boot]\npayload = \"idle\"\n"
    );
    let plan = two_cell_plan(&toml, hugepages);
    // File-backed RAM, as vmhost runs guests: one region per cell, each with its bitmap.
    let ram = memory(&plan);
    let mem = ram.memory().clone();
    let cells: Vec<_> = ram.layout().regions.clone();
    assert_eq!(cells.len(), 2, "{cells:?}");
    assert_eq!((cells[1].cell, cells[1].file_offset), (1, 0));
    let mut vm = Vm::new(&plan, ram, VmOptions::default()).expect("VM");
    let handle = vm.handle();
    let stop = vm.stop_handle();
    let runner = std::thread::spawn(move || vm.run());
    assert!(wait_for(60, || stop.ready_vcpus() == 2), "vCPUs ready");

    handle.start_dirty_log().expect("start the dirty log");
    let p = DIRTY_PAGE_BYTES;
    // The idle guest writes only its RAM pattern pages: nothing else is dirty while it runs.
    let (gpa0, gpa1) = (cells[0].gpa, cells[1].gpa);
    let d0 = handle.take_dirty(0).expect("cell 0");
    assert!(runs_besides_pattern(&d0, &handle, 2, gpa0).is_empty());
    let d1 = handle.take_dirty(1).expect("cell 1");
    assert!(runs_besides_pattern(&d1, &handle, 2, gpa1).is_empty());
    // A VMM write at the end of cell 0 and one 5 pages into cell 1 (guest-physical: after
    // cell 0): each reported in its own cell, at its offset in that cell.
    let end0 = cells[0].gpa + cells[0].size_bytes;
    mem.write_obj(7u64, GuestAddress(end0 - 8)).expect("write");
    mem.write_obj(9u16, GuestAddress(cells[1].gpa + 5 * p + 2))
        .expect("write");
    let d0 = handle.take_dirty(0).expect("cell 0");
    let d1 = handle.take_dirty(1).expect("cell 1");
    let size0 = cells[0].size_bytes;
    let besides = |d: &DirtyBitmap, gpa: u64| runs_besides_pattern(d, &handle, 2, gpa);
    assert_eq!(besides(&d0, gpa0), vec![size0 - p..size0]);
    assert_eq!(besides(&d1, gpa1), vec![5 * p..6 * p]);
    assert_eq!(d1.size_bytes(), cells[1].size_bytes);
    let again = handle.take_dirty(1).expect("cell 1");
    assert!(besides(&again, gpa1).is_empty(), "cleared");

    handle.stop_dirty_log().expect("stop the dirty log");
    assert_eq!(handle.state(), vmhost_vcpu::VmState::Running);
    handle.stop();
    let report = runner.join().expect("runner").expect("run");
    assert_eq!(
        report.status,
        RunStatus::Stopped,
        "{}",
        report.render_text()
    );

    // The VM was dropped at the end of its run: a live handle does not keep its RAM mapped.
    drop(mem);
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    assert!(
        !maps.contains(&format!("vmhost:{name}:cell")),
        "guest RAM still mapped:\n{maps}"
    );
    assert!(matches!(handle.take_dirty(0), Err(DirtyLogError::VmGone)));
}

#[test]
fn guest_writes_to_hugepage_backed_ram_are_logged_page_by_page() {
    let test = "guest_writes_to_hugepage_backed_ram_are_logged_page_by_page";
    if !kvm_available(test) || !hugepages_wanted(test) {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_hugepages();
    require_2m_hugepages(test, 16);
    let plan = plan_toml(
        "name = \"dirty-touch-huge\"\n[cpu]\ncores = 1\n[memory]\nguest = \"32Mi\"\n\
         hugepages = { page_size = \"2Mi\" }\n[boot]\npayload = \"touch\"\n",
    );
    let ram = memory(&plan);
    let size = ram.layout().ram_bytes();
    let mut vm = Vm::new(&plan, ram, VmOptions::default()).expect("VM");
    let handle = vm.handle();
    // On before the guest starts: every page `touch` writes (all of RAM) is in the log, each
    // 4 KiB page on its own although a 2 MiB page backs it.
    handle.start_dirty_log().expect("start the dirty log");
    let report = vm.run().expect("run");
    assert_eq!(
        report.status,
        RunStatus::Completed,
        "{}",
        report.render_text()
    );
    let d = handle.take_dirty(0).expect("take_dirty after the run");
    assert_eq!(d.dirty_pages(), size / DIRTY_PAGE_BYTES);
    assert_eq!(runs(&d), vec![0..size]);
    assert!(handle.take_dirty(0).expect("take_dirty").is_empty());
    handle.stop_dirty_log().expect("stop the dirty log");
}
