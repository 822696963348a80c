#!/usr/bin/env python3
"""Times the KVM VM teardown a short-lived VM pays, by in-kernel PIT mode (docs/benchmarks.md,
"Start -> exit on the CI host"). Each VM: KVM_CREATE_VM, a 1 MiB memslot, KVM_CREATE_IRQCHIP,
then the mode's PIT, one vCPU in real mode running `out 0x80, al; hlt` once (KVM_RUN returns
on the OUT), then close(vCPU fd) and close(VM fd), which is timed.

Modes: pit (KVM_CREATE_PIT2, as vmhost and Firecracker), noreinject (the PIT, then
KVM_REINJECT_CONTROL 0), nopit (no PIT). Rounds rotate the order, 50 ms apart.
Usage: python3 scripts/probe-kvm-close.py [ROUNDS]  (needs /dev/kvm)
"""
import ctypes
import mmap
import os
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
KVMIO = 0xAE


def _io(n):
    return (KVMIO << 8) | n


def _iow(n, size):
    return (1 << 30) | (size << 16) | (KVMIO << 8) | n


def _ior(n, size):
    return (2 << 30) | (size << 16) | (KVMIO << 8) | n


KVM_CREATE_VM = _io(0x01)
KVM_GET_VCPU_MMAP_SIZE = _io(0x04)
KVM_CREATE_VCPU = _io(0x41)
KVM_SET_USER_MEMORY_REGION = _iow(0x46, 32)
KVM_CREATE_IRQCHIP = _io(0x60)
KVM_REINJECT_CONTROL = _io(0x71)
KVM_CREATE_PIT2 = _iow(0x77, 64)
KVM_RUN = _io(0x80)
KVM_SET_REGS = _iow(0x82, 144)
KVM_GET_SREGS = _ior(0x83, 312)
KVM_SET_SREGS = _iow(0x84, 312)
KVM_EXIT_IO = 2


def ioctl(fd, req, arg=0):
    r = libc.ioctl(fd, ctypes.c_ulong(req), arg)
    if r < 0:
        raise OSError(ctypes.get_errno(), f"ioctl {req:#x}")
    return r


def once(mode):
    t0 = time.perf_counter()
    kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    vm = ioctl(kvm, KVM_CREATE_VM, 0)
    size = 1 << 20
    mem = mmap.mmap(-1, size)
    code = bytes([0xE6, 0x80, 0xF4])  # out 0x80, al; hlt
    mem[0 : len(code)] = code
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    ioctl(vm, KVM_SET_USER_MEMORY_REGION, ctypes.create_string_buffer(struct.pack("IIQQQ", 0, 0, 0, size, addr)))
    ioctl(vm, KVM_CREATE_IRQCHIP, 0)
    if mode != "nopit":
        ioctl(vm, KVM_CREATE_PIT2, ctypes.create_string_buffer(64))
        if mode == "noreinject":
            ioctl(vm, KVM_REINJECT_CONTROL, ctypes.create_string_buffer(32))
    vcpu = ioctl(vm, KVM_CREATE_VCPU, 0)
    run = mmap.mmap(vcpu, ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    sregs = ctypes.create_string_buffer(312)
    ioctl(vcpu, KVM_GET_SREGS, sregs)
    raw = bytearray(sregs.raw)
    struct.pack_into("QIH", raw, 0, 0, 0xFFFF, 0)  # cs: base 0, limit 0xffff, selector 0
    ioctl(vcpu, KVM_SET_SREGS, ctypes.create_string_buffer(bytes(raw)))
    regs = bytearray(144)
    struct.pack_into("QQ", regs, 128, 0, 2)  # rip 0, rflags 2
    ioctl(vcpu, KVM_SET_REGS, ctypes.create_string_buffer(bytes(regs)))
    ioctl(vcpu, KVM_RUN, 0)
    reason = struct.unpack_from("I", run, 8)[0]
    if reason != KVM_EXIT_IO:
        raise SystemExit(f"{mode}: exit reason {reason}, want KVM_EXIT_IO")
    run.close()
    os.close(vcpu)
    t1 = time.perf_counter()
    os.close(vm)
    t2 = time.perf_counter()
    os.close(kvm)
    mem.close()
    return (t2 - t1) * 1e3, (t1 - t0) * 1e3, (t2 - t0) * 1e3


def med(v):
    return sorted(v)[len(v) // 2]


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    modes = ["pit", "noreinject", "nopit"]
    res = {m: [] for m in modes}
    for i in range(rounds):
        k = i % len(modes)
        for m in modes[k:] + modes[:k]:
            res[m].append(once(m))
            time.sleep(0.05)
    print(f"{rounds} rounds; ms, median [min-max]")
    for m in modes:
        close, setup, total = (list(x) for x in zip(*res[m]))
        print(
            f"{m:<11} close(VM fd) {med(close):6.2f} [{min(close):.2f}-{max(close):.2f}]"
            f"  create..run {med(setup):6.2f}  total {med(total):6.2f} [{min(total):.2f}-{max(total):.2f}]"
        )


main()
