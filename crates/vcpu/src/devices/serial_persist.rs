//! COM1's state that moves with the VM: vm-superio's `SerialState` (the 16550A's registers
//! and the bytes received and not read yet), as [`UartState`] serde data. The output buffer
//! is not state: bytes the guest wrote are flushed to the old host's writer before the save
//! (see [`SerialConsole::save`]); the writer of the restored VM is its own.

use std::sync::Arc;
use std::time::Duration;

use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::Serial;
use vmhost_devices::persist::{UartState, UART_FIFO};
use vmhost_devices::PersistError;

use super::{ConsoleWriter, IrqLine, SerialConsole};
use crate::control::lock;

/// How long a save waits for the guest's last output to reach the writer.
pub const SAVE_FLUSH_WAIT: Duration = Duration::from_secs(1);

impl SerialConsole {
    /// The UART's state. The output transmitted so far is flushed to the writer first, for
    /// at most [`SAVE_FLUSH_WAIT`] (a writer that does not read keeps it queued here).
    pub fn save(&self) -> UartState {
        self.sync_output(SAVE_FLUSH_WAIT);
        let s = lock(&self.uart).state();
        UartState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    /// Takes over a saved UART state (before the guest runs). Refused, with the UART
    /// unchanged, when the buffered input is larger than the FIFO. vm-superio raises a pending
    /// interrupt at once; a restore runs before the irqchip is loaded and before any vCPU
    /// exists, where that edge is lost, so the VM raises it again with
    /// [`SerialConsole::raise_pending`] once its vCPUs are loaded.
    pub fn restore(&self, saved: &UartState) -> Result<(), PersistError> {
        if saved.in_buffer.len() > UART_FIFO {
            return Err(PersistError::Serial(format!(
                "{} buffered input bytes, the FIFO holds {UART_FIFO}",
                saved.in_buffer.len()
            )));
        }
        let state = SerialState {
            baud_divisor_low: saved.baud_divisor_low,
            baud_divisor_high: saved.baud_divisor_high,
            interrupt_enable: saved.interrupt_enable,
            interrupt_identification: saved.interrupt_identification,
            line_control: saved.line_control,
            line_status: saved.line_status,
            modem_control: saved.modem_control,
            modem_status: saved.modem_status,
            scratch: saved.scratch,
            in_buffer: saved.in_buffer.clone(),
        };
        let irq = self.irq.try_clone().map_err(|e| {
            PersistError::Serial(format!("cannot clone the interrupt eventfd: {e}"))
        })?;
        let writer = ConsoleWriter {
            drain: Arc::clone(&self.drain),
            stats: Arc::clone(&self.stats),
        };
        let uart = Serial::from_state(&state, IrqLine(irq), NoEvents, writer)
            .map_err(|e| PersistError::Serial(e.to_string()))?;
        *lock(&self.uart) = uart;
        Ok(())
    }

    /// Raises the UART's interrupt on the irqfd when one is pending and enabled (transmitter
    /// empty, or data ready): for a restored guest once every vCPU and its LAPIC exist. On the
    /// source the guest's last THR write may have raised an edge that KVM had not injected
    /// yet (an IOAPIC route's irqfd injects from a workqueue) when the VM was saved; the
    /// saved UART still says pending, and without this the guest's driver waits for it
    /// forever. Returns whether it raised one.
    pub fn raise_pending(&self) -> bool {
        let s = lock(&self.uart).state();
        let thr = s.interrupt_enable & IER_THR_EMPTY != 0
            && s.interrupt_identification & IIR_THR_EMPTY != 0;
        let rda = s.interrupt_enable & IER_RDA != 0 && s.interrupt_identification & IIR_RDA != 0;
        (thr || rda) && self.irq.write(1).is_ok()
    }
}

/// IER: data-ready interrupt enable (as vm-superio).
const IER_RDA: u8 = 0x01;
/// IER: transmitter-empty interrupt enable.
const IER_THR_EMPTY: u8 = 0x02;
/// IIR: transmitter empty pending.
const IIR_THR_EMPTY: u8 = 0x02;
/// IIR: data ready pending.
const IIR_RDA: u8 = 0x04;
