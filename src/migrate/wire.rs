//! The migration's transport: `unix:PATH` or `tcp:ADDR:PORT` endpoints, the listener of
//! `vmhost receive` (a Unix socket created 0600 before it has a name; TCP bound to the given
//! address only), and [`Channel`], an authenticated container in each direction over one
//! connection (`auth::handshake` first, then every record MAC'd).

use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use vmhost_persist::auth::{handshake, AuthKey, Role};
use vmhost_persist::container::{Reader, Record, RecordKind, Writer};

/// Where a target listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A Unix socket path.
    Unix(PathBuf),
    /// `ADDR:PORT` (IPv4, `[IPv6]`, or a host name).
    Tcp(String),
}

impl std::str::FromStr for Endpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:").filter(|p| !p.is_empty()) {
            return Ok(Endpoint::Unix(PathBuf::from(p)));
        }
        if let Some(a) = s.strip_prefix("tcp:").filter(|a| a.contains(':')) {
            return Ok(Endpoint::Tcp(a.to_string()));
        }
        Err(format!(
            "{s:?} is not an endpoint: give unix:/path/to/socket or tcp:ADDR:PORT"
        ))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// The socket of one connection.
#[derive(Debug)]
enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// One connection; clones share the socket (no `dup`: the sender's syscall filter has no
/// `fcntl(F_DUPFD)`).
#[derive(Debug, Clone)]
pub struct Stream(Arc<Socket>);

impl Stream {
    /// Connects to `to`.
    pub fn connect(to: &Endpoint) -> Result<Stream> {
        let socket = match to {
            Endpoint::Unix(p) => {
                Socket::Unix(UnixStream::connect(p).with_context(|| format!("connecting to {to}"))?)
            }
            Endpoint::Tcp(a) => {
                let s = TcpStream::connect(a).with_context(|| format!("connecting to {to}"))?;
                s.set_nodelay(true).context("setting TCP_NODELAY")?;
                Socket::Tcp(s)
            }
        };
        Ok(Stream(Arc::new(socket)))
    }

    /// Makes a read or a write that waits longer than `timeout` fail (a peer that hangs
    /// without closing the connection).
    pub fn set_timeouts(&self, timeout: std::time::Duration) -> Result<()> {
        let t = Some(timeout);
        match &*self.0 {
            Socket::Unix(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
            Socket::Tcp(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
        }
        .context("setting the connection's timeouts")
    }

    /// Closes both directions (the peer's reads end).
    pub fn shutdown(&self) {
        let _ = match &*self.0 {
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &*self.0 {
            Socket::Unix(s) => (&*s).read(buf),
            Socket::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &*self.0 {
            Socket::Unix(s) => (&*s).write(buf),
            Socket::Tcp(s) => (&*s).write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        match &*self.0 {
            Socket::Unix(s) => (&*s).write_vectored(bufs),
            Socket::Tcp(s) => (&*s).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The listener of `vmhost receive`; a Unix socket's file is removed when it is dropped.
pub enum Listener {
    /// A Unix socket (mode 0600) and its path.
    Unix(UnixListener, PathBuf),
    /// A TCP socket bound to the given address only.
    Tcp(TcpListener),
}

impl Listener {
    /// Listens on `at`. An existing file at a Unix socket path is refused (never replaced).
    pub fn bind(at: &Endpoint) -> Result<Listener> {
        match at {
            Endpoint::Unix(p) => {
                let l = vmhost_api::bind_unix_0600(p)
                    .with_context(|| format!("listening on {at} (remove a stale socket first)"))?;
                Ok(Listener::Unix(l, p.clone()))
            }
            Endpoint::Tcp(a) => Ok(Listener::Tcp(
                TcpListener::bind(a).with_context(|| format!("listening on {at}"))?,
            )),
        }
    }

    /// Makes [`Listener::accept`] fail after `timeout` without a connection.
    pub fn set_accept_timeout(&self, timeout: std::time::Duration) -> Result<()> {
        use std::os::fd::AsFd;
        let fd = match self {
            Listener::Unix(l, _) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        };
        crate::sys::set_accept_timeout(fd, timeout).context("setting the accept timeout")
    }

    /// Waits for the next connection; the peer's address for the log.
    pub fn accept(&self) -> Result<(Stream, String)> {
        match self {
            Listener::Unix(l, p) => {
                let (s, _) = l.accept().context("accepting a connection")?;
                Ok((
                    Stream(Arc::new(Socket::Unix(s))),
                    format!("unix:{}", p.display()),
                ))
            }
            Listener::Tcp(l) => {
                let (s, peer) = l.accept().context("accepting a connection")?;
                s.set_nodelay(true).context("setting TCP_NODELAY")?;
                Ok((Stream(Arc::new(Socket::Tcp(s))), format!("tcp:{peer}")))
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// An authenticated container each way over one connection.
pub struct Channel {
    tx: Writer<Stream>,
    rx: Reader<BufReader<Stream>>,
    raw: Stream,
}

impl Channel {
    /// Runs the handshake as `role` with `key`, then opens the containers (each side writes
    /// its header before reading the peer's). A peer without the key fails here, before any
    /// record is read.
    pub fn open(
        mut stream: Stream,
        key: &AuthKey,
        role: Role,
        reads: &[RecordKind],
    ) -> Result<Self> {
        let session = handshake(&mut stream, key, role).context("authenticating the peer")?;
        let (raw, input) = (stream.clone(), stream.clone());
        let tx = Writer::authenticated(stream, env!("CARGO_PKG_VERSION"), session.send)
            .context("opening the stream to the peer")?;
        let rx = Reader::authenticated(BufReader::new(input), reads, session.recv)
            .context("reading the peer's stream header")?;
        Ok(Channel { tx, rx, raw })
    }

    /// The sending container (page runs are written on it directly).
    pub fn writer(&mut self) -> &mut Writer<Stream> {
        &mut self.tx
    }

    /// Sends one record.
    pub fn send(&mut self, kind: RecordKind, payload: &[u8]) -> Result<()> {
        self.tx
            .write_record(kind, payload)
            .with_context(|| format!("sending the {kind} record"))
    }

    /// The next record; a stream that ends is an error naming `waiting_for`.
    pub fn recv(&mut self, waiting_for: &str) -> Result<Record> {
        match self.rx.next_record() {
            Ok(Some(r)) => Ok(r),
            Ok(None) => bail!("the peer ended the stream while we waited for {waiting_for}"),
            Err(e) => Err(anyhow::Error::new(e))
                .with_context(|| format!("reading the peer's stream (waiting for {waiting_for})")),
        }
    }

    /// Gives a received record's payload buffer back for the next record
    /// ([`Reader::recycle`]).
    pub fn recycle(&mut self, payload: Vec<u8>) {
        self.rx.recycle(payload);
    }

    /// The connection, to close it from another thread ([`Stream::shutdown`]).
    pub fn stream(&self) -> Stream {
        self.raw.clone()
    }

    /// Closes the connection both ways.
    pub fn close(&self) {
        self.raw.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::Endpoint;

    #[test]
    fn endpoints_parse_and_bad_ones_are_named() {
        assert_eq!(
            "unix:/tmp/x".parse::<Endpoint>(),
            Ok(Endpoint::Unix("/tmp/x".into()))
        );
        assert_eq!(
            "tcp:127.0.0.1:4444".parse::<Endpoint>(),
            Ok(Endpoint::Tcp("127.0.0.1:4444".into()))
        );
        for bad in ["unix:", "tcp:1234", "/tmp/x", "http://a"] {
            assert!(bad.parse::<Endpoint>().unwrap_err().contains(bad));
        }
    }
}
