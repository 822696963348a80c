//! What the benches share: the monotonic clock their spawn times are read on, and a process's
//! resident memory from `/proc`.

/// `CLOCK_MONOTONIC` in nanoseconds (the clock of `vmhost --json`'s timeline).
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// (VmRSS, Pss, Pss_Anon) of `pid` in MiB (NaN where unreadable).
pub fn memory_mib(pid: u32) -> [f64; 3] {
    [
        proc_kib(pid, "status", "VmRSS:") / 1024.0,
        proc_kib(pid, "smaps_rollup", "Pss:") / 1024.0,
        proc_kib(pid, "smaps_rollup", "Pss_Anon:") / 1024.0,
    ]
}

/// A `kB` field of `/proc/<pid>/<file>`.
fn proc_kib(pid: u32, file: &str, field: &str) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}
