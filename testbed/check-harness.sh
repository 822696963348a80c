#!/usr/bin/env bash
# The testbed harness's own checks, on the CI host, without booting QEMU (`make test` runs them
# before testbed/run.sh; a few seconds). They exercise testbed/harness.sh, which run.sh uses:
#   - lockup, oops, hung-task and reset detection on crafted serial logs: the host's own
#     lockup, oops, hung kernel task or reset is retried, a nested guest's (prefixed) line is
#     not taken for one, one on a CPU running (or a hung task that is) a vmhost thread is a
#     failure;
#   - the share's `run` script and the suite verdict with a stand-in runner (a shell script
#     that prints PASS lines and then dies like an aborted runner): a runner that dies
#     mid-suite, or exits 0 without running every listed test, fails the suite;
#   - the real runner's `--list` honours `--only` and `--skip`, and lists the cross-host suite
#     per role.
# Prints one `ok`/`FAIL` line per check; exits 1 when any failed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=testbed/harness.sh
source "$root/testbed/harness.sh"
work=$(mktemp -d /tmp/vmhost-check-harness.XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0

check() {
    local what="$1"
    shift
    if "$@"; then
        echo "ok   harness: $what"
    else
        echo "FAIL harness: $what"
        failures=$((failures + 1))
    fi
}

# --- lockup detection on crafted logs ---------------------------------------------------
fault_is() { # fault_is WANT_PREFIX LOG_TEXT: emulator_fault's verdict starts with WANT ("" = none)
    local want="$1" got
    printf '%s\n' "$2" > "$work/serial.log"
    got=$(emulator_fault "$work/serial.log")
    if [[ -z "$want" ]]; then [[ -z "$got" ]] || { echo "     got: $got"; return 1; }; return 0; fi
    [[ "$got" == "$want"* ]] || { echo "     got: ${got:-nothing}"; return 1; }
}
check "a host soft lockup in a kworker is retried" fault_is retry: \
    $'RUN  memory_vm_on_node1_only\r\n[   48.123456] watchdog: BUG: soft lockup - CPU#2 stuck for 26s! [kworker/2:1:123]\r'
check "a host RCU stall with no vmhost task named is retried" fault_is retry: \
    $'[  101.000001] rcu: INFO: rcu_preempt self-detected stall on CPU\n[  101.000002] rcu: \t1-....: (5250 ticks this GP)'
check "a prefixed guest soft-lockup line is not the host's" fault_is "" \
    $'RUN  virtio_kubevirt_vmi_boots\n     guest| [   22.500000] watchdog: BUG: soft lockup - CPU#0 stuck for 22s! [swapper/0:1]'
check "a prefixed guest RCU stall line is not the host's" fault_is "" \
    '     guest| [   30.1] rcu: INFO: rcu_sched self-detected stall on CPU'
check "a guest lockup quoted in a FAIL reason is not the host's" fault_is "" \
    'FAIL linux_x (30.0 s): no "GUEST-INIT": [   22.5] watchdog: BUG: soft lockup - CPU#1 stuck for 22s! [init:1] | ...'
check "a host soft lockup on a vmhost vCPU thread fails" fault_is fail: \
    '[   48.123456] watchdog: BUG: soft lockup - CPU#3 stuck for 26s! [vcpu1:4242]'
check "a host RCU stall whose backtrace names a vmhost thread fails" fault_is fail: \
    $'[  101.000001] rcu: INFO: rcu_preempt self-detected stall on CPU\n[  101.000003] CPU: 1 PID: 77 Comm: prefault-c0-1 Not tainted 6.1.0-28-amd64 #1'
check "a host soft lockup on the runner itself is retried" fault_is retry: \
    '[   48.1] watchdog: BUG: soft lockup - CPU#0 stuck for 26s! [vmhost-testbed:99]'
check "a host oops in the idle task is retried" fault_is retry: \
    $'RUN  vsock_linux_guest_echo_both_ways\n[  308.999616] BUG: unable to handle page fault for address: ffff8880067b4508\n[  308.999616] #PF: supervisor instruction fetch in kernel mode\n[  308.999616] Oops: 0011 [#1] PREEMPT SMP NOPTI\n[  308.999616] CPU: 1 PID: 0 Comm: swapper/1 Not tainted 6.1.0-57-amd64 #1  Debian 6.1.192-3'
check "a host oops on a vmhost vCPU thread fails" fault_is fail: \
    $'[  120.5] general protection fault, probably for non-canonical address 0xdead000000000100: 0000 [#1] PREEMPT SMP NOPTI\n[  120.5] CPU: 0 PID: 4242 Comm: vcpu0 Not tainted 6.1.0-57-amd64 #1'
check "a host oops after VMRUN on a vmhost vCPU thread is the emulated CPU's, retried" fault_is retry: \
    $'[   52.023433] BUG: TASK stack guard page was hit at 00000000f78997b1 (stack is 000000005a11698e..00000000b81b97ec)\n[   52.023433] stack guard page: 0000 [#1] PREEMPT SMP NOPTI\n[   52.023433] CPU: 0 PID: 229 Comm: vcpu0 Not tainted 6.1.0-57-amd64 #1  Debian 6.1.192-3\n[   52.023433] RIP: 0010:error_entry+0xd/0x130\n[   52.027431] BUG: kernel NULL pointer dereference, address: 0000000000000140\n[   52.027431] Oops: 0002 [#2] PREEMPT SMP NOPTI\n[   52.027431] CPU: 0 PID: 229 Comm: vcpu0 Not tainted 6.1.0-57-amd64 #1  Debian 6.1.192-3\n[   52.027431] RIP: 0010:__svm_vcpu_run+0x9d/0x210 [kvm_amd]'
check "a lone stack overrun in exception entry on a vmhost vCPU thread is the emulated CPU's, retried" fault_is "retry: the emulated CPU's #VMEXIT" \
    $'RUN  migration_linux_between_node_pairs\n[   52.023433] BUG: TASK stack guard page was hit at 00000000f78997b1 (stack is 000000005a11698e..00000000b81b97ec)\n[   52.023433] stack guard page: 0000 [#1] PREEMPT SMP NOPTI\n[   52.023433] CPU: 0 PID: 229 Comm: vcpu0 Not tainted 6.1.0-57-amd64 #1  Debian 6.1.192-3\n[   52.023433] RIP: 0010:error_entry+0xd/0x130\ntestbed: the emulated machine reset or powered off by itself (QEMU status 0, no run script status)'
check "a host double fault on a vmhost vCPU thread is the emulated CPU's, retried" fault_is "retry: the emulated CPU's #VMEXIT" \
    $'[  127.041967] traps: PANIC: double fault, error_code: 0x0\n[  127.041967] double fault: 0000 [#1] PREEMPT SMP NOPTI\n[  127.041967] CPU: 0 PID: 422 Comm: vcpu0 Not tainted 6.1.0-57-amd64 #1  Debian 6.1.192-3\n[  127.064107] RIP: 0010:__local_bh_enable_ip+0x4e/0x70'
check "a host oops elsewhere in KVM on a vmhost vCPU thread still fails" fault_is fail: \
    $'[  120.5] BUG: kernel NULL pointer dereference, address: 0000000000000140\n[  120.5] Oops: 0002 [#1] PREEMPT SMP NOPTI\n[  120.5] CPU: 0 PID: 4242 Comm: vcpu0 Not tainted 6.1.0-57-amd64 #1\n[  120.5] RIP: 0010:kvm_mmu_page_fault+0x1d/0x210 [kvm]'
check "a prefixed guest oops line is not the host's" fault_is "" \
    '     guest| [   12.0] BUG: unable to handle page fault for address: 0000000000000008'
check "a host kernel task hung for minutes is retried" fault_is retry: \
    $'RUN  migration_linux_between_node_pairs\n[  243.298485] INFO: task khugepaged:80 blocked for more than 120 seconds.\n[  243.298844]       Not tainted 6.1.0-57-amd64 #1 Debian 6.1.192-3'
check "a vmhost thread hung for minutes fails" fault_is fail: \
    '[  243.2] INFO: task vmhost-io-0:317 blocked for more than 120 seconds.'
check "a machine that reset itself is retried" fault_is retry: \
    $'RUN  migration_linux_between_node_pairs\ntestbed: the emulated machine reset or powered off by itself (QEMU status 0, no run script status)'
check "a Linux guest's triple fault the runner stopped on is retried, quoting the vCPU" fault_is \
    "retry: a Linux guest triple-faulted in virtio_kubevirt_vmi_boots after 12.0 s (vcpu0 apic 0 pu 0 cell 0: rebooted (triple fault, last exception Some(14), RIP 0xfff0))" \
    $'RUN  virtio_kubevirt_vmi_boots\r\ntestbed: emulated CPU fault: a Linux guest triple-faulted in virtio_kubevirt_vmi_boots after 12.0 s (vcpu0 apic 0 pu 0 cell 0: rebooted (triple fault, last exception Some(14), RIP 0xfff0)); stopping the runner so that the host is booted again\r'
check "a guest's triple fault quoted in a FAIL reason is not the emulator's" fault_is "" \
    'FAIL linux_x (3.0 s): vcpu0 apic 0 pu 0 cell 0: rebooted (triple fault, last exception Some(14), RIP 0xfff0)'
check "silence is retried" fault_is retry: \
    'testbed: no output for 150 s: the emulated machine is frozen'

# --- the run script and the verdict, with a stand-in runner -----------------------------
# share_with STUB_BODY: a share whose vmhost-testbed is a shell stand-in. It answers --list
# with three tests; otherwise it runs STUB_BODY with the tests still to run in $tests.
share_with() {
    local share="$work/share-$RANDOM"
    mkdir -p "$share"
    cat > "$share/vmhost-testbed" <<STUB
#!/bin/sh
all="alpha beta gamma" skip="" list=false
while [ \$# -gt 0 ]; do
    case "\$1" in
        --list) list=true; shift ;;
        --skip) skip=\$(echo "\$2" | tr , ' '); shift 2 ;;
        *) shift ;;
    esac
done
tests=""
for t in \$all; do case " \$skip " in *" \$t "*) ;; *) tests="\$tests \$t" ;; esac; done
if \$list; then for t in \$all; do echo \$t; done; exit 0; fi
$1
STUB
    chmod +x "$share/vmhost-testbed"
    write_run_script "$share" harnesscheck ""
    (cd "$share" && ./vmhost-testbed --suite harnesscheck --list > expected)
    echo "$share"
}
run_in() { (cd "$1" && ./run > run.out 2>&1) || echo $? > "$1/run-exit"; }
verdict_ok() { suite_verdict "$1" > "$1/verdict"; }
verdict_fails() { ! suite_verdict "$1" > "$1/verdict" && grep -q "$2" "$1/verdict"; }
verdict_only_failed() {
    ! suite_verdict "$1" > "$1/verdict" && grep -qx "did not pass: beta" "$1/verdict" \
        && ! grep -q "no result line" "$1/verdict"
}

share=$(share_with 'for t in $tests; do echo "RUN  $t"; echo "PASS $t (0.1 s)"; done; exit 0')
run_in "$share"
check "a runner that passes every listed test passes" verdict_ok "$share"
check "... and its run script exits 0" test ! -e "$share/run-exit"

share=$(share_with 'echo "RUN  alpha"; echo "PASS alpha (0.1 s)"; echo "RUN  beta"; kill -ABRT $$')
run_in "$share"
check "a runner that aborts mid-suite fails the suite, naming what did not pass" \
    verdict_fails "$share" "did not pass: beta,gamma"
check "... and says which tests have no result line at all" \
    grep -q "no result line at all: beta,gamma" "$share/verdict"
check "... and its status (SIGABRT, 134) is kept through the pipe" \
    grep -qx 134 "$share/runner-status"
check "... and the run script exits with it" grep -qx 134 "$share/run-exit"

share=$(share_with 'echo "PASS alpha (0.1 s)"; exit 0')
run_in "$share"
check "a runner that exits 0 after running only some tests fails the suite" \
    verdict_fails "$share" "did not pass: beta,gamma"

share=$(share_with 'echo "PASS alpha (0.1 s)"; echo "FAIL beta (0.1 s): x"; echo "PASS gamma (0.1 s)"; exit 1')
run_in "$share"
check "a runner whose test failed fails the suite, every test with a result line" \
    verdict_only_failed "$share"

share=$(share_with 'for t in $tests; do echo "PASS $t (0.1 s)"; done; exit 0')
echo "PASS alpha (1.0 s)" > "$share/passed-earlier"
echo alpha > "$share/skip"
run_in "$share"
cat "$share/passed-earlier" "$share/results.txt" > "$share/results.all"
mv "$share/results.all" "$share/results.txt"
check "passed in an earlier boot + passed in this one = the list passes" verdict_ok "$share"

share=$(share_with 'for t in $tests; do echo "PASS $t (0.1 s)"; done; exit 0')
# `sed` reads the whole list: `head` would leave the stub's third `echo` a closed pipe, and
# with pipefail its SIGPIPE (141) ended this script in a CI run.
(cd "$share" && ./vmhost-testbed --suite harnesscheck --list | sed -n '1,2p' > expected)
run_in "$share"
check "a PASS line for a test not in the list fails the suite" \
    verdict_fails "$share" "not in the list: gamma"

share=$(share_with 'exit 0')
rm -f "$share/run" && write_run_script "$share" harnesscheck ""
sed -i 's/echo \$? > runner-status/true/' "$share/run"
run_in "$share"
check "a host that reports no runner status fails the suite" \
    verdict_fails "$share" "exit status is missing"

mkdir -p "$work/xhost-run"
write_run_script "$work/xhost-run" xhost "" "--role target"
check "the run script passes the cross-host suite's role to the runner" \
    grep -q -- "--suite xhost --role target --vmhost ./vmhost" "$work/xhost-run/run"

# --- the real runner's --list --------------------------------------------------------------
bin="$root/target/x86_64-unknown-linux-gnu/${VMHOST_TESTBED_PROFILE:-debug}/vmhost-testbed"
(cd "$root" && cargo build --quiet -p vmhost-testbed $([[ "${VMHOST_TESTBED_PROFILE:-}" == release ]] && echo --release))
lists() {
    local got
    got=$("$bin" --suite 2node --only topology_matches_sysfs,memory_vm_on_node1_only,bench_numa_all_scenarios \
        --skip memory_vm_on_node1_only --list | paste -sd, -)
    [[ "$got" == topology_matches_sysfs,bench_numa_all_scenarios ]] || { echo "     got: $got"; return 1; }
}
check "vmhost-testbed --list honours --only and --skip" lists
check "vmhost-testbed --list of a whole suite lists every test" \
    test "$("$bin" --suite 4node --list | wc -l)" -ge 10
check "vmhost-testbed --list fails on an unknown --only name" \
    bash -c "! '$bin' --suite 2node --only no_such_test --list > /dev/null"

check "vmhost-testbed --suite xhost lists one test per role" \
    test "$("$bin" --suite xhost --role source --list)$("$bin" --suite xhost --role target --list)" \
    == "xhost_source_migratesxhost_target_receives"
check "vmhost-testbed --suite xhost without a role is refused" \
    bash -c "! '$bin' --suite xhost --list > /dev/null 2>&1"

if [[ $failures -gt 0 ]]; then
    echo "testbed/check-harness.sh: $failures check(s) failed"
    exit 1
fi
echo "testbed/check-harness.sh: all checks passed"
