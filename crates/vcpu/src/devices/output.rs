//! The serial console's output path: a bounded buffer that vCPU threads append to, and the
//! `vmhost-serial` thread that drains it into the real writer (stdout or
//! [`super::serial::SerialOut`]).
//!
//! A vCPU never waits for the writer: when the buffer is full (the reader is slow or gone, e.g.
//! a pipe nobody reads), new bytes are dropped and counted. Dropping the [`Drain`] waits at most
//! [`FLUSH_TIMEOUT`] for the thread to write what is left; a thread still blocked in the writer
//! is then left behind (it ends with the process) so that stopping the VM never hangs on it.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::control::lock;

/// Bytes buffered between the guest and the writer (plus at most as many in the writer's
/// hands while it writes).
pub const CAPACITY: usize = 64 << 10;
/// How long stopping waits for buffered output to be written.
pub const FLUSH_TIMEOUT: Duration = Duration::from_millis(200);

/// Where the drained bytes go.
pub(crate) type Sink = Box<dyn FnMut(&[u8]) -> io::Result<()> + Send>;

#[derive(Default)]
struct State {
    buf: VecDeque<u8>,
    /// The thread holds bytes it has taken but not yet written.
    writing: bool,
    done: bool,
    exited: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// The bounded buffer and its draining thread.
pub(crate) struct Drain {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// A [`Drain::sync`] timed out: the writer is blocked, so dropping does not wait again.
    stuck: AtomicBool,
}

impl Drain {
    /// Starts the `vmhost-serial` thread writing to `sink`.
    pub fn start(mut sink: Sink) -> io::Result<Drain> {
        let shared = Arc::new(Shared::default());
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("vmhost-serial".into())
                .spawn(move || {
                    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Serial);
                    drain_loop(&shared, &mut sink)
                })?
        };
        Ok(Drain {
            shared,
            thread: Some(thread),
            stuck: AtomicBool::new(false),
        })
    }

    /// Appends what fits of `bytes` without waiting; returns how many bytes were taken.
    pub fn push(&self, bytes: &[u8]) -> usize {
        let mut s = lock(&self.shared.state);
        let n = bytes.len().min(CAPACITY.saturating_sub(s.buf.len()));
        s.buf.extend(&bytes[..n]);
        if n > 0 {
            self.shared.changed.notify_all();
        }
        n
    }

    /// Waits up to `timeout` until everything pushed so far is written; true when it was.
    pub fn sync(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = lock(&self.shared.state);
        while (!s.buf.is_empty() || s.writing) && !s.exited {
            let now = Instant::now();
            if now >= deadline {
                self.stuck.store(true, Ordering::Relaxed);
                return false;
            }
            s = self
                .shared
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        s.buf.is_empty() && !s.writing
    }
}

impl Drop for Drain {
    fn drop(&mut self) {
        let flushed = !self.stuck.load(Ordering::Relaxed) && self.sync(FLUSH_TIMEOUT);
        let exited = {
            let mut s = lock(&self.shared.state);
            s.done = true;
            self.shared.changed.notify_all();
            // A blocked writer does not exit: do not wait for it twice.
            let wait = if flushed {
                FLUSH_TIMEOUT
            } else {
                Duration::ZERO
            };
            let deadline = Instant::now() + wait;
            while !s.exited && Instant::now() < deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                s = self
                    .shared
                    .changed
                    .wait_timeout(s, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            s.exited
        };
        match self.thread.take() {
            Some(t) if exited => {
                let _ = t.join();
            }
            _ => {
                // Blocked in the writer: leave it; it ends with the process.
                tracing::warn!(
                    flushed,
                    "serial output is blocked (nobody reads it); leaving its writer thread behind"
                );
            }
        }
    }
}

fn drain_loop(shared: &Shared, sink: &mut Sink) {
    let mut failed = false;
    loop {
        let chunk: Vec<u8> = {
            let mut s = lock(&shared.state);
            s.writing = false;
            shared.changed.notify_all();
            while s.buf.is_empty() && !s.done {
                s = shared
                    .changed
                    .wait(s)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if s.buf.is_empty() {
                s.exited = true;
                shared.changed.notify_all();
                return;
            }
            s.writing = true;
            s.buf.drain(..).collect()
        };
        if !failed {
            if let Err(e) = sink(&chunk) {
                tracing::warn!(error = %e, "serial output failed; the rest is discarded");
                failed = true;
            }
        }
    }
}

/// A sink writing to `w` and flushing after each chunk.
pub(crate) fn sink_of(w: impl FnMut(&[u8]) -> io::Result<()> + Send + 'static) -> Sink {
    Box::new(w)
}

/// A sink for this process's stdout.
pub(crate) fn stdout_sink() -> Sink {
    sink_of(|b| {
        let mut out = io::stdout().lock();
        out.write_all(b)?;
        out.flush()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn bytes_reach_the_sink_in_order() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let d = {
            let got = Arc::clone(&got);
            Drain::start(sink_of(move |b| {
                lock(&got).extend_from_slice(b);
                Ok(())
            }))
            .unwrap()
        };
        assert_eq!(d.push(b"hello "), 6);
        assert_eq!(d.push(b"world"), 5);
        assert!(d.sync(Duration::from_secs(5)));
        drop(d);
        assert_eq!(&*lock(&got), b"hello world");
    }

    #[test]
    fn a_blocked_sink_never_blocks_the_pusher_and_excess_bytes_are_refused() {
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Mutex::new(release_rx);
        let d = Drain::start(sink_of(move |_| {
            // Blocks like a write to a pipe nobody reads.
            let _ = lock(&release_rx).recv();
            Ok(())
        }))
        .unwrap();
        let t0 = Instant::now();
        let mut taken = 0;
        for _ in 0..1000 {
            taken += d.push(&[b'x'; 1024]);
        }
        assert!(t0.elapsed() < Duration::from_secs(1));
        // At most one buffer held by the blocked writer and one full buffer queued.
        assert!(taken <= 2 * CAPACITY, "{taken}");
        assert!(taken >= CAPACITY, "{taken}");
        assert!(!d.sync(Duration::from_millis(10)));
        let t0 = Instant::now();
        drop(d);
        assert!(t0.elapsed() < FLUSH_TIMEOUT, "{:?}", t0.elapsed());
        drop(release_tx);
    }
}
