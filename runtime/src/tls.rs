//! The runtime's per-thread words, in static TLS (the initial-exec model):
//! at a fixed offset from the thread pointer (fs) in every thread, so that
//! trampolines read them with one instruction given the offset (which the
//! runtime writes into each module's control block).
//!
//! Rust's `thread_local!` in a shared library goes through
//! `__tls_get_addr`, which a trampoline cannot call; hence eighteen words
//! of `.tbss` declared here and read with `fs:`-relative moves. A library
//! with static TLS loaded by `dlopen` takes its 144 bytes from the surplus glibc
//! reserves for that purpose. The symbol is hidden: other code units of the
//! library see it, other modules do not.

use std::arch::{asm, global_asm};

global_asm!(
    ".pushsection .tbss,\"awT\",@nobits",
    ".p2align 3",
    ".globl alloctramp_rt_tls",
    ".hidden alloctramp_rt_tls",
    ".type alloctramp_rt_tls,@object",
    ".size alloctramp_rt_tls,144",
    "alloctramp_rt_tls:",
    ".zero 144",
    ".popsection",
);

/// Word 0: the pointer of the thread's last free that the runtime took
/// out of the shadow map or the pointer table: a free of the same pointer
/// that finds no record is a nested layer of that free (`operator delete`
/// calling `free`, a wrapper calling the allocator's free).
pub const LAST_FREE: usize = 0;
/// Word 1: the thread's charge id: the shadow-map entry base of the
/// active hook's site (0: its module has no ids), which the hook's
/// trampoline writes with the charge (the trampolines read it two words
/// below the charge).
pub const CHARGE_ID: usize = 1;
/// Word 2: the thread's wrapper depth, which the trampolines raise around
/// a counted call to an allocation wrapper and read at the sites inside
/// one (see the patcher's `charge`).
pub const DEPTH: usize = 2;
/// Words 3 to 5: the thread's charge, which a hook site's trampoline sets
/// around its call when no other hook's call is under way: the hook's
/// counter cell, the stack pointer at the hook (0: no hook) and the hook
/// call's return address. Sites inside hooked functions count into that
/// cell while the stack pointer is below the hook's and the word below the
/// hook's is still its return address (see the patcher's `charge`).
pub const CHARGE: usize = 3;
pub const CHARGE_SP: usize = 4;
pub const CHARGE_RET: usize = 5;
/// Words 6 and 7: the call chain of the hook's call, when callers capture
/// recorded one at the hook (a chain slot), and the hook's stack pointer
/// it belongs to: the sites charged to the hook add their calls and bytes
/// to it while the two stack pointers agree.
pub const CHAIN: usize = 6;
pub const CHAIN_SP: usize = 7;
/// Word 8: the thread's shard word (see `layout::shard` and `shards`),
/// which the trampolines read through the control block's `shard_tls`.
pub const SHARD: usize = 8;
/// Word 9, right after it: the thread's shard's offset in the freed view
/// (0 for shard 0).
pub const FREED_SHARD: usize = 9;

/// Words 10 to 12: a call of an allocation wrapper that fault injection
/// fails (see `fault`): the stack pointer at its site (0: none), the
/// wrapper depth inside its call (0: the call is a hook's, whose charge
/// tells when it is under way), and the site's counter cell, which counts
/// the failure. The first allocation inside the call fails.
pub const FAIL_SP: usize = 10;
pub const FAIL_DEPTH: usize = 11;
pub const FAIL_CELL: usize = 12;

/// Word 13: the thread's ring in the trace file while events are
/// recorded: its header's address (0: none claimed yet; 1: none free, see
/// `trace`).
pub const TRACE_RING: usize = 13;
/// Words 14 and 15: the thread's window in its ring: the next record's
/// address and the end of the records it may write before it looks at
/// the ring's tail again (both 0: none open).
pub const TRACE_CUR: usize = 14;
pub const TRACE_END: usize = 15;
/// Word 16: 1 while the thread records an event (see `trace`): an event
/// of a signal handler that interrupts it is not recorded.
pub const TRACE_BUSY: usize = 16;
/// Word 17: the calls of the assignment stub the thread made while its
/// shard word was still 0, which the stub counts (see `shards`): the
/// thread is given a shard of its own only after
/// `layout::shard::PROBATION` of them.
pub const PROBATION: usize = 17;
// The traced entries find them as `trampolines::trace::words` says.
const _: () = {
    use alloctramp_trampolines::trace::words;
    assert!(8 * (TRACE_CUR - TRACE_RING) == words::CUR as usize && 8 * (TRACE_END - TRACE_RING) == words::END as usize);
    assert!(8 * (TRACE_BUSY - TRACE_RING) == words::BUSY as usize && words::RING == 0);
};

/// Offset of word 0 from the thread pointer.
#[inline(always)]
pub fn offset() -> i64 {
    let o: i64;
    // SAFETY: loads the GOT slot the dynamic linker filled with the TLS
    // block's offset (R_X86_64_TPOFF64).
    unsafe {
        // (nomem: the slot does not change once the library is loaded, so
        // the compiler may keep its value across stores.)
        asm!("mov {}, qword ptr [rip + alloctramp_rt_tls@GOTTPOFF]", out(reg) o,
            options(nostack, pure, nomem, preserves_flags));
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

/// [`get`] of a word known at compile time: one load with the word's
/// displacement (for the paths where every instruction counts).
#[inline(always)]
pub fn word<const W: usize>() -> u64 {
    let v: u64;
    // SAFETY: as for `get`.
    unsafe {
        asm!("mov {}, qword ptr fs:[{} + {}]", out(reg) v, in(reg) offset(), const 8 * W,
            options(nostack, readonly, preserves_flags));
    }
    v
}

/// Sets bit 0 of word `W`, returning whether it was clear, in one
/// instruction: a signal handler on this thread that does the same finds
/// it set until the thread clears it (not atomic between threads: each
/// thread has its own words).
#[inline(always)]
pub fn take_word<const W: usize>() -> bool {
    let was: u8;
    // SAFETY: as for `get`; `bts` writes only the word's bit 0.
    unsafe {
        asm!("bts qword ptr fs:[{} + {}], 0", "setc {}", in(reg) offset(), const 8 * W, out(reg_byte) was,
            options(nostack));
    }
    was == 0
}

/// [`set`] of a word known at compile time.
#[inline(always)]
pub fn set_word<const W: usize>(v: u64) {
    // SAFETY: as for `set`.
    unsafe {
        asm!("mov qword ptr fs:[{} + {}], {}", in(reg) offset(), const 8 * W, in(reg) v,
            options(nostack, preserves_flags));
    }
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

/// Whether code running with stack pointer `sp` is inside the call of the
/// thread's hook, as a trampoline's charge gate decides: `sp` is below the
/// hook's and the word below the hook's stack pointer is still the return
/// address its call pushed.
pub fn in_hook_call(sp: u64) -> bool {
    let hook_sp = get(CHARGE_SP);
    sp < hook_sp && hook_word(hook_sp) == get(CHARGE_RET)
}

global_asm!(
    ".pushsection .text.alloctramp_hook_word,\"ax\",@progbits",
    ".globl alloctramp_hook_word",
    ".hidden alloctramp_hook_word",
    ".type alloctramp_hook_word,@function",
    "alloctramp_hook_word:",
    ".cfi_startproc",
    "mov r10, rdi",
    ".globl alloctramp_hook_word_load",
    ".hidden alloctramp_hook_word_load",
    "alloctramp_hook_word_load:",
    "mov r10, qword ptr [r10 - 8]",
    "mov rax, r10",
    "ret",
    ".cfi_endproc",
    ".size alloctramp_hook_word, . - alloctramp_hook_word",
    ".popsection",
);

unsafe extern "C" {
    fn alloctramp_hook_word(hook_sp: u64) -> u64;
    static alloctramp_hook_word_load: u8;
}

/// The word below a hook's recorded stack pointer, read as the trampolines
/// read it: with the instruction [`layout::CHECK_LOAD`], which the fault
/// handler completes with 0 when the word is no longer mapped (the stack
/// the hook's call was made on was switched away from and unmapped).
///
/// [`layout::CHECK_LOAD`]: alloctramp_trampolines::layout::CHECK_LOAD
fn hook_word(hook_sp: u64) -> u64 {
    // SAFETY: reads one word; a fault on it is completed by the fault
    // handler, or (when the program replaced that handler) is the fault the
    // trampolines' own check would take.
    unsafe { alloctramp_hook_word(hook_sp) }
}

/// Whether `rip` is the runtime's own read of a hook's word.
pub fn is_hook_word_load(rip: u64) -> bool {
    rip == &raw const alloctramp_hook_word_load as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_reads_a_hook_word_with_the_trampolines_instruction() {
        let at = &raw const alloctramp_hook_word_load as *const [u8; 4];
        // SAFETY: four bytes of the function's code.
        assert_eq!(unsafe { at.read() }, alloctramp_trampolines::layout::CHECK_LOAD);
        let word = 0x1234_5678_u64;
        let sp = (&raw const word) as u64 + 8;
        assert_eq!(hook_word(sp), word);
    }
}
