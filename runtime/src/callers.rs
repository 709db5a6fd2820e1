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

use crate::foreign;
use crate::registry::{self, PROC};
use crate::state::{self, LIVE};
use crate::sys;
use alloctramp_trampolines::layout::capture::{Frame, MAX_DEPTH};
use alloctramp_trampolines::layout::{self, ControlBlock, ENTRY_SIZE, Entry, Header, SITE_SIZE, Site, site_flags};
use alloctramp_trampolines::pod;
use alloctramp_trampolines::process::{CALLERS_SLOTS, ChainSlot, MAX_MAPS, MapEntry, ProcHeader};
use std::mem::offset_of;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

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
/// On the allocation path of every captured call, so written for few
/// instructions: the site's continuation first; then, if the call comes
/// from the chain last recorded at the site, its memo names the chain's
/// slot after reading one word per frame ([`Memo::replay`]); otherwise
/// [`capture_walk`] unwinds and looks the chain up.
///
/// # Safety
/// `frame` is the stub's frame on the calling thread's stack, `control`
/// and `table` the control block and site table of the module whose
/// trampoline the thread came from (mapped: its code is running), and
/// `frame.index` a site index of that table.
pub unsafe extern "C" fn capture(frame: *mut Frame, control: *const ControlBlock, rbp: u64, table: *const u8) {
    // SAFETY: the stub's frame (caller).
    let f = unsafe { &mut *frame };
    let index = f.index;
    let t = table as u64;
    // SAFETY: forwarded from the caller.
    if crate::fault::any() && unsafe { inject(f, control, t, index) } {
        return;
    }
    // Only the fields needed are read. SAFETY: the header's fields and
    // those of site `index` lie within the module's site table (checked at
    // registration; caller).
    let (bias, site) = unsafe {
        let bias = t.wrapping_sub(read::<u64>(t + offset_of!(Header, table_addr) as u64));
        let sites = u64::from(read::<u32>(t + offset_of!(Header, sites_offset) as u64));
        (bias, t.wrapping_add(sites).wrapping_add(index.wrapping_mul(SITE_SIZE as u64)))
    };
    // Before anything else: where the stub goes back to. SAFETY: as above.
    let (trampoline, count, flags, traced) = unsafe {
        (
            read::<u64>(site + offset_of!(Site, trampoline) as u64),
            read::<u16>(site + offset_of!(Site, count) as u64),
            read::<u8>(site + offset_of!(Site, flags) as u64),
            read::<u16>(site + offset_of!(Site, traced) as u64),
        )
    };
    let special = flags & (site_flags::HOOK | site_flags::UNDER_HOOK | site_flags::DEPTH_CHECK);
    if special != 0 {
        // SAFETY: forwarded.
        return unsafe { capture_special(f, rbp, site, bias.wrapping_add(trampoline), special, t, index) };
    }
    let entry = if LIVE.load(Ordering::Relaxed) { crate::state::live_entry(traced) } else { count };
    f.index = bias.wrapping_add(trampoline).wrapping_add(u64::from(entry));
    // SAFETY: forwarded.
    unsafe { record_chain::<false>(f, rbp, site, t, index) }
}

/// Fails the call if a fault spec says so: the frame then holds what the
/// call returns and where it goes instead of the trampoline (the site's
/// return address, or for a tail call a `ret`), and the call counts as
/// injected. A throwing `operator new` instead calls its target with a
/// size it must refuse, so that the C++ runtime throws `std::bad_alloc`
/// from the call.
///
/// The call of an allocation wrapper (a hook, or a wrapper the patcher
/// found whose own sites check the depth: `Table::calls_wrapper`) is not
/// failed itself: the first allocation the wrapper
/// makes during the call is, so that the wrapper's own handling of a
/// failure runs (git's `xmalloc` dies with its message, redis' `zmalloc`
/// calls its out-of-memory handler). The thread's `FAIL_*` words say
/// which call that is: for a hook, its charge names the call exactly;
/// otherwise the first allocation inside a wrapper, below the site's stack
/// pointer, while the wrapper depth is at least the call's.
///
/// # Safety
/// As for [`capture`].
#[cold]
#[inline(never)]
unsafe fn inject(f: &mut Frame, control: *const ControlBlock, t: u64, index: u64) -> bool {
    use crate::tls;
    let sp = f as *const Frame as u64 + size_of::<Frame>() as u64;
    // SAFETY: the site's record lies within its table (caller).
    let flags = unsafe {
        let sites = u64::from(read::<u32>(t + offset_of!(Header, sites_offset) as u64));
        read::<u8>(
            t.wrapping_add(sites).wrapping_add(index.wrapping_mul(SITE_SIZE as u64)) + offset_of!(Site, flags) as u64,
        )
    };
    let fail_sp = tls::get(tls::FAIL_SP);
    if fail_sp != 0 && flags & (site_flags::UNDER_HOOK | site_flags::DEPTH_CHECK) != 0 {
        let depth = tls::get(tls::FAIL_DEPTH);
        let inside = match depth {
            0 => {
                tls::in_hook_call(sp)
                    && tls::get(tls::CHARGE_SP) == fail_sp
                    && tls::get(tls::CHARGE) == tls::get(tls::FAIL_CELL)
            }
            d => sp < fail_sp && tls::get(tls::DEPTH) >= d,
        };
        if inside {
            tls::set(tls::FAIL_SP, 0);
            // SAFETY: forwarded from the caller.
            return unsafe { fail(f, t, index, tls::get(tls::FAIL_CELL)) };
        }
        if sp >= fail_sp {
            tls::set(tls::FAIL_SP, 0);
        }
    }
    let wrapper = flags & (site_flags::HOOK | site_flags::DEPTH_BUMP) != 0
        && registry::table_at(t).and_then(|table| Some(table.calls_wrapper(&table.get_site(index as usize)?)))
            != Some(false);
    if !crate::fault::decide(t, index, || registry::table_at(t)) {
        if wrapper && tls::get(tls::FAIL_SP) == sp {
            tls::set(tls::FAIL_SP, 0);
        }
        return false;
    }
    // SAFETY: the module's control block (caller), `index` its site.
    let cell = unsafe { crate::live::cell_address(index, control as *const u8) };
    if wrapper {
        let depth = if flags & site_flags::HOOK != 0 { 0 } else { tls::get(tls::DEPTH).wrapping_add(1) };
        tls::set(tls::FAIL_DEPTH, depth);
        tls::set(tls::FAIL_CELL, cell);
        tls::set(tls::FAIL_SP, sp);
        return false;
    }
    // SAFETY: forwarded from the caller.
    unsafe { fail(f, t, index, cell) }
}

/// Fails the call of site `index` of the table at `t` (see [`inject`]),
/// counting it in `cell`.
///
/// # Safety
/// As for [`capture`].
unsafe fn fail(f: &mut Frame, t: u64, index: u64, cell: u64) -> bool {
    use alloctramp_trampolines::entry::{Returns, Size};
    let Some(table) = registry::table_at(t) else { return false };
    let Some(site) = table.get_site(index as usize) else { return false };
    let Some(form) = layout::SiteForm::from_code(site.form) else { return false };
    let entry = table.entry(usize::from(site.entry));
    let name = entry.and_then(|e| table.string(e.name)).unwrap_or_default();
    let sig = entry.and_then(|e| layout::decode_sig(alloctramp_trampolines::entry::Kind::Alloc, e.sig));
    let wrapper = entry.is_some_and(|e| e.flags & layout::entry_flags::WRAPPER != 0);
    let bias = t.wrapping_sub(table.header.table_addr);
    let at = bias.wrapping_add(site.addr);
    let next = at.wrapping_add(u64::from(site.len));
    // A wrapper must fail as its allocation failing makes it (it may die
    // with its message, or return NULL): it is called with a size no
    // allocator grants, 2^63 (no header a wrapper adds, nor an alignment
    // it rounds up to, wraps it around, as SIZE_MAX would); so is a
    // throwing operator new (or mimalloc's and tcmalloc's `new`), which
    // throws.
    let refused = if wrapper || alloctramp_trampolines::entry::throws(name) {
        let set = |f: &mut Frame, i: u8, v: u64| {
            let r = match i {
                0 => &mut f.rdi,
                1 => &mut f.rsi,
                2 => &mut f.rdx,
                3 => &mut f.rcx,
                4 => &mut f.r8,
                5 => &mut f.r9,
                _ => return false,
            };
            *r = v;
            true
        };
        let ok = match sig.map(|s| s.size) {
            Some(Size::Arg(i)) => set(f, i, 1 << 63),
            Some(Size::Product(a, b)) => set(f, a, 1) && set(f, b, 1 << 63),
            // A wrapper whose size no argument holds (strdup's) cannot be
            // made to fail: the call goes on.
            _ => false,
        };
        if !ok {
            return false;
        }
        true
    } else {
        false
    };
    if refused {
        // The operand is the instruction's last four bytes: a rel32 from
        // the next instruction, or the displacement of its GOT slot.
        let operand = site.original.get(usize::from(site.len).wrapping_sub(4)..usize::from(site.len));
        let Some(d) = operand.and_then(|d| <[u8; 4]>::try_from(d).ok()) else { return false };
        let d = i32::from_le_bytes(d) as i64 as u64;
        let target = if form.through_got() {
            // SAFETY: the GOT slot the site's instruction reads, in the
            // module's mapped data (the dynamic linker filled it).
            unsafe { std::ptr::read_volatile(next.wrapping_add(d) as *const u64) }
        } else {
            next.wrapping_add(d)
        };
        // Called as if from the site, past the trampoline (which would
        // count the refused size): a wrapper calls an allocator, which
        // may clobber r10 and r11, so its callers keep nothing there.
        if form.is_tail() {
            f.index = target;
        } else {
            (f.r10, f.r11, f.index) = (target, next, crate::fault::call_thunk());
        }
    } else {
        if let Some(Returns::OutArg(_)) = sig.map(|s| s.result) {
            f.rax = libc::ENOMEM as u64;
        } else {
            f.rax = 0;
            // SAFETY: the calling thread's errno.
            unsafe { *libc::__errno_location() = libc::ENOMEM };
        }
        f.index = if form.is_tail() { crate::fault::return_thunk() } else { next };
    }
    crate::live::count_injected_at(cell);
    true
}

/// [`capture`] for a hook, a site under a hook or one inside a charged
/// wrapper (`special`: its flags), out of the common path.
///
/// # Safety
/// As for [`capture`]; `site` is the site's record, `trampoline` its
/// trampoline's run-time address.
#[cold]
#[inline(never)]
unsafe fn capture_special(f: &mut Frame, rbp: u64, site: u64, trampoline: u64, special: u8, t: u64, index: u64) {
    // A hook comes back past its start's clearing of the chain recorded
    // here. SAFETY: the site's fields lie within its table (caller).
    let (count, drain) = unsafe {
        (read::<u16>(site + offset_of!(Site, count) as u64), read::<u16>(site + offset_of!(Site, drain) as u64))
    };
    let entry = if special & site_flags::HOOK != 0 {
        drain
    } else if LIVE.load(Ordering::Relaxed) {
        0
    } else {
        count
    };
    f.index = trampoline.wrapping_add(u64::from(entry));
    let sp = f as *const Frame as u64 + size_of::<Frame>() as u64;
    if state::CALLERS.load(Ordering::Acquire) == 0 || !records_here(special, sp) {
        return;
    }
    // SAFETY: forwarded.
    unsafe {
        if special & site_flags::HOOK != 0 {
            record_chain::<true>(f, rbp, site, t, index)
        } else {
            record_chain::<false>(f, rbp, site, t, index)
        }
    }
}

/// Records the call's chain at `site` (of table `t`), from the memo or by
/// unwinding: one call and its bytes, or for a `HOOK` the chain the sites
/// charged to it add to.
///
/// # Safety
/// As for [`capture`], `f` the stub's frame and `index` the site's.
#[inline(always)]
unsafe fn record_chain<const HOOK: bool>(f: &Frame, rbp: u64, site: u64, t: u64, index: u64) {
    // The epoch first: switching the depth raises it after the store.
    let epoch = epoch();
    if state::CALLERS.load(Ordering::Acquire) == 0 {
        return;
    }
    let sp = f as *const Frame as u64 + size_of::<Frame>() as u64;
    if let Some((chain, rule)) = memo_of(index).replay(site, sp, rbp, epoch) {
        if HOOK {
            charge_chain(chain, sp);
        } else {
            add(chain, 1, size_of_call(rule, f));
        }
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe { capture_walk(f, rbp, t, index) };
}

/// Whether a hook, a site under a hook or a site inside a charged wrapper
/// (`special`, its site flags) records this call's chain: not when a
/// caller's site counts the wrapper's call (the wrapper depth is raised),
/// nor inside a hook's call (a site under a hook counts into the hook's
/// cell and chain; a hook only makes its call). A hook that takes the
/// charge has no chain until one is recorded.
#[cold]
#[inline(never)]
fn records_here(special: u8, sp: u64) -> bool {
    if special & site_flags::DEPTH_CHECK != 0 && crate::tls::get(crate::tls::DEPTH) != 0 {
        return false;
    }
    if special & (site_flags::HOOK | site_flags::UNDER_HOOK) != 0 && crate::tls::in_hook_call(sp) {
        return false;
    }
    if special & site_flags::HOOK != 0 {
        crate::tls::set(crate::tls::CHAIN_SP, 0);
    }
    true
}

/// The chain of a call its site's memo did not know: unwound with the
/// rows, recorded, and remembered in the memo when it can be replayed.
/// What [`capture`] found is found again here rather than passed, which
/// keeps [`capture`]'s registers for its own path.
///
/// # Safety
/// As for [`capture`], with `t` the table and `index` the site's index.
#[inline(never)]
unsafe fn capture_walk(f: &Frame, rbp: u64, t: u64, index: u64) {
    // SAFETY: as in `capture`.
    let (bias, site) = unsafe {
        let bias = t.wrapping_sub(read::<u64>(t + offset_of!(Header, table_addr) as u64));
        let sites = u64::from(read::<u32>(t + offset_of!(Header, sites_offset) as u64));
        (bias, t.wrapping_add(sites).wrapping_add(index.wrapping_mul(SITE_SIZE as u64)))
    };
    let epoch = epoch();
    let depth = (state::CALLERS.load(Ordering::Acquire) as usize).min(MAX_DEPTH);
    let sp = f as *const Frame as u64 + size_of::<Frame>() as u64;
    let region = REGION.load(Ordering::Acquire);
    if region == 0 || depth == 0 {
        return;
    }
    // SAFETY: the module's control block, mapped with its code (caller).
    let slot = unsafe {
        let control = bias.wrapping_add(read::<u64>(t + offset_of!(Header, control_addr) as u64));
        pod::at::<ControlBlock>(control as usize).module_id.load(Ordering::Relaxed)
    };
    let Some(module) = registry::file_index_of(slot, t as usize) else { return };
    // SAFETY: the site's fields, its entry (the index names one of the
    // table's entries) and the entry's name (one of the table's strings)
    // lie within the table (caller).
    let (addr, e, name) = unsafe {
        let addr: u64 = read(site + offset_of!(Site, addr) as u64);
        let entries = u64::from(read::<u32>(t + offset_of!(Header, entries_offset) as u64));
        let entry_index = u64::from(read::<u16>(site + offset_of!(Site, entry) as u64));
        let e: Entry = read(t.wrapping_add(entries).wrapping_add(entry_index.wrapping_mul(ENTRY_SIZE as u64)));
        let strings = u64::from(read::<u32>(t + offset_of!(Header, strings_offset) as u64));
        (addr, e, t.wrapping_add(strings).wrapping_add(u64::from(e.name)))
    };
    // strndup(s, n) copies at most n bytes (the only default entry with a
    // length limit after the string).
    let limited = b"strndup\0".iter().enumerate().all(|(i, &c)| {
        // SAFETY: a NUL-terminated string of the table; the comparison
        // stops at its first differing byte, at the NUL at the latest.
        unsafe { read::<u8>(name.wrapping_add(i as u64)) == c }
    });
    let rule = size_rule(&e, limited);
    let mut frames = [0u64; MAX_DEPTH];
    let mut at = [0u32; MAX_DEPTH];
    let mut key = seed(module, index as u32);
    let walked = walk(bias.wrapping_add(addr), sp, rbp, depth, &mut frames, &mut at, &mut key);
    // Frames past the chain's end stay 0 and are hashed as such.
    for &ra in frames.get(walked.found..depth).unwrap_or_default() {
        key = mix(key, ra);
    }
    // The chain names the frames as the original program has them; the
    // memo keeps the words on the stack, which a replay compares.
    let on_stack = frames;
    for (k, (f, &n)) in frames.iter_mut().zip(&walked.named).enumerate() {
        if walked.through_hooks & 1 << k != 0 {
            *f = n;
        }
    }
    let (frames, on_stack) = (frames.get(..depth).unwrap_or_default(), on_stack.get(..depth).unwrap_or_default());
    // SAFETY: the site's flags, as for its fields above.
    let hook = unsafe { read::<u8>(site + offset_of!(Site, flags) as u64) } & site_flags::HOOK != 0;
    let figures = if hook { (0, 0) } else { (1, size_of_call(rule, f)) };
    let Some(chain) = record(region, module, index as u32, frames, finish(key), figures) else {
        return;
    };
    if hook {
        charge_chain(chain, sp);
    }
    // A memo is kept where a replay finds what the walk would: see
    // `Memo::replay`.
    let mode = match walked {
        Walked { from_sp: true, end, .. } if sp & 7 == 0 && end != End::Zero => Some(0),
        Walked { from_sp: false, packed: true, end: End::Depth | End::NoRow, .. } => Some(Memo::STEPS),
        _ => None,
    };
    if let Some(mode) = mode {
        let found = on_stack.get(..walked.found).unwrap_or_default();
        memo_of(index).fill(site, rule | mode, epoch, chain, found, &at);
    }
}

/// How an entry's call is sized, in the 9 bits [`size_of_call`] reads:
/// the signature's size rule (`layout::decode_sig`: 0 none, 1 an
/// argument, 2 a product of two, 3 a string's length plus one), the
/// [`Frame`] words (3 bits each) holding its two arguments, and whether
/// the length is limited by the second argument (strndup). A rule this
/// runtime does not know counts no bytes.
fn size_rule(e: &Entry, limited: bool) -> u32 {
    // The argument registers' words in a Frame.
    const WORD: [u32; 6] = [4, 5, 6, 7, 3, 2];
    let [rule, a, b, ..] = e.sig;
    let word = |i: u8| WORD.get(usize::from(i)).copied();
    match (rule, word(a), word(b)) {
        (1, Some(a), _) => 1 | a << 2,
        (2, Some(a), Some(b)) => 2 | a << 2 | b << 5,
        // strdup(s) and strndup(s, n).
        (3, ..) => 3 | 4 << 2 | 5 << 5 | u32::from(limited) << 8,
        _ => 0,
    }
}

/// The size a call asks for, from the saved argument registers and its
/// [`size_rule`].
#[inline(always)]
fn size_of_call(rule: u32, f: &Frame) -> u64 {
    // SAFETY: a Frame is 10 words; the index has 3 bits.
    let arg = |shift: u32| unsafe { (f as *const Frame as *const u64).add(((rule >> shift) & 7) as usize).read() };
    let kind = rule & 3;
    if kind == 1 {
        arg(2)
    } else if kind == 0 {
        0
    } else if kind == 2 {
        arg(2).wrapping_mul(arg(5))
    } else {
        // strdup(s) and strndup(s, n): the copy's length plus one. The
        // string is read as the callee is about to read it.
        let s = arg(2);
        if s == 0 {
            return 0;
        }
        let limit = if rule & 1 << 8 != 0 { arg(5) } else { u64::MAX };
        let mut n = 0u64;
        // SAFETY: a NUL-terminated string the allocator is given.
        while n < limit && unsafe { read::<u8>(s.wrapping_add(n)) } != 0 {
            n += 1;
        }
        n + 1
    }
}

/// What [`walk`] found: how many frames, whether every frame's CFA came
/// from the stack pointer (so that each return address lies at a fixed
/// distance from the site's stack pointer, given the ones below), whether
/// every step fits [`Step::pack`](registry::Step::pack), and why it
/// stopped.
struct Walked {
    found: usize,
    from_sp: bool,
    packed: bool,
    end: End,
    /// Frames (bit k: frame k) whose return address, read in a hook's
    /// trampoline, stands for the site's own (see [`walk`]) ...
    through_hooks: u8,
    /// ... named with the address the site's call would have returned to.
    named: [u64; MAX_DEPTH],
}

impl Walked {
    /// Names the last frame found `ret` (its return address lies in a
    /// hook's trampoline), and mixes that name into the key in place of the
    /// address (`before`: the key before it).
    fn name_last(&mut self, ret: u64, before: u64, key: &mut u64) {
        let k = self.found - 1;
        if let Some(n) = self.named.get_mut(k) {
            *n = ret;
        }
        self.through_hooks |= 1 << k;
        *key = mix(before, ret);
    }
}

/// Why a walk stopped.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// The depth was reached.
    Depth,
    /// No row for the address (or a stop row).
    NoRow,
    /// A CFA, or the saved rbp's slot, out of the frame's bounds.
    Bounds,
    /// A return address of 0.
    Zero,
}

/// Fills `frames` with the return addresses above the site at `pc` (the
/// thread's stack pointer `sp` and rbp there), innermost first (at most
/// `depth`), as read from the stack, and `at` with each one's distance
/// from `sp` while every CFA came from the stack pointer, then with its
/// packed step. A return address inside a hook's trampoline (a callback
/// running during a hook's call) has no row: the walk goes on from the
/// hook's site as if it had made the call, which names the frame
/// ([`Walked::through_hooks`]). Mixes each frame, as named, into `key`.
#[inline(always)]
fn walk(pc: u64, sp: u64, bp: u64, depth: usize, frames: &mut [u64], at: &mut [u32], key: &mut u64) -> Walked {
    let (mut pc, mut cur, mut bp) = (pc, sp, bp);
    let mut w =
        Walked { found: 0, from_sp: true, packed: true, end: End::Depth, through_hooks: 0, named: [0; MAX_DEPTH] };
    let mut steps = [0u32; MAX_DEPTH];
    let mut before = *key;
    for ((slot, dist), packed) in frames.iter_mut().zip(at.iter_mut()).zip(steps.iter_mut()).take(depth) {
        // A return address is after its call: look the call up (the site's
        // own address is that of the call).
        let step = match registry::unwind_step(if w.found == 0 { pc } else { pc.wrapping_sub(1) }) {
            Some(step) => step,
            None => match through_hook(w.found, pc) {
                Some((ret, step)) => {
                    w.name_last(ret, before, key);
                    step
                }
                None => {
                    w.end = End::NoRow;
                    break;
                }
            },
        };
        let cfa = (if step.from_rbp { bp } else { cur }).wrapping_add_signed(step.cfa);
        // (A stop here depends on rbp's value if the CFA came from it.)
        w.from_sp &= !step.from_rbp;
        if cfa.wrapping_sub(cur).wrapping_sub(1) >= MAX_FRAME || cfa & 7 != 0 {
            w.end = End::Bounds;
            break;
        }
        // SAFETY: the row says the return address is at CFA - 8, which
        // lies above `cur` on this thread's stack (checked above).
        let ra: u64 = unsafe { read(cfa - 8) };
        if step.rbp_saved {
            let at = cfa.wrapping_add_signed(step.rbp);
            if at < cur || at + 8 > cfa {
                w.end = End::Bounds;
                break;
            }
            // SAFETY: between `cur` and the CFA (checked above).
            bp = unsafe { read(at) };
        }
        if ra == 0 {
            w.end = End::Zero;
            break;
        }
        *packed = step.pack().unwrap_or_else(|| {
            w.packed = false;
            0
        });
        *slot = ra;
        // Within MAX_DEPTH frames of at most MAX_FRAME bytes each.
        *dist = (cfa - 8 - sp) as u32;
        before = *key;
        *key = mix(*key, ra);
        w.found += 1;
        (pc, cur) = (ra, cfa);
    }
    // The last frame at the depth limit is named as the next lookup would
    // have named it.
    if w.end == End::Depth
        && w.found > 0
        && registry::unwind_step(pc.wrapping_sub(1)).is_none()
        && let Some((ret, _)) = through_hook(w.found, pc)
    {
        w.name_last(ret, before, key);
    }
    if !w.from_sp {
        for (a, &s) in at.iter_mut().zip(&steps) {
            *a = s;
        }
    }
    w
}

/// For frame `found` - 1's return address `ra`, found in no row: the
/// address its hook's site would have returned to, and that address's
/// row, when `ra` lies in a hook's trampoline.
#[cold]
#[inline(never)]
fn through_hook(found: usize, ra: u64) -> Option<(u64, registry::Step)> {
    if found == 0 {
        return None;
    }
    let ret = registry::return_through_hook(ra)?;
    Some((ret, registry::unwind_step(ret.wrapping_sub(1))?))
}

/// The last chain recorded at a site, kept so that the next call from the
/// same chain is recognised by reading its return addresses where they
/// were, without unwinding (see [`Memo::replay`]). Direct-mapped by site;
/// written under a sequence count (odd while written) by whichever thread
/// claims it, read by any.
#[repr(C, align(128))]
struct Memo {
    seq: AtomicU32,
    /// Frames found, and from bit 4 the site's [`size_rule`] with
    /// [`Memo::STEPS`].
    shape: AtomicU32,
    /// The run-time address of the site's record in its table: with the
    /// epoch, it names the site (a module unloaded changes the epoch).
    site: AtomicU64,
    epoch: AtomicU64,
    /// Address of the chain's slot.
    chain: AtomicU64,
    /// Each frame's distance from the site's stack pointer, and its
    /// return address.
    at: [AtomicU32; MAX_DEPTH],
    frames: [AtomicU64; MAX_DEPTH],
}

const MEMOS: usize = 1024;
static MEMO: [Memo; MEMOS] = [const {
    Memo {
        seq: AtomicU32::new(0),
        shape: AtomicU32::new(0),
        site: AtomicU64::new(0),
        epoch: AtomicU64::new(0),
        chain: AtomicU64::new(0),
        at: [const { AtomicU32::new(0) }; MAX_DEPTH],
        frames: [const { AtomicU64::new(0) }; MAX_DEPTH],
    }
}; MEMOS];

/// What a memo was derived from: the unwind rows and the callers region
/// (replacing the region raises the rows' generation too).
#[inline(always)]
fn epoch() -> u64 {
    registry::rows_generation()
}

/// The memo of a site, by its index in its table (sites of other modules
/// with the same low bits share it).
#[inline(always)]
fn memo_of(index: u64) -> &'static Memo {
    // SAFETY: the index is masked to the array's length.
    unsafe { MEMO.get_unchecked(index as usize & (MEMOS - 1)) }
}

impl Memo {
    /// In a memo's rule: the memo holds packed steps, not distances.
    const STEPS: u32 = 1 << 9;

    /// The chain slot (and the size rule) of a call at the site whose
    /// record is at `site`, with stack pointer `sp` and rbp `bp`, if it
    /// comes from this memo's chain.
    ///
    /// The memo was filled by a walk from the same site and at the same
    /// depth (changing the depth changes the epoch), and each row depends
    /// only on the address it is looked up for. Two kinds:
    ///
    /// * Distances: every frame's CFA was the stack pointer plus the row's
    ///   offset, with the stack pointer 8-aligned. The walk from this call
    ///   (with `sp` 8-aligned too) finds the memo's first return address
    ///   at the same distance from `sp` (the site's row), and, if that
    ///   address is the memo's, its second at the same distance as well,
    ///   and so on: each read is where the walk would read (a frame of this
    ///   thread's stack), and a chain that matches every address is the
    ///   memo's, ending where it ended (its stops depend only on the same
    ///   rows and addresses, on `sp` modulo 8, and on no value read, as
    ///   the memo is not kept for a chain that ended at a return address
    ///   of 0).
    /// * Steps (some CFA came from rbp): [`Memo::replay_steps`] takes the
    ///   walk's steps with the walk's checks, without looking rows up.
    ///
    /// Rows that changed change the epoch. Each frame's pair is checked to
    /// be whole (no writer since the sequence count was read) before the
    /// stack is read where it says.
    #[inline(always)]
    fn replay(&self, site: u64, sp: u64, bp: u64, epoch: u64) -> Option<(u64, u32)> {
        let seq = self.seq.load(Ordering::Acquire);
        let shape = self.shape.load(Ordering::Relaxed);
        let chain = self.chain.load(Ordering::Relaxed);
        if seq & 1 != 0 || self.site.load(Ordering::Relaxed) != site || self.epoch.load(Ordering::Relaxed) != epoch {
            return None;
        }
        let found = (shape & 15) as usize;
        let rule = shape >> 4;
        if rule & Memo::STEPS != 0 {
            return self.replay_steps(seq, found, sp, bp).then_some((chain, rule));
        }
        if sp & 7 != 0 {
            return None;
        }
        for (d, ra) in self.at.iter().zip(&self.frames).take(found) {
            let (d, ra) = (d.load(Ordering::Relaxed), ra.load(Ordering::Relaxed));
            std::sync::atomic::fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) != seq {
                return None;
            }
            // SAFETY: where the walk would read the frame's return address
            // (see above): within this thread's stack.
            if unsafe { read::<u64>(sp + u64::from(d)) } != ra {
                return None;
            }
        }
        // `chain` and `shape` were read before the count was checked again
        // (above, or here for a chain of no frames).
        if found == 0 {
            std::sync::atomic::fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) != seq {
                return None;
            }
        }
        Some((chain, rule))
    }

    /// Whether the walk from this call would find the memo's chain: the
    /// memo's steps taken as [`walk`] takes the rows' (same checks, same
    /// reads), each return address compared with the memo's before the
    /// next step is taken (the step of the frame above it is the row of
    /// that address). The memo is kept only for a chain that ended at its
    /// depth or at an address without a row, which the walk would reach
    /// too.
    #[inline(never)]
    fn replay_steps(&self, seq: u32, found: usize, sp: u64, bp: u64) -> bool {
        let (mut cur, mut bp) = (sp, bp);
        for (st, ra) in self.at.iter().zip(&self.frames).take(found) {
            let (st, want) = (st.load(Ordering::Relaxed), ra.load(Ordering::Relaxed));
            std::sync::atomic::fence(Ordering::Acquire);
            if self.seq.load(Ordering::Relaxed) != seq {
                return false;
            }
            let Some(step) = registry::Step::unpack(st) else { return false };
            let cfa = (if step.from_rbp { bp } else { cur }).wrapping_add_signed(step.cfa);
            if cfa.wrapping_sub(cur).wrapping_sub(1) >= MAX_FRAME || cfa & 7 != 0 {
                return false;
            }
            // SAFETY: as in `walk`: the step is the row of this frame's
            // address, and the CFA lies above `cur` on this thread's stack.
            let ra: u64 = unsafe { read(cfa - 8) };
            if step.rbp_saved {
                let at = cfa.wrapping_add_signed(step.rbp);
                if at < cur || at + 8 > cfa {
                    return false;
                }
                // SAFETY: between `cur` and the CFA (checked above).
                bp = unsafe { read(at) };
            }
            if ra != want {
                return false;
            }
            cur = cfa;
        }
        if found == 0 {
            std::sync::atomic::fence(Ordering::Acquire);
            return self.seq.load(Ordering::Relaxed) == seq;
        }
        true
    }

    /// Remembers a chain just recorded into the slot at `chain`, unless
    /// another thread (or this one, interrupted) is writing the memo.
    fn fill(&self, site: u64, rule: u32, epoch: u64, chain: u64, frames: &[u64], at: &[u32]) {
        let seq = self.seq.load(Ordering::Relaxed);
        if seq & 1 != 0 || self.seq.compare_exchange(seq, seq + 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return;
        }
        self.site.store(site, Ordering::Relaxed);
        self.epoch.store(epoch, Ordering::Relaxed);
        self.shape.store(frames.len() as u32 | rule << 4, Ordering::Relaxed);
        self.chain.store(chain, Ordering::Relaxed);
        for ((a, b), (&d, &ra)) in self.at.iter().zip(&self.frames).zip(at.iter().zip(frames)) {
            a.store(d, Ordering::Relaxed);
            b.store(ra, Ordering::Relaxed);
        }
        self.seq.store(seq + 2, Ordering::Release);
    }
}

/// A chain's key: its module and site, then its frames mixed in one by
/// one, then [`finish`]ed.
#[inline(always)]
fn seed(module: u32, site: u32) -> u64 {
    (0xcbf2_9ce4_8422_2325u64 ^ (u64::from(module) << 32 | u64::from(site))).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

#[inline(always)]
fn mix(h: u64, frame: u64) -> u64 {
    (h ^ frame).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29)
}

/// Keys 0 and 1 mark free and claimed slots.
#[inline(always)]
fn finish(h: u64) -> u64 {
    let h = h ^ h >> 31;
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
#[inline(always)]
fn record(region: u64, module: u32, site: u32, frames: &[u64], key: u64, figures: (u64, u64)) -> Option<u64> {
    let (calls, bytes) = figures;
    let slots = SLOTS.load(Ordering::Relaxed);
    let base = region + MAX_MAPS * size_of::<MapEntry>() as u64;
    for probe in 0..PROBES.min(slots) {
        let i = key.wrapping_add(probe) & (slots - 1);
        let at = base + i * size_of::<ChainSlot>() as u64;
        // SAFETY: slot i of the region, mapped while the process runs.
        let s: &ChainSlot = unsafe { pod::at(at as usize) };
        let mut k = s.key.load(Ordering::Acquire);
        if k == key && same(s, module, site, frames) {
            add(at, calls, bytes);
            return Some(at);
        }
        if k == 0 && s.key.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            s.module.store(module, Ordering::Relaxed);
            s.site.store(site, Ordering::Relaxed);
            for (a, &b) in s.frames.iter().zip(frames) {
                a.store(b, Ordering::Relaxed);
            }
            s.calls.fetch_add(calls, Ordering::Relaxed);
            s.bytes.fetch_add(bytes, Ordering::Relaxed);
            s.key.store(key, Ordering::Release);
            return Some(at);
        }
        if k == 0 {
            k = s.key.load(Ordering::Acquire);
            // Claimed and published by another thread meanwhile.
            if k == key && same(s, module, site, frames) {
                add(at, calls, bytes);
                return Some(at);
            }
        }
        // A slot being written (1) is passed over: the chain may then be
        // recorded twice, and a reader adds the two up.
    }
    lost();
    None
}

/// Adds `calls` calls of `bytes` in all to the chain slot at `chain`.
#[inline(always)]
fn add(chain: u64, calls: u64, bytes: u64) {
    // SAFETY: a slot of the region, mapped while the process runs.
    let s: &ChainSlot = unsafe { pod::at(chain as usize) };
    s.calls.fetch_add(calls, Ordering::Relaxed);
    s.bytes.fetch_add(bytes, Ordering::Relaxed);
}

/// A hook whose call chain is `chain` is about to take the thread's
/// charge at stack pointer `sp`: the sites charged to it add their calls
/// and bytes to the chain (the trampolines do, while the hook's stack
/// pointer is `sp`).
fn charge_chain(chain: u64, sp: u64) {
    crate::tls::set(crate::tls::CHAIN, chain);
    crate::tls::set(crate::tls::CHAIN_SP, sp);
}

#[cold]
#[inline(never)]
fn lost() {
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
        h.callers_unloaded.store(0, Ordering::Relaxed);
    }
}

/// Records the process's file-backed executable mappings in the region:
/// those not recorded yet after the ones that are, so that a library
/// unloaded since (`dlclose`) keeps naming the frames recorded in it; a
/// reader takes the last entry that covers an address. Starts over when
/// the region is full.
pub fn snapshot_maps() {
    let region = REGION.load(Ordering::Acquire);
    let Some(h) = crate::procfile::header() else { return };
    if region == 0 {
        return;
    }
    let recorded = u64::from(h.maps_count.load(Ordering::Acquire)).min(MAX_MAPS);
    let n = append_maps(region, recorded).unwrap_or_else(|| append_maps(region, 0).unwrap_or(MAX_MAPS));
    h.maps_count.store(n as u32, Ordering::Release);
}

/// Writes the mappings that the first `kept` entries do not hold after
/// them; the entries then recorded, or `None` if they would not fit.
fn append_maps(region: u64, kept: u64) -> Option<u64> {
    // SAFETY: entry i (< MAX_MAPS) of the region's map array.
    let entry = |i: u64| -> &MapEntry { unsafe { pod::at((region + i * size_of::<MapEntry>() as u64) as usize) } };
    let mut n = kept;
    let mut fits = true;
    sys::for_each_maps_line(|line| {
        let Some(sys::FileMapping { start, end, prot, offset, path, .. }) = sys::parse_maps_file(line) else {
            return true;
        };
        if prot & libc::PROT_EXEC == 0 || path.first() != Some(&b'/') {
            return true;
        }
        if (0..kept).any(|i| same_map(entry(i), start, end, offset, path)) {
            return true;
        }
        if n == MAX_MAPS {
            fits = false;
            return false;
        }
        let m = entry(n);
        m.start.store(start, Ordering::Relaxed);
        m.end.store(end, Ordering::Relaxed);
        m.offset.store(offset, Ordering::Relaxed);
        ProcHeader::set_text(&m.path, path);
        n += 1;
        true
    });
    fits.then_some(n)
}

/// Whether a recorded entry is this mapping (its path as the entry holds
/// it: cut to leave one NUL).
fn same_map(m: &MapEntry, start: u64, end: u64, offset: u64, path: &[u8]) -> bool {
    let path = path.get(..m.path.len() - 1).unwrap_or(path);
    m.start.load(Ordering::Relaxed) == start
        && m.end.load(Ordering::Relaxed) == end
        && m.offset.load(Ordering::Relaxed) == offset
        && m.path.iter().map(|c| c.load(Ordering::Relaxed)).take_while(|&c| c != 0).eq(path.iter().copied())
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
    registry::forget_rows();
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
    // Memos hold chains of the depth they were recorded at.
    registry::forget_rows();
    if let Some(h) = crate::procfile::header() {
        h.callers_depth.store(depth, Ordering::Release);
    }
    if depth != 0 {
        snapshot_maps();
    }
    let switched = registry::refresh_all();
    // After the switch, which opened the rows the modules carry: the file
    // adds what they lack.
    if depth != 0 {
        open_unwind_file();
    }
    switched
}

/// Opens the rows of the process's unwind file, if `alloctramp callers
/// PID on` wrote one (libraries loaded with `dlopen`), and says how many
/// libraries' rows it opened in the process file.
fn open_unwind_file() {
    let mut path = crate::procfile::unwind_path();
    if path.bytes().is_empty() {
        return;
    }
    let opened = match foreign::open_file(path.c_str()) {
        Ok(n) => n,
        Err(e) => {
            sys::log(e.as_bytes());
            0
        }
    };
    if let Some(h) = crate::procfile::header() {
        h.unwind_file_libraries.store(opened, Ordering::Release);
    }
    // Addresses in those libraries were answered "no row" until now.
    registry::forget_rows();
}

/// In a forked child: the parent's region is not the child's; a child
/// that records chains gets a region in its own file.
pub fn after_fork_in_child() {
    REGION.store(0, Ordering::Release);
    registry::forget_rows();
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
