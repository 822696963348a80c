//! The migration benchmark's VMM processes and their guests' beats: a [`Proc`] whose stdout
//! (the guest's console) and stderr lines are kept with the time each arrived, the longest
//! beat gap around a migration ([`longest_gap`]), where it lies ([`gap_edges`]), and the
//! guest's own restart cost when paused and resumed in place ([`pause_in_place`]).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::JOB_LIMIT;
use crate::vm::Env;
use crate::{ensure, Outcome};

/// Lines of a process's stdout, each with the time it arrived.
pub(super) type Stamped = Arc<Mutex<Vec<(Instant, String)>>>;

/// A VMM process whose stdout (the guest's console) is read line by line as it arrives;
/// killed when dropped unless it has ended.
pub(super) struct Proc {
    pub(super) child: Child,
    pub(super) lines: Stamped,
    /// Its stderr's lines as they arrived (also written to `err`).
    pub(super) err_lines: Stamped,
    pub(super) err: PathBuf,
    what: String,
}

/// Reads `from` line by line as it arrives, keeping each line with its arrival time and, when
/// `copy` is given, writing it there too.
fn stamp_lines(from: impl std::io::Read + Send + 'static, copy: Option<std::fs::File>) -> Stamped {
    let lines: Stamped = Arc::default();
    let sink = Arc::clone(&lines);
    std::thread::spawn(move || {
        let mut copy = copy;
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            let at = Instant::now();
            if let Some(f) = copy.as_mut() {
                let _ = writeln!(f, "{line}");
            }
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((at, line.trim_end_matches('\r').to_string()));
        }
    });
    lines
}

impl Proc {
    /// Spawns `cmd` with stdout and stderr piped and timestamped, stderr also written to
    /// `<work>/<name>.err`.
    pub(super) fn spawn(mut cmd: Command, env: &Env, name: &str) -> Result<Proc, String> {
        let err = env.work.join(format!("{name}.err"));
        let file =
            std::fs::File::create(&err).map_err(|e| format!("create {}: {e}", err.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| format!("spawn {name}: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout pipe")?;
        let stderr = child.stderr.take().ok_or("no stderr pipe")?;
        Ok(Proc {
            child,
            lines: stamp_lines(stdout, None),
            err_lines: stamp_lines(stderr, Some(file)),
            err,
            what: name.to_string(),
        })
    }

    /// When a line of stderr containing `what` arrived first.
    pub(super) fn err_line_at(&self, what: &str) -> Option<Instant> {
        let lines = self.err_lines.lock().unwrap_or_else(|p| p.into_inner());
        lines
            .iter()
            .find(|(_, l)| l.contains(what))
            .map(|(t, _)| *t)
    }

    /// The arrival times of the guest's beat lines so far.
    pub(super) fn beats(&self) -> Vec<Instant> {
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines
            .iter()
            .filter(|(_, l)| l.starts_with("B "))
            .map(|(t, _)| *t)
            .collect()
    }

    /// The last lines of stdout and stderr, for a failure message.
    pub(super) fn tail(&self) -> String {
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        let out: Vec<&str> = lines
            .iter()
            .rev()
            .take(40)
            .map(|(_, l)| l.as_str())
            .collect();
        let err = std::fs::read_to_string(&self.err).unwrap_or_default();
        let err: Vec<&str> = err.lines().rev().take(6).collect();
        format!(
            "{}: stdout (last first) {out:?}; stderr (last first) {err:?}",
            self.what
        )
    }

    /// Whether the process still runs (or how it ended), and its last lines: for a failure
    /// that may be its doing (a source VM gone before the migrate command, 6 December).
    pub(super) fn state(&mut self) -> String {
        let status = match self.child.try_wait() {
            Ok(Some(s)) => format!("ended ({s})"),
            Ok(None) => "still running".to_string(),
            Err(e) => format!("unknown ({e})"),
        };
        format!("{} {status}; {}", self.what, self.tail())
    }

    /// Waits until at least `n` beats arrived, failing with the process's output otherwise.
    pub(super) fn wait_beats(&mut self, n: usize, limit: Duration) -> Outcome {
        let deadline = Instant::now() + limit;
        while self.beats().len() < n {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Err(format!(
                    "{} ended ({s}) before {n} beats; {}",
                    self.what,
                    self.tail()
                ));
            }
            ensure!(
                Instant::now() < deadline,
                "{}: fewer than {n} beats within {limit:?}; {}",
                self.what,
                self.tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Waits for the process to end within `limit`.
    pub(super) fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus, String> {
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(s)) => return Ok(s),
                Ok(None) if Instant::now() > deadline => {
                    return Err(format!(
                        "{} did not end within {limit:?}; {}",
                        self.what,
                        self.tail()
                    ))
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(format!("wait {}: {e}", self.what)),
            }
        }
    }

    /// SIGTERM, then its exit status (SIGKILL after 30 s).
    pub(super) fn stop(&mut self) -> Result<ExitStatus, String> {
        let pid = libc::pid_t::try_from(self.child.id()).map_err(|e| e.to_string())?;
        // SAFETY: kill(2) only sends a signal; the child has not been reaped (we hold it and
        // only `try_wait` reaps it), so its pid cannot have been reused.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        self.wait_exit(Duration::from_secs(30)).inspect_err(|_| {
            let _ = self.child.kill();
        })
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The longest gap between consecutive beats of both VMMs' consoles (merged) that overlaps
/// `[from, to]`, the migration, in ms.
pub(super) fn longest_gap(
    mut beats: Vec<Instant>,
    from: Instant,
    to: Instant,
) -> Result<f64, String> {
    beats.sort();
    let gap = beats
        .windows(2)
        .filter(|w| w[1] >= from && w[0] <= to)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .fold(None, |m: Option<f64>, g| Some(m.map_or(g, |m| m.max(g))));
    gap.ok_or_else(|| "no beat before and after the migration".to_string())
}

/// `t` in ms after `t0` (negative before it).
pub(super) fn ms_after(t: Instant, t0: Instant) -> f64 {
    if t >= t0 {
        (t - t0).as_secs_f64() * 1e3
    } else {
        -((t0 - t).as_secs_f64() * 1e3)
    }
}

/// Where the beat gap falls, ms after `t0` (the migrate command's start): the source's last
/// beat before the target's first, and the target's first. Printed beside each VMM's own
/// figures, so that what lies outside its own downtime shows.
pub(super) fn gap_edges(src: &[Instant], dst: &[Instant], t0: Instant) -> String {
    let ms = |t: Instant| ms_after(t, t0);
    let first = dst.iter().min().copied();
    let last = src
        .iter()
        .filter(|t| first.is_none_or(|f| **t <= f))
        .max()
        .copied();
    match (last, first) {
        (Some(l), Some(f)) => format!(
            "last source beat {:.1} ms, first target beat {:.1} ms after the command",
            ms(l),
            ms(f)
        ),
        _ => "no beat on one side".to_string(),
    }
}

/// The guest's restart cost where it is: the VM paused and resumed at once (`pause` and
/// `resume` run by the caller, back to back), then the longest beat gap around it against
/// the time from the pause's request to the resume's answer (at most the pause). A baseline
/// for the migration's beat gap: the part of it that is the guest's own, with no move.
pub(super) fn pause_in_place(
    p: &mut Proc,
    pause_resume: impl FnOnce() -> Outcome,
) -> Result<String, String> {
    let before = p.beats().len();
    let t0 = Instant::now();
    pause_resume()?;
    let t1 = Instant::now();
    p.wait_beats(before + 20, JOB_LIMIT)?;
    let gap = longest_gap(p.beats(), t0, t1)?;
    Ok(format!(
        "paused and resumed in place: beat gap {gap:.1} ms, pause to resumed {:.1} ms",
        (t1 - t0).as_secs_f64() * 1e3
    ))
}
