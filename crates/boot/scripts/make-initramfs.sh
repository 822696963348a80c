#!/usr/bin/env bash
# Builds a small initramfs for booting a test kernel under vmhost to a shell:
#   busybox (static) for the shell and tools, numactl with the shared libraries it needs, and
#   an /init that mounts proc/sys/dev, prints `numactl -H` and the CPU count, then starts a
#   shell on the console. `poweroff -f` in the guest ends the VM (ACPI S5), `reboot -f` too.
# Output: $1 (default: <workspace>/target/test-kernel/initramfs.cpio.gz).
# Needs busybox-static, numactl and cpio (apt-get install busybox-static numactl cpio).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
out="${1:-$root/target/test-kernel/initramfs.cpio.gz}"
mkdir -p "$(dirname "$out")"

busybox="$(command -v busybox || true)"
if [[ -z "$busybox" ]] || ! file -L "$busybox" 2>/dev/null | grep -q "statically linked"; then
    busybox=/bin/busybox
fi
for tool in "$busybox" numactl cpio gzip; do
    command -v "$tool" >/dev/null || {
        echo "missing $tool: apt-get install busybox-static numactl cpio" >&2
        exit 1
    }
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,etc}
cp "$busybox" "$work/bin/busybox"
for applet in $("$busybox" --list); do
    [[ -e "$work/bin/$applet" ]] || ln -s busybox "$work/bin/$applet"
done

# numactl and the libraries the dynamic loader needs for it.
numactl="$(command -v numactl)"
cp "$numactl" "$work/usr/bin/numactl"
ldd "$numactl" | awk '/=>/ { print $3 } /^[ \t]*\// { print $1 }' | sort -u | while read -r lib; do
    [[ -n "$lib" && -e "$lib" ]] || continue
    mkdir -p "$work$(dirname "$lib")"
    cp -L "$lib" "$work$lib"
done

cat > "$work/init" <<'INIT'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
echo "vmhost initramfs: $(grep -c ^processor /proc/cpuinfo) CPUs online"
numactl -H
echo "shell on the serial console; 'poweroff -f' ends the VM"
exec setsid cttyhack /bin/sh
INIT
chmod 755 "$work/init"

(cd "$work" && find . | cpio -o -H newc --quiet | gzip -9) > "$out.tmp"
mv "$out.tmp" "$out"
echo "initramfs $out ($(du -h "$out" | cut -f1))"
