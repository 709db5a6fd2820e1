//! Plans of the ELF files checked in under testbins/golden/ (no compiler
//! needed): where the new parts go, what each site becomes, and the plan's
//! dump compared with patcher/tests/golden/. Regression tests are named
//! after what broke.

use alloctramp_patcher::elf::Elf;
use alloctramp_patcher::error::Location;
use alloctramp_patcher::plan::{self, Decision, PatchOptions, Plan, Region, SkipReason};
use alloctramp_patcher::write::patch;
use alloctramp_patcher::{Analysis, ErrorKind, analyze};
use alloctramp_trampolines::addr::FileOffset;
use alloctramp_trampolines::codegen::{CodegenError, site_jump};
use alloctramp_trampolines::layout::{self, PAGE};
use std::path::Path;

/// The checked-in ELF files (see testbins/golden/build).
const FIXTURES: [&str; 3] = ["every_c", "libatshared.so", "cxx_new_delete"];

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testbins/golden").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn analysis(data: &[u8], name: &str) -> Analysis {
    analyze(data, name, None, &[]).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn plan_of<'a>(data: &'a [u8], a: &Analysis, opts: &PatchOptions) -> alloctramp_patcher::Result<Plan<'a>> {
    plan::plan(&Elf::parse(data).unwrap(), a, opts)
}

fn opts() -> PatchOptions {
    PatchOptions {
        runtime_path: "liballoctramp_rt.so".into(),
        foreign_unwind: Vec::new(),
        skip_allocator_layers: false,
        static_runtime: None,
        threads: 0,
    }
}

/// Every fixture's plan, with its input's bytes.
fn each_plan(mut check: impl FnMut(&str, &[u8], &Analysis, &Plan)) {
    for name in FIXTURES {
        let data = fixture(name);
        let a = analysis(&data, name);
        let p = plan_of(&data, &a, &opts()).unwrap_or_else(|e| panic!("{name}: {e}"));
        check(name, &data, &a, &p);
    }
}

/// (address, memory size, alignment) of the input's PT_LOADs.
fn input_loads(data: &[u8]) -> Vec<(u64, u64, u64)> {
    let u64_at = |at: usize| u64::from_le_bytes(data[at..at + 8].try_into().unwrap());
    let (phoff, phnum) = (u64_at(32) as usize, u16::from_le_bytes([data[56], data[57]]) as usize);
    (0..phnum)
        .map(|i| phoff + i * 56)
        .filter(|&at| data[at..at + 4] == [1, 0, 0, 0])
        .map(|at| (u64_at(at + 16), u64_at(at + 40), u64_at(at + 48)))
        .collect()
}

fn within(inner: Region, outer_off: u64, outer_addr: u64, outer_size: u64) -> bool {
    inner.offset.0 >= outer_off
        && inner.offset.0 + inner.size <= outer_off + outer_size
        && inner.addr.0.wrapping_sub(inner.offset.0) == outer_addr.wrapping_sub(outer_off)
}

#[test]
fn new_segments_are_page_aligned_and_above_every_input_segment() {
    each_plan(|name, data, _, p| {
        let loads = input_loads(data);
        let top = loads.iter().map(|&(a, m, _)| a + m).max().unwrap();
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for s in &p.segments {
            assert_eq!(s.offset.0 % PAGE, 0, "{name}: {s:?}");
            assert_eq!(s.addr.0 % PAGE, 0, "{name}: {s:?}");
            assert_eq!(
                s.addr.0.wrapping_sub(s.offset.0) % s.align,
                0,
                "{name}: offset and address agree modulo p_align: {s:?}"
            );
            assert!(s.addr.0 >= top, "{name}: {s:?} is above every input segment (they end at {top:#x})");
            assert!(s.file_size <= s.mem_size);
            assert!(s.offset.0 + s.file_size <= p.shift, "{name}: {s:?} is before the input in the file");
            spans.push((s.addr.0, s.addr.0 + s.mem_size));
        }
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{name}: new segments overlap in memory: {w:?}");
        }
        // The input keeps every segment's offset modulo its alignment.
        let max_align = loads.iter().map(|&(_, _, a)| a).max().unwrap().max(PAGE);
        assert_eq!(p.shift % max_align, 0, "{name}: the input moves by a multiple of the largest p_align");
        assert_eq!(p.ro().align, max_align, "{name}");
        // In the file: read-only, executable, read-write.
        let (ro, rw, x) = (p.ro(), p.rw(), p.exec());
        assert!(ro.offset.0 + ro.file_size <= x.offset.0 && x.offset.0 + x.file_size <= rw.offset.0, "{name}");
        // The counters' nominal offset is before the input too.
        assert!(p.counters.region.offset.0 < p.shift, "{name}");
    });
}

#[test]
fn every_part_lies_in_its_segment() {
    each_plan(|name, _, _, p| {
        let seg = |s: &plan::Segment, r: Region| within(r, s.offset.0, s.addr.0, s.file_size);
        let c = &p.copies;
        let ro_parts = [Some(p.ehdr), Some(p.phdrs), Some(p.site_table), Some(c.dynsym), Some(c.dynstr)]
            .into_iter()
            .chain([c.versym, c.gnu_hash, c.hash, Some(c.rela), c.jmprel]);
        for r in ro_parts.flatten() {
            assert!(seg(p.ro(), r), "{name}: {r:?} in {:?}", p.ro());
        }
        assert!(seg(p.exec(), p.text), "{name}");
        for r in [p.dynamic, p.control] {
            assert!(seg(p.rw(), r), "{name}: {r:?} in {:?}", p.rw());
        }
        // The counters: the read-write segment's memory past its file bytes.
        let k = p.counters.region;
        let rw = p.rw();
        assert!(k.addr.0 >= rw.addr.0 + rw.file_size && k.end_addr().0 == rw.addr.0 + rw.mem_size, "{name}");
        assert_eq!(k.addr.0 % PAGE, 0, "{name}: the runtime maps shared memory over the counters");
        assert_eq!(k.size, p.counters.stride * u64::from(p.counters.shards));
        // After the input: the section names, then the section headers.
        assert_eq!(p.shstrtab.range.offset.0, p.shift + p.input_size, "{name}");
        assert!(p.shdrs.offset.0 >= p.shstrtab.range.offset.0 + p.shstrtab.range.size, "{name}");
        assert_eq!(p.shdrs.offset.0 % 8, 0);
    });
}

#[test]
fn site_table_follows_the_program_headers() {
    each_plan(|name, data, a, p| {
        assert_eq!(p.site_table.offset.0, (p.phdrs.end_offset().0).next_multiple_of(8), "{name}");
        // Where the runtime looks for it: after the program headers in the
        // patched file's first segment.
        let out = patch(data, a, &opts()).unwrap().to_vec();
        assert_eq!(layout::table_after_phdrs(&out), Some(p.site_table.offset.0 as usize), "{name}");
        let table = &out[p.site_table.offset.0 as usize..p.site_table.end_offset().0 as usize];
        let t = layout::Table::parse(table).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.header.table_addr, p.site_table.addr.0);
        assert_eq!(t.header.ehdr_addr, p.ehdr.addr.0);
        assert_eq!(t.header.text_addr, p.text.addr.0);
        assert_eq!(t.header.counters_addr, p.counters.region.addr.0);
    });
}

#[test]
fn every_patched_site_reaches_each_entry_of_its_trampoline() {
    each_plan(|name, _, a, p| {
        assert_eq!(p.sites.len(), a.scan.sites.len());
        assert!(p.skipped().next().is_none(), "{name}: every site of a fixture is patched");
        let mut next = p.fini.addr.0 + p.fini.bytes.len() as u64;
        for (s, site) in p.sites.iter().zip(&a.scan.sites) {
            assert_eq!((s.addr, s.len, s.form), (site.vaddr, site.len, site.form));
            let t = s.trampoline().unwrap();
            let at = t.code.addr.0;
            assert_eq!(at % 16, 0, "{name}: trampolines are 16-byte aligned");
            assert!(at >= next, "{name}: trampolines follow one another");
            next = at + t.code.bytes.len() as u64;
            assert!(within(
                Region { offset: t.code.offset, addr: t.code.addr, size: t.code.bytes.len() as u64 },
                p.text.offset.0,
                p.text.addr.0,
                p.text.size
            ));
            for entry in [0, t.drain, t.count] {
                assert!(
                    site_jump(s.addr.0, at + u64::from(entry)).is_some(),
                    "{name}: site {} to {at:#x}+{entry:#x}",
                    s.addr
                );
            }
        }
        assert!(next <= p.text.end_addr().0);
    });
}

#[test]
fn repointed_sections_are_the_dynamic_tables() {
    each_plan(|name, data, _, p| {
        let elf = Elf::parse(data).unwrap();
        let mut names: Vec<&str> = p.repoints.iter().map(|r| elf.sections[r.section].name).collect();
        names.sort();
        for r in &p.repoints {
            assert_eq!(elf.sections[r.section].name, r.table.name(), "{name}: section [{}]", r.section);
            assert_eq!(elf.sections[r.section].addr, r.old_addr);
        }
        assert!(
            names.contains(&".dynsym") && names.contains(&".dynstr") && names.contains(&".dynamic"),
            "{name}: {names:?}"
        );
    });
}

#[test]
fn trampolines_made_on_several_threads_give_the_same_file() {
    for name in FIXTURES {
        let data = fixture(name);
        let a = analysis(&data, name);
        let in_turn = PatchOptions { threads: 1, ..opts() };
        let one = plan_of(&data, &a, &in_turn).unwrap();
        assert_eq!(one.threads, 1, "{name}");
        for threads in [2, 3, 7] {
            let o = PatchOptions { threads, ..opts() };
            let p = plan_of(&data, &a, &o).unwrap();
            // Every site's trampoline had its shape's length: no fallback.
            let n = a.scan.sites.len();
            assert_eq!(p.threads, n.div_ceil(n.div_ceil(threads)), "{name}: {threads} threads");
            assert!(p.threads > 1, "{name}: {threads} threads");
            assert_eq!(p.to_string(), one.to_string(), "{name}: {threads} threads");
            let bytes = |o: &PatchOptions| patch(&data, &a, o).unwrap().to_vec();
            assert!(bytes(&o) == bytes(&in_turn), "{name}: {threads} threads: the files differ");
        }
    }
}

#[test]
fn plans_are_deterministic_and_follow_the_options() {
    let data = fixture("every_c");
    let a = analysis(&data, "every_c");
    let one = plan_of(&data, &a, &opts()).unwrap().to_string();
    assert_eq!(one, plan_of(&data, &a, &opts()).unwrap().to_string());
    let p = plan_of(&data, &a, &opts()).unwrap();
    assert_eq!(p.counters.shards, layout::shard::COUNT);
    assert_eq!(p.counters.region.size, u64::from(layout::shard::COUNT) * p.counters.stride);
    // The imported symbols' names are appended to .dynstr (the program
    // needs the C library already); the runtime's path is the init stub's.
    let names: u64 = layout::IMPORTS.iter().map(|i| i.name.len() as u64 + 1).sum();
    let base = plan_of(&data, &a, &opts()).unwrap();
    assert!(base.tables.needs_libc());
    assert_eq!(base.copies.dynstr.size, base.tables.dynstr.size() + names);
    let long = PatchOptions { runtime_path: "/opt/alloctramp/lib/liballoctramp_rt.so".into(), ..opts() };
    let p = plan_of(&data, &a, &long).unwrap();
    assert_eq!(p.copies.dynstr.size, base.copies.dynstr.size);
    assert_eq!(p.init.bytes.len(), base.init.bytes.len() + long.runtime_path.len() - opts().runtime_path.len());
}

#[test]
fn a_patched_file_analyzes_and_is_refused_again() {
    each_plan(|name, data, a, _| {
        let out = patch(data, a, &opts()).unwrap().to_vec();
        let again = analyze(&out, name, None, &[]).unwrap_or_else(|e| panic!("{name} patched: {e}"));
        let e = patch(&out, &again, &opts()).expect_err("refused");
        assert_eq!(e.kind, ErrorKind::AlreadyPatched);
    });
}

// ---- Skip reasons ----

fn skip_reasons(data: &[u8], a: &Analysis) -> Vec<SkipReason> {
    let p = plan_of(data, a, &opts()).unwrap();
    let patched = patch(data, a, &opts()).unwrap();
    assert_eq!(patched.skipped.len(), p.skipped().count());
    let out = patched.to_vec();
    let table = layout::Table::parse(&out[p.site_table.offset.0 as usize..]).unwrap();
    for (i, r) in p.skipped() {
        assert_eq!(table.site(i).trampoline, 0, "site {i} ({r}) has no trampoline in the table");
    }
    p.skipped().map(|(_, r)| r.clone()).collect()
}

#[test]
fn a_site_shorter_than_a_jump_is_skipped() {
    let data = fixture("every_c");
    let mut a = analysis(&data, "every_c");
    a.scan.sites[0].len = 2;
    let reasons = skip_reasons(&data, &a);
    assert!(matches!(reasons[..], [SkipReason::TooShort { len: 2 }]), "{reasons:?}");
    assert_eq!(reasons[0].to_string(), "site instruction of 2 bytes is too short for a jump");
}

#[test]
fn sites_out_of_rel32_range_of_the_new_segments_are_skipped() {
    // The read-only PT_LOAD moved to 0x30000002000 (as in a fuzzed input):
    // the new segments go above it, out of reach of every site.
    let mut data = fixture("every_c");
    let (phoff, at) = (u64::from_le_bytes(data[32..40].try_into().unwrap()) as usize, 4);
    let ph = phoff + at * 56;
    assert_eq!(u64::from_le_bytes(data[ph + 16..ph + 24].try_into().unwrap()), 0x2000, "the fixture's .rodata segment");
    data[ph + 16..ph + 24].copy_from_slice(&0x300_0000_2000u64.to_le_bytes());
    let a = analysis(&data, "every_c");
    let reasons = skip_reasons(&data, &a);
    assert_eq!(reasons.len(), a.scan.sites.len());
    assert!(reasons.iter().all(|r| matches!(r, SkipReason::OutOfRange)), "{reasons:?}");
    assert_eq!(reasons[0].to_string(), "trampoline out of rel32 range");
    let p = plan_of(&data, &a, &opts()).unwrap();
    assert_eq!(
        p.text.size,
        (p.trace.addr.0 - p.text.addr.0) + (p.trace.bytes.len() as u64).next_multiple_of(16),
        "only the stubs"
    );
}

#[test]
fn a_site_whose_trampoline_cannot_be_assembled_is_skipped() {
    let data = fixture("every_c");
    let mut a = analysis(&data, "every_c");
    let i = a.scan.sites.iter().position(|s| s.form.through_got()).unwrap_or(0);
    a.scan.sites[i].form = layout::SiteForm::CallRipMem;
    a.scan.sites[i].target = alloctramp_trampolines::addr::Vaddr(0x7000_0000_0000);
    let reasons = skip_reasons(&data, &a);
    assert!(matches!(reasons[..], [SkipReason::Codegen(CodegenError::Assembler(_))]), "{reasons:?}");
    assert!(reasons[0].to_string().starts_with("trampoline: "), "{}", reasons[0]);
}

#[test]
fn a_decision_per_site_in_the_dump() {
    let data = fixture("every_c");
    let mut a = analysis(&data, "every_c");
    a.scan.sites[1].len = 3;
    let p = plan_of(&data, &a, &opts()).unwrap();
    let dump = p.to_string();
    let lines: Vec<&str> = dump.lines().skip_while(|l| *l != "sites:").skip(1).collect();
    assert_eq!(lines.len(), a.scan.sites.len());
    assert!(lines[1].contains("skipped: site instruction of 3 bytes"), "{}", lines[1]);
    assert!(matches!(p.sites[1].decision, Decision::Skipped(_)));
    assert!(lines[0].contains(&format!("trampoline {:#x}", p.sites[0].trampoline().unwrap().code.addr.0)));
}

// ---- Regressions ----

/// A fuzzed input named an allocated section (.fini_array) as its section
/// name table (e_shstrndx): the writer moved that section's file offset to
/// the grown name table at the end of the file, and the output no longer
/// read as the input did ("section [21]: file offset 0x8e60 but its address
/// is loaded from offset 0x6dd8; they must agree"). Now refused, at
/// e_shstrndx.
#[test]
fn a_section_name_table_that_is_loaded_is_refused() {
    let data = fixture("every_c");
    let elf = Elf::parse(&data).unwrap();
    let shstrndx = |name: &str| elf.sections.iter().position(|s| s.name == name).unwrap() as u16;
    for (section, what) in [
        (".fini_array", "which a PT_LOAD maps (SHF_ALLOC, address 0x3dd8)"),
        (".symtab", "a symbol table (type 0x2)"),
        (".dynstr", "which a PT_LOAD maps"),
    ] {
        let mut d = data.clone();
        d[62..64].copy_from_slice(&shstrndx(section).to_le_bytes());
        let a = analysis(&d, "every_c");
        let e = patch(&d, &a, &opts()).err().unwrap_or_else(|| panic!("e_shstrndx at {section}: patched"));
        assert_eq!((e.kind, e.at), (ErrorKind::Malformed, Location::Offset(FileOffset(62))), "{e}");
        let msg = e.to_string();
        assert!(msg.starts_with("offset 0x3e: e_shstrndx "), "{msg}");
        assert!(msg.contains(what) && msg.ends_with("must be a non-allocated SHT_STRTAB"), "{msg}");
        assert!(!msg.contains('\n'));
    }
    // Another fuzzed input named an empty allocated section: once moved,
    // it held the names and no longer read where its address is loaded.
    let mut d = data.clone();
    let index = shstrndx(".fini_array");
    d[62..64].copy_from_slice(&index.to_le_bytes());
    let sh = u64::from_le_bytes(d[40..48].try_into().unwrap()) as usize + usize::from(index) * 64;
    d[sh + 32..sh + 40].copy_from_slice(&0u64.to_le_bytes());
    let a = analysis(&d, "every_c");
    let e = patch(&d, &a, &opts()).err().unwrap_or_else(|| panic!("an empty loaded name table is refused"));
    assert!(e.to_string().contains("which a PT_LOAD maps"), "{e}");
    // A third named a section whose address left no room for the names
    // the table grows by.
    let mut d = data.clone();
    let index = shstrndx(".comment");
    d[62..64].copy_from_slice(&index.to_le_bytes());
    let sh = u64::from_le_bytes(d[40..48].try_into().unwrap()) as usize + usize::from(index) * 64;
    let size = u64::from_le_bytes(d[sh + 32..sh + 40].try_into().unwrap());
    d[sh + 16..sh + 24].copy_from_slice(&(u64::MAX - size).to_le_bytes());
    let a = analysis(&d, "every_c");
    let e = patch(&d, &a, &opts()).err().unwrap_or_else(|| panic!("a name table at the top of the address space"));
    assert!(e.to_string().contains("leaves no room"), "{e}");
    // The fuzzed input also had its read-only PT_LOAD at 0x30000002000.
    let mut d = data.clone();
    d[62..64].copy_from_slice(&shstrndx(".fini_array").to_le_bytes());
    let ph = u64::from_le_bytes(d[32..40].try_into().unwrap()) as usize + 4 * 56;
    d[ph + 16..ph + 24].copy_from_slice(&0x300_0000_2000u64.to_le_bytes());
    let a = analysis(&d, "every_c");
    assert_eq!(patch(&d, &a, &opts()).err().map(|e| e.at), Some(Location::Offset(FileOffset(62))));
}

/// A section name table elsewhere than usual, neither loaded nor a symbol
/// table, still patches (as it did): .strtab (the symbol names, whose copy
/// keeps every name), a debug section, .comment, an allocated section no
/// segment maps.
#[test]
fn a_section_name_table_in_an_unloaded_section_patches() {
    let data = fixture("every_c");
    let elf = Elf::parse(&data).unwrap();
    for section in [".strtab", ".debug_str", ".comment"] {
        let mut d = data.clone();
        let index = elf.sections.iter().position(|s| s.name == section).unwrap() as u16;
        d[62..64].copy_from_slice(&index.to_le_bytes());
        let a = analysis(&d, "every_c");
        let out = patch(&d, &a, &opts()).unwrap_or_else(|e| panic!("e_shstrndx at [{index}] {section}: {e}")).to_vec();
        analyze(&out, "every_c", None, &[]).unwrap_or_else(|e| panic!("e_shstrndx at [{index}] {section}: {e}"));
    }
    // An allocated section that no PT_LOAD maps (.rodata, its segment
    // moved away) is not loaded either.
    let mut d = data.clone();
    let rodata = elf.sections.iter().position(|s| s.name == ".rodata").unwrap() as u16;
    d[62..64].copy_from_slice(&rodata.to_le_bytes());
    let ph = u64::from_le_bytes(d[32..40].try_into().unwrap()) as usize + 4 * 56;
    d[ph + 16..ph + 24].copy_from_slice(&0x300_0000_2000u64.to_le_bytes());
    let a = analysis(&d, "every_c");
    let out = patch(&d, &a, &opts()).unwrap().to_vec();
    analyze(&out, "every_c", None, &[]).unwrap();
}

/// The bytes of each patched site, by address and in the file (at the
/// analysis' offsets), overlap no other's.
fn assert_patched_sites_apart(p: &Plan, a: &Analysis) {
    assert_eq!(p.sites.len(), a.scan.sites.len());
    for in_file in [false, true] {
        let mut spans: Vec<(u64, u64)> = p
            .sites
            .iter()
            .zip(&a.scan.sites)
            .filter(|(s, _)| s.trampoline().is_some())
            .map(|(s, found)| {
                let at = if in_file { found.offset.0 } else { s.addr.0 };
                (at, at + u64::from(s.len))
            })
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "patched sites overlap (in the file: {in_file}): {w:x?}");
        }
    }
}

/// A fuzzed input's .init section was as long as .plt and .text after it:
/// the scan swept those bytes twice and gave each of main's calls as two
/// sites at one address, both patched ("sites of the table overlap", when
/// the patched file's image was read). An instruction is now one site.
#[test]
fn code_that_two_sections_cover_gives_each_site_once() {
    let data = fixture("every_c");
    let elf = Elf::parse(&data).unwrap();
    let init = elf.sections.iter().position(|s| s.name == ".init").unwrap();
    let text = elf.sections.iter().find(|s| s.name == ".text").unwrap();
    let header = u64::from_le_bytes(data[40..48].try_into().unwrap()) as usize + init * 64;
    let mut d = data.clone();
    let size = text.addr.0 + text.size - elf.sections[init].addr.0;
    d[header + 32..header + 40].copy_from_slice(&size.to_le_bytes());
    let a = analysis(&d, "every_c");
    let before = analysis(&data, "every_c");
    assert!(a.scan.code_bytes >= before.scan.code_bytes + text.size, "the grown .init is swept too");
    let addrs: Vec<u64> = a.scan.sites.iter().map(|s| s.vaddr.0).collect();
    assert!(addrs.windows(2).all(|w| w[0] < w[1]), "one site per address: {addrs:x?}");
    for s in &before.scan.sites {
        assert!(addrs.contains(&s.vaddr.0), "the site at {:#x} is still found", s.vaddr.0);
    }
    let p = plan_of(&d, &a, &opts()).unwrap();
    assert_patched_sites_apart(&p, &a);
    let out = patch(&d, &a, &opts()).unwrap().to_vec();
    alloctramp_patcher::image::switched_image(&out, layout::Image::Live).expect("the patched file's image");
}

/// Sites whose bytes overlap, by address or only in the file (calls
/// decoded across each other, or two addresses of the same bytes): the
/// first keeps its trampoline, the other is skipped and names it.
#[test]
fn a_site_overlapping_an_earlier_one_is_skipped() {
    let data = fixture("every_c");
    for in_file_only in [false, true] {
        let mut a = analysis(&data, "every_c");
        let first = a.scan.sites[0].clone();
        let mut other = a.scan.sites[1].clone();
        other.offset = FileOffset(first.offset.0 + 2);
        if !in_file_only {
            other.vaddr = alloctramp_trampolines::addr::Vaddr(first.vaddr.0 + 2);
            a.scan.sites.insert(1, other);
        } else {
            a.scan.sites[1] = other;
        }
        let p = plan_of(&data, &a, &opts()).unwrap();
        assert!(p.sites[0].trampoline().is_some());
        match &p.sites[1].decision {
            Decision::Skipped(r @ SkipReason::Overlaps(at)) => {
                assert_eq!(*at, first.vaddr);
                assert_eq!(r.to_string(), format!("its bytes overlap those of the site at {}", first.vaddr));
            }
            d => panic!("in the file only: {in_file_only}: {d:?}"),
        }
        assert_eq!(p.skipped().count(), 1, "only the later site");
        assert_patched_sites_apart(&p, &a);
    }
}

/// Each fixture's plan dump (patcher/tests/golden/NAME.plan).
fn golden_dumps() -> Vec<(String, String)> {
    FIXTURES
        .iter()
        .map(|name| {
            let data = fixture(name);
            let a = analysis(&data, name);
            (format!("{name}.plan"), plan_of(&data, &a, &opts()).unwrap().to_string())
        })
        .collect()
}

// ---- Golden files ----

fn goldens() -> alloctramp_testkit::Goldens {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    alloctramp_testkit::Goldens::new(
        here.join("tests/golden"),
        here.parent().unwrap_or(here),
        "ALLOCTRAMP_BLESS=1 cargo test -p alloctramp-patcher --test plan",
    )
}

/// Each fixture's plan dump is its golden file; a file there that no
/// fixture produces is an orphan.
#[test]
fn plan_dumps_match_the_golden_files() {
    let dumps = golden_dumps();
    goldens().check_all(dumps.iter().map(|(n, t)| (n.as_str(), t.clone())));
    goldens().no_orphans(dumps.iter().map(|(n, _)| n.as_str()));
}

/// A fuzzed input gave a PLT section without contents (SHT_NOBITS) a huge
/// size: the wrapper search and the site scan walked its "stubs" one by
/// one for as long as the size said. The stubs walked are those the file
/// holds.
#[test]
fn a_plt_section_without_contents_has_no_stubs() {
    let mut d = fixture("every_c");
    let elf = Elf::parse(&d).unwrap();
    let index = elf.sections.iter().position(|s| s.name == ".plt").unwrap();
    let sh = u64::from_le_bytes(d[40..48].try_into().unwrap()) as usize + index * 64;
    d[sh + 4..sh + 8].copy_from_slice(&8u32.to_le_bytes()); // SHT_NOBITS
    d[sh + 32..sh + 40].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let opts = alloctramp_patcher::wrappers::Options { search: true, charge: true, ..Default::default() };
    let started = std::time::Instant::now();
    let a = alloctramp_patcher::analyze_with(&d, "every_c", None, &[], &opts);
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "took {:?}", started.elapsed());
    if let Ok(a) = a {
        assert!(
            a.scan.sites.iter().all(|s| s.via != alloctramp_patcher::Via::Plt),
            "no site through a PLT without stubs"
        );
    }
}

/// Every trampoline has an unwind entry that the new search table finds,
/// the input's entries are all still listed (by the same address), and
/// inside each call of a trampoline's target the entry makes the
/// trampoline a frame of its own: CFA 8 above the site's stack pointer,
/// rsp = CFA - 8, the return address computed from the call's own.
#[test]
fn every_trampoline_has_an_unwind_entry_and_the_input_keeps_its_own() {
    use gimli::{
        BaseAddresses, CfaRule, EhFrame, EhFrameHdr, LittleEndian, Pointer, RegisterRule, UnwindContext, UnwindSection,
        X86_64,
    };
    use object::read::elf::ProgramHeader as _;
    each_plan(|name, data, a, plan| {
        let eh = plan.eh_frame.as_ref().unwrap_or_else(|| panic!("{name}: no unwind entries"));
        let out = patch(data, a, &opts()).unwrap().to_vec();
        let elf = Elf::parse(&out).unwrap();
        let e = object::LittleEndian;
        let ph = elf.file.elf_program_headers().iter().find(|p| p.p_type(e) == object::elf::PT_GNU_EH_FRAME).unwrap();
        assert_eq!((ph.p_vaddr(e), ph.p_filesz(e)), (eh.hdr.addr.0, eh.hdr.size), "{name}: PT_GNU_EH_FRAME");
        let at = |addr: u64, len: usize| {
            let off = elf.offset_of(alloctramp_trampolines::addr::Vaddr(addr)).unwrap().0 as usize;
            &out[off..off + len]
        };
        let bases = BaseAddresses::default().set_eh_frame_hdr(eh.hdr.addr.0);
        let hdr = EhFrameHdr::new(at(eh.hdr.addr.0, eh.hdr.size as usize), LittleEndian).parse(&bases, 8).unwrap();
        let Pointer::Direct(old_eh) = hdr.eh_frame_ptr() else { panic!("{name}: eh_frame_ptr") };
        // Every FDE the table names lies in the input's .eh_frame or in the
        // new entries: read them all from one slice spanning the lowest to
        // the end of the new ones.
        let end = eh.entries.addr.0 + eh.entries.size;
        let whole: Vec<u8> = (old_eh..end)
            .map(|a| elf.offset_of(alloctramp_trampolines::addr::Vaddr(a)).map_or(0, |o| out[o.0 as usize]))
            .collect();
        let frame = EhFrame::new(&whole, LittleEndian);
        let bases = bases.set_eh_frame(old_eh);
        let table = hdr.table().unwrap();
        let mut listed = Vec::new();
        let mut it = table.iter(&bases);
        while let Some((Pointer::Direct(pc), _)) = it.next().unwrap() {
            listed.push(pc);
        }
        assert!(listed.is_sorted(), "{name}: the search table is sorted");
        let input = Elf::parse(data).unwrap();
        let ph = input.file.elf_program_headers().iter().find(|p| p.p_type(e) == object::elf::PT_GNU_EH_FRAME).unwrap();
        let old_bases = BaseAddresses::default().set_eh_frame_hdr(ph.p_vaddr(e));
        let old_hdr = EhFrameHdr::new(input.bytes_at(ph.p_vaddr(e), ph.p_filesz(e) as usize).unwrap(), LittleEndian)
            .parse(&old_bases, 8)
            .unwrap();
        let old_table = old_hdr.table().unwrap();
        let mut it = old_table.iter(&old_bases);
        while let Some((Pointer::Direct(pc), _)) = it.next().unwrap() {
            assert!(listed.binary_search(&pc).is_ok(), "{name}: the input's entry at {pc:#x} is listed");
        }
        let mut ctx = Box::new(UnwindContext::new());
        let mut calls = 0;
        for s in &plan.sites {
            let Some(t) = s.trampoline() else { continue };
            let entries = [0, t.drain, t.count, t.callers, t.traced].map(u32::from);
            let target = a.scan.sites.iter().find(|x| x.vaddr == s.addr).unwrap().target.0;
            let f =
                alloctramp_trampolines::frames::frames(&t.code.bytes.made().unwrap(), t.code.addr.0, &entries, target)
                    .unwrap();
            for c in f.calls.iter().filter(|c| c.target && !s.form.is_tail()) {
                let ret = t.code.addr.0 + u64::from(c.offset + c.len);
                let row = table
                    .unwind_info_for_address(&frame, &bases, &mut ctx, ret - 1, |s, b, o| s.cie_from_offset(b, o))
                    .unwrap_or_else(|e| panic!("{name}: no entry for {ret:#x}: {e}"));
                let d = i64::from(f.rows.iter().rev().find(|r| r.offset <= c.offset).unwrap().below);
                assert_eq!(
                    *row.cfa(),
                    CfaRule::RegisterAndOffset { register: X86_64::RSP, offset: d + 8 },
                    "{name} {ret:#x}"
                );
                assert_eq!(row.register(X86_64::RSP), Some(RegisterRule::ValOffset(-8)), "{name} {ret:#x}");
                assert!(matches!(row.register(X86_64::RA), Some(RegisterRule::ValExpression(_))), "{name} {ret:#x}");
                calls += 1;
            }
        }
        assert!(calls > 0, "{name}: calls of targets checked");
    });
}

/// A search table entry naming an FDE before `.eh_frame` (a damaged
/// `.eh_frame_hdr`): the file is patched without unwind entries for its
/// trampolines, never with a panic (gimli computes offsets from
/// `.eh_frame` unchecked).
#[test]
fn a_search_table_entry_outside_eh_frame_gives_no_unwind_entries() {
    use object::read::elf::ProgramHeader as _;
    let mut d = fixture("every_c");
    let elf = Elf::parse(&d).unwrap();
    let e = object::LittleEndian;
    let ph = elf.file.elf_program_headers().iter().find(|p| p.p_type(e) == object::elf::PT_GNU_EH_FRAME).unwrap();
    let at = ph.p_offset(e) as usize;
    // The first entry's FDE field: 12 bytes of header, then (pc, fde) pairs.
    d[at + 16..at + 20].copy_from_slice(&(-0x800i32).to_le_bytes());
    let a = analysis(&d, "every_c");
    let p = plan_of(&d, &a, &opts()).unwrap();
    assert!(p.eh_frame.is_none(), "no unwind entries from a damaged table");
    assert!(patch(&d, &a, &opts()).is_ok());
}

#[test]
fn the_switched_images_are_the_file_with_a_jump_to_each_trampoline_s_entry() {
    use layout::Image;
    for name in FIXTURES {
        let data = fixture(name);
        let a = analysis(&data, name);
        let patched = patch(&data, &a, &opts()).unwrap();
        let file = patched.to_vec();
        let elf = Elf::parse(&file).unwrap();
        let table = layout::Table::parse(&file[layout::table_after_phdrs(&file).unwrap()..]).unwrap();
        assert_eq!(patched.images().collect::<Vec<_>>(), Image::ALL, "{name}: every image");
        let mut counted = 0;
        for image in Image::ALL {
            let writes = alloctramp_patcher::image::switched_writes(&file, image).unwrap();
            assert_eq!(writes.len(), patched.sites, "{name}: one jump per patched site");
            // Each jump lands on its site's entry for the image (the
            // trampoline's start, or its counting entry), at the site's
            // offset.
            let mut want = std::collections::BTreeMap::new();
            for s in table.sites().filter(|s| s.trampoline != 0) {
                let at = elf.offset_of(alloctramp_trampolines::addr::Vaddr(s.addr)).unwrap();
                let entry = if image == Image::Live { s.trampoline } else { s.trampoline + u64::from(s.count) };
                counted += usize::from(image == Image::Count && s.count != 0);
                want.insert(at.0, (s.addr, entry));
            }
            for (at, jump) in &writes {
                let (addr, entry) = want[&at.0];
                assert_eq!(jump[0], 0xe9, "{name}: {at}");
                let rel = i32::from_le_bytes(jump[1..].try_into().unwrap());
                assert_eq!(addr.wrapping_add(5).wrapping_add(rel as i64 as u64), entry, "{name}: {at}");
            }
            // The image differs from the file in those bytes only, read
            // from the file or written with it.
            let theirs = patched.switched.iter().find(|(i, _)| *i == image).map(|(_, j)| j.clone());
            assert_eq!(theirs, Some(writes.iter().map(|(at, j)| (at.0, *j)).collect::<Vec<_>>()), "{name}");
            let bytes = alloctramp_patcher::image::switched_image(&file, image).unwrap();
            assert!(patched.image_to_vec(image) == bytes, "{name}");
            assert_eq!(bytes.len(), file.len(), "{name}");
            let mut expected = file.clone();
            for (at, jump) in &writes {
                expected[at.0 as usize..at.0 as usize + 5].copy_from_slice(jump);
            }
            assert!(bytes == expected, "{name}: the image differs from the file elsewhere");
            assert!(
                writes.iter().all(|(at, j)| &file[at.0 as usize..at.0 as usize + 5] != j),
                "{name}: a site unchanged"
            );
        }
        assert!(counted > 0, "{name}: the counting image's jumps are not the live image's");
        // An unpatched file has no image.
        let e = alloctramp_patcher::image::switched_writes(&data, Image::Count).unwrap_err();
        assert!(e.to_string().contains("not a file patched by alloctramp"), "{name}: {e}");
    }
}
