#!/usr/bin/env bash
# Builds the emulated host's boot image from Debian packages, cached under target/testbed/:
#   image/bzImage        the host kernel: the same linux-image-6.1.0-*-amd64 package as the
#                        test kernel (crates/boot/scripts/fetch-test-kernel.sh)
#   image/initramfs.cpio busybox-static, numactl and dmsetup (+ their libraries), the KVM,
#                        virtio/9p, tun, vhost, loop and device-mapper (dm_mod, dm-log-writes)
#                        modules in load order, and testbed/init as /init
#   image/VERSION        what the image was built from (a changed input rebuilds it)
# Needs apt-get, dpkg-deb, depmod/modprobe (kmod) and python3. Downloads only from Debian's
# package archive.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tb="${VMHOST_TESTBED_DIR:-$root/target/testbed}"
img="$tb/image"
debs="$tb/debs"
mkdir -p "$img" "$debs"

# shellcheck source=testbed/modules.sh
source "$root/testbed/modules.sh"
die() { echo "testbed/build-image: $*" >&2; exit 1; }
for tool in apt-get dpkg-deb depmod modprobe python3; do
    command -v "$tool" >/dev/null || die "$tool not found: apt-get install kmod dpkg python3"
done

kpkg="${VMHOST_TEST_KERNEL_PKG:-}"
if [[ -z "$kpkg" && -s "$root/target/test-kernel/VERSION" ]]; then
    kpkg="$(cat "$root/target/test-kernel/VERSION")"
fi
if [[ -z "$kpkg" ]]; then
    kpkg="$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' \
        | awk '{print $1}' | sort -V | tail -n 1)"
fi
[[ -n "$kpkg" ]] || die "no linux-image-6.1.0-*-amd64 package known to apt (run apt-get update)"

modules=(kvm-amd 9p 9pnet_virtio virtio_pci virtio_blk virtio_net virtio_console tun bridge vhost_vsock vhost_net loop dm_mod dm-log-writes)
# dmsetup's libraries beside libdevmapper (from its package), taken from this machine like libc.
dm_libs=(libselinux.so.1 libudev.so.1 libpcre2-8.so.0 libm.so.6)
inputs="$kpkg busybox-static numactl libnuma1 dmsetup libdevmapper1.02.1 ${dm_libs[*]} ${modules[*]} $(cat "$root/testbed/init" "$root/testbed/modules.sh" "$0" | sha256sum | cut -c1-16)"
if [[ -s "$img/initramfs.cpio" && -s "$img/bzImage" && "$(cat "$img/VERSION" 2>/dev/null)" == "$inputs" ]]; then
    echo "testbed image up to date in $img ($kpkg)"
    exit 0
fi

fetch() { # fetch PACKAGE: the .deb in $debs (downloaded once)
    local deb
    deb="$(ls "$debs/$1"_*.deb 2>/dev/null | head -n 1 || true)"
    if [[ -z "$deb" ]]; then
        (cd "$debs" && apt-get download "$1" >/dev/null) || die "apt-get download $1 failed (apt-get update?)"
        deb="$(ls "$debs/$1"_*.deb | head -n 1)"
    fi
    echo "$deb"
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
kroot="$work/kernel"
dpkg-deb -x "$(fetch "$kpkg")" "$kroot"
kver="$(ls "$kroot/lib/modules" | head -n 1)"
cp "$kroot"/boot/vmlinuz-* "$img/bzImage.tmp"

rootfs="$work/rootfs"
mkdir -p "$rootfs"/{bin,sbin,dev,proc,sys,run,tmp,mnt,etc,lib/modules,lib64,lib/x86_64-linux-gnu,usr/bin}
copy_modules "$kroot" "$rootfs" "${modules[@]}"
echo "modules: $(tr '\n' ' ' < "$rootfs/lib/modules/order")"

bb="$work/busybox"
dpkg-deb -x "$(fetch busybox-static)" "$bb"
cp "$bb/bin/busybox" "$rootfs/bin/busybox"

nu="$work/numactl"
dpkg-deb -x "$(fetch numactl)" "$nu"
dpkg-deb -x "$(fetch libnuma1)" "$nu"
cp "$nu/usr/bin/numactl" "$rootfs/usr/bin/numactl"
cp -L "$nu"/usr/lib/x86_64-linux-gnu/libnuma.so.1 "$rootfs/lib/x86_64-linux-gnu/"
# numactl is dynamic: the host's libc and loader (Debian 12, the same release) go with it.
cp -L /lib/x86_64-linux-gnu/libc.so.6 "$rootfs/lib/x86_64-linux-gnu/"
cp -L /lib64/ld-linux-x86-64.so.2 "$rootfs/lib64/"

# dmsetup (dm-log-writes and suspended dm-linear devices of the virtio-blk tests) is dynamic too.
dm="$work/dmsetup"
dpkg-deb -x "$(fetch dmsetup)" "$dm"
dpkg-deb -x "$(fetch libdevmapper1.02.1)" "$dm"
cp "$dm/sbin/dmsetup" "$rootfs/sbin/dmsetup"
cp -L "$dm"/lib/x86_64-linux-gnu/libdevmapper.so.1.02.1 "$rootfs/lib/x86_64-linux-gnu/"
for lib in "${dm_libs[@]}"; do
    [[ -e "/lib/x86_64-linux-gnu/$lib" ]] || die "/lib/x86_64-linux-gnu/$lib not found (dmsetup needs it): apt-get install libselinux1 libudev1 libpcre2-8-0"
    cp -L "/lib/x86_64-linux-gnu/$lib" "$rootfs/lib/x86_64-linux-gnu/"
done
install -m 0755 "$root/testbed/init" "$rootfs/init"

python3 "$root/testbed/mkcpio.py" "$rootfs" "$img/initramfs.cpio.tmp"
mv "$img/bzImage.tmp" "$img/bzImage"
mv "$img/initramfs.cpio.tmp" "$img/initramfs.cpio"
echo "$kver" > "$img/KVER"
echo "$inputs" > "$img/VERSION"
echo "testbed image built in $img ($kpkg, $(du -h "$img/initramfs.cpio" | cut -f1) initramfs)"
