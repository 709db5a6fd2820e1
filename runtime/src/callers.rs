//! Callers capture: the call chains that reach a site, recorded into the
//! process file's callers region while `state::CALLERS` is non-zero.
//!
//! A site with a callers entry jumps there while capture is on; the module's
//! capture stub saves the registers and calls [`capture`], which names the
//! entry to continue at, walks the stack with the unwind rows the patcher
//! built from `.eh_frame` (no DWARF is interpreted here), and adds the call
//! to the chain's slot. It runs on the program's allocation path: it
//! allocates nothing, takes no lock and makes no system call. It reads the
//! stack only where a row says a frame's return address is, within 1 MiB
//! above the frame below; a chain ends at the first address no patched
//! module has rows for (that return address is the chain's last frame).
//!
//! The region also records the process's executable file mappings, so that
//! a reader names the frames after the process is gone.

use crate::registry::{self, PROC};
use crate::state::{self, LIVE};
use crate::sys;
use alloctramp_trampolines::entry::{Kind, Size};
use alloctramp_trampolines::layout::capture::{Frame, MAX_DEPTH};
use alloctramp_trampolines::layout::{self, ControlBlock, ENTRY_SIZE, Entry, Header, SITE_SIZE, Site};
use alloctramp_trampolines::pod;
use alloctramp_trampolines::process::{CALLERS_SLOTS, ChainSlot, MAX_MAPS, MapEntry, ProcHeader};
use std::mem::offset_of;
use std::sync::atomic::{AtomicU64, Ordering};

/// Run-time address of the callers region (0: none) and its chain slots.
static REGION: AtomicU64 = AtomicU64::new(0);
static SLOTS: AtomicU64 = AtomicU64::new(0);

/// How far one frame's CFA may be above the frame below it.
const MAX_FRAME: u64 = 1 << 20;
/// Slots probed for a chain before it is counted as lost.
const PROBES: u64 = 32;

/// Reads a `T` at `addr` of memory the caller knows to be mapped.
///
/// # Safety
/// `size_of::<T>()` bytes at `addr` must be mapped and readable.
unsafe fn read<T: pod::Pod>(addr: u64) -> T {
    // SAFETY: the caller's contract; Pod types are valid for any bits and
    // the read is unaligned.
    unsafe { std::ptr::read_unaligned(addr as *const T) }
}

/// Called by a module's capture stub (see `layout::capture`).
///
/// # Safety
/// `frame` is the stub's frame on the calling thread's stack, `table` the
/// site table of the module whose trampoline the thread came from (mapped:
/// its code is running), and `frame.index` a site index of that table.
pub unsafe extern "C" fn capture(frame: *mut Frame, _control: *const ControlBlock, rbp: u64, table: *const u8) {
    // SAFETY: the stub's frame (caller).
    let f = unsafe { &mut *frame };
    let index = f.index;
    let t = table as u64;
    let header = |field: usize| t.wrapping_add(field as u64);
    // Only the fields needed are read. SAFETY: the header's fields and
    // those of site `index` lie within the module's site table (checked at
    // registration; caller).
    let (bias, site, trampoline, count) = unsafe {
        let bias = t.wrapping_sub(read::<u64>(header(offset_of!(Header, table_addr))));
        let sites = u64::from(read::<u32>(header(offset_of!(Header, sites_offset))));
        let site = t.wrapping_add(sites).wrapping_add(index.wrapping_mul(SITE_SIZE as u64));
        let trampoline: u64 = read(site + offset_of!(Site, trampoline) as u64);
        (bias, site, trampoline, read::<u16>(site + offset_of!(Site, count) as u64))
    };
    let entry = if LIVE.load(Ordering::Relaxed) { 0 } else { count };
    // Before anything else: where the stub goes back to.
    f.index = bias.wrapping_add(trampoline).wrapping_add(u64::from(entry));
    let depth = (state::CALLERS.load(Ordering::Relaxed) as usize).min(MAX_DEPTH);
    let region = REGION.load(Ordering::Acquire);
    if depth == 0 || region == 0 {
        return;
    }
    let Some(module) = registry::file_index_of_table(table as usize) else { return };
    let sp = frame as u64 + size_of::<Frame>() as u64;
    // SAFETY: as above; the site's entry index names an entry of the
    // table, whose name is one of its strings.
    let (addr, e, strings) = unsafe {
        let addr: u64 = read(site + offset_of!(Site, addr) as u64);
        let entries = u64::from(read::<u32>(header(offset_of!(Header, entries_offset))));
        let entry_index = u64::from(read::<u16>(site + offset_of!(Site, entry) as u64));
        let e: Entry = read(t.wrapping_add(entries).wrapping_add(entry_index.wrapping_mul(ENTRY_SIZE as u64)));
        let strings_offset = u64::from(read::<u32>(header(offset_of!(Header, strings_offset))));
        (addr, e, t.wrapping_add(strings_offset).wrapping_add(u64::from(e.name)))
    };
    let frames = walk(bias.wrapping_add(addr), sp, rbp, depth);
    // strndup(s, n) copies at most n bytes (the only default entry with a
    // length limit after the string).
    let limited = || {
        b"strndup\0".iter().enumerate().all(|(i, &c)| {
            // SAFETY: the entry's name is a NUL-terminated string of the
            // table; the comparison stops at its first differing byte, at
            // the NUL at the latest.
            unsafe { read::<u8>(strings + i as u64) == c }
        })
    };
    let bytes = size_of_call(&e, f, limited);
    record(region, module, index as u32, &frames, depth, bytes);
}

/// The size a call asks for, from the saved argument registers.
fn size_of_call(e: &Entry, f: &Frame, limited: impl Fn() -> bool) -> u64 {
    let Some(kind) = Kind::from_code(e.kind) else { return 0 };
    let Some(sig) = layout::decode_sig(kind, e.sig) else { return 0 };
    let arg = |i: u8| match i {
        0 => f.rdi,
        1 => f.rsi,
        2 => f.rdx,
        3 => f.rcx,
        4 => f.r8,
        5 => f.r9,
        _ => 0,
    };
    match sig.size {
        Size::None => 0,
        Size::Arg(a) => arg(a),
        Size::Product(a, b) => arg(a).wrapping_mul(arg(b)),
        // strdup(s) and strndup(s, n): the copy's length plus one. The
        // string is read as the callee is about to read it.
        Size::ResultStrlen if f.rdi == 0 => 0,
        Size::ResultStrlen => {
            let limit = if limited() { f.rsi } else { u64::MAX };
            let mut n = 0u64;
            // SAFETY: a NUL-terminated string the allocator is given.
            while n < limit && unsafe { read::<u8>(f.rdi.wrapping_add(n)) } != 0 {
                n += 1;
            }
            n + 1
        }
    }
}

/// The return addresses above the site at `pc` (the thread's stack pointer
/// `sp` and rbp there), innermost first, at most `depth`.
fn walk(mut pc: u64, mut sp: u64, mut bp: u64, depth: usize) -> [u64; MAX_DEPTH] {
    let mut frames = [0u64; MAX_DEPTH];
    for (k, slot) in frames.iter_mut().enumerate().take(depth) {
        // A return address is after its call: look the call up.
        let Some(row) = registry::unwind_row(if k == 0 { pc } else { pc.wrapping_sub(1) }) else { break };
        let base = if row.kind == layout::unwind::RSP { sp } else { bp };
        let cfa = base.wrapping_add_signed(i64::from(row.cfa_offset));
        if cfa <= sp || cfa - sp > MAX_FRAME || !cfa.is_multiple_of(8) {
            break;
        }
        // SAFETY: the row says the return address is at CFA - 8, which
        // lies above `sp` on this thread's stack (checked above).
        let ra: u64 = unsafe { read(cfa - 8) };
        if row.rbp_saved != 0 {
            let at = cfa.wrapping_add_signed(i64::from(row.rbp_offset));
            if at < sp || at + 8 > cfa {
                break;
            }
            // SAFETY: between `sp` and the CFA (checked above).
            bp = unsafe { read(at) };
        }
        if ra == 0 {
            break;
        }
        *slot = ra;
        (pc, sp) = (ra, cfa);
    }
    frames
}

fn hash(module: u32, site: u32, frames: &[u64]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ (u64::from(module) << 32 | u64::from(site));
    for &f in frames {
        h = (h ^ f).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    h ^= h >> 31;
    if h <= 1 { h + 2 } else { h }
}

fn same(s: &ChainSlot, module: u32, site: u32, frames: &[u64]) -> bool {
    s.module.load(Ordering::Relaxed) == module
        && s.site.load(Ordering::Relaxed) == site
        && s.frames.iter().zip(frames).all(|(a, &b)| a.load(Ordering::Relaxed) == b)
}

/// Adds a call to its chain's slot: found by its key, or claimed (0 -> 1),
/// filled and published with the key.
/// Only the first `depth` frames are compared and written: the others are
/// 0 in every slot (a slot's depth is the capture's at the time; a chain
/// recorded at another depth is another chain).
fn record(region: u64, module: u32, site: u32, all: &[u64; MAX_DEPTH], depth: usize, bytes: u64) {
    let slots = SLOTS.load(Ordering::Relaxed);
    let base = region + MAX_MAPS * size_of::<MapEntry>() as u64;
    let frames = all.get(..depth).unwrap_or(all);
    let key = hash(module, site, frames);
    for probe in 0..PROBES.min(slots) {
        let i = key.wrapping_add(probe) & (slots - 1);
        // SAFETY: slot i of the region, mapped while the process runs.
        let s: &ChainSlot = unsafe { pod::at((base + i * size_of::<ChainSlot>() as u64) as usize) };
        let mut k = s.key.load(Ordering::Acquire);
        if k == 0 && s.key.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            s.module.store(module, Ordering::Relaxed);
            s.site.store(site, Ordering::Relaxed);
            for (a, &b) in s.frames.iter().zip(frames) {
                a.store(b, Ordering::Relaxed);
            }
            s.calls.fetch_add(1, Ordering::Relaxed);
            s.bytes.fetch_add(bytes, Ordering::Relaxed);
            s.key.store(key, Ordering::Release);
            return;
        }
        if k == 0 {
            k = s.key.load(Ordering::Acquire);
        }
        // A slot being written (1) is passed over: the chain may then be
        // recorded twice, and a reader adds the two up.
        if k == key && same(s, module, site, frames) {
            s.calls.fetch_add(1, Ordering::Relaxed);
            s.bytes.fetch_add(bytes, Ordering::Relaxed);
            return;
        }
    }
    if let Some(h) = crate::procfile::header() {
        h.callers_lost.fetch_add(1, Ordering::Relaxed);
    }
}

/// Zeroes every chain's figures (their identities stay: a thread may be
/// adding to a slot as it is zeroed, as with the counters).
pub fn reset() {
    let region = REGION.load(Ordering::Acquire);
    if region == 0 {
        return;
    }
    let base = region + MAX_MAPS * size_of::<MapEntry>() as u64;
    for i in 0..SLOTS.load(Ordering::Relaxed) {
        // SAFETY: slot i of the region, mapped while the process runs.
        let s: &ChainSlot = unsafe { pod::at((base + i * size_of::<ChainSlot>() as u64) as usize) };
        if s.key.load(Ordering::Relaxed) > 1 {
            s.calls.store(0, Ordering::Relaxed);
            s.bytes.store(0, Ordering::Relaxed);
        }
    }
    if let Some(h) = crate::procfile::header() {
        h.callers_lost.store(0, Ordering::Relaxed);
    }
}

/// Records the process's file-backed executable mappings in the region.
pub fn snapshot_maps() {
    let region = REGION.load(Ordering::Acquire);
    let Some(h) = crate::procfile::header() else { return };
    if region == 0 {
        return;
    }
    let mut n = 0u64;
    sys::for_each_maps_line(|line| {
        let Some((start, end, prot, offset, path)) = sys::parse_maps_file_line(line) else { return true };
        if prot & libc::PROT_EXEC == 0 || path.first() != Some(&b'/') {
            return true;
        }
        if n == MAX_MAPS {
            return false;
        }
        // SAFETY: entry n of the region's map array.
        let m: &MapEntry = unsafe { pod::at((region + n * size_of::<MapEntry>() as u64) as usize) };
        m.start.store(start, Ordering::Relaxed);
        m.end.store(end, Ordering::Relaxed);
        m.offset.store(offset, Ordering::Relaxed);
        ProcHeader::set_text(&m.path, path);
        n += 1;
        true
    });
    h.maps_count.store(n as u32, Ordering::Release);
}

/// Makes sure the process file has a callers region (mapped into REGION).
fn ensure_region() -> Result<(), &'static str> {
    if REGION.load(Ordering::Acquire) != 0 {
        return Ok(());
    }
    let r = PROC.with(|p| match p.as_mut() {
        Some(f) => f.add_callers(CALLERS_SLOTS),
        None => Err("no counters file: call chains cannot be recorded"),
    })?;
    SLOTS.store(CALLERS_SLOTS, Ordering::Relaxed);
    REGION.store(r, Ordering::Release);
    Ok(())
}

/// Starts recording chains of `depth` frames (1 to 8) at every site with a
/// callers entry, or stops (`depth` 0). The sites are rewritten to their
/// new entries while profiling is on.
pub fn set_depth(depth: u32) -> Result<(), &'static str> {
    let depth = depth.min(MAX_DEPTH as u32);
    if depth != 0 {
        ensure_region()?;
    }
    state::CALLERS.store(depth, Ordering::Release);
    if let Some(h) = crate::procfile::header() {
        h.callers_depth.store(depth, Ordering::Release);
    }
    if depth != 0 {
        snapshot_maps();
    }
    registry::refresh_all()
}

/// In a forked child: the parent's region is not the child's; a child
/// that records chains gets a region in its own file.
pub fn after_fork_in_child() {
    REGION.store(0, Ordering::Release);
    let depth = state::CALLERS.load(Ordering::Relaxed);
    if depth != 0 && ensure_region().is_ok() {
        if let Some(h) = crate::procfile::header() {
            h.callers_depth.store(depth, Ordering::Release);
        }
        snapshot_maps();
    }
}

/// `ALLOCTRAMP_CALLERS`: `on` (the default depth) or a depth 1 to 8.
pub fn depth_from_env(v: &str) -> Option<u32> {
    match v.trim() {
        "on" | "" => Some(layout::capture::DEFAULT_DEPTH as u32),
        "off" | "0" => Some(0),
        n => n.parse::<u32>().ok().filter(|d| (1..=MAX_DEPTH as u32).contains(d)),
    }
}
