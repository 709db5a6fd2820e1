//! Figures of processes as metrics for Prometheus: the OpenMetrics 1.0
//! text format, or Prometheus' text format 0.0.4 (what `promtool check
//! metrics` and clients that do not ask for OpenMetrics read). Names,
//! labels and types are in docs/formats.md.
//!
//! Per site (or per function, file or module: [`GroupBy`] bounds the
//! number of series), labels `pid`, `command`, `module`, `function`,
//! `file`, `line` (those the grouping keeps): live bytes and live objects
//! (gauges), calls, requested bytes, failed calls and frees (counters).
//! Per process, labels `pid` and `command`: the on/off state, live
//! tracking, sites, and the runtime's own figures. Sites whose labels are
//! the same (two calls on one line) are one series, their figures summed.

use crate::model::{Fig, Figures, GroupBy};
use alloctramp_trampolines::entry::Kind;
use std::collections::HashMap;
use std::io::{self, Write};

/// The content type of each variant.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Which text format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// OpenMetrics 1.0: counter families named without `_total`, `# UNIT`
    /// lines, `# EOF` at the end.
    OpenMetrics,
    /// Prometheus text 0.0.4: counter families named with `_total`.
    Text,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Type {
    Gauge,
    Counter,
}

/// A metric family: name (without `_total`), type, unit, help.
struct Family {
    name: &'static str,
    kind: Type,
    unit: &'static str,
    help: &'static str,
}

const fn family(name: &'static str, kind: Type, unit: &'static str, help: &'static str) -> Family {
    Family { name, kind, unit, help }
}

/// Per-site (or per-group) families, each with the figure it shows
/// (None: not known, no sample).
type SiteValue = fn(&Fig) -> Option<i128>;

const SITE_FAMILIES: &[(Family, SiteValue)] = &[
    (
        family(
            "alloctramp_live_bytes",
            Type::Gauge,
            "bytes",
            "Bytes of the objects allocated here and not freed yet (live tracking on).",
        ),
        |f| f.live_bytes,
    ),
    (
        family(
            "alloctramp_live_objects",
            Type::Gauge,
            "",
            "Objects allocated here and not freed yet (live tracking on).",
        ),
        |f| f.live_calls,
    ),
    (
        family(
            "alloctramp_calls",
            Type::Counter,
            "",
            "Calls of allocation functions here while profiling was on (failed calls included).",
        ),
        |f| Some(f.calls),
    ),
    (
        family(
            "alloctramp_requested_bytes",
            Type::Counter,
            "bytes",
            "Bytes requested by the calls of allocation functions here (failed calls included).",
        ),
        |f| Some(f.bytes),
    ),
    (
        family(
            "alloctramp_failed_calls",
            Type::Counter,
            "",
            "Calls of allocation functions here that returned no memory.",
        ),
        |f| Some(f.failed),
    ),
    (family("alloctramp_frees", Type::Counter, "", "Calls of free functions here."), |f| Some(f.free_calls)),
];

/// Per-process families, each with the figure it shows.
type ProcessValue = fn(&Figures) -> Value;

#[derive(Clone, Copy)]
enum Value {
    Int(i128),
    Seconds(u64, u32),
}

const PROCESS_FAMILIES: &[(Family, ProcessValue)] = &[
    (family("alloctramp_profiling_on", Type::Gauge, "", "1 while profiling is on in the process, else 0."), |f| {
        Value::Int(f.process.on as i128)
    }),
    (
        family(
            "alloctramp_live_tracking",
            Type::Gauge,
            "",
            "1 if the process tracks live objects (live figures known).",
        ),
        |f| Value::Int(f.process.live as i128),
    ),
    (family("alloctramp_sites", Type::Gauge, "", "Patched allocator call sites in the process's modules."), |f| {
        Value::Int(f.modules.iter().map(|m| i128::from(m.sites)).sum())
    }),
    (family("alloctramp_tracked_objects", Type::Gauge, "", "Objects the runtime's pointer table holds."), |f| {
        Value::Int(f.process.table_objects.into())
    }),
    (
        family("alloctramp_tracking_table_bytes", Type::Gauge, "bytes", "Memory the runtime's pointer table holds."),
        |f| Value::Int(f.process.table_bytes.into()),
    ),
    (
        family(
            "alloctramp_untracked_frees",
            Type::Counter,
            "",
            "Frees of memory allocated while profiling was off (or never tracked).",
        ),
        |f| Value::Int(f.sites.iter().map(|(_, x)| x.untracked_frees).sum()),
    ),
    (
        family(
            "alloctramp_untracked_allocations",
            Type::Counter,
            "",
            "Allocations counted but not tracked (the pointer table could not grow).",
        ),
        |f| Value::Int(f.process.untracked_allocs.into()),
    ),
    (
        family(
            "alloctramp_last_switch_duration_seconds",
            Type::Gauge,
            "seconds",
            "How long the last switch of profiling on or off took.",
        ),
        |f| Value::Seconds(f.process.last_switch_ns / 1_000_000_000, (f.process.last_switch_ns % 1_000_000_000) as u32),
    ),
    (family("alloctramp_last_switch_sites", Type::Gauge, "", "Sites rewritten by the last switch."), |f| {
        Value::Int(f.process.last_switch_sites.into())
    }),
    (
        family(
            "alloctramp_last_switch_time_seconds",
            Type::Gauge,
            "seconds",
            "When the last switch of profiling on or off completed (Unix time; 0: none yet).",
        ),
        |f| Value::Seconds(f.process.last_switch_time, 0),
    ),
    (family("alloctramp_start_time_seconds", Type::Gauge, "seconds", "When the process started (Unix time)."), |f| {
        Value::Seconds(f.process.start_time, 0)
    }),
    (
        family(
            "alloctramp_reset_time_seconds",
            Type::Gauge,
            "seconds",
            "When the process's counters were last reset (Unix time; 0: never).",
        ),
        |f| Value::Seconds(f.process.reset_time, 0),
    ),
];

/// The figures of one scrape.
pub struct Scrape<'a> {
    /// The processes, their figures read.
    pub processes: Vec<Figures<'a>>,
    /// Counters files that could not be read in this scrape.
    pub unreadable: u64,
}

/// A label value, escaped (backslash, double quote, newline).
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// The label set of a site under `by`, after `pid` and `command`.
fn site_labels(s: &crate::model::SiteInfo, by: GroupBy) -> String {
    let mut l = format!(",module=\"{}\"", escape(s.module));
    if matches!(by, GroupBy::Site | GroupBy::Function) {
        l.push_str(&format!(",function=\"{}\"", escape(s.function.unwrap_or("?"))));
    }
    if matches!(by, GroupBy::Site | GroupBy::File) {
        l.push_str(&format!(",file=\"{}\"", escape(s.file.unwrap_or(""))));
    }
    if by == GroupBy::Site {
        l.push_str(&format!(",line=\"{}\"", s.line.map_or(String::new(), |l| l.to_string())));
    }
    l
}

/// A series: its labels after `pid` and `command`, its summed figures,
/// and whether a site among them allocates.
type Series = (String, Fig, bool);

/// Series of one process, in order of first appearance.
fn series(figs: &Figures, by: GroupBy) -> Vec<Series> {
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut out: Vec<Series> = Vec::new();
    for (s, f) in &figs.sites {
        let key = site_labels(s, by);
        let allocates = s.kind != Kind::Free;
        match index.get(&key) {
            Some(&i) => {
                out[i].1.add(f);
                out[i].2 |= allocates;
            }
            None => {
                index.insert(key.clone(), out.len());
                out.push((key, *f, allocates));
            }
        }
    }
    out
}

fn header(w: &mut dyn Write, f: &Family, v: Variant) -> io::Result<()> {
    let name = match (v, f.kind) {
        (Variant::Text, Type::Counter) => format!("{}_total", f.name),
        _ => f.name.to_string(),
    };
    writeln!(w, "# HELP {name} {}", f.help)?;
    let t = match f.kind {
        Type::Gauge => "gauge",
        Type::Counter => "counter",
    };
    writeln!(w, "# TYPE {name} {t}")?;
    if v == Variant::OpenMetrics && !f.unit.is_empty() {
        writeln!(w, "# UNIT {name} {}", f.unit)?;
    }
    Ok(())
}

fn sample_name(f: &Family) -> String {
    match f.kind {
        Type::Counter => format!("{}_total", f.name),
        Type::Gauge => f.name.to_string(),
    }
}

/// Writes every family of the scrape. `by`: one series per site, or per
/// function, file or module of each process.
pub fn write(w: &mut dyn Write, scrape: &Scrape, by: GroupBy, variant: Variant) -> io::Result<()> {
    let procs: Vec<(String, Vec<Series>)> = scrape
        .processes
        .iter()
        .map(|f| {
            let p = format!("pid=\"{}\",command=\"{}\"", f.process.pid, escape(&f.process.command));
            (p, series(f, by))
        })
        .collect();
    for (fam, value) in SITE_FAMILIES {
        header(w, fam, variant)?;
        let name = sample_name(fam);
        let frees = fam.name == "alloctramp_frees";
        for (p, rows) in &procs {
            for (labels, fig, allocates) in rows {
                // Free-only series have no allocation figures, and the
                // others no frees unless they have some.
                if (frees && fig.free_calls == 0) || (!frees && !allocates) {
                    continue;
                }
                if let Some(v) = value(fig) {
                    writeln!(w, "{name}{{{p}{labels}}} {v}")?;
                }
            }
        }
    }
    for (fam, value) in PROCESS_FAMILIES {
        header(w, fam, variant)?;
        let name = sample_name(fam);
        for (f, (p, _)) in scrape.processes.iter().zip(&procs) {
            match value(f) {
                Value::Int(v) => writeln!(w, "{name}{{{p}}} {v}")?,
                Value::Seconds(s, 0) => writeln!(w, "{name}{{{p}}} {s}")?,
                Value::Seconds(s, ns) => writeln!(w, "{name}{{{p}}} {s}.{ns:09}")?,
            }
        }
    }
    let processes = family("alloctramp_processes", Type::Gauge, "", "Processes of this user running patched code.");
    header(w, &processes, variant)?;
    writeln!(w, "alloctramp_processes {}", scrape.processes.len())?;
    let bad = family(
        "alloctramp_unreadable_files",
        Type::Gauge,
        "",
        "Counters files in the directory that could not be read in this scrape.",
    );
    header(w, &bad, variant)?;
    writeln!(w, "alloctramp_unreadable_files {}", scrape.unreadable)?;
    if variant == Variant::OpenMetrics {
        writeln!(w, "# EOF")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::figures;

    fn text(scrape: &Scrape, by: GroupBy, v: Variant) -> String {
        let mut out = Vec::new();
        write(&mut out, scrape, by, v).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn series_per_site_with_every_label() {
        let mut f = figures();
        f.process.command = "a \"quoted\"\\name".into();
        f.process.last_switch_ns = 1_500_000;
        f.process.last_switch_time = 1_700_000_000;
        let scrape = Scrape { processes: vec![f], unreadable: 1 };
        let t = text(&scrape, GroupBy::Site, Variant::OpenMetrics);
        let p = r#"pid="42",command="a \"quoted\"\\name""#;
        for want in [
            "# TYPE alloctramp_live_bytes gauge\n# UNIT alloctramp_live_bytes bytes\n".to_string(),
            format!(
                "alloctramp_live_bytes{{{p},module=\"prog\",function=\"main\",file=\"main.c\",line=\"32\"}} 2000\n"
            ),
            format!(
                "alloctramp_calls_total{{{p},module=\"lib.so\",function=\"lib_new\",file=\"lib.c\",line=\"80\"}} 7\n"
            ),
            "# TYPE alloctramp_calls counter\n".to_string(),
            format!("alloctramp_frees_total{{{p},module=\"prog\",function=\"main\",file=\"main.c\",line=\"48\"}} 11\n"),
            format!("alloctramp_untracked_frees_total{{{p}}} 2\n"),
            format!("alloctramp_last_switch_duration_seconds{{{p}}} 0.001500000\n"),
            format!("alloctramp_last_switch_time_seconds{{{p}}} 1700000000\n"),
            format!("alloctramp_profiling_on{{{p}}} 1\n"),
            "alloctramp_unreadable_files 1\n# EOF\n".to_string(),
        ] {
            assert!(t.contains(&want), "{want}\nnot in:\n{t}");
        }
        assert!(!t.contains("alloctramp_live_bytes{pid=\"42\",command=\"a \\\"quoted\\\"\\\\name\",module=\"prog\",function=\"main\",file=\"main.c\",line=\"48\"}"), "free sites have no live series");
        // Every family's samples follow its header, once.
        let types: Vec<&str> = t.lines().filter(|l| l.starts_with("# TYPE")).collect();
        let mut unique = types.clone();
        unique.dedup();
        assert_eq!(types.len(), unique.len());
    }

    #[test]
    fn grouping_bounds_the_series_and_text_names_counters_with_total() {
        let scrape = Scrape { processes: vec![figures()], unreadable: 0 };
        let t = text(&scrape, GroupBy::Function, Variant::Text);
        assert!(t.contains("# TYPE alloctramp_calls_total counter\n"), "{t}");
        assert!(!t.contains("# UNIT") && !t.contains("# EOF"));
        let calls: Vec<&str> = t.lines().filter(|l| l.starts_with("alloctramp_calls_total{")).collect();
        assert_eq!(
            calls,
            [
                r#"alloctramp_calls_total{pid="42",command="prog",module="prog",function="main"} 13"#,
                r#"alloctramp_calls_total{pid="42",command="prog",module="prog",function="work"} 5"#,
                r#"alloctramp_calls_total{pid="42",command="prog",module="lib.so",function="lib_new"} 7"#,
            ]
        );
        let t = text(&scrape, GroupBy::Module, Variant::Text);
        let live: Vec<&str> = t.lines().filter(|l| l.starts_with("alloctramp_live_bytes{")).collect();
        assert_eq!(
            live,
            [
                r#"alloctramp_live_bytes{pid="42",command="prog",module="prog"} 2000"#,
                r#"alloctramp_live_bytes{pid="42",command="prog",module="lib.so"} 448"#,
            ]
        );
        // Without live tracking: no live series.
        let mut f = figures();
        f.process.live = false;
        for (_, x) in &mut f.sites {
            x.live_bytes = None;
            x.live_calls = None;
        }
        let t = text(&Scrape { processes: vec![f], unreadable: 0 }, GroupBy::Site, Variant::Text);
        assert!(!t.contains("alloctramp_live_bytes{"), "{t}");
    }
}
