//! The runtime's per-thread words, in static TLS (the initial-exec model):
//! at a fixed offset from the thread pointer (fs) in every thread, so that
//! trampolines read them with one instruction given the offset (which the
//! runtime writes into each module's control block).
//!
//! Rust's `thread_local!` in a shared library goes through
//! `__tls_get_addr`, which a trampoline cannot call; hence three words of
//! `.tbss` declared here and read with `fs:`-relative moves. A library with
//! static TLS loaded by `dlopen` takes its 24 bytes from the surplus glibc
//! reserves for that purpose. The symbol is hidden: other code units of the
//! library see it, other modules do not.

use std::arch::{asm, global_asm};

global_asm!(
    ".pushsection .tbss,\"awT\",@nobits",
    ".p2align 3",
    ".globl alloctramp_rt_tls",
    ".hidden alloctramp_rt_tls",
    ".type alloctramp_rt_tls,@object",
    ".size alloctramp_rt_tls,24",
    "alloctramp_rt_tls:",
    ".zero 24",
    ".popsection",
);

/// Word 0: the byte offset of the thread's nursery in the runtime's
/// nursery array (0: the inert nursery).
pub const NURSERY: usize = 0;
/// Word 1: the thread's nursery state (see `live`).
pub const STATE: usize = 1;
/// Word 2: the thread's wrapper depth, which the trampolines raise around
/// a counted call to an allocation wrapper and read at the sites inside
/// one (see the patcher's `charge`).
pub const DEPTH: usize = 2;

/// Offset of word 0 from the thread pointer.
#[inline(always)]
pub fn offset() -> i64 {
    let o: i64;
    // SAFETY: loads the GOT slot the dynamic linker filled with the TLS
    // block's offset (R_X86_64_TPOFF64).
    unsafe {
        asm!("mov {}, qword ptr [rip + alloctramp_rt_tls@GOTTPOFF]", out(reg) o,
            options(nostack, pure, readonly, preserves_flags));
    }
    o
}

/// The calling thread's word `w`.
#[inline(always)]
pub fn get(w: usize) -> u64 {
    let v: u64;
    // SAFETY: the word lies in the calling thread's static TLS block.
    unsafe {
        asm!("mov {}, qword ptr fs:[{}]", out(reg) v, in(reg) offset() + 8 * w as i64,
            options(nostack, readonly, preserves_flags));
    }
    v
}

/// Sets the calling thread's word `w`.
#[inline(always)]
pub fn set(w: usize, v: u64) {
    // SAFETY: the word lies in the calling thread's static TLS block, which
    // only this thread (and the trampolines it runs) use.
    unsafe {
        asm!("mov qword ptr fs:[{}], {}", in(reg) offset() + 8 * w as i64, in(reg) v,
            options(nostack, preserves_flags));
    }
}
