//! The device I/O thread: it waits on the queues' ioeventfds and the backends' fds and runs
//! the device work for them, so vCPU threads only touch registers. One thread serves a list
//! of sources; pinning it like the emulator thread is the VMM's job (it owns the plan).
//!
//! Stopping is bounded: a thread still inside a device request [`STOP_WAIT`] after it was
//! told to stop (storage that does not answer: a `pwritev` or `fdatasync` in uninterruptible
//! sleep cannot be ended) is left running and reported ([`WorkerError::Hung`]); it holds
//! its devices and their guest memory until its I/O returns, and the process ends then.
//!
//! Pausing (before a device state is saved: snapshot, migration) is bounded the same way:
//! [`IoThread::pause`] wakes the thread, which finishes the events it was handed, then serves
//! every queue whose notification is pending (so a request the guest made available and
//! notified before it was paused is completed, not left half-way to the target), and parks
//! until [`IoThread::resume`] or a stop. A thread still in a request after the wait
//! ([`STOP_WAIT`]) is reported as [`WorkerError::Hung`] and the save is not taken.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::warn;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::bus::SharedTransport;

const STOP: u64 = u64::MAX;
const PAUSE: u64 = u64::MAX - 1;

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

/// What a paused I/O thread and its owner share.
#[derive(Debug, Default)]
struct Parking {
    /// A pause is asked for (and no resume since).
    requested: bool,
    /// Counts the pauses asked for: a thread parks for one, after the drain that follows it.
    generation: u64,
    /// The generation the thread is parked for, if it is parked.
    parked: Option<u64>,
    /// The thread was told to stop.
    stopping: bool,
    /// The thread has ended.
    ended: bool,
}

#[derive(Debug, Default)]
struct Park {
    state: Mutex<Parking>,
    changed: Condvar,
}

impl Park {
    fn lock(&self) -> std::sync::MutexGuard<'_, Parking> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The thread's side: while a pause is asked for, runs `drain` (outside the lock) and
    /// parks until a resume, a stop or another pause (which drains again); false when it is
    /// to stop.
    fn park_if_asked(&self, drain: impl Fn()) -> bool {
        loop {
            let generation = {
                let s = self.lock();
                if s.stopping || !s.requested {
                    return !s.stopping;
                }
                s.generation
            };
            drain();
            let mut s = self.lock();
            if s.stopping || !s.requested || s.generation != generation {
                continue;
            }
            s.parked = Some(generation);
            self.changed.notify_all();
            let mut s = self
                .changed
                .wait_while(s, |s| {
                    s.requested && !s.stopping && s.generation == generation
                })
                .unwrap_or_else(PoisonError::into_inner);
            s.parked = None;
        }
    }
}

/// Marks the thread ended when it returns or unwinds.
struct EndGuard(Arc<Park>);

impl Drop for EndGuard {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.ended = true;
        s.parked = None;
        self.0.changed.notify_all();
    }
}

/// A running I/O thread; dropping it stops and joins it.
#[derive(Debug)]
pub struct IoThread {
    name: String,
    stop: EventFd,
    pause: EventFd,
    park: Arc<Park>,
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
        let pause = EventFd::new(EFD_NONBLOCK).map_err(WorkerError::Setup)?;
        add(pause.as_raw_fd(), EventSet::IN, PAUSE)?;
        for (i, s) in sources.iter().enumerate() {
            let (fd, events) = match s {
                IoSource::QueueEvent { event, .. } => (event.as_raw_fd(), EventSet::IN),
                IoSource::Backend { fd, .. } => (*fd, EventSet::IN | EventSet::EDGE_TRIGGERED),
            };
            add(fd, events, i as u64)?;
        }
        let events = Events {
            stop: stop.try_clone().map_err(WorkerError::Setup)?,
            pause: pause.try_clone().map_err(WorkerError::Setup)?,
            park: Arc::new(Park::default()),
        };
        let park = Arc::clone(&events.park);
        let (alive, ended) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let _alive = alive;
                let _ended = EndGuard(Arc::clone(&events.park));
                init();
                // Backends are open and registered with epoll: the thread only does I/O now.
                vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::DeviceIo);
                run(&epoll, &sources, &events);
            })
            .map_err(|source| WorkerError::Spawn {
                name: name.to_string(),
                source,
            })?;
        Ok(IoThread {
            name: name.to_string(),
            stop,
            pause,
            park,
            handle: Some(handle),
            ended: Mutex::new(ended),
        })
    }

    /// The thread's id for pinning (`pthread_t` handle via std).
    pub fn thread(&self) -> Option<&std::thread::Thread> {
        self.handle.as_ref().map(JoinHandle::thread)
    }

    /// Quiesces the thread (see the module docs): it completes what it was handed and every
    /// notified request, then parks. Waits at most `wait` for it to park;
    /// [`WorkerError::Hung`] if it is still in a request then (the pause stays asked for: the
    /// thread parks when its request returns, until [`IoThread::resume`]). A parked or ended
    /// thread is left as it is.
    pub fn pause(&self, wait: Duration) -> Result<(), WorkerError> {
        self.ask_pause();
        self.wait_paused(wait)
    }

    /// Asks the thread to pause without waiting (see [`IoThread::pause`]), so several
    /// threads quiesce at once; [`IoThread::wait_paused`] waits for it.
    pub fn ask_pause(&self) {
        let mut s = self.park.lock();
        if s.ended || (s.requested && s.parked.is_some()) {
            return;
        }
        s.requested = true;
        s.generation = s.generation.wrapping_add(1);
        self.park.changed.notify_all();
        if let Err(e) = self.pause.write(1) {
            warn!(error = %e, thread = self.name, "cannot signal the I/O thread to pause");
        }
    }

    /// Waits at most `wait` for the thread to park after the last [`IoThread::ask_pause`];
    /// [`WorkerError::Hung`] if it has not (it parks later, when its request returns). A
    /// thread that was not asked to pause is not waited for.
    pub fn wait_paused(&self, wait: Duration) -> Result<(), WorkerError> {
        let s = self.park.lock();
        if !s.requested {
            return Ok(());
        }
        let generation = s.generation;
        let (s, _) = self
            .park
            .changed
            .wait_timeout_while(s, wait, |s| s.parked != Some(generation) && !s.ended)
            .unwrap_or_else(PoisonError::into_inner);
        if s.parked != Some(generation) && !s.ended {
            return Err(WorkerError::Hung {
                name: self.name.clone(),
                waited: wait,
            });
        }
        Ok(())
    }

    /// Whether the thread is parked by [`IoThread::pause`].
    pub fn is_paused(&self) -> bool {
        let s = self.park.lock();
        s.requested && s.parked.is_some()
    }

    /// Lets a paused thread serve its devices again (a no-op if it is not paused).
    pub fn resume(&self) {
        let mut s = self.park.lock();
        s.requested = false;
        self.park.changed.notify_all();
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
        {
            let mut s = self.park.lock();
            s.stopping = true;
            self.park.changed.notify_all();
        }
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

/// The thread's side of its control eventfds.
struct Events {
    stop: EventFd,
    pause: EventFd,
    park: Arc<Park>,
}

fn run(epoll: &Epoll, sources: &[IoSource], control: &Events) {
    let mut events = vec![EpollEvent::default(); sources.len() + 2];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                warn!(error = %e, "I/O thread: epoll_wait failed; stopping");
                return;
            }
        };
        let mut pause = false;
        for ev in &events[..n] {
            match ev.data() {
                STOP => {
                    // Drain for tidiness; the thread ends either way.
                    let _ = control.stop.read();
                    return;
                }
                // The rest of the batch is served first.
                PAUSE => {
                    let _ = control.pause.read();
                    pause = true;
                }
                i => {
                    if let Some(source) = usize::try_from(i).ok().and_then(|i| sources.get(i)) {
                        serve(source);
                    }
                }
            }
        }
        if pause && !control.park.park_if_asked(|| drain_notifications(sources)) {
            return;
        }
    }
}

/// Serves what one event of `source` asks for.
fn serve(source: &IoSource) {
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

/// Before parking: serves every queue whose notification is pending (its eventfd is set and
/// epoll has not reported it yet), so each request the guest notified is completed.
fn drain_notifications(sources: &[IoSource]) {
    for source in sources {
        if let IoSource::QueueEvent {
            transport,
            queue,
            event,
        } = source
        {
            if event.read().is_ok() {
                transport
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .notify(*queue);
            }
        }
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
