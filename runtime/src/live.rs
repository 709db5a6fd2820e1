//! Live tracking: which call site allocated every object that is still
//! live, so that a free, delete or realloc anywhere in the process takes
//! the object off the figures of the site that allocated it.
//!
//! The pointer table is split into [`SHARDS`] shards by a hash of the
//! pointer. Each shard is an open-addressing table (linear probing,
//! backward-shift deletion, no tombstones) in its own anonymous mapping,
//! guarded by its own spin lock: there is no global lock, two threads meet
//! only when their pointers hash to the same shard, and a shard grows (by a
//! fifth, into a fresh mapping) while the other shards carry on.
//!
//! An entry is 16 bytes: the pointer with the allocating module's slot in
//! its top 16 bits, and the site index (24 bits) with the requested size
//! (40 bits). A shard is kept at most 80% full and grows by a fifth, so it
//! is between two thirds and four fifths full once it has grown: 20 to 24
//! bytes per tracked object.
//!
//! Figures: an allocation through a live-tracking trampoline is counted by
//! the trampoline (calls, bytes requested, and failed calls with their
//! bytes); a tracked free adds to the allocating site's freed objects and
//! bytes. Live objects are calls - failed - freed, live bytes bytes -
//! failed bytes - freed bytes: an allocation costs the table insert and
//! nothing more.
//!
//! Reset forgets every pointer lazily: it bumps [`EPOCH`], and a shard
//! whose epoch is stale empties itself the next time it is locked. That
//! keeps the reset path (a signal handler) away from the shard locks, which
//! the interrupted thread may hold.

use crate::control::header_u64;
use alloctramp_trampolines::layout::{CELL_SIZE, cell};
use alloctramp_trampolines::process::hdr;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

pub const SHARD_BITS: u32 = 8;
pub const SHARDS: usize = 1 << SHARD_BITS;
/// Slots past a shard's home range, so that a probe never wraps around.
/// The last one always stays empty: a probe stops there without a bounds
/// check.
const SLACK: usize = 32;
const ENTRY: usize = 16;
const PTR_BITS: u32 = 48;
const PTR_MASK: u64 = (1 << PTR_BITS) - 1;
const SIZE_BITS: u32 = 40;
const SIZE_MASK: u64 = (1 << SIZE_BITS) - 1;
const MAX_INDEX: u64 = (1 << (64 - SIZE_BITS)) - 1;
const PAGE: usize = 4096;

#[repr(C)]
#[derive(Clone, Copy)]
struct Entry {
    /// Pointer | module slot << 48; 0: empty.
    key: u64,
    /// Site index << 40 | requested size.
    value: u64,
}

/// What an empty shard points at: one empty slot, so that a lookup needs
/// no null check.
static EMPTY: Entry = Entry { key: 0, value: 0 };

struct Inner {
    entries: *mut Entry,
    /// Home positions are 0..cap; cap + SLACK slots are mapped (none when
    /// `entries` is `EMPTY`).
    cap: usize,
    /// The shard grows before `len` would exceed this (80% of cap).
    limit: usize,
    len: usize,
    /// Bytes mapped.
    mapped: usize,
}

#[repr(C, align(64))]
struct Shard {
    lock: AtomicBool,
    /// Copies of the shard's epoch and length, written with the lock held
    /// and readable without it (by the control path, in signal context).
    epoch: AtomicU32,
    len: AtomicUsize,
    inner: UnsafeCell<Inner>,
}

// SAFETY: `inner` is only accessed with `lock` held.
unsafe impl Sync for Shard {}

static TABLE: [Shard; SHARDS] = [const {
    Shard {
        lock: AtomicBool::new(false),
        epoch: AtomicU32::new(0),
        len: AtomicUsize::new(0),
        inner: UnsafeCell::new(Inner {
            entries: &EMPTY as *const Entry as *mut Entry,
            cap: 0,
            limit: 0,
            len: 0,
            mapped: 0,
        }),
    }
}; SHARDS];

/// Bumped by a reset; shards with an older epoch forget their contents.
pub static EPOCH: AtomicU32 = AtomicU32::new(0);

/// Where the allocating module's counters are, per registry slot: the
/// runtime's own mapping of them (never unmapped, so a free may count into
/// a module that was unloaded meanwhile).
pub struct ModuleCounters {
    pub base: AtomicU64,
    pub stride: AtomicU64,
    pub mask: AtomicU32,
}

pub static MODULES: [ModuleCounters; 256] =
    [const { ModuleCounters { base: AtomicU64::new(0), stride: AtomicU64::new(0), mask: AtomicU32::new(0) } }; 256];

/// Records where module slot `slot`'s counters are (the runtime's view).
pub fn set_module(slot: usize, base: u64, stride: u64, mask: u32) {
    let m = &MODULES[slot];
    m.stride.store(stride, Ordering::Relaxed);
    m.mask.store(mask, Ordering::Relaxed);
    m.base.store(base, Ordering::Release);
}

/// After fork, in the child: the module's counters moved to the child's
/// file; the parent's view is dropped.
pub fn replace_module_view(slot: usize, base: u64, size: u64, module_counters: u64) {
    let old = MODULES[slot].base.swap(base, Ordering::AcqRel);
    if old != 0 && old != base && old != module_counters {
        // SAFETY: the runtime's own view of the parent's counters, which
        // nothing in the child uses any more.
        unsafe { libc::munmap(old as *mut libc::c_void, size as usize) };
    }
}

/// Turns live tracking on in a module: its trampolines call the tracking
/// functions from now on.
///
/// # Safety
/// `control` must be the module's control block, with no site switched on.
pub unsafe fn enable_in(control: *mut u8, slot: u64) {
    use alloctramp_trampolines::layout::control as c;
    // SAFETY: 8-aligned u64 fields of the control block (caller).
    unsafe {
        let f = |at: u32| control.add(at as usize).cast::<u64>();
        f(c::MODULE_ID).write_volatile(slot);
        f(c::TRACK_ALLOC).write_volatile(track_alloc as *const () as u64);
        f(c::TRACK_FREE).write_volatile(track_free as *const () as u64);
        f(c::TRACK_REALLOC_BEGIN).write_volatile(track_realloc_begin as *const () as u64);
        f(c::TRACK_REALLOC_END).write_volatile(track_realloc_end as *const () as u64);
    }
}

/// glibc's rseq offset from the thread pointer (see `rseq_offset`).
pub static RSEQ: AtomicU64 = AtomicU64::new(0);

/// While profiling is off and free sites stay on for tracked objects to
/// drain.
pub static DRAINING: AtomicBool = AtomicBool::new(false);

#[inline(always)]
fn hash(ptr: u64) -> u64 {
    (ptr & PTR_MASK).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

#[inline(always)]
fn shard_of(h: u64) -> &'static Shard {
    &TABLE[(h >> (64 - SHARD_BITS)) as usize]
}

/// Home position of a hash in a table of `cap` home slots.
#[inline(always)]
fn home(h: u64, cap: usize) -> usize {
    (((h << SHARD_BITS) as u128 * cap as u128) >> 64) as usize
}

#[inline(always)]
fn same(key: u64, ptr: u64) -> bool {
    (key ^ ptr) << (64 - PTR_BITS) == 0
}

/// Locks a shard and returns its contents, emptied first if a reset
/// happened since it was last used.
/// The contents stay exclusively borrowed until [`unlock`]: the lock, not
/// the borrow checker, makes the `&mut` unique.
#[inline(always)]
#[allow(clippy::mut_from_ref)]
fn lock(shard: &Shard) -> &mut Inner {
    if shard.lock.swap(true, Ordering::Acquire) {
        lock_contended(shard);
    }
    if shard.epoch.load(Ordering::Relaxed) != EPOCH.load(Ordering::Relaxed) {
        forget_shard(shard);
    }
    // SAFETY: the lock is held until `unlock`.
    unsafe { &mut *shard.inner.get() }
}

#[inline(always)]
fn unlock(shard: &Shard) {
    shard.lock.store(false, Ordering::Release);
}

#[cold]
#[inline(never)]
fn lock_contended(shard: &Shard) {
    let mut spins = 0u32;
    loop {
        while shard.lock.load(Ordering::Relaxed) {
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                // SAFETY: sched_yield has no preconditions.
                unsafe { libc::sched_yield() };
            }
        }
        if !shard.lock.swap(true, Ordering::Acquire) {
            return;
        }
    }
}

#[cold]
#[inline(never)]
fn forget_shard(shard: &Shard) {
    // SAFETY: called with the lock held.
    release(unsafe { &mut *shard.inner.get() });
    shard.len.store(0, Ordering::Relaxed);
    shard.epoch.store(EPOCH.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Publishes the table's memory (and, while at it, its object count) in
/// the process file's header.
fn account(mapped_delta: isize) {
    if let Some(b) = header_u64(hdr::TABLE_BYTES) {
        b.fetch_add(mapped_delta as u64, Ordering::Relaxed);
    }
    publish_objects();
}

/// Writes the number of tracked objects into the process file's header.
pub fn publish_objects() {
    if let Some(o) = header_u64(hdr::TABLE_OBJECTS) {
        o.store(objects(), Ordering::Relaxed);
    }
}

/// Unmaps a shard's entries (its objects are forgotten).
fn release(inner: &mut Inner) {
    if inner.mapped != 0 {
        // SAFETY: the shard's own mapping, `mapped` bytes.
        unsafe { libc::munmap(inner.entries.cast(), inner.mapped) };
        account(-(inner.mapped as isize));
    }
    inner.entries = &EMPTY as *const Entry as *mut Entry;
    inner.cap = 0;
    inner.limit = 0;
    inner.len = 0;
    inner.mapped = 0;
}

/// Maps a zeroed array with room for at least `slots` entries.
fn map_entries(slots: usize) -> Option<(*mut Entry, usize)> {
    let bytes = (slots * ENTRY).div_ceil(PAGE) * PAGE;
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some((p.cast(), bytes))
}

/// Moves the shard into a mapping a fifth larger (or its first one).
#[cold]
#[inline(never)]
fn grow(inner: &mut Inner) -> bool {
    let mut want = (inner.cap + inner.cap / 5).max(PAGE / ENTRY);
    let old_slots = if inner.mapped == 0 { 0 } else { inner.cap + SLACK };
    'retry: loop {
        let Some((entries, mapped)) = map_entries(want + SLACK) else { return false };
        let cap = mapped / ENTRY - SLACK;
        for i in 0..old_slots {
            // SAFETY: i is within the old mapping.
            let e = unsafe { *inner.entries.add(i) };
            if e.key == 0 {
                continue;
            }
            let mut j = home(hash(e.key), cap);
            // SAFETY: j stays below cap + SLACK - 1, within the new mapping.
            unsafe {
                while (*entries.add(j)).key != 0 {
                    j += 1;
                }
                if j == cap + SLACK - 1 {
                    libc::munmap(entries.cast(), mapped);
                    want = cap * 2;
                    continue 'retry;
                }
                *entries.add(j) = e;
            }
        }
        if inner.mapped != 0 {
            // SAFETY: the old mapping, no longer referenced.
            unsafe { libc::munmap(inner.entries.cast(), inner.mapped) };
        }
        account(mapped as isize - inner.mapped as isize);
        inner.entries = entries;
        inner.cap = cap;
        inner.limit = cap / 5 * 4;
        inner.mapped = mapped;
        return true;
    }
}

enum Insert {
    Done,
    /// The pointer was already there: that object was freed unseen (by
    /// code that is not patched); its old entry is returned.
    Replaced(Entry),
    Failed,
}

#[inline(always)]
fn insert(key: u64, value: u64) -> Insert {
    let h = hash(key);
    let shard = shard_of(h);
    let inner = lock(shard);
    let r = insert_locked(inner, h, key, value);
    if let Insert::Done = r {
        shard.len.store(inner.len, Ordering::Relaxed);
    }
    unlock(shard);
    r
}

#[inline(always)]
fn insert_locked(inner: &mut Inner, h: u64, key: u64, value: u64) -> Insert {
    if inner.len >= inner.limit && !grow(inner) {
        return Insert::Failed;
    }
    loop {
        let mut p = inner.entries.wrapping_add(home(h, inner.cap));
        // SAFETY: probes stop at an empty slot, at the latest the last
        // one, which stays empty.
        unsafe {
            while (*p).key != 0 {
                if same((*p).key, key) {
                    let old = *p;
                    *p = Entry { key, value };
                    return Insert::Replaced(old);
                }
                p = p.add(1);
            }
            if p != inner.entries.add(inner.cap + SLACK - 1) {
                *p = Entry { key, value };
                inner.len += 1;
                return Insert::Done;
            }
        }
        // A cluster ran into the end of the mapping.
        if !grow(inner) {
            return Insert::Failed;
        }
    }
}

/// Takes a pointer's entry out of the table (key 0: not there). The flag
/// says the shard became empty while draining (time to check whether all
/// of it drained).
#[inline(always)]
fn remove(ptr: u64) -> (Entry, bool) {
    let h = hash(ptr);
    let shard = shard_of(h);
    let inner = lock(shard);
    let mut found = Entry { key: 0, value: 0 };
    let mut emptied = false;
    let mut p = inner.entries.wrapping_add(home(h, inner.cap));
    // SAFETY: probes stop at an empty slot, at the latest the last one.
    unsafe {
        while (*p).key != 0 {
            if same((*p).key, ptr) {
                found = *p;
                if (*p.add(1)).key == 0 {
                    (*p).key = 0;
                } else {
                    shift_back(inner, p);
                }
                inner.len -= 1;
                shard.len.store(inner.len, Ordering::Relaxed);
                emptied = inner.len == 0 && DRAINING.load(Ordering::Relaxed);
                break;
            }
            p = p.add(1);
        }
    }
    unlock(shard);
    (found, emptied)
}

/// Backward-shift deletion of the entry at `hole`: later entries of the
/// cluster that may live at the hole or before move into it.
///
/// # Safety
/// `hole` is an occupied slot of `inner`, locked.
#[cold]
#[inline(never)]
unsafe fn shift_back(inner: &mut Inner, mut hole: *mut Entry) {
    // SAFETY: every slot read lies before the cluster's terminating empty
    // slot, within the mapping.
    unsafe {
        let mut j = hole.add(1);
        while (*j).key != 0 {
            let at = inner.entries.add(home(hash((*j).key), inner.cap));
            if at <= hole {
                *hole = *j;
                hole = j;
            }
            j = j.add(1);
        }
        (*hole).key = 0;
    }
}

/// Whether every shard is empty (or stale after a reset). Lock-free: a
/// reading for the control path, exact once the program is between
/// allocator calls.
pub fn is_empty() -> bool {
    objects() == 0
}

/// Objects tracked now (lock-free reading, see [`is_empty`]).
pub fn objects() -> u64 {
    let epoch = EPOCH.load(Ordering::Acquire);
    TABLE
        .iter()
        .filter(|s| s.epoch.load(Ordering::Relaxed) == epoch)
        .map(|s| s.len.load(Ordering::Relaxed) as u64)
        .sum()
}

/// Forgets every tracked pointer (lazily, see the module documentation).
pub fn forget_all() {
    EPOCH.fetch_add(1, Ordering::AcqRel);
}

/// After fork, in the child: no other thread exists, so no lock is really
/// held; the child's figures start from zero, so the table is forgotten.
pub fn after_fork_in_child() {
    for s in &TABLE {
        s.lock.store(false, Ordering::Release);
    }
    forget_all();
}

/// The current CPU's shard of module `slot`'s cell `index`.
#[inline(always)]
fn cell_at(slot: u64, index: u64) -> *const AtomicU64 {
    let m = &MODULES[(slot & 0xff) as usize];
    let cpu: u32;
    // SAFETY: reads glibc's rseq cpu_id_start (or the thread pointer's own
    // first word when rseq is unavailable): always mapped for the thread.
    unsafe {
        std::arch::asm!("mov {0:e}, fs:[{1}]", out(reg) cpu, in(reg) RSEQ.load(Ordering::Relaxed),
            options(nostack, readonly, preserves_flags));
    }
    let shard = u64::from(cpu & m.mask.load(Ordering::Relaxed));
    let base = m.base.load(Ordering::Relaxed);
    (base + shard * m.stride.load(Ordering::Relaxed) + index * CELL_SIZE as u64) as *const AtomicU64
}

/// Adds to a field of a cell.
#[inline(always)]
fn add(cell: *const AtomicU64, field: u32, v: u64) {
    // SAFETY: `cell` points at a 64-byte cell of a live counters mapping
    // (a slot's counters are recorded by `set_module` before its module's
    // hooks are set, so every slot found in the table has them); `field`
    // is an 8-aligned offset in it.
    unsafe { &*cell.byte_add(field as usize) }.fetch_add(v, Ordering::Relaxed);
}

/// Counts an object as freed on the site that allocated it.
#[inline(always)]
fn charge_free(e: Entry) {
    let c = cell_at(e.key >> PTR_BITS, e.value >> SIZE_BITS);
    add(c, cell::FREED_OBJECTS, 1);
    add(c, cell::FREED_BYTES, e.value & SIZE_MASK);
}

/// The module slot a patched module's control block names.
///
/// # Safety
/// `control` must be a registered module's control block.
#[inline(always)]
unsafe fn slot_of(control: *const u8) -> u64 {
    // SAFETY: MODULE_ID is an 8-aligned u64 of the control block (caller).
    unsafe { control.add(alloctramp_trampolines::layout::control::MODULE_ID as usize).cast::<u64>().read() }
}

/// An allocation that was counted but cannot be followed: it leaves the
/// live figures at once, and the report says they are incomplete.
#[cold]
#[inline(never)]
fn untracked_alloc(slot: u64, index: u64, size: u64) {
    let c = cell_at(slot, index & MAX_INDEX);
    add(c, cell::FREED_OBJECTS, 1);
    add(c, cell::FREED_BYTES, size);
    if let Some(n) = header_u64(hdr::UNTRACKED_ALLOCS) {
        n.fetch_add(1, Ordering::Relaxed);
    }
}

#[inline(always)]
fn track(ptr: u64, size: u64, slot: u64, index: u64) {
    if ptr > PTR_MASK || size > SIZE_MASK || index > MAX_INDEX {
        untracked_alloc(slot, index, size);
        return;
    }
    match insert(ptr | slot << PTR_BITS, index << SIZE_BITS | size) {
        Insert::Done => {}
        Insert::Replaced(old) => charge_free(old),
        Insert::Failed => untracked_alloc(slot, index, size),
    }
}

/// A trampoline's allocation succeeded: `ptr` (non-null) holds `size`
/// requested bytes from site `index` of the module of `control`. Returns
/// `ptr`.
///
/// The common case (shard free, room at the home slot's cluster end) runs
/// without a call; everything else goes to [`track`].
///
/// # Safety
/// Called by trampolines with their module's control block.
pub unsafe extern "C" fn track_alloc(ptr: u64, size: u64, index: u64, control: *const u8) -> u64 {
    // SAFETY: forwarded from the caller.
    let slot = unsafe { slot_of(control) };
    if (ptr >> PTR_BITS) | (size >> SIZE_BITS) | (index >> (64 - SIZE_BITS)) != 0 {
        return alloc_slow(ptr, size, index, slot);
    }
    let (key, value) = (ptr | slot << PTR_BITS, index << SIZE_BITS | size);
    let h = hash(ptr);
    let shard = shard_of(h);
    if !shard.lock.swap(true, Ordering::Acquire) {
        if shard.epoch.load(Ordering::Relaxed) == EPOCH.load(Ordering::Relaxed) {
            // SAFETY: the lock is held.
            let inner = unsafe { &mut *shard.inner.get() };
            if inner.len < inner.limit {
                let mut p = inner.entries.wrapping_add(home(h, inner.cap));
                // SAFETY: probes stop at an empty slot, at the latest the
                // last one, which stays empty.
                unsafe {
                    while (*p).key != 0 && !same((*p).key, key) {
                        p = p.add(1);
                    }
                    if (*p).key == 0 && p != inner.entries.add(inner.cap + SLACK - 1) {
                        *p = Entry { key, value };
                        inner.len += 1;
                        shard.len.store(inner.len, Ordering::Relaxed);
                        unlock(shard);
                        return ptr;
                    }
                }
            }
        }
        unlock(shard);
    }
    alloc_slow(ptr, size, index, slot)
}

/// The general case of an allocation: see [`track_alloc`].
#[cold]
#[inline(never)]
fn alloc_slow(ptr: u64, size: u64, index: u64, slot: u64) -> u64 {
    track(ptr, size, slot, index);
    ptr
}

#[cold]
#[inline(never)]
fn untracked_free(index: u64, control: *const u8) {
    // SAFETY: the trampoline's control block.
    let slot = unsafe { slot_of(control) };
    add(cell_at(slot, index), cell::UNTRACKED_FREES, 1);
}

/// The general case of a free: see [`track_free`].
#[cold]
#[inline(never)]
fn free_slow(ptr: u64, index: u64, control: *const u8) -> u64 {
    let (e, emptied) = remove(ptr);
    if e.key != 0 {
        charge_free(e);
    } else {
        untracked_free(index, control);
    }
    if emptied {
        crate::control::finish_drain();
    }
    ptr
}

/// A free while profiling is off and the free sites stay on for tracked
/// objects to drain: the object leaves its site's live figures, and the
/// free site's own figures do not move (draining sites jump to their
/// trampoline's drain entry, past the counting; an untracked free is not
/// counted either).
#[cold]
#[inline(never)]
fn free_draining(ptr: u64) -> u64 {
    let (e, emptied) = remove(ptr);
    if e.key != 0 {
        charge_free(e);
    }
    if emptied {
        crate::control::finish_drain();
    }
    ptr
}

/// A trampoline is about to free `ptr` from site `index`. Returns `ptr`.
///
/// The common case (shard free, the pointer at the end of its cluster, the
/// shard not emptied while draining) runs without a call; everything else
/// goes to [`free_slow`].
///
/// # Safety
/// Called by trampolines with their module's control block.
pub unsafe extern "C" fn track_free(ptr: u64, index: u64, control: *const u8) -> u64 {
    if ptr == 0 {
        return 0;
    }
    if DRAINING.load(Ordering::Relaxed) {
        return free_draining(ptr);
    }
    let h = hash(ptr);
    let shard = shard_of(h);
    if !shard.lock.swap(true, Ordering::Acquire) {
        if shard.epoch.load(Ordering::Relaxed) == EPOCH.load(Ordering::Relaxed) {
            // SAFETY: the lock is held.
            let inner = unsafe { &mut *shard.inner.get() };
            let mut p = inner.entries.wrapping_add(home(h, inner.cap));
            // SAFETY: probes stop at an empty slot, at the latest the last
            // one, which stays empty.
            unsafe {
                while (*p).key != 0 && !same((*p).key, ptr) {
                    p = p.add(1);
                }
                if (*p).key != 0 && (*p.add(1)).key == 0 {
                    let e = *p;
                    (*p).key = 0;
                    inner.len -= 1;
                    let left = inner.len;
                    shard.len.store(left, Ordering::Relaxed);
                    unlock(shard);
                    charge_free(e);
                    if left == 0 && DRAINING.load(Ordering::Relaxed) {
                        return emptied_while_draining(ptr);
                    }
                    return ptr;
                }
            }
        }
        unlock(shard);
    }
    free_slow(ptr, index, control)
}

/// A free emptied a shard while draining.
#[cold]
#[inline(never)]
fn emptied_while_draining(ptr: u64) -> u64 {
    crate::control::finish_drain();
    ptr
}

/// A realloc of `old` from site `index` is about to run: takes `old` out of
/// the table into `token` (two u64: its entry, or zeros). A realloc that
/// fails puts it back.
///
/// # Safety
/// Called by trampolines; `token` points at 16 writable bytes.
pub unsafe extern "C" fn track_realloc_begin(old: u64, token: *mut u64, index: u64, control: *const u8) -> u64 {
    let mut e = Entry { key: 0, value: 0 };
    if old != 0 {
        e = remove(old).0;
        if e.key == 0 {
            untracked_free(index, control);
        }
    }
    // SAFETY: 16 writable bytes (caller).
    unsafe {
        token.write(e.key);
        token.add(1).write(e.value);
    }
    old
}

/// The realloc returned `result` for `size` bytes. Success: the old object
/// (if tracked) is freed on its site, the new one is tracked here. NULL
/// with size 0: the old object was freed. Other failures: the old object
/// is tracked again, unchanged. A NULL result counts its size as failed
/// bytes (the trampoline counts the failed call). Returns `result`.
///
/// # Safety
/// Called by trampolines with the token `track_realloc_begin` filled.
pub unsafe extern "C" fn track_realloc_end(
    result: u64,
    token: *const u64,
    size: u64,
    index: u64,
    control: *const u8,
) -> u64 {
    // SAFETY: the token the trampoline passed to track_realloc_begin.
    let old = unsafe { Entry { key: token.read(), value: token.add(1).read() } };
    // SAFETY: forwarded from the caller.
    let slot = unsafe { slot_of(control) };
    if result == 0 {
        add(cell_at(slot, index), cell::FAILED_BYTES, size);
    }
    if result != 0 || size == 0 {
        if old.key != 0 {
            charge_free(old);
        }
        if result != 0 {
            track(result, size, slot, index);
        }
    } else if old.key != 0 {
        match insert(old.key, old.value) {
            Insert::Replaced(o) => charge_free(o),
            Insert::Done => {}
            Insert::Failed => {
                charge_free(old);
                if let Some(n) = header_u64(hdr::UNTRACKED_ALLOCS) {
                    n.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    result
}

/// Total tracked objects (takes every shard lock in turn).
#[cfg(test)]
fn len() -> usize {
    TABLE
        .iter()
        .map(|s| {
            let n = lock(s).len;
            unlock(s);
            n
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    // The table is process-global: one test exercises it end to end.
    #[test]
    fn insert_remove_grow_and_forget() {
        let n = 200_000u64;
        let key = |i: u64| 0x5555_0000_0000 + i * 48;
        for i in 0..n {
            assert!(matches!(insert(key(i) | 3 << PTR_BITS, i << SIZE_BITS | (i % 1000)), Insert::Done));
        }
        assert_eq!(len(), n as usize);
        // Re-inserting a pointer replaces (the object was freed unseen).
        match insert(key(7) | 4 << PTR_BITS, 1) {
            Insert::Replaced(e) => {
                assert_eq!(e.key, key(7) | 3 << PTR_BITS);
                assert_eq!(e.value, 7 << SIZE_BITS | 7);
            }
            _ => panic!("expected a replacement"),
        }
        for i in (0..n).step_by(2) {
            let e = remove(key(i)).0;
            assert_ne!(e.key, 0, "{i}");
            assert_eq!(e.key & PTR_MASK, key(i));
        }
        assert!(remove(key(0)).0.key == 0);
        assert!(remove(0x1234).0.key == 0);
        for i in (1..n).step_by(2) {
            assert!(remove(key(i)).0.key != 0, "{i}");
        }
        assert_eq!(len(), 0);
        assert!(is_empty());
        for i in 0..1000 {
            insert(key(i), 1);
        }
        forget_all();
        assert!(remove(key(5)).0.key == 0);
        assert_eq!(len(), 0);
    }
}
