//! The built-in programs, generated when this crate is built.
//!
//! `build.rs` runs [`vmhost_guest`]'s code generator (iced-x86 `code_asm`, from Rust source:
//! no external assembler, no checked-in bytes) for every [`PayloadKind`], checks that each
//! program is position-independent, and writes the bytes and entry offsets into this module.
//! Starting a VM then copies bytes instead of assembling: the assembler's tables cost ~0.6 MiB
//! of heap and ~0.3 ms at every start.

use vmhost_guest::{PayloadKind, ProgramImage};

pub use vmhost_guest::abi::{UNKNOWN_PORT, UNMAPPED_GPA, UNMAPPED_VA};

mod generated {
    use vmhost_guest::{EntryPoints, ProgramImage};
    include!(concat!(env!("OUT_DIR"), "/programs.rs"));
}

/// The program of `kind`.
pub fn image(kind: PayloadKind) -> &'static ProgramImage {
    &generated::IMAGES[kind.index()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmhost_guest::codegen::assemble;

    #[test]
    fn generated_images_are_what_the_generator_produces_today() {
        // Placed anywhere aligned, each image equals a fresh assembly at that address.
        for kind in PayloadKind::ALL {
            for base in [0xC000_8000u64, 0x1_0000_0040] {
                let fresh = assemble(kind, base).unwrap();
                let img = image(kind);
                assert_eq!(img.code, &fresh.code[..], "{kind:?} at {base:#x}");
                assert_eq!(
                    img.entry_points_at(base),
                    Some(fresh.entry_points),
                    "{kind:?} at {base:#x}"
                );
            }
        }
    }
}
