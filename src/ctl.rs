//! `vmhost ctl --api-socket S snapshot DIR [--stop]` and `… migrate unix:PATH|tcp:ADDR:PORT
//! --auth-key FILE`: start the job and follow it until it ends, progress on stderr, the final
//! report on stdout; exit 0 only on success.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};

/// How often the job is polled.
const POLL: Duration = Duration::from_millis(100);

/// Starts the job and polls it to its end.
pub fn snapshot(socket: &Path, dir: &Path, stop: bool) -> Result<u8> {
    // The VM resolves the path against its own working directory: send an absolute one.
    let dir = std::path::absolute(dir).with_context(|| format!("resolving {}", dir.display()))?;
    let body = json!({"dir": dir, "stop": stop});
    let Some(progress) = follow(socket, "/vm/snapshot", &body, "snapshot", describe)? else {
        return Ok(1);
    };
    println!("{}", serde_json::to_string_pretty(&progress)?);
    Ok(u8::from(progress["state"].as_str() != Some("succeeded")))
}

/// Starts a migration job and polls it to its end; prints the source's report (text, or the
/// JSON of `GET /vm/migrate` with `json`).
pub fn migrate(
    socket: &Path,
    to: &str,
    key: &Path,
    max_downtime_ms: u64,
    timeout_s: u64,
    json: bool,
) -> Result<u8> {
    let key = std::path::absolute(key).with_context(|| format!("resolving {}", key.display()))?;
    let body = json!({"to": to, "auth_key": key, "max_downtime_ms": max_downtime_ms, "timeout_s": timeout_s});
    let Some(progress) = follow(socket, "/vm/migrate", &body, "migrate", describe_migration)?
    else {
        return Ok(1);
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&progress)?);
    } else {
        print!("{}", migration_text(&progress));
    }
    Ok(u8::from(progress["state"].as_str() != Some("succeeded")))
}

/// `PUT path` with `body`, then `GET path` until the job is no longer running, each new
/// progress line (`describe`) on stderr as `vmhost: <what>: …`. Returns the last report, or
/// `None` when the job was refused (its answer printed) or the API went away.
fn follow(
    socket: &Path,
    path: &str,
    body: &Value,
    what: &str,
    describe: fn(&Value) -> String,
) -> Result<Option<Value>> {
    let started = vmhost_api::request_with_body(
        socket,
        "PUT",
        path,
        Some(body),
        vmhost_api::DEFAULT_CLIENT_TIMEOUT,
    )?;
    if !started.is_success() {
        println!("{}", serde_json::to_string_pretty(&started.body)?);
        return Ok(None);
    }
    let mut last = String::new();
    loop {
        let progress = match vmhost_api::request(socket, "GET", path) {
            Ok(answer) => answer.body,
            Err(e) => {
                eprintln!(
                    "vmhost: the VM's API went away before the {what} job reported its end: {e}"
                );
                return Ok(None);
            }
        };
        let line = describe(&progress);
        if line != last {
            eprintln!("vmhost: {what}: {line}");
            last = line;
        }
        if progress["state"].as_str() != Some("running") {
            return Ok(Some(progress));
        }
        std::thread::sleep(POLL);
    }
}

fn describe_migration(p: &Value) -> String {
    let mib = p["bytes_sent"].as_u64().unwrap_or(0) >> 20;
    let rounds = p["rounds"].as_array().map_or(0, Vec::len);
    progress_line(p, &format!("{rounds} rounds, {mib} MiB sent"))
}

/// The source's report as text.
fn migration_text(p: &Value) -> String {
    use std::fmt::Write as _;
    let mut s = format!(
        "migration to {}: {}\n",
        p["to"].as_str().unwrap_or("?"),
        p["state"].as_str().unwrap_or("?")
    );
    s.push_str(&crate::migrate::report::side_by_side(
        &p["source_plan"],
        &p["target_plan"],
    ));
    for r in p["rounds"].as_array().into_iter().flatten() {
        let _ = writeln!(
            s,
            "  round {}{}: {} KiB in {:.3} s, {} KiB dirty after",
            r["round"],
            if r["last"].as_bool() == Some(true) {
                " (final, paused)"
            } else {
                ""
            },
            r["bytes"].as_u64().unwrap_or(0) >> 10,
            r["seconds"].as_f64().unwrap_or(0.0),
            r["dirty_bytes_after"].as_u64().unwrap_or(0) >> 10
        );
    }
    let _ = writeln!(
        s,
        "  total {:.3} s, downtime {} ms",
        p["seconds"].as_f64().unwrap_or(0.0),
        p["downtime_ms"]
            .as_f64()
            .map_or("-".into(), |d| format!("{d:.1}"))
    );
    if let Some(e) = p["error"].as_str() {
        let _ = writeln!(s, "  error: {e}");
    }
    s
}

/// One progress line: state, phase, MiB written, the error.
fn describe(p: &Value) -> String {
    let mib = p["bytes_written"].as_u64().unwrap_or(0) >> 20;
    progress_line(p, &format!("{mib} MiB of guest memory written"))
}

/// `state (phase), figures` and `: error` when the job failed.
fn progress_line(p: &Value, figures: &str) -> String {
    let mut line = format!(
        "{} ({}), {figures}",
        p["state"].as_str().unwrap_or("?"),
        p["phase"].as_str().unwrap_or("?")
    );
    if let Some(e) = p["error"].as_str() {
        line.push_str(": ");
        line.push_str(e);
    }
    line
}
