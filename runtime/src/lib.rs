//! The alloctramp runtime: the library every patched module loads (it is a
//! DT_NEEDED entry of the module). It is a guest in someone else's process:
//! it starts no thread, allocates nothing on a trampoline path, and a panic
//! aborts instead of unwinding into C.
//!
//! A patched module imports one symbol, [`alloctramp_runtime_v1`]: a table of
//! functions its init and fini stubs call with the address of the module's
//! site table (see `alloctramp_trampolines::layout`).

use alloctramp_trampolines::layout::{self, API_VERSION, Table};
use std::ffi::{c_char, c_void};

/// The API table patched modules import (layout in `layout::api`).
#[repr(C)]
pub struct Api {
    pub version: u64,
    pub register: unsafe extern "C" fn(table: *const u8),
    pub unregister: unsafe extern "C" fn(table: *const u8),
}

#[allow(non_upper_case_globals)]
#[cfg_attr(not(test), unsafe(no_mangle))]
pub static alloctramp_runtime_v1: Api = Api { version: API_VERSION, register, unregister };

unsafe extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// glibc's offset of `struct rseq` from the thread pointer, or 0 (the
/// thread pointer's own first word, always readable) without rseq.
fn rseq_offset() -> i64 {
    // SAFETY: dlsym with RTLD_DEFAULT (null) and a NUL-terminated name; the
    // symbol, when present, is a `ptrdiff_t` exported by glibc 2.35+.
    unsafe {
        let p = dlsym(std::ptr::null_mut(), c"__rseq_offset".as_ptr()) as *const isize;
        if p.is_null() { 0 } else { *p as i64 }
    }
}

/// Reads the site table at a run-time address.
///
/// # Safety
/// `table` must point at a site table in a loaded module.
unsafe fn table_at<'a>(table: *const u8) -> Option<Table<'a>> {
    // SAFETY: the header is readable (caller); its sizes bound the rest,
    // which lies in the same read-only segment.
    let head = unsafe { std::slice::from_raw_parts(table, layout::HEADER_SIZE) };
    let size = Table::parse_size(head)?;
    // SAFETY: as above, the table is `size` bytes long.
    Table::parse(unsafe { std::slice::from_raw_parts(table, size) }).ok()
}

/// Called by a module's init stub: prepares its control block.
///
/// # Safety
/// `table` must be the run-time address of a module's site table.
unsafe extern "C" fn register(table: *const u8) {
    // SAFETY: forwarded from the caller.
    let Some(t) = (unsafe { table_at(table) }) else { return };
    let bias = (table as u64).wrapping_sub(t.header.table_addr);
    let control = bias.wrapping_add(t.header.control_addr) as *mut u64;
    // SAFETY: the control block is the module's writable
    // .alloctramp.data; fields are u64 at the offsets of `layout::control`.
    unsafe {
        control.byte_add(layout::control::RSEQ_OFFSET as usize).write_volatile(rseq_offset() as u64);
        control.byte_add(layout::control::COUNTERS as usize).write_volatile(bias.wrapping_add(t.header.counters_addr));
    }
}

/// Called by a module's fini stub.
///
/// # Safety
/// `table` must be the run-time address of a module's site table.
unsafe extern "C" fn unregister(_table: *const u8) {}
