//! Every route and status code over a real Unix socket, through both the crate's client and raw
//! HTTP.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;

use common::{exchange, http, start, test_limits, FakeVm, TempDir};
use serde_json::json;
use vmhost_api::request;

#[test]
fn get_routes_answer_from_the_vm() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let socket = server.path();

    let info = request(socket, "GET", "/vm").unwrap();
    assert_eq!(info.status, 200);
    assert_eq!(info.body["state"], "running");
    assert_eq!(info.body["uptime_s"], 7);
    let placement = request(socket, "GET", "/vm/placement").unwrap();
    assert_eq!(
        (placement.status, &placement.body["vcpus"][0]["tid"]),
        (200, &json!(1234))
    );
    let resources = request(socket, "GET", "/vm/resources").unwrap();
    assert_eq!(
        (resources.status, &resources.body["guest_ram"]),
        (200, &json!(1_073_741_824u64))
    );
    assert_eq!(vm.calls(), [1, 1, 1, 0, 0, 0]);
    server.stop().unwrap();
}

#[test]
fn pause_resume_shutdown_and_conflicts() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let socket = server.path();
    let put = |uri: &str| request(socket, "PUT", uri).unwrap();

    let paused = put("/vm/pause");
    assert_eq!(
        (paused.status, &paused.body),
        (200, &json!({ "state": "paused" }))
    );
    assert_eq!(vm.state(), "paused");
    let again = put("/vm/pause");
    assert_eq!(again.status, 409);
    assert!(
        again.error_message().unwrap().contains("not running"),
        "{again:?}"
    );
    assert_eq!(vm.state(), "paused");

    assert_eq!(put("/vm/resume").status, 200);
    assert_eq!(vm.state(), "running");
    let resumed_again = put("/vm/resume");
    assert_eq!(resumed_again.status, 409);
    assert!(resumed_again
        .error_message()
        .unwrap()
        .contains("not paused"));

    assert_eq!(put("/vm/shutdown").status, 200);
    assert_eq!(vm.state(), "stopped");
    assert_eq!(put("/vm/shutdown").status, 409);
    assert_eq!(put("/vm/pause").status, 409);
    assert_eq!(put("/vm/resume").status, 409);
    assert_eq!(
        request(socket, "GET", "/vm").unwrap().body["state"],
        "stopped"
    );
    assert_eq!(vm.calls(), [1, 0, 0, 3, 3, 2]);
    server.stop().unwrap();
}

#[test]
fn failed_action_is_500_with_the_cause() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    vm.fail_pause.store(true, Ordering::SeqCst);
    let server = start(&dir, &vm, test_limits());

    let answer = request(server.path(), "PUT", "/vm/pause").unwrap();
    assert_eq!(answer.status, 500);
    assert_eq!(
        answer.error_message(),
        Some("pausing vCPU 1 failed: vCPU thread did not acknowledge")
    );
    assert_eq!(vm.state(), "running");
    server.stop().unwrap();
}

#[test]
fn panicking_vm_control_is_500_and_the_server_keeps_serving() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    vm.panic_info.store(true, Ordering::SeqCst);
    let server = start(&dir, &vm, test_limits());

    let answer = request(server.path(), "GET", "/vm").unwrap();
    assert_eq!(answer.status, 500);
    assert!(answer.error_message().unwrap().contains("internal error"));
    assert_eq!(
        request(server.path(), "GET", "/vm/resources")
            .unwrap()
            .status,
        200
    );
    server.stop().unwrap();
}

#[test]
fn unknown_path_is_404_json() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());

    for uri in ["/", "/vm/", "/VM", "/vm/pause/now", "/vms", "/vm/%70ause"] {
        let answer = request(server.path(), "GET", uri).unwrap();
        assert_eq!(answer.status, 404, "{uri}");
        assert!(
            answer.error_message().unwrap().contains("no such path"),
            "{answer:?}"
        );
    }
    let raw = exchange(server.path(), &http("GET", "*", ""));
    assert_eq!(raw.status, 404);
    assert_eq!(vm.calls(), [0; 6]);
    server.stop().unwrap();
}

#[test]
fn wrong_method_is_405_with_allow() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());

    for (method, uri, allow) in [
        ("PUT", "/vm", "GET"),
        ("POST", "/vm/placement", "GET"),
        ("DELETE", "/vm/resources", "GET"),
        ("GET", "/vm/pause", "PUT"),
        ("POST", "/vm/resume", "PUT"),
        ("HEAD", "/vm/shutdown", "PUT"),
    ] {
        let raw = exchange(server.path(), &http(method, uri, ""));
        assert_eq!(raw.status, 405, "{method} {uri}");
        assert_eq!(raw.header("allow"), Some(allow), "{method} {uri}");
        assert!(raw.error().contains(method), "{raw:?}");
    }
    assert_eq!(vm.calls(), [0; 6]);
    assert_eq!(vm.state(), "running");
    server.stop().unwrap();
}

#[test]
fn put_body_must_be_empty_or_empty_object() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let socket = server.path();

    assert_eq!(
        exchange(socket, &http("PUT", "/vm/pause", "{}")).status,
        200
    );
    assert_eq!(
        exchange(socket, &http("PUT", "/vm/resume", " { }\n")).status,
        200
    );
    for bad in ["{", "not json", "[]", "{\"force\": true}", "null"] {
        let raw = exchange(socket, &http("PUT", "/vm/pause", bad));
        assert_eq!(raw.status, 400, "{bad}");
        assert!(raw.error().contains("body"), "{raw:?}");
    }
    // A GET with a bogus body is refused the same way.
    assert_eq!(exchange(socket, &http("GET", "/vm", "oops")).status, 400);
    assert_eq!(vm.calls(), [0, 0, 0, 1, 1, 0]);
    assert_eq!(vm.state(), "running");
    server.stop().unwrap();
}

#[test]
fn query_string_http10_and_expect_continue_are_served() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let socket = server.path();

    assert_eq!(request(socket, "GET", "/vm?pretty=1").unwrap().status, 200);
    assert_eq!(exchange(socket, b"GET /vm HTTP/1.0\r\n\r\n").status, 200);

    // A client that waits for 100 Continue before its body gets it, then the answer.
    let mut stream = common::connect(socket);
    common::send(
        &mut stream,
        b"PUT /vm/pause HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n",
    );
    let mut interim = [0u8; 25];
    std::io::Read::read_exact(&mut stream, &mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    common::send(&mut stream, b"{}");
    assert_eq!(common::read_raw(&mut stream).status, 200);
    assert_eq!(vm.state(), "paused");
    server.stop().unwrap();
}

/// A VM whose snapshot job only records what it was asked.
struct SnapVm(std::sync::Mutex<Vec<vmhost_api::SnapshotRequest>>);

impl vmhost_api::VmControl for SnapVm {
    fn info(&self) -> serde_json::Value {
        json!({})
    }
    fn placement(&self) -> serde_json::Value {
        json!({})
    }
    fn resources(&self) -> serde_json::Value {
        json!({})
    }
    fn pause(&self) -> Result<serde_json::Value, vmhost_api::ControlError> {
        Ok(json!({}))
    }
    fn resume(&self) -> Result<serde_json::Value, vmhost_api::ControlError> {
        Ok(json!({}))
    }
    fn shutdown(&self) -> Result<serde_json::Value, vmhost_api::ControlError> {
        Ok(json!({}))
    }
    fn start_snapshot(
        &self,
        request: vmhost_api::SnapshotRequest,
    ) -> Result<serde_json::Value, vmhost_api::ControlError> {
        self.0.lock().unwrap().push(request);
        Ok(json!({"state": "running", "phase": "pause"}))
    }
    fn snapshot_job(&self) -> serde_json::Value {
        json!({"state": "running", "jobs": self.0.lock().unwrap().len()})
    }
}

#[test]
fn snapshot_starts_a_job_with_202_and_its_progress_is_polled() {
    let dir = TempDir::new();
    let vm = std::sync::Arc::new(SnapVm(Default::default()));
    let control: std::sync::Arc<dyn vmhost_api::VmControl> = vm.clone();
    let server = vmhost_api::serve(&dir.join("api.sock"), control, test_limits(), None).unwrap();
    let socket = server.path();
    let body = json!({"dir": "/tmp/snap-1", "stop": true});
    let answer = vmhost_api::request_with_body(
        socket,
        "PUT",
        "/vm/snapshot",
        Some(&body),
        vmhost_api::DEFAULT_CLIENT_TIMEOUT,
    )
    .unwrap();
    assert_eq!(answer.status, 202, "{answer:?}");
    assert_eq!(answer.body["phase"], "pause");
    let got = vm.0.lock().unwrap().clone();
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].dir.to_str(), got[0].stop),
        (Some("/tmp/snap-1"), true)
    );
    assert_eq!(
        request(socket, "GET", "/vm/snapshot").unwrap().body["jobs"],
        1
    );
    for bad in ["{}", "{\"dir\": 1}", "{\"dir\": \"/a\", \"x\": 1}", ""] {
        let raw = exchange(socket, &http("PUT", "/vm/snapshot", bad));
        assert_eq!(raw.status, 400, "{bad}");
    }
    let raw = exchange(socket, &http("DELETE", "/vm/snapshot", ""));
    assert_eq!((raw.status, raw.header("allow")), (405, Some("GET, PUT")));
    assert_eq!(vm.0.lock().unwrap().len(), 1);
    server.stop().unwrap();
}

#[test]
fn a_vm_without_snapshot_support_refuses_with_409() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let raw = exchange(
        server.path(),
        &http("PUT", "/vm/snapshot", "{\"dir\": \"/tmp/x\"}"),
    );
    assert_eq!(raw.status, 409);
    assert_eq!(
        request(server.path(), "GET", "/vm/snapshot").unwrap().body,
        json!({"state": "none"})
    );
    server.stop().unwrap();
}
