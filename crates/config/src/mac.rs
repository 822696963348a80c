//! MAC addresses: parsed from the spec, or generated stably from the VM and interface names.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// An Ethernet MAC address.
///
/// ```
/// use vmhost_config::MacAddress;
/// let m: MacAddress = "02:00:5e:10:00:01".parse().unwrap();
/// assert_eq!(m.to_string(), "02:00:5e:10:00:01");
/// let g = MacAddress::generate("db-1", "default");
/// assert_eq!(g, MacAddress::generate("db-1", "default"));
/// assert!(g.is_locally_administered() && g.is_unicast());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddress(pub [u8; 6]);

/// Why a MAC address did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MacError {
    /// Not six colon-separated hex octets.
    #[error("is not six hex octets separated by ':' (like 02:00:00:00:00:01)")]
    Syntax,
    /// The group bit is set.
    #[error("is a multicast address; a NIC needs a unicast one (first octet even)")]
    Multicast,
}

impl MacAddress {
    /// A locally administered unicast address derived from the VM and interface names with
    /// 64-bit FNV-1a, so the same VM gets the same address at every start.
    pub fn generate(vm: &str, interface: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in vm.bytes().chain([b'/']).chain(interface.bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let b = h.to_be_bytes();
        MacAddress([(b[0] & 0xfc) | 0x02, b[1], b[2], b[3], b[4], b[5]])
    }

    /// The U/L bit: set for addresses not assigned by a vendor.
    pub fn is_locally_administered(&self) -> bool {
        self.0[0] & 0x02 != 0
    }

    /// The I/G bit is clear.
    pub fn is_unicast(&self) -> bool {
        self.0[0] & 0x01 == 0
    }
}

impl FromStr for MacAddress {
    type Err = MacError;

    fn from_str(s: &str) -> Result<Self, MacError> {
        let mut out = [0u8; 6];
        let mut parts = s.split([':', '-']);
        for byte in &mut out {
            let p = parts.next().ok_or(MacError::Syntax)?;
            if p.len() != 2 {
                return Err(MacError::Syntax);
            }
            *byte = u8::from_str_radix(p, 16).map_err(|_| MacError::Syntax)?;
        }
        if parts.next().is_some() {
            return Err(MacError::Syntax);
        }
        let mac = MacAddress(out);
        if !mac.is_unicast() {
            return Err(MacError::Multicast);
        }
        Ok(mac)
    }
}

impl fmt::Display for MacAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl Serialize for MacAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}
