//! x86_64: CPUID ([`cpuid`], [`nested`]), the boot area with its page tables, descriptor tables
//! and special registers ([`boot`]), and the register state of Linux guests ([`linux`]).

pub mod boot;
pub mod cpuid;
pub mod linux;
pub mod msrs;
pub mod nested;
pub mod pv;

pub use boot::{BootError, BootLayout, USER_CS, USER_DS, USER_RFLAGS};
pub use cpuid::{decode_topology, CpuidError, CpuidInputs, CpuidResult, DecodedTopology, Vendor};
pub use nested::mask_for_nested_emulation;
