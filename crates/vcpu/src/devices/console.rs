//! The console input thread, `vmhost-stdin`: while a Linux guest runs with its serial console
//! on a terminal, it reads the terminal and queues the bytes in COM1's receive FIFO.
//!
//! The terminal is switched to non-canonical mode without echo (the guest echoes), keeping
//! signal keys, so Ctrl-C still reaches vmhost (which stops the VM); the previous mode is
//! restored when the thread ends. The thread polls with a short timeout so that it notices the
//! end of the run without a byte to read.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::serial::SerialConsole;
use crate::sys;

/// How often the thread checks for the end of the run.
const POLL: Duration = Duration::from_millis(100);
/// Wait when the guest's receive FIFO is full.
const FIFO_FULL_WAIT: Duration = Duration::from_millis(5);

/// Where a Linux guest's serial input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConsoleInput {
    /// The process's stdin, when it is a terminal and the serial output goes to stdout.
    #[default]
    StdinIfTerminal,
    /// No input.
    None,
}

/// The running console input thread; [`ConsoleReader::finish`] ends it.
#[derive(Debug)]
pub struct ConsoleReader {
    done: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl ConsoleReader {
    /// Starts the thread when `input` asks for stdin and stdin is a terminal.
    pub fn start(
        input: ConsoleInput,
        serial: &Arc<SerialConsole>,
    ) -> std::io::Result<Option<ConsoleReader>> {
        if input != ConsoleInput::StdinIfTerminal || !std::io::stdin().is_terminal() {
            return Ok(None);
        }
        let done = Arc::new(AtomicBool::new(false));
        let thread = {
            let (done, serial) = (Arc::clone(&done), Arc::clone(serial));
            std::thread::Builder::new()
                .name("vmhost-stdin".into())
                .spawn(move || read_loop(&serial, &done))?
        };
        Ok(Some(ConsoleReader { done, thread }))
    }

    /// Ends the thread (within one poll interval) and restores the terminal.
    pub fn finish(self) {
        self.done.store(true, Ordering::SeqCst);
        if self.thread.join().is_err() {
            tracing::warn!("the console input thread panicked");
        }
    }
}

fn read_loop(serial: &SerialConsole, done: &AtomicBool) {
    let _raw = match sys::RawTerminal::enter(libc::STDIN_FILENO) {
        Ok(guard) => Some(guard),
        Err(e) => {
            tracing::warn!(error = %e, "cannot switch the terminal to raw input; keeping its mode");
            None
        }
    };
    vmhost_seccomp::install_current_or_abort(vmhost_seccomp::ThreadKind::Stdin);
    let mut buf = [0u8; 64];
    while !done.load(Ordering::SeqCst) {
        match sys::poll_readable(libc::STDIN_FILENO, POLL) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                tracing::warn!(error = %e, "poll on stdin failed; console input ends");
                return;
            }
        }
        let n = match sys::read_fd(libc::STDIN_FILENO, &mut buf) {
            Ok(0) => return, // end of input
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::warn!(error = %e, "reading stdin failed; console input ends");
                return;
            }
        };
        let mut pending = &buf[..n];
        while !pending.is_empty() && !done.load(Ordering::SeqCst) {
            let queued = serial.enqueue(pending);
            pending = &pending[queued..];
            if !pending.is_empty() {
                std::thread::sleep(FIFO_FULL_WAIT);
            }
        }
    }
}
