//! The Kubernetes quantity parser: never a panic, and what it accepts converts consistently.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmhost_config::Quantity;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(q) = text.parse::<Quantity>() else {
        return;
    };
    let _ = (q.ceil(), q.to_millis(), q.is_negative());
    if let Some(bytes) = q.to_bytes() {
        // Whole bytes round-trip exactly.
        assert_eq!(
            Quantity::from_bytes(bytes).to_bytes(),
            Some(bytes),
            "{text:?}"
        );
        assert!(
            !q.is_negative(),
            "{text:?} is negative but converted to {bytes} bytes"
        );
    }
});
