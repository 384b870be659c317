//! The raw ABI v1 exports' bodies, called from the code [`crate::hook!`]
//! emits. Memory ownership (policies/HOOKS.md): a buffer from `alloc` is a
//! boxed byte slice of exactly `len` bytes; `before_grant` takes ownership
//! of its input buffer and returns a leaked boxed slice holding the answer,
//! which `free` gives back (the host may skip that: it drops the whole store
//! after each call).

#![allow(unsafe_code)]

use crate::{ABI_VERSION, HookRequest, HookResponse, ReleaseNotice};

pub fn abi_version() -> i32 {
    i32::try_from(ABI_VERSION).unwrap_or(-1)
}

pub fn alloc(len: u32) -> u32 {
    let buf = vec![0u8; len as usize].into_boxed_slice();
    Box::leak(buf).as_mut_ptr() as usize as u32
}

pub fn free(ptr: u32, len: u32) {
    if ptr == 0 {
        return;
    }
    // SAFETY: `ptr`/`len` came from `alloc` or an answer (a leaked
    // `Box<[u8]>` of exactly `len` bytes), handed back once.
    drop(unsafe { take(ptr, len) });
}

/// # Safety
/// `ptr`/`len` must be a leaked `Box<[u8]>` of exactly `len` bytes.
unsafe fn take(ptr: u32, len: u32) -> Box<[u8]> {
    let slice = std::ptr::slice_from_raw_parts_mut(ptr as usize as *mut u8, len as usize);
    // SAFETY: the caller's contract.
    unsafe { Box::from_raw(slice) }
}

fn input(ptr: u32, len: u32) -> Box<[u8]> {
    if ptr == 0 {
        return Box::default();
    }
    // SAFETY: the host filled a buffer it got from `alloc(len)` and passes
    // its ownership with this call (HOOKS.md).
    unsafe { take(ptr, len) }
}

pub fn before_grant(ptr: u32, len: u32, f: fn(&HookRequest) -> HookResponse) -> u64 {
    let input = input(ptr, len);
    let out = crate::answer(&input, f).into_boxed_slice();
    drop(input);
    let out_len = out.len() as u32;
    let out_ptr = Box::leak(out).as_mut_ptr() as usize as u32;
    latchkey_hook_abi::pack(out_ptr, out_len)
}

pub fn after_release(ptr: u32, len: u32, f: fn(&ReleaseNotice)) {
    let input = input(ptr, len);
    crate::notice(&input, f);
}
