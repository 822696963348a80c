#!/usr/bin/env bash
# `make testbed`: the emulated multi-NUMA host suite.
#   testbed/run.sh [2node|4node|bench|xhost ...] [--only test_a,test_b]
#   testbed/run.sh --check-log FILE   (does a kept serial log show the emulator locking up?)
# `2node` and `4node` are the test suites (the default: both); `bench` runs the benchmarks that
# compare vmhost with QEMU in the 2-node host (`make bench-testbed`, docs/benchmarks.md); `xhost`
# boots both hosts side by side and migrates a guest from one to the other (testbed/xhost.sh,
# also in `make bench-testbed`: two TCG hosts at once are too much for `make test`'s CI). Tests
# assert behaviour only; timings are reported by the benchmarks, never asserted.
# Builds the image (cached, testbed/build-image.sh), builds vmhost and the in-host runner
# (vmhost-testbed), then boots each emulated host (testbed/boot.sh) with both on a 9p share and
# runs its suite inside. Prints every PASS/FAIL line and a summary; exits non-zero unless every
# test the runner lists for the run (`vmhost-testbed --list`, run here: it is a static binary)
# printed a PASS line and the runner itself exited 0 (testbed/harness.sh). Each host's serial log is kept under
# target/testbed/logs/ (the last run) and, for a failing host, copied to
# target/testbed/failed/<time>-<suite>.log.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tb="${VMHOST_TESTBED_DIR:-$root/target/testbed}"
suites=() only="" check_log=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        2node|4node|bench|xhost) suites+=("$1"); shift ;;
        --only) only="$2"; shift 2 ;;
        --check-log) check_log="$2"; shift 2 ;;
        *) echo "usage: testbed/run.sh [2node|4node|bench|xhost ...] [--only a,b] | --check-log FILE" >&2; exit 2 ;;
    esac
done
[[ ${#suites[@]} -gt 0 ]] || suites=(2node 4node)

# emulator_fault, write_run_script, suite_verdict.
# shellcheck source=testbed/harness.sh
source "$root/testbed/harness.sh"
# run_xhost: the cross-host suite.
# shellcheck source=testbed/xhost.sh
source "$root/testbed/xhost.sh"

# Asks QEMU's monitor (testbed/boot.sh's FILE.monitor socket) where each emulated CPU is: `info
# cpus` and every CPU's registers, for the log of a machine that locked up. A QEMU that does not
# answer within 5 s is stuck itself, and that is said too.
monitor_dump() {
    python3 - "$1" <<'PY'
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.settimeout(5)
try:
    s.connect(sys.argv[1])
except OSError as e:
    sys.exit(f"no QEMU monitor: {e}")
s.sendall(b"info cpus\ninfo registers -a\n")
out, end = b"", time.time() + 8
s.settimeout(1.5)
while time.time() < end:
    try:
        chunk = s.recv(65536)
    except socket.timeout:
        break
    if not chunk:
        break
    out += chunk
keep = ("CPU#", "* CPU", "CPU #", "RIP=", "CS =", "CR0=", "EFER=", "HLT=")
lines = [l.rstrip() for l in out.decode(errors="replace").replace("\r", "").splitlines()]
found = [l for l in lines if l.lstrip().startswith(keep) or "thread_id" in l]
print("\n".join(found) or "QEMU's monitor did not answer within 8 s (QEMU itself is stuck)")
PY
}

# Boots one host (testbed/boot.sh) and watches its serial log: a kernel lockup report, or no
# output for VMHOST_TESTBED_SILENCE seconds (default 150), stops it at once instead of at the
# timeout. Returns boot.sh's status (124 when stopped). Further arguments go to boot.sh.
boot_and_watch() {
    local nodes="$1" share="$2" log="$3" silence="${VMHOST_TESTBED_SILENCE:-150}"
    shift 3
    : > "$log"
    rm -f "$log.frozen"
    bash "$root/testbed/boot.sh" --nodes "$nodes" --share "$share" --log "$log" \
        --timeout "${VMHOST_TESTBED_TIMEOUT:-$default_limit}" "$@" > /dev/null &
    local pid=$! last size=0 grown now
    last=$(date +%s)
    while kill -0 "$pid" 2>/dev/null; do
        sleep 2
        now=$(date +%s)
        grown=$(stat -c %s "$log" 2>/dev/null || echo 0)
        if [[ $grown -ne $size ]]; then
            size=$grown last=$now
        fi
        local stuck=""
        if [[ -n "$(emulator_fault "$log")" ]]; then
            stuck=lockup
        elif (( now - last > silence )); then
            echo "no output for $silence s: the emulated machine is frozen" > "$log.frozen"
            stuck=silence
        fi
        if [[ -n "$stuck" ]]; then
            monitor_dump "$log.monitor" > "$log.cpus" 2>&1 || true
            pkill -TERM -f "path=$share,security_model" 2>/dev/null || true
            wait "$pid" 2>/dev/null
            # After QEMU and tee are gone: the log says why it was stopped.
            [[ -s "$log.frozen" ]] && echo "testbed: $(cat "$log.frozen")" >> "$log"
            if [[ -s "$log.cpus" ]]; then
                echo "testbed: the emulated CPUs when it was stopped (QEMU monitor):" >> "$log"
                sed 's/^/testbed:   /' "$log.cpus" >> "$log"
            fi
            return 124
        fi
    done
    wait "$pid"
}

# Prints a host's test lines and adds them to the counts; a host whose suite did not pass
# sets `status`, keeps its serial log and, unless its FAIL lines say it all, fails on its own.
#   judge SUITE SHARE LOG RC
judge() {
    local suite="$1" share="$2" log="$3" rc="$4" why p f verdict keep
    why=$(emulator_fault "$log")
    grep -E '^(RUN|PASS|FAIL|     )' "$share/results.txt" 2>/dev/null || true
    p=$(grep -c '^PASS' "$share/results.txt" 2>/dev/null || true)
    f=$(grep -c '^FAIL' "$share/results.txt" 2>/dev/null || true)
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
    verdict=$(suite_verdict "$share" || true)
    [[ "$why" == fail:* ]] && verdict+=$'\n'"${why#fail: }"
    if [[ $rc -ne 0 || -n "$verdict" ]]; then
        status=1
        keep="$tb/failed/$(date +%Y%m%d-%H%M%S)-$suite.log"
        cp "$log" "$keep"
        echo "== testbed: $suite host FAILED (status $rc); serial log kept in $keep"
        # Every listed test reported and some failed: their FAIL lines say it all. Anything
        # else (a test without a result line, a runner that died, a lockup on a vmhost thread,
        # a host without a status) is a failure of its own.
        if [[ ${f:-0} -eq 0 ]] \
            || grep -v -q -E "^(did not pass: |the runner's exit status is 1 )" <<< "$verdict"; then
            failed=$((failed + 1))
            echo "FAIL testbed_${suite}_host: the suite did not complete (status $rc):"
            { grep . <<< "$verdict" || true; } | sed 's/^/     /'
            echo "     last serial lines:"
            tail -n 25 "$log" | sed 's/^/     /'
        fi
    fi
}

if [[ -n "$check_log" ]]; then
    why=$(emulator_fault "$check_log")
    echo "${why:-no emulator fault in $check_log}"
    [[ -z "$why" ]]
    exit $?
fi

start=$(date +%s)
bash "$root/testbed/build-image.sh"
bash "$root/testbed/build-guest.sh"
profile="${VMHOST_TESTBED_PROFILE:-debug}"
flags=()
[[ "$profile" == release ]] && flags+=(--release)
(cd "$root" && cargo build --quiet "${flags[@]}" -p vmhost -p vmhost-testbed)
# The benchmarks compare an optimised vmhost with QEMU, whatever the profile.
bench=false
for suite in "${suites[@]}"; do [[ "$suite" == bench ]] && bench=true; done
if $bench; then (cd "$root" && cargo build --quiet --release -p vmhost); fi
bin="$root/target/x86_64-unknown-linux-gnu/$profile"

mkdir -p "$tb/logs" "$tb/failed"

status=0 passed=0 failed=0 retries=()
for suite in "${suites[@]}"; do
    if [[ "$suite" == xhost ]]; then
        run_xhost
        continue
    fi
    share="$tb/share-$suite"
    rm -rf "$share" && mkdir -p "$share"
    cp "$bin/vmhost" "$bin/vmhost-testbed" "$share/"
    # The Linux guests' kernel, initramfs and the QEMU baseline (testbed/build-guest.sh).
    mkdir -p "$share/guest"
    cp "$root/target/test-kernel/vmlinux" "$root/target/test-kernel/bzImage" "$share/guest/"
    cp -a "$tb/guest/initramfs.cpio" "$tb/guest/initramfs-devices.cpio" "$tb/guest/qemu" "$share/guest/"
    if [[ "$suite" == bench ]]; then
        cp "$root/target/x86_64-unknown-linux-gnu/release/vmhost" "$share/guest/vmhost-release"
        # Cloud Hypervisor and Firecracker, where VMHOST_BENCH_CH / _FC named them.
        if [[ -d "$tb/guest/peers" ]]; then cp -a "$tb/guest/peers" "$share/guest/"; fi
    fi
    # The virtio device tests' disk images, new for every run.
    bash "$root/testbed/build-disks.sh" "$share/guest/virtio"
    write_run_script "$share" "$suite" "$only"
    # What is to run, from the runner itself (honouring --only): the PASS lines must match it.
    if ! "$bin/vmhost-testbed" --suite "$suite" ${only:+--only "$only"} --list > "$share/expected"; then
        cat "$share/expected"
        status=1 failed=$((failed + 1))
        continue
    fi
    nodes=${suite%node}
    # The host's time limit unless VMHOST_TESTBED_TIMEOUT is set: the benchmarks take longer
    # (migration_vs_qemu alone about 35 minutes, linux_boot_vs_peers' 11 rounds of 5 VMMs
    # about 15 on a quiet machine, twice that on a loaded one; docs/benchmarks.md).
    default_limit=900
    [[ "$suite" == bench ]] && nodes=2 default_limit=7200
    log="$tb/logs/$suite.log"
    echo "== testbed: $suite host (${nodes} NUMA nodes), serial log $log"
    rc=0
    rm -f "$share/skip" "$share/passed-earlier"
    for attempt in 1 2 3; do
        rm -f "$share/results.txt" "$share/runner-status"
        boot_and_watch "$nodes" "$share" "$log" || rc=$?
        why=$(emulator_fault "$log")
        # The emulated machine itself locked up (a CPU stuck in its own kernel, or no output
        # at all for VMHOST_TESTBED_SILENCE s while the runner writes a watchdog line every 60 s),
        # or the runner stopped on a Linux guest's triple fault (`emulator_fault`): a fault of
        # the emulator, seen before any test was running too. Boot the host again,
        # at most twice, unless a test had already failed (that failure stands) or the stuck CPU
        # was running a vmhost thread (`fail:`, a failure of its own). The tests that passed
        # before the lockup stand too; the next boot runs the rest.
        if [[ "$why" == retry:* && $attempt -lt 3 ]] && ! grep -q '^FAIL' "$share/results.txt" 2>/dev/null; then
            keep="$tb/failed/$(date +%Y%m%d-%H%M%S)-$suite-emulator-fault.log"
            cp "$log" "$keep"
            grep '^PASS' "$share/results.txt" >> "$share/passed-earlier" 2>/dev/null || true
            names=$(sed -E 's/^PASS ([^ ]+).*/\1/' "$share/passed-earlier" 2>/dev/null | paste -sd, -)
            if [[ -n "$names" ]]; then echo "$names" > "$share/skip"; else rm -f "$share/skip"; fi
            retries+=("$suite boot $attempt: ${why#retry: }")
            echo "== testbed: the emulated $suite host locked up, its kernel failed or its CPU broke a guest (${why#retry: }); serial log kept in $keep;" \
                "this is a fault of the emulated machine, not a test result: booting it again" \
                "(boot $((attempt + 1)) of at most 3) for the tests that have not passed yet"
            rc=0
            continue
        fi
        break
    done
    if [[ -s "$share/passed-earlier" ]]; then
        cat "$share/passed-earlier" "$share/results.txt" > "$share/results.all" 2>/dev/null || true
        mv "$share/results.all" "$share/results.txt"
    fi
    judge "$suite" "$share" "$log" "$rc"
done
echo "== testbed: $(( $(date +%s) - start )) s in all"
echo "testbed: $passed passed, $failed failed, ${#retries[@]} host boot(s) retried${retries:+ ($(IFS=';'; echo "${retries[*]}"))}"
exit $status
