//! Event recording (`alloctramp trace`): while a trace is on, every
//! allocation, free and realloc of a traced module becomes a record in the
//! calling thread's ring of the trace file (see `live::set_tracing`: the
//! traced entries of common sites write it through the module's trace stub,
//! which uses the words and windows this module keeps, and the runtime
//! writes the others' here), `PID.trace`
//! beside the process file (layout in `alloctramp_trampolines::trace`),
//! which a drainer outside the process copies into a CTF trace.
//!
//! A thread claims a free ring at its first event (a compare-and-swap on
//! the ring's owner) and marks it exited when it ends; the drainer frees
//! exited rings once it has read them. A thread that finds no free ring,
//! or its ring full, drops the event and counts it, never waiting for the
//! drainer. The file is made at the first trace and stays mapped for the
//! process's lifetime (rings are never unmapped under a writer); it is
//! not inherited by a forked child (`MADV_DONTFORK`), which starts
//! untraced.

use crate::{procfile, sys, tls};
use alloctramp_trampolines::pod;
pub use alloctramp_trampolines::trace::SITE_SHIFT;
use alloctramp_trampolines::trace::{self, Record, RingHeader, TraceHeader, kind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Events are recorded (a trace stops by first sending every module's
/// trampolines back to the tracking functions, `live::set_tracing`; a call
/// of a tracing function already under way then records nothing).
pub static ON: AtomicBool = AtomicBool::new(false);
/// The trace file's mapping (0: none yet).
static BASE: AtomicU64 = AtomicU64::new(0);
/// The thread-exit key that marks a thread's ring exited.
static KEY: AtomicU64 = AtomicU64::new(u64::MAX);
/// The thread's `TRACE_RING` word when no ring was free for it.
const NO_RING: u64 = 1;
/// Only the sites [`SELECTED`] holds are recorded (and frees of what they
/// allocated).
static FILTER: AtomicBool = AtomicBool::new(false);
/// [`ON`] without [`FILTER`]: every event is recorded, and [`record`]
/// takes its short path.
static EVERY: AtomicBool = AtomicBool::new(false);

/// Whether every event is recorded (a trace without a site filter): the
/// traced entries then write their records themselves.
pub fn records_every_event() -> bool {
    EVERY.load(Ordering::Acquire)
}

/// Sets [`EVERY`] from [`ON`] and [`FILTER`].
fn update_every() {
    let every = ON.load(Ordering::Acquire) && !FILTER.load(Ordering::Acquire);
    EVERY.store(every, Ordering::Release);
    // A `stop` since the reading (it clears EVERY, then ON) is not undone.
    if every && !ON.load(Ordering::Acquire) {
        EVERY.store(false, Ordering::Release);
    }
}
/// A bit per site id.
static SELECTED: [AtomicU64; 2048] = [const { AtomicU64::new(0) }; 2048];

fn selected(id: u32) -> bool {
    SELECTED.get(id as usize / 64).is_some_and(|w| w.load(Ordering::Relaxed) & 1 << (id % 64) != 0)
}

/// Records only the sites the sites file lists (see
/// `alloctramp_trampolines::trace::sites_file_name`), or every site
/// without one. Async-signal-safe.
pub fn select_sites() -> Result<(), &'static str> {
    for w in &SELECTED {
        w.store(0, Ordering::Relaxed);
    }
    let mut path = procfile::trace_sites_path();
    // SAFETY: the path is NUL-terminated.
    let fd = unsafe { libc::open(path.c_str().as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        FILTER.store(false, Ordering::Release);
        update_every();
        return Ok(());
    }
    let fd = sys::Fd(fd);
    let mut set = |id: u32| {
        if let Some(w) = SELECTED.get(id as usize / 64) {
            w.fetch_or(1 << (id % 64), Ordering::Relaxed);
        }
    };
    let mut parser = trace::SitesParser::default();
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: reads into the local buffer.
        let n = unsafe { libc::read(fd.0, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
        if n <= 0 {
            break;
        }
        parser.feed(buf.get(..n as usize).unwrap_or_default(), &mut set);
    }
    if !parser.finish(&mut set) {
        FILTER.store(false, Ordering::Release);
        update_every();
        return Err("bad site id in the trace's sites file");
    }
    FILTER.store(true, Ordering::Release);
    update_every();
    Ok(())
}

fn header() -> Option<&'static TraceHeader> {
    let b = BASE.load(Ordering::Acquire);
    // SAFETY: the trace file's mapping, never unmapped once published.
    (b != 0).then(|| unsafe { pod::at::<TraceHeader>(b as usize) })
}

fn ring(i: usize) -> Option<&'static RingHeader> {
    let b = BASE.load(Ordering::Acquire);
    // SAFETY: ring `i` lies in the mapping (i < RINGS).
    (b != 0 && i < trace::RINGS).then(|| unsafe { pod::at::<RingHeader>((b + trace::ring_offset(i)) as usize) })
}

/// The trace file's mapping, once made.
pub fn rings() -> Option<trace::Rings> {
    let b = BASE.load(Ordering::Acquire);
    // SAFETY: the trace file's mapping of FILE_SIZE bytes, never unmapped.
    (b != 0).then(|| unsafe { trace::Rings::new(b as *const u8) })
}

/// The time stamp counter and the CPU (Linux keeps the CPU's number in
/// the low 12 bits of `TSC_AUX`).
#[inline(always)]
pub fn rdtscp() -> (u64, u64) {
    let mut aux = 0u32;
    // SAFETY: rdtscp reads the counter and TSC_AUX; x86-64 Linux enables it.
    let t = unsafe { core::arch::x86_64::__rdtscp(&mut aux) };
    (t, u64::from(aux & 0xfff))
}

/// Starts recording: makes the trace file at the first trace, frees the
/// rings of threads that exited since the last drain, zeroes the loss
/// counts and stamps the start. Async-signal-safe.
pub fn start() -> Result<(), &'static str> {
    // A trace under way (from the start, `ALLOCTRAMP_TRACE`) goes on: its
    // records and losses stay for the drainer that attaches.
    if ON.load(Ordering::Acquire) {
        return Ok(());
    }
    if !has_rdtscp() {
        return Err("tracing needs the rdtscp instruction, which this CPU does not have");
    }
    if BASE.load(Ordering::Acquire) == 0 {
        let base = procfile::create_trace_file(trace::FILE_SIZE, trace::RECORDS_OFFSET)?;
        // SAFETY: the header lies at the start of the fresh mapping.
        let h = unsafe { pod::at::<TraceHeader>(base as usize) };
        h.version.store(trace::VERSION, Ordering::Relaxed);
        h.rings.store(trace::RINGS as u32, Ordering::Relaxed);
        h.ring_records.store(trace::RING_RECORDS as u32, Ordering::Relaxed);
        h.record_size.store(std::mem::size_of::<Record>() as u32, Ordering::Relaxed);
        // SAFETY: getpid has no preconditions.
        h.pid.store(unsafe { libc::getpid() } as u32, Ordering::Relaxed);
        BASE.store(base, Ordering::Release);
    }
    let Some(h) = header() else { return Err("no trace file") };
    for r in (0..trace::RINGS).filter_map(ring) {
        if r.exited.load(Ordering::Acquire) == 1 {
            r.tail.store(r.head.load(Ordering::Acquire), Ordering::Release);
            r.lost.store(0, Ordering::Relaxed);
            r.exited.store(0, Ordering::Relaxed);
            r.owner.store(0, Ordering::Release);
        }
        r.lost.store(0, Ordering::Relaxed);
    }
    h.lost_no_ring.store(0, Ordering::Relaxed);
    h.start_monotonic.store(sys::clock_ns(libc::CLOCK_MONOTONIC), Ordering::Relaxed);
    h.start_realtime.store(sys::clock_ns(libc::CLOCK_REALTIME), Ordering::Relaxed);
    h.start_tsc.store(rdtscp().0, Ordering::Relaxed);
    h.on.store(1, Ordering::Release);
    h.generation.fetch_add(1, Ordering::AcqRel);
    // The magic last: a reader of a file it finds takes it once complete.
    // SAFETY: the header's first 8 bytes, written by this process only.
    unsafe { std::ptr::write_volatile(h.magic.as_ptr() as *mut [u8; 8], trace::MAGIC) };
    ON.store(true, Ordering::Release);
    update_every();
    Ok(())
}

/// Stops recording. Async-signal-safe.
pub fn stop() {
    EVERY.store(false, Ordering::Release);
    ON.store(false, Ordering::Release);
    if let Some(h) = header() {
        h.on.store(0, Ordering::Release);
        h.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// In a forked child: the trace file is not mapped there (a later trace
/// makes the child's own), and nothing is recorded.
pub fn after_fork_in_child() {
    EVERY.store(false, Ordering::Relaxed);
    ON.store(false, Ordering::Relaxed);
    FILTER.store(false, Ordering::Relaxed);
    BASE.store(0, Ordering::Relaxed);
    tls::set(tls::TRACE_RING, 0);
    tls::set(tls::TRACE_BUSY, 0);
    close_window();
    let key = KEY.load(Ordering::Relaxed);
    if key != u64::MAX {
        // SAFETY: a key this runtime created; the thread's ring is gone.
        unsafe { libc::pthread_setspecific(key as libc::pthread_key_t, std::ptr::null()) };
    }
}

/// Whether the CPU has `rdtscp` (CPUID leaf 0x80000001, EDX bit 27).
fn has_rdtscp() -> bool {
    use core::arch::x86_64::__cpuid;
    // The extended leaf is asked for only where the maximum one reaches it.
    __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).edx & 1 << 27 != 0
}

/// The calling thread's ring, claimed at its first event (its records
/// given their storage then): the TLS word's value, the address of the
/// ring's header, or [`NO_RING`].
fn claim() -> u64 {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    for i in 0..trace::RINGS {
        let Some(r) = ring(i) else { break };
        if r.owner.load(Ordering::Relaxed) == 0
            && r.owner.compare_exchange(0, tid, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            // The ring is the thread's from here: a signal handler's event
            // lost while the storage is reserved counts in its `lost`.
            let word = r as *const RingHeader as u64;
            tls::set(tls::TRACE_RING, word);
            if procfile::reserve_trace(trace::records_offset(i), trace::RING_BYTES).is_err() {
                tls::set(tls::TRACE_RING, NO_RING);
                let lost = r.lost.swap(0, Ordering::Relaxed);
                if let Some(h) = header() {
                    h.lost_no_ring.fetch_add(lost, Ordering::Relaxed);
                }
                r.owner.store(0, Ordering::Release);
                break;
            }
            if let Some(h) = header() {
                h.rings_used.fetch_max(i as u32 + 1, Ordering::AcqRel);
            }
            watch_exit(i);
            return word;
        }
    }
    tls::set(tls::TRACE_RING, NO_RING);
    NO_RING
}

/// Has the thread's exit mark ring `i` exited (a pthread key's destructor,
/// as `shards` gives shards back).
fn watch_exit(i: usize) {
    let mut key = KEY.load(Ordering::Acquire);
    if key == u64::MAX {
        let mut k: libc::pthread_key_t = 0;
        // SAFETY: creates a key with a destructor of the right type.
        if unsafe { libc::pthread_key_create(&mut k, Some(exited)) } != 0 {
            return;
        }
        key = match KEY.compare_exchange(u64::MAX, u64::from(k), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => u64::from(k),
            Err(other) => {
                // SAFETY: the key just created, unused.
                unsafe { libc::pthread_key_delete(k) };
                other
            }
        };
    }
    // SAFETY: a key this runtime created; the value (ring + 1) is non-null.
    unsafe { libc::pthread_setspecific(key as libc::pthread_key_t, (i + 1) as *const libc::c_void) };
}

extern "C" fn exited(token: *mut libc::c_void) {
    // Marked recording for good: the thread's later events (a later
    // destructor's, a signal handler's) are counted lost, none touches the
    // ring given back.
    tls::take_word::<{ tls::TRACE_BUSY }>();
    close_window();
    tls::set(tls::TRACE_RING, NO_RING);
    if let Some(r) = ring((token as usize).wrapping_sub(1)) {
        r.exited.store(1, Ordering::Release);
    }
}

/// Makes the thread's next event look at its ring again.
fn close_window() {
    // The end first: with it 0, no position is inside the window.
    tls::set(tls::TRACE_END, 0);
    tls::set(tls::TRACE_CUR, 0);
}

/// The thread's ring: its header, index and head, and how many records
/// the drainer left free in it; None when the thread has no ring (the
/// event is counted lost).
fn my_ring() -> Option<(&'static RingHeader, usize, u64, u64)> {
    let mut word = tls::get(tls::TRACE_RING);
    if word == 0 {
        word = claim();
    }
    let base = BASE.load(Ordering::Acquire);
    let at = word.wrapping_sub(base + trace::ring_offset(0)) as usize / trace::RING_HEADER_SIZE as usize;
    if word == NO_RING || base == 0 || at >= trace::RINGS {
        if let Some(h) = header() {
            h.lost_no_ring.fetch_add(1, Ordering::Relaxed);
        }
        return None;
    }
    let r = ring(at)?;
    let head = r.head.load(Ordering::Relaxed);
    let free = (trace::RING_RECORDS as u64).saturating_sub(head.wrapping_sub(r.tail.load(Ordering::Acquire)));
    Some((r, at, head, free))
}

/// The address of record `head` of ring `i`.
fn record_at(i: usize, head: u64) -> *mut Record {
    let first = BASE.load(Ordering::Relaxed) + trace::records_offset(i);
    (first + (head & (trace::RING_RECORDS as u64 - 1)) * std::mem::size_of::<Record>() as u64) as *mut Record
}

/// Writes a record at `at` and publishes it (`r`: the thread's ring).
#[inline(always)]
fn put(at: u64, r: u64, word: u64, ptr: u64, size: u64) {
    let (tsc, cpu) = rdtscp();
    // SAFETY: a record of the thread's ring inside its window (see
    // `record_slow`): the drainer does not read it until head passes it.
    unsafe { (at as *mut Record).write(Record { tsc, ptr, size, word: word | cpu << 3 }) };
    tls::set_word::<{ tls::TRACE_CUR }>(at + std::mem::size_of::<Record>() as u64);
    // SAFETY: the thread's ring header (`TRACE_RING` holds one whenever
    // the window is open); only this thread writes its head.
    let head = unsafe { &(*(r as *const RingHeader)).head };
    head.store(head.load(Ordering::Relaxed) + 1, Ordering::Release);
}

/// Marks the thread as recording (`TRACE_BUSY`): false if it was already,
/// that is, this event is a signal handler's that interrupted the
/// recording of another (whose window, record and head it must not
/// touch): the event is counted lost.
#[inline(always)]
fn enter() -> bool {
    tls::take_word::<{ tls::TRACE_BUSY }>() || lost_nested()
}

#[inline(always)]
fn leave() {
    tls::set_word::<{ tls::TRACE_BUSY }>(0);
}

#[cold]
#[inline(never)]
fn lost_nested() -> bool {
    match tls::get(tls::TRACE_RING) {
        // SAFETY: the thread's ring header, claimed.
        r if r > NO_RING => unsafe { &*(r as *const RingHeader) }.lost.fetch_add(1, Ordering::Relaxed),
        _ => header().map_or(0, |h| h.lost_no_ring.fetch_add(1, Ordering::Relaxed)),
    };
    false
}

/// Records an event whose word (kind, site and allocating site; see
/// [`Record::pack`]) is `word`, the CPU left 0. The common case inline:
/// every event recorded, and a record free in the thread's window, the
/// records from its ring's head up to what the drainer left free or to
/// the ring's end (`TRACE_CUR`, `TRACE_END`), so that the record takes
/// two loads of per-thread words to place.
/// Returns `ptr` (so that callers end with a jump to the slow path).
#[inline(always)]
fn record_word(word: u64, ptr: u64, size: u64) -> u64 {
    if EVERY.load(Ordering::Relaxed) && tls::take_word::<{ tls::TRACE_BUSY }>() {
        let cur = tls::word::<{ tls::TRACE_CUR }>();
        if cur < tls::word::<{ tls::TRACE_END }>() {
            put(cur, tls::word::<{ tls::TRACE_RING }>(), word, ptr, size);
            leave();
            return ptr;
        }
        leave();
    }
    record_slow(word, ptr, size)
}

/// [`record_word`] when a filter is on, recording is off, the thread's
/// window is used up, or the event is a signal handler's that interrupted
/// the recording of another: opens a new window (claiming a ring at the
/// thread's first event) and records, or counts the event lost. Also the
/// control blocks' `trace_record`, which the trace stub calls in the same
/// cases (the word's CPU 0).
#[cold]
#[inline(never)]
pub extern "C" fn record_slow(word: u64, ptr: u64, size: u64) -> u64 {
    let fields = Record { word, ..Record::default() };
    if !ON.load(Ordering::Relaxed)
        || FILTER.load(Ordering::Relaxed) && !selected(fields.site()) && !selected(fields.alloc_site())
        || !enter()
    {
        return ptr;
    }
    if let Some((r, i, head, free)) = my_ring() {
        if free == 0 {
            r.lost.fetch_add(1, Ordering::Relaxed);
            close_window();
        } else {
            let slot = head & (trace::RING_RECORDS as u64 - 1);
            let cur = record_at(i, head) as u64;
            let end = cur + free.min(trace::RING_RECORDS as u64 - slot) * std::mem::size_of::<Record>() as u64;
            tls::set(tls::TRACE_END, end);
            put(cur, r as *const RingHeader as u64, word, ptr, size);
        }
    }
    leave();
    ptr
}

/// Records an allocation or a free of site `site` (`alloc_site`: the site
/// that allocated the object freed, 0 if not known). Returns `ptr`.
#[inline(always)]
pub fn record(k: u64, site: u32, alloc_site: u32, ptr: u64, size: u64) -> u64 {
    record_word(Record::pack(k, 0, site, alloc_site), ptr, size)
}

/// Records a realloc at `site` of `old` (`old_size` bytes from
/// `alloc_site`) into `ptr` of `size` bytes: two records, published
/// together.
pub fn record_realloc(site: u32, alloc_site: u32, old: u64, old_size: u64, ptr: u64, size: u64) {
    if !ON.load(Ordering::Relaxed) || FILTER.load(Ordering::Relaxed) && !selected(site) && !selected(alloc_site) {
        return;
    }
    if !enter() {
        return;
    }
    record_pair(site, alloc_site, old, old_size, ptr, size);
    leave();
}

/// [`record_realloc`]'s records, the thread recording.
fn record_pair(site: u32, alloc_site: u32, old: u64, old_size: u64, ptr: u64, size: u64) {
    // Outside the window: the two records may straddle the ring's end.
    close_window();
    let Some((r, i, head, free)) = my_ring() else { return };
    if free < 2 {
        r.lost.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let (tsc, cpu) = rdtscp();
    // SAFETY: two free records of the thread's ring, which the reader does
    // not read until head moves.
    unsafe {
        record_at(i, head).write(Record {
            tsc,
            ptr: old,
            size: old_size,
            word: Record::pack(kind::REALLOC_OLD, cpu, site, alloc_site),
        });
        record_at(i, head + 1).write(Record {
            tsc,
            ptr,
            size,
            word: Record::pack(kind::REALLOC, cpu, site, alloc_site),
        });
    }
    r.head.store(head + 2, Ordering::Release);
}
