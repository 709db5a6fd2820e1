//! Profiles and metrics in the formats people already collect, checked by
//! the tools that read them, run for real on loopback: `go tool pprof` on
//! `report --format pprof` files and on `serve`'s `/debug/pprof/heap`,
//! `promtool check metrics` on `/metrics`, and a Prometheus server that
//! scrapes `serve` every second while a process exits and a counters file
//! is corrupt. The tools are installed (golang-go, prometheus) when
//! missing.

use crate::patch::patch_to;
use crate::runtime::{Server, counters_dir, only_counters_file, report};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
    // To stdout when it is not a terminal.
    let piped = alloctramp().arg("report").arg(&file).args(["--format", "pprof"]).output().unwrap();
    assert!(piped.status.success() && piped.stdout.starts_with(b"\x1f\x8b"), "a profile on a pipe");

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

/// A child process killed when the test ends, however it ends.
pub struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `alloctramp serve --listen 127.0.0.1:0` on `dir`: the process, its
/// port, and the lines it logs (collected by a thread).
pub fn start_serve(dir: &Path, extra: &[&str]) -> (Killed, u16, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let mut child = alloctramp()
        .args(["serve", "--listen", "127.0.0.1:0", "--dir"])
        .arg(dir)
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    let port: u16 = first
        .split("http://127.0.0.1:")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("serve says where it listens: {first}"));
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let l = log.clone();
    std::thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    (Killed(child), port, log)
}

/// Runs `promtool check metrics` on a scrape.
fn promtool_check(body: &[u8]) {
    use std::io::Write;
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(body).unwrap();
    let o = p.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "promtool check metrics: {}{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(body)
    );
}

/// A PromQL query through Prometheus' HTTP API: its result vector.
fn promql(port: u16, query: &str) -> Vec<Value> {
    let (status, _, body) = http_get(port, &format!("/api/v1/query?query={}", url_encode(query)), None);
    assert_eq!(status, 200, "{query}: {}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// Live bytes per (file, line) of one process, from a PromQL answer.
fn series_by_line(result: &[Value]) -> ByLine {
    let mut m = ByLine::new();
    for r in result {
        let file = base(r["metric"]["file"].as_str().unwrap_or("?")).to_string();
        let line = r["metric"]["line"].as_str().and_then(|l| l.parse().ok()).unwrap_or(0);
        let v: f64 = r["value"][1].as_str().unwrap().parse().unwrap();
        *m.entry((file, line)).or_default() += v as i128;
    }
    m.retain(|_, v| *v != 0);
    m
}

/// Waits until `f` gives Some, for up to `secs` seconds.
fn wait_for<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `serve` for real, with a patched `server` (testbins/server.c) after two
/// rounds, a second one that exits between scrapes, and a corrupt
/// counters file in the directory:
/// - `/metrics` passes `promtool check metrics` (both formats it offers);
/// - `go tool pprof` over HTTP (`/debug/pprof/heap?pid=PID`) gives every
///   site's line the report's live and total bytes;
/// - a Prometheus server scraping every second answers a PromQL query for
///   the process's live bytes with the report's figure at every site (and
///   the marked malloc's 2 x 500 bytes), keeps scraping (`up` 1, no
///   error) after the second process exits, and the corrupt file is
///   logged once.
#[test]
fn serve_for_pprof_and_prometheus_through_exits_and_bad_files() {
    ensure_tool("go", "golang-go");
    ensure_tool("promtool", "prometheus");
    ensure_tool("prometheus", "prometheus");
    let mut a = Server::start("export-serve", &[("ALLOCTRAMP", "on")]);
    let dir = a.dir.clone();
    assert_eq!(a.cmd("round"), "done");
    assert_eq!(a.cmd("round"), "done");
    std::fs::write(dir.join("4000000.counters"), vec![0x5a; 8192]).unwrap();
    let doc = report(&a.pid(), &dir);
    let want_live = report_by_line(&doc, "live_bytes");
    let malloc = program("server").markers.iter().find(|m| m.entry == "malloc").unwrap();
    assert_eq!(want_live.get(&("server.c".to_string(), malloc.line)), Some(&1000), "5 x 100 bytes kept per round");

    let (_serve, port, log) = start_serve(&dir, &[]);
    // /metrics, as curl and promtool get it, and as OpenMetrics.
    let (status, head, body) = http_get(port, "/metrics", None);
    assert_eq!(status, 200);
    assert!(head.contains("content-type: text/plain; version=0.0.4"), "{head}");
    promtool_check(&body);
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("alloctramp_unreadable_files 1\n"), "{text}");
    let (_, head, om) = http_get(port, "/metrics", Some("application/openmetrics-text;version=1.0.0"));
    assert!(head.contains("content-type: application/openmetrics-text"), "{head}");
    let om = String::from_utf8_lossy(&om);
    assert!(om.ends_with("# EOF\n") && om.contains("# TYPE alloctramp_calls counter\n"), "{om}");
    let marked =
        format!("alloctramp_live_bytes{{pid=\"{}\",command=\"{}\",", a.pid(), doc["command"].as_str().unwrap());
    let marked_line = format!(",line=\"{}\"}} 1000", malloc.line);
    assert!(om.lines().any(|l| l.starts_with(&marked) && l.ends_with(&marked_line)), "{marked}..{marked_line}: {om}");

    // The index links each process's profile.
    let (_, _, index) = http_get(port, "/", None);
    let index = String::from_utf8_lossy(&index);
    assert!(index.contains(&format!("/debug/pprof/heap?pid={}", a.pid())), "{index}");

    // go tool pprof over HTTP.
    let home = scratch("export-serve-home");
    let url = format!("http://127.0.0.1:{port}/debug/pprof/heap?pid={}", a.pid());
    let by_command = format!("http://127.0.0.1:{port}/debug/pprof/heap?command=server.bin");
    let (inuse, _) = pprof_top(&url, "inuse_space", &home);
    assert_eq!(inuse, want_live, "inuse_space over HTTP");
    let (alloc, _) = pprof_top(&by_command, "alloc_space", &home);
    assert_eq!(alloc, report_by_line(&doc, "bytes"), "alloc_space over HTTP (by command, as scrapers ask)");
    let (status, _, _) = http_get(port, "/debug/pprof/heap?pid=1", None);
    assert_eq!(status, 404, "not a process of ours running patched code");

    // Prometheus, scraping every second.
    let pdir = scratch("export-prometheus");
    let pport = free_port();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: alloctramp\n    \
         static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
    );
    std::fs::write(pdir.join("prometheus.yml"), config).unwrap();
    let prom = Command::new("prometheus")
        .arg(format!("--config.file={}", pdir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", pdir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{pport}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(pdir.join("prometheus.log")).unwrap())
        .spawn()
        .unwrap();
    let _prom = Killed(prom);
    let pid = a.pid();
    let query = format!("alloctramp_live_bytes{{job=\"alloctramp\",pid=\"{pid}\"}}");
    let got = wait_for(60, "Prometheus to have scraped the live bytes", || {
        let r = std::panic::catch_unwind(|| series_by_line(&promql(pport, &query))).ok()?;
        (r == want_live).then_some(r)
    });
    assert_eq!(got.get(&("server.c".to_string(), malloc.line)), Some(&1000));

    // A second process appears, then exits between scrapes.
    let b_env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())];
    let mut b = Server::start("export-serve-b", &b_env);
    assert_eq!(b.cmd("round"), "done");
    let bpid = b.pid();
    let on_b = format!("alloctramp_profiling_on{{pid=\"{bpid}\"}}");
    wait_for(30, "the second process in Prometheus", || (!promql(pport, &on_b).is_empty()).then_some(()));
    b.quit();
    let exited = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    // Scrapes after the exit succeed: `up` is 1 at a time after it.
    wait_for(30, "a scrape after the exit", || {
        let r = promql(pport, "timestamp(up{job=\"alloctramp\"}) and up{job=\"alloctramp\"} == 1");
        let t: f64 = r.first()?["value"][1].as_str()?.parse().ok()?;
        (t > exited + 1.0).then_some(())
    });
    let targets: Value = serde_json::from_slice(&http_get(pport, "/api/v1/targets", None).2).unwrap();
    let t = &targets["data"]["activeTargets"][0];
    assert_eq!((t["health"].as_str(), t["lastError"].as_str()), (Some("up"), Some("")), "{t}");
    assert_eq!(series_by_line(&promql(pport, &query)), want_live, "the first process's series go on");
    let (_, _, now) = http_get(port, "/metrics", None);
    assert!(!String::from_utf8_lossy(&now).contains(&format!("pid=\"{bpid}\"")), "an exited process is gone");
    let bad: Vec<String> = log.lock().unwrap().iter().filter(|l| l.contains("4000000.counters")).cloned().collect();
    assert_eq!(bad.len(), 1, "the corrupt file is logged once: {bad:?}");
    a.quit();
}

/// `serve` with an address it cannot listen on: one line, status 2.
#[test]
fn serve_refuses_a_bad_address_in_one_line() {
    for addr in ["nonsense", "127.0.0.1:99999"] {
        let o = alloctramp().args(["serve", "--listen", addr]).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{addr}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with(&format!("alloctramp: --listen {addr}: cannot listen")), "{err}");
    }
}

/// `serve --group-by function` bounds the series: no `file` or `line`
/// label, one series per function of each process.
#[test]
fn serve_groups_series_by_function() {
    ensure_tool("promtool", "prometheus");
    let mut a = Server::start("export-serve-grouped", &[("ALLOCTRAMP", "on")]);
    assert_eq!(a.cmd("round"), "done");
    let (_serve, port, _) = start_serve(&a.dir, &["--group-by", "function"]);
    let (_, _, body) = http_get(port, "/metrics", None);
    promtool_check(&body);
    let text = String::from_utf8_lossy(&body).into_owned();
    let live: Vec<&str> = text.lines().filter(|l| l.starts_with("alloctramp_live_bytes{")).collect();
    assert!(!live.is_empty() && live.iter().all(|l| !l.contains("line=") && !l.contains("file=")), "{text}");
    let doc = report(&a.pid(), &a.dir);
    let mut by_function: BTreeMap<String, i64> = BTreeMap::new();
    for s in doc["sites"].as_array().unwrap().iter().filter(|s| s["kind"] != "free") {
        *by_function.entry(s["function"].as_str().unwrap().to_string()).or_default() +=
            s["live_bytes"].as_i64().unwrap();
    }
    assert_eq!(live.len(), by_function.len(), "one series per function: {live:?}");
    for (f, v) in by_function {
        assert!(
            live.iter().any(|l| l.contains(&format!("function=\"{f}\"")) && l.ends_with(&format!(" {v}"))),
            "{f} {v}: {live:?}"
        );
    }
    a.quit();
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
/// found from the running process's mappings, and, in the file the
/// process left, from its command.
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
    // The file the process left: its module's file is found by its command
    // (the same build id).
    let left = dir.join("inlined-exited.pb.gz");
    let file = only_counters_file(&counters);
    let o = alloctramp().arg("report").arg(&file).args(["--format", "pprof", "-o"]).arg(&left).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let key = |mark| ("inlined.c".to_string(), line(mark));
    for p in [&profile, &left] {
        let (flat, cum) = pprof_top(p.to_str().unwrap(), "inuse_space", &dir);
        assert_eq!(flat.get(&key("@leaf")), Some(&406), "{}: the malloc's line: {flat:?}", p.display());
        assert_eq!(cum.get(&key("@caller")), Some(&406), "{}: the inlined function's caller: {cum:?}", p.display());
    }
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

/// `run --format pprof` needs `-o FILE` (a binary profile is not for the
/// terminal), refused in one line before the program runs; with it, the
/// profile has every site (no default cut to 20 rows).
#[test]
fn run_writes_a_pprof_profile_only_to_a_file() {
    ensure_tool("go", "golang-go");
    let b = built(Config::default_o2());
    let dir = scratch("export-run-pprof");
    let marker = dir.join("ran");
    let o = alloctramp()
        .args(["run", "--on", "--format", "pprof", "--cache"])
        .arg(dir.join("cache"))
        .args(["--", "sh", "-c"])
        .arg(format!("touch {}", marker.display()))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("give -o FILE"), "{err}");
    assert!(!marker.exists(), "the program did not run");

    let profile = dir.join("callers.pb.gz");
    let counters = counters_dir("export-run-pprof");
    let o = alloctramp()
        .args(["run", "--on", "--format", "pprof", "-o"])
        .arg(&profile)
        .arg("--cache")
        .arg(dir.join("cache"))
        .arg("--")
        .arg(b.path("callers"))
        .env("ALLOCTRAMP_DIR", &counters)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (_, alloc) = pprof_top(profile.to_str().unwrap(), "alloc_space", &dir);
    let doc = report(only_counters_file(&counters).to_str().unwrap(), &counters);
    let want = report_by_line(&doc, "bytes");
    assert!(!want.is_empty());
    for (key, bytes) in &want {
        assert_eq!(alloc.get(key), Some(bytes), "{key:?}: {alloc:?}");
    }
}
