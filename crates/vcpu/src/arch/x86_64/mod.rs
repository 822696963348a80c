//! x86_64: CPUID ([`cpuid`]) and the boot area with its page tables, descriptor tables and
//! special registers ([`boot`]).

pub mod boot;
pub mod cpuid;

pub use boot::{BootError, BootLayout, USER_CS, USER_DS, USER_RFLAGS};
pub use cpuid::{decode_topology, CpuidError, CpuidInputs, CpuidResult, DecodedTopology, Vendor};
