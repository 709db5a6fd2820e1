//! Fault injection: `run --fail`, `alloctramp fail PID` and `faultsweep`
//! on the programs of testbins/fault/ (built here), whose four C sites
//! either handle a failed allocation (A, B) or write through NULL (C, D),
//! and whose C++ sites catch `std::bad_alloc` (N) or check a nothrow new
//! (T).

use crate::patch::patch_to;
use crate::runtime::{counters_dir, report};
use crate::util::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;

/// The line of the site marked `/* NAME */` in testbins/fault/FILE.
fn line_of(file: &str, name: &str) -> u32 {
    let text = std::fs::read_to_string(testbins_dir().join("fault").join(file)).unwrap();
    let tag = format!("/* {name} */");
    let lines: Vec<usize> = text.lines().enumerate().filter(|(_, l)| l.contains(&tag)).map(|(i, _)| i + 1).collect();
    assert_eq!(lines.len(), 1, "one {tag} in {file}");
    lines[0] as u32
}

struct Fixture {
    dir: PathBuf,
    counters: PathBuf,
    cache: PathBuf,
    faults: PathBuf,
}

fn fixture(name: &str) -> Fixture {
    let dir = scratch(name);
    let counters = counters_dir(name);
    let faults = build_source("fault/faults.c", &dir);
    Fixture { cache: dir.join("cache"), dir, counters, faults }
}

impl Fixture {
    /// `alloctramp run` with `args`, the report as JSON in `report.json`.
    fn run(&self, args: &[&str], program: &Path, program_args: &[&str]) -> Output {
        alloctramp()
            .args(["run", "-q", "--top", "0", "--format", "json", "-o"])
            .arg(self.dir.join("report.json"))
            .arg("--cache")
            .arg(&self.cache)
            .args(args)
            .arg("--")
            .arg(program)
            .args(program_args)
            .env("ALLOCTRAMP_DIR", &self.counters)
            .output()
            .unwrap()
    }

    fn report(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.dir.join("report.json")).unwrap()).unwrap()
    }
}

/// `faults serve`, patched, started with `env` (profiling off): the
/// process, its pid and the counters directory.
fn serve(f: &Fixture, env: &[(&str, &str)]) -> (Talk, String, String) {
    let patched = f.dir.join("faults.patched");
    patch_to(&f.faults, &patched, &[]);
    let dir = f.counters.to_str().unwrap().to_string();
    let mut env = env.to_vec();
    env.push(("ALLOCTRAMP_DIR", &dir));
    let mut p = Talk::start(&patched, &["serve"], &env);
    assert_eq!(p.line(), "ready\n");
    let pid = p.child.id().to_string();
    (p, pid, dir)
}

/// One pass of `faults serve`: the lines it printed before "pass done".
fn pass(p: &mut Talk) -> Vec<String> {
    p.send("go");
    let mut lines = Vec::new();
    loop {
        let l = p.line();
        if l == "pass done\n" || l.is_empty() {
            return lines;
        }
        lines.push(l);
    }
}

/// Per line of FILE: (calls, bytes, failed, injected) of its allocation
/// sites in a report.
fn by_line(report: &Value, file: &str) -> std::collections::BTreeMap<u32, (u64, u64, u64, u64)> {
    report["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] != "free" && s["file"].as_str().is_some_and(|f| f.ends_with(file)))
        .map(|s| {
            let n = |k: &str| s[k].as_u64().unwrap_or(0);
            (s["line"].as_u64().unwrap() as u32, (n("calls"), n("bytes"), n("failed"), n("injected")))
        })
        .collect()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn run_fail_fails_exactly_the_named_calls_and_counts_them_injected() {
    let f = fixture("fault-run");
    let [a, b, c, d] = ["A", "B", "C", "D"].map(|n| line_of("faults.c", n));
    let plain = std::process::Command::new(&f.faults).output().unwrap();
    assert_eq!(text(&plain.stdout), "B: ok\nC: ok\nD: 7\npass done\n");

    // The second call at A fails: the program says so once, and goes on.
    let o = f.run(&["--fail", &format!("faults.c:{a}:nth=2")], &f.faults, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), format!("A: no memory in round 1 (ENOMEM)\n{}", text(&plain.stdout)));
    let got = by_line(&f.report(), "fault/faults.c");
    // A's allocator was called twice (the failed call never reached it).
    let expected = [(a, (2, 128, 0, 1)), (b, (1, 256, 0, 0)), (c, (1, 32, 0, 0)), (d, (1, 32, 0, 0))];
    assert_eq!(got, expected.into_iter().collect());

    // Two specs at once: every call at A until two failed, and
    // posix_memalign's, which returns ENOMEM and leaves its pointer alone.
    let o = f.run(
        &["--fail", &format!("faults.c:{a}:every=1,times=2"), "--fail", &format!("fault/faults.c:{b}:nth=1")],
        &f.faults,
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout),
        "A: no memory in round 0 (ENOMEM)\nA: no memory in round 1 (ENOMEM)\n\
         B: posix_memalign failed (ENOMEM)\nC: ok\nD: 7\npass done\n"
    );
    let got = by_line(&f.report(), "fault/faults.c");
    let expected = [(a, (1, 64, 0, 2)), (b, (0, 0, 0, 1)), (c, (1, 32, 0, 0)), (d, (1, 32, 0, 0))];
    assert_eq!(got, expected.into_iter().collect());

    // C writes through the NULL it gets: the program dies of SIGSEGV, and
    // `run` exits as it did.
    let o = f.run(&["--fail", &format!("faults.c:{c}:nth=1")], &f.faults, &[]);
    assert_eq!(o.status.code(), Some(128 + libc::SIGSEGV), "{}", text(&o.stderr));

    // A spec that cannot be read: one line, status 2, nothing run.
    let o = f.run(&["--fail", &format!("faults.c:{a}:nth=0")], &f.faults, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(text(&o.stderr).lines().count(), 1, "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("nth= needs a number from 1"), "{}", text(&o.stderr));
    assert!(o.stdout.is_empty());
}

#[test]
fn operator_new_throws_bad_alloc_aligned_or_not_and_nothrow_new_returns_null() {
    let f = fixture("fault-cxx");
    let prog = build_source("fault/faults_new.cpp", &f.dir);
    let [n, t, v] = ["N", "T", "V"].map(|x| line_of("faults_new.cpp", x));
    let plain = std::process::Command::new(&prog).output().unwrap();
    assert_eq!(text(&plain.stdout), "T: ok\nV: ok\ncaught 0\n");
    let o = f.run(
        &[
            "--fail",
            &format!("faults_new.cpp:{n}:nth=2"),
            "--fail",
            &format!("faults_new.cpp:{t}:nth=1"),
            "--fail",
            &format!("faults_new.cpp:{v}:nth=1"),
        ],
        &prog,
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(
        text(&o.stdout),
        "N: bad_alloc caught in round 1\nT: nothrow new returned NULL\nV: bad_alloc caught\ncaught 2\n"
    );
    let got = by_line(&f.report(), "fault/faults_new.cpp");
    assert_eq!(got, [(n, (2, 200, 0, 1)), (t, (0, 0, 0, 1)), (v, (0, 0, 0, 1))].into_iter().collect());
}

#[test]
fn faultsweep_names_the_two_sites_that_crash_and_the_two_that_handle_it() {
    let f = fixture("fault-sweep");
    let [a, b, c, d] = ["A", "B", "C", "D"].map(|n| line_of("faults.c", n));
    let sweep = |format: &str, out: &str| {
        let mut child = alloctramp()
            .args(["faultsweep", "--jobs", "2", "--timeout", "30", "--format", format, "--cache"])
            .arg(&f.cache)
            .arg("-o")
            .arg(f.dir.join(out))
            .arg("--")
            .arg(&f.faults)
            .arg("serve")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Two passes, replayed to every run.
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), b"go\ngo\n").unwrap();
        drop(child.stdin.take());
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        o
    };
    let o = sweep("json", "json");
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["format"], "alloctramp-faultsweep");
    assert_eq!(doc["baseline"], "exit 0");
    let rows: Vec<(u64, String, u64)> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (r["line"].as_u64().unwrap(), r["outcome"].as_str().unwrap().to_string(), r["injected"].as_u64().unwrap())
        })
        .collect();
    // Crashes first, in order of place.
    let segv = "SIGSEGV".to_string();
    let exit0 = "exit 0".to_string();
    assert_eq!(
        rows,
        [(c.into(), segv.clone(), 1), (d.into(), segv, 1), (a.into(), exit0.clone(), 1), (b.into(), exit0, 1)]
    );
    // Each run's output is in its files, named in the row: the run that
    // failed A's first call read both passes from the replayed stdin.
    let a_row = doc["sites"].as_array().unwrap().iter().find(|r| r["line"] == a).unwrap();
    let out = std::fs::read_to_string(a_row["stdout"].as_str().unwrap()).unwrap();
    assert_eq!(out.matches("A: no memory in round 0 (ENOMEM)").count(), 1, "{out}");
    assert_eq!(out.matches("pass done").count(), 2, "{out}");
    assert_eq!(a_row["spec"].as_str().unwrap(), format!("faults:{:#x}:nth=1", a_row["address"].as_u64().unwrap()));

    // The text: the two crashing sites first, by file:line.
    let o = sweep("text", "text");
    let t = text(&o.stdout);
    let lines: Vec<&str> = t.lines().skip(1).collect();
    assert_eq!(lines.len(), 4, "{t}");
    for (l, (outcome, line)) in lines.iter().zip([("SIGSEGV", c), ("SIGSEGV", d), ("exit 0", a), ("exit 0", b)]) {
        assert!(l.starts_with(outcome) && l.contains(&format!("faults.c:{line} ")), "{l}");
    }
}

#[test]
fn fail_switches_a_running_process_s_calls_to_fail_and_back() {
    let f = fixture("fault-pid");
    let a = line_of("faults.c", "A");
    let (mut p, pid, dir) = serve(&f, &[]);
    let fail = |args: &[&str]| alloctramp().args(["fail", "--dir", &dir, &pid]).args(args).output().unwrap();

    // Profiling was off: `fail` puts the spec in effect and switches on.
    let o = fail(&[&format!("faults.c:{a}:nth=2")]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let said = text(&o.stderr);
    assert!(said.contains("1 fault spec in effect, naming 1 allocation site"), "{said}");
    assert!(said.contains("profiling on"), "{said}");
    assert_eq!(pass(&mut p), ["A: no memory in round 1 (ENOMEM)\n", "B: ok\n", "C: ok\n", "D: 7\n"]);
    // The spec's second call has come: no other fails.
    assert_eq!(pass(&mut p), ["B: ok\n", "C: ok\n", "D: 7\n"]);

    // A bad spec changes nothing: one line, status 2.
    let o = fail(&[&format!("faults.c:{a}:prob=2")]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(text(&o.stderr).lines().count(), 1, "{}", text(&o.stderr));

    // Every call at A, then none.
    let o = fail(&[&format!("faults.c:{a}:after=0")]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(pass(&mut p).len(), 6);
    let o = fail(&["--clear"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("no call fails any more"), "{}", text(&o.stderr));
    assert_eq!(pass(&mut p), ["B: ok\n", "C: ok\n", "D: 7\n"]);

    let r = report(&pid, &f.counters);
    let got = by_line(&r, "fault/faults.c");
    // A: 2 + 3 + 0 + 3 calls reached malloc, 1 + 3 were failed.
    assert_eq!(got[&a], (8, 512, 0, 4));
    assert!(got.iter().filter(|(l, _)| **l != a).all(|(_, v)| v.0 == 4 && v.3 == 0), "{got:?}");
    drop(p.child.stdin.take());
    assert_eq!(p.finish().1, Some(0));
}

#[test]
fn a_wrapper_s_call_fails_as_its_own_allocation_failing_makes_it() {
    let f = fixture("fault-wrapped");
    let prog = build_source("fault/wrapped.c", &f.dir);
    let [w1, w2, x, h1, h2] = ["W1", "W2", "X", "H1", "H2"].map(|n| line_of("wrapped.c", n));
    let text_of = |file: &str, what: &str| {
        let t = std::fs::read_to_string(testbins_dir().join("fault").join(file)).unwrap();
        t.lines().position(|l| l.contains(what)).unwrap() as u32 + 1
    };
    let inner = text_of("wrapped.c", "void *p = malloc(n);");
    let plain = std::process::Command::new(&prog).output().unwrap();
    assert_eq!(text(&plain.stdout), "W1: ok\nW2: ok\nP: ok\nX: 3\nH1: ok\nH2: ok\n");

    // Patched alone, xmalloc's malloc is a site that counts only outside a
    // counted call of xmalloc (the call through a pointer): the call at
    // W2 raises the wrapper depth, and the malloc inside it fails, so that
    // xmalloc dies with its own message and W2's size.
    let patched = f.dir.join("wrapped.patched");
    patch_to(&prog, &patched, &[]);
    let launch = |spec: &str| {
        let child = std::process::Command::new(&patched)
            .env_remove("ALLOCTRAMP")
            .env("ALLOCTRAMP_DIR", &f.counters)
            .env("ALLOCTRAMP_FAIL", spec)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id().to_string();
        let o = child.wait_with_output().unwrap();
        (o, by_line(&report(&pid, &f.counters), "fault/wrapped.c"))
    };
    let (o, got) = launch(&format!("wrapped.c:{w2}:nth=1"));
    assert_eq!(o.status.code(), Some(128), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "W1: ok\n");
    assert_eq!(text(&o.stderr), "fatal: out of memory allocating 200 bytes\n");
    // The call at W2 was counted (xmalloc never returned from it); the
    // failure is W2's.
    assert_eq!(got[&w2], (1, 200, 0, 1));
    assert_eq!(got[&w1], (1, 100, 0, 0));

    // The second call of new_node (a hook: its callers take what it
    // allocates) gets NULL from the calloc inside, which it handles.
    let (o, got) = launch(&format!("wrapped.c:{h2}:nth=1"));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "W1: ok\nW2: ok\nP: ok\nX: 3\nH1: ok\nH2: NULL, handled\n");
    assert_eq!(text(&o.stderr), "new_node: no memory\n");
    assert_eq!((got[&h1], got[&h2]), ((1, 56, 0, 0), (0, 0, 0, 1)));

    // xcalloc's calloc is no site (its callers count): the call at X is
    // made past its trampoline with a size no allocator grants, and
    // xcalloc dies as it would.
    let (o, got) = launch(&format!("wrapped.c:{x}:nth=1"));
    assert_eq!(o.status.code(), Some(128), "{}", text(&o.stderr));
    assert_eq!(text(&o.stderr), "fatal: out of memory allocating 1 x 9223372036854775808 bytes\n");
    assert_eq!(got[&x], (0, 0, 0, 1));

    // `run` (every module patched) fails the wrapper's call the same way.
    let o = f.run(&["--fail", &format!("wrapped.c:{w1}:nth=1")], &prog, &[]);
    assert_eq!(o.status.code(), Some(128), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("fatal: out of memory allocating 100 bytes"), "{}", text(&o.stderr));
    assert_eq!(by_line(&f.report(), "fault/wrapped.c")[&w1], (1, 100, 0, 1));

    // The sweep (the program patched alone) fails each wrapper call's
    // allocation and the malloc inside xmalloc (reached through the
    // pointer): the wrappers die four times, new_node's callers cope.
    let o = alloctramp()
        .args(["faultsweep", "--format", "json", "--cache"])
        .arg(&f.cache)
        .arg("-o")
        .arg(f.dir.join("sweep"))
        .arg("--")
        .arg(&prog)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows: Vec<(u64, &str)> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["line"].as_u64().unwrap(), r["outcome"].as_str().unwrap()))
        .collect();
    let e128 = "exit 128";
    assert_eq!(
        rows,
        [
            (inner.into(), e128),
            (w1.into(), e128),
            (w2.into(), e128),
            (x.into(), e128),
            (h1.into(), "exit 0"),
            (h2.into(), "exit 0")
        ]
    );
}

#[test]
fn a_failed_realloc_keeps_its_block_and_a_sweep_ends_a_run_that_hangs() {
    let f = fixture("fault-edge");
    let prog = build_source("fault/edge.c", &f.dir);
    let [r, s] = ["R", "S"].map(|n| line_of("edge.c", n));
    let o = f.run(&["--fail", &format!("edge.c:{r}:nth=1")], &prog, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), "R: realloc failed, the old block still holds \"kept\"\nS: ok\n");
    let got = by_line(&f.report(), "fault/edge.c");
    assert_eq!(got[&r], (0, 0, 0, 1));

    // The run whose malloc at S fails waits for ever: the sweep kills it
    // after --timeout and says so, after the program's own 0 exit.
    let started = std::time::Instant::now();
    let o = alloctramp()
        .args(["faultsweep", "--timeout", "1", "--format", "json", "--cache"])
        .arg(&f.cache)
        .arg("-o")
        .arg(f.dir.join("sweep"))
        .arg("--")
        .arg(&prog)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows: Vec<(u64, &str, bool)> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["line"] == r || x["line"] == s)
        .map(|x| (x["line"].as_u64().unwrap(), x["outcome"].as_str().unwrap(), x["timed_out"].as_bool().unwrap()))
        .collect();
    assert_eq!(rows, [(s.into(), "timeout", true), (r.into(), "exit 0", false)]);
}

#[test]
fn fail_reaches_a_process_switched_by_its_control_signal() {
    // The request is carried out in the control signal's handler: the
    // specs are read and parsed there, without allocating.
    let f = fixture("fault-signal");
    let a = line_of("faults.c", "A");
    let (mut p, pid, dir) = serve(&f, &[("ALLOCTRAMP_SWITCH", "signal")]);
    let o = alloctramp().args(["fail", "--dir", &dir, &pid, &format!("faults.c:{a}:nth=3")]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("naming 1 allocation site"), "{}", text(&o.stderr));
    let lines = pass(&mut p);
    assert_eq!(lines, ["A: no memory in round 2 (ENOMEM)\n", "B: ok\n", "C: ok\n", "D: 7\n"]);
    drop(p.child.stdin.take());
    assert_eq!(p.finish().1, Some(0));
    let got = by_line(&report(&pid, &f.counters), "fault/faults.c");
    assert_eq!(got[&a], (2, 128, 0, 1));
}
