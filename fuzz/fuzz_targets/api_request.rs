//! The control API's HTTP request reader: any bytes a local client sends give a request or an
//! error status, never a panic, and never a body beyond the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match vmhost_api::fuzz_read_request(data) {
        Ok(Some((_method, path, body))) => {
            assert!(
                body <= 64 * 1024,
                "a {body}-byte body passed the 64 KiB limit"
            );
            assert!(path.len() <= data.len());
        }
        Ok(None) => assert!(data.is_empty()),
        Err(status) => assert!((400..=599).contains(&status), "status {status}"),
    }
});
