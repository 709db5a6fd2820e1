//! `alloctramp run`: patch a program into a cache (reused next time), run
//! it, and print the report when it exits.

use crate::control::counters_dir;
use crate::patch::{self, RuntimeLink};
use crate::report::{self, Source, View};
use crate::util::{Input, create_private_dir};
use alloctramp_report::model::{Fig, Figures, GroupBy, SortKey};
use alloctramp_report::text;
use anyhow::{Context, Result, anyhow, bail};
use std::ffi::OsString;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};

/// Patch a program (cached), run it, and print its report when it exits.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp run --on -- ./server --port 8080\n  \
    alloctramp run -- git status          # then, from another terminal: alloctramp enable PID\n  \
    alloctramp run --on --entry xmalloc:alloc --entry xfree:free --top 0 -o report.txt -- ./prog\n\n\
The patched copy is kept in $XDG_CACHE_HOME/alloctramp (else ~/.cache/alloctramp), keyed by the program's \
build-id (else its contents), the entry points and this alloctramp; the next run reuses it, and so are the \
shared libraries it loads, at start or with dlopen (through the loader's audit interface, LD_AUDIT), except \
the C library's own. The exit status is the program's.")]
pub struct Args {
    /// Profile from the start (ALLOCTRAMP=on); without it, switch on with
    /// `alloctramp enable PID` while the program runs.
    #[arg(long)]
    pub on: bool,
    /// Also count calls to this function (see `alloctramp sites --help`).
    #[arg(long = "entry", value_name = "SPEC")]
    pub entries: Vec<String>,
    /// Fail the calls SPEC names (fault injection, WHERE:HOW; see
    /// `alloctramp fail --help`); implies --on.
    #[arg(long = "fail", value_name = "SPEC")]
    pub fail: Vec<String>,
    /// Record every allocation, free and realloc as an event into the
    /// CTF trace directory DIR (see `alloctramp trace --help`); implies
    /// --on.
    #[arg(long = "trace", value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// Write the report to FILE instead of stderr.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// The cache of patched programs [default: $XDG_CACHE_HOME/alloctramp,
    /// else ~/.cache/alloctramp].
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Patch only the program, not the shared libraries it loads.
    #[arg(long)]
    pub no_libraries: bool,
    /// Also profile the programs it executes, and theirs (each process
    /// has its own counters file, in a directory of this run's).
    #[arg(long)]
    pub follow_exec: bool,
    /// Report the whole process tree at exit, one row per site over every
    /// process (implies --follow-exec).
    #[arg(long)]
    pub tree: bool,
    #[command(flatten)]
    pub view: View,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    pub command: Vec<OsString>,
}

/// The cache directory of patched programs.
pub fn cache_dir(explicit: Option<&Path>) -> PathBuf {
    if let Some(d) = explicit {
        return d.to_path_buf();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| Path::new(d).is_absolute()) {
        return PathBuf::from(d).join("alloctramp");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|d| Path::new(d).is_absolute()) {
        return PathBuf::from(h).join(".cache/alloctramp");
    }
    std::env::temp_dir().join(format!("alloctramp-cache-{}", crate::control::euid()))
}

/// A program named on the command line: a path, or a name looked up in PATH.
pub fn find_program(name: &OsString) -> Result<PathBuf> {
    let p = Path::new(name);
    if p.as_os_str().as_encoded_bytes().contains(&b'/') {
        if !p.is_file() {
            bail!("{}: no such program", p.display());
        }
        return Ok(p.to_path_buf());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    for d in std::env::split_paths(&path) {
        let c = d.join(p);
        if c.is_file() && c.metadata().is_ok_and(|m| m.permissions().mode() & 0o111 != 0) {
            return Ok(c);
        }
    }
    bail!("{}: not found in PATH", p.display())
}

/// The interpreter of a script (`#!INTERP [ARG]`, read as the kernel
/// reads it), or None for any other file.
fn interpreter(file: &Path) -> Result<Option<(PathBuf, Option<OsString>)>> {
    use std::io::Read;
    use std::os::unix::ffi::OsStrExt;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(file)
        .and_then(|mut f| f.read(&mut head))
        .with_context(|| format!("{}: cannot read", file.display()))?;
    let Some(line) = head[..n].strip_prefix(b"#!") else { return Ok(None) };
    let line = line.split(|&b| b == b'\n').next().unwrap_or(line);
    let line = line.trim_ascii();
    let (interp, arg) = match line.iter().position(|b| b.is_ascii_whitespace()) {
        Some(at) => (&line[..at], Some(line[at..].trim_ascii())),
        None => (line, None),
    };
    if interp.is_empty() {
        bail!("{}: a script without an interpreter on its #! line", file.display());
    }
    let interp = PathBuf::from(std::ffi::OsStr::from_bytes(interp));
    if !interp.is_file() {
        bail!("{}: its interpreter {} is not a file", file.display(), interp.display());
    }
    let arg = arg.filter(|a| !a.is_empty()).map(|a| std::ffi::OsStr::from_bytes(a).to_os_string());
    Ok(Some((interp, arg)))
}

fn hash_file(h: &mut impl Hasher, path: &Path) -> Result<()> {
    let input = Input::open(path)?;
    input.map.len().hash(h);
    h.write(&input.map);
    Ok(())
}

/// What a run's patched copies depend on besides the file: this
/// alloctramp, its runtime and the entry points.
fn config_hash(runtime: &Path, entries: &[String]) -> Result<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    env!("CARGO_PKG_VERSION").hash(&mut h);
    if let Ok(exe) = std::env::current_exe()
        && let Ok(m) = exe.metadata()
    {
        m.len().hash(&mut h);
        m.modified().ok().hash(&mut h);
    }
    hash_file(&mut h, runtime)?;
    entries.hash(&mut h);
    Ok(h.finish())
}

/// A file's place in the cache.
pub enum Cached {
    /// The patched copy, and whether it was there already.
    Copy(PathBuf, bool),
    /// The file carries its own trampolines: it runs as it is.
    Patched,
    /// A library with no allocation sites: it loads as it is.
    NoSites,
}

/// How `run` patches a file.
#[derive(Clone, Copy)]
pub struct Role {
    /// A library (or a program the tree executes): copied only if it has
    /// allocation sites, without warnings about `--entry` specs.
    pub library: bool,
    /// Every module of the process is patched: the sites inside a file's
    /// own allocator entries are left out (their callers count).
    pub whole_process: bool,
}

/// The cached patched copy of `file` (patched now if not cached yet).
pub fn cached_patch(file: &Path, entries: &[String], cache: &Path, role: Role) -> Result<Cached> {
    let library = role.library;
    let input = Input::open(file)?;
    let elf = alloctramp_patcher::Elf::parse(&input.map).map_err(|e| anyhow!("{}: {e}", file.display()))?;
    if elf.section_by_name(alloctramp_trampolines::layout::SEC_SITES).is_some() {
        return Ok(Cached::Patched);
    }
    let runtime = patch::find_runtime(None)?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    config_hash(&runtime, entries)?.hash(&mut h);
    role.whole_process.hash(&mut h);
    match elf.build_id() {
        Some(id) => {
            "build-id".hash(&mut h);
            id.hash(&mut h);
            input.map.len().hash(&mut h);
        }
        None => {
            "contents".hash(&mut h);
            h.write(&input.map);
        }
    }
    let name = file.file_name().map_or_else(|| "program".into(), |n| n.to_string_lossy().into_owned());
    let dir = cache.join(format!("{name}-{:016x}", h.finish()));
    let out = dir.join(&name);
    if out.is_file() && dir.join(alloctramp_trampolines::layout::RUNTIME_SONAME).is_file() {
        return Ok(Cached::Copy(out, true));
    }
    create_private_dir(&dir)?;
    let args = patch::Args {
        wrappers: Default::default(),
        input: file.to_path_buf(),
        output: Some(out.clone()),
        entries: entries.to_vec(),
        runtime: Some(runtime),
        runtime_link: RuntimeLink::Origin,
        no_library_unwind: false,
        images: vec![patch::ImageArg::Live, patch::ImageArg::Count],
        no_image: false,
        skip_allocator_layers: role.whole_process,
    };
    let s = patch::write_patched(&args, !library)?;
    if library && s.sites == 0 {
        let _ = std::fs::remove_dir_all(&dir);
        return Ok(Cached::NoSites);
    }
    eprintln!("alloctramp: patched {} into {} ({} sites)", file.display(), out.display(), s.sites);
    Ok(Cached::Copy(out, false))
}

/// The run's index of libraries (see the audit library): one per
/// configuration, in the cache.
fn index_dir(cache: &Path, runtime: &Path, entries: &[String]) -> Result<PathBuf> {
    Ok(cache.join(format!("index-{:016x}", config_hash(runtime, entries)?)))
}

/// `alloctramp cache-library FILE`: what the audit library runs when the
/// loader is about to open a file the index does not know. Patches the
/// file into the cache and links its index entry to the copy (or to
/// "not patched", saying why on stderr). The run's settings come from the
/// environment `run` gave the program.
pub fn cache_library(file: &Path) -> Result<()> {
    use alloctramp_audit as audit;
    let var = |k: &str| {
        std::env::var_os(k).ok_or_else(|| anyhow!("{k} is not set (this command is run by `alloctramp run`)"))
    };
    let cache = PathBuf::from(var(audit::ENV_CACHE)?);
    let index = PathBuf::from(var(audit::ENV_INDEX)?);
    let entries: Vec<String> = std::env::var(audit::ENV_ENTRIES)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    let meta = std::fs::metadata(file).with_context(|| format!("{}: cannot read", file.display()))?;
    let role = Role { library: true, whole_process: true };
    let copy = match cached_patch(file, &entries, &cache, role) {
        Ok(Cached::Copy(out, _)) => Some(out),
        Ok(Cached::Patched | Cached::NoSites) => None,
        Err(e) => {
            eprintln!("alloctramp: {}: loaded as it is, not profiled: {e:#}", file.display());
            None
        }
    };
    create_private_dir(&index)?;
    let target = copy.clone().unwrap_or_else(|| PathBuf::from(audit::NOT_PATCHED));
    let mut links = vec![(audit::index_key(&meta), target.clone())];
    // The copy is its own answer (a program `--follow-exec` re-executed).
    if let Some(m) = copy.and_then(|c| std::fs::metadata(c).ok()) {
        links.push((audit::index_key(&m), target));
    }
    for (key, to) in links {
        let tmp = index.join(format!(".{key}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&to, &tmp).with_context(|| format!("{}: cannot write", tmp.display()))?;
        std::fs::rename(&tmp, index.join(&key)).with_context(|| format!("{}: cannot write", index.display()))?;
    }
    Ok(())
}

pub fn run(mut args: Args) -> Result<()> {
    if args.view.format == alloctramp_report::Format::Pprof {
        if args.output.is_none() {
            bail!("--format pprof writes a binary profile: give -o FILE");
        }
        if args.view.group_by != GroupBy::Site {
            bail!("--format pprof has one location per site: --group-by is for the other formats");
        }
        if args.tree {
            bail!("--format pprof describes one process's mappings: --tree is for the other formats");
        }
    }
    if args.tree && args.view.callers {
        bail!("--callers follows one process's call chains: --tree reports its sites");
    }
    let fail = match args.fail.is_empty() {
        true => None,
        false => Some(crate::fault::check_specs(&args.fail)?),
    };
    args.on |= fail.is_some() || args.trace.is_some();
    let trace_partial = args.trace.as_deref().map(crate::trace::start_output).transpose()?;
    let mut program_arg = args.command.remove(0);
    let mut program = find_program(&program_arg)?;
    // A script: its interpreter is the program, as the kernel runs it.
    if let Some((interp, arg)) = interpreter(&program)? {
        let script = program.into_os_string();
        args.command.splice(0..0, arg.into_iter().chain([script]));
        program_arg = interp.clone().into_os_string();
        program = interp;
    }
    let cache = cache_dir(args.cache.as_deref());
    let role = Role { library: false, whole_process: !args.no_libraries };
    let patched = match cached_patch(&program, &args.entries, &cache, role)? {
        Cached::Copy(p, true) => {
            eprintln!("alloctramp: using {} (patched before)", p.display());
            p
        }
        Cached::Copy(p, false) => p,
        Cached::Patched | Cached::NoSites => program.clone(),
    };
    let follow = args.follow_exec || args.tree;
    // A tree's processes write their files into a directory of the run's.
    let dir = match follow {
        true => tree_dir()?,
        false => counters_dir(None),
    };
    let mut cmd = std::process::Command::new(&patched);
    cmd.arg0(&program_arg).args(&args.command);
    if args.on {
        cmd.env("ALLOCTRAMP", "on");
    }
    if let Some(f) = &fail {
        cmd.env("ALLOCTRAMP_FAIL", f);
    }
    if trace_partial.is_some() {
        // Only the child records: the programs it starts inherit the
        // variable, and no drainer would read their events.
        cmd.env("ALLOCTRAMP_TRACE", format!("on:{}", std::process::id()));
    }
    if args.view.callers && std::env::var_os("ALLOCTRAMP_CALLERS").is_none() {
        cmd.env("ALLOCTRAMP_CALLERS", "on");
    }
    if follow {
        cmd.env("ALLOCTRAMP_DIR", &dir).env("ALLOCTRAMP_KEEP", usize::MAX.to_string());
    }
    if !args.no_libraries {
        audit_env(&mut cmd, &patched, &cache, &args.entries, follow)?;
    }
    let mut child = cmd.spawn().with_context(|| format!("{}: cannot run", patched.display()))?;
    let pid = child.id();
    // Ctrl-C and Ctrl-\ are for the program; this process waits to report.
    // SAFETY: setting a signal's disposition to SIG_IGN.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
    let on = if args.on || std::env::var("ALLOCTRAMP").is_ok_and(|v| v == "on") {
        "profiling on".to_string()
    } else {
        format!("profiling off: switch it on with `alloctramp enable {pid}`")
    };
    if !args.view.quiet {
        eprintln!("alloctramp: running {} as pid {pid}, {on}", program.display());
    }
    let status = match (&trace_partial, &args.trace) {
        (Some(partial), Some(output)) => {
            let traced = trace_child(&mut child, &dir, partial);
            let status = child.wait().context("waiting for the program")?;
            match traced {
                Ok(summary) => {
                    crate::trace::finish_output(partial, output)?;
                    eprintln!("alloctramp: {}", summary.text(output));
                }
                Err(e) => {
                    let _ = std::fs::remove_dir_all(partial);
                    eprintln!("alloctramp: no trace: {e:#}");
                }
            }
            status
        }
        _ => child.wait().context("waiting for the program")?,
    };
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    let file = dir.join(alloctramp_trampolines::process::counters_file_name(pid));
    let files = match args.tree {
        true => tree_files(&dir, &file),
        false if file.is_file() => vec![file.clone()],
        false => Vec::new(),
    };
    if files.is_empty() {
        let why = if args.on {
            "profiling was unavailable; see its messages above"
        } else {
            "profiling was never switched on, so it kept no file"
        };
        eprintln!("alloctramp: {} left no counters file in {} ({why})", program.display(), dir.display());
        std::process::exit(code);
    }
    let srcs = files.iter().map(|f| Source::open(&f.to_string_lossy(), &dir)).collect::<Result<Vec<_>>>()?;
    let all = srcs.iter().map(Source::figures).collect::<Result<Vec<_>>>()?;
    let notes = report::notes(&srcs[0], &all[0]);
    let processes: Vec<String> = match args.tree {
        true => srcs.iter().zip(&all).map(|(src, figs)| process_line(src, figs)).collect(),
        false => Vec::new(),
    };
    let mut figs = alloctramp_report::model::merge(all).expect("one process at least");
    let mut view = args.view.clone();
    // A finished program's story: what it allocated in all, largest first
    // (the totals columns come first), and what stayed live at exit; the
    // text's default cut (a profile has every site).
    if view.sort.is_none() && view.format != alloctramp_report::Format::Pprof {
        view.sort = Some(SortKey::Bytes);
        if view.top.is_none() && view.group_by == GroupBy::Site {
            view.top = Some(20);
        }
    }
    let totals = totals_line(&figs);
    let rows = report::rows(&mut figs, &view)?;
    let how = match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => format!("was killed by signal {}", status.signal().unwrap_or(0)),
    };
    if !view.quiet {
        let stay = match args.tree {
            true => format!("the figures of its {} processes stay in {}", srcs.len(), dir.display()),
            false => format!("its figures stay in {} (alloctramp report FILE)", file.display()),
        };
        eprintln!("alloctramp: {} {how}; {stay}", program.display());
        report::print_notes(&notes, false);
        for l in &processes {
            eprintln!("alloctramp:   {l}");
        }
        let whose = if args.tree { "the tree's " } else { "" };
        eprintln!("alloctramp: {whose}{totals}");
    }
    let mut buf = Vec::new();
    report::write_report(&mut buf, &srcs[0], &figs, &rows, &view)?;
    match &args.output {
        Some(p) => crate::util::write_atomic(p, &buf, 0o644)?,
        None => {
            let _ = std::io::stderr().write_all(&buf);
        }
    }
    std::process::exit(code)
}

/// Drains the events of `child` (started with `ALLOCTRAMP_TRACE=on:PID`, PID this process)
/// into the trace directory `partial` until it exits.
fn trace_child(child: &mut std::process::Child, dir: &Path, partial: &Path) -> Result<crate::trace::Summary> {
    let pid = child.id();
    let trace_path = dir.join(alloctramp_trampolines::trace::file_name(pid));
    let counters = dir.join(alloctramp_trampolines::process::counters_file_name(pid));
    // The runtime makes the file at start-up, and keeps it at exit for us.
    // (the child's own: one an earlier process of the same pid left names
    // another pid until the child replaces it).
    let mut file = loop {
        let exited = child.try_wait()?.is_some();
        match crate::trace::TraceFile::open(&trace_path) {
            Ok(f) if f.pid() == pid => break f.claim()?,
            Ok(_) if exited => anyhow::bail!("{}: another process's trace file", trace_path.display()),
            Err(e) if exited => return Err(e),
            _ => std::thread::sleep(std::time::Duration::from_millis(2)),
        }
    };
    let start = file.start_tsc();
    let mut d = crate::trace::Drainer::new(partial, start);
    while child.try_wait()?.is_none() {
        d.drain_and_wait(&mut file)?;
    }
    crate::trace::finish_trace(d, &mut file, &trace_path, &counters, pid)
}

/// The counters files of a run's tree: the root's first, then the others
/// in the order their processes started.
fn tree_files(dir: &Path, root: &Path) -> Vec<PathBuf> {
    let mut found: Vec<(bool, std::time::SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "counters") && p.is_file())
        .map(|p| {
            let t = p.metadata().and_then(|m| m.created().or_else(|_| m.modified()));
            (p != root, t.unwrap_or(std::time::UNIX_EPOCH), p)
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, _, p)| p).collect()
}

/// One process of a tree: its pid, command, state and totals.
fn process_line(src: &Source, figs: &Figures) -> String {
    let p = &figs.process;
    let state = match (src.running, p.exited) {
        (true, _) => "still running",
        (false, true) => "exited",
        (false, false) => "ended, its exit handlers not run",
    };
    let command = p.command_line();
    format!("pid {} `{command}` ({state}): {}", p.pid, totals_line(figs).trim_start_matches("totals: "))
}

/// Sets what the audit library needs to give `program`'s process (and,
/// with `follow`, every process it starts) patched libraries.
fn audit_env(
    cmd: &mut std::process::Command,
    program: &Path,
    cache: &Path,
    entries: &[String],
    follow: bool,
) -> Result<()> {
    use alloctramp_audit as audit;
    let runtime = std::fs::canonicalize(patch::find_runtime(None)?)?;
    let lib = runtime.with_file_name(audit::SONAME);
    if !lib.is_file() {
        eprintln!(
            "alloctramp: {} not found beside {}: the libraries the program loads are not profiled",
            audit::SONAME,
            runtime.display()
        );
        return Ok(());
    }
    let exe = std::env::current_exe().context("locating the alloctramp executable")?;
    let mut list = OsString::from(&lib);
    if let Some(other) = std::env::var_os("LD_AUDIT").filter(|v| !v.is_empty()) {
        list.push(":");
        list.push(other);
    }
    cmd.env("LD_AUDIT", list)
        .env(audit::ENV_EXE, exe)
        .env(audit::ENV_CACHE, cache)
        .env(audit::ENV_INDEX, index_dir(cache, &runtime, entries)?)
        .env(audit::ENV_ENTRIES, entries.join("\n"))
        .env(audit::ENV_RUNTIME, &runtime)
        .env(audit::ENV_PROGRAM, std::fs::canonicalize(program)?);
    if follow {
        cmd.env(audit::ENV_FOLLOW, "1");
    }
    Ok(())
}

/// A new directory for the counters files of a run's process tree, in the
/// user's counters directory.
fn tree_dir() -> Result<PathBuf> {
    let dir = counters_dir(None).join(format!("run-{}", std::process::id()));
    create_private_dir(&dir)?;
    Ok(dir)
}

/// The process's totals: allocations and their bytes, frees, and what
/// stayed live at exit.
fn totals_line(figs: &Figures) -> String {
    let live = figs.process.live;
    let mut t = Fig::zero(live);
    for (_, f) in &figs.sites {
        t.add(f);
    }
    let bytes = |b: i128| {
        if b.unsigned_abs() < 1024 { format!("{b} bytes") } else { format!("{b} bytes ({})", text::human(b)) }
    };
    let failed = match t.failed {
        0 => String::new(),
        n => format!("; {n} failed (requesting {})", bytes(t.failed_bytes)),
    };
    let at_exit = match (t.live_calls, t.live_bytes) {
        (Some(n), Some(b)) if !figs.process.incomplete => format!("{n} objects, {}", bytes(b)),
        (Some(n), Some(b)) => format!("at most {n} objects, {} (live figures incomplete)", bytes(b)),
        _ => "not known (live tracking was off)".to_string(),
    };
    format!(
        "totals: {} allocations, {}{failed}; {} frees; live at exit: {at_exit}",
        t.calls - t.failed,
        bytes(t.bytes - t.failed_bytes),
        t.free_calls
    )
}
