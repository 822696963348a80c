//! "No udev" for static builds.
//!
//! hwloc's Linux backend opens a libudev context when it starts and, for I/O objects only
//! (block devices, network interfaces), reads device properties through it. vmhost filters
//! every I/O object out (see `hwloc.rs`), and Debian ships no static libudev, so a static
//! vmhost answers hwloc's libudev calls here: `udev_new()` returns NULL, the documented failure
//! that hwloc handles by going without udev, and the other entry points, which hwloc only
//! calls with a context, are inert. Dynamic builds use the real libudev and leave this module
//! out. See docs/dependencies.md ("Static linking").

use std::ffi::{c_char, c_void};
use std::ptr::{null, null_mut};

/// `struct udev *udev_new(void)`: no udev context.
#[no_mangle]
extern "C" fn udev_new() -> *mut c_void {
    null_mut()
}

/// `struct udev *udev_unref(struct udev *)`: nothing to release.
#[no_mangle]
extern "C" fn udev_unref(_udev: *mut c_void) -> *mut c_void {
    null_mut()
}

/// `struct udev_device *udev_device_new_from_subsystem_sysname(...)`: no such device.
#[no_mangle]
extern "C" fn udev_device_new_from_subsystem_sysname(
    _udev: *mut c_void,
    _subsystem: *const c_char,
    _sysname: *const c_char,
) -> *mut c_void {
    null_mut()
}

/// `const char *udev_device_get_property_value(struct udev_device *, const char *)`: unset.
#[no_mangle]
extern "C" fn udev_device_get_property_value(
    _device: *mut c_void,
    _key: *const c_char,
) -> *const c_char {
    null()
}

/// `struct udev_device *udev_device_unref(struct udev_device *)`: nothing to release.
#[no_mangle]
extern "C" fn udev_device_unref(_device: *mut c_void) -> *mut c_void {
    null_mut()
}

#[cfg(test)]
mod tests {
    #[test]
    fn live_discovery_works_without_udev() {
        // hwloc's Linux backend called udev_new() (above, NULL) and went on without it.
        let host = crate::discover().unwrap();
        assert!(!host.nodes.is_empty() && !host.cores.is_empty());
    }
}
