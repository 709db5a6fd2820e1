//! `alloctramp run`: patch a program into a cache (reused next time), run
//! it, and print the report when it exits.

use crate::control::counters_dir;
use crate::patch::{self, RuntimeLink};
use crate::report::{self, Source, View};
use crate::util::Input;
use alloctramp_report::model::{Fig, Figures, GroupBy, SortKey};
use alloctramp_report::text;
use anyhow::{Context, Result, anyhow, bail};
use std::ffi::OsString;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};

/// Patch a program (cached), run it, and print its report when it exits.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp run --on -- ./server --port 8080\n  \
    alloctramp run -- git status          # then, from another terminal: alloctramp enable PID\n  \
    alloctramp run --on --entry xmalloc:alloc --entry xfree:free --top 0 -o report.txt -- ./prog\n\n\
The patched copy is kept in $XDG_CACHE_HOME/alloctramp (else ~/.cache/alloctramp), keyed by the program's \
build-id (else its contents), the entry points and this alloctramp; the next run reuses it. The exit status \
is the program's. Only the program itself is patched, not the libraries it loads.")]
pub struct Args {
    /// Profile from the start (ALLOCTRAMP=on); without it, switch on with
    /// `alloctramp enable PID` while the program runs.
    #[arg(long)]
    pub on: bool,
    /// Also count calls to this function (see `alloctramp sites --help`).
    #[arg(long = "entry", value_name = "SPEC")]
    pub entries: Vec<String>,
    /// Write the report to FILE instead of stderr.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// The cache of patched programs [default: $XDG_CACHE_HOME/alloctramp,
    /// else ~/.cache/alloctramp].
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
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

fn hash_file(h: &mut impl Hasher, path: &Path) -> Result<()> {
    let input = Input::open(path)?;
    input.map.len().hash(h);
    h.write(&input.map);
    Ok(())
}

/// The cached patched copy of `program` (patched now if not cached yet),
/// and whether it was cached already.
pub fn cached_patch(program: &Path, entries: &[String], cache: &Path) -> Result<(PathBuf, bool)> {
    let input = Input::open(program)?;
    let elf = alloctramp_patcher::Elf::parse(&input.map).map_err(|e| anyhow!("{}: {e}", program.display()))?;
    if elf.section_by_name(alloctramp_trampolines::layout::SEC_SITES).is_some() {
        // Patched already: run it as it is.
        return Ok((program.to_path_buf(), true));
    }
    let runtime = patch::find_runtime(None)?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    env!("CARGO_PKG_VERSION").hash(&mut h);
    if let Ok(exe) = std::env::current_exe()
        && let Ok(m) = exe.metadata()
    {
        m.len().hash(&mut h);
        m.modified().ok().hash(&mut h);
    }
    hash_file(&mut h, &runtime)?;
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
    entries.hash(&mut h);
    let name = program.file_name().map_or_else(|| "program".into(), |n| n.to_string_lossy().into_owned());
    let dir = cache.join(format!("{name}-{:016x}", h.finish()));
    let out = dir.join(&name);
    if out.is_file() && dir.join(alloctramp_trampolines::layout::RUNTIME_SONAME).is_file() {
        return Ok((out, true));
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("{}: cannot create the cache directory", dir.display()))?;
    let args = patch::Args {
        wrappers: Default::default(),
        input: program.to_path_buf(),
        output: Some(out.clone()),
        entries: entries.to_vec(),
        runtime: Some(runtime),
        runtime_link: RuntimeLink::Origin,
        shards: 16,
        no_library_unwind: false,
    };
    let s = patch::patch_file(&args)?;
    eprintln!("alloctramp: patched {} into {} ({} sites)", program.display(), out.display(), s.sites);
    Ok((out, false))
}

pub fn run(mut args: Args) -> Result<()> {
    if args.view.format == alloctramp_report::Format::Pprof {
        if args.output.is_none() {
            bail!("--format pprof writes a binary profile: give -o FILE");
        }
        if args.view.group_by != GroupBy::Site {
            bail!("--format pprof has one location per site: --group-by is for the other formats");
        }
    }
    let program_arg = args.command.remove(0);
    let program = find_program(&program_arg)?;
    let cache = cache_dir(args.cache.as_deref());
    let (patched, cached) = cached_patch(&program, &args.entries, &cache)?;
    if cached && patched != program {
        eprintln!("alloctramp: using {} (patched before)", patched.display());
    }
    let dir = counters_dir(None);
    let mut cmd = std::process::Command::new(&patched);
    cmd.arg0(&program_arg).args(&args.command);
    if args.on {
        cmd.env("ALLOCTRAMP", "on");
    }
    if args.view.callers && std::env::var_os("ALLOCTRAMP_CALLERS").is_none() {
        cmd.env("ALLOCTRAMP_CALLERS", "on");
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
    let status = child.wait().context("waiting for the program")?;
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    let file = dir.join(alloctramp_trampolines::process::counters_file_name(pid));
    if !file.is_file() {
        let why = if args.on {
            "profiling was unavailable; see its messages above"
        } else {
            "profiling was never switched on, so it removed its file at exit"
        };
        eprintln!("alloctramp: {} left no counters file in {} ({why})", program.display(), dir.display());
        std::process::exit(code);
    }
    let src = Source::open(&file.to_string_lossy(), &dir)?;
    let mut figs = src.figures()?;
    let notes = report::notes(&src, &figs);
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
        eprintln!(
            "alloctramp: {} {how}; its figures stay in {} (alloctramp report FILE)",
            program.display(),
            file.display()
        );
        report::print_notes(&notes, false);
        eprintln!("alloctramp: {totals}");
    }
    let mut buf = Vec::new();
    report::write_report(&mut buf, &src, &figs, &rows, &view)?;
    match &args.output {
        Some(p) => crate::util::write_atomic(p, &buf, 0o644)?,
        None => {
            let _ = std::io::stderr().write_all(&buf);
        }
    }
    std::process::exit(code)
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
