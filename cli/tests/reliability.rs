//! Regression tests for what could damage a user's system, files or
//! programs: special output paths, FIFOs, leftovers of failed patches,
//! writable+executable segments, descriptors the program reuses, system
//! calls interrupted by switching, and counters files piling up. The
//! programs are in testbins/reliability/, built here.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, report};
use crate::util::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Builds testbins/reliability/NAME.c (PIE, -O2) into `dir`.
fn build(name: &str, dir: &Path) -> PathBuf {
    build_source(&format!("reliability/{name}.c"), dir)
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn counters_files(dir: &Path) -> Vec<String> {
    files_in(dir).into_iter().filter(|n| n.ends_with(".counters")).collect()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A patch that fails: status 2, one line naming the output path.
fn assert_refused(o: &std::process::Output, what: &str) {
    assert_eq!(o.status.code(), Some(2), "{}", stderr(o));
    assert_eq!(stderr(o).lines().count(), 1, "one line: {}", stderr(o));
    assert!(stderr(o).contains(what), "{what:?} in {}", stderr(o));
}

#[test]
fn output_onto_a_fifo_a_directory_or_a_link_to_a_device_is_refused_and_nothing_is_left() {
    let b = built(Config::default_o2());
    let dir = scratch("special-outputs");
    let input = b.path("basic");

    // A FIFO at the output path stays a FIFO.
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let o = alloctramp().arg("patch").arg(&input).arg("-o").arg(&fifo).output().unwrap();
    assert_refused(&o, "output path is a FIFO, not a regular file");
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());

    // A symbolic link to /dev/null: refused (renaming over it would only
    // replace the link, but the user asked to write to a device).
    let link = dir.join("null");
    std::os::unix::fs::symlink("/dev/null", &link).unwrap();
    let o = alloctramp().arg("patch").arg(&input).arg("-o").arg(&link).output().unwrap();
    assert_refused(&o, "output path is a character device");
    assert_eq!(std::fs::read_link(&link).unwrap(), Path::new("/dev/null"));

    // A directory: refused, and no runtime copy or temporary file beside it.
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let o = alloctramp().arg("patch").arg(&input).arg("-o").arg(&sub).output().unwrap();
    assert_refused(&o, "output path is a directory");
    assert_eq!(files_in(&dir), ["fifo", "null", "sub"], "nothing left beside the outputs");
    assert!(files_in(&sub).is_empty());

    // A runtime copy that would land on a special file: refused before the
    // output is written.
    let rt = dir.join("rt");
    std::fs::create_dir(&rt).unwrap();
    assert!(Command::new("mkfifo").arg(rt.join("liballoctramp_rt.so")).status().unwrap().success());
    let o = alloctramp().arg("patch").arg(&input).arg("-o").arg(rt.join("basic")).output().unwrap();
    assert_refused(&o, "liballoctramp_rt.so: output path is a FIFO");
    assert_eq!(files_in(&rt), ["liballoctramp_rt.so"]);

    // A directory that does not exist: the message names the output path.
    let missing = dir.join("no/such/dir/out");
    let o = alloctramp().arg("patch").arg(&input).arg("-o").arg(&missing).output().unwrap();
    assert_refused(&o, &format!("{}: cannot create the output", missing.display()));
    assert_eq!(files_in(&dir), ["fifo", "null", "rt", "sub"]);
}

use std::os::unix::fs::FileTypeExt;

#[test]
fn a_fifo_as_input_is_refused_without_blocking() {
    let dir = scratch("fifo-input");
    let fifo = dir.join("f");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for cmd in [&["sites"][..], &["patch"], &["report"]] {
        let start = Instant::now();
        let mut child = alloctramp().args(cmd).arg(&fifo).stderr(Stdio::piped()).spawn().unwrap();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                panic!("alloctramp {cmd:?} blocked on a FIFO");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(2), "{cmd:?}: {err}");
        assert!(err.contains("not a regular file (a FIFO)"), "{cmd:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    assert_eq!(files_in(&dir), ["f"]);
}

/// The report's calls at each line of `file`, summed over sites.
fn calls_by_line(doc: &serde_json::Value, file: &str) -> std::collections::BTreeMap<(u64, String), u64> {
    let mut m = std::collections::BTreeMap::new();
    for s in doc["sites"].as_array().unwrap() {
        if s["file"].as_str().is_some_and(|f| base(f) == file) {
            let k = (s["line"].as_u64().unwrap(), s["entry"].as_str().unwrap().to_string());
            *m.entry(k).or_insert(0) += s["calls"].as_u64().unwrap();
        }
    }
    m
}

#[test]
fn a_writable_and_executable_segment_stays_writable_when_profiling_switches_on() {
    let dir = counters_dir("rwx");
    let (patched, original) = rwx(&dir);
    let d = dir.to_str().unwrap();
    assert_eq!(run_program(&patched, &[], &[("ALLOCTRAMP_DIR", d)]), original, "off");
    assert_eq!(run_program(&patched, &[], &[("ALLOCTRAMP_DIR", d), ("ALLOCTRAMP", "on")]), original, "on");
    let doc = report(only_counters_file(&dir).to_str().unwrap(), &dir);
    let want: std::collections::BTreeMap<(u64, String), u64> =
        program_markers("reliability/rwx.c").into_iter().map(|(line, entry, calls)| ((line, entry), calls)).collect();
    assert_eq!(calls_by_line(&doc, "rwx.c"), want);
}

/// (line, entry, calls) of every `@site` marker in a test source.
fn program_markers(rel: &str) -> Vec<(u64, String, u64)> {
    site_marks(rel).into_iter().map(|m| (u64::from(m.line), m.entry, m.calls)).collect()
}

fn only_counters_file(dir: &Path) -> PathBuf {
    let f = counters_files(dir);
    assert_eq!(f.len(), 1, "one counters file in {}: {f:?}", dir.display());
    dir.join(&f[0])
}

#[test]
fn a_program_that_closes_every_descriptor_keeps_its_own_file_through_fork_dlopen_and_reset() {
    let b = built(Config::default_o2());
    let dir = counters_dir("fds");
    let bin = build("fds", &dir);
    let patched = dir.join("fds.patched");
    patch_to(&bin, &patched, &[]);
    let lib = b.path("libatshared");
    let plib = dir.join("libatshared.patched.so");
    patch_to(&lib, &plib, &[]);

    let run = |prog: &Path, library: &Path, file: &Path, reset: bool| -> String {
        let env = [("ALLOCTRAMP_DIR", dir.to_str().unwrap()), ("ALLOCTRAMP", "on")];
        let mut t = Talk::start(prog, &[file.to_str().unwrap(), library.to_str().unwrap()], &env);
        let mut out = String::new();
        for _ in 0..3 {
            out += &t.line();
        }
        assert!(out.ends_with("dlopen ok\n"), "{out}");
        if reset {
            let o = alloctramp().arg("reset").arg("--dir").arg(&dir).arg(t.child.id().to_string()).output().unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
        }
        t.send("go");
        let (rest, code) = t.finish();
        assert_eq!(code, Some(0));
        out + &rest
    };
    let plain_file = dir.join("plain.txt");
    let patched_file = dir.join("patched.txt");
    let plain = run(&bin, &lib, &plain_file, false);
    let with_runtime = run(&patched, &plib, &patched_file, true);
    assert_eq!(plain, "file descriptor 3\nchild exit 0\ndlopen ok\ndescriptors: 0 1 2 3\n");
    assert_eq!(with_runtime, plain, "the patched program's output and descriptors");
    assert_eq!(std::fs::read(&patched_file).unwrap(), std::fs::read(&plain_file).unwrap());
}

impl Drop for Talk {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Switches the process on and off `n` times with `alloctramp enable` and
/// `disable`, each waiting until the process has done it.
fn switch_many(dir: &Path, pid: u32, n: usize) {
    for _ in 0..n {
        for what in ["enable", "disable"] {
            let o = alloctramp().arg(what).arg("--dir").arg(dir).arg(pid.to_string()).output().unwrap();
            assert!(o.status.success(), "{what}: {}", stderr(&o));
        }
    }
}

#[test]
fn switching_fifty_times_interrupts_no_system_call() {
    let dir = counters_dir("syscalls");
    let bin = build("signals", &dir);
    let patched = dir.join("signals.patched");
    patch_to(&bin, &patched, &[]);
    let d = dir.to_str().unwrap();

    // pause() with an alarm pending: returns once, when the alarm fires
    // (late enough that 100 switches finish first on a loaded machine).
    let alarm = 15;
    let expect = "pause returned -1 (Interrupted system call), alarms handled 1\n";
    let mut t = Talk::start(&patched, &["pause", &alarm.to_string()], &[("ALLOCTRAMP_DIR", d)]);
    assert_eq!(t.line(), "ready\n");
    let start = Instant::now();
    switch_many(&dir, t.child.id(), 50);
    assert!(
        start.elapsed() < Duration::from_secs(alarm - 1),
        "switching took {:?}: too long for the alarm to still be pending",
        start.elapsed()
    );
    assert_eq!(t.finish(), (expect.to_string(), Some(0)));
    let mut t = Talk::start(&bin, &["pause", "1"], &[]);
    assert_eq!(t.line(), "ready\n");
    assert_eq!(t.finish(), (expect.to_string(), Some(0)), "the unpatched program");

    // A blocking 1 MiB write into a full pipe: returns all of it.
    let mut t = Talk::start(&patched, &["pipe"], &[("ALLOCTRAMP_DIR", d)]);
    assert_eq!(t.line(), "ready\n");
    std::thread::sleep(Duration::from_millis(50));
    switch_many(&dir, t.child.id(), 50);
    t.send("drain");
    assert_eq!(t.finish(), ("write returned 1048576\n".to_string(), Some(0)));

    // sigwait() for a process-directed SIGTERM that the program blocked.
    let mut t = Talk::start(&patched, &["sigwait"], &[("ALLOCTRAMP_DIR", d)]);
    assert_eq!(t.line(), "ready\n");
    switch_many(&dir, t.child.id(), 50);
    // SAFETY: kill(2) with the child's pid.
    assert_eq!(unsafe { libc::kill(t.child.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(t.finish(), ("sigwait returned 0, signal 15\n".to_string(), Some(0)));
}

#[test]
fn the_watcher_thread_blocks_every_signal_holds_no_descriptor_and_takes_no_arena() {
    let dir = counters_dir("watcher");
    let bin = build("signals", &dir);
    let patched = dir.join("signals.patched");
    patch_to(&bin, &patched, &[]);
    let mut t = Talk::start(&patched, &["sigwait"], &[("ALLOCTRAMP_DIR", dir.to_str().unwrap())]);
    assert_eq!(t.line(), "ready\n");
    let pid = t.child.id();
    // The thread names itself as it starts.
    let watchers = |pid: u32| -> Vec<PathBuf> {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .map(|t| t.unwrap().path())
            .filter(|t| std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.trim() == "alloctramp"))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while watchers(pid).is_empty() {
        assert!(Instant::now() < deadline, "no thread named alloctramp");
        std::thread::sleep(Duration::from_millis(5));
    }
    let found = watchers(pid);
    assert_eq!(found.len(), 1);
    // Started off, the process has its file 10 ms later, made by the
    // watcher: what follows holds after that too.
    process_file(&dir, pid);
    let status = std::fs::read_to_string(found[0].join("status")).unwrap();
    let blocked = status.lines().find_map(|l| l.strip_prefix("SigBlk:")).unwrap().trim().to_string();
    // Every signal but SIGKILL and SIGSTOP, which cannot be blocked, and
    // glibc's two internal ones (32 and 33), which it never lets a thread
    // block.
    let unblockable = [libc::SIGKILL, libc::SIGSTOP, 32, 33].iter().fold(0u64, |m, s| m | 1 << (s - 1));
    assert_eq!(u64::from_str_radix(&blocked, 16).unwrap(), !unblockable, "SigBlk: {blocked}");
    // The same descriptors as the unpatched program (the test's runner
    // may pass some of its own to every child).
    let fds = |pid: u32| {
        let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let mut plain = Talk::start(&bin, &["sigwait"], &[]);
    assert_eq!(plain.line(), "ready\n");
    // (The watcher names itself before it has settled: a descriptor it
    // uses while it starts may still be open.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while fds(pid) != fds(plain.child.id()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(fds(pid), fds(plain.child.id()));
    // It takes no memory from the C library as it starts: glibc gives a
    // thread's first allocation an arena of its own, a 64 MiB-aligned
    // reservation of 64 MiB whose start is read-write and the rest not.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let anon: Vec<(u64, u64, String)> = maps
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (s, e) = f.first()?.split_once('-')?;
            (f.len() == 5).then(|| (u64::from_str_radix(s, 16).ok(), u64::from_str_radix(e, 16).ok(), f[1].to_string()))
        })
        .filter_map(|(s, e, p)| Some((s?, e?, p)))
        .collect();
    const ARENA: u64 = 64 << 20;
    let arenas = anon
        .windows(2)
        .filter(|w| w[0].0 % ARENA == 0 && w[0].2 == "rw-p" && w[1].2 == "---p" && w[0].1 == w[1].0)
        .filter(|w| w[1].1 - w[0].0 == ARENA)
        .count();
    assert_eq!(arenas, 0, "a C library arena in the patched process: {maps}");
    // SAFETY: kill(2) with the child's pid.
    assert_eq!(unsafe { libc::kill(plain.child.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(plain.finish().1, Some(0));
    // SAFETY: kill(2) with the child's pid.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    assert_eq!(t.finish().1, Some(0));
}

#[test]
fn counters_files_of_processes_that_never_profiled_do_not_pile_up() {
    let b = built(Config::default_o2());
    let dir = counters_dir("pile-up");
    let bin = dir.join("basic");
    patch_to(&b.path("basic"), &bin, &[]);
    let d = dir.to_str().unwrap();
    let runs = |n: usize, env: &[(&str, &str)]| {
        for _ in 0..n {
            let mut e = vec![("ALLOCTRAMP_DIR", d)];
            e.extend_from_slice(env);
            assert_eq!(run_program(&bin, &[], &e).2, 0);
        }
    };

    // Never switched on: nothing left at exit.
    runs(3, &[]);
    assert!(counters_files(&dir).is_empty(), "{:?}", files_in(&dir));
    // Profiled: the file stays as the final snapshot, within the bound.
    runs(1, &[("ALLOCTRAMP", "on")]);
    assert_eq!(counters_files(&dir).len(), 1);
    runs(5, &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_KEEP", "2")]);
    assert_eq!(counters_files(&dir).len(), 2, "ALLOCTRAMP_KEEP=2: {:?}", files_in(&dir));
    // Past a bound of 8, the oldest go until an eighth fewer stay, so the
    // next seven exits read no file. (`none`: no watcher thread, whose
    // prune at start-up would race with the one at exit.)
    let eight = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_KEEP", "8"), ("ALLOCTRAMP_SWITCH", "none")];
    runs(6, &eight);
    assert_eq!(counters_files(&dir).len(), 8, "within ALLOCTRAMP_KEEP=8: {:?}", files_in(&dir));
    runs(1, &eight);
    assert_eq!(counters_files(&dir).len(), 7, "past ALLOCTRAMP_KEEP=8: {:?}", files_in(&dir));
    runs(1, &eight);
    assert_eq!(counters_files(&dir).len(), 8, "{:?}", files_in(&dir));
    runs(5, &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_KEEP", "2")]);
    assert_eq!(counters_files(&dir).len(), 2, "ALLOCTRAMP_KEEP=2 again: {:?}", files_in(&dir));

    // A process killed before it could remove its file, and one still
    // running.
    let server = |env: &[(&str, &str)]| {
        let mut t = Talk::start(
            &dir.join("server"),
            &[],
            &[("ALLOCTRAMP_DIR", d)].iter().chain(env).copied().collect::<Vec<_>>(),
        );
        t.send("round");
        assert_eq!(t.line(), "done\n");
        process_file(&dir, t.child.id());
        t
    };
    patch_to(&b.path("server"), &dir.join("server"), &[]);
    let mut killed = server(&[]);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    // Without a watcher (which would prune the killed process's file as it
    // starts: see the end).
    let running = server(&[("ALLOCTRAMP_SWITCH", "none")]);
    assert_eq!(counters_files(&dir).len(), 4);

    let o = alloctramp().arg("clean").arg("--dir").arg(&dir).arg("--keep").arg("1").output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("removed 2 counters files of ended processes"), "{}", stderr(&o));
    let left = counters_files(&dir);
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.contains(&format!("{}.counters", running.child.id())));
    let o = alloctramp().arg("clean").arg("--dir").arg(&dir).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(counters_files(&dir), [format!("{}.counters", running.child.id())]);
    let mut running = running;
    running.send("quit");
    assert_eq!(running.finish().1, Some(0));
    assert!(counters_files(&dir).is_empty(), "{:?}", files_in(&dir));

    // A process killed before it could remove its file: the next process's
    // watcher thread removes it as it starts, once the directory holds more
    // files than ALLOCTRAMP_KEEP.
    let mut killed = server(&[]);
    let gone = format!("{}.counters", killed.child.id());
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    assert_eq!(counters_files(&dir), std::slice::from_ref(&gone));
    let mut next = server(&[("ALLOCTRAMP_KEEP", "1")]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while counters_files(&dir).contains(&gone) {
        assert!(Instant::now() < deadline, "the killed process's file stays: {:?}", files_in(&dir));
        std::thread::sleep(Duration::from_millis(5));
    }
    next.send("quit");
    assert_eq!(next.finish().1, Some(0));
    assert!(counters_files(&dir).is_empty(), "{:?}", files_in(&dir));
}

/// The patched `reliability/rwx.c` beside its original's output.
fn rwx(dir: &Path) -> (PathBuf, (String, String, i32)) {
    let bin = build("rwx", dir);
    let patched = dir.join("rwx.patched");
    patch_to(&bin, &patched, &[]);
    let original = run_program(&bin, &[], &[]);
    assert_eq!(original.2, 0);
    (patched, original)
}

/// A counters file on a file system with no room left: a program whose
/// counters were mapped over pages without storage would die of SIGBUS at
/// its first count. Swept over tmpfs sizes (mounted in a private mount
/// namespace) from too small for the file's header to large enough for
/// everything, with a program of one thread and one of four (each thread
/// that makes more than `shard::PROBATION` counted calls is given a shard,
/// which needs storage of its own): every run must behave as the original,
/// and the runs that lacked room must say so.
#[test]
fn a_full_file_system_never_kills_a_profiled_program() {
    let dir = counters_dir("nospace");
    let (rwx, rwx_out) = rwx(&dir);
    let threads = dir.join("threads.patched");
    patch_to(&built(Config::default_o2()).path("threads"), &threads, &[]);
    // Each pair is two counted calls.
    let pairs = 600;
    assert!(2 * pairs > alloctramp_trampolines::layout::shard::PROBATION);
    let pairs = [pairs.to_string()];
    let threads_out = run_program(&built(Config::default_o2()).path("threads"), &pairs, &[]);
    assert_eq!(threads_out.2, 0);
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mut said = String::new();
    for (program, args, original) in [(&rwx, &[][..], &rwx_out), (&threads, &pairs[..], &threads_out)] {
        for kib in (4..=80).step_by(4) {
            let out = Command::new("unshare")
                .args([
                    "-rm",
                    "sh",
                    "-c",
                    "mount -t tmpfs -o size=$2 tmpfs \"$1\" || exit 99; shift 2; exec \"$@\"",
                    "sh",
                ])
                .arg(&mnt)
                .arg(format!("{kib}k"))
                .arg(program)
                .args(args)
                .env("ALLOCTRAMP", "on")
                .env("ALLOCTRAMP_DIR", mnt.join("d"))
                .output()
                .unwrap();
            let err = stderr(&out);
            if said.is_empty() && kib == 4 && (out.status.code() == Some(99) || err.starts_with("unshare:")) {
                skip(test_name(), &format!("cannot mount a tmpfs in a user and mount namespace: {}", err.trim()));
                return;
            }
            let got = (String::from_utf8_lossy(&out.stdout).into_owned(), out.status.code());
            assert_eq!(got, (original.0.clone(), Some(0)), "{} on a tmpfs of {kib} KiB: {err}", program.display());
            said.push_str(&err);
        }
    }
    assert!(said.contains("no space left for the counters file in"), "the header never lacked room: {said}");
    assert!(said.contains("(profiling is unavailable)"), "{said}");
    assert!(said.contains("no space left for the counters file; a patched module counts, but no report can"), "{said}");
    assert!(
        said.contains("no space left for the counters file; threads without storage for a shard of their own share"),
        "a thread's shard never lacked room: {said}"
    );
}

/// A process with a file-size limit (`ulimit -f`): growing the counters
/// file past it would send SIGXFSZ, which kills. A limit below the header
/// leaves the process without a file; one below its module's region
/// leaves the module's counters private. Both runs behave as the original.
#[test]
fn a_file_size_limit_never_kills_a_profiled_program() {
    use std::os::unix::process::CommandExt;
    let dir = counters_dir("fsize");
    let (patched, original) = rwx(&dir);
    for (limit, says) in [(8u64 << 10, "profiling is unavailable"), (20 << 10, "counts, but no report can read")] {
        let d = dir.join(format!("d{limit}"));
        let mut cmd = Command::new(&patched);
        cmd.env("ALLOCTRAMP", "on").env("ALLOCTRAMP_DIR", &d);
        // SAFETY: setrlimit is async-signal-safe; the closure touches no
        // memory the parent shares.
        unsafe {
            cmd.pre_exec(move || {
                let rl = libc::rlimit { rlim_cur: limit, rlim_max: limit };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &rl) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let err = stderr(&out);
        assert_eq!(
            (String::from_utf8_lossy(&out.stdout).into_owned(), out.status.code()),
            (original.0.clone(), Some(0)),
            "limit {limit}: {err}"
        );
        assert!(err.contains("file-size limit (ulimit -f)") && err.contains(says), "limit {limit}: {err}");
    }
}
