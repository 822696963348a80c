//! vmhost's control API: HTTP/1.1 with JSON bodies on a Unix socket, served by each
//! `vmhost --config vm.toml --api-socket PATH` process, and the blocking client behind
//! `vmhost ctl --api-socket PATH <command>`.
//!
//! This crate knows HTTP and sockets, not KVM: the VM side is the [`VmControl`] trait, which the
//! binary implements. The server runs on a tokio current-thread runtime, either on a thread that
//! [`serve`] starts (named `vmhost-api`, with a start hook so the caller can pin it as the
//! emulator thread) or on the caller's own runtime via [`ApiListener::run`].
//!
//! # Routes
//!
//! | method | path             | answer                                                       |
//! |--------|------------------|--------------------------------------------------------------|
//! | `GET`  | `/vm`            | [`VmControl::info`]: state, spec, uptime                     |
//! | `GET`  | `/vm/placement`  | [`VmControl::placement`]: live placement, deviations flagged |
//! | `GET`  | `/vm/resources`  | [`VmControl::resources`]: envelope next to measured figures  |
//! | `PUT`  | `/vm/pause`      | [`VmControl::pause`]                                         |
//! | `PUT`  | `/vm/resume`     | [`VmControl::resume`]                                        |
//! | `PUT`  | `/vm/shutdown`   | [`VmControl::shutdown`]                                      |
//! | `PUT`  | `/vm/snapshot`   | [`VmControl::start_snapshot`]: starts the job, answers 202   |
//! | `GET`  | `/vm/snapshot`   | [`VmControl::snapshot_job`]: the job's progress              |
//! | `PUT`  | `/vm/migrate`    | [`VmControl::start_migration`]: starts the job, answers 202  |
//! | `GET`  | `/vm/migrate`    | [`VmControl::migration_job`]: the job's progress             |
//!
//! A query string is ignored. A request body must be absent, empty or the JSON object `{}`,
//! except on `PUT /vm/snapshot`, whose body is a [`SnapshotRequest`], and `PUT /vm/migrate`,
//! whose body is a [`MigrateRequest`].
//! Every answer, errors included, is a JSON document (`Content-Type: application/json`); errors
//! are `{"error": "..."}`. Each connection carries one request (`Connection: close`).
//!
//! # Status codes
//!
//! | code | when                                                                            |
//! |------|---------------------------------------------------------------------------------|
//! | 200  | the route's answer                                                              |
//! | 202  | a long job was started (`PUT /vm/snapshot`); poll its `GET` route               |
//! | 400  | malformed request line, header or `Content-Length`; a body that is not `{}`     |
//! | 404  | unknown path                                                                    |
//! | 405  | known path, wrong method (with an `Allow` header)                               |
//! | 408  | the request was not fully received within [`ServerLimits::request_timeout`]     |
//! | 409  | [`ControlError::Conflict`], e.g. pausing a paused VM or resuming a stopped one   |
//! | 411  | `Transfer-Encoding` (chunked bodies are not accepted; send `Content-Length`)      |
//! | 413  | body larger than [`ServerLimits::max_body_bytes`]                               |
//! | 431  | request head larger than [`ServerLimits::max_head_bytes`] or too many headers    |
//! | 500  | [`ControlError::Failed`], or the [`VmControl`] implementation panicked          |
//! | 503  | more than [`ServerLimits::max_connections`] connections open; closed at once    |
//!
//! None of these disturb the VM: a bad request never reaches [`VmControl`], and the server keeps
//! serving.
//!
//! # Socket
//!
//! The socket is created with mode `0600` (bound under a temporary name, chmodded, then linked
//! into place, so it is never reachable with a wider mode). An existing socket at the path is
//! replaced only when it is stale (connecting is refused); a live socket or any other kind of
//! file makes binding fail. Stopping the server removes the socket, if it is still ours.
#![warn(missing_docs)]

mod client;
#[cfg(feature = "fuzzing")]
mod fuzzing;
mod http;
mod routes;
mod server;
mod socket;
mod sys;

use std::time::Duration;

pub use client::{
    request, request_with_body, request_with_timeout, ApiResponse, ClientError,
    DEFAULT_CLIENT_TIMEOUT,
};
#[cfg(feature = "fuzzing")]
pub use fuzzing::{fuzz_read_request, fuzz_serve_connection};
pub use server::{serve, ApiListener, ApiServer, ServeError, ThreadStartHook};
pub use socket::BindError;

/// Binds and listens on a new Unix stream socket at `path` created with mode `0600` from its
/// first moment (`fchmod` on the unbound socket, no umask change): for other listeners of
/// vmhost (`vmhost receive`). Fails with `EADDRINUSE` when anything exists at `path`.
pub fn bind_unix_0600(path: &std::path::Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    sys::bind_unix_with_mode(path, 0o600)
}

/// The VM side of the API, implemented by the binary.
///
/// Methods run on the API thread (the emulator thread when the binary pins it) and block it
/// while they run, so they should return promptly: pausing should signal and wait for the vCPUs,
/// not for the guest. A panic in a method is caught and answered with 500. A method must not
/// stop or drop the [`ApiServer`] (that joins the thread it runs on): signal the main thread,
/// which stops the server.
pub trait VmControl: Send + Sync + 'static {
    /// `GET /vm`: the VM's state (`created`, `running`, `paused`, `stopped`), spec and uptime.
    fn info(&self) -> serde_json::Value;
    /// `GET /vm/placement`: live placement read from `/proc`, with deviations from the plan.
    fn placement(&self) -> serde_json::Value;
    /// `GET /vm/resources`: the plan's envelope next to measured figures.
    fn resources(&self) -> serde_json::Value;
    /// `PUT /vm/pause`: pause all vCPUs.
    fn pause(&self) -> Result<serde_json::Value, ControlError>;
    /// `PUT /vm/resume`: resume paused vCPUs.
    fn resume(&self) -> Result<serde_json::Value, ControlError>;
    /// `PUT /vm/shutdown`: end the VM (the process then exits and stops the server). The
    /// binary stops a payload VM at once and asks a Linux guest to power off through its ACPI
    /// power button, stopping it if it has not within a grace period.
    fn shutdown(&self) -> Result<serde_json::Value, ControlError>;
    /// `PUT /vm/snapshot`: start a snapshot job and return at once (answered with 202) with
    /// the job's first progress report; [`ControlError::Conflict`] when a job is running or
    /// the VM cannot be snapshotted. The default refuses (a VM without snapshot support).
    fn start_snapshot(&self, request: SnapshotRequest) -> Result<serde_json::Value, ControlError> {
        let _ = request;
        Err(ControlError::Conflict(
            "this VM cannot be snapshotted".into(),
        ))
    }
    /// `GET /vm/snapshot`: the last snapshot job's progress, `{"state": "none"}` when there
    /// was none (see the binary's job for the other fields).
    fn snapshot_job(&self) -> serde_json::Value {
        serde_json::json!({"state": "none"})
    }
    /// `PUT /vm/migrate`: start a live migration job and return at once (answered with 202)
    /// with its first progress report; [`ControlError::Conflict`] when a job is running or the
    /// VM cannot migrate. The default refuses.
    fn start_migration(&self, request: MigrateRequest) -> Result<serde_json::Value, ControlError> {
        let _ = request;
        Err(ControlError::Conflict("this VM cannot migrate".into()))
    }
    /// `GET /vm/migrate`: the last migration job's progress, `{"state": "none"}` when there
    /// was none.
    fn migration_job(&self) -> serde_json::Value {
        serde_json::json!({"state": "none"})
    }
}

/// The body of `PUT /vm/migrate`: `{"to": "unix:/path" | "tcp:ADDR:PORT", "auth_key":
/// "/path/key", "max_downtime_ms": 300, "timeout_s": 120}` (the last two optional).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// Where the target (`vmhost receive`) listens.
    pub to: String,
    /// The pre-shared key file (absolute; read by the VM's process).
    pub auth_key: std::path::PathBuf,
    /// The longest pause accepted for the final round, in milliseconds (default 300).
    #[serde(default)]
    pub max_downtime_ms: Option<u64>,
    /// How long pre-copy may go on before the migration is cancelled, in seconds (default 120).
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

impl MigrateRequest {
    /// Parses the body (no other field; `to` must start with `unix:` or `tcp:`).
    pub fn from_json(body: &[u8]) -> Result<Self, String> {
        let r: MigrateRequest = serde_json::from_slice(body).map_err(|err| {
            format!(
                "the body must be {{\"to\": \"unix:/path\"|\"tcp:ADDR:PORT\", \"auth_key\": \"/path\", \
                 \"max_downtime_ms\": 300, \"timeout_s\": 120}}: {err}"
            )
        })?;
        if !(r.to.starts_with("unix:") || r.to.starts_with("tcp:")) {
            return Err(format!(
                "\"to\" is {:?}: give unix:/path or tcp:ADDR:PORT",
                r.to
            ));
        }
        Ok(r)
    }
}

/// The body of `PUT /vm/snapshot`: `{"dir": "/path/new-dir", "stop": false}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRequest {
    /// The snapshot directory to create (it must not exist).
    pub dir: std::path::PathBuf,
    /// End the VM after the snapshot (instead of resuming it).
    pub stop: bool,
}

impl SnapshotRequest {
    /// Parses the body: an object with a non-empty string `dir` and an optional boolean
    /// `stop`, no other field.
    pub fn from_json(body: &[u8]) -> Result<Self, String> {
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|err| format!("request body is not valid JSON: {err}"))?;
        let fields = value
            .as_object()
            .ok_or("the body must be a JSON object like {\"dir\": \"/path\", \"stop\": false}")?;
        if let Some(other) = fields
            .keys()
            .find(|k| !matches!(k.as_str(), "dir" | "stop"))
        {
            return Err(format!(
                "unknown field {other:?} in the body; it takes \"dir\" and \"stop\""
            ));
        }
        let dir = match fields.get("dir").and_then(|d| d.as_str()) {
            Some(d) if !d.is_empty() => std::path::PathBuf::from(d),
            _ => return Err("\"dir\" must be the path of a new directory (a string)".into()),
        };
        let stop = match fields.get("stop") {
            None => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(_) => return Err("\"stop\" must be true or false".into()),
        };
        Ok(SnapshotRequest { dir, stop })
    }
}

/// Why a [`VmControl`] action was not carried out.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The VM is in a state that does not allow the action ("already paused", "not running").
    /// Answered with 409 Conflict.
    #[error("{0}")]
    Conflict(String),
    /// The action was attempted and failed. Answered with 500 and the error chain.
    #[error("{action} failed")]
    Failed {
        /// What was attempted, e.g. "pausing vCPU 3".
        action: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl ControlError {
    /// The HTTP status this error is answered with.
    pub fn status(&self) -> u16 {
        match self {
            Self::Conflict(_) => 409,
            Self::Failed { .. } => 500,
        }
    }
}

/// Bounds that keep a misbehaving client from disturbing the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest accepted request body; a larger `Content-Length` gets 413. Default 64 KiB.
    pub max_body_bytes: usize,
    /// Largest accepted request head (request line and headers); more gets 431. Default 8 KiB.
    pub max_head_bytes: usize,
    /// Most connections served at once; one more gets 503 and is closed. Default 16.
    pub max_connections: usize,
    /// Time to receive a whole request, head and body; past it the answer is 408. Default 10 s.
    pub request_timeout: Duration,
    /// Time to write an answer before the connection is dropped. Default 10 s.
    pub write_timeout: Duration,
    /// On stop, how long connections in progress may finish before they are dropped.
    /// Default 2 s.
    pub stop_grace: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 64 * 1024,
            max_head_bytes: 8 * 1024,
            max_connections: 16,
            request_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            stop_grace: Duration::from_secs(2),
        }
    }
}
