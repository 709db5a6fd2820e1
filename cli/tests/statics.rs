//! Static programs (glibc `-static`, musl `-static`, `-static-pie`): the
//! patched file carries the static runtime. testbins/static/exact.c is
//! built each way and patched with no option: it prints what it printed
//! before, off and on; on from start or switched on while it waits, every
//! marked site counts exactly (calls, bytes, live objects and bytes, with
//! objects of four threads freed by the main thread); the child it forks
//! counts into a file of its own, never into its parent's.

use crate::allocators::{Rows, marks, rows};
use crate::patch::patch_to;
use crate::runtime::{counters_dir, report};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const SRC: &str = "static/exact.c";

/// The line of the site only the forked child reaches.
fn child_line() -> u32 {
    let text = std::fs::read_to_string(testbins_dir().join(SRC)).unwrap();
    text.lines().position(|l| l.contains("@site malloc calls=0")).unwrap() as u32 + 1
}

/// Builds testbins/static/exact.c with `cc` and `flags`, and patches it.
fn build(name: &str, cc: &str, flags: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(&format!("static-{name}"));
    let src = testbins_dir().join(SRC);
    let bin = dir.join("exact");
    // (`cc` may be a whole command with {src} and {out}.)
    let cmd = match cc.contains("{src}") {
        true => cc.replace("{src}", &src.to_string_lossy()).replace("{out}", &bin.to_string_lossy()),
        false => format!("{cc} -g -O1 {flags} -Wall -Werror -pthread {} -o {}", src.display(), bin.display()),
    };
    let o = Command::new("sh").arg("-c").arg(&cmd).output().unwrap();
    assert!(o.status.success(), "{cmd}: {}", String::from_utf8_lossy(&o.stderr));
    let patched = dir.join("patched");
    patch_to(&bin, &patched, &[]);
    (bin, patched)
}

/// The counters files in `dir`, by process id.
fn files(dir: &Path) -> BTreeMap<u32, PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "counters"))
        .map(|p| (p.file_stem().unwrap().to_string_lossy().parse().unwrap(), p))
        .collect()
}

/// A counters file's totals: calls, bytes, failures, live objects and
/// bytes, frees.
fn totals(file: &Path, counters: &Path) -> Vec<u64> {
    let doc = report(file.to_str().unwrap(), counters);
    let t = &doc["totals"];
    ["calls", "bytes", "failed", "live_calls", "live_bytes", "freed_objects", "free_calls"]
        // (basic.c's failed call asks for SIZE_MAX bytes: a byte total past
        // u64, which JSON carries as a float.)
        .map(|k| t[k].as_u64().or_else(|| t[k].as_f64().map(|f| f as u64)).unwrap_or_else(|| panic!("{k} in {t}")))
        .to_vec()
}

/// The parent's and the child's figures: the parent's are the markers',
/// the child's are its five objects at its own site and nothing else.
fn check(counters: &Path, parent: u32, how: &str) {
    let files = files(counters);
    assert_eq!(files.len(), 2, "{how}: the parent's file and the forked child's: {files:?}");
    let doc = report(files[&parent].to_str().unwrap(), counters);
    assert_eq!(rows(&doc, SRC), marks(SRC), "{how}: (line, entry) -> (calls, bytes, live)");
    let (&child, file) = files.iter().find(|(p, _)| **p != parent).unwrap();
    let doc = report(file.to_str().unwrap(), counters);
    let counted: Rows = rows(&doc, SRC).into_iter().filter(|(_, r)| r.0 != 0).collect();
    let want = Rows::from([((child_line(), "malloc".to_string()), (5, 200, Some((5, 200))))]);
    assert_eq!(counted, want, "{how}: child {child}'s own figures");
}

fn exact(name: &str, cc: &str, flags: &str) {
    let (bin, patched) = build(name, cc, flags);
    let plain = Command::new(&bin).output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    // Off, then on from start.
    let (mut on_totals, mut on_dir) = (Vec::new(), None);
    for on in [false, true] {
        let counters = counters_dir(&format!("static-{name}-{on}"));
        let mut c = Command::new(&patched);
        c.env("ALLOCTRAMP_DIR", &counters);
        if on {
            c.env("ALLOCTRAMP", "on");
        }
        let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let pid = child.id();
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(0), "on {on}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, plain.stdout, "on {on}: the same output");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "", "on {on}: nothing on stderr");
        if on {
            check(&counters, pid, "on from start");
            on_totals = totals(&files(&counters)[&pid], &counters);
            on_dir = Some(counters);
        } else {
            // (The child leaves its empty file, as a dynamic program's
            // does: it ends with _exit.)
            assert!(!files(&counters).contains_key(&pid), "a process never profiled leaves no file");
        }
    }
    // On from start in `counters`: its pid and output.
    let on_from_start = |bin: &Path, counters: &Path| {
        let child = Command::new(bin)
            .env("ALLOCTRAMP", "on")
            .env("ALLOCTRAMP_DIR", counters)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        (child.id(), child.wait_with_output().unwrap())
    };
    // A second process in the same directory names the first one's site
    // table (the static runtime's open, fstat, futimens and stat).
    let counters = on_dir.unwrap();
    let (pid, o) = on_from_start(&patched, &counters);
    assert_eq!((o.status.code(), &o.stdout), (Some(0), &plain.stdout), "a second process");
    assert_eq!(totals(&files(&counters)[&pid], &counters), on_totals, "a second process");
    assert_eq!(std::fs::read_dir(counters.join("tables")).unwrap().count(), 1, "one table for both");
    // Stripped: the runtime's segments and the new tables have sections,
    // so `strip` keeps them.
    let stripped = patched.with_file_name("stripped");
    std::fs::copy(&patched, &stripped).unwrap();
    assert!(Command::new("strip").arg(&stripped).status().unwrap().success());
    let counters = counters_dir(&format!("static-{name}-stripped"));
    let (pid, o) = on_from_start(&stripped, &counters);
    assert_eq!((o.status.code(), &o.stdout), (Some(0), &plain.stdout), "stripped");
    // (Without .symtab, rows have no function names: the lines are the
    // DWARF's, which strip removed too; compare totals.)
    let files = files(&counters);
    assert_eq!(files.len(), 2, "stripped: {files:?}");
    assert_eq!(totals(&files[&pid], &counters), on_totals, "stripped: the same totals as on from start");
    // Switched on while it waits, by `alloctramp enable`: through the
    // watcher thread (the static runtime's `clone`), or the control signal
    // (its `sigaction`).
    for switch in ["thread", "signal"] {
        let counters = counters_dir(&format!("static-{name}-enabled-{switch}"));
        let mut child = Command::new(&patched)
            .arg("wait")
            .env("ALLOCTRAMP_DIR", &counters)
            .env("ALLOCTRAMP_SWITCH", switch)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n");
        let o = alloctramp().args(["enable", &pid.to_string(), "--dir"]).arg(&counters).output().unwrap();
        assert!(o.status.success(), "enable ({switch}): {}", String::from_utf8_lossy(&o.stderr));
        child.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        assert!(child.wait().unwrap().success());
        assert_eq!(format!("{line}{rest}").as_bytes(), [b"ready\n".as_slice(), &plain.stdout].concat());
        check(&counters, pid, &format!("switched on while running ({switch})"));
    }
}

#[test]
fn a_glibc_static_program_counts_exactly() {
    exact("glibc", "gcc", "-static");
}

#[test]
fn a_musl_static_program_counts_exactly() {
    ensure_tool("musl-gcc", "musl-tools");
    exact("musl", "musl-gcc", "-static");
}

#[test]
fn a_glibc_static_pie_program_counts_exactly() {
    exact("glibc-pie", "gcc", "-static-pie");
}

/// Packed relative relocations (`-z pack-relative-relocs`, DT_RELR) fill
/// words of the thread-local image too: they apply to the merged copy.
#[test]
fn a_glibc_static_pie_program_with_packed_relocations_counts_exactly() {
    exact("glibc-pie-relr", "gcc", "-static-pie -Wl,-z,pack-relative-relocs");
}

/// musl's static-pie (`rcrt1.o`, which relocates the program itself):
/// Debian's musl-gcc links a dynamic PIE for `-static-pie`, so the object
/// is compiled by musl-gcc and linked by hand.
#[test]
fn a_musl_static_pie_program_counts_exactly() {
    ensure_tool("musl-gcc", "musl-tools");
    let m = "/usr/lib/x86_64-linux-musl";
    let gcc_file = |f: &str| {
        let o = Command::new("gcc").arg(format!("-print-file-name={f}")).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let cmd = format!(
        "musl-gcc -c -g -O1 -fPIE -Wall -Werror -pthread {{src}} -o {{out}}.o && gcc -static-pie -nostdlib \
         -nostartfiles {m}/rcrt1.o {m}/crti.o {} {{out}}.o -L{m} -lc {} {} {m}/crtn.o -o {{out}}",
        gcc_file("crtbeginS.o"),
        gcc_file("libgcc.a"),
        gcc_file("crtendS.o"),
    );
    exact("musl-pie", &cmd, "");
}

/// Calls and bytes of the rows whose function is `name`, summed.
fn by_function(doc: &Value, name: &str) -> (u64, u64, u64) {
    let mut t = (0, 0, 0);
    for s in doc["sites"].as_array().unwrap().iter().filter(|s| s["function"] == name && s["kind"] != "free") {
        t.0 += s["calls"].as_u64().unwrap();
        t.1 += s["bytes"].as_u64().unwrap();
        t.2 += s["live_calls"].as_u64().unwrap();
    }
    t
}

/// A static Rust program (glibc, static-pie): the same output off and on,
/// and exact figures. `churn`'s vectors are charged to it, through
/// `__rust_alloc` and `__rdl_alloc` (whose `malloc` is the file's own, in a
/// GOT slot a relative relocation fills); `keep`'s boxes are allocated
/// through a register loaded once from the GOT, a call no site sees, and
/// count at `__rust_alloc`'s own site.
#[test]
fn a_static_rust_program_counts_exactly() {
    let dir = scratch("static-rust");
    let bin = dir.join("exact");
    let src = testbins_dir().join("static/exact.rs");
    let o = Command::new("rustc")
        .args(["-O", "-g", "-C", "target-feature=+crt-static", "--edition", "2021"])
        .arg(&src)
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap();
    assert!(o.status.success(), "rustc: {}", String::from_utf8_lossy(&o.stderr));
    let patched = dir.join("patched");
    patch_to(&bin, &patched, &[]);
    let plain = Command::new(&bin).output().unwrap();
    assert!(plain.status.success());
    let counters = counters_dir("static-rust");
    for on in [false, true] {
        let mut c = Command::new(&patched);
        c.env("ALLOCTRAMP_DIR", &counters);
        if on {
            c.env("ALLOCTRAMP", "on");
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "on {on}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, plain.stdout, "on {on}: the same output");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "", "on {on}: nothing on stderr");
    }
    let files = files(&counters);
    assert_eq!(files.len(), 1, "{files:?}");
    let doc = report(files.values().next().unwrap().to_str().unwrap(), &counters);
    assert_eq!(by_function(&doc, "exact::churn"), (500, 500 * 24, 0), "churn's vectors");
    assert_eq!(by_function(&doc, "exact::keep"), (5, 8 * (1000 + 250 + 251 + 252 + 253), 0), "keep's vectors");
    assert_eq!(by_function(&doc, "__rustc::__rust_alloc"), (2006, 2006 * 40, 0), "keep's boxes");
}

/// A program linked dynamically with musl would get glibc's runtime
/// library loaded into it (and crash): it is refused, with one line and
/// no output.
#[test]
fn a_program_linked_dynamically_with_musl_is_refused() {
    ensure_tool("musl-gcc", "musl-tools");
    let dir = scratch("static-musl-dynamic");
    let bin = dir.join("exact");
    let src = testbins_dir().join(SRC);
    let o = Command::new("musl-gcc").args(["-O1", "-pthread"]).arg(&src).arg("-o").arg(&bin).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = dir.join("patched");
    let o = alloctramp().arg("patch").arg(&bin).arg("-o").arg(&out).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("linked dynamically with musl"), "{stderr}");
    assert!(!out.exists());
}

/// Exceptions through trampolines in static C++ programs: the original
/// `.eh_frame` has no search table (the start files register it with the
/// unwinder), so the patched file gets one, with the trampolines' entries,
/// and the runtime's personality routine reads frames with the program's
/// own unwinder. testbins/unwind/throws.cpp and badalloc.cpp (which
/// tests/charge.rs runs dynamically) unwind as the original and count as
/// they do there; in the static throws, the exception object libstdc++
/// allocates inside make_name is a site too, charged to main's call.
#[test]
fn exceptions_unwind_through_trampolines_in_static_programs() {
    let dir = scratch("static-unwind");
    for name in ["throws", "badalloc"] {
        let exe = dir.join(name);
        let src = testbins_dir().join(format!("unwind/{name}.cpp"));
        let o = Command::new("g++").args(["-O2", "-g", "-static"]).arg(&src).arg("-o").arg(&exe).output().unwrap();
        assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
        let patched = dir.join(format!("{name}-patched"));
        patch_to(&exe, &patched, &[]);
        let plain = Command::new(&exe).output().unwrap();
        let counters = counters_dir(&format!("static-unwind-{name}"));
        let o = Command::new(&patched).env("ALLOCTRAMP", "on").env("ALLOCTRAMP_DIR", &counters).output().unwrap();
        assert_eq!((o.status.code(), &o.stdout), (plain.status.code(), &plain.stdout), "{name}: as the original");
        let files = files(&counters);
        assert_eq!(files.len(), 1, "{name}: {files:?}");
        let doc = report(files.values().next().unwrap().to_str().unwrap(), &counters);
        let row = |line: u64| {
            let rows = doc["sites"].as_array().unwrap();
            let r = rows.iter().find(|s| s["kind"] != "free" && s["line"] == line).expect("a row");
            ["calls", "bytes", "failed", "live_calls", "live_bytes", "freed_objects"].map(|k| r[k].as_u64().unwrap())
        };
        if name == "throws" {
            assert_eq!(row(18), [7, 220, 0, 0, 0, 7], "throws: main's call of make_name");
            assert_eq!(row(9), [0; 6], "throws: make_name's own malloc");
        } else {
            let requested = 2 * (1u64 << 62) + 64 * (1 + 2 + 3 + 5 + 6 + 7);
            assert_eq!(row(16), [8, requested, 2, 0, 0, 6], "badalloc: main's call of take");
            assert_eq!(row(9), [1, 100, 0, 0, 0, 1], "badalloc: take's own site, called through a pointer");
        }
    }
}

/// PT_TLS's size, from the program headers.
fn tls_memsz(file: &Path) -> Option<u64> {
    use object::read::elf::{FileHeader, ProgramHeader};
    let data = std::fs::read(file).unwrap();
    let h = object::elf::FileHeader64::<object::Endianness>::parse(&*data).unwrap();
    let e = h.endian().unwrap();
    let phdrs = h.program_headers(e, &*data).unwrap();
    phdrs.iter().find(|p| p.p_type(e) == object::elf::PT_TLS).map(|p| p.p_memsz(e))
}

/// A static program without thread-local variables of its own (musl's
/// basic.c has no PT_TLS) gets one for the runtime's block; a section
/// covers all of it, so that `strip`, which sizes PT_TLS by its sections,
/// keeps its size, and the stripped program counts as the unstripped one.
#[test]
fn a_stripped_static_program_without_thread_locals_keeps_the_runtime_s_block() {
    ensure_tool("musl-gcc", "musl-tools");
    let dir = scratch("static-no-tls");
    let bin = dir.join("basic");
    let src = testbins_dir().join("basic.c");
    let o = Command::new("musl-gcc").args(["-O1", "-g", "-static"]).arg(&src).arg("-o").arg(&bin).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(tls_memsz(&bin), None, "the program has no PT_TLS of its own");
    let patched = dir.join("patched");
    patch_to(&bin, &patched, &[]);
    let stripped = dir.join("stripped");
    std::fs::copy(&patched, &stripped).unwrap();
    assert!(Command::new("strip").arg(&stripped).status().unwrap().success());
    assert!(tls_memsz(&patched).is_some_and(|n| n > 0));
    assert_eq!(tls_memsz(&stripped), tls_memsz(&patched), "strip keeps the runtime's block whole");
    let plain = Command::new(&bin).output().unwrap();
    let mut seen = Vec::new();
    for (k, file) in [&patched, &stripped].into_iter().enumerate() {
        let counters = counters_dir(&format!("static-no-tls-{k}"));
        let o = Command::new(file).env("ALLOCTRAMP", "on").env("ALLOCTRAMP_DIR", &counters).output().unwrap();
        assert_eq!((o.status.code(), &o.stdout), (Some(0), &plain.stdout), "{}", file.display());
        let files = files(&counters);
        assert_eq!(files.len(), 1, "{files:?}");
        seen.push(totals(files.values().next().unwrap(), &counters));
    }
    // basic.c: 31 allocation calls (one fails) and 20 frees at its sites.
    assert_eq!(seen[0][0], 31, "allocation calls: {:?}", seen[0]);
    assert_eq!(seen[0][2], 1, "failed calls: {:?}", seen[0]);
    assert_eq!(seen[1], seen[0], "stripped and not: the same totals");
}

/// A static program's own pool, called through a table of operations
/// (testbins/apis/ptrpool.c, built `-static` with glibc and with musl):
/// its functions are hooked at their entry as in a dynamic program, with
/// exact figures on from start and switched on while it waits.
#[test]
fn entry_hooks_count_exactly_in_static_programs() {
    use crate::allocators::{POOL, POOL_ENTRIES, assert_pool_rows, pool_switched};
    ensure_tool("musl-gcc", "musl-tools");
    for cc in ["gcc", "musl-gcc"] {
        let dir = scratch(&format!("static-ptrpool-{cc}"));
        let bin = dir.join("ptrpool");
        let src = testbins_dir().join(POOL);
        let o = Command::new(cc)
            .args(["-O2", "-g", "-static", "-pthread", "-Wall", "-Werror"])
            .arg(&src)
            .arg("-o")
            .arg(&bin)
            .output()
            .unwrap();
        assert!(o.status.success(), "{cc}: {}", String::from_utf8_lossy(&o.stderr));
        let patched = dir.join("patched");
        patch_to(&bin, &patched, &POOL_ENTRIES);
        let plain = Command::new(&bin).output().unwrap();
        assert!(plain.status.success());
        for on in [false, true] {
            let counters = counters_dir(&format!("static-ptrpool-{cc}-{on}"));
            let mut c = Command::new(&patched);
            c.env("ALLOCTRAMP_DIR", &counters);
            if on {
                c.env("ALLOCTRAMP", "on");
            }
            let o = c.output().unwrap();
            assert_eq!(o.status.code(), Some(0), "{cc} on {on}: {}", String::from_utf8_lossy(&o.stderr));
            assert_eq!(o.stdout, plain.stdout, "{cc} on {on}: the same output");
            if on {
                let files = files(&counters);
                assert_eq!(files.len(), 1, "{cc}: {files:?}");
                let doc = report(files.values().next().unwrap().to_str().unwrap(), &counters);
                assert_pool_rows(&doc, &format!("{cc}: on from start"));
            }
        }
        let counters = counters_dir(&format!("static-ptrpool-{cc}-enabled"));
        pool_switched(&patched, &counters, &plain.stdout, "wait", &[("ready", "enable")]);
    }
}
