//! Test support: building the programs in testbins/ in every configuration,
//! reading their markers, and running the alloctramp binary.

#![allow(dead_code)]

use serde_json::Value;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub fn testbins_dir() -> PathBuf {
    workspace().join("testbins")
}

/// A scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("scratch").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The alloctramp binary, with no debuginfod server (`DEBUGINFOD_URLS`
/// unset): tests never reach the network unless they start a server.
pub fn alloctramp() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_alloctramp"));
    cmd.env_remove("DEBUGINFOD_URLS");
    cmd
}

/// Runs alloctramp with arguments; returns the output.
pub fn run_alloctramp<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    alloctramp().args(args).output().expect("spawn alloctramp")
}

/// Runs `alloctramp sites --json FILE [extra...]` and parses the document.
/// The option that counts every allocator call where it is made (the
/// tests whose markers give those figures pass it).
pub const OWN: &str = "--no-charge-callers";

pub fn sites_json(file: &Path, extra: &[&str]) -> Value {
    let out = alloctramp().arg("sites").arg("--json").arg(file).args(extra).output().unwrap();
    assert!(
        out.status.success(),
        "alloctramp sites {} failed: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("sites --json output is JSON")
}

/// One build configuration of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    pub opt: &'static str,
    pub pie: bool,
    pub extra: &'static str,
}

impl Config {
    pub fn all() -> Vec<Config> {
        let mut v = Vec::new();
        for opt in ["-O0", "-O2"] {
            for pie in [true, false] {
                for extra in ["", "-fno-plt", "-fcf-protection=full"] {
                    v.push(Config { opt, pie, extra });
                }
            }
        }
        v
    }
    pub fn default_o2() -> Config {
        Config { opt: "-O2", pie: true, extra: "" }
    }
    pub fn name(&self) -> String {
        let extra = match self.extra {
            "" => "plt",
            "-fno-plt" => "noplt",
            _ => "cet",
        };
        format!("{}-{}-{}", &self.opt[1..], if self.pie { "pie" } else { "nopie" }, extra)
    }
    pub fn optimized(&self) -> bool {
        self.opt != "-O0"
    }
    pub fn no_plt(&self) -> bool {
        self.extra == "-fno-plt"
    }
}

/// The form `sites` gives a marked call in `config`: a jump at -O2 where the
/// marker says `tail`; through the GOT with -fno-plt, unless the call is
/// `direct` (to a function the file defines).
pub fn expected_form(config: Config, tail: bool, direct: bool) -> String {
    let jmp = tail && config.optimized();
    match (jmp, config.no_plt() && !direct) {
        (false, false) => "call rel32",
        (true, false) => "jmp rel32",
        (false, true) => "call [rip+disp]",
        (true, true) => "jmp [rip+disp]",
    }
    .to_string()
}

/// An allocation call marked in a source file.
#[derive(Clone, Debug)]
pub struct Marker {
    pub file: String,
    pub line: u32,
    pub entry: String,
    pub tail: bool,
    pub calls: u64,
    pub bytes: u64,
    pub failed: u64,
    /// Objects (and their bytes) still allocated at exit, where given.
    pub live: Option<(u64, u64)>,
    /// Frees of untracked memory at this site, where given.
    pub untracked: Option<u64>,
    /// Inside an allocation wrapper: charging callers (the default), it counts
    /// only `charged` (calls, bytes; none where not given).
    pub inside: bool,
    pub charged: Option<(u64, u64)>,
    /// In a library: what it counts charging callers when only the
    /// library is patched (`alone=CALLS,BYTES`).
    pub alone: Option<(u64, u64)>,
    /// Inside a function whose callers take its allocations (a hook): what
    /// it counts charging callers, reached without a hook
    /// (`under=CALLS,BYTES`).
    pub under: Option<(u64, u64)>,
}

impl Program {
    /// The sites that count, and what they count, when the program is
    /// patched with no option (charging callers): calls to wrappers count
    /// what the wrappers allocate; a site inside a wrapper counts what
    /// reaches it without such a call (`charged=`), or nothing (it is
    /// listed, not patched).
    pub fn charged_view(&self) -> Vec<Marker> {
        let inside = self.markers.iter().filter(|m| m.inside).map(|m| {
            let (calls, bytes) = m.charged.unwrap_or((0, 0));
            Marker { calls, bytes, failed: 0, live: None, untracked: None, ..m.clone() }
        });
        // A site inside a hooked function counts what reaches it without
        // a hook; the hooks count the rest.
        let under = |m: &Marker| match m.under {
            Some((calls, bytes)) => Marker { calls, bytes, failed: 0, live: None, untracked: None, ..m.clone() },
            None => m.clone(),
        };
        self.markers
            .iter()
            .filter(|m| !m.inside)
            .chain(&self.charged_markers)
            .map(under)
            .chain(self.hook_markers.iter().cloned())
            .chain(inside)
            .collect()
    }
}

/// A program in testbins/ with its build line and markers.
#[derive(Clone, Debug)]
pub struct Program {
    pub name: String,
    pub src: PathBuf,
    pub build: String,
    pub output: String,
    pub needs: Vec<String>,
    pub run: Vec<String>,
    pub markers: Vec<Marker>,
    /// Calls of program-defined allocation functions, counted only when
    /// those are named as entry points.
    pub user_markers: Vec<Marker>,
    /// Sites that only charging callers makes: calls to wrappers
    /// (`@charged`).
    pub charged_markers: Vec<Marker>,
    /// Calls to functions whose callers take what they allocate (`@hook`).
    pub hook_markers: Vec<Marker>,
    pub is_library: bool,
    /// Counts depend on timing (`// counts: variable`): not compared.
    pub variable_counts: bool,
    /// Functions that are allocation wrappers (`@wrapper NAME KIND`):
    /// (name, kind).
    pub wrappers: Vec<(String, String)>,
    /// Functions that allocate but are not wrappers (`@notwrapper NAME`).
    pub not_wrappers: Vec<String>,
}

fn parse_marker(tag: &str, file: &str, line: u32, text: &str) -> Option<Marker> {
    let open = format!("/* {tag} ");
    let start = text.find(&open)?;
    let body = &text[start + open.len()..];
    let body = &body[..body.find("*/")?];
    let mut words = body.split_whitespace();
    let entry = words.next()?.to_string();
    let mut m = Marker {
        file: file.to_string(),
        line,
        entry,
        tail: false,
        calls: 0,
        bytes: 0,
        failed: 0,
        live: None,
        untracked: None,
        inside: false,
        charged: None,
        alone: None,
        under: None,
    };
    for w in words {
        match w.split_once('=') {
            None if w == "tail" => m.tail = true,
            None if w == "inside" => m.inside = true,
            Some((k @ ("charged" | "alone" | "under"), v)) => {
                let (c, b) = v.split_once(',').unwrap_or_else(|| panic!("{file}:{line}: {k}=CALLS,BYTES"));
                let pair = Some((c.parse().unwrap(), b.parse().unwrap()));
                match k {
                    "charged" => m.charged = pair,
                    "alone" => m.alone = pair,
                    _ => m.under = pair,
                }
            }
            Some(("calls", v)) => m.calls = v.parse().unwrap(),
            Some(("bytes", v)) => m.bytes = v.parse().unwrap(),
            Some(("failed", v)) => m.failed = v.parse().unwrap(),
            Some(("live", v)) => m.live = Some((v.parse().unwrap(), m.live.map_or(0, |l| l.1))),
            Some(("live_bytes", v)) => m.live = Some((m.live.map_or(0, |l| l.0), v.parse().unwrap())),
            Some(("untracked", v)) => m.untracked = Some(v.parse().unwrap()),
            _ => panic!("{file}:{line}: bad marker word {w:?}"),
        }
    }
    Some(m)
}

pub fn programs() -> &'static [Program] {
    static PROGRAMS: OnceLock<Vec<Program>> = OnceLock::new();
    PROGRAMS.get_or_init(|| {
        let mut v = Vec::new();
        let mut entries: Vec<_> = std::fs::read_dir(testbins_dir()).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for src in entries {
            let ext = src.extension().and_then(|e| e.to_str()).unwrap_or("");
            if ext != "c" && ext != "cpp" {
                continue;
            }
            let text = std::fs::read_to_string(&src).unwrap();
            let stem = src.file_stem().unwrap().to_str().unwrap().to_string();
            let file = src.file_name().unwrap().to_str().unwrap().to_string();
            let mut p = Program {
                name: stem.clone(),
                src: src.clone(),
                build: String::new(),
                output: stem,
                needs: vec![],
                run: vec![],
                markers: vec![],
                user_markers: vec![],
                charged_markers: vec![],
                hook_markers: vec![],
                is_library: false,
                variable_counts: false,
                wrappers: vec![],
                not_wrappers: vec![],
            };
            for (i, line) in text.lines().enumerate() {
                if let Some(b) = line.strip_prefix("// build: ") {
                    p.build = b.to_string();
                } else if let Some(o) = line.strip_prefix("// output: ") {
                    p.output = o.trim().to_string();
                } else if let Some(n) = line.strip_prefix("// needs: ") {
                    p.needs = n.split_whitespace().map(str::to_string).collect();
                } else if line.trim() == "// counts: variable" {
                    p.variable_counts = true;
                } else if let Some(r) = line.strip_prefix("// run: ") {
                    p.run = r.split_whitespace().map(str::to_string).collect();
                }
                if let Some(m) = parse_marker("@site", &file, i as u32 + 1, line) {
                    p.markers.push(m);
                }
                if let Some(m) = parse_marker("@usersite", &file, i as u32 + 1, line) {
                    p.user_markers.push(m);
                }
                if let Some(m) = parse_marker("@charged", &file, i as u32 + 1, line) {
                    p.charged_markers.push(m);
                }
                if let Some(m) = parse_marker("@hook", &file, i as u32 + 1, line) {
                    p.hook_markers.push(m);
                }
                let words = |tag: &str| {
                    let body = line.split_once(&format!("/* {tag} "))?.1.split_once("*/")?.0;
                    Some(body.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                };
                match words("@wrapper").as_deref() {
                    Some([name, kind]) => p.wrappers.push((name.clone(), kind.clone())),
                    Some(_) => panic!("{file}:{}: a wrapper marker is `@wrapper NAME KIND`", i + 1),
                    None => {}
                }
                if let Some([name]) = words("@notwrapper").as_deref() {
                    p.not_wrappers.push(name.clone());
                }
            }
            assert!(!p.build.is_empty(), "{}: no '// build:' line", src.display());
            p.is_library = p.build.contains("-shared");
            v.push(p);
        }
        // Libraries first, so programs that need them can link.
        v.sort_by_key(|p| !p.is_library);
        v
    })
}

pub fn program(name: &str) -> &'static Program {
    programs().iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no test program {name}"))
}

/// The test programs built in one configuration.
pub struct Built {
    pub config: Config,
    pub dir: PathBuf,
}

impl Built {
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(&program(name).output)
    }
}

fn build_one(p: &Program, config: Config, dir: &Path) {
    let out = dir.join(&p.output);
    let cmd = p
        .build
        .replace("{cc}", "gcc")
        .replace("{cxx}", "g++")
        .replace("{opt}", config.opt)
        .replace("{pie}", if config.pie { "-fPIE -pie" } else { "-fno-PIE -no-pie" })
        .replace("{extra}", config.extra)
        .replace("{src}", p.src.to_str().unwrap())
        .replace("{out}", out.to_str().unwrap())
        .replace("{dir}", dir.to_str().unwrap());
    let status = Command::new("sh").arg("-c").arg(&cmd).output().unwrap();
    assert!(status.status.success(), "build failed: {cmd}\n{}", String::from_utf8_lossy(&status.stderr));
}

/// Builds (once per test process) every test program in `config`.
pub fn built(config: Config) -> Arc<Built> {
    type Slot = Arc<Mutex<Option<Arc<Built>>>>;
    static CACHE: OnceLock<Mutex<HashMap<Config, Slot>>> = OnceLock::new();
    let slot = CACHE.get_or_init(Default::default).lock().unwrap().entry(config).or_default().clone();
    let mut guard = slot.lock().unwrap();
    if let Some(b) = &*guard {
        return b.clone();
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("testbins").join(config.name());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for p in programs() {
        build_one(p, config, &dir);
    }
    let b = Arc::new(Built { config, dir });
    *guard = Some(b.clone());
    b
}

/// Runs a program and returns (stdout, stderr, exit code).
/// A file written just before may be held open for writing by a child
/// that another test thread forked and that has not yet exec'd: exec then
/// fails with ETXTBSY for a moment, and is retried.
pub fn run_program(path: &Path, args: &[String], env: &[(&str, &str)]) -> (String, String, i32) {
    let mut tries = 0;
    let out = loop {
        match Command::new(path).args(args).envs(env.iter().copied()).output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => break r.unwrap(),
        }
    };
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code().unwrap_or(-1),
    )
}

pub fn have(tool: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().is_ok_and(|o| o.status.success())
}

/// The file name part of a path in a JSON site (DWARF paths are absolute).
pub fn base(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// One test per build configuration of the matrix, each calling `$check`
/// with its [`Config`]: `mod name { matrix!(super::check); }` gives tests
/// `name::o0_pie_plt` ... `name::o2_nopie_cet`.
#[macro_export]
macro_rules! matrix {
    ($check:path) => {
        $crate::matrix!(@each $check;
            o0_pie_plt: "-O0", true, ""; o0_pie_noplt: "-O0", true, "-fno-plt";
            o0_pie_cet: "-O0", true, "-fcf-protection=full"; o0_nopie_plt: "-O0", false, "";
            o0_nopie_noplt: "-O0", false, "-fno-plt"; o0_nopie_cet: "-O0", false, "-fcf-protection=full";
            o2_pie_plt: "-O2", true, ""; o2_pie_noplt: "-O2", true, "-fno-plt";
            o2_pie_cet: "-O2", true, "-fcf-protection=full"; o2_nopie_plt: "-O2", false, "";
            o2_nopie_noplt: "-O2", false, "-fno-plt"; o2_nopie_cet: "-O2", false, "-fcf-protection=full";
        );
    };
    (@each $check:path; $($name:ident: $opt:literal, $pie:literal, $extra:literal;)*) => {$(
        #[test]
        fn $name() {
            $check($crate::util::Config { opt: $opt, pie: $pie, extra: $extra });
        }
    )*};
}

/// A program talking over stdin/stdout.
pub struct Talk {
    pub child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Talk {
    /// Starts `command` (without the caller's `ALLOCTRAMP`, with `env`).
    pub fn spawn(command: &mut Command, env: &[(&str, &str)]) -> Talk {
        let mut child = command
            .env_remove("ALLOCTRAMP")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Talk { child, out }
    }
    pub fn start(bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Talk {
        Talk::spawn(Command::new(bin).args(args), env)
    }
    pub fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        l
    }
    pub fn send(&mut self, s: &str) {
        writeln!(self.child.stdin.as_mut().unwrap(), "{s}").unwrap();
    }
    /// The rest of stdout and the exit status (the program is killed if the
    /// test fails first: see Drop).
    pub fn finish(&mut self) -> (String, Option<i32>) {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.out, &mut rest).unwrap();
        let status = self.child.wait().unwrap();
        (rest, status.code())
    }
}

/// Where skipped tests are recorded: `.ci/run` prints the count and the
/// reasons after the tests, so a skip never passes unseen.
pub fn skips_file() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped.txt")
}

/// Records that `test` did not check what it is for, and why.
pub fn skip(test: &str, why: &str) {
    eprintln!("skipped: {test}: {why}");
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(skips_file()).unwrap();
    writeln!(f, "{test}: {why}").unwrap();
}

/// The running test's name (the test harness names its thread after it).
pub fn test_name() -> &'static str {
    let name = std::thread::current().name().unwrap_or("?").to_string();
    Box::leak(name.into_boxed_str())
}

/// Makes sure `tool` is installed: if it is missing, installs the Debian
/// `package` that has it (apt-get update first; as root) and fails the
/// test if it is still missing, so that a check never passes without
/// running. One installation at a time.
pub fn ensure_tool(tool: &str, package: &str) {
    ensure(tool, package, || have(tool));
}

/// Makes sure the shared library `file` (say `libjemalloc.so.2`) is
/// installed, as [`ensure_tool`] does for a command; returns its path.
pub fn ensure_library(file: &str, package: &str) -> PathBuf {
    let find = || {
        let out = Command::new("gcc").arg(format!("-print-file-name={file}")).output().expect("run gcc");
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        path.is_absolute().then_some(path)
    };
    ensure(file, package, || find().is_some());
    find().unwrap()
}

fn ensure(what: &str, package: &str, present: impl Fn() -> bool) {
    static APT: Mutex<()> = Mutex::new(());
    let _guard = APT.lock().unwrap_or_else(|e| e.into_inner());
    if present() {
        return;
    }
    eprintln!("{what} is missing: installing {package}");
    let script =
        format!("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {package} >/dev/null");
    let out = Command::new("sh").arg("-c").arg(&script).output().expect("run apt-get");
    assert!(
        present(),
        "{what} is missing and installing the {package} package failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// An HTTP GET on loopback: (status, headers in lower case, body).
pub fn http_get(port: u16, path: &str, accept: Option<&str>) -> (u16, String, Vec<u8>) {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{accept}Connection: close\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("an HTTP answer");
    let head = String::from_utf8_lossy(&raw[..end]).to_lowercase();
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, head, raw[end + 4..].to_vec())
}

/// A URL query value, percent-encoded.
pub fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Builds the C, C++ or other source testbins/REL into `dir` by the
/// command on its first line (`// build: ...`, with `{cc}` gcc, `{cxx}`
/// g++, `{pie}`, `{src}`, `{out}` and `{dir}`, where the libraries it
/// needs were built): the file its `// output:` line names, else the
/// source's stem.
pub fn build_source(rel: &str, dir: &Path) -> PathBuf {
    let src = testbins_dir().join(rel);
    let text = std::fs::read_to_string(&src).unwrap();
    let line = text.lines().next().and_then(|l| l.strip_prefix("// build: ")).expect("a build line");
    let name = text
        .lines()
        .find_map(|l| l.strip_prefix("// output: "))
        .map(str::to_string)
        .unwrap_or_else(|| src.file_stem().unwrap().to_string_lossy().into_owned());
    let out = dir.join(name);
    let cmd = line
        .replace("{cc}", "gcc")
        .replace("{cxx}", "g++")
        .replace("{pie}", "-fPIE -pie")
        .replace("{src}", src.to_str().unwrap())
        .replace("{out}", out.to_str().unwrap())
        .replace("{dir}", dir.to_str().unwrap());
    let o = Command::new("sh").arg("-c").arg(&cmd).output().unwrap();
    assert!(o.status.success(), "build failed: {cmd}\n{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// An `@site` marker of a source built by [`build_source`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteMark {
    pub line: u32,
    pub entry: String,
    pub calls: u64,
    pub bytes: u64,
    /// `live=OBJECTS,BYTES`: what is still live at exit.
    pub live: Option<(u64, u64)>,
}

/// The `@site ENTRY calls=N [bytes=N] [live=N,N]` markers of testbins/REL.
pub fn site_marks(rel: &str) -> Vec<SiteMark> {
    let text = std::fs::read_to_string(testbins_dir().join(rel)).unwrap();
    let mut v = Vec::new();
    for (i, l) in text.lines().enumerate() {
        let Some(at) = l.find("/* @site ") else { continue };
        let mut w = l[at + 9..].split_whitespace();
        let entry = w.next().unwrap().to_string();
        let words: Vec<&str> = w.collect();
        let field = |k: &str| words.iter().find_map(|x| x.strip_prefix(k));
        let num = |k: &str| field(k).map_or(0, |n| n.parse().unwrap());
        let live = field("live=").map(|p| {
            let (a, b) = p.split_once(',').unwrap();
            (a.parse().unwrap(), b.parse().unwrap())
        });
        v.push(SiteMark { line: i as u32 + 1, entry, calls: num("calls="), bytes: num("bytes="), live });
    }
    v
}

/// The counters files in `dir`, in name order (not the shared site tables
/// beside them).
pub fn counters_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "counters"))
        .collect();
    files.sort();
    files
}

/// The counters file of process `pid` in `dir`, once it is there: a
/// process that starts with profiling off makes it 10 ms after it starts.
pub fn process_file(dir: &Path, pid: u32) -> PathBuf {
    let file = dir.join(format!("{pid}.counters"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !file.exists() {
        assert!(std::time::Instant::now() < deadline, "no counters file of process {pid} in {}", dir.display());
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    file
}

/// A counters file's bytes with the shared site tables its modules name
/// read in from the tables directory beside it, as every command reads
/// them.
pub fn counters_bytes(file: &Path) -> Vec<u8> {
    use alloctramp_trampolines::process;
    let mut bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let tables = file.parent().unwrap().join(process::TABLES_DIR);
    process::read_in_shared_tables(&mut bytes, |id, _| std::fs::read(tables.join(process::shared_table_name(id))).ok());
    bytes
}
