//! Diagnostics: the `tracing` events of every crate (and `log` records, which
//! `tracing_subscriber` forwards through `LogTracer`) go to stderr: warnings and errors by
//! default, more with `VMHOST_LOG` (a target list such as `info` or `vmhost_devices=debug`).
//!
//! Until the run path starts the writer thread ([`start_writer`]) a line is written to stderr
//! directly. From then on lines go into a bounded buffer that the `vmhost-diag` thread drains
//! into stderr (the serial console's [`Drain`]), so a vCPU or I/O thread that logs never blocks
//! on a full stderr pipe while it holds a device lock. A line that does not fit is dropped
//! whole and counted; the next line that fits is preceded by
//! `vmhost: N diagnostic lines dropped`. At the end [`finish`] gives the buffer a bounded time
//! to drain and writes a count still pending itself. The lines written after it (`main`'s
//! final error) and the seccomp `SIGSYS` handler's line go to stderr directly, never through
//! the buffer, so they are never dropped.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use vmhost_vcpu::devices::output::{sink_of, Drain, DrainThread, FLUSH_TIMEOUT};

/// The diagnostics writer thread.
const DIAG_THREAD: DrainThread = DrainThread {
    name: "vmhost-diag",
    kind: vmhost_seccomp::ThreadKind::Diag,
    what: "diagnostic output",
};

/// The bounded path, once started.
static BOUNDED: OnceLock<Bounded> = OnceLock::new();

struct Bounded {
    drain: Drain,
    /// Lines dropped and not yet reported.
    dropped: AtomicU64,
}

impl Bounded {
    /// Queues `line` whole, after the report of lines dropped before it; never waits.
    fn push(&self, line: &[u8]) {
        let pending = self.dropped.load(Ordering::Relaxed);
        if pending > 0 {
            if !self.drain.push_whole(dropped_line(pending).as_bytes()) {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            self.dropped.fetch_sub(pending, Ordering::Relaxed);
        }
        if !self.drain.push_whole(line) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn dropped_line(n: u64) -> String {
    format!("vmhost: {n} diagnostic lines dropped (stderr was not read fast enough)\n")
}

/// Installs the `tracing` subscriber (stderr directly until [`start_writer`]).
pub fn init() {
    // The builder's own level (INFO by default) would cap the filter's.
    let _ = tracing_subscriber::fmt()
        .with_max_level(LevelFilter::TRACE)
        .with_writer(DiagWriter)
        .with_target(false)
        .without_time()
        .finish()
        .with(filter(std::env::var("VMHOST_LOG").ok().as_deref()))
        .try_init();
}

/// The filter `VMHOST_LOG` asks for: `tracing_subscriber`'s target list (`info`,
/// `vmhost_devices=debug`, `warn,vmhost_memory=trace`), as `RUST_LOG`-style directives without
/// span or field matching. Unset, empty or not a valid list: warnings and errors, and a
/// directive that cannot be parsed is said so on stderr.
fn filter(directives: Option<&str>) -> Targets {
    let default = Targets::new().with_default(LevelFilter::WARN);
    match directives.map(str::trim).filter(|d| !d.is_empty()) {
        None => default,
        Some(d) => d.parse().unwrap_or_else(|e| {
            eprintln!(
                "vmhost: warning: VMHOST_LOG={d:?} is not a filter ({e}); showing warnings as \
                 without it. Write a level (info) or target=level pairs separated by commas \
                 (vmhost_devices=debug)"
            );
            default
        }),
    }
}

/// Starts the `vmhost-diag` thread; diagnostics go through its bounded buffer from now on.
/// Call it after the stop signals are blocked (the thread inherits the mask) and after any
/// fork (the cgroup v2 supervisor needs a single-threaded process).
pub fn start_writer() -> io::Result<()> {
    if BOUNDED.get().is_some() {
        return Ok(());
    }
    let drain = Drain::start_thread(
        DIAG_THREAD,
        sink_of(|bytes| {
            let mut err = io::stderr().lock();
            err.write_all(bytes)?;
            err.flush()
        }),
    )?;
    let _ = BOUNDED.set(Bounded {
        drain,
        dropped: AtomicU64::new(0),
    });
    Ok(())
}

/// Before the final lines: waits at most [`FLUSH_TIMEOUT`] for the buffered diagnostics to
/// reach stderr, then writes the count of dropped lines still unreported, directly.
pub fn finish() {
    let Some(b) = BOUNDED.get() else {
        return;
    };
    b.drain.sync(FLUSH_TIMEOUT);
    let n = b.dropped.swap(0, Ordering::Relaxed);
    if n > 0 {
        let _ = io::stderr().write_all(dropped_line(n).as_bytes());
    }
}

/// The subscriber's writer: one [`DiagLine`] per event.
struct DiagWriter;

impl<'a> MakeWriter<'a> for DiagWriter {
    type Writer = DiagLine;

    fn make_writer(&'a self) -> DiagLine {
        DiagLine
    }
}

/// One formatted event (`tracing_subscriber` writes each with a single `write_all`).
struct DiagLine;

impl Write for DiagLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match BOUNDED.get() {
            Some(b) => {
                b.push(buf);
                Ok(buf.len())
            }
            None => io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match BOUNDED.get() {
            Some(_) => Ok(()),
            None => io::stderr().flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::filter;
    use tracing::Level;

    #[test]
    fn vmhost_log_selects_levels_per_target() {
        let unset = filter(None);
        assert!(unset.would_enable("vmhost_devices", &Level::WARN));
        assert!(!unset.would_enable("vmhost_devices", &Level::INFO));
        assert_eq!(format!("{:?}", filter(Some(" "))), format!("{unset:?}"));

        let info = filter(Some("info"));
        assert!(info.would_enable("vmhost_memory::cells", &Level::INFO));
        assert!(!info.would_enable("vmhost_memory::cells", &Level::DEBUG));

        let devices = filter(Some("warn,vmhost_devices=debug"));
        assert!(devices.would_enable("vmhost_devices::block", &Level::DEBUG));
        assert!(!devices.would_enable("vmhost_memory", &Level::INFO));
        assert!(devices.would_enable("vmhost_memory", &Level::WARN));
    }

    #[test]
    fn a_vmhost_log_that_is_not_a_filter_shows_warnings() {
        let bad = filter(Some("vmhost_devices=loud"));
        assert!(bad.would_enable("vmhost_devices", &Level::WARN));
        assert!(!bad.would_enable("vmhost_devices", &Level::INFO));
    }
}
