//! The blocking client behind `vmhost ctl`: one request per connection over a std
//! [`UnixStream`], bounded in time and size, answer parsed by `httparse` and `serde_json`.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long [`request`] waits for a whole answer.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest answer accepted, head and body.
const MAX_RESPONSE_BYTES: usize = 16 * 1024 * 1024;

/// An answer from the API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiResponse {
    /// The HTTP status code.
    pub status: u16,
    /// The JSON body; for errors, `{"error": "..."}`.
    pub body: serde_json::Value,
}

impl ApiResponse {
    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The `error` field of an error answer.
    pub fn error_message(&self) -> Option<&str> {
        self.body.get("error").and_then(serde_json::Value::as_str)
    }
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The method or URI cannot be sent as given.
    #[error("invalid request {method:?} {uri:?}: {reason}")]
    InvalidRequest {
        /// The method given.
        method: String,
        /// The URI given.
        uri: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// Nothing is at the socket path.
    #[error(
        "no API socket at {}: is the VM running with --api-socket {}?",
        path.display(),
        path.display()
    )]
    NoSocket {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The socket exists but nobody listens (a stale socket).
    #[error(
        "nothing is serving the API socket {}: is the VM running with --api-socket {}?",
        path.display(),
        path.display()
    )]
    Refused {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Connecting failed otherwise (e.g. permission denied: the socket is mode 0600).
    #[error("cannot connect to the API socket {}", path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Sending the request or receiving the answer failed.
    #[error("cannot talk to the API socket {}", path.display())]
    Io {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// No complete answer within the timeout.
    #[error("no answer from the API socket {} within {timeout:?}", path.display())]
    Timeout {
        /// The socket path.
        path: PathBuf,
        /// The timeout.
        timeout: Duration,
    },
    /// The answer is not a well-formed HTTP response.
    #[error("malformed answer from the API socket {}: {reason}", path.display())]
    Malformed {
        /// The socket path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The answer's body is not JSON.
    #[error("the answer from the API socket {} is not JSON", path.display())]
    NotJson {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

/// Sends `method uri` (e.g. `GET /vm`, `PUT /vm/pause`) to the API socket at `socket` and waits
/// up to [`DEFAULT_CLIENT_TIMEOUT`] for the answer. Any status is an `Ok` answer; errors are
/// for when there is no answer.
///
/// ```no_run
/// let answer = vmhost_api::request("/run/vmhost/vm1.sock".as_ref(), "GET", "/vm")?;
/// println!("{} {:#}", answer.status, answer.body);
/// # Ok::<(), vmhost_api::ClientError>(())
/// ```
pub fn request(socket: &Path, method: &str, uri: &str) -> Result<ApiResponse, ClientError> {
    request_with_timeout(socket, method, uri, DEFAULT_CLIENT_TIMEOUT)
}

/// [`request`] with a timeout for the whole exchange.
pub fn request_with_timeout(
    socket: &Path,
    method: &str,
    uri: &str,
    timeout: Duration,
) -> Result<ApiResponse, ClientError> {
    request_with_body(socket, method, uri, None, timeout)
}

/// [`request_with_timeout`] with a JSON request body (e.g. `PUT /vm/snapshot`'s
/// `{"dir": ..., "stop": false}`).
pub fn request_with_body(
    socket: &Path,
    method: &str,
    uri: &str,
    body: Option<&serde_json::Value>,
    timeout: Duration,
) -> Result<ApiResponse, ClientError> {
    check_request(method, uri)?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let deadline = Instant::now() + timeout;
    let mut stream = connect(socket)?;
    let io_err = |source| ClientError::Io {
        path: socket.to_owned(),
        source,
    };
    stream.set_write_timeout(Some(timeout)).map_err(io_err)?;
    let length = if matches!(method, "GET" | "HEAD") && body.is_empty() {
        String::new()
    } else {
        let kind = if body.is_empty() {
            ""
        } else {
            "Content-Type: application/json\r\n"
        };
        format!("{kind}Content-Length: {}\r\n", body.len())
    };
    let head = format!(
        "{method} {uri} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Connection: close\r\n{length}\r\n{body}"
    );
    if let Err(err) = stream.write_all(head.as_bytes()) {
        // A server that answers at once (503) may close before reading: read its answer.
        if !matches!(
            err.kind(),
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
        ) {
            return Err(io_err(err));
        }
    }
    let raw = read_answer(&mut stream, deadline).map_err(|err| match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Timeout {
            path: socket.to_owned(),
            timeout,
        },
        _ => io_err(err),
    })?;
    parse_answer(&raw).map_err(|reason| match reason {
        Parsed::Malformed(reason) => ClientError::Malformed {
            path: socket.to_owned(),
            reason,
        },
        Parsed::NotJson(source) => ClientError::NotJson {
            path: socket.to_owned(),
            source,
        },
    })
}

/// Refuses methods and URIs that would break the request line.
fn check_request(method: &str, uri: &str) -> Result<(), ClientError> {
    let invalid = |reason| ClientError::InvalidRequest {
        method: method.to_owned(),
        uri: uri.to_owned(),
        reason,
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(invalid("the method must be upper-case letters, e.g. GET"));
    }
    if !uri.starts_with('/') || uri.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(invalid(
            "the URI must start with / and contain no spaces or controls",
        ));
    }
    Ok(())
}

/// Connects, telling a missing socket and a stale one apart from other failures.
fn connect(socket: &Path) -> Result<UnixStream, ClientError> {
    UnixStream::connect(socket).map_err(|source| {
        let path = socket.to_owned();
        match source.kind() {
            io::ErrorKind::NotFound => ClientError::NoSocket { path, source },
            io::ErrorKind::ConnectionRefused => ClientError::Refused { path, source },
            _ => ClientError::Connect { path, source },
        }
    })
}

/// Reads until the answer is complete by its `Content-Length`, or until the server closes.
fn read_answer(stream: &mut UnixStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut raw = Vec::with_capacity(4096);
    let mut chunk = [0u8; 8192];
    loop {
        if complete_length(&raw).is_some_and(|len| raw.len() >= len) {
            return Ok(raw);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut chunk) {
            Ok(0) => return Ok(raw),
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
            // A server closing with our request unread resets the connection after its answer.
            Err(err) if err.kind() == io::ErrorKind::ConnectionReset && !raw.is_empty() => {
                return Ok(raw)
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
        if raw.len() > MAX_RESPONSE_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("answer larger than {MAX_RESPONSE_BYTES} bytes"),
            ));
        }
    }
}

/// The full length (head and body) of the answer in `raw`, once its head is complete and
/// announces a `Content-Length`.
fn complete_length(raw: &[u8]) -> Option<usize> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(head_len) = response.parse(raw).ok()? else {
        return None;
    };
    let length = content_length(response.headers)?;
    head_len.checked_add(length)
}

/// The `Content-Length` header's value, if present and numeric.
fn content_length(headers: &[httparse::Header<'_>]) -> Option<usize> {
    let header = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))?;
    std::str::from_utf8(header.value).ok()?.trim().parse().ok()
}

/// Why an answer could not be parsed.
enum Parsed {
    Malformed(String),
    NotJson(serde_json::Error),
}

/// Parses a complete answer.
fn parse_answer(raw: &[u8]) -> Result<ApiResponse, Parsed> {
    if raw.is_empty() {
        return Err(Parsed::Malformed(
            "the server closed the connection without answering".to_owned(),
        ));
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let head_len = match response.parse(raw) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => {
            return Err(Parsed::Malformed(
                "the answer's head is incomplete".to_owned(),
            ))
        }
        Err(err) => return Err(Parsed::Malformed(format!("bad HTTP head: {err}"))),
    };
    let status = response.code.unwrap_or_default();
    let body = &raw[head_len..];
    let body = match content_length(response.headers) {
        Some(len) if len <= body.len() => &body[..len],
        Some(len) => {
            return Err(Parsed::Malformed(format!(
                "body of {} bytes, {len} announced",
                body.len()
            )))
        }
        None => body,
    };
    let body = serde_json::from_slice(body).map_err(Parsed::NotJson)?;
    Ok(ApiResponse { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_request_line_injection() {
        assert!(check_request("GET", "/vm").is_ok());
        for (method, uri) in [
            ("GET", "vm"),
            ("GET", "/vm HTTP/1.1\r\nX: y"),
            ("get", "/vm"),
            ("", "/vm"),
            ("G T", "/vm"),
        ] {
            assert!(check_request(method, uri).is_err(), "{method:?} {uri:?}");
        }
    }

    #[test]
    fn parses_answers() {
        let raw = b"HTTP/1.1 409 Conflict\r\nContent-Length: 19\r\n\r\n{\"error\":\"paused\"}\nXX";
        let answer = parse_answer(raw).ok().expect("parsed");
        assert_eq!(answer.status, 409);
        assert_eq!(answer.error_message(), Some("paused"));
        assert!(!answer.is_success());
        assert!(matches!(
            parse_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno"),
            Err(Parsed::NotJson(_))
        ));
        assert!(matches!(
            parse_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}"),
            Err(Parsed::Malformed(_))
        ));
        assert!(matches!(parse_answer(b""), Err(Parsed::Malformed(_))));
    }
}
