//! Allocators other than malloc: programs calling jemalloc's, mimalloc's
//! and tcmalloc's own APIs directly (testbins/apis/, built here) are
//! profiled with no option, with exact calls, bytes and live figures at
//! every marked site.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, only_counters_file, report};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// (line, entry) -> (calls, bytes, live objects and bytes; None for frees).
pub type Rows = BTreeMap<(u32, String), (u64, u64, Option<(u64, u64)>)>;

/// The `@site` markers of testbins/REL.
pub fn marks(rel: &str) -> Rows {
    site_marks(rel).into_iter().map(|m| ((m.line, m.entry), (m.calls, m.bytes, m.live))).collect()
}

/// A report's rows of the source file `file`.
pub fn rows(doc: &Value, file: &str) -> Rows {
    let mut m = Rows::new();
    for s in doc["sites"].as_array().unwrap() {
        if !s["file"].as_str().is_some_and(|f| f.ends_with(file)) {
            continue;
        }
        let n = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k} of {s}"));
        let key = (n("line") as u32, s["entry"].as_str().unwrap().to_string());
        let row = if s["kind"] == "free" {
            (n("calls"), 0, None)
        } else {
            (n("calls"), n("bytes"), Some((n("live_calls"), n("live_bytes"))))
        };
        assert!(m.insert(key, row).is_none(), "one row per line: {s}");
    }
    m
}

/// Builds testbins/apis/SRC (which links `library`, from the Debian
/// `package`), patches it with no option and checks that it prints what
/// it printed before, off and on, and that on, every marked site counts
/// exactly what its marker says.
fn exact_without_options(src: &str, library: &str, package: &str) {
    ensure_library(library, package);
    exact(src, &[]);
}

/// [`exact_without_options`] for a program that links nothing more,
/// patched with `options`.
fn exact(src: &str, options: &[&str]) {
    exact_rows(src, options, |rows| rows)
}

/// [`exact`], comparing the markers with the report's rows as `rows`
/// gives them.
fn exact_rows(src: &str, options: &[&str], rows: impl Fn(Rows) -> Rows) {
    let rel = format!("apis/{src}");
    let dir = scratch(&format!("apis-{src}"));
    let counters = counters_dir(&format!("apis-{src}"));
    let bin = build_source(&rel, &dir);
    let patched = dir.join("patched");
    patch_to(&bin, &patched, options);
    let plain = Command::new(&bin).output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    for on in [false, true] {
        let mut c = Command::new(&patched);
        c.env("ALLOCTRAMP_DIR", &counters);
        if on {
            c.env("ALLOCTRAMP", "on");
        }
        let o = c.output().unwrap();
        assert_eq!(o.status.code(), Some(0), "on {on}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, plain.stdout, "on {on}: the same output");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "", "on {on}: nothing on stderr");
    }
    let file = only_counters_file(&counters);
    let doc = report(file.to_str().unwrap(), &counters);
    assert_eq!(rows(self::rows(&doc, &rel)), marks(&rel), "{src}: (line, entry) -> (calls, bytes, live)");
}

#[test]
fn jemalloc_api_calls_count_exactly_with_no_option() {
    exact_without_options("jemalloc_api.c", "libjemalloc.so", "libjemalloc-dev");
}

#[test]
fn mimalloc_api_calls_count_exactly_with_no_option() {
    exact_without_options("mimalloc_api.c", "libmimalloc.so", "libmimalloc-dev");
}

#[test]
fn tcmalloc_api_calls_count_exactly_with_no_option() {
    exact_without_options("tcmalloc_api.cpp", "libtcmalloc.so", "libgoogle-perftools-dev");
}

/// A pool allocator the user names whose objects start 4 past an
/// 8-aligned address: a free of one must not take the empty entry of its
/// granule, or a freed record at the granule's start, for its record
/// (which would leave it live and charge a site made up of its address
/// bits).
#[test]
fn a_user_named_pool_of_4_aligned_objects_has_exact_live_figures() {
    exact("pool4.c", &["--entry", "pool_alloc:alloc", "--entry", "pool_free:free"]);
}

/// CPython's allocator shape (testbins/apis/pyshape.c): PyObject_Malloc
/// and PyObject_Free call a pool through slots of a table in data, and
/// objects are freed through their type's tp_free pointer. With no option,
/// every free counts once and the live figures are exact.
#[test]
fn an_allocator_api_called_through_slots_and_freed_through_pointers_has_exact_live_figures() {
    exact("pyshape.c", &[]);
}

pub const POOL: &str = "apis/ptrpool.c";
pub const POOL_ENTRIES: [&str; 4] = ["--entry", "pool_alloc:alloc", "--entry", "pool_free:free"];

/// A pool the user names that is also called through a table of
/// operations in data (testbins/apis/ptrpool.c): no site sees those calls,
/// so both functions are hooked at their entry. The calls through the
/// table count on the functions' own rows, the direct ones at their sites,
/// and every live figure is exact (three frees in four of the direct
/// allocations go through the table, and the main thread frees through it
/// what four threads allocated through it). Without the hooks the same
/// program misses the calls through the table: its live figures are wrong.
#[test]
fn a_pool_called_through_a_table_of_operations_is_hooked_at_its_entry_with_exact_live_figures() {
    exact_rows("ptrpool.c", &POOL_ENTRIES, |rows| near_markers(rows, &marks(POOL)));
    let dir = scratch("apis-ptrpool-unhooked");
    let counters = counters_dir("apis-ptrpool-unhooked");
    let bin = build_source(POOL, &dir);
    let patched = dir.join("patched");
    patch_to(&bin, &patched, &[&POOL_ENTRIES[..], &["--no-entry-hooks"]].concat());
    let o = Command::new(&patched).env("ALLOCTRAMP_DIR", &counters).env("ALLOCTRAMP", "on").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc = report(only_counters_file(&counters).to_str().unwrap(), &counters);
    let got = rows(&doc, POOL);
    assert_eq!(got.len(), 4, "only the four direct calls are sites: {got:?}");
    let direct_a = got.iter().find(|(k, v)| k.1 == "pool_alloc" && v.1 == 24000).expect("the direct 24-byte row");
    assert_ne!(direct_a.1.2, Some((250, 6000)), "without hooks, the frees through the table are missed");
}

/// The hooked pool switched on while it waits (`alloctramp enable`): the
/// hooks' jumps switch as any site does, and every figure is exact.
#[test]
fn an_entry_hook_switched_on_while_running_counts_exactly() {
    let (bin, patched) = built_pool("apis-ptrpool-enabled");
    let plain = Command::new(&bin).output().unwrap();
    pool_switched(&patched, &counters_dir("apis-ptrpool-enabled"), &plain.stdout, "wait", &[("ready", "enable")]);
}

/// The hooked pool switched off between its two parts (`alloctramp
/// disable`), called through its table while off (its jumps back on the
/// stubs, uncounted), and on again (`alloctramp enable`): every figure is
/// exact.
#[test]
fn an_entry_hook_switched_off_and_on_again_counts_exactly() {
    let (bin, patched) = built_pool("apis-ptrpool-paused");
    let plain = Command::new(&bin).output().unwrap();
    let steps = [("paused", "disable"), ("resumed", "enable")];
    pool_switched(&patched, &counters_dir("apis-ptrpool-paused"), &plain.stdout, "pause", &steps);
}

/// testbins/apis/ptrpool.c built in the scratch directory `name` and
/// patched with the pool's entries: the program and its patched copy.
fn built_pool(name: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    let bin = build_source(POOL, &dir);
    let patched = dir.join("patched");
    patch_to(&bin, &patched, &POOL_ENTRIES);
    (bin, patched)
}

/// Runs `patched` (a build of testbins/apis/ptrpool.c) with `arg`, on from
/// start unless the first step switches it on; at each of `steps` (a line
/// the program prints, then `alloctramp enable` or `disable`) switches it
/// and lets it go on. Checks its output and that every marked row is exact.
pub fn pool_switched(patched: &Path, counters: &Path, plain: &[u8], arg: &str, steps: &[(&str, &str)]) {
    let mut c = Command::new(patched);
    c.arg(arg).env("ALLOCTRAMP_DIR", counters).stdin(Stdio::piped()).stdout(Stdio::piped());
    if steps.first().is_some_and(|s| s.1 != "enable") {
        c.env("ALLOCTRAMP", "on");
    }
    let mut child = c.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    for &(prompt, switch) in steps {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim_end(), prompt);
        let o = alloctramp().args([switch, &child.id().to_string(), "--dir"]).arg(counters).output().unwrap();
        assert!(o.status.success(), "{switch}: {}", String::from_utf8_lossy(&o.stderr));
        stdin.write_all(b"go\n").unwrap();
    }
    drop(stdin);
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut out, &mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(rest, plain, "the same output");
    assert_pool_rows(&report(only_counters_file(counters).to_str().unwrap(), counters), "");
}

/// Every marked row of testbins/apis/ptrpool.c in `doc` is exact (`what`
/// says which run failed).
pub fn assert_pool_rows(doc: &Value, what: &str) {
    let want = marks(POOL);
    assert_eq!(near_markers(rows(doc, POOL), &want), want, "{what} (line, entry) -> (calls, bytes, live)");
}

/// `got` with each row that no marker of `want` names moved to the line of
/// a marker for the same entry at most three lines away that has no row:
/// an entry hook's row is named after the line of the function's first
/// moved instruction, which the compiler decides (its opening brace, or
/// its first statement, where the marker is).
pub fn near_markers(got: Rows, want: &Rows) -> Rows {
    let mut out = Rows::new();
    for ((line, entry), row) in got.clone() {
        let moved = (!want.contains_key(&(line, entry.clone())))
            .then(|| {
                want.keys().find(|(l, e)| *e == entry && l.abs_diff(line) <= 3 && !got.contains_key(&(*l, e.clone())))
            })
            .flatten()
            .map_or(line, |k| k.0);
        out.insert((moved, entry), row);
    }
    out
}

/// Live objects per function of the module `module` in a report of a
/// running process, and their sum.
fn live_by_function(doc: &Value, module: &str) -> (BTreeMap<String, u64>, u64) {
    let mut by = BTreeMap::new();
    for s in doc["sites"].as_array().unwrap() {
        if s["module"] != module {
            continue;
        }
        if let (Some(f), Some(n)) = (s["function"].as_str(), s["live_calls"].as_u64()) {
            *by.entry(f.to_string()).or_insert(0) += n;
        }
    }
    let total = by.values().sum();
    (by, total)
}

/// The Python interpreter library, patched with no option, running a
/// script (through a launcher built here): its rows name CPython's C
/// functions, and the live figures follow what the script holds, the
/// strings it frees (through `tp_free`, a pointer) included.
#[test]
fn the_python_interpreter_library_counts_what_a_script_holds_and_frees() {
    ensure_tool("python3-config", "python3-dev");
    let config = |args: &[&str]| -> String {
        let o = Command::new("/usr/bin/python3-config").args(args).output().unwrap();
        assert!(o.status.success(), "python3-config {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap().trim().to_string()
    };
    let dir = scratch("apis-python");
    let launcher = dir.join("python");
    std::fs::write(
        dir.join("launch.c"),
        "#include <Python.h>\nint main(int c, char **v) { return Py_BytesMain(c, v); }\n",
    )
    .unwrap();
    let flags = config(&["--embed", "--cflags", "--ldflags"]);
    let o = Command::new("cc")
        .arg(dir.join("launch.c"))
        .arg("-o")
        .arg(&launcher)
        .args(flags.split_whitespace())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The library the launcher loads, patched into a directory of its own.
    let ldd = String::from_utf8(Command::new("ldd").arg(&launcher).output().unwrap().stdout).unwrap();
    let library = ldd
        .lines()
        .find_map(|l| l.split_once(" => ").filter(|(name, _)| name.trim().starts_with("libpython")))
        .map(|(name, path)| (name.trim().to_string(), path.split_whitespace().next().unwrap().to_string()))
        .unwrap_or_else(|| panic!("the launcher needs no libpython: {ldd}"));
    let libs = dir.join("lib");
    std::fs::create_dir_all(&libs).unwrap();
    patch_to(Path::new(&library.1), &libs.join(&library.0), &[]);
    let counters = counters_dir("apis-python");
    let mut child = Command::new(&launcher)
        .arg(testbins_dir().join("apis/hold.py"))
        .env("LD_LIBRARY_PATH", &libs)
        .env("ALLOCTRAMP", "on")
        .env("ALLOCTRAMP_DIR", &counters)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut steps = Vec::new();
    for tag in ["start", "holding", "released"] {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), tag);
        steps.push(live_by_function(&report(&child.id().to_string(), &counters), &library.0));
        child.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
    }
    assert!(child.wait().unwrap().success());
    let [(start, before), (holding, held), (_, after)] = &steps[..] else { unreachable!() };
    // The 100,000 strings (and the list's array), then back where it was,
    // give or take the interpreter's own few objects (the line `readline`
    // returned, its buffers), which come and go between the steps.
    assert!(held.abs_diff(before + 100_000) <= 10, "{before} live objects, then {held}");
    assert!(after.abs_diff(*before) <= 5, "{before} live objects at the start, {after} once released");
    // One C function of CPython holds the strings.
    let grown: Vec<(&String, u64)> = holding
        .iter()
        .map(|(f, n)| (f, n.saturating_sub(start.get(f).copied().unwrap_or(0))))
        .filter(|&(_, n)| n >= 100_000)
        .collect();
    assert!(
        grown.len() == 1 && !grown[0].0.starts_with("fn@") && !grown[0].0.starts_with("Py"),
        "the functions that hold the strings: {grown:?}"
    );
    assert!(start.contains_key("PyUnicode_New"), "rows name CPython's functions: {:?}", start.keys());
}

/// The stub an entry hook moves a function's first instructions to
/// unwinds as those instructions did where they were: at every moved
/// instruction and at the jump back, the patched file's unwind entries
/// (which its new search table, read by the C++ unwinder and
/// `backtrace()`, lists) give the row the function had there. (The stub
/// runs on every call, profiling on or off.)
#[test]
fn an_entry_hook_s_stub_unwinds_as_the_function_s_head() {
    use alloctramp_patcher::{Elf, ehframe::Sources, hooks::movable_head};
    for (name, flags) in [("pie", "-fPIE -pie"), ("static", "-static")] {
        let dir = scratch(&format!("apis-ptrpool-unwind-{name}"));
        let bin = dir.join("ptrpool");
        let cmd = format!("gcc -O2 -g {flags} -pthread {} -o {}", testbins_dir().join(POOL).display(), bin.display());
        let o = Command::new("sh").arg("-c").arg(&cmd).output().unwrap();
        assert!(o.status.success(), "{cmd}: {}", String::from_utf8_lossy(&o.stderr));
        let patched = dir.join("patched");
        patch_to(&bin, &patched, &POOL_ENTRIES);
        let (orig_data, new_data) = (std::fs::read(&bin).unwrap(), std::fs::read(&patched).unwrap());
        let (orig, new) = (Elf::parse(&orig_data).unwrap(), Elf::parse(&new_data).unwrap());
        let from = Sources::new(&orig).unwrap();
        let to = Sources::section(&new, alloctramp_trampolines::layout::SEC_EH_FRAME).unwrap();
        for f in ["pool_alloc", "pool_free"] {
            let s = orig.symbols(false).iter().find(|s| s.name == f && s.defined).unwrap();
            let head = movable_head(&orig, s.value, s.value + s.size).unwrap();
            let jump = new.bytes_at(head.at.0, 5).unwrap();
            assert_eq!(jump[0], 0xe9, "{name} {f}: a jump to the stub");
            let rel = i32::from_le_bytes(jump[1..5].try_into().unwrap());
            let stub = (head.at.0 + 5).wrapping_add(rel as i64 as u64);
            let (code, points) = head.stub(stub).unwrap();
            assert_eq!(new.bytes_at(stub, code.len()).unwrap(), &code[..], "{name} {f}: the stub");
            assert!(points.len() >= 2, "{name} {f}: {points:?}");
            assert_eq!(points[0].0, 0, "{name} {f}: the stub starts with the first moved instruction");
            for &(off, at) in &points {
                let want = from.row(at).unwrap_or_else(|e| panic!("{name} {f}: the row at {at:#x}: {e}"));
                assert_eq!(to.row(stub + u64::from(off)), Ok(want), "{name} {f}: stub+{off} against {at:#x}");
            }
        }
    }
}

/// An allocator whose first instructions call malloc and free
/// (testbins/apis/headcall.c): a hook would move those sites into its
/// stub, so it gets none, and the calls through its table count at the
/// checked sites inside. Exact figures, and no crash once profiling is on.
#[test]
fn an_allocator_whose_head_calls_malloc_is_not_hooked_and_counts_exactly() {
    exact("headcall.c", &["--entry", "xalloc:alloc", "--entry", "xfree:free"]);
}

/// `alloctramp run`, where a module's own definitions of allocator entry
/// points are layers whose sites are not patched: the pool, built under
/// mimalloc's names (`mi_malloc`, `mi_free`: entry points by default, no
/// option), is hooked at its entry all the same, and counts the calls
/// through its table exactly.
#[test]
fn entry_hooks_count_exactly_under_alloctramp_run() {
    let dir = counters_dir("apis-ptrpool-run");
    let bin = dir.join("ptrpool");
    let o = Command::new("gcc")
        .args(["-O2", "-g", "-fPIE", "-pie", "-pthread", "-Dpool_alloc=mi_malloc", "-Dpool_free=mi_free"])
        .arg(testbins_dir().join(POOL))
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = dir.join("report.json");
    let o = alloctramp()
        .args(["run", "--on", "--top", "0", "--format", "json", "-q", "-o"])
        .arg(&out)
        .arg("--cache")
        .arg(dir.join("cache"))
        .arg("--")
        .arg(&bin)
        .env("ALLOCTRAMP_DIR", &dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout, Command::new(&bin).output().unwrap().stdout, "the program's output");
    let doc: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let named = |rows: Rows| -> Rows {
        let name = |e: String| e.replace("pool_alloc", "mi_malloc").replace("pool_free", "mi_free");
        rows.into_iter().map(|((line, e), v)| ((line, name(e)), v)).collect()
    };
    let want = named(marks(POOL));
    assert_eq!(near_markers(named(rows(&doc, POOL)), &want), want, "(line, entry) -> (calls, bytes, live)");
}

/// A library's exported pool that the user names, reached through a
/// table of operations from the program and from the library
/// (testbins/apis/libsharedpool.c, sharedpool.c): both files patched with
/// the same entries, the program's calls through the PLT count at its
/// sites (raising the depth), and the calls through the table at the
/// library's entry hooks, each once; every live figure is exact.
#[test]
fn an_exported_pool_reached_through_pointers_counts_once_across_modules() {
    let dir = scratch("apis-sharedpool");
    let lib = build_source("apis/libsharedpool.c", &dir);
    let bin = build_source("apis/sharedpool.c", &dir);
    let patched = dir.join("patched");
    std::fs::create_dir_all(&patched).unwrap();
    patch_to(&lib, &patched.join("libsharedpool.so"), &POOL_ENTRIES);
    patch_to(&bin, &patched.join("sharedpool"), &POOL_ENTRIES);
    let plain = Command::new(&bin).output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    let counters = counters_dir("apis-sharedpool");
    for on in [false, true] {
        let mut c = Command::new(patched.join("sharedpool"));
        c.env("LD_LIBRARY_PATH", &patched).env("ALLOCTRAMP_DIR", &counters);
        if on {
            c.env("ALLOCTRAMP", "on");
        }
        let o = c.output().unwrap();
        assert_eq!(o.status.code(), Some(0), "on {on}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, plain.stdout, "on {on}: the same output");
    }
    let doc = report(only_counters_file(&counters).to_str().unwrap(), &counters);
    for rel in ["apis/sharedpool.c", "apis/libsharedpool.c"] {
        let want = marks(rel);
        assert_eq!(near_markers(rows(&doc, rel), &want), want, "{rel}: (line, entry) -> (calls, bytes, live)");
    }
    // A fault spec naming the program's call of the pool fails that call
    // (the pool is an allocator, not a wrapper whose own allocation would
    // fail), although the call raises the depth: the program returns 1.
    let (&(line, _), _) = marks("apis/sharedpool.c").iter().find(|((_, e), _)| e == "pool_alloc").unwrap();
    let o = Command::new(patched.join("sharedpool"))
        .env("LD_LIBRARY_PATH", &patched)
        .env("ALLOCTRAMP_DIR", counters_dir("apis-sharedpool-fault"))
        .env("ALLOCTRAMP_FAIL", format!("sharedpool.c:{line}:nth=1"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "the first call fails: {}", String::from_utf8_lossy(&o.stderr));
}
