#!/bin/busybox sh
# The live-migration workload (`vmhost.action=migrate`, run by /init; the initramfs with the
# device modules). It loads the virtio modules, gives eth0 10.0.2.15/24, mounts the ext4 disk
# /dev/vda, echoes every TCP connection on port 7000 (busybox `nc -e cat`), runs `dirty 32 128`
# (writing 128 MiB/s over a 32 MiB buffer, faster than the emulated host's stream, its beat lines sent back; testbed/guest/dirty.c) for
# as long as a TCP connection on port 7001 stays open, prints its NUMA view
# once (`GUEST-MIGREADY`), then ticks every half second until the VM is stopped:
# - `n`: a counter kept in the shell's memory, one more per tick;
# - a line `N BOOT_ID` appended to the disk's `ticks` file and synced; `lines` and `whole`
#   (1 when line k holds k and this boot's id, for every k) are read back from the disk;
# - 1 MiB of fresh random bytes written over `/tmp/blob` (tmpfs, guest RAM), its sha256 kept
#   in a shell variable; `mem_ok` is 1 when the blob still has the checksum of the last write
#   (a page the migration missed or sent stale would break it);
# - `numa_same`: the guest's NUMA view (each node's CPUs, distances, MemTotal) equals the first;
# - `nopic`: 1 when the guest finds no 8259 PIC (a split irqchip) with Linux's own probe,
#   `serial_irqs`: the interrupts counted on ttyS0 (the console's writes wait on them);
# - `reads`: passes of a background reader that keeps a disk read in flight nearly all the
#   time (`dd iflag=direct`, 1 MiB in 64 KiB requests from the raw disk). A request in flight
#   at the source's pause completes while the source quiesces its devices; its data and used
#   ring must reach the target, or the read never completes there and `reads` stops.
# testbed/runner/src/migration_tests.rs reads these lines from the source's and the target's
# consoles.
up() { cut -d' ' -f1 /proc/uptime; }
for m in $(cat /lib/modules/devices/order); do
    insmod "/lib/modules/devices/$m" 2>/dev/null
done
for i in $(seq 100); do
    [ -e /sys/block/vda ] && [ -e /sys/class/net/eth0 ] && break
    sleep 0.1
done
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
mkdir -p /mnt/log
mount -t ext4 /dev/vda /mnt/log || echo "GUEST-MIGFAIL mount=failed"
(while :; do nc -l -p 7000 -e cat; done) &
printf '#!/bin/busybox sh\nexec dirty 32 128\n' > /tmp/dirtier
chmod +x /tmp/dirtier
(while :; do nc -l -p 7001 -e /tmp/dirtier; done) &
(r=0; while :; do
    dd if=/dev/vda of=/dev/null bs=65536 count=16 iflag=direct 2>/dev/null
    r=$((r + 1))
    echo "$r" > /tmp/reads
done) &
numa() {
    for n in /sys/devices/system/node/node[0-9]*; do
        printf '%s:%s:%s:%s;' "${n##*node}" "$(cat "$n/cpulist")" "$(tr ' ' , < "$n/distance")" \
            "$(awk '/MemTotal/ {print $4}' "$n/meminfo")"
    done
}
view=$(numa)
# Linux's own 8259 probe, through /dev/port: 0xfb written to the master's mask register
# (0x21) reads back from a PIC; an absent one reads all ones. The mask is set back to 0xff
# (every PIC line masked, as Linux leaves it with an I/O APIC).
pic_probe() {
    printf '\373' | dd of=/dev/port bs=1 seek=33 count=1 conv=notrunc 2>/dev/null
    v=$(dd if=/dev/port bs=1 skip=33 count=1 2>/dev/null | od -An -tu1 | tr -d ' ')
    printf '\377' | dd of=/dev/port bs=1 seek=33 count=1 conv=notrunc 2>/dev/null
    if [ "$v" = 255 ]; then echo 1; else echo 0; fi
}
serial_irqs() {
    awk '/ttyS0/ {s = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i; print s}' /proc/interrupts
}
# A stall report, should the ticks stop (a failed test's evidence; never seen in a healthy
# run, whose ticks are at most a few seconds apart even while the emulated host migrates it):
# once per stall of 20 s of guest uptime, through /dev/kmsg (the kernel's console writes poll
# the UART, so they get out even when the tty's own output waits for an interrupt), the
# ttyS0 and virtio interrupt counts, the disk's requests in flight, the UART's counters, the
# processes, the kernel's last messages, and every task in D state (sysrq w).
stall() {
    echo "<3>GUEST-MIGSTALL $*" > /dev/kmsg
}
(seen=""; while :; do
    sleep 2
    t=$(cat /tmp/tick_at 2>/dev/null)
    [ -n "$t" ] && [ "$t" != "$seen" ] || continue
    now=$(up)
    [ $(( ${now%.*} - ${t%.*} )) -ge 20 ] || continue
    seen=$t
    stall "no tick since uptime $t, now $now; vda in flight (reads writes): $(cat /sys/block/vda/inflight)"
    grep -E 'ttyS0|virtio|LOC' /proc/interrupts | while read -r l; do stall "irq $l"; done
    grep '^0:' /proc/tty/driver/serial | while read -r l; do stall "uart $l"; done
    # Every user process with its state (a tick loop that died shows by its absence), and the
    # kernel's last lines below the console's level (a segfault is KERN_INFO).
    for p in /proc/[0-9]*; do
        c=$(tr '\0' ' ' 2>/dev/null < "$p/cmdline")
        [ -n "$c" ] && stall "task ${p#/proc/} $(cut -d' ' -f3 "$p/stat" 2>/dev/null) $c"
    done
    dmesg | grep -v GUEST-MIGSTALL | tail -n 15 | while read -r l; do stall "dmesg $l"; done
    # The task lines are KERN_INFO: the console prints them only at a higher log level.
    lvl=$(cut -f1 /proc/sys/kernel/printk)
    echo 7 > /proc/sys/kernel/printk
    echo w > /proc/sysrq-trigger
    echo "$lvl" > /proc/sys/kernel/printk
done) &
boot=$(cat /proc/sys/kernel/random/boot_id)
echo "GUEST-MIGREADY boot_id=$boot numa=$view mac=$(cat /sys/class/net/eth0/address)"
i=0
sum=""
while :; do
    up > /tmp/tick_at
    mem_ok=1
    [ -n "$sum" ] && [ "$(sha256sum < /tmp/blob | cut -c1-64)" != "$sum" ] && mem_ok=0
    dd if=/dev/urandom of=/tmp/blob bs=65536 count=16 2>/dev/null
    sum=$(sha256sum < /tmp/blob | cut -c1-64)
    echo "$i $boot" >> /mnt/log/ticks
    sync
    lines=$(wc -l < /mnt/log/ticks)
    whole=$(awk -v b="$boot" '$1 != NR - 1 || $2 != b {bad = 1} END {print bad ? 0 : 1}' /mnt/log/ticks)
    same=0
    [ "$(numa)" = "$view" ] && same=1
    reads=$(cat /tmp/reads 2>/dev/null)
    nopic=$(pic_probe)
    echo "GUEST-MIGTICK n=$i boot_id=$boot uptime=$(up) lines=$lines whole=$whole mem_ok=$mem_ok numa_same=$same reads=${reads:-0} nopic=$nopic serial_irqs=$(serial_irqs)"
    i=$((i + 1))
    sleep 0.5
done
