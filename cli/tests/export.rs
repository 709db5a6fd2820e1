//! Profiles in the formats people already collect, checked by the tools
//! that read them: `go tool pprof` on `report --format pprof` files
//! (golang-go is installed when missing), and the kernel's newer
//! `/proc/allocinfo` layout.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, only_counters_file, report};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// (source file name, line) -> a figure.
type ByLine = BTreeMap<(String, u32), i128>;

/// `go tool pprof -top -lines` of a file or URL for one sample type:
/// flat and cumulative bytes per source line.
fn pprof_top(target: &str, sample_index: &str, home: &Path) -> (ByLine, ByLine) {
    let o = Command::new("go")
        .args(["tool", "pprof", "-top", "-lines", "-unit=B", "-nodecount=100000", "-nodefraction=0"])
        .arg("-edgefraction=0")
        .arg(format!("-sample_index={sample_index}"))
        .arg(target)
        .env("HOME", home)
        .env("PPROF_TMPDIR", home)
        .output()
        .expect("run go tool pprof");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "go tool pprof {target}: {}\n{out}", String::from_utf8_lossy(&o.stderr));
    let (mut flat, mut cum) = (ByLine::new(), ByLine::new());
    let bytes = |s: &str| -> i128 { s.trim_end_matches('B').parse().unwrap_or_else(|_| panic!("a size: {s}\n{out}")) };
    for l in out.lines().skip_while(|l| !l.trim_start().starts_with("flat")).skip(1) {
        // `... function file:line`, `(inline)` after an inlined function.
        let w: Vec<&str> = l.split_whitespace().filter(|&x| x != "(inline)").collect();
        let Some((file, line)) = w.last().and_then(|x| x.rsplit_once(':')) else { continue };
        let Ok(line) = line.parse::<u32>() else { continue };
        let key = (base(file).to_string(), line);
        *flat.entry(key.clone()).or_default() += bytes(w[0]);
        *cum.entry(key).or_default() += bytes(w[3]);
    }
    flat.retain(|_, v| *v != 0);
    (flat, cum)
}

/// A report's figure per source line (sites that allocate; lines without
/// a figure left out).
fn report_by_line(doc: &Value, figure: &str) -> ByLine {
    let mut m = ByLine::new();
    for s in doc["sites"].as_array().unwrap() {
        if s["kind"] == "free" {
            continue;
        }
        let key = (base(s["file"].as_str().unwrap_or("?")).to_string(), s["line"].as_u64().unwrap_or(0) as u32);
        *m.entry(key).or_default() += s[figure].as_i64().unwrap() as i128;
    }
    m.retain(|_, v| *v != 0);
    m
}

/// `live`'s and `liblive.so`'s markers: (file, line) -> (bytes, live
/// bytes).
fn live_markers() -> BTreeMap<(String, u32), (i128, i128)> {
    let mut m = BTreeMap::new();
    for p in [program("live"), program("liblive")] {
        for mk in p.markers.iter().filter(|mk| mk.entry != "free") {
            let e: &mut (i128, i128) = m.entry((mk.file.clone(), mk.line)).or_default();
            e.0 += mk.bytes as i128;
            e.1 += mk.live.map_or(0, |l| l.1 as i128);
        }
    }
    m
}

/// `report --format pprof -o FILE` of `testbins/live.c` (and
/// `liblive.so`) run to its end: `go tool pprof` gives every marked
/// site's `file:line` exactly the report's live bytes (inuse_space) and
/// bytes (alloc_space), which are the markers'; nothing else has a
/// figure.
#[test]
fn pprof_file_shows_the_report_figures_at_every_marked_site() {
    ensure_tool("go", "golang-go");
    let b = built(Config::default_o2());
    let dir = scratch("export-pprof-live");
    for name in ["live", "liblive"] {
        patch_to(&b.path(name), &dir.join(&program(name).output), &[OWN]);
    }
    let counters = counters_dir("export-pprof-live");
    let env = [
        ("ALLOCTRAMP", "on"),
        ("ALLOCTRAMP_DIR", counters.to_str().unwrap()),
        ("LD_LIBRARY_PATH", dir.to_str().unwrap()),
    ];
    let (_, err, code) = run_program(&dir.join("live"), &program("live").run, &env);
    assert_eq!(code, 0, "{err}");
    let file = only_counters_file(&counters);
    let doc = report(file.to_str().unwrap(), &counters);
    let profile = dir.join("heap.pb.gz");
    let o = alloctramp().arg("report").arg(&file).args(["--format", "pprof", "-o"]).arg(&profile).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(&std::fs::read(&profile).unwrap()[..2], b"\x1f\x8b", "gzipped");

    let markers = live_markers();
    let target = profile.to_str().unwrap();
    let (inuse, _) = pprof_top(target, "inuse_space", &dir);
    let (alloc, _) = pprof_top(target, "alloc_space", &dir);
    assert_eq!(inuse, report_by_line(&doc, "live_bytes"), "inuse_space per line is the report's live bytes");
    assert_eq!(alloc, report_by_line(&doc, "bytes"), "alloc_space per line is the report's bytes");
    for (key, &(bytes, live)) in &markers {
        assert_eq!(inuse.get(key).copied().unwrap_or(0), live, "{key:?}: inuse_space is the marker's live bytes");
        assert_eq!(alloc.get(key).copied().unwrap_or(0), bytes, "{key:?}: alloc_space is the marker's bytes");
    }
    assert!(inuse.len() >= 4 && alloc.len() >= 8, "the marked sites have figures: {inuse:?} {alloc:?}");

    // Written atomically: a failure leaves no file, and bad input is one
    // line with status 2.
    let bad = alloctramp()
        .args(["report", "--format", "pprof", "-o"])
        .arg(dir.join("none.pb.gz"))
        .arg(dir.join("no-such.counters"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(String::from_utf8_lossy(&bad.stderr).lines().count(), 1);
    assert!(!dir.join("none.pb.gz").exists());
    let grouped = alloctramp()
        .arg("report")
        .arg(&file)
        .args(["--format", "pprof", "--group-by", "module", "-o"])
        .arg(&profile)
        .output()
        .unwrap();
    assert_eq!(grouped.status.code(), Some(2), "pprof has one location per site");
    assert!(String::from_utf8_lossy(&grouped.stderr).contains("--group-by is for the other formats"));
}

/// `@frame NAME` lines of callers.c.
fn frame_lines() -> BTreeMap<String, u32> {
    let src = std::fs::read_to_string(testbins_dir().join("callers.c")).unwrap();
    let mut m = BTreeMap::new();
    for (i, l) in src.lines().enumerate() {
        if let Some(at) = l.find("/* @frame ") {
            m.insert(l[at + 10..].split_whitespace().next().unwrap().to_string(), i as u32 + 1);
        }
    }
    m
}

/// With callers capture, the profile's stacks are the recorded chains:
/// `go tool pprof` gives each `@frame` line of `testbins/callers.c` the
/// bytes of the chains through it (cumulative), and the malloc site all
/// of them (flat).
#[test]
fn pprof_stacks_are_the_recorded_call_chains() {
    ensure_tool("go", "golang-go");
    let b = built(Config::default_o2());
    let dir = scratch("export-pprof-callers");
    let bin = dir.join("callers");
    patch_to(&b.path("callers"), &bin, &[]);
    let counters = counters_dir("export-pprof-callers");
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
    assert_eq!(run_program(&bin, &[], &env).2, 0);
    let file = only_counters_file(&counters);
    let profile = dir.join("callers.pb.gz");
    let o = alloctramp().arg("report").arg(&file).args(["--format", "pprof", "-o"]).arg(&profile).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (flat, cum) = pprof_top(profile.to_str().unwrap(), "alloc_space", &dir);
    let site = program("callers").markers.iter().find(|m| m.entry == "malloc").unwrap();
    let key = |line: u32| ("callers.c".to_string(), line);
    assert_eq!(flat.get(&key(site.line)).copied(), Some(256), "the site: {flat:?}");
    assert_eq!(flat.len(), 1, "only the site has flat bytes: {flat:?}");
    let l = frame_lines();
    for (frame, bytes) in [("a", 96), ("b", 160), ("main1", 48), ("main2", 160), ("main3", 48)] {
        assert_eq!(cum.get(&key(l[frame])).copied(), Some(bytes), "@frame {frame}: {cum:?}");
    }
}

/// The kernel's newer layout behind an option: `allocinfo - version:
/// 2.0`, and `accurate:no` on every row when live tracking was off.
#[test]
fn allocinfo_version_2() {
    let b = built(Config::default_o2());
    let dir = scratch("export-allocinfo2");
    let bin = dir.join("basic");
    patch_to(&b.path("basic"), &bin, &[OWN]);
    for (live, accurate) in [("1", ""), ("0", " accurate:no")] {
        let counters = counters_dir(&format!("export-allocinfo2-{live}"));
        let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_LIVE", live), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
        assert_eq!(run_program(&bin, &[], &env).2, 0);
        let file = only_counters_file(&counters);
        let v1 = alloctramp().args(["report", "-q"]).arg(&file).output().unwrap();
        let v2 = alloctramp().args(["report", "-q", "--allocinfo-version", "2"]).arg(&file).output().unwrap();
        assert!(v2.status.success());
        let (v1, v2) = (String::from_utf8_lossy(&v1.stdout), String::from_utf8_lossy(&v2.stdout));
        assert!(v2.starts_with("allocinfo - version: 2.0\n#     <size>  <calls> <tag info>\n"), "{v2}");
        let rows1: Vec<&str> = v1.lines().skip(2).collect();
        let rows2: Vec<String> = v2.lines().skip(2).map(str::to_string).collect();
        assert_eq!(rows2.len(), rows1.len());
        assert!(!rows1.is_empty());
        for (r1, r2) in rows1.iter().zip(&rows2) {
            assert_eq!(*r2, format!("{r1}{accurate}"), "live={live}");
        }
    }
}

/// A C program whose malloc is inlined into its caller (built here at
/// -O2): it allocates, then waits for its stdin to close.
const INLINED: &str = r#"#include <stdio.h>
#include <stdlib.h>
static void *keep[8];
static inline __attribute__((always_inline)) void *grab(size_t n)
{
    return malloc(n); /* @leaf */
}
__attribute__((noinline)) void fill(void)
{
    for (int i = 0; i < 4; i++)
        keep[i] = grab(100 + i); /* @caller */
}
int main(void)
{
    fill();
    puts("ready");
    fflush(stdout);
    while (getchar() != EOF)
        ;
    return keep[3] == 0;
}
"#;

/// A site in an inlined function is one location with two lines, the
/// inlined function's first (as pprof expects): `go tool pprof` gives
/// the malloc's line the bytes (flat) and the line that calls the inlined
/// function the same bytes (cumulative), and the function `grab` its
/// flat bytes though it has no symbol of its own. The module's file is
/// found from the running process's mappings.
#[test]
fn pprof_locations_have_the_inlined_lines() {
    ensure_tool("go", "golang-go");
    let dir = scratch("export-pprof-inlined");
    let src = dir.join("inlined.c");
    std::fs::write(&src, INLINED).unwrap();
    let exe = dir.join("inlined");
    let cc =
        Command::new("gcc").args(["-g", "-O2", "-Wall", "-Werror"]).arg(&src).arg("-o").arg(&exe).output().unwrap();
    assert!(cc.status.success(), "{}", String::from_utf8_lossy(&cc.stderr));
    let bin = dir.join("inlined.patched");
    patch_to(&exe, &bin, &[OWN]);
    let line = |mark: &str| INLINED.lines().position(|l| l.contains(mark)).unwrap() as u32 + 1;
    let counters = counters_dir("export-pprof-inlined");
    let mut t = Talk::start(&bin, &[], &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())]);
    assert_eq!(t.line().trim(), "ready");
    let pid = t.child.id().to_string();
    let doc = report(&pid, &counters);
    let site = &doc["sites"].as_array().unwrap().iter().find(|s| s["entry"] == "malloc").unwrap().clone();
    assert_eq!((site["line"].as_u64(), site["function"].as_str()), (Some(line("@leaf") as u64), Some("fill")));
    let profile = dir.join("inlined.pb.gz");
    let o = alloctramp()
        .args(["report", "--dir"])
        .arg(&counters)
        .arg(&pid)
        .args(["--format", "pprof", "-o"])
        .arg(&profile)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    drop(t.child.stdin.take());
    assert_eq!(t.finish().1, Some(0));

    let (flat, cum) = pprof_top(profile.to_str().unwrap(), "inuse_space", &dir);
    let key = |mark| ("inlined.c".to_string(), line(mark));
    assert_eq!(flat.get(&key("@leaf")), Some(&406), "the malloc's line: {flat:?}");
    assert_eq!(cum.get(&key("@caller")), Some(&406), "the inlined function's caller: {cum:?}");
    let o = Command::new("go")
        .args(["tool", "pprof", "-top", "-unit=B", "-sample_index=alloc_space"])
        .arg(&profile)
        .env("HOME", &dir)
        .output()
        .unwrap();
    let top = String::from_utf8_lossy(&o.stdout);
    let grab = top.lines().find(|l| l.trim_end().ends_with(" grab (inline)")).unwrap_or_else(|| panic!("grab: {top}"));
    assert!(grab.trim_start().starts_with("406B "), "{grab}");
}
