//! `ALLOCTRAMP_TRACE=DIR`: the process drains its own trace into
//! `DIR/PID`, on the watcher thread (every 20 ms, sooner while rings fill)
//! and at exit, with the drainer `alloctramp trace` uses
//! (`alloctramp_trampolines::trace::Drainer`). It opens each stream file
//! for a write and closes it again (the runtime holds no descriptor while
//! the program runs); the sites and the metadata are rewritten (under a
//! temporary name, then renamed) as modules get site ids and once a
//! second,
//! so that a process that dies by a signal leaves a trace that reads up
//! to its last drain.

use crate::registry::{self, SpinLock};
use crate::{sys, trace};
use alloctramp_trampolines::trace::{Drainer, ctf};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

struct Dir {
    path: PathBuf,
    d: Drainer,
    /// Every site described so far, by id (those of modules unloaded
    /// since stay).
    sites: std::collections::BTreeMap<u32, alloctramp_trampolines::trace::SiteInfo>,
    /// [`crate::live::ids_given`] when the sites were last collected:
    /// the registry is read again only when modules got ids since.
    ids_seen: u32,
    /// When the metadata was last written (CLOCK_MONOTONIC, ns).
    meta_at: u64,
    command: String,
}

static STATE: SpinLock<Option<Dir>> = SpinLock::new(None);
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// Whether this process drains its own trace.
pub fn active() -> bool {
    ACTIVE.load(Ordering::Acquire)
}

/// Starts draining into `dir/PID` (made if missing): after the trace
/// started. Errors are logged; the trace then waits for `alloctramp
/// trace`.
pub fn start(dir: &str) {
    let Some(rings) = trace::rings() else { return };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let path = PathBuf::from(dir).join(pid.to_string());
    // Absolute, so that the program's chdir does not move it.
    let path = match std::fs::create_dir_all(&path).and_then(|()| std::fs::canonicalize(&path)) {
        Ok(p) => p,
        Err(e) => {
            sys::log(format!("ALLOCTRAMP_TRACE: {}: cannot create ({e}); no trace written", path.display()).as_bytes());
            return;
        }
    };
    if rings.header().drainer.compare_exchange(0, pid as u32, Ordering::AcqRel, Ordering::Relaxed).is_err() {
        return;
    }
    let command = std::fs::read("/proc/self/comm").map(|c| String::from_utf8_lossy(&c).trim().to_string());
    let mut uuid = [0u8; 16];
    // SAFETY: getrandom writes at most 16 bytes into the buffer.
    unsafe { libc::getrandom(uuid.as_mut_ptr() as *mut libc::c_void, 16, 0) };
    let uuid = alloctramp_trampolines::trace::uuid_v4(uuid);
    let start = rings.header().start_tsc.load(Ordering::Acquire);
    STATE.with(|s| {
        *s = Some(Dir {
            path,
            d: Drainer::new(uuid, start),
            sites: Default::default(),
            ids_seen: 0,
            meta_at: 0,
            command: command.unwrap_or_default(),
        })
    });
    ACTIVE.store(true, Ordering::Release);
    // The sites of the modules loaded at start-up, now: a short-lived
    // process may exit (its modules unregistering first) before the
    // watcher's first drain.
    run(false);
}

fn append(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    std::fs::OpenOptions::new().create(true).append(true).open(dir.join(name))?.write_all(bytes)
}

/// Writes `bytes` as `dir/name`, whole (a temporary file renamed).
fn replace(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.new"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(name))
}

/// Drains the rings; rewrites the sites and the metadata when they are
/// due (`last`: at exit, everything closed). Returns the most records
/// read from one ring.
pub fn run(last: bool) -> u64 {
    if !active() {
        return 0;
    }
    let Some(rings) = trace::rings() else { return 0 };
    STATE.with(|s| {
        // Finished meanwhile (at exit, on another thread).
        if !active() {
            return 0;
        }
        let Some(st) = s.as_mut() else { return 0 };
        let path = st.path.clone();
        let mut sink = |name: &str, bytes: &[u8]| append(&path, name, bytes);
        let drained = st.d.drain(&rings, trace::rdtscp().0, &mut sink);
        let closed = if last { st.d.close_all(&mut sink) } else { Ok(()) };
        let most = match (drained, closed) {
            (Ok(n), Ok(())) => Ok(n),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        if let Err(e) = &most {
            sys::log(format!("ALLOCTRAMP_TRACE: {}: {e}; the trace stops here", path.display()).as_bytes());
            ACTIVE.store(false, Ordering::Release);
            return 0;
        }
        let known = st.sites.len();
        let ids = crate::live::ids_given();
        if ids != st.ids_seen {
            let (infos, complete) = registry::site_infos();
            if complete {
                st.ids_seen = ids;
            }
            for info in infos {
                st.sites.entry(info.id).or_insert(info);
            }
        }
        if st.sites.len() != known {
            let all: Vec<_> = st.sites.values().cloned().collect();
            let _ = replace(&path, "sites", &st.d.sites(&all));
        }
        let now = sys::clock_ns(libc::CLOCK_MONOTONIC);
        let since_start = now.saturating_sub(rings.header().start_monotonic.load(Ordering::Relaxed));
        if last || (since_start >= 10_000_000 && now.saturating_sub(st.meta_at) >= 1_000_000_000) {
            // The two clocks read together, for the rate.
            let (tsc, now) = (trace::rdtscp().0, sys::clock_ns(libc::CLOCK_MONOTONIC));
            let (freq, offset_ns) = alloctramp_trampolines::trace::clock(rings.header(), tsc, now);
            // SAFETY: getpid has no preconditions.
            let pid = unsafe { libc::getpid() } as u32;
            let meta = ctf::metadata(&ctf::Meta { uuid: st.d.uuid(), freq, offset_ns, pid, command: &st.command });
            let _ = replace(&path, "metadata", meta.as_bytes());
            st.meta_at = now;
        }
        most.unwrap_or(0)
    })
}

/// The wait before the next drain (ns): sooner while rings fill.
pub fn next_wait(most: u64) -> u64 {
    match most {
        0 => 20_000_000,
        n if n < alloctramp_trampolines::trace::RING_RECORDS as u64 / 8 => 1_000_000,
        _ => 0,
    }
}

/// At exit: recording stops, then the last events are drained and the
/// trace completed (the watcher, if it is draining, finishes first; it
/// drains no more after).
pub fn finish() {
    // The traced entries first: their stub checks no flag.
    registry::set_tracing_all(false);
    trace::stop();
    run(true);
    STATE.with(|_| ACTIVE.store(false, Ordering::Release));
}

/// In a forked child: the parent drains its own trace.
pub fn after_fork_in_child() {
    ACTIVE.store(false, Ordering::Relaxed);
    STATE.force_unlock();
}
