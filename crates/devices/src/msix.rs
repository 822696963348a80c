//! MSI-X for a virtio-pci function: the vector table and pending-bit array the driver sees in
//! BAR 0, the capability's enable and function-mask bits, and which vector each queue (and the
//! configuration change) raises.
//!
//! It does not know KVM: a message goes out through an [`MsiSink`] (vmhost-vcpu's sends it with
//! `KVM_SIGNAL_MSI`). A message for a masked vector, or while the function is masked or MSI-X
//! is off, sets the vector's pending bit instead and goes out when the driver unmasks it, as
//! the PCI specification asks.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use vmhost_devices::msix::{Msix, MsiSink, MSIX_CONTROL_ENABLE};
//!
//! #[derive(Debug, Default)]
//! struct Sent(Mutex<Vec<(u64, u32)>>);
//! impl MsiSink for Sent {
//!     fn send(&self, address: u64, data: u32) -> std::io::Result<()> {
//!         self.0.lock().unwrap().push((address, data));
//!         Ok(())
//!     }
//! }
//! let sent = Arc::new(Sent::default());
//! let msix = Msix::new(2, 1, sent.clone());
//! msix.table_write(0, &0xfee0_0000u32.to_le_bytes()); // vector 0: address
//! msix.table_write(8, &0x41u32.to_le_bytes()); // data
//! msix.table_write(12, &0u32.to_le_bytes()); // unmasked
//! assert_eq!(msix.set_queue_vector(0, 0), 0);
//! msix.set_control(MSIX_CONTROL_ENABLE);
//! msix.signal_queue(0).unwrap();
//! assert_eq!(*sent.0.lock().unwrap(), vec![(0xfee0_0000, 0x41)]);
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

/// "No vector" in the virtio-pci `msix_config` and `queue_msix_vector` registers.
pub const MSIX_NO_VECTOR: u16 = 0xffff;
/// Message control: MSI-X enabled.
pub const MSIX_CONTROL_ENABLE: u16 = 1 << 15;
/// Message control: every vector of the function masked.
pub const MSIX_CONTROL_FUNCTION_MASK: u16 = 1 << 14;
/// Bytes per table entry.
pub const MSIX_ENTRY_SIZE: u64 = 16;
/// Most vectors a function has (the pending bits fit one 64-bit word).
pub const MSIX_MAX_VECTORS: u16 = 64;

/// Where MSI messages go (the VMM's interrupt controller).
pub trait MsiSink: Send + Sync + std::fmt::Debug {
    /// Delivers the message `data` written to `address`.
    fn send(&self, address: u64, data: u32) -> std::io::Result<()>;
}

/// One table entry as the driver wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixEntry {
    /// Message address.
    pub address: u64,
    /// Message data.
    pub data: u32,
    /// Vector control bit 0.
    pub masked: bool,
}

impl Default for MsixEntry {
    /// Masked, as after a reset.
    fn default() -> Self {
        MsixEntry {
            address: 0,
            data: 0,
            masked: true,
        }
    }
}

/// The MSI-X state that moves with the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixState {
    /// The vector table.
    pub entries: Vec<MsixEntry>,
    /// Pending bits, bit `n` for vector `n`.
    pub pending: u64,
    /// MSI-X enable.
    pub enabled: bool,
    /// Function mask.
    pub function_masked: bool,
    /// The configuration-change vector.
    pub config_vector: u16,
    /// Each queue's vector.
    pub queue_vectors: Vec<u16>,
}

/// A function's MSI-X vectors.
#[derive(Debug)]
pub struct Msix {
    state: Mutex<MsixState>,
    /// A restored function before its guest's interrupt controller is loaded: messages are
    /// pending until [`Msix::release`].
    held: AtomicBool,
    sink: Arc<dyn MsiSink>,
}

impl Msix {
    /// `vectors` table entries (at most [`MSIX_MAX_VECTORS`]) for a device with `queues`
    /// queues, sending through `sink`.
    pub fn new(vectors: u16, queues: usize, sink: Arc<dyn MsiSink>) -> Self {
        let vectors = vectors.clamp(1, MSIX_MAX_VECTORS);
        Msix {
            state: Mutex::new(MsixState {
                entries: vec![MsixEntry::default(); usize::from(vectors)],
                pending: 0,
                enabled: false,
                function_masked: false,
                config_vector: MSIX_NO_VECTOR,
                queue_vectors: vec![MSIX_NO_VECTOR; queues],
            }),
            held: AtomicBool::new(false),
            sink,
        }
    }

    fn lock(&self) -> MutexGuard<'_, MsixState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Number of table entries.
    pub fn vectors(&self) -> u16 {
        u16::try_from(self.lock().entries.len()).unwrap_or(MSIX_MAX_VECTORS)
    }

    /// The table's size in bytes.
    pub fn table_size(&self) -> u64 {
        u64::from(self.vectors()) * MSIX_ENTRY_SIZE
    }

    /// Whether the driver enabled MSI-X (interrupts then go nowhere else).
    pub fn enabled(&self) -> bool {
        self.lock().enabled
    }

    /// The capability's message control: the enable and mask bits and the table size - 1.
    pub fn control(&self) -> u16 {
        let s = self.lock();
        let size = u16::try_from(s.entries.len().saturating_sub(1)).unwrap_or(0);
        size | if s.enabled { MSIX_CONTROL_ENABLE } else { 0 }
            | if s.function_masked {
                MSIX_CONTROL_FUNCTION_MASK
            } else {
                0
            }
    }

    /// The driver wrote message control: takes the enable and mask bits, and sends what was
    /// pending and is now deliverable.
    pub fn set_control(&self, control: u16) {
        let mut s = self.lock();
        s.enabled = control & MSIX_CONTROL_ENABLE != 0;
        s.function_masked = control & MSIX_CONTROL_FUNCTION_MASK != 0;
        self.flush(s);
    }

    /// A read of the vector table at byte `offset`; bytes outside it read as zero.
    pub fn table_read(&self, offset: u64, data: &mut [u8]) {
        let s = self.lock();
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = offset
                .checked_add(i as u64)
                .and_then(|o| entry_byte(&s.entries, o))
                .unwrap_or(0);
        }
    }

    /// A write to the vector table at byte `offset` (4 or 8 bytes, aligned; others are
    /// ignored). Unmasking a vector sends its pending message.
    pub fn table_write(&self, offset: u64, data: &[u8]) {
        let mut s = self.lock();
        let words: Vec<(u64, u32)> = match data.len() {
            4 if offset % 4 == 0 => vec![(offset, le32(data))],
            8 if offset % 8 == 0 => {
                vec![(offset, le32(&data[..4])), (offset + 4, le32(&data[4..]))]
            }
            _ => return,
        };
        for (at, value) in words {
            let Some(entry) = usize::try_from(at / MSIX_ENTRY_SIZE)
                .ok()
                .and_then(|i| s.entries.get_mut(i))
            else {
                return;
            };
            match at % MSIX_ENTRY_SIZE {
                0 => entry.address = (entry.address & !0xffff_ffff) | u64::from(value),
                4 => entry.address = (entry.address & 0xffff_ffff) | (u64::from(value) << 32),
                8 => entry.data = value,
                _ => entry.masked = value & 1 != 0,
            }
        }
        self.flush(s);
    }

    /// A read of the pending-bit array at byte `offset`.
    pub fn pba_read(&self, offset: u64, data: &mut [u8]) {
        let pending = self.lock().pending.to_le_bytes();
        for (i, byte) in data.iter_mut().enumerate() {
            *byte = offset
                .checked_add(i as u64)
                .and_then(|o| usize::try_from(o).ok())
                .and_then(|o| pending.get(o).copied())
                .unwrap_or(0);
        }
    }

    /// Sets the configuration-change vector; returns what the register reads back
    /// ([`MSIX_NO_VECTOR`] for a vector the table does not have).
    pub fn set_config_vector(&self, vector: u16) -> u16 {
        let mut s = self.lock();
        s.config_vector = checked_vector(&s, vector);
        s.config_vector
    }

    /// The configuration-change vector.
    pub fn config_vector(&self) -> u16 {
        self.lock().config_vector
    }

    /// Sets queue `queue`'s vector; returns what the register reads back.
    pub fn set_queue_vector(&self, queue: usize, vector: u16) -> u16 {
        let mut s = self.lock();
        let vector = checked_vector(&s, vector);
        match s.queue_vectors.get_mut(queue) {
            Some(v) => {
                *v = vector;
                vector
            }
            None => MSIX_NO_VECTOR,
        }
    }

    /// Queue `queue`'s vector ([`MSIX_NO_VECTOR`] for a queue that does not exist).
    pub fn queue_vector(&self, queue: usize) -> u16 {
        let s = self.lock();
        s.queue_vectors
            .get(queue)
            .copied()
            .unwrap_or(MSIX_NO_VECTOR)
    }

    /// The device reset: the queue and configuration vectors are unassigned (the table, which
    /// belongs to the PCI function, stays).
    pub fn reset_vectors(&self) {
        let mut s = self.lock();
        s.config_vector = MSIX_NO_VECTOR;
        s.queue_vectors.iter_mut().for_each(|v| *v = MSIX_NO_VECTOR);
    }

    /// Raises queue `queue`'s vector, if it has one.
    pub fn signal_queue(&self, queue: usize) -> std::io::Result<()> {
        let vector = self.queue_vector(queue);
        self.trigger(vector)
    }

    /// Raises the configuration-change vector, if there is one.
    pub fn signal_config(&self) -> std::io::Result<()> {
        let vector = self.config_vector();
        self.trigger(vector)
    }

    /// Sends vector `vector`'s message, or marks it pending while it is masked.
    pub fn trigger(&self, vector: u16) -> std::io::Result<()> {
        let mut s = self.lock();
        let Some(entry) = s.entries.get(usize::from(vector)).copied() else {
            return Ok(());
        };
        if !s.enabled || s.function_masked || entry.masked || self.held.load(Ordering::SeqCst) {
            s.pending |= 1 << vector;
            return Ok(());
        }
        drop(s);
        self.sink.send(entry.address, entry.data)
    }

    /// A restored function, once its guest's vCPUs and LAPICs are loaded and before the guest
    /// runs: messages go out again, the ones pending first. Returns how many went out.
    pub fn release(&self) -> usize {
        self.held.store(false, Ordering::SeqCst);
        let s = self.lock();
        self.flush(s)
    }

    fn flush(&self, mut s: MutexGuard<'_, MsixState>) -> usize {
        if !s.enabled || s.function_masked || s.pending == 0 || self.held.load(Ordering::SeqCst) {
            return 0;
        }
        let mut due = Vec::new();
        for (n, entry) in s.entries.iter().enumerate() {
            if s.pending & (1 << n) != 0 && !entry.masked {
                due.push((n, entry.address, entry.data));
            }
        }
        for (n, _, _) in &due {
            s.pending &= !(1 << n);
        }
        drop(s);
        for (_, address, data) in &due {
            if let Err(e) = self.sink.send(*address, *data) {
                tracing::warn!(error = %e, "MSI-X: cannot send a pending message");
            }
        }
        due.len()
    }

    /// The state that moves with the VM.
    pub fn save(&self) -> MsixState {
        self.lock().clone()
    }

    /// Takes over a saved state, which must have this function's table and queue count.
    /// Messages stay pending until [`Msix::release`].
    pub fn restore(&self, saved: &MsixState) -> Result<(), String> {
        let mut s = self.lock();
        if saved.entries.len() != s.entries.len()
            || saved.queue_vectors.len() != s.queue_vectors.len()
        {
            return Err(format!(
                "MSI-X: saved {} vectors for {} queues, this device has {} for {}",
                saved.entries.len(),
                saved.queue_vectors.len(),
                s.entries.len(),
                s.queue_vectors.len()
            ));
        }
        *s = saved.clone();
        self.held.store(true, Ordering::SeqCst);
        Ok(())
    }
}

fn checked_vector(s: &MsixState, vector: u16) -> u16 {
    if usize::from(vector) < s.entries.len() {
        vector
    } else {
        MSIX_NO_VECTOR
    }
}

fn entry_byte(entries: &[MsixEntry], offset: u64) -> Option<u8> {
    let entry = entries.get(usize::try_from(offset / MSIX_ENTRY_SIZE).ok()?)?;
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&entry.address.to_le_bytes());
    bytes[8..12].copy_from_slice(&entry.data.to_le_bytes());
    bytes[12..].copy_from_slice(&u32::from(entry.masked).to_le_bytes());
    bytes
        .get(usize::try_from(offset % MSIX_ENTRY_SIZE).ok()?)
        .copied()
}

fn le32(bytes: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[..4]);
    u32::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default)]
    struct Sent(Mutex<Vec<(u64, u32)>>);
    impl MsiSink for Sent {
        fn send(&self, address: u64, data: u32) -> std::io::Result<()> {
            self.0.lock().unwrap().push((address, data));
            Ok(())
        }
    }

    fn program(m: &Msix, vector: u64, address: u64, data: u32) {
        let at = vector * MSIX_ENTRY_SIZE;
        m.table_write(at, &address.to_le_bytes());
        m.table_write(at + 8, &data.to_le_bytes());
    }

    #[test]
    fn a_masked_vector_is_pending_until_unmasked() {
        let sent = Arc::new(Sent::default());
        let m = Msix::new(3, 2, sent.clone());
        assert_eq!(m.control(), 2, "table size - 1, disabled");
        program(&m, 1, 0xfee0_1000, 0x22);
        assert_eq!(m.set_queue_vector(1, 1), 1);
        assert_eq!(m.set_queue_vector(0, 7), MSIX_NO_VECTOR, "no such vector");
        m.set_control(MSIX_CONTROL_ENABLE);
        m.signal_queue(1).unwrap();
        m.signal_queue(0).unwrap();
        assert!(
            sent.0.lock().unwrap().is_empty(),
            "vector 1 is still masked"
        );
        let mut pba = [0u8; 8];
        m.pba_read(0, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 0b10);
        m.table_write(MSIX_ENTRY_SIZE + 12, &0u32.to_le_bytes());
        assert_eq!(*sent.0.lock().unwrap(), vec![(0xfee0_1000, 0x22)]);
        m.pba_read(0, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 0);
    }

    #[test]
    fn the_function_mask_holds_every_vector() {
        let sent = Arc::new(Sent::default());
        let m = Msix::new(2, 1, sent.clone());
        program(&m, 0, 0xfee0_0000, 0x30);
        m.table_write(12, &0u32.to_le_bytes());
        m.set_config_vector(0);
        m.set_control(MSIX_CONTROL_ENABLE | MSIX_CONTROL_FUNCTION_MASK);
        m.signal_config().unwrap();
        assert!(sent.0.lock().unwrap().is_empty());
        m.set_control(MSIX_CONTROL_ENABLE);
        assert_eq!(sent.0.lock().unwrap().len(), 1);
        let mut entry = [0u8; 16];
        m.table_read(0, &mut entry);
        assert_eq!(&entry[8..12], &0x30u32.to_le_bytes());
    }

    #[test]
    fn state_round_trips_and_refuses_another_shape() {
        let m = Msix::new(2, 1, Arc::new(Sent::default()));
        program(&m, 1, 0xfee0_2000, 5);
        m.set_queue_vector(0, 1);
        let saved = m.save();
        let sent = Arc::new(Sent::default());
        let other = Msix::new(2, 1, sent.clone());
        other.restore(&saved).unwrap();
        assert_eq!(other.save(), saved);
        // Held until released: a message of the restored device waits for the guest's LAPICs.
        other.table_write(MSIX_ENTRY_SIZE + 12, &0u32.to_le_bytes());
        other.set_control(MSIX_CONTROL_ENABLE);
        other.signal_queue(0).unwrap();
        assert!(sent.0.lock().unwrap().is_empty());
        assert_eq!(other.release(), 1);
        assert_eq!(*sent.0.lock().unwrap(), vec![(0xfee0_2000, 5)]);
        assert!(Msix::new(3, 1, Arc::new(Sent::default()))
            .restore(&saved)
            .is_err());
    }
}
