//! COM1: a 16550A UART (vm-superio's `Serial`) at port [`COM1_BASE`], its interrupt on GSI
//! [`COM1_GSI`] through an eventfd registered with `KVM_IRQFD`, its output to the process's
//! stdout or a writer given in [`crate::VmOptions::serial_out`], and its input queue, which the
//! console thread ([`super::console`]) fills from a terminal.
//!
//! Every byte the guest transmits is counted, and the moment of the first one is kept for the
//! run report (how long the guest took to say anything).
//!
//! Output never blocks a vCPU: transmitted bytes go into a bounded buffer that the
//! `vmhost-serial` thread drains into the writer ([`super::output`]); bytes that do not fit
//! (nobody reads the output) are dropped and counted ([`SerialStats::dropped`]).

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use vm_superio::serial::NoEvents;
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub use super::output::FLUSH_TIMEOUT;
use super::output::{self, Drain};
use crate::control::lock;

/// First port of COM1.
pub const COM1_BASE: u16 = 0x3f8;
/// Ports of one UART.
pub const UART_PORTS: u16 = 8;
/// COM1's interrupt: ISA IRQ 4, which KVM's default routing sends to I/O APIC pin 4.
pub const COM1_GSI: u32 = 4;

/// Where a Linux guest's serial output goes (see [`crate::VmOptions::serial_out`]).
#[derive(Clone)]
pub struct SerialOut(pub Arc<Mutex<dyn Write + Send>>);

impl std::fmt::Debug for SerialOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SerialOut(..)")
    }
}

/// What the guest transmitted: how many bytes, and when the first one came.
#[derive(Debug, Default)]
pub struct SerialStats {
    first: OnceLock<Instant>,
    bytes: AtomicU64,
    dropped: AtomicU64,
}

impl SerialStats {
    /// When the guest transmitted its first byte.
    pub fn first_byte(&self) -> Option<Instant> {
        self.first.get().copied()
    }

    /// Bytes transmitted so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes dropped because the output buffer was full (nobody read them in time).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn record(&self, n: usize) {
        if n > 0 {
            self.first.get_or_init(Instant::now);
            self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

/// The UART's output: counts, then queues for the drain thread without waiting.
struct ConsoleWriter {
    drain: Arc<Drain>,
    stats: Arc<SerialStats>,
}

impl Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stats.record(buf.len());
        let taken = self.drain.push(buf);
        if taken < buf.len() {
            let lost = (buf.len() - taken) as u64;
            self.stats.dropped.fetch_add(lost, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The UART's interrupt line: one eventfd write per edge, which KVM turns into GSI 4.
struct IrqLine(EventFd);

impl Trigger for IrqLine {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

type Uart = Serial<IrqLine, NoEvents, ConsoleWriter>;

/// COM1 and its interrupt eventfd.
pub struct SerialConsole {
    uart: Mutex<Uart>,
    irq: EventFd,
    stats: Arc<SerialStats>,
    drain: Arc<Drain>,
    warned: AtomicBool,
}

impl std::fmt::Debug for SerialConsole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialConsole")
            .field("bytes", &self.stats.bytes())
            .finish()
    }
}

impl SerialConsole {
    /// A UART writing to `out` (stdout when `None`) through the `vmhost-serial` thread, with
    /// a fresh interrupt eventfd.
    pub fn new(out: Option<SerialOut>) -> io::Result<Self> {
        let irq = EventFd::new(EFD_NONBLOCK)?;
        let irq_line = IrqLine(irq.try_clone()?);
        let sink = match out {
            Some(o) => output::sink_of(move |b| {
                let mut w = lock(&o.0);
                w.write_all(b)?;
                w.flush()
            }),
            None => output::stdout_sink(),
        };
        let drain = Arc::new(Drain::start(sink)?);
        let stats = Arc::new(SerialStats::default());
        let writer = ConsoleWriter {
            drain: Arc::clone(&drain),
            stats: Arc::clone(&stats),
        };
        Ok(SerialConsole {
            uart: Mutex::new(Serial::new(irq_line, writer)),
            irq,
            stats,
            drain,
            warned: AtomicBool::new(false),
        })
    }

    /// Waits up to `timeout` for the output transmitted so far to reach the writer; true when
    /// it did (false: the writer is blocked or slow; the bytes stay queued).
    pub fn sync_output(&self, timeout: Duration) -> bool {
        self.drain.sync(timeout)
    }

    /// The eventfd to register as the irqfd of [`COM1_GSI`].
    pub fn irq_fd(&self) -> &EventFd {
        &self.irq
    }

    /// What the guest transmitted.
    pub fn stats(&self) -> Arc<SerialStats> {
        Arc::clone(&self.stats)
    }

    /// True for COM1's ports.
    pub fn claims(port: u16) -> bool {
        port >= COM1_BASE && port - COM1_BASE < UART_PORTS
    }

    fn offset(port: u16) -> u8 {
        u8::try_from(port - COM1_BASE).unwrap_or(0)
    }

    /// A guest read of UART register `port` (the value goes in the first byte).
    pub fn read(&self, port: u16, data: &mut [u8]) {
        let value = lock(&self.uart).read(Self::offset(port));
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = value;
        }
    }

    /// A guest write to UART register `port` (only the first byte counts).
    pub fn write(&self, port: u16, data: &[u8]) {
        let Some(&value) = data.first() else {
            return;
        };
        if let Err(e) = lock(&self.uart).write(Self::offset(port), value) {
            self.warn_once(&e);
        }
    }

    /// Queues host input for the guest; returns how many bytes fit in the receive FIFO.
    pub fn enqueue(&self, bytes: &[u8]) -> usize {
        let mut uart = lock(&self.uart);
        if uart.fifo_capacity() == 0 {
            return 0;
        }
        match uart.enqueue_raw_bytes(bytes) {
            Ok(n) => n,
            Err(e) => {
                drop(uart);
                self.warn_once(&e);
                0
            }
        }
    }

    fn warn_once(&self, e: &vm_superio::serial::Error<io::Error>) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, "serial console error (reported once)");
        }
    }
}

#[path = "serial_persist.rs"]
mod persist;
pub use persist::SAVE_FLUSH_WAIT;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Capture(Vec<u8>);

    impl Write for Capture {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn transmitted_bytes_reach_the_writer_and_raise_the_interrupt() {
        let capture = Arc::new(Mutex::new(Capture::default()));
        let s = SerialConsole::new(Some(SerialOut(capture.clone()))).unwrap();
        assert!(s.stats().first_byte().is_none());
        s.write(COM1_BASE + 1, &[0x02]); // IER: THR empty interrupt
        for b in b"hi\n" {
            s.write(COM1_BASE, &[*b]);
        }
        assert!(s.sync_output(Duration::from_secs(5)));
        assert_eq!(lock(&capture).0, b"hi\n");
        assert_eq!(s.stats().bytes(), 3);
        assert!(s.stats().first_byte().is_some());
        assert!(s.irq_fd().read().unwrap() >= 1, "interrupt raised");
        let mut lsr = [0u8; 1];
        s.read(COM1_BASE + 5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0, "THR empty");
    }

    /// `raise_pending` raises the interrupt only while one is pending and enabled.
    #[test]
    fn a_pending_interrupt_is_raised_again_only_while_pending() {
        let sink = || Some(SerialOut(Arc::new(Mutex::new(io::sink()))));
        let s = SerialConsole::new(sink()).unwrap();
        while s.irq_fd().read().is_ok() {}
        assert!(!s.raise_pending(), "nothing enabled, nothing pending");
        s.write(COM1_BASE + 1, &[0x02]); // IER: THR empty interrupt
        s.write(COM1_BASE, b"x");
        assert!(s.sync_output(Duration::from_secs(5)));
        while s.irq_fd().read().is_ok() {}
        assert!(s.raise_pending(), "THR empty, enabled, not acknowledged");
        assert!(s.irq_fd().read().unwrap() >= 1, "raised on the irqfd");
        let mut iir = [0u8; 1];
        s.read(COM1_BASE + 2, &mut iir); // reading IIR acknowledges THR empty
        assert_eq!(iir[0] & 0x0f, 0x02, "IIR said THR empty");
        assert!(!s.raise_pending(), "acknowledged: nothing pending");
    }

    /// LSR, IER, LCR, the scratch register, the divisor and buffered input survive a save
    /// and a restore into a fresh console; the restored one raises its pending interrupt.
    #[test]
    fn serial_state_round_trips_through_serde() {
        let sink = || Some(SerialOut(Arc::new(Mutex::new(io::sink()))));
        let a = SerialConsole::new(sink()).unwrap();
        a.write(COM1_BASE + 3, &[0x83]); // LCR: DLAB, 8 bits
        a.write(COM1_BASE, &[0x0c]); // divisor low: 9600 baud
        a.write(COM1_BASE + 3, &[0x03]); // DLAB off
        a.write(COM1_BASE + 7, &[0x5a]); // scratch
        a.write(COM1_BASE + 1, &[0x01]); // IER: data ready interrupt
        assert_eq!(a.enqueue(b"abc"), 3); // unread: the data-ready interrupt is pending
        let saved = a.save();
        let json = serde_json::to_string(&saved).unwrap();
        let back: vmhost_devices::persist::UartState = serde_json::from_str(&json).unwrap();
        assert_eq!(back, saved);

        let r = SerialConsole::new(sink()).unwrap();
        while r.irq_fd().read().is_ok() {}
        r.restore(&back).unwrap();
        assert!(
            r.irq_fd().read().unwrap() >= 1,
            "data-ready interrupt raised again"
        );
        let reg = |port: u16| {
            let mut b = [0u8; 1];
            r.read(COM1_BASE + port, &mut b);
            b[0]
        };
        assert_eq!(reg(7), 0x5a, "scratch");
        assert_eq!(reg(1), 0x01, "IER");
        assert_eq!(reg(3), 0x03, "LCR");
        assert_ne!(reg(5) & 1, 0, "LSR: data ready");
        assert_eq!(
            [reg(0), reg(0), reg(0)],
            *b"abc",
            "the unread input, in order"
        );
        assert_eq!(reg(5) & 1, 0, "LSR: drained");
        r.write(COM1_BASE + 3, &[0x83]);
        assert_eq!(reg(0), 0x0c, "divisor low");
    }

    #[test]
    fn an_oversized_input_buffer_is_refused() {
        let s = SerialConsole::new(Some(SerialOut(Arc::new(Mutex::new(io::sink()))))).unwrap();
        let mut bad = s.save();
        bad.in_buffer = vec![b'x'; 65];
        let err = s.restore(&bad).unwrap_err();
        assert!(err.to_string().contains("65 buffered input bytes"), "{err}");
    }

    #[test]
    fn queued_input_is_read_back_by_the_guest() {
        let s = SerialConsole::new(Some(SerialOut(Arc::new(Mutex::new(io::sink()))))).unwrap();
        assert_eq!(s.enqueue(b"ls\n"), 3);
        let mut b = [0u8; 1];
        s.read(COM1_BASE + 5, &mut b);
        assert_ne!(b[0] & 1, 0, "data ready");
        let mut got = Vec::new();
        for _ in 0..3 {
            s.read(COM1_BASE, &mut b);
            got.push(b[0]);
        }
        assert_eq!(got, b"ls\n");
        assert!(SerialConsole::claims(0x3ff) && !SerialConsole::claims(0x400));
    }
}
