//! The runner's watchdog: every 60 s a line on the serial console that says whether the
//! emulated host is alive, what is stuck in the kernel and what is spinning; and when no
//! process was started for a whole minute, where the runner itself waits (its current step,
//! each thread's state, wait channel and kernel stack) and what every process it started is
//! doing. A run that hangs while the host idles then says what it waits for.

use std::collections::HashMap;

use crate::diagnose;

/// Starts the watchdog thread.
pub fn start() {
    let spawned = std::thread::Builder::new()
        .name("watchdog".into())
        .spawn(|| {
            let mut last: HashMap<String, u64> = HashMap::new();
            let mut last_pid = String::new();
            loop {
                std::thread::sleep(std::time::Duration::from_secs(60));
                let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
                let (stuck, busy) = task_states(&mut last);
                let loadavg = read("/proc/loadavg");
                println!(
                    "testbed watchdog: uptime {} load {} D-state: {:?} busy: {:?}",
                    read("/proc/uptime")
                        .split_whitespace()
                        .next()
                        .unwrap_or("?"),
                    loadavg.trim(),
                    stuck,
                    busy
                );
                // The fifth field of loadavg is the last pid the kernel handed out.
                let pid = loadavg.split_whitespace().nth(4).unwrap_or("").to_string();
                if pid == last_pid {
                    for line in stall_report() {
                        println!("testbed watchdog: {line}");
                    }
                }
                last_pid = pid;
            }
        });
    if let Err(e) = spawned {
        println!("testbed: no watchdog thread: {e}");
    }
}

/// Where the runner waits when it started no process for a minute: its step, its threads
/// with their kernel stacks, and each process it started (and theirs) with its threads.
fn stall_report() -> Vec<String> {
    let me = std::process::id();
    let mut lines = vec![
        format!(
            "no process started for 60 s; the runner's step: {}",
            crate::vm::step()
        ),
        format!("runner threads: {}", diagnose::threads(me)),
    ];
    for tid in tasks(me) {
        let stack = std::fs::read_to_string(format!("/proc/{me}/task/{tid}/stack"))
            .unwrap_or_else(|e| e.to_string());
        let frames: Vec<&str> = stack
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .take(10)
            .collect();
        lines.push(format!(
            "runner thread {tid} kernel stack: {}",
            frames.join(" < ")
        ));
    }
    for pid in descendants(me) {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let words: Vec<String> = cmdline
            .split(|&b| b == 0)
            .filter(|w| !w.is_empty())
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        lines.push(format!(
            "child {pid} ({}): {}",
            words.join(" "),
            diagnose::threads(pid)
        ));
    }
    lines
}

/// The thread ids of process `pid`.
fn tasks(pid: u32) -> Vec<u32> {
    let mut tids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| t.file_name().to_string_lossy().parse().ok())
        .collect();
    tids.sort_unstable();
    tids
}

/// Every process below `root` (children, their children, ...), from each process's `PPid`.
fn descendants(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let ppid = status
                .lines()
                .find_map(|l| l.strip_prefix("PPid:"))?
                .trim()
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(parents.iter().filter(|p| p.1 == parent).map(|p| p.0));
        i += 1;
    }
    found.remove(0);
    found.sort_unstable();
    found
}

/// The tasks in `D` (`tid:comm@wchan`) and those that used more than 10 s of CPU since the
/// last call (`tid:comm@cpuN +S s`), from `/proc/*/task/*/stat`; `last` keeps each task's
/// CPU ticks between calls.
fn task_states(last: &mut HashMap<String, u64>) -> (Vec<String>, Vec<String>) {
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
    let (mut stuck, mut busy) = (Vec::new(), Vec::new());
    let mut now = HashMap::new();
    for pid in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        for task in std::fs::read_dir(pid.path().join("task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let stat = read(&task.path().join("stat"));
            let Some(after) = stat.rsplit_once(") ").map(|(_, a)| a) else {
                continue;
            };
            // Fields from the state on: utime and stime are the 12th and 13th, the CPU the 37th.
            let f: Vec<&str> = after.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let id = format!(
                "{}/{}",
                pid.file_name().to_string_lossy(),
                task.file_name().to_string_lossy()
            );
            let ticks = num(11) + num(12);
            let used = ticks.saturating_sub(last.get(&id).copied().unwrap_or(ticks));
            now.insert(id, ticks);
            let comm = read(&task.path().join("comm"));
            let tid = task.file_name().to_string_lossy().into_owned();
            if after.starts_with('D') {
                let wchan = read(&task.path().join("wchan"));
                stuck.push(format!("{tid}:{}@{}", comm.trim(), wchan.trim()));
            }
            // USER_HZ is 100.
            if used > 1000 {
                busy.push(format!(
                    "{tid}:{}@cpu{} +{} s",
                    comm.trim(),
                    num(36),
                    used / 100
                ));
            }
        }
    }
    *last = now;
    (stuck, busy)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The child reports itself ready from its own code, after its exec: its command line is
    /// in /proc by then (read before the exec, it is empty). Other tests of this binary run
    /// meanwhile and set steps of their own, so only the step's line is checked here.
    #[test]
    fn the_stall_report_names_the_step_and_each_child_with_its_threads() {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        crate::vm::set_step("test stall_report_itself");
        let mut child = Command::new("sh")
            .args(["-c", "echo ready; read x"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "ready\n");
        let report = stall_report();
        drop(child.stdin.take());
        let _ = child.wait();
        let text = report.join("\n");
        assert!(text.contains("runner's step: "), "{text}");
        assert!(text.contains("runner threads: "), "{text}");
        assert!(text.contains("kernel stack: "), "{text}");
        assert!(
            text.contains(&format!(
                "child {} (sh -c echo ready; read x): sh)",
                child.id()
            )),
            "{text}"
        );
    }
}
