//! `vmhost-testbed`: the test runner that runs *inside* the emulated multi-NUMA host.
//!
//! `testbed/run.sh` boots the emulated host (QEMU TCG, 2 or 4 NUMA nodes, real cgroup v2,
//! `/dev/kvm` from `kvm_amd`) with this binary and `vmhost` on a 9p share, and the share's
//! `run` script calls `vmhost-testbed --suite 2node|4node`. Every test drives the real `vmhost`
//! binary and checks what it did against the kernel's own account: sysfs, `/proc/<pid>/task`,
//! `numa_maps`, the cgroup v2 files. Each prints one `PASS name` or `FAIL name: why` line; the
//! summary line is `N passed, N failed` and the exit status is 0 only when every test passed.
//! A test that cannot run (a missing node, no `/dev/kvm`) fails: nothing is skipped, and a
//! test that leaves a VM or a cgroup behind fails, naming it. `--list` prints the tests that
//! `--only`/`--skip` select and runs nothing: `testbed/run.sh` counts the PASS lines against it.

mod cgroup_tests;
mod device_bench;
mod device_tests;
mod diagnose;
mod dm_log;
mod first_exit;
mod flight;
mod host;
mod irqchip_tests;
mod kvm_exits;
mod ledger_tests;
mod linux_bench;
mod linux_tests;
mod memory_tests;
mod migration_bench;
mod migration_tests;
mod pci_tests;
mod peers_bench;
mod pod_tests;
mod snapshot_tests;
mod static_keys;
mod text_pages;
mod topology_tests;
mod vm;
mod vsock_af;
mod vsock_tests;
mod watchdog;
mod xhost_tests;

use std::time::Instant;

/// The prefix of every line of a guest's console the runner copies to its output (the
/// emulated host's serial log): testbed/run.sh tells the host's own kernel lines (`[ t] ...`
/// at the start of a line) from a nested guest's by it.
pub const GUEST_PREFIX: &str = "     guest| ";

/// What a test returns: `Err` carries the reason it failed.
pub type Outcome = Result<(), String>;

/// Fails the test with a formatted reason unless the condition holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

type Test = (&'static str, fn(&vm::Env) -> Outcome);

/// The tests of the 2-node host (2 × 2 PUs, 3 GiB and one 1 GiB page per node).
const TWO_NODE: &[Test] = &[
    ("topology_matches_sysfs", topology_tests::matches_sysfs),
    (
        "memory_two_cells_on_two_nodes",
        memory_tests::two_cells_on_two_nodes,
    ),
    ("memory_vm_on_node1_only", memory_tests::vm_on_node1_only),
    (
        "memory_pool_short_on_node1_refused",
        memory_tests::pool_short_on_node1_refused,
    ),
    (
        "memory_1g_pages_per_node",
        memory_tests::one_gig_pages_per_node,
    ),
    (
        "memory_spans_nodes_without_passthrough",
        memory_tests::memory_spans_nodes_without_passthrough,
    ),
    (
        "memory_split_by_vcpus_without_passthrough",
        memory_tests::memory_split_by_vcpus_without_passthrough,
    ),
    (
        "vcpu_realtime_mask_runs_fifo",
        memory_tests::realtime_vcpus_run_fifo,
    ),
    (
        "bench_numa_all_scenarios",
        memory_tests::bench_numa_all_scenarios,
    ),
    ("cgroup_v2_limits_from_plan", cgroup_tests::limits_from_plan),
    (
        "cgroup_v2_envelope_breach_exit_5",
        cgroup_tests::envelope_breach,
    ),
    (
        "cgroup_v2_breach_while_running_exit_5",
        cgroup_tests::breach_while_running,
    ),
    (
        "cgroup_v2_stop_signals_through_the_supervisor",
        cgroup_tests::stop_signals_through_the_supervisor,
    ),
    (
        "cgroup_v2_prefault_inside_the_cgroup",
        cgroup_tests::prefault_inside_the_cgroup,
    ),
    (
        "pod_cgroup_confines_vmhost",
        cgroup_tests::pod_confines_vmhost,
    ),
    (
        "pod_cgroup_refuses_oversized_vm",
        cgroup_tests::pod_refuses_oversized_vm,
    ),
    (
        "pod_memory_on_the_pods_node",
        pod_tests::memory_on_the_pods_node,
    ),
    (
        "pod_hugetlb_limit_refuses",
        pod_tests::hugetlb_limit_refuses,
    ),
    (
        "ledger_two_vms_on_two_nodes",
        ledger_tests::two_vms_then_refusal_then_kill,
    ),
    (
        "linux_vmlinux_two_cells_acpi_shutdown",
        linux_tests::vmlinux_two_cells_acpi_shutdown,
    ),
    (
        "linux_bzimage_one_vcpu_panic_exit_4",
        linux_tests::bzimage_one_vcpu_panic_exit_4,
    ),
    (
        "linux_vmlinux_two_vcpus_poweroff_and_reboot",
        linux_tests::vmlinux_two_vcpus_poweroff_and_reboot,
    ),
    (
        "linux_bzimage_two_vcpus_sigterm_exit_130",
        linux_tests::bzimage_two_vcpus_sigterm_exit_130,
    ),
    (
        "linux_bzimage_from_9p_msize_256k",
        linux_tests::bzimage_from_9p_msize_256k,
    ),
    (
        "linux_vmlinux_from_9p_msize_256k",
        linux_tests::vmlinux_from_9p_msize_256k,
    ),
    (
        "linux_restore_onto_the_other_node",
        snapshot_tests::linux_restore_onto_the_other_node,
    ),
    (
        "vsock_linux_guest_echo_both_ways",
        vsock_tests::linux_guest_echo_both_ways,
    ),
    (
        "vsock_vhost_linux_guest_echo_both_ways",
        vsock_tests::vhost_linux_guest_echo_both_ways,
    ),
    (
        "vsock_vhost_pci_linux_guest_echo_both_ways",
        vsock_tests::vhost_pci_linux_guest_echo_both_ways,
    ),
    ("virtio_pci_linux_guest", pci_tests::virtio_pci_linux_guest),
    (
        "virtio_pci_linux_migration",
        pci_tests::virtio_pci_linux_migration,
    ),
    (
        "split_irqchip_linux_migration",
        irqchip_tests::split_irqchip_linux_migration,
    ),
    (
        "split_irqchip_mmio_linux_guest",
        irqchip_tests::split_irqchip_mmio_linux_guest,
    ),
];

/// The benchmarks of the 2-node host (`testbed/run.sh bench`, `make bench-testbed`): they
/// report vmhost's figures next to QEMU's and fail only when a run fails, never on a timing.
const BENCH: &[Test] = &[
    ("linux_boot_time_vs_qemu", linux_bench::boot_time_vs_qemu),
    ("virtio_vs_qemu", device_bench::virtio_vs_qemu),
    ("linux_boot_vs_peers", peers_bench::linux_boot_vs_peers),
    ("migration_vs_qemu", migration_bench::migration_vs_qemu),
];

/// The tests of the 4-node host (4 × 2 PUs, 1 GiB per node, asymmetric distances).
const FOUR_NODE: &[Test] = &[
    (
        "topology_matches_sysfs_asymmetric",
        topology_tests::matches_sysfs,
    ),
    (
        "memory_four_cells_on_four_nodes",
        memory_tests::four_cells_on_four_nodes,
    ),
    (
        "linux_four_cells_asymmetric",
        linux_tests::four_cells_asymmetric,
    ),
    // The virtio devices under Linux drivers: one boot (device_tests::session) for all.
    (
        "virtio_kubevirt_vmi_boots",
        device_tests::kubevirt_vmi_boots,
    ),
    (
        "virtio_probed_from_acpi_alone",
        device_tests::probed_from_acpi_alone,
    ),
    ("virtio_blk_disk_checksums", device_tests::disk_checksums),
    (
        "virtio_blk_flush_durability",
        device_tests::flush_durability,
    ),
    (
        "virtio_blk_hung_storage_stops",
        device_tests::hung_storage_stops,
    ),
    ("virtio_blk_read_only", device_tests::read_only),
    (
        "virtio_net_ping_and_64mib_each_way",
        device_tests::net_ping_and_64mib_each_way,
    ),
    (
        "virtio_cloud_init_seed_user_data",
        device_tests::cloud_init_seed,
    ),
    ("virtio_rng_hwrng", device_tests::hwrng),
    (
        "migration_linux_between_node_pairs",
        migration_tests::linux_between_node_pairs,
    ),
];

/// The cross-host suite (`testbed/run.sh xhost`, `make bench-testbed`): the 2-node host's
/// role (`--suite xhost --role source`) and the 4-node host's (`--role target`), booted side
/// by side with a network and a common share between them (`xhost_tests`).
const XHOST_SOURCE: &[Test] = &[("xhost_source_migrates", xhost_tests::source_migrates)];
const XHOST_TARGET: &[Test] = &[("xhost_target_receives", xhost_tests::target_receives)];

/// What the command line asks for.
struct Args {
    suite: Option<String>,
    /// `--role source|target`: which side of the cross-host suite this host is.
    role: Option<String>,
    vmhost: String,
    only: Vec<String>,
    /// Tests that passed in an earlier boot of this host (testbed/run.sh, after the emulated
    /// machine locked up): not run again.
    skip: Vec<String>,
    /// `--list`: print the tests that would run, one per line, and run nothing.
    list: bool,
}

fn usage() -> ! {
    eprintln!(
        "usage: vmhost-testbed --suite 2node|4node|bench|xhost [--role source|target] \
         [--vmhost PATH] [--only a,b] [--skip c,d] [--list]"
    );
    std::process::exit(2);
}

fn parse_args(args: &[String]) -> Args {
    let mut a = Args {
        suite: None,
        role: None,
        vmhost: "./vmhost".to_string(),
        only: Vec::new(),
        skip: Vec::new(),
        list: false,
    };
    let mut i = 1;
    while i < args.len() {
        if args[i] == "--list" {
            a.list = true;
            i += 1;
            continue;
        }
        let names = |v: &String| -> Vec<String> {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        };
        match (args[i].as_str(), args.get(i + 1)) {
            ("--suite", Some(v)) => a.suite = Some(v.clone()),
            ("--role", Some(v)) => a.role = Some(v.clone()),
            ("--vmhost", Some(v)) => a.vmhost = v.clone(),
            ("--only", Some(v)) => a.only.extend(names(v)),
            ("--skip", Some(v)) => a.skip.extend(names(v)),
            _ => usage(),
        }
        i += 2;
    }
    a
}

/// The suite's tests that `--only` and `--skip` select, in suite order; exits with a
/// `FAIL testbed_setup` line when either names a test the suite does not have.
fn select(args: &Args) -> (Vec<&'static Test>, usize) {
    let tests = match args.suite.as_deref() {
        Some("2node") => TWO_NODE,
        Some("4node") => FOUR_NODE,
        Some("bench") => BENCH,
        Some("xhost") => match args.role.as_deref() {
            Some("source") => XHOST_SOURCE,
            Some("target") => XHOST_TARGET,
            other => {
                eprintln!("vmhost-testbed: suite xhost needs --role source|target, not {other:?}");
                std::process::exit(2);
            }
        },
        other => {
            eprintln!("vmhost-testbed: unknown suite {other:?} (2node, 4node, bench or xhost)");
            std::process::exit(2);
        }
    };
    for (option, names) in [("--only", &args.only), ("--skip", &args.skip)] {
        if let Some(unknown) = names.iter().find(|o| !tests.iter().any(|(n, _)| n == o)) {
            println!(
                "FAIL testbed_setup: {option} names {unknown:?}, not a test of suite {:?}",
                args.suite
            );
            std::process::exit(1);
        }
    }
    let chosen = tests
        .iter()
        .filter(|(name, _)| args.only.is_empty() || args.only.iter().any(|o| o == name));
    let skipped = chosen
        .clone()
        .filter(|(name, _)| args.skip.iter().any(|s| s == name))
        .count();
    let run = chosen
        .filter(|(name, _)| !args.skip.iter().any(|s| s == name))
        .collect();
    (run, skipped)
}

/// For testing the harness only (testbed/check-harness.sh, `run.sh` passes it into the
/// emulated host): `VMHOST_TESTBED_ABORT_AFTER=N` makes the runner `abort()` once N tests
/// have reported, as a runner that panics or is killed mid-suite would end.
fn abort_after() -> Option<usize> {
    std::env::var("VMHOST_TESTBED_ABORT_AFTER")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// Prints a test's result line. A multi-line reason is indented on its further lines, so no
/// line of it can pass for a kernel line or a result line in the serial log.
fn report(name: &str, secs: f64, outcome: &Outcome) {
    match outcome {
        Ok(()) => println!("PASS {name} ({secs:.1} s)"),
        Err(why) => println!(
            "FAIL {name} ({secs:.1} s): {}",
            why.trim_end().replace('\n', "\n     ")
        ),
    }
}

/// How vmhost reports a Linux guest's triple fault (`rebooted (triple fault, last exception
/// …)`, crates/vcpu/src/report.rs).
const GUEST_TRIPLE_FAULT: &str = "(triple fault, last exception";

/// A failed test's reason that shows a Linux guest triple-faulting where the test did not ask
/// for a reset: on this emulated host, the emulated CPU's fault (docs/testing.md, "Guest triple
/// faults"). The runner stops there and says so (`testbed: emulated CPU fault: …`, no FAIL
/// line); testbed/harness.sh's `emulator_fault` then boots the host again, at most twice in
/// all, for the tests that have not passed. A guest that triple-faults in every boot fails.
fn emulated_cpu_fault(why: &str) -> Option<&str> {
    let at = why.find(GUEST_TRIPLE_FAULT)?;
    // From the report line's `vcpuN …` to the parenthesis that closes the one at `at`:
    // `vcpu0 apic 0 pu 0 cell 0: rebooted (triple fault, last exception Some(14), RIP 0xfff0)`.
    let line_start = why[..at].rfind('\n').map_or(0, |i| i + 1);
    let start = why[line_start..at]
        .rfind("vcpu")
        .map_or(at, |i| line_start + i);
    let mut depth = 0usize;
    let end = why[at..]
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '(' => depth += 1,
                ')' => depth = depth.saturating_sub(1),
                _ => {}
            }
            depth == 0
        })
        .map_or(why.len(), |(i, _)| at + i + 1);
    Some(&why[start..end])
}

/// The emulated host's own kernel's double fault, if its log has one (`traps: PANIC: double
/// fault`): no program can cause one on a correct CPU, and on this emulated one it came with a
/// vmhost vCPU thread in `KVM_RUN` and its nested guest oopsing at the same moment with the
/// same faulting address (docs/testing.md). A test that failed after it failed with it. The
/// kernel's log is read whole from `/dev/kmsg`, without blocking.
fn host_double_fault() -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut kmsg = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .ok()?;
    let mut record = vec![0u8; 8192];
    loop {
        // One record per read; EAGAIN at the end; EPIPE when a record was overwritten.
        match kmsg.read(&mut record) {
            Ok(0) => return None,
            Ok(n) => {
                if let Some(fault) = double_fault_in(&String::from_utf8_lossy(&record[..n])) {
                    return Some(fault);
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
            Err(_) => return None,
        }
    }
}

/// The fault a `/dev/kmsg` record (`prio,seq,usec,flags;message`) says, if it is the kernel's
/// double fault.
fn double_fault_in(record: &str) -> Option<String> {
    let message = record.split_once(';').map_or(record, |(_, m)| m);
    message
        .contains("traps: PANIC: double fault")
        .then(|| format!("the host kernel double-faulted ({})", message.trim()))
}

/// Says that the runner stops on the emulated CPU's fault (a guest's triple fault, or the
/// host kernel's double fault: the line `emulator_fault` in testbed/harness.sh reads), with
/// the test's reason and what KVM saw last on the vCPUs.
fn stop_on_emulated_cpu_fault(
    name: &str,
    secs: f64,
    why: &str,
    fault: &str,
    flight: &Option<flight::Flight>,
) {
    println!(
        "testbed: emulated CPU fault: {fault} in {name} after {secs:.1} s; stopping the runner \
         so that the host is booted again"
    );
    println!("     {}", why.trim_end().replace('\n', "\n     "));
    match flight.as_ref().map(|f| f.last_of_vcpus(80)) {
        Some(Ok(events)) => {
            println!(
                "     KVM's last {} events on vCPU threads (the flight recorder):",
                events.len()
            );
            for e in events {
                println!("     kvm| {e}");
            }
        }
        Some(Err(e)) => println!("     the flight recorder could not be read: {e}"),
        None => {}
    }
}

/// Runs one test, then cleans up after it: a VM or cgroup the test left behind fails it.
fn run_one(env: &vm::Env, test: fn(&vm::Env) -> Outcome) -> Outcome {
    let outcome = test(env);
    let leaked = env.cleanup();
    match (outcome, leaked) {
        (Ok(()), Err(leak)) => Err(format!("it left behind {leak}")),
        (Err(why), Err(leak)) => Err(format!("{why}; and it left behind {leak}")),
        (outcome, Ok(())) => outcome,
    }
}

/// The KVM flight recorder only when asked for (`VMHOST_TESTBED_FLIGHT=1`, passed in by
/// testbed/run.sh; never in the benchmarks, whose VM exits it would slow). Off by default as a
/// precaution: a tracepoint in KVM's exit path is the code the emulated CPU gets wrong
/// (flight.rs). Exits with a `FAIL testbed_setup` line when it cannot start.
fn start_flight(suite: Option<&str>) -> Option<flight::Flight> {
    match (flight::wanted(), suite) {
        (true, Some(suite)) if suite != "bench" => {
            Some(flight::Flight::start().unwrap_or_else(|e| {
                println!("FAIL testbed_setup: starting the KVM flight recorder: {e}");
                std::process::exit(1);
            }))
        }
        _ => None,
    }
}

/// The kernel's static keys held for the run, and the tests' environment; exits with a
/// `FAIL testbed_setup` line when either cannot be had.
fn hold_keys_and_env(vmhost: &str) -> (static_keys::StaticKeyPin, vm::Env) {
    let keys = match static_keys::hold() {
        Ok(keys) => keys,
        Err(e) => {
            println!("FAIL testbed_setup: holding the kernel's static keys: {e}");
            std::process::exit(1);
        }
    };
    let env = match vm::Env::new(vmhost) {
        Ok(env) => env,
        Err(e) => {
            println!("FAIL testbed_setup: {e}");
            println!("0 passed, 1 failed");
            std::process::exit(1);
        }
    };
    (keys, env)
}

/// A run of the tests stopped on the emulated CPU's fault ([`stop_on_emulated_cpu_fault`]
/// said so): the runner exits with status 3.
struct Stopped;

/// Runs `tests` in order, each with its `RUN` and result lines; (passed, failed), or
/// [`Stopped`] at a test that failed with the emulated CPU's fault.
fn run_tests(
    tests: &[&'static Test],
    env: &vm::Env,
    flight: &Option<flight::Flight>,
) -> Result<(usize, usize), Stopped> {
    let abort = abort_after();
    let (mut passed, mut failed) = (0, 0);
    for (name, test) in tests {
        if abort.is_some_and(|n| passed + failed >= n) {
            println!("testbed: VMHOST_TESTBED_ABORT_AFTER: aborting the runner (harness check)");
            std::process::abort();
        }
        println!("RUN  {name}");
        vm::set_step(&format!("test {name}"));
        let start = Instant::now();
        let outcome = run_one(env, *test);
        if let Err(why) = &outcome {
            let fault = emulated_cpu_fault(why)
                .map(|line| format!("a Linux guest triple-faulted ({line})"))
                .or_else(host_double_fault);
            if let Some(fault) = fault {
                stop_on_emulated_cpu_fault(
                    name,
                    start.elapsed().as_secs_f64(),
                    why,
                    &fault,
                    flight,
                );
                return Err(Stopped);
            }
        }
        report(name, start.elapsed().as_secs_f64(), &outcome);
        if outcome.is_ok() {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    Ok((passed, failed))
}

/// Prints the summary line, lets the static keys go and exits: 0 only when every one of the
/// `selected` tests reported and passed, and some test passed in this boot or an earlier one.
fn finish(
    selected: usize,
    (passed, failed): (usize, usize),
    skipped: usize,
    keys: static_keys::StaticKeyPin,
) -> ! {
    println!("{passed} passed, {failed} failed, {skipped} passed in an earlier boot");
    drop(keys);
    // Every selected test must have reported; none selected at all is a failure too.
    let complete = passed + failed == selected && passed + skipped > 0;
    if !complete {
        println!(
            "FAIL testbed_runner: {} tests were to run, {} reported, {skipped} passed earlier",
            selected,
            passed + failed
        );
    }
    std::process::exit(i32::from(failed > 0 || !complete));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let args = parse_args(&args);
    let (tests, skipped) = select(&args);
    if args.list {
        for (name, _) in &tests {
            println!("{name}");
        }
        return;
    }
    watchdog::start();
    let flight = start_flight(args.suite.as_deref());
    let (keys, env) = hold_keys_and_env(&args.vmhost);
    match run_tests(&tests, &env, &flight) {
        Ok(tally) => finish(tests.len(), tally, skipped, keys),
        Err(Stopped) => {
            drop(keys);
            drop(flight);
            std::process::exit(3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{double_fault_in, emulated_cpu_fault};

    #[test]
    fn a_kmsg_record_of_a_double_fault_is_the_emulated_cpus_fault() {
        assert_eq!(
            double_fault_in("0,1234,127041967,-;traps: PANIC: double fault, error_code: 0x0\n")
                .as_deref(),
            Some("the host kernel double-faulted (traps: PANIC: double fault, error_code: 0x0)")
        );
        assert_eq!(
            double_fault_in("4,1235,127063033,-;WARNING: CPU: 0 PID: 422 at kernel/softirq.c:400"),
            None
        );
    }

    #[test]
    fn a_guest_triple_fault_in_a_failure_is_found_and_quoted() {
        let why = "no \"GUEST-SYNCED\" on the guest console within 240s:   vcpu0 apic 0 pu 0 \
                   cell 0: rebooted (triple fault, last exception Some(14), RIP 0xfff0), 742 \
                   exits |   vcpu1 apic 1 pu 1 cell 0: stopped, 2230 exits";
        assert_eq!(
            emulated_cpu_fault(why),
            Some("vcpu0 apic 0 pu 0 cell 0: rebooted (triple fault, last exception Some(14), RIP 0xfff0)")
        );
        let multi = "the source ended\n       vcpu1 apic 1 pu 2 cell 1: rebooted (triple fault, \
                     last exception None, RIP 0xfff0), 5 exits\n";
        assert_eq!(
            emulated_cpu_fault(multi),
            Some("vcpu1 apic 1 pu 2 cell 1: rebooted (triple fault, last exception None, RIP 0xfff0)")
        );
    }

    #[test]
    fn other_failures_are_not_the_emulated_cpu() {
        assert_eq!(emulated_cpu_fault("GUEST node=1 cpus=2-3 (want 1)"), None);
        assert_eq!(
            emulated_cpu_fault("vcpu0: rebooted (keyboard controller)"),
            None
        );
        assert_eq!(emulated_cpu_fault("guest kernel panic (pvpanic)"), None);
    }
}
