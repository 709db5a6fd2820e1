//! Charging callers (the default): calls to allocation wrappers are sites that count
//! what the wrappers allocate, and the sites inside a wrapper count only
//! when it is reached without one. Exact figures for `wrappers` (and the
//! library `libwraps.so` it needs) in every build configuration.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, display, figures, live_figures, only_counters_file, report};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;

/// A site of `sites --json`: (file, line, entry, form, charge, inside a
/// hooked function).
type SiteKey = (String, u32, String, String, String, bool);

/// Whether a marker's entry is called directly: a function of the
/// program, not an allocator or a library's wrapper (which a library calls
/// through its PLT or GOT too, since another module may interpose it).
fn is_local(p: &Program, entry: &str) -> bool {
    !p.is_library && p.wrappers.iter().any(|(n, _)| n == entry)
}

/// The sites `sites` lists, as the markers give them:
/// (file, line, entry, form, charge). A site inside a wrapper that can be
/// reached without a call site (exported, or its address taken: a marker
/// with `charged=`) checks the depth.
fn expected_sites(p: &Program, config: Config, exported: bool) -> Vec<SiteKey> {
    let checked_lines: Vec<u32> = p.markers.iter().filter(|m| m.charged.is_some()).map(|m| m.line).collect();
    let charge = |m: &Marker, caller: bool| match (m.inside, exported || checked_lines.contains(&m.line)) {
        (false, _) if caller => "caller",
        (false, _) => "own",
        (true, true) => "inside-checked",
        (true, false) => "inside",
    };
    let key = |m: &Marker, direct: bool, caller: bool| {
        let form = expected_form(config, m.tail, direct);
        (m.file.clone(), m.line, m.entry.clone(), form, charge(m, caller).to_string(), m.under.is_some())
    };
    let hook = |m: &Marker| {
        let form = expected_form(config, m.tail, is_local(p, &m.entry));
        (m.file.clone(), m.line, m.entry.clone(), form, "hook".to_string(), false)
    };
    let mut v: Vec<SiteKey> = p
        .markers
        .iter()
        .map(|m| key(m, false, false))
        .chain(p.charged_markers.iter().map(|m| key(m, is_local(p, &m.entry), true)))
        .chain(p.hook_markers.iter().map(hook))
        .collect();
    v.sort();
    v
}

fn actual_sites(path: &std::path::Path) -> Vec<SiteKey> {
    let doc = sites_json(path, &[]);
    let mut v: Vec<SiteKey> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                base(s["file"].as_str().unwrap()).to_string(),
                s["line"].as_u64().unwrap() as u32,
                s["entry_display"].as_str().unwrap().to_string(),
                s["form"].as_str().unwrap().to_string(),
                s["charge"].as_str().unwrap().to_string(),
                s["under_hook"].as_bool().unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

type Figures = BTreeMap<(String, u32, String), (u64, u64, u64)>;

/// What each site counts (charging callers), the program and its
/// libraries patched: calls to wrappers their markers' figures, sites
/// inside wrappers only what reaches them otherwise.
fn charged_figures(progs: &[&Program]) -> (Figures, Figures) {
    let (mut counts, mut live) = (Figures::new(), Figures::new());
    for p in progs {
        for m in p.markers.iter().chain(&p.charged_markers).chain(&p.hook_markers) {
            let key = (m.file.clone(), m.line, display(&m.entry));
            let (c, l) = match (m.inside, m.charged) {
                // Inside a hooked function: what reaches it without a hook.
                (false, _) if m.under.is_some() => {
                    let (calls, bytes) = m.under.unwrap_or_default();
                    ((calls, bytes, 0), (0, 0))
                }
                (false, _) => ((m.calls, m.bytes, m.failed), m.live.unwrap_or((0, 0))),
                (true, Some((calls, bytes))) => ((calls, bytes, 0), (0, 0)),
                (true, None) => ((0, 0, 0), (0, 0)),
            };
            counts.insert(key.clone(), c);
            live.insert(key, (l.0, l.1, 0));
        }
    }
    (counts, live)
}

/// `progs` (a program, then the libraries it needs) patched with no option
/// into a directory of their own (returned), the program run with
/// profiling on from the start, tracking live objects and counting only:
/// it behaves as the original, and every site counts what the markers say
/// charging callers.
fn charged_runs(config: Config, progs: &[&Program], tag: &str) -> std::path::PathBuf {
    let b = built(config);
    let prog = progs[0];
    let pdir = b.dir.join(format!("patched-{tag}"));
    let _ = std::fs::remove_dir_all(&pdir);
    std::fs::create_dir_all(&pdir).unwrap();
    for p in progs {
        patch_to(&b.path(&p.name), &pdir.join(&p.output), &[]);
    }
    let original = run_program(&b.path(&prog.name), &prog.run, &[]);
    let (counts, live) = charged_figures(progs);
    for (mode, live_on) in [("live", "1"), ("count", "0")] {
        let dir = counters_dir(&format!("{}-{tag}-{mode}", config.name()));
        let env = [
            ("ALLOCTRAMP", "on"),
            ("ALLOCTRAMP_LIVE", live_on),
            ("ALLOCTRAMP_DIR", dir.to_str().unwrap()),
            ("LD_LIBRARY_PATH", pdir.to_str().unwrap()),
        ];
        let out = run_program(&pdir.join(&prog.output), &prog.run, &env);
        assert_eq!(out, original, "{} {mode}: the program behaves as the original", config.name());
        let file = only_counters_file(&dir);
        let doc = report(file.to_str().unwrap(), &dir);
        assert_eq!(figures(&doc), counts, "{} {mode}: charged counts differ from the markers", config.name());
        if live_on == "1" {
            assert_eq!(live_figures(&file), live, "{} {mode}: live figures differ from the markers", config.name());
        }
    }
    pdir
}

fn check_charge(config: Config) {
    let b = built(config);
    let (prog, lib) = (program("wrappers"), program("libwraps"));
    assert_eq!(actual_sites(&b.path(&prog.name)), expected_sites(prog, config, false), "{}", config.name());
    assert_eq!(actual_sites(&b.path(&lib.name)), expected_sites(lib, config, true), "{}", config.name());

    let pdir = charged_runs(config, &[prog, lib], "charged");
    // The original program with the patched library: nothing raises the
    // depth, so the checked sites inside the library's wrappers count.
    let dir = counters_dir(&format!("{}-charge-lib-only", config.name()));
    let copy = pdir.join("wrappers-unpatched");
    std::fs::copy(b.path(&prog.name), &copy).unwrap();
    let env =
        [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap()), ("LD_LIBRARY_PATH", pdir.to_str().unwrap())];
    let out = run_program(&copy, &prog.run, &env);
    assert_eq!(out, run_program(&b.path(&prog.name), &prog.run, &[]));
    let doc = report(only_counters_file(&dir).to_str().unwrap(), &dir);
    let expected: Figures = lib
        .markers
        .iter()
        .chain(&lib.charged_markers)
        .chain(&lib.hook_markers)
        .map(|m| {
            let (calls, bytes) = m.alone.unwrap_or(if m.inside { (0, 0) } else { (m.calls, m.bytes) });
            ((m.file.clone(), m.line, display(&m.entry)), (calls, bytes, 0))
        })
        .collect();
    assert_eq!(figures(&doc), expected, "{}: the library alone counts its wrappers' calls", config.name());
}

mod exact_charged_counts {
    crate::matrix!(super::check_charge);
}

/// Hooks: calls to wrappers whose size is not an argument (`hooks`) take
/// what the sites inside allocate, the outermost call on each thread,
/// through nesting, a function pointer (no hook: the inner site counts)
/// and a `longjmp` out of a hook's call. Exact in every build
/// configuration, counting and tracking live objects.
fn check_hooks(config: Config) {
    let b = built(config);
    let p = program("hooks");
    let path = b.path(&p.name);
    let expected = expected_sites(p, config, false);
    let actual = actual_sites(&path);
    assert_eq!(actual, expected, "{}: sites, charges and hooks differ from the markers", config.name());

    charged_runs(config, &[p], "hooks");
}

mod hooks_matrix {
    crate::matrix!(super::check_hooks);
}

/// A hook's call left on a stack the program then unmaps (a fiber destroyed
/// while suspended inside it): the next checks below it, a hook's and a
/// hooked function's site's, find the charge stale instead of faulting.
/// Exact in every build configuration, counting, tracking live objects and
/// recording call chains (whose capture makes the same check).
fn check_fibers(config: Config) {
    let b = built(config);
    let p = program("fibers");
    let path = b.path(&p.name);
    assert_eq!(
        actual_sites(&path),
        expected_sites(p, config, false),
        "{}: sites differ from the markers",
        config.name()
    );
    let pdir = charged_runs(config, &[p], "fibers");
    let dir = counters_dir(&format!("{}-fibers-callers", config.name()));
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())];
    let out = run_program(&pdir.join(&p.output), &p.run, &env);
    assert_eq!(
        out,
        run_program(&path, &p.run, &[]),
        "{}: with call chains, the program behaves as the original",
        config.name()
    );
    let file = only_counters_file(&dir);
    let doc = report(file.to_str().unwrap(), &dir);
    assert_eq!(
        figures(&doc),
        charged_figures(&[p]).0,
        "{}: with call chains, counts differ from the markers",
        config.name()
    );

    // A fault of the program's own still ends it by SIGSEGV.
    use std::os::unix::process::ExitStatusExt;
    for (exe, env) in [(path.clone(), vec![]), (pdir.join(&p.output), env.to_vec())] {
        let o = std::process::Command::new(&exe).arg("crash").envs(env).output().unwrap();
        assert_eq!(o.status.signal(), Some(libc::SIGSEGV), "{}: {} crash: {:?}", config.name(), exe.display(), o);
        assert_eq!(o.stdout, out.0.as_bytes(), "{}: {} crash", config.name(), exe.display());
    }

    // The program's own SIGSEGV handler (SA_SIGINFO | SA_RESETHAND),
    // installed before profiling is switched on, gets a fault and a
    // SIGSEGV the program sends itself as it would have: once, with their
    // codes, and the fault then ends the program.
    for what in ["crash", "kill"] {
        let original = run_with_handler(&path, what, None);
        let dir = counters_dir(&format!("{}-fibers-handler-{what}", config.name()));
        let patched = run_with_handler(&pdir.join(&p.output), what, Some(&dir));
        assert_eq!(patched, original, "{}: handler {what}", config.name());
        let code = if what == "crash" { 1 } else { 0 };
        assert!(original.0.ends_with(&format!("caught 11 code {code}\n")), "{}: {original:?}", config.name());
    }
}

/// `fibers handler WHAT`, switched on with `alloctramp enable` while it
/// waits (`dir`: its counters directory; None: the original, not
/// switched): its output and the signal that ended it.
fn run_with_handler(exe: &std::path::Path, what: &str, dir: Option<&std::path::Path>) -> (String, Option<i32>) {
    use std::io::{BufRead, Read, Write};
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["handler", what]).stdin(Stdio::piped()).stdout(Stdio::piped());
    if let Some(d) = dir {
        cmd.env("ALLOCTRAMP_DIR", d);
    }
    let mut child = cmd.spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut text = String::new();
    out.read_line(&mut text).unwrap();
    assert_eq!(text, "ready\n");
    if let Some(d) = dir {
        let o = alloctramp().args(["enable", &child.id().to_string(), "--dir"]).arg(d).output().unwrap();
        assert!(o.status.success(), "enable: {}", String::from_utf8_lossy(&o.stderr));
    }
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    out.read_to_string(&mut text).unwrap();
    (text, child.wait().unwrap().signal())
}

mod fibers_matrix {
    crate::matrix!(super::check_fibers);
}

/// Calls through a GOT slot that a relative relocation fills with an entry
/// point the file defines (`call *f@GOTPCREL(%rip)` that the linker did not
/// relax, as Rust calls `__rust_alloc`) are sites, not addresses in data.
#[test]
fn got_slots_filled_by_relative_relocations_are_sites() {
    let p = program("own_malloc");
    let dir = scratch("got-relative");
    let exe = dir.join("own_malloc");
    let src = p.src.to_str().unwrap();
    let o = std::process::Command::new("gcc")
        .args(["-g", "-O2", "-fPIC", "-pie", "-fno-plt", "-Wa,-mrelax-relocations=no", "-Wall", "-Werror", "-I"])
        .arg(testbins_dir())
        .args([src, "-o"])
        .arg(&exe)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let entries = ["--entry", "my_alloc:alloc", "--entry", "my_free:free"];
    let doc = sites_json(&exe, &entries);
    let user: Vec<(u32, String, String, String)> = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["entry"].as_str().unwrap().starts_with("my_"))
        .map(|s| {
            (
                s["line"].as_u64().unwrap() as u32,
                s["entry"].as_str().unwrap().to_string(),
                s["form"].as_str().unwrap().to_string(),
                s["via"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expected: Vec<(u32, String, String, String)> = p
        .user_markers
        .iter()
        .map(|m| (m.line, m.entry.clone(), "call [rip+disp]".to_string(), "got".to_string()))
        .collect();
    assert_eq!(user, expected, "calls through the GOT are sites");
    let in_data = doc["unpatchable"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["entry"].as_str().unwrap().starts_with("my_"))
        .count();
    assert_eq!(in_data, 0, "the GOT slots are not addresses in data: {}", doc["unpatchable"]);

    // Patched and run: the calls count at their lines.
    let patched = dir.join("own_malloc.patched");
    patch_to(&exe, &patched, &entries);
    let counters = counters_dir("got-relative");
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
    assert_eq!(run_program(&patched, &p.run, &env), run_program(&exe, &p.run, &[]));
    let got = figures(&report(only_counters_file(&counters).to_str().unwrap(), &counters));
    for m in &p.user_markers {
        let key = (m.file.clone(), m.line, m.entry.clone());
        assert_eq!(got.get(&key), Some(&(m.calls, m.bytes, m.failed)), "{key:?}");
    }
}

/// A Rust program: its calls of `__rust_alloc` and kin (through GOT slots
/// and directly) are charged to the standard library's code that makes
/// them, never to the allocator shims, and every figure of the whole
/// process is what it is without charging.
#[test]
fn a_rust_program_is_charged_to_the_code_that_allocates() {
    let dir = scratch("rust-charge");
    let exe = dir.join("collections");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let src = testbins_dir().join("rust/collections.rs");
    let o = std::process::Command::new(rustc)
        .args(["-O", "-g", "--edition", "2021"])
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(o.status.success(), "rustc: {}", String::from_utf8_lossy(&o.stderr));
    let doc = sites_json(&exe, &[]);
    let shims: Vec<String> = doc["wrappers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["function"].as_str().unwrap().to_string())
        .filter(|f| f.starts_with("__rustc::"))
        .collect();
    assert!(shims.iter().any(|f| f == "__rustc::__rust_alloc"), "the allocator shims are wrappers: {shims:?}");
    let original = run_program(&exe, &[], &[]);
    let mut totals = Vec::new();
    for (name, flags) in [("own", &[OWN][..]), ("charged", &[][..])] {
        let patched = dir.join(format!("collections-{name}"));
        patch_to(&exe, &patched, flags);
        let counters = counters_dir(&format!("rust-charge-{name}"));
        let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
        assert_eq!(run_program(&patched, &[], &env), original, "{name}: the program behaves as the original");
        let rep = report(only_counters_file(&counters).to_str().unwrap(), &counters);
        let rows = rep["sites"].as_array().unwrap();
        let sum = |free: bool, field: &str| -> u64 {
            rows.iter().filter(|r| (r["kind"] == "free") == free).map(|r| r[field].as_u64().unwrap_or(0)).sum()
        };
        totals.push((sum(false, "calls"), sum(false, "bytes"), sum(false, "live_calls"), sum(true, "calls")));
        if name == "charged" {
            let at_shims: u64 = rows
                .iter()
                .filter(|r| r["kind"] != "free" && r["function"].as_str().is_some_and(|f| shims.iter().any(|s| s == f)))
                .map(|r| r["bytes"].as_u64().unwrap())
                .sum();
            assert_eq!(at_shims, 0, "no bytes charged to the allocator shims");
        }
    }
    assert!(totals[0].0 > 1000, "the program allocates: {totals:?}");
    assert_eq!(totals[0], totals[1], "calls, bytes, live objects and frees are the same charged or not");

    // With call chains: the allocations made in the standard library's
    // plumbing (RawVec growth, hashbrown's rehash, format) are charged to
    // their first caller outside it, the program's main, at its lines
    // (rows of main's own code count as they are: plumbing inlined into
    // it, and its calls of plumbing that was not inlined, which are hooks).
    let patched = dir.join("collections-charged");
    let counters = counters_dir("rust-charge-callers");
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", "8"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
    assert_eq!(run_program(&patched, &[], &env), original);
    let file = only_counters_file(&counters);
    let o = alloctramp().args(["report", "--callers", "--format", "json"]).arg(&file).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    let (mut total, mut in_main) = (0u64, 0u64);
    let mut lines = std::collections::BTreeSet::new();
    let in_main_source = |f: &Value| {
        f["function"] == "collections::main" && f["file"].as_str().is_some_and(|p| p.ends_with("collections.rs"))
    };
    for s in doc["sites"].as_array().unwrap().iter().filter(|s| s["kind"] != "free") {
        total += s["bytes"].as_u64().unwrap();
        if in_main_source(s) {
            // Plumbing inlined into main: the row is main's line.
            in_main += s["bytes"].as_u64().unwrap();
            lines.insert(s["line"].as_u64().unwrap());
            continue;
        }
        for c in s["callers"].as_array().unwrap() {
            let Some(i) = c["outside_plumbing"].as_u64() else { continue };
            let f = &c["frames"][i as usize];
            if in_main_source(f) {
                in_main += c["bytes"].as_u64().unwrap();
                lines.insert(f["line"].as_u64().unwrap());
            }
        }
    }
    assert!(in_main * 10 >= total * 9, "at least 90% of the bytes charged to main's lines: {in_main} of {total}");
    assert!(lines.len() >= 3, "format!, the map's growth and collect are lines of their own: {lines:?}");
}

/// Exceptions and panics thrown by a function a trampoline calls unwind
/// through the trampoline (its unwind entry) into the site's function, as
/// in the original, with profiling on: past hooks (which C++ and Rust
/// files get since trampolines carry unwind entries), past counting
/// trampolines (`operator new` throwing `std::bad_alloc`). The runtime's
/// personality routine undoes what the trampoline did before the call: a
/// call that threw counts as failed, a hook's charge is cleared, so later
/// calls are charged exactly. A thread cancelled inside a hooked call
/// (a forced unwind) runs its cleanup handlers.
#[test]
fn exceptions_and_panics_unwind_through_trampolines_as_in_the_original() {
    let dir = scratch("unwind-charge");
    let src = testbins_dir().join("unwind");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let builds: [(&str, Vec<std::ffi::OsString>); 4] = [
        ("panics", vec![rustc, "-O".into(), "-g".into(), src.join("panics.rs").into()]),
        ("throws", vec!["g++".into(), "-O2".into(), "-g".into(), src.join("throws.cpp").into()]),
        ("badalloc", vec!["g++".into(), "-O2".into(), "-g".into(), src.join("badalloc.cpp").into()]),
        ("cancel", vec!["gcc".into(), "-O2".into(), "-g".into(), "-pthread".into(), src.join("cancel.c").into()]),
    ];
    // Panic messages carry no backtrace, whatever the caller's setting.
    let quiet = [("RUST_BACKTRACE", "0")];
    let mut totals: BTreeMap<&str, u64> = BTreeMap::new();
    for (name, argv) in builds {
        let exe = dir.join(name);
        let o = std::process::Command::new(&argv[0]).args(&argv[1..]).arg("-o").arg(&exe).output().unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let doc = sites_json(&exe, &[]);
        let charges: Vec<&str> = doc["sites"].as_array().unwrap().iter().filter_map(|s| s["charge"].as_str()).collect();
        // A file that unwinds through its calls gets hooks, and wrappers
        // that may throw are charged to their callers.
        let want = if name == "badalloc" { "caller" } else { "hook" };
        assert!(charges.contains(&want), "{name}: a {want} site in {charges:?}");
        let original = run_program(&exe, &[], &quiet);
        assert_eq!(original.2, 0, "{name}: {original:?}");
        for variant in ["", "--no-wrappers"] {
            let patched = dir.join(format!("{name}-patched{variant}"));
            let extra: Vec<&str> = Some(variant).filter(|v| !v.is_empty()).into_iter().collect();
            patch_to(&exe, &patched, &extra);
            let counters = counters_dir(&format!("unwind-{name}{variant}"));
            let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap()), quiet[0]];
            let got = run_program(&patched, &[], &env);
            // stderr names the panicking thread by its id: stdout and the
            // status are compared.
            assert_eq!(
                (&got.0, got.2),
                (&original.0, original.2),
                "{name}{variant}: the patched program unwinds as the original"
            );
            let file = only_counters_file(&counters);
            let doc = report(file.to_str().unwrap(), &counters);
            let f = figures(&doc);
            let sites = doc["sites"].as_array().unwrap().iter();
            let allocs: u64 = sites.filter(|s| s["kind"] != "free").map(|s| s["calls"].as_u64().unwrap()).sum();
            if variant.is_empty() {
                totals.insert(name, allocs);
            } else {
                // Hooks move charges and lose none: with no wrappers every
                // allocation is counted at the allocator's own call.
                assert_eq!(totals[name], allocs, "{name}: allocation calls with hooks and without wrappers");
            }
            match (name, variant) {
                ("throws", "") => {
                    // make_name's malloc is charged to main's call, also
                    // after the call that threw (i == 3).
                    assert_eq!(f[&("throws.cpp".to_string(), 18, "make_name".to_string())], (6, 192, 0));
                    assert_eq!(f[&("throws.cpp".to_string(), 9, "malloc".to_string())], (0, 0, 0));
                }
                ("panics", "") => {
                    let mk = f.iter().find(|(k, _)| k.0 == "panics.rs" && k.1 == 12).map(|(_, v)| v.0);
                    assert!(mk.is_some_and(|calls| calls >= 9), "panics: format! is charged to mk: {f:?}");
                }
                ("cancel", "") => {
                    // The worker's call to make_and_wait takes its malloc
                    // (strlen("hello") + 16 bytes, never freed). The
                    // cancellation's forced unwind walked through the
                    // hook's trampoline to the cleanup handler's frame.
                    assert_eq!(f[&("cancel.c".to_string(), 20, "make_and_wait".to_string())], (1, 21, 0));
                    assert_eq!(f[&("cancel.c".to_string(), 11, "malloc".to_string())], (0, 0, 0));
                }
                ("badalloc", _) => {
                    // Two of eight calls throw std::bad_alloc: the runtime's
                    // personality routine counts them as failed, with their
                    // bytes, so nothing stays live. take() is charged to
                    // main's call; its own site counts the call made through
                    // a pointer (with no wrappers, every call).
                    let requested = 2 * (1u64 << 62) + 64 * (1 + 2 + 3 + 5 + 6 + 7);
                    let row = |line: u64| {
                        let rows = doc["sites"].as_array().unwrap();
                        let r = rows.iter().find(|s| s["kind"] == "alloc" && s["line"] == line).expect("a row");
                        ["calls", "bytes", "failed", "live_calls", "live_bytes", "freed_objects"]
                            .map(|k| r[k].as_u64().unwrap())
                    };
                    if variant.is_empty() {
                        assert_eq!(row(16), [8, requested, 2, 0, 0, 6], "badalloc: main's call of take");
                        assert_eq!(row(9), [1, 100, 0, 0, 0, 1], "badalloc: take's own site, called through a pointer");
                    } else {
                        assert_eq!(row(9), [9, requested + 100, 2, 0, 0, 7], "badalloc{variant}: take's own site");
                    }
                }
                _ => {}
            }
        }
    }
}

/// A program that links libstdc++ statically defines the operators it
/// calls: its `operator new[]` calls its `operator new`, which calls
/// `malloc`; its `operator delete[]` and sized delete call its `operator
/// delete`, which calls `free`. Each allocation and free counts once, at
/// the program's line; the calls inside the operators count only what
/// reaches them without a site (operator new through a pointer).
#[test]
fn a_program_s_own_operators_count_each_allocation_once() {
    let dir = scratch("static-cxx");
    let exe = build_source("charge/static_cxx.cpp", &dir);
    let patched = dir.join("static_cxx-patched");
    patch_to(&exe, &patched, &[]);
    let counters = counters_dir("static-cxx");
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
    let original = run_program(&exe, &[], &[]);
    let got = run_program(&patched, &[], &env);
    assert_eq!((&got.0, got.2), (&original.0, 0), "{}", got.1);
    let doc = report(only_counters_file(&counters).to_str().unwrap(), &counters);
    let rows: Vec<&Value> =
        doc["sites"].as_array().unwrap().iter().filter(|s| s["calls"].as_u64().unwrap() > 0).collect();
    let num = |s: &Value, k: &str| s[k].as_u64().unwrap();
    // The program's lines: exactly their markers.
    for m in site_marks("charge/static_cxx.cpp") {
        let r = rows.iter().find(|s| s["line"] == m.line && s["kind"] == "alloc").expect("a row");
        assert_eq!((num(r, "calls"), num(r, "bytes")), (m.calls, m.bytes), "line {}", m.line);
        assert_eq!(Some((num(r, "live_calls"), num(r, "live_bytes"))), m.live, "line {}", m.line);
    }
    // Every free once, at main's calls: 10 delete[], 8 sized deletes, 5
    // deletes of the blocks from the pointer.
    let frees: BTreeMap<String, u64> = rows
        .iter()
        .filter(|s| s["kind"] == "free")
        .map(|s| (format!("{} {}", s["function"].as_str().unwrap(), s["line"]), num(s, "calls")))
        .collect();
    let want: BTreeMap<String, u64> =
        [("main 30", 10), ("main 37", 8), ("main 42", 5)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    assert_eq!(frees, want);
    // Inside the operators: only the malloc that the pointer's calls
    // reached; besides, libstdc++'s start-up pool.
    let inner: Vec<(String, u64, u64)> = rows
        .iter()
        .filter(|s| s["kind"] == "alloc" && s["line"].is_null())
        .map(|s| (s["function"].as_str().unwrap().to_string(), num(s, "calls"), num(s, "bytes")))
        .collect();
    let layer = inner.iter().find(|r| r.0 == "operator new(unsigned long)");
    assert_eq!(layer.map(|r| (r.1, r.2)), Some((5, 240)), "{inner:?}");
    let others: Vec<_> = inner.iter().filter(|r| r.0 != "operator new(unsigned long)").collect();
    assert!(others.len() == 1 && others[0].0.contains("eh_alloc") && others[0].1 == 1, "{inner:?}");
    assert_eq!(num(&doc["totals"], "calls"), 20 + 8 + 5 + 1);
    assert_eq!(num(&doc["totals"], "free_calls"), 10 + 8 + 5);
    assert_eq!(num(&doc["totals"], "untracked_frees"), 0);
}
