//! The process's profiling state: which sites should be on, whether live
//! tracking runs, what the figures mean, and how they are published in the
//! counters file's header. Below patching, live tracking and the registry;
//! imports only the process file and system calls.

use crate::procfile;
use crate::sys;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

/// Which sites of a module jump to their trampolines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Sites {
    /// None: the module runs its original code.
    Off = 0,
    /// Only the free sites (live tracking drains after profiling is off).
    Frees = 1,
    /// Every site.
    On = 2,
}

impl Sites {
    pub fn from_u8(v: u8) -> Sites {
        match v {
            2 => Sites::On,
            1 => Sites::Frees,
            _ => Sites::Off,
        }
    }
}

/// Which sites should be on: what every module converges to ([`Sites`]).
pub static WANT: AtomicU8 = AtomicU8::new(Sites::Off as u8);

pub fn want() -> Sites {
    Sites::from_u8(WANT.load(Ordering::Acquire))
}

/// Whether profiling is on (every site).
pub fn is_on() -> bool {
    want() == Sites::On
}

/// Frames recorded per call chain while callers capture is on (0: off):
/// sites with a callers entry jump there while profiling is on.
pub static CALLERS: AtomicU32 = AtomicU32::new(0);

/// The sites (run-time addresses) whose chains are recorded, the first
/// `CALLERS_SITES_N`; none: every site.
pub static CALLERS_SITES: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];
pub static CALLERS_SITES_N: AtomicU32 = AtomicU32::new(0);

/// Whether the site at run-time address `addr` records chains now.
pub fn records_chains(addr: u64) -> bool {
    if CALLERS.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let n = CALLERS_SITES_N.load(Ordering::Relaxed) as usize;
    n == 0 || CALLERS_SITES.iter().take(n).any(|s| s.load(Ordering::Relaxed) == addr)
}

/// Live tracking in this process: decided at start-up
/// (`ALLOCTRAMP_LIVE`), and given up when profiling first goes on if the
/// shadow map cannot be reserved.
pub static LIVE: AtomicBool = AtomicBool::new(false);

/// A trace of every site is on: sites with a traced entry jump there
/// instead of to their start (see `live::set_tracing`). A trace with a
/// site filter leaves them on their start, which calls the runtime.
pub static TRACED: AtomicBool = AtomicBool::new(false);

/// The entry a site's jump or its callers entry goes to while profiling is
/// on with live tracking: the traced entry during a trace, else the start
/// (offset 0).
pub fn live_entry(traced: u16) -> u16 {
    if traced != 0 && TRACED.load(Ordering::Relaxed) { traced } else { 0 }
}

/// Live figures may overstate from now on (until a reset).
pub static INCOMPLETE: AtomicBool = AtomicBool::new(false);

/// Profiling was on at some time in this process (inherited by a forked
/// child, whose sites are in the same state).
pub static PROFILED: AtomicBool = AtomicBool::new(false);

/// Writes the wanted state and the live-tracking flags into the process
/// file's header.
pub fn publish_state() {
    if let Some(h) = procfile::header() {
        publish_state_to(h);
    } else if is_on() {
        PROFILED.store(true, Ordering::Relaxed);
    }
}

/// [`publish_state`] into a header (of a file not yet published).
pub fn publish_state_to(h: &alloctramp_trampolines::process::ProcHeader) {
    use alloctramp_trampolines::process::flags;
    if is_on() {
        PROFILED.store(true, Ordering::Relaxed);
    }
    let mut f = 0;
    if PROFILED.load(Ordering::Relaxed) {
        f |= flags::PROFILED;
    }
    if LIVE.load(Ordering::Relaxed) {
        f |= flags::LIVE;
    }
    if want() == Sites::Frees {
        f |= flags::DRAINING;
    }
    if INCOMPLETE.load(Ordering::Relaxed) {
        f |= flags::INCOMPLETE;
    }
    h.flags.store(f, Ordering::Release);
    h.state.store(u32::from(is_on()), Ordering::Release);
}

pub fn report_error(e: &str) {
    sys::log(e.as_bytes());
    if let Some(h) = procfile::header() {
        alloctramp_trampolines::process::ProcHeader::set_text(&h.last_error, e.as_bytes());
    }
}
