//! Reports and differences as one JSON document each (formats
//! `alloctramp-report` version 2 and `alloctramp-diff` version 1, schema in
//! docs/formats.md).

use crate::model::{GroupBy, ModuleInfo, ProcessInfo, Row, SortKey, totals};
use serde::Serialize;
use std::io::{self, Write};

/// One row (sites: the site's fields; groups: the group's key), as JSON
/// and CSV show it.
#[derive(Serialize)]
pub struct RowDoc<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub module: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_calls: Option<i128>,
    /// Calls failed by fault injection; left out where there were none.
    #[serde(skip_serializing_if = "is_zero")]
    pub injected: i128,
}

fn is_zero(v: &i128) -> bool {
    *v == 0
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
            free_calls: (!site).then_some(f.free_calls),
            injected: f.injected,
        }
    }
}

/// The process part of a document: the file read, the process and its
/// state.
#[derive(Serialize)]
pub struct ProcessDoc<'a> {
    pub path: &'a str,
    pub pid: u32,
    pub command: &'a str,
    pub arguments: &'a [String],
    /// The process that wrote the file is running now.
    pub running: bool,
    pub on: bool,
    pub exited: bool,
    pub live: bool,
    pub draining: bool,
    pub incomplete: bool,
    pub generation: u64,
    pub start_time: u64,
    pub reset_time: u64,
    pub last_switch_ns: u64,
    pub last_switch_sites: u64,
    pub last_switch_time: u64,
    pub last_error: &'a str,
    pub untracked_allocs: u64,
    pub table_bytes: u64,
    pub table_objects: u64,
    pub modules: &'a [ModuleInfo],
}

impl<'a> ProcessDoc<'a> {
    /// `path`: the file read; `running`: whether the process that wrote it
    /// runs now (the caller looks).
    pub fn new(path: &'a str, running: bool, p: &'a ProcessInfo, modules: &'a [ModuleInfo]) -> ProcessDoc<'a> {
        ProcessDoc {
            path,
            pid: p.pid,
            command: &p.command,
            arguments: &p.arguments,
            running,
            on: p.on,
            exited: p.exited,
            live: p.live,
            draining: p.draining,
            incomplete: p.incomplete,
            generation: p.generation,
            start_time: p.start_time,
            reset_time: p.reset_time,
            last_switch_ns: p.last_switch_ns,
            last_switch_sites: p.last_switch_sites,
            last_switch_time: p.last_switch_time,
            last_error: &p.last_error,
            untracked_allocs: p.untracked_allocs,
            table_bytes: p.table_bytes,
            table_objects: p.table_objects,
            modules,
        }
    }
}

/// A JSON writer's error as the I/O error it was, if it was one (so that a
/// closed pipe is recognised as such).
fn json_io(e: serde_json::Error) -> io::Error {
    match e.io_error_kind() {
        Some(kind) => io::Error::from(kind),
        None => io::Error::other(e),
    }
}

fn write_doc(w: &mut dyn Write, doc: &impl Serialize) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *w, doc).map_err(json_io)?;
    writeln!(w)
}

/// The rows as `sites` (grouped by site) or `groups`.
fn split<'a>(rows: &'a [Row<'a>], group_by: GroupBy) -> (Option<Vec<RowDoc<'a>>>, Option<Vec<RowDoc<'a>>>) {
    let docs: Vec<RowDoc> = rows.iter().map(RowDoc::new).collect();
    if group_by == GroupBy::Site { (Some(docs), None) } else { (None, Some(docs)) }
}

/// A report: the process, then the rows and their totals. `sort`: the
/// order the rows are in (None: site order).
pub fn write_report(
    w: &mut dyn Write,
    process: &ProcessDoc,
    rows: &[Row],
    group_by: GroupBy,
    sort: Option<SortKey>,
) -> io::Result<()> {
    #[derive(Serialize)]
    struct Doc<'a> {
        format: &'static str,
        version: u32,
        #[serde(flatten)]
        process: &'a ProcessDoc<'a>,
        group_by: GroupBy,
        sort: Option<SortKey>,
        totals: RowDoc<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        sites: Option<Vec<RowDoc<'a>>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        groups: Option<Vec<RowDoc<'a>>>,
    }
    let total = totals(rows, process.live);
    let (sites, groups) = split(rows, group_by);
    let doc = Doc {
        format: "alloctramp-report",
        version: 2,
        process,
        group_by,
        sort,
        totals: RowDoc::new(&total),
        sites,
        groups,
    };
    write_doc(w, &doc)
}

/// A difference: both processes, then the rows (NEW minus OLD) and their
/// totals. `live`: both sides had live figures.
pub fn write_diff(
    w: &mut dyn Write,
    old: &ProcessDoc,
    new: &ProcessDoc,
    live: bool,
    rows: &[Row],
    group_by: GroupBy,
    sort: Option<SortKey>,
) -> io::Result<()> {
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
    let total = totals(rows, live);
    let (sites, groups) = split(rows, group_by);
    let doc = Doc {
        format: "alloctramp-diff",
        version: 1,
        old,
        new,
        live,
        group_by,
        sort,
        totals: RowDoc::new(&total),
        sites,
        groups,
    };
    write_doc(w, &doc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::figures;
    use crate::model::{Selection, diff, group, select};

    fn out(f: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> String {
        let mut v = Vec::new();
        f(&mut v).unwrap();
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn a_report_document() {
        let f = figures();
        let sel = Selection { module: Some("lib.so"), ..Selection::default() };
        let rows = select(f.sites.clone(), &f.modules, &sel, false).unwrap();
        let p = ProcessDoc::new("/run/42.counters", false, &f.process, &f.modules[1..]);
        let text = out(|w| write_report(w, &p, &rows, GroupBy::Site, None));
        let want = r#"{
  "format": "alloctramp-report",
  "version": 2,
  "path": "/run/42.counters",
  "pid": 42,
  "command": "prog",
  "arguments": [],
  "running": false,
  "on": true,
  "exited": false,
  "live": true,
  "draining": false,
  "incomplete": false,
  "generation": 0,
  "start_time": 0,
  "reset_time": 0,
  "last_switch_ns": 0,
  "last_switch_sites": 0,
  "last_switch_time": 0,
  "last_error": "",
  "untracked_allocs": 0,
  "table_bytes": 0,
  "table_objects": 0,
  "modules": [
    {
      "name": "lib.so",
      "build_id": "b1d",
      "sites": 2,
      "on": true,
      "unloaded": false,
      "table_size": 4096,
      "counters_size": 4096
    }
  ],
  "group_by": "site",
  "sort": null,
  "totals": {
    "sites": 2,
    "calls": 7,
    "bytes": 448,
    "failed": 0,
    "live_calls": 7,
    "live_bytes": 448,
    "freed_objects": 0,
    "freed_bytes": 0,
    "untracked_frees": 2,
    "free_calls": 2
  },
  "sites": [
    {
      "module": "lib.so",
      "build_id": "b1d",
      "address": 80,
      "function": "lib_new",
      "file": "lib.c",
      "line": 80,
      "entry": "malloc",
      "kind": "alloc",
      "form": "call rel32",
      "calls": 7,
      "bytes": 448,
      "failed": 0,
      "live_calls": 7,
      "live_bytes": 448,
      "freed_objects": 0,
      "freed_bytes": 0,
      "untracked_frees": 0
    },
    {
      "module": "lib.so",
      "build_id": "b1d",
      "address": 96,
      "function": "lib_free",
      "file": "lib.c",
      "line": 96,
      "entry": "free",
      "kind": "free",
      "form": "call rel32",
      "calls": 2,
      "bytes": 0,
      "failed": 0,
      "live_calls": 0,
      "live_bytes": 0,
      "freed_objects": 0,
      "freed_bytes": 0,
      "untracked_frees": 2
    }
  ]
}
"#;
        assert_eq!(text, want);
    }

    #[test]
    fn groups_and_a_difference_document() {
        let f = figures();
        let rows = group(f.sites.clone(), GroupBy::File);
        let p = ProcessDoc::new("f", true, &f.process, &f.modules);
        let text = out(|w| write_report(w, &p, &rows, GroupBy::File, Some(SortKey::Bytes)));
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["sort"], "bytes");
        assert_eq!(doc["group_by"], "file");
        assert!(doc.get("sites").is_none());
        let lib = r#"
    {
      "module": "lib.so",
      "file": "lib.c",
      "sites": 2,
      "calls": 7,
      "bytes": 448,
      "failed": 0,
      "live_calls": 7,
      "live_bytes": 448,
      "freed_objects": 0,
      "freed_bytes": 0,
      "untracked_frees": 2,
      "free_calls": 2
    }
  ]
}
"#;
        assert!(text.ends_with(lib), "{text}");
        assert_eq!(doc["totals"]["calls"], 25);

        let mut new = figures();
        new.process.live = false;
        new.sites[0].1.calls += 2;
        let d = diff(&f, &new, false);
        let live = d.live;
        let rows = d.select(&Selection::default()).unwrap();
        let (po, pn) = (
            ProcessDoc::new("a", false, &f.process, &f.modules),
            ProcessDoc::new("b", true, &new.process, &new.modules),
        );
        let doc: serde_json::Value =
            serde_json::from_str(&out(|w| write_diff(w, &po, &pn, live, &rows, GroupBy::Site, None))).unwrap();
        assert_eq!(doc["format"], "alloctramp-diff");
        assert_eq!(
            (&doc["old"]["path"], &doc["new"]["live"], &doc["live"]),
            (&"a".into(), &false.into(), &false.into())
        );
        assert!(doc["old"].get("format").is_none());
        let s = &doc["sites"][0];
        assert_eq!(
            (&s["in_old"], &s["in_new"], &s["calls"], &s["live_bytes"]),
            (&true.into(), &true.into(), &2.into(), &serde_json::Value::Null)
        );
        assert_eq!(doc["totals"]["calls"], 2);
    }
}
