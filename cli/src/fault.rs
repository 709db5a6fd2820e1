//! Fault injection: `alloctramp fail PID SPEC...` (the specs of a running
//! process) and `alloctramp faultsweep -- PROGRAM` (one run per reached
//! site, with that site's Nth call failing).

use crate::control::{self, SwitchArgs, counters_dir, euid, pid_file};
use crate::run::{Cached, Role, cache_dir, cached_patch, find_program};
use crate::util::{Snapshot, create_private_dir};
use alloctramp_trampolines::entry::Kind;
use alloctramp_trampolines::fault::{self, MAX_SPECS, Spec};
use alloctramp_trampolines::process::{self, ProcessFile, Request};
use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use std::ffi::OsString;
use std::io::{IsTerminal, Read};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Fail chosen allocation calls of a running process (fault injection).
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp fail 12345 parse.c:120:nth=2\n  \
    alloctramp fail 12345 'load_table:every=10,times=3' 'cache.c:88:prob=0.01,seed=7'\n  \
    alloctramp fail 12345 --clear\n\n\
A SPEC is WHERE:HOW.\n  \
WHERE: FILE:LINE (a file name or a path suffix), a function name, or [MODULE:]0xADDRESS (the site's address \
in its file, as `alloctramp report --format json` shows it)\n  \
HOW:   comma-separated nth=N (the Nth call only), every=N, after=N (the calls after the first N), prob=P (0 to \
1, with seed=S), times=K (at most K failures); a call is counted over every site the spec names\n\
A failed call does not reach the allocator: malloc-like calls return NULL with errno ENOMEM, posix_memalign \
returns ENOMEM, realloc leaves the block alone and returns NULL, a throwing operator new throws \
std::bad_alloc, a nothrow one returns NULL. Calls fail while profiling is on (this command switches it on), \
and count as `injected` in the report. The process's fail file (PID.fail beside its counters file) holds the \
specs; ALLOCTRAMP_FAIL=SPEC[;SPEC...] sets them at start.")]
pub struct FailArgs {
    #[command(flatten)]
    pub switch: SwitchArgs,
    /// Fault specs (they replace those in effect).
    #[arg(value_name = "SPEC", required_unless_present = "clear")]
    pub specs: Vec<String>,
    /// Stop failing calls.
    #[arg(long, conflicts_with = "specs")]
    pub clear: bool,
}

/// The specs as one text (`SPEC;SPEC...`), each checked: the error names
/// the spec and the byte.
pub fn check_specs(specs: &[String]) -> Result<String> {
    let mut all = Vec::new();
    for s in specs {
        // Split as the runtime splits them.
        for part in s.split([';', '\n']).filter(|p| !p.trim().is_empty()) {
            Spec::parse(part.as_bytes()).map_err(|e| anyhow!("fault spec {part:?}: {e}"))?;
            all.push(part.trim());
        }
    }
    if all.len() > MAX_SPECS {
        bail!("{} fault specs; at most {MAX_SPECS} at once", all.len());
    }
    let text = all.join(";");
    if text.len() > fault::MAX_TEXT {
        bail!("fault specs of {} bytes; at most {}", text.len(), fault::MAX_TEXT);
    }
    Ok(text)
}

pub fn run_fail(args: &FailArgs) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let text = if args.clear { String::new() } else { check_specs(&args.specs)? };
    let pid = args.switch.pid;
    let path = pid_file(pid, &counters_dir(args.switch.dir.as_deref()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    // Written by root for another user's process: the file is given to
    // that user, as the process's own files are.
    let owner = std::fs::metadata(&path)?.uid();
    let give = (euid() == 0 && owner != 0).then_some(owner);
    crate::util::write_atomic_as(&dir.join(process::fail_file_name(pid)), text.as_bytes(), 0o600, give)?;
    let msg = control::switch(&args.switch, Request::Fail)?;
    eprintln!("alloctramp: {msg}");
    let m = Snapshot::read(&path)?;
    let pf = ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    if args.clear {
        return Ok(());
    }
    if pf.header.fail_sites.load(Relaxed) == 0 {
        eprintln!(
            "alloctramp: warning: no allocation site of process {pid} matches; the specs stay in effect for \
             modules it loads later (`alloctramp fail {pid} --clear` removes them)"
        );
    }
    if !pf.on {
        let msg = control::switch(&args.switch, Request::On)?;
        eprintln!("alloctramp: {msg} (calls fail while profiling is on)");
    }
    Ok(())
}

/// Run a program once per allocation site it reaches, with that site's
/// Nth call failing, and report what each run did: crashes first.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp faultsweep -- ./server --selftest\n  \
    alloctramp faultsweep --nth 2 --jobs 4 --timeout 10 -- ./parse input.txt < stdin.txt\n  \
    alloctramp faultsweep --format json -o sweep -- ./tool\n\n\
The first run, with profiling on and no failure, finds the sites the program reaches; each later run fails \
the Nth call of one of them (spec MODULE:0xADDRESS:nth=N; see `alloctramp fail --help`). What the program \
reads on standard input is read once and given to every run; each run's standard output and error go to \
files in the output directory, named in the report. A row's outcome is the signal that killed the run, \
`timeout`, or its exit status; `not failed` means the run never made that call (the program is not \
deterministic, or the Nth call never came).")]
pub struct SweepArgs {
    /// Which call of each site fails (1: the first).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub nth: u64,
    /// Runs at once [default: the number of CPUs].
    #[arg(short, long, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub jobs: Option<u64>,
    /// Seconds a run may take before it is killed (SIGKILL, to its process
    /// group).
    #[arg(long, default_value = "60", value_name = "SECONDS", value_parser = seconds)]
    pub timeout: Duration,
    /// Where each run's output goes [default: ./alloctramp-faultsweep].
    #[arg(short, long = "output-dir", value_name = "DIR")]
    pub output_dir: Option<PathBuf>,
    /// text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
    /// Also count calls to this function (see `alloctramp sites --help`).
    #[arg(long = "entry", value_name = "SPEC")]
    pub entries: Vec<String>,
    /// The cache of patched programs (as for `run`).
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    pub command: Vec<OsString>,
}

/// `--timeout`: seconds above 0 that a `Duration` holds.
fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if v.is_nan() || v <= 0.0 {
        return Err(format!("{s} seconds: give more than 0"));
    }
    Duration::try_from_secs_f64(v).map_err(|_| format!("{s} seconds is too long"))
}

/// How a run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    Exit(i32),
    Signal(i32),
    Timeout,
    /// It could not be run (the message says why).
    Error(String),
}

impl End {
    fn text(&self) -> String {
        match self {
            End::Exit(c) => format!("exit {c}"),
            End::Signal(s) => signal_name(*s),
            End::Timeout => "timeout".to_string(),
            End::Error(e) => format!("not run: {e}"),
        }
    }
}

/// The process groups of the runs under way (0: a free slot), which an
/// interrupt of the sweep kills with it.
static GROUPS: [std::sync::atomic::AtomicI32; 256] = [const { std::sync::atomic::AtomicI32::new(0) }; 256];

extern "C" fn on_interrupt(sig: i32) {
    for g in &GROUPS {
        let pgid = g.load(Relaxed);
        if pgid > 0 {
            // SAFETY: kill(2) is async-signal-safe.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    }
    // SAFETY: the default disposition back, then the signal again: the
    // sweep ends as the signal would have ended it.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

fn signal_name(s: i32) -> String {
    let name = match s {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGPIPE => "SIGPIPE",
        _ => return format!("signal {s}"),
    };
    name.to_string()
}

/// A site the first run reached.
#[derive(Clone)]
struct Reached {
    module: String,
    address: u64,
    function: Option<String>,
    file: Option<String>,
    line: u32,
    calls: u64,
}

/// One run: its output files, how it ended, and its counters file's
/// figures (module, address, calls, injected).
struct Ran {
    end: End,
    stdout: PathBuf,
    stderr: PathBuf,
    sites: Vec<(Reached, u64)>,
}

struct Sweep<'a> {
    program: &'a Path,
    patched: &'a Path,
    arg0: &'a OsString,
    args: &'a [OsString],
    out: &'a Path,
    stdin: Option<PathBuf>,
    timeout: Duration,
}

impl Sweep<'_> {
    /// Runs the program once, profiling on, with `fail` (if any) in
    /// effect; `label` names its files, `slot` its entry in [`GROUPS`].
    fn run(&self, label: &str, fail: Option<&str>, slot: usize) -> Result<Ran> {
        let counters = self.out.join(".counters").join(label);
        let _ = std::fs::remove_dir_all(&counters);
        create_private_dir(&counters)?;
        let stdout = self.out.join(format!("{label}.stdout"));
        let stderr = self.out.join(format!("{label}.stderr"));
        let open = |p: &Path| std::fs::File::create(p).with_context(|| format!("{}: cannot create", p.display()));
        let mut cmd = std::process::Command::new(self.patched);
        cmd.arg0(self.arg0)
            .args(self.args)
            .env("ALLOCTRAMP", "on")
            .env("ALLOCTRAMP_DIR", &counters)
            .env("ALLOCTRAMP_SWITCH", "none")
            .env_remove("ALLOCTRAMP_FAIL")
            .stdout(open(&stdout)?)
            .stderr(open(&stderr)?)
            .process_group(0);
        cmd.stdin(match &self.stdin {
            Some(p) => std::fs::File::open(p)?.into(),
            None => std::process::Stdio::null(),
        });
        if let Some(f) = fail {
            cmd.env("ALLOCTRAMP_FAIL", f);
        }
        let mut child = cmd.spawn().with_context(|| format!("{}: cannot run", self.patched.display()))?;
        let pid = child.id();
        let group = GROUPS.get(slot);
        if let Some(g) = group {
            g.store(pid as i32, Relaxed);
        }
        // No deadline past what an Instant holds.
        let deadline = Instant::now().checked_add(self.timeout);
        let timed_out = loop {
            // Exited, not reaped yet: its pid still names the group.
            // SAFETY: waitid(2) of our child into a zeroed siginfo.
            let exited = unsafe {
                let mut info: libc::siginfo_t = std::mem::zeroed();
                libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) == 0
                    && info.si_pid() != 0
            };
            if exited {
                break false;
            }
            if deadline.is_some_and(|d| Instant::now() > d) {
                break true;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        // What the run left behind (or all of it, on a timeout) goes with
        // the group, before the child is reaped. SAFETY: kill(2).
        unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
        let status = child.wait()?;
        if let Some(g) = group {
            g.store(0, Relaxed);
        }
        let end = match (timed_out, status.code(), status.signal()) {
            (true, _, _) => End::Timeout,
            (false, Some(c), _) => End::Exit(c),
            (false, None, Some(s)) => End::Signal(s),
            (false, None, None) => End::Exit(-1),
        };
        let file = counters.join(process::counters_file_name(pid));
        // A file that cannot be read counts as no call failed.
        let sites = if file.is_file() { read_sites(&file).unwrap_or_default() } else { Vec::new() };
        let _ = std::fs::remove_dir_all(&counters);
        Ok(Ran { end, stdout, stderr, sites })
    }
}

/// The allocation sites of a counters file with their calls and injected
/// failures: the sites a fault spec can fail (not frees), wrappers' calls
/// included (a hook's cell counts what its call allocated).
fn read_sites(path: &Path) -> Result<Vec<(Reached, u64)>> {
    let m = Snapshot::read(path)?;
    let pf = ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for md in pf.modules().map_err(|e| anyhow!("{}: {e}", path.display()))? {
        let t = &md.table;
        for (i, s) in t.sites().enumerate() {
            if s.trampoline == 0 || s.callers == 0 {
                continue;
            }
            if t.entry_kind(s.entry) == Some(Kind::Free) {
                continue;
            }
            let c = md.cell(i);
            let r = Reached {
                module: t.module_name().to_string(),
                address: s.addr,
                function: t.string(s.function).map(str::to_string),
                file: t.string(s.file).map(str::to_string),
                line: s.line,
                calls: c.calls.wrapping_add(c.injected),
            };
            out.push((r, c.injected));
        }
    }
    Ok(out)
}

#[derive(Serialize)]
struct RowDoc {
    module: String,
    address: u64,
    function: Option<String>,
    file: Option<String>,
    line: Option<u32>,
    spec: String,
    outcome: String,
    exit_status: Option<i32>,
    signal: Option<i32>,
    timed_out: bool,
    /// Calls the run failed at the site (0: it never made the Nth call).
    injected: u64,
    stdout: String,
    stderr: String,
}

#[derive(Serialize)]
struct SweepDoc {
    format: &'static str,
    version: u32,
    program: String,
    nth: u64,
    baseline: String,
    sites: Vec<RowDoc>,
}

pub fn run_sweep(mut args: SweepArgs) -> Result<()> {
    let program_arg = args.command.remove(0);
    let program = find_program(&program_arg)?;
    let cache = cache_dir(args.cache.as_deref());
    let role = Role { library: false, whole_process: false };
    let patched = match cached_patch(&program, &args.entries, &cache, role)? {
        Cached::Copy(p, _) => p,
        Cached::Patched | Cached::NoSites => program.clone(),
    };
    let out = args.output_dir.clone().unwrap_or_else(|| PathBuf::from("alloctramp-faultsweep"));
    create_private_dir(&out)?;
    // Standard input, read once, replayed to every run.
    let stdin = if std::io::stdin().is_terminal() {
        None
    } else {
        let mut data = Vec::new();
        std::io::stdin().read_to_end(&mut data).context("reading standard input")?;
        let p = out.join("stdin");
        crate::util::write_atomic(&p, &data, 0o600)?;
        Some(p)
    };
    let sweep = Sweep {
        program: &program,
        patched: &patched,
        arg0: &program_arg,
        args: &args.command,
        out: &out,
        stdin,
        timeout: args.timeout,
    };
    // An interrupt of the sweep ends its runs too (each is in a process
    // group of its own, which the terminal's signal does not reach).
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a handler that makes only async-signal-safe calls.
        unsafe { libc::signal(sig, on_interrupt as extern "C" fn(i32) as libc::sighandler_t) };
    }
    let first = sweep.run("baseline", None, 0)?;
    let mut reached: Vec<Reached> = first.sites.into_iter().map(|(r, _)| r).filter(|r| r.calls > 0).collect();
    reached.sort_by(|a, b| (&a.module, a.address).cmp(&(&b.module, b.address)));
    eprintln!(
        "alloctramp: {} reached {} allocation site{} ({}); failing call {} of each, one run per site",
        sweep.program.display(),
        reached.len(),
        if reached.len() == 1 { "" } else { "s" },
        first.end.text(),
        args.nth
    );
    let jobs = args.jobs.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), |j| j as usize);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<Ran>>>> =
        reached.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let spec_of = |r: &Reached| format!("{}:{:#x}:nth={}", r.module, r.address, args.nth);
    std::thread::scope(|s| {
        for worker in 0..jobs.min(reached.len()) {
            let (next, results, reached, sweep, spec_of) = (&next, &results, &reached, &sweep, &spec_of);
            s.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(r) = reached.get(i) else { break };
                    let ran = sweep.run(&format!("site-{}", i + 1), Some(&spec_of(r)), worker);
                    if let Some(slot) = results.get(i) {
                        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(ran);
                    }
                }
            });
        }
    });
    let _ = std::fs::remove_dir(out.join(".counters"));
    let mut rows = Vec::new();
    for (r, slot) in reached.iter().zip(results) {
        let ran = match slot.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(ran)) => ran,
            Some(Err(e)) => Ran {
                end: End::Error(format!("{e:#}")),
                stdout: PathBuf::new(),
                stderr: PathBuf::new(),
                sites: Vec::new(),
            },
            None => bail!("a run was lost"),
        };
        let injected =
            ran.sites.iter().find(|(s, _)| s.module == r.module && s.address == r.address).map_or(0, |(_, n)| *n);
        rows.push((r.clone(), ran, injected));
    }
    // Crashes first, then timeouts, then runs that ended otherwise than
    // the first run, then the rest; in each, by place.
    let rank = |ran: &Ran, injected: u64| match &ran.end {
        End::Signal(_) if injected != 0 => 0,
        End::Timeout if injected != 0 => 1,
        e if injected != 0 && *e != first.end => 2,
        _ if injected != 0 => 3,
        End::Error(_) => 5,
        _ => 4,
    };
    rows.sort_by(|(a, ra, ia), (b, rb, ib)| {
        (rank(ra, *ia), &a.file, a.line, &a.module, a.address).cmp(&(
            rank(rb, *ib),
            &b.file,
            b.line,
            &b.module,
            b.address,
        ))
    });
    let docs: Vec<RowDoc> = rows
        .iter()
        .map(|(r, ran, injected)| RowDoc {
            module: r.module.clone(),
            address: r.address,
            function: r.function.clone(),
            file: r.file.clone(),
            line: (r.line != 0).then_some(r.line),
            spec: spec_of(r),
            outcome: match &ran.end {
                End::Error(_) => ran.end.text(),
                _ if *injected == 0 => "not failed".to_string(),
                e => e.text(),
            },
            exit_status: match ran.end {
                End::Exit(c) => Some(c),
                _ => None,
            },
            signal: match ran.end {
                End::Signal(s) => Some(s),
                _ => None,
            },
            timed_out: ran.end == End::Timeout,
            injected: *injected,
            stdout: ran.stdout.display().to_string(),
            stderr: ran.stderr.display().to_string(),
        })
        .collect();
    if args.format == "json" {
        let doc = SweepDoc {
            format: "alloctramp-faultsweep",
            version: 1,
            program: program.display().to_string(),
            nth: args.nth,
            baseline: first.end.text(),
            sites: docs,
        };
        return crate::util::emit(|w| {
            serde_json::to_writer_pretty(&mut *w, &doc).map_err(std::io::Error::other)?;
            writeln!(w)
        });
    }
    let width = docs.iter().map(|d| location_of(d).len()).max().unwrap_or(4).max(4);
    crate::util::emit(|w| {
        writeln!(w, "# {:<12} {:<width$} {:<24} output", "outcome", "site", "function")?;
        for d in &docs {
            writeln!(
                w,
                "{:<14} {:<width$} {:<24} {}",
                d.outcome,
                location_of(d),
                d.function.as_deref().unwrap_or("?"),
                d.stdout.trim_end_matches(".stdout").to_string() + ".{stdout,stderr}"
            )?;
        }
        Ok(())
    })
}

fn location_of(d: &RowDoc) -> String {
    match (&d.file, d.line) {
        (Some(f), Some(l)) => format!("{f}:{l}"),
        _ => format!("{}:{:#x}", d.module, d.address),
    }
}
