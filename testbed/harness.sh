# The testbed harness's judgement, sourced by testbed/run.sh and testbed/check-harness.sh (which
# exercises it on the CI host without booting QEMU): what a serial log says about the emulated
# machine, the share's `run` script, and whether a suite really ran all its tests.

# A line the emulated host's own kernel printed: `[ seconds.micros] ` at the very start of a
# line. The runner prefixes every line of a nested guest's console it copies (`     guest| `),
# and indents a FAIL reason's further lines, so a guest's kernel can never print such a line.
host_kernel_line='^\[ *[0-9]+\.[0-9]+\] '
host_lockup="${host_kernel_line}(watchdog: BUG: soft lockup - CPU#[0-9]+|rcu: INFO: rcu_(preempt|sched) (self-)?detected stall)"
# The emulated host's own kernel failing (an oops: boot.sh's `oops=panic` then ends the
# machine): `BUG: unable to handle …`, `general protection fault`, `kernel BUG at`, `Oops:`,
# and a task's kernel stack overrun (`BUG: TASK stack guard page was hit`, whose own oops line
# reads `stack guard page: 0000 [#1]` and may be the last the machine prints).
host_oops="${host_kernel_line}(BUG: unable to handle|general protection fault|kernel BUG at|invalid opcode:|Oops: |BUG: TASK stack guard page was hit|traps: PANIC: double fault)"
# A task of the host's own kernel blocked for minutes (the hung-task detector, 120 s): a CPU
# that never runs it, as when an emulated CPU is stuck where the lockup detectors do not look.
host_hung="${host_kernel_line}INFO: task .+:[0-9]+ blocked for more than [0-9]+ seconds"

# The emulated CPU's own fault, whatever task ran: the host kernel oopsing at the instruction
# right after VMRUN (`__svm_vcpu_run`, where KVM pops its own pointer off the stack the #VMEXIT
# gave back), or overrunning a task's stack in exception entry as that broken state unwinds.
# On a real CPU no user-space program can reach either: #VMEXIT restores the host's RSP and
# RAX from the host save area. Seen in the 4-node migration test (kvm_amd under QEMU 7.2's
# TCG SVM, 8 emulated CPUs on 2 real ones, a guest taking thousands of dirty-log write faults
# a second): `RAX: 0000000000000010` popped as KVM's svm pointer, docs/testing.md. And a
# double fault of the host's kernel (`traps: PANIC: double fault`): seen on a vCPU thread in
# KVM_RUN with CR2 in the host's entry-area exception stacks, the nested guest oopsing at the
# same moment with the same CR2 (the boot benchmark, 6 December 2026).
host_vmexit="${host_kernel_line}(RIP: 0010:__svm_vcpu_run\+|BUG: TASK stack guard page was hit|traps: PANIC: double fault)"

# Is a task name (`comm`) one of vmhost's threads? vCPUs are `vcpu<N>`, prefault workers
# `prefault-c<cell>-<i>`, a restore's loaders and a migration's senders and receivers
# `load-c<cell>`, `mig-c<cell>`, `recv-c<cell>`, the rest `vmhost`, `vmhost-<what>` or
# `vmhost-<what>-<i>` (I/O threads); the runner (`vmhost-testbed`) is not vmhost.
is_vmhost_comm() {
    [[ "$1" != vmhost-testbed ]] \
        && [[ "$1" =~ ^(vcpu[0-9]+|prefault-c[0-9]+-[0-9]+|(load|recv|mig)-c[0-9]+|vmhost(-[a-z]+(-[0-9]+)?)?)$ ]]
}

# What in a serial log shows that the emulated machine locked up or its kernel failed, one
# line, empty when nothing does: `retry: WHY` for a fault of the emulator (a CPU stuck in the
# host's own kernel, a kernel task hung for minutes, an oops of that kernel outside vmhost's
# threads, the emulated CPU's broken #VMEXIT on any thread (`host_vmexit`), a Linux guest's
# triple fault in a test that asked for no reset (the runner's `testbed: emulated CPU fault:`
# line), a reset of the machine by itself, or no output at all),
# `fail: WHY` when the stuck or failing CPU was running a vmhost thread (a vmhost guest or a
# vmhost bug must not be retried into green). The task on that CPU comes from the soft-lockup
# line's `[comm:pid]` and from any `CPU: N PID: P Comm: X` / `task:X` line the kernel printed
# after the first lockup or oops line.
emulator_fault() {
    local log="$1" line first comm comms=()
    first=$(grep -a -n -m1 -E "$host_lockup|$host_oops|$host_hung" "$log" | cut -d: -f1 || true)
    if [[ -n "$first" ]]; then
        line=$(sed -n "${first}p" "$log" | tr -d '\r')
        if tail -n +"$first" "$log" | tr -d '\r' | head -n 200 | grep -a -q -E "$host_vmexit"; then
            echo "retry: the emulated CPU's #VMEXIT broke the host kernel's state (an oops after VMRUN in __svm_vcpu_run or a stack overrun in exception entry): ${line#*] }"
            return
        fi
        [[ "$line" =~ !\ \[([^[]+):[0-9]+\]$ ]] && comms+=("${BASH_REMATCH[1]}")
        [[ "$line" =~ INFO:\ task\ (.+):[0-9]+\ blocked ]] && comms+=("${BASH_REMATCH[1]}")
        while read -r comm; do
            comms+=("$comm")
        done < <(tail -n +"$first" "$log" | tr -d '\r' | grep -a -E "$host_kernel_line" \
            | head -n 200 | sed -n -E 's/.*(CPU: [0-9]+ PID: [0-9]+ Comm: |\] task:)([^ ]+).*/\2/p')
        for comm in "${comms[@]}"; do
            if is_vmhost_comm "$comm"; then
                echo "fail: a CPU locked up running vmhost thread $comm: ${line#*] }"
                return
            fi
        done
        echo "retry: kernel: ${line#*] }"
    elif grep -q -a '^testbed: emulated CPU fault: ' "$log"; then
        # The runner stopped after a Linux guest triple-faulted where its test asked for no
        # reset (testbed/runner/src/main.rs, `emulated_cpu_fault`; docs/testing.md).
        echo "retry: $(grep -a -m1 '^testbed: emulated CPU fault: ' "$log" | tr -d '\r' \
            | sed -E 's/^testbed: emulated CPU fault: //; s/; stopping the runner.*//')"
    elif grep -q -a '^testbed: no output for' "$log"; then
        echo "retry: $(grep -a -m1 '^testbed: no output for' "$log" | sed 's/^testbed: //')"
    elif [[ -s "$log.frozen" ]]; then
        echo "retry: $(cat "$log.frozen")"
    elif grep -q -a '^testbed: the emulated machine reset or powered off by itself' "$log"; then
        echo "retry: the emulated machine reset or powered off by itself"
    fi
}

# Writes the share's `run` script (busybox sh inside the emulated host). No pipeline status
# is lost: the runner's own exit status goes to `runner-status` from inside the group whose
# output `tee` copies, and `run` exits with it (or 125 when there is none).
#   write_run_script SHARE SUITE ONLY [RUNNER_ARGS]  (RUNNER_ARGS: e.g. `--role source` of xhost)
write_run_script() {
    local share="$1" suite="$2" only="$3" more="${4:-}" abort="" rounds="" pages=""
    [[ -n "${VMHOST_TESTBED_ABORT_AFTER:-}" ]] \
        && abort="VMHOST_TESTBED_ABORT_AFTER=$VMHOST_TESTBED_ABORT_AFTER; export VMHOST_TESTBED_ABORT_AFTER"
    # The cross-host suite's target may be given another KVM TSC tolerance (testbed/xhost.sh).
    [[ -n "${VMHOST_TESTBED_XHOST_TSC_TOLERANCE:-}" ]] \
        && abort+=$'\n'"VMHOST_TESTBED_XHOST_TSC_TOLERANCE=$VMHOST_TESTBED_XHOST_TSC_TOLERANCE; export VMHOST_TESTBED_XHOST_TSC_TOLERANCE"
    # The runner's KVM flight recorder (testbed/runner/src/flight.rs): off unless asked for.
    [[ "${VMHOST_TESTBED_FLIGHT:-}" == 1 ]] \
        && abort+=$'\n'"VMHOST_TESTBED_FLIGHT=1; export VMHOST_TESTBED_FLIGHT"
    # The rounds of the peers benchmark (linux_boot_vs_peers), when set: for development.
    [[ "${VMHOST_BENCH_ROUNDS:-}" =~ ^[0-9]+$ ]] \
        && rounds="VMHOST_BENCH_ROUNDS=$VMHOST_BENCH_ROUNDS; export VMHOST_BENCH_ROUNDS"
    # The interleaved pairs of the migration benchmark (migration_vs_qemu), when set (>= 5).
    [[ "${VMHOST_BENCH_PAIRS:-}" =~ ^[0-9]+$ ]] \
        && rounds+=$'\n'"VMHOST_BENCH_PAIRS=$VMHOST_BENCH_PAIRS; export VMHOST_BENCH_PAIRS"
    # VMHOST_BENCH_SCRUB=0: the peers benchmark without its scrub of stale translations.
    [[ "${VMHOST_BENCH_SCRUB:-}" == 0 ]] \
        && rounds+=$'\n'"VMHOST_BENCH_SCRUB=0; export VMHOST_BENCH_SCRUB"
    # VMHOST_BENCH_SMAPS=1: the peers benchmark prints where each VMM is resident at /init.
    [[ "${VMHOST_BENCH_SMAPS:-}" == 1 ]] \
        && rounds+=$'\n'"VMHOST_BENCH_SMAPS=1; export VMHOST_BENCH_SMAPS"
    # VMHOST_BENCH_TEXT_PAGES=1: the peers benchmark profiles instead: the pages of vmhost's
    # binary each boot touched by /init, for scripts/text-order.py --emulated-pages.
    [[ "${VMHOST_BENCH_TEXT_PAGES:-}" == 1 ]] \
        && rounds+=$'\n'"VMHOST_BENCH_TEXT_PAGES=1; export VMHOST_BENCH_TEXT_PAGES"
    # 1 GiB pages: boot.sh reserves one per node of the 2-node host on the kernel command line
    # (with nokaslr, so the kernel image never takes node 0's only free 1 GiB range); should a
    # node still have none, try once more, while its memory is still unfragmented. Only in
    # that host: the script must never touch a pool anywhere else (check-harness.sh runs it).
    if [[ "$suite" == 2node || "$suite" == bench ]]; then
        pages='for f in /sys/devices/system/node/node*/hugepages/hugepages-1048576kB/nr_hugepages; do
    [ "$(cat $f)" -lt 1 ] && echo 1 > $f
done'
    fi
    cat > "$share/run" <<RUN
#!/bin/sh
$pages
# skip: the tests that passed in an earlier boot of this host (written by run.sh after the
# emulated machine locked up).
skip=""; [ -s skip ] && skip="--skip \$(cat skip)"
$abort
$rounds
rm -f runner-status
{ ./vmhost-testbed --suite $suite ${more:+$more }--vmhost ./vmhost ${only:+--only $only} \$skip; echo \$? > runner-status; } 2>&1 | tee results.txt
[ -s runner-status ] || exit 125
exit \$(cat runner-status)
RUN
    chmod +x "$share/run"
}

# Did the suite run completely? Compares the share's files: `expected` (the runner's `--list`
# for this run), `results.txt` (this boot's output, with `passed-earlier`'s PASS lines from
# earlier boots prepended by run.sh) and `runner-status` (the last boot's runner exit status).
# Prints one line per problem; returns 1 when there is one. Only `did not pass:` and a runner
# status of 1 are what a run whose every test reported, some with FAIL, shows.
suite_verdict() {
    local share="$1" problems=() want got missing silent extra status
    want=$(sort -u "$share/expected" 2>/dev/null || true)
    got=$(sed -n -E 's/^PASS ([^ ]+).*/\1/p' "$share/results.txt" 2>/dev/null | sort || true)
    [[ -n "$want" ]] || problems+=("no test was to run (empty --list)")
    missing=$(comm -23 <(printf '%s\n' "$want") <(printf '%s\n' "$got" | sort -u) | paste -sd, -)
    extra=$(comm -13 <(printf '%s\n' "$want") <(printf '%s\n' "$got" | sort -u) | paste -sd, -)
    [[ -z "$missing" ]] || problems+=("did not pass: $missing")
    # Not even a FAIL line: the runner died, or never got to them.
    silent=$(comm -23 <(printf '%s\n' "$want") \
        <(sed -n -E 's/^(PASS|FAIL) ([^ ]+).*/\2/p' "$share/results.txt" 2>/dev/null | sort -u) \
        | paste -sd, -)
    [[ -z "$silent" ]] || problems+=("no result line at all: $silent")
    [[ -z "$extra" ]] || problems+=("PASS lines for tests not in the list: $extra")
    [[ $(printf '%s\n' "$got" | grep -c .) -eq $(printf '%s\n' "$got" | sort -u | grep -c .) ]] \
        || problems+=("a test passed twice")
    status=$(cat "$share/runner-status" 2>/dev/null || true)
    [[ "$status" == 0 ]] || problems+=("the runner's exit status is ${status:-missing} (want 0)")
    if [[ ${#problems[@]} -gt 0 ]]; then
        printf '%s\n' "${problems[@]}"
        return 1
    fi
}
