//! vmhost's snapshot and migration formats. This crate knows no KVM: it holds bytes, not
//! vCPUs, and the VMM's state structs are written into it as records by their owners.
//!
//! - [`container`]: the versioned record container (header, checksummed records, end record)
//!   that snapshot files and the migration stream share, and its reader's bounds and errors;
//! - [`auth`]: the pre-shared key, the mutual handshake, and the per-record MAC of a stream;
//! - [`pages`]: guest memory as runs of pages, zero and untouched pages left out;
//! - [`dir`]: the snapshot directory, created safely and checked whole before a restore;
//! - [`migration`]: the live migration protocol's messages (versioned, JSON records on an
//!   authenticated stream);
//! - [`precopy`]: when live migration's pre-copy rounds stop (estimated downtime against
//!   `--max-downtime`, giving up after `--timeout`).
//!
//! `docs/migration.md` describes the formats byte by byte.
//!
//! ```
//! use vmhost_persist::container::{Reader, RecordKind, Writer};
//!
//! let mut w = Writer::new(Vec::new(), "0.1.0").unwrap();
//! w.write_record(RecordKind::SPEC, b"name: web-1").unwrap();
//! let bytes = w.finish().unwrap();
//!
//! let mut r = Reader::new(&bytes[..], &[RecordKind::SPEC]).unwrap();
//! assert_eq!(r.header().vmhost_version, "0.1.0");
//! let rec = r.next_record().unwrap().unwrap();
//! assert_eq!((rec.kind, &rec.payload[..]), (RecordKind::SPEC, &b"name: web-1"[..]));
//! assert!(r.next_record().unwrap().is_none());
//! ```
#![warn(missing_docs)]

pub mod auth;
pub mod container;
pub mod dir;
pub mod migration;
pub mod pages;
pub mod precopy;

pub use auth::{handshake, AuthError, AuthKey, Role, Session};
pub use container::{ContainerError, Reader, Record, RecordKind, Writer, FORMAT_VERSION};
pub use dir::{DirError, FileName, Snapshot, SnapshotWriter};
pub use pages::{CellGeometry, PageError, PageRun};
pub use precopy::{Convergence, Decision, PrecopyLimits, RoundStats};
