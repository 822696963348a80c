#!/usr/bin/env bash
# Runs every cargo-fuzz target for a bounded time and fails on the first crash.
#   scripts/fuzz.sh [SECONDS_PER_TARGET (default 30)] [TARGET ...]
# Needs the nightly toolchain (installed here) and cargo-fuzz (installed from crates.io when
# missing). All targets are built first, then run VMHOST_FUZZ_JOBS at a time (default: one per
# CPU; a libFuzzer run is single-threaded, so each target gets a whole CPU for its time and the
# same number of executions as alone). New inputs go to a scratch directory; the committed
# seeds in fuzz/corpus/<target> are only read. A crash leaves its input in
# fuzz/artifacts/<target>/ and the run fails: turn it into a regression test
# (docs/security.md, "Fuzzing").
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"; shift || true
jobs="${VMHOST_FUZZ_JOBS:-$(nproc)}"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked --quiet
rustup toolchain list | grep -q '^nightly' \
    || { echo "fuzz: the nightly toolchain is missing (rustup toolchain install nightly)" >&2; exit 1; }
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || mapfile -t targets < <(cd fuzz && cargo +nightly fuzz list)
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
(cd fuzz && cargo +nightly fuzz build)

# One target: its own log and status file in the scratch directory.
fuzz_one() {
    local t="$1" log="$scratch/$1.log"
    mkdir -p "$scratch/$t"
    if (cd fuzz && cargo +nightly fuzz run "$t" "$scratch/$t" "corpus/$t" -- \
            -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1) > "$log" 2>&1; then
        echo 0 > "$scratch/$t.rc"
    else
        echo 1 > "$scratch/$t.rc"
    fi
}

running=0
for t in "${targets[@]}"; do
    echo "== fuzz $t for ${secs}s"
    fuzz_one "$t" &
    running=$((running + 1))
    if (( running >= jobs )); then wait -n || true; running=$((running - 1)); fi
done
wait
status=0
for t in "${targets[@]}"; do
    if [[ "$(cat "$scratch/$t.rc" 2>/dev/null)" != 0 ]]; then
        # The panic message first: the tail alone is the backtrace and cargo-fuzz's footer.
        grep -m 1 -A 3 'panicked at' "$scratch/$t.log" || true
        tail -n 60 "$scratch/$t.log"
        echo "fuzz: $t FAILED; the input is in fuzz/artifacts/$t/" >&2
        status=1
        continue
    fi
    runs=$(grep -o 'Done [0-9]* runs' "$scratch/$t.log" | tail -n 1 | grep -o '[0-9]*' || echo '?')
    echo "$t: $runs executions in ${secs}s, no crash"
done
exit "$status"
