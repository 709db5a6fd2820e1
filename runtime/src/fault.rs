//! Fault injection: the specs in effect (`ALLOCTRAMP_FAIL`, or the fail
//! file a request names), which sites they route through the runtime, and
//! which calls fail.
//!
//! A site a spec names jumps to its callers entry while profiling is on, so
//! that each call reaches `callers::capture`, which asks
//! [`decide`] before anything else. Sites no spec names keep the entry they
//! had (those whose chains callers capture records pass through
//! [`decide`] too, since they reach the same call-out).
//!
//! The specs are two banks: a change writes the bank no reader is in, then
//! publishes it. A reader announces itself in the bank it found active and
//! checks that it still is; a writer waits (briefly: it may be a signal
//! handler that interrupted a reader) for the bank it writes to have none.

use crate::procfile;
use crate::sys;
use alloctramp_trampolines::entry::Kind;
use alloctramp_trampolines::fault::{self, MAX_SPECS, Spec, SpecError};
use alloctramp_trampolines::layout::{Site, Table, site_flags};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};

struct Bank {
    specs: UnsafeCell<[Spec; MAX_SPECS]>,
    n: AtomicUsize,
    readers: AtomicU32,
    /// Calls each spec has seen, and the failures it injected.
    calls: [AtomicU64; MAX_SPECS],
    failures: [AtomicU64; MAX_SPECS],
    /// Which specs name the sites called lately.
    memo: [Memo; MEMO],
}

/// Memo entries per bank (direct-mapped by table and site).
const MEMO: usize = 256;

/// A site (its table's address and index) and the specs that name it (bit
/// `i`: spec `i`), so that a call of a named site matches file names and
/// functions once, not at every call. Written under a sequence count (odd
/// while written; a writer that finds it odd skips), so a reader never
/// takes one site's answer for another's.
struct Memo {
    seq: AtomicU32,
    mask: AtomicU32,
    table: AtomicU64,
    index: AtomicU64,
}

impl Memo {
    const fn new() -> Memo {
        Memo { seq: AtomicU32::new(0), mask: AtomicU32::new(0), table: AtomicU64::new(0), index: AtomicU64::new(0) }
    }

    fn get(&self, table: u64, index: u64) -> Option<u32> {
        let s = self.seq.load(Ordering::Acquire);
        if s & 1 != 0 {
            return None;
        }
        let (t, i, m) =
            (self.table.load(Ordering::Relaxed), self.index.load(Ordering::Relaxed), self.mask.load(Ordering::Relaxed));
        fence(Ordering::Acquire);
        (self.seq.load(Ordering::Relaxed) == s && t == table && i == index).then_some(m)
    }

    fn put(&self, table: u64, index: u64, mask: u32) {
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 != 0 || self.seq.compare_exchange(s, s.wrapping_add(1), Ordering::Acquire, Ordering::Relaxed).is_err()
        {
            return;
        }
        fence(Ordering::Release);
        self.table.store(table, Ordering::Relaxed);
        self.index.store(index, Ordering::Relaxed);
        self.mask.store(mask, Ordering::Relaxed);
        self.seq.store(s.wrapping_add(2), Ordering::Release);
    }
}

fn memo_slot(table: u64, index: u64) -> usize {
    (table.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40 ^ index).wrapping_mul(0x2545_f491) as usize % MEMO
}

// SAFETY: `specs` is written only by the one writer (WRITING), while no
// reader is in the bank (`readers` is 0 and the bank is not active, so no
// reader can enter it), and read only by readers announced in `readers`.
unsafe impl Sync for Bank {}

impl Bank {
    const fn new() -> Bank {
        Bank {
            specs: UnsafeCell::new([const { Spec::EMPTY }; MAX_SPECS]),
            n: AtomicUsize::new(0),
            readers: AtomicU32::new(0),
            calls: [const { AtomicU64::new(0) }; MAX_SPECS],
            failures: [const { AtomicU64::new(0) }; MAX_SPECS],
            memo: [const { Memo::new() }; MEMO],
        }
    }
}

static BANKS: [Bank; 2] = [Bank::new(), Bank::new()];

fn bank(i: usize) -> &'static Bank {
    let [a, b] = &BANKS;
    if i & 1 == 0 { a } else { b }
}
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Specs in the active bank: the one load a site's switch and a captured
/// call make when there are none.
static COUNT: AtomicUsize = AtomicUsize::new(0);
static WRITING: AtomicBool = AtomicBool::new(false);

/// Whether any spec is in effect.
#[inline(always)]
pub fn any() -> bool {
    COUNT.load(Ordering::Relaxed) != 0
}

/// The active bank, with this reader announced in it until the guard goes.
struct Reading(&'static Bank);

impl Reading {
    fn new() -> Reading {
        loop {
            let i = ACTIVE.load(Ordering::SeqCst) & 1;
            let b = bank(i);
            b.readers.fetch_add(1, Ordering::SeqCst);
            if ACTIVE.load(Ordering::SeqCst) & 1 == i {
                return Reading(b);
            }
            b.readers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn specs(&self) -> &[Spec] {
        let n = self.0.n.load(Ordering::Acquire).min(MAX_SPECS);
        // SAFETY: announced in the bank (see `Bank`'s Sync).
        unsafe { (*self.0.specs.get()).get(..n).unwrap_or_default() }
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.readers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Replaces the specs with those of `text` (`SPEC[;SPEC...]`; empty: none).
/// On a bad spec nothing changes. Safe in a signal handler.
pub fn set(text: &[u8]) -> Result<usize, (usize, SpecError)> {
    let mut parsed = [const { Spec::EMPTY }; MAX_SPECS];
    let n = fault::parse_list(text, &mut parsed)?;
    let busy = |what| Err((0, SpecError { what, at: 0 }));
    if WRITING.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
        return busy("fault specs are being changed");
    }
    let next = (ACTIVE.load(Ordering::SeqCst) & 1) ^ 1;
    let bank = bank(next);
    // A reader in the other bank read it active before the last change;
    // it leaves within a call. A signal handler that interrupted it on
    // this thread would wait forever: give up instead.
    let mut spins = 0u32;
    while bank.readers.load(Ordering::SeqCst) != 0 {
        spins += 1;
        if spins > 1 << 20 {
            WRITING.store(false, Ordering::Release);
            return busy("fault specs are in use by a call; try again");
        }
        std::hint::spin_loop();
    }
    // SAFETY: no reader is in the bank and none can enter it (not active);
    // this is the one writer.
    unsafe { *bank.specs.get() = parsed };
    for (c, f) in bank.calls.iter().zip(&bank.failures) {
        c.store(0, Ordering::Relaxed);
        f.store(0, Ordering::Relaxed);
    }
    for m in &bank.memo {
        m.put(0, 0, 0);
    }
    bank.n.store(n, Ordering::Release);
    ACTIVE.store(next, Ordering::SeqCst);
    COUNT.store(n, Ordering::Release);
    if let Some(h) = procfile::header() {
        h.fail_specs.store(n as u32, Ordering::Release);
    }
    WRITING.store(false, Ordering::Release);
    Ok(n)
}

/// In a forked child, whose only thread is in no bank and writes no spec:
/// the counts the parent's other threads left are not the child's.
pub fn after_fork_in_child() {
    for b in &BANKS {
        b.readers.store(0, Ordering::Relaxed);
    }
    WRITING.store(false, Ordering::Relaxed);
}

/// Writes the number of specs in effect into the process file's header
/// (a forked child's new file).
pub fn publish() {
    if let Some(h) = procfile::header() {
        h.fail_specs.store(COUNT.load(Ordering::Relaxed) as u32, Ordering::Release);
    }
}

/// Sets the specs from `ALLOCTRAMP_FAIL` at start-up; a bad spec is logged
/// and none is set.
pub fn set_from_env(text: &[u8]) -> bool {
    match set(text) {
        Ok(n) => n != 0,
        Err((i, e)) => {
            log_error(b"ALLOCTRAMP_FAIL", i, &e);
            false
        }
    }
}

/// Logs a bad spec in one line.
pub fn log_error(source: &[u8], i: usize, e: &SpecError) {
    let mut m = sys::Buf::<256>::new();
    m.push(source).str(": fault spec ").num(i as u64 + 1).str(", byte ").num(e.at as u64).str(": ").str(e.what);
    sys::log(m.bytes());
}

/// Whether a spec names `site` and the site can be failed: an allocation
/// or realloc site with a callers entry, or a call of an allocation
/// wrapper (a hook, or a wrapper whose own sites check the depth), whose
/// failure is the first allocation the wrapper makes during the call.
pub fn names(table: &Table, site: &Site) -> bool {
    any() && site.callers != 0 && failable(table, site) && Reading::new().specs().iter().any(|s| s.names(table, site))
}

/// Whether `site` jumps to its callers entry for fault injection: a site a
/// spec names, or while a spec names a wrapper's call ([`WRAPPED`]), a
/// site inside a wrapper (which may have to fail on that call's behalf).
pub fn routes(table: &Table, site: &Site) -> bool {
    let inside = site_flags::UNDER_HOOK | site_flags::DEPTH_CHECK;
    if any() && site.callers != 0 && site.flags & inside != 0 && WRAPPED.load(Ordering::Relaxed) {
        return failable(table, site);
    }
    names(table, site)
}

/// Whether a spec names a wrapper's call: set when the specs change (and
/// at start-up) from the registered modules' sites, before they switch.
static WRAPPED: AtomicBool = AtomicBool::new(false);

/// Sets [`WRAPPED`]; says whether it changed.
pub fn set_wrapped(v: bool) -> bool {
    WRAPPED.swap(v, Ordering::Relaxed) != v
}

/// Whether `site` calls an allocation wrapper a spec names.
pub fn names_wrapper(table: &Table, site: &Site) -> bool {
    table.calls_wrapper(site) && names(table, site)
}

fn failable(table: &Table, site: &Site) -> bool {
    site.trampoline != 0 && table.entry(usize::from(site.entry)).is_some_and(|e| e.kind != Kind::Free.code())
}

/// Counts a call of site `index` of the module whose table is at `t` for
/// every spec that names it, and says whether the call fails. On the path
/// of every call of a named site (and of every captured call while specs
/// are in effect): the specs that name a site are matched once, then
/// remembered (`table` gives the module's table for that).
pub fn decide<'a>(t: u64, index: u64, table: impl FnOnce() -> Option<Table<'a>>) -> bool {
    let r = Reading::new();
    let memo = r.0.memo.get(memo_slot(t, index));
    let mask = match memo.and_then(|m| m.get(t, index)) {
        Some(m) => m,
        None => {
            let named = |table: &Table, site: Site| {
                if !failable(table, &site) {
                    return 0;
                }
                r.specs().iter().enumerate().filter(|(_, s)| s.names(table, &site)).fold(0, |m, (i, _)| m | 1 << i)
            };
            let m = table().and_then(|t| Some(named(&t, t.get_site(index as usize)?))).unwrap_or(0);
            if let Some(memo) = memo {
                memo.put(t, index, m);
            }
            m
        }
    };
    let mut fail = false;
    for (i, s) in r.specs().iter().enumerate().filter(|(i, _)| mask & 1 << i != 0) {
        let (Some(calls), Some(failures)) = (r.0.calls.get(i), r.0.failures.get(i)) else { continue };
        let n = calls.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if s.fails(n) && (s.how.times == 0 || failures.fetch_add(1, Ordering::Relaxed) < s.how.times) {
            fail = true;
        }
    }
    fail
}

/// A module's table at `t` is going away (the module is unloaded): what
/// the memos say of its sites could be taken for another module's later.
pub fn forget_table(t: u64) {
    for b in &BANKS {
        for m in b.memo.iter().filter(|m| m.table.load(Ordering::Relaxed) == t) {
            m.put(0, 0, 0);
        }
    }
}

/// Reads the fail file (`alloctramp fail`) and puts its specs in effect:
/// a missing or empty file clears them.
pub fn set_from_file() -> Result<usize, &'static str> {
    let mut path = procfile::fail_path();
    if path.bytes().is_empty() {
        return Err("no fail file: the process has no counters file");
    }
    let mut buf = [0u8; fault::MAX_TEXT + 1];
    let n = sys::read_small_file(path.c_str(), &mut buf).unwrap_or(0);
    if n > fault::MAX_TEXT {
        return Err("the fail file holds more than 4096 bytes");
    }
    set(buf.get(..n).unwrap_or_default()).map_err(|(i, e)| {
        log_error(path.bytes(), i, &e);
        "bad fault spec in the fail file"
    })
}

std::arch::global_asm!(
    ".pushsection .text.alloctramp_fault,\"ax\",@progbits",
    ".p2align 4",
    ".globl alloctramp_fault_return",
    ".hidden alloctramp_fault_return",
    "alloctramp_fault_return:",
    "ret",
    ".p2align 4",
    ".globl alloctramp_fault_call",
    ".hidden alloctramp_fault_call",
    "alloctramp_fault_call:",
    "push r11",
    "jmp r10",
    ".popsection",
);

unsafe extern "C" {
    /// `ret`: a failed tail call returns to its caller's caller.
    fn alloctramp_fault_return();
    /// `push r11; jmp r10`: calls the function in r10 as if from the
    /// return address in r11.
    fn alloctramp_fault_call();
}

/// Where a failed call goes.
pub fn return_thunk() -> u64 {
    alloctramp_fault_return as *const () as u64
}

pub fn call_thunk() -> u64 {
    alloctramp_fault_call as *const () as u64
}
