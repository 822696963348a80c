//! virtio-rng: fills the guest's buffers from the host's `getrandom(2)`.

use tracing::warn;
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::Queue;
use vmhost_memory::GuestMemoryMmap;

use crate::chain::{Chain, ChainError, ChainLimits};
use crate::device::{serve_single_queue, DeviceError, VirtioDevice};
use crate::persist::{DeviceState, StateError};
use crate::sys::getrandom;

/// Size of the request queue.
pub const RNG_QUEUE_SIZE: u16 = 256;
/// Most bytes handed out per request; a larger buffer gets this many (the driver is told how
/// many through the used length).
pub const RNG_MAX_REQUEST: usize = 64 * 1024;

const LIMITS: ChainLimits = ChainLimits {
    max_segments: RNG_QUEUE_SIZE as usize,
    max_readable: 0,
    max_writable: u32::MAX as u64,
};

/// Why the entropy device failed (kept for a uniform device API; getrandom errors are logged
/// and the request is answered with 0 bytes).
#[derive(Debug, thiserror::Error)]
pub enum RngError {
    /// getrandom(2) failed.
    #[error("virtio-rng: getrandom failed")]
    GetRandom(#[source] std::io::Error),
}

/// A virtio-rng device.
///
/// ```
/// use vmhost_devices::{Rng, VirtioDevice};
/// let rng = Rng::new();
/// assert_eq!(rng.device_type(), 4);
/// assert!(rng.config().is_empty());
/// ```
#[derive(Debug)]
pub struct Rng {
    queue_sizes: [u16; 1],
    buf: Vec<u8>,
    error_logged: bool,
}

impl Default for Rng {
    fn default() -> Self {
        Self::new()
    }
}

impl Rng {
    /// A new entropy device.
    pub fn new() -> Self {
        Rng {
            queue_sizes: [RNG_QUEUE_SIZE],
            buf: vec![0; RNG_MAX_REQUEST],
            error_logged: false,
        }
    }

    fn serve(&mut self, chain: &Chain, mem: &GuestMemoryMmap) -> Result<u32, ChainError> {
        if !chain.readable.is_empty() {
            return Err(ChainError::Direction {
                head: chain.head,
                what: "entropy buffers must be device-writable only",
            });
        }
        let want = usize::try_from(chain.writable_len())
            .unwrap_or(usize::MAX)
            .min(RNG_MAX_REQUEST);
        let n = match getrandom(&mut self.buf[..want]) {
            Ok(n) => n,
            Err(e) => {
                if !self.error_logged {
                    self.error_logged = true;
                    warn!(error = %RngError::GetRandom(e), "virtio-rng: answering with no bytes");
                }
                0
            }
        };
        chain.write_at(mem, 0, &self.buf[..n])?;
        // n <= RNG_MAX_REQUEST, which fits in u32.
        Ok(u32::try_from(n).unwrap_or(0))
    }
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX
    }

    fn config(&self) -> Vec<u8> {
        Vec::new()
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemoryMmap,
    ) -> Result<bool, DeviceError> {
        serve_single_queue(index, queue, mem, &LIMITS, |c, m| self.serve(c, m))
    }

    /// Each request is served whole: the entropy device keeps nothing between them.
    fn save_state(&mut self, _queues: &mut [Queue]) -> Result<DeviceState, StateError> {
        Ok(DeviceState::Rng(RngState {}))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), StateError> {
        match state {
            DeviceState::Rng(RngState {}) => Ok(()),
            other => Err(StateError::Kind {
                saved: other.kind().to_string(),
                built: "rng".to_string(),
            }),
        }
    }
}

/// virtio-rng's own state: none (what the driver set up is in the transport's state).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngState {}

#[cfg(test)]
#[path = "rng_tests.rs"]
mod tests;
