//! The personality routine that the trampolines' unwind entries name. When
//! an exception or a forced unwind (thread cancellation) passes a
//! trampoline's call of its target, the routine undoes what the trampoline
//! did before the call, as the code after the call would have
//! (`layout::undo`): a counted allocation counts as failed (with its bytes
//! on the live path), a raised wrapper depth goes down, a hook's charge is
//! cleared. It never catches: every unwind goes on to the site's function,
//! whose own entry finds the original landing pad.
//!
//! The unwinder that calls it is the process's (libgcc_s's, or another
//! that exports the same functions); the routine asks that unwinder for
//! the entry's LSDA, the return address and the stack pointer at the call.
//! It looks the unwinder's functions up by name in the process (`dlsym`):
//! the runtime's own copy of libgcc's unwinder, linked in for Rust's
//! standard library, must not read a context another unwinder (or another
//! version of libgcc) laid out. Where the process exports none (the static
//! runtime, whose C library shim forwards these functions to the
//! program's own), the linked functions are called.

use crate::{live, tls};
use alloctramp_trampolines::layout::undo::{self, UndoCall, UndoHeader};
use std::ffi::{CStr, c_void};
use std::mem::size_of;
use std::sync::atomic::{AtomicUsize, Ordering};

const UA_CLEANUP_PHASE: i32 = 2;
const URC_FATAL_PHASE1_ERROR: i32 = 3;
const URC_CONTINUE_UNWIND: i32 = 8;

unsafe extern "C" {
    fn _Unwind_GetLanguageSpecificData(ctx: *mut c_void) -> *const u8;
    fn _Unwind_GetIP(ctx: *mut c_void) -> usize;
    fn _Unwind_GetRegionStart(ctx: *mut c_void) -> usize;
    fn _Unwind_GetCFA(ctx: *mut c_void) -> usize;
}

/// The routine (the Itanium C++ ABI's `__personality_routine`).
///
/// # Safety
/// Called by the unwinder with the context of a frame whose entry is a
/// trampoline's: its LSDA is an undo list the patcher wrote.
pub unsafe extern "C" fn personality(
    version: i32,
    actions: i32,
    _class: u64,
    _exception: *mut c_void,
    ctx: *mut c_void,
) -> i32 {
    if version != 1 {
        return URC_FATAL_PHASE1_ERROR;
    }
    if actions & UA_CLEANUP_PHASE != 0 {
        // SAFETY: forwarded from the caller.
        unsafe { undo(ctx) };
    }
    URC_CONTINUE_UNWIND
}

/// An unwinder function the routine calls: its name, the linked one, and
/// the process's once found (0: not yet).
struct Accessor {
    name: &'static CStr,
    linked: unsafe extern "C" fn(*mut c_void) -> usize,
    found: AtomicUsize,
}

static LSDA: Accessor =
    Accessor { name: c"_Unwind_GetLanguageSpecificData", linked: lsda_linked, found: AtomicUsize::new(0) };
static IP: Accessor = Accessor { name: c"_Unwind_GetIP", linked: _Unwind_GetIP, found: AtomicUsize::new(0) };
static REGION_START: Accessor =
    Accessor { name: c"_Unwind_GetRegionStart", linked: _Unwind_GetRegionStart, found: AtomicUsize::new(0) };
static CFA: Accessor = Accessor { name: c"_Unwind_GetCFA", linked: _Unwind_GetCFA, found: AtomicUsize::new(0) };

unsafe extern "C" fn lsda_linked(ctx: *mut c_void) -> usize {
    // SAFETY: forwarded from the caller.
    unsafe { _Unwind_GetLanguageSpecificData(ctx) as usize }
}

impl Accessor {
    /// Calls the process's function with `ctx`: the one it exports (found
    /// once; the unwinder that calls the routine is loaded then), else the
    /// linked one.
    ///
    /// # Safety
    /// `ctx` is the context the process's unwinder passed.
    unsafe fn ask(&self, ctx: *mut c_void) -> usize {
        let mut f = self.found.load(Ordering::Acquire);
        if f == 0 {
            // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the
            // process's global scope, which the runtime's own (local)
            // copies of these functions are not in.
            f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, self.name.as_ptr()) } as usize;
            if f != 0 {
                self.found.store(f, Ordering::Release);
            }
        }
        if f == 0 {
            // SAFETY: forwarded from the caller.
            return unsafe { (self.linked)(ctx) };
        }
        // SAFETY: the process's `_Unwind_Get*` function, which takes the
        // context and returns a word.
        unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void) -> usize>(f)(ctx) }
    }
}

/// Undoes what the trampoline did before the call the unwind passes.
///
/// # Safety
/// As for [`personality`].
unsafe fn undo(ctx: *mut c_void) {
    // SAFETY: the unwinder's context of the trampoline's frame.
    let (lsda, ip, start, sp) =
        unsafe { (LSDA.ask(ctx) as *const u8, IP.ask(ctx), REGION_START.ask(ctx), CFA.ask(ctx)) };
    if lsda.is_null() {
        return;
    }
    // SAFETY: the patcher's undo list: a header and `count` calls, in the
    // patched module's mapped, read-only unwind data.
    let header = unsafe { (lsda as *const UndoHeader).read_unaligned() };
    let control = (lsda as i64).wrapping_add(i64::from(header.control)) as *const u8;
    let ret = ip.wrapping_sub(start) as u64;
    for k in 0..header.count as usize {
        // SAFETY: as above.
        let call = unsafe {
            (lsda.add(size_of::<UndoHeader>() + k * size_of::<UndoCall>()) as *const UndoCall).read_unaligned()
        };
        if u64::from(call.ret) == ret {
            // SAFETY: forwarded; `sp` is the stack pointer at the call.
            unsafe { apply(call, u64::from(header.index), control, sp as u64) };
            return;
        }
    }
}

/// # Safety
/// `control` is a registered module's control block and `sp` the stack
/// pointer at the trampoline's call, whose frame slots `call` names.
unsafe fn apply(call: UndoCall, index: u64, control: *const u8, sp: u64) {
    let what = call.what;
    if what & undo::FAILED != 0 {
        let size = (what & undo::LIVE_SIZE != 0).then(|| {
            let at = sp.wrapping_add(call.size_at as i64 as u64) as *const u64;
            // SAFETY: the live path's frame slots, on this thread's stack
            // above the unwinding frames.
            unsafe {
                let a = at.read();
                if what & undo::LIVE_PRODUCT != 0 { a.wrapping_mul(at.add(1).read()) } else { a }
            }
        });
        let (index, control) =
            if what & undo::CHARGED != 0 { (tls::get(tls::CHARGE), std::ptr::null()) } else { (index, control) };
        // SAFETY: a site of a registered module, or the hook's cell.
        unsafe { live::count_unwound(index, control, size) };
    }
    if what & undo::DEPTH != 0 {
        tls::set(tls::DEPTH, tls::get(tls::DEPTH).wrapping_sub(1));
    }
    if what & undo::HOOK != 0 {
        tls::set(tls::CHARGE_SP, 0);
        tls::set(tls::CHAIN_SP, 0);
    }
}
