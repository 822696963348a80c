//! The vCPUs' path to a virtio-pci function: configuration mechanism #1
//! (`vmhost_devices::pci::PciRoot`, ports 0xcf8-0xcff) and BAR 0 on the bus
//! (`MmioBus::insert_pci`: the common configuration, ISR, notification, device configuration,
//! MSI-X table and pending bits), with virtio-rng behind it over guest RAM the input fills, as
//! `vmhost_vcpu::virtio::attach(.., Transport::Pci, ..)` builds it; MSI-X messages go to a sink
//! that counts them. Any sequence of port and BAR reads and writes of any width, and queue
//! notifications as the I/O thread delivers them.
//!
//! Invariants: a port access is taken exactly when the bus claims the port; a BAR access is
//! taken exactly when it is inside the 4 KiB window; the host bridge and the function keep
//! their ids (read-only bytes stay read-only); a message is only ever sent with MSI-X enabled,
//! and is what an unmasked table entry holds; nothing panics.
//!
//! Input: `[n_ops, n_ops × (op, where 0-1, value 0-3), guest memory image...]`.
#![no_main]

use std::sync::{Arc, Mutex, Weak};

use libfuzzer_sys::fuzz_target;
use vm_memory::{Bytes, GuestAddress};
use vmhost_devices::bus::MmioBus;
use vmhost_devices::msix::{MsiSink, Msix};
use vmhost_devices::pci::{PciRoot, PCI_CONFIG_ADDRESS};
use vmhost_devices::virtio_pci::{self, msix_vectors, VirtioPciFront};
use vmhost_devices::{Interrupt, MmioTransport, Rng, VirtioDevice};
use vmhost_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const BASE: u64 = 0xd000_0000;
const WINDOW: u64 = 0x1000;
const RAM: usize = 64 << 10;

/// Every message sent, and whether MSI-X was on when it was.
#[derive(Debug)]
struct Sink {
    sent: Mutex<Vec<(u64, u32)>>,
    /// The function's vectors (weak: they hold the sink).
    msix: Mutex<Weak<Msix>>,
}

impl MsiSink for Sink {
    fn send(&self, address: u64, data: u32) -> std::io::Result<()> {
        let msix = self.msix.lock().unwrap().upgrade().expect("the function's vectors");
        assert!(msix.enabled(), "a message sent with MSI-X off");
        let state = msix.save();
        assert!(
            state
                .entries
                .iter()
                .any(|e| e.address == address && e.data == data && !e.masked),
            "message {data:#x} to {address:#x}, which no unmasked table entry holds"
        );
        self.sent.lock().unwrap().push((address, data));
        Ok(())
    }
}

fn config32(root: &PciRoot, device: u32, register: u32) -> u32 {
    let address = 0x8000_0000 | (device << 11) | register;
    assert!(root.pio_write(PCI_CONFIG_ADDRESS, &address.to_le_bytes()));
    let mut b = [0u8; 4];
    assert!(root.pio_read(0xcfc, &mut b));
    u32::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    let [n_ops, rest @ ..] = data else {
        return;
    };
    let Some((ops, image)) = rest.split_at_checked(usize::from(n_ops % 64) * 8) else {
        return;
    };
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM)]).expect("guest memory");
    let image = &image[..image.len().min(RAM)];
    mem.write_slice(image, GuestAddress(0)).expect("guest image");
    let sink = Arc::new(Sink {
        sent: Mutex::new(Vec::new()),
        msix: Mutex::new(Weak::new()),
    });
    let device: Box<dyn VirtioDevice> = Box::new(Rng::new());
    let queues = device.queue_max_sizes().len();
    let msix = Arc::new(Msix::new(msix_vectors(queues), queues, sink.clone()));
    *sink.msix.lock().unwrap() = Arc::downgrade(&msix);
    let function = Arc::new(virtio_pci::function(1, 4, BASE as u32, msix.clone()));
    let front = Arc::new(VirtioPciFront::new(function.clone(), queues).expect("front"));
    let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    let interrupt = Arc::new(Interrupt::with_msix(irq, msix.clone()));
    interrupt.set_ack_on_read(true);
    let transport = MmioTransport::new(device, mem, interrupt).expect("transport");
    let transport = Arc::new(Mutex::new(transport));
    let mut bus = MmioBus::default();
    bus.insert_pci(BASE, transport.clone(), front).expect("bus");
    let root = PciRoot::new(vec![function]);
    let (bridge_id, function_id) = (config32(&root, 0, 0), config32(&root, 1, 0));

    for op in ops.chunks_exact(8) {
        let (kind, len) = (op[0] % 4, [1usize, 2, 4, 8][usize::from(op[1] % 4)]);
        let at = u16::from_le_bytes([op[2], op[3]]);
        let value = u32::from_le_bytes([op[4], op[5], op[6], op[7]]).to_le_bytes();
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&value);
        bytes[4..].copy_from_slice(&value);
        let buf = &mut bytes[..len];
        match kind {
            0 | 1 => {
                let port = 0xcf8 + at % 8;
                let claimed = PciRoot::claims(port, len);
                let taken = if kind == 0 {
                    root.pio_read(port, buf)
                } else {
                    root.pio_write(port, buf)
                };
                assert_eq!(taken, claimed, "port {port:#x}, {len} bytes");
            }
            2 | 3 => {
                let gpa = BASE - WINDOW + u64::from(at) % (3 * WINDOW);
                let inside = (BASE..BASE + WINDOW).contains(&gpa);
                let taken = if kind == 2 {
                    bus.read(gpa, buf)
                } else {
                    bus.write(gpa, buf)
                };
                assert_eq!(taken, inside, "BAR access at {gpa:#x}");
            }
            _ => unreachable!(),
        }
        if op[0] & 0x80 != 0 {
            transport.lock().unwrap().notify(usize::from(op[1]) % (queues + 1));
        }
    }
    assert_eq!(config32(&root, 0, 0), bridge_id, "the host bridge's ids");
    assert_eq!(config32(&root, 1, 0), function_id, "the function's ids");
});
