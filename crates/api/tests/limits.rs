//! Malformed, oversized, slow and flooding clients get 4xx/503 and never stop the server; many
//! parallel clients are all answered.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{connect, exchange, http, read_raw, send, start, test_limits, FakeVm, TempDir};
use vmhost_api::{request, ServerLimits};

/// The server still answers a normal request.
fn assert_serving(socket: &std::path::Path) {
    let answer = request(socket, "GET", "/vm").unwrap();
    assert_eq!(answer.status, 200, "{answer:?}");
}

#[test]
fn oversized_body_is_413_and_the_server_keeps_serving() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let limits = ServerLimits {
        max_body_bytes: 1024,
        ..test_limits()
    };
    let server = start(&dir, &vm, limits);
    let socket = server.path();

    // Announced and actually sent: 1 MiB, far more than the socket buffers hold.
    let body = "x".repeat(1 << 20);
    let raw = exchange(socket, &http("PUT", "/vm/pause", &body));
    assert_eq!(raw.status, 413);
    assert!(raw.error().contains("1024"), "{raw:?}");
    // Announced only.
    let raw = exchange(
        socket,
        b"PUT /vm/pause HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
    );
    assert_eq!(raw.status, 413);
    // A body of exactly the limit is read (whitespace counts as an empty body).
    let raw = exchange(socket, &http("PUT", "/vm/pause", &" ".repeat(1024)));
    assert_eq!(raw.status, 200);

    assert_eq!(vm.pause_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_serving(socket);
    server.stop().unwrap();
}

#[test]
fn garbage_and_malformed_requests_are_400() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let socket = server.path();

    for garbage in [
        &b"\x00\x01\x02\xff\xfe garbage\r\n\r\n"[..],
        b"GET\r\n\r\n",
        b"GET /vm\r\n\r\n",
        b"GET /vm HTTP/9.9\r\n\r\n",
        b"GET /vm HTTP/1.1 extra\r\n\r\n",
        b"GET /vm HTTP/1.1\r\nno colon here\r\n\r\n",
        b"GET /vm HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"GET /vm HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ] {
        let raw = exchange(socket, garbage);
        assert_eq!(raw.status, 400, "{:?}", String::from_utf8_lossy(garbage));
        assert!(!raw.error().is_empty());
    }
    // Closing in the middle of the request still gets an answer, as far as one can be sent.
    let mut stream = connect(socket);
    send(
        &mut stream,
        b"PUT /vm/pause HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}",
    );
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(read_raw(&mut stream).status, 400);

    assert_eq!(vm.calls(), [0; 6]);
    assert_serving(socket);
    server.stop().unwrap();
}

#[test]
fn chunked_body_is_411_and_huge_head_is_431() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let socket = server.path();

    let chunked =
        b"PUT /vm/pause HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
    assert_eq!(exchange(socket, chunked).status, 411);

    let long_header = format!(
        "GET /vm HTTP/1.1\r\nX-Junk: {}\r\n\r\n",
        "j".repeat(64 * 1024)
    );
    assert_eq!(exchange(socket, long_header.as_bytes()).status, 431);
    let long_uri = format!("GET /vm?{} HTTP/1.1\r\n\r\n", "q".repeat(16 * 1024));
    assert_eq!(exchange(socket, long_uri.as_bytes()).status, 431);
    let many = format!("GET /vm HTTP/1.1\r\n{}\r\n", "A: b\r\n".repeat(100));
    assert_eq!(exchange(socket, many.as_bytes()).status, 431);

    assert_eq!(vm.calls(), [0; 6]);
    assert_serving(socket);
    server.stop().unwrap();
}

#[test]
fn slow_client_gets_408_and_others_are_served_meanwhile() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let limits = ServerLimits {
        request_timeout: Duration::from_millis(300),
        ..test_limits()
    };
    let server = start(&dir, &vm, limits);
    let socket = server.path();

    // Slowloris: part of a head, then nothing.
    let mut slow_head = connect(socket);
    send(&mut slow_head, b"GET /vm HTTP/1.1\r\nHost: lo");
    // A body that never arrives.
    let mut slow_body = connect(socket);
    send(
        &mut slow_body,
        b"PUT /vm/pause HTTP/1.1\r\nContent-Length: 2\r\n\r\n{",
    );
    // A connection that sends nothing at all.
    let mut silent = connect(socket);

    assert_serving(socket);
    for stream in [&mut slow_head, &mut slow_body, &mut silent] {
        let raw = read_raw(stream);
        assert_eq!(raw.status, 408, "{raw:?}");
        assert!(raw.error().contains("not received"), "{raw:?}");
    }
    assert_eq!(vm.pause_calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_serving(socket);
    server.stop().unwrap();
}

#[test]
fn connections_beyond_the_limit_get_503_while_existing_ones_work() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let limits = ServerLimits {
        max_connections: 4,
        request_timeout: Duration::from_secs(60),
        ..test_limits()
    };
    let server = start(&dir, &vm, limits);
    let socket = server.path();

    // Fill every slot with an idle connection; the backlog is accepted in order, so the next
    // connection is the fifth the server sees.
    let mut held: Vec<_> = (0..4).map(|_| connect(socket)).collect();
    for _ in 0..3 {
        let refused = request(socket, "GET", "/vm").unwrap();
        assert_eq!(refused.status, 503, "{refused:?}");
        assert!(refused.error_message().unwrap().contains("limit 4"));
    }
    // A raw client that sends its request anyway also gets the 503 and a closed connection.
    assert_eq!(exchange(socket, &http("PUT", "/vm/pause", "")).status, 503);
    assert_eq!(vm.calls(), [0; 6]);

    // The held connections still work.
    let mut first = held.remove(0);
    send(&mut first, &http("PUT", "/vm/pause", ""));
    assert_eq!(read_raw(&mut first).status, 200);
    assert_eq!(vm.state(), "paused");

    // Its slot frees once its task ends; retry briefly rather than assume when that is.
    let deadline = Instant::now() + common::IO_TIMEOUT;
    loop {
        let answer = request(socket, "GET", "/vm").unwrap();
        if answer.status == 200 {
            break;
        }
        assert_eq!(answer.status, 503);
        assert!(Instant::now() < deadline, "slot never freed");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(held);
    server.stop().unwrap();
}

#[test]
fn many_parallel_clients_are_all_answered() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let limits = ServerLimits {
        max_connections: 64,
        ..test_limits()
    };
    let server = start(&dir, &vm, limits);
    let socket = Arc::new(server.path().to_owned());

    let clients: Vec<_> = (0..32)
        .map(|i| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let uris = ["/vm", "/vm/placement", "/vm/resources"];
                (0..20)
                    .map(|j| request(&socket, "GET", uris[(i + j) % 3]).unwrap().status)
                    .filter(|status| *status == 200)
                    .count()
            })
        })
        .collect();
    let answered: usize = clients.into_iter().map(|c| c.join().unwrap()).sum();
    assert_eq!(answered, 32 * 20);
    assert_eq!(vm.calls()[..3].iter().sum::<usize>(), 32 * 20);
    server.stop().unwrap();
}

#[test]
fn flood_beyond_the_limit_gets_answers_not_hangs() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let socket = Arc::new(server.path().to_owned());

    let clients: Vec<_> = (0..48)
        .map(|_| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                (0..10)
                    .map(|_| request(&socket, "GET", "/vm").unwrap().status)
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let statuses: Vec<u16> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    assert_eq!(statuses.len(), 480);
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    assert!(statuses.contains(&200));
    assert_serving(&socket);
    server.stop().unwrap();
}

#[test]
fn a_probe_that_sends_nothing_and_closes_gets_no_answer() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());

    let mut probe = connect(server.path());
    probe.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    probe.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "{:?}", String::from_utf8_lossy(&rest));
    assert_serving(server.path());
    server.stop().unwrap();
}
