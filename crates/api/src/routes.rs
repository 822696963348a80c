//! Routing a well-formed request to [`VmControl`]: path (404), method (405), body (400), then
//! the call itself (200, 409, 500), with panics in the implementation caught.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::http::{Request, Response};
use crate::{ControlError, VmControl};

/// What a route does.
#[derive(Debug, Clone, Copy)]
enum Action {
    Info,
    Placement,
    Resources,
    Pause,
    Resume,
    Shutdown,
    StartSnapshot,
    SnapshotJob,
    StartMigration,
    MigrationJob,
}

/// A job request parsed from a body.
enum Job {
    Snapshot(crate::SnapshotRequest),
    Migrate(crate::MigrateRequest),
}

/// Every route: path, the one method it accepts, and its action.
const ROUTES: &[(&str, &str, Action)] = &[
    ("/vm", "GET", Action::Info),
    ("/vm/placement", "GET", Action::Placement),
    ("/vm/resources", "GET", Action::Resources),
    ("/vm/pause", "PUT", Action::Pause),
    ("/vm/resume", "PUT", Action::Resume),
    ("/vm/shutdown", "PUT", Action::Shutdown),
    ("/vm/snapshot", "PUT", Action::StartSnapshot),
    ("/vm/snapshot", "GET", Action::SnapshotJob),
    ("/vm/migrate", "PUT", Action::StartMigration),
    ("/vm/migrate", "GET", Action::MigrationJob),
];

/// Answers one request.
pub(crate) fn route(request: &Request, control: &dyn VmControl) -> Response {
    let on_path = ROUTES.iter().filter(|(path, ..)| *path == request.path);
    let mut found = None;
    for &(path, method, action) in on_path.clone() {
        if found.is_none() || method == request.method {
            found = Some((path, method, action));
        }
    }
    let Some((path, method, action)) = found else {
        let known: Vec<String> = ROUTES.iter().map(|(p, m, _)| format!("{m} {p}")).collect();
        return Response::error(
            404,
            format!(
                "no such path {:?}; the API has {}",
                request.path,
                known.join(", ")
            ),
        );
    };
    if request.method != method {
        let allowed: Vec<&str> = on_path.map(|(_, m, _)| *m).collect();
        let mut response = Response::error(
            405,
            format!(
                "method {} is not allowed on {path}; use {}",
                request.method,
                allowed.join(" or ")
            ),
        );
        response.allow = Some(if allowed.len() > 1 {
            "GET, PUT"
        } else {
            method
        });
        return response;
    }
    let job = match action {
        Action::StartSnapshot => match crate::SnapshotRequest::from_json(&request.body) {
            Ok(r) => Some(Job::Snapshot(r)),
            Err(message) => return Response::error(400, message),
        },
        Action::StartMigration => match crate::MigrateRequest::from_json(&request.body) {
            Ok(r) => Some(Job::Migrate(r)),
            Err(message) => return Response::error(400, message),
        },
        _ => None,
    };
    if job.is_none() {
        if let Err(message) = check_body(&request.body) {
            return Response::error(400, message);
        }
    }
    match catch_unwind(AssertUnwindSafe(|| call(control, action, job))) {
        Ok(Ok(body)) if matches!(action, Action::StartSnapshot | Action::StartMigration) => {
            let mut r = Response::ok(body);
            r.status = 202;
            r
        }
        Ok(Ok(body)) => Response::ok(body),
        Ok(Err(err)) => Response::error(err.status(), error_chain(&err)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            tracing::error!(path, panic = %what, "VmControl panicked");
            Response::error(500, format!("internal error while serving {method} {path}"))
        }
    }
}

/// Calls the action's [`VmControl`] method.
fn call(
    control: &dyn VmControl,
    action: Action,
    job: Option<Job>,
) -> Result<serde_json::Value, ControlError> {
    match (action, job) {
        (Action::StartSnapshot, Some(Job::Snapshot(r))) => control.start_snapshot(r),
        (Action::StartMigration, Some(Job::Migrate(r))) => control.start_migration(r),
        (Action::StartSnapshot | Action::StartMigration, _) => {
            Err(ControlError::Conflict("no job request".into()))
        }
        (action, _) => call_plain(control, action),
    }
}

/// Calls the [`VmControl`] method of an action without a request body.
fn call_plain(control: &dyn VmControl, action: Action) -> Result<serde_json::Value, ControlError> {
    match action {
        Action::SnapshotJob => Ok(control.snapshot_job()),
        Action::MigrationJob => Ok(control.migration_job()),
        Action::StartSnapshot | Action::StartMigration => {
            Err(ControlError::Conflict("no job request".into()))
        }
        Action::Info => Ok(control.info()),
        Action::Placement => Ok(control.placement()),
        Action::Resources => Ok(control.resources()),
        Action::Pause => control.pause(),
        Action::Resume => control.resume(),
        Action::Shutdown => control.shutdown(),
    }
}

/// A body must be absent, empty (whitespace) or the JSON object `{}`.
fn check_body(body: &[u8]) -> Result<(), String> {
    if body.trim_ascii().is_empty() {
        return Ok(());
    }
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|err| format!("request body is not valid JSON: {err}"))?;
    match value.as_object() {
        Some(fields) if fields.is_empty() => Ok(()),
        Some(fields) => {
            let names: Vec<&str> = fields.keys().map(String::as_str).collect();
            Err(format!(
                "unknown field(s) in request body: {}; the body must be empty or {{}}",
                names.join(", ")
            ))
        }
        None => Err("request body must be empty or the JSON object {}".to_owned()),
    }
}

/// The error and its causes, `: `-separated.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies() {
        for ok in [&b""[..], b"  \r\n", b"{}", b" { } "] {
            assert!(check_body(ok).is_ok(), "{ok:?}");
        }
        for bad in [&b"{"[..], b"[]", b"null", b"{\"force\":true}", b"\xff"] {
            assert!(check_body(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn snapshot_bodies() {
        let r = crate::SnapshotRequest::from_json(br#"{"dir": "/s/1", "stop": true}"#).unwrap();
        assert_eq!((r.dir.to_str(), r.stop), (Some("/s/1"), true));
        let r = crate::SnapshotRequest::from_json(br#"{"dir": "/s/1"}"#).unwrap();
        assert!(!r.stop);
        for bad in [
            &b"{}"[..],
            br#"{"dir": ""}"#,
            br#"{"dir": 3}"#,
            br#"{"dir": "/a", "stop": "yes"}"#,
            br#"{"dir": "/a", "force": true}"#,
            b"[]",
        ] {
            assert!(crate::SnapshotRequest::from_json(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn chain_is_joined() {
        let err = ControlError::Failed {
            action: "pausing vCPU 3".to_owned(),
            source: "KVM_RUN interrupted".into(),
        };
        assert_eq!(
            error_chain(&err),
            "pausing vCPU 3 failed: KVM_RUN interrupted"
        );
        assert_eq!(err.status(), 500);
    }
}
