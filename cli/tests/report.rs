//! `alloctramp report`, `snapshot`, `diff`, `run` and `demo`: exact per-site
//! figures in text (parsed back), JSON and CSV; reports of a running process
//! as it allocates; differences of snapshots; one-line errors.
//!
//! Live figures are checked exactly where the test programs make them
//! known, whenever the process file says live tracking was on.

use crate::patch::patch_to;
use crate::runtime::{Server, free_handler_line};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The display name of an entry point given by symbol.
fn display(symbol: &str) -> String {
    alloctramp_trampolines::entry::defaults()
        .into_iter()
        .find(|e| e.target.to_string() == symbol)
        .map_or_else(|| symbol.to_string(), |e| e.display)
}

/// A fresh counters directory (mode 0700).
fn counters_dir(name: &str) -> PathBuf {
    let d = scratch(&format!("report-{name}"));
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    d
}

fn ok(o: &Output, what: &str) -> String {
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn report_out(target: &Path, extra: &[&str]) -> Output {
    alloctramp().arg("report").arg(target).args(extra).output().unwrap()
}

fn report_json(target: &Path, extra: &[&str]) -> Value {
    let o = report_out(target, &[&["--format", "json"], extra].concat());
    serde_json::from_str(&ok(&o, "report --format json")).unwrap()
}

/// (file name, line) of a site.
type Key = (String, u32);

/// Figures of one site as the markers give them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Expect {
    entry: String,
    calls: u64,
    bytes: u64,
    failed: u64,
}

fn is_free(entry: &str) -> bool {
    entry == "free" || entry.starts_with("_Zd")
}

fn expected(p: &Program) -> BTreeMap<Key, Expect> {
    expected_as(p, |q| q.markers.clone())
}

/// What each site of `p` (and the libraries it needs) counts, the sites
/// and figures as `view` gives them.
fn expected_as(p: &Program, view: impl Fn(&Program) -> Vec<Marker>) -> BTreeMap<Key, Expect> {
    let mut m = BTreeMap::new();
    let mut progs = vec![p];
    progs.extend(p.needs.iter().map(|n| program(n)));
    for q in progs {
        for mk in &view(q) {
            let e = Expect { entry: display(&mk.entry), calls: mk.calls, bytes: mk.bytes, failed: mk.failed };
            m.insert((mk.file.clone(), mk.line), e);
        }
    }
    m
}

/// Live objects and bytes the test programs leave per site when the run
/// ends (where known): nothing in `basic` and `server` (everything is
/// freed); what `demo`'s @demo-live markers say.
fn expected_live(p: &Program) -> Option<BTreeMap<Key, (u64, u64)>> {
    let mut m: BTreeMap<Key, (u64, u64)> = expected(p).into_keys().map(|k| (k, (0, 0))).collect();
    match p.name.as_str() {
        "basic" | "server" => Some(m),
        "demo" => {
            m.extend(demo_live());
            Some(m)
        }
        _ => None,
    }
}

/// `@demo-live objects=N bytes=B` markers of demo.c.
fn demo_live() -> BTreeMap<Key, (u64, u64)> {
    let src = std::fs::read_to_string(testbins_dir().join("demo.c")).unwrap();
    let mut m = BTreeMap::new();
    for (i, l) in src.lines().enumerate() {
        if let Some(at) = l.find("/* @demo-live ") {
            let body = &l[at + 14..l[at..].find("*/").unwrap() + at];
            let mut v = (0, 0);
            for w in body.split_whitespace() {
                match w.split_once('=') {
                    Some(("objects", n)) => v.0 = n.parse().unwrap(),
                    Some(("bytes", n)) => v.1 = n.parse().unwrap(),
                    _ => panic!("demo.c:{}: bad @demo-live word {w}", i + 1),
                }
            }
            m.insert(("demo.c".to_string(), i as u32 + 1), v);
        }
    }
    assert_eq!(m.len(), 2, "demo.c has two @demo-live markers");
    m
}

/// One text row: (size, calls, extra columns, tag), and the total bytes
/// and calls when the layout shows them first (sorted by a total).
#[derive(Debug)]
struct TextRow {
    size: i128,
    calls: i128,
    extra: Vec<String>,
    tag: String,
    totals: Option<(i128, i128)>,
}

/// Parses the allocinfo layout (asserting its two header lines), or the
/// one with the totals first.
fn parse_text(out: &str, extra_columns: usize) -> Vec<TextRow> {
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("allocinfo - version: 1.0"));
    let header = lines.next().unwrap();
    let totals_first = header.starts_with("#  <total-bytes> <total-calls>       <size>  <calls> ");
    assert!(totals_first || header.starts_with("#     <size>  <calls> "), "{out}");
    lines
        .map(|l| {
            let mut words = l.split_whitespace();
            let mut num = || -> i128 { words.next().unwrap().parse().unwrap() };
            let totals = totals_first.then(|| (num(), num()));
            let size = words.next().unwrap().parse().unwrap();
            let calls = words.next().unwrap().parse().unwrap();
            let extra: Vec<String> = words.by_ref().take(extra_columns).map(str::to_string).collect();
            let rest: Vec<&str> = words.collect();
            TextRow { size, calls, extra, tag: rest.join(" "), totals }
        })
        .collect()
}

/// (file name, line) from a site tag `FILE:LINE module:M func:F`.
fn tag_key(tag: &str) -> Key {
    let loc = tag.split(" module:").next().unwrap();
    let (file, line) = loc.rsplit_once(':').unwrap();
    (base(file).to_string(), line.parse().unwrap())
}

fn json_key(s: &Value) -> Key {
    (base(s["file"].as_str().unwrap()).to_string(), s["line"].as_u64().unwrap() as u32)
}

/// Minimal CSV reader (quoted fields, doubled quotes).
fn parse_csv(text: &str) -> Vec<BTreeMap<String, String>> {
    let parse_line = |l: &str| -> Vec<String> {
        let mut out = vec![];
        let mut cur = String::new();
        let mut quoted = false;
        let mut chars = l.chars().peekable();
        while let Some(c) = chars.next() {
            match (c, quoted) {
                ('"', true) if chars.peek() == Some(&'"') => {
                    cur.push('"');
                    chars.next();
                }
                ('"', _) => quoted = !quoted,
                (',', false) => out.push(std::mem::take(&mut cur)),
                _ => cur.push(c),
            }
        }
        out.push(cur);
        out
    };
    let mut lines = text.lines();
    let head = parse_line(lines.next().unwrap());
    lines
        .map(|l| {
            let v = parse_line(l);
            assert_eq!(v.len(), head.len(), "{l}");
            head.iter().cloned().zip(v).collect()
        })
        .collect()
}

/// Runs every test program (default build) with profiling on from the
/// start; returns the program and its final counters file.
fn final_files(name: &str) -> Vec<(&'static Program, PathBuf)> {
    let b = built(Config::default_o2());
    let pdir = scratch(&format!("report-{name}-bin"));
    for p in programs() {
        patch_to(&b.path(&p.name), &pdir.join(&p.output), &[OWN]);
    }
    let mut out = vec![];
    for p in programs().iter().filter(|p| !p.is_library && !p.variable_counts) {
        let dir = counters_dir(&format!("{name}-{}", p.name));
        let env = [
            ("ALLOCTRAMP", "on"),
            ("ALLOCTRAMP_DIR", dir.to_str().unwrap()),
            ("LD_LIBRARY_PATH", pdir.to_str().unwrap()),
        ];
        let (_, err, rc) = run_program(&pdir.join(&p.output), &p.run, &env);
        assert_eq!(rc, 0, "{}: {err}", p.name);
        let files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "counters"))
            .collect();
        assert_eq!(files.len(), 1, "{}: {files:?}", p.name);
        out.push((p, files[0].clone()));
    }
    out
}

#[test]
fn report_of_each_program_matches_its_markers_in_text_json_and_csv() {
    for (p, file) in final_files("exact") {
        let exp = expected(p);
        let name = &p.name;

        // JSON: every site, exact calls/bytes/failed; live figures null
        // exactly when live tracking was off.
        let doc = report_json(&file, &[]);
        assert_eq!(doc["format"], "alloctramp-report");
        assert_eq!(doc["exited"], true);
        assert!(doc.get("usable").is_none(), "no usable-size figures: nothing writes them");
        let live = doc["live"].as_bool().unwrap();
        let mut got = BTreeMap::new();
        let mut live_got = BTreeMap::new();
        for s in doc["sites"].as_array().unwrap() {
            let e = Expect {
                entry: s["entry"].as_str().unwrap().to_string(),
                calls: s["calls"].as_u64().unwrap(),
                bytes: s["bytes"].as_u64().unwrap(),
                failed: s["failed"].as_u64().unwrap(),
            };
            assert_eq!(s["kind"] == "free", is_free(&e.entry) || e.entry.starts_with("operator delete"), "{s}");
            assert_eq!(s["live_bytes"].is_null(), !live, "{name}: {s}");
            assert!(s.get("usable_bytes").is_none(), "{name}: {s}");
            assert_eq!(s["live_calls"].is_null(), !live, "{name}: {s}");
            if live {
                let lc = s["live_calls"].as_u64().unwrap();
                assert!(lc <= e.calls - e.failed, "{name}: live objects beyond calls: {s}");
                live_got.insert(json_key(s), (lc, s["live_bytes"].as_u64().unwrap()));
            }
            assert!(got.insert(json_key(s), e).is_none(), "{name}: one site per marked line");
        }
        assert_eq!(got, exp, "{name}: JSON figures differ from the markers");
        if live && let Some(l) = expected_live(p) {
            assert_eq!(live_got, l, "{name}: live figures");
        }

        // Text: allocation sites only; <size> <calls> are the live figures,
        // or the totals (bytes, successful calls) without live tracking.
        let o = report_out(&file, &[]);
        let text = ok(&o, "report");
        let rows = parse_text(&text, 0);
        let allocating: BTreeMap<&Key, &Expect> = exp.iter().filter(|(_, e)| !is_free(&e.entry)).collect();
        let allocating: BTreeMap<&Key, &Expect> =
            allocating.into_iter().filter(|(_, e)| !e.entry.starts_with("operator delete")).collect();
        assert_eq!(rows.len(), allocating.len(), "{name}: one row per allocation site:\n{text}");
        for r in &rows {
            let k = tag_key(&r.tag);
            let e = allocating[&k];
            let want = if live {
                let (c, b) = live_got[&k];
                (b as i128, c as i128)
            } else {
                (e.bytes as i128, (e.calls - e.failed) as i128)
            };
            assert_eq!((r.size, r.calls), want, "{name}: {}", r.tag);
            let src_of = |q: &Program| q.src.file_name().unwrap().to_str().unwrap().to_string();
            let owner = std::iter::once(p).chain(p.needs.iter().map(|n| program(n))).find(|q| src_of(q) == k.0);
            let module = &owner.unwrap().output;
            assert!(r.tag.contains(&format!(" module:{module} ")), "{name}: {}", r.tag);
            assert!(r.tag.contains(" func:"), "{}", r.tag);
        }
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(stderr.contains("live tracking is off"), !live, "{stderr}");
        assert!(stderr.lines().count() <= 1, "{stderr}");

        // Text with every column: free sites too, exact totals.
        let text = ok(&report_out(&file, &["--all-columns", "--quiet"]), "report --all-columns");
        assert_eq!(
            text.lines().nth(1),
            Some(
                "#     <size>  <calls> <total-calls>  <total-bytes> <failed>  <freed> <untracked>  <kind> <tag info> \
                 entry:<entry>"
            )
        );
        let rows = parse_text(&text, 6);
        assert_eq!(rows.len(), exp.len(), "{name}: every site with --all-columns");
        for r in &rows {
            let k = tag_key(&r.tag);
            let e = &exp[&k];
            let col = |i: usize| r.extra[i].parse::<u64>().unwrap();
            assert_eq!((col(0), col(1), col(2)), (e.calls, e.bytes, e.failed), "{name}: {}", r.tag);
            let kind = if is_free(&e.entry) || e.entry.starts_with("operator delete") { "free" } else { "alloc" };
            assert!(r.extra[5] == kind || r.extra[5] == "realloc", "{name}: kind column: {}", r.tag);
            assert!(r.tag.ends_with(&format!(" entry:{}", e.entry)), "{}", r.tag);
        }

        // CSV: the same figures.
        let csv = ok(&report_out(&file, &["--format", "csv"]), "report --format csv");
        assert_eq!(
            csv.lines().next(),
            Some(
                "module,build_id,address,function,file,line,entry,kind,form,calls,bytes,failed,live_calls,live_bytes,\
                 freed_objects,freed_bytes,untracked_frees,injected"
            )
        );
        let recs = parse_csv(&csv);
        let mut got = BTreeMap::new();
        for r in &recs {
            let k = (base(&r["file"]).to_string(), r["line"].parse().unwrap());
            let e = Expect {
                entry: r["entry"].clone(),
                calls: r["calls"].parse().unwrap(),
                bytes: r["bytes"].parse().unwrap(),
                failed: r["failed"].parse().unwrap(),
            };
            assert_eq!(r["live_bytes"].is_empty(), !live);
            assert_eq!(r["injected"], "0", "no call failed by injection");
            got.insert(k, e);
        }
        assert_eq!(got, exp, "{name}: CSV figures differ from the markers");
    }
}

#[test]
fn sorting_selecting_grouping_and_human_sizes() {
    let files = final_files("views");
    let (_, file) = files.iter().find(|(p, _)| p.name == "demo").unwrap();
    let exp = expected(program("demo"));
    let doc = report_json(file, &[]);
    let live = doc["live"].as_bool().unwrap();

    // --sort and --top: largest first, cut.
    for (key, field) in [("bytes", 0), ("calls", 1), ("live-bytes", 2), ("live-calls", 3)] {
        let j = report_json(file, &["--sort", key]);
        let v: Vec<i128> = j["sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                let c = s["calls"].as_i64().unwrap() as i128;
                let f = s["failed"].as_i64().unwrap() as i128;
                // A free site has no live figures, nor allocations.
                let (c_alloc, f) = if s["kind"] == "free" { (0, 0) } else { (c, f) };
                match field {
                    0 => s["bytes"].as_i64().unwrap() as i128,
                    1 => c,
                    2 => s["live_bytes"].as_i64().map_or(s["bytes"].as_i64().unwrap() as i128, |x| x as i128),
                    _ => s["live_calls"].as_i64().map_or(c_alloc - f, |x| x as i128),
                }
            })
            .collect();
        assert!(v.windows(2).all(|w| w[0] >= w[1]), "--sort {key}: {v:?}");
    }
    let text = ok(&report_out(file, &["--top", "3"]), "--top");
    let rows = parse_text(&text, 0);
    assert_eq!(rows.len(), 3);
    let top = tag_key(&rows[0].tag);
    if live {
        assert_eq!(top, demo_live().into_iter().max_by_key(|(_, v)| v.1).unwrap().0, "the leak is on top");
    } else {
        let biggest = exp.iter().max_by_key(|(_, e)| e.bytes).unwrap().0;
        assert_eq!(&top, biggest, "the biggest total on top");
        assert_eq!(rows[0].size, 409600);
    }

    // --min-bytes keeps rows whose size column reaches it (suffixes work).
    let rows = parse_text(&ok(&report_out(file, &["--min-bytes", "10K"]), "--min-bytes"), 0);
    assert!(!rows.is_empty() && rows.iter().all(|r| r.size >= 10240), "{rows:?}");
    let all = parse_text(&ok(&report_out(file, &[]), "report"), 0);
    assert_eq!(rows.len(), all.iter().filter(|r| r.size >= 10240).count());

    // --human: sizes as sort -h reads them.
    let text = ok(&report_out(file, &["--human", "--sort", "bytes", "--all-columns"]), "--human");
    if !live {
        assert!(text.contains("400.0KiB"), "{text}");
    }
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("sort -h -r -k4 | head -1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let first = String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap();
    assert!(first.contains("func:read_request"), "sort -h on total bytes: {first}");

    // --module: only that module; an unknown one is an error.
    let j = report_json(file, &["--module", "demo"]);
    assert_eq!(j["sites"].as_array().unwrap().len(), exp.len());
    let o = report_out(file, &["--module", "nosuch"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no module \"nosuch\""));

    // --group-by function: sums per function.
    let j = report_json(file, &["--group-by", "function"]);
    let mut sums: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for s in doc["sites"].as_array().unwrap() {
        let e = sums.entry(s["function"].as_str().unwrap().to_string()).or_default();
        if s["kind"] != "free" {
            e.0 += s["calls"].as_u64().unwrap();
        }
        e.1 += s["bytes"].as_u64().unwrap();
    }
    let groups: BTreeMap<String, (u64, u64)> = j["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (g["function"].as_str().unwrap().to_string(), (g["calls"].as_u64().unwrap(), g["bytes"].as_u64().unwrap()))
        })
        .collect();
    assert_eq!(groups, sums);
    assert_eq!(sums["render"], (200, 28800), "malloc(32) and realloc(256) per request");
    // Text: `module:M func:F` tags; module and file groupings sum it all.
    let rows = parse_text(&ok(&report_out(file, &["--group-by", "function", "--sort", "bytes"]), "group"), 0);
    assert!(rows[0].tag.ends_with("module:demo func:read_request"), "{rows:?}");
    let total: u64 = exp.values().map(|e| e.bytes).sum();
    for by in ["module", "file"] {
        let j = report_json(file, &["--group-by", by]);
        let g = j["groups"].as_array().unwrap();
        assert_eq!(g.len(), 1, "{by}: {j}");
        assert_eq!(g[0]["bytes"].as_u64().unwrap(), total);
        assert_eq!(g[0]["sites"].as_u64().unwrap(), exp.len() as u64);
    }
    let csv = parse_csv(&ok(&report_out(file, &["--group-by", "module", "--format", "csv"]), "csv"));
    assert_eq!(csv.len(), 1);
    assert_eq!(csv[0]["bytes"], total.to_string());
}

/// Report views of a running `server` (see testbins/README.md).
impl Server {
    fn alloctramp(&self, args: &[&str]) -> Output {
        alloctramp().args(args).arg("--dir").arg(&self.dir).output().unwrap()
    }
    /// The text report, as (file name, line) -> (size, calls).
    fn text(&self, extra: &[&str]) -> BTreeMap<Key, (i128, i128)> {
        let o = self.alloctramp(&[&["report", &self.pid()], extra].concat());
        parse_text(&ok(&o, "report PID"), 0).into_iter().map(|r| (tag_key(&r.tag), (r.size, r.calls))).collect()
    }
    fn json(&self) -> Value {
        serde_json::from_str(&ok(&self.alloctramp(&["report", "--format", "json", &self.pid()]), "report")).unwrap()
    }
}

/// server.c's marked line of ENTRY before the `free` handler (the round's
/// site), or in it.
fn server_line(entry: &str, in_free_handler: bool) -> Key {
    let free_at = free_handler_line();
    let m =
        program("server").markers.iter().find(|m| m.entry == entry && (m.line > free_at) == in_free_handler).unwrap();
    (m.file.clone(), m.line)
}

#[test]
fn reports_of_a_running_process_follow_its_allocations() {
    let mut s = Server::start("live", &[]);
    let malloc = server_line("malloc", false);
    let calloc = server_line("calloc", false);
    assert_eq!(s.cmd("round"), "done");
    // A process that never profiled keeps its modules out of its file
    // until they first switch on: nothing to show, and the report says so.
    let o = s.alloctramp(&["report", &s.pid()]);
    assert!(parse_text(&ok(&o, "report PID"), 0).is_empty(), "profiling never on: no rows");
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing was counted"), "{o:?}");

    // The process list shows it, off.
    let list = ok(&s.alloctramp(&["report"]), "report (list)");
    let line = list.lines().find(|l| l.split_whitespace().next() == Some(&s.pid())).expect("listed");
    assert_eq!(line.split_whitespace().nth(1), Some("off"), "{line}");

    let o = s.alloctramp(&["enable", &s.pid()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("profiling on"), "{o:?}");
    let list = ok(&s.alloctramp(&["report"]), "report (list)");
    let line = list.lines().find(|l| l.split_whitespace().next() == Some(&s.pid())).unwrap();
    assert_eq!(line.split_whitespace().nth(1), Some("on"), "{line}");
    assert!(line.contains("server"), "{line}");

    let live = s.json()["live"].as_bool().unwrap();
    for round in 1..=3i128 {
        assert_eq!(s.cmd("round"), "done");
        let t = s.text(&[]);
        assert_eq!(t[&malloc], (500 * round, 5 * round), "round {round}: the kept blocks");
        let c = if live { (0, 0) } else { (160 * round, 2 * round) };
        assert_eq!(t[&calloc], c, "round {round}: freed at once");
    }
    assert_eq!(s.cmd("free"), "freed");
    let t = s.text(&[]);
    assert_eq!(t[&malloc], if live { (0, 0) } else { (1500, 15) }, "after `free`");
    let doc = s.json();
    let free_site =
        doc["sites"].as_array().unwrap().iter().find(|x| json_key(x) == server_line("free", true)).unwrap().clone();
    assert_eq!(free_site["calls"], 20, "the blocks of all four rounds, counted or not");

    // Off, with live tracking: the frees keep being seen.
    assert_eq!(s.cmd("round"), "done");
    let o = s.alloctramp(&["disable", &s.pid()]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(s.cmd("free"), "freed");
    if live {
        assert_eq!(s.text(&[])[&malloc], (0, 0), "the free after disable was attributed");
        // And everything off at once.
        assert!(s.alloctramp(&["enable", &s.pid()]).status.success());
        assert_eq!(s.cmd("round"), "done");
        let o = s.alloctramp(&["disable", "--now", &s.pid()]);
        assert!(o.status.success(), "{o:?}");
        assert_eq!(s.cmd("free"), "freed");
        assert_eq!(s.text(&[])[&malloc], (500, 5), "off now: the frees are no longer seen");
    }
    let o = s.alloctramp(&["reset", &s.pid()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("counters reset"), "{o:?}");
    assert!(s.text(&[]).values().all(|v| *v == (0, 0)));
    s.quit();
}

#[test]
fn a_diff_of_two_snapshots_is_exactly_what_happened_between_them() {
    let mut s = Server::start("diff", &[("ALLOCTRAMP", "on")]);
    assert_eq!(s.cmd("round"), "done");
    let a = s.dir.join("a.snapshot");
    let b = s.dir.join("b.snapshot");
    let o = s.alloctramp(&["snapshot", &s.pid(), "-o", a.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("saved process"), "{o:?}");
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.cmd("free"), "freed");
    assert!(s.alloctramp(&["snapshot", &s.pid(), "-o", b.to_str().unwrap()]).status.success());
    // The snapshot is private and stays what it was.
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&a).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(s.cmd("round"), "done");
    let a_doc = report_json(&a, &[]);
    let b_doc = report_json(&b, &[]);
    let calls = |d: &Value| -> BTreeMap<Key, (u64, u64)> {
        d["sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (json_key(x), (x["calls"].as_u64().unwrap(), x["bytes"].as_u64().unwrap())))
            .collect()
    };
    let (ca, cb) = (calls(&a_doc), calls(&b_doc));
    assert_eq!(ca[&server_line("malloc", false)], (5, 500), "snapshot a: one round");
    assert_eq!(cb[&server_line("malloc", false)], (15, 1500), "snapshot b: three rounds");
    assert_eq!(cb[&server_line("free", true)], (15, 0), "snapshot b: one free of 15 blocks");

    // JSON diff: new minus old, per site, exactly.
    let o = alloctramp().args(["diff", "--format", "json"]).arg(&a).arg(&b).output().unwrap();
    let d: Value = serde_json::from_str(&ok(&o, "diff")).unwrap();
    assert_eq!(d["format"], "alloctramp-diff");
    let live = d["live"].as_bool().unwrap();
    let mut got = BTreeMap::new();
    for x in d["sites"].as_array().unwrap() {
        got.insert(json_key(x), (x["calls"].as_i64().unwrap(), x["bytes"].as_i64().unwrap()));
        assert_eq!((x["in_old"].as_bool(), x["in_new"].as_bool()), (Some(true), Some(true)));
        if live {
            let k = json_key(x);
            let lb = |doc: &Value| {
                doc["sites"].as_array().unwrap().iter().find(|y| json_key(y) == k).unwrap()["live_bytes"]
                    .as_i64()
                    .unwrap()
            };
            assert_eq!(x["live_bytes"].as_i64().unwrap(), lb(&b_doc) - lb(&a_doc));
        }
    }
    got.retain(|_, d| *d != (0, 0));
    let want: BTreeMap<Key, (i64, i64)> = ca
        .iter()
        .map(|(k, va)| (k.clone(), (cb[k].0 as i64 - va.0 as i64, cb[k].1 as i64 - va.1 as i64)))
        .filter(|(_, d)| *d != (0, 0))
        .collect();
    assert_eq!(got, want, "diff = b - a");

    // Text diff: signed figures, growth first.
    let o = alloctramp().args(["diff"]).arg(&a).arg(&b).output().unwrap();
    let text = ok(&o, "diff");
    let rows: Vec<_> = text.lines().skip(2).collect();
    assert!(!rows.is_empty());
    let sizes: Vec<i128> = rows.iter().map(|l| l.split_whitespace().next().unwrap().parse().unwrap()).collect();
    assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "growth first: {text}");
    if !live {
        assert!(rows[0].starts_with("       +1000      +10 "), "the kept blocks grew most: {text}");
    }
    // A snapshot against the running process: the round since.
    let o = alloctramp().args(["diff", "--format", "json", "--dir"]).arg(&s.dir).arg(&b).arg(s.pid()).output().unwrap();
    let d: Value = serde_json::from_str(&ok(&o, "diff with a pid")).unwrap();
    let m = d["sites"].as_array().unwrap().iter().find(|x| json_key(x) == server_line("malloc", false)).unwrap();
    assert_eq!((m["calls"].as_i64(), m["bytes"].as_i64()), (Some(5), Some(500)));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("reset"), "{o:?}");
    s.quit();
}

/// A diff across `alloctramp reset` says so: its changes were negative
/// with nothing to say why.
#[test]
fn a_diff_across_a_reset_says_the_counters_were_reset() {
    let mut s = Server::start(test_name(), &[("ALLOCTRAMP", "on")]);
    assert_eq!(s.cmd("round"), "done");
    let a = s.dir.join("a.snapshot");
    assert!(s.alloctramp(&["snapshot", &s.pid(), "-o", a.to_str().unwrap()]).status.success());
    assert!(s.alloctramp(&["reset", &s.pid()]).status.success());
    let o = alloctramp().args(["diff", "--format", "json", "--dir"]).arg(&s.dir).arg(&a).arg(s.pid()).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("the counters were reset between the two"), "{err}");
    let d: Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = d["sites"].as_array().unwrap().iter().find(|x| json_key(x) == server_line("malloc", false)).unwrap();
    assert_eq!((m["calls"].as_i64(), m["bytes"].as_i64()), (Some(-5), Some(-500)));
    s.quit();
}

fn expect_error(o: &Output, what: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{what}: {err}");
    assert!(o.stdout.is_empty(), "{what}: no output: {}", String::from_utf8_lossy(&o.stdout));
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains(what), "expected {what:?} in {err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A patched process whose runtime could not make its counters file (its
/// directory is open to other users) is named as such, once the command
/// has waited for the file.
#[test]
fn a_patched_process_without_its_file_is_told_apart_from_an_unpatched_one() {
    let dir = counters_dir("no-file");
    let open_dir = dir.join("open");
    std::fs::create_dir_all(&open_dir).unwrap();
    std::fs::set_permissions(&open_dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let bin = dir.join("server");
    patch_to(&built(Config::default_o2()).path("server"), &bin, &[]);
    let mut talk = Talk::spawn(Command::new(&bin).env("ALLOCTRAMP_DIR", &open_dir), &[]);
    talk.send("round");
    assert_eq!(talk.line(), "done\n");
    let pid = talk.child.id().to_string();
    let o = alloctramp().args(["enable", "--dir"]).arg(&open_dir).arg(&pid).output().unwrap();
    expect_error(&o, "runs patched code but has no counters file");
    talk.send("quit");
    let (_, code) = talk.finish();
    assert_eq!(code, Some(0));
}

#[test]
fn errors_are_one_line_with_status_2() {
    let dir = counters_dir("errors");
    let r = |args: &[&str]| alloctramp().args(args).arg("--dir").arg(&dir).output().unwrap();
    // No such process (above the largest possible pid).
    expect_error(&r(&["report", "99999999"]), "no process 99999999");
    expect_error(&r(&["enable", "99999999"]), "no process 99999999");
    // A process without patched code: this test.
    let me = std::process::id().to_string();
    expect_error(&r(&["report", &me]), "runs no patched code");
    expect_error(&r(&["snapshot", &me, "-o", "/dev/null"]), "runs no patched code");
    // A process of another user (only checkable when not root).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        expect_error(&r(&["report", "1"]), "belongs to another user");
    }

    // Damaged, foreign, truncated and older snapshots.
    let good = final_files("errors").into_iter().find(|(p, _)| p.name == "basic").unwrap().1;
    // (Self-contained, as a snapshot is: the shared table read in.)
    let bytes = counters_bytes(&good);
    let write = |name: &str, data: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, data).unwrap();
        p
    };
    let foreign = built(Config::default_o2()).path("basic");
    expect_error(&report_out(&foreign, &[]), "not an alloctramp process file");
    expect_error(&report_out(&write("empty", b""), &[]), "not an alloctramp process file");
    let mut damaged = bytes.clone();
    damaged[..8].copy_from_slice(b"garbage!");
    expect_error(&report_out(&write("damaged", &damaged), &[]), "damaged or foreign");
    expect_error(&report_out(&write("truncated", &bytes[..bytes.len() / 2]), &[]), "truncated");
    let mut old = bytes.clone();
    old[8..12].copy_from_slice(&1u32.to_le_bytes());
    expect_error(&report_out(&write("old", &old), &[]), "version 1");
    let mut table = bytes.clone();
    // The first module's site table: a bad magic.
    let at = u64::from_le_bytes(bytes[512..520].try_into().unwrap()) as usize;
    table[at] ^= 0xff;
    expect_error(&report_out(&write("badtable", &table), &[]), "site table");
    expect_error(&report_out(&dir.join("missing"), &[]), "no such file");
    expect_error(&alloctramp().args(["diff"]).arg(&good).arg(dir.join("old")).output().unwrap(), "version 1");
    expect_error(&alloctramp().args(["report", "--min-bytes", "lots"]).arg(&good).output().unwrap(), "64K");
    expect_error(&alloctramp().args(["run", "--", "/nonexistent/prog"]).output().unwrap(), "no such program");

    // `report | head` closes quietly.
    let mut child = alloctramp()
        .args(["report", "--all-columns"])
        .arg(&good)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("Broken pipe"), "{o:?}");
}

/// A command missing an argument names it: `diff` with one snapshot said
/// "the following required arguments were not provided:" and no name.
#[test]
fn a_missing_argument_is_named() {
    let o = alloctramp().args(["diff", "1.counters"]).output().unwrap();
    expect_error(&o, "the following required arguments were not provided: <NEW>");
    let o = alloctramp().args(["enable"]).output().unwrap();
    expect_error(&o, "<PID>");
}

#[test]
fn every_command_has_help_with_an_example() {
    for cmd in ["sites", "patch", "run", "report", "snapshot", "diff", "enable", "disable", "reset", "demo"] {
        let o = alloctramp().args([cmd, "--help"]).output().unwrap();
        let text = ok(&o, cmd);
        assert!(text.contains("Example"), "{cmd} --help has an example:\n{text}");
        assert!(text.contains("alloctramp "), "{cmd}:\n{text}");
    }
}

#[test]
fn run_patches_into_a_cache_reuses_it_and_reports_at_exit() {
    let b = built(Config::default_o2());
    let dir = counters_dir("run");
    let cache = dir.join("cache");
    let report = dir.join("report.txt");
    let go = || {
        alloctramp()
            .args(["run", "--on", "--top", "0", "-o"])
            .arg(&report)
            .arg("--cache")
            .arg(&cache)
            .arg("--")
            .arg(b.path("basic"))
            .env("ALLOCTRAMP_DIR", &dir)
            .output()
            .unwrap()
    };
    let o = go();
    assert!(o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("patched"), "{err}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), run_program(&b.path("basic"), &[], &[]).0, "the program's output");
    // The final counters file is left, and the report is made of it.
    let doc = report_json(&dir.join(format!("{}.counters", find_pid(&err))), &[]);
    assert_eq!(doc["exited"], true);
    let live = doc["live"].as_bool().unwrap();
    let text = std::fs::read_to_string(&report).unwrap();
    let rows: BTreeMap<Key, (i128, i128)> =
        parse_text(&text, 0).into_iter().map(|r| (tag_key(&r.tag), (r.size, r.calls))).collect();
    let exp = expected(program("basic"));
    let allocating: Vec<_> = exp.iter().filter(|(_, e)| !is_free(&e.entry)).collect();
    assert_eq!(rows.len(), allocating.len(), "{text}");
    for (k, e) in &allocating {
        let want = if live { (0, 0) } else { (e.bytes as i128, (e.calls - e.failed) as i128) };
        assert_eq!(rows[*k], want, "{k:?}");
    }
    // A program that frees everything still shows what it allocated:
    // totals first, largest first, and the process's totals on one line.
    let parsed = parse_text(&text, 0);
    let totals: Vec<(i128, i128)> = parsed.iter().map(|r| r.totals.expect("totals first")).collect();
    assert!(totals.windows(2).all(|w| w[0].0 >= w[1].0), "sorted by total bytes: {text}");
    for r in &parsed {
        let e = &exp[&tag_key(&r.tag)];
        assert_eq!(r.totals, Some((e.bytes as i128, e.calls as i128)), "{}", r.tag);
    }
    // Allocations that succeeded (a failed one's request is said apart;
    // basic.c's failing site fails every time).
    assert!(allocating.iter().all(|(_, e)| e.failed == 0 || e.failed == e.calls));
    let (calls, bytes) = allocating
        .iter()
        .filter(|(_, e)| e.failed == 0)
        .fold((0i128, 0i128), |(c, b), (_, e)| (c + e.calls as i128, b + e.bytes as i128));
    let frees: u64 = exp.values().filter(|e| is_free(&e.entry)).map(|e| e.calls).sum();
    let at_exit = if live { "live at exit: 0 objects, 0 bytes" } else { "live at exit: not known" };
    let line = err.lines().find(|l| l.starts_with("alloctramp: totals: ")).unwrap_or_else(|| panic!("{err}"));
    assert!(line.starts_with(&format!("alloctramp: totals: {calls} allocations")), "{line}");
    assert!(line.contains(&format!(", {bytes} bytes")), "{line}");
    assert!(line.contains(&format!("; {frees} frees; {at_exit}")), "{line}");
    let entries: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
    assert_eq!(entries.len(), 1, "one cache entry");

    // Again: the cached copy is reused.
    let o = go();
    assert!(o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("patched before"), "{err}");
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);

    // The exit status is the program's; without -o the report goes to stderr.
    let o = alloctramp()
        .args(["run", "--on", "--cache"])
        .arg(&cache)
        .args(["--", "false"])
        .env("ALLOCTRAMP_DIR", &dir)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("allocinfo - version: 1.0"), "{o:?}");
}

/// The pid in `running PROG as pid N`.
fn find_pid(stderr: &str) -> u32 {
    let at = stderr.find(" as pid ").unwrap() + 8;
    stderr[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

#[test]
fn the_demo_runs_to_completion_and_shows_the_expected_top_sites() {
    let o = alloctramp().arg("demo").output().unwrap();
    let out = ok(&o, "demo");
    for step in ["1. Building", "2. Patching", "3. Running", "4. Switching profiling on", "5. ", "6. The report"] {
        assert!(out.contains(step), "step {step:?}:\n{out}");
    }
    let start = out.find("allocinfo - version: 1.0").expect("a report");
    let report: String = out[start..].lines().take_while(|l| !l.is_empty()).map(|l| format!("{l}\n")).collect();
    let rows = parse_text(&report, 0);
    // The demo patches with no option: callers of wrappers take the charge.
    let exp = expected_as(program("demo"), Program::charged_view);
    let allocating: Vec<(&Key, &Expect)> = exp.iter().filter(|(_, e)| !is_free(&e.entry)).collect();
    assert_eq!(rows.len(), allocating.len(), "{report}");
    let live = out.contains("largest first (alloctramp report");
    // Profiling was on for the second 100 requests: what the markers count.
    let got: BTreeMap<Key, (i128, i128)> = rows.iter().map(|r| (tag_key(&r.tag), (r.size, r.calls))).collect();
    if live {
        let l = demo_live();
        for (k, _) in &allocating {
            assert_eq!(got[*k], l.get(*k).map_or((0, 0), |v| (v.1 as i128, v.0 as i128)), "{k:?}");
        }
        assert_eq!(tag_key(&rows[0].tag), l.iter().max_by_key(|(_, v)| v.1).unwrap().0.clone(), "the leak first");
        assert!(rows[0].tag.ends_with("func:open_session"));
    } else {
        for (k, e) in &allocating {
            assert_eq!(got[*k], (e.bytes as i128, (e.calls - e.failed) as i128), "{k:?}");
        }
        assert!(rows[0].tag.ends_with("func:read_request"), "{report}");
        assert_eq!(rows[0].size, 409600);
    }
}

/// A profiled process's counters file has storage for every byte the
/// process writes through its mappings (a write to a page without storage
/// on a full tmpfs would kill it with SIGBUS), and for no counters shard
/// that no thread was given: a process that never profiled holds only the
/// header; switched on, its one counting thread's shard (1) and the shared
/// one (0) have storage after the table copy, the other 14 shards are a
/// hole; the callers region has storage once added. Reading the file
/// (report, the process list, snapshot) and a reset change nothing. On
/// tmpfs, where counters files usually live and storage is memory.
#[test]
fn a_profiled_process_s_counters_file_has_storage_for_what_its_threads_write() {
    let shm = Path::new("/dev/shm");
    // SAFETY: statfs fills the struct it is given.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let path = std::ffi::CString::new("/dev/shm").unwrap();
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 || st.f_type != libc::TMPFS_MAGIC {
        skip(test_name(), "/dev/shm is not tmpfs here");
        return;
    }
    /// Removes the directory even when the test fails.
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = shm.join(format!("alloctramp-test-holes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir(&dir).unwrap();
    let _gone = Gone(dir.clone());
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let d = dir.to_str().unwrap();
    let mut s = Server::start("holes", &[("ALLOCTRAMP_DIR", d)]);
    let file = dir.join(format!("{}.counters", s.pid()));
    let size = || std::fs::metadata(&file).unwrap().len();
    let blocks = || std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&file).unwrap()) * 512;
    // Once the program answers, start-up is over.
    assert_eq!(s.cmd("round"), "done");
    let header = alloctramp_trampolines::process::PROC_HEADER_SIZE;
    assert_eq!(size(), header, "never profiled: the header only");
    // Blocks, not SEEK_DATA: tmpfs counts storage it gave (fallocate) but
    // shows pages never written as holes.
    assert_eq!(blocks(), header, "never profiled");
    let run = |args: &[&str]| {
        let o = alloctramp().args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    let pid = s.pid();
    let snap = dir.join("s.snapshot");
    run(&["enable", "--dir", d, &pid]);
    assert_eq!(s.cmd("round"), "done");
    let bytes = std::fs::read(&file).unwrap();
    let pf = alloctramp_trampolines::process::ProcessFile::parse(&bytes).unwrap();
    let slots = pf.header.published();
    assert_eq!(slots.len(), 1, "switched on: the module joined the file");
    let counters = slots[0].counters_offset.load(std::sync::atomic::Ordering::Relaxed);
    let stride = slots[0].counters_size.load(std::sync::atomic::Ordering::Relaxed) / 16;
    assert_eq!(size(), counters + 16 * stride, "the file ends with the module's counters");
    // The thread counts in shard 0 while it has not made `PROBATION` calls
    // of the assign stub, and is given shard 1 at the next. A round makes
    // twelve: one per counted call, and strdup's trampoline counts the
    // call before it and the bytes after it.
    assert_eq!(blocks(), counters + stride, "the header, the table and shard 0: not the other 15");
    let probation = alloctramp_trampolines::layout::shard::PROBATION;
    let mut rounds = 1;
    while blocks() == counters + stride && rounds < 200 {
        assert_eq!(s.cmd("round"), "done");
        rounds += 1;
    }
    assert_eq!(
        rounds,
        (probation + 1).div_ceil(12),
        "shard 1 came with the round of the call after the first {probation}"
    );
    assert_eq!(blocks(), counters + 2 * stride, "the header, the table, shards 0 and 1: not the other 14");
    run(&["callers", "--dir", d, &pid, "on"]);
    assert_eq!(s.cmd("round"), "done");
    let callers = counters + 16 * stride;
    assert_eq!(blocks(), counters + 2 * stride + size() - callers, "and the callers region");
    let before = (size(), blocks());
    run(&["report", "--dir", d, &pid]);
    run(&["report", "--format", "json", "--dir", d, &pid]);
    run(&["report", "--dir", d]);
    run(&["snapshot", "--dir", d, &pid, "-o", snap.to_str().unwrap()]);
    run(&["reset", "--dir", d, &pid]);
    assert_eq!((size(), blocks()), before, "reading and resetting keep the file as it was");
    // Three more threads counting at once, 1,200 calls each: three more
    // shards.
    assert_eq!(s.cmd("spread"), "spread");
    assert_eq!(blocks(), before.1 + 3 * stride, "shards 2, 3 and 4 for the threads");
    // A forked child's own file holds the shards its only thread needs
    // (0 and its own), not every shard its parent reserved.
    let child = s.cmd("fork");
    let child_file = dir.join(format!("{}.counters", child.strip_prefix("child ").unwrap()));
    let meta = std::fs::metadata(&child_file).unwrap();
    assert_eq!(meta.len(), size(), "the child's file is laid out as its parent's");
    let child_blocks = std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
    assert_eq!(
        child_blocks,
        counters + 2 * stride + meta.len() - callers,
        "the forked child: header, table, shards 0 and 1, and the callers region"
    );
    assert_eq!(s.cmd("round"), "done");
    run(&["disable", "--dir", d, &pid]);
    drop(s);
}

/// `report --format json | head -c100` used to print "writing output:
/// Broken pipe" and exit 2: a closed pipe ends every format quietly. The
/// report (every C++ operator's sites, over 20 KB) is larger than the
/// command's output buffer, and the pipe is made as small as the kernel
/// allows (one page), so the writing meets the closed end.
#[test]
fn json_report_into_a_closed_pipe_is_quiet() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let files = final_files("closed-pipe");
    let (_, file) = files.iter().find(|(p, _)| p.name == "cxx_new_delete").unwrap();
    for format in ["json", "text", "csv"] {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 fills two descriptors, which the OwnedFds then own;
        // F_SETPIPE_SZ only resizes the pipe.
        let (read, write) = unsafe {
            assert_eq!(libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC), 0);
            libc::fcntl(fds[1], libc::F_SETPIPE_SZ, 4096);
            (std::fs::File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
        };
        let child = {
            let mut c = alloctramp();
            c.args(["report", "--format", format, "--all-columns"]).arg(file);
            c.stdout(std::process::Stdio::from(write)).stderr(std::process::Stdio::piped());
            c.spawn().unwrap()
        };
        let mut first = [0u8; 10];
        std::io::Read::read_exact(&mut &read, &mut first).unwrap();
        drop(read);
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{format}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(o.stderr.is_empty(), "{format}: {}", String::from_utf8_lossy(&o.stderr));
    }
}
