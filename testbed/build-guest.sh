#!/usr/bin/env bash
# Builds the initramfs of the Linux guests the emulated-host tests boot, cached in
# target/testbed/guest/:
#   initramfs.cpio  busybox-static, testbed/guest/init as /init, and the modules it loads
#                   (evdev + button for the ACPI power button, pvpanic + pvpanic-mmio,
#                   virtio_mmio + vmw_vsock_virtio_transport), /bin/vsock-test and
#                   /bin/dirty (the live-migration benchmark's beat and dirtying guest)
#   initramfs-devices.cpio  the same plus testbed/guest/devices.sh and the virtio, ext4 and
#                   vfat modules it loads (lib/modules/devices/), for the virtio device tests,
#                   and the device benchmark's /iobench-run with its static /bin/iobench
#   qemu/           this machine's qemu-system-x86_64 with its shared libraries and loader
#                   (lib/) and the firmware a direct kernel boot needs (share/): the baseline of
#                   the boot-time benchmark, run inside the emulated host as
#                   qemu/lib/ld-linux-x86-64.so.2 --library-path qemu/lib qemu/qemu-system-x86_64 -L qemu/share
#   peers/ch/, peers/fc/  the peers of the boot benchmark (linux_boot_vs_peers): the binaries
#                   VMHOST_BENCH_CH (Cloud Hypervisor) and VMHOST_BENCH_FC (Firecracker) name,
#                   each with its shared libraries and loader in lib/, run the same way as QEMU;
#                   a bundle whose variable is unset is removed (the benchmark then says how to
#                   get that peer: docs/benchmarks.md, "How to get the peers")
# The kernel is the test kernel (crates/boot/scripts/fetch-test-kernel.sh), the same Debian 6.1
# kernel as the emulated host's. Uses the packages testbed/build-image.sh already downloaded
# (run that first).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tb="${VMHOST_TESTBED_DIR:-$root/target/testbed}"
out="$tb/guest"
debs="$tb/debs"
# shellcheck source=testbed/modules.sh
source "$root/testbed/modules.sh"
die() { echo "testbed/build-guest: $*" >&2; exit 1; }

bash "$root/crates/boot/scripts/fetch-test-kernel.sh" >/dev/null
kdir="${VMHOST_TEST_KERNEL_DIR:-$root/target/test-kernel}"
kpkg="$(cat "$kdir/VERSION")"
modules=(evdev button pvpanic-mmio)
# vsock test: the virtio-mmio transport (found through the DSDT), virtio-pci (its variant on
# `boot.virtio_announce = "pci"`) and the vsock driver, plus the static helper
# testbed/guest/vsock-test.c (busybox has no AF_VSOCK).
modules+=(virtio_mmio virtio_pci vmw_vsock_virtio_transport)
# The virtio drivers and file systems of `vmhost.action=devices` (testbed/guest/devices.sh),
# loaded by that script alone from lib/modules/devices/.
# virtio_pci: the device benchmark's QEMU baseline gives the same guest PCI devices.
device_modules=(virtio_mmio virtio_pci virtio_blk virtio_net virtio_rng ext4 crc32c_generic vfat nls_cp437 nls_ascii nls_utf8)
inputs="$kpkg busybox-static ${modules[*]} ${device_modules[*]} $(cat "$root/testbed/guest/init" "$root/testbed/guest/devices.sh" "$root/testbed/guest/migrate.sh" "$root/testbed/guest/iobench-run" "$root/testbed/guest/iobench.c" "$0" "$root/testbed/modules.sh" | sha256sum | cut -c1-16)"
inputs+=" vsock-test:$(sha256sum < "$root/testbed/guest/vsock-test.c" | cut -c1-16)"
inputs+=" dirty:$(sha256sum < "$root/testbed/guest/dirty.c" | cut -c1-16)"
mkdir -p "$out"
qemu_bundle() { # this machine's QEMU, its libraries and firmware, for the emulated host
    local q d="$out/qemu"
    q="$(command -v qemu-system-x86_64)" || die "qemu-system-x86_64 not found: apt-get install qemu-system-x86"
    [[ -x "$d/qemu-system-x86_64" ]] && cmp -s "$q" "$d/qemu-system-x86_64" && return 0
    rm -rf "$d" && mkdir -p "$d/lib" "$d/share"
    cp "$q" "$d/"
    ldd "$q" | awk '/=> \// {print $3} /^\s*\/lib64/ {print $1}' | while read -r lib; do
        cp -L "$lib" "$d/lib/"
    done
    cp -L /lib64/ld-linux-x86-64.so.2 "$d/lib/"
    for f in /usr/share/seabios/bios-256k.bin /usr/share/qemu/linuxboot_dma.bin \
        /usr/share/qemu/kvmvapic.bin /usr/share/qemu/pvh.bin; do
        cp -L "$f" "$d/share/"
    done
    echo "qemu bundle in $d ($(du -sh "$d" | cut -f1))"
}
qemu_bundle
peer_bundle() { # NAME VARIABLE: a peer VMM the user built, its libraries and loader (ldd)
    local d="$out/peers/$1" bin="${!2:-}"
    if [[ -z "$bin" ]]; then
        rm -rf "$d"
        return 0
    fi
    [[ -x "$bin" ]] || die "$2=$bin is not an executable"
    [[ -x "$d/$1" ]] && cmp -s "$bin" "$d/$1" && return 0
    rm -rf "$d" && mkdir -p "$d/lib"
    cp "$bin" "$d/$1"
    ldd "$bin" | awk '/=> \// {print $3} /^\s*\/lib64/ {print $1}' | while read -r lib; do
        cp -L "$lib" "$d/lib/"
    done
    cp -L /lib64/ld-linux-x86-64.so.2 "$d/lib/"
    echo "peer bundle $1 from $bin in $d ($(du -sh "$d" | cut -f1))"
}
peer_bundle ch VMHOST_BENCH_CH
peer_bundle fc VMHOST_BENCH_FC
if [[ -s "$out/initramfs.cpio" && -s "$out/initramfs-devices.cpio" && "$(cat "$out/VERSION" 2>/dev/null)" == "$inputs" ]]; then
    echo "guest initramfs up to date in $out"
    exit 0
fi
kdeb="$(ls "$debs/$kpkg"_*.deb 2>/dev/null | head -n 1 || true)"
bdeb="$(ls "$debs"/busybox-static_*.deb 2>/dev/null | head -n 1 || true)"
[[ -n "$kdeb" && -n "$bdeb" ]] || die "no $kpkg or busybox-static package in $debs: run testbed/build-image.sh"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
dpkg-deb -x "$kdeb" "$work/kernel"
rootfs="$work/rootfs"
mkdir -p "$rootfs"/{bin,dev,proc,sys,tmp,etc,lib/modules}
copy_modules "$work/kernel" "$rootfs" "${modules[@]}"
dpkg-deb -x "$bdeb" "$work/busybox"
cp "$work/busybox/bin/busybox" "$rootfs/bin/busybox"
install -m 0755 "$root/testbed/guest/init" "$rootfs/init"
command -v gcc >/dev/null || die "gcc not found (the vsock test helper is a static C program): apt-get install gcc libc6-dev"
gcc -static -O2 -Wall -o "$rootfs/bin/vsock-test" "$root/testbed/guest/vsock-test.c"
# The live-migration benchmark's guest (`vmhost.action=beat|dirty`, testbed/guest/dirty.c).
gcc -static -O2 -Wall -o "$rootfs/bin/dirty" "$root/testbed/guest/dirty.c"
python3 "$root/testbed/mkcpio.py" "$rootfs" "$out/initramfs.cpio.tmp"
# The device tests' initramfs: the same plus devices.sh and its modules (the other guests
# boot without them, so their boot times do not change).
copy_modules "$work/kernel" "$work/devices" "${device_modules[@]}"
mv "$work/devices/lib/modules" "$rootfs/lib/modules/devices"
install -m 0755 "$root/testbed/guest/devices.sh" "$rootfs/devices.sh"
install -m 0755 "$root/testbed/guest/migrate.sh" "$rootfs/migrate.sh"
# The device benchmark's guest side (`vmhost.action=iobench`, testbed/guest/iobench-run).
install -m 0755 "$root/testbed/guest/iobench-run" "$rootfs/iobench-run"
gcc -static -O2 -Wall -o "$rootfs/bin/iobench" "$root/testbed/guest/iobench.c"
python3 "$root/testbed/mkcpio.py" "$rootfs" "$out/initramfs-devices.cpio.tmp"
mv "$out/initramfs-devices.cpio.tmp" "$out/initramfs-devices.cpio"
mv "$out/initramfs.cpio.tmp" "$out/initramfs.cpio"
echo "$inputs" > "$out/VERSION"
echo "guest initramfs built in $out ($(tr '\n' ' ' < "$rootfs/lib/modules/order"), $(du -h "$out/initramfs.cpio" | cut -f1))"
