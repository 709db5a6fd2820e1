//! The slow tier: a fixed sample of the installed ELF files (700; all of
//! them with ALLOCTRAMP_CORPUS=all) through `alloctramp patch`, and
//! thousands of mutants of three test programs through `sites` and
//! `patch`. Runs only with ALLOCTRAMP_SLOW=1 (`.ci/run` sets it); otherwise
//! it says so on stdout and runs nothing. Select one part with an argument:
//! `cargo test --test slow -- corpus` (or `mutants`).

mod util;

use std::collections::{BTreeMap, HashSet};
use std::hash::{Hash, Hasher};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use util::*;

const WORKERS: usize = 2;
const RUNTIME: &str = alloctramp_trampolines::layout::RUNTIME_SONAME;

fn main() {
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let tests: [(&str, fn()); 2] = [("corpus", corpus), ("mutants", mutants)];
    let selected: Vec<_> =
        tests.iter().filter(|(n, _)| filter.is_empty() || filter.iter().any(|f| n.contains(f.as_str()))).collect();
    if std::env::var("ALLOCTRAMP_SLOW").as_deref() != Ok("1") {
        println!(
            "slow tier SKIPPED ({} tests not run): set ALLOCTRAMP_SLOW=1 to run the corpus and mutation tests (.ci/run does)",
            selected.len()
        );
        println!("test result: ok. 0 passed; 0 failed; {} ignored; 0 measured; 0 filtered out", selected.len());
        return;
    }
    let (mut passed, mut failed) = (0, 0);
    for (name, f) in &selected {
        println!("test slow::{name} ...");
        let t = Instant::now();
        let ok = std::panic::catch_unwind(f).is_ok();
        println!("test slow::{name} ... {} ({:.1} s)", if ok { "ok" } else { "FAILED" }, t.elapsed().as_secs_f64());
        if ok {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    println!(
        "test result: {}. {passed} passed; {failed} failed; 0 ignored; 0 measured; {} filtered out",
        if failed == 0 { "ok" } else { "FAILED" },
        tests.len() - selected.len()
    );
    if failed > 0 {
        std::process::exit(101);
    }
}

/// What a run did: exit code or signal, stdout, stderr.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Ran {
    /// `Ok(code)` or `Err(signal)`; a timeout is `Err(-1)`.
    status: Result<i32, i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn code(&self) -> Option<i32> {
        self.status.ok()
    }
}

/// Runs `cmd` (stdin empty, output to files in `tmp`) with a time limit,
/// killing its whole process group when it is over.
fn run_limited(mut cmd: Command, tmp: &Path, limit: Duration) -> Ran {
    let (o, e) = (tmp.join("stdout"), tmp.join("stderr"));
    cmd.stdin(Stdio::null())
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap())
        .process_group(0);
    // A program that cannot be executed at all (a mutant's interpreter
    // missing, say) does not start: status Err(-2).
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(err) => return Ran { status: Err(-2), stdout: String::new(), stderr: format!("exec: {err}") },
    };
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code().ok_or_else(|| s.signal().unwrap_or(0));
        }
        if start.elapsed() > limit {
            // SAFETY: kill(2) on the process group of a child we started.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            break Err(-1);
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    Ran { status, stdout: read(&o), stderr: read(&e) }
}

fn hash_file(p: &Path) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    std::fs::read(p).unwrap().hash(&mut h);
    h.finish()
}

/// Files in `dir` other than the runtime copy `patch` writes beside its
/// outputs.
fn leftovers(dir: &Path) -> Vec<String> {
    let names = |d: &Path| -> Vec<String> {
        std::fs::read_dir(d)
            .map_or(vec![], |r| r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
    };
    // The switched images' directories, which `patch` keeps: the images
    // in them.
    let dirs = alloctramp_trampolines::layout::Image::ALL.map(|i| i.dir());
    let mut left: Vec<String> =
        names(dir).into_iter().filter(|n| n != RUNTIME && !dirs.contains(&n.as_str())).collect();
    for images in dirs {
        left.extend(names(&dir.join(images)).into_iter().map(|n| format!("{images}/{n}")));
    }
    left
}

/// Removes a patched output and its switched images.
fn remove_output(out: &Path) {
    let _ = std::fs::remove_file(out);
    for image in alloctramp_trampolines::layout::Image::ALL {
        let _ = std::fs::remove_file(out.parent().unwrap().join(image.dir()).join(out.file_name().unwrap()));
    }
}

/// A refusal's text without the file name and numbers: the reason.
fn reason(line: &str, file: &Path) -> String {
    let text = line.trim().replace(&format!("alloctramp: {}: ", file.display()), "");
    let mut out = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            while chars.peek().is_some_and(|c| c.is_ascii_hexdigit() || *c == 'x') {
                chars.next();
            }
            out.push('N');
        } else {
            out.push(c);
        }
    }
    out
}

/// Checks what every `sites`/`patch` run must do, on any input: exit
/// status 0 or 2 (never a signal or timeout), never a panic, and one line
/// of error with status 2. Returns a complaint.
fn check_tool_run(what: &str, r: &Ran) -> Option<String> {
    match r.status {
        Ok(0) => None,
        Ok(2) if r.stderr.lines().count() == 1 && !r.stderr.contains("panicked") => None,
        Ok(2) => Some(format!("{what}: status 2 with {} lines: {:?}", r.stderr.lines().count(), r.stderr)),
        Ok(c) => Some(format!("{what}: exit status {c}: {:?}", r.stderr)),
        Err(-1) => Some(format!("{what}: timed out")),
        Err(s) => Some(format!("{what}: killed by signal {s}: {:?}", r.stderr)),
    }
}

// ---------------------------------------------------------------- corpus

/// Every 64-bit x86-64 executable or shared library under the system's
/// program and library directories (regular files, each inode once).
fn system_elf_files() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> =
        ["/usr/bin", "/usr/sbin", "/usr/lib", "/usr/libexec"].iter().map(PathBuf::from).collect();
    for r in ["/bin", "/sbin", "/lib"] {
        if std::fs::symlink_metadata(r).is_ok_and(|m| m.is_dir()) {
            roots.push(r.into());
        }
    }
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut stack = roots;
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for ent in rd.flatten() {
            let p = ent.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else { continue };
            if m.is_dir() {
                stack.push(p);
            } else if m.is_file() && seen.insert((m.dev(), m.ino())) {
                let mut head = [0u8; 20];
                let ok = std::fs::File::open(&p).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head)).is_ok();
                if ok
                    && head[..4] == *b"\x7fELF"
                    && head[4] == 2
                    && head[5] == 1
                    && matches!(head[16], 2 | 3)
                    && head[18] == 62
                {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    out
}

fn readelf_warnings(p: &Path) -> String {
    let o = Command::new("readelf").arg("-lSdW").arg(p).output().unwrap();
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn elflint_ok(p: &Path) -> (bool, String) {
    let o = Command::new("eu-elflint").arg("--gnu-ld").arg(p).output().expect("eu-elflint (elfutils) is installed");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    (o.status.success() && text.trim() == "No errors", text)
}

/// Programs that print their version with `--version` and do nothing
/// else; those installed here form the run sample. Not gdb: it reports the
/// signal handlers it inherits, and with profiling on from the start the
/// runtime's SIGTRAP handler (installed by the first switch) is one.
const VERSION_PROGRAMS: &[&str] = &[
    "ls",
    "cat",
    "cp",
    "mv",
    "rm",
    "mkdir",
    "ln",
    "chmod",
    "chown",
    "date",
    "echo",
    "env",
    "head",
    "tail",
    "sort",
    "uniq",
    "wc",
    "cut",
    "tr",
    "tee",
    "touch",
    "stat",
    "du",
    "df",
    "basename",
    "dirname",
    "readlink",
    "realpath",
    "seq",
    "sha256sum",
    "md5sum",
    "base64",
    "od",
    "split",
    "expr",
    "printf",
    "nproc",
    "uname",
    "id",
    "whoami",
    "grep",
    "sed",
    "find",
    "xargs",
    "diff",
    "cmp",
    "tar",
    "gzip",
    "xz",
    "bzip2",
    "zstd",
    "git",
    "bash",
    "dash",
    "perl",
    "python3",
    "make",
    "readelf",
    "objdump",
    "nm",
    "strip",
    "objcopy",
    "as",
    "ld.bfd",
    "ld.gold",
    "curl",
    "wget",
    "ssh",
    "rsync",
    "file",
    "less",
    "patch",
    "gawk",
    "sqlite3",
    "jq",
    "node",
    "eu-elflint",
    "eu-readelf",
    "strace",
    "ltrace",
    "valgrind",
    "zip",
    "unzip",
    "openssl",
    "gpg",
    "dpkg",
    "apt-get",
];

struct CorpusStats {
    patched: usize,
    refused: BTreeMap<String, usize>,
    elflint_checked: usize,
    ran: Vec<String>,
    failures: Vec<String>,
}

/// Files larger than this are left out of the corpus (a debug build
/// patching a 300 MB browser and eu-elflint reading it twice take minutes
/// of the CI's time); `bench/run patch` patches the largest ELF file.
const CORPUS_MAX_FILE: u64 = 128 << 20;

/// Files in the corpus sample: the floor is 500, and 700 files take
/// about five minutes of a debug build on two cores, within the tier's
/// ten-minute budget even on a loaded machine.
const CORPUS_SAMPLE: usize = 700;

fn corpus() {
    let start = Instant::now();
    let (all, big): (Vec<PathBuf>, Vec<PathBuf>) = system_elf_files()
        .into_iter()
        .partition(|p| std::fs::metadata(p).map(|m| m.len() <= CORPUS_MAX_FILE).unwrap_or(false));
    if !big.is_empty() {
        println!("corpus: {} ELF files over {} MiB left out: {big:?}", big.len(), CORPUS_MAX_FILE >> 20);
    }
    // A fixed sample when there are very many: every k-th file (the list is
    // sorted by path, so it spreads over executables and libraries), plus
    // the programs that are run off and on. ALLOCTRAMP_CORPUS=N changes the
    // sample's size; `all` takes every file.
    let max = match std::env::var("ALLOCTRAMP_CORPUS").as_deref() {
        Ok("all") => usize::MAX,
        Ok(n) => n.parse().expect("ALLOCTRAMP_CORPUS: a number or `all`"),
        Err(_) => CORPUS_SAMPLE,
    };
    let files: Vec<PathBuf> = if all.len() <= max {
        all.clone()
    } else {
        let mut files: Vec<PathBuf> = (0..max).map(|i| all[i * all.len() / max].clone()).collect();
        for name in VERSION_PROGRAMS {
            let p = Path::new("/usr/bin").join(name);
            if all.contains(&p) && !files.contains(&p) {
                files.push(p);
            }
        }
        files
    };
    println!("corpus: {} ELF files found, {} in the sample", all.len(), files.len());
    assert!(files.len() >= 500, "only {} ELF files: the corpus test needs at least 500", files.len());
    let base = scratch("slow-corpus");
    let stats = Mutex::new(CorpusStats {
        patched: 0,
        refused: BTreeMap::new(),
        elflint_checked: 0,
        ran: vec![],
        failures: vec![],
    });
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for w in 0..WORKERS {
            let (files, stats, next, base) = (&files, &stats, &next, &base);
            s.spawn(move || {
                let dir = base.join(format!("w{w}"));
                std::fs::create_dir_all(&dir).unwrap();
                // Each worker its own counters directory: one empties it
                // after each run, which would take a file from under a
                // process of another worker.
                let counters = base.join(format!("counters-w{w}"));
                std::fs::create_dir_all(&counters).unwrap();
                std::fs::set_permissions(&counters, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(input) = files.get(i) else { break };
                    corpus_one(input, &dir, &counters, stats);
                }
            });
        }
    });
    let st = stats.into_inner().unwrap();
    let refused: usize = st.refused.values().sum();
    println!(
        "corpus: {} files: {} patched, {refused} refused, {} elflint-checked before and after, {} run with --version; {:.1} s",
        files.len(),
        st.patched,
        st.elflint_checked,
        st.ran.len(),
        start.elapsed().as_secs_f64()
    );
    for (r, n) in &st.refused {
        println!("corpus: refused {n:5}: {r}");
    }
    println!("corpus: ran {}", st.ran.join(" "));
    for f in &st.failures {
        println!("corpus: FAILURE {f}");
    }
    assert!(st.failures.is_empty(), "{} failures", st.failures.len());
    assert_eq!(st.patched + refused, files.len());
    let installed = VERSION_PROGRAMS.iter().filter(|n| Path::new("/usr/bin").join(n).exists()).count();
    assert!(st.ran.len() >= 30.min(installed * 2 / 3), "only {} programs run of {installed} installed", st.ran.len());
}

fn corpus_one(input: &Path, dir: &Path, counters: &Path, stats: &Mutex<CorpusStats>) {
    let name = input.file_name().unwrap().to_string_lossy().into_owned();
    let out = dir.join(&name);
    let fail = |msg: String| stats.lock().unwrap().failures.push(format!("{}: {msg}", input.display()));
    let mut cmd = alloctramp();
    cmd.arg("patch").arg(input).arg("-o").arg(&out);
    let r = run_limited(cmd, dir, Duration::from_secs(300));
    if let Some(c) = check_tool_run("patch", &r) {
        return fail(c);
    }
    if r.code() == Some(2) {
        if out.exists() || !leftovers(dir).iter().all(|n| n == "stdout" || n == "stderr") {
            fail(format!("refused but left files: {:?}", leftovers(dir)));
        }
        *stats.lock().unwrap().refused.entry(reason(&r.stderr, input)).or_default() += 1;
        return;
    }
    stats.lock().unwrap().patched += 1;
    let warnings = readelf_warnings(&out);
    if !warnings.is_empty() {
        fail(format!("readelf -lSdW warns: {}", warnings.lines().next().unwrap_or("")));
    }
    if elflint_ok(input).0 {
        let (ok, text) = elflint_ok(&out);
        if !ok {
            fail(format!("eu-elflint accepted the input, not the output: {}", text.lines().next().unwrap_or("")));
        }
        stats.lock().unwrap().elflint_checked += 1;
    }
    let in_sample = input.parent() == Some(Path::new("/usr/bin")) && VERSION_PROGRAMS.contains(&name.as_str());
    if in_sample && let Some(msg) = same_version_output(input, &out, dir, counters) {
        match msg {
            Ok(()) => stats.lock().unwrap().ran.push(name.clone()),
            Err(m) => fail(m),
        }
    }
    remove_output(&out);
}

/// `--version` of the original and of the patched program (profiling off,
/// then on): the same stdout, stderr and status. `None` when the original's
/// own output is not reproducible (then nothing can be compared).
fn same_version_output(input: &Path, out: &Path, dir: &Path, counters: &Path) -> Option<Result<(), String>> {
    let name = input.file_name().unwrap();
    let run = |prog: &Path, env: &[(&str, &Path)]| {
        let mut c = Command::new(prog);
        c.arg0(name).arg("--version").current_dir(dir);
        for (k, v) in env {
            c.env(k, v);
        }
        run_limited(c, dir, Duration::from_secs(10))
    };
    let a = run(input, &[]);
    if a.status != Ok(0) || a.stdout.is_empty() || run(input, &[]) != a {
        return None;
    }
    let off = run(out, &[]);
    let on = run(out, &[("ALLOCTRAMP", Path::new("on")), ("ALLOCTRAMP_DIR", counters)]);
    for f in std::fs::read_dir(counters).unwrap().flatten() {
        let _ = std::fs::remove_file(f.path());
    }
    Some(if off != a {
        Err(format!("--version differs with profiling off: {off:?} vs {a:?}"))
    } else if on != a {
        Err(format!("--version differs with ALLOCTRAMP=on: {on:?} vs {a:?}"))
    } else {
        Ok(())
    })
}

// --------------------------------------------------------------- mutants

/// xorshift64*: a fixed sequence from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// The byte ranges of a file worth mutating: headers and the tables the
/// loader and the patcher read, plus some code.
fn regions(d: &[u8]) -> Vec<(String, usize, usize)> {
    let elf = alloctramp_patcher::Elf::parse(d).unwrap();
    let phoff = u64::from_le_bytes(d[32..40].try_into().unwrap()) as usize;
    let phnum = u16::from_le_bytes([d[56], d[57]]) as usize;
    let shoff = u64::from_le_bytes(d[40..48].try_into().unwrap()) as usize;
    let mut v = vec![
        ("ELF header".to_string(), 0, 64),
        ("program headers".to_string(), phoff, phoff + phnum * 56),
        ("section headers".to_string(), shoff, shoff + elf.sections.len() * 64),
    ];
    for s in &elf.sections {
        let wanted = [
            ".interp",
            ".dynamic",
            ".dynsym",
            ".dynstr",
            ".gnu.version",
            ".gnu.version_r",
            ".gnu.version_d",
            ".gnu.hash",
            ".hash",
            ".rela.dyn",
            ".rela.plt",
            ".symtab",
            ".plt",
            ".plt.sec",
            ".text",
            ".got",
            ".init_array",
        ];
        if wanted.contains(&s.name) && !s.data.is_empty() {
            v.push((s.name.to_string(), s.offset.0 as usize, s.offset.0 as usize + s.data.len()));
        }
    }
    v
}

/// Sections of machine code. A mutant that changes code goes through
/// `sites` and `patch` but is not compared with its patched copy: its code
/// can read what the ABI leaves undefined, which another library in the
/// process (the runtime) changes, or jump into the middle of a call site
/// that profiling overwrites. Seed 0x9e3779b97f4a7890 of the PIE turns
/// `mov %r13,%rsi` before `call fill` into `mov %sil,%r13b` (fill's length
/// is whatever malloc left in %rsi); seed 0x1234567a87654a8d of the
/// library turns free@plt's `jmp *slot` into `call *slot`, so free runs
/// twice, the second time on whatever the first left in %rdi.
const CODE: &[&str] = &[".text", ".plt", ".plt.sec"];

/// Applies 1 to 3 mutations; returns what was done and whether it changed
/// code.
fn mutate(d: &mut [u8], regions: &[(String, usize, usize)], rng: &mut Rng) -> (String, bool) {
    let mut what = Vec::new();
    let mut code = false;
    for _ in 0..1 + rng.below(3) {
        let (name, lo, hi) = &regions[rng.below(regions.len())];
        let at = lo + rng.below(hi - lo);
        let kind = rng.below(7);
        let r = rng.next();
        match kind {
            0 => d[at] = r as u8,
            1 => d[at] ^= 1 << (r % 8),
            2 => d[at] = 0,
            3 => d[at] = 0xff,
            4 | 5 if at / 8 * 8 + 8 <= d.len() => {
                // A 64-bit field nudged: off by a little, or doubled.
                let a = at / 8 * 8;
                let v = u64::from_le_bytes(d[a..a + 8].try_into().unwrap());
                let delta = [1u64, 8, 16, 24, 0x40, 0x1000][(r % 6) as usize];
                let nv = match (r >> 8) % 3 {
                    0 => v.wrapping_add(delta),
                    1 => v.wrapping_sub(delta),
                    _ => v.wrapping_mul(2),
                };
                d[a..a + 8].copy_from_slice(&nv.to_le_bytes());
            }
            _ if at / 2 * 2 + 2 <= d.len() => {
                let a = at / 2 * 2;
                d[a..a + 2].copy_from_slice(&(r as u16).to_le_bytes());
            }
            _ => d[at] = r as u8,
        }
        what.push(format!("{name}@{at:#x}/{kind}"));
        code |= CODE.contains(&name.as_str());
    }
    (what.join(","), code)
}

#[derive(Default)]
struct MutantStats {
    mutants: usize,
    sites_ok: usize,
    sites_refused: usize,
    patched: usize,
    refused: usize,
    input_starts: usize,
    nondeterministic: usize,
    compared: usize,
    /// Refusals of mutants that start, by reason.
    refused_starting: BTreeMap<String, usize>,
    code: usize,
    compared_on: usize,
    failures: Vec<String>,
}

/// One of the three files: how to run it (for the library: the program
/// that uses it, with the mutant first in the library path).
struct Subject {
    name: &'static str,
    file: PathBuf,
    runner: Option<PathBuf>,
    expected: Ran,
}

/// Mutants per file, and the base of their seeds; ALLOCTRAMP_MUTANTS and
/// ALLOCTRAMP_MUTANT_SEED (hex) change them for a longer or another run.
const MUTANTS_PER_FILE: usize = 800;
const MUTANT_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

fn mutants() {
    let start = Instant::now();
    let base = scratch("slow-mutants");
    let pie = built(Config::default_o2());
    let nopie = built(Config { opt: "-O2", pie: false, extra: "" });
    let mut subjects = vec![
        Subject { name: "basic", file: pie.path("basic"), runner: None, expected: empty_ran() },
        Subject { name: "basic", file: nopie.path("basic"), runner: None, expected: empty_ran() },
        Subject {
            name: "libatshared.so",
            file: pie.path("libatshared"),
            runner: Some(pie.path("uses_lib")),
            expected: empty_ran(),
        },
    ];
    for s in &mut subjects {
        let dir = base.join("expected");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&s.file, dir.join(s.name)).unwrap();
        s.expected = run_subject(s, &dir.join(s.name), &dir, None);
        assert_eq!(s.expected.status, Ok(0), "{}: {:?}", s.file.display(), s.expected);
    }
    let per_file = std::env::var("ALLOCTRAMP_MUTANTS").ok().and_then(|v| v.parse().ok()).unwrap_or(MUTANTS_PER_FILE);
    let base_seed = std::env::var("ALLOCTRAMP_MUTANT_SEED")
        .ok()
        .and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        .unwrap_or(MUTANT_SEED);
    println!("mutants: {per_file} per file, seeds from {base_seed:#x}");
    let stats = Mutex::new(MutantStats::default());
    let mut jobs: Vec<(usize, u64)> =
        (0..subjects.len()).flat_map(|k| (0..per_file as u64).map(move |i| (k, i))).collect();
    // ALLOCTRAMP_MUTANT_DEBUG=K:I runs mutant I of file K alone, verbosely.
    if let Some(one) = std::env::var("ALLOCTRAMP_MUTANT_DEBUG").ok().and_then(|v| {
        let (k, i) = v.split_once(':')?;
        Some((k.parse().ok()?, i.parse().ok()?))
    }) {
        jobs = vec![one];
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for w in 0..WORKERS {
            let (jobs, subjects, stats, next, base) = (&jobs, &subjects, &stats, &next, &base);
            sc.spawn(move || {
                let dir = base.join(format!("w{w}"));
                // The mutant and its patched copy run from paths of one length:
                // a mutant that reads memory it never set sees the stack
                // shifted by a longer argv[0] (the environment's strings
                // are on it).
                let (ind, outd, tmp, counters) =
                    (dir.join("in_"), dir.join("out"), dir.join("tmp"), dir.join("counters"));
                for d in [&ind, &outd, &tmp, &counters] {
                    std::fs::create_dir_all(d).unwrap();
                }
                std::fs::set_permissions(&counters, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
                let originals: Vec<Vec<u8>> = subjects.iter().map(|s| std::fs::read(&s.file).unwrap()).collect();
                let regions: Vec<_> = originals.iter().map(|d| regions(d)).collect();
                loop {
                    let j = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(k, i)) = jobs.get(j) else { break };
                    let s = &subjects[k];
                    let seed = base_seed ^ ((k as u64) << 32 | i);
                    let mut rng = Rng(seed);
                    let mut data = originals[k].clone();
                    let (what, code) = mutate(&mut data, &regions[k], &mut rng);
                    let label = format!("{} #{i} (seed {seed:#x}: {what})", s.file.display());
                    let complaints = mutant_one(s, &data, code, &ind, &outd, &tmp, &counters, stats);
                    if !complaints.is_empty() {
                        let keep = base.join("failed");
                        std::fs::create_dir_all(&keep).unwrap();
                        std::fs::write(keep.join(format!("{k}-{i}-{}", s.name)), &data).unwrap();
                        let mut st = stats.lock().unwrap();
                        st.failures.extend(complaints.into_iter().map(|c| format!("{label}: {c}")));
                    }
                }
            });
        }
    });
    let st = stats.into_inner().unwrap();
    println!(
        "mutants: {} mutants of {} files: sites ok {} / refused {}; patch ok {} / refused {}; {} mutants start ({} not reproducibly); {} patched and compared with profiling off, {} also on ({} mutants changed code: not compared); {} failures; {:.1} s",
        st.mutants,
        subjects.len(),
        st.sites_ok,
        st.sites_refused,
        st.patched,
        st.refused,
        st.input_starts,
        st.nondeterministic,
        st.compared,
        st.compared_on,
        st.code,
        st.failures.len(),
        start.elapsed().as_secs_f64()
    );
    for (r, n) in &st.refused_starting {
        println!("mutants: refused though it starts {n:5}: {r}");
    }
    for f in st.failures.iter().take(40) {
        println!("mutants: FAILURE {f}");
    }
    assert!(
        st.failures.is_empty(),
        "{} failures (mutants kept in {})",
        st.failures.len(),
        base.join("failed").display()
    );
    assert_eq!(st.mutants, subjects.len() * per_file);
    assert!(st.compared >= 300, "only {} starting mutants were patched and compared", st.compared);
}

fn empty_ran() -> Ran {
    Ran { status: Ok(-1), stdout: String::new(), stderr: String::new() }
}

/// Runs a subject from `file` (a program, or the library loaded by its
/// runner from `file`'s directory).
fn run_subject(s: &Subject, file: &Path, tmp: &Path, counters: Option<&Path>) -> Ran {
    run_subject_with(s, file, tmp, counters, None)
}

fn run_subject_with(s: &Subject, file: &Path, tmp: &Path, counters: Option<&Path>, preload: Option<&Path>) -> Ran {
    let mut c = match &s.runner {
        Some(r) => {
            let mut c = Command::new(r);
            c.env("LD_LIBRARY_PATH", file.parent().unwrap());
            c
        }
        None => Command::new(file),
    };
    if let Some(d) = counters {
        c.env("ALLOCTRAMP", "on").env("ALLOCTRAMP_DIR", d);
    }
    if let Some(p) = preload {
        c.env("LD_PRELOAD", p);
    }
    run_limited(c, tmp, Duration::from_secs(10))
}

#[allow(clippy::too_many_arguments)]
fn mutant_one(
    s: &Subject,
    data: &[u8],
    code: bool,
    ind: &Path,
    outd: &Path,
    tmp: &Path,
    counters: &Path,
    stats: &Mutex<MutantStats>,
) -> Vec<String> {
    let mut complaints = Vec::new();
    let input = ind.join(s.name);
    std::fs::write(&input, data).unwrap();
    std::fs::set_permissions(&input, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let hash = hash_file(&input);
    let limit = Duration::from_secs(30);

    let mut cmd = alloctramp();
    cmd.arg("sites").arg(&input);
    let sites = run_limited(cmd, tmp, limit);
    complaints.extend(check_tool_run("sites", &sites));

    let out = outd.join(s.name);
    let mut cmd = alloctramp();
    cmd.arg("patch").arg(&input).arg("-o").arg(&out);
    let patch = run_limited(cmd, tmp, limit);
    complaints.extend(check_tool_run("patch", &patch));
    if hash_file(&input) != hash {
        complaints.push("the input was modified".into());
    }
    if patch.code() != Some(0) && !leftovers(outd).is_empty() {
        complaints.push(format!("patch failed and left {:?}", leftovers(outd)));
    }

    // Paths in messages (the loader's) name the input or the output.
    let norm = |mut r: Ran| {
        for d in [ind, outd] {
            r.stdout = r.stdout.replace(&d.display().to_string(), "DIR");
            r.stderr = r.stderr.replace(&d.display().to_string(), "DIR");
        }
        r
    };
    let ran = norm(run_subject(s, &input, tmp, None));
    let starts = ran.status == s.expected.status;
    // A mutant that behaves differently once more is loaded (the runtime
    // library, switched on and preloaded into the unpatched mutant: it
    // reads memory it never set, whose contents depend on others'
    // allocations) can only be compared by exit status.
    let preload = outd.join(RUNTIME);
    // One that does not even exit the same way then (a mutant PLT stub
    // that calls free twice, the second time with whatever the first left
    // in %rdi) is not compared at all.
    let again = (starts && preload.exists()).then(|| {
        let mut again = norm(run_subject_with(s, &input, tmp, Some(counters), Some(&preload)));
        again.stderr = again.stderr.replace(&preload.display().to_string(), "");
        again
    });
    if std::env::var_os("ALLOCTRAMP_MUTANT_DEBUG").is_some() {
        println!("mutant run: {ran:?}\npreloaded: {again:?}\npatch: {patch:?}");
    }
    let mut reproducible = again.as_ref() == Some(&ran);
    let comparable = again.as_ref().is_some_and(|a| a.status == ran.status);
    let mut compared = false;
    let mut compared_on = false;
    if starts && comparable && patch.code() == Some(0) && !code {
        let off = norm(run_subject(s, &out, tmp, None));
        let on = Some(norm(run_subject(s, &out, tmp, Some(counters))));
        let differs = |r: &Ran, reproducible: bool| (reproducible && *r != ran) || r.status != ran.status;
        let bad_off = differs(&off, reproducible);
        let bad_on = on.as_ref().is_some_and(|on| differs(on, reproducible));
        // Before calling a difference a failure, make sure the mutant's own
        // behaviour does not depend on its address-space layout (which
        // patching changes: new segments, the heap after them), the way a
        // mutant that calls calloc through realloc's GOT slot with a heap
        // pointer for a count does: 256 more runs under other random
        // layouts must all agree with the first (one mutant, reading a
        // pointer it never set, differs in about 1 run in 60).
        if (bad_off || bad_on) && (0..256).any(|_| norm(run_subject(s, &input, tmp, None)) != ran) {
            reproducible = false;
        } else {
            if bad_off {
                complaints.push(format!("the mutant starts, its patched copy behaves differently: {off:?} vs {ran:?}"));
            }
            if let Some(on) = on.filter(|_| bad_on) {
                complaints.push(format!("with ALLOCTRAMP=on, the patched copy behaves differently: {on:?} vs {ran:?}"));
            }
            compared = true;
            compared_on = true;
        }
    }
    remove_output(&out);
    for f in std::fs::read_dir(counters).unwrap().flatten() {
        let _ = std::fs::remove_file(f.path());
    }

    let mut st = stats.lock().unwrap();
    st.mutants += 1;
    match sites.code() {
        Some(0) => st.sites_ok += 1,
        _ => st.sites_refused += 1,
    }
    match patch.code() {
        Some(0) => st.patched += 1,
        _ => st.refused += 1,
    }
    st.input_starts += usize::from(starts);
    st.nondeterministic += usize::from(starts && !reproducible);
    st.compared += usize::from(compared);
    st.compared_on += usize::from(compared_on);
    if starts && patch.code() == Some(2) {
        *st.refused_starting.entry(reason(&patch.stderr, &input)).or_default() += 1;
    }
    st.code += usize::from(code);
    complaints
}
