//! Golden outputs: what `alloctramp` prints and writes for the ELF files
//! checked in under testbins/golden/ (built once, so that nothing here
//! depends on the machine's compiler), compared byte for byte with the
//! files under cli/tests/golden/.
//!
//! - `sites/`: `alloctramp sites FILE` and `sites --json FILE`;
//! - `patch/`: the layout of `alloctramp patch FILE` (ELF header, program
//!   and section headers, read with `object`) and `alloctramp sites` on it;
//! - `report/`: the final report of the patched every_c (one call of each
//!   C allocator, so every count is exact) in text, JSON and CSV, with what
//!   changes from run to run (pid, paths, start time, the pointer table's
//!   memory) replaced by placeholders.
//!
//! After an intended change, rewrite them with
//! `ALLOCTRAMP_BLESS=1 cargo test -p alloctramp --test golden` and review
//! the diff. [`GOLDEN`] lists every golden file: a file in cli/tests/golden/
//! that it does not list is an orphan, which fails the tests (and is deleted
//! when blessing).

mod util;

use alloctramp_testkit::Goldens;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Mutex, OnceLock};
use util::{alloctramp, scratch, workspace};

const BLESS: &str = "ALLOCTRAMP_BLESS=1 cargo test -p alloctramp --test golden";

/// A golden file (its path under cli/tests/golden/) and what produces it.
type Golden = (&'static str, fn() -> String);

/// Every golden file. The first path component names the test that checks
/// it.
const GOLDEN: &[Golden] = &[
    ("sites/every_c.txt", || sites("every_c", false)),
    ("sites/every_c.json", || sites("every_c", true)),
    ("sites/libatshared.so.txt", || sites("libatshared.so", false)),
    ("sites/libatshared.so.json", || sites("libatshared.so", true)),
    ("sites/cxx_new_delete.txt", || sites("cxx_new_delete", false)),
    ("sites/cxx_new_delete.json", || sites("cxx_new_delete", true)),
    ("patch/every_c.layout", || layout("every_c")),
    ("patch/every_c.sites.txt", || patched_sites("every_c")),
    ("patch/libatshared.so.layout", || layout("libatshared.so")),
    ("patch/libatshared.so.sites.txt", || patched_sites("libatshared.so")),
    ("patch/cxx_new_delete.layout", || layout("cxx_new_delete")),
    ("patch/cxx_new_delete.sites.txt", || patched_sites("cxx_new_delete")),
    ("report/every_c.txt", || report(&[])),
    ("report/every_c.all-columns.txt", || report(&["--all-columns"])),
    ("report/every_c.json", || report(&["--format", "json"])),
    ("report/every_c.csv", || report(&["--format", "csv"])),
];

/// The tests, by the first path component of the golden files they check.
const TESTS: &[&str] = &["sites", "patch", "report"];

#[test]
fn sites_of_each_file() {
    check_all("sites");
}

#[test]
fn patched_layouts_and_sites() {
    check_all("patch");
}

#[test]
fn final_report_of_every_c() {
    check_all("report");
}

/// Every golden file is listed in [`GOLDEN`] and so checked by a test; one
/// that is not is an orphan (deleted when blessing).
#[test]
fn no_orphans() {
    let listed: BTreeSet<&str> = GOLDEN.iter().map(|g| g.0).collect();
    assert_eq!(listed.len(), GOLDEN.len(), "a golden file is listed twice in GOLDEN");
    for name in &listed {
        let test = name.split('/').next().unwrap();
        assert!(TESTS.contains(&test), "golden file {name}: no test checks {test}/ (TESTS)");
    }
    goldens().no_orphans(listed);
}

// ---- The outputs ----

fn golden_input(name: &str) -> PathBuf {
    workspace().join("testbins/golden").join(name)
}

fn ok(o: &Output, what: &str) -> String {
    assert!(o.status.success(), "{what}: status {:?}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).expect("UTF-8 output")
}

/// `alloctramp sites [--json] testbins/golden/NAME`, run in the workspace
/// (the path is as given, so relative).
fn sites(name: &str, json: bool) -> String {
    let mut c = alloctramp();
    c.current_dir(workspace()).arg("sites");
    if json {
        c.arg("--json");
    }
    let o = c.arg(format!("testbins/golden/{name}")).output().unwrap();
    ok(&o, &format!("alloctramp sites {name}"))
}

/// Where NAME was patched to (`--no-library-unwind`), and what `alloctramp patch` said (the output
/// as a name relative to its directory, where the command ran). Patched
/// once per test process.
fn patched(name: &str) -> (PathBuf, String) {
    static DONE: OnceLock<Mutex<HashMap<String, (PathBuf, String)>>> = OnceLock::new();
    let mut done = DONE.get_or_init(Default::default).lock().unwrap();
    if let Some(p) = done.get(name) {
        return p.clone();
    }
    let dir = scratch(&format!("golden-patch-{name}"));
    // Without the installed libraries' unwind rows, whose size is the
    // machine's (tests/callers.rs checks them).
    let o = alloctramp()
        .current_dir(&dir)
        .arg("patch")
        .arg(golden_input(name))
        .args(["-o", name, "--no-library-unwind"])
        .output()
        .unwrap();
    ok(&o, &format!("alloctramp patch {name}"));
    let said = String::from_utf8(o.stderr).unwrap();
    let p = (dir.join(name), said);
    done.insert(name.to_string(), p.clone());
    p
}

/// `alloctramp sites` on the patched file.
fn patched_sites(name: &str) -> String {
    let (out, _) = patched(name);
    let o = alloctramp().current_dir(out.parent().unwrap()).arg("sites").arg(name).output().unwrap();
    ok(&o, &format!("alloctramp sites on patched {name}"))
}

/// What `alloctramp patch` said, then the patched file's ELF header,
/// program headers and section headers.
fn layout(name: &str) -> String {
    use object::read::elf::{FileHeader, ProgramHeader, SectionHeader};
    let (out, said) = patched(name);
    let data = std::fs::read(&out).unwrap();
    let h = object::elf::FileHeader64::<object::Endianness>::parse(&*data).expect("an ELF64 file");
    let e = h.endian().unwrap();
    let mut s = String::new();
    for l in said.lines() {
        writeln!(s, "# {l}").unwrap();
    }
    writeln!(s, "ELF header").unwrap();
    writeln!(s, "  type {}  machine {}  flags {:#x}", et(h.e_type(e)), em(h.e_machine(e)), h.e_flags(e)).unwrap();
    writeln!(s, "  entry {:#x}", h.e_entry(e)).unwrap();
    writeln!(s, "  program headers at {:#x}: {} of {} bytes", h.e_phoff(e), h.e_phnum(e), h.e_phentsize(e)).unwrap();
    writeln!(s, "  section headers at {:#x}: {} of {} bytes", h.e_shoff(e), h.e_shnum(e), h.e_shentsize(e)).unwrap();
    writeln!(s, "  section names in section {}", h.e_shstrndx(e)).unwrap();
    writeln!(s, "  header size {}", h.e_ehsize(e)).unwrap();
    writeln!(s, "Program headers").unwrap();
    writeln!(
        s,
        "  {:<14} {:<5} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "type", "flags", "offset", "vaddr", "filesz", "memsz", "align"
    )
    .unwrap();
    for ph in h.program_headers(e, &*data).unwrap() {
        writeln!(
            s,
            "  {:<14} {:<5} {:>#10x} {:>#10x} {:>#10x} {:>#10x} {:>#8x}",
            pt(ph.p_type(e)),
            pflags(ph.p_flags(e)),
            ph.p_offset(e),
            ph.p_vaddr(e),
            ph.p_filesz(e),
            ph.p_memsz(e),
            ph.p_align(e)
        )
        .unwrap();
    }
    writeln!(s, "Section headers").unwrap();
    writeln!(
        s,
        "  {:>3} {:<24} {:<14} {:<5} {:>10} {:>10} {:>10}",
        "nr", "name", "type", "flags", "addr", "offset", "size"
    )
    .unwrap();
    let sections = h.sections(e, &*data).unwrap();
    for (i, sh) in sections.iter().enumerate() {
        let name = String::from_utf8_lossy(sections.section_name(e, sh).unwrap());
        writeln!(
            s,
            "  {i:>3} {name:<24} {:<14} {:<5} {:>#10x} {:>#10x} {:>#10x}",
            sht(sh.sh_type(e)),
            shflags(sh.sh_flags(e)),
            sh.sh_addr(e),
            sh.sh_offset(e),
            sh.sh_size(e)
        )
        .unwrap();
    }
    s
}

fn et(t: object::elf::FileType) -> String {
    use object::elf::*;
    match t {
        ET_EXEC => "EXEC".into(),
        ET_DYN => "DYN".into(),
        _ => format!("{t:#x}"),
    }
}

fn em(m: object::elf::Machine) -> String {
    if m == object::elf::EM_X86_64 { "X86_64".into() } else { format!("{m:#x}") }
}

fn pt(t: object::elf::ProgramType) -> String {
    use object::elf::*;
    let name = match t {
        PT_NULL => "NULL",
        PT_LOAD => "LOAD",
        PT_DYNAMIC => "DYNAMIC",
        PT_INTERP => "INTERP",
        PT_NOTE => "NOTE",
        PT_PHDR => "PHDR",
        PT_TLS => "TLS",
        PT_GNU_EH_FRAME => "GNU_EH_FRAME",
        PT_GNU_STACK => "GNU_STACK",
        PT_GNU_RELRO => "GNU_RELRO",
        PT_GNU_PROPERTY => "GNU_PROPERTY",
        _ => return format!("{t:#x}"),
    };
    name.into()
}

fn pflags(f: object::elf::ProgramFlags) -> String {
    use object::elf::*;
    let mut s = String::new();
    for (bit, c) in [(PF_R, 'R'), (PF_W, 'W'), (PF_X, 'X')] {
        if f.0 & bit.0 != 0 {
            s.push(c);
        }
    }
    let rest = f.0 & !(PF_R.0 | PF_W.0 | PF_X.0);
    if rest != 0 {
        write!(s, "+{rest:#x}").unwrap();
    }
    s
}

fn sht(t: object::elf::SectionType) -> String {
    use object::elf::*;
    let name = match t {
        SHT_NULL => "NULL",
        SHT_PROGBITS => "PROGBITS",
        SHT_SYMTAB => "SYMTAB",
        SHT_STRTAB => "STRTAB",
        SHT_RELA => "RELA",
        SHT_HASH => "HASH",
        SHT_DYNAMIC => "DYNAMIC",
        SHT_NOTE => "NOTE",
        SHT_NOBITS => "NOBITS",
        SHT_REL => "REL",
        SHT_DYNSYM => "DYNSYM",
        SHT_INIT_ARRAY => "INIT_ARRAY",
        SHT_FINI_ARRAY => "FINI_ARRAY",
        SHT_GNU_HASH => "GNU_HASH",
        SHT_GNU_VERSYM => "GNU_VERSYM",
        SHT_GNU_VERNEED => "GNU_VERNEED",
        SHT_GNU_VERDEF => "GNU_VERDEF",
        _ => return format!("{t:#x}"),
    };
    name.into()
}

/// Section flags as readelf shows them.
fn shflags(f: object::elf::SectionFlags) -> String {
    use object::elf::*;
    let mut s = String::new();
    let mut rest = f.0;
    for (bit, c) in [
        (SHF_WRITE, 'W'),
        (SHF_ALLOC, 'A'),
        (SHF_EXECINSTR, 'X'),
        (SHF_MERGE, 'M'),
        (SHF_STRINGS, 'S'),
        (SHF_INFO_LINK, 'I'),
        (SHF_LINK_ORDER, 'L'),
        (SHF_GROUP, 'G'),
        (SHF_TLS, 'T'),
    ] {
        if f.0 & bit.0 != 0 {
            s.push(c);
            rest &= !bit.0;
        }
    }
    if rest != 0 {
        write!(s, "+{rest:#x}").unwrap();
    }
    s
}

/// The patched every_c run once with profiling on from the start: its
/// final counters file, the counters directory, and the patched program's
/// directory.
fn every_c_run() -> &'static (PathBuf, PathBuf, PathBuf) {
    static RUN: OnceLock<(PathBuf, PathBuf, PathBuf)> = OnceLock::new();
    RUN.get_or_init(|| {
        let (program, _) = patched("every_c");
        let dir = scratch("golden-report-counters");
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        let mut c = std::process::Command::new(&program);
        // Only this run's settings: ALLOCTRAMP_LIVE=0 in the environment
        // would change every figure.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ALLOCTRAMP") {
                c.env_remove(k);
            }
        }
        let o = c.env("ALLOCTRAMP", "on").env("ALLOCTRAMP_DIR", &dir).output().unwrap();
        ok(&o, "the patched every_c");
        let files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "counters"))
            .collect();
        assert_eq!(files.len(), 1, "one counters file: {files:?}");
        (files[0].clone(), dir, program.parent().unwrap().to_path_buf())
    })
}

/// `alloctramp report FILE [args]` of the every_c run, with what changes
/// from run to run replaced: the pid (`<PID>`), the directories
/// (`<COUNTERS-DIR>`, `<PATCHED-DIR>`), the start time (`<START-TIME>`)
/// and the pointer table's memory (`<TABLE-BYTES>`).
fn report(args: &[&str]) -> String {
    let (file, dir, program_dir) = every_c_run();
    let o = alloctramp().arg("report").arg(file).args(args).output().unwrap();
    let out = ok(&o, &format!("alloctramp report {args:?}"));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.is_empty(), "no notes on a final file with live figures: {stderr}");
    let pid = file.file_stem().unwrap().to_string_lossy().into_owned();
    let mut s = String::new();
    for line in out.lines() {
        let line = json_value(line, "pid", "\"<PID>\"")
            .or_else(|| json_value(line, "start_time", "\"<START-TIME>\""))
            // Shards of the pointer table take pages when objects collide in
            // the nursery, which depends on where the heap is (ASLR).
            .or_else(|| json_value(line, "table_bytes", "\"<TABLE-BYTES>\""))
            .unwrap_or_else(|| line.to_string());
        let line = line
            .replace(&format!("{}/{pid}.counters", dir.display()), "<COUNTERS-DIR>/<PID>.counters")
            .replace(&program_dir.display().to_string(), "<PATCHED-DIR>");
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// A line `"key": value[,]` of pretty JSON with the value replaced.
fn json_value(line: &str, key: &str, value: &str) -> Option<String> {
    let indent = &line[..line.len() - line.trim_start().len()];
    let rest = line.trim_start().strip_prefix(&format!("\"{key}\": "))?;
    let comma = if rest.ends_with(',') { "," } else { "" };
    Some(format!("{indent}\"{key}\": {value}{comma}"))
}

// ---- Comparing and blessing ----

fn goldens() -> Goldens {
    Goldens::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden"), workspace(), BLESS)
}

/// Produces every golden file of `test` and compares (or, blessing,
/// writes) it; fails with every difference at once.
fn check_all(test: &str) {
    goldens().check_all(
        GOLDEN.iter().filter(|g| g.0.split('/').next() == Some(test)).map(|(name, produce)| (*name, produce())),
    );
}
