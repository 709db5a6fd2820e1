//! The dynamic loader's audit library of `alloctramp run` (rtld-audit(7)):
//! the processes `run` starts load it through `LD_AUDIT`, and it hands the
//! loader a patched copy, from the cache, of every shared library the
//! program loads, at start (`DT_NEEDED`) and later (`dlopen`), by name or
//! by path. With `--follow-exec` it also replaces an unpatched program
//! with its patched copy before the program's first instruction runs.
//!
//! How: for each file the loader is about to open (`la_objsearch`, once per
//! candidate path), it looks the file up in the run's index: a directory of
//! symbolic links, one per file identity ([`index_key`]), to the patched
//! copy, or to [`NOT_PATCHED`]. On a miss it runs `alloctramp
//! cache-library FILE` (the index's writer, without `LD_AUDIT`) and waits:
//! a library is patched once per build and reused by every later run.
//! Without a usable answer the loader opens the original file, unprofiled.
//!
//! What it leaves alone: the C library's own files (the allocator and the
//! code around it: see [`excluded`]) and alloctramp's. Audit libraries
//! live in their own link-map namespace with their own C library, so this
//! library's allocations are invisible to the program's profile.
//!
//! Everything it needs comes from the environment `run` sets ([`ENV_EXE`],
//! [`ENV_INDEX`], [`ENV_PROGRAM`], [`ENV_FOLLOW`]); in a process that has
//! none of it, or that `run` does not profile, `la_version` returns 0 and
//! the loader unloads it at once.

#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr, c_char, c_uint};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The library's file name, installed beside the runtime library.
pub const SONAME: &str = "liballoctramp_audit.so";
/// The `alloctramp` executable that patches a library on a miss.
pub const ENV_EXE: &str = "ALLOCTRAMP_RUN_EXE";
/// The index directory (links named by [`index_key`]).
pub const ENV_INDEX: &str = "ALLOCTRAMP_RUN_INDEX";
/// The runtime library every patched module of the process loads: each
/// copy beside a cached file is redirected to this one, so that the
/// process loads it once (the loader tells files apart by inode).
pub const ENV_RUNTIME: &str = "ALLOCTRAMP_RUN_RUNTIME";
/// The cache of patched copies (read by [`CACHE_COMMAND`]).
pub const ENV_CACHE: &str = "ALLOCTRAMP_RUN_CACHE";
/// The `--entry` specs of the run, one per line (read by [`CACHE_COMMAND`]).
pub const ENV_ENTRIES: &str = "ALLOCTRAMP_RUN_ENTRIES";
/// The patched program `run` started (canonical path): without
/// [`ENV_FOLLOW`], only a process running it gets patched libraries.
pub const ENV_PROGRAM: &str = "ALLOCTRAMP_RUN_PROGRAM";
/// `1`: every program executed in the tree is profiled (`--follow-exec`).
pub const ENV_FOLLOW: &str = "ALLOCTRAMP_RUN_FOLLOW";
/// The hidden `alloctramp` subcommand that fills the index.
pub const CACHE_COMMAND: &str = "cache-library";
/// The target of an index link for a file that is not patched (no
/// allocation sites, or a file the patcher refuses).
pub const NOT_PATCHED: &str = "-";

/// The index entry of a file: its identity and version as `stat` sees
/// them (device, inode, size, modification time), so that a file replaced
/// or rebuilt in place is looked up afresh. The copy it names is keyed by
/// build id (`run`'s cache), so the patching itself is done once per
/// build whatever the path.
pub fn index_key(meta: &std::fs::Metadata) -> String {
    format!("{:x}-{:x}-{:x}-{}.{:09}", meta.dev(), meta.ino(), meta.size(), meta.mtime(), meta.mtime_nsec())
}

/// Files never patched: the C library's (the allocator itself, the
/// loader, and the libraries built with it, whose calls to `malloc` are
/// the allocator's own business), the compiler's unwinder (`libgcc_s`,
/// whose allocations are its own frame tables) and alloctramp's.
pub fn excluded(base: &[u8]) -> bool {
    const PREFIXES: &[&str] = &[
        "ld-linux",
        "libc.so",
        "libm.so",
        "libmvec.so",
        "libpthread.so",
        "libdl.so",
        "librt.so",
        "libresolv.so",
        "libutil.so",
        "libanl.so",
        "libnsl.so",
        "libnss_",
        "libBrokenLocale.so",
        "libc_malloc_debug.so",
        "libthread_db.so",
        "libmemusage.so",
        "libpcprofile.so",
        "libSegFault.so",
        "libgcc_s.so",
        "liballoctramp_",
    ];
    PREFIXES.iter().any(|p| base.starts_with(p.as_bytes()))
}

struct Config {
    exe: PathBuf,
    index: PathBuf,
    /// The runtime's path, and its file name.
    runtime: Option<CString>,
    runtime_name: Vec<u8>,
    /// The run's variables, for [`CACHE_COMMAND`] (the process's own
    /// environment may have lost them: [`hide_variables`]).
    vars: Vec<(std::ffi::OsString, std::ffi::OsString)>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();
/// Answers given so far, by the path the loader asked about: the loader
/// keeps the returned string, so each is allocated once and kept.
static ANSWERS: Mutex<Option<HashMap<Vec<u8>, Option<&'static CStr>>>> = Mutex::new(None);

// rtld-audit(7): the search flags of `la_objsearch`.
const LA_SER_ORIG: c_uint = 0x01;

/// The loader's first call: the interface version it speaks. Returning 0
/// unloads this library (a process `run` does not profile).
#[unsafe(no_mangle)]
pub extern "C" fn la_version(version: c_uint) -> c_uint {
    let (Some(exe), Some(index)) = (std::env::var_os(ENV_EXE), std::env::var_os(ENV_INDEX)) else {
        return 0;
    };
    let runtime = std::env::var_os(ENV_RUNTIME).and_then(|r| CString::new(r.into_vec()).ok());
    let runtime_name = runtime.as_ref().map_or(Vec::new(), |r| {
        let r = r.as_bytes();
        r.rsplit(|&b| b == b'/').next().unwrap_or(r).to_vec()
    });
    let vars = std::env::vars_os().filter(|(k, _)| k.as_bytes().starts_with(b"ALLOCTRAMP_RUN_")).collect();
    let config = Config { exe: exe.into(), index: index.into(), runtime, runtime_name, vars };
    let me = std::fs::read_link("/proc/self/exe").ok();
    if std::env::var_os(ENV_FOLLOW).is_some_and(|v| v == "1") {
        // Every program in the tree: this one too, before it starts.
        if let Some(me) = &me
            && let Some(copy) = lookup(&config, me)
            && copy != *me
        {
            reexec(&copy);
        }
    } else if me.as_deref().map(Path::as_os_str) != std::env::var_os(ENV_PROGRAM).as_deref() {
        return 0;
    } else {
        // Only this process: the program and its children do not see the
        // run's variables (the loader has read LD_AUDIT already).
        // SAFETY: nothing else runs yet; `environ` is the initial array.
        unsafe { hide_variables() };
    }
    let _ = CONFIG.set(config);
    version
}

/// Takes the run's variables out of the process's environment, in place
/// (the program's C library reads the same array when it starts); other
/// audit libraries in `LD_AUDIT` stay.
///
/// # Safety
/// Only before the program runs, with no other thread.
unsafe fn hide_variables() {
    let ours = |e: &[u8]| ["ALLOCTRAMP_RUN_", "LD_AUDIT="].iter().any(|p| e.starts_with(p.as_bytes()));
    // SAFETY: `environ` is a NULL-terminated array of NUL-terminated
    // strings; entries are only moved towards its start, or replaced by
    // strings that live as long as the process.
    unsafe {
        let mut from = libc::environ;
        if from.is_null() {
            return;
        }
        let mut to = from;
        while !(*from).is_null() {
            let e = CStr::from_ptr(*from).to_bytes();
            let keep = match e.strip_prefix(b"LD_AUDIT=") {
                // Ours comes first (`run` puts it there).
                Some(list) => match list.iter().position(|&b| b == b':') {
                    Some(at) => CString::new([b"LD_AUDIT=", &list[at + 1..]].concat())
                        .ok()
                        .map(|c| Box::leak(c.into_boxed_c_str()).as_ptr().cast_mut()),
                    None => None,
                },
                None => (!ours(e)).then_some(*from),
            };
            if let Some(k) = keep {
                *to = k;
                to = to.add(1);
            }
            from = from.add(1);
        }
        *to = std::ptr::null_mut();
    }
}

/// The loader is about to open `name` (`flag`: which search found it).
/// The answer is the file to open instead: the patched copy, or `name`.
///
/// # Safety
/// Called by the dynamic loader with a NUL-terminated `name`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn la_objsearch(name: *const c_char, _cookie: *mut usize, flag: c_uint) -> *const c_char {
    let Some(config) = CONFIG.get() else { return name };
    if name.is_null() {
        return name;
    }
    // SAFETY: the loader passes a NUL-terminated string that outlives the call.
    let path = unsafe { CStr::from_ptr(name) }.to_bytes();
    // A bare name is searched for next, one candidate path at a time.
    if flag == LA_SER_ORIG && !path.contains(&b'/') {
        return name;
    }
    let base = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
    if let Some(runtime) = &config.runtime
        && base == config.runtime_name
    {
        return runtime.as_ptr();
    }
    if excluded(base) {
        return name;
    }
    let mut answers = ANSWERS.lock().unwrap_or_else(|e| e.into_inner());
    let answers = answers.get_or_insert_with(HashMap::new);
    let answer = *answers.entry(path.to_vec()).or_insert_with(|| {
        let copy = lookup(config, Path::new(OsStr::from_bytes(path)))?;
        let copy = CString::new(copy.into_os_string().into_vec()).ok()?;
        Some(&*Box::leak(copy.into_boxed_c_str()))
    });
    answer.map_or(name, CStr::as_ptr)
}

/// The patched copy of `file`, patched now on a miss; `None` to use the
/// file as it is.
fn lookup(config: &Config, file: &Path) -> Option<PathBuf> {
    let meta = std::fs::metadata(file).ok().filter(std::fs::Metadata::is_file)?;
    let link = config.index.join(index_key(&meta));
    for attempt in 0..2 {
        if let Ok(target) = std::fs::read_link(&link) {
            if target.as_os_str() == NOT_PATCHED {
                return None;
            }
            // A copy removed since (`alloctramp clean`) is patched again.
            if target.is_file() {
                return Some(target);
            }
        }
        if attempt == 0 {
            fill(config, file);
        }
    }
    None
}

/// Runs `alloctramp cache-library FILE` and waits for it. Its messages go
/// to the program's stderr, as `run`'s own do; nothing goes to stdout.
///
/// The child is the program's only in appearance. The program's child is
/// made with no exit signal (`clone` with an exit signal of 0), so the
/// program gets no `SIGCHLD` for it and its own `wait` calls (which
/// without `__WALL` only see children that signal) never reap it; an
/// `execve` would make the exit signal `SIGCHLD` again, so that child runs
/// alloctramp as its own child (with `SIGCHLD` at its default), waits for
/// it and exits.
fn fill(config: &Config, file: &Path) {
    let c = |b: &[u8]| CString::new(b).ok();
    let mut env: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| k != "LD_AUDIT" && !k.as_bytes().starts_with(b"ALLOCTRAMP_RUN_"))
        .chain(config.vars.iter().cloned())
        .filter_map(|(k, v)| c(&[k.as_bytes(), b"=", v.as_bytes()].concat()))
        .collect();
    env.sort();
    let (Some(exe), Some(arg), Some(path), Some(null)) = (
        c(config.exe.as_os_str().as_bytes()),
        c(CACHE_COMMAND.as_bytes()),
        c(file.as_os_str().as_bytes()),
        c(b"/dev/null"),
    ) else {
        return;
    };
    let argv = [exe.as_ptr(), arg.as_ptr(), path.as_ptr(), std::ptr::null()];
    let envp: Vec<*const c_char> = env.iter().map(|e| e.as_ptr()).chain([std::ptr::null()]).collect();
    // SAFETY: a fork without an exit signal (no CLONE_VM: the child has its
    // own copy of memory, stack included). The child calls only
    // async-signal-safe functions, on memory prepared above.
    let pid = unsafe { fork_with_signal(0) };
    if pid == 0 {
        // SAFETY: in the child: only system calls, then exit.
        unsafe {
            libc::signal(libc::SIGCHLD, libc::SIG_DFL);
            let worker = fork_with_signal(libc::SIGCHLD);
            if worker == 0 {
                let fd = libc::open(null.as_ptr(), libc::O_RDWR);
                if fd >= 0 {
                    libc::dup2(fd, 0);
                    libc::dup2(fd, 1);
                    if fd > 2 {
                        libc::close(fd);
                    }
                }
                libc::execve(exe.as_ptr(), argv.as_ptr(), envp.as_ptr());
                libc::_exit(127);
            }
            let mut status = 0;
            while worker > 0 && libc::waitpid(worker, &mut status, 0) < 0 && *libc::__errno_location() == libc::EINTR {}
            libc::_exit(0);
        }
    }
    if pid < 0 {
        return;
    }
    let mut status = 0;
    // SAFETY: waiting for our own child (`__WALL`: it sends no signal).
    while unsafe { libc::waitpid(pid, &mut status, libc::__WALL) } < 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
    {}
}

/// `fork` as the system call, with `signal` as the child's exit signal (0:
/// none), and none of the C library's fork handlers.
///
/// # Safety
/// As `fork` in a process that may have threads: the child may only call
/// async-signal-safe functions.
unsafe fn fork_with_signal(signal: libc::c_int) -> libc::pid_t {
    // SAFETY: clone with no stack and no sharing flags is fork.
    let pid = unsafe { libc::syscall(libc::SYS_clone, signal as libc::c_ulong, 0 as libc::c_ulong, 0, 0, 0) };
    pid as libc::pid_t
}

/// Replaces this process's program with `copy`, with the same arguments
/// and environment (as the kernel gave them: nothing has run yet). Returns
/// only if that fails, and the program then runs as it is.
fn reexec(copy: &Path) {
    // NUL-terminated strings, end to end; an empty argument stays.
    let split = |bytes: Vec<u8>| -> Vec<CString> {
        match bytes.strip_suffix(&[0]) {
            Some(all) => all.split(|&b| b == 0).filter_map(|s| CString::new(s).ok()).collect(),
            None => Vec::new(),
        }
    };
    let (Ok(args), Ok(env)) = (std::fs::read("/proc/self/cmdline"), std::fs::read("/proc/self/environ")) else {
        return;
    };
    let (args, env) = (split(args), split(env));
    let Ok(path) = CString::new(copy.as_os_str().as_bytes()) else { return };
    let argv: Vec<*const c_char> = args.iter().map(|a| a.as_ptr()).chain([std::ptr::null()]).collect();
    let envp: Vec<*const c_char> = env.iter().map(|a| a.as_ptr()).chain([std::ptr::null()]).collect();
    // SAFETY: NUL-terminated strings in NULL-terminated arrays that outlive
    // the call (which returns only on failure).
    unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
}
