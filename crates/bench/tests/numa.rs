//! The benchmark's machinery on the live host, never its timings: the host chases the guest's
//! own chain, the chase visits every line once per lap, the stream reads the bytes it claims,
//! results arrive from every vCPU, and each scenario's policy and pinning read back from the
//! kernel as named.
//!
//! KVM tests need `/dev/kvm` (opt out: `VMHOST_SKIP_KVM_TESTS=1`), hugepage tests free 2 MiB
//! pages (opt out: `VMHOST_SKIP_HUGEPAGE_TESTS=1`).

use std::collections::BTreeSet;

use vm_memory::{Bytes, GuestAddress};
use vmhost_bench::host::{allocate, run_threads};
use vmhost_bench::scenario::{baseline_plan, interleave_setup, setup};
use vmhost_bench::{kernel, run_planned, BenchArgs, BenchError, Planned, Scenario, ScenarioReport};
use vmhost_memory::{GuestMemory, MemoryOptions, Progress};
use vmhost_plan::{plan, Plan, PlanOptions};
use vmhost_testsupport::{lock_cpus, lock_pool, need_kvm, need_pages};
use vmhost_topology::HostTopology;
use vmhost_vcpu::payload::bench::LINE;
use vmhost_vcpu::{BenchOptions, Vm, VmOptions};

const MIB: u64 = 1 << 20;

fn live_plan(memory: &str, hugepages: bool) -> (Plan, HostTopology) {
    let cpus = vmhost_memory::sys::current_affinity()
        .expect("affinity")
        .len();
    let toml = format!(
        "name = \"benchtest\"\n[cpu]\ncores = {}\ndedicated_cpu_placement = true\n\
         [memory]\nguest = \"{memory}\"\n{}[boot]\npayload = \"halt\"\n",
        cpus.min(2),
        if hugepages {
            "hugepages = { page_size = \"2Mi\" }\n"
        } else {
            ""
        }
    );
    let spec = vmhost_config::from_toml_str(&toml, "test.toml")
        .expect("spec")
        .spec;
    let host = vmhost_topology::discover().expect("topology");
    let plan = plan(&spec, &host, &PlanOptions::default())
        .into_result()
        .expect("the test VM fits this host");
    (plan, host)
}

fn quiet() -> MemoryOptions {
    let mut o = MemoryOptions::default();
    o.prefault.progress = Progress::Hidden;
    o
}

fn bench(ws: u64) -> BenchOptions {
    BenchOptions {
        working_set_bytes: Some(ws),
        chase_loads: Some(ws / LINE),
        stream_passes: Some(3),
    }
}

#[test]
fn host_baseline_chases_the_guests_own_chain() {
    if !need_kvm("host_baseline_chases_the_guests_own_chain") {
        return;
    }
    let _cpus = lock_cpus();
    let (plan, host) = live_plan("16Mi", false);
    let s = setup(Scenario::Pinned, &plan, &host).expect("pinned");
    let ws = 4 * MIB;
    // The guest's chain, as Vm::new writes it into guest RAM.
    let mem = GuestMemory::new(&s.plan, &quiet()).expect("guest memory");
    let vm = Vm::new(
        &s.plan,
        mem,
        VmOptions {
            bench: bench(ws),
            ..VmOptions::default()
        },
    )
    .expect("VM");
    let guest_mem = vm.ram().guest_memory();
    let region = vm.ram().guest_layout().regions[0];
    // The host's, relocated into its own memory.
    let hm = allocate(
        "test",
        &baseline_plan(&s, ws),
        &quiet(),
        &bench(ws),
        s.plan.vcpus.len(),
    )
    .expect("host memory");
    let c = &hm.cells[0];
    assert_eq!(c.slot.stream_len, ws);
    for line in 0..ws / LINE {
        let g: u64 = guest_mem
            .read_obj(GuestAddress(region.gpa + line * LINE))
            .expect("guest link");
        let h: u64 = hm
            .mem
            .memory()
            .read_obj(GuestAddress(c.gpa + line * LINE))
            .expect("host link");
        assert_eq!(
            g - region.gpa,
            h - c.base,
            "line {line}: guest and host chains differ"
        );
    }
}

#[test]
fn host_chase_visits_every_line_once_per_lap_and_stream_reads_its_bytes() {
    let _cpus = lock_cpus();
    let (plan, host) = live_plan("16Mi", false);
    let s = setup(Scenario::Pinned, &plan, &host).expect("pinned");
    let ws = 2 * MIB;
    let hm = allocate("test", &baseline_plan(&s, ws), &quiet(), &bench(ws), 2).expect("memory");
    let c = &hm.cells[0];
    let lines = ws / LINE;
    // Walk the relocated chain: every line once, back to the start after `lines` links.
    let mut seen = BTreeSet::new();
    let mut at = c.starts[0];
    for _ in 0..lines {
        assert!((c.base..c.base + ws).contains(&at) && at % LINE == 0);
        assert!(seen.insert(at), "line {at:#x} visited twice in one lap");
        at = hm
            .mem
            .memory()
            .read_obj(GuestAddress(at - c.base + c.gpa))
            .expect("link");
    }
    assert_eq!(seen.len() as u64, lines);
    assert_eq!(at, c.starts[0], "the lap closes");
    assert_ne!(
        c.starts[0], c.starts[1],
        "threads enter the cycle at different lines"
    );
    // SAFETY: the chain was built and relocated inside `hm`, which is alive and unchanged.
    let lap = unsafe { kernel::chase(c.starts[1], lines / kernel::LOADS_PER_ITER) };
    assert_eq!(
        lap.end, c.starts[1],
        "one lap of the kernel ends where it began"
    );
    // The threads report exactly the loads and bytes they were given.
    let cpus = vec![s.thread_cpus()[0].clone(), s.thread_cpus()[0].clone()];
    let out = run_threads(&hm, &cpus).expect("threads");
    assert_eq!(out.len(), 2);
    for t in &out {
        assert_eq!(t.cpus_allowed, cpus[0]);
        assert_eq!(t.cells[0].loads, lines);
        assert_eq!(t.cells[0].bytes, 3 * ws);
        assert!(t.cells[0].chase.cycles > 0 && t.cells[0].stream.cycles > 0);
    }
    // The stream's accumulators saw every word: the chain's links are all that is non-zero,
    // so three passes sum to three times the sum of the links.
    let mut links = 0u64;
    for line in 0..lines {
        let v: u64 = hm
            .mem
            .memory()
            .read_obj(GuestAddress(c.gpa + line * LINE))
            .expect("link");
        links = links.wrapping_add(v);
    }
    let sums = out[0].cells[0].stream.sums;
    let total = sums.iter().fold(0u64, |a, s| a.wrapping_add(*s));
    assert_eq!(total, links.wrapping_mul(3));
}

#[test]
fn a_cell_smaller_than_the_working_set_names_the_memory_needed() {
    let (plan, host) = live_plan("16Mi", false);
    let mut args = BenchArgs::new(plan, host);
    args.working_set_bytes = Some(32 * MIB);
    let err = vmhost_bench::run(&args).expect_err("16Mi cannot hold 32Mi");
    assert!(
        matches!(err, BenchError::CellTooSmall { cell: 0, working_set, .. } if working_set == 32 * MIB),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("set memory.guest to at least 32Mi"),
        "{err}"
    );
}

/// Every vCPU × cell has 2 runs on each side, and memory policy and pinning read back as
/// planned.
fn assert_measured_with_policy(r: &ScenarioReport, plan: &Plan, policy: &str) {
    let s = r.scenario;
    assert_eq!(r.skipped, None);
    assert_eq!(
        r.entries.len(),
        plan.vcpus.len() * plan.guest_cells.len(),
        "{s}"
    );
    for e in &r.entries {
        for c in [&e.latency_ns, &e.bandwidth_gb_per_s] {
            assert_eq!(
                (c.guest.runs, c.host.runs, c.ratio.runs),
                (2, 2, 2),
                "{s}: {e:?}"
            );
            assert_eq!((c.guest_runs.len(), c.host_runs.len()), (2, 2));
        }
    }
    let rb = r.readback.as_ref().expect("read back");
    for p in rb.guest_memory.iter().chain(&rb.host_memory) {
        assert_eq!(p.expected, policy);
        assert!(
            p.numa_maps.starts_with(policy),
            "{s}: numa_maps {}",
            p.numa_maps
        );
        assert!(p.matches, "{s}: {p:?}");
    }
    assert_eq!(rb.vcpu_threads.len(), plan.vcpus.len());
    assert!(rb.all_match(), "{s}: {rb:?}");
}

#[test]
fn every_scenario_measures_every_vcpu_and_reads_back_its_placement() {
    if !need_kvm("every_scenario_measures_every_vcpu") {
        return;
    }
    let _cpus = lock_cpus();
    let _pool = lock_pool();
    if !need_pages("every_scenario_measures_every_vcpu", 2 * MIB, 16) {
        return;
    }
    let (plan, host) = live_plan("16Mi", true);
    let mut args = BenchArgs::new(plan.clone(), host.clone());
    args.repeat = 2;
    args.working_set_bytes = Some(8 * MIB);
    args.stream_passes = 2;
    let planned: Vec<Planned> = vec![
        Ok(setup(Scenario::Pinned, &plan, &host).expect("pinned")),
        Ok(setup(Scenario::Floating, &plan, &host).expect("floating")),
        setup(Scenario::Remote, &plan, &host).map_err(|r| (Scenario::Remote, r)),
        // Interleave over node 0 only: runs on one-node hosts too, and is visible in numa_maps.
        Ok(interleave_setup(&plan, vec![0])),
    ];
    let report = run_planned(&args, planned).expect("bench");
    println!("{report}");
    let by = |s: Scenario| {
        report
            .scenarios
            .iter()
            .find(|r| r.scenario == s)
            .expect("scenario")
    };
    let nodes = host.nodes.len();
    if nodes < 2 {
        assert_eq!(
            by(Scenario::Remote).skipped.as_deref(),
            Some(format!("needs ≥ 2 NUMA nodes, host has {nodes}").as_str())
        );
    }
    let node = plan.guest_cells[0].host_node.expect("bound");
    for (s, policy) in [
        (Scenario::Pinned, format!("bind:{node}")),
        (Scenario::Floating, format!("bind:{node}")),
        (Scenario::Interleave, "interleave:0".to_string()),
    ] {
        assert_measured_with_policy(by(s), &plan, &policy);
    }
    let floating = by(Scenario::Floating).readback.as_ref().expect("read back");
    assert!(floating
        .vcpu_threads
        .iter()
        .all(|t| t.cpus_allowed == host.allowed_cpus));
    let pinned = by(Scenario::Pinned).readback.as_ref().expect("read back");
    for (t, v) in pinned.vcpu_threads.iter().zip(&plan.vcpus) {
        assert_eq!(t.cpus_allowed, vec![v.host_cpu.expect("pinned")]);
    }
    let json = serde_json::to_value(&report).expect("json");
    assert_eq!(json["scenarios"][0]["scenario"], "pinned");
    let svg = vmhost_bench::render_svg(&report);
    assert_eq!(svg.matches("<rect").count(), 1 + 3 * 6 * plan.vcpus.len());
    assert!(report.to_string().contains("latency (ns)"));
}
