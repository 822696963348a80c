//! The kernel's own account of the host and of a process: sysfs, `/proc/<pid>`, cgroup files.
//! The tests compare what vmhost says and did with what these files say.

use std::collections::BTreeMap;
use std::fs;

/// Reads a file to a trimmed string, naming the file on error.
pub fn read(path: &str) -> Result<String, String> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| format!("read {path}: {e}"))
}

/// Writes a value to a sysfs or cgroup file, naming the file on error.
pub fn write(path: &str, value: &str) -> Result<(), String> {
    fs::write(path, value).map_err(|e| format!("write {value:?} to {path}: {e}"))
}

/// Parses a kernel cpulist/nodelist such as `0-2,5`.
pub fn parse_list(s: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let bad = || format!("bad list {s:?}");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) =
                    (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(out)
}

/// The online NUMA nodes.
pub fn nodes() -> Result<Vec<u32>, String> {
    parse_list(&read("/sys/devices/system/node/online")?)
}

/// The PUs of `node`.
pub fn node_cpus(node: u32) -> Result<Vec<u32>, String> {
    parse_list(&read(&format!(
        "/sys/devices/system/node/node{node}/cpulist"
    ))?)
}

/// The distance row of `node`, in node order.
pub fn distances(node: u32) -> Result<Vec<u32>, String> {
    read(&format!("/sys/devices/system/node/node{node}/distance"))?
        .split_whitespace()
        .map(|d| d.parse().map_err(|e| format!("distance {d:?}: {e}")))
        .collect()
}

fn pool_dir(node: u32, page_kib: u64) -> String {
    format!("/sys/devices/system/node/node{node}/hugepages/hugepages-{page_kib}kB")
}

/// `(total, free)` hugepages of `page_kib` KiB on `node`.
pub fn hugepages(node: u32, page_kib: u64) -> Result<(u64, u64), String> {
    let d = pool_dir(node, page_kib);
    let num = |f: &str| -> Result<u64, String> {
        read(&format!("{d}/{f}"))?
            .parse()
            .map_err(|e| format!("{d}/{f}: {e}"))
    };
    Ok((num("nr_hugepages")?, num("free_hugepages")?))
}

/// Sets the 2 MiB pool of `node` to `pages` and checks the kernel granted them all.
pub fn set_2m_pool(node: u32, pages: u64) -> Result<(), String> {
    let path = format!("{}/nr_hugepages", pool_dir(node, 2048));
    write(&path, &pages.to_string())?;
    let (total, _) = hugepages(node, 2048)?;
    if total != pages {
        return Err(format!(
            "node{node}: asked for {pages} 2 MiB pages, the kernel granted {total}"
        ));
    }
    Ok(())
}

/// Sets every node's 2 MiB pool: `pools[i]` pages on node `i`.
pub fn set_2m_pools(pools: &[u64]) -> Result<(), String> {
    for (node, &pages) in (0u32..).zip(pools) {
        set_2m_pool(node, pages)?;
    }
    Ok(())
}

/// Free pages per node of `page_kib` KiB, in node order.
pub fn free_per_node(page_kib: u64) -> Result<Vec<u64>, String> {
    nodes()?
        .into_iter()
        .map(|n| hugepages(n, page_kib).map(|p| p.1))
        .collect()
}

/// One thread of a process, from `/proc/<pid>/task/<tid>/{comm,status}`.
#[derive(Debug, Clone)]
pub struct Thread {
    /// Thread id.
    pub tid: u32,
    /// Its name (`comm`).
    pub name: String,
    /// `Cpus_allowed_list`.
    pub cpus: Vec<u32>,
    /// `Mems_allowed_list`.
    pub mems: Vec<u32>,
}

fn status_field(status: &str, key: &str) -> Option<String> {
    status.lines().find_map(|l| {
        l.strip_prefix(key)
            .map(|v| v.trim_start_matches(':').trim().to_string())
    })
}

/// Every thread of `pid`, read back from `/proc`.
pub fn threads(pid: u32) -> Result<Vec<Thread>, String> {
    let dir = format!("/proc/{pid}/task");
    let mut out = Vec::new();
    let entries = fs::read_dir(&dir).map_err(|e| format!("read {dir}: {e}"))?;
    for entry in entries.flatten() {
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(status) = read(&format!("{dir}/{tid}/status")) else {
            continue;
        };
        let name = read(&format!("{dir}/{tid}/comm")).unwrap_or_default();
        let field = |k: &str| {
            status_field(&status, k).ok_or_else(|| format!("no {k} in {dir}/{tid}/status"))
        };
        out.push(Thread {
            tid,
            name,
            cpus: parse_list(&field("Cpus_allowed_list")?)?,
            mems: parse_list(&field("Mems_allowed_list")?)?,
        });
    }
    out.sort_by_key(|t| t.tid);
    Ok(out)
}

/// Pages per node of the hugepage mappings of `pid`, from `/proc/<pid>/numa_maps`, keyed by
/// the kernel page size in KiB.
pub fn numa_maps_huge(pid: u32) -> Result<BTreeMap<u64, BTreeMap<u32, u64>>, String> {
    let text = read(&format!("/proc/{pid}/numa_maps"))?;
    let mut out: BTreeMap<u64, BTreeMap<u32, u64>> = BTreeMap::new();
    for line in text.lines().filter(|l| l.contains(" huge")) {
        let page = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("kernelpagesize_kB="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        for w in line.split_whitespace() {
            if let Some((n, c)) = w.strip_prefix('N').and_then(|r| r.split_once('=')) {
                if let (Ok(n), Ok(c)) = (n.parse::<u32>(), c.parse::<u64>()) {
                    *out.entry(page).or_default().entry(n).or_default() += c;
                }
            }
        }
    }
    Ok(out)
}

/// The child processes of `pid` (from every `/proc/<n>/stat`).
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|n| {
            // The parent pid is the second field after the `(comm)` one.
            fs::read_to_string(format!("/proc/{n}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, rest)| rest.split_whitespace().nth(1).map(str::to_string))
                })
                .flatten()
                .is_some_and(|ppid| ppid == pid.to_string())
        })
        .collect()
}

/// The live processes whose executable is `exe` (from `/proc/<n>/exe`), with their command
/// lines; zombies and processes already gone are left out.
pub fn processes_of(exe: &std::path::Path) -> Vec<(u32, String)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out: Vec<(u32, String)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|n| fs::read_link(format!("/proc/{n}/exe")).is_ok_and(|p| p == exe))
        .filter(|n| state(*n).is_some_and(|s| s != 'Z'))
        .map(|n| {
            let cmdline = fs::read(format!("/proc/{n}/cmdline")).unwrap_or_default();
            let words: Vec<String> = cmdline
                .split(|&b| b == 0)
                .filter(|w| !w.is_empty())
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect();
            (n, words.join(" "))
        })
        .collect();
    out.sort_unstable();
    out
}

/// The state letter of process `pid` (field 3 of its `stat`), if it still exists.
fn state(pid: u32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// SIGKILLs a leftover process and waits (at most 10 s) until it is gone or a zombie.
pub fn kill_and_reap(pid: u32) {
    let Ok(raw) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) only sends a signal. `pid` was just read from /proc as a live vmhost
    // process (not a zombie), so it names that process or, if it ended in between, at worst
    // a pid not yet reused (Linux allocates pids cyclically).
    unsafe { libc::kill(raw, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while state(pid).is_some_and(|s| s != 'Z') && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The CPU thread `tid` of `pid` last ran on (field 39 of its `stat`).
pub fn last_cpu(pid: u32, tid: u32) -> Result<u32, String> {
    let path = format!("/proc/{pid}/task/{tid}/stat");
    let stat = read(&path)?;
    let rest = stat
        .rsplit_once(") ")
        .map(|(_, r)| r)
        .ok_or_else(|| format!("{path}: no (comm)"))?;
    // After `(comm)` the fields start at 3: processor is field 39.
    rest.split_whitespace()
        .nth(39 - 3)
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("{path}: no processor field"))
}

/// The cgroup v2 path of thread `tid` of `pid` (`0::/a/b` in `/proc/<pid>/task/<tid>/cgroup`).
pub fn task_cgroup(pid: u32, tid: u32) -> Result<String, String> {
    let path = format!("/proc/{pid}/task/{tid}/cgroup");
    let text = read(&path)?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
        .ok_or_else(|| format!("{path}: no cgroup v2 line in {text:?}"))
}

/// The scheduling policy of thread `tid` of `pid` (field 41 of its `stat`: 0 SCHED_OTHER,
/// 1 SCHED_FIFO, 2 SCHED_RR).
pub fn sched_policy(pid: u32, tid: u32) -> Result<u32, String> {
    let path = format!("/proc/{pid}/task/{tid}/stat");
    let stat = read(&path)?;
    // Fields after `(comm)` start at field 3; policy is field 41.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| format!("{path}: no (comm)"))?;
    rest.split_whitespace()
        .nth(41 - 3)
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("{path}: no policy field"))
}

/// What each thread of process `pid` is doing, one line each: thread id, name, state, the CPU
/// it last ran on and its kernel wait channel. For the log of a VM that hung, so it shows
/// whether a vCPU thread was blocked in vmhost, sleeping in the kernel or running.
pub fn thread_states(pid: u32) -> String {
    let mut lines = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let read = |f: &str| std::fs::read_to_string(task.path().join(f)).unwrap_or_default();
        let stat = read("stat");
        // After the command's closing parenthesis: state is field 3, processor field 39.
        let fields: Vec<&str> = stat
            .rsplit_once(") ")
            .map_or(Vec::new(), |(_, a)| a.split_whitespace().collect());
        lines.push(format!(
            "thread {} {} state {} cpu {} wchan {}",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            fields.first().unwrap_or(&"?"),
            fields.get(36).unwrap_or(&"?"),
            read("wchan").trim()
        ));
    }
    lines.sort();
    lines.join("; ")
}

/// Runs a host tool (`args[0]`) to completion; fails naming it, its status and its stderr.
pub fn run_tool(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// A private anonymous mapping of 2 MiB hugepages (`MAP_HUGETLB`), unmapped when dropped.
pub struct HugeMap {
    ptr: *mut libc::c_void,
    len: usize,
}

impl HugeMap {
    /// Maps `len` bytes (a multiple of 2 MiB, not 0); the pool reserves its pages now.
    pub fn new(len: usize) -> Result<HugeMap, String> {
        // SAFETY: a new private anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!(
                "mmap {len} bytes of 2 MiB pages: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(HugeMap { ptr, len })
    }

    /// The mapping's start, for `mbind`.
    pub fn ptr(&self) -> *mut libc::c_void {
        self.ptr
    }

    /// Its bytes (the kernel faults each page in at the first touch).
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a readable and writable mapping of `len` bytes that lives as long
        // as `self`, and the returned borrow of `self` keeps any other use out.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for HugeMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no borrow of it outlives `self`.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

#[cfg(test)]
mod thread_state_tests {
    #[test]
    fn thread_states_lists_the_calling_thread_running() {
        // The other tests of this binary start and end threads meanwhile, and a thread that
        // ends during a read of `/proc/PID/task` can make the kernel skip the next entry: the
        // probe reads the list again (a few times at most) until it finds itself.
        let named = std::thread::Builder::new()
            .name("tstate-probe".into())
            .spawn(|| {
                let mut states = String::new();
                for _ in 0..20 {
                    states = super::thread_states(std::process::id());
                    if states.contains("tstate-probe ") {
                        break;
                    }
                }
                states
            })
            .unwrap();
        let states = named.join().unwrap();
        assert!(
            states.contains("tstate-probe state R cpu "),
            "the probe thread itself is running: {states}"
        );
    }
}
