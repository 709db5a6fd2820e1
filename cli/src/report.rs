//! `alloctramp report` and the commands that talk to a running process
//! (`enable`, `disable`, `reset`).

use alloctramp_trampolines::entry::Kind;
use alloctramp_trampolines::layout::SiteForm;
use alloctramp_trampolines::process::{self, ProcessFile};
use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where this user's process files are: `--dir`, else `$ALLOCTRAMP_DIR`,
/// else the runtime's default.
pub fn counters_dir(explicit: Option<&Path>) -> PathBuf {
    if let Some(d) = explicit {
        return d.to_path_buf();
    }
    if let Some(d) = std::env::var_os("ALLOCTRAMP_DIR") {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc_geteuid() };
    PathBuf::from(process::default_dir(std::env::var("XDG_RUNTIME_DIR").ok().as_deref(), uid))
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// A PID or a file: the counters file to read.
pub fn resolve(target: &str, dir: &Path) -> Result<PathBuf> {
    if let Ok(pid) = target.parse::<u32>() {
        let p = dir.join(process::counters_file_name(pid));
        if !p.exists() {
            if Path::new(&format!("/proc/{pid}")).exists() {
                bail!("process {pid} runs no patched code (no {})", p.display());
            }
            bail!("no process {pid}");
        }
        return Ok(p);
    }
    Ok(PathBuf::from(target))
}

/// A module in a report.
#[derive(Serialize, Clone, Debug)]
pub struct ModuleDoc {
    pub name: String,
    pub sites: u32,
    pub on: bool,
    pub unloaded: bool,
}

/// One row of a report.
#[derive(Serialize, Clone, Debug)]
pub struct Row {
    pub module: String,
    pub address: u64,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub entry: String,
    pub kind: &'static str,
    pub form: &'static str,
    pub calls: u64,
    pub bytes: u64,
    pub failed: u64,
    pub live_calls: u64,
    pub live_bytes: u64,
    pub freed_objects: u64,
    pub untracked_frees: u64,
}

/// Reads every site's figures from a process file.
pub fn rows(pf: &ProcessFile) -> Result<Vec<Row>> {
    let mut out = Vec::new();
    for m in pf.modules().map_err(|e| anyhow!("{e}"))? {
        let t = &m.table;
        for (i, s) in t.sites().enumerate() {
            let c = m.cell(i);
            let entry = t.entry(s.entry as usize);
            let kind = entry.as_ref().and_then(|e| Kind::from_code(e.kind)).unwrap_or(Kind::Alloc);
            let allocates = kind != Kind::Free;
            out.push(Row {
                module: t.module_name().to_string(),
                address: s.addr,
                function: t.string(s.function).map(str::to_string),
                file: t.string(s.file).map(str::to_string),
                line: (s.line != 0).then_some(s.line),
                entry: entry.and_then(|e| t.string(e.name)).unwrap_or("?").to_string(),
                kind: kind.as_str(),
                form: SiteForm::from_code(s.form).map_or("?", SiteForm::as_str),
                calls: c.calls,
                bytes: c.bytes,
                failed: c.failed,
                live_calls: if allocates {
                    (c.calls - c.failed.min(c.calls)).saturating_sub(c.freed_objects)
                } else {
                    0
                },
                live_bytes: if allocates { c.bytes.saturating_sub(c.freed_bytes) } else { 0 },
                freed_objects: c.freed_objects,
                untracked_frees: c.untracked_frees,
            });
        }
    }
    Ok(out)
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Print allocation figures per call site, like /proc/allocinfo.
///
/// Example: alloctramp report 12345 | sort -g -r | head
#[derive(clap::Args)]
pub struct Args {
    /// A process id, or a counters file (a process's final snapshot).
    pub target: String,
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
    /// Where process counters files are [default: $ALLOCTRAMP_DIR, else
    /// $XDG_RUNTIME_DIR/alloctramp, else /tmp/alloctramp-UID].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let dir = counters_dir(args.dir.as_deref());
    let path = resolve(&args.target, &dir)?;
    let bytes = std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))?;
    let pf = ProcessFile::parse(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    let rows = rows(&pf).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    crate::util::emit(|w| match args.format {
        Format::Json => {
            #[derive(Serialize)]
            struct Doc<'a> {
                format: &'static str,
                version: u32,
                pid: u32,
                command: &'a str,
                on: bool,
                exited: bool,
                generation: u64,
                last_switch_ns: u64,
                last_switch_sites: u64,
                modules: Vec<ModuleDoc>,
                sites: &'a [Row],
            }
            let doc = Doc {
                format: "alloctramp-report",
                version: 1,
                pid: pf.pid,
                command: &pf.command,
                on: pf.on,
                exited: pf.exited,
                generation: pf.generation,
                last_switch_ns: pf.last_switch_ns,
                last_switch_sites: pf.last_switch_sites,
                modules: pf
                    .modules()
                    .unwrap_or_default()
                    .iter()
                    .map(|m| ModuleDoc {
                        name: m.table.module_name().to_string(),
                        sites: m.table.header.site_count,
                        on: m.on,
                        unloaded: m.unloaded,
                    })
                    .collect(),
                sites: &rows,
            };
            serde_json::to_writer_pretty(&mut *w, &doc)?;
            writeln!(w)
        }
        Format::Text => {
            writeln!(w, "allocinfo - version: 1.0")?;
            writeln!(w, "#     <size>  <calls> <tag info>")?;
            for r in rows.iter().filter(|r| r.kind != "free") {
                let loc = match (&r.file, r.line) {
                    (Some(f), Some(l)) => format!("{f}:{l}"),
                    _ => format!("{:#x}", r.address),
                };
                writeln!(
                    w,
                    "{:12} {:8} {loc} module:{} func:{}",
                    r.live_bytes,
                    r.live_calls,
                    r.module,
                    r.function.as_deref().unwrap_or("?")
                )?;
            }
            Ok(())
        }
    })
}

/// Switch profiling in a running process.
///
/// Example: alloctramp enable 12345
#[derive(clap::Args)]
pub struct SwitchArgs {
    /// The process id.
    pub pid: u32,
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// How long to wait for the process to act on the request.
    #[arg(long, default_value_t = 5.0)]
    pub timeout: f64,
}

/// Writes the request into the process's control file, signals it (or lets
/// its watcher see the file), and waits until the process reports that the
/// request was carried out.
pub fn switch(args: SwitchArgs, request: &str) -> Result<()> {
    let dir = counters_dir(args.dir.as_deref());
    let path = resolve(&args.pid.to_string(), &dir)?;
    let read = || -> Result<(u64, bool, String, u32, bool, bool)> {
        let bytes = std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        let pf = ProcessFile::parse(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok((pf.generation, pf.on, pf.last_error.clone(), pf.signal, pf.watcher, pf.exited))
    };
    let (generation, _, _, signal, watcher, exited) = read()?;
    if exited || !Path::new(&format!("/proc/{}", args.pid)).exists() {
        bail!("process {} has exited", args.pid);
    }
    if signal == 0 && !watcher {
        bail!("process {} listens to no signal and runs no watcher (ALLOCTRAMP_SIGNAL=none)", args.pid);
    }
    let ctl = dir.join(process::control_file_name(args.pid));
    crate::util::write_atomic(&ctl, format!("{request}\n").as_bytes(), 0o600)?;
    if signal != 0 {
        // SAFETY: kill(2) with a pid and a signal number.
        if unsafe { libc_kill(args.pid as i32, signal as i32) } != 0 {
            bail!("cannot signal process {}: {}", args.pid, std::io::Error::last_os_error());
        }
    }
    let deadline = Instant::now() + Duration::from_secs_f64(args.timeout);
    loop {
        let (g, on, err, ..) = read()?;
        if g != generation {
            if !err.is_empty() {
                bail!("process {}: {err}", args.pid);
            }
            let state = if on { "on" } else { "off" };
            match request {
                "reset" => eprintln!("alloctramp: process {}: counters reset (profiling {state})", args.pid),
                _ => eprintln!("alloctramp: process {}: profiling {state}", args.pid),
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("process {} did not act on the request within {} s", args.pid, args.timeout);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
