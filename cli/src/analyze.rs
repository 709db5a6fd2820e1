//! `alloctramp analyze DIR`: per site, lifetimes, what is live at the
//! trace's end, temporary allocations and the peak of live bytes, from an
//! event trace (`alloctramp trace`, `run --trace`).

use alloctramp_report::events::{self, Analysis, SiteStats, Trace};
use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

/// Lifetimes, leaks within the trace, temporary allocations and the peak
/// of live bytes, per allocation site, from an event trace.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp analyze trace\n  \
    alloctramp analyze trace --svg live.svg --top 5\n  \
    alloctramp analyze trace --format json | jq '.sites[0]'\n\n\
Lifetimes are those of objects allocated and freed within the trace (median, 90th percentile, maximum); \
`live` counts objects allocated in the trace and not freed by its end; a temporary allocation is freed before \
its thread allocates anything else (heaptrack's definition); the peak is that of the live bytes of objects \
allocated in the trace, with what each site held then.")]
pub struct Args {
    /// The trace directory.
    pub trace: PathBuf,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write a timeline of live bytes (the total and the top sites)
    /// as an SVG file.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Sites in the text output and the timeline (0: every site).
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub top: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Reads the trace directory: its metadata, then every stream file.
pub fn read(dir: &std::path::Path) -> Result<Trace> {
    let meta_path = dir.join("metadata");
    let text = std::fs::read_to_string(&meta_path).with_context(|| format!("{}: cannot read", meta_path.display()))?;
    let (uuid, freq, _) = events::read_metadata(&text).map_err(|e| anyhow!("{}: {e}", meta_path.display()))?;
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot read the directory", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n != "metadata" && !n.to_string_lossy().starts_with('.')))
        .collect();
    names.sort();
    let mut streams = Vec::new();
    for p in names {
        let b = std::fs::read(&p).with_context(|| format!("{}: cannot read", p.display()))?;
        streams.push(events::read_stream(&b, Some(uuid)).map_err(|e| anyhow!("{}: {e}", p.display()))?);
    }
    Ok(Trace::new(streams, freq))
}

fn human_ns(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} µs", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}

pub fn run(args: Args) -> Result<()> {
    if !args.trace.is_dir() {
        bail!("{}: not a trace directory", args.trace.display());
    }
    let t = read(&args.trace)?;
    let a = events::analyze(&t);
    let name = |id: u32| match t.sites.get(&id) {
        Some(s) if !s.file.is_empty() => format!("{}:{} {} ({})", s.file, s.line, s.function, s.module),
        Some(s) => format!("{:#x} {} ({})", s.address, s.function, s.module),
        None => format!("site {id}"),
    };
    if let Some(path) = &args.svg {
        let top = if args.top == 0 { usize::MAX } else { args.top };
        let svg = events::timeline_svg(&t, &a, top.min(8), &name);
        crate::util::write_atomic(path, svg.as_bytes(), 0o644)?;
    }
    let mut rows: Vec<&SiteStats> = a.sites.iter().collect();
    rows.sort_by_key(|s| (std::cmp::Reverse(s.bytes), s.site));
    match args.format {
        Format::Json => {
            let sites: Vec<serde_json::Value> = rows
                .iter()
                .map(|s| {
                    let info = t.sites.get(&s.site);
                    json!({
                        "site": s.site,
                        "address": info.map(|i| i.address),
                        "function": info.map(|i| i.function.as_str()),
                        "file": info.map(|i| i.file.as_str()).filter(|f| !f.is_empty()),
                        "line": info.map(|i| i.line).filter(|&l| l != 0),
                        "module": info.map(|i| i.module.as_str()),
                        "allocations": s.allocations,
                        "bytes": s.bytes,
                        "freed": s.freed,
                        "lifetime_ns": s.lifetime.map(|(m, p, x)| json!({"median": m, "p90": p, "max": x})),
                        "live_objects": s.live,
                        "live_bytes": s.live_bytes,
                        "temporary": s.temporary,
                        "bytes_at_peak": s.at_peak,
                    })
                })
                .collect();
            let doc = json!({
                "format": "alloctramp-analysis",
                "version": 1,
                "events": a.events,
                "discarded": a.discarded,
                "duration_ns": a.duration,
                "peak_bytes": a.peak,
                "peak_at_ns": a.peak_at,
                "sites": sites,
            });
            crate::util::emit(|w| writeln!(w, "{}", serde_json::to_string_pretty(&doc).unwrap_or_default()))
        }
        Format::Text => crate::util::emit(|w| text(w, &args, &a, &rows, &name)),
    }
}

fn text(
    w: &mut dyn Write,
    args: &Args,
    a: &Analysis,
    rows: &[&SiteStats],
    name: &dyn Fn(u32) -> String,
) -> std::io::Result<()> {
    writeln!(
        w,
        "{}: {} events over {}{}; peak of live bytes {} at {}",
        args.trace.display(),
        a.events,
        human_ns(a.duration),
        match a.discarded {
            0 => String::new(),
            n => format!(" ({n} events lost while recording: the figures below miss them)"),
        },
        a.peak,
        human_ns(a.peak_at)
    )?;
    writeln!(
        w,
        "{:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9} {:>12} {:>9} {:>12}  site",
        "allocs", "bytes", "freed", "median", "p90", "max", "live", "live bytes", "temporary", "at peak"
    )?;
    let n = if args.top == 0 { rows.len() } else { args.top.min(rows.len()) };
    for s in &rows[..n] {
        let (m, p, x) = s
            .lifetime
            .map_or(("-".into(), "-".into(), "-".into()), |(m, p, x)| (human_ns(m), human_ns(p), human_ns(x)));
        writeln!(
            w,
            "{:>10} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9} {:>12} {:>9} {:>12}  {}",
            s.allocations,
            s.bytes,
            s.freed,
            m,
            p,
            x,
            s.live,
            s.live_bytes,
            s.temporary,
            s.at_peak,
            name(s.site)
        )?;
    }
    if n < rows.len() {
        writeln!(w, "({} more sites: --top 0 lists every one)", rows.len() - n)?;
    }
    Ok(())
}
