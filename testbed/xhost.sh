# The cross-host suite, sourced by testbed/run.sh (`testbed/run.sh xhost`, run by
# `make bench-testbed`; docs/testing.md): live migration of a Linux guest from the 2-node
# emulated host to the 4-node one, both booted side by side on this machine.
#   - a network: each host gets a virtio NIC on a QEMU UDP socket network on loopback
#     (`-netdev socket,udp=127.0.0.1:THEIRS,localaddr=127.0.0.1:MINE`: connectionless, so
#     neither host waits for the other to start); the runners give them 192.168.77.1 and .2;
#   - storage both see: target/testbed/share-xhost-common on a third virtio-9p device (tag
#     xshare, mounted at /xshare by the runner) in both hosts: the guest's disk image and the
#     files the two runners hand each other (TSC rates, the source's report and console, the
#     target's account);
#   - each host its own share (share-xhost-source, share-xhost-target) with the binaries, its
#     `run` script (`vmhost-testbed --suite xhost --role source|target`) and its results.
# Both hosts must pass: each share's PASS lines are judged against its own `--list`, as any
# suite's (judge, harness.sh's suite_verdict). No host is booted again after an emulator
# lockup here (the other host would wait for it in vain): a lockup fails the run. `--only` does
# not apply (each role has one test). VMHOST_TESTBED_XHOST_TSC_TOLERANCE=PPM sets the target
# KVM's kvm.tsc_tolerance_ppm before anything runs (0: any difference in the two hosts' TSC
# rates is refused at the hello, the test then asserts the refusal). Uses run.sh's
# boot_and_watch, judge, $root, $tb, $bin.

# Two free UDP ports on 127.0.0.1, one per host.
xhost_udp_ports() {
    python3 -c 'import socket
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])'
}

# A fresh share for ROLE's host: binaries, guest assets, disk images, `run`, `expected`.
#   xhost_share ROLE
xhost_share() {
    local role="$1" share="$tb/share-xhost-$1"
    rm -rf "$share" && mkdir -p "$share/guest"
    cp "$bin/vmhost" "$bin/vmhost-testbed" "$share/"
    cp "$root/target/test-kernel/vmlinux" "$root/target/test-kernel/bzImage" "$share/guest/"
    cp -a "$tb/guest/initramfs.cpio" "$tb/guest/initramfs-devices.cpio" "$share/guest/"
    bash "$root/testbed/build-disks.sh" "$share/guest/virtio" > /dev/null
    write_run_script "$share" xhost "" "--role $role"
    rm -f "$share/skip" "$share/passed-earlier" "$share/results.txt" "$share/runner-status"
    "$bin/vmhost-testbed" --suite xhost --role "$role" --list > "$share/expected"
}

# Boots both hosts at once, waits for both, and judges each.
run_xhost() {
    local common="$tb/share-xhost-common" port_s port_t rc_s=0 rc_t=0 pid_s pid_t role
    rm -rf "$common" && mkdir -p "$common"
    xhost_share source
    xhost_share target
    read -r port_s port_t < <(xhost_udp_ports)
    default_limit=900
    echo "== testbed: xhost: the 2-node host (source) and the 4-node host (target) side by side," \
        "UDP ports $port_s/$port_t, serial logs $tb/logs/xhost-{source,target}.log"
    boot_and_watch 2 "$tb/share-xhost-source" "$tb/logs/xhost-source.log" --xshare "$common" \
        --nic "socket,udp=127.0.0.1:$port_t,localaddr=127.0.0.1:$port_s" \
        --mac 52:54:00:77:00:01 &
    pid_s=$!
    boot_and_watch 4 "$tb/share-xhost-target" "$tb/logs/xhost-target.log" --xshare "$common" \
        --nic "socket,udp=127.0.0.1:$port_s,localaddr=127.0.0.1:$port_t" \
        --mac 52:54:00:77:00:02 &
    pid_t=$!
    wait "$pid_s" || rc_s=$?
    wait "$pid_t" || rc_t=$?
    for role in source target; do
        grep -a -E '^  (xhost|migration):' "$tb/share-xhost-$role/results.txt" 2>/dev/null || true
    done
    judge xhost-source "$tb/share-xhost-source" "$tb/logs/xhost-source.log" "$rc_s"
    judge xhost-target "$tb/share-xhost-target" "$tb/logs/xhost-target.log" "$rc_t"
}
