//! Spec arithmetic over the whole `u64` range of every quantity field: TOML spec → validate →
//! plan never panics (debug builds check every operation) and never wraps. Either validation
//! fails naming a field, the plan is refused as invalid input naming a field, or the envelope's
//! sums are exactly what u128 arithmetic says they are.
//!
//! Regression for issue 15 #1: `added_overhead = "18446744073709551615"` used to give a total
//! overhead of 6.6 MiB and a memory request of 1030 MiB.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use vmhost_config::{from_toml_str, ConfigError};
use vmhost_plan::{plan, Backing, OverheadModel, PlanOptions};
use vmhost_topology::{apply_hugepages, load_synthetic, parse_hugepages_arg, HostTopology};

fn host() -> HostTopology {
    let mut h = load_synthetic("package:1 numa:2 core:4 pu:2").unwrap();
    let pools = "node0:2Mi=1000000,node1:2Mi=1000000,node0:1Gi=4096,node1:1Gi=4096";
    apply_hugepages(&mut h, &parse_hugepages_arg(pools).unwrap()).unwrap();
    h
}

/// Any u64, with the edges (0, powers of two and their neighbours, 2^64 - 1) and whole GiB
/// counts weighted in.
fn bytes() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        (0u32..64).prop_map(|b| 1u64 << b),
        (0u32..64).prop_map(|b| (1u64 << b).wrapping_sub(1)),
        (1u64..=1 << 22).prop_map(|n| n << 30),
        Just(u64::MAX),
        Just(0),
    ]
}

/// A CPU quantity in milli-CPUs over the whole u64 range.
fn millis() -> impl Strategy<Value = u64> {
    prop_oneof![any::<u64>(), 0u64..=8000, Just(u64::MAX)]
}

#[derive(Debug, Clone)]
struct Input {
    guest: Option<u64>,
    added: Option<u64>,
    req_mem: Option<u64>,
    lim_mem: Option<u64>,
    req_cpu: Option<u64>,
    lim_cpu: Option<u64>,
    topology: Option<(u32, u32, u32)>,
    page: Option<&'static str>,
    dedicated: bool,
    kubevirt: bool,
    ratio: Option<f64>,
}

fn input() -> impl Strategy<Value = Input> {
    let sizes = (
        proptest::option::of(bytes()),
        proptest::option::of(bytes()),
        proptest::option::of(bytes()),
        proptest::option::of(bytes()),
    );
    let cpu = (
        proptest::option::of(millis()),
        proptest::option::of(millis()),
        proptest::option::of((any::<u32>(), 0u32..4, 0u32..3)),
    );
    let rest = (
        proptest::option::of(prop_oneof![Just("2Mi"), Just("1Gi")]),
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(prop_oneof![
            Just(1.2f64),
            Just(1e300),
            Just(f64::MAX),
            0.0f64..1e20
        ]),
    );
    (sizes, cpu, rest).prop_map(
        |((guest, added, req_mem, lim_mem), (req_cpu, lim_cpu, topology), (page, d, k, ratio))| {
            Input {
                guest,
                added,
                req_mem,
                lim_mem,
                req_cpu,
                lim_cpu,
                topology,
                page,
                dedicated: d,
                kubevirt: k,
                ratio,
            }
        },
    )
}

fn toml(i: &Input) -> String {
    let mut t = String::from("name = \"p\"\n[cpu]\n");
    if let Some((s, c, th)) = i.topology {
        t += &format!("sockets = {s}\ncores = {c}\nthreads = {th}\n");
    }
    t += &format!("dedicated_cpu_placement = {}\n[memory]\n", i.dedicated);
    if let Some(g) = i.guest {
        t += &format!("guest = \"{g}\"\n");
    }
    if let Some(p) = i.page {
        t += &format!("hugepages = {{ page_size = \"{p}\" }}\n");
    }
    if let Some(a) = i.added {
        t += &format!("reserved_overhead = {{ added_overhead = \"{a}\" }}\n");
    }
    t += "[resources.requests]\n";
    if let Some(m) = i.req_mem {
        t += &format!("memory = \"{m}\"\n");
    }
    if let Some(c) = i.req_cpu {
        t += &format!("cpu = \"{c}m\"\n");
    }
    t += "[resources.limits]\n";
    if let Some(m) = i.lim_mem {
        t += &format!("memory = \"{m}\"\n");
    }
    if let Some(c) = i.lim_cpu {
        t += &format!("cpu = \"{c}m\"\n");
    }
    t
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn spec_to_plan_never_panics_and_never_wraps(i in input()) {
        let text = toml(&i);
        let spec = match from_toml_str(&text, "p.toml") {
            Ok(l) => l.spec,
            Err(ConfigError::Invalid(errors)) => {
                prop_assert!(errors.iter().all(|e| !e.field.is_empty()), "{errors:?}");
                return Ok(());
            }
            // A quantity beyond what Kubernetes can hold fails to parse, naming the text.
            Err(ConfigError::Toml { message, .. }) => {
                prop_assert!(message.contains("quantity"), "{message}");
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
        };
        let opts = PlanOptions {
            overhead_model: if i.kubevirt { OverheadModel::Kubevirt } else { OverheadModel::Vmhost },
            overhead_ratio: i.ratio,
            ..PlanOptions::default()
        };
        let outcome = plan(&spec, &host(), &opts);
        if outcome.invalid_input() {
            prop_assert!(
                outcome.reasons.iter().any(|r| r.starts_with("--overhead-ratio")
                    || r.starts_with("memory.")
                    || r.starts_with("resources.")
                    || r.starts_with("cpu.")),
                "{:?}",
                outcome.reasons
            );
            return Ok(());
        }
        let e = &outcome.plan.envelope;
        let terms: u128 = e.overhead_terms.values().map(|&v| u128::from(v)).sum();
        prop_assert_eq!(u128::from(e.overhead_bytes), terms);
        // Guest RAM is the quantity rounded up to whole pages (KubeVirt accepts `1G`); the
        // overhead and requests use the exact quantity.
        let guest = u128::from(spec.memory.guest_ram_bytes());
        prop_assert_eq!(u128::from(e.guest_memory_bytes), guest);
        let exact = u128::from(spec.memory.guest_bytes);
        let beyond = |b: u64| if spec.memory.hugepages.is_some() {
            u128::from(b).saturating_sub(exact)
        } else {
            u128::from(b)
        };
        let req = spec.resources.requests.memory_bytes.unwrap_or(spec.memory.guest_bytes);
        prop_assert_eq!(u128::from(e.memory_request_bytes), terms + beyond(req));
        if let (false, Some(lim)) = (spec.cpu.dedicated_cpu_placement, spec.resources.limits.memory_bytes) {
            prop_assert_eq!(e.memory_limit_bytes.map(u128::from), Some(terms + beyond(lim)));
        }
        if spec.memory.added_overhead_bytes > 0 {
            prop_assert!(e.overhead_bytes >= spec.memory.added_overhead_bytes);
        }
        if outcome.fits {
            let cells: u128 = outcome.plan.guest_cells.iter().map(|c| u128::from(c.memory_bytes)).sum();
            prop_assert_eq!(cells, guest);
            if let Backing::Hugetlb { page_size_bytes, .. } = outcome.plan.backing {
                let pages: u128 = e.hugepages.iter().map(|h| u128::from(h.count)).sum();
                prop_assert_eq!(pages * u128::from(page_size_bytes), guest);
            }
        }
    }
}
