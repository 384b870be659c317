//! Logging through the host: the one import a hook may use. The host
//! bounds it per call and tags each line with the class. On the host
//! (native tests) lines go to stderr.

#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code)]
mod imp {
    #[link(wasm_import_module = "latchkey")]
    unsafe extern "C" {
        fn log(level: i32, ptr: u32, len: u32);
    }

    pub fn write(level: i32, msg: &str) {
        let len = u32::try_from(msg.len()).unwrap_or(u32::MAX);
        // SAFETY: the host reads `len` bytes at `ptr` from this module's
        // memory during the call and keeps nothing.
        unsafe { log(level, msg.as_ptr() as u32, len) }
    }
}

#[cfg(not(target_arch = "wasm32"))]
mod imp {
    pub fn write(level: i32, msg: &str) {
        eprintln!("hook log [{level}]: {msg}");
    }
}

pub fn error(msg: &str) {
    imp::write(0, msg);
}

pub fn warn(msg: &str) {
    imp::write(1, msg);
}

pub fn info(msg: &str) {
    imp::write(2, msg);
}

pub fn debug(msg: &str) {
    imp::write(3, msg);
}
