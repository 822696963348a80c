#!/usr/bin/env bash
# Downloads a Debian 6.1 amd64 kernel for vmhost-boot's loader tests and extracts it into
# $VMHOST_TEST_KERNEL_DIR (default: <workspace>/target/test-kernel):
#   bzImage  - the package's boot/vmlinuz-* (a compressed bzImage)
#   vmlinux  - the uncompressed ELF cut out of it (the kernel's scripts/extract-vmlinux approach)
#   VERSION  - the package name
# Run it once before `cargo test -p vmhost-boot` (CI does); the tests never download anything.
# Needs apt-get, dpkg, python3 (lzma/gzip/bz2 built in) and, for zstd-compressed images, zstd.
# Set VMHOST_TEST_KERNEL_PKG to pick a package (default: the newest linux-image-6.1.0-*-amd64).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
dir="${VMHOST_TEST_KERNEL_DIR:-$root/target/test-kernel}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

if [[ -s "$dir/bzImage" && -s "$dir/vmlinux" ]]; then
    echo "test kernel already in $dir ($(cat "$dir/VERSION" 2>/dev/null || echo unknown))"
    exit 0
fi

pkg="${VMHOST_TEST_KERNEL_PKG:-}"
if [[ -z "$pkg" ]]; then
    pkg="$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64$' \
        | awk '{print $1}' | sort -V | tail -n 1)"
fi
if [[ -z "$pkg" ]]; then
    echo "no linux-image-6.1.0-*-amd64 package known to apt (run apt-get update?)" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "$pkg")
dpkg -x "$work"/*.deb "$work/root"
vmlinuz="$(ls "$work"/root/boot/vmlinuz-* | head -n 1)"
cp "$vmlinuz" "$dir/bzImage.tmp"

python3 - "$vmlinuz" "$dir/vmlinux.tmp" <<'PY'
import bz2, gzip, lzma, shutil, subprocess, sys, zlib

src, dst = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()

def xz(b): return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(b)
def lzma_alone(b): return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(b)
def gz(b): return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(b)
def bzip2(b): return bz2.BZ2Decompressor().decompress(b)
def zstd(b):
    if shutil.which("zstd") is None:
        raise RuntimeError("zstd not installed")
    r = subprocess.run(["zstd", "-dc"], input=b, capture_output=True)
    return r.stdout  # trailing garbage after the frame makes zstd fail after writing it

formats = [
    (b"\xfd7zXZ\x00", xz), (b"\x28\xb5\x2f\xfd", zstd), (b"\x1f\x8b\x08", gz),
    (b"\x5d\x00\x00\x00", lzma_alone), (b"BZh", bzip2),
]
for magic, fn in formats:
    pos = data.find(magic)
    while pos >= 0:
        try:
            out = fn(data[pos:])
        except Exception:
            out = b""
        if out[:4] == b"\x7fELF":
            open(dst, "wb").write(out)
            print(f"vmlinux: {fn.__name__} stream at offset {pos:#x}, {len(out)} bytes")
            sys.exit(0)
        pos = data.find(magic, pos + 1)
sys.exit("no compressed ELF found in " + src)
PY

mv "$dir/bzImage.tmp" "$dir/bzImage"
mv "$dir/vmlinux.tmp" "$dir/vmlinux"
echo "$pkg" > "$dir/VERSION"
echo "test kernel $pkg in $dir"
