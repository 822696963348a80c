//! The device I/O thread: it waits on the queues' ioeventfds and the backends' fds and runs
//! the device work for them, so vCPU threads only touch registers. One thread serves a list
//! of sources; pinning it like the emulator thread is the VMM's job (it owns the plan).
//!
//! Stopping is bounded: a thread still inside a device request [`STOP_WAIT`] after it was
//! told to stop (storage that does not answer: a `pwritev` or `fdatasync` in uninterruptible
//! sleep cannot be ended) is left running and reported ([`WorkerError::Hung`]); it holds
//! its devices and their guest memory until its I/O returns, and the process ends then.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::warn;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::bus::SharedTransport;

const STOP: u64 = u64::MAX;

/// How long a stop waits for an I/O thread to leave its current device request.
pub const STOP_WAIT: Duration = Duration::from_secs(2);

/// Why the I/O thread could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// epoll or eventfd setup failed.
    #[error("cannot set up the I/O thread's event loop")]
    Setup(#[source] std::io::Error),
    /// The thread could not be spawned.
    #[error("cannot spawn I/O thread {name}")]
    Spawn {
        /// Thread name.
        name: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The thread panicked.
    #[error("I/O thread {0} panicked")]
    Panicked(String),
    /// The thread did not leave its device request in time: it is left running.
    #[error(
        "I/O thread {name} is still in a device request {waited:?} after it was told to stop \
         (host storage not answering?); it is left behind and the process exits when its I/O \
         returns"
    )]
    Hung {
        /// Thread name.
        name: String,
        /// How long the stop waited.
        waited: Duration,
    },
}

/// Something the I/O thread waits for.
#[derive(Debug)]
pub enum IoSource {
    /// A queue's notification eventfd (registered with KVM as an ioeventfd on `QueueNotify`
    /// with the queue index as data match).
    QueueEvent {
        /// The device.
        transport: SharedTransport,
        /// The queue.
        queue: usize,
        /// The eventfd.
        event: EventFd,
    },
    /// A backend fd (a tap) that became readable: process `queue` (edge-triggered, so a
    /// backend with data but no guest buffers does not spin; the guest's next notification
    /// of the queue picks the data up).
    Backend {
        /// The device.
        transport: SharedTransport,
        /// The queue to process (receive).
        queue: usize,
        /// The fd; it must stay open as long as the transport lives (the device owns it).
        fd: RawFd,
    },
}

/// A running I/O thread; dropping it stops and joins it.
#[derive(Debug)]
pub struct IoThread {
    name: String,
    stop: EventFd,
    handle: Option<JoinHandle<()>>,
    // Disconnected when the thread ends (its sender is dropped, unwinding included); in a
    // Mutex only so that the thread's owner stays Sync.
    ended: Mutex<Receiver<()>>,
}

impl IoThread {
    /// Starts thread `name` serving `sources`.
    pub fn spawn(name: &str, sources: Vec<IoSource>) -> Result<Self, WorkerError> {
        Self::spawn_with(name, sources, || {})
    }

    /// Starts thread `name` serving `sources`; the thread runs `init` first (the VMM pins it
    /// there, like the emulator thread).
    pub fn spawn_with<F>(name: &str, sources: Vec<IoSource>, init: F) -> Result<Self, WorkerError>
    where
        F: FnOnce() + Send + 'static,
    {
        let epoll = Epoll::new().map_err(WorkerError::Setup)?;
        let stop = EventFd::new(EFD_NONBLOCK).map_err(WorkerError::Setup)?;
        let add = |fd: RawFd, events: EventSet, data: u64| {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(events, data))
                .map_err(WorkerError::Setup)
        };
        add(stop.as_raw_fd(), EventSet::IN, STOP)?;
        for (i, s) in sources.iter().enumerate() {
            let (fd, events) = match s {
                IoSource::QueueEvent { event, .. } => (event.as_raw_fd(), EventSet::IN),
                IoSource::Backend { fd, .. } => (*fd, EventSet::IN | EventSet::EDGE_TRIGGERED),
            };
            add(fd, events, i as u64)?;
        }
        let stop_clone = stop.try_clone().map_err(WorkerError::Setup)?;
        let (alive, ended) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let _alive = alive;
                init();
                // Backends are open and registered with epoll: the thread only does I/O now.
                vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::DeviceIo);
                run(&epoll, &sources, &stop_clone);
            })
            .map_err(|source| WorkerError::Spawn {
                name: name.to_string(),
                source,
            })?;
        Ok(IoThread {
            name: name.to_string(),
            stop,
            handle: Some(handle),
            ended: Mutex::new(ended),
        })
    }

    /// The thread's id for pinning (`pthread_t` handle via std).
    pub fn thread(&self) -> Option<&std::thread::Thread> {
        self.handle.as_ref().map(JoinHandle::thread)
    }

    /// Stops the thread and waits for it, at most [`STOP_WAIT`] for a device request it is
    /// in (see [`IoThread::stop_within`]).
    pub fn stop(self) -> Result<(), WorkerError> {
        self.stop_within(STOP_WAIT)
    }

    /// Stops the thread and waits for it, at most `wait` for a device request it is in;
    /// [`WorkerError::Hung`] if it is still in one then (the thread is left running).
    pub fn stop_within(mut self, wait: Duration) -> Result<(), WorkerError> {
        self.shutdown(wait)
    }

    fn shutdown(&mut self, wait: Duration) -> Result<(), WorkerError> {
        let Some(handle) = self.handle.take() else {
            return Ok(());
        };
        if let Err(e) = self.stop.write(1) {
            warn!(error = %e, thread = self.name, "cannot signal the I/O thread to stop");
        }
        let ended = self.ended.get_mut().unwrap_or_else(PoisonError::into_inner);
        match ended.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => Err(WorkerError::Hung {
                name: self.name.clone(),
                waited: wait,
            }),
            // Disconnected: the thread has ended (nothing is ever sent).
            Ok(()) | Err(RecvTimeoutError::Disconnected) => handle
                .join()
                .map_err(|_| WorkerError::Panicked(self.name.clone())),
        }
    }
}

impl Drop for IoThread {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown(STOP_WAIT) {
            warn!(error = %e, "I/O thread");
        }
    }
}

fn run(epoll: &Epoll, sources: &[IoSource], stop: &EventFd) {
    let mut events = vec![EpollEvent::default(); sources.len() + 1];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!(error = %e, "I/O thread: epoll_wait failed; stopping");
                return;
            }
        };
        for ev in &events[..n] {
            if ev.data() == STOP {
                // Drain for tidiness; the thread ends either way.
                let _ = stop.read();
                return;
            }
            let Some(source) = usize::try_from(ev.data()).ok().and_then(|i| sources.get(i)) else {
                continue;
            };
            let (transport, queue) = match source {
                IoSource::QueueEvent {
                    transport,
                    queue,
                    event,
                } => {
                    // EAGAIN: a spurious wake-up; the queue is processed anyway.
                    let _ = event.read();
                    (transport, *queue)
                }
                IoSource::Backend {
                    transport, queue, ..
                } => (transport, *queue),
            };
            transport
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .notify(queue);
        }
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
