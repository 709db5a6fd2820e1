//! `alloctramp report`: per-site figures of a running process, a snapshot or
//! the final file a process left, in the `/proc/allocinfo` layout, JSON or
//! CSV; without an argument, the list of this user's profiled processes.
//!
//! The figures are read from the memory-mapped counters file (the process
//! is never stopped), and names come from the site table copy in that file.

use crate::control::{Target, counters_dir, file_process_running, parse_target, pid_file};
use crate::util::{Snapshot, emit};
use alloctramp_trampolines::entry::Kind;
use alloctramp_trampolines::layout::SiteForm;
use alloctramp_trampolines::process::{ProcessFile, flags};
use anyhow::{Result, anyhow, bail};
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// The order of rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SortKey {
    /// Live bytes (totals when live tracking is off), largest first.
    LiveBytes,
    /// Live objects (calls minus failures when live tracking is off).
    LiveCalls,
    /// Bytes requested in total.
    Bytes,
    /// Calls in total.
    Calls,
}

/// What one row stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GroupBy {
    Site,
    Function,
    File,
    Module,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// The /proc/allocinfo layout.
    Text,
    /// One JSON document (schema in docs/formats.md).
    Json,
    /// Comma-separated values with a header row.
    Csv,
}

/// How rows are selected and shown (shared by `report`, `diff` and `run`).
#[derive(clap::Args, Clone, Debug)]
pub struct View {
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub format: Format,
    /// Sort rows, largest first [default: site order, as /proc/allocinfo;
    /// live-bytes with --top].
    #[arg(long, value_enum)]
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
    /// untracked frees, usable bytes; free sites too.
    #[arg(long)]
    pub all_columns: bool,
    /// One row per site, or summed per function, source file or module.
    #[arg(long, value_enum, default_value = "site")]
    pub group_by: GroupBy,
    /// No notes on stderr (live tracking off, process exited, ...).
    #[arg(short, long)]
    pub quiet: bool,
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
    alloctramp report saved.snapshot --format csv > sites.csv\n\n\
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
}

/// Figures of one row: a site, a group of sites, or a difference. Signed so
/// that differences use the same type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fig {
    /// Calls of allocation and realloc sites.
    pub calls: i128,
    /// Bytes requested through them (failed calls included).
    pub bytes: i128,
    pub failed: i128,
    /// Live objects and their bytes (None: live tracking was off).
    pub live_calls: Option<i128>,
    pub live_bytes: Option<i128>,
    pub freed_objects: i128,
    pub freed_bytes: i128,
    /// Calls of free sites.
    pub free_calls: i128,
    pub untracked_frees: i128,
    /// Bytes the allocator reserved for the live objects (None: not
    /// tracked).
    pub usable_bytes: Option<i128>,
}

fn add_opt(a: Option<i128>, b: Option<i128>) -> Option<i128> {
    Some(a? + b?)
}
fn sub_opt(a: Option<i128>, b: Option<i128>) -> Option<i128> {
    Some(a? - b?)
}

impl Fig {
    pub fn add(&mut self, o: &Fig) {
        self.calls += o.calls;
        self.bytes += o.bytes;
        self.failed += o.failed;
        self.live_calls = add_opt(self.live_calls, o.live_calls);
        self.live_bytes = add_opt(self.live_bytes, o.live_bytes);
        self.freed_objects += o.freed_objects;
        self.freed_bytes += o.freed_bytes;
        self.free_calls += o.free_calls;
        self.untracked_frees += o.untracked_frees;
        self.usable_bytes = add_opt(self.usable_bytes, o.usable_bytes);
    }
    pub fn sub(&self, o: &Fig) -> Fig {
        Fig {
            calls: self.calls - o.calls,
            bytes: self.bytes - o.bytes,
            failed: self.failed - o.failed,
            live_calls: sub_opt(self.live_calls, o.live_calls),
            live_bytes: sub_opt(self.live_bytes, o.live_bytes),
            freed_objects: self.freed_objects - o.freed_objects,
            freed_bytes: self.freed_bytes - o.freed_bytes,
            free_calls: self.free_calls - o.free_calls,
            untracked_frees: self.untracked_frees - o.untracked_frees,
            usable_bytes: sub_opt(self.usable_bytes, o.usable_bytes),
        }
    }
    /// The allocinfo size column: live bytes, else the bytes requested.
    pub fn size(&self) -> i128 {
        self.live_bytes.unwrap_or(self.bytes)
    }
    /// The allocinfo calls column: live objects, else successful calls.
    pub fn count(&self) -> i128 {
        self.live_calls.unwrap_or(self.calls - self.failed)
    }
    pub fn key(&self, k: SortKey) -> i128 {
        match k {
            SortKey::LiveBytes => self.size(),
            SortKey::LiveCalls => self.count(),
            SortKey::Bytes => self.bytes,
            SortKey::Calls => self.calls + self.free_calls,
        }
    }
    pub fn is_zero(&self) -> bool {
        let z = Fig {
            live_calls: self.live_calls.map(|_| 0),
            live_bytes: self.live_bytes.map(|_| 0),
            usable_bytes: self.usable_bytes.map(|_| 0),
            ..Fig::default()
        };
        *self == z
    }
}

/// A site's identity and names, all from the site table.
#[derive(Clone, Debug)]
pub struct SiteInfo<'a> {
    pub module: &'a str,
    pub build_id: Rc<str>,
    pub address: u64,
    pub function: Option<&'a str>,
    pub file: Option<&'a str>,
    pub line: Option<u32>,
    pub entry: &'a str,
    pub kind: Kind,
    pub form: &'static str,
}

impl SiteInfo<'_> {
    /// `file:line`, or the module-relative address without line information.
    pub fn location(&self) -> String {
        match (&self.file, self.line) {
            (Some(f), Some(l)) => format!("{f}:{l}"),
            _ => format!("{:#x}", self.address),
        }
    }
}

/// Everything read from one process file.
pub struct Figures<'a> {
    pub sites: Vec<(SiteInfo<'a>, Fig)>,
    pub modules: Vec<ModuleDoc>,
    pub live: bool,
    pub usable: bool,
}

#[derive(Serialize, Clone, Debug)]
pub struct ModuleDoc {
    pub name: String,
    pub build_id: String,
    pub sites: u32,
    pub on: bool,
    pub unloaded: bool,
    /// Bytes of the module's site table copy and of its counters in the
    /// process file.
    pub table_size: u64,
    pub counters_size: u64,
}

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

fn signed(v: u64) -> i128 {
    v as i128
}

/// Reads every site's names and figures.
pub fn read_figures<'a>(pf: &ProcessFile<'a>) -> Result<Figures<'a>> {
    let live = pf.live();
    let usable = false;
    let mut sites = Vec::new();
    let mut modules = Vec::new();
    for m in pf.modules().map_err(|e| anyhow!("{e}"))? {
        let t = &m.table;
        let h = &t.header;
        let name = t.module_name();
        let build_id: Rc<str> = hex(&h.build_id[..h.build_id_len as usize]).into();
        modules.push(ModuleDoc {
            name: name.to_string(),
            build_id: build_id.to_string(),
            sites: h.site_count,
            on: m.on,
            unloaded: m.unloaded,
            table_size: t.bytes().len() as u64,
            counters_size: h.counters_size,
        });
        // Entry names and kinds, once per module.
        let entries: Vec<(&str, Kind)> = (0..h.entry_count as usize)
            .map(|i| {
                let e = t.entry(i).unwrap();
                (t.string(e.name).unwrap_or("?"), Kind::from_code(e.kind).unwrap_or(Kind::Alloc))
            })
            .collect();
        sites.reserve(h.site_count as usize);
        for (i, s) in t.sites().enumerate() {
            let c = m.cell(i);
            let (entry, kind) = entries.get(s.entry as usize).copied().unwrap_or(("?", Kind::Alloc));
            let allocates = kind != Kind::Free;
            let fig = if allocates {
                Fig {
                    calls: signed(c.calls),
                    bytes: signed(c.bytes),
                    failed: signed(c.failed),
                    live_calls: live.then(|| signed(c.live_objects())),
                    live_bytes: live.then(|| signed(c.live_bytes())),
                    freed_objects: signed(c.freed_objects),
                    freed_bytes: signed(c.freed_bytes),
                    free_calls: 0,
                    untracked_frees: signed(c.untracked_frees),
                    usable_bytes: None,
                }
            } else {
                Fig {
                    live_calls: live.then_some(0),
                    live_bytes: live.then_some(0),
                    free_calls: signed(c.calls),
                    untracked_frees: signed(c.untracked_frees),
                    usable_bytes: usable.then_some(0),
                    ..Fig::default()
                }
            };
            let info = SiteInfo {
                module: name,
                build_id: build_id.clone(),
                address: s.addr,
                function: t.string(s.function),
                file: t.string(s.file),
                line: (s.line != 0).then_some(s.line),
                entry,
                kind,
                form: SiteForm::from_code(s.form).map_or("?", SiteForm::as_str),
            };
            sites.push((info, fig));
        }
    }
    Ok(Figures { sites, modules, live, usable })
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
        ProcessFile::parse(&self.input.bytes).map_err(|e| {
            let what = if e.is_version() {
                format!("{e} (written by another version of alloctramp)")
            } else {
                format!("{e} (damaged or foreign file)")
            };
            anyhow!("{}: {what}", self.path.display())
        })
    }

    pub fn figures(&self) -> Result<(ProcessFile<'_>, Figures<'_>)> {
        let pf = self.parse()?;
        let f = read_figures(&pf).map_err(|e| anyhow!("{}: {e}", self.path.display()))?;
        Ok((pf, f))
    }
}

/// A row of output: a site or a group.
#[derive(Clone, Debug)]
pub struct Row<'a> {
    pub group: GroupBy,
    /// The site (for groups: the first site of the group).
    pub site: SiteInfo<'a>,
    pub sites: u64,
    /// Some site of the row allocates (shown without --all-columns).
    pub allocates: bool,
    pub fig: Fig,
    /// For differences: whether the row's sites exist in the old and new
    /// files.
    pub presence: Option<(bool, bool)>,
}

impl Row<'_> {
    /// The allocinfo tag.
    pub fn tag(&self) -> String {
        let mut v = Vec::new();
        let _ = self.write_tag(&mut v);
        String::from_utf8_lossy(&v).into_owned()
    }

    pub fn write_tag(&self, w: &mut dyn Write) -> io::Result<()> {
        let s = &self.site;
        let func = s.function.unwrap_or("?");
        match self.group {
            GroupBy::Site => match (s.file, s.line) {
                (Some(f), Some(l)) => write!(w, "{f}:{l} module:{} func:{func}", s.module),
                _ => write!(w, "{:#x} module:{} func:{func}", s.address, s.module),
            },
            GroupBy::Function => write!(w, "module:{} func:{func}", s.module),
            GroupBy::File => write!(w, "{} module:{}", s.file.unwrap_or("?"), s.module),
            GroupBy::Module => write!(w, "module:{}", s.module),
        }
    }
}

/// One row per site, or sums per group (in the order groups first appear).
pub fn group<'a>(sites: Vec<(SiteInfo<'a>, Fig)>, by: GroupBy) -> Vec<Row<'a>> {
    let row = |(site, fig): (SiteInfo<'a>, Fig)| Row {
        group: by,
        allocates: site.kind != Kind::Free,
        site,
        sites: 1,
        fig,
        presence: None,
    };
    if by == GroupBy::Site {
        return sites.into_iter().map(row).collect();
    }
    let mut index: HashMap<(&str, Option<&str>), usize> = HashMap::new();
    let mut out: Vec<Row> = Vec::new();
    for (site, fig) in sites {
        let key = match by {
            GroupBy::Function => (site.module, site.function),
            GroupBy::File => (site.module, site.file),
            _ => (site.module, None),
        };
        match index.get(&key) {
            Some(&i) => {
                let r = &mut out[i];
                r.fig.add(&fig);
                r.sites += 1;
                r.allocates |= site.kind != Kind::Free;
            }
            None => {
                index.insert(key, out.len());
                out.push(row((site, fig)));
            }
        }
    }
    out
}

/// Filters (module), groups, filters (size), sorts and cuts per the view.
pub fn select<'a>(
    sites: Vec<(SiteInfo<'a>, Fig)>,
    modules: &[ModuleDoc],
    view: &View,
    signed_min: bool,
) -> Result<Vec<Row<'a>>> {
    let sites = match &view.module {
        None => sites,
        Some(name) => {
            if !modules.iter().any(|m| &m.name == name) {
                let names: Vec<&str> = modules.iter().map(|m| m.name.as_str()).collect();
                bail!("no module {name:?} here (modules: {})", names.join(", "));
            }
            sites.into_iter().filter(|(s, _)| s.module == name).collect()
        }
    };
    let mut rows = group(sites, view.group_by);
    if !view.all_columns && view.format == Format::Text {
        rows.retain(|r| r.allocates);
    }
    if let Some(min) = view.min_bytes {
        let min = min as i128;
        rows.retain(|r| if signed_min { r.fig.size().abs() >= min } else { r.fig.size() >= min });
    }
    let sort = view.sort.or(view.top.map(|_| SortKey::LiveBytes));
    if let Some(k) = sort {
        // Stable: equal rows stay in site order.
        rows.sort_by_key(|r| std::cmp::Reverse(r.fig.key(k)));
    }
    if let Some(n) = view.top.filter(|&n| n > 0) {
        rows.truncate(n);
    }
    Ok(rows)
}

/// A size as `sort -h` reads it: 1023, 1.0KiB, 12.5MiB.
pub fn human(v: i128) -> String {
    let a = v.unsigned_abs();
    if a < 1024 {
        return v.to_string();
    }
    let units = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = a as f64 / 1024.0;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    let sign = if v < 0 { "-" } else { "" };
    format!("{sign}{x:.1}{}", units[u])
}

/// Text rows in the /proc/allocinfo layout.
pub fn write_text(w: &mut dyn Write, rows: &[Row], view: &View, diff: bool) -> io::Result<()> {
    let num = |v: i128, bytes: bool| -> String {
        let s = if bytes && view.human { human(v) } else { v.to_string() };
        if diff && v > 0 { format!("+{s}") } else { s }
    };
    let opt = |v: Option<i128>, bytes: bool| v.map_or_else(|| "-".to_string(), |v| num(v, bytes));
    writeln!(w, "allocinfo - version: 1.0")?;
    if view.all_columns {
        writeln!(
            w,
            "#     <size>  <calls> <total-calls>  <total-bytes> <failed>  <freed> <untracked> <usable-bytes>  \
             <kind> <tag info> entry:<entry>"
        )?;
    } else {
        writeln!(w, "#     <size>  <calls> <tag info>")?;
    }
    for r in rows {
        let f = &r.fig;
        if view.all_columns {
            let kind = if r.sites == 1 { r.site.kind.as_str() } else { "sites" };
            let kind = if r.sites == 1 { kind.to_string() } else { format!("{}{kind}", r.sites) };
            let entry = if r.sites == 1 { format!(" entry:{}", r.site.entry) } else { String::new() };
            writeln!(
                w,
                "{:>12} {:>8} {:>13} {:>14} {:>8} {:>8} {:>11} {:>14} {kind:>7} {}{entry}",
                num(f.size(), true),
                num(f.count(), false),
                num(f.calls + f.free_calls, false),
                num(f.bytes, true),
                num(f.failed, false),
                num(f.freed_objects, false),
                num(f.untracked_frees, false),
                opt(f.usable_bytes, true),
                r.tag()
            )?;
        } else if !diff && !view.human {
            write!(w, "{:>12} {:>8} ", f.size(), f.count())?;
            r.write_tag(w)?;
            writeln!(w)?;
        } else {
            writeln!(w, "{:>12} {:>8} {}", num(f.size(), true), num(f.count(), false), r.tag())?;
        }
    }
    Ok(())
}

/// One row as JSON (sites: the site's fields; groups: the group's key).
#[derive(Serialize)]
pub struct RowDoc<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub module: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<u64>,
    #[serde(skip_serializing_if = "skip_function")]
    pub function: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "skip_function")]
    pub file: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "skip_function")]
    pub line: Option<Option<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub form: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sites: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_old: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_new: Option<bool>,
    pub calls: i128,
    pub bytes: i128,
    pub failed: i128,
    pub live_calls: Option<i128>,
    pub live_bytes: Option<i128>,
    pub freed_objects: i128,
    pub freed_bytes: i128,
    pub untracked_frees: i128,
    pub usable_bytes: Option<i128>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_calls: Option<i128>,
}

fn skip_function<T>(v: &Option<Option<T>>) -> bool {
    v.is_none()
}

impl<'a> RowDoc<'a> {
    pub fn new(r: &'a Row<'a>) -> RowDoc<'a> {
        let s = &r.site;
        let f = &r.fig;
        let site = r.group == GroupBy::Site;
        let g = r.group;
        RowDoc {
            module: (!s.module.is_empty()).then_some(s.module),
            build_id: site.then_some(&*s.build_id),
            address: site.then_some(s.address),
            function: matches!(g, GroupBy::Site | GroupBy::Function).then_some(s.function),
            file: matches!(g, GroupBy::Site | GroupBy::File).then_some(s.file),
            line: site.then_some(s.line),
            entry: site.then_some(s.entry),
            kind: site.then_some(s.kind.as_str()),
            form: site.then_some(s.form),
            sites: (!site).then_some(r.sites),
            in_old: r.presence.map(|p| p.0),
            in_new: r.presence.map(|p| p.1),
            // A site's calls are its own, whatever its kind; a group's are
            // its allocation calls, with the frees apart.
            calls: if site { f.calls + f.free_calls } else { f.calls },
            bytes: f.bytes,
            failed: f.failed,
            live_calls: f.live_calls,
            live_bytes: f.live_bytes,
            freed_objects: f.freed_objects,
            freed_bytes: f.freed_bytes,
            untracked_frees: f.untracked_frees,
            usable_bytes: f.usable_bytes,
            free_calls: (!site).then_some(f.free_calls),
        }
    }
}

/// CSV columns, per grouping.
pub fn csv_columns(g: GroupBy, diff: bool) -> Vec<&'static str> {
    let mut c: Vec<&str> = match g {
        GroupBy::Site => vec!["module", "build_id", "address", "function", "file", "line", "entry", "kind", "form"],
        GroupBy::Function => vec!["module", "function", "sites"],
        GroupBy::File => vec!["module", "file", "sites"],
        GroupBy::Module => vec!["module", "sites"],
    };
    if diff {
        c.extend(["in_old", "in_new"]);
    }
    c.extend([
        "calls",
        "bytes",
        "failed",
        "live_calls",
        "live_bytes",
        "freed_objects",
        "freed_bytes",
        "untracked_frees",
        "usable_bytes",
    ]);
    if g != GroupBy::Site {
        c.push("free_calls");
    }
    c
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

pub fn write_csv(w: &mut dyn Write, rows: &[Row], group: GroupBy, diff: bool) -> io::Result<()> {
    let cols = csv_columns(group, diff);
    writeln!(w, "{}", cols.join(","))?;
    let mut line = String::new();
    for r in rows {
        let d = RowDoc::new(r);
        line.clear();
        for (i, c) in cols.iter().enumerate() {
            if i > 0 {
                line.push(',');
            }
            let int = |v: Option<i128>| v.map(|v| v.to_string()).unwrap_or_default();
            let text = |v: Option<&str>| v.map(csv_field).unwrap_or_default();
            let field = match *c {
                "module" => text(d.module),
                "build_id" => text(d.build_id),
                "address" => int(d.address.map(i128::from)),
                "function" => text(d.function.flatten()),
                "file" => text(d.file.flatten()),
                "line" => int(d.line.flatten().map(i128::from)),
                "entry" => text(d.entry),
                "kind" => text(d.kind),
                "form" => text(d.form),
                "sites" => int(d.sites.map(i128::from)),
                "in_old" => d.in_old.map(|b| b.to_string()).unwrap_or_default(),
                "in_new" => d.in_new.map(|b| b.to_string()).unwrap_or_default(),
                "calls" => d.calls.to_string(),
                "bytes" => d.bytes.to_string(),
                "failed" => d.failed.to_string(),
                "live_calls" => int(d.live_calls),
                "live_bytes" => int(d.live_bytes),
                "freed_objects" => d.freed_objects.to_string(),
                "freed_bytes" => d.freed_bytes.to_string(),
                "untracked_frees" => d.untracked_frees.to_string(),
                "usable_bytes" => int(d.usable_bytes),
                "free_calls" => int(d.free_calls),
                _ => String::new(),
            };
            line.push_str(&field);
        }
        writeln!(w, "{line}")?;
    }
    Ok(())
}

/// The header of a report's JSON document: the process and its state.
#[derive(Serialize)]
pub struct ProcessDoc<'a> {
    pub path: String,
    pub pid: u32,
    pub command: &'a str,
    /// The process that wrote the file is running now.
    pub running: bool,
    pub on: bool,
    pub exited: bool,
    pub live: bool,
    pub draining: bool,
    pub incomplete: bool,
    pub usable: bool,
    pub generation: u64,
    pub start_time: u64,
    pub reset_time: u64,
    pub last_switch_ns: u64,
    pub last_switch_sites: u64,
    pub last_error: &'a str,
    pub untracked_allocs: u64,
    pub table_bytes: u64,
    pub table_objects: u64,
    pub modules: Vec<ModuleDoc>,
}

impl<'a> ProcessDoc<'a> {
    pub fn new(src: &Source, pf: &'a ProcessFile, modules: Vec<ModuleDoc>) -> ProcessDoc<'a> {
        ProcessDoc {
            path: src.path.display().to_string(),
            pid: pf.pid,
            command: &pf.command,
            running: src.running,
            on: pf.on,
            exited: pf.exited,
            live: pf.live(),
            draining: pf.flags & flags::DRAINING != 0,
            incomplete: pf.flags & flags::INCOMPLETE != 0,
            usable: false,
            generation: pf.generation,
            start_time: pf.start_time,
            reset_time: pf.reset_time,
            last_switch_ns: pf.last_switch_ns,
            last_switch_sites: pf.last_switch_sites,
            last_error: &pf.last_error,
            untracked_allocs: pf.untracked_allocs,
            table_bytes: pf.table_bytes,
            table_objects: pf.table_objects,
            modules,
        }
    }
}

/// Notes on stderr about what the figures mean (stdout stays parseable).
pub fn notes(src: &Source, pf: &ProcessFile, figs: &Figures) -> Vec<String> {
    let mut n = Vec::new();
    let pid = pf.pid;
    if !src.running {
        if pf.exited {
            if src.by_pid {
                n.push(format!("process {pid} has exited: these are its final figures ({})", src.path.display()));
            }
        } else if src.by_pid {
            n.push(format!("process {pid} is gone without exiting normally: figures as it left them"));
        }
    }
    if !pf.live() {
        n.push(
            "live tracking is off in this process (ALLOCTRAMP_LIVE=0, or a runtime without it): <size> and <calls> \
             are totals since profiling was switched on (or reset), not live figures"
                .to_string(),
        );
    }
    if pf.flags & flags::DRAINING != 0 {
        let live: i128 = figs.sites.iter().filter_map(|(_, f)| f.live_calls).sum();
        n.push(format!(
            "profiling is off; free sites stay on until the {live} tracked objects are freed, so live figures keep \
             coming down"
        ));
    }
    if pf.flags & flags::INCOMPLETE != 0 {
        let untracked = if pf.untracked_allocs > 0 {
            format!("; {} allocations could not be tracked", pf.untracked_allocs)
        } else {
            String::new()
        };
        n.push(format!(
            "live figures may overstate: profiling was switched fully off while objects were live{untracked}"
        ));
    }
    if src.running && !pf.on && pf.flags & flags::DRAINING == 0 && figs.sites.iter().all(|(_, f)| f.is_zero()) {
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
        return list(&dir, &args.view, args.all);
    };
    let src = Source::open(target, &dir)?;
    let (pf, mut figs) = src.figures()?;
    let view = &args.view;
    print_notes(&notes(&src, &pf, &figs), view.quiet);
    let rows = select(std::mem::take(&mut figs.sites), &figs.modules, view, false)?;
    emit(|w| write_report(w, &src, &pf, &figs, &rows, view))
}

/// A report in the view's format.
pub fn write_report(
    w: &mut dyn Write,
    src: &Source,
    pf: &ProcessFile,
    figs: &Figures,
    rows: &[Row],
    view: &View,
) -> io::Result<()> {
    match view.format {
        Format::Text => write_text(w, rows, view, false),
        Format::Csv => write_csv(w, rows, view.group_by, false),
        Format::Json => {
            #[derive(Serialize)]
            struct Doc<'a> {
                format: &'static str,
                version: u32,
                #[serde(flatten)]
                process: ProcessDoc<'a>,
                group_by: GroupBy,
                sort: Option<SortKey>,
                totals: RowDoc<'a>,
                #[serde(skip_serializing_if = "Option::is_none")]
                sites: Option<Vec<RowDoc<'a>>>,
                #[serde(skip_serializing_if = "Option::is_none")]
                groups: Option<Vec<RowDoc<'a>>>,
            }
            let total = totals(rows, figs.live, figs.usable);
            let docs: Vec<RowDoc> = rows.iter().map(RowDoc::new).collect();
            let (sites, groups) = if view.group_by == GroupBy::Site { (Some(docs), None) } else { (None, Some(docs)) };
            let doc = Doc {
                format: "alloctramp-report",
                version: 2,
                process: ProcessDoc::new(src, pf, figs.modules.clone()),
                group_by: view.group_by,
                sort: view.sort.or(view.top.map(|_| SortKey::LiveBytes)),
                totals: RowDoc::new(&total),
                sites,
                groups,
            };
            serde_json::to_writer_pretty(&mut *w, &doc).map_err(crate::util::json_io)?;
            writeln!(w)
        }
    }
}

/// The sum of the rows shown, as a module-level group.
pub fn totals(rows: &[Row], live: bool, usable: bool) -> Row<'static> {
    let mut fig = Fig {
        live_calls: live.then_some(0),
        live_bytes: live.then_some(0),
        usable_bytes: usable.then_some(0),
        ..Fig::default()
    };
    let mut sites = 0;
    for r in rows {
        fig.add(&r.fig);
        sites += r.sites;
    }
    Row {
        group: GroupBy::Module,
        site: SiteInfo {
            module: "",
            build_id: "".into(),
            address: 0,
            function: None,
            file: None,
            line: None,
            entry: "",
            kind: Kind::Alloc,
            form: "",
        },
        sites,
        allocates: true,
        fig,
        presence: None,
    }
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
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "counters") {
            continue;
        }
        let Some(pid) = p.file_stem().and_then(|s| s.to_str()).and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(input) = Snapshot::read(&p) else { continue };
        let Ok(pf) = ProcessFile::parse(&input.bytes) else { continue };
        let running = file_process_running(&pf);
        if !running && !all {
            continue;
        }
        let Ok(figs) = read_figures(&pf) else { continue };
        let state = if running {
            if pf.on {
                "on"
            } else if pf.flags & flags::DRAINING != 0 {
                "draining"
            } else {
                "off"
            }
        } else if pf.exited {
            "exited"
        } else {
            "gone"
        };
        let live = if figs.live {
            let b: i128 = figs.sites.iter().filter_map(|(_, f)| f.live_bytes).sum();
            if view.human { human(b) } else { b.to_string() }
        } else {
            "-".to_string()
        };
        let names: Vec<&str> = figs.modules.iter().map(|m| m.name.as_str()).collect();
        let sites: u64 = figs.modules.iter().map(|m| m.sites as u64).sum();
        let command = if pf.command.is_empty() { "?" } else { pf.command.as_str() };
        found.push((pid, format!("{pid:>8} {state:<8} {live:>12} {sites:>7} {:<24} {command}", names.join(","))));
    }
    found.sort();
    if found.is_empty() && !view.quiet {
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
