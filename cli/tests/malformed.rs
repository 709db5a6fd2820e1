//! Inputs that used to patch "successfully" into files that cannot start
//! or that ELF checkers newly reject, sparse inputs, and error messages that
//! did not say what was wrong. Each test is named after what broke.

use crate::patch::patch_to;
use crate::util::*;
use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn le16(d: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(d[at..at + 2].try_into().unwrap())
}
fn le32(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().unwrap())
}
fn le64(d: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(d[at..at + 8].try_into().unwrap())
}
fn set64(d: &mut [u8], at: usize, v: u64) {
    d[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// (file offset of the program header, p_type) of every program header.
fn phdrs(d: &[u8]) -> Vec<(usize, u32)> {
    let (phoff, phnum) = (le64(d, 32) as usize, le16(d, 56) as usize);
    (0..phnum).map(|i| phoff + i * 56).map(|at| (at, le32(d, at))).collect()
}

/// The file offset of a virtual address, through the PT_LOAD headers.
fn offset_of(d: &[u8], addr: u64) -> usize {
    for (at, t) in phdrs(d) {
        let (off, va, filesz) = (le64(d, at + 8), le64(d, at + 16), le64(d, at + 32));
        if t == 1 && addr >= va && addr - va < filesz {
            return (off + addr - va) as usize;
        }
    }
    panic!("address {addr:#x} not loaded")
}

/// The dynamic table as the loader reads it (from PT_DYNAMIC's address up
/// to DT_NULL): (file offset of the entry, tag, value).
fn dynamic(d: &[u8]) -> Vec<(usize, i64, u64)> {
    let (at, _) = phdrs(d).into_iter().find(|&(_, t)| t == 2).expect("PT_DYNAMIC");
    let mut off = offset_of(d, le64(d, at + 16));
    let mut v = Vec::new();
    while le64(d, off) != 0 {
        v.push((off, le64(d, off) as i64, le64(d, off + 8)));
        off += 16;
    }
    v
}

fn dyn_entry(d: &[u8], tag: i64) -> (usize, u64) {
    dynamic(d).into_iter().find(|e| e.1 == tag).map(|e| (e.0, e.2)).unwrap_or_else(|| panic!("no tag {tag:#x}"))
}

/// Writes `data` edited by `edit` to `dir/name`.
fn edited(dir: &Path, name: &str, data: &[u8], edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut d = data.to_vec();
    edit(&mut d);
    let p = dir.join(name);
    std::fs::write(&p, d).unwrap();
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    p
}

/// `alloctramp patch IN -o OUT` must fail with exit status 2 and exactly
/// one line that names the file and contains every one of `what`; nothing
/// is written.
fn expect_patch_refused(input: &Path, out: &Path, what: &[&str]) -> String {
    let o = alloctramp().arg("patch").arg(input).arg("-o").arg(out).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{}: {stderr}", input.display());
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains(&input.display().to_string()), "names the file: {stderr}");
    for w in what {
        assert!(stderr.contains(w), "expected {w:?} in: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.exists(), "no output written");
    stderr
}

const DT_SONAME: i64 = 14;
const DT_STRSZ: i64 = 10;
const DT_NEEDED: i64 = 1;
const DT_VERSYM: i64 = 0x6fff_fff0;

#[test]
fn short_pt_dynamic_keeps_every_dynamic_entry() {
    // PT_DYNAMIC's file size says 4 entries; the loader reads to DT_NULL
    // and the program starts. The patched copy used to keep only what
    // PT_DYNAMIC's size covered and lost DT_NEEDED, DT_STRTAB and more.
    let dir = scratch("short-dynamic");
    let b = built(Config::default_o2());
    let real = std::fs::read(b.path("basic")).unwrap();
    let (ph, _) = phdrs(&real).into_iter().find(|&(_, t)| t == 2).unwrap();
    let input = edited(&dir, "basic", &real, |d| {
        set64(d, ph + 32, 4 * 16);
        set64(d, ph + 40, 4 * 16);
    });
    let expected = run_program(&b.path("basic"), &[], &[]);
    assert_eq!(expected.2, 0);
    assert_eq!(run_program(&input, &[], &[]), expected, "the edited input starts");
    let out = dir.join("out/basic");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    patch_to(&input, &out, &[]);
    assert_eq!(run_program(&out, &[], &[]), expected, "the patched program starts and behaves the same");
    let counters = crate::runtime::counters_dir("short-dynamic");
    assert_eq!(
        run_program(&out, &[], &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())]),
        expected
    );
    let before: Vec<i64> = dynamic(&real).iter().map(|e| e.1).collect();
    let after: Vec<i64> = dynamic(&std::fs::read(&out).unwrap()).iter().map(|e| e.1).collect();
    assert!(before.len() > 4 + 10, "{before:?}");
    // Every entry (the program needs the C library: no DT_NEEDED added),
    // then DT_INIT and DT_FINI if it had none.
    let mut want = before.clone();
    for tag in [DT_INIT, DT_FINI] {
        if !want.contains(&tag) {
            want.push(tag);
        }
    }
    assert_eq!(after, want);
}

#[test]
fn soname_outside_string_table_is_refused() {
    // DT_SONAME past DT_STRSZ: the patched string table is a copy, so the
    // name read bytes past its end and ld.so crashed loading the runtime.
    let dir = scratch("soname-out");
    let b = built(Config::default_o2());
    let real = std::fs::read(b.path("libatshared")).unwrap();
    let (_, strsz) = dyn_entry(&real, DT_STRSZ);
    let (at, _) = dyn_entry(&real, DT_SONAME);
    let input = edited(&dir, "libatshared.so", &real, |d| set64(d, at + 8, strsz + 0x40));
    let msg = expect_patch_refused(
        &input,
        &dir.join("out.so"),
        &[
            &format!("offset {at:#x}"),
            "DT_SONAME",
            &format!("string offset {:#x} is outside the dynamic string table (DT_STRSZ {strsz:#x})", strsz + 0x40),
            &format!("must be below {strsz:#x}"),
        ],
    );
    assert!(!msg.contains("Invalid ELF"), "{msg}");

    // The same for a program's DT_NEEDED, one byte past the end.
    let real = std::fs::read(b.path("basic")).unwrap();
    let (_, strsz) = dyn_entry(&real, DT_STRSZ);
    let (at, _) = dyn_entry(&real, DT_NEEDED);
    let input = edited(&dir, "basic", &real, |d| set64(d, at + 8, strsz));
    expect_patch_refused(&input, &dir.join("out"), &[&format!("offset {at:#x}"), "DT_NEEDED", "outside"]);
}

#[test]
fn out_of_range_symbol_version_index_is_refused() {
    // A .gnu.version entry above every index the version tables define:
    // the loader reads past its version array.
    let dir = scratch("versym-range");
    let b = built(Config::default_o2());
    let real = std::fs::read(b.path("basic")).unwrap();
    let (_, versym) = dyn_entry(&real, DT_VERSYM);
    let at = offset_of(&real, versym) + 2; // symbol 1
    let input = edited(&dir, "basic", &real, |d| d[at..at + 2].copy_from_slice(&0x7ff0u16.to_le_bytes()));
    expect_patch_refused(
        &input,
        &dir.join("out"),
        &[
            &format!("offset {at:#x}"),
            ".gnu.version entry of dynamic symbol 1: version index 32752 is out of range",
            "the version tables define indices up to",
        ],
    );
    // The hidden bit does not count: 0x8001 is index 1.
    let hidden = edited(&dir, "hidden", &real, |d| d[at..at + 2].copy_from_slice(&0x8001u16.to_le_bytes()));
    let out = dir.join("hidden.out");
    patch_to(&hidden, &out, &[]);
}

fn elflint(file: &Path) -> (bool, BTreeSet<String>) {
    let o = Command::new("eu-elflint").arg("--gnu-ld").arg(file).output().expect("eu-elflint (elfutils) is installed");
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    let ok = o.status.success() && text.trim() == "No errors";
    // Symbol indices of .dynsym shift by one: compare without numbers.
    let norm = |l: &str| l.replace(&file.display().to_string(), "").chars().filter(|c| !c.is_ascii_digit()).collect();
    (ok, text.lines().filter(|l| !l.contains("No errors")).map(norm).collect())
}

/// Every STT_SECTION symbol of .symtab that names an allocated section has
/// that section's address; _DYNAMIC has .dynamic's address and (if the
/// linker gave it one) size. Returns how many section symbols it checked.
fn assert_symbols_follow_sections(file: &Path) -> usize {
    use object::read::elf::{FileHeader, SectionHeader, Sym};
    let d = std::fs::read(file).unwrap();
    let e = object::LittleEndian;
    let h = object::elf::FileHeader64::<object::LittleEndian>::parse(&*d).unwrap();
    let sections = h.sections(e, &*d).unwrap();
    let symtab = sections.symbols(e, &*d, object::elf::SHT_SYMTAB).unwrap();
    let dynamic = sections.iter().find(|s| s.sh_type(e) == object::elf::SHT_DYNAMIC).unwrap();
    let mut n = 0;
    for sym in symtab.iter() {
        let name = sym.name(e, symtab.strings()).unwrap_or(b"");
        if sym.st_type() == object::elf::STT_SECTION {
            let sec = sections.section(object::SectionIndex(sym.st_shndx(e).0.into())).unwrap();
            if sec.sh_addr(e) != 0 {
                assert_eq!(sym.st_value(e), sec.sh_addr(e), "{}: section symbol of section {}", file.display(), {
                    String::from_utf8_lossy(sections.section_name(e, sec).unwrap())
                });
                n += 1;
            }
        } else if name == b"_DYNAMIC" {
            assert_eq!(sym.st_value(e), dynamic.sh_addr(e), "{}: _DYNAMIC's address", file.display());
            if sym.st_size(e) != 0 {
                assert_eq!(sym.st_size(e), dynamic.sh_size(e), "{}: _DYNAMIC's size", file.display());
            }
        }
    }
    n
}

fn gcc(args: &[&str]) {
    let o = Command::new("gcc").args(args).output().unwrap();
    assert!(o.status.success(), "gcc {args:?}: {}", String::from_utf8_lossy(&o.stderr));
}

/// A library whose own exported function, called through its PLT, is
/// larger than what follows its GOT slot: the slot's relocation "reaches"
/// (offset + symbol size) past the end of the data segment, where the new
/// read-only segment used to start.
const REACH_LIB: &str = r#"
#include <stdlib.h>
#define R10(x) x x x x x x x x x x
int big(int x) { volatile int v = x; R10(R10(R10(v = v * 3 + 1;))) return v; }
int use(int x) { void *p = malloc(16); int r = big(x) + (p != 0); free(p); return r; }
"#;

#[test]
fn elflint_accepts_after_patching_what_it_accepted_before() {
    let dir = scratch("elflint-before-after");
    let mut inputs: Vec<(PathBuf, bool)> = Vec::new(); // (file, must pass elflint before)
    for config in [Config::default_o2(), Config { opt: "-O0", pie: false, extra: "-fcf-protection=full" }] {
        let b = built(config);
        for p in programs() {
            inputs.push((b.path(&p.name), true));
        }
    }
    let src = dir.join("reach.c");
    std::fs::write(&src, REACH_LIB).unwrap();
    let reach = dir.join("libreach.so");
    gcc(&["-O0", "-fPIC", "-shared", src.to_str().unwrap(), "-o", reach.to_str().unwrap()]);
    inputs.push((reach.clone(), true));
    // Section symbols kept by --emit-relocs name the moved tables.
    let basic = testbins_dir().join("basic.c");
    let emit = dir.join("basic-emit-relocs");
    gcc(&["-O2", "-Wl,--emit-relocs", basic.to_str().unwrap(), "-o", emit.to_str().unwrap()]);
    inputs.push((emit.clone(), true));
    // System libraries, where installed and accepted.
    for lib in ["libz.so.1", "libbz2.so.1.0", "libsqlite3.so.0", "libexpat.so.1", "libstdc++.so.6", "libcrypto.so.3"] {
        let p = Path::new("/usr/lib/x86_64-linux-gnu").join(lib);
        if p.exists() {
            inputs.push((std::fs::canonicalize(p).unwrap(), false));
        }
    }
    let mut checked = 0;
    let mut section_symbols = 0;
    for (i, (input, must)) in inputs.iter().enumerate() {
        let (ok, _) = elflint(input);
        assert!(ok || !must, "{}: eu-elflint rejects the input", input.display());
        if !ok {
            continue;
        }
        let out = dir.join(format!("{i}")).join(input.file_name().unwrap());
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        patch_to(input, &out, &[]);
        let (ok_after, complaints) = elflint(&out);
        assert!(ok_after, "{}: eu-elflint rejects the patched file: {complaints:?}", input.display());
        section_symbols += assert_symbols_follow_sections(&out);
        checked += 1;
    }
    let must = inputs.iter().filter(|i| i.1).count();
    assert!(checked > must, "{checked} checked: at least one system library besides {must} test programs");
    assert!(section_symbols > 20, "{section_symbols} section symbols checked");

    // gold: eu-elflint complains about gold's .rodata before and after;
    // nothing new, and _DYNAMIC's size follows the new .dynamic.
    let gold = dir.join("basic-gold");
    gcc(&["-O2", "-fuse-ld=gold", basic.to_str().unwrap(), "-o", gold.to_str().unwrap()]);
    let out = dir.join("gold/basic");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    patch_to(&gold, &out, &[]);
    let (_, before) = elflint(&gold);
    let (_, after) = elflint(&out);
    assert!(after.is_subset(&before), "new complaints: {:?}", after.difference(&before));
    assert_symbols_follow_sections(&out);
    assert_eq!(run_program(&out, &[], &[]), run_program(&gold, &[], &[]));
}

#[test]
fn sparse_input_keeps_holes_in_output() {
    // A program with 64 MiB of zeros in .data, copied sparsely: the
    // patched copy must not fill the holes in.
    let dir = scratch("sparse");
    let src = dir.join("big.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\n#include <stdio.h>\n\
         __attribute__((section(\".data\"))) char big[64 << 20];\n\
         int main(void) { char *p = malloc(8); big[12345] = 1; printf(\"%d\\n\", big[12345] + (p != 0)); free(p); return 0; }\n",
    )
    .unwrap();
    let dense = dir.join("big.dense");
    gcc(&["-O2", src.to_str().unwrap(), "-o", dense.to_str().unwrap()]);
    let input = dir.join("big");
    assert!(Command::new("cp").arg("--sparse=always").arg(&dense).arg(&input).status().unwrap().success());
    let meta = std::fs::metadata(&input).unwrap();
    assert!(meta.len() > 64 << 20);
    assert!(meta.blocks() * 512 < 8 << 20, "the input is sparse: {} blocks", meta.blocks());

    let data = std::fs::read(&input).unwrap();
    let analysis = alloctramp_patcher::analyze(&data, "big", None, &[]).unwrap();
    let opts = alloctramp_patcher::write::PatchOptions::default();
    let patched = alloctramp_patcher::write::patch(&data, &analysis, &opts).unwrap();
    let out = dir.join("big.patched");
    // The library call carries no libraries' unwind rows (default options).
    patch_to(&input, &out, &["--no-library-unwind"]);
    let written = std::fs::read(&out).unwrap();
    assert!(written == patched.to_vec(), "`alloctramp patch` wrote the same bytes as the dense writer");
    let meta = std::fs::metadata(&out).unwrap();
    assert_eq!(meta.len(), written.len() as u64);
    assert!(meta.blocks() * 512 < 16 << 20, "holes kept: {} bytes on disk of {}", meta.blocks() * 512, meta.len());

    assert_eq!(run_program(&input, &[], &[]).0, "2\n");
    assert_eq!(run_program(&out, &[], &[]), run_program(&input, &[], &[]));
}

#[test]
fn vague_messages_say_what_is_wrong_and_what_would_be_right() {
    let dir = scratch("messages");
    let b = built(Config::default_o2());
    let real = std::fs::read(b.path("basic")).unwrap();
    let sites = |p: &Path| {
        let o = run_alloctramp(["sites".as_ref(), p.as_os_str()]);
        assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
        let s = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(s.lines().count(), 1, "{s}");
        assert!(!s.contains("Invalid ELF") && !s.contains("Unsupported ELF header"), "library text: {s}");
        s
    };

    // Was "segment alignment 0x1001".
    let (ph, _) = phdrs(&real).into_iter().find(|&(_, t)| t == 1).unwrap();
    let input = edited(&dir, "align", &real, |d| set64(d, ph + 48, 0x1001));
    expect_patch_refused(
        &input,
        &dir.join("out"),
        &[&format!("offset {:#x}", ph + 48), "PT_LOAD alignment 0x1001 is not a power of two"],
    );

    // Was "ELF header: Unsupported ELF header".
    let input = edited(&dir, "version", &real, |d| d[6] = 0);
    let msg = sites(&input);
    assert!(msg.contains("offset 0x6: ELF identification version 0 (EI_VERSION); it must be 1"), "{msg}");

    // Was "offset 0x...: section headers: Invalid ELF e_shstrndx".
    let input = edited(&dir, "shstrndx", &real, |d| d[62..64].copy_from_slice(&900u16.to_le_bytes()));
    let msg = sites(&input);
    assert!(msg.contains("offset 0x3e: e_shstrndx 900 is not a section index (e_shnum is "), "{msg}");

    let data = alloctramp_patcher::Elf::parse(&real).unwrap();
    // A code section whose file offset is not where its segment maps its
    // address from: the sites were read from other bytes than the ones
    // that run (a `jmp free` became a `jmp malloc` site).
    let text = data.sections.iter().find(|s| s.name == ".text").unwrap();
    let at = le64(&real, 40) as usize + text.index * 64 + 24;
    let input = edited(&dir, "textoff", &real, |d| set64(d, at, text.offset.0 + 0x10));
    let msg = sites(&input);
    assert!(
        msg.contains(&format!(
            "offset {at:#x}: section [{}] .text: file offset {:#x} but its address {} is loaded from offset {}; they must agree",
            text.index,
            text.offset.0 + 0x10,
            text.addr,
            text.offset
        )),
        "{msg}"
    );

    // Was "offset 0x0: Invalid ELF section index": .symtab's sh_link.
    let symtab = data.sections.iter().find(|s| s.name == ".symtab").unwrap().index;
    let sh = le64(&real, 40) as usize + symtab * 64;
    let input = edited(&dir, "link", &real, |d| d[sh + 40..sh + 44].copy_from_slice(&9999u32.to_le_bytes()));
    let msg = sites(&input);
    assert!(
        msg.contains(&format!(
            "offset {:#x}: section [{symtab}] .symtab: sh_link 9999 is not a section index",
            sh + 40
        )),
        "{msg}"
    );
}

const DT_STRTAB: i64 = 5;
const DT_FINI: i64 = 13;
const DT_INIT: i64 = 12;
const DT_PLTRELSZ: i64 = 2;

#[test]
fn dynamic_entries_read_as_the_loader_reads_them() {
    let dir = scratch("dynamic-as-loader");
    let b = built(Config { opt: "-O2", pie: false, extra: "" });
    let real = std::fs::read(b.path("basic")).unwrap();
    let expected = run_program(&b.path("basic"), &[], &[]);
    assert_eq!(expected.2, 0);
    let check = |name: &str, edit: &dyn Fn(&mut Vec<u8>)| {
        let input = edited(&dir, name, &real, |d| edit(d));
        assert_eq!(run_program(&input, &[], &[]), expected, "{name}: the edited input starts");
        let out = dir.join("out").join(name);
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        patch_to(&input, &out, &[]);
        assert_eq!(run_program(&out, &[], &[]), expected, "{name}: the patched copy behaves the same");
    };
    // A second DT_STRTAB before the real one, pointing at code: the loader
    // keeps the last; the patcher used to copy strings from the first.
    let (fini, _) = dyn_entry(&real, DT_FINI);
    let (strtab, _) = dyn_entry(&real, DT_STRTAB);
    assert!(fini < strtab, "DT_FINI comes before DT_STRTAB in gcc's output");
    check("duplicate-strtab", &|d: &mut Vec<u8>| {
        set64(d, fini, DT_STRTAB as u64);
        set64(d, fini + 8, 0x401000);
    });
    // DT_PLTRELSZ 0: lazy binding still reads .rela.plt by the index each
    // PLT stub pushes; the patcher used to copy nothing (and took the empty
    // table at the end of .rela.dyn for part of it).
    let (pltrelsz, _) = dyn_entry(&real, DT_PLTRELSZ);
    check("pltrelsz-0", &|d: &mut Vec<u8>| set64(d, pltrelsz + 8, 0));
}

/// A damaged SysV `.hash` header (bucket count 0x46444000) used to size the
/// rebuilt table: 4.7 GB of output and 9 GB of memory from a 20 KB input
/// (found by the analyze_patch fuzz target). The count must fit the file.
#[test]
fn a_hash_bucket_count_larger_than_the_file_is_refused() {
    const DT_HASH: i64 = 4;
    let dir = scratch("hash-buckets");
    let src = testbins_dir().join("basic.c");
    let bin = dir.join("basic");
    gcc(&["-O2", "-Wl,--hash-style=both", src.to_str().unwrap(), "-o", bin.to_str().unwrap()]);
    let real = std::fs::read(&bin).unwrap();
    let (_, hash_addr) = dyn_entry(&real, DT_HASH);
    let at = offset_of(&real, hash_addr);
    let input = edited(&dir, "basic.damaged", &real, |d| d[at..at + 4].copy_from_slice(&0x4644_4000u32.to_le_bytes()));
    let out = dir.join("out");
    let o = alloctramp().arg("patch").arg(&input).arg("-o").arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(".hash with its buckets") && err.contains("extends past the end of the file"), "{err}");
    assert!(!out.exists());
    // The undamaged program still patches.
    patch_to(&bin, &out, &[]);
}

/// Section header 0 is reserved: a damaged one claiming to be an allocated
/// section used to be checked and carried into the output, which then
/// failed its own check ("section [0]: file offset ... they must agree";
/// found by the analyze_patch fuzz target). It is ignored, as tools do.
#[test]
fn a_damaged_section_header_zero_is_ignored() {
    let dir = scratch("section-zero");
    let b = built(Config::default_o2());
    let real = std::fs::read(b.path("basic")).unwrap();
    let shoff = le64(&real, 0x28) as usize;
    let input = edited(&dir, "basic", &real, |d| {
        d[shoff + 4..shoff + 8].copy_from_slice(&1u32.to_le_bytes()); // SHT_PROGBITS
        set64(d, shoff + 8, 2); // SHF_ALLOC
        set64(d, shoff + 16, 0x1318); // sh_addr
        set64(d, shoff + 24, 0x1318); // sh_offset
        set64(d, shoff + 32, 16); // sh_size
    });
    let out = dir.join("out");
    patch_to(&input, &out, &[]);
    sites_json(&out, &[]);
    assert_eq!(run_program(&out, &[], &[]), run_program(&input, &[], &[]));
}

/// An allocated section whose address no segment loads: the new segments
/// used to be placed over it, and the patched file then failed the check
/// it had passed ("file offset ... but its address ... is loaded from
/// ..."; found by the analyze_patch fuzz target). They go above it.
#[test]
fn an_allocated_section_outside_every_segment_stays_outside_the_new_ones() {
    let dir = scratch("section-outside");
    let b = built(Config::default_o2());
    let real = std::fs::read(b.path("basic")).unwrap();
    let (shoff, shnum, shstrndx) = (le64(&real, 0x28) as usize, le16(&real, 0x3c) as usize, le16(&real, 0x3e) as usize);
    let names = le64(&real, shoff + shstrndx * 64 + 24) as usize;
    let note = (0..shnum)
        .find(|&i| {
            let n = names + le32(&real, shoff + i * 64) as usize;
            real[n..].starts_with(b".note.gnu.build-id\0")
        })
        .expect("a build-id note");
    let end = phdrs(&real)
        .iter()
        .filter(|(_, t)| *t == 1)
        .map(|(at, _)| le64(&real, at + 16) + le64(&real, at + 40))
        .max()
        .unwrap();
    let input = edited(&dir, "basic", &real, |d| set64(d, shoff + note * 64 + 16, end + 0x1803));
    let out = dir.join("out");
    patch_to(&input, &out, &[]);
    sites_json(&out, &[]);
    assert_eq!(run_program(&out, &[], &[]), run_program(&input, &[], &[]));
}
