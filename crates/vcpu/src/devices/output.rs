//! A bounded output path that never blocks its producers: a buffer that vCPU and I/O threads
//! append to, and a thread of its own that drains it into the real writer. The serial console
//! uses it (the `vmhost-serial` thread, into stdout or [`super::serial::SerialOut`]), and so
//! does the binary's diagnostics writer (`vmhost-diag`, into stderr), so that a full stdout or
//! stderr pipe never stalls a vCPU.
//!
//! A producer never waits for the writer: when the buffer is full (the reader is slow or gone,
//! e.g. a pipe nobody reads), new bytes are dropped and counted. Dropping the [`Drain`] waits at
//! most [`FLUSH_TIMEOUT`] for the thread to write what is left; a thread still blocked in the
//! writer is then left behind (it ends with the process) so that stopping the VM never hangs on
//! it.

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
pub type Sink = Box<dyn FnMut(&[u8]) -> io::Result<()> + Send>;

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

/// The draining thread: its name, its syscall filter, and what its output is (for warnings).
#[derive(Debug, Clone, Copy)]
pub struct DrainThread {
    /// Thread name.
    pub name: &'static str,
    /// The filter the thread installs on itself before it writes anything.
    pub kind: vmhost_seccomp::ThreadKind,
    /// What the output is, e.g. "serial output".
    pub what: &'static str,
}

/// The serial console's drain thread.
pub const SERIAL_THREAD: DrainThread = DrainThread {
    name: "vmhost-serial",
    kind: vmhost_seccomp::ThreadKind::Serial,
    what: "serial output",
};

/// The bounded buffer and its draining thread.
pub struct Drain {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// A [`Drain::sync`] timed out: the writer is blocked, so dropping does not wait again.
    stuck: AtomicBool,
    what: &'static str,
}

impl std::fmt::Debug for Drain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drain")
            .field("what", &self.what)
            .finish_non_exhaustive()
    }
}

impl Drain {
    /// Starts the `vmhost-serial` thread writing to `sink`.
    pub(crate) fn start(sink: Sink) -> io::Result<Drain> {
        Drain::start_thread(SERIAL_THREAD, sink)
    }

    /// Starts `thread` writing to `sink`. The thread inherits the caller's signal mask (start
    /// it after the stop signals are blocked, as the run path does).
    pub fn start_thread(thread: DrainThread, mut sink: Sink) -> io::Result<Drain> {
        let shared = Arc::new(Shared::default());
        let handle = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(thread.name.into())
                .spawn(move || {
                    vmhost_seccomp::install_current_or_abort(thread.kind);
                    drain_loop(&shared, &mut sink, thread.what)
                })?
        };
        Ok(Drain {
            shared,
            thread: Some(handle),
            stuck: AtomicBool::new(false),
            what: thread.what,
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

    /// Appends all of `bytes` if they fit, else nothing, without waiting (a line is written
    /// whole or dropped whole); true when they were taken.
    pub fn push_whole(&self, bytes: &[u8]) -> bool {
        let mut s = lock(&self.shared.state);
        if bytes.len() > CAPACITY.saturating_sub(s.buf.len()) {
            return false;
        }
        s.buf.extend(bytes);
        self.shared.changed.notify_all();
        true
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
                    "{} is blocked (nobody reads it); leaving its writer thread behind",
                    self.what
                );
            }
        }
    }
}

fn drain_loop(shared: &Shared, sink: &mut Sink, what: &str) {
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
                tracing::warn!(error = %e, "{what} failed; the rest is discarded");
                failed = true;
            }
        }
    }
}

/// A sink writing to `w` and flushing after each chunk.
pub fn sink_of(w: impl FnMut(&[u8]) -> io::Result<()> + Send + 'static) -> Sink {
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

    /// How long a step that must not block may take before the test calls it blocked: a
    /// watchdog against a hang, never a measurement.
    const WATCHDOG: Duration = Duration::from_secs(60);

    /// Runs `f` on a thread of its own; `None` when it has not returned within [`WATCHDOG`].
    fn finishes<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(WATCHDOG).ok()
    }

    /// A sink that blocks like a write to a pipe nobody reads: it reports each call on
    /// `entered` and returns only when `release` is dropped.
    fn blocked_sink() -> (Sink, mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (entered_tx, entered) = mpsc::channel::<()>();
        let (release, release_rx) = mpsc::channel::<()>();
        let release_rx = Mutex::new(release_rx);
        let sink = sink_of(move |_| {
            let _ = entered_tx.send(());
            let _ = lock(&release_rx).recv();
            Ok(())
        });
        (sink, entered, release)
    }

    #[test]
    fn a_blocked_sink_never_blocks_the_pusher_and_excess_bytes_are_refused() {
        let (sink, entered, release) = blocked_sink();
        let d = Arc::new(Drain::start(sink).unwrap());
        assert_eq!(d.push(b"first"), 5);
        // The writer now holds "first" and is blocked in the sink.
        entered.recv().unwrap();
        let pusher = Arc::clone(&d);
        let taken = finishes(move || (0..1000).map(|_| pusher.push(&[b'x'; 1024])).sum::<usize>())
            .expect("push blocked while the writer was blocked");
        // The writer never came back meanwhile: every push returned while it was blocked.
        assert!(entered.try_recv().is_err(), "the sink was released early");
        // Exactly one full buffer queued behind the blocked writer; the rest was refused.
        assert_eq!(taken, CAPACITY);
        assert!(!d.push_whole(b"y"), "a full buffer takes no whole line");
        assert!(!d.sync(Duration::from_millis(10)));
        let d = Arc::into_inner(d).unwrap();
        // Dropping does not wait for the blocked writer again: it returns while the writer is
        // still blocked (the sink is released only afterwards).
        finishes(move || drop(d)).expect("dropping waited for the blocked writer");
        assert!(entered.try_recv().is_err(), "the sink was released early");
        drop(release);
    }

    #[test]
    fn a_whole_line_is_taken_whole_or_not_at_all() {
        let (sink, entered, release) = blocked_sink();
        let d = Drain::start(sink).unwrap();
        assert!(d.push_whole(b"held by the writer\n"));
        entered.recv().unwrap();
        let line = [b'l'; 1000];
        let fitted = (0..CAPACITY).take_while(|_| d.push_whole(&line)).count();
        assert_eq!(fitted, CAPACITY / line.len());
        // What is left is smaller than a line: nothing of it is taken, but a shorter line fits.
        assert!(!d.push_whole(&line));
        let left = CAPACITY % line.len();
        assert!(d.push_whole(&vec![b's'; left]));
        assert_eq!(d.push(b"z"), 0);
        drop(release);
    }
}
