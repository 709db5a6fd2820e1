//! Switching on request: requests taken from the process file's header
//! (written there by `alloctramp enable|disable|reset`), the watcher thread
//! that waits for them on a futex, the optional control signal (with the
//! optional control file a person may write), and the SIGTRAP handler of
//! the patching protocol. Everything reachable from a signal handler here
//! is async-signal-safe: system calls, atomics, fixed buffers (the one
//! wait, for the SIGTRAP handler's installation, is not a wait: a switch
//! that finds it under way fails). Live tracking's shard locks are taken
//! by trampoline call-outs; a program that allocates in a signal handler
//! which interrupted its own allocator call is outside what the C library
//! allows, and may deadlock there as it may in malloc itself.

use crate::live;
use crate::procfile::header;
use crate::registry;
use crate::state::{self, LIVE, Sites};
use crate::sys::{self, Buf, PathCell};
use alloctramp_trampolines::process::{ProcHeader, Request};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Do(Request),
    /// A bare control signal with no request and no control file: toggle.
    Toggle,
}

/// The control file's path, set at start-up (and after fork).
pub static CONTROL_PATH: PathCell = PathCell::new();

static SWITCHING: AtomicBool = AtomicBool::new(false);
static PENDING: AtomicBool = AtomicBool::new(false);
static SIGNALED: AtomicBool = AtomicBool::new(false);
static DRAIN: AtomicBool = AtomicBool::new(false);

/// Carries out the request in the header; after a control signal with none,
/// the control file's (or a toggle). Safe in signal context. A request
/// arriving while another is being carried out is picked up by that one
/// before it finishes.
pub fn handle_request(signaled: bool) {
    if signaled {
        SIGNALED.store(true, Ordering::Release);
    }
    PENDING.store(true, Ordering::Release);
    run_pending();
}

/// A free emptied a shard of the pointer table while draining: if every
/// tracked object is gone, the free sites go off too.
pub fn finish_drain() {
    DRAIN.store(true, Ordering::Release);
    run_pending();
}

fn run_pending() {
    loop {
        if SWITCHING.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return;
        }
        loop {
            if PENDING.swap(false, Ordering::AcqRel) {
                if let Some(cmd) = take_request() {
                    apply(cmd);
                }
            } else if DRAIN.swap(false, Ordering::AcqRel) {
                if state::want() == Sites::Frees {
                    match registry::tracked_objects() {
                        Some(0) => apply(Command::Do(Request::Off)),
                        Some(n) => live::DRAIN_LEFT.store(n as i64, Ordering::Relaxed),
                        None => {}
                    }
                }
            } else {
                break;
            }
        }
        SWITCHING.store(false, Ordering::Release);
        if !PENDING.load(Ordering::Acquire) && !DRAIN.load(Ordering::Acquire) {
            return;
        }
    }
}

/// The pending request: the header's, else (after a control signal) the
/// control file's, else a toggle.
fn take_request() -> Option<Command> {
    let code = header().map_or(0, |h| h.request.swap(0, Ordering::AcqRel));
    if let Some(r) = Request::from_code(code) {
        SIGNALED.store(false, Ordering::Release);
        return Some(Command::Do(r));
    }
    if !SIGNALED.swap(false, Ordering::AcqRel) {
        return None;
    }
    let mut path = CONTROL_PATH.get();
    let mut buf = [0u8; 64];
    let n = sys::read_small_file(path.c_str(), &mut buf).unwrap_or(0);
    let text = buf.get(..n).unwrap_or_default();
    if text.trim_ascii().is_empty() {
        return Some(Command::Toggle);
    }
    match Request::parse(text) {
        Some(r) => Some(Command::Do(r)),
        None => {
            let mut m = Buf::<256>::new();
            m.str("ignoring unknown request in ").push(path.bytes()).str(" (expected on, off, off now or reset)");
            sys::log(m.bytes());
            None
        }
    }
}

/// Carries out a command and publishes the result in the process file.
pub fn apply(cmd: Command) {
    let start = monotonic_ns();
    let live = LIVE.load(Ordering::Relaxed);
    let off = || {
        if !live || registry::nothing_tracked() {
            return registry::switch_all(Sites::Off);
        }
        registry::switch_all(Sites::Frees)?;
        // A free on a trampoline's inline path, still at the live entry
        // while the sites switched, may have taken the last object out
        // without knowing about the drain.
        match registry::tracked_objects() {
            Some(0) => registry::switch_all(Sites::Off),
            n => {
                live::DRAIN_LEFT.store(n.map_or(1, |n| n as i64), Ordering::Relaxed);
                Ok(())
            }
        }
    };
    // Switching on without live tracking (the map cannot be reserved) is
    // carried out, with the reason published.
    let mut warning = None;
    let result = match cmd {
        Command::Do(Request::Off) => off(),
        Command::Toggle if state::is_on() => off(),
        Command::Do(Request::On) | Command::Toggle => {
            warning = registry::prepare_live().err();
            let r = registry::switch_all(Sites::On);
            // A module that could not join the process file counts where
            // no report reads it: the switch says why.
            warning = warning.or(registry::take_place_error());
            r
        }
        Command::Do(Request::OffNow) => {
            if live && !registry::nothing_tracked() {
                state::INCOMPLETE.store(true, Ordering::Relaxed);
            }
            registry::switch_all(Sites::Off)
        }
        Command::Do(Request::Callers) => {
            // The sites asked for (none: every site), before the sites move.
            let n = header().map_or(0, |h| h.callers_request_sites.load(Ordering::Acquire) as usize);
            let n = if n > state::CALLERS_SITES.len() { 0 } else { n };
            for (i, s) in state::CALLERS_SITES.iter().enumerate() {
                let addr = header().and_then(|h| h.callers_sites.get(i)).map_or(0, |a| a.load(Ordering::Relaxed));
                s.store(if i < n { addr } else { 0 }, Ordering::Relaxed);
            }
            state::CALLERS_SITES_N.store(n as u32, Ordering::Release);
            let asked = header().map_or(0, |h| h.callers_request_depth.load(Ordering::Acquire));
            let depth = if asked == 0 { alloctramp_trampolines::layout::capture::DEFAULT_DEPTH as u32 } else { asked };
            crate::callers::set_depth(depth)
        }
        Command::Do(Request::NoCallers) => crate::callers::set_depth(0),
        Command::Do(Request::Trace) => start_trace(),
        Command::Do(Request::NoTrace) => {
            // The traced entries' stub checks no flag: their limits go to 0
            // first (events until then are the trace's).
            registry::set_tracing_all(false);
            crate::trace::stop();
            state::TRACED.store(false, Ordering::Release);
            registry::refresh_all()
        }
        Command::Do(Request::Fail) => {
            let set = crate::fault::set_from_file();
            registry::publish_fail_sites();
            set.and(registry::refresh_all()).map(|_| ())
        }
        Command::Do(Request::Reset) => {
            reset_counters();
            crate::callers::reset();
            live::forget_all();
            state::INCOMPLETE.store(false, Ordering::Relaxed);
            if state::want() == Sites::Frees { registry::switch_all(Sites::Off) } else { Ok(()) }
        }
    };
    match result {
        Ok(()) => {
            if let Some(h) = header() {
                ProcHeader::set_text(&h.last_error, b"");
            }
        }
        Err(e) => state::report_error(e),
    }
    if let Some(w) = warning {
        state::report_error(w);
    }
    if let Some(h) = header() {
        h.last_switch_ns.store(monotonic_ns().saturating_sub(start), Ordering::Relaxed);
        h.last_switch_sites.store(registry::site_count(), Ordering::Relaxed);
        h.last_switch_time.store(sys::now_secs(), Ordering::Relaxed);
    }
    state::publish_state();
    if let Some(n) = registry::tracked_objects() {
        live::publish_objects(n);
    }
    if let Some(h) = header() {
        h.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// Starts recording events (and profiling, if it was off).
pub fn start_trace() -> Result<(), &'static str> {
    if !LIVE.load(Ordering::Relaxed) {
        return Err("tracing needs live tracking (the process was started with ALLOCTRAMP_LIVE=0)");
    }
    registry::prepare_live()?;
    crate::trace::select_sites()?;
    crate::trace::start()?;
    registry::set_tracing_all(true);
    state::TRACED.store(crate::trace::records_every_event(), Ordering::Release);
    if state::is_on() { registry::refresh_all() } else { registry::switch_all(Sites::On) }
}

fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes the timespec.
    unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

/// Zeroes the words of the pages of `size` bytes at `base` (the runtime's
/// own shared mapping of a module's counters, page-aligned) that hold one
/// that is not zero. Only resident pages are read: a page never written
/// is a hole of the file, or storage never touched, and reads as zero, and
/// reading a hole of a tmpfs file would allocate it. Punching the written
/// pages out instead (`MADV_REMOVE`) would give their storage back, and a
/// later count on a full file system would fault.
fn zero_written_pages(base: u64, size: u64) {
    const CHUNK: u64 = 4096;
    let page = alloctramp_trampolines::layout::PAGE;
    let mut resident = [0u8; CHUNK as usize];
    let mut from = 0u64;
    while from < size {
        let len = (size - from).min(CHUNK * page);
        // SAFETY: a page-aligned range of the mapping; `resident` holds a
        // byte per page of it.
        if unsafe { libc::mincore((base + from) as *mut libc::c_void, len as usize, resident.as_mut_ptr()) } != 0 {
            resident = [1; CHUNK as usize];
        }
        for (k, r) in resident.iter().take(len.div_ceil(page) as usize).enumerate() {
            if r & 1 == 0 {
                continue;
            }
            let at = base + from + k as u64 * page;
            // SAFETY: a resident page of the mapping (never unmapped but by
            // a forked child replacing it before any request runs).
            let words = unsafe { std::slice::from_raw_parts(at as *const AtomicU64, page as usize / 8) };
            if words.iter().any(|w| w.load(Ordering::Relaxed) != 0) {
                for w in words {
                    w.store(0, Ordering::Relaxed);
                }
            }
        }
        from += len;
    }
}

/// Zeroes every counter in the process file, through the runtime's own
/// shared mapping of each module's counters (no descriptor needed).
fn reset_counters() {
    for (slot, m) in registry::slots().zip(&live::MODULES) {
        if slot.file_index.load(Ordering::Relaxed) == u32::MAX {
            continue;
        }
        let (base, size) = (m.base.load(Ordering::Acquire), m.size.load(Ordering::Relaxed));
        if base == 0 || size == 0 {
            continue;
        }
        zero_written_pages(base, size);
    }
    if let Some(h) = header() {
        h.reset_time.store(sys::now_secs(), Ordering::Relaxed);
        h.untracked_allocs.store(0, Ordering::Relaxed);
    }
}

/// The control signal's handler. A signal that `alloctramp` queued with
/// its request's value only carries out the header's request (it may find
/// it taken already by the handling of another signal); any other is a
/// bare control signal.
pub extern "C" fn on_signal(_sig: i32, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    let _errno = sys::ErrnoGuard::new();
    let _handling = crate::patching::Handling::enter();
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler;
    // si_value is meaningful for SI_QUEUE.
    let request = !info.is_null()
        && unsafe {
            (*info).si_code == libc::SI_QUEUE
                && (*info).si_value().sival_ptr as usize == alloctramp_trampolines::process::REQUEST_SIGNAL_VALUE
        };
    handle_request(!request);
}

/// The previous SIGTRAP disposition, to chain to for traps that are not
/// ours.
pub static OLD_TRAP: SavedAction = SavedAction::new();

/// Hands a trap that is not ours to the disposition the program had: its
/// handler, or the default action (restored, and the signal raised again:
/// the process ends as it would have without us).
fn chain_trap(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let (h, flags) = OLD_TRAP.get().map_or((libc::SIG_DFL, 0), |a| (a.sa_sigaction, a.sa_flags));
    if h == libc::SIG_IGN {
        return;
    }
    if h == libc::SIG_DFL {
        // SAFETY: restoring the default action and re-raising.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
        return;
    }
    // SAFETY: calling the handler that was installed before ours, with the
    // signature its flags declare.
    unsafe {
        if flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(i32, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(i32) = std::mem::transmute(h);
            f(sig);
        }
    }
}

/// A disposition saved whole (handler, flags, mask), to chain to or give
/// back to the program: two buffers and the index of the one in use, so that a
/// handler reading it while it is saved again reads one or the other.
pub struct SavedAction {
    buffers: [std::cell::UnsafeCell<std::mem::MaybeUninit<libc::sigaction>>; 2],
    /// 0: none saved; 1 or 2: buffers[current - 1].
    current: std::sync::atomic::AtomicU8,
}

// SAFETY: a buffer is written only while it is not the current one, and
// published by a release store of `current` that readers acquire.
unsafe impl Sync for SavedAction {}

impl SavedAction {
    pub const fn new() -> Self {
        SavedAction {
            buffers: [const { std::cell::UnsafeCell::new(std::mem::MaybeUninit::uninit()) }; 2],
            current: std::sync::atomic::AtomicU8::new(0),
        }
    }

    /// Saves `a`. Called by the one thread that installs the handler.
    pub fn set(&self, a: &libc::sigaction) {
        let next = if self.current.load(Ordering::Acquire) == 1 { 2 } else { 1 };
        if let Some(b) = self.buffers.get(usize::from(next) - 1) {
            // SAFETY: not the current buffer: no reader reads it.
            unsafe { (*b.get()).write(*a) };
            self.current.store(next, Ordering::Release);
        }
    }

    fn get(&self) -> Option<libc::sigaction> {
        let i = self.current.load(Ordering::Acquire);
        let b = self.buffers.get(usize::from(i).checked_sub(1)?)?;
        // SAFETY: the current buffer, written before it was published.
        Some(unsafe { (*b.get()).assume_init() })
    }
}

/// SIGTRAP: a thread reached a site while it held INT3 during a switch.
/// Sends it to the site's trampoline; other traps go to the previous
/// handler (or the default action).
pub extern "C" fn on_trap(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let _errno = sys::ErrnoGuard::new();
    let uc = ctx as *mut libc::ucontext_t;
    // SAFETY: the kernel passes a valid ucontext to an SA_SIGINFO handler.
    let gregs = unsafe { &mut (*uc).uc_mcontext.gregs };
    if let Some(rip) = gregs.get_mut(libc::REG_RIP as usize)
        && let Some(t) = registry::trampoline_for((*rip as u64).wrapping_sub(1))
    {
        // The trampoline does what the site's instruction does, from the
        // same stack state.
        *rip = t as i64;
        return;
    }
    chain_trap(sig, info, ctx);
}

/// The previous SIGSEGV and SIGBUS dispositions, given back for faults
/// that are not a charge check's.
pub static OLD_SEGV: SavedAction = SavedAction::new();
pub static OLD_BUS: SavedAction = SavedAction::new();

/// Whether a fault with this code comes again when the thread returns to
/// the faulting instruction (what the kernel raises for an access).
fn repeats(sig: i32, code: i32) -> bool {
    match sig {
        // SEGV_MAPERR, SEGV_ACCERR, SEGV_BNDERR, SEGV_PKUERR; SI_KERNEL (a
        // general protection fault).
        libc::SIGSEGV => matches!(code, 1..=4 | 0x80),
        // BUS_ADRALN, BUS_ADRERR, BUS_OBJERR, BUS_MCEERR_AR.
        libc::SIGBUS => matches!(code, 1..=4),
        _ => false,
    }
}

/// SIGSEGV and SIGBUS: a charge check read the word below a hook's stack
/// pointer on a stack that is no longer mapped (a program that switches
/// stacks left, or freed, the one a hook's call was made on). The read
/// completes with 0, which is never the hook's return address: the check
/// finds the charge stale and clears it, as after a `longjmp`.
///
/// Any other fault or signal is given back to the program exactly as the
/// kernel would have delivered it: the disposition the program had is
/// restored whole (handler, flags, mask, alternate stack), and a fault
/// comes again from the same instruction while any other signal is queued
/// again with its own siginfo. Our handler is installed again at the next
/// switch.
pub extern "C" fn on_fault(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let _errno = sys::ErrnoGuard::new();
    // SAFETY: the kernel passes a valid siginfo and ucontext to an
    // SA_SIGINFO handler.
    let code = if info.is_null() { 0 } else { unsafe { (*info).si_code } };
    let again = repeats(sig, code);
    let uc = ctx as *mut libc::ucontext_t;
    if again && !uc.is_null() {
        // SAFETY: as above.
        let gregs = unsafe { &mut (*uc).uc_mcontext.gregs };
        let (r10, rip) = (libc::REG_R10 as usize, libc::REG_RIP as usize);
        if let Some(&pc) = gregs.get(rip)
            && (crate::tls::is_hook_word_load(pc as u64) || registry::is_check_load(pc as u64))
        {
            if let Some(v) = gregs.get_mut(r10) {
                *v = 0;
            }
            if let Some(v) = gregs.get_mut(rip) {
                *v += alloctramp_trampolines::layout::CHECK_LOAD.len() as i64;
            }
            return;
        }
    }
    let saved = if sig == libc::SIGBUS { &OLD_BUS } else { &OLD_SEGV };
    // SAFETY: a zeroed sigaction is the default action.
    let old = saved.get().unwrap_or_else(|| unsafe { std::mem::zeroed() });
    // SAFETY: restores the program's disposition; queues the signal again,
    // to this thread, with the siginfo it came with (a process may send
    // itself any code). It is blocked until this handler returns.
    unsafe {
        libc::sigaction(sig, &old, std::ptr::null_mut());
        crate::patching::FAULT_HANDLER.forget();
        if !again && !info.is_null() {
            libc::syscall(libc::SYS_rt_tgsigqueueinfo, libc::getpid(), libc::gettid(), sig, info);
        }
    }
}

/// The watcher thread: waits on the header's futex word and carries out
/// each request. It holds no descriptor, blocks every signal (so a signal
/// the program directs at the process always reaches one of the program's
/// own threads, and none of its system calls is interrupted), and never
/// exits.
extern "C" fn watch(first: *mut libc::c_void) -> *mut libc::c_void {
    // Named from inside (prctl), so that naming it opens no file.
    // SAFETY: PR_SET_NAME reads a NUL-terminated name of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"alloctramp".as_ptr()) };
    if !first.is_null() {
        // SAFETY: `start_watcher` passes a `fn()` as the argument.
        let first: fn() = unsafe { std::mem::transmute::<*mut libc::c_void, fn()>(first) };
        first();
    }
    loop {
        // The header moves after fork (the child's thread is a new one,
        // but the loop reads it afresh anyway).
        let Some(h) = header() else { return std::ptr::null_mut() };
        let wake = &h.wake;
        let seen = wake.load(Ordering::Acquire);
        if h.request.load(Ordering::Acquire) != 0 {
            handle_request(false);
        }
        // A requester stores the request, increments the word, then wakes:
        // if it did so since `seen` was read, the wait returns at once.
        if crate::drain::active() {
            match crate::drain::next_wait(crate::drain::run(false)) {
                0 => {}
                ns => sys::futex_wait_for(wake, seen, ns),
            }
        } else {
            sys::futex_wait(wake, seen);
        }
    }
}

/// Starts the watcher thread with every signal blocked; it runs `first`
/// before it waits for requests (work the program need not wait for).
/// Returns false if the thread could not be created.
pub fn start_watcher(first: fn()) -> bool {
    // The new thread inherits the mask; this one gets its own back.
    let _blocked = sys::SignalsBlocked::new();
    // SAFETY: plain pthread calls on local, initialized structures; the
    // thread's argument is `first`, a `fn()` that `watch` turns back into
    // one.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        libc::pthread_attr_init(&mut attr);
        libc::pthread_attr_setstacksize(&mut attr, 256 << 10);
        libc::pthread_attr_setdetachstate(&mut attr, libc::PTHREAD_CREATE_DETACHED);
        let mut t: libc::pthread_t = 0;
        let ok = libc::pthread_create(&mut t, &attr, watch, first as *mut libc::c_void) == 0;
        libc::pthread_attr_destroy(&mut attr);
        ok
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn control_file_requests() {
        assert_eq!(Request::parse(b"on\n"), Some(Request::On));
        assert_eq!(Request::parse(b"  off "), Some(Request::Off));
        assert_eq!(Request::parse(b"off now\n"), Some(Request::OffNow));
        assert_eq!(Request::parse(b"reset"), Some(Request::Reset));
        assert_eq!(Request::parse(b"ON"), None);
        assert_eq!(Request::parse(b"on off"), None);
        assert_eq!(Request::parse(b""), None);
    }
}
