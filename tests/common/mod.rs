//! Helpers for the end-to-end tests: run the real `vmhost` binary.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// Path of the repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs vmhost with `args` from the repository root.
pub fn vmhost(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmhost"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

/// stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs vmhost and parses its stdout as JSON.
pub fn vmhost_json(args: &[&str]) -> (i32, serde_json::Value) {
    let o = vmhost(args);
    let v = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            stdout(&o),
            stderr(&o)
        )
    });
    (o.status.code().unwrap(), v)
}
