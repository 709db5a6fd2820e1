//! The runtime: exact counts with profiling on from the start, switching a
//! live process by signal, control file and watcher, and switching under
//! load.

use crate::patch::patch_to;
use crate::util::*;
use alloctramp_trampolines::layout;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The display name of an entry point given by symbol.
pub fn display(symbol: &str) -> String {
    alloctramp_trampolines::entry::defaults()
        .into_iter()
        .find(|e| e.target.to_string() == symbol)
        .map_or_else(|| symbol.to_string(), |e| e.display)
}

/// A fresh counters directory (mode 0700).
pub fn counters_dir(name: &str) -> PathBuf {
    let d = scratch(&format!("counters-{name}"));
    std::os::unix::fs::PermissionsExt::set_mode(&mut std::fs::metadata(&d).unwrap().permissions(), 0o700);
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    d
}

/// `alloctramp report --format json` of a pid or file.
pub fn report(target: &str, dir: &Path) -> Value {
    let o = alloctramp().args(["report", "--format", "json", "--dir"]).arg(dir).arg(target).output().unwrap();
    assert!(o.status.success(), "report {target}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The single counters file a finished run left in `dir`.
pub fn only_counters_file(dir: &Path) -> PathBuf {
    let files = counters_files(dir);
    assert_eq!(files.len(), 1, "counters files in {}: {files:?}", dir.display());
    files[0].clone()
}

type Figures = BTreeMap<(String, u32, String), (u64, u64, u64)>;

/// (file, line, entry) -> (calls, bytes, failed) from a report.
pub fn figures(doc: &Value) -> Figures {
    let mut m = Figures::new();
    for s in doc["sites"].as_array().unwrap() {
        let key = (
            base(s["file"].as_str().unwrap_or("?")).to_string(),
            s["line"].as_u64().unwrap_or(0) as u32,
            s["entry"].as_str().unwrap().to_string(),
        );
        let v = (s["calls"].as_u64().unwrap(), s["bytes"].as_u64().unwrap(), s["failed"].as_u64().unwrap());
        let e = m.entry(key).or_insert((0, 0, 0));
        e.0 += v.0;
        e.1 += v.1;
        e.2 += v.2;
    }
    m
}

fn expected(programs: &[&Program]) -> Figures {
    let mut m = Figures::new();
    for p in programs {
        for mk in &p.markers {
            m.insert((mk.file.clone(), mk.line, display(&mk.entry)), (mk.calls, mk.bytes, mk.failed));
        }
    }
    m
}

fn check_counts(config: Config) {
    let b = built(config);
    let pdir = b.dir.join("patched-on");
    let _ = std::fs::remove_dir_all(&pdir);
    std::fs::create_dir_all(&pdir).unwrap();
    for p in programs() {
        patch_to(&b.path(&p.name), &pdir.join(&p.output), &[OWN]);
    }
    for p in programs().iter().filter(|p| !p.is_library && !p.variable_counts) {
        let dir = counters_dir(&format!("{}-{}", config.name(), p.name));
        let original = run_program(&b.path(&p.name), &p.run, &[]);
        let env = [
            ("ALLOCTRAMP", "on"),
            ("ALLOCTRAMP_DIR", dir.to_str().unwrap()),
            ("LD_LIBRARY_PATH", pdir.to_str().unwrap()),
        ];
        let out = run_program(&pdir.join(&p.output), &p.run, &env);
        assert_eq!(out, original, "{} {}: profiling on changes the program's behaviour", p.name, config.name());
        let doc = report(only_counters_file(&dir).to_str().unwrap(), &dir);
        assert_eq!(doc["exited"], true);
        let mut progs = vec![p];
        progs.extend(
            p.needs.iter().map(|n| programs().iter().find(|q| q.output == format!("{n}.so") || &q.name == n).unwrap()),
        );
        assert_eq!(figures(&doc), expected(&progs), "{} built {}: counts differ from markers", p.name, config.name());
        let live = live_figures(&only_counters_file(&dir));
        for mk in progs.iter().flat_map(|q| &q.markers) {
            let key = (mk.file.clone(), mk.line, display(&mk.entry));
            let got = live.get(&key).copied().unwrap_or_default();
            if let Some(l) = mk.live {
                assert_eq!((got.0, got.1), l, "{} {}: live objects and bytes at {key:?}", p.name, config.name());
            }
            if let Some(u) = mk.untracked {
                assert_eq!(got.2, u, "{} {}: untracked frees at {key:?}", p.name, config.name());
            }
        }
        // Counting only: the sites jump to their trampolines' count entries.
        let dir = counters_dir(&format!("{}-{}-count", config.name(), p.name));
        let env = [
            ("ALLOCTRAMP", "on"),
            ("ALLOCTRAMP_LIVE", "0"),
            ("ALLOCTRAMP_DIR", dir.to_str().unwrap()),
            ("LD_LIBRARY_PATH", pdir.to_str().unwrap()),
        ];
        let out = run_program(&pdir.join(&p.output), &p.run, &env);
        assert_eq!(out, original, "{} {}: counting only changes the program's behaviour", p.name, config.name());
        let file = only_counters_file(&dir);
        let doc = report(file.to_str().unwrap(), &dir);
        assert_eq!(figures(&doc), expected(&progs), "{} built {}: counting only, counts differ", p.name, config.name());
        assert_no_live_figures(&file);
    }
}

/// A counters file written with live tracking off: no flag, and no
/// tracking figure moved.
fn assert_no_live_figures(file: &Path) {
    use alloctramp_trampolines::process::ProcessFile;
    let bytes = counters_bytes(file);
    let pf = ProcessFile::parse(&bytes).unwrap();
    assert!(!pf.live(), "{}: ALLOCTRAMP_LIVE=0 counts only", file.display());
    for module in pf.modules().unwrap() {
        for i in 0..module.table.header.site_count as usize {
            let c = module.cell(i);
            assert_eq!(
                (c.freed_objects, c.freed_bytes, c.untracked_frees),
                (0, 0, 0),
                "{}: site {i} has tracking figures",
                file.display()
            );
        }
    }
}

/// (file, line, entry) -> (live objects, live bytes, untracked frees),
/// read from a counters file with the shared layout code.
pub fn live_figures(file: &Path) -> BTreeMap<(String, u32, String), (u64, u64, u64)> {
    use alloctramp_trampolines::process::ProcessFile;
    let bytes = counters_bytes(file);
    let pf = ProcessFile::parse(&bytes).unwrap();
    assert!(pf.live(), "{}: live tracking is on by default", file.display());
    let mut m = BTreeMap::new();
    for module in pf.modules().unwrap() {
        let t = &module.table;
        for (i, site) in t.sites().enumerate() {
            let c = module.cell(i);
            let file = t.string(site.file).map_or("?".to_string(), |f| base(f).to_string());
            let e = t.entry(site.entry as usize).unwrap();
            let entry = t.string(e.name).unwrap_or("?").to_string();
            let v: &mut (u64, u64, u64) = m.entry((file, site.line, entry)).or_default();
            // Live figures belong to the sites that allocate.
            if e.kind != alloctramp_trampolines::entry::Kind::Free.code() {
                v.0 += c.live_objects();
                v.1 += c.live_bytes();
            }
            v.2 += c.untracked_frees;
        }
    }
    m
}

mod exact_counts {
    crate::matrix!(super::check_counts);
}

/// A patched `server` running under control of the test.
pub struct Server {
    talk: Talk,
    pub dir: PathBuf,
}

impl Server {
    pub fn start(name: &str, env: &[(&str, &str)]) -> Server {
        Self::start_with(name, env, None)
    }

    /// Starts the server, optionally through a launcher command that execs
    /// it (the program path is appended).
    pub fn start_with(name: &str, env: &[(&str, &str)], launcher: Option<&[&str]>) -> Server {
        Self::start_prepared(name, env, launcher, |_| {})
    }

    /// Like [`start_with`](Self::start_with), calling `prepare` with the
    /// patched program's path before it starts.
    pub fn start_prepared(
        name: &str,
        env: &[(&str, &str)],
        launcher: Option<&[&str]>,
        prepare: impl FnOnce(&Path),
    ) -> Server {
        let b = built(Config::default_o2());
        let dir = counters_dir(name);
        let bin = dir.join("server.bin");
        patch_to(&b.path("server"), &bin, &[]);
        prepare(&bin);
        let mut command = match launcher {
            Some(l) => {
                let mut c = Command::new(l[0]);
                c.args(&l[1..]).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        // The counters go to ALLOCTRAMP_DIR if `env` names one.
        let dir = env.iter().find(|e| e.0 == "ALLOCTRAMP_DIR").map_or(dir, |e| PathBuf::from(e.1));
        let talk = Talk::spawn(command.env("ALLOCTRAMP_DIR", &dir), env);
        // The runtime creates the counters file before main runs, or 10 ms
        // after the start of a process that starts with profiling off.
        process_file(&dir, talk.child.id());
        Server { talk, dir }
    }
    pub fn pid(&self) -> String {
        self.talk.child.id().to_string()
    }
    pub fn cmd(&mut self, c: &str) -> String {
        self.talk.send(c);
        self.talk.line().trim().to_string()
    }
    pub fn figures(&self) -> Figures {
        figures(&report(&self.pid(), &self.dir))
    }
    pub fn switch(&self, what: &str) -> std::process::Output {
        alloctramp().arg(what).arg("--dir").arg(&self.dir).arg(self.pid()).output().unwrap()
    }
    pub fn quit(mut self) {
        self.talk.send("quit");
        let _ = self.talk.finish();
    }
}

/// The line where server.c's `free` command handler starts: markers after
/// it count that command, the others one `round`.
pub fn free_handler_line() -> u32 {
    let src = std::fs::read_to_string(testbins_dir().join("server.c")).unwrap();
    src.lines().position(|l| l.contains("static void do_free(void)")).expect("server.c has do_free") as u32 + 1
}

/// Figures after `rounds` rounds and no `free` command.
fn round_figures(rounds: u64) -> Figures {
    let free_at = free_handler_line();
    expected(&[program("server")])
        .into_iter()
        .map(|(k, (c, b, f))| {
            let n = if k.1 > free_at { 0 } else { rounds };
            (k, (c * n, b * n, f * n))
        })
        .collect()
}

fn zero() -> Figures {
    round_figures(0)
}

#[test]
fn switching_a_live_process_by_command_signal_and_file() {
    let mut s = Server::start("switch", &[("ALLOCTRAMP_SWITCH", "signal")]);
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), zero(), "off by default: nothing counted");

    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let o = s.switch("enable");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("profiling on"));
    // The report says when the switch completed, how long it took and
    // what it rewrote.
    let o = alloctramp().args(["report", "--format", "json", "--dir"]).arg(&s.dir).arg(s.pid()).output().unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let when = doc["last_switch_time"].as_u64().unwrap();
    assert!(when >= before && when <= before + 60, "last_switch_time {when}, switched at {before}");
    assert!(doc["last_switch_sites"].as_u64().unwrap() > 0 && doc["last_switch_ns"].as_u64().unwrap() > 0, "{doc}");
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(2));

    assert!(s.switch("disable").status.success());
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(2), "off: counts stay");

    assert!(s.switch("reset").status.success());
    assert_eq!(s.figures(), zero());

    // A bare signal with no control file toggles.
    let control = s.dir.join(alloctramp_trampolines::process::control_file_name(s.pid().parse().unwrap()));
    assert!(!control.exists(), "the runtime creates no control file");
    let sig = 64 - 7; // SIGRTMAX - 7, the default
    assert!(Command::new("kill").arg(format!("-{sig}")).arg(s.pid()).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(5);
    while !report(&s.pid(), &s.dir)["on"].as_bool().unwrap() {
        assert!(Instant::now() < deadline, "bare signal did not switch on");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(1));

    // Bad text in the control file: a warning, nothing switched.
    std::fs::write(&control, "sideways\n").unwrap();
    assert!(Command::new("kill").arg(format!("-{sig}")).arg(s.pid()).status().unwrap().success());
    std::thread::sleep(Duration::from_millis(100));
    assert!(report(&s.pid(), &s.dir)["on"].as_bool().unwrap());
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(2));

    // The control file's words, carried out on the signal.
    std::fs::write(&control, "off\n").unwrap();
    assert!(Command::new("kill").arg(format!("-{sig}")).arg(s.pid()).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(5);
    while report(&s.pid(), &s.dir)["on"].as_bool().unwrap() {
        assert!(Instant::now() < deadline, "the control file's `off` did not switch off");
        std::thread::sleep(Duration::from_millis(5));
    }

    // A signal queued as `alloctramp` queues its requests' (whose request
    // another signal's handling may have taken already) never toggles, and
    // reads no control file.
    std::fs::remove_file(&control).unwrap();
    let generation = report(&s.pid(), &s.dir)["generation"].as_u64().unwrap();
    let value = libc::sigval { sival_ptr: alloctramp_trampolines::process::REQUEST_SIGNAL_VALUE as *mut libc::c_void };
    // SAFETY: sigqueue(3) with the server's pid, its control signal and a value.
    assert_eq!(unsafe { libc::sigqueue(s.pid().parse().unwrap(), sig, value) }, 0);
    std::thread::sleep(Duration::from_millis(200));
    let doc = report(&s.pid(), &s.dir);
    assert_eq!(
        (doc["on"].as_bool(), doc["generation"].as_u64()),
        (Some(false), Some(generation)),
        "a request's signal without a request"
    );
    // The same signal with any other value is a bare one: it toggles.
    let other = libc::sigval { sival_ptr: 7 as *mut libc::c_void };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::sigqueue(s.pid().parse().unwrap(), sig, other) }, 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !report(&s.pid(), &s.dir)["on"].as_bool().unwrap() {
        assert!(Instant::now() < deadline, "a bare queued signal did not toggle on");
        std::thread::sleep(Duration::from_millis(5));
    }
    s.quit();
}

#[test]
fn switching_on_at_start_by_environment_and_by_watcher() {
    let mut s = Server::start("env", &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_SWITCH", "none")]);
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(1));
    s.quit();

    // The default: a watcher thread, woken through the counters file.
    let mut s = Server::start("watch", &[]);
    assert_eq!(s.cmd("round"), "done");
    let o = s.switch("enable");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(1));
    s.quit();

    // No way to switch while running: the command says so.
    let s = Server::start("nosignal", &[("ALLOCTRAMP_SWITCH", "none")]);
    let o = s.switch("enable");
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("takes no requests while it runs"));
    s.quit();
}

/// The path of process `pid`'s first executable mapping of a file in
/// `dir` or below: its code (the trampolines follow it).
fn code_path(pid: &str, dir: &Path) -> String {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    maps.lines()
        .filter(|l| l.split_whitespace().nth(1) == Some("r-xp"))
        .filter_map(|l| l.find('/').map(|i| l[i..].to_string()))
        .find(|p| Path::new(p).starts_with(dir))
        .unwrap_or_else(|| panic!("process {pid} maps no code from {}: {maps}", dir.display()))
}

#[test]
fn switched_on_at_start_the_code_is_the_switched_image_not_copied_pages() {
    let image = |s: &Server| s.dir.join(layout::IMAGE_DIR).join("server.bin").display().to_string();
    let own = |s: &Server| s.dir.join("server.bin").display().to_string();
    // Live tracking from the start: the code is the image's, the counts
    // are exact, and switching off and on again writes over its pages.
    // (The counters file appears before the sites switch: the code is
    // looked at once the program answers.)
    let mut s = Server::start("image", &[("ALLOCTRAMP", "on")]);
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(code_path(&s.pid(), &s.dir), image(&s));
    assert_eq!(copied_kb(&s.pid(), &image(&s)), 0, "no code page copied");
    assert_eq!(s.figures(), round_figures(1));
    assert!(s.switch("disable").status.success());
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(1), "off: not counted");
    assert!(s.switch("enable").status.success());
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.figures(), round_figures(2));
    s.quit();

    // Counting only wants the jumps of the counting image: its code is
    // that image's, and counts exactly. Without that image (patched with
    // `--images live`), the sites are written (their pages copied).
    let counting = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_LIVE", "0")];
    let count_image = |s: &Server| s.dir.join(layout::COUNT_IMAGE_DIR).join("server.bin").display().to_string();
    let mut s = Server::start("image-count", &counting);
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(code_path(&s.pid(), &s.dir), count_image(&s));
    assert_eq!(copied_kb(&s.pid(), &count_image(&s)), 0, "no code page copied");
    assert_eq!(s.figures(), round_figures(1));
    s.quit();
    let no_count_image = |bin: &Path| {
        std::fs::remove_file(bin.parent().unwrap().join(layout::COUNT_IMAGE_DIR).join("server.bin")).unwrap()
    };
    let mut s = Server::start_prepared("image-count-none", &counting, None, no_count_image);
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(code_path(&s.pid(), &s.dir), own(&s));
    assert!(copied_kb(&s.pid(), &own(&s)) > 0);
    assert_eq!(s.figures(), round_figures(1));
    s.quit();

    // An image that is not the file's, or that others could have changed,
    // is not used: the file was written since; others may write the image;
    // its site table differs from the file's (a byte of its strings); its
    // first site does not hold the jump; it is a symbolic link (to a good
    // copy); it belongs to another user.
    let image_of = |bin: &Path| bin.parent().unwrap().join(layout::IMAGE_DIR).join("server.bin");
    let keep_time = |bin: &Path, change: &dyn Fn(&mut Vec<u8>)| {
        let path = image_of(bin);
        let time = std::fs::metadata(&path).unwrap().modified().unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        change(&mut bytes);
        std::fs::write(&path, &bytes).unwrap();
        std::fs::File::options().write(true).open(&path).unwrap().set_modified(time).unwrap();
    };
    let older = |bin: &Path| {
        let f = std::fs::OpenOptions::new().write(true).open(bin).unwrap();
        f.set_modified(std::time::SystemTime::now() - Duration::from_secs(60)).unwrap();
    };
    let writable = |bin: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(image_of(bin), std::fs::Permissions::from_mode(0o757)).unwrap();
    };
    let table = |bin: &Path| {
        keep_time(bin, &|b| {
            let at = layout::table_after_phdrs(b).unwrap();
            let len = layout::Table::parse(&b[at..]).unwrap().bytes().len();
            b[at + len - 2] ^= 0x20;
        })
    };
    let site = |bin: &Path| {
        let file = std::fs::read(bin).unwrap();
        keep_time(bin, &|b| {
            let first = b.iter().zip(&file).position(|(x, y)| x != y).unwrap();
            b[first] = file[first];
        })
    };
    let link = |bin: &Path| {
        let path = image_of(bin);
        let elsewhere = bin.with_extension("image");
        std::fs::rename(&path, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &path).unwrap();
    };
    let owner = |bin: &Path| std::os::unix::fs::chown(image_of(bin), Some(65534), Some(65534)).unwrap();
    type Prepare<'a> = &'a dyn Fn(&Path);
    let mut preparations: Vec<(&str, Prepare)> = vec![
        ("image-stale", &older),
        ("image-writable", &writable),
        ("image-table", &table),
        ("image-site", &site),
        ("image-link", &link),
    ];
    // SAFETY: geteuid cannot fail.
    match unsafe { libc::geteuid() } {
        0 => preparations.push(("image-owner", &owner)),
        _ => skip(test_name(), "an image of another user's needs root to make"),
    }
    for (name, prepare) in preparations {
        let mut s = Server::start_prepared(name, &[("ALLOCTRAMP", "on")], None, prepare);
        assert_eq!(s.cmd("round"), "done");
        assert_eq!(code_path(&s.pid(), &s.dir), own(&s), "{name}");
        assert_eq!(s.figures(), round_figures(1), "{name}");
        s.quit();
    }

    // Switched on later: by the watcher thread (a second thread), or with
    // one thread by the control signal's handler (whose stack is the
    // program's): the sites are written.
    for (name, env) in [("image-later", &[][..]), ("image-signal", &[("ALLOCTRAMP_SWITCH", "signal")][..])] {
        let mut s = Server::start(name, env);
        // Its modules registered (its file is there before): a module that
        // registers once profiling is on switches on at registration, by
        // the image.
        assert_eq!(s.cmd("round"), "done");
        assert!(s.switch("enable").status.success(), "{name}");
        assert_eq!(s.cmd("round"), "done");
        assert_eq!(code_path(&s.pid(), &s.dir), own(&s), "{name}");
        assert_eq!(s.figures(), round_figures(1), "{name}");
        s.quit();
    }
}

/// The kilobytes of process `pid`'s mapping of `path` that are copies of
/// the file's pages (`Anonymous` in `/proc/PID/smaps`).
fn copied_kb(pid: &str, path: &str) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut in_it = false;
    for l in smaps.lines() {
        let range = l.split_whitespace().next().unwrap_or("");
        if range.contains('-') && range.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            in_it = l.ends_with(path) && l.contains(" r-xp ");
        } else if in_it && let Some(kb) = l.strip_prefix("Anonymous:") {
            return kb.trim().trim_end_matches("kB").trim().parse().unwrap();
        }
    }
    panic!("process {pid} does not map {path}")
}

#[test]
fn a_debugger_s_breakpoint_survives_switching_on_at_start() {
    // gdb writes its breakpoints into the code before the runtime switches
    // the sites on at start-up: the runtime sees the written page and
    // writes the sites instead of mapping the image over gdb's breakpoint.
    let b = built(Config { opt: "-O0", pie: true, extra: "" });
    let dir = counters_dir("gdb-on");
    let out = dir.join("basic");
    patch_to(&b.path("basic"), &out, &[]);
    assert!(dir.join(layout::IMAGE_DIR).join("basic").is_file());
    let o = Command::new("gdb")
        .args(["-nx", "-batch", "-ex", "break main", "-ex", "run", "-ex", "info proc mappings", "-ex", "continue"])
        .arg(&out)
        .env("ALLOCTRAMP", "on")
        .env("ALLOCTRAMP_DIR", &dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("Breakpoint 1, main ()"), "{text}");
    assert!(text.contains("exited normally"), "{text}");
    let code = text
        .lines()
        .find(|l| l.contains("r-xp") && l.ends_with("/basic"))
        .unwrap_or_else(|| panic!("no code mapping: {text}"));
    assert!(code.ends_with(&format!(" {}", out.display())), "the file's own code, not the image: {code}");
    let doc = report(only_counters_file(&dir).to_str().unwrap(), &dir);
    assert_eq!(figures(&doc), expected(&[program("basic")]), "under gdb");
}

/// Sends a signal with kill(2).
fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid and a signal number.
    assert_eq!(unsafe { libc::kill(pid as i32, sig) }, 0);
}

fn calls(doc: &Value) -> u64 {
    doc["sites"].as_array().unwrap().iter().map(|s| s["calls"].as_u64().unwrap()).sum()
}

/// Posts a request in a process's counters file and wakes its watcher, as
/// `alloctramp enable|disable` do, without waiting for it.
fn post(file: &Path, code: u32) {
    use alloctramp_trampolines::process::{PROC_HEADER_SIZE, ProcHeader};
    use std::sync::atomic::Ordering;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(file).unwrap();
    // SAFETY: a shared mapping of the header of a file the test owns, written
    // only through atomics.
    let mut map = unsafe { memmap2::MmapOptions::new().len(PROC_HEADER_SIZE as usize).map_mut(&f) }.unwrap();
    let h: &ProcHeader = alloctramp_trampolines::pod::view_shared(&mut map).unwrap();
    h.request.store(code, Ordering::Release);
    h.wake.fetch_add(1, Ordering::AcqRel);
    // SAFETY: FUTEX_WAKE on the shared word.
    unsafe { libc::syscall(libc::SYS_futex, h.wake.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

#[test]
fn stress_eight_threads_while_switching_ten_thousand_times() {
    stress("signal");
}

#[test]
fn stress_eight_threads_while_the_watcher_switches_ten_thousand_times() {
    stress("thread");
}

/// Waits until no instance of signal `sig` sent to process `pid` is still
/// queued (its bit clear in /proc/PID/status's ShdPnd).
fn wait_until_no_signal_pending(pid: u32, sig: i32) {
    let start = Instant::now();
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let pending = status
            .lines()
            .find_map(|l| l.strip_prefix("ShdPnd:"))
            .map(|h| u64::from_str_radix(h.trim(), 16).unwrap())
            .unwrap();
        if pending & (1 << (sig - 1)) == 0 {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "signal {sig} still queued after 60 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the generation of process `target`'s switches has stayed
/// the same for `quiet`.
fn wait_until_no_switch_for(target: &str, dir: &Path, quiet: Duration) {
    let start = Instant::now();
    let generation = || report(target, dir)["generation"].as_u64().expect("the report gives the generation");
    let mut last = generation();
    let mut since = Instant::now();
    while since.elapsed() < quiet {
        assert!(start.elapsed() < Duration::from_secs(60), "switches still carried out after 60 s");
        std::thread::sleep(Duration::from_millis(50));
        let g = generation();
        if g != last {
            last = g;
            since = Instant::now();
        }
    }
}

fn stress(mode: &str) {
    let b = built(Config::default_o2());
    let dir = counters_dir(&format!("stress-{mode}"));
    let bin = dir.join("stress");
    patch_to(&b.path("stress"), &bin, &[]);
    let mut child = Command::new(&bin)
        .env("ALLOCTRAMP_DIR", &dir)
        .env("ALLOCTRAMP_SWITCH", mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "started");
    let pid = child.id();
    let sig = libc::SIGRTMAX() - 7;
    let file = process_file(&dir, pid);
    // No control file: each signal toggles. The watcher is asked on and
    // off in turn, faster than it can follow (requests fold together).
    let mut last = 0;
    let start = Instant::now();
    for i in 0..10_000 {
        if mode == "signal" {
            kill(pid, sig);
        } else {
            post(&file, if i % 2 == 0 { 1 } else { 2 });
        }
        if i % 500 == 499 {
            let doc = report(&pid.to_string(), &dir);
            let c = calls(&doc);
            assert!(c >= last, "calls went down: {last} -> {c}");
            last = c;
        }
    }
    // The control signal is a real-time one: each of those sent is queued
    // and toggles when it is taken, so a toggle still queued would turn
    // profiling on again after the disable below. Wait until none is.
    // A toggle already taken from the queue may still be on its way
    // through a handler; one that finished after the disable would turn
    // profiling on again. Wait until no switch has been carried out for
    // half a second.
    if mode == "signal" {
        wait_until_no_signal_pending(pid, sig);
        wait_until_no_switch_for(&pid.to_string(), &dir, Duration::from_millis(500));
    }
    let doc = report(&pid.to_string(), &dir);
    assert!(doc["generation"].as_u64().expect("the report gives the generation") > 0, "requests were carried out");
    // Requests fold together: a watcher that a loaded machine seldom runs
    // may have carried out only requests to switch off. Switched on for
    // good, the threads count.
    let o = alloctramp().arg("enable").arg("--dir").arg(&dir).arg(pid.to_string()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let deadline = Instant::now() + Duration::from_secs(10);
    while calls(&report(&pid.to_string(), &dir)) <= last {
        assert!(Instant::now() < deadline, "nothing counted once on");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Switch off for good and wait until it is done.
    let o = alloctramp().arg("disable").arg("--dir").arg(&dir).arg(pid.to_string()).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let off = calls(&report(&pid.to_string(), &dir));
    assert!(off >= last && off > 0, "counted while on: {off}");
    // A call already inside a trampoline when the switch completed may
    // still count; once those have returned, nothing is counted.
    std::thread::sleep(Duration::from_millis(100));
    let settled = calls(&report(&pid.to_string(), &dir));
    assert!(settled >= off && settled - off <= 8, "at most one call in flight per thread: {off} -> {settled}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(calls(&report(&pid.to_string(), &dir)), settled, "nothing counted once off");
    writeln!(child.stdin.as_mut().unwrap(), "stop").unwrap();
    line.clear();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ok work done");
    assert!(child.wait().unwrap().success());
    eprintln!("10,000 switch requests ({mode}) under load in {:?}", start.elapsed());
}

fn parked_figures(doc: &Value) -> BTreeMap<(u32, String), u64> {
    doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                (s["line"].as_u64().unwrap() as u32, s["entry"].as_str().unwrap().to_string()),
                s["calls"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn sites_switched_while_threads_are_inside_the_target() {
    let b = built(Config::default_o2());
    let p = program("parked");
    let line_of = |entry: &str, user: bool| -> Vec<u32> {
        let ms = if user { &p.user_markers } else { &p.markers };
        ms.iter().filter(|m| m.entry == entry).map(|m| m.line).collect()
    };
    for start_on in [true, false] {
        let dir = counters_dir(&format!("parked-{start_on}"));
        let bin = dir.join("parked");
        patch_to(&b.path("parked"), &bin, &["--entry", "slow_alloc:alloc", OWN]);
        let mut cmd = Command::new(&bin);
        cmd.env("ALLOCTRAMP_DIR", &dir).stdin(Stdio::piped()).stdout(Stdio::piped());
        if start_on {
            cmd.env("ALLOCTRAMP", "on");
        }
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "parked");
        // Both threads are inside slow_alloc: switch the other way.
        let what = if start_on { "disable" } else { "enable" };
        let o = alloctramp().arg(what).arg("--dir").arg(&dir).arg(child.id().to_string()).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        writeln!(child.stdin.as_mut().unwrap(), "go").unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        assert_eq!(rest, "dt 4\n", "threads returned correctly");
        assert!(child.wait().unwrap().success());
        let f = parked_figures(&report(only_counters_file(&dir).to_str().unwrap(), &dir));
        // Calls of slow_alloc were counted if they were made while on; the
        // malloc and the frees after the switch if the switch was to on.
        let (entered, after) = if start_on { (1, 0) } else { (0, 1) };
        for l in line_of("slow_alloc", true) {
            assert_eq!(f[&(l, "slow_alloc".to_string())], entered, "slow_alloc at line {l}");
        }
        for l in line_of("malloc", false) {
            assert_eq!(f[&(l, "malloc".to_string())], 2 * after, "malloc at line {l}");
        }
        for l in line_of("free", false) {
            assert_eq!(f[&(l, "free".to_string())], after, "free at line {l}");
        }
    }
}

#[test]
fn modules_loaded_with_dlopen_and_unloaded_with_dlclose() {
    let b = built(Config::default_o2());
    let dir = counters_dir("dlopen");
    let bin_dir = dir.join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    patch_to(&b.path("dlopener"), &bin_dir.join("dlopener"), &[]);
    patch_to(&b.path("libatshared"), &bin_dir.join("libatshared.so"), &[]);
    let out = run_program(
        &bin_dir.join("dlopener"),
        &[bin_dir.to_string_lossy().into_owned()],
        &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())],
    );
    assert_eq!(out, ("dlopen ok\n".to_string(), String::new(), 0));
    let doc = report(only_counters_file(&dir).to_str().unwrap(), &dir);
    let lib = doc["modules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "libatshared.so")
        .expect("the dlopened library registered");
    assert_eq!(lib["unloaded"], true, "dlclose unregistered it");
    let f = figures(&doc);
    let lib_src = program("libatshared");
    let line = |e: &str| lib_src.markers.iter().find(|m| m.entry == e).unwrap().line;
    assert_eq!(f[&("libatshared.c".to_string(), line("malloc"), "malloc".to_string())], (3, 120, 0));
    assert_eq!(f[&("libatshared.c".to_string(), line("free"), "free".to_string())], (3, 0, 0));
}

/// An unpatched host loads two patched copies of a library (the first
/// brings the runtime in), allocates in the first, unloads it and frees the
/// object through the second: the free counts on the unloaded copy's site,
/// through the runtime's own mapping of its counters.
#[test]
fn an_object_of_an_unloaded_library_freed_through_another() {
    let b = built(Config::default_o2());
    let dir = counters_dir("handover");
    let bin_dir = dir.join("bin");
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::fs::copy(b.path("dlopener"), bin_dir.join("dlopener")).unwrap();
    patch_to(&b.path("libatshared"), &bin_dir.join("libatshared.so"), &[]);
    patch_to(&b.path("libatshared"), &bin_dir.join("libatshared_b.so"), &[]);
    let out = run_program(
        &bin_dir.join("dlopener"),
        &[bin_dir.to_string_lossy().into_owned(), "handover".into()],
        &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())],
    );
    assert_eq!(out, ("handover ok\n".to_string(), String::new(), 0));
    let live = live_figures(&only_counters_file(&dir));
    let lib_src = program("libatshared");
    let line = |e: &str| lib_src.markers.iter().find(|m| m.entry == e).unwrap().line;
    let key = |e: &str| ("libatshared.c".to_string(), line(e), e.to_string());
    // Summed over both copies: nothing live, every free tracked.
    assert_eq!(live[&key("malloc")], (0, 0, 0), "{live:?}");
    assert_eq!(live[&key("free")], (0, 0, 0), "{live:?}");
    let doc = report(only_counters_file(&dir).to_str().unwrap(), &dir);
    let f = figures(&doc);
    assert_eq!(f[&("libatshared.c".to_string(), line("malloc"), "malloc".to_string())], (4, 144, 0));
    assert_eq!(f[&("libatshared.c".to_string(), line("free"), "free".to_string())], (4, 0, 0));
}

/// What a forker process's counters file says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct ForkerFile {
    /// Calls at its malloc sites.
    mallocs: u64,
    on: bool,
    exited: bool,
}

/// Runs the patched forker with `args`, profiling on, its counters in a
/// directory of `name`: its output, and that directory.
fn run_forker(name: &str, args: &[String]) -> ((String, String, i32), PathBuf) {
    let b = built(Config::default_o2());
    let dir = counters_dir(name);
    let bin = dir.join("forker");
    patch_to(&b.path("forker"), &bin, &[]);
    let out = run_program(&bin, args, &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())]);
    (out, dir)
}

/// The counters files in `dir`, in order (the pid each names is in the
/// debug text).
fn forker_files(dir: &Path) -> (Vec<ForkerFile>, String) {
    let mut by_pid = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "counters") {
            let doc = report(p.to_str().unwrap(), dir);
            let mallocs: u64 = doc["sites"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["entry"] == "malloc")
                .map(|s| s["calls"].as_u64().unwrap())
                .sum();
            let flag = |k: &str| doc[k].as_bool().unwrap_or_else(|| panic!("{k} in {doc}"));
            let file = ForkerFile { mallocs, on: flag("on"), exited: flag("exited") };
            by_pid.insert(doc["pid"].as_u64().unwrap(), file);
        }
    }
    let mut files: Vec<ForkerFile> = by_pid.values().copied().collect();
    files.sort();
    (files, format!("{by_pid:?}"))
}

/// A process that never profiled keeps its modules out of its counters
/// file (they join it at their first switch on), and so does a child it
/// forks: switched on later, the child's figures are exact from zero, the
/// parent's file still holds no module, and the parent, which never
/// profiled, removes its file at exit.
#[test]
fn a_never_profiled_parent_s_forked_child_switched_on_later_counts_exactly() {
    let mut s = Server::start("fork-later", &[]);
    assert_eq!(s.cmd("round"), "done");
    let parent = s.pid();
    let pfile = s.dir.join(format!("{parent}.counters"));
    let header_only =
        |f: &Path| std::fs::metadata(f).unwrap().len() == alloctramp_trampolines::process::PROC_HEADER_SIZE;
    assert!(header_only(&pfile), "never profiled: the header only");
    let child = s.cmd("fork").strip_prefix("child ").expect("child PID").to_string();
    let cfile = s.dir.join(format!("{child}.counters"));
    // Its watcher thread makes it a few milliseconds after the fork.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cfile.exists() {
        assert!(std::time::Instant::now() < deadline, "the child's file never came: {}", cfile.display());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(header_only(&cfile), "the child of a process that never profiled: the header only");
    // The process list counts the modules not in the files yet, and their
    // sites: as many as once they joined.
    let list = || {
        let o = alloctramp().args(["report", "--dir"]).arg(&s.dir).output().unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let columns = |list: &str, pid: &str| -> Vec<String> {
        let line = list.lines().find(|l| l.split_whitespace().next() == Some(pid)).expect("listed");
        line.split_whitespace().map(str::to_string).collect()
    };
    let before = list();
    let sites = columns(&before, &parent)[3].clone();
    assert!(sites.parse::<u64>().unwrap() > 0, "{before}");
    for pid in [&parent, &child] {
        assert_eq!(columns(&before, pid)[1..6], ["off", "0", &sites, "1", "module"], "{before}");
    }
    let o = alloctramp().args(["enable", "--dir"]).arg(&s.dir).arg(&child).output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stderr).contains("profiling on"), "{o:?}");
    assert!(!header_only(&cfile), "switched on: the child's modules joined its file");
    let after = list();
    assert_eq!(columns(&after, &child)[1..5], ["on", "0", &sites, "server"], "{after}");
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(s.cmd("round"), "done");
    assert_eq!(figures(&report(&child, &s.dir)), round_figures(2), "the child's figures");
    assert!(header_only(&pfile), "the parent's file is untouched");
    let dir = s.dir.clone();
    s.quit();
    assert!(!pfile.exists(), "the parent never profiled: its file went at exit");
    assert_eq!(figures(&report(cfile.to_str().unwrap(), &dir)), round_figures(2), "the child's final file");
}

#[test]
fn a_forked_child_counts_into_its_own_file_from_zero() {
    let (out, dir) = run_forker("fork", &[]);
    assert_eq!(out, ("child 2\nparent 7\n".to_string(), String::new(), 0));
    let (files, by_pid) = forker_files(&dir);
    let on: Vec<(u64, bool)> = files.iter().map(|f| (f.mallocs, f.on)).collect();
    assert_eq!(on, vec![(2, true), (7, true)], "child and parent files: {by_pid}");
}

#[test]
fn a_forked_child_that_runs_another_program_leaves_no_counters_file() {
    let (out, dir) = run_forker("fork-exec", &["exec".into()]);
    assert_eq!(out, ("parent 7\n".to_string(), String::new(), 0));
    // The child's file (it counted nothing before it became /bin/sh) went
    // when the parent exited, though the directory is within its bound.
    let (files, by_pid) = forker_files(&dir);
    let left: Vec<(u64, bool)> = files.iter().map(|f| (f.mallocs, f.exited)).collect();
    assert_eq!(left, [(7, true)], "the parent's file alone: {by_pid}");
}

/// A child forked by a process that never profiled makes its counters
/// file only some milliseconds after the fork, in its watcher thread: one
/// that runs another program at once makes none (here, though its parent
/// is killed before any exit handler could remove one).
#[test]
fn a_never_profiled_parent_s_child_that_runs_another_program_at_once_makes_no_file() {
    let b = built(Config::default_o2());
    let dir = counters_dir("fork-exec-off");
    let bin = dir.join("forker");
    patch_to(&b.path("forker"), &bin, &[]);
    let mut parent = 0;
    let made = created_in(&dir, || {
        let child = Command::new(&bin)
            .arg("exec-killed")
            .env("ALLOCTRAMP_DIR", &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        parent = child.id();
        let o = child.wait_with_output().unwrap();
        let out = (o.status.code(), &o.stdout[..], &o.stderr[..]);
        assert_eq!(out, (None, &b""[..], &b""[..]), "killed by its signal");
    });
    // The child made no file, not even for a moment. The parent, never
    // profiled, makes its file 10 ms after it starts if it lives that long,
    // and, killed, cannot remove it.
    let mine = [format!("{parent}.counters.new"), format!("{parent}.counters")];
    assert!(made.iter().all(|n| mine.contains(n)), "the killed parent's file at most: {made:?}");
    let files = counters_files(&dir);
    assert!(files.len() <= 1 && files.iter().all(|f| f.ends_with(&mine[1])), "{files:?}");
    let (parsed, by_pid) = forker_files(&dir);
    let v: Vec<(u64, bool, bool)> = parsed.iter().map(|f| (f.mallocs, f.on, f.exited)).collect();
    assert!(v.iter().all(|f| *f == (0, false, false)), "never profiled, killed: {by_pid}");
}

/// The names created in (or moved into) `dir` while `f` runs.
fn created_in(dir: &Path, f: impl FnOnce()) -> Vec<String> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: plain system calls on a descriptor this function owns and
    // closes, and a buffer it owns.
    unsafe {
        let fd = libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC);
        assert!(fd >= 0);
        assert!(libc::inotify_add_watch(fd, path.as_ptr(), libc::IN_CREATE | libc::IN_MOVED_TO) >= 0);
        f();
        let mut names = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            if n <= 0 {
                break;
            }
            let mut at = 0;
            while at + 16 <= n as usize {
                let len = u32::from_ne_bytes(buf[at + 12..at + 16].try_into().unwrap()) as usize;
                let name = &buf[at + 16..at + 16 + len];
                let end = name.iter().position(|&c| c == 0).unwrap_or(len);
                names.push(String::from_utf8_lossy(&name[..end]).into_owned());
                at += 16 + len;
            }
        }
        libc::close(fd);
        names
    }
}

/// A process that starts with profiling off makes its counters file 10 ms
/// after it starts: a short one makes none, and a request that arrives
/// before the file waits for it.
#[test]
fn a_process_started_off_makes_its_file_only_if_it_lives_and_is_enabled_at_once() {
    let b = built(Config::default_o2());
    let dir = counters_dir("start-off-file");
    let bin = dir.join("basic");
    patch_to(&b.path("basic"), &bin, &[]);
    // (A run that took over 10 ms, on a busy machine, may make one: one
    // run in five that makes none will do.)
    let mut made = Vec::new();
    for _ in 0..5 {
        made = created_in(&dir, || {
            let (out, err, code) = run_program(&bin, &[], &[("ALLOCTRAMP_DIR", dir.to_str().unwrap())]);
            assert_eq!((err.as_str(), code), ("", 0), "{out}");
        });
        if made.is_empty() {
            break;
        }
    }
    assert_eq!(made, Vec::<String>::new(), "a process that ended at once made no file");
    assert_eq!(counters_files(&dir), Vec::<PathBuf>::new(), "nor left one");

    // Enabled as soon as it runs: the command waits for the file.
    let server = dir.join("server");
    patch_to(&b.path("server"), &server, &[]);
    let mut talk = Talk::spawn(Command::new(&server).env("ALLOCTRAMP_DIR", &dir), &[]);
    let pid = talk.child.id().to_string();
    let o = alloctramp().arg("enable").arg("--dir").arg(&dir).arg(&pid).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    talk.send("round");
    assert_eq!(talk.line(), "done\n");
    assert_eq!(figures(&report(&pid, &dir)), round_figures(1));
    talk.send("quit");
    assert_eq!(talk.finish().1, Some(0));
}

#[test]
fn clean_removes_the_empty_file_of_a_forked_child_that_ran_another_program() {
    // The parent is killed before its exit handlers could prune anything.
    let (out, dir) = run_forker("fork-exec-clean", &["exec-killed".into()]);
    assert_eq!(out, (String::new(), String::new(), -1), "killed by its signal");
    let (files, by_pid) = forker_files(&dir);
    let v: Vec<(u64, bool)> = files.iter().map(|f| (f.mallocs, f.exited)).collect();
    assert_eq!(v, [(0, false), (3, false)], "the child's empty file and the killed parent's: {by_pid}");
    let o = alloctramp().arg("clean").arg("--dir").arg(&dir).arg("--keep").arg("10").output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("removed 1 counters file of ended processes"), "{err}");
    let (files, by_pid) = forker_files(&dir);
    let left: Vec<(u64, bool)> = files.iter().map(|f| (f.mallocs, f.exited)).collect();
    assert_eq!(left, [(3, false)], "the killed parent's stays: {by_pid}");
}

/// A parent that forked reads, at exit, only the files of processes given
/// higher PIDs than its own (its children's), not the whole directory: an
/// empty file left before it started waits for a prune past the bound.
#[test]
fn a_parent_that_forked_removes_its_children_s_empty_files_and_reads_no_older_file() {
    let (out, dir) = run_forker("fork-exec-older", &["exec-killed".into()]);
    assert_eq!(out.2, -1, "killed by its signal");
    let bin = dir.join("forker");
    let out = run_program(&bin, &["exec".into()], &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", dir.to_str().unwrap())]);
    assert_eq!(out, ("parent 7\n".to_string(), String::new(), 0));
    let (files, by_pid) = forker_files(&dir);
    let left: Vec<(u64, bool)> = files.iter().map(|f| (f.mallocs, f.exited)).collect();
    assert_eq!(
        left,
        [(0, false), (3, false), (7, true)],
        "the first child's empty file and the killed parent's stay, the second child's went: {by_pid}"
    );
    // A prune that reads every file removes it.
    let o = alloctramp().arg("clean").arg("--dir").arg(&dir).arg("--keep").arg("10").output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let (files, by_pid) = forker_files(&dir);
    assert_eq!(files.len(), 2, "{by_pid}");
}

fn mode(p: &Path) -> u32 {
    std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions()) & 0o7777
}

#[test]
fn private_files_and_refusal_of_unsafe_directories() {
    let b = built(Config::default_o2());
    let dir = counters_dir("security");
    let bin = dir.join("basic");
    patch_to(&b.path("basic"), &bin, &[]);
    let expected = run_program(&b.path("basic"), &[], &[]);

    let ok = dir.join("ok");
    let out = run_program(&bin, &[], &[("ALLOCTRAMP_DIR", ok.to_str().unwrap())]);
    assert_eq!(out, expected);
    assert_eq!(mode(&ok), 0o700, "the runtime creates its directory 0700");
    for e in std::fs::read_dir(&ok).unwrap() {
        assert_eq!(mode(&e.unwrap().path()), 0o600, "files are 0600");
    }

    // A directory others can write to is refused: one line, no files, the
    // program runs as always.
    let open = dir.join("open");
    std::fs::create_dir_all(&open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let (o, e, rc) = run_program(&bin, &[], &[("ALLOCTRAMP_DIR", open.to_str().unwrap()), ("ALLOCTRAMP", "on")]);
    assert_eq!((o, rc), (expected.0.clone(), expected.2));
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.contains("accessible to other users"), "{e}");
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);

    // A symlink in place of the directory is refused too.
    let link = dir.join("link");
    std::os::unix::fs::symlink(&ok, &link).unwrap();
    let (_, e, rc) = run_program(&bin, &[], &[("ALLOCTRAMP_DIR", link.to_str().unwrap())]);
    assert_eq!(rc, expected.2);
    assert!(e.contains("not a directory"), "{e}");
}

/// The shared site tables in a counters directory's tables directory.
fn shared_tables(dir: &Path) -> Vec<PathBuf> {
    let mut t: Vec<PathBuf> =
        std::fs::read_dir(dir.join("tables")).map(|d| d.map(|e| e.unwrap().path()).collect()).unwrap_or_default();
    t.sort();
    t
}

/// Sets a file's modification time `secs` seconds back.
fn age(path: &Path, secs: u64) {
    let then = std::time::SystemTime::now() - Duration::from_secs(secs);
    std::fs::File::options().write(true).open(path).unwrap().set_modified(then).unwrap();
}

#[test]
fn processes_of_one_patched_file_share_its_site_table() {
    use alloctramp_trampolines::process::{self, ProcessFile};
    let b = built(Config::default_o2());
    let dir = counters_dir("shared-tables");
    let bin = dir.join("basic");
    patch_to(&b.path("basic"), &bin, &[]);
    let expected = run_program(&b.path("basic"), &[], &[]);
    let run = dir.join("run");
    let on = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", run.to_str().unwrap())];
    for _ in 0..2 {
        assert_eq!(run_program(&bin, &[], &on), expected);
    }
    // One table, written once, that both files name and neither holds.
    let tables = shared_tables(&run);
    assert_eq!(tables.len(), 1, "{tables:?}");
    let table = std::fs::read(&tables[0]).unwrap();
    let id = process::table_id(&table);
    assert_eq!(tables[0].file_name().unwrap().to_str().unwrap(), process::shared_table_name(id));
    assert_eq!((mode(&run.join("tables")), mode(&tables[0])), (0o700, 0o600));
    let files = counters_files(&run);
    assert_eq!(files.len(), 2);
    let mut reports = Vec::new();
    for f in &files {
        let raw = std::fs::read(f).unwrap();
        assert_eq!(process::shared_tables(&raw), [(0, id, table.len() as u64)], "{}", f.display());
        assert!(!raw.windows(8).any(|w| w == &table[..8]), "{}: no copy of a table (its magic)", f.display());
        let doc = report(f.to_str().unwrap(), &run);
        assert!(figures(&doc).values().any(|v| v.0 > 0), "counted: {doc}");
        reports.push(figures(&doc));
    }
    assert_eq!(reports[0], reports[1], "the same program, the same figures");

    // A snapshot holds the table: it reads without the tables directory, a
    // bare copy of the counters file does not, and says which is missing.
    let snap = dir.join("basic.snapshot");
    let o = alloctramp().arg("snapshot").arg(&files[0]).arg("-o").arg(&snap).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let away = dir.join("tables-away");
    std::fs::rename(run.join("tables"), &away).unwrap();
    assert_eq!(figures(&report(snap.to_str().unwrap(), &run)), reports[0]);
    assert_eq!(process::table_ids(&std::fs::read(&snap).unwrap()), [id]);
    let o = alloctramp().arg("report").arg(&files[0]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!(
            "module 0: its site table, tables/{} beside the counters file",
            process::shared_table_name(id)
        )) && err.contains(files[0].to_str().unwrap()),
        "{err}"
    );
    // The process list says which files it cannot read, and why; without
    // --all, files of ended processes are not its business.
    let list = |all: bool| {
        let mut c = alloctramp();
        c.args(["report", "--dir"]).arg(&run);
        if all {
            c.arg("--all");
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{o:?}");
        (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (out, err) = list(true);
    assert!(out.is_empty(), "{out}");
    for f in &files {
        let said = err.lines().filter(|l| l.contains(f.to_str().unwrap())).collect::<Vec<_>>();
        assert!(said.len() == 1 && said[0].contains("tables/") && said[0].ends_with("(not listed)"), "{err}");
    }
    assert_eq!(err.lines().count(), files.len(), "{err}");
    let (out, err) = list(false);
    assert!(out.is_empty() && !err.contains("not listed"), "{out}{err}");
    std::fs::rename(&away, run.join("tables")).unwrap();

    // A clean-up keeps a table while a file names it or it was used lately,
    // and removes it after.
    let clean = |keep: &str| {
        let o = alloctramp().args(["clean", "--keep", keep, "--dir"]).arg(&run).output().unwrap();
        assert!(o.status.success(), "{o:?}");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    age(&tables[0], 3600);
    let said = clean("1");
    assert!(!said.contains("shared site table"), "{said}");
    assert_eq!(shared_tables(&run), tables, "a kept file names it");
    std::fs::write(run.join("tables").join("00000000000000aa.sites.99.new"), b"part").unwrap();
    age(&tables[0], 0);
    let said = clean("0");
    assert!(said.contains("removed 1 counters file"), "{said}");
    assert!(!said.contains("shared site table"), "used a moment ago: {said}");
    assert_eq!(shared_tables(&run).len(), 2, "the table and the fresh temporary stay");
    for t in shared_tables(&run) {
        age(&t, 3600);
    }
    let said = clean("0");
    assert!(said.contains("removed 2 shared site tables"), "{said}");
    assert!(shared_tables(&run).is_empty());

    // Where no table can be shared (the name is taken by a file), the
    // process copies it into its own file, as before.
    let copied = dir.join("copied");
    std::fs::create_dir_all(&copied).unwrap();
    std::fs::set_permissions(&copied, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    std::fs::write(copied.join("tables"), b"not a directory").unwrap();
    let on = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", copied.to_str().unwrap())];
    assert_eq!(run_program(&bin, &[], &on), expected);
    let file = only_counters_file(&copied);
    let raw = std::fs::read(&file).unwrap();
    assert!(process::shared_tables(&raw).is_empty() && process::table_ids(&raw).is_empty());
    assert_eq!(ProcessFile::parse(&raw).unwrap().modules().unwrap()[0].table.bytes(), &table[..]);
    assert_eq!(figures(&report(file.to_str().unwrap(), &copied)), reports[0]);
}

#[test]
fn a_process_that_prunes_the_directory_removes_the_tables_no_file_names() {
    let b = built(Config::default_o2());
    let dir = counters_dir("prune-tables");
    let (first, second) = (dir.join("basic"), dir.join("uses_lib"));
    patch_to(&b.path("basic"), &first, &[]);
    patch_to(&b.path("uses_lib"), &second, &[]);
    let run = dir.join("run");
    let env = |keep: &'static str| {
        [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", run.to_str().unwrap()), ("ALLOCTRAMP_KEEP", keep)]
    };
    assert_eq!(run_program(&first, &[], &env("8")).2, 0);
    let old = shared_tables(&run);
    assert_eq!(old.len(), 1);
    // Unused for an hour, but named by the first process's file, which
    // stays while the directory is within its bound.
    age(&old[0], 3600);
    let lib = [("LD_LIBRARY_PATH", b.dir.to_str().unwrap())];
    let second_env: Vec<(&str, &str)> = env("8").into_iter().chain(lib).collect();
    assert_eq!(run_program(&second, &[], &second_env).2, 0);
    assert!(shared_tables(&run).contains(&old[0]), "{:?}", shared_tables(&run));
    // Over the bound of one file: the exit of the next process removes the
    // first process's file, and with it its table; the second's stays,
    // named by the file kept.
    let keep_one: Vec<(&str, &str)> = env("1").into_iter().chain(lib).collect();
    assert_eq!(run_program(&second, &[], &keep_one).2, 0);
    let left = shared_tables(&run);
    assert!(!left.contains(&old[0]), "{left:?}");
    assert!(!left.is_empty(), "the tables the kept file names stay");
    assert_eq!(counters_files(&run).len(), 1);
}

#[test]
fn setuid_programs_leave_the_runtime_inert() {
    // Needs root (to make a setuid program) and an unprivileged user.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !have("setpriv") {
        skip(test_name(), "needs root and setpriv");
        return;
    }
    let b = built(Config::default_o2());
    let dir = std::env::temp_dir().join(format!("alloctramp-setuid-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let bin = dir.join("basic");
    patch_to(&b.path("basic"), &bin, &["--runtime-link", "absolute"]);
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o4755)).unwrap();
    let counters = dir.join("counters");
    std::fs::create_dir_all(&counters).unwrap();
    std::fs::set_permissions(&counters, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&bin)
        .env("ALLOCTRAMP", "on")
        .env("ALLOCTRAMP_DIR", &counters)
        .output()
        .unwrap();
    let expected = run_program(&b.path("basic"), &[], &[]);
    let _ = std::fs::remove_dir_all(&dir);
    if !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("Permission denied") {
        skip(test_name(), "the runtime is not readable by an unprivileged user here");
        return;
    }
    assert_eq!(String::from_utf8_lossy(&o.stdout), expected.0);
    assert_eq!(String::from_utf8_lossy(&o.stderr), "", "inert: no message");
}

#[test]
fn a_system_that_refuses_writable_code_keeps_the_program_unchanged() {
    // Memory-Deny-Write-Execute (Linux 6.3+), set before exec: mprotect can
    // no longer make code writable and executable.
    let launcher = [
        "python3",
        "-c",
        "import ctypes, os, sys; r = ctypes.CDLL(None).prctl(65, 1, 0, 0, 0); \
         sys.exit(77) if r != 0 else os.execv(sys.argv[1], sys.argv[1:])",
    ];
    if !have("python3") {
        skip(test_name(), "needs python3");
        return;
    }
    let mut s = Server::start_with("mdwe", &[], Some(&launcher));
    assert_eq!(s.cmd("round"), "done");
    let o = s.switch("enable");
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.success() {
        skip(test_name(), "this kernel has no Memory-Deny-Write-Execute");
        s.quit();
        return;
    }
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("refused to make code writable"), "{err}");
    assert!(!report(&s.pid(), &s.dir)["on"].as_bool().unwrap(), "still off");
    assert_eq!(s.cmd("round"), "done", "the program runs on, unchanged");
    assert_eq!(s.figures(), zero());
    s.quit();
}
