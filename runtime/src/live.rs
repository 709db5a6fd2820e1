//! Live tracking: which call site allocated every object that is still
//! live, so that a free, delete or realloc anywhere in the process takes
//! the object off the figures of the site that allocated it.
//!
//! Two structures hold the pointer-to-site association:
//!
//! - A **nursery** per thread (up to [`MAX_NURSERIES`]): a direct-mapped
//!   table of the objects the thread allocated recently (layout in
//!   `layout::nursery`). The trampolines insert into their thread's nursery
//!   and take out of it inline, without a call, a lock or an atomic
//!   instruction: an object that is freed by the thread that allocated it
//!   while it is still in the nursery (most objects: they die young) costs
//!   a few stores and the two counter additions of its free.
//! - The **pointer table**, shared by all threads, for the objects that
//!   stay live: when a new object needs an occupied nursery slot, the
//!   runtime moves the slot's object into the table. The table is split
//!   into [`SHARDS`] shards by a hash of the pointer; each is an
//!   open-addressing table (linear probing, backward-shift deletion, no
//!   tombstones) in its own anonymous mapping, guarded by its own spin
//!   lock: there is no global lock, two threads meet only when their
//!   pointers hash to the same shard, and a shard grows (by a fifth, into a
//!   fresh mapping) while the other shards carry on.
//!
//! A nursery also records its thread's last tracked free: a free of that
//! pointer that misses the nursery is a nested layer of the same free (a
//! patched `operator delete` calling a patched `free`) and is left alone.
//!
//! A free that misses its own thread's nursery locks the pointer's shard
//! and looks at the same slot of the other threads' nurseries, then in the
//! shard. The nursery's owner writes its slots with plain stores; another
//! thread takes a slot only by compare-and-swap of its key, and only holding
//! the key's shard lock, which the owner also holds to move a slot into the
//! table: an object is found exactly once, wherever it is.
//!
//! Entries record the allocating site's counter cell (in the runtime's own
//! mapping of the counters, never unmapped (but in a forked child, after
//! every record was made stale), so a free may count into a
//! module that was unloaded meanwhile, in the shard of the CPU that
//! allocated) and the requested size. A table entry is 16 bytes: the
//! pointer (48 bits) with 16 bits of the cell's address, and the other 25
//! bits of the cell's address (a 64-byte aligned user-space address has 41
//! significant bits) with the size (39 bits). A shard is kept at most 80%
//! full and grows by a fifth, so it is between two thirds and four fifths
//! full once it has grown: 20 to 24 bytes per tracked object. A nursery is
//! 8 KiB per thread whatever the number of objects.
//!
//! Figures: an allocation through a live-tracking trampoline is counted by
//! the trampoline (calls, bytes requested, and failed calls with their
//! bytes); a tracked free adds to the allocating site's freed objects and
//! bytes. Live objects are calls - failed - freed, live bytes bytes -
//! failed bytes - freed bytes.
//!
//! Reset forgets every pointer lazily: it bumps [`EPOCH`], and a shard
//! whose epoch is stale empties itself the next time it is locked; it
//! flags every nursery stale, and its owner empties it at its next use.
//! That keeps the reset path (a signal handler) away from the shard locks,
//! which the interrupted thread may hold, and from the nurseries' slots.

use crate::procfile::header;
use crate::tls;
use alloctramp_trampolines::layout::nursery as ns;
use alloctramp_trampolines::layout::{CELL_SIZE, ControlBlock, Nursery, NurserySlot, cell};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};

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

/// Where the allocating module's counters are, per registry slot: the
/// runtime's own mapping of them (never unmapped, so a free may count into
/// a module that was unloaded meanwhile; in a forked child, the parent's
/// view is replaced once no record names it, see `replace_module_view`).
/// Never memory the module owns: a module whose counters cannot be given
/// such a view is not profiled.
pub struct ModuleCounters {
    pub base: AtomicU64,
    pub size: AtomicU64,
    pub stride: AtomicU64,
    pub mask: AtomicU32,
}

pub static MODULES: [ModuleCounters; 256] = [const {
    ModuleCounters {
        base: AtomicU64::new(0),
        size: AtomicU64::new(0),
        stride: AtomicU64::new(0),
        mask: AtomicU32::new(0),
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

/// After fork, in the child: the module's counters moved to the child's
/// file (or a private mapping); the parent's view is dropped.
///
/// # Safety
/// Only in a forked child's only thread, after [`after_fork_in_child`]
/// made every nursery and table record (which name cells of the old view)
/// stale.
pub unsafe fn replace_module_view(slot: usize, base: u64, size: u64, module_counters: u64) {
    let Some(m) = MODULES.get(slot) else { return };
    let old = m.base.swap(base, Ordering::AcqRel);
    if old != 0 && old != base && old != module_counters {
        // SAFETY: the runtime's own view of the parent's counters; no
        // record names a cell in it any more (caller), and the control
        // block now names the new view.
        unsafe { libc::munmap(old as *mut libc::c_void, size as usize) };
    }
}

/// Turns live tracking on in a module: its trampolines call the tracking
/// functions and use the nurseries from now on.
///
/// # Safety
/// `control` must be the module's control block, with no site switched on.
pub unsafe fn enable_in(control: &ControlBlock, slot: u64) {
    NURSERIES[0].flags.store(INERT, Ordering::Relaxed);
    let r = Ordering::Relaxed;
    control.module_id.store(slot, r);
    control.track_alloc.store(track_alloc as *const () as u64, r);
    control.track_free.store(track_free as *const () as u64, r);
    control.track_realloc_begin.store(track_realloc_begin as *const () as u64, r);
    control.track_realloc_end.store(track_realloc_end as *const () as u64, r);
    control.nursery_tls.store(tls::offset() + 8 * tls::NURSERY as i64, r);
    control.nurseries.store(NURSERIES.as_ptr() as u64, r);
}

/// What to call when a free while draining may have taken the last tracked
/// object (set at start-up by the layer that switches: live tracking sits
/// below it and does not call up into it).
pub static ON_DRAINED: crate::sys::Hook = crate::sys::Hook::new();

fn drain_may_be_over() {
    ON_DRAINED.call();
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
#[allow(clippy::indexing_slicing)]
fn shard_of(h: u64) -> &'static Shard {
    // The top SHARD_BITS bits of a u64 index TABLE's 1 << SHARD_BITS shards.
    const _: () = assert!(SHARDS == 1 << SHARD_BITS);
    &TABLE[(h >> (64 - SHARD_BITS)) as usize]
}

/// A pointer's slot in a nursery.
#[inline(always)]
#[allow(clippy::indexing_slicing)]
fn slot_in(n: &Nursery, ptr: u64) -> &NurserySlot {
    // slot_of keeps the top SLOT_BITS bits of a u32: below SLOT_COUNT.
    &n.slots[ns::slot_of(ptr)]
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
    shard.len.store(0, Ordering::Relaxed);
    shard.epoch.store(EPOCH.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Publishes the table's memory (and, while at it, its object count) in
/// the process file's header.
fn account(mapped_delta: isize) {
    if let Some(b) = header().map(|h| &h.table_bytes) {
        b.fetch_add(mapped_delta as u64, Ordering::Relaxed);
    }
    publish_objects();
}

/// Writes the number of tracked objects into the process file's header.
pub fn publish_objects() {
    if let Some(o) = header().map(|h| &h.table_objects) {
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

/// Inserts into a locked shard, publishing its length.
fn insert_in(shard: &Shard, inner: &mut Inner, h: u64, e: Entry) -> Insert {
    let r = insert_locked(inner, h, e);
    if let Insert::Done = r {
        shard.len.store(inner.len, Ordering::Relaxed);
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

/// Most threads with a nursery at once; further threads use the pointer
/// table only. It bounds what a free that misses its own nursery reads:
/// one slot per nursery.
pub const MAX_NURSERIES: usize = 64;
/// Nursery flags (`layout::nursery::FLAGS`).
const STALE: u8 = 1;
const INERT: u8 = 0x80;
/// Thread states (TLS word `tls::STATE`).
const NEW: u64 = 0;
const ASSIGNED: u64 = 1;
/// Exited, or no nursery was free: the pointer table only.
const WITHOUT: u64 = 2;

/// Nursery 0 is the inert one (every thread's TLS word starts at 0): its
/// flags send the trampolines to the runtime, which gives the thread a
/// nursery of its own. Nurseries are never freed: one whose thread exited
/// keeps its objects until another thread takes it over.
static NURSERIES: [Nursery; MAX_NURSERIES + 1] = [const {
    Nursery {
        flags: AtomicU8::new(INERT),
        owned: AtomicU8::new(0),
        reserved: [0; 6],
        last: AtomicU64::new(0),
        reserved2: [0; 48],
        slots: [const {
            NurserySlot {
                key: AtomicU64::new(0),
                cell: AtomicU64::new(0),
                size: AtomicU64::new(0),
                reserved: AtomicU64::new(0),
            }
        }; ns::SLOT_COUNT],
    }
}; MAX_NURSERIES + 1];

/// Nurseries 1..=CREATED have been handed out at least once.
static CREATED: AtomicUsize = AtomicUsize::new(0);
/// The cell of every slot that never held an object: a free of the empty
/// key (which nothing should free) charges this, not address 0.
#[repr(C, align(64))]
struct SpareCell([AtomicU64; 8]);
static SPARE_CELL: SpareCell = SpareCell([const { AtomicU64::new(0) }; 8]);
/// Serialises handing out nurseries (a try-lock: a thread that finds it
/// taken, maybe by itself in a signal handler, goes without for now).
static HANDING_OUT: AtomicBool = AtomicBool::new(false);
/// The pthread key whose destructor gives a nursery back (key + 1; 0: none
/// yet).
static EXIT_KEY: AtomicU32 = AtomicU32::new(0);

fn created() -> &'static [Nursery] {
    NURSERIES.get(1..=CREATED.load(Ordering::Acquire).min(MAX_NURSERIES)).unwrap_or_default()
}

/// Index of the calling thread's nursery (0: none).
#[inline(always)]
fn own_index() -> usize {
    tls::get(tls::NURSERY) as usize / ns::BYTES
}

/// The calling thread's nursery, emptied first if a reset made it stale;
/// hands the thread one if it has none yet.
fn own() -> Option<&'static Nursery> {
    let i = own_index();
    let n = if i == 0 {
        if tls::get(tls::STATE) != NEW {
            return None;
        }
        hand_out()?
    } else {
        NURSERIES.get(i)?
    };
    if n.flags.load(Ordering::Acquire) & STALE != 0 {
        empty_slots(n);
        n.flags.fetch_and(!STALE, Ordering::AcqRel);
    }
    Some(n)
}

/// Empties every slot of a nursery its caller owns (or is about to hand
/// out): no object, and the spare cell.
fn empty_slots(n: &Nursery) {
    for s in &n.slots {
        s.cell.store(SPARE_CELL.0.as_ptr() as u64, Ordering::Relaxed);
        s.key.store(ns::EMPTY, Ordering::Relaxed);
    }
}

/// Gives the calling thread a nursery: one whose thread exited, else a
/// fresh one while fewer than [`MAX_NURSERIES`] exist.
#[cold]
#[inline(never)]
fn hand_out() -> Option<&'static Nursery> {
    if HANDING_OUT.swap(true, Ordering::Acquire) {
        return None;
    }
    let mut key = EXIT_KEY.load(Ordering::Relaxed);
    if key == 0 {
        let mut k: libc::pthread_key_t = 0;
        // SAFETY: creates a key; the destructor is a function of this
        // library, which is never unloaded (linked with -z nodelete).
        if unsafe { libc::pthread_key_create(&mut k, Some(thread_exit)) } == 0 {
            key = k + 1;
            EXIT_KEY.store(key, Ordering::Relaxed);
        }
    }
    let mut got = None;
    if key != 0 {
        let made = CREATED.load(Ordering::Relaxed);
        got = (1..=made).find(|&i| {
            NURSERIES
                .get(i)
                .is_some_and(|n| n.owned.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed).is_ok())
        });
        if got.is_none()
            && made < MAX_NURSERIES
            && let Some(n) = NURSERIES.get(made + 1)
        {
            empty_slots(n);
            n.owned.store(1, Ordering::Relaxed);
            n.flags.store(0, Ordering::Relaxed);
            CREATED.store(made + 1, Ordering::Release);
            account(ns::BYTES as isize);
            got = Some(made + 1);
        }
    }
    HANDING_OUT.store(false, Ordering::Release);
    let Some(i) = got else {
        tls::set(tls::STATE, WITHOUT);
        return None;
    };
    // The thread has its nursery before pthread_setspecific, which may
    // allocate (through patched code, back here).
    tls::set(tls::NURSERY, (i * ns::BYTES) as u64);
    tls::set(tls::STATE, ASSIGNED);
    // SAFETY: a key created above; the value is never dereferenced.
    if unsafe { libc::pthread_setspecific(key - 1, i as *const libc::c_void) } != 0 {
        // Without the destructor the nursery would never come back.
        thread_exit(i as *mut libc::c_void);
        return None;
    }
    NURSERIES.get(i)
}

/// A thread exits: its nursery, objects and all, goes to the next thread
/// that needs one (its objects stay findable meanwhile).
extern "C" fn thread_exit(v: *mut libc::c_void) {
    tls::set(tls::NURSERY, 0);
    tls::set(tls::STATE, WITHOUT);
    std::sync::atomic::compiler_fence(Ordering::SeqCst);
    if let Some(n) = NURSERIES.get(v as usize) {
        n.owned.store(0, Ordering::Release);
    }
}

/// Objects in a nursery (none if it is stale).
fn nursery_objects(n: &Nursery) -> u64 {
    if n.flags.load(Ordering::Acquire) & STALE != 0 {
        return 0;
    }
    n.slots.iter().filter(|s| s.key.load(Ordering::Relaxed) != ns::EMPTY).count() as u64
}

/// Records a new object of the calling thread (`cell`: its site's cell).
fn track(ptr: u64, cell: u64, size: u64) {
    let Some(n) = own() else {
        track_in_table(ptr, cell, size);
        return;
    };
    let s = slot_in(n, ptr);
    let k = s.key.load(Ordering::Relaxed);
    if k == ptr {
        // The allocator handed out an address the nursery still holds:
        // that object was freed unseen.
        charge_free(s.cell.load(Ordering::Relaxed), s.size.load(Ordering::Relaxed));
    } else if k != ns::EMPTY {
        evict(n, s, k);
    }
    s.cell.store(cell, Ordering::Relaxed);
    s.size.store(size, Ordering::Relaxed);
    s.key.store(ptr, Ordering::Release);
}

/// Moves the object in one of the calling thread's nursery slots into the
/// pointer table (unless another thread took it meanwhile: it is being
/// freed).
#[cold]
#[inline(never)]
fn evict(n: &Nursery, s: &NurserySlot, k: u64) {
    let h = hash(k);
    let shard = shard_of(h);
    let mut inner = lock(shard);
    // The owner is the only writer of cell and size.
    let (cell, size) = (s.cell.load(Ordering::Relaxed), s.size.load(Ordering::Relaxed));
    let taken = s.key.compare_exchange(k, ns::EMPTY, Ordering::AcqRel, Ordering::Relaxed).is_ok();
    // A reset since the nursery was checked: the object is forgotten (the
    // shard, just emptied by `lock`, must not take it).
    let stale = n.flags.load(Ordering::Acquire) & STALE != 0;
    let r = match Entry::pack(k, cell, size) {
        Some(e) if taken && !stale => Some(insert_in(shard, &mut inner, h, e)),
        _ => None,
    };
    drop(inner);
    match r {
        None if taken && !stale => untracked_alloc(cell, size),
        Some(Insert::Replaced(old)) => charge_free(old.cell(), old.size()),
        Some(Insert::Failed) => untracked_alloc(cell, size),
        _ => {}
    }
}

/// Records an object in the pointer table.
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

/// Takes an object out of whichever structure holds it: the calling
/// thread's nursery, another thread's, or the pointer table. Returns its
/// cell and size, and whether, while draining, the structure it came from
/// became empty.
fn remove(ptr: u64) -> (Option<(u64, u64)>, bool) {
    if ptr == ns::EMPTY {
        return (None, false);
    }
    let mine = own();
    if let Some(n) = mine {
        let s = slot_in(n, ptr);
        if s.key.load(Ordering::Relaxed) == ptr {
            let found = (s.cell.load(Ordering::Relaxed), s.size.load(Ordering::Relaxed));
            s.key.store(ns::EMPTY, Ordering::Release);
            n.last.store(ptr, Ordering::Relaxed);
            return (Some(found), DRAINING.load(Ordering::Relaxed) && nursery_objects(n) == 0);
        }
    }
    let h = hash(ptr);
    let shard = shard_of(h);
    let mut inner = lock(shard);
    // Nurseries first: when a nursery and the table both hold an address,
    // the table's record is usually the stale one (an object freed unseen;
    // see docs/architecture.md, "Pointers freed unseen").
    let mut r = (None, false);
    for n in created() {
        if mine.is_some_and(|m| std::ptr::eq(m, n)) || n.flags.load(Ordering::Acquire) & STALE != 0 {
            continue;
        }
        let s = slot_in(n, ptr);
        if s.key.load(Ordering::Acquire) == ptr {
            let found = (s.cell.load(Ordering::Relaxed), s.size.load(Ordering::Relaxed));
            if s.key.compare_exchange(ptr, ns::EMPTY, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                r = (Some(found), DRAINING.load(Ordering::Relaxed) && nursery_objects(n) == 0);
                break;
            }
        }
    }
    if r.0.is_none()
        && let Some((e, emptied)) = remove_in(shard, &mut inner, h, ptr)
    {
        r = (Some((e.cell(), e.size())), emptied && DRAINING.load(Ordering::Relaxed));
    }
    drop(inner);
    if let (Some(n), Some(_)) = (mine, r.0) {
        n.last.store(ptr, Ordering::Relaxed);
    }
    r
}

/// Whether a free of `ptr` is a nested layer of the calling thread's last
/// tracked free (see `layout::nursery::LAST`).
#[inline(always)]
fn nested(ptr: u64) -> bool {
    let i = own_index();
    i != 0 && NURSERIES.get(i).is_some_and(|n| n.last.load(Ordering::Relaxed) == ptr)
}

/// Whether nothing is tracked (or everything is stale after a reset).
/// Lock-free: a reading for the control path, exact once the program is
/// between allocator calls.
pub fn is_empty() -> bool {
    objects() == 0
}

/// Objects tracked now (lock-free reading, see [`is_empty`]).
pub fn objects() -> u64 {
    let epoch = EPOCH.load(Ordering::Acquire);
    let table: u64 = TABLE
        .iter()
        .filter(|s| s.epoch.load(Ordering::Relaxed) == epoch)
        .map(|s| s.len.load(Ordering::Relaxed) as u64)
        .sum();
    table + created().iter().map(nursery_objects).sum::<u64>()
}

/// Forgets every tracked pointer (lazily, see the module documentation).
/// Async-signal-safe.
pub fn forget_all() {
    EPOCH.fetch_add(1, Ordering::AcqRel);
    for n in created() {
        n.flags.fetch_or(STALE, Ordering::AcqRel);
    }
}

/// After fork, in the child: no other thread exists, so no lock is really
/// held and only this thread's nursery has an owner; the child's figures
/// start from zero, so everything is forgotten.
pub fn after_fork_in_child() {
    for s in &TABLE {
        s.lock.store(false, Ordering::Release);
    }
    HANDING_OUT.store(false, Ordering::Release);
    let mine = own_index();
    for (i, n) in created().iter().enumerate() {
        if i + 1 != mine {
            n.owned.store(0, Ordering::Release);
        }
    }
    forget_all();
    // A fork inside a hooked call: the hook's cell is in the parent's view
    // of the counters, which the child drops. The child's allocations
    // until the hook returns count at their own sites.
    crate::tls::set(crate::tls::CHARGE_SP, 0);
}

/// The cell a trampoline's runtime call names: site `index` of the module
/// of `control`, or with `control` 0 (a site inside a hooked function
/// counting for the hook) `index` is the hook's cell, which a trampoline
/// computed as it computes the cells it stores in nurseries.
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

/// The current CPU's shard of module `slot`'s cell `index`.
#[inline(always)]
fn cell_at(slot: u64, index: u64) -> u64 {
    let Some(m) = MODULES.get((slot & 0xff) as usize) else { return SPARE_CELL.0.as_ptr() as u64 };
    let cpu: u32;
    // SAFETY: reads glibc's rseq cpu_id_start (or the thread pointer's own
    // first word when rseq is unavailable): always mapped for the thread.
    unsafe {
        std::arch::asm!("mov {0:e}, fs:[{1}]", out(reg) cpu, in(reg) RSEQ.load(Ordering::Relaxed),
            options(nostack, readonly, preserves_flags));
    }
    let shard = u64::from(cpu & m.mask.load(Ordering::Relaxed));
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

/// A trampoline's allocation succeeded and its thread's nursery could not
/// take it inline: `ptr` (non-null) holds `size` requested bytes from site
/// `index` of the module of `control` (or for the hook's cell `index`, with
/// `control` 0: see [`cell_of`]). Returns `ptr`.
///
/// # Safety
/// Called by trampolines with their module's control block (or 0).
pub unsafe extern "C" fn track_alloc(ptr: u64, size: u64, index: u64, control: *const u8) -> u64 {
    // SAFETY: forwarded from the caller.
    track(ptr, unsafe { cell_of(index, control) }, size);
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
    if nested(ptr) {
        return ptr;
    }
    let (found, emptied) = remove(ptr);
    if let Some((cell, size)) = found {
        charge_free(cell, size);
    }
    // Also now and then on an untracked free: the last tracked object may
    // have left through a trampoline's inline path that had not seen the
    // drain begin, and nothing else would end it.
    let misses = DRAIN_MISSES.load(Ordering::Relaxed).wrapping_add(u32::from(found.is_none()));
    DRAIN_MISSES.store(misses, Ordering::Relaxed);
    if emptied || (found.is_none() && misses % 1024 == 0) {
        drain_may_be_over();
    }
    ptr
}

/// Untracked frees while draining (approximately: not an atomic count).
static DRAIN_MISSES: AtomicU32 = AtomicU32::new(0);

/// A trampoline is about to free `ptr` from site `index`, and did not find
/// it in its thread's nursery. Returns `ptr`.
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
    if nested(ptr) {
        return ptr;
    }
    let (found, emptied) = remove(ptr);
    match found {
        Some((cell, size)) => charge_free(cell, size),
        None => untracked_free(index, control),
    }
    if emptied {
        drain_may_be_over();
    }
    ptr
}

/// A realloc of `old` from site `index` is about to run: takes `old` out of
/// its structure into `token` (two u64: its table entry, or zeros). A
/// realloc that fails puts it back.
///
/// # Safety
/// Called by trampolines with their module's control block; `token` points
/// at 16 writable, 8-aligned bytes (a slot of the trampoline's frame).
pub unsafe extern "C" fn track_realloc_begin(old: u64, token: *mut u64, index: u64, control: *const u8) -> u64 {
    let mut e = Entry { key: 0, value: 0 };
    if old != 0 {
        match remove(old).0 {
            None => untracked_free(index, control),
            Some((cell, size)) => match Entry::pack(old, cell, size) {
                Some(p) => e = p,
                // Too large to keep in a token: freed now.
                None => charge_free(cell, size),
            },
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
    let cell = unsafe { cell_of(index, control) };
    if result == 0 {
        add(cell, cell::FAILED_BYTES, size);
    }
    if result != 0 || size == 0 {
        if old.key != 0 {
            charge_free(old.cell(), old.size());
        }
        if result != 0 {
            track(result, cell, size);
        }
    } else if old.key != 0 {
        track(old.key & PTR_MASK, old.cell(), old.size());
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

    /// Cells for the test: the table only stores their addresses.
    fn cell(i: u64) -> u64 {
        0x10_0000_0000 + (i % 4096) * 64
    }

    // The table and nurseries are process-global: one test exercises them
    // end to end, on one thread and then across threads.
    #[test]
    fn track_remove_grow_evict_and_forget() {
        let n = 200_000u64;
        let key = |i: u64| 0x5555_0000_0000 + i * 48;
        for i in 0..n {
            track_in_table(key(i), cell(i), i % 1000);
        }
        assert_eq!(len(), n as usize);
        for i in (0..n).step_by(2) {
            let (found, _) = remove(key(i));
            assert_eq!(found, Some((cell(i), i % 1000)), "{i}");
        }
        assert_eq!(remove(key(0)).0, None);
        assert_eq!(remove(0x1234).0, None);
        for i in (1..n).step_by(2) {
            assert!(remove(key(i)).0.is_some(), "{i}");
        }
        assert_eq!(len(), 0);
        assert!(is_empty());

        // Through this thread's nursery: every object is found once,
        // whether it stayed in the nursery or was moved into the table.
        for i in 0..5000 {
            track(key(i), cell(i), i);
        }
        assert_eq!(objects(), 5000);
        assert!(len() >= 5000 - ns::SLOT_COUNT);
        // Freed by other threads: they look in this thread's nursery.
        std::thread::scope(|t| {
            for part in 0..4u64 {
                t.spawn(move || {
                    for i in (part..5000).step_by(4) {
                        assert_eq!(remove(key(i)).0, Some((cell(i), i)), "{i}");
                    }
                });
            }
        });
        assert!(is_empty());

        for i in 0..1000 {
            track(key(i), cell(i), 1);
        }
        forget_all();
        assert_eq!(remove(key(5)).0, None);
        assert_eq!(len(), 0);
        assert!(is_empty());
    }
}
