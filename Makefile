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

# The emulated host's benchmarks against QEMU (docs/benchmarks.md) and the live migration
# between the 2-node and the 4-node emulated hosts booted side by side (testbed/xhost.sh: two
# TCG hosts at once are too much for a 2-CPU CI machine); not part of `make test`.
bench-testbed: setup
	bash crates/boot/scripts/fetch-test-kernel.sh
	bash testbed/check-harness.sh
	bash testbed/run.sh bench xhost

# Start -> exit on this host, vmhost vs Cloud Hypervisor vs Firecracker (docs/benchmarks.md);
# VMHOST_BENCH_CH / VMHOST_BENCH_FC name the peers' binaries. Not part of `make test`.
bench-peers: setup
	VMHOST_TEST_HUGEPAGES_1G=0 bash scripts/with-hugepages.sh $(CARGO) bench --bench peers

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
