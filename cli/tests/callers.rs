//! Callers capture: the call chains that reach a site, recorded with the
//! unwind rows the patcher builds from `.eh_frame`, switched on from the
//! start (ALLOCTRAMP_CALLERS) and on a running process (`alloctramp
//! callers PID on|off`), shown by `report --callers`. Exact chains of
//! `testbins/callers.c` in every build configuration.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, only_counters_file};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// `@frame NAME` lines of callers.c.
fn frame_lines() -> BTreeMap<String, u32> {
    frame_lines_of("callers.c")
}

/// `@frame NAME` lines of a test program's source.
fn frame_lines_of(file: &str) -> BTreeMap<String, u32> {
    let src = std::fs::read_to_string(testbins_dir().join(file)).unwrap();
    let mut m = BTreeMap::new();
    for (i, l) in src.lines().enumerate() {
        if let Some(at) = l.find("/* @frame ") {
            let name = l[at + 10..].split_whitespace().next().unwrap().to_string();
            m.insert(name, i as u32 + 1);
        }
    }
    m
}

/// (frames as "function:line" strings, calls, bytes) of the malloc site's
/// chains, from `report --callers --format json`.
type Chains = Vec<(Vec<String>, u64, u64)>;

/// `report --callers --format json` of a counters file.
fn callers_report(file: &Path, dir: &Path) -> Value {
    let o =
        alloctramp().args(["report", "--callers", "--format", "json", "--dir"]).arg(dir).arg(file).output().unwrap();
    assert!(o.status.success(), "report --callers: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// A chain's frames as "function:line", or "[module]" where the frame
/// has no line.
fn frame_names(chain: &Value) -> Vec<String> {
    chain["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| match (f["function"].as_str(), f["line"].as_u64()) {
            (Some(func), Some(line)) => format!("{func}:{line}"),
            _ => format!("[{}]", f["module"].as_str().unwrap_or("?").rsplit('/').next().unwrap()),
        })
        .collect()
}

/// The test program `name` built in `config`, patched with no option into
/// a directory of its own: the patched program and the original's output.
fn patched(config: Config, name: &str) -> (std::path::PathBuf, (String, String, i32)) {
    let b = built(config);
    let dir = b.dir.join(format!("patched-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join(name);
    patch_to(&b.path(name), &bin, &[]);
    (bin, run_program(&b.path(name), &[], &[]))
}

fn chains_of(file: &Path, dir: &Path) -> (Chains, Value) {
    let doc = callers_report(file, dir);
    let site =
        doc["sites"].as_array().unwrap().iter().find(|s| s["entry"] == "malloc").expect("the malloc site").clone();
    let mut chains: Chains = site["callers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (frame_names(c), c["calls"].as_u64().unwrap(), c["bytes"].as_u64().unwrap()))
        .collect();
    chains.sort();
    (chains, site)
}

/// The malloc site's chains at `depth` frames. Above main they go on
/// through the C library (the patched program carries its unwind rows)
/// to the program's `_start`; with `--no-library-unwind` they end at the
/// first frame in the C library.
fn expected(scale: u64, depth: usize, library_rows: bool) -> Chains {
    let l = frame_lines();
    let libc = "[libc.so.6]".to_string();
    let above: Vec<String> = if library_rows { vec![libc.clone(), libc, "[callers]".to_string()] } else { vec![libc] };
    let chain = |first: String, main: &str| {
        let mut v = vec![first, format!("main:{}", l[main])];
        v.extend(above.iter().cloned());
        v.truncate(depth);
        v
    };
    let mut v: Chains = vec![
        (chain(format!("from_a:{}", l["a"]), "main1"), 3 * scale, 48 * scale),
        (chain(format!("from_b:{}", l["b"]), "main2"), 5 * scale, 160 * scale),
        (chain(format!("from_a:{}", l["a"]), "main3"), 3 * scale, 48 * scale),
    ];
    v.sort();
    v
}

fn check_callers(config: Config) {
    let b = built(config);
    let dir = b.dir.join("patched-callers");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("callers");
    patch_to(&b.path("callers"), &bin, &[]);
    let bare = dir.join("callers-no-library-unwind");
    patch_to(&b.path("callers"), &bare, &["--no-library-unwind"]);
    let original = run_program(&b.path("callers"), &[], &[]);
    for (exe, library_rows, live, depth) in
        [(&bin, true, "1", "on"), (&bin, true, "0", "8"), (&bare, false, "0", "4"), (&bare, false, "1", "8")]
    {
        let what = format!("{} library rows={library_rows} live={live} depth={depth}", config.name());
        let counters = counters_dir(&format!("{}-callers-{library_rows}-{live}-{depth}", config.name()));
        let env = [
            ("ALLOCTRAMP", "on"),
            ("ALLOCTRAMP_LIVE", live),
            ("ALLOCTRAMP_CALLERS", depth),
            ("ALLOCTRAMP_DIR", counters.to_str().unwrap()),
        ];
        assert_eq!(run_program(exe, &[], &env), original, "{what}: the program behaves as the original");
        let file = only_counters_file(&counters);
        let (chains, site) = chains_of(&file, &counters);
        let frames = if depth == "on" { 4 } else { depth.parse().unwrap() };
        assert_eq!(chains, expected(1, frames, library_rows), "{what}: the malloc site's chains");
        assert_eq!(site["calls"], 11, "{what}: the site's own count");
        let sum: u64 = chains.iter().map(|c| c.1).sum();
        assert_eq!(sum, 11, "the chains' calls add up to the site's");
    }
    // Without ALLOCTRAMP_CALLERS nothing is recorded.
    let counters = counters_dir(&format!("{}-callers-none", config.name()));
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
    assert_eq!(run_program(&bin, &[], &env), original);
    let (chains, _) = chains_of(&only_counters_file(&counters), &counters);
    assert!(chains.is_empty(), "no chains unless asked: {chains:?}");
}

mod exact_chains {
    crate::matrix!(super::check_callers);
}

/// Four threads reach one malloc site at once through four chains
/// (`testbins/callers_threads.c`): each chain's calls and bytes are exact,
/// whether its calls are recognised from the site's last chain or unwound
/// (the threads keep replacing it), at -O0 (frames found through rbp) and
/// -O2 (through the stack pointer).
fn check_threaded_chains(config: Config) {
    let (bin, original) = patched(config, "callers_threads");
    for depth in ["2", "4"] {
        let counters = counters_dir(&format!("{}-callers-threads-{depth}", config.name()));
        let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", depth), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
        assert_eq!(run_program(&bin, &[], &env), original, "{}: the program behaves as the original", config.name());
        let doc = callers_report(&only_counters_file(&counters), &counters);
        assert_eq!(doc["callers_lost"], 0, "{}: no chain lost", config.name());
        let site = doc["sites"].as_array().unwrap().iter().find(|s| s["entry"] == "malloc").unwrap();
        let mut got: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for c in site["callers"].as_array().unwrap() {
            let frames = c["frames"].as_array().unwrap();
            // path<t> <- worker <- the C library's thread start and clone
            // (through the rows the program carries for it).
            assert_eq!(frames.len(), depth.parse::<usize>().unwrap(), "{}: {c}", config.name());
            let names: Vec<&str> = frames.iter().map(|f| f["function"].as_str().unwrap_or("?")).collect();
            assert_eq!(names[1], "worker", "{}: {names:?}", config.name());
            for f in frames.iter().skip(2) {
                assert!(f["module"].as_str().unwrap().ends_with("/libc.so.6"), "{}: {c}", config.name());
            }
            let e = got.entry(names[0].to_string()).or_default();
            e.0 += c["calls"].as_u64().unwrap();
            e.1 += c["bytes"].as_u64().unwrap();
        }
        let want: BTreeMap<String, (u64, u64)> =
            (0..4u64).map(|t| (format!("path{t}"), (20_000, 20_000 * 16 * (t + 1)))).collect();
        assert_eq!(got, want, "{} depth {depth}: each thread's chain, exactly", config.name());
    }
}

/// `program` (default build) patched with and without the libraries'
/// unwind rows, run with call chains recorded: for each (`true`: with
/// them), the chains of its malloc site, which makes 3 calls, and the line
/// of its `@frame MARK` marker.
fn chains_with_and_without_library_rows(program: &str, mark: &str) -> (u64, Vec<(bool, Vec<Value>)>) {
    let b = built(Config::default_o2());
    let dir = b.dir.join(format!("patched-{program}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = std::fs::read_to_string(testbins_dir().join(format!("{program}.c"))).unwrap();
    let line = src.lines().position(|l| l.contains(&format!("@frame {mark}"))).unwrap() as u64 + 1;
    let mut out = Vec::new();
    for (flags, through) in [(&[][..], true), (&["--no-library-unwind"][..], false)] {
        let bin = dir.join(format!("{program}-{through}"));
        patch_to(&b.path(program), &bin, flags);
        let counters = counters_dir(&format!("{program}-{through}"));
        let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", "8"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
        assert_eq!(run_program(&bin, &[], &env), run_program(&b.path(program), &[], &[]));
        let (_, site) = chains_of(&only_counters_file(&counters), &counters);
        let chains = site["callers"].as_array().unwrap().clone();
        let calls: u64 = chains.iter().map(|c| c["calls"].as_u64().unwrap()).sum();
        assert_eq!(calls, 3, "{site}");
        out.push((through, chains));
    }
    (line, out)
}

/// A chain through the C library's qsort (`testbins/callers_qsort.c`):
/// the comparison function's allocations are charged, through qsort's own
/// frames, to the call of qsort in sort_them; without the library's rows
/// the chains end at qsort's first frame.
#[test]
fn chains_go_on_through_the_c_library() {
    let (line, runs) = chains_with_and_without_library_rows("callers_qsort", "qsort");
    for (through, chains) in runs {
        for c in &chains {
            let frames = c["frames"].as_array().unwrap();
            let first = &frames[0];
            assert!(first["module"].as_str().unwrap().ends_with("/libc.so.6"), "qsort calls cmp: {c}");
            let at = frames.iter().position(|f| {
                f["function"].as_str().is_some_and(|n| n.starts_with("sort_them")) && f["line"].as_u64() == Some(line)
            });
            if through {
                let at = at.unwrap_or_else(|| panic!("the chain reaches sort_them's call of qsort: {c}"));
                assert!(frames[1..at].iter().all(|f| f["module"].as_str().unwrap().ends_with("/libc.so.6")), "{c}");
                assert_eq!(frames[at + 1]["function"], "main", "{c}");
            } else {
                assert_eq!(frames.len(), 1, "the chain ends in the C library: {c}");
            }
        }
    }
}

/// A chain through two unpatched libraries, one needed only by the other
/// (`callers_deep`): the program carries both libraries' rows, so the chain
/// goes from the callback's malloc through libcbinner.so and libcbouter.so
/// back to main's call; without them it ends in libcbinner.so.
#[test]
fn chains_go_on_through_a_library_that_a_library_needs() {
    let (line, runs) = chains_with_and_without_library_rows("callers_deep", "outer_apply");
    for (through, chains) in runs {
        for c in &chains {
            let frames = c["frames"].as_array().unwrap();
            let module = |i: usize| frames[i]["module"].as_str().unwrap().rsplit('/').next().unwrap().to_string();
            assert_eq!(module(0), "libcbinner.so", "inner_apply calls grow: {c}");
            if through {
                assert_eq!(module(1), "libcbouter.so", "{c}");
                assert_eq!(frames[2]["function"], "main", "{c}");
                assert_eq!(frames[2]["line"].as_u64(), Some(line), "{c}");
            } else {
                assert_eq!(frames.len(), 1, "the chain ends in libcbinner.so: {c}");
            }
        }
    }
}

/// How the malloc site's chains of `callers_dlopen` end, as calls: at the
/// first library frame (inner_apply's), at the second (outer_apply's), and
/// through both libraries to round_of_three's call of outer_apply (`line`).
/// Any other chain fails the test: rows never describe what they were not
/// opened for. With `names`, the library frames must be named after their
/// libraries (frames are named from the mappings recorded last: not once
/// the libraries moved, for chains recorded before).
fn dlopen_chain_ends(pid: &str, dir: &Path, line: u64, names: bool) -> [u64; 3] {
    let (_, site) = chains_of(Path::new(pid), dir);
    let mut ends = [0; 3];
    for c in site["callers"].as_array().unwrap() {
        let frames = c["frames"].as_array().unwrap();
        let module = |i: usize| frames[i]["module"].as_str().unwrap().rsplit('/').next().unwrap().to_string();
        let libraries = frames.len().min(2);
        if names {
            let want = ["libcbinner.so", "libcbouter.so"];
            assert_eq!((0..libraries).map(module).collect::<Vec<_>>(), want[..libraries], "{c}");
        }
        if frames.len() > 2 {
            assert_eq!(frames[2]["function"], "round_of_three", "{c}");
            assert_eq!(frames[2]["line"].as_u64(), Some(line), "{c}");
        }
        ends[frames.len().min(3) - 1] += c["calls"].as_u64().unwrap();
    }
    ends
}

/// A chain through libraries the program loaded with `dlopen`
/// (`testbins/callers_dlopen.c`), which the patched program carries no rows
/// for: recorded from the start, its chains end at the first library frame;
/// `alloctramp callers PID on` writes the process's unwind file, and from
/// then on they go on through both libraries to the program's call. Once
/// the libraries are unloaded and loaded again in the other order, rows
/// opened for a library serve only that library where it was: a chain
/// ends where a library moved, exactly, until `callers on` again.
#[test]
fn chains_go_on_through_libraries_loaded_with_dlopen() {
    let b = built(Config::default_o2());
    let (bin, _) = patched(Config::default_o2(), "callers_dlopen");
    let dir = counters_dir("callers-dlopen");
    let line = u64::from(frame_lines_of("callers_dlopen.c")["outer_apply"]);
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", "8"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())];
    let mut t = Talk::start(&bin, &[b.dir.to_str().unwrap()], &env);
    let pid = t.child.id().to_string();
    let ask = |t: &mut Talk, c: &str| {
        t.send(c);
        t.line().trim().to_string()
    };
    let mut seen = [0u64; 3];
    let mut round = |t: &mut Talk, want: [u64; 3], names: bool, what: &str| {
        assert!(ask(t, "round").starts_with("done "));
        let now = dlopen_chain_ends(&pid, &dir, line, names);
        let got = [now[0] - seen[0], now[1] - seen[1], now[2] - seen[2]];
        assert_eq!(got, want, "{what}: calls whose chains end at libcbinner.so, at libcbouter.so, go through");
        seen = now;
    };
    let callers_on = |pid: &str| {
        let o = alloctramp().args(["callers", "--depth", "8", "--dir"]).arg(&dir).arg(pid).arg("on").output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };

    round(&mut t, [3, 0, 0], true, "before the unwind file");
    let said = callers_on(&pid);
    // Both libraries, and others the program carries no rows for (the
    // dynamic linker).
    let more: u32 = said.split("chains go on through ").nth(1).and_then(|r| r.split(' ').next()?.parse().ok()).unwrap();
    assert!(more >= 2, "{said}");
    let file = std::fs::read(dir.join(format!("{pid}.unwind"))).unwrap();
    for lib in ["/libcbouter.so\0", "/libcbinner.so\0"] {
        assert!(file.windows(lib.len()).any(|w| w == lib.as_bytes()), "the unwind file names {lib}");
    }
    round(&mut t, [0, 0, 3], true, "with the unwind file's rows");

    let before = ask(&mut t, "maps");
    assert_eq!(ask(&mut t, "swap"), "done");
    let after = ask(&mut t, "maps");
    let bases = |l: &str| l.split_whitespace().skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>();
    let (was, now) = (bases(&before), bases(&after));
    let want = match (now[0] == was[0], now[1] == was[1]) {
        (_, false) => [3, 0, 0],
        (false, true) => [0, 3, 0],
        (true, true) => [0, 0, 3],
    };
    let moved = want != [0, 0, 3];
    let unloaded = || callers_report(Path::new(&pid), &dir)["callers_unloaded"].as_u64().unwrap();
    round(&mut t, want, !moved, &format!("reloaded: {before} -> {after}"));
    // A walk that reached rows of a library no longer where they were
    // built for is counted: in libcbouter.so's old place, libcbinner.so's
    // frame (the libraries swapped places, as they do when the address
    // space has no other hole for them).
    let stale = unloaded();
    if (now[0].as_str(), now[1].as_str()) == (was[1].as_str(), was[0].as_str()) {
        assert!(stale > 0, "{before} -> {after}");
    } else if !moved {
        assert_eq!(stale, 0);
    }
    callers_on(&pid);
    round(&mut t, [0, 0, 3], !moved, "rows built again");
    assert_eq!(unloaded(), stale, "rows built for what is loaded now");

    t.send("quit");
    let (rest, code) = t.finish();
    assert_eq!(code, Some(0), "{rest}");
}

/// A callback that allocates while a hook's call is under way
/// (`testbins/callers_hook.c`): its chains go on through the hook's
/// trampoline as if the hook's site had made the call, to the hook's
/// caller and on, exactly, in every build configuration.
fn check_chains_through_a_hook(config: Config) {
    let (bin, original) = patched(config, "callers_hook");
    let l = frame_lines_of("callers_hook.c");
    let visit = program("callers_hook").markers.iter().find(|m| m.calls == 3 && m.bytes == 51).unwrap().line;
    for depth in ["2", "4", "8"] {
        let what = format!("{} depth {depth}", config.name());
        let counters = counters_dir(&format!("{}-callers-hook-{depth}", config.name()));
        let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", depth), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
        assert_eq!(run_program(&bin, &[], &env), original, "{what}: the program behaves as the original");
        let doc = callers_report(&only_counters_file(&counters), &counters);
        let site = doc["sites"].as_array().unwrap().iter().find(|s| s["line"].as_u64() == Some(visit.into())).unwrap();
        let chains = site["callers"].as_array().unwrap();
        assert_eq!(chains.len(), 1, "{what}: one chain: {site}");
        let c = &chains[0];
        assert_eq!((c["calls"].as_u64(), c["bytes"].as_u64()), (Some(3), Some(51)), "{what}: {c}");
        let frames = frame_names(c);
        let want = [format!("build:{}", l["cb"]), format!("run:{}", l["hook"]), format!("main:{}", l["main"])];
        if depth == "2" {
            // The last frame, at the depth limit, is named through the hook too.
            assert_eq!(frames, want[..2], "{what}: {c}");
            continue;
        }
        assert_eq!(frames[..3], want, "{what}: {c}");
        assert_eq!(frames[3], "[libc.so.6]", "{what}: {c}");
        assert_eq!(frames.len(), if depth == "4" { 4 } else { 6 }, "{what}: through the C library to _start: {c}");
    }
}

mod chains_through_a_hook {
    crate::matrix!(super::check_chains_through_a_hook);
}

mod threaded_chains {
    #[test]
    fn o0_pie() {
        super::check_threaded_chains(crate::util::Config { opt: "-O0", pie: true, extra: "" });
    }
    #[test]
    fn o2_pie() {
        super::check_threaded_chains(crate::util::Config::default_o2());
    }
}

/// `report --callers` in text: the chains under the site's tag, `#` lines
/// after the table.
#[test]
fn text_report_lists_chains_after_the_table() {
    let b = built(Config::default_o2());
    let dir = b.dir.join("patched-callers-text");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("callers");
    patch_to(&b.path("callers"), &bin, &[]);
    let counters = counters_dir("callers-text");
    let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", "2"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
    run_program(&bin, &[], &env);
    let file = only_counters_file(&counters);
    let o = alloctramp().args(["report", "--callers", "--dir"]).arg(&counters).arg(&file).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let l = frame_lines();
    // Paths are as DWARF gives them (absolute).
    let want =
        ["from_b (".to_string(), format!("callers.c:{}) <- main (", l["b"]), format!("callers.c:{})", l["main2"])];
    let line = text
        .lines()
        .find(|x| want.iter().all(|w| x.contains(w.as_str())) && x.ends_with(&want[2]))
        .unwrap_or_else(|| panic!("a chain line with {want:?}:\n{text}"));
    assert!(line.starts_with('#'), "{line}");
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!((words[1], words[2]), ("5", "160"), "{line}");
}

/// Sum of the chains' calls per site (entry name, line) of a running
/// process, and the site's own calls.
fn chain_sums(pid: &str, dir: &Path) -> BTreeMap<(String, u64), (u64, u64, bool)> {
    let o = alloctramp().args(["report", "--callers", "--format", "json", "--dir"]).arg(dir).arg(pid).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut m = BTreeMap::new();
    for s in doc["sites"].as_array().unwrap() {
        let chains = s["callers"].as_array().unwrap();
        let sum: u64 = chains.iter().map(|c| c["calls"].as_u64().unwrap()).sum();
        // Every chain's first frame is a function of server.c, by name and line.
        let named = chains.iter().all(|c| {
            let f = &c["frames"][0];
            f["function"].is_string() && f["file"].as_str().is_some_and(|p| p.ends_with("server.c"))
        });
        let key = (s["entry"].as_str().unwrap().to_string(), s["line"].as_u64().unwrap_or(0));
        m.insert(key, (s["calls"].as_u64().unwrap(), sum, named));
    }
    m
}

/// `alloctramp callers PID on|off` on a running process: chains are
/// recorded only while on, add up to the calls made meanwhile, and a reset
/// zeroes them with the counters.
#[test]
fn switched_on_and_off_in_a_running_process() {
    let mut s = crate::runtime::Server::start("callers-live", &[("ALLOCTRAMP", "on")]);
    assert_eq!(s.cmd("round"), "done");
    let before = chain_sums(&s.pid(), &s.dir);
    assert!(before.values().all(|&(calls, sum, _)| calls > 0 || sum == 0));
    assert!(before.values().all(|&(_, sum, _)| sum == 0), "nothing recorded before: {before:?}");

    let on = alloctramp().args(["callers", "--dir"]).arg(&s.dir).arg(s.pid()).arg("on").output().unwrap();
    assert!(on.status.success(), "{}", String::from_utf8_lossy(&on.stderr));
    assert!(String::from_utf8_lossy(&on.stderr).contains("recording call chains of 4 frames"));
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.cmd("round"), "done");
    let during = chain_sums(&s.pid(), &s.dir);
    for (k, &(calls, sum, named)) in &during {
        let (was, _, _) = before[k];
        assert_eq!(sum, calls - was, "{k:?}: the chains count the calls made while on");
        assert!(named, "{k:?}: frames named from the program's DWARF");
    }
    assert!(during.values().any(|&(_, sum, _)| sum >= 10), "round's malloc(100) x5, twice: {during:?}");

    let off = alloctramp().args(["callers", "--dir"]).arg(&s.dir).arg(s.pid()).arg("off").output().unwrap();
    assert!(off.status.success(), "{}", String::from_utf8_lossy(&off.stderr));
    assert_eq!(s.cmd("round"), "done");
    let after = chain_sums(&s.pid(), &s.dir);
    for (k, &(calls, sum, _)) in &after {
        assert_eq!(sum, during[k].1, "{k:?}: nothing recorded once off");
        assert!(calls >= during[k].0);
    }
    assert!(s.switch("reset").status.success());
    let reset = chain_sums(&s.pid(), &s.dir);
    assert!(reset.values().all(|&(calls, sum, _)| calls == 0 && sum == 0), "reset: {reset:?}");
    s.quit();
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The Debian redis-server, patched with no option and run with profiling
/// and callers capture on from the start under redis-benchmark: the chains
/// of its busiest site add up to the site's calls, none lost.
#[test]
fn redis_busiest_site_callers_add_up_to_its_calls() {
    if !(have("redis-server") && have("redis-benchmark") && have("redis-cli")) {
        skip(test_name(), "redis-server and redis-tools are not installed");
        return;
    }
    let real = std::fs::canonicalize(which("redis-server")).unwrap();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("redis-callers");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // redis picks its mode from the name it runs under.
    let bin = dir.join("redis-server");
    patch_to(&real, &bin, &[]);
    let counters = counters_dir("redis-callers");
    let port = free_port().to_string();
    let mut server = std::process::Command::new(&bin)
        .args(["--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no"])
        .env("ALLOCTRAMP", "on")
        .env("ALLOCTRAMP_CALLERS", "on")
        .env("ALLOCTRAMP_DIR", &counters)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let cli = |args: &[&str]| std::process::Command::new("redis-cli").args(["-p", &port]).args(args).output().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while String::from_utf8_lossy(&cli(&["ping"]).stdout).trim() != "PONG" {
        assert!(std::time::Instant::now() < deadline, "redis-server did not answer");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let bench = std::process::Command::new("redis-benchmark")
        .args(["-p", &port, "-n", "5000", "-q", "-t", "set,get,lpush,lpop,hset,sadd"])
        .output()
        .unwrap();
    assert!(bench.status.success(), "redis-benchmark: {}", String::from_utf8_lossy(&bench.stderr));
    cli(&["shutdown", "nosave"]);
    let status = server.wait().unwrap();
    assert!(status.success(), "redis-server exits cleanly: {status:?}");

    let doc = callers_report(&only_counters_file(&counters), &counters);
    assert_eq!(doc["callers_lost"], 0, "every chain found a slot");
    let busiest = doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["kind"] != "free")
        .max_by_key(|s| s["calls"].as_u64().unwrap())
        .unwrap();
    let calls = busiest["calls"].as_u64().unwrap();
    let chains = busiest["callers"].as_array().unwrap();
    let sum: u64 = chains.iter().map(|c| c["calls"].as_u64().unwrap()).sum();
    assert!(calls > 10_000, "the benchmark's 30,000 requests allocate: {calls}");
    assert_eq!(sum, calls, "the chains of {} add up to its calls", busiest["function"]);
    // So do every other site's (hooks' too: the chain recorded at the hook
    // takes what the sites inside count for it), and callers tell paths
    // apart.
    let mut forked = 0;
    for s in doc["sites"].as_array().unwrap().iter().filter(|s| s["kind"] != "free") {
        let chains = s["callers"].as_array().unwrap();
        let sum: u64 = chains.iter().map(|c| c["calls"].as_u64().unwrap()).sum();
        assert_eq!(sum, s["calls"].as_u64().unwrap(), "the chains of {} at {} add up", s["function"], s["address"]);
        forked += usize::from(chains.len() >= 2);
    }
    assert!(forked >= 3, "sites reached by more than one chain: {forked}");
    // Every chain starts inside redis-server itself.
    for c in chains {
        let m = c["frames"][0]["module"].as_str().unwrap_or("");
        assert!(m.ends_with("/redis-server"), "first frame in {m}");
    }
}

fn which(tool: &str) -> std::path::PathBuf {
    let o = std::process::Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().unwrap();
    std::path::PathBuf::from(String::from_utf8_lossy(&o.stdout).trim())
}

/// `--site FILE:LINE` records the chains of that site only; a spec that
/// names no site is refused with one line.
#[test]
fn one_site_chosen_on_a_running_process() {
    let line = program("server").markers.iter().find(|m| m.entry == "malloc").unwrap().line;
    let mut s = crate::runtime::Server::start("callers-one-site", &[("ALLOCTRAMP", "on")]);
    let on = |spec: &str| {
        alloctramp()
            .args(["callers", "--dir"])
            .arg(&s.dir)
            .arg(s.pid())
            .args(["on", "--depth", "2", "--site", spec])
            .output()
            .unwrap()
    };
    let bad = on("server.c:1");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--site server.c:1: no patched site"), "{err}");
    let ok = on(&format!("server.c:{line}"));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(String::from_utf8_lossy(&ok.stderr).contains("recording call chains of 2 frames at 1 site"));
    assert_eq!(s.cmd("round"), "done");
    let sums = chain_sums(&s.pid(), &s.dir);
    for ((entry, l), &(_, sum, _)) in &sums {
        let want = if *l == u64::from(line) && entry == "malloc" { 5 } else { 0 };
        assert_eq!(sum, want, "{entry} at line {l}: chains only at the chosen site");
    }
    s.quit();
}

/// A process that never profiled but records call chains
/// (`ALLOCTRAMP_CALLERS`) gives a forked child its counters file at the
/// fork, with the chains' region (a child of a process that never profiled
/// otherwise makes it later): switched on, the child's chains count every
/// call.
#[test]
fn a_never_profiled_parent_recording_chains_forks_a_child_whose_chains_count() {
    let mut s = crate::runtime::Server::start("callers-fork", &[("ALLOCTRAMP_CALLERS", "4")]);
    assert_eq!(s.cmd("round"), "done");
    let child = s.cmd("fork").strip_prefix("child ").expect("child PID").to_string();
    assert!(s.dir.join(format!("{child}.counters")).exists(), "the child's file, made at the fork");
    let on = alloctramp().args(["enable", "--dir"]).arg(&s.dir).arg(&child).output().unwrap();
    assert!(on.status.success(), "{}", String::from_utf8_lossy(&on.stderr));
    assert_eq!(s.cmd("round"), "done");
    let sums = chain_sums(&child, &s.dir);
    for (k, &(calls, sum, named)) in &sums {
        assert_eq!(sum, calls, "{k:?}: every call has its chain");
        assert!(named || calls == 0, "{k:?}: frames named");
    }
    assert!(sums.values().any(|&(_, sum, _)| sum >= 5), "round's malloc(100) x5: {sums:?}");
    s.quit();
}
