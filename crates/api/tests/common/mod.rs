//! Shared test support: a fake VM, temporary directories and a raw HTTP exchange over a real
//! Unix socket.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use vmhost_api::{serve, ApiServer, ControlError, ServerLimits, VmControl};

/// Generous bound on any single exchange: a hung server fails the test instead of hanging it.
pub const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// A fake VM: tracks its state and counts calls.
#[derive(Default)]
pub struct FakeVm {
    state: Mutex<&'static str>,
    pub info_calls: AtomicUsize,
    pub placement_calls: AtomicUsize,
    pub resources_calls: AtomicUsize,
    pub pause_calls: AtomicUsize,
    pub resume_calls: AtomicUsize,
    pub shutdown_calls: AtomicUsize,
    /// Make pause fail with a 500.
    pub fail_pause: AtomicBool,
    /// Make `info` panic.
    pub panic_info: AtomicBool,
}

impl FakeVm {
    pub fn running() -> Arc<Self> {
        let vm = Self::default();
        *vm.state.lock().unwrap() = "running";
        Arc::new(vm)
    }

    pub fn state(&self) -> &'static str {
        *self.state.lock().unwrap()
    }

    /// All calls made, in route order.
    pub fn calls(&self) -> [usize; 6] {
        [
            &self.info_calls,
            &self.placement_calls,
            &self.resources_calls,
            &self.pause_calls,
            &self.resume_calls,
            &self.shutdown_calls,
        ]
        .map(|c| c.load(Ordering::SeqCst))
    }

    fn transition(
        &self,
        from: &[&str],
        to: &'static str,
        conflict: &str,
    ) -> Result<Value, ControlError> {
        let mut state = self.state.lock().unwrap();
        if !from.contains(&*state) {
            return Err(ControlError::Conflict(format!(
                "{conflict} (state {})",
                *state
            )));
        }
        *state = to;
        Ok(json!({ "state": to }))
    }
}

impl VmControl for FakeVm {
    fn info(&self) -> Value {
        self.info_calls.fetch_add(1, Ordering::SeqCst);
        assert!(
            !self.panic_info.load(Ordering::SeqCst),
            "fake VM told to panic"
        );
        json!({ "state": self.state(), "spec": { "vcpus": 2 }, "uptime_s": 7 })
    }

    fn placement(&self) -> Value {
        self.placement_calls.fetch_add(1, Ordering::SeqCst);
        json!({ "vcpus": [{ "index": 0, "tid": 1234, "allowed": [2], "last_cpu": 2 }] })
    }

    fn resources(&self) -> Value {
        self.resources_calls.fetch_add(1, Ordering::SeqCst);
        json!({ "guest_ram": 1_073_741_824u64 })
    }

    fn pause(&self) -> Result<Value, ControlError> {
        self.pause_calls.fetch_add(1, Ordering::SeqCst);
        if self.fail_pause.load(Ordering::SeqCst) {
            return Err(ControlError::Failed {
                action: "pausing vCPU 1".to_owned(),
                source: "vCPU thread did not acknowledge".into(),
            });
        }
        self.transition(&["running"], "paused", "VM is not running")
    }

    fn resume(&self) -> Result<Value, ControlError> {
        self.resume_calls.fetch_add(1, Ordering::SeqCst);
        self.transition(&["paused"], "running", "VM is not paused")
    }

    fn shutdown(&self) -> Result<Value, ControlError> {
        self.shutdown_calls.fetch_add(1, Ordering::SeqCst);
        self.transition(
            &["created", "running", "paused"],
            "stopped",
            "VM is already stopped",
        )
    }
}

/// A temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let serial = SERIAL.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("vmhost-api-{}-{serial}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Names in the directory, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Limits for tests: short stop grace so idle connections do not slow the suite.
pub fn test_limits() -> ServerLimits {
    ServerLimits {
        stop_grace: Duration::from_millis(100),
        ..ServerLimits::default()
    }
}

/// A server on `dir/api.sock` for `vm`.
pub fn start(dir: &TempDir, vm: &Arc<FakeVm>, limits: ServerLimits) -> ApiServer {
    let control: Arc<dyn VmControl> = vm.clone();
    serve(&dir.join("api.sock"), control, limits, None).unwrap()
}

/// An answer read off the wire.
#[derive(Debug)]
pub struct Raw {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl Raw {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn error(&self) -> &str {
        self.body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error field in {self:?}"))
    }
}

/// A connected stream with generous timeouts.
pub fn connect(path: &Path) -> UnixStream {
    let stream = UnixStream::connect(path).unwrap();
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    stream.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    stream
}

/// Sends `bytes` as they are and reads the answer until the server closes.
pub fn exchange(path: &Path, bytes: &[u8]) -> Raw {
    let mut stream = connect(path);
    send(&mut stream, bytes);
    read_raw(&mut stream)
}

/// Writes, tolerating a server that already answered and closed.
pub fn send(stream: &mut UnixStream, bytes: &[u8]) {
    if let Err(err) = stream.write_all(bytes) {
        assert!(
            matches!(
                err.kind(),
                ErrorKind::BrokenPipe | ErrorKind::ConnectionReset
            ),
            "write failed: {err}"
        );
    }
}

/// Reads an answer until EOF (or a reset after the answer) and parses it.
pub fn read_raw(stream: &mut UnixStream) -> Raw {
    let mut raw = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
            Err(err) if err.kind() == ErrorKind::ConnectionReset && !raw.is_empty() => break,
            Err(err) => panic!("read failed after {} bytes: {err}", raw.len()),
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let head_len = match response.parse(&raw) {
        Ok(httparse::Status::Complete(len)) => len,
        other => panic!("bad answer {other:?}: {:?}", String::from_utf8_lossy(&raw)),
    };
    let headers: Vec<(String, String)> = response
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_owned(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    let status = response.code.unwrap();
    let body = &raw[head_len..];
    let raw = Raw {
        status,
        body: serde_json::from_slice(body).unwrap_or_else(|err| {
            panic!("body not JSON ({err}): {:?}", String::from_utf8_lossy(body))
        }),
        headers,
    };
    assert_eq!(raw.header("content-type"), Some("application/json"));
    assert_eq!(
        raw.header("content-length"),
        Some(body.len().to_string().as_str())
    );
    raw
}

/// `METHOD path` with an optional body, as a well-formed request.
pub fn http(method: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}
