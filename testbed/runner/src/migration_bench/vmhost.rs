//! The migration benchmark's vmhost side: one migration of a freshly booted guest to a new
//! `vmhost receive` at the downtime limit, again at the fallback limit when pre-copy does not
//! converge ([`vmhost_run`]); the migration threads' states sampled meanwhile, and vmhost's
//! report read back: its rounds, where its time went and where the beat gap lies.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::process::{gap_edges, longest_gap, ms_after, pause_in_place, Proc};
use super::{
    field, Sample, Setup, AFTER_BEATS, BOOT_LIMIT, FALLBACK_DOWNTIME_MS, FALLBACK_TIMEOUT_S,
    FIRST_TIMEOUT_S, JOB_LIMIT, MAX_DOWNTIME_MS, WARM_BEATS,
};
use crate::vm::api_call;
use crate::{ensure, host, Outcome};

/// Waits until `file` (a VMM's stderr) contains `what`.
fn wait_text(file: &Path, what: &str, limit: Duration) -> Outcome {
    let deadline = Instant::now() + limit;
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if text.contains(what) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "no {what:?} in {} within {limit:?}: {text}",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// vmhost's migration report in short: its error and each round's MiB sent, seconds, MiB
/// left dirty and estimated downtime.
fn rounds_summary(v: &Value) -> String {
    let rounds: Vec<String> = v["rounds"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let mib = |k: &str| r[k].as_f64().unwrap_or(f64::NAN) / 1048576.0;
            format!(
                "{:.1} MiB in {:.2} s, {:.1} MiB dirty after, est. {:.0} ms",
                mib("bytes"),
                r["seconds"].as_f64().unwrap_or(f64::NAN),
                mib("dirty_bytes_after"),
                r["estimated_downtime_ms"].as_f64().unwrap_or(f64::NAN)
            )
        })
        .collect();
    format!(
        "error {}, phase {}, {} rounds: {}",
        v["error"],
        v["phase"],
        rounds.len(),
        rounds.join("; ")
    )
}

/// Where a migration's time went, from its report: outside the rounds and the pause
/// (connecting, the hello, the target's plan and memory, the resume), each round with its
/// senders' split (the last one runs inside the pause), and the pause.
fn time_split(v: &Value) -> String {
    let rounds = v["rounds"].as_array().cloned().unwrap_or_default();
    // The last round runs inside the pause.
    let in_rounds: f64 = rounds
        .iter()
        .filter(|r| r["last"] != true)
        .filter_map(|r| r["seconds"].as_f64())
        .sum();
    let total = v["seconds"].as_f64().unwrap_or(f64::NAN);
    let pause_s = v["downtime_ms"].as_f64().unwrap_or(f64::NAN) / 1000.0;
    let each: Vec<String> = rounds
        .iter()
        .map(|r| {
            let t = |k: &str| r["senders"][k].as_f64().unwrap_or(f64::NAN);
            format!(
                "{:.1} MiB in {:.3} s (senders: copy {:.3}, seal {:.3}, write {:.3}, total {:.3}; {} records)",
                r["bytes"].as_f64().unwrap_or(f64::NAN) / 1048576.0,
                r["seconds"].as_f64().unwrap_or(f64::NAN),
                t("copy"),
                t("seal"),
                t("write"),
                t("total"),
                r["senders"]["records"].as_u64().unwrap_or(0)
            )
        })
        .collect();
    format!(
        "total {total:.3} s: outside the rounds and the pause {:.3} s; rounds: {}; pause {pause_s:.3} s; phases began at (s): {}",
        total - in_rounds - pause_s,
        each.join("; "),
        phase_marks(v)
    )
}

/// The report's phases and when each began (`connect 0.000, hello 0.012, …`).
fn phase_marks(v: &Value) -> String {
    v["phases"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|m| {
                    format!(
                        "{} {:.3}",
                        m["phase"].as_str().unwrap_or("?"),
                        m["at"].as_f64().unwrap_or(f64::NAN)
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// When the source's job entered `phase`, ms after the job began (the report's `phases`).
fn phase_at_ms(v: &Value, phase: &str) -> Option<f64> {
    v["phases"]
        .as_array()?
        .iter()
        .find(|m| m["phase"] == phase)?["at"]
        .as_f64()
        .map(|s| s * 1e3)
}

/// One `vmhost ctl migrate` of the running source to a new `vmhost receive`.
struct Attempt {
    /// The source's report (`ctl migrate --json`).
    report: Value,
    /// Whether the job succeeded.
    ok: bool,
    /// The target (ended by itself when the job failed).
    dst: Proc,
    /// When the command was started and when it returned.
    t0: Instant,
    t1: Instant,
}

/// Per thread name, how many samples found it in each state (`R`, or `S@wait channel`).
type ThreadSamples = BTreeMap<String, BTreeMap<String, u32>>;

/// Samples every 250 ms, until `stop` is set, the state of the migration threads of `pids`
/// (names starting with `vmhost-mig`, `mig-` or `recv-`): running, or asleep and where in the
/// kernel. Shows which side a slow migration waits for.
fn sample_threads(pids: Vec<u32>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<ThreadSamples> {
    std::thread::spawn(move || {
        let mut seen = ThreadSamples::new();
        while !stop.load(Ordering::Relaxed) {
            for pid in &pids {
                for task in std::fs::read_dir(format!("/proc/{pid}/task"))
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let read =
                        |f: &str| std::fs::read_to_string(task.path().join(f)).unwrap_or_default();
                    let name = read("comm").trim().to_string();
                    if !["vmhost-mig", "mig-", "recv-"]
                        .iter()
                        .any(|p| name.starts_with(p))
                    {
                        continue;
                    }
                    let stat = read("stat");
                    let state = stat
                        .rsplit_once(") ")
                        .and_then(|(_, a)| a.chars().next())
                        .unwrap_or('?');
                    let key = if state == 'R' {
                        "R".to_string()
                    } else {
                        format!("{state}@{}", read("wchan").trim())
                    };
                    *seen.entry(name).or_default().entry(key).or_default() += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        seen
    })
}

/// [`ThreadSamples`] in one line.
fn show_samples(s: &ThreadSamples) -> String {
    let threads: Vec<String> = s
        .iter()
        .map(|(name, states)| {
            let st: Vec<String> = states.iter().map(|(k, n)| format!("{k} {n}")).collect();
            format!("{name}: {}", st.join(", "))
        })
        .collect();
    threads.join("; ")
}

/// Starts a target and migrates the source at `src_sock` to it with `--max-downtime
/// max_downtime_ms --timeout timeout_s`.
fn vmhost_attempt(
    s: &Setup,
    src_sock: &Path,
    src_pid: u32,
    max_downtime_ms: u64,
    timeout_s: u64,
) -> Result<Attempt, String> {
    let listen = s.env.work.join("mig.listen");
    let _ = std::fs::remove_file(&listen);
    let to = format!("unix:{}", listen.display());
    let key = s.key.to_string_lossy().to_string();
    let (cmd, _) = s.vmhost("migdst", &["receive", "--listen", &to, "--auth-key", &key]);
    let dst = Proc::spawn(cmd, s.env, "vmhost target")?;
    wait_text(&dst.err, "listening on", JOB_LIMIT)?;
    let (limit, timeout) = (max_downtime_ms.to_string(), timeout_s.to_string());
    let args = [
        "--json",
        "migrate",
        &to,
        "--auth-key",
        &key,
        "--max-downtime",
        &limit,
        "--timeout",
        &timeout,
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_threads(vec![src_pid, dst.child.id()], Arc::clone(&stop));
    let t0 = Instant::now();
    // Pre-copy's give-up time, then the final round at the emulated host's pace.
    let out = s.ctl(src_sock, &args, Duration::from_secs(timeout_s * 3 + 120));
    let t1 = Instant::now();
    stop.store(true, Ordering::Relaxed);
    if let Ok(samples) = sampler.join() {
        println!(
            "       vmhost at {max_downtime_ms} ms, migration threads every 250 ms: {}",
            show_samples(&samples)
        );
    }
    let out = out?;
    let report = out
        .json()
        .map_err(|e| format!("ctl migrate: exit {}: {e}; {}", out.code, dst.tail()))?;
    Ok(Attempt {
        ok: out.code == 0,
        report,
        dst,
        t0,
        t1,
    })
}

/// Migrates the source `src` (its API socket `src_sock`) at [`MAX_DOWNTIME_MS`] and, when
/// pre-copy does not converge there, again to a new target at [`FALLBACK_DOWNTIME_MS`]: the
/// attempt that succeeded, and when the first gave up, its last estimate of the downtime, ms.
fn migrate_or_fall_back(
    s: &Setup,
    src_sock: &Path,
    src: &mut Proc,
) -> Result<(Attempt, Option<f64>), String> {
    let mut at = vmhost_attempt(
        s,
        src_sock,
        src.child.id(),
        MAX_DOWNTIME_MS,
        FIRST_TIMEOUT_S,
    )
    .map_err(|e| format!("{e}; {}", src.state()))?;
    if at.ok {
        return Ok((at, None));
    }
    let why = rounds_summary(&at.report);
    ensure!(
        at.report["error"]
            .as_str()
            .is_some_and(|e| e.contains("did not converge")),
        "ctl migrate: {why}; {}; {}",
        src.tail(),
        at.dst.tail()
    );
    let code = at.dst.wait_exit(JOB_LIMIT)?;
    println!("       vmhost at {MAX_DOWNTIME_MS} ms: {why}; the target: {code}");
    let gave_up = Some(last_estimate(&at.report));
    at = vmhost_attempt(
        s,
        src_sock,
        src.child.id(),
        FALLBACK_DOWNTIME_MS,
        FALLBACK_TIMEOUT_S,
    )?;
    ensure!(
        at.ok,
        "ctl migrate --max-downtime {FALLBACK_DOWNTIME_MS}: {}; {}; {}",
        rounds_summary(&at.report),
        src.tail(),
        at.dst.tail()
    );
    Ok((at, gave_up))
}

/// One vmhost migration of a freshly booted guest doing `action`: source → `vmhost receive`,
/// at [`MAX_DOWNTIME_MS`]; when pre-copy does not converge there (the source gives up after
/// [`FIRST_TIMEOUT_S`] and runs on), again to a new target at [`FALLBACK_DOWNTIME_MS`].
pub(super) fn vmhost_run(s: &Setup, action: &str) -> Result<Sample, String> {
    let spec = s.spec(action)?;
    let (cmd, src_sock) = s.vmhost("migsrc", &["--config", &spec.to_string_lossy()]);
    let mut src = Proc::spawn(cmd, s.env, "vmhost source")?;
    src.wait_beats(WARM_BEATS, BOOT_LIMIT)?;
    let in_place = pause_in_place(&mut src, || {
        api_call(&src_sock, "PUT", "/vm/pause")?;
        api_call(&src_sock, "PUT", "/vm/resume").map(drop)
    })?;
    println!("       vmhost: {in_place}");
    let (mut at, gave_up) = migrate_or_fall_back(s, &src_sock, &mut src)?;
    if let Err(e) = at.dst.wait_beats(AFTER_BEATS, JOB_LIMIT) {
        // What the target's VM and threads were doing, for the log.
        let dst_sock = s.env.work.join("migdst.sock");
        let info = s.ctl(&dst_sock, &["info"], JOB_LIMIT).map(|o| o.stdout);
        return Err(format!(
            "{e}; the target's ctl info: {info:?}; its threads: {}",
            host::thread_states(at.dst.child.id())
        ));
    }
    let (src_beats, dst_beats) = (src.beats(), at.dst.beats());
    let edges = gap_edges(&src_beats, &dst_beats, at.t0);
    let mut beats = src_beats;
    beats.extend(dst_beats);
    let gap_ms = longest_gap(beats, at.t0, at.t1)?;
    let code = src.wait_exit(JOB_LIMIT)?;
    ensure!(
        code.success(),
        "the migrated source: {code}; {}",
        src.tail()
    );
    at.dst.stop()?;
    let r = &at.report;
    println!("       vmhost's report: {}", time_split(r));
    where_the_gap_goes(&at, &edges);
    Ok(Sample {
        gap_ms,
        own_downtime_ms: field(r, "/downtime_ms")?,
        total_s: field(r, "/seconds")?,
        bytes: field(r, "/bytes_sent")?,
        rounds: r["rounds"].as_array().map_or(0, Vec::len) as f64,
        gave_up,
    })
}

/// Prints where a vmhost migration's beat gap went (`edges`: [`gap_edges`]): the target's line
/// that its guest runs again, the source's pause to its commit and to its state sent, the
/// target's first console byte after the release (its report, printed at its end), and the
/// target's own account of its steps (`vmhost: receive: ready for the rounds …`, `… the
/// guest runs again …`).
fn where_the_gap_goes(at: &Attempt, edges: &str) {
    let r = &at.report;
    let resumed = at
        .dst
        .err_line_at("the guest runs again")
        .map_or(f64::NAN, |t| ms_after(t, at.t0));
    println!(
        "       the gap: {edges}; the target's line that its guest runs again {resumed:.1} ms; \
         the source's pause to the commit {:.1} ms, its state sent {:.1} ms after the pause",
        field(r, "/downtime_ms").unwrap_or(f64::NAN),
        phase_at_ms(r, "commit").unwrap_or(f64::NAN) - phase_at_ms(r, "pause").unwrap_or(f64::NAN)
    );
    let first_byte = {
        let lines = at.dst.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines
            .iter()
            .find_map(|(_, l)| {
                let i = l.find("first serial byte ")?;
                Some(l[i..].split(',').next().unwrap_or_default().to_string())
            })
            .unwrap_or_else(|| "no first serial byte in its report".to_string())
    };
    println!("       the target's report: {first_byte} after the guest's release");
    let err = at.dst.err_lines.lock().unwrap_or_else(|p| p.into_inner());
    for (_, line) in err
        .iter()
        .filter(|(_, l)| l.contains("ready for the rounds") || l.contains("the guest runs again"))
    {
        println!(
            "       the target: {}",
            line.trim_start_matches("vmhost: receive: ")
        );
    }
}

/// The estimated downtime of a report's last round, ms.
fn last_estimate(report: &Value) -> f64 {
    report["rounds"]
        .as_array()
        .and_then(|r| r.last())
        .and_then(|r| r["estimated_downtime_ms"].as_f64())
        .unwrap_or(f64::NAN)
}
