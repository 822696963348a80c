//! The small HTTP/1.1 subset the server speaks: read one request (head parsed by `httparse`,
//! bounded head and body, `Content-Length` bodies only), and encode one JSON response that
//! closes the connection.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::ServerLimits;

/// Most headers accepted in a request; more get 431.
const MAX_HEADERS: usize = 32;

/// One received request.
#[derive(Debug)]
pub(crate) struct Request {
    /// The method, e.g. `GET`.
    pub(crate) method: String,
    /// The request target without its query string.
    pub(crate) path: String,
    /// The body, at most [`ServerLimits::max_body_bytes`] long.
    pub(crate) body: Vec<u8>,
}

/// Why a request was not read; each maps to a 4xx answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// `httparse` rejected the request head.
    #[error("malformed request: {0}")]
    Malformed(httparse::Error),
    /// The head grew past the limit before it was complete.
    #[error("request head larger than {limit} bytes")]
    HeadTooLarge {
        /// [`ServerLimits::max_head_bytes`].
        limit: usize,
    },
    /// More than [`MAX_HEADERS`] headers.
    #[error("more than {MAX_HEADERS} request headers")]
    TooManyHeaders,
    /// A `Content-Length` that is not a number, or several that disagree.
    #[error("invalid Content-Length header")]
    BadContentLength,
    /// A `Transfer-Encoding` header: only `Content-Length` bodies are accepted.
    #[error("Transfer-Encoding is not supported; send the body with Content-Length")]
    TransferEncoding,
    /// The announced body is larger than the limit.
    #[error("request body of {length} bytes is larger than the limit of {limit} bytes")]
    BodyTooLarge {
        /// The announced length.
        length: u64,
        /// [`ServerLimits::max_body_bytes`].
        limit: usize,
    },
    /// The client closed the connection in the middle of the request.
    #[error("connection closed before the request was complete")]
    Truncated,
    /// Reading from the socket failed.
    #[error("cannot read the request")]
    Read(#[source] std::io::Error),
}

impl RequestError {
    /// The status this error is answered with.
    pub(crate) fn status(&self) -> u16 {
        match self {
            Self::Malformed(_) | Self::BadContentLength | Self::Truncated | Self::Read(_) => 400,
            Self::HeadTooLarge { .. } | Self::TooManyHeaders => 431,
            Self::TransferEncoding => 411,
            Self::BodyTooLarge { .. } => 413,
        }
    }
}

/// The parts of a complete request head the server uses.
struct Head {
    method: String,
    path: String,
    head_len: usize,
    content_length: u64,
    expect_continue: bool,
}

/// Reads one request. `Ok(None)` when the client closed the connection before sending a byte
/// (as a liveness probe does).
pub(crate) async fn read_request<S>(
    stream: &mut S,
    limits: &ServerLimits,
) -> Result<Option<Request>, RequestError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf = Vec::with_capacity(1024);
    let head = loop {
        if let Some(head) = parse_head(&buf, limits)? {
            break head;
        }
        if buf.len() >= limits.max_head_bytes {
            return Err(RequestError::HeadTooLarge {
                limit: limits.max_head_bytes,
            });
        }
        let want = (limits.max_head_bytes - buf.len()).min(4096);
        let start = buf.len();
        buf.resize(start + want, 0);
        let n = stream
            .read(&mut buf[start..])
            .await
            .map_err(RequestError::Read)?;
        buf.truncate(start + n);
        if n == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(RequestError::Truncated)
            };
        }
    };

    // `parse_head` bounded the length by `max_body_bytes`, so it fits in usize.
    let length =
        usize::try_from(head.content_length).map_err(|_| RequestError::BadContentLength)?;
    let mut body = buf.split_off(head.head_len);
    body.truncate(length); // bytes past the body (pipelining) are ignored: one request each
    if body.len() < length {
        if head.expect_continue {
            stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await
                .map_err(RequestError::Read)?;
        }
        let start = body.len();
        body.resize(length, 0);
        stream
            .read_exact(&mut body[start..])
            .await
            .map_err(|err| match err.kind() {
                std::io::ErrorKind::UnexpectedEof => RequestError::Truncated,
                _ => RequestError::Read(err),
            })?;
    }
    Ok(Some(Request {
        method: head.method,
        path: head.path,
        body,
    }))
}

/// Parses the head in `buf`: `Ok(None)` while it is incomplete.
fn parse_head(buf: &[u8], limits: &ServerLimits) -> Result<Option<Head>, RequestError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(RequestError::TooManyHeaders),
        Err(err) => return Err(RequestError::Malformed(err)),
    };
    let mut content_length: Option<u64> = None;
    let mut expect_continue = false;
    for header in req.headers.iter() {
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(RequestError::TransferEncoding);
        } else if header.name.eq_ignore_ascii_case("content-length") {
            let value = parse_content_length(header.value)?;
            if content_length.is_some_and(|seen| seen != value) {
                return Err(RequestError::BadContentLength);
            }
            content_length = Some(value);
        } else if header.name.eq_ignore_ascii_case("expect") {
            expect_continue = header.value.eq_ignore_ascii_case(b"100-continue");
        }
    }
    let content_length = content_length.unwrap_or(0);
    if content_length > limits.max_body_bytes as u64 {
        return Err(RequestError::BodyTooLarge {
            length: content_length,
            limit: limits.max_body_bytes,
        });
    }
    // A complete parse always has a method and a path.
    let target = req.path.unwrap_or_default();
    let path = target.split_once('?').map_or(target, |(path, _query)| path);
    Ok(Some(Head {
        method: req.method.unwrap_or_default().to_owned(),
        path: path.to_owned(),
        head_len,
        content_length,
        expect_continue,
    }))
}

/// A `Content-Length` value: ASCII digits only (no sign, no spaces inside), at most 19 of them.
fn parse_content_length(value: &[u8]) -> Result<u64, RequestError> {
    let value = value.trim_ascii();
    if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
        return Err(RequestError::BadContentLength);
    }
    value
        .iter()
        .try_fold(0u64, |acc, digit| {
            acc.checked_mul(10)?.checked_add(u64::from(digit - b'0'))
        })
        .ok_or(RequestError::BadContentLength)
}

/// One JSON response; every response closes the connection.
#[derive(Debug)]
pub(crate) struct Response {
    /// The status code.
    pub(crate) status: u16,
    /// The JSON body.
    pub(crate) body: serde_json::Value,
    /// The `Allow` header, for 405.
    pub(crate) allow: Option<&'static str>,
}

impl Response {
    /// A 200 answer.
    pub(crate) fn ok(body: serde_json::Value) -> Self {
        Self {
            status: 200,
            body,
            allow: None,
        }
    }

    /// An error answer with body `{"error": message}`.
    pub(crate) fn error(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            body: serde_json::json!({ "error": message.into() }),
            allow: None,
        }
    }

    /// The bytes on the wire: status line, headers, JSON body and a newline.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = self.body.to_string().into_bytes();
        body.push(b'\n');
        let allow = self
            .allow
            .map(|methods| format!("Allow: {methods}\r\n"))
            .unwrap_or_default();
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\nCache-Control: no-store\r\n{allow}\r\n",
            self.status,
            reason(self.status),
            body.len(),
        )
        .into_bytes();
        out.extend_from_slice(&body);
        out
    }
}

/// The reason phrase of the status codes the server sends.
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ServerLimits {
        ServerLimits {
            max_head_bytes: 256,
            max_body_bytes: 16,
            ..ServerLimits::default()
        }
    }

    #[test]
    fn content_length_digits_only() {
        assert_eq!(parse_content_length(b" 42 ").ok(), Some(42));
        for bad in [
            &b""[..],
            b"-1",
            b"+1",
            b"1 2",
            b"0x10",
            b"99999999999999999999",
        ] {
            assert!(parse_content_length(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn head_parse_statuses() {
        let l = limits();
        assert!(matches!(parse_head(b"GET /vm HTTP/1.1\r\n", &l), Ok(None)));
        let head = parse_head(
            b"PUT /vm/pause?x=1 HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
            &l,
        );
        let head = head.ok().flatten().expect("complete head");
        assert_eq!((head.path.as_str(), head.content_length), ("/vm/pause", 2));
        let status = |raw: &[u8]| parse_head(raw, &l).err().map(|e| e.status());
        assert_eq!(status(b"\x00\x01garbage\r\n\r\n"), Some(400));
        assert_eq!(
            status(b"GET /vm HTTP/1.1\r\nContent-Length: 99\r\n\r\n"),
            Some(413)
        );
        assert_eq!(
            status(b"GET /vm HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
            Some(400)
        );
        assert_eq!(
            status(b"PUT /vm HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Some(411)
        );
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "a: b\r\n".repeat(MAX_HEADERS + 1)
        );
        assert_eq!(status(many.as_bytes()), Some(431));
    }

    #[test]
    fn response_encoding() {
        let mut response = Response::error(405, "no");
        response.allow = Some("GET");
        let text = String::from_utf8(response.encode()).expect("utf-8");
        assert!(
            text.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"),
            "{text}"
        );
        assert!(text.contains("\r\nAllow: GET\r\n"), "{text}");
        assert!(text.contains("Content-Length: 15\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\n{\"error\":\"no\"}\n"), "{text}");
    }
}
