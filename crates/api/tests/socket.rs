//! The socket file's life: mode 0600, stale sockets replaced, live sockets and other files left
//! alone, removal at stop; the `vmhost-api` thread and its start hook; running on the caller's
//! runtime; the client's errors when nothing serves the path.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};

use common::{start, test_limits, FakeVm, TempDir};
use vmhost_api::{
    request, request_with_timeout, serve, ApiListener, BindError, ClientError, ServeError,
    VmControl,
};
use vmhost_testsupport::dirwatch::{DirEvent, DirWatch};

fn control(vm: &Arc<FakeVm>) -> Arc<dyn VmControl> {
    vm.clone()
}

#[test]
fn socket_mode_is_0600_and_no_temporary_file_is_left() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());

    let meta = std::fs::symlink_metadata(server.path()).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    assert_eq!(dir.names(), ["api.sock"]);
    server.stop().unwrap();
}

/// The socket's name never exists with a mode wider than 0600: the watched directory sees the
/// name created once and no mode change afterwards (a chmod after bind, even of a temporary
/// name, shows as an attribute change), and the mode it has is 0600 although the process's
/// umask would leave group and others more.
#[test]
fn the_socket_name_is_created_with_mode_0600_and_never_chmodded() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let path = dir.join("api.sock");
    let mut watch = DirWatch::new(path.parent().unwrap());
    let server = start(&dir, &vm, test_limits());
    let events = watch.events();
    assert_eq!(events, [DirEvent::Created("api.sock".into())], "{events:?}");
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    server.stop().unwrap();
}

#[test]
fn stop_and_drop_remove_the_socket() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let path = dir.join("api.sock");

    let server = start(&dir, &vm, test_limits());
    server.stop().unwrap();
    assert!(!path.exists());
    let err = request(&path, "GET", "/vm").unwrap_err();
    assert!(matches!(err, ClientError::NoSocket { .. }), "{err:?}");

    let server = start(&dir, &vm, test_limits());
    assert!(path.exists());
    drop(server);
    assert!(!path.exists());
    assert!(dir.names().is_empty());
}

#[test]
fn stop_leaves_a_socket_that_replaced_ours_alone() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let server = start(&dir, &vm, test_limits());
    let path = server.path().to_owned();

    std::fs::remove_file(&path).unwrap();
    let other = UnixListener::bind(&path).unwrap();
    server.stop().unwrap();
    assert!(path.exists(), "someone else's socket was removed");
    drop(other);
}

#[test]
fn stale_socket_file_is_replaced() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let path = dir.join("api.sock");
    drop(UnixListener::bind(&path).unwrap()); // leaves the file, nobody listening
    assert!(path.exists());
    let err = request(&path, "GET", "/vm").unwrap_err();
    assert!(matches!(err, ClientError::Refused { .. }), "{err:?}");
    assert!(err.to_string().contains("--api-socket"), "{err}");

    let server = start(&dir, &vm, test_limits());
    assert_eq!(request(&path, "GET", "/vm").unwrap().status, 200);
    server.stop().unwrap();
}

#[test]
fn live_socket_of_another_server_is_refused() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let first = start(&dir, &vm, test_limits());
    let path = first.path().to_owned();

    let second = serve(&path, control(&vm), test_limits(), None).unwrap_err();
    assert!(
        matches!(second, ServeError::Bind(BindError::InUse { .. })),
        "{second:?}"
    );
    assert!(second.to_string().contains("live socket"), "{second}");
    // The first server is undisturbed: its socket is still there and it still answers.
    assert_eq!(request(&path, "GET", "/vm").unwrap().status, 200);
    assert_eq!(dir.names(), ["api.sock"]);
    first.stop().unwrap();

    // A plain listener of some other program counts as live too.
    let other = UnixListener::bind(&path).unwrap();
    let err = ApiListener::bind(&path, test_limits()).unwrap_err();
    assert!(
        matches!(err, ServeError::Bind(BindError::InUse { .. })),
        "{err:?}"
    );
    assert!(path.exists());
    drop(other);
}

#[test]
fn non_socket_files_are_refused_and_left_alone() {
    let dir = TempDir::new();
    let vm = FakeVm::running();

    let file = dir.join("file.sock");
    std::fs::write(&file, "precious").unwrap();
    let err = serve(&file, control(&vm), test_limits(), None).unwrap_err();
    assert!(
        matches!(
            err,
            ServeError::Bind(BindError::NotASocket {
                kind: "regular file",
                ..
            })
        ),
        "{err:?}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "precious");

    let subdir = dir.join("dir.sock");
    std::fs::create_dir(&subdir).unwrap();
    let err = ApiListener::bind(&subdir, test_limits()).unwrap_err();
    assert!(err.to_string().contains("directory"), "{err}");
    assert!(subdir.is_dir());

    // A symlink is not followed, even to a stale socket.
    let stale = dir.join("stale");
    drop(UnixListener::bind(&stale).unwrap());
    let link = dir.join("link.sock");
    std::os::unix::fs::symlink(&stale, &link).unwrap();
    let err = ApiListener::bind(&link, test_limits()).unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());

    assert_eq!(dir.names(), ["dir.sock", "file.sock", "link.sock", "stale"]);
}

#[test]
fn missing_directory_is_a_bind_error() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let err = serve(
        &dir.join("no/such/dir/api.sock"),
        control(&vm),
        test_limits(),
        None,
    )
    .unwrap_err();
    assert!(
        matches!(err, ServeError::Bind(BindError::Bind { .. })),
        "{err:?}"
    );
}

#[test]
fn start_hook_runs_on_the_named_thread_before_serving() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let seen = Arc::new(Mutex::new(None));
    let record = seen.clone();
    let hook = Box::new(move || {
        *record.lock().unwrap() = std::thread::current().name().map(str::to_owned);
        Ok(())
    });
    let server = serve(
        &dir.join("api.sock"),
        control(&vm),
        test_limits(),
        Some(hook),
    )
    .unwrap();
    assert_eq!(seen.lock().unwrap().as_deref(), Some("vmhost-api"));
    assert_eq!(request(server.path(), "GET", "/vm").unwrap().status, 200);
    server.stop().unwrap();
}

#[test]
fn failing_start_hook_fails_serve_and_leaves_no_socket() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let hook = Box::new(|| Err("cannot pin to CPU 3".into()));
    let err = serve(
        &dir.join("api.sock"),
        control(&vm),
        test_limits(),
        Some(hook),
    )
    .unwrap_err();
    assert!(matches!(err, ServeError::StartHook(_)), "{err:?}");
    assert_eq!(
        std::error::Error::source(&err).unwrap().to_string(),
        "cannot pin to CPU 3"
    );
    assert!(dir.names().is_empty(), "{:?}", dir.names());
}

#[test]
fn panicking_start_hook_is_reported() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let hook = Box::new(|| panic!("hook panicked on purpose"));
    let err = serve(
        &dir.join("api.sock"),
        control(&vm),
        test_limits(),
        Some(hook),
    )
    .unwrap_err();
    assert!(matches!(err, ServeError::ThreadPanicked), "{err:?}");
    assert!(dir.names().is_empty(), "{:?}", dir.names());
}

#[test]
fn listener_runs_on_the_callers_runtime() {
    let dir = TempDir::new();
    let vm = FakeVm::running();
    let listener = ApiListener::bind(&dir.join("api.sock"), test_limits()).unwrap();
    let path = listener.path().to_owned();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();

    let runtime_thread = std::thread::spawn({
        let vm = vm.clone();
        move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(listener.run(control(&vm), async {
                let _ = stop_rx.await;
            }))
        }
    });
    // The socket is bound before `run`, so requests queue until the runtime accepts them.
    assert_eq!(request(&path, "PUT", "/vm/pause").unwrap().status, 200);
    assert_eq!(vm.state(), "paused");
    stop_tx.send(()).unwrap();
    runtime_thread.join().unwrap().unwrap();
    assert!(!path.exists());
}

#[test]
fn dropped_listener_removes_its_socket() {
    let dir = TempDir::new();
    let listener = ApiListener::bind(&dir.join("api.sock"), test_limits()).unwrap();
    assert_eq!(dir.names(), ["api.sock"]);
    drop(listener);
    assert!(dir.names().is_empty());
}

#[test]
fn client_explains_a_missing_socket_and_refuses_bad_requests() {
    let dir = TempDir::new();
    let path = dir.join("nothing.sock");
    let err = request(&path, "GET", "/vm").unwrap_err();
    assert!(matches!(err, ClientError::NoSocket { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("is the VM running with --api-socket"),
        "{message}"
    );
    assert!(message.contains("nothing.sock"), "{message}");

    let err = request(&path, "GET", "/vm HTTP/1.1\r\nX-Injected: 1").unwrap_err();
    assert!(matches!(err, ClientError::InvalidRequest { .. }), "{err:?}");
}

#[test]
fn client_times_out_on_a_server_that_never_answers() {
    let dir = TempDir::new();
    let path = dir.join("mute.sock");
    let mute = UnixListener::bind(&path).unwrap(); // accepts into the backlog, never answers
    let timeout = std::time::Duration::from_millis(200);
    let err = request_with_timeout(&path, "GET", "/vm", timeout).unwrap_err();
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
    drop(mute);
}
