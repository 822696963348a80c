#!/usr/bin/env bash
# Boots the emulated host once and runs the share's `run` script inside it.
#   testbed/boot.sh --nodes 2|4 --share DIR --log FILE [--timeout SECONDS]
#                   [--xshare DIR2] [--nic NETDEV --mac MAC]
# The host: QEMU in pure TCG (never -enable-kvm) emulating an AMD EPYC with SVM and nested
# paging, so kvm_amd loads inside and /dev/kvm works.
#   2 nodes: 2 sockets x 2 cores, 3 GiB per node, one 1 GiB page reserved per node at boot,
#            distances 10/20 (symmetric).
#   4 nodes: 4 sockets x 2 cores, 1 GiB per node, the asymmetric matrix
#            10 16 22 28 / 18 10 28 22 / 24 30 10 16 / 32 26 20 10.
# DIR is shared read-write over virtio-9p (mounted at /mnt inside), and read-only through a
# second virtio-9p device (tag share-small, mounted at /mnt-small with a smaller msize). The serial console goes to
# stdout and FILE; QEMU's monitor listens on the Unix socket FILE.monitor (testbed/run.sh asks
# it where the emulated CPUs are when the machine locks up). The cross-host suite
# (testbed/xhost.sh) boots two hosts side by side with two more things: --xshare DIR2, one more
# virtio-9p device (tag xshare, read-write) onto a directory both hosts get, and --nic NETDEV,
# a virtio NIC with MAC on the QEMU network backend `-netdev NETDEV` (a UDP socket pair on
# loopback). The exit status is the status of DIR/run inside, or 124 on a time-out, or
# 125 when the host did not report one (it crashed or never ran the script).
# VMHOST_TESTBED_QEMU names another QEMU binary (default: qemu-system-x86_64 on PATH) and
# VMHOST_TESTBED_QEMU_ARGS adds to its command line (e.g. `-L DIR` for its firmware), to try
# another emulator (docs/testing.md, "Guest triple faults").
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
img="${VMHOST_TESTBED_DIR:-$root/target/testbed}/image"
nodes=2 share="" log="" timeout=480 extra=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nodes) nodes="$2"; shift 2 ;;
        --share) share="$2"; shift 2 ;;
        --log) log="$2"; shift 2 ;;
        --timeout) timeout="$2"; shift 2 ;;
        --xshare) extra+=(-fsdev "local,id=fs2,path=$2,security_model=none"
                          -device virtio-9p-pci,fsdev=fs2,mount_tag=xshare); shift 2 ;;
        --nic) extra+=(-netdev "$2,id=xnet"); shift 2 ;;
        --mac) extra+=(-device "virtio-net-pci,netdev=xnet,mac=$2,romfile="); shift 2 ;;
        *) echo "testbed/boot.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[[ -n "$share" && -n "$log" ]] || { echo "usage: boot.sh --nodes 2|4 --share DIR --log FILE" >&2; exit 2; }
qemu="${VMHOST_TESTBED_QEMU:-qemu-system-x86_64}"
command -v "$qemu" >/dev/null \
    || { echo "testbed: $qemu not found: apt-get install qemu-system-x86" >&2; exit 1; }
[[ -s "$img/bzImage" && -s "$img/initramfs.cpio" ]] \
    || { echo "testbed: no image in $img: run testbed/build-image.sh" >&2; exit 1; }

numa=() append="console=ttyS0 panic=-1 oops=panic loglevel=4 mitigations=off"
case "$nodes" in
    2)
        smp="4,sockets=2,cores=2,threads=1"; per_node=3G
        dist=("10 20" "20 10")
        # nokaslr: with the kernel image at a random physical address it sometimes lands in
        # node 0's only free 1 GiB-aligned range (1-2 GiB), and Linux 6.1 then silently places
        # node 0's boot-time 1 GiB page on node 1 (memblock_alloc_try_nid_raw falls back to any
        # node). Without KASLR the image sits at 16 MiB and node 0 always gets its page.
        append+=" nokaslr hugepagesz=1G hugepages=0:1,1:1"
        ;;
    4)
        smp="8,sockets=4,cores=2,threads=1"; per_node=1G
        dist=("10 16 22 28" "18 10 28 22" "24 30 10 16" "32 26 20 10")
        ;;
    *) echo "testbed/boot.sh: --nodes must be 2 or 4" >&2; exit 2 ;;
esac
cpus_per_node=$(( ${smp%%,*} / nodes ))
for ((n = 0; n < nodes; n++)); do
    first=$(( n * cpus_per_node )); last=$(( first + cpus_per_node - 1 ))
    numa+=(-object "memory-backend-ram,id=m$n,size=$per_node"
           -numa "node,nodeid=$n,cpus=$first-$last,memdev=m$n")
done
for ((i = 0; i < nodes; i++)); do
    read -r -a row <<< "${dist[$i]}"
    for ((j = 0; j < nodes; j++)); do
        [[ $i -eq $j ]] && continue
        numa+=(-numa "dist,src=$i,dst=$j,val=${row[$j]}")
    done
done

set +e
timeout -k 10 "$timeout" "$qemu" ${VMHOST_TESTBED_QEMU_ARGS:-} \
    -accel tcg,thread=multi -cpu EPYC,+svm,+npt -machine pc \
    -smp "$smp" "${numa[@]}" -m "$(( ${per_node%G} * nodes ))G" \
    -kernel "$img/bzImage" -initrd "$img/initramfs.cpio" -append "$append" \
    -fsdev "local,id=fs0,path=$share,security_model=none" \
    -device virtio-9p-pci,fsdev=fs0,mount_tag=share \
    -fsdev "local,id=fs1,path=$share,security_model=none,readonly=on" \
    -device virtio-9p-pci,fsdev=fs1,mount_tag=share-small \
    "${extra[@]}" \
    -device isa-debug-exit,iobase=0xf4,iosize=0x04 \
    -display none -monitor "unix:$log.monitor,server=on,wait=off" \
    -serial stdio -no-reboot </dev/null 2>&1 | tee "$log"
qemu=${PIPESTATUS[0]}
set -e
if [[ $qemu -eq 124 || $qemu -eq 137 ]]; then
    echo "testbed: the ${nodes}-node host did not finish within ${timeout} s (serial log: $log)" >&2
    exit 124
fi
if (( qemu % 2 == 1 )); then
    exit $(( qemu >> 1 ))
fi
echo "testbed: the ${nodes}-node host exited with QEMU status $qemu without reporting one (serial log: $log)" >&2
# Status 0 under -no-reboot, not from a signal: the emulated machine reset (a triple fault) or
# powered off by itself; its run script always ends through the debug-exit port. Said in the
# log, where testbed/harness.sh's emulator_fault finds it.
if [[ $qemu -eq 0 ]] && ! tail -n 3 "$log" | grep -q 'terminating on signal'; then
    echo "testbed: the emulated machine reset or powered off by itself (QEMU status 0, no run script status)" >> "$log"
fi
exit 125
