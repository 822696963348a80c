use vmhost_config::from_toml_str;
use vmhost_topology::{load_synthetic, HostTopology};

use super::*;
use crate::{plan, render_text, OverheadModel, Plan, PlanOptions};

/// A VM with `cpu`, `head` (top-level keys), disks named by `disks` (a trailing `*` asks for
/// a dedicated I/O thread), rng and `extra` devices.
fn vm(head: &str, cpu: &str, disks: &str, extra: &str) -> VmSpec {
    let mut text =
        format!("{head}\n[cpu]\n{cpu}\n[memory]\nguest = \"256Mi\"\n[devices]\nrng = {{}}\n");
    for d in disks.split_whitespace() {
        let name = d.trim_end_matches('*');
        let dedicated = d.ends_with('*');
        text.push_str(&format!(
            "[[devices.disks]]\nname = \"{name}\"\ndedicated_io_thread = {dedicated}\n"
        ));
    }
    for d in disks.split_whitespace() {
        let name = d.trim_end_matches('*');
        text.push_str(&format!(
            "[[volumes]]\nname = \"{name}\"\nempty_disk = {{ capacity = \"1Mi\" }}\n"
        ));
    }
    text.push_str(extra);
    from_toml_str(&text, "t.toml").unwrap().spec
}

fn host(desc: &str) -> HostTopology {
    load_synthetic(desc).unwrap()
}

fn fits(s: &VmSpec, h: &HostTopology) -> Plan {
    plan(s, h, &PlanOptions::default()).into_result().unwrap()
}

/// (role, device slot kinds) per thread.
fn layout(p: &Plan) -> Vec<(IoThreadRole, Vec<VirtioKind>)> {
    p.devices
        .io_threads
        .iter()
        .map(|t| {
            let kinds = t
                .devices
                .iter()
                .map(|&i| p.devices.slots[i].device)
                .collect();
            (t.role, kinds)
        })
        .collect()
}

fn vcpu_pus(p: &Plan) -> Vec<u32> {
    p.vcpus.iter().filter_map(|v| v.host_cpu).collect()
}

const DEDICATED_ISOLATED: &str =
    "cores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true";
const SHARED_2: &str = "cores = 2";

#[test]
fn no_policy_one_thread_serves_every_device() {
    let s = vm("", SHARED_2, "a b", "");
    assert_eq!(kubevirt_count(&s), (0, 0), "KubeVirt: no IOThreads");
    let p = fits(&s, &host("package:1 numa:1 core:2 pu:1"));
    use VirtioKind::*;
    assert_eq!(
        layout(&p),
        [(IoThreadRole::Shared, vec![Disk(0), Disk(1), Rng])]
    );
    let t = &p.devices.io_threads[0];
    assert_eq!(t.name, "vmhost-io-0");
    assert_eq!(
        t.host_cpus, p.emulator.host_cpus,
        "floats with the emulator"
    );
    assert!(!t.exclusive);
}

#[test]
fn shared_policy_one_shared_thread_plus_one_per_dedicated_disk() {
    let s = vm("io_threads_policy = \"shared\"", SHARED_2, "a b* c", "");
    // KubeVirt: 2 shared + 1 dedicated disks exceed the limit 1: shared = max(1 - 1, 1).
    assert_eq!(kubevirt_count(&s), (2, 1));
    let p = fits(&s, &host("package:1 numa:1 core:2 pu:1"));
    use VirtioKind::*;
    assert_eq!(
        layout(&p),
        [
            (IoThreadRole::Shared, vec![Disk(0), Disk(2), Rng]),
            (IoThreadRole::Dedicated, vec![Disk(1)]),
        ]
    );
    assert_eq!(p.devices.io_threads[1].name, "vmhost-io-1");
    // KubeVirt's quirk: two dedicated disks and nothing else still give a shared thread.
    let s = vm("io_threads_policy = \"shared\"", SHARED_2, "a* b*", "");
    assert_eq!(kubevirt_count(&s), (3, 1));
    let p = fits(&s, &host("package:1 numa:1 core:2 pu:1"));
    assert_eq!(
        layout(&p),
        [
            (IoThreadRole::Shared, vec![Rng]),
            (IoThreadRole::Dedicated, vec![Disk(0)]),
            (IoThreadRole::Dedicated, vec![Disk(1)]),
        ]
    );
}

#[test]
fn auto_policy_sizes_the_pool_by_the_cpu_request() {
    // requests.cpu = 2 → limit 4; 4 shared disks + 1 dedicated exceed it → 3 shared threads.
    let s = vm(
        "io_threads_policy = \"auto\"",
        SHARED_2,
        "a b c d e*",
        "[resources.requests]\ncpu = 2\n",
    );
    assert_eq!(kubevirt_count(&s), (4, 3));
    let p = fits(&s, &host("package:1 numa:1 core:2 pu:1"));
    use VirtioKind::*;
    assert_eq!(
        layout(&p),
        [
            (IoThreadRole::Shared, vec![Disk(0), Disk(3), Rng]),
            (IoThreadRole::Shared, vec![Disk(1)]),
            (IoThreadRole::Shared, vec![Disk(2)]),
            (IoThreadRole::Dedicated, vec![Disk(4)]),
        ]
    );
    // Under the limit every shared disk gets its own thread; no request → limit 2 (1 CPU).
    let s = vm("io_threads_policy = \"auto\"", SHARED_2, "a b", "");
    assert_eq!(kubevirt_count(&s), (2, 2));
    let s = vm("io_threads_policy = \"auto\"", SHARED_2, "a b c", "");
    assert_eq!(kubevirt_count(&s), (2, 2));
    // "500m" rounds up to 1 CPU like Quantity.Value().
    let s = vm(
        "io_threads_policy = \"auto\"",
        SHARED_2,
        "a b c",
        "[resources.requests]\ncpu = \"500m\"\n",
    );
    assert_eq!(kubevirt_count(&s), (2, 2));
    // Dedicated CPUs with an isolated emulator: limit 1 (the IOThread shares its PU).
    let s = vm(
        "io_threads_policy = \"auto\"",
        DEDICATED_ISOLATED,
        "a b c",
        "",
    );
    assert_eq!(kubevirt_count(&s), (1, 1));
}

#[test]
fn isolated_emulator_shares_its_pus_with_the_io_threads() {
    let s = vm(
        "io_threads_policy = \"shared\"",
        DEDICATED_ISOLATED,
        "a b*",
        "",
    );
    let p = fits(&s, &host("package:1 numa:1 core:2 pu:1"));
    assert_eq!(p.devices.io_threads.len(), 2);
    for t in &p.devices.io_threads {
        assert_eq!(t.host_cpus, p.emulator.host_cpus, "{}", t.name);
        assert!(!t.host_cpus.iter().any(|c| vcpu_pus(&p).contains(c)));
        assert!(!t.exclusive);
    }
    assert_eq!(p.envelope.dedicated_cpus, 2, "no PU beyond vCPU + emulator");
}

#[test]
fn without_an_isolated_emulator_io_threads_avoid_vcpu_pus_or_are_refused() {
    let h = host("package:1 numa:1 core:2 pu:1");
    let s = vm("", "cores = 1\ndedicated_cpu_placement = true", "a", "");
    let p = fits(&s, &h);
    let vcpu = vcpu_pus(&p);
    let spare: Vec<u32> = h
        .allowed_cpus
        .iter()
        .copied()
        .filter(|c| !vcpu.contains(c))
        .collect();
    assert_eq!(p.devices.io_threads[0].host_cpus, spare);
    assert_eq!(
        p.emulator.host_cpus, vcpu,
        "the emulator itself still shares the vCPU PU"
    );
    // Both PUs taken by vCPUs: nowhere for the I/O thread.
    let s = vm("", "cores = 2\ndedicated_cpu_placement = true", "a", "");
    let o = plan(&s, &h, &PlanOptions::default());
    assert!(!o.fits);
    assert!(
        o.reasons[0].contains("never run on vCPU PUs")
            && o.reasons[0].contains("isolate_emulator_thread"),
        "{:?}",
        o.reasons
    );
    // A payload VM without devices has no I/O thread and fits as before.
    let s = from_toml_str(
        "[cpu]\ncores = 2\ndedicated_cpu_placement = true\n[memory]\nguest = \"256Mi\"\n",
        "t",
    )
    .unwrap()
    .spec;
    assert!(fits(&s, &h).devices.io_threads.is_empty());
}

const POOL_2: &str =
    "io_threads_policy = \"supplementalPool\"\nio_threads = { supplemental_pool_thread_count = 2 }";

#[test]
fn supplemental_pool_takes_dedicated_pus_of_its_own() {
    let s = vm(POOL_2, DEDICATED_ISOLATED, "a b* c", "");
    assert_eq!(kubevirt_count(&s), (2, 0));
    let p = fits(&s, &host("package:1 numa:1 core:4 pu:1"));
    use VirtioKind::*;
    assert_eq!(
        layout(&p),
        [
            (IoThreadRole::SupplementalPool, vec![Disk(0), Disk(2), Rng]),
            (IoThreadRole::SupplementalPool, vec![Disk(1)]),
        ],
        "dedicated_io_thread is moot with a pool (KubeVirt gives every disk the pool)"
    );
    let mut all: Vec<u32> = vcpu_pus(&p);
    all.extend(&p.emulator.host_cpus);
    for t in &p.devices.io_threads {
        assert_eq!(t.host_cpus.len(), 1);
        assert!(t.exclusive);
        all.extend(&t.host_cpus);
    }
    all.sort_unstable();
    all.dedup();
    assert_eq!(
        all.len(),
        4,
        "vCPU, 2 pool PUs and the emulator all distinct"
    );
    assert_eq!(p.envelope.dedicated_cpus, 4);
    assert!((p.envelope.cpus - 4.0).abs() < f64::EPSILON);
    // Without an isolated emulator the pool still gets its own PUs.
    let s = vm(POOL_2, "cores = 1\ndedicated_cpu_placement = true", "a", "");
    let p = fits(&s, &host("package:1 numa:1 core:3 pu:1"));
    assert_eq!(p.envelope.dedicated_cpus, 3);
    assert!(p.devices.io_threads.iter().all(|t| t.exclusive));
}

#[test]
fn supplemental_pool_refused_precisely_when_the_host_lacks_pus() {
    let s = vm(POOL_2, DEDICATED_ISOLATED, "a", "");
    let o = plan(
        &s,
        &host("package:1 numa:1 core:3 pu:1"),
        &PlanOptions::default(),
    );
    assert!(!o.fits);
    assert_eq!(
        o.reasons,
        ["dedicated placement needs 4 PUs (1 vCPUs + 2 supplemental I/O thread PUs + 1 isolated emulator thread), the host allows 3 free"]
    );
}

#[test]
fn supplemental_pool_counts_towards_even_parity() {
    let parity = "cores = 1\ndedicated_cpu_placement = true\nisolate_emulator_thread = true\nemulator_thread_complete_to_even_parity = true";
    let pool_1 =
        "io_threads_policy = \"supplementalPool\"\nio_threads = { supplemental_pool_thread_count = 1 }";
    // 1 vCPU + 1 pool PU is even → the emulator gets 2 PUs (KubeVirt pins the pool first).
    let s = vm(pool_1, parity, "a", "");
    assert_eq!(s.emulator_pus(), 2);
    let p = fits(&s, &host("package:1 numa:1 core:4 pu:1"));
    assert_eq!(p.emulator.host_cpus.len(), 2);
    assert_eq!(p.envelope.dedicated_cpus, 4);
    // 1 vCPU alone is odd → 1.
    let s = vm("", parity, "a", "");
    assert_eq!(s.emulator_pus(), 1);
}

#[test]
fn shared_placement_pool_adds_to_the_cpu_request() {
    let s = vm(POOL_2, SHARED_2, "a", "");
    let p = fits(&s, &host("package:1 numa:1 core:2 pu:1"));
    // KubeVirt: (2 vCPUs + 2 pool threads) / cpuAllocationRatio 10.
    assert!((p.envelope.cpus - 0.4).abs() < 1e-9, "{}", p.envelope.cpus);
    assert_eq!(p.envelope.dedicated_cpus, 0);
    for t in &p.devices.io_threads {
        assert_eq!(t.host_cpus, p.floating_cpus);
        assert!(!t.exclusive);
    }
}

#[test]
fn overhead_terms_per_io_thread_and_device() {
    use crate::envelope::*;
    let nic =
        "[[devices.interfaces]]\nname = \"n\"\nbridge = {}\n[[networks]]\nname = \"n\"\npod = {}\n";
    let s = vm("io_threads_policy = \"shared\"", SHARED_2, "a b*", nic);
    let h = host("package:1 numa:1 core:2 pu:1");
    let p = fits(&s, &h);
    let t = &p.envelope.overhead_terms;
    assert_eq!(p.devices.io_threads.len(), 2);
    assert_eq!(t["io_threads"], 2 * VMHOST_PER_IO_THREAD);
    assert_eq!(
        t["virtio_blk"],
        2 * (2 * VIRTIO_BLK_MAX_REQUEST + 2 * 4096),
        "two cache=none disks: request and scratch buffers"
    );
    assert_eq!(
        t["virtio_net"],
        33 * 4096,
        "two 65,562-byte frames in pages"
    );
    assert_eq!(t["virtio_rng"], 64 << 10);
    assert_eq!(p.envelope.overhead_bytes, t.values().sum::<u64>());
    // KubeVirt: one static 8Mi IOThread term whatever the count, nothing per device.
    let opts = PlanOptions {
        overhead_model: OverheadModel::Kubevirt,
        ..PlanOptions::default()
    };
    let k = plan(&s, &h, &opts).into_result().unwrap();
    let kt = &k.envelope.overhead_terms;
    assert_eq!(kt["iothread"], 8 << 20);
    assert!(kt
        .keys()
        .all(|n| !n.starts_with("virtio") && n != "io_threads"));
    let text = render_text(&plan(&s, &h, &PlanOptions::default()));
    for want in [
        "I/O threads:",
        "vmhost-io-0   shared",
        "devices: disk a, interface n, rng",
        "vmhost-io-1   dedicated",
        "devices: disk b",
        "virtio_blk",
        "io_threads",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }
}

#[test]
fn on_two_nodes_the_pool_and_emulator_go_with_vcpu0_and_avoid_held_pus() {
    let h = host("package:2 numa:1 core:4 pu:1");
    let node_of = |pu: u32| h.cores.iter().find(|c| c.pus.contains(&pu)).unwrap().node;
    let s = vm(POOL_2, DEDICATED_ISOLATED, "a", "");
    // Another VM holds node 0's first PU.
    let first = h.allowed_cpus[0];
    let opts = PlanOptions {
        held_cpus: [first].into_iter().collect(),
        ..PlanOptions::default()
    };
    let p = plan(&s, &h, &opts).into_result().unwrap();
    let home = p.vcpus[0].host_node.unwrap();
    for t in &p.devices.io_threads {
        assert!(!t.host_cpus.contains(&first), "{} on a held PU", t.name);
        assert_eq!(node_of(t.host_cpus[0]), home, "{} on vCPU 0's node", t.name);
    }
    // Node 0 has 3 free PUs, node 1 has 4: the node set is chosen with room for the pool and
    // the emulator next to vCPU 0, so everything lands on node 1.
    assert_eq!(home, 1);
    assert_eq!(node_of(p.emulator.host_cpus[0]), 1);
    assert!(
        !p.notes.iter().any(|n| n.contains("has no PU left")),
        "{:?}",
        p.notes
    );
}
