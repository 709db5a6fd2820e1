//! Live figures: objects leave the figures of the site that allocated
//! them wherever they are freed; switching on and off midway, reset, and
//! a million objects in flight on eight threads.

use crate::patch::patch_to;
use crate::runtime::{Server, counters_dir, live_figures, only_counters_file};
use crate::util::*;
use alloctramp_trampolines::entry::{Kind, Target};
use alloctramp_trampolines::process::{ProcessFile, flags};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

type Live = BTreeMap<(String, u32, String), (u64, u64, u64)>;

/// Per site of server.c: (calls, live objects, live bytes, untracked frees).
fn server_sites(s: &Server) -> BTreeMap<u32, (u64, u64, u64, u64)> {
    let file = s.dir.join(format!("{}.counters", s.pid()));
    let bytes = counters_bytes(&file);
    let pf = ProcessFile::parse(&bytes).unwrap();
    let mut m = BTreeMap::new();
    for module in pf.modules().unwrap() {
        for (i, site) in module.table.sites().enumerate() {
            let c = module.cell(i);
            let frees = module.table.entry(site.entry as usize).unwrap().kind == Kind::Free.code();
            let (lo, lb) = if frees { (0, 0) } else { (c.live_objects(), c.live_bytes()) };
            m.insert(site.line, (c.calls, lo, lb, c.untracked_frees));
        }
    }
    m
}

fn process_flags(s: &Server) -> (bool, u32) {
    let bytes = std::fs::read(s.dir.join(format!("{}.counters", s.pid()))).unwrap();
    let pf = ProcessFile::parse(&bytes).unwrap();
    (pf.on, pf.flags)
}

/// server.c's lines: the kept malloc, the calloc and its free, the strdup
/// and its free, and the free of the kept blocks.
const MALLOC: u32 = 101;
const CALLOC: u32 = 111;
const CALLOC_FREE: u32 = 115;
const STRDUP: u32 = 117;
const STRDUP_FREE: u32 = 121;
const KEPT_FREE: u32 = 129;

fn check_lines() {
    let src = std::fs::read_to_string(testbins_dir().join("server.c")).unwrap();
    let line = |n: u32| src.lines().nth(n as usize - 1).unwrap().to_string();
    assert!(line(MALLOC).contains("@site malloc"), "server.c changed: {}", line(MALLOC));
    assert!(line(CALLOC).contains("@site calloc"));
    assert!(line(CALLOC_FREE).contains("@site free"));
    assert!(line(STRDUP).contains("@site strdup"));
    assert!(line(STRDUP_FREE).contains("@site free"));
    assert!(line(KEPT_FREE).contains("@site free"));
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn switched_on_midway_then_off_figures_still_come_down() {
    check_lines();
    let mut s = Server::start("live-midway", &[]);
    // Off: 5 blocks kept that the runtime never sees allocated.
    assert_eq!(s.cmd("round"), "done");
    assert!(s.switch("enable").status.success());
    assert_eq!(s.cmd("round"), "done");
    let m = server_sites(&s);
    assert_eq!(m[&MALLOC], (5, 5, 500, 0));
    assert_eq!(m[&CALLOC], (2, 0, 0, 0));
    assert_eq!(m[&CALLOC_FREE], (2, 0, 0, 0));
    assert_eq!(m[&STRDUP], (1, 0, 0, 0));

    // Frees of the 10 kept blocks: 5 were allocated before profiling.
    assert_eq!(s.cmd("free"), "freed");
    let m = server_sites(&s);
    assert_eq!(m[&KEPT_FREE], (10, 0, 0, 5), "5 untracked frees");
    assert_eq!(m[&MALLOC], (5, 0, 0, 0), "never negative");

    // Off with 5 tracked blocks alive: the free sites stay on, quietly.
    assert_eq!(s.cmd("round"), "done");
    assert!(s.switch("disable").status.success());
    let (on, f) = process_flags(&s);
    assert!(!on);
    assert_eq!(f & (flags::LIVE | flags::DRAINING), flags::LIVE | flags::DRAINING);
    let before = server_sites(&s);
    assert_eq!(before[&MALLOC], (10, 5, 500, 0));
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(server_sites(&s), before, "off: no figure moves");
    // The 10 kept blocks are freed: 5 were tracked, and they come down.
    assert_eq!(s.cmd("free"), "freed");
    let m = server_sites(&s);
    assert_eq!(m[&MALLOC], (10, 0, 0, 0));
    assert_eq!(m[&KEPT_FREE], before[&KEPT_FREE], "the free site's own figures stay");
    // Everything drained: the free sites went off too.
    wait_until("the drain completes", || process_flags(&s).1 & flags::DRAINING == 0);
    assert_eq!(process_flags(&s).1 & flags::INCOMPLETE, 0);
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.cmd("free"), "freed");
    assert_eq!(server_sites(&s), m, "fully off");
    s.quit();
}

#[test]
fn reset_forgets_tracked_objects_and_off_now_marks_figures_incomplete() {
    check_lines();
    let mut s = Server::start("live-reset", &[("ALLOCTRAMP", "on")]);
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(server_sites(&s)[&MALLOC], (10, 10, 1000, 0));
    assert!(s.switch("reset").status.success());
    assert!(server_sites(&s).values().all(|v| *v == (0, 0, 0, 0)), "reset zeroes every figure");
    // The 10 blocks were forgotten: their frees are untracked, nothing
    // goes negative.
    assert_eq!(s.cmd("free"), "freed");
    let m = server_sites(&s);
    assert_eq!(m[&KEPT_FREE], (10, 0, 0, 10));
    assert_eq!(m[&MALLOC], (0, 0, 0, 0));

    // Off at once with tracked blocks alive: everything off, and the
    // figures say they may overstate.
    assert_eq!(s.cmd("round"), "done");
    let o = alloctramp().arg("disable").arg("--now").arg("--dir").arg(&s.dir).arg(s.pid()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (on, f) = process_flags(&s);
    assert!(!on);
    assert_eq!(f & (flags::DRAINING | flags::INCOMPLETE), flags::INCOMPLETE);
    let m = server_sites(&s);
    assert_eq!(m[&MALLOC], (5, 5, 500, 0));
    assert_eq!(s.cmd("free"), "freed");
    assert_eq!(server_sites(&s), m, "the free sites are off: the 5 blocks still show");
    assert!(s.switch("reset").status.success());
    assert_eq!(process_flags(&s).1 & flags::INCOMPLETE, 0, "reset clears the mark");
    s.quit();
}

/// Runs a program that prints `held OBJECTS BYTES` (what it still holds
/// at exit) patched, with profiling on from the start: its output is the
/// original's, the live figures of its source's lines sum to what it
/// holds, and every free was of a tracked object.
/// `preload`: a shared library to run both programs with (`LD_PRELOAD`).
fn live_figures_equal_what_the_program_holds(name: &str, preload: Option<&Path>) -> String {
    let b = built(Config::default_o2());
    let source = program(name).src.file_name().unwrap().to_str().unwrap().to_string();
    live_figures_equal_what_it_holds(&b.path(name), &source, preload, 0)
}

/// [`live_figures_equal_what_the_program_holds`] for the program `original`
/// built from `source` (its file name), where code linked in from
/// elsewhere (a static library) still holds `outside` objects at exit.
fn live_figures_equal_what_it_holds(original: &Path, source: &str, preload: Option<&Path>, outside: u64) -> String {
    let dir = counters_dir(test_name());
    let bin = dir.join(format!("{}.bin", original.file_name().unwrap().to_str().unwrap()));
    patch_to(original, &bin, &[]);
    let mut env = vec![("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())];
    if let Some(lib) = preload {
        env.push(("LD_PRELOAD", lib.to_str().unwrap()));
    }
    let (out, err, code) = run_program(&bin, &[], &env);
    assert_eq!(code, 0, "{err}");
    let (unpatched, _, _) = run_program(original, &[], &env[2..]);
    assert_eq!(out, unpatched);
    let held = out.lines().find_map(|l| l.strip_prefix("held ")).expect("a held line");
    let mut w = held.split_whitespace().map(|v| v.parse::<u64>().unwrap());
    let (objects, bytes) = (w.next().unwrap(), w.next().unwrap());
    let live: Live = live_figures(&only_counters_file(&dir));
    let (own, other): (Live, Live) = live.clone().into_iter().partition(|((f, _, _), _)| f == source);
    let sum = own.values().fold((0, 0, 0), |a, v| (a.0 + v.0, a.1 + v.1, a.2 + v.2));
    assert_eq!((sum.0, sum.1), (objects, bytes), "live figures equal what the program holds");
    let beside = other.values().fold((0, 0), |a, v| (a.0 + v.0, a.1 + v.2));
    assert_eq!(beside, (outside, 0), "objects held outside the program's source: {other:?}");
    assert_eq!(sum.2, 0, "every free was of a tracked object");
    // Every allocating line the program names: its figures exactly.
    for l in out.lines().filter_map(|l| l.strip_prefix("site ")) {
        let v: Vec<u64> = l.split_whitespace().map(|v| v.parse().unwrap()).collect();
        let at_line = live
            .iter()
            .filter(|((f, line, _), _)| f == source && u64::from(*line) == v[0])
            .fold((0, 0), |a, (_, f)| (a.0 + f.0, a.1 + f.1));
        assert_eq!(at_line, (v[1], v[2]), "{source}:{}: live objects and bytes", v[0]);
    }
    let file = std::fs::read(only_counters_file(&dir)).unwrap();
    let pf = ProcessFile::parse(&file).unwrap();
    assert_eq!(pf.untracked_allocs, 0);
    assert_eq!(pf.flags & flags::INCOMPLETE, 0);
    out
}

#[test]
fn eight_threads_a_million_objects_in_flight() {
    live_figures_equal_what_the_program_holds("live_stress", None);
}

/// A C++ program with libstdc++ linked in (`-static-libstdc++`) defines
/// operator new and delete itself, as wrappers of malloc and free: its
/// objects are the process's malloc's, recorded by plain store like a C
/// program's (`Scan::forward_own_definitions`), and its live figures stay
/// exact with 8 threads deleting each other's objects.
#[test]
fn a_program_with_libstdcxx_linked_in_keeps_live_figures_exact() {
    let dir = counters_dir(&format!("{}-build", test_name()));
    let exe = build_source("libstdcxx/live_stress.cpp", &dir);
    let data = std::fs::read(&exe).unwrap();
    let search = alloctramp_patcher::wrappers::Options { search: true, charge: true, ..Default::default() };
    let a = alloctramp_patcher::analyze_with(&data, "live_stress", None, &[], &search).unwrap();
    assert!(!a.scan.own_definitions.is_empty(), "the program defines operator new");
    assert!(!a.scan.own_allocator, "its operator new only leads to malloc");
    let new = a.scan.entries.iter().position(|e| e.target == Target::Symbol("_Znam".into())).unwrap();
    assert!(a.scan.plain_store(new), "new[] is recorded by plain store");
    // The command's patched file has the plain path (`bts` of an entry's
    // LIVE bit), which only plain-store trampolines hold.
    let patched = dir.join("live_stress.patched");
    patch_to(&exe, &patched, &[]);
    let asm = std::process::Command::new("objdump").args(["-d", "-j", ".alloctramp.text"]).arg(&patched).output();
    let asm = String::from_utf8(asm.unwrap().stdout).unwrap();
    let plain = |l: &&str| l.contains("\tbtsl") && l.contains("$0x2,(");
    assert!(asm.lines().any(|l| plain(&l)), "a plain-store path in the trampolines");
    // (GLIBCXX_TUNABLES could size libstdc++'s emergency pool for
    // exceptions, allocated at start-up, which the figures count.)
    assert!(std::env::var_os("GLIBCXX_TUNABLES").is_none(), "the test needs libstdc++'s default pool");
    live_figures_equal_what_it_holds(&exe, "live_stress.cpp", None, 1);
}

/// An operator new of the program's own that is more than a way to malloc
/// keeps the file's records compare-and-swap: one that hands out pieces of
/// an arena, side by side; one that takes small objects from a wrapper
/// with a size header and the others from malloc (two sources); one that
/// returns malloc's pointer on one path and a header's length past it on
/// another.
#[test]
fn a_program_s_own_operator_new_that_is_more_than_malloc_keeps_compare_and_swap_records() {
    const SHAPES: [(&str, &str); 3] = [
        (
            "arena",
            "static unsigned char arena[1 << 16] alignas(16);\nstatic std::size_t used;\n\
            void *operator new(std::size_t n) { void *p = arena + used; used += (n + 15) & ~std::size_t(15); return p; }\n",
        ),
        (
            "two_sources",
            "__attribute__((noinline)) static void *small_new(std::size_t n) {\n\
            char *p = static_cast<char *>(std::malloc(n + 16)); if (!p) std::abort(); return p + 16; }\n\
            void *operator new(std::size_t n) { if (n <= 16) return small_new(n);\n\
            void *p = std::malloc(n); if (!p) std::abort(); return p; }\n",
        ),
        (
            "two_offsets",
            "static volatile int whole;\n\
            void *operator new(std::size_t n) { char *p = static_cast<char *>(std::malloc(n + 16)); if (!p) std::abort();\n\
            if (whole) { asm volatile(\"\" ::: \"memory\"); return p; } return p + 16; }\n",
        ),
    ];
    let dir = counters_dir(test_name());
    for (name, new) in SHAPES {
        let src = dir.join(format!("{name}.cpp"));
        let program = format!(
            "#include <cstdlib>\n#include <new>\n{new}void operator delete(void *) noexcept {{}}\n\
             int main() {{ int *a = new int(1); int *b = new int(2); int r = *a + *b - 3; delete a; delete b;\n\
             void *c = std::malloc(4); std::free(c); return r; }}\n"
        );
        std::fs::write(&src, program).unwrap();
        let bin = dir.join(name);
        let out = std::process::Command::new("g++").args(["-O2", "-o"]).arg(&bin).arg(&src).output().unwrap();
        assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let data = std::fs::read(&bin).unwrap();
        let search = alloctramp_patcher::wrappers::Options { search: true, charge: true, ..Default::default() };
        let a = alloctramp_patcher::analyze_with(&data, name, None, &[], &search).unwrap();
        assert!(!a.scan.own_definitions.is_empty(), "{name}: the program defines operator new");
        assert!(a.scan.own_allocator, "{name}: its operator new is more than a way to malloc");
        let malloc = a.scan.entries.iter().position(|e| e.target == Target::Symbol("malloc".into())).unwrap();
        assert!(!a.scan.plain_store(malloc), "{name}");
    }
}

/// Objects of 1 KiB or more, which the shadow map describes with a record
/// and the size in the next granule's entry: freed at patched sites, freed
/// unseen and their memory handed out again (at the same address, at the
/// next granule, over small objects freed unseen), objects of 0 bytes
/// where wide ones were, reallocs across 1 KiB. The program says that
/// glibc handed out the addresses each scenario needs.
#[test]
fn wide_objects_freed_seen_and_unseen_keep_figures_exact() {
    let out = live_figures_equal_what_the_program_holds("live_wide", None);
    let reuses: Vec<&str> = out.lines().filter(|l| l.starts_with("reuse ")).collect();
    assert_eq!(reuses.len(), 6, "{out}");
    for l in reuses {
        assert!(l.ends_with(" yes"), "the heap's layout is not the one the scenario needs: {l}");
    }
}

/// The same under jemalloc, whose small size classes start several live
/// objects in one 32-byte granule: the trampolines record by
/// compare-and-swap, and an object whose granule is taken goes to the
/// pointer table.
#[test]
fn eight_threads_a_million_objects_in_flight_under_jemalloc() {
    let jemalloc = ensure_library("libjemalloc.so.2", "libjemalloc2");
    live_figures_equal_what_the_program_holds("live_stress", Some(&jemalloc));
}

/// 80 threads at once (more than there are nurseries), objects of exited
/// threads freed by the threads that take over their nurseries and by main.
#[test]
fn more_threads_than_nurseries_and_objects_of_exited_threads() {
    live_figures_equal_what_the_program_holds("live_waves", None);
}

/// The process's address space in KiB (VmSize).
fn vm_size_kib(pid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).expect("VmSize in /proc/PID/status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `disable` with tracked objects live says how many: the objects the
/// allocation sites still hold, not the calls the free sites counted.
#[test]
fn disable_counts_the_objects_still_live_not_the_frees() {
    let mut s = Server::start(test_name(), &[]);
    assert!(s.switch("enable").status.success());
    for _ in 0..3 {
        assert_eq!(s.cmd("round"), "done");
    }
    assert_eq!(s.cmd("free"), "freed");
    assert_eq!(s.cmd("round"), "done");
    let m = server_sites(&s);
    assert_eq!(m[&KEPT_FREE].0, 15, "the free command's frees");
    let o = s.switch("disable");
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("until the 5 tracked objects are freed"), "{said}");
    s.quit();
}

/// Kilobytes of the executable mappings of `path` in process `pid` that the
/// process wrote to (a switched site's page is a private dirty copy).
fn dirty_code_kib(pid: u32, path: &Path) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut ours = false;
    let mut kib = 0;
    let mut seen = 0;
    for l in smaps.lines() {
        let mut w = l.split_whitespace();
        let first = w.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            let perms = w.next().unwrap_or("");
            ours = perms.contains('x') && l.ends_with(path.to_str().unwrap());
            seen += usize::from(ours);
        } else if ours && first == "Private_Dirty:" {
            kib += w.next().unwrap().parse::<u64>().unwrap();
        }
    }
    assert!(seen > 0, "no executable mapping of {} in process {pid}", path.display());
    kib
}

/// `ALLOCTRAMP=on` with a counters directory the runtime refuses: the
/// program runs as usual, unprofiled. No site is switched (its code stays
/// as loaded) and no shadow map is reserved: figures nobody can read would
/// cost the program what profiling costs.
#[test]
fn a_refused_counters_directory_leaves_every_site_off() {
    const TIB_IN_KIB: u64 = 1 << 30;
    let b = built(Config::default_o2());
    let dir = counters_dir(test_name());
    let bin = dir.join("server.bin");
    patch_to(&b.path("server"), &bin, &[]);
    let open = dir.join("open");
    std::fs::create_dir_all(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    for live in ["1", "0"] {
        let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_LIVE", live), ("ALLOCTRAMP_DIR", open.to_str().unwrap())];
        let mut t = Talk::spawn(&mut std::process::Command::new(&bin), &env);
        t.send("round");
        assert_eq!(t.line().trim(), "done");
        let pid = t.child.id();
        assert_eq!(dirty_code_kib(pid, &bin), 0, "ALLOCTRAMP_LIVE={live}: a site was switched");
        let vm = vm_size_kib(&pid.to_string());
        assert!(vm < TIB_IN_KIB, "ALLOCTRAMP_LIVE={live}: not profiled, yet {vm} KiB of address space");
        t.send("quit");
        let _ = t.finish();
        assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0, "no file in a refused directory");
    }
}

/// A patched process that is not profiled reserves no shadow map: it does
/// when profiling first goes on. Under an address-space limit the process
/// says why only then, and counts without live figures.
#[test]
fn the_shadow_map_is_reserved_when_profiling_first_goes_on() {
    const TIB_IN_KIB: u64 = 1 << 30;
    let mut s = Server::start(&format!("{}-free", test_name()), &[]);
    assert_eq!(s.cmd("round"), "done");
    let before = vm_size_kib(&s.pid());
    assert!(before < TIB_IN_KIB, "not profiled, yet {before} KiB of address space");
    let o = s.switch("enable");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let after = vm_size_kib(&s.pid());
    assert!(after >= 16 * TIB_IN_KIB, "profiling with live tracking: {after} KiB of address space");
    assert_eq!(s.cmd("round"), "done");
    let file = std::fs::read(s.dir.join(format!("{}.counters", s.pid()))).unwrap();
    assert!(ProcessFile::parse(&file).unwrap().live());
    let m = server_sites(&s);
    assert!(m.values().any(|v| v.1 > 0), "live objects after a round: {m:?}");
    s.quit();

    // 4 GiB of address space: the program runs, the map does not fit.
    let dir = counters_dir(&format!("{}-limited", test_name()));
    let err = dir.join("stderr.txt");
    let script = format!("ulimit -v 4194304; exec \"$0\" 2>'{}'", err.display());
    let mut s = Server::start_with(
        &format!("{}-limited", test_name()),
        &[("ALLOCTRAMP_DIR", dir.to_str().unwrap())],
        Some(&["sh", "-c", &script]),
    );
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(std::fs::read_to_string(&err).unwrap(), "", "not profiled: the program's stderr is its own");
    // Switched on, counting only: `enable` succeeds and says why.
    let o = s.switch("enable");
    let told = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && told.contains("cannot reserve the shadow map"), "{told}");
    assert_eq!(s.cmd("round"), "done");
    let said = std::fs::read_to_string(&err).unwrap();
    assert!(said.contains("cannot reserve the shadow map"), "stderr: {said:?}");
    let file = std::fs::read(dir.join(format!("{}.counters", s.pid()))).unwrap();
    let pf = ProcessFile::parse(&file).unwrap();
    assert!(!pf.live(), "counting only");
    assert!(pf.last_error.contains("cannot reserve the shadow map"), "last error: {:?}", pf.last_error);
    let m = server_sites(&s);
    assert!(m.values().any(|v| v.0 > 0), "counted: {m:?}");
    s.quit();
}
