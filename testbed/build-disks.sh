#!/usr/bin/env bash
# testbed/build-disks.sh DIR: the disk images of the virtio device tests
# (testbed/runner/src/device_tests.rs), made fresh for every run of testbed/run.sh:
#   DIR/files/      known files (random contents and sizes, a text file, an empty file, a
#                   nested directory); the runner checksums them itself
#   DIR/data.ext4   a 32 MiB ext4 file system holding exactly DIR/files (mkfs.ext4 -d)
#   DIR/golden.img  4 MiB of random bytes, the read-only disk
#   DIR/empty.ext4  a 32 MiB empty ext4 file system (the live-migration guest's log disk,
#                   testbed/runner/src/migration_tests.rs)
# Needs mkfs.ext4 (e2fsprogs).
set -euo pipefail
dir="$1"
command -v mkfs.ext4 >/dev/null || { echo "testbed/build-disks: mkfs.ext4 not found: apt-get install e2fsprogs" >&2; exit 1; }
rm -rf "$dir" && mkdir -p "$dir/files/docs" "$dir/files/deep/er/est"
head -c 1048576 /dev/urandom > "$dir/files/one-mib.bin"
head -c 12345 /dev/urandom > "$dir/files/odd-size.bin"
head -c 6000000 /dev/urandom > "$dir/files/deep/er/est/six-mb.bin"
printf 'vmhost virtio-blk test disk, built %s\n' "$(date -u +%FT%TZ)" > "$dir/files/docs/readme.txt"
: > "$dir/files/empty"
mkfs.ext4 -q -F -L data -d "$dir/files" "$dir/data.ext4" 32M > /dev/null
head -c 4194304 /dev/urandom > "$dir/golden.img"
mkfs.ext4 -q -F -L log "$dir/empty.ext4" 32M > /dev/null
