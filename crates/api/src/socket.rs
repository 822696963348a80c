//! Binding the API socket file: never clobber a live socket or a non-socket file, replace a stale
//! socket, create the socket with mode 0600 from its first moment at the path, and remove it
//! again when the server stops, if it is still ours.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::sys;

/// Why the API socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The path has no file name (e.g. `/` or `..`).
    #[error("API socket path {path:?} does not name a file")]
    NoFileName {
        /// The path given.
        path: PathBuf,
    },
    /// Another process is serving on the socket at the path.
    #[error("{path:?} is a live socket of another process (is this VM already running?)")]
    InUse {
        /// The path given.
        path: PathBuf,
    },
    /// Something other than a socket is at the path; it is left alone.
    #[error("{path:?} exists and is a {kind}, not a socket; refusing to replace it")]
    NotASocket {
        /// The path given.
        path: PathBuf,
        /// What is there: "regular file", "directory", "symbolic link", ...
        kind: &'static str,
    },
    /// The path could not be inspected.
    #[error("cannot inspect {path:?}")]
    Inspect {
        /// The path given.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Connecting to the existing socket failed in a way that does not tell whether it is stale.
    #[error("cannot tell whether the existing socket {path:?} is live")]
    Probe {
        /// The path given.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A stale socket could not be removed.
    #[error("cannot remove the stale socket {path:?}")]
    RemoveStale {
        /// The stale socket's path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Binding the socket failed.
    #[error("cannot bind a Unix socket at {path:?}")]
    Bind {
        /// The path bound.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// A bound, listening socket and the file that names it.
#[derive(Debug)]
pub(crate) struct BoundSocket {
    pub(crate) listener: UnixListener,
    pub(crate) file: SocketFile,
}

/// The socket's file; dropping it removes the file if it still is the socket bound here.
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    /// The socket's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        match fs::symlink_metadata(&self.path) {
            Ok(meta) if meta.dev() == self.dev && meta.ino() == self.ino => {
                if let Err(err) = fs::remove_file(&self.path) {
                    tracing::warn!(path = ?self.path, %err, "cannot remove the API socket");
                }
            }
            // Gone, or replaced by someone else's file: not ours to remove.
            _ => {}
        }
    }
}

/// Binds a listening socket at `path` with mode 0600; see the module docs for the rules.
pub(crate) fn bind(path: &Path) -> Result<BoundSocket, BindError> {
    if path.file_name().is_none() {
        return Err(BindError::NoFileName {
            path: path.to_owned(),
        });
    }
    clear_stale(path)?;

    // The mode is set on the socket before bind names it (no temporary name, no chmod after,
    // no umask); bind fails rather than replace a file that appeared at `path` meanwhile.
    let listener = sys::bind_unix_with_mode(path, 0o600).map_err(|source| BindError::Bind {
        path: path.to_owned(),
        source,
    })?;

    let meta = fs::symlink_metadata(path).map_err(|source| BindError::Inspect {
        path: path.to_owned(),
        source,
    })?;
    Ok(BoundSocket {
        listener,
        file: SocketFile {
            path: path.to_owned(),
            dev: meta.dev(),
            ino: meta.ino(),
        },
    })
}

/// Leaves `path` free: absent, or a stale socket that is removed. Anything else is an error.
fn clear_stale(path: &Path) -> Result<(), BindError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(BindError::Inspect {
                path: path.to_owned(),
                source,
            })
        }
    };
    let file_type = meta.file_type();
    if !file_type.is_socket() {
        return Err(BindError::NotASocket {
            path: path.to_owned(),
            kind: kind_of(&file_type),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(BindError::InUse {
            path: path.to_owned(),
        }),
        Err(err) if err.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(?path, "removing stale API socket");
            match fs::remove_file(path) {
                Ok(()) => Ok(()),
                Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(source) => Err(BindError::RemoveStale {
                    path: path.to_owned(),
                    source,
                }),
            }
        }
        Err(source) => Err(BindError::Probe {
            path: path.to_owned(),
            source,
        }),
    }
}

/// A human name for a non-socket file type.
fn kind_of(file_type: &fs::FileType) -> &'static str {
    if file_type.is_file() {
        "regular file"
    } else if file_type.is_dir() {
        "directory"
    } else if file_type.is_symlink() {
        "symbolic link"
    } else if file_type.is_fifo() {
        "FIFO"
    } else if file_type.is_block_device() {
        "block device"
    } else if file_type.is_char_device() {
        "character device"
    } else {
        "non-socket file"
    }
}
