//! Counter shards owned by threads (see `layout::shard`): a thread adds to
//! a shard no other thread adds to while it lives, with plain instructions,
//! or, when every owned shard is taken, shares shard 0 and adds with
//! `lock`.
//!
//! A thread's trampolines find its shard word 0 (static TLS starts zeroed)
//! the first time they count and call [`alloctramp_assign_stub`] through
//! their module's control block: it keeps every register. For the
//! thread's first [`shard::PROBATION`] calls (one per counted call; an
//! entry that counts both before and after its call, as strdup's does,
//! makes two) it only counts them and returns, and each call adds to
//! shard 0 with `lock`: a thread that
//! allocates little (a worker that stats files, a short command) never
//! costs the process a shard's storage (on tmpfs, reserving 64 bytes per
//! site takes longer than a thousand shared calls). The next call runs
//! [`assign`], which takes a free shard, or says the thread shares. The word says
//! "shared" while the assignment runs, so an allocation it makes (or a
//! signal handler's) counts into shard 0 and does not come back here. A
//! thread-specific key's destructor gives the shard back as the thread
//! exits; the thread shares shard 0 from then on (its last destructors may
//! still allocate).
//!
//! A shard is given out only once its counters have their storage in the
//! process file ([`RESERVED`]): a module joining the file reserves the
//! shards given out so far, and the first thread given another one
//! reserves it in every module. A program with one thread holds at most 2
//! of the 16 shards' storage (1 until its thread has made [`shard::PROBATION`]
//! counted calls), and so does a forked child (shard 0 and its only
//! thread's, whatever its parent held). If the storage is refused, the
//! thread shares.
//!
//! The runtime's own additions (a free that the pointer table settles, an
//! unwound call) go into the calling thread's shard with atomic adds, which
//! the owner's plain adds on the same thread never race with. A figure
//! that another thread may add to later (the cell a pointer-table record
//! charges when its object is freed) is always shard 0's.

use crate::tls;
use alloctramp_trampolines::layout::{shadow, shard};
use std::arch::global_asm;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Bit `s` set: shard `s` has its storage in the process file for every
/// module it holds; a module joining it reserves the same. Shard 0
/// (shared) always has. A bit is set, under the registration lock, before
/// a thread is given its shard.
pub static RESERVED: AtomicU32 = AtomicU32::new(1);

/// The function that reserves the shard it is given (set at start-up; 0:
/// none, no file to reserve in).
static RESERVE: AtomicUsize = AtomicUsize::new(0);

/// Sets the function that gives shard `s` its storage in the process file
/// and sets its bit in [`RESERVED`], or returns false.
pub fn set_reserve(f: fn(u32) -> bool) {
    RESERVE.store(f as usize, Ordering::Release);
}

/// Whether shard `s`'s counters have their storage (reserving it if not):
/// a thread never counts into pages a full file system could not back.
fn has_storage(s: u32) -> bool {
    if RESERVED.load(Ordering::Acquire) & 1 << s != 0 {
        return true;
    }
    let f = RESERVE.load(Ordering::Acquire);
    if f == 0 {
        return true;
    }
    // SAFETY: only ever set from a `fn(u32) -> bool` by `set_reserve`.
    unsafe { std::mem::transmute::<usize, fn(u32) -> bool>(f)(s) }
}

/// Shards with an owner: bit `s` for shard `s`; shard 0 is never owned.
static OWNED: AtomicU32 = AtomicU32::new(1);
/// The thread-specific key whose destructor gives a shard back, plus one
/// (0: none; threads then share shard 0).
static KEY: AtomicU32 = AtomicU32::new(0);

const ALL: u32 = if shard::COUNT >= 32 { u32::MAX } else { (1 << shard::COUNT) - 1 };
const _: () = assert!(shard::COUNT <= shadow::FREED_SHARDS && shard::COUNT <= 32);

/// Creates the key (once, at start-up, before any module registers).
pub fn init() {
    if KEY.load(Ordering::Relaxed) != 0 {
        return;
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: `key` is writable; the destructor is an extern "C" function
    // of the runtime, which is never unloaded.
    if unsafe { libc::pthread_key_create(&mut key, Some(release)) } == 0 {
        KEY.store(key + 1, Ordering::Relaxed);
    }
}

/// Gives the calling thread a shard of its own if one is free, else has it
/// share shard 0 (see the module's text). Called by
/// [`alloctramp_assign_stub`] when the thread's shard word is 0.
extern "C" fn assign() {
    if tls::get(tls::SHARD) != shard::UNASSIGNED {
        return;
    }
    tls::set(tls::FREED_SHARD, 0);
    tls::set(tls::SHARD, shard::SHARED);
    let Some(key) = KEY.load(Ordering::Relaxed).checked_sub(1) else { return };
    let mut owned = OWNED.load(Ordering::Relaxed);
    let s = loop {
        let free = !owned & ALL;
        if free == 0 {
            return;
        }
        let s = free.trailing_zeros();
        match OWNED.compare_exchange_weak(owned, owned | 1 << s, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => break s,
            Err(now) => owned = now,
        }
    };
    // SAFETY: a key this runtime created; the value is a non-null token
    // (the shard plus one) that only `release` reads.
    if !has_storage(s) || unsafe { libc::pthread_setspecific(key, (s as usize + 1) as *const libc::c_void) } != 0 {
        OWNED.fetch_and(!(1 << s), Ordering::Release);
        return;
    }
    tls::set(tls::FREED_SHARD, u64::from(s) << shadow::FREED_SHARD_SHIFT);
    tls::set(tls::SHARD, shard::EXCLUSIVE | u64::from(s));
}

/// The key's destructor, as the thread exits: it shares shard 0 from now
/// on and gives its own back.
extern "C" fn release(token: *mut libc::c_void) {
    let s = (token as usize).wrapping_sub(1);
    tls::set(tls::SHARD, shard::SHARED);
    tls::set(tls::FREED_SHARD, 0);
    // A hook's charge names a cell of the shard given back: no site counts
    // into it any more (a thread exits outside any hook's call).
    tls::set(tls::CHARGE_SP, 0);
    if (1..shard::COUNT as usize).contains(&s) {
        // The thread's last plain adds precede this locked operation, and
        // the next owner's take of the bit precedes its first add.
        OWNED.fetch_and(!(1 << s), Ordering::Release);
    }
}

/// In a forked child: its only thread keeps its shard; the parent's other
/// threads' shards are free again, and the child's own file (made next)
/// reserves only shard 0 and that thread's.
pub fn after_fork_in_child() {
    let w = tls::get(tls::SHARD);
    let mine = if w & shard::EXCLUSIVE != 0 { 1 << shard::index(w, shard::COUNT) } else { 0 };
    OWNED.store(1 | mine, Ordering::Relaxed);
    RESERVED.store(1 | mine, Ordering::Relaxed);
}

/// The calling thread's shard (0 when it shares, or has none yet).
#[inline(always)]
pub fn current() -> u32 {
    shard::index(tls::get(tls::SHARD), shard::COUNT)
}

// The assignment stub the control blocks name: keeps every general
// register and the x87/SSE state (the trampoline that calls it is about to
// make its site's call with the arguments in them). It raises the thread's
// probation count and returns while the count is at most
// `shard::PROBATION`; after that it realigns the stack for `assign`, and
// returns. (It changes the flags, which the trampoline does not use across
// the call.)
global_asm!(
    ".pushsection .text.alloctramp_assign_stub,\"ax\",@progbits",
    ".globl alloctramp_assign_stub",
    ".hidden alloctramp_assign_stub",
    ".type alloctramp_assign_stub,@function",
    "alloctramp_assign_stub:",
    ".cfi_startproc",
    "push r11", ".cfi_adjust_cfa_offset 8",
    "mov r11, qword ptr [rip + alloctramp_rt_tls@GOTTPOFF]",
    "add qword ptr fs:[r11 + {count}], 1",
    "cmp qword ptr fs:[r11 + {count}], {probation}",
    "pop r11", ".cfi_adjust_cfa_offset -8",
    "ja 2f",
    "ret",
    "2:",
    "push rax", ".cfi_adjust_cfa_offset 8",
    "push rcx", ".cfi_adjust_cfa_offset 8",
    "push rdx", ".cfi_adjust_cfa_offset 8",
    "push rsi", ".cfi_adjust_cfa_offset 8",
    "push rdi", ".cfi_adjust_cfa_offset 8",
    "push r8", ".cfi_adjust_cfa_offset 8",
    "push r9", ".cfi_adjust_cfa_offset 8",
    "push r10", ".cfi_adjust_cfa_offset 8",
    "push r11", ".cfi_adjust_cfa_offset 8",
    "push rbx", ".cfi_adjust_cfa_offset 8", ".cfi_rel_offset rbx, 0",
    "mov rbx, rsp", ".cfi_def_cfa_register rbx",
    "and rsp, -16",
    "sub rsp, 512",
    "fxsave64 [rsp]",
    "call {assign}",
    "fxrstor64 [rsp]",
    "mov rsp, rbx", ".cfi_def_cfa_register rsp",
    "pop rbx", ".cfi_adjust_cfa_offset -8", ".cfi_restore rbx",
    "pop r11", ".cfi_adjust_cfa_offset -8",
    "pop r10", ".cfi_adjust_cfa_offset -8",
    "pop r9", ".cfi_adjust_cfa_offset -8",
    "pop r8", ".cfi_adjust_cfa_offset -8",
    "pop rdi", ".cfi_adjust_cfa_offset -8",
    "pop rsi", ".cfi_adjust_cfa_offset -8",
    "pop rdx", ".cfi_adjust_cfa_offset -8",
    "pop rcx", ".cfi_adjust_cfa_offset -8",
    "pop rax", ".cfi_adjust_cfa_offset -8",
    "ret",
    ".cfi_endproc",
    ".size alloctramp_assign_stub, . - alloctramp_assign_stub",
    ".popsection",
    assign = sym assign,
    count = const 8 * tls::PROBATION,
    probation = const shard::PROBATION,
);

unsafe extern "C" {
    fn alloctramp_assign_stub();
}

/// The stub's address, for the control blocks.
pub fn stub() -> u64 {
    alloctramp_assign_stub as *const () as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls the stub as a thread's trampolines do until it assigns the
    /// thread's word: the first `shard::PROBATION` calls leave it 0.
    fn count_until_assigned() {
        for _ in 0..shard::PROBATION {
            // SAFETY: the stub keeps every register.
            unsafe { alloctramp_assign_stub() };
            assert_eq!(tls::get(tls::SHARD), shard::UNASSIGNED);
        }
        // SAFETY: as above.
        unsafe { alloctramp_assign_stub() };
        assert_ne!(tls::get(tls::SHARD), shard::UNASSIGNED);
    }

    #[test]
    fn threads_own_shards_while_they_live_and_share_shard_0_when_none_is_free() {
        init();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut handles = Vec::new();
        // More threads than owned shards, all alive at once.
        let n = shard::COUNT as usize + 3;
        let all = std::sync::Arc::new(std::sync::Barrier::new(n + 1));
        for _ in 0..n {
            let (tx, all) = (tx.clone(), all.clone());
            handles.push(std::thread::spawn(move || {
                count_until_assigned();
                tx.send((tls::get(tls::SHARD), tls::get(tls::FREED_SHARD))).unwrap();
                all.wait();
            }));
        }
        let mut words: Vec<(u64, u64)> = (0..n).map(|_| rx.recv().unwrap()).collect();
        all.wait();
        for h in handles {
            h.join().unwrap();
        }
        words.sort();
        let shared = words.iter().filter(|w| w.0 == shard::SHARED).count();
        // Other tests of this process may hold shards too.
        assert!(shared >= 4, "{words:x?}");
        let mut owned: Vec<u32> =
            words.iter().filter(|w| w.0 != shard::SHARED).map(|w| shard::index(w.0, shard::COUNT)).collect();
        for &(w, f) in &words {
            let s = shard::index(w, shard::COUNT);
            assert_eq!(f, u64::from(s) << shadow::FREED_SHARD_SHIFT);
        }
        owned.dedup();
        assert!(owned.iter().all(|&s| (1..shard::COUNT).contains(&s)), "{owned:?}");
        assert_eq!(owned.len(), n - shared, "two threads owned one shard: {words:x?}");
        // Every thread exited: their shards are free again.
        let after = std::thread::spawn(|| {
            count_until_assigned();
            tls::get(tls::SHARD)
        })
        .join()
        .unwrap();
        assert_ne!(after & shard::EXCLUSIVE, 0, "{after:x}");
    }
}
