#!/usr/bin/env python3
"""Writes src/text-order.txt: the functions a VM start runs, for the linker to put first.

The kernel maps a binary's text 64 KiB at a time around each page a process runs
(fault-around), so `VmRSS` follows how far apart the code a start runs is, not how much of it
there is: without an order, a running vmhost maps 4.2 of its 4.4 MiB of text. `build.rs` passes
this file to LLD (`--symbol-ordering-file`) for the release binary; the functions named here
then sit together at the start of `.text` (docs/benchmarks.md, "Resident memory").

How: a release build of vmhost made for valgrind (`VMHOST_BUILD_FOR_VALGRIND=1`: valgrind has
no seccomp(2), crates/seccomp) runs the starts below under `valgrind --tool=callgrind`, which
names every function that ran. Functions are ordered by how many of the runs ran them (most
first), then by their address in the build (the order LTO gave them); then the rest of the
device and vCPU crates (a Linux guest's I/O, which a nested host's guest never reaches); those
only `vmhost ctl` runs come last. The names are the mangled symbols, which stay the same while a crate's version,
features and the compiler stay the same: run this again after `cargo update` or a new rustc
(the linker skips names it no longer finds; `--check` counts them).

Needs root, /dev/kvm, 32 free 2 MiB hugepages (scripts/with-hugepages.sh), valgrind and nm.

    python3 scripts/text-order.py            # build, profile, write src/text-order.txt
    python3 scripts/text-order.py --check    # how many names the release binary still has
    python3 scripts/text-order.py --emulated-pages LOG   # see below

The nested guest of this host does not get far into a Linux boot, so the code a whole boot
runs in the VMM (the guest's port and MMIO probes, its console, ACPI) is missing from these
profiles; the emulated host's boots reach user space. `VMHOST_TESTBED_PROFILE=release
VMHOST_BENCH_TEXT_PAGES=1 bash testbed/run.sh bench --only linux_boot_vs_peers` boots vmhost
there with the kernel's fault-around at one page and prints which pages of the release binary
each boot mapped by `/init` (testbed/runner/src/text_pages.rs). `--emulated-pages LOG` (the
bench host's serial log, target/testbed/logs/bench.log) names the functions on those pages
from the same release binary into src/text-order-emulated.txt; the order puts those that the
profiles here did not see right after the ones they did.
"""

import bisect
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = os.path.join(ROOT, "src", "text-order.txt")
EMULATED = os.path.join(ROOT, "src", "text-order-emulated.txt")
PROFILE_TARGET = os.path.join(ROOT, "target", "text-order")
TRIPLE = "x86_64-unknown-linux-gnu"
RELEASE_BIN = os.path.join(ROOT, "target", TRIPLE, "release", "vmhost")

SPEC = """name = "order-{name}"
[cpu]
cores = {cores}
dedicated_cpu_placement = {pinned}
isolate_emulator_thread = {pinned}
[memory]
guest = "64Mi"
hugepages = {{ page_size = "2Mi" }}
[boot]
payload = "{payload}"
"""

# A Linux guest with a disk, a cloud-init seed and an entropy device: its start (the kernel
# loaded, the devices and their threads, ACPI) and its first seconds of serial and device I/O.
# On a nested host a guest kernel's ring 0 is emulated, so it does not get far in LINUX_SECONDS;
# what the VMM runs before and around the guest's early boot is the point.
LINUX = """name = "order-linux"
[cpu]
cores = 1
[memory]
guest = "256Mi"
hugepages = {{ page_size = "2Mi" }}
[boot]
kernel = "{kernel}"
cmdline = "console=ttyS0"
[devices]
rng = {{}}
[[devices.disks]]
name = "scratch"
[[volumes]]
name = "scratch"
empty_disk = {{ capacity = "8Mi" }}
[[devices.disks]]
name = "seed"
bus = "cdrom"
[[volumes]]
name = "seed"
cloud_init_no_cloud = {{ user_data = "#cloud-config\\n" }}
"""
LINUX_SECONDS = 20
KERNEL = os.path.join(ROOT, "target", "test-kernel", "vmlinux")

# The code a running Linux guest's drivers reach (virtqueues, device requests, the UART, the
# vCPUs' exit handling) that the runs above do not, because on a nested host the guest's kernel
# does not get to its drivers: every other function of these crates, right after the profiled
# ones, so that a guest doing I/O maps that code from one place.
WARM_CRATES = ["vmhost_devices", "virtio_queue", "vm_superio", "vmhost_vcpu"]

# (name, payload (`linux`: the LINUX spec), pinned, extra vmhost options, query the control API)
RUNS = [
    ("halt", "halt", "false", [], False),
    ("halt-json", "halt", "false", ["--json"], False),
    ("idle", "idle", "false", [], False),
    ("idle-api", "idle", "false", ["--api-socket", "{dir}/api.sock"], True),
    ("idle-pinned", "idle", "true", [], False),
    ("idle-background", "idle", "false", ["--prefault", "background"], False),
    ("quickstart", None, "false", [], False),
    ("linux", "linux", "false", [], False),
]


def die(msg):
    sys.exit(f"text-order: {msg}")


def text_symbols(binary):
    """Function symbol -> (address, size, nm type) of `binary` (`i`: an IFUNC resolver)."""
    out = subprocess.run(["nm", "-S", binary], check=True, capture_output=True, text=True).stdout
    syms = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) == 4 and f[2] in "tTwWi":
            syms.setdefault(f[3], (int(f[0], 16), int(f[1], 16), f[2]))
    return syms


# What runs before `main` that callgrind does not name as itself: the entry point, libc's start
# (`(below main)` to valgrind) and every IFUNC resolver, which a static binary's start-up calls
# for its IRELATIVE relocations (memcpy's and the other string functions' pick of a variant).
# The C runtime's own start-up code (crtbegin's `frame_dummy` and its neighbours) is added too.
STARTUP = ["_start", "__libc_start_main", "__libc_start_main_impl", "__libc_start_call_main",
           "frame_dummy", "register_tm_clones", "deregister_tm_clones", "__do_global_dtors_aux"]


def ran(callgrind_out):
    """The functions a callgrind profile counts any cost for."""
    names, ids = set(), {}
    for line in open(callgrind_out, errors="replace"):
        m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
        if m:
            kind, i, name = m.groups()
            if name:
                ids[i] = name.split("'")[0]
            if kind == "fn" and i in ids:
                names.add(ids[i])
    return names


def valgrind(out, argv, **kw):
    env = dict(os.environ, VMHOST_LOG="warn")
    cmd = ["valgrind", "--tool=callgrind", "--demangle=no", f"--callgrind-out-file={out}"]
    return subprocess.Popen(cmd + argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, **kw)


def has_vcpu0(pid):
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                if f.read().strip() == "vcpu0":
                    return True
    except OSError:
        pass
    return False


def run_one(binary, work, run):
    name, payload, pinned, extra, query = run
    d = os.path.join(work, name)
    os.makedirs(d)
    argv = [binary, "--run-dir", d]
    if payload:
        spec = os.path.join(d, "spec.toml")
        with open(spec, "w") as f:
            if payload == "linux":
                f.write(LINUX.format(kernel=KERNEL))
            else:
                f.write(SPEC.format(name=name, cores=1, pinned=pinned, payload=payload))
        argv += ["--config", spec]
    argv += [a.format(dir=d) for a in extra]
    outs = [os.path.join(d, "vmm.cg")]
    p = valgrind(outs[0], argv)
    if payload == "linux":
        time.sleep(LINUX_SECONDS)
        if p.poll() is not None:
            die(f"{name}: vmhost ended early: {p.stderr.read().decode()[-2000:]}")
        p.send_signal(signal.SIGTERM)
        # SIGTERM stops a running guest with exit status 130 (stopped before the guest ended).
        if p.wait(300) != 130:
            die(f"{name}: vmhost exited {p.returncode}: {p.stderr.read().decode()[-2000:]}")
        return outs
    if payload == "idle":
        deadline = time.monotonic() + 120
        while not has_vcpu0(p.pid):
            if p.poll() is not None or time.monotonic() > deadline:
                die(f"{name}: no vcpu0 thread: {p.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
        time.sleep(1)
        if query:
            for c in ["info", "placement", "resources"]:
                out = os.path.join(d, f"ctl-{c}.cg")
                q = valgrind(out, [binary, "ctl", "--api-socket", os.path.join(d, "api.sock"), c])
                if q.wait(120) != 0:
                    die(f"{name}: ctl {c} failed: {q.stderr.read().decode()[-2000:]}")
                outs.append(out)
        p.send_signal(signal.SIGTERM)
    if p.wait(300) != 0:
        die(f"{name}: vmhost exited {p.returncode}: {p.stderr.read().decode()[-2000:]}")
    return outs


def order(binary):
    syms = text_symbols(binary)
    work = tempfile.mkdtemp(prefix="vmhost-text-order-")
    try:
        vmm, ctl = [], set()
        for run in RUNS:
            outs = run_one(binary, work, run)
            vmm.append(ran(outs[0]))
            for o in outs[1:]:
                ctl |= ran(o)
            print(f"text-order: {run[0]}: {len(vmm[-1])} functions ran", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    count = {}
    for names in vmm:
        for n in names:
            if n in syms:
                count[n] = count.get(n, 0) + 1
    startup = [n for n in STARTUP if n in syms]
    startup += sorted((n for n in syms if syms[n][2] == "i"), key=lambda n: syms[n][0])
    for n in startup:
        count[n] = len(vmm) + 1
    first = sorted(count, key=lambda n: (-count[n], syms[n][0]))
    emulated = sorted((n for n in emulated_names() if n in syms and n not in count),
                      key=lambda n: syms[n][0])
    first += emulated
    for n in emulated:
        count[n] = 0
    warm = sorted((n for n in syms if n not in count and any(c in n for c in WARM_CRATES)),
                  key=lambda n: syms[n][0])
    last = sorted((n for n in ctl if n in syms and n not in count and n not in warm),
                  key=lambda n: syms[n][0])
    size = lambda names: sum(syms[n][1] for n in names) / 1024
    total = sum(s for _, s, _ in syms.values()) / 1024
    with open(ORDER, "w") as f:
        f.write("# Generated by scripts/text-order.py: the functions a VM start runs, for LLD's\n"
                "# --symbol-ordering-file (build.rs). Do not edit; run the script again.\n"
                f"# {len(first)} functions ({size(first):.0f} KiB) run by vmhost's {len(RUNS)} "
                f"profiled starts ({len(emulated)} of them only in the emulated host's Linux "
                f"boots, {os.path.relpath(EMULATED, ROOT)}), then the rest of the device and vCPU crates ({len(warm)}, "
                f"{size(warm):.0f} KiB), then {len(last)} ({size(last):.0f} KiB) only `vmhost "
                f"ctl` runs, of {total:.0f} KiB of text.\n")
        for n in first + warm + last:
            f.write(n + "\n")
    print(f"text-order: wrote {ORDER}: {len(first)} + {len(warm)} + {len(last)} functions, "
          f"{size(first):.0f} + {size(warm):.0f} + {size(last):.0f} KiB of {total:.0f} KiB",
          file=sys.stderr)


def emulated_names():
    """The names in src/text-order-emulated.txt (none when it does not exist)."""
    if not os.path.exists(EMULATED):
        return []
    return [l.strip() for l in open(EMULATED) if l.strip() and not l.startswith("#")]


def exec_segments(binary):
    """(file offset, virtual address, file size) of each executable PT_LOAD segment."""
    out = subprocess.run(["readelf", "-lW", binary], check=True, capture_output=True,
                         text=True).stdout
    segs = []
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == "LOAD" and "E" in f[6:-1]:
            segs.append((int(f[1], 16), int(f[2], 16), int(f[4], 16)))
    return segs


def emulated_pages(log):
    """Writes src/text-order-emulated.txt: the functions of the release binary on the pages
    of its executable mapping that the emulated host's boots in `log` had mapped."""
    if not os.path.exists(RELEASE_BIN):
        die(f"no {RELEASE_BIN}: the release binary the log's boots ran")
    pages = set()
    pattern = re.compile(r"text-pages r-xp (0x[0-9a-f]+): ([0-9,-]*)")
    for line in open(log, errors="replace"):
        m = pattern.search(line)
        if not m:
            continue
        for part in filter(None, m.group(2).split(",")):
            lo, _, hi = part.partition("-")
            pages.update(range(int(lo), int(hi or lo) + 1))
    if not pages:
        die(f"{log}: no `text-pages r-xp` lines (VMHOST_BENCH_TEXT_PAGES=1)")
    segs = exec_segments(RELEASE_BIN)

    def vaddr(page):
        # A page of the file may start before its segment (the segment is not page-aligned
        # in the file); its address is the segment's, shifted the same way.
        off = page * 4096
        for f_off, v, size in segs:
            if f_off - 4096 < off < f_off + size:
                return v + off - f_off
        return None

    ranges = sorted(v for v in map(vaddr, pages) if v is not None)
    syms = text_symbols(RELEASE_BIN)
    names = []
    for n, (addr, size, _) in syms.items():
        end = addr + max(size, 1)
        # Is any touched page [p, p + 4096) overlapping [addr, end)?
        i = bisect.bisect_right(ranges, addr) - 1
        hit = (i >= 0 and ranges[i] + 4096 > addr) or \
            (i + 1 < len(ranges) and ranges[i + 1] < end)
        if hit:
            names.append(n)
    names.sort(key=lambda n: syms[n][0])
    with open(EMULATED, "w") as f:
        f.write("# Generated by scripts/text-order.py --emulated-pages: the functions on the pages\n"
                "# of vmhost's text the emulated host's Linux boots mapped by /init, with its\n"
                f"# fault-around at one page ({len(pages)} pages). Do not edit.\n")
        for n in names:
            f.write(n + "\n")
    print(f"text-order: wrote {EMULATED}: {len(names)} functions on {len(pages)} pages",
          file=sys.stderr)


def check():
    if not os.path.exists(RELEASE_BIN):
        die(f"no {RELEASE_BIN}: cargo build --release first")
    syms = text_symbols(RELEASE_BIN)
    names = [l.strip() for l in open(ORDER) if l.strip() and not l.startswith("#")]
    found = sum(1 for n in names if n in syms)
    print(f"text-order: {found} of the {len(names)} functions in {ORDER} are in {RELEASE_BIN}")
    if found < len(names) * 0.9:
        die("fewer than 90 % are: run python3 scripts/text-order.py again")


def main():
    if sys.argv[1:] == ["--check"]:
        return check()
    if len(sys.argv) == 3 and sys.argv[1] == "--emulated-pages":
        return emulated_pages(sys.argv[2])
    if sys.argv[1:]:
        die("usage: text-order.py [--check | --emulated-pages LOG]")
    for tool in ["valgrind", "nm"]:
        if shutil.which(tool) is None:
            die(f"{tool} is not installed (apt-get install valgrind binutils)")
    if not os.path.isfile(KERNEL):
        die(f"no {KERNEL}: bash crates/boot/scripts/fetch-test-kernel.sh")
    env = dict(os.environ, VMHOST_BUILD_FOR_VALGRIND="1", CARGO_TARGET_DIR=PROFILE_TARGET)
    subprocess.run(["cargo", "build", "--release", "--bin", "vmhost"], cwd=ROOT, env=env,
                   check=True)
    order(os.path.join(PROFILE_TARGET, TRIPLE, "release", "vmhost"))


if __name__ == "__main__":
    main()
