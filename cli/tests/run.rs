//! `alloctramp run` on the whole process: the shared libraries a program
//! loads (through its PLT and with dlopen by name) are patched into the
//! cache and profiled, and with `--follow-exec` the programs it executes,
//! whose figures `--tree` adds up. The programs are in testbins/run/,
//! built here.

use crate::runtime::{counters_dir, report};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

/// (source file name, line, entry) of a row.
type Key = (String, u32, String);
/// calls, bytes, and live objects and bytes.
type Got = (u64, u64, Option<(u64, u64)>);

/// Builds grower and the two libraries it uses into `dir`.
fn build_grower(dir: &Path) -> PathBuf {
    build_source("run/libgrow.c", dir);
    build_source("run/libdlgrow.c", dir);
    build_source("run/grower.c", dir)
}

/// What the markers of grower and its libraries say, `times` runs of it.
fn grower_marks(times: u64) -> BTreeMap<Key, Got> {
    let mut m = BTreeMap::new();
    for src in ["grower.c", "libgrow.c", "libdlgrow.c"] {
        for s in site_marks(&format!("run/{src}")) {
            let live = s.live.map(|(o, b)| (o * times, b * times)).or(Some((0, 0)));
            m.insert((src.to_string(), s.line, s.entry), (s.calls * times, s.bytes * times, live));
        }
    }
    m
}

/// The rows of a JSON report, by source line, of the files in `of`.
fn rows(doc: &Value, of: &[&str]) -> BTreeMap<Key, Got> {
    let mut m = BTreeMap::new();
    for s in doc["sites"].as_array().unwrap() {
        let file = base(s["file"].as_str().unwrap_or("?")).to_string();
        if !of.contains(&file.as_str()) {
            continue;
        }
        let n = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k} of {s}"));
        let live = s["live_calls"].as_u64().map(|o| (o, n("live_bytes")));
        let key = (file, s["line"].as_u64().unwrap() as u32, s["entry"].as_str().unwrap().to_string());
        let row = if s["kind"] == "free" { (n("calls"), 0, None) } else { (n("calls"), n("bytes"), live) };
        assert!(m.insert(key, row).is_none(), "one row per line: {s}");
    }
    m
}

/// Free sites have no live figures: what the markers say of them.
fn without_free_live(mut m: BTreeMap<Key, Got>) -> BTreeMap<Key, Got> {
    for (k, v) in m.iter_mut() {
        if k.2 == "free" {
            v.2 = None;
        }
    }
    m
}

/// `alloctramp run --on --top 0 --format json -o REPORT ARGS -- COMMAND`.
fn run_json(dir: &Path, cache: &Path, report: &Path, args: &[&str], command: &[&str]) -> Output {
    alloctramp()
        .args(["run", "--on", "--top", "0", "--format", "json", "-o"])
        .arg(report)
        .arg("--cache")
        .arg(cache)
        .args(args)
        .arg("--")
        .args(command)
        .env("ALLOCTRAMP_DIR", dir)
        .output()
        .unwrap()
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn digest(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect()
}

#[test]
fn run_profiles_a_library_through_its_plt_and_one_loaded_with_dlopen_by_name() {
    // No colon in the directory: it is a RUNPATH.
    let dir = counters_dir("run-libraries");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let grower = build_grower(&bin);
    let cache = dir.join("cache");
    let out = dir.join("report.json");
    let original = run_program(&grower, &[], &[]);
    assert_eq!(original, ("grower: one handle, g\n".to_string(), String::new(), 0));
    let before = digest(&bin);

    let o = run_json(&dir, &cache, &out, &[], &[grower.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), original.0, "the program's output");
    let err = String::from_utf8_lossy(&o.stderr);
    for lib in ["libgrow.so", "libdlgrow.so"] {
        assert!(err.contains(&format!("patched {} into", bin.join(lib).display())), "{lib}: {err}");
    }
    let want = without_free_live(grower_marks(1));
    let of = ["grower.c", "libgrow.c", "libdlgrow.c"];
    assert_eq!(rows(&json(&out), &of), want, "exact figures at every marked line");
    assert_eq!(digest(&bin), before, "nothing outside the cache changes");

    // Again: every copy comes from the cache, the figures are the same.
    let o = run_json(&dir, &cache, &out, &[], &[grower.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("alloctramp: patched"), "patched once: {err}");
    assert_eq!(rows(&json(&out), &of), want);

    // Only the program, on request.
    let o = run_json(&dir, &cache, &out, &["--no-libraries"], &[grower.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let got = rows(&json(&out), &of);
    assert_eq!(got, want.into_iter().filter(|(k, _)| k.0 == "grower.c").collect(), "the program's rows alone");
}

#[test]
fn run_reports_jq_with_the_sites_of_its_library() {
    ensure_tool("jq", "jq");
    let dir = counters_dir("run-jq");
    let input = dir.join("in.json");
    std::fs::write(&input, r#"{"a":[1,2,3],"b":{"c":"text","d":[{"e":1},{"e":2}]}}"#).unwrap();
    let args = ["jq", "-c", "[.a[]*2, (.b.d|map(.e)), .b.c]", input.to_str().unwrap()];
    let original = std::process::Command::new("jq").args(&args[1..]).output().unwrap();
    assert!(original.status.success());
    let out = dir.join("report.json");
    let o = run_json(&dir, &dir.join("cache"), &out, &[], &args);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(o.stdout, original.stdout, "jq's output");
    let doc = json(&out);
    let calls = |module: &str| -> u64 {
        doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["module"] == module && s["kind"] != "free")
            .map(|s| s["calls"].as_u64().unwrap())
            .sum()
    };
    assert!(calls("libjq.so.1") > 100, "libjq's rows count jq's allocations: {}", calls("libjq.so.1"));
    let modules: Vec<&str> = doc["modules"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert!(modules.contains(&"libjq.so.1") && modules.contains(&"libonig.so.5"), "{modules:?}");
    assert!(!modules.iter().any(|m| m.starts_with("libc.so")), "the C library stays as it is: {modules:?}");
}

#[test]
fn run_follows_a_scripts_children_and_adds_up_the_tree() {
    let dir = counters_dir("run-tree");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let grower = build_grower(&bin);
    let script = bin.join("twice.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\necho start\n{0} first\n{0} 'two words' > /dev/null\necho end\n", grower.display()),
    )
    .unwrap();
    std::os::unix::fs::PermissionsExt::set_mode(&mut std::fs::metadata(&script).unwrap().permissions(), 0o755);
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let cache = dir.join("cache");
    let out = dir.join("report.json");
    let expected_out = "start\ngrower: one handle, g\nend\n";
    let of = ["grower.c", "libgrow.c", "libdlgrow.c"];
    let counters = |d: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "counters"))
            .collect();
        v.sort();
        v
    };

    // Without --follow-exec the children run as they are.
    let o = run_json(&dir, &cache, &out, &[], &[script.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), expected_out);
    assert_eq!(counters(&dir).len(), 1, "the shell's file alone");
    assert_eq!(rows(&json(&out), &of), BTreeMap::new());

    // With it, each child has its own file with its own exact figures.
    let o = run_json(&dir, &cache, &out, &["--follow-exec"], &[script.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), expected_out);
    let runs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("run-"))
        .collect();
    assert_eq!(runs.len(), 1, "one directory for the run's tree");
    let files = counters(&runs[0]);
    assert_eq!(files.len(), 3, "the shell and two children: {files:?}");
    let one = without_free_live(grower_marks(1));
    let children: Vec<BTreeMap<Key, Got>> =
        files.iter().map(|f| rows(&report(f.to_str().unwrap(), &runs[0]), &of)).filter(|r| !r.is_empty()).collect();
    assert_eq!(children, vec![one.clone(), one], "each child's exact figures");
    let doc = json(&out);
    assert_eq!(rows(&doc, &of), BTreeMap::new(), "the run's report is the shell's");

    // --tree adds the tree up: the two children's figures, once per line.
    let o = run_json(&dir, &cache, &out, &["--tree"], &[script.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), expected_out);
    assert_eq!(rows(&json(&out), &of), without_free_live(grower_marks(2)), "the tree's figures");
    let err = String::from_utf8_lossy(&o.stderr);
    let listed = err.lines().filter(|l| l.starts_with("alloctramp:   pid ")).count();
    assert_eq!(listed, 3, "one line per process: {err}");
    // Each process is named by its command line.
    for child in [format!("`{} first`", grower.display()), format!("`{} 'two words'`", grower.display())] {
        assert_eq!(err.lines().filter(|l| l.contains(&child)).count(), 1, "{child} in {err}");
    }
    assert!(err.contains("alloctramp: the tree's totals: "), "{err}");
}

#[test]
fn the_program_run_sees_no_variable_of_the_run_but_other_audit_libraries() {
    let dir = counters_dir("run-env");
    let cache = dir.join("cache");
    // The environment `env` prints, sorted: under `run --on`, and as the
    // same environment with ALLOCTRAMP=on gives it without alloctramp.
    let lines = |o: Output| -> Vec<String> {
        assert!(o.status.success(), "{o:?}");
        let mut v: Vec<String> = String::from_utf8(o.stdout).unwrap().lines().map(String::from).collect();
        v.sort();
        v
    };
    for audit in [None, Some("/nonexistent/audit.so")] {
        let mut run = alloctramp();
        run.args(["run", "--on", "-q", "--cache"]).arg(&cache).args(["--", "env"]).env("ALLOCTRAMP_DIR", &dir);
        let mut plain = std::process::Command::new("env");
        plain.env("ALLOCTRAMP", "on").env("ALLOCTRAMP_DIR", &dir);
        // A user's audit library stays in the list (it does not exist
        // here: the loader says so and goes on).
        for c in [&mut run, &mut plain] {
            match audit {
                Some(a) => c.env("LD_AUDIT", a),
                None => c.env_remove("LD_AUDIT"),
            };
        }
        let got = lines(run.output().unwrap());
        assert_eq!(got, lines(plain.output().unwrap()), "with LD_AUDIT {audit:?}");
        assert!(got.iter().any(|l| l == "ALLOCTRAMP=on"));
        assert_eq!(got.iter().any(|l| l.starts_with("LD_AUDIT=")), audit.is_some());
    }
}

#[test]
fn a_cxx_allocation_counts_once_though_libstdcxx_is_patched_too() {
    let dir = counters_dir("run-layers");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let layers = build_source("run/layers.cpp", &bin);
    let out = dir.join("report.json");
    let o = run_json(&dir, &dir.join("cache"), &out, &[], &[layers.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "layers: 100 strings, sum 234\n");
    let doc = json(&out);
    // Each line's allocations, whatever its calls are: operator new, or
    // hooks (calls of libstdc++'s _M_construct, or of the program's own
    // copy of _M_realloc_insert). Lines that allocated nothing are left
    // out.
    let mut news: BTreeMap<u32, Got> = BTreeMap::new();
    for ((_, line, entry), (calls, bytes, live)) in rows(&doc, &["layers.cpp"]) {
        if !entry.starts_with("operator delete") && calls > 0 {
            let (o, b) = live.unwrap_or_else(|| panic!("live figures on line {line}"));
            let n = news.entry(line).or_insert((0, 0, Some((0, 0))));
            let (lo, lb) = n.2.unwrap();
            *n = (n.0 + calls, n.1 + bytes, Some((lo + o, lb + b)));
        }
    }
    let want: BTreeMap<u32, Got> =
        site_marks("run/layers.cpp").into_iter().map(|m| (m.line, (m.calls, m.bytes, m.live))).collect();
    assert_eq!(news, want, "the program's own lines");
    // Rows that allocated name the program's own lines, not the standard
    // headers the allocation was inlined from.
    for s in doc["sites"].as_array().unwrap() {
        if s["module"] == "layers" && s["kind"] != "free" && s["calls"].as_u64().unwrap() > 0 {
            assert!(s["file"].as_str().unwrap().ends_with("/layers.cpp"), "{s}");
        }
    }
    // libstdc++'s rows: the strings are the program's calls' (hooks); the
    // malloc inside operator new counts nothing (its one malloc row with
    // calls, if any, is its own start-up pool).
    let lib = |malloc: bool| -> (u64, u64, usize) {
        let rows: Vec<&Value> = doc["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["module"].as_str().unwrap().starts_with("libstdc++") && s["kind"] != "free")
            .filter(|s| (s["entry"] == "malloc") == malloc)
            .filter(|s| s["calls"].as_u64().unwrap() > 0)
            .collect();
        let sum = |k: &str| rows.iter().map(|s| s[k].as_u64().unwrap()).sum();
        (sum("calls"), sum("bytes"), rows.len())
    };
    assert_eq!(lib(false), (0, 0, 0), "the strings are charged to the program's lines");
    let (pool, pool_bytes, pool_rows) = lib(true);
    assert!(pool <= 1 && pool_rows <= 1, "libstdc++'s mallocs: {pool} calls at {pool_rows} sites");
    let err = String::from_utf8_lossy(&o.stderr);
    let all = want.values().map(|w| w.0).sum::<u64>() + pool;
    let bytes = want.values().map(|w| w.1).sum::<u64>() + pool_bytes;
    assert!(err.contains(&format!("alloctramp: totals: {all} allocations, {bytes} bytes")), "once each: {err}");
}

#[test]
fn a_library_patched_during_dlopen_sends_the_program_no_signal_and_no_child() {
    let dir = counters_dir("run-reaper");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    build_source("run/libdlgrow.c", &bin);
    let reaper = build_source("run/reaper.c", &bin);
    let expected = "reaper: 0 signals, 0 children reaped\n";
    assert_eq!(run_program(&reaper, &[], &[]).0, expected);
    let out = dir.join("report.json");
    let o = run_json(&dir, &dir.join("cache"), &out, &[], &[reaper.to_str().unwrap()]);
    assert!(o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("patched {} into", bin.join("libdlgrow.so").display())),
        "patched during dlopen: {err}"
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), expected);
    let got = rows(&json(&out), &["libdlgrow.c"]);
    let line = site_marks("run/libdlgrow.c")[0].line;
    assert_eq!(got[&("libdlgrow.c".to_string(), line, "malloc".to_string())], (2, 65, Some((2, 65))));
}
