//! `alloctramp report`: per-site figures of a running process, a snapshot or
//! the final file a process left, in the `/proc/allocinfo` layout, JSON or
//! CSV; without an argument, the list of this user's profiled processes.
//!
//! The figures are read from the memory-mapped counters file (the process
//! is never stopped); the `alloctramp-report` library turns its bytes into
//! rows and writes them. Here: the arguments, finding the file, and notes.

use crate::control::{Target, counters_dir, file_process_running, parse_target, pid_file};
use crate::util::{Snapshot, emit};
use alloctramp_report::json::ProcessDoc;
use alloctramp_report::model::{self, Figures, GroupBy, Row, Selection, SortKey};
use alloctramp_report::{Format, csv, json, read, text};
use alloctramp_trampolines::process::ProcessFile;
use anyhow::{Result, anyhow, bail};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use std::io::{self, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A value parser for an enum of the report library: the names (and their
/// parsing) are the library's, the help line of each value (empty: none)
/// is the command line's.
fn choice<T>(values: &'static [(&'static str, &'static str)]) -> impl TypedValueParser<Value = T>
where
    T: FromStr + Clone + Send + Sync + 'static,
    T::Err: std::fmt::Display,
{
    let possible = values.iter().map(|&(name, help)| {
        let v = PossibleValue::new(name);
        if help.is_empty() { v } else { v.help(help) }
    });
    PossibleValuesParser::new(possible)
        .map(|s: String| s.parse::<T>().unwrap_or_else(|e| unreachable!("a possible value that does not parse: {e}")))
}

const FORMATS: &[(&str, &str)] = &[
    (Format::Text.as_str(), "The /proc/allocinfo layout"),
    (Format::Json.as_str(), "One JSON document (schema in docs/formats.md)"),
    (Format::Csv.as_str(), "Comma-separated values with a header row"),
    (Format::Pprof.as_str(), "A gzipped pprof heap profile (go tool pprof, Pyroscope, Parca); binary: use -o FILE"),
];

const SORT_KEYS: &[(&str, &str)] = &[
    (SortKey::LiveBytes.as_str(), "Live bytes (totals when live tracking is off), largest first"),
    (SortKey::LiveCalls.as_str(), "Live objects (calls minus failures when live tracking is off)"),
    (SortKey::Bytes.as_str(), "Bytes requested in total"),
    (SortKey::Calls.as_str(), "Calls in total"),
];

const GROUPINGS: &[(&str, &str)] = &[
    (GroupBy::Site.as_str(), ""),
    (GroupBy::Function.as_str(), ""),
    (GroupBy::File.as_str(), ""),
    (GroupBy::Module.as_str(), ""),
];

/// How rows are selected and shown (shared by `report`, `diff` and `run`).
#[derive(clap::Args, Clone, Debug)]
pub struct View {
    /// Output format.
    #[arg(long, value_parser = choice::<Format>(FORMATS), default_value = "text")]
    pub format: Format,
    /// Sort rows, largest first [default: site order, as /proc/allocinfo;
    /// live-bytes with --top].
    #[arg(long, value_parser = choice::<SortKey>(SORT_KEYS))]
    pub sort: Option<SortKey>,
    /// Only the first N rows (sorted by --sort, default live-bytes; 0: all
    /// rows).
    #[arg(long, value_name = "N")]
    pub top: Option<usize>,
    /// Sizes in B/KiB/MiB/GiB, as `sort -h` reads them.
    #[arg(long)]
    pub human: bool,
    /// Only sites of this module (its SONAME or file name).
    #[arg(long, value_name = "NAME")]
    pub module: Option<String>,
    /// Only rows whose size column is at least N bytes (K, M, G suffixes:
    /// 64K, 1M).
    #[arg(long, value_name = "N", value_parser = parse_size)]
    pub min_bytes: Option<u64>,
    /// All figures: total calls and bytes, failed calls, freed objects,
    /// untracked frees; free sites too.
    #[arg(long)]
    pub all_columns: bool,
    /// One row per site, or summed per function, source file or module.
    #[arg(long, value_parser = choice::<GroupBy>(GROUPINGS), default_value = "site")]
    pub group_by: GroupBy,
    /// No notes on stderr (live tracking off, process exited, ...).
    #[arg(short, long)]
    pub quiet: bool,
    /// The call chains recorded for each site (callers capture: `alloctramp
    /// callers PID on`, or ALLOCTRAMP_CALLERS=on), with their calls and
    /// bytes: after the table in text, in each site's `callers` in JSON.
    #[arg(long)]
    pub callers: bool,
    /// Also allocation plumbing, for --callers (a glob over demangled
    /// names, `*` any text), besides the default list: a chain of a site in
    /// plumbing is attributed to its first frame outside it.
    #[arg(long = "plumbing", value_name = "PATTERN", requires = "callers")]
    pub plumbing: Vec<String>,
    /// The text layout's version: 1 (`allocinfo - version: 1.0`), or 2, the
    /// kernel's newer layout (`allocinfo - version: 2.0`; rows say
    /// `accurate:no` when their figures are not exact live figures).
    #[arg(long, value_name = "VERSION", value_parser = ["1", "2"], default_value = "1")]
    pub allocinfo_version: String,
}

impl Default for View {
    fn default() -> View {
        View {
            format: Format::Text,
            sort: None,
            top: None,
            human: false,
            module: None,
            min_bytes: None,
            all_columns: false,
            group_by: GroupBy::Site,
            quiet: false,
            callers: false,
            plumbing: Vec::new(),
            allocinfo_version: "1".to_string(),
        }
    }
}

impl View {
    /// The rows this view shows (text without --all-columns: no free
    /// sites).
    pub fn selection(&self) -> Selection<'_> {
        Selection {
            module: self.module.as_deref(),
            group_by: self.group_by,
            allocating_only: !self.all_columns && self.format == Format::Text,
            min_bytes: self.min_bytes,
            sort: self.sort,
            top: self.top,
        }
    }

    /// `inaccurate`: the size and calls columns are not exact live
    /// figures (said with `--allocinfo-version 2`).
    pub fn text_options(&self, diff: bool, inaccurate: bool) -> text::Options {
        text::Options {
            all_columns: self.all_columns,
            human: self.human,
            diff,
            version2: self.allocinfo_version == "2",
            inaccurate,
            totals_first: matches!(self.sort, Some(SortKey::Bytes | SortKey::Calls)),
        }
    }
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (t, 1u64),
        Some((i, _)) => {
            let m = match t[i..].to_ascii_lowercase().as_str() {
                "b" => 1,
                "k" | "kb" | "kib" => 1 << 10,
                "m" | "mb" | "mib" => 1 << 20,
                "g" | "gb" | "gib" => 1 << 30,
                "t" | "tb" | "tib" => 1 << 40,
                _ => return Err(format!("{s:?}: expected a number of bytes, like 4096, 64K or 1M")),
            };
            (&t[..i], m)
        }
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected a number of bytes, like 4096, 64K or 1M"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?}: too large"))
}

/// Print allocation figures per call site, like /proc/allocinfo.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp report                                  # this user's profiled processes\n  \
    alloctramp report 12345 | sort -g -r | head        # largest live sites first\n  \
    alloctramp report 12345 --top 10 --human --all-columns\n  \
    alloctramp report 12345 --group-by module\n  \
    alloctramp report saved.snapshot --format csv > sites.csv\n  \
    alloctramp report 12345 --format pprof -o heap.pb.gz && go tool pprof -top heap.pb.gz\n\n\
Without live tracking (ALLOCTRAMP_LIVE=0) <size> and <calls> are totals since profiling was switched on.")]
pub struct Args {
    /// A process id, or a counters file (a snapshot, or the final file a
    /// process left). Without it: this user's processes that run patched
    /// code, one line each.
    pub target: Option<String>,
    #[command(flatten)]
    pub view: View,
    /// Without a target: also list the files of processes that have exited.
    #[arg(long)]
    pub all: bool,
    /// Where process counters files are [default: $ALLOCTRAMP_DIR, else
    /// $XDG_RUNTIME_DIR/alloctramp, else /tmp/alloctramp-UID].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Write the report to FILE (complete or not at all: written aside and
    /// renamed into place) instead of stdout.
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// An opened counters file (a live process's or a saved one).
pub struct Source {
    pub path: PathBuf,
    pub input: Snapshot,
    /// Given as a process id.
    pub by_pid: bool,
    /// The process that wrote the file runs now.
    pub running: bool,
}

impl Source {
    pub fn open(target: &str, dir: &Path) -> Result<Source> {
        let (path, by_pid) = match parse_target(target) {
            Target::Pid(pid) => (pid_file(pid, dir)?, true),
            Target::File(p) => {
                if !p.exists() {
                    bail!("{}: no such file (and not a process id)", p.display());
                }
                (p, false)
            }
        };
        let mut src = Source { input: Snapshot::read(&path)?, path, by_pid, running: false };
        // A module registering while the file was read may lie past the
        // end read: read again.
        for _ in 0..3 {
            let (running, complete) = {
                let pf = src.parse()?;
                (file_process_running(&pf), pf.modules().is_ok())
            };
            src.running = running;
            if complete || !running {
                break;
            }
            src.input = Snapshot::read(&src.path)?;
        }
        Ok(src)
    }

    pub fn parse(&self) -> Result<ProcessFile<'_>> {
        read::parse(&self.input.bytes).map_err(|e| anyhow!("{}: {e}", self.path.display()))
    }

    pub fn figures(&self) -> Result<Figures<'_>> {
        let pf = self.parse()?;
        read::figures(&pf).map_err(|e| anyhow!("{}: {e}", self.path.display()))
    }

    /// The process part of a JSON document, borrowing `path`.
    pub fn doc<'a>(&self, path: &'a str, figs: &'a Figures) -> ProcessDoc<'a> {
        ProcessDoc::new(path, self.running, &figs.process, &figs.modules)
    }
}

/// The rows `view` shows of `figs` (whose sites they take).
pub fn rows<'a>(figs: &mut Figures<'a>, view: &View) -> Result<Vec<Row<'a>>> {
    Ok(model::select(std::mem::take(&mut figs.sites), &figs.modules, &view.selection(), false)?)
}

/// Notes on stderr about what the figures mean (stdout stays parseable).
pub fn notes(src: &Source, figs: &Figures) -> Vec<String> {
    let mut n = Vec::new();
    let p = &figs.process;
    let pid = p.pid;
    if !src.running {
        if p.exited {
            if src.by_pid {
                n.push(format!("process {pid} has exited: these are its final figures ({})", src.path.display()));
            }
        } else if src.by_pid {
            n.push(format!("process {pid} is gone without exiting normally: figures as it left them"));
        }
    }
    if !p.live {
        n.push(
            "live tracking is off in this process (ALLOCTRAMP_LIVE=0, or a runtime without it): <size> and <calls> \
             are totals since profiling was switched on (or reset), not live figures"
                .to_string(),
        );
    }
    if p.draining {
        let live: i128 = figs.sites.iter().filter_map(|(_, f)| f.live_calls).sum();
        n.push(format!(
            "profiling is off; free sites stay on until the {live} tracked objects are freed, so live figures keep \
             coming down"
        ));
    }
    if p.incomplete {
        let untracked = if p.untracked_allocs > 0 {
            format!("; {} allocations could not be tracked", p.untracked_allocs)
        } else {
            String::new()
        };
        n.push(format!(
            "live figures may overstate: profiling was switched fully off while objects were live{untracked}"
        ));
    }
    if src.running && !p.on && !p.draining && figs.sites.iter().all(|(_, f)| f.is_zero()) {
        n.push(format!("profiling is off in process {pid} and nothing was counted: `alloctramp enable {pid}`"));
    }
    n
}

pub fn print_notes(notes: &[String], quiet: bool) {
    if !quiet {
        for l in notes {
            eprintln!("alloctramp: {l}");
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let dir = counters_dir(args.dir.as_deref());
    let Some(target) = &args.target else {
        if args.output.is_some() {
            bail!("-o FILE is for a report of one process: name it (PID or FILE)");
        }
        return list(&dir, &args.view, args.all);
    };
    let view = &args.view;
    if view.format == Format::Pprof {
        if view.group_by != GroupBy::Site {
            bail!("--format pprof has one location per site: --group-by is for the other formats");
        }
        if args.output.is_none() && io::stdout().is_terminal() {
            bail!("--format pprof writes a binary profile: give -o FILE, or redirect stdout");
        }
    }
    if let Some(out) = &args.output {
        crate::util::check_output_path(out)?;
    }
    let src = Source::open(target, &dir)?;
    let mut figs = src.figures()?;
    print_notes(&notes(&src, &figs), view.quiet);
    let rows = rows(&mut figs, view)?;
    match &args.output {
        Some(out) => crate::util::write_atomic_with(out, 0o644, |w| write_report(w, &src, &figs, &rows, view)),
        None => emit(|w| write_report(w, &src, &figs, &rows, view)),
    }
}

/// A report in the view's format.
pub fn write_report(w: &mut dyn Write, src: &Source, figs: &Figures, rows: &[Row], view: &View) -> io::Result<()> {
    let (chains, lost) = match (view.callers, src.parse()) {
        (true, Ok(pf)) => {
            let plumbing = alloctramp_patcher::plumbing::Plumbing::with(&view.plumbing);
            (crate::callers::chains(&pf, &plumbing), crate::callers::Lost::of(&pf))
        }
        _ => (Vec::new(), Default::default()),
    };
    match view.format {
        Format::Text => {
            text::write(w, rows, &view.text_options(false, !figs.process.live || figs.process.incomplete))?;
            if view.callers {
                crate::callers::write_text(w, rows, &chains, lost)?;
            }
            Ok(())
        }
        Format::Csv => csv::write(w, rows, view.group_by, false),
        Format::Json if view.callers => {
            let path = src.path.display().to_string();
            let mut buf = Vec::new();
            json::write_report(&mut buf, &src.doc(&path, figs), rows, view.group_by, view.selection().order())?;
            crate::callers::write_json(w, &buf, &chains, lost)
        }
        Format::Json => {
            let path = src.path.display().to_string();
            json::write_report(w, &src.doc(&path, figs), rows, view.group_by, view.selection().order())
        }
        Format::Pprof => {
            // The sites the view selects, with their figures.
            let shown = Figures {
                process: figs.process.clone(),
                modules: figs.modules.clone(),
                sites: rows.iter().filter(|r| r.sites == 1).map(|r| (r.site.clone(), r.fig)).collect(),
            };
            w.write_all(&pprof(src, &shown, &view.plumbing))
        }
    }
}

/// The pprof heap profile of `figs` (read from `src`): its sites' source
/// lines with inlined functions where the modules' files are found (the
/// process's mappings: recorded in the file, else /proc/PID/maps of a
/// running process, else the program's command when it names a file of
/// the module's build id), and their call chains where callers were
/// captured.
pub fn pprof(src: &Source, figs: &Figures, plumbing: &[String]) -> Vec<u8> {
    use alloctramp_report::pprof::{Extra, Mapped, module_files, write};
    let (chains, mut maps) = match src.parse() {
        Ok(pf) => {
            let plumbing = alloctramp_patcher::plumbing::Plumbing::with(plumbing);
            let maps: Vec<Mapped> = pf
                .maps()
                .into_iter()
                .map(|m| Mapped { start: m.start, end: m.end, offset: m.offset, path: m.path })
                .collect();
            (crate::callers::chains(&pf, &plumbing), maps)
        }
        Err(_) => (Vec::new(), Vec::new()),
    };
    if maps.is_empty() && src.running {
        maps = proc_maps(figs.process.pid);
    }
    // A module no mapping names (the file of a process that exited without
    // callers capture): the program's own file, if its command names a
    // file of the same build.
    let named = module_files(figs, &maps);
    let missing: Vec<&alloctramp_report::ModuleInfo> =
        figs.modules.iter().filter(|m| !named.contains_key(&m.name)).collect();
    drop(named);
    for m in missing {
        let Ok(path) = std::fs::canonicalize(&figs.process.command) else { break };
        if m.build_id.is_empty() || !crate::callers::has_build_id(&path, &m.build_id) {
            continue;
        }
        let addrs = figs.sites.iter().filter(|(s, _)| s.module == m.name).map(|(s, _)| s.address);
        let (lo, hi) = addrs.fold((u64::MAX, 0), |(lo, hi), a| (lo.min(a), hi.max(a)));
        if lo <= hi {
            let (start, end) = (m.bias.wrapping_add(lo), m.bias.wrapping_add(hi).wrapping_add(1));
            maps.push(Mapped { start, end, offset: 0, path: path.to_string_lossy().into_owned() });
        }
    }
    let mut inlined = std::collections::HashMap::new();
    for (module, map) in module_files(figs, &maps) {
        let sites: Vec<&alloctramp_report::SiteInfo> =
            figs.sites.iter().map(|(s, _)| s).filter(|s| s.module == module).collect();
        for (address, lines) in crate::callers::site_lines(Path::new(&map.path), &sites) {
            inlined.insert((module.clone(), address), lines);
        }
    }
    let time_nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
    write(figs, &Extra { maps: &maps, inlined, chains: &chains, time_nanos, module: None })
}

/// The executable file mappings of a running process (`/proc/PID/maps`).
pub fn proc_maps(pid: u32) -> Vec<alloctramp_report::pprof::Mapped> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms, offset) = (f.next()?, f.next()?, f.next()?);
            // The path is the rest of the line from its first '/'.
            let path = &l[l.find('/')?..];
            if !perms.contains('x') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some(alloctramp_report::pprof::Mapped {
                start: u64::from_str_radix(a, 16).ok()?,
                end: u64::from_str_radix(b, 16).ok()?,
                offset: u64::from_str_radix(offset, 16).ok()?,
                path: path.to_string(),
            })
        })
        .collect()
}

/// A counters file of the directory.
pub enum Found {
    /// Its header reads (whether its modules do is for the reader).
    Readable(Source),
    /// It cannot be read: its path and why.
    Unreadable(PathBuf, String),
}

/// The counters files (`PID.counters`) of a directory that belong to
/// this user (others are left alone), each copied into memory without
/// stopping its process and its header parsed. A file removed meanwhile
/// (its process exited without profiling) is left out.
pub fn discover(entries: std::fs::ReadDir) -> Vec<Found> {
    use std::os::unix::fs::MetadataExt;
    let me = crate::control::euid();
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "counters") {
            continue;
        }
        if p.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse::<u32>().ok()).is_none() {
            continue;
        }
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.uid() == me || me == 0 => {}
            _ => continue,
        }
        let input = match Snapshot::read(&p) {
            Ok(i) => i,
            Err(_) if !p.exists() => continue,
            Err(e) => {
                let why = e.chain().skip(1).map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
                out.push(Found::Unreadable(p, why));
                continue;
            }
        };
        let running = match ProcessFile::parse(&input.bytes) {
            Ok(pf) => file_process_running(&pf),
            Err(e) => {
                out.push(Found::Unreadable(p, read::ReadError(e).to_string()));
                continue;
            }
        };
        out.push(Found::Readable(Source { path: p, input, by_pid: true, running }));
    }
    out
}

/// One line per process of this user that runs patched code.
fn list(dir: &Path, view: &View, all: bool) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if !view.quiet {
                eprintln!("alloctramp: no process of yours runs patched code ({} does not exist)", dir.display());
            }
            return Ok(());
        }
        Err(e) => return Err(anyhow!("{}: {e}", dir.display())),
    };
    let mut found: Vec<(u32, String)> = Vec::new();
    // Files that cannot be read are said, not listed: those of running
    // processes, and with `all` every one.
    let mut unreadable: Vec<String> = Vec::new();
    let runs = |p: &Path| {
        let pid = p.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse::<u32>().ok());
        pid.is_some_and(|pid| Path::new("/proc").join(pid.to_string()).exists())
    };
    for f in discover(entries) {
        let src = match f {
            Found::Readable(src) => src,
            Found::Unreadable(p, why) => {
                if all || runs(&p) {
                    unreadable.push(format!("{}: {why}", p.display()));
                }
                continue;
            }
        };
        let running = src.running;
        if !running && !all {
            continue;
        }
        let pf = match read::parse(&src.input.bytes) {
            Ok(pf) => pf,
            Err(e) => {
                unreadable.push(format!("{}: {e}", src.path.display()));
                continue;
            }
        };
        let figs = match read::figures(&pf) {
            Ok(f) => f,
            Err(e) => {
                unreadable.push(format!("{}: {}", src.path.display(), read::ReadError(e)));
                continue;
            }
        };
        let pid = pf.pid;
        let state = if running {
            if pf.on {
                "on"
            } else if figs.process.draining {
                "draining"
            } else {
                "off"
            }
        } else if pf.exited {
            "exited"
        } else {
            "gone"
        };
        let live = match figs.live_bytes() {
            Some(b) if view.human => text::human(b),
            Some(b) => b.to_string(),
            None => "-".to_string(),
        };
        // Modules not in the file yet (never switched on) count by number.
        let mut names: Vec<String> = figs.modules.iter().map(|m| m.name.clone()).collect();
        match pf.pending_modules {
            0 => {}
            n if names.is_empty() => names.push(format!("{n} module{}", if n == 1 { "" } else { "s" })),
            n => names.push(format!("+{n}")),
        }
        let sites: u64 = figs.modules.iter().map(|m| m.sites as u64).sum::<u64>() + pf.pending_sites;
        let command = if pf.command.is_empty() { "?".to_string() } else { pf.command_line() };
        found.push((pid, format!("{pid:>8} {state:<8} {live:>12} {sites:>7} {:<24} {command}", names.join(","))));
    }
    found.sort();
    if !view.quiet {
        for u in &unreadable {
            eprintln!("alloctramp: {u} (not listed)");
        }
    }
    if found.is_empty() && unreadable.is_empty() && !view.quiet {
        eprintln!("alloctramp: no process of yours runs patched code (looked in {})", dir.display());
    }
    emit(|w| {
        if !found.is_empty() {
            writeln!(w, "#    PID STATE      LIVE-BYTES   SITES MODULES                  COMMAND")?;
        }
        for (_, l) in &found {
            writeln!(w, "{l}")?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value of the library's enums is offered, under its own name.
    #[test]
    fn every_choice_is_offered() {
        let names = |t: &[(&'static str, &str)]| t.iter().map(|v| v.0).collect::<Vec<&str>>();
        assert_eq!(names(FORMATS), Format::ALL.iter().map(|f| f.as_str()).collect::<Vec<_>>());
        assert_eq!(names(SORT_KEYS), SortKey::ALL.iter().map(|f| f.as_str()).collect::<Vec<_>>());
        assert_eq!(names(GROUPINGS), GroupBy::ALL.iter().map(|f| f.as_str()).collect::<Vec<_>>());
    }
}
