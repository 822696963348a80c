#!/bin/busybox sh
# The virtio device checks of the Linux guest (`vmhost.action=devices`, run by /init): loads
# the virtio-mmio, blk, net, rng, ext4 and vfat modules (lib/modules/devices/), then reports
# what the real drivers see as `GUEST key=value` lines on the console, for
# testbed/runner/src/device_tests.rs to compare with the host's side. The disks are found by
# their serial (GET_ID): `data` (ext4, read-write), `golden` (read-only), `scratch` (raw,
# read-write) and `cloudinitdisk` (the NoCloud seed). The host is 10.0.2.1 on the tap; it
# listens on 5001 (receives 64 MiB) and 5002 (sends 64 MiB). Last, a pattern is written to the
# scratch disk and synced; then the guest idles until vmhost is killed.
up() { cut -d' ' -f1 /proc/uptime; }
for m in $(cat /lib/modules/devices/order); do
    insmod "/lib/modules/devices/$m" 2>/dev/null
done
echo "GUEST cmdline_virtio=$(grep -c virtio_mmio.device /proc/cmdline) uptime=$(up)"
# Give the drivers a moment to probe (the devices appear while the modules load).
for i in $(seq 50); do
    [ "$(ls /sys/block | grep -c '^vd')" -ge 4 ] && [ -e /sys/class/net/eth0 ] && break
    sleep 0.1
done
for d in /sys/bus/virtio/devices/*; do
    [ -e "$d" ] || continue
    drv=$(readlink "$d/driver")
    parent=$(readlink -f "$d/..")
    echo "GUEST virtio=${d##*/} device=$(cat "$d/device") parent=${parent##*/} driver=${drv##*/}"
done
dev_of() { # dev_of SERIAL: the vdX whose GET_ID serial is SERIAL
    for b in /sys/block/vd*; do
        [ "$(cat "$b/serial" 2>/dev/null)" = "$1" ] && echo "${b##*/}" && return
    done
}
for b in /sys/block/vd*; do
    [ -e "$b" ] || continue
    # write_cache "write back": the driver saw VIRTIO_BLK_F_FLUSH and sends flushes.
    echo "GUEST disk=${b##*/} serial=$(cat "$b/serial") ro=$(cat "$b/ro") sectors=$(cat "$b/size") write_cache=$(tr ' ' _ < "$b/queue/write_cache")"
done

# Entropy.
bytes=$(head -c 64 /dev/hwrng | wc -c)
hex=$(head -c 64 /dev/hwrng | xxd -p | tr -d '\n')
echo "GUEST hwrng current=$(cat /sys/class/misc/hw_random/rng_current) bytes=$bytes hex=$hex"

# The cloud-init seed.
seed=$(dev_of cloudinitdisk)
mkdir -p /mnt/seed /mnt/data
if [ -n "$seed" ] && mount -t vfat -o ro "/dev/$seed" /mnt/seed; then
    echo "GUEST seed files=$(ls /mnt/seed | tr '\n' ,) user_data_bytes=$(wc -c < /mnt/seed/user-data) user_data_sha256=$(sha256sum < /mnt/seed/user-data | cut -c1-64)"
    echo "GUEST seed instance=$(grep instance-id /mnt/seed/meta-data | tr -d ' ')"
    umount /mnt/seed
else
    echo "GUEST seed mount=failed dev=$seed"
fi

# The ext4 disk: every file's checksum.
data=$(dev_of data)
if [ -n "$data" ] && mount -t ext4 "/dev/$data" /mnt/data; then
    (cd /mnt/data && find . -type f | sort | while read -r f; do
        echo "GUEST file=${f#./} sha256=$(sha256sum < "$f" | cut -c1-64)"
    done)
    umount /mnt/data
    echo "GUEST data files_done=1"
else
    echo "GUEST data mount=failed dev=$data"
fi

# The read-only disk: the guest sees it read-only and a write fails.
golden=$(dev_of golden)
if [ -n "$golden" ]; then
    err=$(dd if=/dev/zero of="/dev/$golden" bs=4096 count=1 conv=fsync 2>&1)
    rc=$?
    echo "GUEST golden ro=$(cat "/sys/block/$golden/ro") write_rc=$rc write_err=$(echo "$err" | head -n 1 | tr ' ' _)"
else
    echo "GUEST golden missing=1"
fi

# The network: ping the host over the tap, then 64 MiB each way.
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
# The virtio feature bits the driver accepted, bit 0 first (bit 15: mergeable receive buffers).
echo "GUEST net mac=$(cat /sys/class/net/eth0/address) features=$(cat /sys/class/net/eth0/device/features)"
for i in $(seq 120); do
    ping -c 1 -W 1 10.0.2.1 >/dev/null 2>&1 && break
done
received=$(ping -c 3 -W 2 10.0.2.1 | grep -o '[0-9]* packets received' | cut -d' ' -f1)
echo "GUEST ping received=${received:-0} uptime=$(up)"
dd if=/dev/urandom of=/tmp/out bs=1048576 count=64 2>/dev/null
out=$(sha256sum < /tmp/out | cut -c1-64)
t0=$(up)
nc 10.0.2.1 5001 < /tmp/out
rc=$?
echo "GUEST net_out rc=$rc bytes=$(wc -c < /tmp/out) sha256=$out start=$t0 end=$(up)"
rm -f /tmp/out
t0=$(up)
nc 10.0.2.1 5002 -e sh -c 'cat > /tmp/in'
t1=$(up)
echo "GUEST net_in bytes=$(wc -c < /tmp/in) sha256=$(sha256sum < /tmp/in | cut -c1-64) start=$t0 end=$t1"
rm -f /tmp/in

# Flush durability: a pattern at 1 MiB into the scratch disk, fsync'd and synced.
scratch=$(dev_of scratch)
dd if=/dev/urandom of=/tmp/pattern bs=4096 count=64 2>/dev/null
if [ -n "$scratch" ] && dd if=/tmp/pattern of="/dev/$scratch" bs=4096 seek=256 conv=fsync 2>/dev/null; then
    sync
    echo "GUEST-SYNCED uptime=$(up) offset=1048576 bytes=262144 sha256=$(sha256sum < /tmp/pattern | cut -c1-64)"
else
    echo "GUEST-SYNCED failed=1 dev=$scratch"
fi
while :; do sleep 1; done
