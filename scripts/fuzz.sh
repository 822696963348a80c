#!/usr/bin/env bash
# Runs every cargo-fuzz target for a bounded time and fails on the first crash.
#   scripts/fuzz.sh [SECONDS_PER_TARGET (default 30)] [TARGET ...]
# Needs the nightly toolchain (installed here) and cargo-fuzz (installed from crates.io when
# missing). New inputs go to a scratch directory; the committed seeds in fuzz/corpus/<target>
# are only read. A crash leaves its input in fuzz/artifacts/<target>/ and the run fails: turn it
# into a regression test (docs/security.md, "Fuzzing").
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-30}"; shift || true
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked --quiet
rustup toolchain list | grep -q '^nightly' \
    || { echo "fuzz: the nightly toolchain is missing (rustup toolchain install nightly)" >&2; exit 1; }
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || mapfile -t targets < <(cd fuzz && cargo +nightly fuzz list)
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
summary=()
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t"
    log="$scratch/$t.log"
    echo "== fuzz $t for ${secs}s"
    if ! (cd fuzz && cargo +nightly fuzz run "$t" "$scratch/$t" "corpus/$t" -- \
            -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1) > "$log" 2>&1; then
        tail -n 60 "$log"
        echo "fuzz: $t FAILED; the input is in fuzz/artifacts/$t/" >&2
        exit 1
    fi
    runs=$(grep -o 'Done [0-9]* runs' "$log" | tail -n 1 | grep -o '[0-9]*' || echo '?')
    summary+=("$t: $runs executions in ${secs}s, no crash")
done
printf '%s\n' "${summary[@]}"
