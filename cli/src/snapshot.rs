//! `alloctramp snapshot` (a consistent copy of a process's counters file)
//! and `alloctramp diff` (per-site change between two of them).

use crate::control::counters_dir;
use crate::report::{Source, View, print_notes};
use crate::util::{emit, write_atomic};
use alloctramp_report::model::{self, SortKey};
use alloctramp_report::{Format, csv, json, read, text};
use alloctramp_trampolines::process::ProcessFile;
use anyhow::{Result, anyhow, bail};
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

pub fn run_snapshot(args: SnapshotArgs) -> Result<()> {
    let dir = counters_dir(args.dir.as_deref());
    let src = Source::open(&args.target, &dir)?;
    let pf = src.parse()?;
    let data = read::consistent_copy(&src.input.bytes).map_err(|e| anyhow!("{}: {e}", src.path.display()))?;
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

pub fn run_diff(args: DiffArgs) -> Result<()> {
    if args.view.format == Format::Pprof {
        bail!(
            "diff --format pprof: a profile holds one process's figures; compare two with `go tool pprof -diff_base OLD.pb.gz NEW.pb.gz`"
        );
    }
    let dir = counters_dir(args.dir.as_deref());
    let old = Source::open(&args.old, &dir)?;
    let new = Source::open(&args.new, &dir)?;
    let ofig = old.figures()?;
    let nfig = new.figures()?;
    let mut notes = Vec::new();
    let (opid, npid) = (ofig.process.pid, nfig.process.pid);
    if opid != npid {
        notes.push(format!("comparing different processes (pid {opid} and pid {npid})"));
    } else if nfig.process.reset_time != ofig.process.reset_time {
        notes.push(format!(
            "the counters were reset between the two (`alloctramp reset`, at {} seconds since the epoch): \
             figures restarted from zero then, so changes can be negative",
            nfig.process.reset_time
        ));
    }
    let diff = model::diff(&ofig, &nfig, args.all);
    for m in &diff.rebuilt {
        notes.push(format!("module {m} is a different build in the two files"));
    }
    let live = diff.live;
    if !live {
        notes.push(
            "live tracking was off in one of them: <size> and <calls> are changes of the totals, not of live figures"
                .to_string(),
        );
    }
    let mut view = args.view.clone();
    if view.sort.is_none() {
        view.sort = Some(SortKey::LiveBytes);
    }
    let rows = diff.select(&view.selection())?;
    print_notes(&notes, view.quiet);
    let (opath, npath) = (old.path.display().to_string(), new.path.display().to_string());
    let (odoc, ndoc) = (old.doc(&opath, &ofig), new.doc(&npath, &nfig));
    emit(|w| match view.format {
        Format::Text => text::write(w, &rows, &view.text_options(true, !live)),
        Format::Csv => csv::write(w, &rows, view.group_by, true),
        Format::Json => json::write_diff(w, &odoc, &ndoc, live, &rows, view.group_by, view.sort),
        Format::Pprof => Ok(()),
    })
}
