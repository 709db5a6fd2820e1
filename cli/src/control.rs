//! Finding a process's counters file, and the commands that talk to a
//! running process: `enable`, `disable [--now]`, `reset`.

use crate::util::Snapshot;
use alloctramp_trampolines::entry::Kind;
use alloctramp_trampolines::process::{self, ProcHeader, ProcessFile, Request, flags};
use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Where this user's process files are: `--dir`, else `$ALLOCTRAMP_DIR`,
/// else the runtime's default.
pub fn counters_dir(explicit: Option<&Path>) -> PathBuf {
    if let Some(d) = explicit {
        return d.to_path_buf();
    }
    if let Some(d) = std::env::var_os("ALLOCTRAMP_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    PathBuf::from(process::default_dir(std::env::var("XDG_RUNTIME_DIR").ok().as_deref(), euid()))
}

pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The owner of a running process, if it exists.
pub fn process_owner(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let uids = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    // Real, effective, saved, filesystem: the effective uid decides.
    uids.split_whitespace().nth(1)?.parse().ok()
}

pub fn process_exists(pid: u32) -> bool {
    pid != 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// A process's start time in seconds since the epoch (from /proc).
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let ticks: u64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let btime: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(btime + ticks / hz)
}

/// The process that wrote a counters file is the one running under its pid
/// now (not exited, the pid not reused since, the program not replaced by
/// `exec`).
pub fn file_process_running(pf: &ProcessFile) -> bool {
    if pf.exited || !process_exists(pf.pid) {
        return false;
    }
    let exe = pf.exe;
    if exe != (0, 0)
        && let Ok(m) = std::fs::metadata(format!("/proc/{}/exe", pf.pid))
    {
        use std::os::unix::fs::MetadataExt;
        if (m.dev(), m.ino()) != exe {
            return false;
        }
    }
    match process_start_time(pf.pid) {
        // Both are whole seconds, taken a moment apart.
        Some(t) if pf.start_time != 0 => t.abs_diff(pf.start_time) <= 2,
        _ => true,
    }
}

/// Whether process `pid` runs the runtime: its library is mapped (a
/// dynamically linked patched program), or a thread is named as the
/// watcher names itself (a static program carries the runtime in its own
/// file).
fn runs_runtime(pid: u32) -> bool {
    let name = format!("/{}", alloctramp_trampolines::layout::RUNTIME_SONAME);
    let mapped = std::fs::read(format!("/proc/{pid}/maps"))
        .is_ok_and(|m| m.split(|&b| b == b'\n').any(|l| l.ends_with(name.as_bytes())));
    mapped
        || std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
            tasks.flatten().any(|t| std::fs::read(t.path().join("comm")).is_ok_and(|c| c.trim_ascii() == b"alloctramp"))
        })
}

/// Whether the counters file at `path` is the one of the process now
/// running under its pid (not one left before an `exec`, or by an earlier
/// process given the same pid).
fn file_of_running_process(path: &Path) -> bool {
    use std::io::Read;
    let mut head = vec![0u8; process::PROC_HEADER_SIZE as usize];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok()
        && ProcessFile::parse(&head).is_ok_and(|pf| file_process_running(&pf))
}

/// `ALLOCTRAMP_DIR` as set in a running process's environment (readable
/// for our own processes).
fn dir_from_environ(pid: u32) -> Option<PathBuf> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| kv.strip_prefix(b"ALLOCTRAMP_DIR=")).filter(|v| !v.is_empty()).map(|v| {
        use std::os::unix::ffi::OsStrExt;
        PathBuf::from(std::ffi::OsStr::from_bytes(v))
    })
}

/// What the user named: a process or a file.
pub enum Target {
    Pid(u32),
    File(PathBuf),
}

pub fn parse_target(target: &str) -> Target {
    match target.parse::<u32>() {
        Ok(pid) if !target.starts_with('+') => Target::Pid(pid),
        _ => Target::File(PathBuf::from(target)),
    }
}

/// The counters file of process `pid`: in `dir`, else where the process's
/// own `ALLOCTRAMP_DIR` points. The error says why there is none.
pub fn pid_file(pid: u32, dir: &Path) -> Result<PathBuf> {
    let p = dir.join(process::counters_file_name(pid));
    let running = process_exists(pid);
    if p.exists() && (!running || file_of_running_process(&p)) {
        return Ok(p);
    }
    if !running {
        bail!("no process {pid} (and no counters file {})", p.display());
    }
    if let Some(owner) = process_owner(pid)
        && owner != euid()
        && euid() != 0
    {
        bail!("process {pid} belongs to another user (uid {owner}); run alloctramp as that user");
    }
    let elsewhere = dir_from_environ(pid).map(|d| d.join(process::counters_file_name(pid)));
    // A process that starts with profiling off (and a forked child of a
    // process that never profiled) makes its file 10 ms after it starts
    // (replacing one an earlier program under its pid left): waited for
    // half a second, or five once the runtime is seen running (a busy
    // machine may run its watcher thread late).
    let start = std::time::Instant::now();
    let waited = |limit_ms| start.elapsed() >= std::time::Duration::from_millis(limit_ms);
    let files = || [Some(&p), elsewhere.as_ref()].into_iter().flatten().filter(|q| q.exists());
    loop {
        if let Some(q) = files().find(|q| file_of_running_process(q)) {
            return Ok(q.clone());
        }
        if !process_exists(pid) || waited(5000) || (waited(500) && !runs_runtime(pid)) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The file an earlier program under this pid left: its final figures.
    if let Some(q) = files().next() {
        return Ok(q.clone());
    }
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if runs_runtime(pid) {
        bail!(
            "process {pid} ({}) runs patched code but has no counters file {} (its directory was unusable, \
             see the process's stderr at its start)",
            comm.trim(),
            p.display()
        )
    }
    bail!("process {pid} ({}) runs no patched code (no {})", comm.trim(), p.display())
}

/// Switch profiling in a running process.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  alloctramp enable 12345\n  alloctramp disable --now 12345")]
pub struct SwitchArgs {
    /// The process id.
    pub pid: u32,
    /// Where process counters files are [default: $ALLOCTRAMP_DIR, else
    /// $XDG_RUNTIME_DIR/alloctramp, else /tmp/alloctramp-UID].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Seconds to wait for the process to act on the request.
    #[arg(long, default_value_t = 5.0, value_name = "SECONDS")]
    pub timeout: f64,
}

/// Switch profiling off in a running process.
#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  alloctramp disable 12345        # free sites stay on until tracked objects are freed\n  \
                        alloctramp disable --now 12345  # everything off at once"
)]
pub struct DisableArgs {
    #[command(flatten)]
    pub switch: SwitchArgs,
    /// Switch every site off at once, free sites included (objects still
    /// live are no longer seen leaving: live figures become incomplete).
    #[arg(long)]
    pub now: bool,
}

/// Record the call chains that reach the sites of a running process
/// (callers capture), or stop.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  alloctramp callers 12345 on            # chains of 4 frames\n  \
                        alloctramp callers 12345 on --depth 8\n  \
                        alloctramp report 12345 --callers\n  \
                        alloctramp callers 12345 off")]
pub struct CallersArgs {
    #[command(flatten)]
    pub switch: SwitchArgs,
    /// `on` or `off`.
    #[arg(value_parser = ["on", "off"])]
    pub state: String,
    /// Frames recorded per chain (1 to 8).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub depth: u32,
    /// Only the sites SPEC names (any number of times, 16 sites at most):
    /// FILE:LINE (a file name or a path suffix), a function name, or
    /// [MODULE:]0xADDRESS (in its module's file, or at run time). Default:
    /// every site.
    #[arg(long = "site", value_name = "SPEC")]
    pub sites: Vec<String>,
}

pub fn run_callers(args: &CallersArgs) -> Result<()> {
    let request = if args.state == "on" { Request::Callers } else { Request::NoCallers };
    if request == Request::NoCallers && !args.sites.is_empty() {
        bail!("callers off stops every site: --site is for `on`");
    }
    let sites = select_sites(&args.switch, &args.sites)?;
    let path = pid_file(args.switch.pid, &counters_dir(args.switch.dir.as_deref()))?;
    // Rows for libraries loaded with dlopen, for a process that can take
    // the request (switch_with says why another cannot); without them
    // chains end at such libraries, as before.
    let takes = read_state(&path).is_ok_and(|s| !s.exited && (s.watcher || s.signal != 0));
    let written = match request == Request::Callers && takes {
        true => write_unwind_file(args.switch.pid, &path).unwrap_or_else(|e| {
            eprintln!("alloctramp: warning: {e:#}; chains end at libraries loaded with dlopen");
            0
        }),
        false => 0,
    };
    let msg = switch_with(&args.switch, request, args.depth, &sites)?;
    eprintln!("alloctramp: {msg}");
    if written > 0 {
        let opened = Snapshot::read(&path)
            .ok()
            .and_then(|m| ProcessFile::parse(&m.bytes).ok().map(|pf| pf.header.unwind_file_libraries.load(Relaxed)))
            .unwrap_or(0);
        if opened == 0 {
            return Ok(());
        }
        eprintln!(
            "alloctramp: process {}: chains go on through {opened} more librar{} (unwind rows for libraries \
             loaded without them)",
            args.switch.pid,
            if opened == 1 { "y" } else { "ies" }
        );
    }
    Ok(())
}

/// Rows written per unwind file at most (12 bytes each): libraries past it
/// are left out.
const MAX_UNWIND_FILE_ROWS: usize = 1 << 24;

/// Files larger than this are not read for rows.
const MAX_LIBRARY_FILE: u64 = 4 << 30;

/// Writes the process's unwind file (`process::UnwindFileHeader`) next to
/// its counters file (`counters`): rows for every unpatched ELF file with
/// a build-id that it maps executable (read through `/proc/PID/root`, the
/// process's view of the file system), so that chains go on through
/// libraries it loaded with `dlopen`. The runtime opens only those it has
/// no rows for. Returns the libraries written.
fn write_unwind_file(pid: u32, counters: &Path) -> Result<usize> {
    use std::os::unix::fs::MetadataExt;
    let maps = crate::report::proc_maps(pid);
    if maps.is_empty() {
        bail!("process {pid}: cannot read its maps");
    }
    let mut paths: Vec<&str> = maps.iter().map(|m| m.path.as_str()).filter(|p| !p.ends_with(" (deleted)")).collect();
    paths.sort_unstable();
    paths.dedup();
    let mut libraries = Vec::new();
    let mut total = 0;
    for path in paths {
        let read = |p: &str| -> Option<Vec<u8>> {
            let meta = std::fs::metadata(p).ok()?;
            (meta.is_file() && meta.len() <= MAX_LIBRARY_FILE).then(|| std::fs::read(p).ok()).flatten()
        };
        let Some(data) = read(&format!("/proc/{pid}/root{path}")).or_else(|| read(path)) else { continue };
        let Some(f) = alloctramp_patcher::deps::library_rows(path, &data) else { continue };
        if total + f.rows.len() > MAX_UNWIND_FILE_ROWS {
            continue;
        }
        total += f.rows.len();
        libraries.push(f);
    }
    let bytes = process::encode_unwind_file(pid, &libraries);
    let dir = counters.parent().unwrap_or(Path::new("."));
    // Written by root for another user's process: the runtime maps only
    // its own user's file.
    let owner = std::fs::metadata(counters)?.uid();
    let give = (euid() == 0 && owner != 0).then_some(owner);
    crate::util::write_atomic_as(&dir.join(process::unwind_file_name(pid)), &bytes, 0o600, give)?;
    Ok(libraries.len())
}

/// The sites of `modules` a `--site` spec names (by its place, or by its
/// run-time address), with their module and index.
pub fn sites_named<'m, 'a: 'm>(
    modules: impl Iterator<Item = &'m process::Module<'a>> + 'm,
    spec: &str,
) -> Result<impl Iterator<Item = (&'m process::Module<'a>, usize, alloctramp_trampolines::layout::Site)> + 'm> {
    let place =
        alloctramp_trampolines::fault::Spec::parse_where(spec.as_bytes()).map_err(|e| anyhow!("--site {spec}: {e}"))?;
    Ok(modules.flat_map(move |m| {
        m.table.sites().enumerate().filter_map(move |(i, s)| {
            let hit = place.names(&m.table, &s)
                || matches!(place.place, alloctramp_trampolines::fault::Where::Address(a) if a == m.bias.wrapping_add(s.addr));
            hit.then_some((m, i, s))
        })
    }))
}

/// The run-time addresses of the patched sites the specs name.
fn select_sites(args: &SwitchArgs, specs: &[String]) -> Result<Vec<u64>> {
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    let path = pid_file(args.pid, &counters_dir(args.dir.as_deref()))?;
    let m = Snapshot::read(&path)?;
    let pf = ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let modules = pf.modules().map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for spec in specs {
        let before = out.len();
        let live = modules.iter().filter(|m| !m.unloaded);
        for (md, _, s) in sites_named(live, spec)?.filter(|(_, _, s)| s.trampoline != 0 && s.callers != 0) {
            let run = md.bias.wrapping_add(s.addr);
            if !out.contains(&run) {
                out.push(run);
            }
        }
        if out.len() == before {
            bail!("--site {spec}: no patched site of process {} matches", args.pid);
        }
    }
    if out.len() > process::MAX_CALLERS_SITES {
        bail!("--site names {} sites; at most {} at once", out.len(), process::MAX_CALLERS_SITES);
    }
    Ok(out)
}

struct State {
    generation: u64,
    on: bool,
    flags: u32,
    error: String,
    signal: u32,
    watcher: bool,
    exited: bool,
    sites: u64,
    modules: usize,
    switch_ns: u64,
    live_objects: u64,
    fail_specs: u32,
    fail_sites: u32,
}

fn read_state(path: &Path) -> Result<State> {
    let m = Snapshot::read(path)?;
    let pf = ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mods = pf.modules().unwrap_or_default();
    let mut live_objects = 0u64;
    if pf.live() {
        for md in &mods {
            // Allocation sites only: a free site's calls are frees.
            for (i, site) in md.table.sites().enumerate() {
                if md.table.entry_kind(site.entry) != Some(Kind::Free) {
                    live_objects = live_objects.saturating_add(md.cell(i).live_objects());
                }
            }
        }
    }
    Ok(State {
        generation: pf.generation,
        on: pf.on,
        flags: pf.flags,
        error: pf.last_error.clone(),
        signal: pf.signal,
        watcher: pf.watcher,
        exited: pf.exited,
        sites: mods.iter().map(|m| m.table.header.site_count as u64).sum(),
        modules: mods.len(),
        switch_ns: pf.last_switch_ns,
        live_objects,
        fail_specs: pf.header.fail_specs.load(Relaxed),
        fail_sites: pf.header.fail_sites.load(Relaxed),
    })
}

/// Puts the request in the process file's header and wakes the process's
/// watcher thread (a futex in the shared file) or sends its control signal,
/// then waits until the process reports that the request was carried out.
/// Returns the message to show.
pub fn switch(args: &SwitchArgs, request: Request) -> Result<String> {
    switch_with(args, request, 0, &[])
}

/// [`switch`], with the depth and the sites (none: every site) a
/// [`Request::Callers`] asks for.
fn switch_with(args: &SwitchArgs, request: Request, depth: u32, sites: &[u64]) -> Result<String> {
    let pid = args.pid;
    let dir = counters_dir(args.dir.as_deref());
    let path = pid_file(pid, &dir)?;
    let before = read_state(&path)?;
    {
        let m = Snapshot::read(&path)?;
        let pf = ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        if before.exited || !file_process_running(&pf) {
            bail!("process {pid} has exited ({} is its final snapshot)", path.display());
        }
    }
    if before.signal == 0 && !before.watcher {
        bail!("process {pid} takes no requests while it runs (started with ALLOCTRAMP_SWITCH=none)");
    }
    post_request(&path, request, before.watcher, depth, sites)?;
    if !before.watcher {
        // The value marks the signal as a request's: it never toggles.
        let value =
            libc::sigval { sival_ptr: alloctramp_trampolines::process::REQUEST_SIGNAL_VALUE as *mut libc::c_void };
        // SAFETY: sigqueue(3) with a pid, a signal number and a value.
        if unsafe { libc::sigqueue(pid as i32, before.signal as i32, value) } != 0 {
            bail!("cannot signal process {pid}: {}", std::io::Error::last_os_error());
        }
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout.max(0.0));
    loop {
        let s = read_state(&path)?;
        if s.generation != before.generation {
            if !s.error.is_empty() {
                // Switched on without live tracking: said, not failed.
                if !(request == Request::On && s.on) {
                    bail!("process {pid}: {}", s.error);
                }
                eprintln!("alloctramp: process {pid}: {}", s.error);
            }
            let plural = |n: u64, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
            let where_ = format!("{} in {}", plural(s.sites, "site"), plural(s.modules as u64, "module"));
            let took = match s.switch_ns {
                0 => String::new(),
                ns if ns < 100_000 => format!(", switched in {} µs", ns.div_ceil(1000)),
                ns => format!(", switched in {:.1} ms", ns as f64 / 1e6),
            };
            return Ok(match request {
                Request::Callers => format!(
                    "process {pid}: recording call chains of {depth} frames at {} ({where_}{took}{})",
                    match sites.len() {
                        0 => "every site".to_string(),
                        1 => "1 site".to_string(),
                        n => format!("{n} sites"),
                    },
                    if s.on { "" } else { "; profiling is off: `alloctramp enable` to count" }
                ),
                Request::NoCallers => format!("process {pid}: call chains no longer recorded ({where_}{took})"),
                Request::Fail => {
                    let (specs, sites) = (u64::from(s.fail_specs), u64::from(s.fail_sites));
                    match specs {
                        0 => format!("process {pid}: no call fails any more"),
                        _ => format!(
                            "process {pid}: {} in effect, naming {}{}",
                            plural(specs, "fault spec"),
                            plural(sites, "allocation site"),
                            if s.on { "" } else { "; profiling is off" }
                        ),
                    }
                }
                Request::Trace => format!(
                    "process {pid}: recording events ({where_}{took}{})",
                    if before.on { "" } else { "; profiling switched on for the trace" }
                ),
                Request::NoTrace => format!("process {pid}: events no longer recorded"),
                Request::On if before.on => format!("process {pid}: profiling was already on ({where_})"),
                Request::On => format!("process {pid}: profiling on ({where_}{took})"),
                Request::Reset => {
                    format!("process {pid}: counters reset (profiling {})", if s.on { "on" } else { "off" })
                }
                Request::Off | Request::OffNow if s.flags & flags::DRAINING != 0 => format!(
                    "process {pid}: profiling off; free sites stay on until the {} tracked objects are freed \
                     (`alloctramp disable --now {pid}` stops them too)",
                    s.live_objects
                ),
                Request::OffNow if s.flags & flags::INCOMPLETE != 0 => format!(
                    "process {pid}: profiling off, free sites too; live figures are incomplete from now on \
                     (objects still live are no longer seen leaving)"
                ),
                _ if !before.on && before.flags & flags::DRAINING == 0 => {
                    format!("process {pid}: profiling was already off")
                }
                _ => format!("process {pid}: profiling off ({where_}{took})"),
            });
        }
        if Instant::now() > deadline {
            let hint = if request == Request::OffNow { " (does its runtime know `off now`?)" } else { "" };
            bail!("process {pid} did not act on the request within {} s{hint}", args.timeout);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Stores the request in the header of the process file at `path` and, for
/// a watcher, increments the wake word and wakes it.
fn post_request(path: &Path, request: Request, watcher: bool, depth: u32, sites: &[u64]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::Ordering;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("{}: cannot open", path.display()))?;
    if !file.metadata()?.is_file() || file.metadata()?.len() < process::PROC_HEADER_SIZE {
        bail!("{}: not a process file", path.display());
    }
    // SAFETY: a shared mapping of the header, written only through atomics
    // (the process reads and writes the same words atomically).
    let mut map = unsafe { memmap2::MmapOptions::new().len(process::PROC_HEADER_SIZE as usize).map_mut(&file) }
        .with_context(|| format!("{}: cannot map", path.display()))?;
    let h: &ProcHeader = alloctramp_trampolines::pod::view_shared(&mut map).context("the header mapping")?;
    h.callers_request_depth.store(depth, Ordering::Release);
    for (slot, &a) in h.callers_sites.iter().zip(sites) {
        slot.store(a, Ordering::Relaxed);
    }
    h.callers_request_sites.store(sites.len() as u32, Ordering::Release);
    h.request.store(request as u32, Ordering::Release);
    if watcher {
        h.wake.fetch_add(1, Ordering::AcqRel);
        // SAFETY: FUTEX_WAKE on an aligned u32 of a shared file mapping (not
        // private: the waiter is another process).
        unsafe { libc::syscall(libc::SYS_futex, h.wake.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
    }
    Ok(())
}

pub fn run_switch(args: &SwitchArgs, request: Request) -> Result<()> {
    let msg = switch(args, request)?;
    eprintln!("alloctramp: {msg}");
    Ok(())
}
