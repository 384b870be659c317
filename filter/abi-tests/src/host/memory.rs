//! The module's memory from a host call: reading its arguments, writing
//! answers, and copying values into memory it allocates (`malloc`).

use wasmtime::{Caller, Error, Extern, Memory, Result};

use super::HostState;

pub(super) type C<'a> = Caller<'a, HostState>;

pub(super) fn memory(caller: &mut C<'_>) -> Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(m)) => Ok(m),
        _ => Err(Error::msg("the module exports no memory")),
    }
}

pub(super) fn addr(v: i32) -> usize {
    // wasm32 pointers and sizes are u32.
    v as u32 as usize
}

pub(super) fn read(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>> {
    let mem = memory(caller)?;
    let (start, len) = (addr(ptr), addr(len));
    let end = start
        .checked_add(len)
        .ok_or_else(|| Error::msg("pointer overflow"))?;
    mem.data(&*caller)
        .get(start..end)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| Error::msg(format!("out-of-bounds read of {len} bytes at {start}")))
}

pub(super) fn read_str(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<String> {
    String::from_utf8(read(caller, ptr, len)?).map_err(|_| Error::msg("not UTF-8"))
}

pub(super) fn write(caller: &mut C<'_>, ptr: i32, bytes: &[u8]) -> Result<()> {
    let mem = memory(caller)?;
    mem.write(&mut *caller, addr(ptr), bytes)
        .map_err(|e| Error::msg(format!("out-of-bounds write at {}: {e}", addr(ptr))))
}

/// Copies `bytes` into memory the module allocates and writes the pointer and
/// size to `ptr_out` and `size_out`.
pub(super) fn give(caller: &mut C<'_>, bytes: &[u8], ptr_out: i32, size_out: i32) -> Result<()> {
    let malloc = match caller.get_export("malloc") {
        Some(Extern::Func(f)) => f.typed::<i32, i32>(&*caller)?,
        _ => return Err(Error::msg("the module exports no malloc")),
    };
    let len = i32::try_from(bytes.len()).map_err(|_| Error::msg("value too large"))?;
    let ptr = malloc.call(&mut *caller, len)?;
    write(caller, ptr, bytes)?;
    write(caller, ptr_out, &ptr.to_le_bytes())?;
    write(caller, size_out, &len.to_le_bytes())
}
