//! Architecture-specific code, chosen here once; the rest of the crate uses only what this
//! module re-exports.

#[cfg(target_arch = "x86_64")]
pub mod x86_64;

#[cfg(target_arch = "x86_64")]
pub use self::x86_64::*;

#[cfg(not(target_arch = "x86_64"))]
compile_error!("vmhost-vcpu supports x86_64 hosts only");
