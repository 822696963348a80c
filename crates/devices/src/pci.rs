//! A PCI bus 0 for the virtio-pci devices: configuration mechanism #1 (ports `0xcf8`-`0xcff`),
//! a host bridge at 00:00.0 and one function per virtio device, each with a 32-bit memory
//! BAR 0 that holds its virtio-pci structures and MSI-X table ([`crate::virtio_pci`]).
//!
//! The configuration space of a function is 256 bytes with a per-byte write mask: the
//! command register, BAR 0's address bits (so the driver can size it), the interrupt line and
//! MSI-X's enable and function-mask bits are writable; everything else reads as built. The
//! BARs are assigned by vmhost (the plan's slot bases, inside the window the DSDT gives the
//! host bridge) and the guest keeps them; a guest that moves one is warned about once, and
//! the device stays where the plan put it.
//!
//! ```
//! use vmhost_devices::pci::PciRoot;
//! let root = PciRoot::new(Vec::new());
//! root.pio_write(0xcf8, &0x8000_0000u32.to_le_bytes()); // 00:00.0, register 0
//! let mut id = [0u8; 4];
//! root.pio_read(0xcfc, &mut id);
//! assert_eq!(u32::from_le_bytes(id) & 0xffff, 0x8086); // the host bridge's vendor
//! ```

use std::sync::{Arc, Mutex, PoisonError};

use crate::msix::Msix;

/// The configuration address port.
pub const PCI_CONFIG_ADDRESS: u16 = 0xcf8;
/// The first configuration data port (`0xcfc`-`0xcff`).
pub const PCI_CONFIG_DATA: u16 = 0xcfc;
/// Size of BAR 0 of a virtio function.
pub const VIRTIO_PCI_BAR_SIZE: u64 = 0x1000;

const CONFIG_SIZE: usize = 256;
const STATUS_CAP_LIST: u16 = 1 << 4;
const CAP_ID_MSIX: u8 = 0x11;
/// Capability id of a vendor-specific capability (virtio-pci's structures).
pub const CAP_ID_VENDOR: u8 = 0x09;
const BAR0: usize = 0x10;
const CAP_POINTER: usize = 0x34;
const INTERRUPT_LINE: usize = 0x3c;

/// The configuration space of one function.
#[derive(Debug, Clone)]
pub struct PciConfig {
    bytes: [u8; CONFIG_SIZE],
    wmask: [u8; CONFIG_SIZE],
    next_cap: usize,
    last_cap: Option<usize>,
    msix_cap: Option<usize>,
    bar0: u32,
    moved_logged: bool,
}

impl PciConfig {
    /// A type-0 header: vendor, device, revision, class (base, sub, interface in the top 24
    /// bits), subsystem vendor and id.
    pub fn new(vendor: u16, device: u16, revision: u8, class: u32, subsystem: (u16, u16)) -> Self {
        let mut c = PciConfig {
            bytes: [0; CONFIG_SIZE],
            wmask: [0; CONFIG_SIZE],
            next_cap: 0x40,
            last_cap: None,
            msix_cap: None,
            bar0: 0,
            moved_logged: false,
        };
        c.put16(0x00, vendor);
        c.put16(0x02, device);
        c.put32(0x08, (class << 8) | u32::from(revision));
        c.put16(0x2c, subsystem.0);
        c.put16(0x2e, subsystem.1);
        // Command: I/O, memory and bus-master enables, INTx disable.
        c.wmask[0x04] = 0x07;
        c.wmask[0x05] = 0x04;
        c.wmask[INTERRUPT_LINE] = 0xff;
        c
    }

    /// A 32-bit non-prefetchable memory BAR 0 of `size` bytes (a power of two, at least 16)
    /// at `base`.
    pub fn set_bar0(&mut self, base: u32, size: u32) {
        self.bar0 = base;
        self.put32(BAR0, base);
        let mask = !(size.max(16) - 1);
        self.wmask[BAR0..BAR0 + 4].copy_from_slice(&mask.to_le_bytes());
    }

    /// Appends a capability (`body` without its id and next bytes); returns its offset.
    pub fn add_capability(&mut self, id: u8, body: &[u8]) -> usize {
        let at = self.next_cap;
        let end = at + 2 + body.len();
        let Ok(at_byte) = u8::try_from(at) else {
            return at;
        };
        if end > CONFIG_SIZE {
            return at;
        }
        self.bytes[at] = id;
        self.bytes[at + 2..end].copy_from_slice(body);
        match self.last_cap {
            Some(prev) => self.bytes[prev + 1] = at_byte,
            None => {
                self.bytes[CAP_POINTER] = at_byte;
                let status = self.get16(0x06) | STATUS_CAP_LIST;
                self.put16(0x06, status);
            }
        }
        self.last_cap = Some(at);
        self.next_cap = (end + 3) & !3;
        at
    }

    /// Appends the MSI-X capability for a table at `table_offset` and pending bits at
    /// `pba_offset` in BAR 0; its message control then mirrors `msix`.
    pub fn add_msix(&mut self, msix: &Msix, table_offset: u32, pba_offset: u32) {
        let mut body = Vec::with_capacity(10);
        body.extend_from_slice(&msix.control().to_le_bytes());
        body.extend_from_slice(&table_offset.to_le_bytes());
        body.extend_from_slice(&pba_offset.to_le_bytes());
        let at = self.add_capability(CAP_ID_MSIX, &body);
        // Enable and function mask.
        self.wmask[at + 3] = 0xc0;
        self.msix_cap = Some(at);
    }

    /// A read of `data.len()` bytes at `offset`, with `msix`'s current message control.
    pub fn read(&self, offset: usize, data: &mut [u8], msix: Option<&Msix>) {
        let mut bytes = self.bytes;
        if let (Some(at), Some(m)) = (self.msix_cap, msix) {
            bytes[at + 2..at + 4].copy_from_slice(&m.control().to_le_bytes());
        }
        for (i, b) in data.iter_mut().enumerate() {
            *b = bytes.get(offset + i).copied().unwrap_or(0xff);
        }
    }

    /// A write of `data` at `offset`: the writable bits change; a write to MSI-X's message
    /// control goes to `msix`.
    pub fn write(&mut self, offset: usize, data: &[u8], msix: Option<&Msix>) {
        for (i, &b) in data.iter().enumerate() {
            let Some(mask) = self.wmask.get(offset + i).copied() else {
                break;
            };
            let old = self.bytes[offset + i];
            self.bytes[offset + i] = (old & !mask) | (b & mask);
        }
        if let (Some(at), Some(m)) = (self.msix_cap, msix) {
            if offset < at + 4 && offset + data.len() > at + 2 {
                m.set_control(self.get16(at + 2));
            }
        }
        if offset < BAR0 + 4 && offset + data.len() > BAR0 {
            self.check_bar0();
        }
    }

    fn check_bar0(&mut self) {
        let now = self.get32(BAR0);
        let mask = u32::from_le_bytes([
            self.wmask[BAR0],
            self.wmask[BAR0 + 1],
            self.wmask[BAR0 + 2],
            self.wmask[BAR0 + 3],
        ]);
        // All ones is the driver sizing the BAR; it writes the address back after.
        if now != self.bar0 && now != mask && !std::mem::replace(&mut self.moved_logged, true) {
            tracing::warn!(
                planned = format_args!("{:#x}", self.bar0),
                written = format_args!("{now:#x}"),
                "PCI: the guest moved a virtio function's BAR 0; it stays at the planned address"
            );
        }
    }

    fn get16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.bytes[at], self.bytes[at + 1]])
    }

    fn get32(&self, at: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.bytes[at..at + 4]);
        u32::from_le_bytes(b)
    }

    fn put16(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn put32(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// The writable bytes (command, BAR 0, interrupt line; MSI-X's control is the
    /// [`Msix`]'s), for a snapshot.
    pub fn save(&self) -> Vec<u8> {
        self.bytes.to_vec()
    }

    /// Takes over the writable bits of a saved configuration space.
    pub fn restore(&mut self, saved: &[u8]) {
        for (i, &b) in saved.iter().enumerate().take(CONFIG_SIZE) {
            let mask = self.wmask[i];
            self.bytes[i] = (self.bytes[i] & !mask) | (b & mask);
        }
    }
}

/// A function on bus 0: its device number and configuration space (and MSI-X, whose control
/// the capability shows).
#[derive(Debug)]
pub struct PciFunction {
    /// Device number (1-31; 0 is the host bridge).
    pub device: u8,
    /// Its configuration space.
    pub config: Mutex<PciConfig>,
    /// Its MSI-X vectors.
    pub msix: Option<Arc<Msix>>,
}

/// Bus 0: the host bridge and the functions, behind configuration mechanism #1.
#[derive(Debug)]
pub struct PciRoot {
    address: Mutex<u32>,
    host_bridge: Mutex<PciConfig>,
    functions: Vec<Arc<PciFunction>>,
}

impl PciRoot {
    /// The bus with `functions` (device numbers 1-31, each at most once).
    pub fn new(functions: Vec<Arc<PciFunction>>) -> Self {
        // Intel's vendor id and a host-bridge class, which Linux's probe of mechanism #1
        // looks for on bus 0.
        let bridge = PciConfig::new(0x8086, 0x0d57, 0, 0x06_00_00, (0, 0));
        PciRoot {
            address: Mutex::new(0),
            host_bridge: Mutex::new(bridge),
            functions,
        }
    }

    /// Whether `port` is one of the configuration ports this bus answers for a `len`-byte
    /// access (the address port only as a whole: `0xcf9` is the reset register).
    pub fn claims(port: u16, len: usize) -> bool {
        (port == PCI_CONFIG_ADDRESS && len == 4)
            || (PCI_CONFIG_DATA..PCI_CONFIG_DATA + 4).contains(&port)
    }

    /// A guest `in`; false when the port is not the bus's.
    pub fn pio_read(&self, port: u16, data: &mut [u8]) -> bool {
        if !Self::claims(port, data.len()) {
            return false;
        }
        let address = *self.address.lock().unwrap_or_else(PoisonError::into_inner);
        if port == PCI_CONFIG_ADDRESS {
            data.copy_from_slice(&address.to_le_bytes());
            return true;
        }
        data.fill(0xff);
        if let Some((device, offset)) = decode(address, port) {
            self.with_config(device, |c, m| c.read(offset, data, m));
        }
        true
    }

    /// A guest `out`; false when the port is not the bus's.
    pub fn pio_write(&self, port: u16, data: &[u8]) -> bool {
        if !Self::claims(port, data.len()) {
            return false;
        }
        let mut address = self.address.lock().unwrap_or_else(PoisonError::into_inner);
        if port == PCI_CONFIG_ADDRESS {
            let mut b = [0u8; 4];
            b.copy_from_slice(data);
            *address = u32::from_le_bytes(b);
            return true;
        }
        let at = *address;
        drop(address);
        if let Some((device, offset)) = decode(at, port) {
            self.with_config(device, |c, m| c.write(offset, data, m));
        }
        true
    }

    fn with_config(&self, device: u8, f: impl FnOnce(&mut PciConfig, Option<&Msix>)) {
        if device == 0 {
            let mut c = self
                .host_bridge
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            f(&mut c, None);
        } else if let Some(func) = self.functions.iter().find(|f| f.device == device) {
            let mut c = func.config.lock().unwrap_or_else(PoisonError::into_inner);
            f(&mut c, func.msix.as_deref());
        }
    }

    /// The functions, in device order.
    pub fn functions(&self) -> &[Arc<PciFunction>] {
        &self.functions
    }
}

/// The device number and register offset a data-port access at `address` reaches: bus 0,
/// function 0, enabled; `None` otherwise (the access reads as all ones).
fn decode(address: u32, port: u16) -> Option<(u8, usize)> {
    let enabled = address & 0x8000_0000 != 0;
    let bus = (address >> 16) & 0xff;
    let device = ((address >> 11) & 0x1f) as u8;
    let function = (address >> 8) & 0x7;
    if !enabled || bus != 0 || function != 0 {
        return None;
    }
    let register = (address & 0xfc) as usize;
    Some((device, register + usize::from(port - PCI_CONFIG_DATA)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn select(root: &PciRoot, device: u32, register: u32) {
        let address = 0x8000_0000 | (device << 11) | register;
        assert!(root.pio_write(PCI_CONFIG_ADDRESS, &address.to_le_bytes()));
    }

    fn read32(root: &PciRoot, device: u32, register: u32) -> u32 {
        select(root, device, register);
        let mut b = [0u8; 4];
        assert!(root.pio_read(PCI_CONFIG_DATA, &mut b));
        u32::from_le_bytes(b)
    }

    fn function(device: u8) -> Arc<PciFunction> {
        let mut c = PciConfig::new(0x1af4, 0x1042, 1, 0x01_80_00, (0x1af4, 0x40));
        c.set_bar0(0xd000_1000, 0x1000);
        c.add_capability(
            CAP_ID_VENDOR,
            &[16, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0],
        );
        Arc::new(PciFunction {
            device,
            config: Mutex::new(c),
            msix: None,
        })
    }

    #[test]
    fn the_address_port_reads_back_and_absent_devices_read_all_ones() {
        let root = PciRoot::new(vec![function(1)]);
        select(&root, 0, 0);
        let mut b = [0u8; 4];
        assert!(root.pio_read(PCI_CONFIG_ADDRESS, &mut b));
        assert_eq!(u32::from_le_bytes(b), 0x8000_0000);
        assert_eq!(read32(&root, 7, 0), 0xffff_ffff);
        assert_eq!(read32(&root, 1, 0), 0x1042_1af4);
        assert_eq!(read32(&root, 0, 8) >> 8, 0x06_00_00, "host bridge class");
        assert!(
            !PciRoot::claims(0xcf9, 1),
            "the reset register stays legacy's"
        );
    }

    #[test]
    fn bar0_sizes_and_keeps_its_flags() {
        let root = PciRoot::new(vec![function(3)]);
        assert_eq!(read32(&root, 3, 0x10), 0xd000_1000);
        select(&root, 3, 0x10);
        root.pio_write(PCI_CONFIG_DATA, &u32::MAX.to_le_bytes());
        assert_eq!(read32(&root, 3, 0x10), 0xffff_f000, "4 KiB, 32-bit memory");
        select(&root, 3, 0x10);
        root.pio_write(PCI_CONFIG_DATA, &0xd000_1000u32.to_le_bytes());
        assert_eq!(read32(&root, 3, 0x10), 0xd000_1000);
        assert_eq!(read32(&root, 3, 0), 0x1042_1af4, "read-only id");
        select(&root, 3, 0);
        root.pio_write(PCI_CONFIG_DATA, &0u32.to_le_bytes());
        assert_eq!(read32(&root, 3, 0), 0x1042_1af4);
    }

    #[test]
    fn capabilities_are_chained_from_the_pointer() {
        let root = PciRoot::new(vec![function(2)]);
        assert_ne!(read32(&root, 2, 4) >> 16 & u32::from(STATUS_CAP_LIST), 0);
        let pointer = read32(&root, 2, 0x34) & 0xff;
        assert_eq!(pointer, 0x40);
        assert_eq!(read32(&root, 2, pointer) & 0xff, u32::from(CAP_ID_VENDOR));
        // Byte access through the data ports.
        select(&root, 2, 0x40);
        let mut b = [0u8; 1];
        root.pio_read(PCI_CONFIG_DATA + 2, &mut b);
        assert_eq!(b[0], 16, "the capability's length byte");
    }
}
