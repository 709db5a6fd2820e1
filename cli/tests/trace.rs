//! Event traces: `alloctramp trace PID` on a running process and `run
//! --trace` from the start write CTF traces that babeltrace2 reads; every
//! event is in the trace or counted lost.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, live_figures};
use crate::util::*;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

/// The line of the site marked `NAME */` in testbins/trace/pairs.c.
fn line_of(name: &str) -> u32 {
    mark_line("trace/pairs.c", name)
}

/// The line of the site marked `NAME */` in testbins/REL.
fn mark_line(rel: &str, name: &str) -> u32 {
    let text = std::fs::read_to_string(testbins_dir().join(rel)).unwrap();
    let tag = format!(" {name} */");
    let lines: Vec<usize> =
        text.lines().enumerate().filter(|(_, l)| l.contains("@site") && l.contains(&tag)).map(|(i, _)| i + 1).collect();
    assert_eq!(lines.len(), 1, "one {tag}");
    lines[0] as u32
}

/// An event as babeltrace2 prints it: its name and fields.
type Event = (String, HashMap<String, String>);

/// `babeltrace2 DIR`: its events and what it said on stderr.
fn babeltrace(dir: &Path) -> (Vec<Event>, String) {
    ensure_tool("babeltrace2", "babeltrace2");
    let o = Command::new("babeltrace2").arg("--clock-cycles").arg(dir).output().unwrap();
    assert!(o.status.success(), "babeltrace2 {}: {}", dir.display(), String::from_utf8_lossy(&o.stderr));
    let mut events = Vec::new();
    for l in String::from_utf8_lossy(&o.stdout).lines() {
        // [cycles] (+delta) procname NAME: { tid = N }, { f = v, ... }
        let Some((head, body)) = l.split_once(": { ") else { panic!("an event line: {l}") };
        let name = head.rsplit(' ').next().unwrap().to_string();
        let mut fields: HashMap<String, String> = body
            .split(", ")
            .flat_map(|kv| kv.trim_matches(|c| c == '{' || c == '}' || c == ' ').split_once(" = "))
            .map(|(k, v)| (k.trim_start_matches("{ ").to_string(), v.trim_matches('"').to_string()))
            .collect();
        let cycles = head.strip_prefix('[').and_then(|h| h.split_once(']')).expect("[cycles]").0;
        fields.insert("time".into(), cycles.to_string());
        events.push((name, fields));
    }
    (events, String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The site ids the trace's `site` events give the lines of pairs.c.
fn sites_by_line(events: &[Event]) -> HashMap<u32, String> {
    sites_of(events, "trace/pairs.c")
}

/// The site ids the trace's `site` events give the lines of testbins/REL.
fn sites_of(events: &[Event], rel: &str) -> HashMap<u32, String> {
    events
        .iter()
        .filter(|(n, f)| n == "site" && f["file"].ends_with(rel))
        .map(|(_, f)| (f["line"].parse().unwrap(), f["site"].clone()))
        .collect()
}

/// testbins/trace/pairs.c built and patched in the scratch directory
/// `name`, started with its own counters directory and `ALLOCTRAMP_TRACE`
/// set to `trace` (unless empty), once it said "ready": (scratch
/// directory, counters directory, process).
fn start_pairs(name: &str, trace: &str) -> (std::path::PathBuf, std::path::PathBuf, Talk) {
    let dir = scratch(name);
    let counters = counters_dir(name);
    let bin = build_source("trace/pairs.c", &dir);
    let patched = dir.join("pairs.patched");
    patch_to(&bin, &patched, &[]);
    let mut env = vec![("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
    if !trace.is_empty() {
        env.push(("ALLOCTRAMP_TRACE", trace));
    }
    let mut p = Talk::start(&patched, &[], &env);
    assert_eq!(p.line(), "ready\n");
    (dir, counters, p)
}

#[test]
fn trace_of_a_running_process_holds_its_1000_pairs_exactly() {
    let (dir, counters, mut p) = start_pairs("trace-pairs", "");
    let out = dir.join("trace");
    let rest = traced(&mut p, &counters, &out, &[], &["go 1000", "realloc", "keep 5", "grow"]);
    assert!(rest.contains("no event lost"), "{rest}");
    // The process goes on untraced, profiling off again.
    p.send("go 10");
    assert_eq!(p.line(), "done\n");
    drop(p.child.stdin.take());
    assert_eq!(p.finish(), (String::new(), Some(0)));

    let (events, warnings) = babeltrace(&out);
    assert_eq!(warnings, "", "babeltrace2 reads the trace without a warning");
    let sites = sites_by_line(&events);
    let [a, f, r0, r1, r2, r3] = ["A", "F", "R0", "R1", "R2", "R3"].map(|n| sites[&line_of(n)].clone());
    let count = |name: &str, k: &str, v: &str| events.iter().filter(|(n, f)| n == name && f[k] == v).count();
    assert_eq!(count("alloc", "site", &a), 1000);
    assert!(events.iter().filter(|(n, f)| n == "alloc" && f["site"] == a).all(|(_, f)| f["size"] == "48"));
    assert_eq!(count("free", "alloc_site", &a), 1000);
    assert_eq!(count("free", "site", &f), 1000);
    // Every pointer allocated at A is freed at F once.
    let mut at_a: Vec<&String> =
        events.iter().filter(|(n, f)| n == "alloc" && f["site"] == a).map(|(_, f)| &f["ptr"]).collect();
    let mut freed: Vec<&String> =
        events.iter().filter(|(n, f)| n == "free" && f["alloc_site"] == a).map(|(_, f)| &f["ptr"]).collect();
    at_a.sort();
    freed.sort();
    assert_eq!(at_a, freed);
    // The realloc chain: R0's object grown at R1, then at R2, freed at R3.
    let reallocs: Vec<&HashMap<String, String>> =
        events.iter().filter(|(n, _)| n == "realloc").map(|(_, f)| f).collect();
    assert_eq!(reallocs.len(), 3);
    let pick =
        |f: &HashMap<String, String>| [&f["site"], &f["alloc_site"], &f["size"], &f["old_size"]].map(|s| s.to_string());
    assert_eq!(pick(reallocs[0]), [r1.clone(), r0.clone(), "100".into(), "10".into()]);
    assert_eq!(pick(reallocs[1]), [r2.clone(), r1, "5000".into(), "100".into()]);
    assert_eq!(reallocs[1]["ptr"], count_free_ptr(&events, &r3, &r2));
    // A buffer no site allocated (the C library's, before the trace): its
    // pointer is named, its site and size are not known.
    let g = sites[&line_of("G")].clone();
    assert_eq!(pick(reallocs[2]), [g, "0".into(), "4096".into(), "0".into()]);
    assert!(reallocs[2]["old_ptr"] != "0x0" && reallocs[2]["old_ptr"] != reallocs[2]["ptr"], "{:?}", reallocs[2]);
    // Nothing else: 1,006 allocations, 1,001 frees, 3 reallocs.
    let kinds = |n: &str| events.iter().filter(|(k, _)| k == n).count();
    assert_eq!((kinds("alloc"), kinds("free"), kinds("realloc")), (1006, 1001, 3));
    // The site's description names its file and line.
    let desc = &events.iter().find(|(n, f)| n == "site" && f["site"] == a).unwrap().1;
    assert_eq!((desc["function"].as_str(), desc["module"].as_str()), ("main", "pairs"));

    // The analysis: A's 1,000 objects all freed (the last one before any
    // other allocation: temporary), K's 5 still live, the peak A's 48,000
    // bytes; and a timeline of them.
    let svg = dir.join("live.svg");
    let o = alloctramp().arg("analyze").arg(&out).args(["--format", "json", "--svg"]).arg(&svg).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((doc["format"].as_str(), doc["version"].as_u64()), (Some("alloctramp-analysis"), Some(1)));
    assert_eq!((doc["events"].as_u64(), doc["peak_bytes"].as_u64()), (Some(2010), Some(48_000)));
    let row = |line: u32| {
        doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["line"] == line)
            .unwrap_or_else(|| panic!("line {line}"))
            .clone()
    };
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    let a_row = row(line_of("A"));
    let got = ["allocations", "bytes", "freed", "live_objects", "temporary", "bytes_at_peak"].map(|k| n(&a_row, k));
    assert_eq!(got, [1000, 48_000, 1000, 0, 1, 48_000]);
    let life = &a_row["lifetime_ns"];
    assert!(n(life, "median") <= n(life, "p90") && n(life, "p90") <= n(life, "max") && n(life, "median") > 0);
    let k_row = row(line_of("K"));
    assert_eq!(["allocations", "live_objects", "live_bytes", "freed"].map(|k| n(&k_row, k)), [5, 5, 320, 0]);
    assert!(k_row["lifetime_ns"].is_null());
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
    assert!(svg.matches("<polyline").count() >= 2, "the total and A");
    assert!(svg.contains("pairs.c:21") || svg.contains(&format!("pairs.c:{}", line_of("A"))));

    // Bad input: one line and status 2.
    std::fs::write(out.join("thread-1"), [b'x'; 100]).unwrap();
    let o = alloctramp().arg("analyze").arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("thread-1: offset 0x0: no CTF magic"), "{err}");
}

/// `alloctramp trace` of the running `p` into `out` (with `extra`
/// arguments) while `p` carries out `commands`, ended by Ctrl-C: what the
/// tracer said after its first line.
fn traced(p: &mut Talk, counters: &Path, out: &Path, extra: &[&str], commands: &[&str]) -> String {
    let (mut tracer, mut err, first) = start_tracer(p, counters, out, extra);
    if extra.is_empty() {
        assert!(first.contains("profiling switched on for the trace"), "{first}");
    }
    for c in commands {
        p.send(c);
        assert_eq!(p.line(), "done\n");
    }
    // SAFETY: kill(2) on the tracer's pid.
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert!(tracer.wait().unwrap().success(), "{rest}");
    rest
}

#[test]
fn trace_site_records_only_the_sites_it_names_and_the_frees_of_their_objects() {
    let (dir, counters, mut p) = start_pairs("trace-site", "");
    let out = dir.join("trace");
    let a = format!("pairs.c:{}", line_of("A"));
    traced(&mut p, &counters, &out, &["--site", &a], &["go 100", "keep 4", "realloc"]);
    let (events, warnings) = babeltrace(&out);
    assert_eq!(warnings, "");
    let sites = sites_by_line(&events);
    let (sa, sf) = (sites[&line_of("A")].clone(), sites[&line_of("F")].clone());
    let kinds: Vec<(&str, &str)> =
        events.iter().filter(|(n, _)| n != "site").map(|(n, f)| (n.as_str(), f["site"].as_str())).collect();
    // A's 100 allocations and their 100 frees at F; nothing of K or R.
    assert_eq!(kinds.len(), 200, "{kinds:?}");
    assert!(kinds.iter().all(|&(n, s)| (n, s) == ("alloc", sa.as_str()) || (n, s) == ("free", sf.as_str())));
    // Every site is still described.
    assert_eq!(sites.len(), 8);
    // A spec that names no site: one line, status 2, no trace.
    let o = alloctramp()
        .args(["trace", &p.child.id().to_string(), "--dir", counters.to_str().unwrap(), "--site", "nosuch.c:1", "-o"])
        .arg(dir.join("none"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!((o.status.code(), err.lines().count()), (Some(2), 1), "{err}");
    assert!(err.contains("--site nosuch.c:1: no site"), "{err}");
    assert!(!dir.join("none").exists());
    drop(p.child.stdin.take());
    assert_eq!(p.finish(), (String::new(), Some(0)));
}

/// The pointer of the one free at `site` of an object from `alloc_site`.
fn count_free_ptr(events: &[Event], site: &str, alloc_site: &str) -> String {
    let v: Vec<&String> = events
        .iter()
        .filter(|(n, f)| n == "free" && f["site"] == site && f["alloc_site"] == alloc_site)
        .map(|(_, f)| &f["ptr"])
        .collect();
    assert_eq!(v.len(), 1);
    v[0].clone()
}

/// `alloctramp trace` of `p` into `out` (removed first) with `extra`
/// options, once it said it records: the command, its stderr, and that
/// first line.
fn start_tracer(
    p: &Talk,
    counters: &Path,
    out: &Path,
    extra: &[&str],
) -> (std::process::Child, BufReader<std::process::ChildStderr>, String) {
    let _ = std::fs::remove_dir_all(out);
    let pid = p.child.id().to_string();
    let mut tracer = alloctramp()
        .args(["trace", &pid, "--dir", counters.to_str().unwrap(), "-o", out.to_str().unwrap()])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(tracer.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.contains("recording events"), "{first}");
    (tracer, err, first)
}

/// What `alloctramp run --trace` of a program said and wrote.
struct TracedRun {
    /// Calls of every site, from the run's report.
    calls: u64,
    /// The run's summary: events in the trace, and events lost.
    events: u64,
    lost: u64,
    /// babeltrace2's events and warnings.
    trace: Vec<Event>,
    warnings: String,
    stdout: String,
}

/// `alloctramp run --trace` of `argv` in the scratch directory `name`,
/// with `extra` options: what it reported, checked against the trace
/// (babeltrace2 reads the events the summary says, and its "discarded"
/// warnings add up to the events lost).
fn run_traced(name: &str, extra: &[&str], argv: &[&std::ffi::OsStr]) -> TracedRun {
    let dir = scratch(name);
    let counters = counters_dir(name);
    let out = dir.join("trace");
    let _ = std::fs::remove_dir_all(&out);
    let report = dir.join("report.json");
    let o = alloctramp()
        .args(["run", "--top", "0", "--format", "json", "-o"])
        .arg(&report)
        .arg("--cache")
        .arg(dir.join("cache"))
        .arg("--trace")
        .arg(&out)
        .args(extra)
        .arg("--")
        .args(argv)
        .env("ALLOCTRAMP_DIR", &counters)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let calls: u64 = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["calls"].as_u64().unwrap_or(0) + s["free_calls"].as_u64().unwrap_or(0))
        .sum();
    // "DIR: N events in T thread streams, S sites described; L events lost" or "no event lost".
    let line = stderr.lines().find(|l| l.contains(" events in ")).expect("the trace's summary");
    let number = |after: &str| -> u64 {
        let at = line.find(after).unwrap();
        line[..at].rsplit(' ').next().unwrap().replace(',', "").parse().unwrap()
    };
    let events = number(" events in ");
    let lost = if line.contains("no event lost") { 0 } else { number(" events lost") };
    // The trace holds the events it says, and says what it lost per stream.
    let (trace, warnings) = babeltrace(&out);
    let in_trace = trace.iter().filter(|(n, _)| n != "site").count() as u64;
    assert_eq!(in_trace, events);
    let discarded: u64 = warnings
        .lines()
        .filter_map(|l| l.strip_prefix("WARNING: Tracer discarded "))
        .map(|l| l.split(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(discarded, lost, "discarded in the trace, lost in the summary: {line}");
    assert!(warnings.lines().all(|l| l.starts_with("WARNING: Tracer discarded ")), "{warnings}");
    TracedRun { calls, events, lost, trace, warnings, stdout: String::from_utf8_lossy(&o.stdout).into_owned() }
}

#[test]
fn eight_threads_traced_from_the_start_events_plus_lost_equal_calls() {
    let b = built(Config::default_o2());
    let r = run_traced("trace-stress", &[], &[b.path("live_stress").as_os_str()]);
    assert!(r.calls > 1_800_000, "{}", r.calls);
    assert_eq!(r.events + r.lost, r.calls, "{}", r.warnings);
}

/// live_waves keeps 80 threads alive at once, then 80 more: each has a
/// ring of its own (there were 64), so nothing is lost.
#[test]
fn more_than_64_threads_at_once_each_record_in_a_ring_of_their_own() {
    let b = built(Config::default_o2());
    let r = run_traced("trace-waves", &[], &[b.path("live_waves").as_os_str()]);
    assert_eq!((r.events, r.lost), (r.calls, 0), "{}", r.warnings);
    let threads: std::collections::HashSet<&String> =
        r.trace.iter().filter(|(n, _)| n != "site").filter_map(|(_, f)| f.get("tid")).collect();
    assert_eq!(threads.len(), 161, "the main thread and two waves of 80");
}

#[test]
fn events_of_a_signal_handler_that_interrupts_a_record_are_lost_and_counted_never_mixed_into_it() {
    // The handler's sites call a pool allocator named as entry points; the
    // main thread's malloc and free are recorded under it ~20,000 times a
    // second.
    let bin = build_source("trace/signals.c", &scratch("trace-signals-build"));
    let entries = ["--entry", "pool_alloc:alloc", "--entry", "pool_free:free"];
    let r = run_traced("trace-signals", &entries, &[bin.as_os_str(), "1000000".as_ref()]);
    // "passes P handled H"
    let said: Vec<u64> = r.stdout.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    let [passes, handled] = said[..] else { panic!("{}", r.stdout) };
    assert!(passes >= 1_000_000 && handled >= 2000, "{}", r.stdout);
    // Two sites' calls per pass, two per handler's run.
    assert_eq!(r.calls, 2 * passes + 2 * handled);
    assert_eq!(r.events + r.lost, r.calls, "{}", r.warnings);
    let sites = sites_of(&r.trace, "trace/signals.c");
    let id = |name: &str| sites[&mark_line("trace/signals.c", name)].clone();
    let (m, mf, s) = (id("M"), id("MF"), id("S"));
    // One thread, so one stream, in the order recorded: no event's time is
    // before the one before (a slot published unwritten and read from an
    // earlier lap would go back), and no record repeats the one before (a
    // record written twice). Two events may share a time: after the thread
    // moved to another CPU, whose time stamp counter a virtual machine may
    // keep a little behind, an event can read an earlier count than the one
    // before, and the stream writes it at the later time
    // (`trace::ctf::Stream` never goes back). The main thread's malloc and
    // free alternate,
    // but where events were lost, each free freeing what the malloc
    // returned (glibc's malloc gives the loop the same chunk every time).
    let (mut time, mut breaks, mut last, mut handler) = (0u64, 0u64, None, 0u64);
    let mut main_ptr: Option<String> = None;
    let mut before = None;
    for (n, f) in r.trace.iter().filter(|(n, _)| n != "site") {
        let t: u64 = f["time"].parse().unwrap();
        assert!(t >= time && before != Some((n, f)), "{n} {f:?} at {t}, after {before:?} at {time}");
        (time, before) = (t, Some((n, f)));
        let site = &f["site"];
        if *site == m || *site == mf {
            let kind = (n.as_str(), site == &m);
            assert!(matches!(kind, ("alloc", true) | ("free", false)), "{n} {f:?}");
            assert_eq!(main_ptr.get_or_insert_with(|| f["ptr"].clone()), &f["ptr"]);
            if *site == mf {
                assert_eq!(f["alloc_site"], m);
            }
            breaks += u64::from(last == Some(kind.1));
            last = Some(kind.1);
        } else if *site == s {
            handler += 1;
        }
    }
    assert!(breaks <= r.lost, "{breaks} pairs broken, {} events lost", r.lost);
    assert!(handler > 0 && handler <= handled);
}

/// `run --trace` records the program it starts; a program that one
/// starts inherits the environment but records nothing (nobody would
/// drain it), though it counts as usual.
#[test]
fn run_trace_records_the_program_it_starts_not_the_programs_that_one_starts() {
    let dir = scratch("trace-spawn-build");
    let bin = build_source("trace/spawn.c", &dir);
    let copy = dir.join("spawn.patched");
    patch_to(&bin, &copy, &[]);
    let r = run_traced("trace-spawn", &[], &[bin.as_os_str(), copy.as_os_str()]);
    assert_eq!(r.stdout, "child counters file: yes\nchild trace file: no\nparent done\n");
    assert_eq!((r.calls, r.events, r.lost), (20, 20, 0), "{}", r.warnings);
    let sites = sites_of(&r.trace, "trace/spawn.c");
    let (p, f) = (&sites[&mark_line("trace/spawn.c", "P")], &sites[&mark_line("trace/spawn.c", "F")]);
    let count = |name: &str, site: &str| r.trace.iter().filter(|(n, e)| n == name && e["site"] == site).count();
    assert_eq!((count("alloc", p), count("free", f)), (10, 10));
}

/// A library loaded and unloaded between two drains of a process that
/// drains its own trace: its sites are described all the same.
#[test]
fn a_library_unloaded_between_two_drains_is_described_in_the_trace() {
    let b = built(Config::default_o2());
    let dir = scratch("trace-dlclose");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    patch_to(&b.path("dlopener"), &bin.join("dlopener"), &[]);
    patch_to(&b.path("libatshared"), &bin.join("libatshared.so"), &[]);
    let counters = counters_dir("trace-dlclose");
    let out = dir.join("traces");
    let o = Command::new(bin.join("dlopener"))
        .arg(&bin)
        .env("ALLOCTRAMP_TRACE", &out)
        .env("ALLOCTRAMP_DIR", &counters)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "dlopen ok\n");
    let (events, warnings) = babeltrace(&out.join(only_process(&out)));
    assert_eq!(warnings, "");
    let described: std::collections::HashSet<&String> =
        events.iter().filter(|(n, _)| n == "site").map(|(_, f)| &f["site"]).collect();
    let in_library = events.iter().filter(|(n, f)| n == "site" && f["module"] == "libatshared.so").count();
    assert!(in_library >= 2, "the library's sites are described: {in_library}");
    let mut library_events = 0;
    for (n, f) in events.iter().filter(|(n, _)| n != "site") {
        assert!(described.contains(&f["site"]), "{n} {f:?}: its site is not described");
        if f.get("alloc_site").is_some_and(|a| a != "0") {
            assert!(described.contains(&f["alloc_site"]), "{n} {f:?}: its allocating site is not described");
        }
        library_events += usize::from(
            events.iter().any(|(m, s)| m == "site" && s["site"] == f["site"] && s["module"] == "libatshared.so"),
        );
    }
    assert!(library_events >= 6, "the library's allocations and frees are in the trace: {library_events}");
}

/// The one process directory in `out` (`ALLOCTRAMP_TRACE=DIR`).
fn only_process(out: &Path) -> String {
    let names: Vec<String> =
        std::fs::read_dir(out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names.len(), 1, "{names:?}");
    names[0].clone()
}

#[test]
fn alloctramp_trace_dir_makes_the_process_drain_its_own_trace() {
    let out = scratch("trace-env").join("traces");
    let _ = std::fs::remove_dir_all(&out);
    let (_, counters, mut p) = start_pairs("trace-env", out.to_str().unwrap());
    let pid = p.child.id();
    p.send("go 1000");
    assert_eq!(p.line(), "done\n");
    p.send("keep 3");
    assert_eq!(p.line(), "done\n");
    drop(p.child.stdin.take());
    assert_eq!(p.finish(), (String::new(), Some(0)));
    // DIR/PID, complete at exit; the process's trace file is gone.
    let trace = out.join(pid.to_string());
    let (events, warnings) = babeltrace(&trace);
    assert_eq!(warnings, "");
    let sites = sites_by_line(&events);
    let (a, k) = (sites[&line_of("A")].clone(), sites[&line_of("K")].clone());
    let count = |name: &str, key: &str, v: &str| events.iter().filter(|(n, f)| n == name && f[key] == v).count();
    assert_eq!(
        (count("alloc", "site", &a), count("free", "alloc_site", &a), count("alloc", "site", &k)),
        (1000, 1000, 3)
    );
    assert!(!counters.join(format!("{pid}.trace")).exists());
}

#[test]
fn a_trace_recorded_from_the_start_keeps_its_events_for_the_one_drainer_that_attaches() {
    let (dir, counters, mut p) = start_pairs("trace-attach", "on");
    // Recorded before any drainer exists.
    p.send("go 10");
    assert_eq!(p.line(), "done\n");
    let out = dir.join("trace");
    let pid = p.child.id().to_string();
    let (mut tracer, mut err, _) = start_tracer(&p, &counters, &out, &[]);
    // A second drainer is refused while the first runs.
    let second = dir.join("second");
    let o = alloctramp()
        .args(["trace", &pid, "--dir", counters.to_str().unwrap(), "-o", second.to_str().unwrap()])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{said}");
    assert!(said.lines().last().unwrap_or("").contains("drains this trace already"), "{said}");
    assert!(!second.exists());
    p.send("keep 2");
    assert_eq!(p.line(), "done\n");
    // SAFETY: kill(2) on the tracer's pid.
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert!(tracer.wait().unwrap().success(), "{rest}");
    drop(p.child.stdin.take());
    assert_eq!(p.finish(), (String::new(), Some(0)));
    let (events, warnings) = babeltrace(&out);
    assert_eq!(warnings, "");
    let sites = sites_by_line(&events);
    let (a, k) = (sites[&line_of("A")].clone(), sites[&line_of("K")].clone());
    let count = |name: &str, key: &str, v: &str| events.iter().filter(|(n, f)| n == name && f[key] == v).count();
    assert_eq!((count("alloc", "site", &a), count("free", "alloc_site", &a), count("alloc", "site", &k)), (10, 10, 2));
}

/// A trace of a process whose profiling is on already: its sites move to
/// their traced entries and back, and the live figures stay exact across
/// both moves, the objects of every phase counted once.
#[test]
fn a_trace_of_a_profiled_process_moves_its_sites_and_back_with_exact_figures() {
    let name = "trace-profiled";
    let dir = scratch(name);
    let counters = counters_dir(name);
    let bin = build_source("trace/pairs.c", &dir);
    let patched = dir.join("pairs.patched");
    patch_to(&bin, &patched, &[]);
    let env = [("ALLOCTRAMP_DIR", counters.to_str().unwrap()), ("ALLOCTRAMP", "on")];
    let mut p = Talk::start(&patched, &[], &env);
    assert_eq!(p.line(), "ready\n");
    let run = |p: &mut Talk, commands: &[&str]| {
        for c in commands {
            p.send(c);
            assert_eq!(p.line(), "done\n");
        }
    };
    run(&mut p, &["go 30", "keep 3"]);
    let out = dir.join("trace");
    let (mut tracer, mut err, _) = start_tracer(&p, &counters, &out, &[]);
    run(&mut p, &["go 200", "keep 2"]);
    // SAFETY: kill(2) on the tracer's pid.
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert!(tracer.wait().unwrap().success(), "{rest}");
    assert!(rest.contains("no event lost"), "{rest}");
    run(&mut p, &["go 50", "keep 1"]);
    let live = live_figures(&counters.join(format!("{}.counters", p.child.id())));
    let at = |marker: &str| live[&("pairs.c".to_string(), line_of(marker), "malloc".to_string())];
    assert_eq!(at("A"), (0, 0, 0), "every object of A freed, in and out of the trace");
    assert_eq!(at("K"), (6, 6 * 64, 0));
    assert_eq!(live[&("pairs.c".to_string(), line_of("F"), "free".to_string())].2, 0, "no free untracked");
    drop(p.child.stdin.take());
    assert_eq!(p.finish(), (String::new(), Some(0)));

    // The trace holds the events of its own phase only.
    let (events, warnings) = babeltrace(&out);
    assert_eq!(warnings, "");
    let sites = sites_by_line(&events);
    let [a, f, k] = ["A", "F", "K"].map(|n| sites[&line_of(n)].clone());
    let count = |name: &str, k: &str, v: &str| events.iter().filter(|(n, f)| n == name && f[k] == v).count();
    assert_eq!((count("alloc", "site", &a), count("alloc", "site", &k)), (200, 2));
    assert_eq!((count("free", "site", &f), count("free", "alloc_site", &a)), (200, 200));
}
