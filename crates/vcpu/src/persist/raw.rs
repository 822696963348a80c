//! Raw KVM structs as bytes: the zerocopy views kvm-bindings derives, so no `unsafe` here.

use zerocopy::{FromBytes, Immutable, IntoBytes};

use super::PersistError;

/// The bytes of a KVM struct, as the state stores them.
pub(crate) fn to_bytes<T: IntoBytes + Immutable>(v: &T) -> Vec<u8> {
    v.as_bytes().to_vec()
}

/// A KVM struct from its saved bytes; the length must match exactly.
pub(crate) fn from_bytes<T: FromBytes>(piece: &'static str, b: &[u8]) -> Result<T, PersistError> {
    T::read_from_bytes(b).map_err(|_| PersistError::Size {
        piece,
        found: b.len(),
        expected: std::mem::size_of::<T>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_regs;

    #[test]
    fn a_struct_round_trips_and_a_short_one_is_refused() {
        let regs = kvm_regs {
            rip: 0x1234,
            rax: 7,
            ..Default::default()
        };
        let b = to_bytes(&regs);
        assert_eq!(from_bytes::<kvm_regs>("registers", &b).unwrap(), regs);
        let err = from_bytes::<kvm_regs>("registers", &b[1..]).unwrap_err();
        assert!(
            matches!(err, PersistError::Size { piece: "registers", found, expected }
                if found + 1 == expected && expected == std::mem::size_of::<kvm_regs>()),
            "{err}"
        );
    }
}
