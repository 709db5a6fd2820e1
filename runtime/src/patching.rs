//! Rewriting call sites in a running process.
//!
//! The protocol is the kernel's (text_poke_bp): for every site of a batch,
//! write INT3 over its first byte; serialize every thread; write the other
//! bytes; serialize; write the new first byte; serialize. A thread that
//! reaches a site while it holds INT3 traps, and the SIGTRAP handler sends
//! it to the site's trampoline, which does what either the old or the new
//! instruction would (the trampoline calls the same target). Only the first
//! five bytes of a site ever change, and they are one instruction in both
//! states, so a thread is never left inside a half-written instruction.
//!
//! Code pages are made writable (and stay executable, for the other
//! threads) only during a switch, then get back exactly the protection each
//! mapping had (read from `/proc/self/maps`): a segment that is writable and
//! executable, or a page shared with a data segment, stays as it was.

use crate::state::{LIVE, Sites, records_chains};
use crate::sys;
use alloctramp_trampolines::entry::Kind;
use alloctramp_trampolines::layout::{self, Image, PAGE, Table};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};

const INT3: u8 = 0xcc;

/// A signal handler the runtime installs once, just before it is first
/// needed, given at start-up by the layer that owns signal handling. It is
/// installed before the first switch that needs it, so a process that never
/// switches has no handler of ours (a program that looks at its inherited
/// dispositions, as gdb does, sees its own).
pub struct Installer {
    install: sys::Hook,
    /// 0: not installed, 1: being installed, 2: installed.
    state: AtomicU8,
}

impl Installer {
    const fn new() -> Self {
        Installer { install: sys::Hook::new(), state: AtomicU8::new(0) }
    }

    pub fn set(&self, f: fn()) {
        self.install.set(f);
    }

    /// Installs the handler once. A caller that finds another one
    /// installing it does not wait (it may be a signal handler that
    /// interrupted the installer): its switch fails and is retried by the
    /// next request.
    fn ensure(&self) -> Result<(), &'static str> {
        if self.state.load(Ordering::Acquire) == 2 {
            return Ok(());
        }
        if self.state.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.install.call();
            self.state.store(2, Ordering::Release);
        }
        if self.state.load(Ordering::Acquire) == 2 { Ok(()) } else { Err("a signal handler is being installed") }
    }

    /// The handler was removed (it gave the program's disposition back):
    /// the next switch that needs it installs it again.
    pub fn forget(&self) {
        let _ = self.state.compare_exchange(2, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// The SIGTRAP handler that sends a thread trapped on a site's INT3 to its
/// trampoline: before the first switch.
pub static TRAP_HANDLER: Installer = Installer::new();
/// The SIGSEGV and SIGBUS handler that completes a charge check's read of
/// a hook's word on a stack no longer mapped
/// ([`CHECK_LOAD`](layout::CHECK_LOAD)): before the first switch of a
/// module with hooks or sites inside hooked functions.
pub static FAULT_HANDLER: Installer = Installer::new();

/// A switched module is a program whose start-up looks for the default
/// SIGSEGV disposition ([`layout::flags::DEFAULT_SEGV_AT_START`]).
static SEGV_LOOKED_AT: AtomicBool = AtomicBool::new(false);

/// Whether the fault handler must wait: such a program's SIGSEGV
/// disposition is still the default (its start-up has not installed its
/// own handler yet, and must find none of ours when it does).
fn fault_handler_waits(table: &Table) -> bool {
    if table.header.flags & layout::flags::DEFAULT_SEGV_AT_START != 0 {
        SEGV_LOOKED_AT.store(true, Ordering::Release);
    }
    if !SEGV_LOOKED_AT.load(Ordering::Acquire) {
        return false;
    }
    sys::disposition(libc::SIGSEGV).is_some_and(|a| a.sa_sigaction == libc::SIG_DFL)
}

/// The bytes a site should hold: `jmp` to one of its trampoline's entries
/// (the callers entry while call chains are recorded or a fault spec names
/// the site; counting and tracking, or its traced entry during a trace;
/// counting only when live tracking is off; or the drain entry of a free
/// site while draining), or the original bytes.
fn wanted(table: &Table, bias: u64, site: &alloctramp_trampolines::layout::Site, sites: Sites) -> [u8; 5] {
    let free = || table.entry(site.entry as usize).is_some_and(|e| e.kind == Kind::Free.code());
    let entry = match sites {
        Sites::On
            if site.callers != 0
                && (records_chains(bias.wrapping_add(site.addr)) || crate::fault::routes(table, site)) =>
        {
            Some(site.callers)
        }
        Sites::On if LIVE.load(Ordering::Relaxed) => Some(crate::state::live_entry(site.traced)),
        Sites::On => Some(site.count),
        Sites::Frees if free() && site.drain != 0 => Some(site.drain),
        Sites::Frees | Sites::Off => None,
    };
    // The patcher checked that every entry is in reach of the site.
    if let Some(j) = entry.and_then(|e| layout::site_jump(site.addr, site.entry_at(e))) {
        return j;
    }
    let mut b = [0u8; 5];
    b.copy_from_slice(&site.original[..5]);
    b
}

/// The runtime's signal handlers running now that may switch (the control
/// signal's). A switch made in one never maps an image: its stack is the
/// interrupted code's, and the image's checks need a few KiB of it.
static HANDLING: AtomicU32 = AtomicU32::new(0);

/// Marks a signal handler that may switch, while it lives.
pub struct Handling(());

impl Handling {
    pub fn enter() -> Handling {
        HANDLING.fetch_add(1, Ordering::Relaxed);
        Handling(())
    }
}

impl Drop for Handling {
    fn drop(&mut self) {
        HANDLING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The switched image whose jump every site with a trampoline wants
/// ([`Image::site`]), if there is one: switched on, with no trace of every
/// site, no callers capture and no fault spec (the arms of [`wanted`]
/// before live tracking's are then never taken), [`Image::Live`] with live
/// tracking (it gives entry 0) and [`Image::Count`] without (the counting
/// entry).
fn wanted_image(on: Sites) -> Option<Image> {
    let plain = on == Sites::On
        && crate::state::live_entry(1) == 0
        && crate::state::CALLERS.load(Ordering::Relaxed) == 0
        && !crate::fault::any();
    let live = LIVE.load(Ordering::Relaxed);
    plain.then_some(if live { Image::Live } else { Image::Count })
}

/// The mappings of a module's code that a switch made writable, with the
/// protection each had.
struct Unprotected {
    n: usize,
    saved: [(u64, u64, i32); MAX_MAPPINGS],
}

/// More mappings than this in one module's span of sites: the switch is
/// refused (a module's code is one or a few mappings).
const MAX_MAPPINGS: usize = 32;

impl Unprotected {
    /// Makes every page of `[lo, hi)` writable, keeping each mapping's other
    /// permissions. On failure, nothing stays changed.
    fn new(lo: u64, hi: u64) -> Result<Unprotected, &'static str> {
        let (lo, hi) = (lo & !(PAGE - 1), hi.checked_next_multiple_of(PAGE).unwrap_or(!(PAGE - 1)));
        let mut u = Unprotected { n: 0, saved: [(0, 0, 0); MAX_MAPPINGS] };
        let mut too_many = false;
        // The mappings are read in full before any changes them.
        let read = sys::for_each_mapping(|start, end, prot| {
            let (s, e) = (start.max(lo), end.min(hi));
            if start >= hi {
                return false;
            }
            if s < e && prot & libc::PROT_WRITE == 0 {
                let Some(free) = u.saved.get_mut(u.n) else {
                    too_many = true;
                    return false;
                };
                *free = (s, e, prot);
                u.n += 1;
            }
            true
        });
        if !read {
            return Err("cannot read /proc/self/maps");
        }
        if too_many {
            return Err("the module's code spans too many mappings");
        }
        for (i, &(s, e, prot)) in u.saved.iter().take(u.n).enumerate() {
            // SAFETY: pages of the module's own code, mapped while the module
            // is registered; only write permission is added.
            if unsafe { libc::mprotect(s as *mut libc::c_void, (e - s) as usize, prot | libc::PROT_WRITE) } != 0 {
                u.n = i;
                u.restore();
                return Err("the system refused to make code writable (mprotect)");
            }
        }
        Ok(u)
    }

    /// Gives every mapping back the protection it had.
    fn restore(&self) {
        for &(s, e, prot) in self.saved.iter().take(self.n) {
            // SAFETY: as above; the protection the pages had before.
            unsafe { libc::mprotect(s as *mut libc::c_void, (e - s) as usize, prot) };
        }
    }
}

/// What switching needs to know of a loaded module.
pub struct Module<'a> {
    /// Its site table (in the module's mapped, read-only segment).
    pub table: Table<'a>,
    /// Run-time address minus file address.
    pub bias: u64,
    /// Run-time addresses of its first site and past its last.
    pub span: (u64, u64),
}

/// Switches the sites of one module to `on`. Returns an error message
/// when the code could not be made writable (nothing was changed then).
///
/// # Safety
/// The module must stay mapped during the call and no other thread may
/// switch it at the same time (the registry holds its slot).
pub unsafe fn switch_module(m: &Module, on: Sites, barrier: sys::Barrier) -> Result<(), &'static str> {
    let (table, bias) = (&m.table, m.bias);
    let at = |s: &alloctramp_trampolines::layout::Site| bias.wrapping_add(s.addr) as *mut u8;
    let active = |s: &alloctramp_trampolines::layout::Site| s.trampoline != 0 && s.len >= 5;

    // Nothing to do if every site already holds the wanted bytes.
    // SAFETY: sites lie in the module's mapped executable segments, which
    // stay mapped during the call (caller).
    let differs = || table.sites().filter(active).any(|s| unsafe { read5(at(&s)) } != wanted(table, m.bias, &s, on));
    // The only thread (a program switched on at start-up, before it
    // starts any): nothing else runs this code, and with its signals
    // blocked no handler on this thread runs a site half-written, so each
    // site is written once, without the protocol's traps and barriers.
    // Only this thread could start another, and it is busy here.
    let alone = sys::threads() == Some(1);
    // Alone, with every site wanting the jump of one of the module's
    // switched images, the image may replace its code without copying a
    // page (and without the check above, which reads every page the image
    // replaces).
    let image = wanted_image(on).filter(|_| alone && HANDLING.load(Ordering::Relaxed) == 0);
    if image.is_none() && !differs() {
        return Ok(());
    }
    if barrier == sys::Barrier::None && !alone {
        return Err("membarrier is not available: cannot switch safely");
    }
    if !alone {
        TRAP_HANDLER.ensure()?;
    }
    let charges = layout::site_flags::HOOK | layout::site_flags::UNDER_HOOK;
    let waits = fault_handler_waits(table);
    if on != Sites::Off && !waits && table.sites().any(|s| active(&s) && s.flags & charges != 0) {
        FAULT_HANDLER.ensure()?;
    }
    let (lo, hi) = m.span;
    let blocked = alone.then(sys::SignalsBlocked::new);
    debug_assert!(
        image.is_none_or(|i| table.sites().filter(active).all(|s| i.site(&s) == Some(wanted(table, bias, &s, on)))),
        "wanted_image disagrees with wanted"
    );
    let adopted = image.is_some_and(|image| {
        // SAFETY: this thread is alone with its signals blocked (`blocked`);
        // the module stays mapped (caller).
        unsafe { crate::image::adopt(table, bias, m.span, image) }
    });
    if image.is_some() && (adopted || !differs()) {
        return Ok(());
    }
    let unprotected = Unprotected::new(lo, hi)?;
    populate(table.sites().filter(active).map(|s| at(&s) as u64));
    if blocked.is_some() {
        for s in table.sites().filter(active) {
            let (p, w) = (at(&s), wanted(table, m.bias, &s, on));
            // SAFETY: as below; no other code runs in the process.
            if unsafe { read5(p) } != w {
                // SAFETY: as above.
                unsafe { std::ptr::write_volatile(p as *mut [u8; 5], w) };
            }
        }
        // (Returning is a jump: enough for the code this thread wrote.)
        unprotected.restore();
        return Ok(());
    }
    // The three passes of the protocol. SAFETY (every block below): the
    // site's five bytes are mapped (caller) and writable now (`unprotected`
    // covers the module's span of sites); each write stays within them.
    for s in table.sites().filter(active) {
        let p = at(&s);
        // SAFETY: as above.
        if unsafe { read5(p) } != wanted(table, m.bias, &s, on) {
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(p, INT3) };
        }
    }
    sys::serialize(barrier);
    for s in table.sites().filter(active) {
        let p = at(&s);
        // SAFETY: as above.
        if unsafe { std::ptr::read_volatile(p) } == INT3 {
            let w = wanted(table, m.bias, &s, on);
            for (k, &b) in w.iter().enumerate().skip(1) {
                // SAFETY: as above (k < 5).
                unsafe { std::ptr::write_volatile(p.add(k), b) };
            }
        }
    }
    sys::serialize(barrier);
    for s in table.sites().filter(active) {
        let p = at(&s);
        // SAFETY: as above.
        if unsafe { std::ptr::read_volatile(p) } == INT3 {
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(p, wanted(table, m.bias, &s, on)[0]) };
        }
    }
    sys::serialize(barrier);
    unprotected.restore();
    Ok(())
}

/// Breaks copy-on-write of every page a site is on (each site's five
/// bytes may end on the next page), in one system call per run of such
/// pages (`MADV_POPULATE_WRITE`), instead of one fault per page at the
/// first write. A kernel without it (before 5.14) leaves it to the faults.
fn populate(sites: impl Iterator<Item = u64>) {
    let mut run: Option<(u64, u64)> = None;
    let flush = |(s, e): (u64, u64)| {
        // SAFETY: the pages are the module's code, mapped and writable for
        // the duration of the switch (caller); populating them writes nothing.
        unsafe { libc::madvise(s as *mut libc::c_void, (e - s) as usize, libc::MADV_POPULATE_WRITE) };
    };
    for a in sites {
        let (first, end) = (a & !(PAGE - 1), (a + 5).next_multiple_of(PAGE));
        run = match run {
            Some((s, e)) if first <= e => Some((s, e.max(end))),
            Some(r) => {
                flush(r);
                Some((first, end))
            }
            None => Some((first, end)),
        };
    }
    if let Some(r) = run {
        flush(r);
    }
}

/// The five bytes at a site.
///
/// # Safety
/// `p` must point at five mapped bytes.
unsafe fn read5(p: *const u8) -> [u8; 5] {
    // SAFETY: the caller's contract; [u8; 5] has alignment 1.
    unsafe { std::ptr::read_volatile(p as *const [u8; 5]) }
}

/// The trampoline of the site of `m` at run-time address `addr`, if any.
pub fn trampoline_in(m: &Module, addr: u64) -> Option<u64> {
    let (table, bias) = (&m.table, m.bias);
    let want = addr.wrapping_sub(bias);
    let (mut lo, mut hi) = (0usize, table.header.site_count as usize);
    while lo < hi {
        let mid = (lo + hi) / 2;
        let s = table.get_site(mid)?;
        if s.addr == want {
            return (s.trampoline != 0).then(|| bias.wrapping_add(s.trampoline));
        }
        if s.addr < want {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    None
}
