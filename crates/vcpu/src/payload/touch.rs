//! `touch`, host side: checking that the guest wrote every page (see [`vmhost_guest::touch`]
//! for what the guest does).

use vm_memory::{Bytes, GuestAddress};
use vmhost_memory::GuestMemoryMmap;

pub use vmhost_guest::touch::{pattern, TOUCH_PAGE, TOUCH_TAG};

/// The first 4 KiB page in `gpa..gpa + len` whose words are not all [`pattern`], if any.
pub fn first_untouched(memory: &GuestMemoryMmap, gpa: u64, len: u64) -> Option<u64> {
    let mut buf = [0u8; 4096];
    let mut page = gpa;
    while page < gpa + len {
        if memory.read_slice(&mut buf, GuestAddress(page)).is_err() {
            return Some(page);
        }
        let want = pattern(page).to_le_bytes();
        if !buf.chunks_exact(8).all(|w| w == want) {
            return Some(page);
        }
        page += TOUCH_PAGE;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untouched_pages_are_found() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 * 4096)]).unwrap();
        for p in 0..4u64 {
            for w in 0..512u64 {
                mem.write_obj(pattern(p * 4096), GuestAddress(p * 4096 + 8 * w))
                    .unwrap();
            }
        }
        assert_eq!(first_untouched(&mem, 0, 4 * 4096), None);
        mem.write_obj(0u64, GuestAddress(2 * 4096 + 4000)).unwrap();
        assert_eq!(first_untouched(&mem, 0, 4 * 4096), Some(2 * 4096));
        assert_eq!(first_untouched(&mem, 0, 5 * 4096), Some(2 * 4096));
        assert_eq!(first_untouched(&mem, 3 * 4096, 2 * 4096), Some(4 * 4096));
    }
}
