//! The alloctramp runtime: the library every patched module loads (a
//! DT_NEEDED entry of the module). It is a guest in someone else's process:
//! it holds no file descriptor while the program runs, does nothing on a
//! trampoline path, runs only async-signal-safe code in signal handlers, and
//! a panic aborts (it never unwinds into C). Its personality routine
//! (`unwinding`) lets exceptions pass trampolines.
//!
//! At start-up it creates the process's counters file (a process that
//! starts with profiling off makes it 10 ms later, from its watcher thread),
//! starts the watcher thread that waits for requests (or installs the
//! control signal's handler), and registers every patched module already loaded (the SIGTRAP
//! handler of the patching protocol waits for the first switch); modules loaded later register from their init stub, and
//! unregister from their fini stub. At exit, a process that never profiled
//! removes its file.
//!
//! Environment: `ALLOCTRAMP=on` (profile from the start), `ALLOCTRAMP_LIVE=0`
//! (count calls and bytes only, no live figures; fixed for the process's
//! lifetime), `ALLOCTRAMP_SWITCH` (`thread`, the default: a watcher thread
//! waits on a futex in the counters file; `signal`: the control signal
//! `ALLOCTRAMP_SIGNAL`, default `SIGRTMAX-7`, see
//! [`DEFAULT_SIGNAL_FROM_RTMAX`]; `none`: only the environment),
//! `ALLOCTRAMP_DIR` (where the counters files go), `ALLOCTRAMP_KEEP` (how
//! many files of ended processes stay there), `ALLOCTRAMP_TRACE=on`
//! (record every allocation and free as an event from the start, for
//! `alloctramp trace` to drain; see `trace`), `ALLOCTRAMP_TRACE=on:PID`
//! (the same in a process whose parent is PID: what `alloctramp run
//! --trace` sets) or `ALLOCTRAMP_TRACE=DIR` (the same, drained by the
//! process itself into `DIR/PID`; see `drain`).

#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc, clippy::indexing_slicing)]

mod callers;
mod control;
mod drain;
mod fault;
mod foreign;
mod image;
mod live;
mod patching;
mod procfile;
mod registry;
mod shards;
mod state;
mod sys;
mod tls;
mod trace;
mod unwinding;

use alloctramp_trampolines::layout::{self, API_VERSION};
use alloctramp_trampolines::process;
use registry::PROC;
use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The API table patched modules import (layout in `layout::api`).
#[repr(C)]
pub struct Api {
    pub version: u64,
    pub register: unsafe extern "C" fn(table: *const u8),
    pub unregister: unsafe extern "C" fn(table: *const u8),
}

#[allow(non_upper_case_globals)]
#[cfg_attr(not(test), unsafe(no_mangle))]
pub static alloctramp_runtime_v1: Api = Api { version: API_VERSION, register, unregister };

/// The default control signal: a real-time signal few programs use
/// (SIGRTMAX - 7, 57 with glibc).
pub const DEFAULT_SIGNAL_FROM_RTMAX: i32 = 7;

struct Config {
    inert: bool,
}

static CONFIG: OnceLock<Config> = OnceLock::new();
static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// Parses `ALLOCTRAMP_SIGNAL`: `none`, a number, or a name (`USR2`,
/// `SIGUSR2`, `RTMIN+3`, `RTMAX-7`).
fn parse_signal(s: &str) -> Result<i32, String> {
    let name = s.trim().to_ascii_uppercase();
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    if name == "NONE" {
        return Ok(0);
    }
    if let Ok(n) = name.parse::<i32>() {
        return if (1..=libc::SIGRTMAX()).contains(&n) { Ok(n) } else { Err(format!("no signal {n}")) };
    }
    let rt = |base: i32, rest: &str| -> Option<i32> {
        if rest.is_empty() {
            return Some(base);
        }
        let v: i32 = rest.parse().ok()?;
        Some(base + v)
    };
    let n = match name {
        "USR1" => Some(libc::SIGUSR1),
        "USR2" => Some(libc::SIGUSR2),
        "PROF" => Some(libc::SIGPROF),
        "URG" => Some(libc::SIGURG),
        "WINCH" => Some(libc::SIGWINCH),
        "HUP" => Some(libc::SIGHUP),
        _ if name.starts_with("RTMIN") => rt(libc::SIGRTMIN(), &name[5..]),
        _ if name.starts_with("RTMAX") => rt(libc::SIGRTMAX(), &name[5..]),
        _ => None,
    };
    match n {
        Some(n) if (libc::SIGRTMIN()..=libc::SIGRTMAX()).contains(&n) || n < 32 => Ok(n),
        _ => Err(format!("unknown signal {s:?}")),
    }
}

fn secure_execution() -> bool {
    // SAFETY: getauxval has no preconditions.
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

/// The directory of the counters files, as an absolute path: the runtime
/// opens its file again by path later, after the program may have changed
/// its working directory.
fn counters_dir() -> String {
    if let Ok(d) = std::env::var("ALLOCTRAMP_DIR") {
        if d.starts_with('/') {
            return d;
        }
        let cwd = std::env::current_dir().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
        return format!("{cwd}/{d}");
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    process::default_dir(std::env::var("XDG_RUNTIME_DIR").ok().as_deref(), uid)
}

/// The command line as the kernel keeps it: argv[0] and each argument,
/// each ended by a NUL, as much as the process file keeps. Read without
/// allocating: the watcher thread makes a deferred file, and a thread's
/// first allocation would cost the process a C library arena.
fn command_name(buf: &mut [u8; process::COMMAND_LEN]) -> &[u8] {
    let n = sys::read_small_file(c"/proc/self/cmdline", buf).unwrap_or(0);
    buf.get(..n).unwrap_or_default()
}

/// How a running process hears requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Switch {
    /// A watcher thread waits on a futex word of the counters file.
    Thread,
    /// The control signal's handler carries requests out.
    Signal(i32),
    /// Only `ALLOCTRAMP=on` at start.
    None,
}

fn switch_mode() -> Switch {
    let signal = || match std::env::var("ALLOCTRAMP_SIGNAL") {
        Ok(s) => match parse_signal(&s) {
            Ok(n) if n != 0 => n,
            Ok(_) | Err(_) => {
                sys::log(
                    format!("ALLOCTRAMP_SIGNAL={s:?}: not a signal; using SIGRTMAX-{DEFAULT_SIGNAL_FROM_RTMAX}")
                        .as_bytes(),
                );
                libc::SIGRTMAX() - DEFAULT_SIGNAL_FROM_RTMAX
            }
        },
        Err(_) => libc::SIGRTMAX() - DEFAULT_SIGNAL_FROM_RTMAX,
    };
    match std::env::var("ALLOCTRAMP_SWITCH").as_deref() {
        Ok("thread") | Ok("") | Err(_) => Switch::Thread,
        Ok("signal") => Switch::Signal(signal()),
        Ok("none") => Switch::None,
        Ok(other) => {
            sys::log(format!("ALLOCTRAMP_SWITCH={other:?}: expected thread, signal or none; using thread").as_bytes());
            Switch::Thread
        }
    }
}

/// Whether a failure to make the process file is told on stderr: not by
/// a file deferred to the watcher thread, when the program may have closed
/// its stderr and reused the descriptor.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Say {
    Errors,
    Nothing,
}

/// Makes the counters directory if it is missing and checks it (ours, not
/// open to others); says why not in one line.
fn counters_dir_ready(dir: &str, say: Say) -> bool {
    let mut d = sys::Buf::<256>::new();
    d.str(dir);
    if let Err(e) = procfile::ensure_dir(d.c_str()) {
        if say == Say::Errors {
            let mut m = sys::Buf::<512>::new();
            m.str(e).str(": ").str(dir).str(" (profiling is unavailable)");
            sys::log(m.bytes());
        }
        return false;
    }
    true
}

/// Creates the process file for the current pid, in `dir` if it is ready
/// (see [`create_process_file`]).
fn open_process_file(
    dir: &str,
    mode: Switch,
    say: Say,
    init: impl FnOnce(&process::ProcHeader),
) -> Option<procfile::ProcFile> {
    counters_dir_ready(dir, say).then(|| create_process_file(dir, mode, say, init)).flatten()
}

/// Creates the process file for the current pid in `dir`, which is ready;
/// `init` completes its header before it can be seen.
fn create_process_file(
    dir: &str,
    mode: Switch,
    say: Say,
    init: impl FnOnce(&process::ProcHeader),
) -> Option<procfile::ProcFile> {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    let signal = if let Switch::Signal(n) = mode { n as u32 } else { 0 };
    let mut command = [0u8; process::COMMAND_LEN];
    let watcher = mode == Switch::Thread;
    match procfile::ProcFile::create(dir.as_bytes(), pid, signal, watcher, command_name(&mut command), init) {
        Ok(f) => {
            let mut name = sys::Buf::<32>::new();
            name.num(u64::from(pid)).str(process::CONTROL_SUFFIX);
            control::CONTROL_PATH.set(procfile::path_in(dir.as_bytes(), name.bytes()).bytes());
            procfile::set_header(f.header);
            Some(f)
        }
        Err(e) => {
            if say == Say::Errors {
                let mut m = sys::Buf::<512>::new();
                m.str(e).str(" in ").str(dir).str(" (profiling is unavailable)");
                sys::log(m.bytes());
            }
            None
        }
    }
}

/// Starts the watcher thread; if it cannot start, the file says no watcher
/// listens (so `alloctramp enable` says why instead of waiting).
fn start_watcher(first: fn()) {
    if !control::start_watcher(first) {
        sys::log(b"cannot start the watcher thread; this process cannot be switched while it runs");
        // A deferred file will not come.
        registry::make_deferred_file(&EXITING, |_| None);
        PROC.with(|p| {
            if let Some(f) = p.as_ref() {
                f.header.watcher.store(0, Ordering::Release);
            }
        });
    }
}

static MODE: OnceLock<Switch> = OnceLock::new();
static DIR: OnceLock<String> = OnceLock::new();

/// The process forked since it started (a `fork`, which runs the fork
/// handlers: `posix_spawn` and `vfork` children exec at once and never
/// have a counters file). Its exit then looks for the empty files children
/// that ran other programs left.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_in_parent() {
    FORKED.store(true, Ordering::Relaxed);
}

/// How long a process that never profiled waits, in its watcher thread,
/// before it makes its counters file: most such processes are short (a
/// shell's, `make`'s or git's commands, and forked children that run
/// another program at once), need none, and so pay no more than the
/// thread for it.
const FILE_DELAY_NS: u64 = 10_000_000;

/// Makes the counters file of a process whose file was deferred
/// ([`FILE_DELAY_NS`]), in its watcher thread, and keeps the directory
/// within its bound as every watcher does as it starts; then the thread
/// waits for requests (or ends if there is no file). The file is made
/// under the registry's lock, complete (its pending modules counted, its
/// state published) before it can be seen; an exit meanwhile waits for
/// the lock, then removes it. It says nothing if it cannot be made: the
/// program may have closed its stderr by now and reused the descriptor,
/// and a request then says that the process has no file.
fn deferred_file() {
    let mut left = libc::timespec { tv_sec: 0, tv_nsec: FILE_DELAY_NS as i64 };
    // SAFETY: nanosleep reads and writes the two local timespecs; the
    // thread's signals are blocked, so it only returns early on error.
    while unsafe { libc::nanosleep(&left, &mut left) } != 0 && sys::errno() == libc::EINTR {}
    let (Some(dir), Some(&mode)) = (DIR.get(), MODE.get()) else { return };
    let made = registry::make_deferred_file(&EXITING, |init| open_process_file(dir, mode, Say::Nothing, init));
    if made {
        prune_over_bound();
    }
}

extern "C" fn after_fork_in_child() {
    FORKED.store(false, Ordering::Relaxed);
    shards::after_fork_in_child();
    fault::after_fork_in_child();
    if trace::ON.load(Ordering::Relaxed) {
        registry::set_tracing_all(false);
    }
    // The child starts untraced: its sites leave their traced entries
    // once its modules have their own counters.
    let traced = state::TRACED.swap(false, Ordering::Relaxed);
    trace::after_fork_in_child();
    drain::after_fork_in_child();
    let (Some(dir), Some(&mode)) = (DIR.get(), MODE.get()) else { return };
    // The child profiled only if its sites are on now.
    state::PROFILED.store(state::is_on(), Ordering::Relaxed);
    // A child of a process that never profiled has nothing to count into
    // its file until a request switches it on, and the request needs the
    // file: its watcher makes it a little later (`deferred_file`), unless
    // the child has run another program by then.
    // Not with callers capture or fault specs set: their regions and
    // header fields are made with the file, at fork.
    let defer = mode == Switch::Thread
        && !state::PROFILED.load(Ordering::Relaxed)
        && !traced
        && registry::all_pending()
        && state::CALLERS.load(Ordering::Relaxed) == 0
        && !fault::any();
    registry::FILE_DEFERRED.store(defer, Ordering::Relaxed);
    registry::reopen_after_fork(|| if defer { None } else { open_process_file(dir, mode, Say::Errors, |_| {}) });
    callers::after_fork_in_child();
    if traced {
        // (A module that cannot be switched keeps its traced entries, which
        // record nothing with the trace's limits zeroed.)
        let _ = registry::refresh_all();
    }
    state::publish_state();
    fault::publish();
    if fault::any() {
        registry::publish_fail_sites();
    }
    if defer {
        start_watcher(deferred_file);
    } else if mode == Switch::Thread && procfile::header().is_some() {
        start_watcher(prune_over_bound);
    }
}

/// Installs a handler. `alternate`: it may run on the thread's alternate
/// signal stack (SIGTRAP's handler needs little stack; the control signal's
/// switches modules, with a few KiB of buffers, so it runs on the thread's
/// own stack, never on a small alternate one a program set up).
fn install(
    sig: i32,
    handler: extern "C" fn(i32, *mut libc::siginfo_t, *mut c_void),
    alternate: bool,
) -> Option<libc::sigaction> {
    // SAFETY: a zeroed sigaction with our handler, SA_SIGINFO and
    // SA_RESTART (interrupted system calls resume), no signals masked.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | if alternate { libc::SA_ONSTACK } else { 0 };
        libc::sigemptyset(&mut sa.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(sig, &sa, &mut old) == 0).then_some(old)
    }
}

/// The SIGTRAP handler of the patching protocol, installed before the first
/// switch (chaining to the handler the program had, saved before ours is
/// in place).
fn install_trap_handler() {
    if let Some(cur) = sys::disposition(libc::SIGTRAP) {
        control::OLD_TRAP.set(&cur);
    }
    if let Some(old) = install(libc::SIGTRAP, control::on_trap, true) {
        control::OLD_TRAP.set(&old);
    }
}

/// The SIGSEGV and SIGBUS handlers that complete a charge check's read on
/// an unmapped stack, installed before the first switch of a module with
/// hooks. The program's dispositions are saved before ours are in place,
/// and again as the installation found them. They may run on the
/// alternate stack: a stack overflow of the program's reaches its own
/// handler there, as it would have.
fn install_fault_handlers() {
    for (sig, saved) in [(libc::SIGSEGV, &control::OLD_SEGV), (libc::SIGBUS, &control::OLD_BUS)] {
        if let Some(cur) = sys::disposition(sig) {
            saved.set(&cur);
        }
        if let Some(old) = install(sig, control::on_fault, true) {
            saved.set(&old);
        }
    }
}

/// A two-valued environment variable: `values[0]` is true, `values[1]`
/// false; unset or empty is `default`, and so is anything else, with a
/// line that says what was expected and what happens (`then`).
fn env_flag(name: &str, values: [&str; 2], default: bool, then: &str) -> bool {
    match std::env::var(name).as_deref() {
        Ok(v) if v == values[0] => true,
        Ok(v) if v == values[1] => false,
        Ok("") | Err(_) => default,
        Ok(other) => {
            let [yes, no] = values;
            sys::log(format!("{name}={other:?}: expected {yes} or {no}; {then}").as_bytes());
            default
        }
    }
}

/// Start-up: runs as a constructor of the runtime, before the patched
/// modules' initializers.
fn init() {
    if INITIALIZED.swap(true, Ordering::AcqRel) {
        return;
    }
    let inert = secure_execution();
    if inert {
        let _ = CONFIG.set(Config { inert });
        scan_loaded_modules(true);
        return;
    }
    sys::register_barrier();
    let _ = CONFIG.set(Config { inert });
    live::ON_DRAINED.set(control::finish_drain);
    patching::TRAP_HANDLER.set(install_trap_handler);
    patching::FAULT_HANDLER.set(install_fault_handlers);

    let mode = switch_mode();
    let _ = MODE.set(mode);
    // Modules join the process file when they first switch on, where the
    // switch can take the registration lock: not in a signal handler.
    registry::DEFER_PLACEMENT.store(!matches!(mode, Switch::Signal(_)), Ordering::Relaxed);
    if let Some(k) = std::env::var("ALLOCTRAMP_KEEP").ok().and_then(|k| k.parse().ok()) {
        KEEP.store(k, Ordering::Relaxed);
    }
    let live = env_flag("ALLOCTRAMP_LIVE", ["1", "0"], true, "tracking live objects");
    state::LIVE.store(live, Ordering::Release);
    shards::init();
    shards::set_reserve(registry::reserve_shard);
    let on = env_flag("ALLOCTRAMP", ["on", "off"], false, "profiling stays off");
    let dir = counters_dir();
    let fail_spec = std::env::var("ALLOCTRAMP_FAIL").ok();
    // ALLOCTRAMP_TRACE=on records for a drainer outside; =DIR (a path:
    // it has a slash) drains too; =on:PID (what `alloctramp run --trace`
    // sets, PID its own) records only in a process whose parent is PID:
    // the program the command started and drains, not the programs that
    // one starts, which inherit the variable and which nobody drains.
    let trace_value = std::env::var("ALLOCTRAMP_TRACE").unwrap_or_default();
    let trace_dir = trace_value.contains('/').then(|| trace_value.clone());
    let parent = trace_value.strip_prefix("on:").filter(|_| trace_dir.is_none()).map(|p| p.parse::<i32>());
    if trace_dir.is_none() && !["", "on", "off"].contains(&trace_value.as_str()) && !matches!(parent, Some(Ok(_))) {
        sys::log(
            format!(
                "ALLOCTRAMP_TRACE={trace_value:?}: expected on, off, on:PID or a directory (a path with a /); \
                 no events recorded"
            )
            .as_bytes(),
        );
    }
    // SAFETY: getppid has no preconditions.
    let for_me = |pid: i32| pid == unsafe { libc::getppid() };
    let recording = trace_value == "on" || matches!(parent, Some(Ok(pid)) if for_me(pid));
    let wants_trace = live && (trace_dir.is_some() || recording);
    let callers_value = std::env::var("ALLOCTRAMP_CALLERS").ok();
    let capture = callers_value.as_deref().is_some_and(|v| callers::depth_from_env(v) != Some(0));

    // A process that starts with nothing to count (off, switched by its
    // watcher thread, with no fault spec, trace or callers capture, whose
    // regions and header fields come with the file) has no use for its
    // file until a request switches it on, and the request needs the
    // file: the watcher makes it a little later (`deferred_file`), so a
    // short command run without profiling makes none. Meanwhile its
    // modules register pending, as with the file.
    let ready = counters_dir_ready(&dir, Say::Errors);
    let defer = ready && mode == Switch::Thread && !on && fail_spec.is_none() && !wants_trace && !capture;
    registry::FILE_DEFERRED.store(defer, Ordering::Relaxed);
    let f = if ready && !defer { create_process_file(&dir, mode, Say::Errors, |_| {}) } else { None };
    let have_file = f.is_some();
    PROC.with(|p| *p = f);
    // Fault injection acts on sites that are on: specs at start switch
    // profiling on.
    let fail = have_file && fail_spec.is_some_and(|v| fault::set_from_env(v.as_bytes()));
    let traced = have_file && wants_trace;
    // Without its file the process is not profiled: figures nobody can
    // read would cost the program what profiling costs.
    let on = (on || fail || traced) && have_file;
    if on {
        state::WANT.store(state::Sites::On as u8, Ordering::Release);
    }
    // The shadow map is reserved when profiling first goes on: now if it
    // starts on, or if requests will be carried out in a signal handler
    // (which cannot take the registration lock); otherwise by the watcher
    // thread at the first request. Before any module registers.
    if have_file
        && (on || matches!(mode, Switch::Signal(_)))
        && let Err(e) = registry::prepare_live()
    {
        state::report_error(e);
    }
    // Before any module registers: each turns tracing on as it turns live
    // tracking on.
    if traced {
        match trace::start() {
            Ok(()) => state::TRACED.store(trace::records_every_event(), Ordering::Release),
            Err(e) => state::report_error(e),
        }
    }
    registry::CAPTURE.store(callers::capture as *const () as usize as u64, Ordering::Relaxed);
    if let Some(v) = callers_value {
        match callers::depth_from_env(&v) {
            Some(d) => {
                if let Err(e) = callers::set_depth(d) {
                    sys::log(e.as_bytes());
                }
            }
            None => sys::log(format!("ALLOCTRAMP_CALLERS={v:?}: expected on, off or a depth 1 to 8").as_bytes()),
        }
    }
    state::publish_state();
    let _ = DIR.set(dir);

    if let (Switch::Signal(n), true) = (mode, have_file) {
        // Requests are carried out in the handler, where `dlsym` is not
        // for calling: looked up now. Otherwise when first needed.
        foreign::look_up_now();
        install(n, control::on_signal, false);
    }
    // SAFETY: registering fork handlers that run in the parent and the
    // child.
    unsafe { libc::pthread_atfork(None, Some(after_fork_in_parent), Some(after_fork_in_child)) };
    scan_loaded_modules(false);
    if fault::any()
        && registry::publish_fail_sites()
        && let Err(e) = registry::refresh_all()
    {
        state::report_error(e);
    }
    if let Some(dir) = trace_dir.filter(|_| traced && trace::ON.load(Ordering::Relaxed)) {
        if mode == Switch::Thread {
            drain::start(&dir);
        } else {
            sys::log(
                b"ALLOCTRAMP_TRACE=DIR: the process drains its trace on its watcher thread, which \
                ALLOCTRAMP_SWITCH=signal or none does not start; `alloctramp trace PID -o DIR` drains it",
            );
        }
    }
    if defer {
        start_watcher(deferred_file);
    } else if mode == Switch::Thread && have_file {
        start_watcher(prune_over_bound);
    }
}

/// Registers every patched module already loaded (the program and its
/// libraries): their site tables follow the program headers in a segment
/// that maps the ELF header above the module's other segments.
fn scan_loaded_modules(inert: bool) {
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> i32 {
        // SAFETY: dl_iterate_phdr passes a valid info for a loaded object.
        let info = unsafe { &*info };
        let inert = data as usize == 1;
        let phdrs = info.dlpi_phdr;
        if phdrs.is_null() {
            return 0;
        }
        // SAFETY: dlpi_phnum program headers at dlpi_phdr.
        let phdrs = unsafe { std::slice::from_raw_parts(phdrs, info.dlpi_phnum as usize) };
        let lowest = phdrs.iter().filter(|p| p.p_type == libc::PT_LOAD).map(|p| p.p_vaddr).min();
        for p in phdrs.iter().filter(|p| p.p_type == libc::PT_LOAD && p.p_offset == 0 && read_only(p)) {
            if Some(p.p_vaddr) == lowest || p.p_filesz < 64 {
                continue;
            }
            let start = info.dlpi_addr.wrapping_add(p.p_vaddr) as *const u8;
            // SAFETY: the segment is mapped, p_filesz bytes from its start.
            let seg = unsafe { std::slice::from_raw_parts(start, p.p_filesz as usize) };
            if let Some(at) = layout::table_after_phdrs(seg)
                && let Some(module) = segments(info.dlpi_addr, phdrs, start as u64 + at as u64)
            {
                // SAFETY: a site table inside a loaded module's read-only
                // segment, which holds `module.room` bytes from it.
                unsafe { registry::register(start.add(at), &module, inert) };
            }
        }
        0
    }
    // SAFETY: the callback only reads what dl_iterate_phdr hands it.
    unsafe { libc::dl_iterate_phdr(Some(each), usize::from(inert) as *mut c_void) };
}

/// Runs the runtime's start-up as a constructor.
#[used]
#[unsafe(link_section = ".init_array")]
static INIT: extern "C" fn() = {
    extern "C" fn run() {
        init();
    }
    run
};

/// At exit: the counters file of a process that profiled becomes its final
/// snapshot; a process that never profiled removes its file.
#[used]
#[unsafe(link_section = ".fini_array")]
static FINI: extern "C" fn() = {
    extern "C" fn run() {
        at_exit();
    }
    run
};

/// The process is exiting: a deferred file is not made.
static EXITING: AtomicBool = AtomicBool::new(false);

/// The runtime's work at exit (a destructor of the runtime; in a static
/// program, a hook on the program's own destructors).
pub fn at_exit() {
    // (Under the registry's lock: a deferred file that arrives later
    // removes itself.)
    PROC.with(|_| EXITING.store(true, Ordering::Release));
    if procfile::header().is_none() {
        return;
    }
    // The mappings as they are at the end, for naming chains' frames.
    callers::snapshot_maps();
    PROC.with(|p| {
        let Some(f) = p.as_mut() else { return };
        if state::PROFILED.load(Ordering::Relaxed) {
            if let Some(n) = registry::tracked_objects() {
                live::publish_objects(n);
            }
            f.header.exited.store(1, Ordering::Release);
        } else {
            f.remove();
        }
    });
    // A trace under way keeps its file: the drainer reads the last
    // events after the process is gone, and removes it, unless the
    // process is its own drainer.
    if drain::active() {
        drain::finish();
    }
    if !trace::ON.load(Ordering::Relaxed) {
        procfile::remove_trace_file();
    }
    // A process that keeps its file keeps the directory within its
    // bound; others leave that to the watcher threads.
    if state::PROFILED.load(Ordering::Relaxed) {
        // SAFETY: getpid has no preconditions.
        let me = FORKED.load(Ordering::Relaxed).then(|| unsafe { libc::getpid() } as u32);
        prune(me);
    }
}

/// How many files of ended processes stay (`ALLOCTRAMP_KEEP`), read at
/// start-up.
static KEEP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(process::DEFAULT_KEEP);

/// Prunes the counters directory, at exit in a process that keeps its file.
/// A process that forked (`children_of`: its PID) reads the files of
/// processes with higher PIDs, so that the empty files its children left
/// when they ran other programs go; otherwise a directory within its bound
/// costs only the reading of its names.
fn prune(children_of: Option<u32>) {
    if let Some(dir) = DIR.get() {
        procfile::prune(dir, KEEP.load(Ordering::Relaxed), children_of);
    }
}

/// Prunes a directory over its bound, in the watcher thread as it starts
/// (the program does not wait for it): a process that never profiles reads
/// only the directory's names.
fn prune_over_bound() {
    prune(None);
}

/// Called by a module's init stub.
///
/// # Safety
/// `table` must be the run-time address of a module's site table.
unsafe extern "C" fn register(table: *const u8) {
    init();
    let inert = CONFIG.get().is_none_or(|c| c.inert);
    if registry::is_registered(table) {
        // Found at start-up, before its initializers ran.
        return;
    }
    let Some(module) = module_of(table as u64) else {
        sys::log(b"a module registered a site table outside its read-only segments; it is not profiled");
        return;
    };
    // SAFETY: the table's module is loaded (its init stub is running), and
    // `module.room` bytes of the read-only segment that holds it follow it.
    unsafe { registry::register(table, &module, inert) };
    // A module loaded while chains are recorded: its mapping names frames.
    if state::CALLERS.load(Ordering::Relaxed) != 0 {
        callers::snapshot_maps();
    }
}

fn read_only(p: &libc::Elf64_Phdr) -> bool {
    p.p_flags & libc::PF_R != 0 && p.p_flags & libc::PF_W == 0
}

/// The segments of the object loaded at `bias` with program headers
/// `phdrs`, if `table` lies in one of its read-only segments.
fn segments(bias: u64, phdrs: &[libc::Elf64_Phdr], table: u64) -> Option<registry::Segments> {
    let loads = phdrs.iter().filter(|p| p.p_type == libc::PT_LOAD);
    let room = loads.clone().filter(|p| read_only(p)).find_map(|p| {
        let start = bias.wrapping_add(p.p_vaddr);
        let end = start.checked_add(p.p_filesz)?;
        (start..end).contains(&table).then(|| usize::try_from(end - table).ok()).flatten()
    })?;
    let mut writable = [(0, 0); 8];
    for (w, p) in writable.iter_mut().zip(loads.filter(|p| p.p_flags & libc::PF_W != 0)) {
        let start = bias.wrapping_add(p.p_vaddr);
        *w = (start, start.saturating_add(p.p_memsz));
    }
    Some(registry::Segments { room, writable })
}

/// The segments of the loaded object whose read-only segment holds `table`
/// (the loader's view of every object's program headers).
fn module_of(table: u64) -> Option<registry::Segments> {
    struct Find {
        table: u64,
        found: Option<registry::Segments>,
    }
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> i32 {
        // SAFETY: dl_iterate_phdr passes a valid info and our `Find`.
        let (info, find) = unsafe { (&*info, &mut *(data as *mut Find)) };
        if info.dlpi_phdr.is_null() {
            return 0;
        }
        // SAFETY: dlpi_phnum program headers at dlpi_phdr.
        let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
        find.found = segments(info.dlpi_addr, phdrs, find.table);
        i32::from(find.found.is_some())
    }
    let mut find = Find { table, found: None };
    // SAFETY: the callback only reads what dl_iterate_phdr hands it and
    // writes `find`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut find as *mut Find).cast()) };
    find.found
}

/// Called by a module's fini stub.
///
/// # Safety
/// `table` must be the run-time address of a module's site table.
unsafe extern "C" fn unregister(table: *const u8) {
    // A process that drains its own trace describes the module's sites
    // before they go: it may have been loaded since the last drain.
    if drain::active() {
        drain::run(false);
    }
    registry::unregister(table);
}

/// The runtime's layers, lowest first: a module may use only modules of
/// lower layers (checked by a test), so what a signal handler or a
/// trampoline can reach is read from a few files.
#[cfg(test)]
const LAYERS: &[&[&str]] = &[
    &["sys", "tls"],
    &["shards", "image"],
    &["procfile"],
    &["state", "fault", "trace"],
    &["patching", "live", "foreign"],
    &["unwinding"],
    &["registry"],
    &["callers", "drain"],
    &["control"],
    &["lib"],
];

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn signal_names() {
        assert_eq!(parse_signal("none"), Ok(0));
        assert_eq!(parse_signal("USR2"), Ok(libc::SIGUSR2));
        assert_eq!(parse_signal("sigusr1"), Ok(libc::SIGUSR1));
        assert_eq!(parse_signal("12"), Ok(12));
        assert_eq!(parse_signal("RTMAX-7"), Ok(libc::SIGRTMAX() - 7));
        assert_eq!(parse_signal("RTMIN+2"), Ok(libc::SIGRTMIN() + 2));
        assert!(parse_signal("BOGUS").is_err());
        assert!(parse_signal("999").is_err());
    }

    #[test]
    fn modules_import_only_lower_layers() {
        let layer = |m: &str| LAYERS.iter().position(|l| l.contains(&m));
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            let name = path.file_stem().unwrap().to_str().unwrap().to_string();
            let mine = layer(&name).unwrap_or_else(|| panic!("{name}.rs is in no layer"));
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap();
            for (i, _) in code.match_indices("crate::") {
                let rest = &code[i + 7..];
                let names: Vec<&str> = if let Some(list) = rest.strip_prefix('{') {
                    list[..list.find('}').unwrap()].split(',').map(|n| n.split("::").next().unwrap().trim()).collect()
                } else {
                    vec![rest.split(|c: char| !c.is_alphanumeric() && c != '_').next().unwrap()]
                };
                for used in names.into_iter().filter(|n| layer(n).is_some()) {
                    assert!(layer(used).unwrap() < mine, "{name}.rs uses {used}, which is not below it");
                }
            }
        }
    }
}
