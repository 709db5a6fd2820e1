//! Live tracking: which call site allocated every object that is still
//! live, so that a free, delete or realloc anywhere in the process takes
//! the object off the figures of the site that allocated it.
//!
//! Two structures hold the pointer-to-site association:
//!
//! - The **shadow map** (layout in `layout::shadow`): one 32-bit entry per
//!   32-byte granule of the address space below 2^47, in one reservation
//!   that only the granules objects start in materialise. An entry holds
//!   the allocating site's id, the requested size (below 1 KiB; from 1 KiB
//!   a wide record keeps it in the next granule's entry), bits 3-4 of the
//!   address and a LIVE bit. The trampolines write it after an
//!   allocation and clear LIVE before a free inline, without a call, a lock
//!   or a table walk, whichever thread frees; the allocator's own locality
//!   (neighbouring objects, a freed chunk reused for the next allocation of
//!   its size) keeps the entries they touch in few cache lines. glibc's
//!   malloc never starts two live objects in one granule (its chunks are at
//!   least 32 bytes), so an entry has one writer at a time and the
//!   trampolines record with a plain store; with another allocator (whose
//!   small size classes pack several objects in a granule), and at the
//!   sites of allocators the user names, they record by compare-and-swap,
//!   and the object that finds its granule taken goes to the pointer
//!   table. Either way only the owner of a live record writes
//!   it: an allocation writes an entry only while LIVE is clear, so a
//!   free's plain clear of LIVE races with nothing.
//! - The **pointer table**, for the objects the map cannot describe (512
//!   MiB or more, a module without site ids, an address above 2^47, a
//!   granule another live object starts in): split into [`SHARDS`] shards by a hash
//!   of the pointer; each is an open-addressing table (linear probing,
//!   backward-shift deletion, no tombstones) in its own anonymous mapping,
//!   guarded by its own spin lock.
//!
//! A site's id is global: each module with live tracking gets a range of
//! ids as it registers, one per cell of a counter shard, and the runtime
//! maps the module's counters a second time into the **freed view**, at
//! `freed + shard * FREED_SHARD_BYTES + id * 64` for each of
//! `FREED_SHARDS` shards (aliasing the same file pages), so that a free
//! finds the allocating site's cell in the freeing CPU's shard from the id
//! alone.
//!
//! A free clears LIVE and leaves the rest of the entry: a free of the same
//! pointer that finds such an entry is a nested layer of that free (a
//! patched `operator delete` calling a patched `free`) and is left alone.
//!
//! Figures: an allocation through a live-tracking trampoline is counted by
//! the trampoline (calls, bytes requested, and failed calls with their
//! bytes); a tracked free adds to the allocating site's freed objects and
//! bytes. Live objects are calls - failed - freed, live bytes bytes -
//! failed bytes - freed bytes.
//!
//! Reset forgets every pointer: it discards the shadow map's pages
//! (`MADV_DONTNEED`, one system call, safe in the signal handler it runs
//! in) and bumps [`EPOCH`]: a shard whose epoch is stale empties itself
//! the next time it is locked, which keeps the reset path away from the
//! shard locks, which the interrupted thread may hold. A forked child
//! starts with an empty map (`MADV_WIPEONFORK`).

use crate::procfile::{ProcFile, header};
use crate::{sys, tls, trace};
use alloctramp_trampolines::layout::shadow;
use alloctramp_trampolines::layout::{CELL_SIZE, ControlBlock, cell};
use alloctramp_trampolines::trace::kind as trace_kind;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

pub const SHARD_BITS: u32 = 8;
pub const SHARDS: usize = 1 << SHARD_BITS;
/// Slots past a shard's home range, so that a probe never wraps around.
/// The last one always stays empty: a probe stops there without a bounds
/// check.
const SLACK: usize = 32;
const ENTRY: usize = 16;
const PTR_BITS: u32 = 48;
const PTR_MASK: u64 = (1 << PTR_BITS) - 1;
const SIZE_BITS: u32 = 39;
const SIZE_MASK: u64 = (1 << SIZE_BITS) - 1;
/// Cells are 64-byte aligned user-space addresses: 41 significant bits.
const CELL_SHIFT: u32 = 6;
const CELL_LIMIT: u64 = 1 << 47;
const PAGE: usize = 4096;

#[repr(C)]
#[derive(Clone, Copy)]
struct Entry {
    /// Pointer | low 16 bits of (cell >> 6) << 48; 0: empty.
    key: u64,
    /// The other 25 bits of (cell >> 6) << 39 | requested size.
    value: u64,
}

impl Entry {
    /// The entry for an object, if its figures fit.
    fn pack(ptr: u64, cell: u64, size: u64) -> Option<Entry> {
        if ptr == 0 || ptr > PTR_MASK || size > SIZE_MASK || cell >= CELL_LIMIT || cell & 63 != 0 {
            return None;
        }
        let c = cell >> CELL_SHIFT;
        Some(Entry { key: ptr | (c & 0xffff) << PTR_BITS, value: (c >> 16) << SIZE_BITS | size })
    }

    fn cell(&self) -> u64 {
        ((self.key >> PTR_BITS) | (self.value >> SIZE_BITS) << 16) << CELL_SHIFT
    }

    fn size(&self) -> u64 {
        self.value & SIZE_MASK
    }
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

/// Objects in the table's shards (current or stale): while 0, a free that
/// finds no record in the shadow map need not lock a shard.
static TABLE_LEN: AtomicUsize = AtomicUsize::new(0);

/// What to call when a free while draining may have taken the last tracked
/// object (set at start-up by the layer that switches: live tracking sits
/// below it and does not call up into it).
pub static ON_DRAINED: crate::sys::Hook = crate::sys::Hook::new();

fn drain_may_be_over() {
    ON_DRAINED.call();
}

/// While profiling is off and free sites stay on for tracked objects to
/// drain.
pub static DRAINING: AtomicBool = AtomicBool::new(false);

/// While draining: tracked frees still expected before the count of
/// tracked objects is taken again (set by the switching layer).
pub static DRAIN_LEFT: AtomicI64 = AtomicI64::new(0);

#[inline(always)]
fn hash(ptr: u64) -> u64 {
    (ptr & PTR_MASK).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

#[inline(always)]
#[allow(clippy::indexing_slicing)]
fn shard_of(h: u64) -> &'static Shard {
    // The top SHARD_BITS bits of a u64 index TABLE's 1 << SHARD_BITS shards.
    const _: () = assert!(SHARDS == 1 << SHARD_BITS);
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

/// A locked shard: its contents, exclusively, until the guard is dropped.
struct Locked<'a> {
    shard: &'a Shard,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    #[inline(always)]
    fn deref(&self) -> &Inner {
        // SAFETY: the guard holds the shard's lock.
        unsafe { &*self.shard.inner.get() }
    }
}

impl std::ops::DerefMut for Locked<'_> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut Inner {
        // SAFETY: the guard holds the shard's lock, and `&mut self` makes
        // this the only borrow through it.
        unsafe { &mut *self.shard.inner.get() }
    }
}

impl Drop for Locked<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.shard.lock.store(false, Ordering::Release);
    }
}

/// Locks a shard; its contents are emptied first if a reset happened since
/// it was last used.
#[inline(always)]
fn lock(shard: &Shard) -> Locked<'_> {
    if shard.lock.swap(true, Ordering::Acquire) {
        lock_contended(shard);
    }
    if shard.epoch.load(Ordering::Relaxed) != EPOCH.load(Ordering::Relaxed) {
        forget_shard(shard);
    }
    Locked { shard }
}

#[cold]
#[inline(never)]
fn lock_contended(shard: &Shard) {
    let mut spins = 0u32;
    loop {
        while shard.lock.load(Ordering::Relaxed) {
            spins = spins.saturating_add(1);
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
    TABLE_LEN.fetch_sub(shard.len.swap(0, Ordering::Relaxed), Ordering::Relaxed);
    shard.epoch.store(EPOCH.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Publishes the table's memory in the process file's header.
fn account(mapped_delta: isize) {
    if let Some(b) = header().map(|h| &h.table_bytes) {
        b.fetch_add(mapped_delta as u64, Ordering::Relaxed);
    }
}

/// Writes the number of tracked objects into the process file's header.
pub fn publish_objects(objects: u64) {
    if let Some(o) = header().map(|h| &h.table_objects) {
        o.store(objects, Ordering::Relaxed);
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

/// Inserts into a locked shard, publishing its length.
fn insert_in(shard: &Shard, inner: &mut Inner, h: u64, e: Entry) -> Insert {
    let r = insert_locked(inner, h, e);
    if let Insert::Done = r {
        shard.len.store(inner.len, Ordering::Relaxed);
        TABLE_LEN.fetch_add(1, Ordering::Relaxed);
    }
    r
}

fn insert_locked(inner: &mut Inner, h: u64, e: Entry) -> Insert {
    if inner.len >= inner.limit && !grow(inner) {
        return Insert::Failed;
    }
    loop {
        let mut p = inner.entries.wrapping_add(home(h, inner.cap));
        // SAFETY: probes stop at an empty slot, at the latest the last
        // one, which stays empty.
        unsafe {
            while (*p).key != 0 {
                if same((*p).key, e.key) {
                    let old = *p;
                    *p = e;
                    return Insert::Replaced(old);
                }
                p = p.add(1);
            }
            if p != inner.entries.add(inner.cap + SLACK - 1) {
                *p = e;
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

/// Takes a pointer's entry out of a locked shard. The flag says the shard
/// became empty.
fn remove_in(shard: &Shard, inner: &mut Inner, h: u64, ptr: u64) -> Option<(Entry, bool)> {
    let mut p = inner.entries.wrapping_add(home(h, inner.cap));
    // SAFETY: probes stop at an empty slot, at the latest the last one.
    unsafe {
        while (*p).key != 0 {
            if same((*p).key, ptr) {
                let found = *p;
                if (*p.add(1)).key == 0 {
                    (*p).key = 0;
                } else {
                    shift_back(inner, p);
                }
                inner.len -= 1;
                shard.len.store(inner.len, Ordering::Relaxed);
                TABLE_LEN.fetch_sub(1, Ordering::Relaxed);
                return Some((found, inner.len == 0));
            }
            p = p.add(1);
        }
    }
    None
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

/// Where the shadow map and the freed view are (0: live tracking has no
/// shadow map; the process only counts).
static SHADOW: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);
/// Granules the shadow map covers (from address 0).
static GRANULES: AtomicU64 = AtomicU64::new(0);
/// The allocator never starts two live objects in one granule (the
/// process's malloc is glibc's, see [`reserve`]): the trampolines record
/// objects with plain stores.
static ONE_PER_GRANULE: AtomicBool = AtomicBool::new(false);
/// The next site id to give.
static NEXT_ID: AtomicU32 = AtomicU32::new(shadow::FIRST_ID);

/// The next site id to give: it grows each time a module gets ids, so a
/// reader that saw the same value knows of every site with an id.
pub fn ids_given() -> u32 {
    NEXT_ID.load(Ordering::Acquire)
}

/// Whether the shadow map is reserved ([`reserve`]).
pub fn reserved() -> bool {
    SHADOW.load(Ordering::Acquire) != 0
}

/// Reserves the shadow map and the freed view. Live tracking needs them;
/// without (an address-space limit, strict overcommit) the process only
/// counts, and the error says why.
pub fn reserve() -> Result<(), &'static str> {
    if SHADOW.load(Ordering::Relaxed) != 0 {
        return Ok(());
    }
    let map = |bytes: u64, prot: i32| {
        // SAFETY: a fresh private anonymous reservation.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes as usize,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        (p != libc::MAP_FAILED).then_some(p)
    };
    // The whole user address space, or as much of its bottom as the
    // process can reserve (under valgrind, the client's).
    let Some((sh, granules)) = (36..=shadow::ADDRESS_BITS).rev().find_map(|bits| {
        let granules = 1u64 << (bits - shadow::GRANULE_SHIFT);
        // A spare page after the last entry: a free of an object of 0
        // bytes in the last granule reads the next entry (see
        // `layout::shadow`), which no record ever writes there.
        map(granules * 4 + PAGE as u64, libc::PROT_READ | libc::PROT_WRITE).map(|p| (p, granules))
    }) else {
        return Err(
            "cannot reserve the shadow map for live tracking (address space limit or strict overcommit); counting only",
        );
    };
    let bytes = granules as usize * 4 + PAGE;
    let freed_bytes = u64::from(shadow::FREED_SHARDS) * shadow::FREED_SHARD_BYTES;
    let Some(fr) = map(freed_bytes, libc::PROT_NONE) else {
        // SAFETY: the reservation just made.
        unsafe { libc::munmap(sh, bytes) };
        return Err("cannot reserve the freed view for live tracking; counting only");
    };
    // SAFETY: advice on the runtime's own reservation. A child of fork
    // starts with an empty map (its figures start from zero); core dumps
    // leave it out; huge pages would materialise 2 MiB per object outside
    // the heap. Failures only cost memory.
    unsafe {
        libc::madvise(sh, bytes, libc::MADV_DONTDUMP);
        libc::madvise(sh, bytes, libc::MADV_NOHUGEPAGE);
        if libc::madvise(sh, bytes, libc::MADV_WIPEONFORK) != 0 {
            WIPE_IN_CHILD.store(true, Ordering::Relaxed);
        }
        libc::madvise(fr, freed_bytes as usize, libc::MADV_DONTDUMP);
    }
    ONE_PER_GRANULE.store(malloc_is_glibcs(), Ordering::Relaxed);
    FREED.store(fr as u64, Ordering::Relaxed);
    GRANULES.store(granules, Ordering::Relaxed);
    SHADOW.store(sh as u64, Ordering::Release);
    Ok(())
}

/// The kernel did not take `MADV_WIPEONFORK` (before Linux 4.14): a forked
/// child discards the map itself.
static WIPE_IN_CHILD: AtomicBool = AtomicBool::new(false);

/// Whether `malloc` resolves to the C library's own (the one that
/// exports `__libc_malloc`): only then do the trampolines write entries
/// with plain stores (one live object per granule).
fn malloc_is_glibcs() -> bool {
    let object_of = |f: *const libc::c_void| sys::object_of(f as usize);
    // SAFETY: dlsym with a static C string.
    let libc_malloc = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"__libc_malloc".as_ptr()) };
    if libc_malloc.is_null() {
        return false;
    }
    let malloc = libc::malloc as *const libc::c_void;
    matches!((object_of(malloc), object_of(libc_malloc)), (Some(a), Some(b)) if a == b)
}

/// The shadow map's entry for `ptr`, if the map covers it.
#[inline(always)]
fn entry_of(ptr: u64) -> Option<&'static AtomicU32> {
    let base = SHADOW.load(Ordering::Relaxed);
    let granule = ptr >> shadow::GRANULE_SHIFT;
    if base == 0 || granule >= GRANULES.load(Ordering::Relaxed) {
        return None;
    }
    let at = base + granule * 4;
    // SAFETY: inside the reservation, which is never unmapped
    // and reads as zeros where nothing was written; 4-aligned.
    Some(unsafe { &*(at as *const AtomicU32) })
}

/// The entry of the granule after `e`'s (or the spare page's first word
/// after the map's last).
#[inline(always)]
fn next_entry(e: &AtomicU32) -> &AtomicU32 {
    // SAFETY: `e` is an entry of the reservation, which has a spare page
    // after its last entry (see `reserve`).
    unsafe { &*(e as *const AtomicU32).add(1) }
}

/// The size of the object whose record `old` (decoded with `ptr`) is in
/// `e`: the record's own, or for a wide record its extension's, which this
/// clears.
fn take_size(e: &AtomicU32, old: u32, ptr: u64) -> u64 {
    let size = shadow::size(old, ptr);
    if size != 0 {
        return size;
    }
    let next = next_entry(e);
    let x = next.load(Ordering::Relaxed);
    if !shadow::is_ext(x) {
        return 0;
    }
    next.store(0, Ordering::Relaxed);
    shadow::ext_size(x)
}

/// Granule `granule` holds `old`, which is live: if it is the record of an
/// object that an object of `size` bytes at `ptr` overlaps, or an
/// extension of a record such an object overlaps, that object was freed
/// unseen: charges it and takes its record out. Returns whether the entry
/// is free now (false: the live record of a neighbour `ptr` does not
/// overlap, left alone).
fn settle_overlapped(e: &AtomicU32, old: u32, granule: u64, ptr: u64, size: u64) -> bool {
    if shadow::is_ext(old) {
        // The record it extends is in the granule before, of an object at
        // least SIZE_LIMIT long, which covers this granule.
        if granule > 0 {
            // SAFETY: the entry before `e` in the reservation.
            let before = unsafe { &*(e as *const AtomicU32).sub(1) };
            let b = before.load(Ordering::Relaxed);
            if let Some(at) = shadow::live_record_at(b, granule - 1)
                && shadow::size(b, at) == 0
                && before.compare_exchange(b, b & !shadow::LIVE, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                charge_id(shadow::id(b, at), shadow::ext_size(old));
            }
        }
        // (A record gone meanwhile left its extension behind: stale.)
        e.store(0, Ordering::Relaxed);
        return true;
    }
    let Some(at) = shadow::live_record_at(old, granule) else { return true };
    // Two objects overlap if either starts inside the other: the record's
    // is wide (it covers its granule and more) or starts where ours
    // starts, or ours covers its start.
    let theirs_wide = shadow::size(old, at) == 0 && shadow::is_ext(next_entry(e).load(Ordering::Relaxed));
    let overlaps =
        at == ptr || (at < ptr && (theirs_wide || at + shadow::size(old, at) > ptr)) || (ptr < at && at - ptr < size);
    if !overlaps {
        return false;
    }
    if e.compare_exchange(old, old & !shadow::LIVE, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
        charge_id(shadow::id(old, at), take_size(e, old, at));
    }
    true
}

/// Records an object in the shadow map (a wide record from
/// [`shadow::SIZE_LIMIT`] bytes). False: the granule (or for a wide record
/// the next) holds another live object's record (the pointer table takes
/// this one).
fn insert_shadow(e: &AtomicU32, ptr: u64, id: u32, size: u64) -> bool {
    let granule = ptr >> shadow::GRANULE_SHIFT;
    let wide = size >= shadow::SIZE_LIMIT;
    if wide {
        // The next granule lies inside the object: whatever live record
        // or extension it holds is of an object freed unseen.
        let next = next_entry(e);
        sys::touch_for_write(next);
        let x = next.load(Ordering::Relaxed);
        if shadow::is_live(x) && !settle_overlapped(next, x, granule + 1, ptr, size) {
            return false;
        }
    }
    let new = shadow::entry(ptr, id, if wide { 0 } else { size });
    // A record is written: the entry's first access is a write.
    sys::touch_for_write(e);
    let mut old = e.load(Ordering::Relaxed);
    loop {
        if shadow::is_live(old) {
            if !settle_overlapped(e, old, granule, ptr, size) {
                if wide {
                    // No extension without its record.
                    next_entry(e).store(0, Ordering::Relaxed);
                }
                return false;
            }
            old = e.load(Ordering::Relaxed);
            continue;
        }
        if wide {
            // Before the record: a free that finds the record finds it.
            next_entry(e).store(shadow::ext(size), Ordering::Relaxed);
        }
        match e.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(now) => old = now,
        }
    }
}

/// Takes `ptr`'s record out of the shadow map: its site id and size.
fn remove_shadow(ptr: u64) -> Option<(u32, u64)> {
    let e = entry_of(ptr)?;
    let mut old = e.load(Ordering::Relaxed);
    loop {
        if !shadow::is_record_of(old, ptr) || shadow::id(old, ptr) == 0 {
            return None;
        }
        match e.compare_exchange_weak(old, old & !shadow::LIVE, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return Some((shadow::id(old, ptr), take_size(e, old, ptr))),
            Err(now) => old = now,
        }
    }
}

/// Discards every record in the shadow map. Async-signal-safe.
fn wipe_shadow() {
    let base = SHADOW.load(Ordering::Acquire);
    if base != 0 {
        let bytes = GRANULES.load(Ordering::Relaxed) as usize * 4;
        // SAFETY: the runtime's own reservation; its pages read as zeros
        // afterwards.
        unsafe { libc::madvise(base as *mut libc::c_void, bytes, libc::MADV_DONTNEED) };
    }
}

/// Where the allocating module's counters are, per registry slot: the
/// runtime's own mapping of them (never unmapped, so a free may count into
/// a module that was unloaded meanwhile; in a forked child, the parent's
/// view is replaced once no record names it, see `replace_module_view`),
/// and the module's site ids (first 0: none) with its index in the
/// process file, whose counters the freed view maps ([`NO_FILE_INDEX`]:
/// none in this process's file, as in a forked child for a module that
/// did not join the child's).
/// Never memory the module owns: a module whose counters cannot be given
/// such a view is not profiled.
pub struct ModuleCounters {
    pub base: AtomicU64,
    pub size: AtomicU64,
    pub stride: AtomicU64,
    pub mask: AtomicU32,
    pub first_id: AtomicU32,
    pub ids: AtomicU32,
    pub file_index: AtomicU32,
}

/// A [`ModuleCounters::file_index`] that names no module of the file.
pub const NO_FILE_INDEX: u32 = u32::MAX;

pub static MODULES: [ModuleCounters; 256] = [const {
    ModuleCounters {
        base: AtomicU64::new(0),
        size: AtomicU64::new(0),
        stride: AtomicU64::new(0),
        mask: AtomicU32::new(0),
        first_id: AtomicU32::new(0),
        ids: AtomicU32::new(0),
        file_index: AtomicU32::new(NO_FILE_INDEX),
    }
}; 256];

/// Records where module slot `slot`'s counters are (the runtime's view).
pub fn set_module(slot: usize, base: u64, size: u64, stride: u64, mask: u32) {
    let Some(m) = MODULES.get(slot) else { return };
    m.size.store(size, Ordering::Relaxed);
    m.stride.store(stride, Ordering::Relaxed);
    m.mask.store(mask, Ordering::Relaxed);
    m.base.store(base, Ordering::Release);
}

/// Maps module `file_index`'s counters (shards of `stride` bytes, `mask`)
/// into the freed view at ids `first..`: each freed shard that a thread
/// may add to (one whose storage is reserved, `shards::RESERVED`) maps the
/// module's shard of the same number (modulo its shard count) from the
/// process file. The others stay unmapped until a thread is first given
/// their shard ([`map_freed_shard`]): a process of one thread maps 1 or 2
/// of the 16.
fn alias_freed(file: &mut ProcFile, file_index: u32, first: u32, stride: u64, mask: u32) -> bool {
    let base = shard0_freed_cell(first);
    let reserved = crate::shards::RESERVED.load(Ordering::Acquire) | 1;
    file.map_module_shards(std::iter::once((file_index, stride, mask, base)), reserved, shadow::FREED_SHARD_BYTES)
        .is_ok()
}

/// Maps freed shard `s` of every module with site ids (loaded or not: a
/// thread may free an object of an unloaded module), before a thread is
/// given shard `s` for the first time. Called with the process file's lock
/// held, as `give_ids` is: a module given ids meanwhile maps the shard
/// itself.
pub fn map_freed_shard(file: &mut ProcFile, s: u32) -> Result<(), &'static str> {
    if FREED.load(Ordering::Relaxed) == 0 || s >= shadow::FREED_SHARDS {
        return Ok(());
    }
    // (A forked child's module that is not in its file has no index: the
    // child's records of it were forgotten, and no free adds to its cells.)
    let modules = MODULES.iter().filter_map(|m| {
        let (first, index) = (m.first_id.load(Ordering::Acquire), m.file_index.load(Ordering::Relaxed));
        (first != 0 && index != NO_FILE_INDEX).then(|| {
            let (stride, mask) = (m.stride.load(Ordering::Relaxed), m.mask.load(Ordering::Relaxed));
            (index, stride, mask, shard0_freed_cell(first))
        })
    });
    file.map_module_shards(modules, 1 << s, shadow::FREED_SHARD_BYTES)
}

/// Gives a module site ids and its freed view, if the process file holds
/// its counters (`file`: the file and the module's index in it) and ids
/// remain; writes what its trampolines read.
fn give_ids(control: &ControlBlock, slot: usize, file: Option<(&mut ProcFile, u32)>) {
    let r = Ordering::Relaxed;
    let Some(m) = MODULES.get(slot) else { return };
    let (stride, mask) = (m.stride.load(r), m.mask.load(r));
    let n = (stride / CELL_SIZE as u64) as u32;
    let first = NEXT_ID.load(r);
    let index = file.as_ref().map(|&(_, index)| index);
    let fits = n > 0
        && FREED.load(r) != 0
        && u64::from(first) + u64::from(n) <= 1 << shadow::ID_BITS
        && file.is_some_and(|(f, index)| alias_freed(f, index, first, stride, mask) && f.set_first_id(index, first));
    if !fits {
        m.first_id.store(0, r);
        no_inline_records(control);
        return;
    }
    m.ids.store(n, r);
    if let Some(index) = index {
        m.file_index.store(index, r);
    }
    m.first_id.store(first, Ordering::Release);
    // After the module's ids: a reader that sees the new value sees them.
    NEXT_ID.store(first + n, Ordering::Release);
    control.entry_base.store(u64::from(first << shadow::ID_SHIFT | shadow::LIVE), r);
    // Plain stores where one granule never holds two live objects, else
    // compare-and-swap (see the module's documentation).
    control.cas_limit.store(shadow::SIZE_LIMIT, r);
    control.inline_limit.store(if ONE_PER_GRANULE.load(r) { shadow::SIZE_LIMIT } else { 0 }, r);
}

/// The module's trampolines leave every record to the runtime.
fn no_inline_records(control: &ControlBlock) {
    control.inline_limit.store(0, Ordering::Relaxed);
    control.cas_limit.store(0, Ordering::Relaxed);
    control.entry_base.store(0, Ordering::Relaxed);
}

/// After fork, in the child: the module's counters moved to the child's
/// file (`file`: the file and the module's index in it) or a private
/// mapping; the parent's view is dropped. The freed view follows the new
/// view; a module whose new view is private loses its ids.
///
/// # Safety
/// Only in a forked child's only thread, after [`after_fork_in_child`]
/// forgot every record (which name cells of the old view); `control` is
/// the module's control block.
pub unsafe fn replace_module_view(
    control: &ControlBlock,
    slot: usize,
    base: u64,
    size: u64,
    module_counters: u64,
    file: Option<(&mut ProcFile, u32)>,
) {
    let Some(m) = MODULES.get(slot) else { return };
    let old = m.base.swap(base, Ordering::AcqRel);
    if old != 0 && old != base && old != module_counters {
        // SAFETY: the runtime's own view of the parent's counters; no
        // record names a cell in it any more (caller), and the control
        // block now names the new view.
        unsafe { libc::munmap(old as *mut libc::c_void, size as usize) };
    }
    let (first, stride, mask) =
        (m.first_id.load(Ordering::Relaxed), m.stride.load(Ordering::Relaxed), m.mask.load(Ordering::Relaxed));
    if let Some((_, index)) = file {
        m.file_index.store(index, Ordering::Relaxed);
    }
    if first != 0
        && !file.is_some_and(|(f, index)| alias_freed(f, index, first, stride, mask) && f.set_first_id(index, first))
    {
        m.first_id.store(0, Ordering::Relaxed);
        no_inline_records(control);
        // The parent's pages must not take the child's frees: fresh zeros.
        for k in 0..u64::from(shadow::FREED_SHARDS) {
            let at = shard0_freed_cell(first) + k * shadow::FREED_SHARD_BYTES;
            // SAFETY: the module's range of the runtime's freed view.
            unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    stride as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
        }
    }
}

/// Turns live tracking on in a module: its trampolines record objects in
/// the shadow map and call the tracking functions from now on. `file`:
/// the process file and the module's index in it, when the file holds the
/// module's counters (set with [`set_module`]), which the freed view maps.
///
/// # Safety
/// `control` must be the module's control block, with no site switched on.
pub unsafe fn enable_in(control: &ControlBlock, slot: u64, file: Option<(&mut ProcFile, u32)>) {
    let r = Ordering::Relaxed;
    control.module_id.store(slot, r);
    control.track_alloc.store(track_alloc as *const () as u64, r);
    control.track_free.store(track_free as *const () as u64, r);
    control.track_realloc_begin.store(track_realloc_begin as *const () as u64, r);
    control.track_realloc_end.store(track_realloc_end as *const () as u64, r);
    control.shadow.store(SHADOW.load(r), r);
    control.freed.store(FREED.load(r), r);
    control.shadow_granules.store(GRANULES.load(r), r);
    control.shadow_mask.store(shadow_mask(), r);
    give_ids(control, slot as usize, file);
    if trace::ON.load(Ordering::Acquire) {
        // SAFETY: the module's control block, live tracking just on.
        unsafe { set_tracing(control, slot as usize, true) };
    }
}

/// The control blocks' `shadow_mask`: the offset of the last granule the
/// map covers.
fn shadow_mask() -> u64 {
    let granules = GRANULES.load(Ordering::Relaxed);
    (granules << shadow::GRANULE_SHIFT).wrapping_sub(1) & !((1 << shadow::GRANULE_SHIFT) - 1)
}

/// Switches a module's trampolines to tracing (`on`) or back: while
/// tracing, the start entries leave every record to the runtime, whose
/// tracing functions record each event (see `trace`). The traced entries,
/// which the sites jump to while every event is recorded
/// (`state::TRACED`), record inline where the start entries would and
/// write each event's record themselves (their own copies of the limits
/// and mask, set here then); at any other time they too leave every
/// record to the runtime. No trampoline runs a tracing instruction
/// otherwise. The fields change one by one under running trampolines, and every mix of old and new values is correct:
/// the limits only choose between the inline path and the runtime's, the
/// mask 0 sends a free's inline lookup to the entry of the map's first
/// granule (which no object starts in, so it finds no record and calls
/// the runtime, whose lookup uses the whole map), and either set of
/// functions tracks objects the same way. A module without ids (its
/// frees could not name the allocating site) is not traced.
///
/// # Safety
/// `control` must be the module's control block, with live tracking on.
pub unsafe fn set_tracing(control: &ControlBlock, slot: usize, on: bool) {
    let r = Ordering::Relaxed;
    let first = MODULES.get(slot).map_or(0, |m| m.first_id.load(Ordering::Acquire));
    let has_ids = first != 0;
    // The traced entries' inline paths stop first (and start last).
    control.trace_inline_limit.store(0, r);
    control.trace_cas_limit.store(0, r);
    control.trace_shadow_mask.store(0, r);
    if control.track_alloc.load(r) == 0 || on && !has_ids {
        return;
    }
    // What the three fields the trace zeroes hold without one.
    let mask = shadow_mask();
    let cas = shadow::SIZE_LIMIT;
    let inline = if ONE_PER_GRANULE.load(r) { shadow::SIZE_LIMIT } else { 0 };
    if on {
        control.track_alloc.store(trace_alloc as *const () as u64, r);
        control.track_free.store(trace_free as *const () as u64, r);
        control.track_realloc_begin.store(trace_realloc_begin as *const () as u64, r);
        control.track_realloc_end.store(trace_realloc_end as *const () as u64, r);
        control.inline_limit.store(0, r);
        control.cas_limit.store(0, r);
        control.shadow_mask.store(0, r);
        // Every event recorded: the traced entries record inline where
        // the start entries would, and each writes the record itself
        // (`state::TRACED` switches the sites to them).
        if trace::records_every_event() {
            control.trace_base.store(u64::from(first) << trace::SITE_SHIFT, r);
            control.trace_shadow_mask.store(mask, r);
            control.trace_cas_limit.store(cas, r);
            control.trace_inline_limit.store(inline, r);
        }
    } else {
        control.shadow_mask.store(mask, r);
        if has_ids {
            control.cas_limit.store(cas, r);
            control.inline_limit.store(inline, r);
        }
        control.track_alloc.store(track_alloc as *const () as u64, r);
        control.track_free.store(track_free as *const () as u64, r);
        control.track_realloc_begin.store(track_realloc_begin as *const () as u64, r);
        control.track_realloc_end.store(track_realloc_end as *const () as u64, r);
    }
}

/// The process-wide id of a counter cell's site (shard 0's copy, or a
/// cell of the freed view), as traces name sites; 0: not known.
fn id_of_cell(cell: u64) -> u32 {
    let id = id_of_freed_cell(cell);
    if id != 0 {
        return id;
    }
    for m in &MODULES {
        let base = m.base.load(Ordering::Acquire);
        let (size, stride) = (m.size.load(Ordering::Relaxed), m.stride.load(Ordering::Relaxed));
        let first = m.first_id.load(Ordering::Relaxed);
        if base != 0 && stride != 0 && first != 0 && cell >= base && cell - base < size {
            return first + ((cell - base) % stride / CELL_SIZE as u64) as u32;
        }
    }
    0
}

fn charge_site(c: Charge) -> u32 {
    match c {
        Charge::Id(id) => id,
        Charge::Cell(cell) => id_of_cell(cell),
    }
}

/// The id of site `index` of a traced module (one with ids: see
/// [`set_tracing`]) from its control block's entry base, or the hook's
/// (`control` 0).
///
/// # Safety
/// As for [`cell_of`].
#[inline(always)]
unsafe fn traced_id(index: u64, control: *const u8) -> u32 {
    if control.is_null() {
        // SAFETY: forwarded from the caller.
        return unsafe { origin(index, control) }.id;
    }
    // SAFETY: a registered module's control block (caller).
    let c = unsafe { alloctramp_trampolines::pod::at::<ControlBlock>(control as usize) };
    let first = (c.entry_base.load(Ordering::Relaxed) >> shadow::ID_SHIFT) as u32;
    // 0 (no id): a module without ids (it lost them in a forked child).
    if first == 0 || index >= 1 << shadow::ID_BITS { 0 } else { first + index as u32 }
}

/// [`track_alloc`], recording the event. The common case first, with no
/// call: a module with ids, and an 8-aligned object below
/// `shadow::SIZE_LIMIT` whose granule holds no live record, recorded by
/// compare-and-swap as a trampoline would (everything else:
/// [`trace_alloc_slow`]).
///
/// # Safety
/// As for [`track_alloc`].
unsafe extern "C" fn trace_alloc(ptr: u64, size: u64, index: u64, control: *const u8) -> u64 {
    if !control.is_null() && size < shadow::SIZE_LIMIT && ptr & 7 == 0 && index < 1 << shadow::ID_BITS {
        // SAFETY: a registered module's control block (caller).
        let c = unsafe { alloctramp_trampolines::pod::at::<ControlBlock>(control as usize) };
        // The module's first id, shifted, with LIVE (0: no ids).
        let base = c.entry_base.load(Ordering::Relaxed) as u32;
        if base != 0
            && let Some(e) = control_entry(c, ptr)
        {
            let id_bits = base + ((index as u32) << shadow::ID_SHIFT);
            let old = e.load(Ordering::Relaxed);
            let new = ((size as u32) << shadow::SIZE_SHIFT | id_bits) ^ ptr as u32;
            if !shadow::is_live(old) && e.compare_exchange(old, new, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                return trace::record(trace_kind::ALLOC, id_bits >> shadow::ID_SHIFT, 0, ptr, size);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { trace_alloc_slow(ptr, size, index, control) }
}

/// The shadow-map entry of `ptr` as a trampoline of the module of `c`
/// finds it: None above the granules the map covers (0 while the module's
/// live tracking is off).
#[inline(always)]
fn control_entry(c: &ControlBlock, ptr: u64) -> Option<&'static AtomicU32> {
    let granule = ptr >> shadow::GRANULE_SHIFT;
    if granule >= c.shadow_granules.load(Ordering::Relaxed) {
        return None;
    }
    let at = c.shadow.load(Ordering::Relaxed) + granule * 4;
    // SAFETY: granules below `shadow_granules` lie in the map the control
    // block names (written together), which is never unmapped and reads as
    // zeros where nothing was written; 4-aligned.
    Some(unsafe { &*(at as *const AtomicU32) })
}

/// [`trace_alloc`] for every other allocation.
///
/// # Safety
/// As for [`track_alloc`].
#[cold]
#[inline(never)]
unsafe extern "C" fn trace_alloc_slow(ptr: u64, size: u64, index: u64, control: *const u8) -> u64 {
    // SAFETY: forwarded from the caller.
    let (id, o) = unsafe { (traced_id(index, control), origin(index, control)) };
    track(ptr, o, size);
    trace::record(trace_kind::ALLOC, id, 0, ptr, size)
}

/// [`track_free`], recording the event (with the site that allocated
/// the object, when known). The common case first, with no call: a
/// module with ids freeing an object whose record (not a wide one) the
/// shadow map holds, which it frees as a trampoline would (everything
/// else: [`trace_free_slow`]).
///
/// # Safety
/// As for [`track_free`].
unsafe extern "C" fn trace_free(ptr: u64, index: u64, control: *const u8) -> u64 {
    if !control.is_null() && index < 1 << shadow::ID_BITS && !DRAINING.load(Ordering::Relaxed) {
        // SAFETY: a registered module's control block (caller).
        let c = unsafe { alloctramp_trampolines::pod::at::<ControlBlock>(control as usize) };
        let first = (c.entry_base.load(Ordering::Relaxed) as u32) >> shadow::ID_SHIFT;
        if first != 0
            && let Some(e) = control_entry(c, ptr)
        {
            let old = e.load(Ordering::Relaxed);
            let (alloc_site, size) = (shadow::id(old, ptr), shadow::size(old, ptr));
            if shadow::is_record_of(old, ptr)
                && alloc_site != 0
                && size != 0
                && e.compare_exchange(old, old & !shadow::LIVE, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                charge_id(alloc_site, size);
                return trace::record(trace_kind::FREE, first + index as u32, alloc_site, ptr, size);
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { trace_free_slow(ptr, index, control) }
}

/// [`trace_free`] for every other free.
///
/// # Safety
/// As for [`track_free`].
#[cold]
#[inline(never)]
unsafe extern "C" fn trace_free_slow(ptr: u64, index: u64, control: *const u8) -> u64 {
    // SAFETY: forwarded from the caller.
    let site = unsafe { traced_id(index, control) };
    if ptr == 0 {
        return trace::record(trace_kind::FREE, site, 0, 0, 0);
    }
    if DRAINING.load(Ordering::Relaxed) {
        return free_draining(ptr);
    }
    match remove(ptr) {
        Some((c, size)) => {
            charge(c, size);
            trace::record(trace_kind::FREE, site, charge_site(c), ptr, size);
        }
        None if nested(ptr) => {}
        None => {
            untracked_free(index, control);
            trace::record(trace_kind::FREE, site, 0, ptr, 0);
        }
    }
    ptr
}

/// [`track_realloc_begin`], keeping the old pointer for the event: in the
/// token's second word when it holds no record (`track_realloc_end` reads
/// that word only with a record), so that a signal handler's realloc
/// between the two halves keeps its own.
///
/// # Safety
/// As for [`track_realloc_begin`].
unsafe extern "C" fn trace_realloc_begin(old: u64, token: *mut u64, index: u64, control: *const u8) -> u64 {
    // SAFETY: forwarded from the caller.
    let r = unsafe { track_realloc_begin(old, token, index, control) };
    // SAFETY: the token's 16 bytes (caller), just written.
    unsafe {
        if token.read() == 0 {
            token.add(1).write(old);
        }
    }
    r
}

/// [`track_realloc_end`], recording the event when the realloc moved or
/// freed the object.
///
/// # Safety
/// As for [`track_realloc_end`].
unsafe extern "C" fn trace_realloc_end(
    result: u64,
    token: *const u64,
    size: u64,
    index: u64,
    control: *const u8,
) -> u64 {
    // SAFETY: the token the trampoline passed to track_realloc_begin.
    let old = unsafe { Entry { key: token.read(), value: token.add(1).read() } };
    let (alloc_site, old_size) = if old.key != 0 { (id_of_cell(old.cell()), old.size()) } else { (0, 0) };
    // The token's pointer when it holds a record; else the one the tracing
    // begin kept in its place (an untracked object).
    let old_ptr = if old.key != 0 { old.key & PTR_MASK } else { old.value };
    // SAFETY: forwarded from the caller.
    let site = unsafe { traced_id(index, control) };
    // SAFETY: forwarded from the caller.
    let r = unsafe { track_realloc_end(result, token, size, index, control) };
    if result != 0 || size == 0 {
        trace::record_realloc(site, alloc_site, old_ptr, old_size, result, size);
    }
    r
}

/// The cell a record names when it can name no site's: a free of it counts
/// nowhere that a report reads.
#[repr(C, align(64))]
struct SpareCell([AtomicU64; 8]);
static SPARE_CELL: SpareCell = SpareCell([const { AtomicU64::new(0) }; 8]);

/// The calling thread's shard, as the trampolines select it.
#[inline(always)]
fn my_shard() -> u32 {
    crate::shards::current()
}

/// The cell a trampoline's runtime call names: site `index` of the module
/// of `control`, or with `control` 0 (a site inside a hooked function
/// counting for the hook) `index` is the hook's cell, which a trampoline
/// computed as it computes the cells it counts into.
///
/// # Safety
/// `control` is 0 or a registered module's control block.
#[inline(always)]
unsafe fn cell_of(index: u64, control: *const u8) -> u64 {
    if control.is_null() {
        return if index != 0 && index.is_multiple_of(CELL_SIZE as u64) { index } else { SPARE_CELL.0.as_ptr() as u64 };
    }
    // SAFETY: forwarded from the caller.
    let slot = unsafe { slot_of(control) };
    cell_at(slot, index)
}

/// The calling thread's shard of module `slot`'s cell `index`.
#[inline(always)]
fn cell_at(slot: u64, index: u64) -> u64 {
    cell_in(slot, index, my_shard())
}

/// Shard `shard`'s copy of module `slot`'s cell `index`.
#[inline(always)]
fn cell_in(slot: u64, index: u64, shard: u32) -> u64 {
    let Some(m) = MODULES.get((slot & 0xff) as usize) else { return SPARE_CELL.0.as_ptr() as u64 };
    let shard = u64::from(shard & m.mask.load(Ordering::Relaxed));
    let (base, stride) = (m.base.load(Ordering::Relaxed), m.stride.load(Ordering::Relaxed));
    let at = index.wrapping_mul(CELL_SIZE as u64);
    if base == 0 || at >= stride {
        // Not a site of the module (the table holds a cell per site in
        // every shard): the spare cell, never memory past the counters.
        return SPARE_CELL.0.as_ptr() as u64;
    }
    base.wrapping_add(shard.wrapping_mul(stride)).wrapping_add(at)
}

/// Adds to a field of a cell.
#[inline(always)]
fn add(cell: u64, field: u32, v: u64) {
    // SAFETY: `cell` is the spare cell or a 64-byte cell inside a module's
    // view in MODULES (`cell_at` checks the index against the stride;
    // records hold only cells it made), which the runtime never unmaps
    // while a record can name it (see ModuleCounters); `field` is an
    // 8-aligned offset below 64.
    unsafe { &*((cell + u64::from(field)) as *const AtomicU64) }.fetch_add(v, Ordering::Relaxed);
}

/// A counted call that an exception or a forced unwind left (see
/// `unwinding`): a failure, with its requested bytes on the live path, in
/// site `index`'s cell of the module whose control block is `control` (in
/// the current CPU's shard), or with `control` null in the cell at `index`.
///
/// # Safety
/// As for [`cell_of`].
pub unsafe fn count_unwound(index: u64, control: *const u8, size: Option<u64>) {
    // SAFETY: forwarded from the caller.
    let cell = unsafe { cell_of(index, control) };
    add(cell, cell::FAILED, 1);
    if let Some(size) = size {
        add(cell, cell::FAILED_BYTES, size);
    }
}

/// Site `index`'s cell of the module whose control block is `control`, in
/// the calling thread's shard (as the trampolines compute it).
///
/// # Safety
/// As for [`cell_of`].
pub unsafe fn cell_address(index: u64, control: *const u8) -> u64 {
    // SAFETY: forwarded from the caller.
    unsafe { cell_of(index, control) }
}

/// A call failed by fault injection, counted in `cell`, which
/// [`cell_address`] gave.
pub fn count_injected_at(cell: u64) {
    add(cell, cell::INJECTED, 1);
}

/// Counts an object as freed on the site that allocated it.
#[inline(always)]
fn charge_free(cell: u64, size: u64) {
    add(cell, cell::FREED_OBJECTS, 1);
    add(cell, cell::FREED_BYTES, size);
}

/// The module slot a patched module's control block names.
///
/// # Safety
/// `control` must be a registered module's control block.
#[inline(always)]
unsafe fn slot_of(control: *const u8) -> u64 {
    // SAFETY: a registered module's control block is mapped and 64-aligned
    // (caller).
    let control = unsafe { alloctramp_trampolines::pod::at::<ControlBlock>(control as usize) };
    control.module_id.load(Ordering::Relaxed)
}

/// What a record charges when its object is freed: a site id (its cell
/// in the freed view) or a cell address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Charge {
    Id(u32),
    Cell(u64),
}

/// The allocating site of a trampoline's runtime call: its cell and, if
/// its module has them, its id.
#[derive(Clone, Copy)]
struct Origin {
    cell: u64,
    id: u32,
}

/// The origin a trampoline's runtime call names (see [`cell_of`]), with
/// shard 0's cell: a record keeps it, and another thread may charge the
/// object's free to it. A hook's cell (`control` 0) takes the hook's id
/// from the thread's charge.
///
/// # Safety
/// As for [`cell_of`].
unsafe fn origin(index: u64, control: *const u8) -> Origin {
    if control.is_null() {
        // SAFETY: forwarded from the caller.
        let cell = home_cell(unsafe { cell_of(index, control) });
        return Origin { cell, id: shadow::id(tls::get(tls::CHARGE_ID) as u32, 0) };
    }
    // SAFETY: forwarded from the caller.
    let slot = unsafe { slot_of(control) };
    let cell = cell_in(slot, index, 0);
    let id = MODULES.get((slot & 0xff) as usize).map_or(0, |m| {
        let first = m.first_id.load(Ordering::Acquire);
        if first != 0 && index < u64::from(m.ids.load(Ordering::Relaxed)) { first + index as u32 } else { 0 }
    });
    Origin { cell, id }
}

/// The id's cell in the calling thread's shard of the freed view.
#[inline(always)]
fn freed_cell(id: u32) -> u64 {
    // The thread's shard's offset in the view, as `shards` keeps it.
    shard0_freed_cell(id) + tls::word::<{ tls::FREED_SHARD }>()
}

/// The id's cell in shard 0 of the freed view.
#[inline(always)]
fn shard0_freed_cell(id: u32) -> u64 {
    FREED.load(Ordering::Relaxed) + u64::from(id) * CELL_SIZE as u64
}

/// The id of a cell in shard 0 of the freed view (0: another cell).
fn id_of_freed_cell(cell: u64) -> u32 {
    let freed = FREED.load(Ordering::Relaxed);
    if freed != 0 && cell >= freed && cell < freed + shadow::FREED_SHARD_BYTES {
        ((cell - freed) / CELL_SIZE as u64) as u32
    } else {
        0
    }
}

/// Counts an object of site `id` as freed.
fn charge_id(id: u32, size: u64) {
    charge_free(freed_cell(id), size);
}

fn charge(c: Charge, size: u64) {
    match c {
        Charge::Id(id) => charge_id(id, size),
        Charge::Cell(cell) => charge_free(cell, size),
    }
}

/// Records a new object.
fn track(ptr: u64, o: Origin, size: u64) {
    if o.id != 0
        && size < shadow::WIDE_LIMIT
        && ptr & 7 == 0
        && let Some(e) = entry_of(ptr)
        && (size < shadow::SIZE_LIMIT || entry_of(ptr + (1 << shadow::GRANULE_SHIFT)).is_some())
        && insert_shadow(e, ptr, o.id, size)
    {
        return;
    }
    track_in_table(ptr, o.cell, size);
}

/// Shard 0's copy of a cell of the calling thread's shard (a hook's, which
/// the trampoline computed): where a record charges its object's free,
/// which another thread may make (adds to a shard its owner adds to with
/// plain instructions would race).
fn home_cell(cell: u64) -> u64 {
    let s = u64::from(my_shard());
    if s == 0 {
        return cell;
    }
    for m in &MODULES {
        let base = m.base.load(Ordering::Acquire);
        let (size, stride) = (m.size.load(Ordering::Relaxed), m.stride.load(Ordering::Relaxed));
        if base != 0 && cell >= base && cell - base < size {
            return if cell - base >= s * stride { cell - s * stride } else { cell };
        }
    }
    cell
}

/// Records an object in the pointer table, charging `cell` (shard 0's:
/// see [`origin`]) when it is freed.
fn track_in_table(ptr: u64, cell: u64, size: u64) {
    let Some(e) = Entry::pack(ptr, cell, size) else {
        untracked_alloc(cell, size);
        return;
    };
    let h = hash(ptr);
    let shard = shard_of(h);
    let mut inner = lock(shard);
    let r = insert_in(shard, &mut inner, h, e);
    drop(inner);
    match r {
        Insert::Done => {}
        Insert::Replaced(old) => charge_free(old.cell(), old.size()),
        Insert::Failed => untracked_alloc(cell, size),
    }
}

/// Takes an object's record out of the shadow map or the pointer table:
/// what it charges, and its size. Notes the pointer as the thread's last
/// tracked free.
fn remove(ptr: u64) -> Option<(Charge, u64)> {
    if ptr == 0 {
        return None;
    }
    let found = if let Some((id, size)) = remove_shadow(ptr) {
        Some((Charge::Id(id), size))
    } else if TABLE_LEN.load(Ordering::Relaxed) == 0 {
        None
    } else {
        let h = hash(ptr);
        let shard = shard_of(h);
        let mut inner = lock(shard);
        let r = remove_in(shard, &mut inner, h, ptr);
        drop(inner);
        r.map(|(e, _)| (Charge::Cell(e.cell()), e.size()))
    };
    if found.is_some() {
        tls::set(tls::LAST_FREE, ptr);
    }
    found
}

/// Whether a free of `ptr` that found no record is a nested layer of a
/// tracked free: the thread's last one through the runtime, or the entry
/// a trampoline's free left for this address (LIVE clear).
#[inline(always)]
fn nested(ptr: u64) -> bool {
    if tls::get(tls::LAST_FREE) == ptr {
        return true;
    }
    entry_of(ptr).is_some_and(|e| shadow::is_freed_record_of(e.load(Ordering::Relaxed), ptr))
}

/// Forgets every tracked pointer (see the module documentation).
/// Async-signal-safe.
pub fn forget_all() {
    EPOCH.fetch_add(1, Ordering::AcqRel);
    wipe_shadow();
}

/// After fork, in the child: no other thread exists, so no lock is really
/// held; the child's figures start from zero, so everything is forgotten.
pub fn after_fork_in_child() {
    for s in &TABLE {
        s.lock.store(false, Ordering::Release);
    }
    // Indexes of the parent's file; `replace_module_view` gives each
    // module that joins the child's file its index there.
    for m in &MODULES {
        m.file_index.store(NO_FILE_INDEX, Ordering::Relaxed);
    }
    EPOCH.fetch_add(1, Ordering::AcqRel);
    if WIPE_IN_CHILD.load(Ordering::Relaxed) {
        wipe_shadow();
    }
    tls::set(tls::LAST_FREE, 0);
    // A fork inside a hooked call: the hook's cell is in the parent's view
    // of the counters, which the child drops. The child's allocations
    // until the hook returns count at their own sites.
    crate::tls::set(crate::tls::CHARGE_SP, 0);
}

/// An allocation that was counted but cannot be followed: it leaves the
/// live figures at once, and the report says they are incomplete.
#[cold]
#[inline(never)]
fn untracked_alloc(cell: u64, size: u64) {
    charge_free(cell, size);
    if let Some(n) = header().map(|h| &h.untracked_allocs) {
        n.fetch_add(1, Ordering::Relaxed);
    }
}

/// A trampoline's allocation succeeded and it could not record the object
/// inline: `ptr` (non-null) holds `size` requested bytes from site `index`
/// of the module of `control` (or for the hook's cell `index`, with
/// `control` 0: see [`cell_of`]). Returns `ptr`.
///
/// # Safety
/// Called by trampolines with their module's control block (or 0).
pub unsafe extern "C" fn track_alloc(ptr: u64, size: u64, index: u64, control: *const u8) -> u64 {
    // SAFETY: forwarded from the caller.
    track(ptr, unsafe { origin(index, control) }, size);
    ptr
}

#[cold]
#[inline(never)]
fn untracked_free(index: u64, control: *const u8) {
    // SAFETY: the trampoline's control block, or 0 with a hook's cell.
    add(unsafe { cell_of(index, control) }, cell::UNTRACKED_FREES, 1);
}

/// A free while profiling is off and the free sites stay on for tracked
/// objects to drain: the object leaves its site's live figures, and the
/// free site's own figures do not move (draining sites jump to their
/// trampoline's drain entry, past the counting; an untracked free is not
/// counted either).
#[cold]
#[inline(never)]
fn free_draining(ptr: u64) -> u64 {
    if let Some((c, size)) = remove(ptr) {
        charge(c, size);
        if DRAIN_LEFT.fetch_sub(1, Ordering::Relaxed) <= 1 {
            drain_may_be_over();
        }
        return ptr;
    }
    // Also now and then on an untracked free: the last tracked object may
    // have left through a trampoline's inline path that had not seen the
    // drain begin, and nothing else would end it.
    let misses = DRAIN_MISSES.load(Ordering::Relaxed).wrapping_add(1);
    DRAIN_MISSES.store(misses, Ordering::Relaxed);
    if misses.is_multiple_of(1024) {
        drain_may_be_over();
    }
    ptr
}

/// Untracked frees while draining (approximately: not an atomic count).
static DRAIN_MISSES: AtomicU32 = AtomicU32::new(0);

/// A trampoline is about to free `ptr` from site `index`, and found no
/// record of it inline. Returns `ptr`.
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
    match remove(ptr) {
        Some((c, size)) => charge(c, size),
        None if nested(ptr) => {}
        None => untracked_free(index, control),
    }
    ptr
}

/// A realloc of `old` from site `index` is about to run: takes `old` out of
/// its structure into `token` (two u64: a table entry, naming the freed
/// view's cell of a shadow record's id, or zeros). A realloc that fails
/// puts it back.
///
/// # Safety
/// Called by trampolines with their module's control block; `token` points
/// at 16 writable, 8-aligned bytes (a slot of the trampoline's frame).
pub unsafe extern "C" fn track_realloc_begin(old: u64, token: *mut u64, index: u64, control: *const u8) -> u64 {
    let mut e = Entry { key: 0, value: 0 };
    if old != 0 {
        match remove(old) {
            None => untracked_free(index, control),
            Some((c, size)) => {
                let cell = match c {
                    Charge::Id(id) => shard0_freed_cell(id),
                    Charge::Cell(cell) => cell,
                };
                match Entry::pack(old, cell, size) {
                    Some(p) => e = p,
                    // Too large to keep in a token: freed now.
                    None => charge(c, size),
                }
            }
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
    let o = unsafe { origin(index, control) };
    if result == 0 {
        add(o.cell, cell::FAILED_BYTES, size);
    }
    if result != 0 || size == 0 {
        if old.key != 0 {
            charge_free(old.cell(), old.size());
        }
        if result != 0 {
            track(result, o, size);
        }
    } else if old.key != 0 {
        let cell = old.cell();
        track(old.key & PTR_MASK, Origin { cell, id: id_of_freed_cell(cell) }, old.size());
    }
    result
}

/// Total objects in the pointer table (takes every shard lock in turn).
#[cfg(test)]
fn len() -> usize {
    TABLE.iter().map(|s| lock(s).len).sum()
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn entries_keep_pointer_cell_and_size() {
        let (ptr, cell, size) = (0x7fff_ffff_fff0, 0x7fff_ffff_ffc0, SIZE_MASK);
        let e = Entry::pack(ptr, cell, size).unwrap();
        assert!(same(e.key, ptr));
        assert_eq!((e.cell(), e.size()), (cell, size));
        let e = Entry::pack(0x1000, 0x40, 0).unwrap();
        assert_eq!((e.key & PTR_MASK, e.cell(), e.size()), (0x1000, 0x40, 0));
        assert!(Entry::pack(ptr, cell, SIZE_MASK + 1).is_none());
        assert!(Entry::pack(ptr, CELL_LIMIT, 1).is_none());
        assert!(Entry::pack(ptr, cell + 8, 1).is_none());
        assert!(Entry::pack(1 << PTR_BITS, cell, 1).is_none());
    }

    #[test]
    fn shadow_entries_name_one_address() {
        let p = 0x5555_0000_1238;
        let e = shadow::entry(p, 4321, 1023);
        assert_eq!((shadow::id(e, p), shadow::size(e, p)), (4321, 1023));
        assert!(shadow::is_record_of(e, p) && shadow::is_live(e));
        // The other addresses of the granule, and the freed entry.
        for other in [0x5555_0000_1220, 0x5555_0000_1228, 0x5555_0000_1230, 0x5555_0000_123c] {
            assert!(!shadow::is_record_of(e, other), "{other:#x}");
            assert!(!shadow::is_freed_record_of(e & !shadow::LIVE, other), "{other:#x}");
        }
        assert!(!shadow::is_record_of(e & !shadow::LIVE, p) && shadow::is_freed_record_of(e & !shadow::LIVE, p));
        assert!(!shadow::is_record_of(0, 0x5555_0000_1220) && !shadow::is_freed_record_of(0, 0x5555_0000_1220));
    }

    /// An extension, live or cleared by a free (bits 1 and 2, as the
    /// wide-size stub does), is never a record, live or freed, of any
    /// 8-aligned address of its granule, and a live one is never free
    /// for an inline allocation (its bit 2 is set).
    #[test]
    fn extensions_are_not_records() {
        let granule = 0x5555_0000_1240u64 >> shadow::GRANULE_SHIFT;
        for size in [shadow::SIZE_LIMIT, 4000, 123_457, shadow::WIDE_LIMIT - 1] {
            let x = shadow::ext(size);
            assert!(shadow::is_ext(x) && shadow::is_live(x) && shadow::ext_size(x) == size);
            let cleared = x & !(shadow::EXT_BIT | shadow::LIVE);
            assert!(!shadow::is_ext(cleared) && !shadow::is_live(cleared));
            for k in 0..4 {
                let at = (granule << shadow::GRANULE_SHIFT) | (k * 8);
                for v in [x, cleared] {
                    assert!(!shadow::is_record_of(v, at) && !shadow::is_freed_record_of(v, at), "{v:#x} at {at:#x}");
                }
            }
            assert_eq!(shadow::live_record_at(x, granule), None);
        }
        // A wide record names its address and has size 0.
        let p = 0x5555_0000_1258;
        let e = shadow::entry(p, 777, 0);
        assert_eq!(shadow::live_record_at(e, p >> shadow::GRANULE_SHIFT), Some(p));
        assert_eq!((shadow::id(e, p), shadow::size(e, p)), (777, 0));
        assert!(!shadow::is_ext(e) && !shadow::is_ext(e & !shadow::LIVE));
    }

    /// Cells for the test: the table only stores their addresses.
    fn cell(i: u64) -> u64 {
        0x10_0000_0000 + (i % 4096) * 64
    }

    // The table and the map are process-global: one test exercises them
    // end to end, on one thread and then across threads.
    #[test]
    fn track_remove_grow_and_forget() {
        let n = 200_000u64;
        let key = |i: u64| 0x5555_0000_0000 + i * 48;
        for i in 0..n {
            track_in_table(key(i), cell(i), i % 1000);
        }
        assert_eq!(len(), n as usize);
        for i in (0..n).step_by(2) {
            assert_eq!(remove(key(i)), Some((Charge::Cell(cell(i)), i % 1000)), "{i}");
        }
        assert_eq!(remove(key(0)), None);
        assert_eq!(remove(0x1234), None);
        for i in (1..n).step_by(2) {
            assert!(remove(key(i)).is_some(), "{i}");
        }
        assert_eq!(len(), 0);

        // Through the shadow map, freed by other threads; a granule that
        // holds a live record sends its neighbour to the table.
        reserve().unwrap();
        let id = |i: u64| (shadow::FIRST_ID as u64 + i % 1000) as u32;
        for i in 0..5000 {
            track(key(i), Origin { cell: cell(i), id: id(i) }, i % 1024);
        }
        track(key(0) + 8, Origin { cell: cell(7), id: 99 }, 5);
        track(key(6000), Origin { cell: cell(8), id: 0 }, 6);
        assert_eq!(len(), 2);
        std::thread::scope(|t| {
            for part in 0..4u64 {
                t.spawn(move || {
                    for i in (part..5000).step_by(4) {
                        assert_eq!(remove(key(i)), Some((Charge::Id(id(i)), i % 1024)), "{i}");
                    }
                });
            }
        });
        // Freed elsewhere: the entry left behind names a nested free.
        tls::set(tls::LAST_FREE, 0);
        assert!(nested(key(3)) && !nested(key(3) + 8) && !nested(key(9000)));
        assert_eq!(remove(key(0) + 8), Some((Charge::Cell(cell(7)), 5)));
        assert_eq!(remove(key(6000)), Some((Charge::Cell(cell(8)), 6)));
        assert_eq!(len(), 0);

        for i in 0..1000 {
            track(key(i), Origin { cell: cell(i), id: id(i) }, 1);
        }
        track_in_table(key(5000), cell(1), 1);
        forget_all();
        assert_eq!(remove(key(5)), None);
        assert_eq!(remove(key(5000)), None);
        assert_eq!(len(), 0);
    }
}
