//! The host side of vmhost's vsock, Firecracker's "hybrid vsock": a Unix socket instead of the
//! kernel's AF_VSOCK.
//!
//! - Host → guest: a program connects to the Unix socket at `path` and writes
//!   `CONNECT <port>\n`; vmhost sends the guest a REQUEST to `<port>` from a fresh host port,
//!   and on the guest's RESPONSE writes `OK <host port>\n` to the program. Bytes then flow
//!   both ways. A refused connection (guest RST) closes the program's stream.
//! - Guest → host: a guest connection to CID 2, port `P` connects to the Unix socket
//!   `<path>_P`, where a host program listens; no listener there means RST.
//!
//! Every Unix stream is non-blocking and registered (edge-triggered) with one epoll instance,
//! whose fd the I/O thread watches for the device ([`Backend::poll_fd`]): any host activity
//! makes it process the receive queue, which calls [`Backend::pump`] and then hands out
//! packets with [`Backend::next_rx`]. Work that the transmit queue creates (a RESPONSE, an
//! RST) is announced through the same epoll with an eventfd ([`Backend::kick`]).

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use tracing::{debug, warn};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::conn::{ConnError, Connection, FromHost, State};
use super::packet::{Header, Op, HOST_CID, TYPE_STREAM};
use crate::sys::{self, unix_connect_nonblocking, unix_listen_with_mode};

/// Most connections (open or being opened) at a time; more are refused.
pub const MAX_CONNECTIONS: usize = 256;
/// Most control packets waiting for guest receive buffers; more are dropped (and logged).
pub const MAX_CONTROL: usize = 1024;
/// Longest `CONNECT <port>\n` line.
const MAX_LINE: usize = 32;
/// First host port given to host-initiated connections (as Firecracker does).
const FIRST_HOST_PORT: u32 = 1 << 30;
const TAG_LISTENER: u64 = 0;
const TAG_KICK: u64 = 1;
const TAG_STREAM: u64 = 2;

/// Why the Unix socket could not be set up (host errors).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Another process listens on the path.
    #[error("{0} is in use: another process listens on it; stop that process (another VM?) or choose another devices.vsock.socket")]
    InUse(PathBuf),
    /// Something other than a socket is at the path.
    #[error("{0} exists and is not a socket; remove it or choose another devices.vsock.socket")]
    NotASocket(PathBuf),
    /// bind(2) or listen(2) failed.
    #[error("cannot listen on vsock socket {path}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// epoll or eventfd setup failed.
    #[error("cannot set up the vsock event loop")]
    Events(#[source] io::Error),
}

/// A host connection still sending its `CONNECT <port>\n` line.
#[derive(Debug)]
struct Greeting {
    stream: UnixStream,
    line: Vec<u8>,
}

/// The Unix-socket side of the device: listener, connections, packets for the guest.
#[derive(Debug)]
pub struct Backend {
    cid: u64,
    path: PathBuf,
    listener: UnixListener,
    epoll: Epoll,
    kick: EventFd,
    greetings: Vec<Greeting>,
    conns: BTreeMap<(u32, u32), Connection>,
    control: VecDeque<Header>,
    next_port: u32,
    last_served: (u32, u32),
    drop_logged: bool,
    /// Guest connections refused because `<path>_<port>` was not our socket.
    foreign_refused: u64,
    /// This process's effective uid, read once here: the I/O thread's seccomp filter has no
    /// `geteuid`.
    euid: u32,
}

impl Backend {
    /// Listens on `path` for guest `cid`. A stale socket (nobody listening) is replaced; a live
    /// one or a non-socket file is refused.
    pub fn new(cid: u64, path: &Path) -> Result<Self, BackendError> {
        let listener = listen(path)?;
        let epoll = Epoll::new().map_err(BackendError::Events)?;
        let kick = EventFd::new(EFD_NONBLOCK).map_err(BackendError::Events)?;
        let backend = Backend {
            cid,
            path: path.to_path_buf(),
            listener,
            epoll,
            kick,
            greetings: Vec::new(),
            conns: BTreeMap::new(),
            control: VecDeque::new(),
            next_port: FIRST_HOST_PORT,
            last_served: (0, 0),
            drop_logged: false,
            foreign_refused: 0,
            euid: sys::euid(),
        };
        backend
            .watch(backend.listener.as_raw_fd(), TAG_LISTENER)
            .and_then(|()| backend.watch(backend.kick.as_raw_fd(), TAG_KICK))
            .map_err(BackendError::Events)?;
        Ok(backend)
    }

    fn watch(&self, fd: RawFd, tag: u64) -> io::Result<()> {
        let events =
            EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, tag))
    }

    /// The fd that becomes readable when the backend has work (an epoll fd).
    pub fn poll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// The Unix socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Announces work for the receive queue (made while serving the transmit queue).
    pub fn kick(&self) {
        if let Err(e) = self.kick.write(1) {
            warn!(error = %e, "vsock: cannot signal the receive path");
        }
    }

    /// Forgets every connection (device reset); the listener stays.
    pub fn reset(&mut self) {
        self.greetings.clear();
        self.conns.clear();
        self.control.clear();
    }

    /// Takes in host activity: new connections, CONNECT lines, queued bytes the host streams
    /// now accept.
    pub fn pump(&mut self) {
        self.drain_events();
        self.accept();
        self.read_greetings();
        let keys: Vec<_> = self.conns.keys().copied().collect();
        for key in keys {
            self.flush(key);
        }
    }

    fn drain_events(&mut self) {
        let mut events = [EpollEvent::default(); 32];
        while let Ok(n) = self.epoll.wait(0, &mut events) {
            if n < events.len() {
                break;
            }
        }
        // EAGAIN when it was not written.
        let _ = self.kick.read();
    }

    fn accept(&mut self) {
        loop {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    if e.kind() != io::ErrorKind::WouldBlock {
                        debug!(error = %e, "vsock: accept failed");
                    }
                    return;
                }
            };
            if self.at_connection_limit() {
                debug!("vsock: connection limit reached; closing a new host connection");
                continue;
            }
            let watched = stream
                .set_nonblocking(true)
                .and_then(|()| self.watch(stream.as_raw_fd(), TAG_STREAM));
            if let Err(e) = watched {
                debug!(error = %e, "vsock: cannot watch a new host connection");
                continue;
            }
            self.greetings.push(Greeting {
                stream,
                line: Vec::new(),
            });
        }
    }

    /// Reads CONNECT lines byte by byte (what follows the newline is the connection's data).
    fn read_greetings(&mut self) {
        let mut i = 0;
        while i < self.greetings.len() {
            match read_line(&mut self.greetings[i]) {
                Ok(Some(port)) => {
                    let g = self.greetings.swap_remove(i);
                    self.connect_guest(g.stream, port);
                }
                Ok(None) => i += 1,
                Err(why) => {
                    debug!("vsock: closing a host connection: {why}");
                    self.greetings.swap_remove(i);
                }
            }
        }
    }

    fn connect_guest(&mut self, stream: UnixStream, port: u32) {
        if self.at_connection_limit() {
            debug!("vsock: connection limit reached; closing a host connection");
            return;
        }
        let local = self.free_port();
        let mut conn = Connection::new(stream, local, port, State::Connecting);
        let hdr = conn.header(self.cid, Op::Request);
        self.conns.insert((local, port), conn);
        self.push_control(hdr);
    }

    fn free_port(&mut self) -> u32 {
        loop {
            let port = self.next_port;
            self.next_port = match self.next_port.checked_add(1) {
                Some(p) => p,
                None => FIRST_HOST_PORT,
            };
            if !self.conns.keys().any(|&(local, _)| local == port) {
                return port;
            }
        }
    }

    fn push_control(&mut self, hdr: Header) {
        if self.control.len() >= MAX_CONTROL {
            if !self.drop_logged {
                self.drop_logged = true;
                warn!("vsock: the guest does not take control packets; dropping them");
            }
            return;
        }
        self.control.push_back(hdr);
    }

    /// An RST answering guest packet `hdr`.
    fn rst_for(&self, hdr: &Header) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: hdr.dst_port,
            dst_port: hdr.src_port,
            len: 0,
            kind: TYPE_STREAM,
            op: Op::Rst as u16,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        }
    }

    /// Resets the connection of guest packet `hdr` (a protocol error): RST to the guest, the
    /// host stream closed. An RST is never answered.
    pub fn refuse(&mut self, hdr: &Header) {
        self.conns.remove(&(hdr.dst_port, hdr.src_port));
        if Op::from_wire(hdr.op) != Some(Op::Rst) {
            let rst = self.rst_for(hdr);
            self.push_control(rst);
        }
    }

    fn reset_conn(&mut self, key: (u32, u32), why: &ConnError) {
        debug!(
            local = key.0,
            peer = key.1,
            "vsock: resetting a connection: {why}"
        );
        if let Some(mut conn) = self.conns.remove(&key) {
            let rst = conn.header(self.cid, Op::Rst);
            self.push_control(rst);
        }
    }

    /// A checked guest packet of operation `op` with `payload`.
    pub fn from_guest(&mut self, hdr: &Header, op: Op, payload: &[u8]) {
        let key = (hdr.dst_port, hdr.src_port);
        match op {
            Op::Rst => {
                self.conns.remove(&key);
                return;
            }
            Op::Request => return self.guest_connect(hdr),
            _ => {}
        }
        let cid = self.cid;
        let Some(conn) = self.conns.get_mut(&key) else {
            let rst = self.rst_for(hdr);
            return self.push_control(rst);
        };
        conn.update_peer_credit(hdr);
        let result = match op {
            Op::Response if conn.state == State::Connecting => {
                conn.state = State::Established;
                let line = format!("OK {}\n", conn.local_port);
                conn.stream()
                    .write_all(line.as_bytes())
                    .map_err(|source| ConnError::Stream {
                        op: "write",
                        source,
                    })
            }
            Op::Rw => conn.from_guest(payload),
            Op::Shutdown => {
                conn.shutdown_from_guest(hdr.flags);
                Ok(())
            }
            Op::CreditUpdate => Ok(()),
            Op::CreditRequest => {
                let upd = conn.header(cid, Op::CreditUpdate);
                self.push_control(upd);
                Ok(())
            }
            other => Err(ConnError::UnexpectedOp {
                op: other,
                state: conn.state,
            }),
        };
        match result {
            Ok(()) => self.flush(key),
            Err(e) => self.reset_conn(key, &e),
        }
    }

    /// Whether the connections, open or being opened, and the host connections still sending
    /// their CONNECT line reach [`MAX_CONNECTIONS`].
    fn at_connection_limit(&self) -> bool {
        self.conns.len() + self.greetings.len() >= MAX_CONNECTIONS
    }

    /// A guest REQUEST to host port `dst_port`: connect to `<path>_<dst_port>`, when that is
    /// a socket of this process's user (another user's listener never gets guest data).
    fn guest_connect(&mut self, hdr: &Header) {
        let key = (hdr.dst_port, hdr.src_port);
        if self.conns.contains_key(&key) || self.at_connection_limit() {
            return self.refuse(hdr);
        }
        let mut target = self.path.clone().into_os_string();
        target.push(format!("_{}", hdr.dst_port));
        if let Some(why) = foreign_listener(Path::new(&target), self.euid) {
            // Counted, and logged at the 1st, 2nd, 4th, 8th… refusal: a guest retrying in a
            // loop cannot flood the log.
            self.foreign_refused += 1;
            if self.foreign_refused.is_power_of_two() {
                warn!(
                    path = %Path::new(&target).display(),
                    refused = self.foreign_refused,
                    "vsock: not forwarding a guest connection: {why}"
                );
            }
            return self.refuse(hdr);
        }
        let stream = unix_connect_nonblocking(Path::new(&target))
            .and_then(|s| self.watch(s.as_raw_fd(), TAG_STREAM).map(|()| s));
        match stream {
            Ok(stream) => {
                let mut conn =
                    Connection::new(stream, hdr.dst_port, hdr.src_port, State::Established);
                conn.update_peer_credit(hdr);
                let resp = conn.header(self.cid, Op::Response);
                self.conns.insert(key, conn);
                self.push_control(resp);
            }
            Err(e) => {
                debug!(port = hdr.dst_port, error = %e, "vsock: no host listener; refusing");
                self.refuse(hdr);
            }
        }
    }

    /// Writes queued guest bytes of `key` to its host stream; sends the guest a credit update
    /// when due; ends a connection the guest shut down completely.
    fn flush(&mut self, key: (u32, u32)) {
        let cid = self.cid;
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if let Err(e) = conn.flush() {
            return self.reset_conn(key, &e);
        }
        if conn.finished() {
            let rst = conn.header(cid, Op::Rst);
            self.conns.remove(&key);
            return self.push_control(rst);
        }
        if conn.credit_update_due() {
            let upd = conn.header(cid, Op::CreditUpdate);
            self.push_control(upd);
        }
    }

    /// The next packet for the guest, its payload in `buf` (whose length bounds it).
    pub fn next_rx(&mut self, buf: &mut [u8]) -> Option<(Header, usize)> {
        if let Some(hdr) = self.control.pop_front() {
            return Some((hdr, 0));
        }
        // Round robin: the connections after the one served last, then the rest.
        let keys: Vec<_> = self
            .conns
            .range((
                std::ops::Bound::Excluded(self.last_served),
                std::ops::Bound::Unbounded,
            ))
            .chain(self.conns.range(..=self.last_served))
            .map(|(k, _)| *k)
            .collect();
        let cid = self.cid;
        for key in keys {
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            let got = conn.to_guest(buf);
            let hdr = match got {
                Ok(FromHost::Nothing) => continue,
                Ok(FromHost::Data(n)) => {
                    let mut hdr = conn.header(cid, Op::Rw);
                    // n <= buf.len() <= MAX_PAYLOAD.
                    hdr.len = u32::try_from(n).unwrap_or(0);
                    self.last_served = key;
                    return Some((hdr, n));
                }
                Ok(FromHost::Eof) => conn.header(cid, Op::Shutdown),
                Ok(FromHost::NeedCredit) => conn.header(cid, Op::CreditRequest),
                Err(e) => {
                    debug!(
                        local = key.0,
                        peer = key.1,
                        "vsock: resetting a connection: {e}"
                    );
                    let rst = conn.header(cid, Op::Rst);
                    self.conns.remove(&key);
                    rst
                }
            };
            self.last_served = key;
            return Some((hdr, 0));
        }
        None
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                warn!(path = %self.path.display(), error = %e, "cannot remove the vsock socket");
            }
        }
    }
}

/// Binds `path`, replacing a stale socket.
fn listen(path: &Path) -> Result<UnixListener, BackendError> {
    let bind_err = |source| BackendError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(BackendError::NotASocket(path.to_path_buf()));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(BackendError::InUse(path.to_path_buf()));
        }
        // Left by a VM that was killed: nobody listens.
        std::fs::remove_file(path).map_err(bind_err)?;
    }
    // Like the control API socket: only the owner (the VMM's user) may connect, and the name
    // never exists with a wider mode (the mode is set on the socket before bind names it).
    unix_listen_with_mode(path, 0o600).map_err(bind_err)
}

/// Why `path` must not get a guest connection: it exists and is not a socket of user `euid`
/// (this process's). `None` when it is one, or is missing (then the connect fails as usual).
fn foreign_listener(path: &Path, euid: u32) -> Option<String> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => return Some(format!("cannot inspect it: {e}")),
    };
    if !meta.file_type().is_socket() {
        return Some("it is not a socket".into());
    }
    (meta.uid() != euid).then(|| {
        format!(
            "it is owned by uid {}, not by uid {euid} which runs the VM; remove it, or run \
             the listener as uid {euid}",
            meta.uid()
        )
    })
}

/// Reads the greeting up to its newline: `Ok(Some(port))` when complete, `Ok(None)` when more
/// is to come, `Err` for a closed stream or a malformed line.
fn read_line(g: &mut Greeting) -> Result<Option<u32>, String> {
    let mut byte = [0u8; 1];
    loop {
        match g.stream.read(&mut byte) {
            Ok(0) => return Err("closed before its CONNECT line".into()),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => {
                g.line.push(byte[0]);
                if g.line.len() > MAX_LINE {
                    return Err("CONNECT line too long".into());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    let line = String::from_utf8_lossy(&g.line);
    line.trim_end_matches('\r')
        .strip_prefix("CONNECT ")
        .and_then(|p| p.trim().parse::<u32>().ok())
        .map(Some)
        .ok_or_else(|| format!("malformed greeting {line:?}; expected \"CONNECT <port>\""))
}
