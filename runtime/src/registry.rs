//! The patched modules of the process: a fixed array of slots read without
//! locks (signal handlers read it), written under a spin lock by the
//! registration path (module init and fini, never in signal context).

use crate::patching;
use crate::procfile::ProcFile;
use crate::state::{self, LIVE, Sites, WANT, want};
use crate::{foreign, live, sys};
use alloctramp_trampolines::layout::{self, CONTROL_SIZE, ControlBlock, Table, UNWIND_ROW_SIZE, UnwindRow};
use alloctramp_trampolines::pod;
use alloctramp_trampolines::process::ProcHeader;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};

pub const MAX_SLOTS: usize = 256;

const FREE: u8 = 0;
const ACTIVE: u8 = 1;
const DEAD: u8 = 2;

/// One registered module.
pub struct Slot {
    /// Run-time address of the site table.
    pub table: AtomicUsize,
    pub table_size: AtomicUsize,
    /// Sites in the table (read without reading the table, which an
    /// unload may unmap).
    site_count: AtomicU32,
    pub bias: AtomicU64,
    /// Run-time addresses of the first and past the last site.
    lo: AtomicU64,
    hi: AtomicU64,
    /// Run-time range of the module's trampolines (read by the fault
    /// handler without reading the table).
    text_lo: AtomicU64,
    text_hi: AtomicU64,
    state: AtomicU8,
    /// Held while the module's code is being switched or it is unloading.
    pub busy: AtomicBool,
    /// Which sites jump to their trampolines ([`Sites`] as u8).
    pub sites: AtomicU8,
    /// Index in the process file (u32::MAX: none).
    pub file_index: AtomicU32,
    /// Registered while the process never profiled: its counters are a
    /// private mapping, and neither its table nor its counters are in the
    /// process file yet. They join it when its sites first leave Off
    /// ([`place`]); its table's order is checked then too.
    pending: AtomicBool,
    /// Run-time address and count of the module's unwind rows (0: none),
    /// and the run-time range of code they cover.
    unwind: AtomicUsize,
    unwind_count: AtomicU32,
    /// The block index after the rows (`unwind_blocks` entries).
    unwind_blocks: AtomicU32,
    code_lo: AtomicU64,
    code_hi: AtomicU64,
    /// End of the module's read-only segment after the table (what the
    /// rows it carries for libraries must lie within).
    unwind_end: AtomicU64,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            table: AtomicUsize::new(0),
            table_size: AtomicUsize::new(0),
            site_count: AtomicU32::new(0),
            bias: AtomicU64::new(0),
            lo: AtomicU64::new(0),
            hi: AtomicU64::new(0),
            text_lo: AtomicU64::new(0),
            text_hi: AtomicU64::new(0),
            state: AtomicU8::new(FREE),
            busy: AtomicBool::new(false),
            sites: AtomicU8::new(Sites::Off as u8),
            file_index: AtomicU32::new(u32::MAX),
            pending: AtomicBool::new(false),
            unwind: AtomicUsize::new(0),
            unwind_count: AtomicU32::new(0),
            unwind_blocks: AtomicU32::new(0),
            code_lo: AtomicU64::new(0),
            code_hi: AtomicU64::new(0),
            unwind_end: AtomicU64::new(0),
        }
    }

    /// The unwind row that covers `pc`, if this module has one.
    /// On the path of every captured call: a range check, then a few rows
    /// scanned from the block index.
    fn unwind_row(&self, pc: u64) -> Option<UnwindRow> {
        // code_hi is published last (check_unwind): read first.
        let hi = self.code_hi.load(Ordering::Acquire);
        let lo = self.code_lo.load(Ordering::Relaxed);
        if pc < lo || pc >= hi || !self.is_active() {
            return None;
        }
        let p = self.unwind.load(Ordering::Relaxed) as *const UnwindRow;
        let n = self.unwind_count.load(Ordering::Relaxed) as usize;
        // SAFETY: set_unwind checked that the rows and the block index
        // after them lie in the module's read-only segment (mapped while
        // the slot is active), and check_unwind that they are sound before
        // it published code_hi.
        unsafe { foreign::row_at(p, n, self.bias.load(Ordering::Relaxed), lo, pc) }
    }

    pub fn is_active(&self) -> bool {
        self.state.load(Ordering::Acquire) == ACTIVE
    }

    pub fn contains(&self, addr: u64) -> bool {
        self.is_active() && addr >= self.lo.load(Ordering::Relaxed) && addr < self.hi.load(Ordering::Relaxed)
    }

    /// The module's site table.
    ///
    /// # Safety
    /// The module must still be mapped (active, or held busy).
    pub unsafe fn table<'a>(&self) -> Option<Table<'a>> {
        let p = self.table.load(Ordering::Acquire) as *const u8;
        if p.is_null() {
            return None;
        }
        let n = self.table_size.load(Ordering::Relaxed);
        // SAFETY: the table was checked at registration and is mapped
        // (caller).
        Table::parse(unsafe { std::slice::from_raw_parts(p, n) }).ok()
    }

    /// What switching needs of the module.
    ///
    /// # Safety
    /// The module must still be mapped (active, or held busy).
    pub unsafe fn module<'a>(&self) -> Option<patching::Module<'a>> {
        Some(patching::Module {
            // SAFETY: forwarded from the caller.
            table: unsafe { self.table() }?,
            bias: self.bias.load(Ordering::Relaxed),
            span: (self.lo.load(Ordering::Relaxed), self.hi.load(Ordering::Relaxed)),
        })
    }

    pub fn state(&self) -> Sites {
        Sites::from_u8(self.sites.load(Ordering::Acquire))
    }

    pub fn try_hold(&self) -> bool {
        self.is_active() && self.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    pub fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }
}

static SLOTS: [Slot; MAX_SLOTS] = [const { Slot::new() }; MAX_SLOTS];
static SLOT_COUNT: AtomicUsize = AtomicUsize::new(0);

/// The slots in use so far (active or dead).
pub fn slots() -> impl Iterator<Item = &'static Slot> {
    SLOTS.get(..SLOT_COUNT.load(Ordering::Acquire).min(MAX_SLOTS)).unwrap_or_default().iter()
}

/// Sites of the active modules.
pub fn site_count() -> u64 {
    slots().filter(|s| s.is_active()).map(|s| u64::from(s.site_count.load(Ordering::Relaxed))).sum()
}

/// Objects tracked now: the live objects (calls - failed - freed) of every
/// site that allocates, in every active module, summed over the shards of
/// the runtime's view of its counters. Lock-free; None while a module is
/// held by a switch or a registration. Modules unloaded since are left
/// out: their objects still leave their figures when freed.
pub fn tracked_objects() -> Option<u64> {
    use alloctramp_trampolines::layout::{CELL_SIZE, cell, site_flags};
    // Summed over every site and shard (each figure wraps; so does the sum).
    let mut live = 0u64;
    for (i, slot) in slots().enumerate() {
        if !slot.is_active() {
            continue;
        }
        if !slot.try_hold() {
            return None;
        }
        // SAFETY: an active, held slot's table is mapped.
        let t = unsafe { slot.table() };
        let m = live::MODULES.get(i);
        if let (Some(t), Some(m)) = (t, m) {
            let (base, stride) = (m.base.load(Ordering::Acquire), m.stride.load(Ordering::Relaxed));
            let shards = u64::from(m.mask.load(Ordering::Relaxed)) + 1;
            for s in 0..shards {
                let shard = base.wrapping_add(s.wrapping_mul(stride));
                // Pages never written are holes of the counters file, which
                // a read would allocate (tmpfs): only resident pages are read.
                let mut resident = [0u8; 4096];
                let mut chunk = u64::MAX;
                for (k, site) in t.sites().enumerate() {
                    let at = (k * CELL_SIZE) as u64;
                    if base == 0 || at >= stride {
                        break;
                    }
                    if site.drain != 0 && site.flags & site_flags::HOOK == 0 {
                        continue;
                    }
                    let page = at / 4096;
                    if page / 4096 != chunk {
                        chunk = page / 4096;
                        let from = chunk * 4096 * 4096;
                        let len = (stride - from).min(4096 * 4096);
                        // SAFETY: a page-aligned range of the runtime's view
                        // of the module's counters; `resident` holds a byte
                        // per page of it.
                        if unsafe {
                            libc::mincore((shard + from) as *mut libc::c_void, len as usize, resident.as_mut_ptr())
                        } != 0
                        {
                            resident = [1; 4096];
                        }
                    }
                    if resident.get((page % 4096) as usize).is_none_or(|r| r & 1 == 0) {
                        continue;
                    }
                    let field = |f: u32| {
                        // SAFETY: a cell inside a resident page of the
                        // runtime's view of the module's counters (never
                        // unmapped while the slot is active); 8-aligned.
                        unsafe { &*((shard + at + u64::from(f)) as *const AtomicU64) }.load(Ordering::Relaxed)
                    };
                    live = live
                        .wrapping_add(field(cell::CALLS))
                        .wrapping_sub(field(cell::FAILED))
                        .wrapping_sub(field(cell::FREED_OBJECTS));
                }
            }
        }
        slot.release();
    }
    Some(live.min(i64::MAX as u64))
}

/// Whether nothing is tracked any more (see [`tracked_objects`]).
pub fn nothing_tracked() -> bool {
    tracked_objects() == Some(0)
}

/// A spin lock for the registration path (never taken in signal context,
/// but by [`SpinLock::with_unless_mine`]).
pub struct SpinLock<T> {
    /// The holder's `pthread_self()` (0: free): taking the lock records
    /// its holder in the same step, so a thread can tell that it holds it.
    owner: AtomicUsize,
    value: UnsafeCell<T>,
}

// SAFETY: access to the value is serialized by `owner`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

fn me() -> usize {
    // SAFETY: pthread_self reads the thread pointer; no preconditions.
    unsafe { libc::pthread_self() as usize }
}

impl<T> SpinLock<T> {
    pub const fn new(v: T) -> Self {
        SpinLock { owner: AtomicUsize::new(0), value: UnsafeCell::new(v) }
    }
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let me = me();
        while self.owner.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
        // SAFETY: the lock is held.
        let r = f(unsafe { &mut *self.value.get() });
        self.owner.store(0, Ordering::Release);
        r
    }
    /// As [`with`](Self::with), or `None` if the calling thread holds the
    /// lock already (a signal handler that interrupted the holder, which
    /// would wait for itself forever).
    pub fn with_unless_mine<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        if self.owner.load(Ordering::Relaxed) == me() {
            return None;
        }
        Some(self.with(f))
    }
    /// After fork, in the child, where no other thread can hold the lock.
    pub fn force_unlock(&self) {
        self.owner.store(0, Ordering::Release);
    }
}

/// The process file, once created.
pub static PROC: SpinLock<Option<ProcFile>> = SpinLock::new(None);

/// The control block of a module loaded at `bias`.
///
/// # Safety
/// The module must be loaded, and stay loaded while the reference is used.
unsafe fn control_block<'a>(bias: u64, h: &layout::Header) -> &'a ControlBlock {
    // SAFETY: the caller's contract; the patcher aligns the control block
    // to 64 bytes and the runtime writes it only through atomics.
    unsafe { pod::at(bias.wrapping_add(h.control_addr) as usize) }
}

/// Registers a module by the run-time address of its site table, then
/// brings its sites to the wanted state. Idempotent. A table that does not
/// fit the `room` bytes is ignored (with a message).
///
/// # Safety
/// `table` must be the run-time address of a loaded module's site table,
/// followed by `room` readable bytes of the module's read-only segment
/// (the table's bytes are checked against `room`, not trusted).
pub unsafe fn register(table: *const u8, module: &Segments, inert: bool) {
    // SAFETY: `room` bytes are mapped and read-only (caller).
    let bytes = unsafe { std::slice::from_raw_parts(table, module.room) };
    // A module that joins the process file later has its order checked
    // then (a process never profiled reads no more of its table than this).
    let defer = !inert && DEFER_PLACEMENT.load(Ordering::Relaxed);
    let t = match Table::parse(bytes).and_then(|t| if defer { Ok(t) } else { t.check_order().map(|()| t) }) {
        Ok(t) => t,
        Err(e) => return log_unreadable(e),
    };
    let size = t.bytes().len();
    let bias = (table as u64).wrapping_sub(t.header.table_addr);
    let h = &t.header;
    let control_at = bias.wrapping_add(h.control_addr);
    let counters = bias.wrapping_add(h.counters_addr);
    if !module.writable(control_at, CONTROL_SIZE as u64) || !module.writable(counters, h.counters_size) {
        sys::log(b"a patched module's control block or counters lie outside its writable segments; not profiled");
        return;
    }

    // The control block: where the counters are, how to find the thread's shard.
    // SAFETY: CONTROL_SIZE bytes at a 64-aligned address (Table::parse)
    // inside a writable segment of the module (checked above), mapped
    // while the module is loaded, which it is until its fini stub
    // unregisters it.
    let control = unsafe { control_block(bias, h) };
    control.shard_tls.store(crate::tls::offset() + 8 * crate::tls::SHARD as i64, Ordering::Relaxed);
    control.assign.store(crate::shards::stub(), Ordering::Relaxed);
    control.depth_tls.store(crate::tls::offset() + 8 * crate::tls::DEPTH as i64, Ordering::Relaxed);
    control.charge_tls.store(crate::tls::offset() + 8 * crate::tls::CHARGE as i64, Ordering::Relaxed);
    control.capture.store(CAPTURE.load(Ordering::Relaxed), Ordering::Relaxed);
    control.trace_tls.store(crate::tls::offset() + 8 * crate::tls::TRACE_RING as i64, Ordering::Relaxed);
    control.trace_record.store(crate::trace::record_slow as *const () as u64, Ordering::Relaxed);
    control.personality.store(crate::unwinding::personality as *const () as u64, Ordering::Relaxed);
    // A module registers twice (the runtime finds it loaded, then its init
    // stub runs): the second time must keep the runtime's mapping.
    let _ = control.counters.compare_exchange(0, counters, Ordering::Relaxed, Ordering::Relaxed);
    if inert {
        return;
    }

    let slot = PROC.with(|proc| {
        if slots().any(|s| s.is_active() && s.table.load(Ordering::Relaxed) == table as usize) {
            return None;
        }
        let i = SLOT_COUNT.load(Ordering::Relaxed);
        let Some(slot) = SLOTS.get(i) else {
            sys::log(b"too many patched modules; one is not profiled");
            return None;
        };
        // A process that never profiled (and is switched from its watcher
        // thread, which can take this lock) keeps the module out of its
        // file until it first switches on: a program run a thousand times
        // without profiling writes no table and reserves no counters.
        let file = proc.is_some() || FILE_DEFERRED.load(Ordering::Relaxed);
        let pending = defer && file && want() == Sites::Off && !state::PROFILED.load(Ordering::Relaxed);
        if !pending
            && defer
            && let Err(e) = t.check_order()
        {
            log_unreadable(e);
            return None;
        }
        let placed = match proc
            .as_mut()
            .filter(|_| !pending)
            .map(|f| (f.add_module(t.bytes(), bias, counters, h.counters_size, None), f))
        {
            Some((Ok(r), _)) => Some(r),
            other => {
                if let Some((Err(e), f)) = other {
                    log_unplaced(f, e);
                }
                private_counters(h.counters_size).map(|own| (u32::MAX, own))
            }
        };
        let Some((file_index, own)) = placed else {
            sys::log(b"cannot map a patched module's counters; it is not profiled");
            return None;
        };
        live::set_module(i, own, h.counters_size, h.shard_stride, h.shard_count.saturating_sub(1));
        // The trampolines count through the runtime's own mapping, which
        // outlives the module: a shadow-map record or table entry may name a cell
        // after the module is unloaded.
        control.counters.store(own, Ordering::Relaxed);
        control.module_id.store(i as u64, Ordering::Relaxed);
        if LIVE.load(Ordering::Relaxed) && live::reserved() {
            let file = proc.as_mut().filter(|_| file_index != u32::MAX).map(|f| (f, file_index));
            // SAFETY: its sites are all off until `converge`.
            unsafe { live::enable_in(control, i as u64, file) };
        }
        slot.table.store(table as usize, Ordering::Relaxed);
        slot.table_size.store(size, Ordering::Relaxed);
        slot.site_count.store(h.site_count, Ordering::Relaxed);
        slot.bias.store(bias, Ordering::Relaxed);
        let (lo, hi) = match (t.sites().next(), h.site_count.checked_sub(1).map(|l| t.site(l as usize))) {
            (Some(a), Some(b)) => (bias.wrapping_add(a.addr), bias.wrapping_add(b.addr.wrapping_add(u64::from(b.len)))),
            _ => (0, 0),
        };
        slot.lo.store(lo, Ordering::Relaxed);
        slot.hi.store(hi, Ordering::Relaxed);
        slot.text_lo.store(bias.wrapping_add(h.text_addr), Ordering::Relaxed);
        slot.text_hi.store(bias.wrapping_add(h.text_addr).wrapping_add(h.text_size), Ordering::Relaxed);
        slot.file_index.store(file_index, Ordering::Relaxed);
        slot.pending.store(pending, Ordering::Relaxed);
        if pending && let Some(f) = proc.as_ref() {
            count_pending(f.header, h.site_count, true);
        }
        set_unwind(slot, &t, table as u64, module.room);
        slot.busy.store(true, Ordering::Relaxed);
        slot.state.store(ACTIVE, Ordering::Release);
        SLOT_COUNT.store(i + 1, Ordering::Release);
        Some(slot)
    });
    if let Some(slot) = slot {
        converge(slot);
    }
}

/// The module's unwind rows, if they lie within the `room` bytes of its
/// read-only segment after the table at `table`, are sorted, and are
/// 4-byte aligned.
fn set_unwind(slot: &Slot, t: &Table, table: u64, room: usize) {
    let h = &t.header;
    let n = h.unwind_count as usize;
    let blocks = h.unwind_blocks as usize;
    let start = h.unwind_addr.wrapping_sub(h.table_addr);
    let ok = n > 0
        && h.unwind_addr >= h.table_addr
        && start.is_multiple_of(4)
        && usize::try_from(start)
            .ok()
            .and_then(|s| s.checked_add(n.checked_mul(UNWIND_ROW_SIZE)?)?.checked_add(blocks.checked_mul(4)?))
            .is_some_and(|end| end <= room);
    if !ok {
        return;
    }
    slot.unwind_count.store(n as u32, Ordering::Relaxed);
    slot.unwind_blocks.store(blocks as u32, Ordering::Relaxed);
    slot.unwind_end.store(table.wrapping_add(room as u64), Ordering::Relaxed);
    slot.unwind.store(table.wrapping_add(start) as usize, Ordering::Relaxed);
}

/// Checks a held slot's unwind rows once (sorted, a block index that
/// covers them and names rows that exist, addresses that fit 32 bits from
/// the bias), then opens them to lookups. Done when callers capture first
/// needs them, not at registration: a module whose chains are never
/// recorded never reads its rows (nor maps their pages).
fn check_unwind(slot: &Slot) {
    if slot.code_hi.load(Ordering::Relaxed) != 0 {
        return;
    }
    let p = slot.unwind.load(Ordering::Relaxed) as *const UnwindRow;
    let (n, blocks) =
        (slot.unwind_count.load(Ordering::Relaxed) as usize, slot.unwind_blocks.load(Ordering::Relaxed) as usize);
    if p.is_null() {
        return;
    }
    // SAFETY: within the module's read-only segment (set_unwind), mapped
    // while the slot is held.
    let (rows, index) =
        unsafe { (std::slice::from_raw_parts(p, n), std::slice::from_raw_parts(p.add(n) as *const u32, blocks)) };
    let bias = slot.bias.load(Ordering::Relaxed);
    let Some((lo, hi)) = foreign::rows_are_sound(rows, index, bias) else {
        slot.unwind.store(0, Ordering::Relaxed);
        return;
    };
    slot.code_lo.store(lo, Ordering::Relaxed);
    slot.code_hi.store(hi, Ordering::Release);
    open_foreign(slot, p as u64 + (n * UNWIND_ROW_SIZE + blocks * 4) as u64);
    // Addresses of this module were answered "no row" until now.
    forget_rows();
}

/// Opens the rows an executable carries for its libraries, in a directory
/// after its own rows (ending at `own_end`). Only an executable's: its
/// segment, where they lie, stays mapped while any thread may be in a
/// library it needs, which a library's own unloading would not ensure.
fn open_foreign(slot: &Slot, own_end: u64) {
    // SAFETY: the slot is held (caller): its module is mapped.
    let Some(t) = (unsafe { slot.table() }) else { return };
    let count = t.header.foreign_count;
    let bias = slot.bias.load(Ordering::Relaxed);
    if count == 0 || !is_executable(bias.wrapping_add(t.header.ehdr_addr)) {
        return;
    }
    let Some(index) = slots().position(|s| std::ptr::eq(s, slot)) else { return };
    let string = |o: u32| t.string(o).map(str::as_bytes);
    let dir = layout::foreign_offset(own_end as usize) as u64;
    foreign::open(index, dir, count, slot.unwind_end.load(Ordering::Relaxed), string);
}

/// Whether the ELF file whose header is mapped at `ehdr` (a registered
/// module's) has a program interpreter: an executable, never unloaded.
fn is_executable(ehdr: u64) -> bool {
    // SAFETY: a registered module's ELF header and program headers, which
    // the patcher places at the start of its read-only segment (mapped
    // while the module is).
    unsafe {
        let phoff: u64 = std::ptr::read_unaligned((ehdr + 32) as *const u64);
        let phnum: u16 = std::ptr::read_unaligned((ehdr + 56) as *const u16);
        (0..u64::from(phnum.min(64))).any(|i| {
            std::ptr::read_unaligned((ehdr.wrapping_add(phoff).wrapping_add(i * 56)) as *const u32) == libc::PT_INTERP
        })
    }
}

/// The runtime's `capture` function, written into every module's control
/// block at registration (set at start-up by the layer that owns it).
pub static CAPTURE: AtomicU64 = AtomicU64::new(0);

/// How to find a frame's caller (an unwind row, decoded): the CFA is rbp
/// (`from_rbp`) or rsp plus `cfa`; the return address is at CFA - 8 and,
/// if `rbp_saved`, the caller's rbp at CFA + `rbp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub from_rbp: bool,
    pub cfa: i64,
    pub rbp_saved: bool,
    pub rbp: i64,
}

impl Step {
    /// The step in 30 bits (the low bits of a [`ROW_CACHE`] entry), if its
    /// offsets are multiples of 8.
    pub fn pack(self) -> Option<u32> {
        let fits = |v: i64| v % 8 == 0 && (-32_768..32_768).contains(&v);
        if !fits(self.cfa) || (self.rbp_saved && !fits(self.rbp)) {
            return None;
        }
        let kind = if self.from_rbp { layout::unwind::RBP } else { layout::unwind::RSP };
        let rbp = if self.rbp_saved { self.rbp / 8 } else { 0 };
        Some(
            ((rbp as u32) & 0x3fff) << 16
                | ((self.cfa / 8) as u32 & 0x1fff) << 3
                | u32::from(self.rbp_saved) << 2
                | u32::from(kind),
        )
    }

    /// A step [`Step::pack`] made (`None` for 0).
    #[inline(always)]
    pub fn unpack(v: u32) -> Option<Step> {
        unpack_step(u64::from(v))
    }

    fn of(r: UnwindRow) -> Option<Step> {
        (r.kind == layout::unwind::RSP || r.kind == layout::unwind::RBP).then_some(Step {
            from_rbp: r.kind == layout::unwind::RBP,
            cfa: i64::from(r.cfa_offset),
            rbp_saved: r.rbp_saved != 0,
            rbp: i64::from(r.rbp_offset),
        })
    }
}

/// The unwind step at `pc`, from the row of the patched module whose code
/// holds it (`None` where a chain ends: no module has a row there, or the
/// row says stop).
///
/// On the path of every captured call, once per frame: most lookups are
/// answered by [`ROW_CACHE`] with one load.
#[inline(always)]
pub fn unwind_step(pc: u64) -> Option<Step> {
    let cell = row_cell(pc);
    let v = cell.load(Ordering::Relaxed);
    // An empty entry (0) matches only addresses below 8 KiB, which it
    // answers as a stop; an address above 47 bits matches no entry.
    if v >> CACHE_TAG_SHIFT == pc >> CACHE_BITS {
        return unpack_step(v);
    }
    unwind_miss(pc, cell)
}

#[cold]
#[inline(never)]
fn unwind_miss(pc: u64, cell: &AtomicU64) -> Option<Step> {
    let generation = ROW_CACHE_GENERATION.load(Ordering::SeqCst);
    let (row, cacheable) = match slots().find_map(|s| s.unwind_row(pc)) {
        Some(r) => (Some(r), true),
        None => {
            let l = foreign::row(pc);
            (l.row, l.cacheable)
        }
    };
    if let Some(v) = pack_row(pc, row).filter(|_| cacheable) {
        if !ROWS_CACHED.load(Ordering::SeqCst) {
            ROWS_CACHED.store(true, Ordering::SeqCst);
        }
        cell.store(v, Ordering::SeqCst);
        // Forgotten meanwhile (the answer may be stale): take it back.
        if ROW_CACHE_GENERATION.load(Ordering::SeqCst) != generation {
            let _ = cell.compare_exchange(v, 0, Ordering::SeqCst, Ordering::Relaxed);
        }
    }
    row.and_then(Step::of)
}

/// Lookups of [`unwind_row`], direct-mapped by the address's low
/// [`CACHE_BITS`] bits, one word each so that no reader sees half an
/// entry: from bit 0, the row's kind (2 bits), whether rbp was saved (1),
/// the CFA offset and the saved rbp's offset in units of 8 bytes (13 and
/// 14 bits, two's complement), then the address's bits above the index
/// (the tag; user addresses have 47 bits). 0 is empty: the first page of
/// the address space is never code. A row whose offsets do not fit is not
/// cached (it is looked up each time); "no row" is cached as a stop.
///
/// An answer can go stale only when the rows it came from change: a
/// module's rows opened to lookups (`check_unwind`) or its unloading.
/// Both call [`forget_rows`], which raises the generation before clearing
/// every entry; a lookup that stored an answer checks the generation
/// after the store and takes the answer back if it moved (all SeqCst: if
/// the clearing missed the store, the lookup sees the new generation).
static ROW_CACHE: [AtomicU64; 1 << CACHE_BITS] = [const { AtomicU64::new(0) }; 1 << CACHE_BITS];
static ROW_CACHE_GENERATION: AtomicU64 = AtomicU64::new(0);

/// Raised whenever unwind rows change (see [`ROW_CACHE`]): what was
/// derived from lookups made under another generation is stale.
#[inline(always)]
pub fn rows_generation() -> u64 {
    ROW_CACHE_GENERATION.load(Ordering::Acquire)
}
const CACHE_BITS: u32 = 13;
const CACHE_PC_BITS: u32 = 47;
const CACHE_TAG_SHIFT: u32 = 30;

fn row_cell(pc: u64) -> &'static AtomicU64 {
    let i = (pc & ((1 << CACHE_BITS) - 1)) as usize;
    // SAFETY: the index is masked to the array's length.
    unsafe { ROW_CACHE.get_unchecked(i) }
}

fn pack_row(pc: u64, row: Option<UnwindRow>) -> Option<u64> {
    if pc >> CACHE_PC_BITS != 0 || pc >> CACHE_BITS == 0 {
        return None;
    }
    let tag = (pc >> CACHE_BITS) << CACHE_TAG_SHIFT;
    let Some(r) = row else { return Some(tag) };
    let (cfa, rbp) = (i64::from(r.cfa_offset), i64::from(r.rbp_offset));
    let saved = r.rbp_saved != 0;
    if r.kind > 3 || cfa % 8 != 0 || (saved && rbp % 8 != 0) {
        return None;
    }
    let rbp = if saved { rbp / 8 } else { 0 };
    // i16 / 8 fits 13 bits, and so 14.
    Some(
        tag | ((rbp as u64) & 0x3fff) << 16
            | ((cfa / 8) as u64 & 0x1fff) << 3
            | u64::from(saved) << 2
            | u64::from(r.kind),
    )
}

#[inline(always)]
fn unpack_step(v: u64) -> Option<Step> {
    let kind = (v & 3) as u8;
    if kind != layout::unwind::RSP && kind != layout::unwind::RBP {
        return None;
    }
    // Each offset field, sign-extended and shifted so that it lands at
    // bit 3 (times 8), with the bits below it cleared.
    Some(Step {
        from_rbp: kind == layout::unwind::RBP,
        cfa: ((v << 48) as i64 >> 48) & !7,
        rbp_saved: v & 4 != 0,
        rbp: ((v << 34) as i64 >> 47) & !7,
    })
}

/// Forgets every cached unwind lookup (see [`ROW_CACHE`]), and raises the
/// generation that what callers capture derives from them carries. Not in
/// signal context: on the registration and switching paths.
pub fn forget_rows() {
    ROW_CACHE_GENERATION.fetch_add(1, Ordering::SeqCst);
    // A process that never recorded a chain has nothing to clear (and its
    // exit touches none of the cache's pages).
    if ROWS_CACHED.swap(false, Ordering::SeqCst) {
        for c in &ROW_CACHE {
            c.store(0, Ordering::SeqCst);
        }
    }
}

/// Set before a lookup stores an answer in [`ROW_CACHE`], cleared by the
/// [`forget_rows`] that clears it (a store after the clearing sees the
/// new generation, as the cache's protocol requires, and takes its answer
/// back).
static ROWS_CACHED: AtomicBool = AtomicBool::new(false);

/// The process-file index of the module in slot `slot` (its control
/// block's `module_id`), if that slot is active and holds the site table
/// at `table`.
#[inline(always)]
pub fn file_index_of(slot: u64, table: usize) -> Option<u32> {
    let s = SLOTS.get(slot as usize)?;
    let i = s.file_index.load(Ordering::Relaxed);
    (s.is_active() && s.table.load(Ordering::Relaxed) == table && i != u32::MAX).then_some(i)
}

/// The site table of the registered module whose table is at `t`.
pub fn table_at<'a>(t: u64) -> Option<Table<'a>> {
    // SAFETY: an active slot's module is mapped; the caller runs code of
    // the module whose table it names, so it stays mapped meanwhile.
    slots().find(|s| s.is_active() && s.table.load(Ordering::Relaxed) as u64 == t).and_then(|s| unsafe { s.table() })
}

/// Counts the sites fault specs name into the process file's header, and
/// notes whether one is a wrapper's call (whose failure is an allocation
/// inside the wrapper, so the sites inside wrappers must be routed too).
/// Says whether that changed (the sites must then be switched again).
pub fn publish_fail_sites() -> bool {
    let (mut n, mut wrapped) = (0u64, false);
    for slot in slots() {
        if !slot.try_hold() {
            continue;
        }
        // SAFETY: the slot is held.
        if let Some(t) = unsafe { slot.table() } {
            for s in t.sites().filter(|s| crate::fault::names(&t, s)) {
                n += 1;
                wrapped |= crate::fault::names_wrapper(&t, &s);
            }
        }
        slot.release();
    }
    if let Some(h) = crate::procfile::header() {
        h.fail_sites.store(n.min(u64::from(u32::MAX)) as u32, Ordering::Release);
    }
    crate::fault::set_wrapped(wrapped)
}

/// Rewrites every module's sites to the entries they should hold now
/// (after callers capture was switched): sites already right stay.
pub fn refresh_all() -> Result<(), &'static str> {
    let mut result = Ok(());
    for slot in slots() {
        if !slot.try_hold() {
            continue;
        }
        // SAFETY: the slot is held.
        if let Err(e) = unsafe { switch(slot, slot.state()) } {
            result = Err(e);
        }
        slot.release();
    }
    result
}

/// Counters for a module the process file does not hold (nothing reads
/// them): a private mapping that, like the file's, outlives the module.
/// `None` if the system refuses it (the module is then not profiled: the
/// runtime never counts into memory the module owns, which an unload
/// would take away from under a tracked object's cell).
fn private_counters(size: u64) -> Option<u64> {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as u64)
}

/// Where a module's segments are, for checking its site table's layout
/// against them.
pub struct Segments {
    /// Bytes of the read-only segment from the site table onwards.
    pub room: usize,
    /// Run-time ranges of the writable segments (start, end of memory).
    pub writable: [(u64, u64); 8],
}

impl Segments {
    /// Whether `size` bytes at `addr` lie inside one writable segment.
    pub fn writable(&self, addr: u64, size: u64) -> bool {
        let Some(end) = addr.checked_add(size) else { return false };
        self.writable.iter().any(|&(lo, hi)| lo <= addr && end <= hi && lo < hi)
    }
}

/// With the slot held: brings it to the wanted state, releases it, and
/// repeats if the wanted state changed meanwhile (a switch that found the
/// slot busy skipped it).
fn converge(slot: &Slot) {
    loop {
        let target = want();
        if slot.state() != target {
            // SAFETY: the slot is held.
            match unsafe { switch(slot, target) } {
                Ok(()) => set_on(slot, target),
                Err(e) => state::report_error(e),
            }
        }
        slot.release();
        if want() == slot.state() || !slot.try_hold() {
            return;
        }
    }
}

/// Switches a held slot's module.
///
/// # Safety
/// The slot must be held busy by the caller.
unsafe fn switch(slot: &Slot, to: Sites) -> Result<(), &'static str> {
    // SAFETY: held (caller), with its sites off if it is pending.
    if to != Sites::Off && slot.pending.load(Ordering::Relaxed) && !unsafe { place(slot) } {
        return Ok(());
    }
    if to != Sites::Off && LIVE.load(Ordering::Relaxed) && live::reserved() {
        // SAFETY: held (caller); a slot leaves Off for the first time here.
        unsafe { enable_live(slot) };
    }
    if state::CALLERS.load(Ordering::Relaxed) != 0 {
        check_unwind(slot);
    }
    // SAFETY: a held slot's module stays mapped (caller).
    match unsafe { slot.module() } {
        // SAFETY: as above; holding the slot excludes other switches.
        Some(m) => unsafe { patching::switch_module(&m, to, crate::sys::barrier()) },
        None => Ok(()),
    }
}

/// Whether modules that register while the process never profiled stay
/// out of its file until they first switch on (set at start-up where
/// requests are carried out by a thread, which may take the registration
/// lock; a signal handler may not).
pub static DEFER_PLACEMENT: AtomicBool = AtomicBool::new(false);

/// Why the last module that joined the process file could not (its
/// counters stay private: it counts, and no report shows it), for the
/// switch that tried to say.
static PLACE_ERROR: SpinLock<Option<&'static str>> = SpinLock::new(None);

/// Gives shard `s` its storage in every module of the process file and
/// its place in the freed view, then sets its bit in `shards::RESERVED`
/// (see `shards`). Called as a thread is
/// first given shard `s`: on any thread, perhaps in a signal handler,
/// keeping errno. False (the thread shares shard 0) if the storage is
/// refused, or the thread holds the registration lock already.
pub fn reserve_shard(s: u32) -> bool {
    let _errno = sys::ErrnoGuard::new();
    PROC.with_unless_mine(|proc| {
        if crate::shards::RESERVED.load(Ordering::Acquire) & 1 << s != 0 {
            return true;
        }
        if let Some(f) = proc.as_mut()
            && let Err(e) = f.reserve_shard(s).and_then(|()| live::map_freed_shard(f, s))
        {
            if !SHARD_REFUSED.swap(true, Ordering::Relaxed) {
                let mut m = sys::Buf::<512>::new();
                m.push(f.path()).str(": ").str(e).str("; threads without storage for a shard of their own share one");
                sys::log(m.bytes());
            }
            return false;
        }
        crate::shards::RESERVED.fetch_or(1 << s, Ordering::Release);
        true
    })
    .unwrap_or(false)
}

/// A shard's storage was refused once (said once).
static SHARD_REFUSED: AtomicBool = AtomicBool::new(false);

/// Takes the reason the last placement failed, if one did.
pub fn take_place_error() -> Option<&'static str> {
    PLACE_ERROR.with(Option::take)
}

/// A process that never profiled (from its start, or a forked child of
/// one) makes its counters file later, in its watcher thread
/// (`deferred_file` in lib.rs): until then, modules that register are
/// pending, as with the file.
pub static FILE_DEFERRED: AtomicBool = AtomicBool::new(false);

/// Whether every registered module is pending: none joined the process
/// file (the process never switched on).
pub fn all_pending() -> bool {
    slots().filter(|s| s.is_active()).all(|s| s.pending.load(Ordering::Relaxed))
}

/// Makes the file of a process whose file was deferred, with `make`
/// (given what completes the header before the file can be seen), under
/// the registry's lock: its pending modules count in it as they would have
/// from the start, and none registers or goes meanwhile. Not if the
/// process is exiting (`exiting`, set under the same lock). Returns
/// whether the process has its file now.
pub fn make_deferred_file(exiting: &AtomicBool, make: impl FnOnce(&dyn Fn(&ProcHeader)) -> Option<ProcFile>) -> bool {
    PROC.with(|p| {
        FILE_DEFERRED.store(false, Ordering::Relaxed);
        if exiting.load(Ordering::Acquire) {
            return false;
        }
        // (A module being unloaded stays pending until `unregister` takes
        // it away under this lock.)
        let init = |h: &ProcHeader| {
            for slot in slots().filter(|s| s.pending.load(Ordering::Relaxed)) {
                count_pending(h, slot.site_count.load(Ordering::Relaxed), true);
            }
            state::publish_state_to(h);
        };
        let Some(f) = make(&init) else { return false };
        crate::procfile::set_header(f.header);
        *p = Some(f);
        true
    })
}

/// Adds a module of `sites` sites to the file's count of modules not in
/// it yet (`add`), or takes it away.
fn count_pending(h: &ProcHeader, sites: u32, add: bool) {
    if add {
        h.pending_modules.fetch_add(1, Ordering::Relaxed);
        h.pending_sites.fetch_add(u64::from(sites), Ordering::Relaxed);
    } else {
        h.pending_modules.fetch_sub(1, Ordering::Relaxed);
        h.pending_sites.fetch_sub(u64::from(sites), Ordering::Relaxed);
    }
}

/// A pending module joins the process file as its sites first leave Off:
/// its table is checked, then copied into the file, and the file's region
/// is mapped over its private counters at the same address (they never
/// counted, so nothing is lost, and every address the runtime recorded
/// for them stays right). Returns false if the module must not switch: its
/// table is out of order (it is then forgotten, with a message).
///
/// # Safety
/// The slot must be held busy by the caller, with its sites off.
unsafe fn place(slot: &Slot) -> bool {
    // SAFETY: a held slot's module is mapped (caller).
    let Some(t) = (unsafe { slot.table() }) else { return false };
    let h = &t.header;
    slot.pending.store(false, Ordering::Relaxed);
    let ordered = t.check_order();
    let bias = slot.bias.load(Ordering::Relaxed);
    let counters = bias.wrapping_add(h.counters_addr);
    let own = slots()
        .position(|s| std::ptr::eq(s, slot))
        .and_then(|i| live::MODULES.get(i))
        .map_or(0, |m| m.base.load(Ordering::Acquire));
    PROC.with(|proc| {
        let Some(f) = proc.as_mut() else { return };
        count_pending(f.header, h.site_count, false);
        if ordered.is_err() || own == 0 {
            return;
        }
        match f.add_module(t.bytes(), bias, counters, h.counters_size, Some(own)) {
            Ok((idx, _)) => slot.file_index.store(idx, Ordering::Relaxed),
            Err(e) => {
                log_unplaced(f, e);
                PLACE_ERROR.with(|p| *p = Some(e));
            }
        }
    });
    if let Err(e) = ordered {
        log_unreadable(e);
        slot.state.store(DEAD, Ordering::Release);
        forget_rows();
        return false;
    }
    own != 0
}

/// Says that a module's site table is unreadable: it is not profiled.
fn log_unreadable(e: layout::TableError) {
    let mut m = sys::Buf::<128>::new();
    m.str("a patched module's site table is unreadable: ").str(e.as_str()).str("; it is not profiled");
    sys::log(m.bytes());
}

/// Says why a module could not join the process file: it counts into
/// private memory, which no report reads.
fn log_unplaced(f: &ProcFile, e: &str) {
    let mut m = sys::Buf::<512>::new();
    m.push(f.path()).str(": ").str(e).str("; a patched module counts, but no report can read its figures");
    sys::log(m.bytes());
}

/// Where a thread that trapped on a site's INT3 goes: its trampoline.
pub fn trampoline_for(addr: u64) -> Option<u64> {
    slots()
        .filter(|s| s.contains(addr))
        // SAFETY: an active slot's module is mapped (a module unloading
        // waits for no trap: its code cannot be running).
        .find_map(|s| unsafe { s.module() }.and_then(|m| patching::trampoline_in(&m, addr)))
}

/// Where the call of a hook's site would have returned to (the site's
/// address plus its length), when `ra` is a return address inside that
/// site's trampoline: a hook's trampoline calls its target with the stack
/// pointer the site had (a trampolines test checks it), so the caller's
/// frame is unwound from there as if the site had made the call. Called
/// by callers capture when `ra` has no unwind row.
pub fn return_through_hook(ra: u64) -> Option<u64> {
    let within = |s: &Slot| ra > s.text_lo.load(Ordering::Relaxed) && ra < s.text_hi.load(Ordering::Relaxed);
    slots().filter(|s| s.is_active() && within(s)).find_map(|s| {
        // SAFETY: an active slot's module is mapped.
        let t = unsafe { s.table() }?;
        let bias = s.bias.load(Ordering::Relaxed);
        let site = t.get_site(last_trampoline_below(&t, ra.wrapping_sub(bias))?)?;
        (site.flags & layout::site_flags::HOOK != 0)
            .then(|| bias.wrapping_add(site.addr).wrapping_add(u64::from(site.len)))
    })
}

/// The index of the site whose trampoline starts last before `addr` (a
/// link-time address): trampolines follow one another in site order, and
/// sites without one (0) are skipped.
fn last_trampoline_below(t: &Table, addr: u64) -> Option<usize> {
    let n = t.header.site_count as usize;
    let (mut lo, mut hi, mut best) = (0usize, n, None);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        // The first site at or after `mid` (before `hi`) with a trampoline.
        let Some((k, at)) =
            (mid..hi).find_map(|k| t.get_site(k).filter(|s| s.trampoline != 0).map(|s| (k, s.trampoline)))
        else {
            hi = mid;
            continue;
        };
        if at < addr {
            best = Some(k);
            lo = k + 1;
        } else {
            hi = mid;
        }
    }
    best
}

/// Whether `rip` is a charge check's read of a hook's word
/// ([`CHECK_LOAD`](alloctramp_trampolines::layout::CHECK_LOAD)) in the
/// trampolines of an active module. Called from the fault handler.
pub fn is_check_load(rip: u64) -> bool {
    use alloctramp_trampolines::layout::CHECK_LOAD;
    let end = rip.wrapping_add(CHECK_LOAD.len() as u64);
    slots().any(|s| {
        s.is_active()
            && rip >= s.text_lo.load(Ordering::Relaxed)
            && end <= s.text_hi.load(Ordering::Relaxed)
            && end > rip
            // SAFETY: the faulting instruction, in the trampolines of an
            // active module: mapped (the thread was executing it).
            && unsafe { (rip as *const [u8; 4]).read_unaligned() } == CHECK_LOAD
    })
}

fn set_on(slot: &Slot, sites: Sites) {
    slot.sites.store(sites as u8, Ordering::Release);
    let idx = slot.file_index.load(Ordering::Relaxed);
    if idx != u32::MAX {
        header_set_module_on(idx, sites == Sites::On);
    }
}

fn header_set_module_on(idx: u32, on: bool) {
    if let Some(s) = crate::procfile::header().and_then(|h| h.modules.get(idx as usize)) {
        s.on.store(u32::from(on), Ordering::Release);
    }
}

/// Whether the module of this site table is registered (and loaded).
pub fn is_registered(table: *const u8) -> bool {
    slots().any(|s| s.is_active() && s.table.load(Ordering::Relaxed) == table as usize)
}

/// Unregisters a module about to be unloaded, by its site table's run-time
/// address (compared, never read): waits until no switch holds it, then
/// forgets it (its figures stay in the process file).
pub fn unregister(table: *const u8) {
    for (i, slot) in slots().enumerate() {
        if slot.is_active() && slot.table.load(Ordering::Relaxed) == table as usize {
            while slot.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
                std::hint::spin_loop();
            }
            slot.state.store(DEAD, Ordering::Release);
            crate::fault::forget_table(table as u64);
            foreign::close(i);
            forget_rows();
            let idx = slot.file_index.load(Ordering::Relaxed);
            let sites = slot.site_count.load(Ordering::Relaxed);
            PROC.with(|p| {
                // (Under the lock: a deferred file counts the slots still
                // pending as it is made, `make_deferred_file`.)
                let pending = slot.pending.swap(false, Ordering::Relaxed);
                if let (Some(f), true) = (p.as_ref(), idx != u32::MAX) {
                    f.set_unloaded(idx);
                }
                if let (Some(f), true) = (p.as_ref(), pending) {
                    count_pending(f.header, sites, false);
                }
            });
        }
    }
}

/// Before the first switch on with live tracking: reserves the shadow map
/// and the freed view (a process never profiled reserves nothing; each
/// module's sites turn live tracking on as they first switch, see
/// [`switch`]). Without the reservation (an address-space limit) the
/// process counts only, and the error says why (for the caller to
/// report). Runs where requests are carried out: on the watcher thread,
/// or at start-up for a process switched by signal or started with
/// profiling on.
pub fn prepare_live() -> Result<(), &'static str> {
    if LIVE.load(Ordering::Acquire) && !live::reserved() {
        live::reserve().inspect_err(|_| LIVE.store(false, Ordering::Release))?;
    }
    Ok(())
}

/// Turns live tracking on in a held slot's module, once: before its sites
/// first switch to a live-tracking entry.
///
/// # Safety
/// The slot must be held busy by the caller, with its sites off.
unsafe fn enable_live(slot: &Slot) {
    // SAFETY: a held slot's table is mapped (caller).
    let Some(t) = (unsafe { slot.table() }) else { return };
    // SAFETY: as above: the module is loaded.
    let control = unsafe { control_block(slot.bias.load(Ordering::Relaxed), &t.header) };
    if control.track_alloc.load(Ordering::Relaxed) != 0 {
        return;
    }
    let Some(i) = slots().position(|s| std::ptr::eq(s, slot)) else { return };
    let idx = slot.file_index.load(Ordering::Relaxed);
    PROC.with(|proc| {
        let file = proc.as_mut().filter(|_| idx != u32::MAX).map(|f| (f, idx));
        // SAFETY: the module's control block; its sites are off (caller).
        unsafe { live::enable_in(control, i as u64, file) };
    });
}

/// What an event trace says of each site: every site of the registered
/// modules with ids (see `live::MODULES`), and whether that is all of them
/// (false: a module with ids was busy or not published yet; ask again).
pub fn site_infos() -> (Vec<alloctramp_trampolines::trace::SiteInfo>, bool) {
    let mut out = Vec::new();
    let published = slots().count();
    let mut complete = live::MODULES.iter().skip(published).all(|m| m.first_id.load(Ordering::Acquire) == 0);
    for (i, slot) in slots().enumerate() {
        let first = live::MODULES.get(i).map_or(0, |m| m.first_id.load(Ordering::Acquire));
        // An unloaded module (DEAD) was described while it was loaded, or
        // cannot be now.
        if first == 0 || slot.state.load(Ordering::Acquire) == DEAD {
            continue;
        }
        if !slot.try_hold() {
            complete = false;
            continue;
        }
        // SAFETY: a held slot's table is mapped.
        let table = unsafe { slot.table() };
        complete &= table.is_some();
        if let Some(t) = table {
            out.extend(alloctramp_trampolines::trace::site_infos(&t, first, slot.bias.load(Ordering::Relaxed)));
        }
        slot.release();
    }
    (out, complete)
}

/// Switches the trampolines of every module with live tracking to
/// tracing or back (see `live::set_tracing`). Modules that turn live
/// tracking on later follow the trace's state (`live::enable_in`).
pub fn set_tracing_all(on: bool) {
    for (i, slot) in slots().enumerate() {
        if !slot.try_hold() {
            continue;
        }
        // SAFETY: a held slot's table is mapped.
        if let Some(t) = unsafe { slot.table() } {
            // SAFETY: as above: the module is loaded.
            let control = unsafe { control_block(slot.bias.load(Ordering::Relaxed), &t.header) };
            // SAFETY: the module's control block (a module without live
            // tracking is left alone).
            unsafe { live::set_tracing(control, i, on) };
        }
        slot.release();
    }
}

/// Switches every module; modules busy elsewhere converge by themselves.
/// On an error, every module goes back to the state it had before and the
/// first error is returned.
pub fn switch_all(to: Sites) -> Result<(), &'static str> {
    let before = WANT.swap(to as u8, Ordering::AcqRel);
    live::DRAINING.store(to == Sites::Frees, Ordering::Release);
    let mut result = Ok(());
    for slot in slots() {
        if !slot.try_hold() {
            continue;
        }
        if slot.state() != to {
            // SAFETY: the slot is held.
            match unsafe { switch(slot, to) } {
                Ok(()) => set_on(slot, to),
                Err(e) => {
                    if result.is_ok() {
                        result = Err(e);
                    }
                }
            }
        }
        slot.release();
    }
    if result.is_err() {
        let back = Sites::from_u8(before);
        WANT.store(before, Ordering::Release);
        live::DRAINING.store(back == Sites::Frees, Ordering::Release);
        for slot in slots() {
            if slot.try_hold() {
                if slot.state() != back {
                    // SAFETY: the slot is held.
                    if unsafe { switch(slot, back) }.is_ok() {
                        set_on(slot, back);
                    }
                }
                slot.release();
            }
        }
    }
    result
}

/// After fork, in the child: fresh process file, every module's counters
/// remapped onto it (starting from zero).
/// A child that cannot have a file of its own counts privately, and a
/// module that cannot be given new counters is switched off: nothing the
/// child does reaches its parent's file.
pub fn reopen_after_fork(make: impl FnOnce() -> Option<ProcFile>) {
    PROC.force_unlock();
    live::after_fork_in_child();
    let mut f = make();
    if f.is_none() {
        crate::procfile::clear_header();
    }
    for (i, slot) in slots().enumerate() {
        if !slot.is_active() {
            continue;
        }
        // SAFETY: active slots' tables are mapped.
        let Some(t) = (unsafe { slot.table() }) else { continue };
        if slot.pending.load(Ordering::Relaxed) {
            // Its private counters, copied with the process, never counted:
            // it joins the child's file as it would have joined the parent's.
            if let Some(f) = &f {
                count_pending(f.header, t.header.site_count, true);
            }
            continue;
        }
        let bias = slot.bias.load(Ordering::Relaxed);
        let counters = bias.wrapping_add(t.header.counters_addr);
        let size = t.header.counters_size;
        let placed = match f.as_mut().map(|f| f.add_module(t.bytes(), bias, counters, size, None).map_err(|e| (e, &*f)))
        {
            Some(Ok(r)) => Some(r),
            other => {
                if let Some(Err((e, f))) = other {
                    log_unplaced(f, e);
                }
                private_counters(size).map(|own| (u32::MAX, own))
            }
        };
        // SAFETY: an active slot's module is loaded (it leaves the slots
        // before its fini stub returns); only this thread runs.
        let control = unsafe { control_block(bias, &t.header) };
        let Some((idx, own)) = placed else {
            sys::log(b"cannot map a patched module's counters in a child process; it is not profiled there");
            if slot.try_hold() {
                // SAFETY: the slot is held.
                if unsafe { switch(slot, Sites::Off) }.is_ok() {
                    set_on(slot, Sites::Off);
                }
                slot.state.store(DEAD, Ordering::Release);
                forget_rows();
                slot.release();
            }
            continue;
        };
        control.counters.store(own, Ordering::Relaxed);
        // SAFETY: the child's only thread, after every record naming a cell
        // of the parent's view was made stale (after_fork_in_child above).
        unsafe {
            live::replace_module_view(
                control,
                i,
                own,
                size,
                counters,
                f.as_mut().filter(|_| idx != u32::MAX).map(|f| (f, idx)),
            )
        };
        slot.file_index.store(idx, Ordering::Relaxed);
        if let Some(f) = &f
            && idx != u32::MAX
        {
            f.set_module_on(idx, slot.state() == Sites::On);
        }
    }
    if let Some(f) = &f {
        crate::procfile::set_header(f.header);
    }
    PROC.with(|p| {
        if let Some(old) = p.take() {
            // SAFETY: the parent's header view; the header pointer now
            // names the child's file or nothing, and only this thread runs.
            unsafe { old.unmap() };
        }
        *p = f;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_rows_round_trip() {
        let pc = 0x7f12_3456_789a;
        let row = |kind, cfa, saved, rbp| UnwindRow {
            addr: 0,
            cfa_offset: cfa,
            rbp_offset: rbp,
            kind,
            rbp_saved: saved,
            reserved: [0; 2],
        };
        for r in [
            row(layout::unwind::RSP, 8, 0, 0),
            row(layout::unwind::RSP, 32_760, 1, -16),
            row(layout::unwind::RBP, 16, 1, -16),
            row(layout::unwind::RBP, -32_768, 1, -32_768),
            row(layout::unwind::RSP, 4_096, 1, 32_760),
        ] {
            let v = pack_row(pc, Some(r)).unwrap();
            assert_eq!(v >> CACHE_TAG_SHIFT, pc >> CACHE_BITS);
            assert_eq!(unpack_step(v), Step::of(r), "{r:?}");
            let step = unpack_step(v).unwrap();
            assert_eq!(Step::unpack(step.pack().unwrap()), Some(step));
            assert_eq!(u64::from(step.pack().unwrap()), v & 0x3fff_ffff);
            assert_eq!((step.cfa, step.from_rbp), (i64::from(r.cfa_offset), r.kind == layout::unwind::RBP));
            if r.rbp_saved != 0 {
                assert_eq!(step.rbp, i64::from(r.rbp_offset));
            }
        }
        // Stops, and "no row", are cached as stops.
        assert_eq!(unpack_step(pack_row(pc, None).unwrap()), None);
        assert_eq!(unpack_step(pack_row(pc, Some(row(layout::unwind::STOP, 0, 0, 0))).unwrap()), None);
        assert_eq!(unpack_step(0), None);
        // What does not fit is not cached.
        assert_eq!(pack_row(pc, Some(row(layout::unwind::RSP, 12, 0, 0))), None);
        assert_eq!(pack_row(pc, Some(row(layout::unwind::RBP, 16, 1, -12))), None);
        assert_eq!(pack_row(1 << 47, None), None);
        assert_eq!(pack_row(0x1fff, None), None);
        // An empty entry answers only the first 8 KiB.
        assert_eq!(0u64 >> CACHE_TAG_SHIFT, 0x1fffu64 >> CACHE_BITS);
        assert_ne!(0u64 >> CACHE_TAG_SHIFT, 0x2000u64 >> CACHE_BITS);
    }
}
