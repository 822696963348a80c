//! The control API end to end (`vmhost_api::fuzz_serve_connection`, feature `fuzzing`): the
//! server's per-connection code reads any bytes a local client sends on a real Unix socket,
//! routes the request to a VM whose pause, resume, shutdown and job starts (snapshot, migrate)
//! succeed, conflict or fail as the input's first byte says, and answers. Invariants: exactly one well-formed HTTP/1.1
//! response and nothing after it (none for an empty connection; a `100 Continue` before it
//! only when the client asked for one), a status the API documents
//! with its reason phrase, a JSON body of the announced length; errors are `{"error": text}`,
//! 405 names the allowed methods (`GET, PUT` on the job routes); the VM is called at most once,
//! and exactly when the status is 200, 202, 409 or 500; a 200 or 202 carries what it returned,
//! and 202 answers exactly the job starts.
//!
//! Input: `[VM behaviour, bytes the client sends...]`.
#![no_main]

use std::sync::{Arc, Mutex};

use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};
use vmhost_api::{ControlError, MigrateRequest, SnapshotRequest, VmControl};

/// A VM that records its calls; `mode` picks how its actions end.
struct Vm {
    mode: u8,
    calls: Mutex<Vec<Value>>,
}

impl Vm {
    fn answer(&self, route: &str) -> Value {
        let v = json!({ "route": route });
        self.calls.lock().expect("calls").push(v.clone());
        v
    }

    fn act(&self, route: &str) -> Result<Value, ControlError> {
        let v = self.answer(route);
        match self.mode % 3 {
            0 => Ok(v),
            1 => Err(ControlError::Conflict(format!("{route}: not now"))),
            _ => Err(ControlError::Failed {
                action: route.to_owned(),
                source: "the fuzzer said so".into(),
            }),
        }
    }
}

impl VmControl for Vm {
    fn info(&self) -> Value {
        self.answer("info")
    }
    fn placement(&self) -> Value {
        self.answer("placement")
    }
    fn resources(&self) -> Value {
        self.answer("resources")
    }
    fn pause(&self) -> Result<Value, ControlError> {
        self.act("pause")
    }
    fn resume(&self) -> Result<Value, ControlError> {
        self.act("resume")
    }
    fn shutdown(&self) -> Result<Value, ControlError> {
        self.act("shutdown")
    }
    fn start_snapshot(&self, _: SnapshotRequest) -> Result<Value, ControlError> {
        self.act("start_snapshot")
    }
    fn snapshot_job(&self) -> Value {
        self.answer("snapshot_job")
    }
    fn start_migration(&self, _: MigrateRequest) -> Result<Value, ControlError> {
        self.act("start_migration")
    }
    fn migration_job(&self) -> Value {
        self.answer("migration_job")
    }
}

/// The routes that start a long job (answered with 202, not 200).
const JOB_STARTS: &[&str] = &["start_snapshot", "start_migration"];

const STATUSES: &[(u16, &str)] = &[
    (200, "OK"),
    (202, "Accepted"),
    (400, "Bad Request"),
    (404, "Not Found"),
    (405, "Method Not Allowed"),
    (409, "Conflict"),
    (411, "Length Required"),
    (413, "Content Too Large"),
    (431, "Request Header Fields Too Large"),
    (500, "Internal Server Error"),
];

fn header<'a>(headers: &'a [httparse::Header<'_>], name: &str) -> Option<&'a [u8]> {
    let mut found = headers.iter().filter(|h| h.name.eq_ignore_ascii_case(name));
    let first = found.next()?;
    assert!(found.next().is_none(), "header {name} twice");
    Some(first.value)
}

/// The one response in `wire`: status (documented, with its reason phrase), body (of the
/// announced length, the last bytes on the wire) and headers (JSON, `Connection: close`).
fn parse_answer<'w, 'h>(
    wire: &'w [u8],
    headers: &'h mut [httparse::Header<'w>],
) -> (u16, &'w [u8], &'h [httparse::Header<'w>]) {
    let mut response = httparse::Response::new(headers);
    let head_len = match response.parse(wire) {
        Ok(httparse::Status::Complete(n)) => n,
        other => panic!(
            "not one HTTP response ({other:?}): {:?}",
            String::from_utf8_lossy(wire)
        ),
    };
    assert_eq!(response.version, Some(1));
    let status = response.code.expect("a status");
    let reason = STATUSES
        .iter()
        .find(|(s, _)| *s == status)
        .map(|(_, r)| *r)
        .unwrap_or_else(|| panic!("undocumented status {status}"));
    assert_eq!(response.reason, Some(reason));
    let h = response.headers;
    assert_eq!(header(h, "content-type"), Some(&b"application/json"[..]));
    assert_eq!(header(h, "connection"), Some(&b"close"[..]));
    let length: usize = std::str::from_utf8(header(h, "content-length").expect("Content-Length"))
        .expect("ASCII")
        .parse()
        .expect("a number");
    assert_eq!(
        wire.len(),
        head_len + length,
        "bytes beyond the one response"
    );
    let body = &wire[head_len..];
    assert_eq!(body.last(), Some(&b'\n'));
    (status, body, h)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, sent)) = data.split_first() else {
        return;
    };
    let vm = Arc::new(Vm {
        mode,
        calls: Mutex::new(Vec::new()),
    });
    let wire = vmhost_api::fuzz_serve_connection(sent, vm.clone()).expect("the harness");
    let calls = vm.calls.lock().expect("calls").clone();
    if sent.is_empty() {
        assert!(
            wire.is_empty() && calls.is_empty(),
            "an empty connection got {wire:?}"
        );
        return;
    }
    // An interim answer to `Expect: 100-continue` may come first.
    let wire = match wire.strip_prefix(&b"HTTP/1.1 100 Continue\r\n\r\n"[..]) {
        Some(rest) => {
            let asked = sent
                .windows(12)
                .any(|w| w.eq_ignore_ascii_case(b"100-continue"));
            assert!(asked, "100 Continue without Expect: 100-continue");
            rest
        }
        None => &wire[..],
    };
    let mut headers = [httparse::EMPTY_HEADER; 16];
    let (status, body, h) = parse_answer(wire, &mut headers);
    let value: Value = serde_json::from_slice(body).expect("a JSON body");
    match status {
        200 | 202 => {
            assert_eq!(Some(&value), calls.first(), "a {status} not from the VM");
            let started = JOB_STARTS.contains(&value["route"].as_str().unwrap_or(""));
            assert_eq!(status == 202, started, "status {status} for {value}");
        }
        _ => assert!(value["error"].is_string(), "error body {value}"),
    }
    if status == 405 {
        let allow = header(h, "allow").expect("405 names the allowed method");
        assert!(
            [&b"GET"[..], b"PUT", b"GET, PUT"].contains(&allow),
            "Allow: {allow:?}"
        );
    }
    let called = usize::from(matches!(status, 200 | 202 | 409 | 500));
    assert_eq!(
        calls.len(),
        called,
        "status {status} after VM calls {calls:?}"
    );
    if matches!(status, 409 | 500) {
        assert_eq!(
            mode % 3,
            if status == 409 { 1 } else { 2 },
            "status {status}"
        );
    }
});
