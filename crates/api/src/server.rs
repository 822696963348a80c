//! The server: an accept loop with a connection limit, one task per connection with a request
//! timeout, and the `vmhost-api` thread that runs it on a tokio current-thread runtime.

use std::future::Future;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::http::{self, Response};
use crate::socket::{self, BindError, BoundSocket, SocketFile};
use crate::{routes, ServerLimits, VmControl};

/// Run first on the `vmhost-api` thread, before its runtime exists: e.g. set the thread's CPU
/// affinity and record its thread id. An error stops [`serve`], which returns it.
pub type ThreadStartHook =
    Box<dyn FnOnce() -> Result<(), Box<dyn std::error::Error + Send + Sync>> + Send>;

/// The name of the thread [`serve`] starts.
const THREAD_NAME: &str = "vmhost-api";

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Binding the socket failed.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// Switching the socket to non-blocking mode or registering it with tokio failed.
    #[error("cannot register the API socket {} with the tokio runtime", path.display())]
    Register {
        /// The socket's path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The `vmhost-api` thread could not be started.
    #[error("cannot start the {THREAD_NAME} thread")]
    SpawnThread(#[source] io::Error),
    /// The caller's [`ThreadStartHook`] failed.
    #[error("the {THREAD_NAME} thread's start hook failed")]
    StartHook(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The `vmhost-api` thread's tokio runtime could not be built.
    #[error("cannot build the {THREAD_NAME} thread's tokio runtime")]
    Runtime(#[source] io::Error),
    /// The `vmhost-api` thread panicked.
    #[error("the {THREAD_NAME} thread panicked")]
    ThreadPanicked,
    /// The `vmhost-api` thread's syscall filter could not be installed.
    #[error("cannot install the {THREAD_NAME} thread's syscall filter")]
    Seccomp(#[source] vmhost_seccomp::SeccompError),
}

/// A bound API socket, not yet serving: for running the server on a runtime of the caller's
/// (e.g. the emulator thread's) instead of the thread [`serve`] starts.
///
/// Dropping it, or the end of [`ApiListener::run`], removes the socket file.
#[derive(Debug)]
pub struct ApiListener {
    socket: BoundSocket,
    limits: ServerLimits,
}

impl ApiListener {
    /// Binds the socket at `path` with mode 0600. A stale socket there is replaced; a live
    /// socket or a non-socket file is an error and left alone.
    pub fn bind(path: &Path, limits: ServerLimits) -> Result<Self, ServeError> {
        let socket = socket::bind(path)?;
        socket
            .listener
            .set_nonblocking(true)
            .map_err(|source| ServeError::Register {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self { socket, limits })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        self.socket.file.path()
    }

    /// Serves until `shutdown` completes, then stops accepting, removes the socket file, lets
    /// connections in progress finish for [`ServerLimits::stop_grace`] and drops the rest.
    ///
    /// Must run inside a tokio runtime with IO and time enabled; connections are spawned as
    /// tasks on it.
    pub async fn run(
        self,
        control: Arc<dyn VmControl>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        self.register()?.serve(control, shutdown).await;
        Ok(())
    }

    /// Registers the socket with the current tokio runtime.
    fn register(self) -> Result<Registered, ServeError> {
        let BoundSocket { listener, file } = self.socket;
        let listener = tokio::net::UnixListener::from_std(listener).map_err(|source| {
            ServeError::Register {
                path: file.path().to_owned(),
                source,
            }
        })?;
        Ok(Registered {
            listener,
            file,
            limits: Arc::new(self.limits),
        })
    }
}

/// A socket registered with a tokio runtime, ready to accept.
struct Registered {
    listener: tokio::net::UnixListener,
    file: SocketFile,
    limits: Arc<ServerLimits>,
}

impl Registered {
    /// The accept loop; see [`ApiListener::run`].
    async fn serve(self, control: Arc<dyn VmControl>, shutdown: impl Future<Output = ()>) {
        let Self {
            listener,
            file,
            limits,
        } = self;
        tracing::info!(path = ?file.path(), "control API listening");
        let mut shutdown = std::pin::pin!(shutdown);
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(done) = connections.join_next(), if !connections.is_empty() => {
                    log_join(done);
                }
                accepted = listener.accept() => match accepted {
                    Ok((stream, _addr)) => {
                        while let Some(done) = connections.try_join_next() {
                            log_join(done);
                        }
                        if connections.len() >= limits.max_connections {
                            refuse(stream, limits.max_connections);
                        } else {
                            connections.spawn(connection(stream, control.clone(), limits.clone()));
                        }
                    }
                    Err(err) => {
                        // E.g. EMFILE: back off instead of spinning; connections in progress
                        // finish meanwhile and free descriptors.
                        tracing::warn!(%err, "control API accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        drop(listener);
        drop(file);
        let drain = async { while connections.join_next().await.is_some() {} };
        if tokio::time::timeout(limits.stop_grace, drain)
            .await
            .is_err()
        {
            tracing::debug!(left = connections.len(), "dropping API connections at stop");
        }
        connections.shutdown().await;
        tracing::info!("control API stopped");
    }
}

/// Logs a connection task that panicked (requests themselves never panic the task).
fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(err) = done {
        if err.is_panic() {
            tracing::error!(%err, "control API connection task panicked");
        }
    }
}

/// Answers 503 on a connection over the limit and closes it, without reading its request and
/// without waiting: the answer fits in the empty socket buffer, and a write that does not is
/// dropped.
fn refuse(stream: UnixStream, limit: usize) {
    let response = Response::error(
        503,
        format!("too many connections to the control API (limit {limit}); retry later"),
    );
    match stream.into_std() {
        Ok(mut std_stream) => {
            let _ = std_stream.write(&response.encode());
        }
        Err(err) => tracing::debug!(%err, "cannot answer a refused API connection"),
    }
    tracing::warn!(
        limit,
        "control API connection refused: too many connections"
    );
}

/// Serves one connection: one request, one answer.
pub(crate) async fn connection(
    mut stream: UnixStream,
    control: Arc<dyn VmControl>,
    limits: Arc<ServerLimits>,
) {
    let read = http::read_request(&mut stream, &limits);
    let response = match tokio::time::timeout(limits.request_timeout, read).await {
        Err(_elapsed) => Response::error(
            408,
            format!("request not received within {:?}", limits.request_timeout),
        ),
        Ok(Ok(None)) => return,
        Ok(Err(err)) => {
            tracing::debug!(%err, "bad control API request");
            Response::error(err.status(), err.to_string())
        }
        Ok(Ok(Some(request))) => {
            let response = routes::route(&request, &*control);
            tracing::debug!(
                method = request.method,
                path = request.path,
                status = response.status,
                "control API request"
            );
            response
        }
    };
    let write = async {
        stream.write_all(&response.encode()).await?;
        stream.shutdown().await
    };
    match tokio::time::timeout(limits.write_timeout, write).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => tracing::debug!(%err, "cannot write a control API answer"),
        Err(_elapsed) => tracing::debug!("timed out writing a control API answer"),
    }
}

/// The server running on its own `vmhost-api` thread. [`ApiServer::stop`] or dropping it stops
/// the server and removes the socket file.
#[derive(Debug)]
pub struct ApiServer {
    path: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Binds the API socket at `path` (see [`ApiListener::bind`]) and serves it on a new thread
/// named `vmhost-api` with a tokio current-thread runtime. `on_thread_start` runs first on that
/// thread (e.g. to pin it as the emulator thread). Returns once the server accepts connections.
pub fn serve(
    path: &Path,
    control: Arc<dyn VmControl>,
    limits: ServerLimits,
    on_thread_start: Option<ThreadStartHook>,
) -> Result<ApiServer, ServeError> {
    let listener = ApiListener::bind(path, limits)?;
    let path = listener.path().to_owned();
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Result<(), ServeError>>(1);
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(THREAD_NAME.to_owned())
        .spawn(move || {
            let started = start_thread(on_thread_start).and_then(|runtime| {
                let registered = {
                    let _context = runtime.enter();
                    listener.register()?
                };
                // The runtime, its epoll instance and the registered socket exist: from here
                // on the thread accepts, reads, writes and answers.
                vmhost_seccomp::install_current(vmhost_seccomp::ThreadKind::Api)
                    .map_err(ServeError::Seccomp)?;
                Ok((registered, runtime))
            });
            let (registered, runtime) = match started {
                Ok(started) => started,
                Err(err) => {
                    let _ = ready_tx.send(Err(err));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            runtime.block_on(registered.serve(control, async {
                // A dropped sender (ApiServer dropped without stop) also stops the server.
                let _ = stop_rx.await;
            }));
        })
        .map_err(ServeError::SpawnThread)?;
    let server = ApiServer {
        path,
        stop: Some(stop_tx),
        thread: Some(thread),
    };
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(server),
        Ok(Err(err)) => {
            let _ = server.stop();
            Err(err)
        }
        Err(_disconnected) => server.stop().and(Err(ServeError::ThreadPanicked)),
    }
}

/// Runs the hook and builds the runtime, on the new thread.
fn start_thread(hook: Option<ThreadStartHook>) -> Result<tokio::runtime::Runtime, ServeError> {
    if let Some(hook) = hook {
        hook().map_err(ServeError::StartHook)?;
    }
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)
}

impl ApiServer {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops the server and waits for its thread: accepting ends and the socket file is
    /// removed at once, connections in progress get [`ServerLimits::stop_grace`] to finish.
    pub fn stop(mut self) -> Result<(), ServeError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), ServeError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread.join().map_err(|_panic| ServeError::ThreadPanicked),
            None => Ok(()),
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Err(err) = self.stop_and_join() {
            tracing::warn!(%err, "control API server did not stop cleanly");
        }
    }
}
