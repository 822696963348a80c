//! `vmhost ctl --api-socket S snapshot DIR [--stop]`: starts the snapshot job and follows it
//! until it ends, progress on stderr, the final report on stdout; exit 0 only on success.

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
    let started = vmhost_api::request_with_body(
        socket,
        "PUT",
        "/vm/snapshot",
        Some(&body),
        vmhost_api::DEFAULT_CLIENT_TIMEOUT,
    )?;
    if !started.is_success() {
        println!("{}", serde_json::to_string_pretty(&started.body)?);
        return Ok(1);
    }
    let mut last = String::new();
    loop {
        let progress = match vmhost_api::request(socket, "GET", "/vm/snapshot") {
            Ok(answer) => answer.body,
            Err(e) => {
                eprintln!(
                    "vmhost: the VM's API went away before the snapshot job reported its end: {e}"
                );
                return Ok(1);
            }
        };
        let line = describe(&progress);
        if line != last {
            eprintln!("vmhost: snapshot: {line}");
            last = line;
        }
        match progress["state"].as_str() {
            Some("running") => std::thread::sleep(POLL),
            Some("succeeded") => {
                println!("{}", serde_json::to_string_pretty(&progress)?);
                return Ok(0);
            }
            _ => {
                println!("{}", serde_json::to_string_pretty(&progress)?);
                return Ok(1);
            }
        }
    }
}

/// One progress line: state, phase, MiB written, the error.
fn describe(p: &Value) -> String {
    let mib = p["bytes_written"].as_u64().unwrap_or(0) >> 20;
    let mut line = format!(
        "{} ({}), {mib} MiB of guest memory written",
        p["state"].as_str().unwrap_or("?"),
        p["phase"].as_str().unwrap_or("?")
    );
    if let Some(e) = p["error"].as_str() {
        line.push_str(": ");
        line.push_str(e);
    }
    line
}
