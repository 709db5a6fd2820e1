//! `alloctramp sites`: exact site lists for every test program in every
//! build configuration, a second opinion from objdump, separate debug files,
//! user-named entry points and references that cannot be patched.

use crate::util::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

type Key = (String, u32, String, String);

/// The allocation wrappers `sites` lists are the file's `@wrapper` markers
/// (name and kind) and, for a program, those of the libraries it needs
/// that it imports; no `@notwrapper` function is one.
fn check_wrappers(p: &Program, doc: &Value, path: &Path, config: Config) {
    use object::{Object, ObjectSymbol};
    let kinds = |v: &Value| -> Vec<(String, String, bool)> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|w| {
                // C++ names without their parameters, as markers give them.
                let name = w["function"].as_str().unwrap();
                let name = name.split_once('(').map_or(name, |(n, _)| n).to_string();
                (name, w["kind"].as_str().unwrap().to_string(), w["address"].is_null())
            })
            .collect()
    };
    let mut actual = kinds(&doc["wrappers"]);
    let data = std::fs::read(path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let imports: BTreeSet<String> =
        file.dynamic_symbols().filter(|s| s.is_undefined()).filter_map(|s| s.name().ok().map(str::to_string)).collect();
    let mut expected: Vec<(String, String, bool)> =
        p.wrappers.iter().map(|(n, k)| (n.clone(), k.clone(), false)).collect();
    for lib in p.needs.iter().filter_map(|n| programs().iter().find(|q| &q.name == n)) {
        expected.extend(
            lib.wrappers.iter().filter(|(n, _)| imports.contains(n)).map(|(n, k)| (n.clone(), k.clone(), true)),
        );
    }
    actual.sort();
    expected.sort();
    assert_eq!(
        actual,
        expected,
        "{} built {}: wrappers (name, kind, imported) differ from markers",
        p.name,
        config.name()
    );
    for n in &p.not_wrappers {
        assert!(!actual.iter().any(|w| &w.0 == n), "{} built {}: {n} is not a wrapper", p.name, config.name());
    }
}

/// Every site of every test program in `config` matches a marker (file,
/// line, entry, form), and every marker has exactly one site.
fn check_markers(config: Config) {
    let built = built(config);
    for p in programs() {
        let doc = sites_json(&built.path(&p.name), &[OWN]);
        let mut actual: Vec<Key> = Vec::new();
        for s in doc["sites"].as_array().unwrap() {
            let file = s["file"].as_str().unwrap_or_else(|| panic!("{}: site without file:line: {s}", p.name));
            actual.push((
                base(file).to_string(),
                s["line"].as_u64().unwrap() as u32,
                s["entry"].as_str().unwrap().to_string(),
                s["form"].as_str().unwrap().to_string(),
            ));
        }
        let mut expected: Vec<Key> = p
            .markers
            .iter()
            .map(|m| (m.file.clone(), m.line, m.entry.clone(), expected_form(config, m.tail, false)))
            .collect();
        actual.sort();
        expected.sort();
        assert_eq!(actual, expected, "{} built {}: sites differ from markers", p.name, config.name());
        check_wrappers(p, &doc, &built.path(&p.name), config);
        let unpatchable = doc["unpatchable"].as_array().unwrap().len();
        assert_eq!(
            unpatchable,
            unpatchable_expected(&p.name, config),
            "{} built {}: unpatchable references {}",
            p.name,
            config.name(),
            doc["unpatchable"]
        );
    }
}

/// References that cannot be patched, by program: fnptr keeps &malloc in
/// data (a relocation in every build) and reads &free in code (a GOT read,
/// or the PLT entry's address as an immediate in a non-PIE build).
fn unpatchable_expected(name: &str, _config: Config) -> usize {
    match name {
        "fnptr" => 2,
        "live" => 1,
        "live_wide" => 2,
        _ => 0,
    }
}

mod markers {
    crate::matrix!(super::check_markers);
}

/// The function symbol (from `nm -S`) whose range holds `addr`.
fn nm_function_at(file: &Path, addr: u64) -> Option<String> {
    let out = Command::new("nm").args(["-S", "--defined-only"]).arg(file).output().unwrap();
    String::from_utf8(out.stdout).unwrap().lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() != 4 || !matches!(f[2], "T" | "t" | "W") {
            return None;
        }
        let start = u64::from_str_radix(f[0], 16).ok()?;
        let size = u64::from_str_radix(f[1], 16).ok()?;
        (start <= addr && addr < start + size).then(|| f[3].to_string())
    })
}

#[test]
fn function_module_and_kind_are_reported() {
    let b = built(Config::default_o2());
    for name in ["wrapper", "basic", "threads", "cxx_new_delete"] {
        let doc = sites_json(&b.path(name), &[]);
        assert_eq!(doc["module"], name);
        for s in doc["sites"].as_array().unwrap() {
            let expected = nm_function_at(&b.path(name), s["address"].as_u64().unwrap()).unwrap();
            assert_eq!(s["function_mangled"].as_str().unwrap(), expected, "{name}: {s}");
            assert_eq!(s["module"], name);
        }
    }
    let lib = sites_json(&b.path("libatshared"), &[]);
    assert_eq!(lib["module"], "libatshared.so", "the SONAME names a library");
    assert_eq!(lib["type"], "shared");

    let cxx = sites_json(&b.path("cxx_new_delete"), &[]);
    let sites = cxx["sites"].as_array().unwrap();
    let displays: BTreeSet<&str> = sites.iter().map(|s| s["entry_display"].as_str().unwrap()).collect();
    for d in [
        "operator new(unsigned long)",
        "operator new[](unsigned long, std::align_val_t, std::nothrow_t const&)",
        "operator delete(void*, unsigned long)",
        "operator delete[](void*, unsigned long, std::align_val_t)",
    ] {
        assert!(displays.contains(d), "{d} missing from {displays:?}");
    }
    let kinds: BTreeSet<&str> = sites.iter().map(|s| s["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, BTreeSet::from(["alloc", "free"]));
    // Demangled function names for C++.
    assert!(sites.iter().all(|s| !s["function"].as_str().unwrap().starts_with("_Z")));
}

#[test]
fn text_output_has_one_line_per_site_and_a_summary() {
    let b = built(Config::default_o2());
    let out = run_alloctramp(["sites".as_ref(), b.path("basic").as_os_str()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), program("basic").markers.len());
    let mut addrs = Vec::new();
    for r in &rows {
        let cols: Vec<&str> = r.split('\t').collect();
        assert_eq!(cols.len(), 9, "{r}");
        addrs.push(u64::from_str_radix(cols[0].trim_start_matches("0x"), 16).unwrap());
        assert!(cols[7].contains("basic.c:"), "{r}");
        assert_eq!(cols[8], "basic");
    }
    assert!(addrs.windows(2).all(|w| w[0] < w[1]), "sorted by address");
    assert!(text.contains(&format!("# {} sites in basic (PIE executable", rows.len())), "{text}");
    assert!(text.contains("#   entry malloc: 2"), "{text}");
    assert!(text.contains("# 0 references that cannot be patched"), "{text}");
}

#[test]
fn user_named_entries_by_symbol_and_address() {
    for config in [Config::default_o2(), Config { opt: "-O0", pie: false, extra: "-fno-plt" }] {
        let b = built(config);
        for (name, specs) in
            [("wrapper", ["xmalloc:alloc", "xfree:free"]), ("own_malloc", ["my_alloc:alloc", "my_free:free"])]
        {
            let p = program(name);
            let args: Vec<&str> = specs.iter().flat_map(|s| ["--entry", *s]).chain([OWN]).collect();
            let doc = sites_json(&b.path(name), &args);
            let mut actual: Vec<Key> = doc["sites"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    (
                        base(s["file"].as_str().unwrap()).to_string(),
                        s["line"].as_u64().unwrap() as u32,
                        s["entry"].as_str().unwrap().to_string(),
                        s["form"].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            // Calls to functions defined in the program are direct.
            let mut expected: Vec<Key> = p
                .markers
                .iter()
                .map(|m| (m.file.clone(), m.line, m.entry.clone(), expected_form(config, m.tail, false)))
                .chain(
                    p.user_markers
                        .iter()
                        .map(|m| (m.file.clone(), m.line, m.entry.clone(), expected_form(config, m.tail, true))),
                )
                .collect();
            actual.sort();
            expected.sort();
            assert_eq!(actual, expected, "{name} {} with {specs:?}", config.name());
        }
    }

    // The same by address, as for a stripped file.
    let b = built(Config::default_o2());
    let wrapper = b.path("wrapper");
    let nm = Command::new("nm").arg(&wrapper).output().unwrap();
    let nm = String::from_utf8(nm.stdout).unwrap();
    let addr = nm.lines().find(|l| l.ends_with(" xmalloc")).unwrap().split(' ').next().unwrap();
    let by_addr = sites_json(&wrapper, &["--entry", &format!("0x{addr}:alloc:name=my_xmalloc")]);
    let by_name = sites_json(&wrapper, &["--entry", "xmalloc:alloc"]);
    let addrs = |d: &Value, e: &str| -> Vec<u64> {
        d["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["entry_display"] == e)
            .map(|s| s["address"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(addrs(&by_addr, "my_xmalloc"), addrs(&by_name, "xmalloc"));
    assert_eq!(
        addrs(&by_addr, "my_xmalloc").len(),
        program("wrapper").user_markers.iter().filter(|m| m.entry == "xmalloc").count()
    );

    // An entry the file does not have is a warning, not an error.
    let out = run_alloctramp(["sites".as_ref(), "--entry".as_ref(), "nosuch:alloc".as_ref(), wrapper.as_os_str()]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("entry nosuch is neither defined nor imported"));
    // A bad spec is an error.
    let out = run_alloctramp(["sites".as_ref(), "--entry".as_ref(), "x:grow".as_ref(), wrapper.as_os_str()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown kind"));
}

/// `patch --entry` with a name the file neither defines nor imports: the
/// same warning as `sites` (it said nothing), and the file is patched.
#[test]
fn patch_warns_of_an_entry_the_file_does_not_have() {
    let wrapper = built(Config::default_o2()).path("wrapper");
    let dir = scratch(test_name());
    let out = run_alloctramp([
        "patch".as_ref(),
        "--entry".as_ref(),
        "nosuch:alloc".as_ref(),
        wrapper.as_os_str(),
        "-o".as_ref(),
        dir.join("wrapper").as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("entry nosuch is neither defined nor imported"), "{err}");
    assert!(dir.join("wrapper").exists());
}

#[test]
fn separate_debug_file_through_debuglink_and_build_id() {
    let b = built(Config::default_o2());
    let dir = scratch("debuglink");
    let full = b.path("basic");
    let with_lines = sites_json(&full, &[]);
    let lines = |d: &Value| -> Vec<(u64, u64)> {
        d["sites"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["address"].as_u64().unwrap(), s["line"].as_u64().unwrap_or(0)))
            .collect()
    };
    let stripped = dir.join("basic");
    let debug = dir.join("basic.debug");
    let sh = |cmd: String| assert!(Command::new("sh").arg("-c").arg(&cmd).status().unwrap().success(), "{cmd}");
    sh(format!("objcopy --only-keep-debug {} {}", full.display(), debug.display()));
    sh(format!(
        "objcopy --strip-debug --add-gnu-debuglink={} {} {}",
        debug.display(),
        full.display(),
        stripped.display()
    ));
    let via_link = sites_json(&stripped, &[]);
    assert!(via_link["debug_info"].as_str().unwrap().ends_with("basic.debug"));
    assert_eq!(lines(&via_link), lines(&with_lines));

    // By build-id under a debug directory, when the debuglink target is gone.
    let id_dir = dir.join("debugroot");
    let readelf = Command::new("readelf").arg("-n").arg(&full).output().unwrap();
    let notes = String::from_utf8(readelf.stdout).unwrap();
    let id =
        notes.lines().find_map(|l| l.trim().strip_prefix("Build ID: ")).expect("gcc writes a build-id").to_string();
    std::fs::create_dir_all(id_dir.join(".build-id").join(&id[..2])).unwrap();
    std::fs::rename(&debug, id_dir.join(".build-id").join(&id[..2]).join(format!("{}.debug", &id[2..]))).unwrap();
    let none = sites_json(&stripped, &[]);
    assert_eq!(none["debug_info"], "");
    assert!(lines(&none).iter().all(|&(_, l)| l == 0));
    let via_id = sites_json(&stripped, &["--debug-dir", id_dir.to_str().unwrap()]);
    assert_eq!(lines(&via_id), lines(&with_lines));
}

#[test]
fn stripped_files_name_functions_from_dynsym_or_unwind_info() {
    let b = built(Config::default_o2());
    let dir = scratch("stripped");
    for name in ["basic", "libatshared"] {
        let full = b.path(name);
        let stripped = dir.join(full.file_name().unwrap());
        assert!(Command::new("strip").arg("-s").arg("-o").arg(&stripped).arg(&full).status().unwrap().success());
        let a = sites_json(&full, &[]);
        let s = sites_json(&stripped, &[]);
        let key = |d: &Value| -> Vec<(u64, String, String)> {
            d["sites"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    (
                        s["address"].as_u64().unwrap(),
                        s["form"].as_str().unwrap().into(),
                        s["entry"].as_str().unwrap().into(),
                    )
                })
                .collect()
        };
        assert_eq!(key(&a), key(&s), "{name}: stripping changes no site");
        for (site, orig) in s["sites"].as_array().unwrap().iter().zip(a["sites"].as_array().unwrap()) {
            let f = site["function"].as_str().unwrap();
            if name == "libatshared" {
                // Exported functions keep their names through .dynsym.
                assert_eq!(f, orig["function"].as_str().unwrap());
            } else {
                assert!(f.starts_with("fn@0x"), "{f}");
            }
        }
    }
}

/// Calls and jumps to entry points as objdump shows them:
/// address -> ("call" | "jmp", entry name).
fn objdump_sites(file: &Path, entries: &BTreeSet<String>) -> Option<BTreeMap<u64, (String, String)>> {
    let out = Command::new("objdump").args(["-d", "-w", "--no-show-raw-insn"]).arg(file).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // GOT slot -> symbol, from the GLOB_DAT and JUMP_SLOT relocations.
    let relocs = Command::new("readelf").args(["-rW"]).arg(file).output().ok()?;
    let mut got = BTreeMap::new();
    for line in String::from_utf8_lossy(&relocs.stdout).lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        if w.len() >= 5
            && (w[2].ends_with("GLOB_DAT") || w[2].ends_with("JUMP_SLOT"))
            && let Ok(off) = u64::from_str_radix(w[0], 16)
        {
            got.insert(off, w[4].split('@').next().unwrap().to_string());
        }
    }
    let mut section = String::new();
    let mut map = BTreeMap::new();
    for line in text.lines() {
        if let Some(s) = line.strip_prefix("Disassembly of section ") {
            section = s.trim_end_matches(':').to_string();
            continue;
        }
        if section.starts_with(".plt") {
            continue;
        }
        let Some((addr, rest)) = line.split_once(":\t") else { continue };
        let Ok(addr) = u64::from_str_radix(addr.trim(), 16) else { continue };
        let mut words = rest.split_whitespace().peekable();
        while matches!(words.peek(), Some(&("bnd" | "notrack" | "addr32" | "data16" | "cs" | "ds"))) {
            words.next();
        }
        let Some(mnemonic) = words.next() else { continue };
        let kind = match mnemonic {
            "call" | "callq" => "call",
            "jmp" | "jmpq" => "jmp",
            _ => continue,
        };
        // Through a GOT slot: objdump names the slot after the nearest
        // symbol, which may be another one; the relocation says which.
        if rest.contains("(%rip)") {
            let Some(hash) = rest.rfind("# ") else { continue };
            let slot = rest[hash + 2..].split_whitespace().next().unwrap_or("");
            let Ok(slot) = u64::from_str_radix(slot, 16) else { continue };
            if let Some(sym) = got.get(&slot).filter(|s| entries.contains(*s)) {
                map.insert(addr, (kind.to_string(), sym.clone()));
            }
            continue;
        }
        let Some(open) = rest.rfind('<') else { continue };
        let name = rest[open + 1..].trim_end_matches('>');
        if name.contains('+') || name.contains('-') {
            continue;
        }
        let sym = name.split('@').next().unwrap();
        if entries.contains(sym) {
            map.insert(addr, (kind.to_string(), sym.to_string()));
        }
    }
    Some(map)
}

fn ours(doc: &Value) -> BTreeMap<u64, (String, String)> {
    doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let form = s["form"].as_str().unwrap();
            (
                s["address"].as_u64().unwrap(),
                (form.split(' ').next().unwrap().to_string(), s["entry"].as_str().unwrap().to_string()),
            )
        })
        .collect()
}

fn default_entry_names() -> BTreeSet<String> {
    alloctramp_trampolines::entry::defaults().into_iter().map(|e| e.target.to_string()).collect()
}

fn compare_with_objdump(file: &Path) -> Option<usize> {
    let entries = default_entry_names();
    let theirs = objdump_sites(file, &entries)?;
    // The sites alone (the wrapper search reads every function again).
    let doc = sites_json(file, &["--no-wrappers"]);
    let mine = ours(&doc);
    // Direct calls to an in-file definition may be shown by objdump under an
    // alias (e.g. __libc_malloc); they are compared where objdump names them.
    let mine_named: BTreeMap<u64, (String, String)> = mine
        .iter()
        .filter(|(a, _)| {
            theirs.contains_key(a)
                || !doc["sites"].as_array().unwrap().iter().any(|s| s["address"] == **a && s["via"] == "direct")
        })
        .map(|(a, v)| (*a, v.clone()))
        .collect();
    assert_eq!(mine_named, theirs, "{}: alloctramp and objdump disagree", file.display());
    Some(theirs.len())
}

#[test]
fn objdump_agrees_on_every_test_program() {
    for config in Config::all() {
        let b = built(config);
        for p in programs() {
            compare_with_objdump(&b.path(&p.name)).expect("objdump runs");
        }
    }
}

#[test]
fn objdump_agrees_on_installed_programs_and_libraries() {
    let budget = Duration::from_secs(40);
    let start = Instant::now();
    let mut files = Vec::new();
    for dir in ["/usr/bin", "/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"] {
        let Ok(rd) = std::fs::read_dir(dir) else { continue };
        let mut v: Vec<_> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        v.sort();
        files.extend(v);
    }
    let mut checked = 0;
    let mut sites = 0;
    let mut seen = BTreeSet::new();
    for f in files {
        if start.elapsed() > budget {
            break;
        }
        let Ok(canon) = std::fs::canonicalize(&f) else { continue };
        let Ok(meta) = std::fs::metadata(&canon) else { continue };
        // objdump takes seconds on large files: keep each under 4 MB.
        if !meta.is_file() || meta.len() > 4 << 20 || !seen.insert(canon.clone()) {
            continue;
        }
        let mut magic = [0u8; 20];
        let Ok(mut fh) = std::fs::File::open(&canon) else { continue };
        if std::io::Read::read_exact(&mut fh, &mut magic).is_err()
            || &magic[..4] != b"\x7fELF"
            || magic[4] != 2
            || magic[18] != 62
            || !matches!(magic[16], 2 | 3)
        {
            continue;
        }
        if let Some(n) = compare_with_objdump(&canon) {
            checked += 1;
            sites += n;
        }
    }
    eprintln!("objdump cross-check: {checked} installed files, {sites} sites");
    assert!(checked >= 20, "only {checked} installed ELF files were checked");
    assert!(sites > 0);
}
