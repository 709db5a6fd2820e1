//! Switching on request: the control signal, the control file, the
//! optional watcher thread, and the SIGTRAP handler of the patching
//! protocol. Everything reachable from a signal handler here is
//! async-signal-safe: system calls, atomics, fixed buffers.

use crate::live;
use crate::patching::Sites;
use crate::registry::{self, LIVE, PROC_FD, PROC_HEADER};
use crate::sys::{self, Buf};
use alloctramp_trampolines::process::hdr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// What the control file asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    On,
    /// Off; with live tracking, free and realloc sites stay on until the
    /// tracked objects are freed (or a reset).
    Off,
    /// Every site off at once (live figures become incomplete if tracked
    /// objects remain).
    OffNow,
    Reset,
    /// Empty or missing file: a bare signal toggles.
    Toggle,
}

/// Parses the control file's contents (surrounding white space ignored).
pub fn parse(text: &[u8]) -> Result<Command, ()> {
    let t = text.trim_ascii();
    match t {
        b"on" => Ok(Command::On),
        b"off" => Ok(Command::Off),
        b"off now" => Ok(Command::OffNow),
        b"reset" => Ok(Command::Reset),
        b"" => Ok(Command::Toggle),
        _ => Err(()),
    }
}

/// The control file's path, set at start-up (and after fork).
pub static CONTROL_PATH: ControlPath = ControlPath::new();

pub struct ControlPath {
    bytes: [AtomicU64; 32],
    len: AtomicUsize,
}

impl ControlPath {
    const fn new() -> Self {
        ControlPath { bytes: [const { AtomicU64::new(0) }; 32], len: AtomicUsize::new(0) }
    }
    pub fn set(&self, p: &[u8]) {
        let n = p.len().min(255);
        for (i, chunk) in self.bytes.iter().enumerate() {
            let mut w = [0u8; 8];
            for (k, b) in w.iter_mut().enumerate() {
                *b = p.get(i * 8 + k).copied().filter(|_| i * 8 + k < n).unwrap_or(0);
            }
            chunk.store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
        self.len.store(n, Ordering::Release);
    }
    fn get(&self) -> Buf<256> {
        let n = self.len.load(Ordering::Acquire);
        let mut raw = [0u8; 256];
        for (i, chunk) in self.bytes.iter().enumerate() {
            raw[i * 8..i * 8 + 8].copy_from_slice(&chunk.load(Ordering::Relaxed).to_le_bytes());
        }
        let mut b = Buf::new();
        b.push(&raw[..n]);
        b
    }
}

fn header_u32(at: usize) -> Option<&'static AtomicU32> {
    let h = PROC_HEADER.load(Ordering::Acquire);
    // SAFETY: the header mapping lives until the process ends; `at` is a
    // 4-aligned field offset.
    (h != 0).then(|| unsafe { &*((h + at) as *const AtomicU32) })
}

pub(crate) fn header_u64(at: usize) -> Option<&'static AtomicU64> {
    let h = PROC_HEADER.load(Ordering::Acquire);
    // SAFETY: as above, 8-aligned.
    (h != 0).then(|| unsafe { &*((h + at) as *const AtomicU64) })
}

static SWITCHING: AtomicBool = AtomicBool::new(false);
static PENDING: AtomicBool = AtomicBool::new(false);
static DRAIN: AtomicBool = AtomicBool::new(false);

/// Reads the control file and does what it asks. Safe in signal context.
/// A request arriving while another is being carried out is picked up by
/// that one before it finishes.
pub fn handle_request() {
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
                apply_control_file();
            } else if DRAIN.swap(false, Ordering::AcqRel) {
                if registry::want() == Sites::Frees && live::is_empty() {
                    apply(Command::Off);
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

fn apply_control_file() {
    let mut path = CONTROL_PATH.get();
    let mut buf = [0u8; 64];
    let n = sys::read_small_file(path.c_str(), &mut buf).unwrap_or(0);
    let cmd = match parse(&buf[..n]) {
        Ok(c) => c,
        Err(()) => {
            let mut m = Buf::<256>::new();
            m.str("ignoring unknown request in ").push(path.bytes()).str(" (expected on, off, off now or reset)");
            sys::log(m.bytes());
            return;
        }
    };
    apply(cmd);
}

/// Carries out a command and publishes the result in the process file.
pub fn apply(cmd: Command) {
    let start = monotonic_ns();
    let live = LIVE.load(Ordering::Relaxed);
    let off = || {
        if !live || live::is_empty() {
            return registry::switch_all(Sites::Off);
        }
        registry::switch_all(Sites::Frees)?;
        // A free on a trampoline's inline path, still at the live entry
        // while the sites switched, may have taken the last object out
        // without knowing about the drain.
        if live::is_empty() { registry::switch_all(Sites::Off) } else { Ok(()) }
    };
    let result = match cmd {
        Command::On => registry::switch_all(Sites::On),
        Command::Off => off(),
        Command::Toggle if registry::is_on() => off(),
        Command::Toggle => registry::switch_all(Sites::On),
        Command::OffNow => {
            if live && !live::is_empty() {
                registry::INCOMPLETE.store(true, Ordering::Relaxed);
            }
            registry::switch_all(Sites::Off)
        }
        Command::Reset => {
            reset_counters();
            live::forget_all();
            registry::INCOMPLETE.store(false, Ordering::Relaxed);
            if registry::want() == Sites::Frees { registry::switch_all(Sites::Off) } else { Ok(()) }
        }
    };
    match result {
        Ok(()) => {
            if let Some(e) = header_u32(hdr::LAST_ERROR) {
                e.store(0, Ordering::Relaxed);
            }
        }
        Err(e) => registry::report_error(e),
    }
    if let Some(t) = header_u64(hdr::LAST_SWITCH_NS) {
        t.store(monotonic_ns().saturating_sub(start), Ordering::Relaxed);
    }
    if let Some(n) = header_u64(hdr::LAST_SWITCH_SITES) {
        n.store(registry::site_count(), Ordering::Relaxed);
    }
    registry::publish_state();
    live::publish_objects();
    if let Some(g) = header_u64(hdr::GENERATION) {
        g.fetch_add(1, Ordering::AcqRel);
    }
}

fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes the timespec.
    unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

fn reset_counters() {
    use alloctramp_trampolines::process::{MODULE_SLOT_SIZE, MODULE_SLOTS_AT, slot};
    let fd = PROC_FD.load(Ordering::Acquire);
    let (Some(count), true) = (header_u32(hdr::MODULE_COUNT), fd != u32::MAX) else { return };
    for i in 0..count.load(Ordering::Acquire) as usize {
        let base = MODULE_SLOTS_AT as usize + i * MODULE_SLOT_SIZE as usize;
        let (Some(off), Some(size)) =
            (header_u64(base + slot::COUNTERS_OFFSET), header_u64(base + slot::COUNTERS_SIZE))
        else {
            continue;
        };
        // SAFETY: punching a hole in our own counters file; its shared
        // mappings read zeros from then on.
        unsafe {
            libc::fallocate(
                fd as i32,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off.load(Ordering::Relaxed) as i64,
                size.load(Ordering::Relaxed) as i64,
            );
        }
    }
    if let Some(t) = header_u64(hdr::RESET_TIME) {
        t.store(sys::now_secs(), Ordering::Relaxed);
    }
    if let Some(n) = header_u64(hdr::UNTRACKED_ALLOCS) {
        n.store(0, Ordering::Relaxed);
    }
}

/// The control signal's handler.
pub extern "C" fn on_signal(_sig: i32, _info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    let _errno = sys::ErrnoGuard::new();
    handle_request();
}

/// The previous SIGTRAP disposition, to chain to for traps that are not
/// ours.
pub static OLD_TRAP: OldAction = OldAction::new();

pub struct OldAction {
    handler: AtomicUsize,
    flags: AtomicUsize,
}

impl OldAction {
    const fn new() -> Self {
        OldAction { handler: AtomicUsize::new(libc::SIG_DFL), flags: AtomicUsize::new(0) }
    }
    pub fn set(&self, a: &libc::sigaction) {
        self.handler.store(a.sa_sigaction, Ordering::Relaxed);
        self.flags.store(a.sa_flags as usize, Ordering::Release);
    }
}

/// SIGTRAP: a thread reached a site while it held INT3 during a switch.
/// Sends it to the site's trampoline; other traps go to the previous
/// handler (or the default action).
pub extern "C" fn on_trap(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let _errno = sys::ErrnoGuard::new();
    let uc = ctx as *mut libc::ucontext_t;
    // SAFETY: the kernel passes a valid ucontext to an SA_SIGINFO handler.
    let rip = unsafe { (*uc).uc_mcontext.gregs[libc::REG_RIP as usize] } as u64;
    if let Some(t) = crate::patching::trampoline_for(rip.wrapping_sub(1)) {
        // SAFETY: as above; the trampoline does what the site's
        // instruction does, from the same stack state.
        unsafe { (*uc).uc_mcontext.gregs[libc::REG_RIP as usize] = t as i64 };
        return;
    }
    let h = OLD_TRAP.handler.load(Ordering::Acquire);
    let flags = OLD_TRAP.flags.load(Ordering::Relaxed) as i32;
    if h == libc::SIG_IGN {
        return;
    }
    if h == libc::SIG_DFL {
        // SAFETY: restoring the default action and re-raising: the process
        // ends as it would have without us.
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

/// The opt-in watcher: follows the control file with inotify, without a
/// signal and without polling.
pub fn start_watcher(dir: Vec<u8>, file: Vec<u8>) {
    let spawn = std::thread::Builder::new().name("alloctramp-watch".into()).spawn(move || {
        let mut d = Buf::<256>::new();
        d.push(&dir);
        // SAFETY: inotify on our own directory; the buffer is ours.
        unsafe {
            let fd = libc::inotify_init1(libc::IN_CLOEXEC);
            if fd < 0 || libc::inotify_add_watch(fd, d.c_str().as_ptr(), libc::IN_CLOSE_WRITE | libc::IN_MOVED_TO) < 0 {
                sys::log(b"cannot watch the control file");
                return;
            }
            let mut buf = [0u8; 4096];
            loop {
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                if n <= 0 {
                    if n < 0 && sys::errno() == libc::EINTR {
                        continue;
                    }
                    return;
                }
                let mut at = 0usize;
                let mut ours = false;
                while at + 16 <= n as usize {
                    let len = u32::from_le_bytes(buf[at + 12..at + 16].try_into().unwrap()) as usize;
                    let name = &buf[at + 16..(at + 16 + len).min(n as usize)];
                    let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(name.len())];
                    ours |= name == file.as_slice();
                    at += 16 + len;
                }
                if ours {
                    handle_request();
                }
            }
        }
    });
    if spawn.is_err() {
        sys::log(b"cannot start the control file watcher");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_file_commands() {
        assert_eq!(parse(b"on\n"), Ok(Command::On));
        assert_eq!(parse(b"  off "), Ok(Command::Off));
        assert_eq!(parse(b"off now\n"), Ok(Command::OffNow));
        assert_eq!(parse(b"reset"), Ok(Command::Reset));
        assert_eq!(parse(b""), Ok(Command::Toggle));
        assert_eq!(parse(b"\n"), Ok(Command::Toggle));
        assert_eq!(parse(b"ON"), Err(()));
        assert_eq!(parse(b"on off"), Err(()));
    }
}
