# vmhost: `make run` runs the main job on the embedded quickstart spec; `make test` runs every test.
CARGO ?= cargo

.PHONY: setup run test testbed bench-testbed bench-peers lint bench

setup:
	bash scripts/setup.sh

run: setup
	$(CARGO) run --release --quiet --

test: setup
	bash crates/boot/scripts/fetch-test-kernel.sh
	bash scripts/with-hugepages.sh $(CARGO) test --workspace
	bash testbed/check-harness.sh
	bash testbed/run.sh

# The emulated multi-NUMA host suite alone (docs/testing.md).
testbed: setup
	bash crates/boot/scripts/fetch-test-kernel.sh
	bash testbed/check-harness.sh
	bash testbed/run.sh

# The emulated host's benchmarks against QEMU (docs/benchmarks.md); not part of `make test`.
bench-testbed: setup
	bash crates/boot/scripts/fetch-test-kernel.sh
	bash testbed/check-harness.sh
	bash testbed/run.sh bench

# Start -> exit on this host, vmhost vs Cloud Hypervisor vs Firecracker (docs/benchmarks.md);
# VMHOST_BENCH_CH / VMHOST_BENCH_FC name the peers' binaries. Not part of `make test`.
bench-peers: setup
	VMHOST_TEST_HUGEPAGES_1G=0 bash scripts/with-hugepages.sh $(CARGO) bench --bench peers

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
