//! `alloctramp snapshot` (a consistent copy of a process's counters file)
//! and `alloctramp diff` (per-site change between two of them).

use crate::control::counters_dir;
use crate::report::{
    self, Fig, Format, GroupBy, ProcessDoc, Row, RowDoc, SiteInfo, SortKey, Source, View, print_notes, select,
    write_csv, write_text,
};
use crate::util::{emit, write_atomic};
use alloctramp_trampolines::pod;
use alloctramp_trampolines::process::{PROC_HEADER_SIZE, ProcessFile};
use anyhow::{Result, anyhow, bail};
use serde::Serialize;
use std::collections::HashMap;
use std::io::{self, Write};
use std::path::PathBuf;

/// Save a process's current figures to a file.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp snapshot 12345 -o before.snapshot\n  \
    alloctramp report before.snapshot --top 20\n  \
    alloctramp diff before.snapshot 12345     # what grew since")]
pub struct SnapshotArgs {
    /// A process id (or a counters file to copy).
    pub target: String,
    /// The snapshot file to write [default: ./PID-SECONDS.snapshot].
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Where process counters files are [default: $ALLOCTRAMP_DIR, else
    /// $XDG_RUNTIME_DIR/alloctramp, else /tmp/alloctramp-UID].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// A consistent copy of a counters file: the header with the modules
/// published when the copy started, and exactly their regions.
pub fn consistent_copy(bytes: &[u8]) -> Result<Vec<u8>, String> {
    use std::sync::atomic::Ordering;
    let pf = ProcessFile::parse(bytes).map_err(|e| e.to_string())?;
    let h = &pf.header;
    let head = PROC_HEADER_SIZE as usize;
    // The copy publishes the modules the parsed header had published.
    h.module_count.store(pf.module_count, Ordering::Relaxed);
    let mut out = pod::bytes_of(&**h).to_vec();
    let mut regions = Vec::new();
    for (m, sl) in h.published().iter().enumerate() {
        for (at, size) in [(&sl.table_offset, &sl.table_size), (&sl.counters_offset, &sl.counters_size)] {
            let (at, size) = (at.load(Ordering::Relaxed) as usize, size.load(Ordering::Relaxed) as usize);
            let end = at.checked_add(size).filter(|&e| e <= bytes.len() && at >= head);
            let Some(end) = end else {
                return Err(format!("module {m}: region outside the file"));
            };
            regions.push((at, end));
        }
    }
    let len = regions.iter().map(|r| r.1).max().unwrap_or(head).max(head);
    out.resize(len, 0);
    for (a, e) in regions {
        out[a..e].copy_from_slice(&bytes[a..e]);
    }
    // What was copied must read back.
    let copy = ProcessFile::parse(&out).map_err(|e| e.to_string())?;
    copy.modules().map_err(|e| e.to_string())?;
    Ok(out)
}

pub fn run_snapshot(args: SnapshotArgs) -> Result<()> {
    let dir = counters_dir(args.dir.as_deref());
    let src = Source::open(&args.target, &dir)?;
    let pf = src.parse()?;
    let data = consistent_copy(&src.input.bytes).map_err(|e| anyhow!("{}: {e}", src.path.display()))?;
    let out = args.output.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        PathBuf::from(format!("{}-{secs}.snapshot", pf.pid))
    });
    if out.is_dir() {
        bail!("{}: is a directory", out.display());
    }
    write_atomic(&out, &data, 0o600)?;
    let copy = ProcessFile::parse(&data).map_err(|e| anyhow!("{e}"))?;
    let mods = copy.modules().unwrap_or_default();
    let sites: u64 = mods.iter().map(|m| m.table.header.site_count as u64).sum();
    let state = if src.running { "running" } else { "exited" };
    eprintln!(
        "alloctramp: saved process {} ({state}; {} modules, {sites} sites) to {}",
        pf.pid,
        mods.len(),
        out.display()
    );
    Ok(())
}

/// Per-site change between two snapshots (or a snapshot and a process).
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp snapshot 12345 -o a.snapshot; sleep 60; alloctramp snapshot 12345 -o b.snapshot\n  \
    alloctramp diff a.snapshot b.snapshot | head        # sites that grew most first\n  \
    alloctramp diff a.snapshot 12345 --group-by function --human\n\n\
Rows are NEW minus OLD, sorted by growth of the size column (live bytes; bytes requested when live tracking \
is off). Unchanged sites are left out unless --all.")]
pub struct DiffArgs {
    /// The earlier snapshot (a file, or a process id: its current figures).
    pub old: String,
    /// The later snapshot (a file, or a process id: its current figures).
    pub new: String,
    #[command(flatten)]
    pub view: View,
    /// Also rows that did not change.
    #[arg(long)]
    pub all: bool,
    /// Where process counters files are.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

type SiteKey<'a> = (&'a str, u64);

pub fn run_diff(args: DiffArgs) -> Result<()> {
    let dir = counters_dir(args.dir.as_deref());
    let old = Source::open(&args.old, &dir)?;
    let new = Source::open(&args.new, &dir)?;
    let (opf, ofig) = old.figures()?;
    let (npf, nfig) = new.figures()?;
    let mut notes = Vec::new();
    if opf.pid != npf.pid {
        notes.push(format!("comparing different processes (pid {} and pid {})", opf.pid, npf.pid));
    }
    for m in &nfig.modules {
        if let Some(o) = ofig.modules.iter().find(|o| o.name == m.name)
            && o.build_id != m.build_id
        {
            notes.push(format!("module {} is a different build in the two files", m.name));
        }
    }
    let live = ofig.live && nfig.live;
    if !live {
        notes.push(
            "live tracking was off in one of them: <size> and <calls> are changes of the totals, not of live figures"
                .to_string(),
        );
    }
    let strip = |mut f: Fig| {
        if !live {
            f.live_calls = None;
            f.live_bytes = None;
        }
        if !(ofig.usable && nfig.usable) {
            f.usable_bytes = None;
        }
        f
    };
    let mut old_sites: HashMap<SiteKey, Fig> = HashMap::new();
    for (s, f) in &ofig.sites {
        old_sites.insert((s.module, s.address), strip(*f));
    }
    let zero = strip(Fig { live_calls: Some(0), live_bytes: Some(0), usable_bytes: Some(0), ..Fig::default() });
    let mut sites: Vec<(SiteInfo, Fig)> = Vec::new();
    let mut presence: HashMap<SiteKey, (bool, bool)> = HashMap::new();
    for (s, f) in &nfig.sites {
        let key = (s.module, s.address);
        let o = old_sites.remove(&key);
        presence.insert(key, (o.is_some(), true));
        sites.push((s.clone(), strip(*f).sub(&o.unwrap_or(zero))));
    }
    // Sites only in the old file (a module unloaded and gone).
    for (s, f) in &ofig.sites {
        let key = (s.module, s.address);
        if let Some(o) = old_sites.remove(&key) {
            debug_assert_eq!(o, strip(*f));
            presence.insert(key, (true, false));
            sites.push((s.clone(), zero.sub(&o)));
        }
    }
    if !args.all {
        sites.retain(|(_, f)| !f.is_zero());
    }
    let mut modules = nfig.modules.clone();
    for m in &ofig.modules {
        if !modules.iter().any(|n| n.name == m.name) {
            modules.push(m.clone());
        }
    }
    let mut view = args.view.clone();
    if view.sort.is_none() {
        view.sort = Some(SortKey::LiveBytes);
    }
    let mut rows = select(sites, &modules, &view, true)?;
    if view.group_by == GroupBy::Site {
        for r in &mut rows {
            r.presence = presence.get(&(r.site.module, r.site.address)).copied();
        }
    }
    print_notes(&notes, view.quiet);
    let docs = (ProcessDoc::new(&old, &opf, ofig.modules.clone()), ProcessDoc::new(&new, &npf, nfig.modules.clone()));
    let usable = ofig.usable && nfig.usable;
    emit(|w| write_diff(w, &rows, &view, &docs, live, usable))
}

fn write_diff(
    w: &mut dyn Write,
    rows: &[Row],
    view: &View,
    procs: &(ProcessDoc, ProcessDoc),
    live: bool,
    usable: bool,
) -> io::Result<()> {
    match view.format {
        Format::Text => write_text(w, rows, view, true),
        Format::Csv => write_csv(w, rows, view.group_by, true),
        Format::Json => {
            #[derive(Serialize)]
            struct Doc<'a> {
                format: &'static str,
                version: u32,
                old: &'a ProcessDoc<'a>,
                new: &'a ProcessDoc<'a>,
                live: bool,
                group_by: GroupBy,
                sort: Option<SortKey>,
                totals: RowDoc<'a>,
                #[serde(skip_serializing_if = "Option::is_none")]
                sites: Option<Vec<RowDoc<'a>>>,
                #[serde(skip_serializing_if = "Option::is_none")]
                groups: Option<Vec<RowDoc<'a>>>,
            }
            let total = report::totals(rows, live, usable);
            let docs: Vec<RowDoc> = rows.iter().map(RowDoc::new).collect();
            let (sites, groups) = if view.group_by == GroupBy::Site { (Some(docs), None) } else { (None, Some(docs)) };
            let doc = Doc {
                format: "alloctramp-diff",
                version: 1,
                old: &procs.0,
                new: &procs.1,
                live,
                group_by: view.group_by,
                sort: view.sort,
                totals: RowDoc::new(&total),
                sites,
                groups,
            };
            serde_json::to_writer_pretty(&mut *w, &doc).map_err(crate::util::json_io)?;
            writeln!(w)
        }
    }
}
