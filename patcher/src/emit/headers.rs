//! The ELF header and the program headers (at the start of the file), and
//! the grown section name table and the section headers (after the
//! original file).

use crate::bytes::align;
use crate::elf::Elf;
use crate::plan::{Plan, Region, Segment, Table};
use alloctramp_trampolines::layout::{self, PAGE};
use object::LittleEndian as LE;
use object::elf;
use object::pod::bytes_of;
use object::read::elf::ProgramHeader as _;

type Phdr = elf::ProgramHeader64<LE>;
type Shdr = elf::SectionHeader64<LE>;

/// The input's ELF header with the tables' new places and counts.
pub(super) fn elf_header(elf: &Elf, plan: &Plan) -> Vec<u8> {
    let mut h = elf.data[..64].to_vec();
    h[32..40].copy_from_slice(&plan.phdrs.offset.0.to_le_bytes());
    h[40..48].copy_from_slice(&plan.shdrs.offset.0.to_le_bytes());
    h[56..58].copy_from_slice(&(plan.phnum as u16).to_le_bytes());
    if let Some(s) = &plan.statics {
        h[24..32].copy_from_slice(&s.entry.addr.0.to_le_bytes());
    }
    h[60..62].copy_from_slice(&(plan.shnum as u16).to_le_bytes());
    h
}

fn phdr(p_type: elf::ProgramType, flags: u32, r: Region, align: u64) -> Phdr {
    let s = Segment { flags, offset: r.offset, addr: r.addr, file_size: r.size, mem_size: r.size, align };
    load(p_type, &s)
}

fn load(p_type: elf::ProgramType, s: &Segment) -> Phdr {
    let e = LE;
    Phdr {
        p_type: object::U32::new(e, p_type),
        p_flags: object::U32::new(e, elf::ProgramFlags(s.flags)),
        p_offset: object::U64::new(e, s.offset.0),
        p_vaddr: object::U64::new(e, s.addr.0),
        p_paddr: object::U64::new(e, s.addr.0),
        p_filesz: object::U64::new(e, s.file_size),
        p_memsz: object::U64::new(e, s.mem_size),
        p_align: object::U64::new(e, s.align),
    }
}

/// The input's program headers, their offsets shifted, PT_PHDR and
/// PT_DYNAMIC pointing at the new tables, and the new PT_LOADs after the
/// last PT_LOAD (PT_LOADs stay sorted by address).
pub(super) fn program_headers(elf: &Elf, plan: &Plan) -> Vec<u8> {
    let e = LE;
    let phdrs = elf.file.elf_program_headers();
    let last_load = phdrs.iter().rposition(|p| p.p_type(e) == elf::PT_LOAD);
    let mut out = Vec::with_capacity(plan.phnum * 56);
    for (i, p) in phdrs.iter().enumerate() {
        let mut p = *p;
        let t = p.p_type(e);
        if t == elf::PT_PHDR {
            p = phdr(elf::PT_PHDR, elf::PF_R.0, plan.phdrs, 8);
        } else if t == elf::PT_DYNAMIC && plan.statics.is_none() {
            p = phdr(elf::PT_DYNAMIC, elf::PF_R.0 | elf::PF_W.0, plan.dynamic, 8);
        } else if let (elf::PT_GNU_EH_FRAME, Some(eh)) = (t, &plan.eh_frame) {
            p = phdr(elf::PT_GNU_EH_FRAME, elf::PF_R.0, eh.hdr, 4);
        } else if let (elf::PT_TLS, Some(s)) = (t, &plan.statics) {
            p = tls(s);
        } else if p.p_filesz(e) > 0 || p.p_offset(e) > 0 {
            p.p_offset.set(e, p.p_offset(e) + plan.shift);
        }
        out.extend_from_slice(bytes_of(&p));
        if Some(i) == last_load {
            // In address order: a static program's runtime lies between
            // the read-write segment and the executable one.
            let [ro, rw, exec] = &plan.segments;
            let runtime = plan.statics.iter().flat_map(|s| &s.runtime.segments);
            for s in [ro, rw].into_iter().chain(runtime).chain([exec]) {
                out.extend_from_slice(bytes_of(&load(elf::PT_LOAD, s)));
            }
        }
    }
    if let Some(s) = plan.statics.as_ref().filter(|s| s.runtime.tls_phdr.is_none()) {
        out.extend_from_slice(bytes_of(&tls(s)));
    }
    // A static program without a search table gets one for the
    // trampolines' entries (its start files register the original
    // `.eh_frame`; the unwinder looks for the rest through the program
    // headers); a null entry where it has no trampoline entries.
    if plan.statics.is_some() && !phdrs.iter().any(|p| p.p_type(e) == elf::PT_GNU_EH_FRAME) {
        let p = match &plan.eh_frame {
            Some(eh) => phdr(elf::PT_GNU_EH_FRAME, elf::PF_R.0, eh.hdr, 4),
            None => phdr(elf::PT_NULL, 0, Region { size: 0, ..plan.ehdr }, 0),
        };
        out.extend_from_slice(bytes_of(&p));
    }
    out
}

/// A static program's PT_TLS: the runtime's block in front of the
/// program's (`statics::merge_tls`).
fn tls(s: &crate::plan::StaticPlan) -> Phdr {
    let t = &s.runtime.tls;
    let r = Region { size: t.filesz, ..s.tls_image };
    let mut p = phdr(elf::PT_TLS, elf::PF_R.0, r, t.align);
    p.p_memsz.set(LE, t.memsz);
    p
}

/// What follows the original file: the section name table, then the
/// section headers.
pub(super) fn tail(elf: &Elf, plan: &Plan) -> Vec<u8> {
    let mut tail = shstrtab(elf, plan);
    tail.resize((plan.shdrs.offset.0 - plan.shstrtab.range.offset.0) as usize, 0);
    for sh in section_headers(elf, plan) {
        tail.extend_from_slice(bytes_of(&sh));
    }
    tail
}

/// The input's section name table with the new sections' names appended.
fn shstrtab(elf: &Elf, plan: &Plan) -> Vec<u8> {
    let old = plan.shstrtab.section.and_then(|i| elf.sections.get(i)).map_or(&[][..], |s| s.data);
    let mut v = old.to_vec();
    for name in layout::NEW_SECTIONS {
        v.extend_from_slice(name.as_bytes());
        v.push(0);
    }
    if plan.shstrtab.static_names.is_some() {
        for name in crate::plan::STATIC_SECTION_NAMES {
            v.extend_from_slice(name.as_bytes());
            v.push(0);
        }
    }
    debug_assert_eq!(v.len() as u64, plan.shstrtab.range.size);
    v
}

/// The input's section headers, offsets shifted and the copied tables'
/// repointed, then the new sections'.
fn section_headers(elf: &Elf, plan: &Plan) -> Vec<Shdr> {
    let e = LE;
    let mut shdrs: Vec<Shdr> = elf.file.elf_section_table().iter().copied().collect();
    for sh in shdrs.iter_mut().skip(1) {
        sh.sh_offset.set(e, sh.sh_offset.get(e).wrapping_add(plan.shift));
    }
    for r in &plan.repoints {
        let sh = &mut shdrs[r.section];
        sh.sh_addr.set(e, r.to.addr.0);
        sh.sh_offset.set(e, r.to.offset.0);
        sh.sh_size.set(e, r.to.size);
        // The symbols the section's sh_info counts as local: the new
        // symbols are not.
        if r.table == Table::Dynsym && u64::from(sh.sh_info.get(e)) > plan.tables.insert_at {
            sh.sh_info.set(e, sh.sh_info.get(e) + crate::tables::IMPORTED);
        }
    }
    // A static program's thread-local sections are in the new image.
    if let Some((s, old)) = plan.statics.as_ref().and_then(|s| Some((s, s.runtime.old_tls?))) {
        for sh in shdrs.iter_mut().skip(1).filter(|sh| sh.sh_flags.get(e).0 & elf::SHF_TLS.0 != 0) {
            let Some(d) = sh.sh_addr.get(e).checked_sub(old.vaddr).filter(|&d| d <= old.memsz) else { continue };
            let d = d + s.runtime.tls_shift;
            sh.sh_addr.set(e, s.tls_image.addr.0 + d);
            sh.sh_offset.set(e, s.tls_image.offset.0 + d);
        }
    }
    if let Some(sh) = plan.shstrtab.section.and_then(|i| shdrs.get_mut(i)) {
        sh.sh_offset.set(e, plan.shstrtab.range.offset.0);
        sh.sh_size.set(e, plan.shstrtab.range.size);
    }
    let (a, x, w) = (elf::SHF_ALLOC.0, elf::SHF_EXECINSTR.0, elf::SHF_WRITE.0);
    let names = plan.shstrtab.names;
    shdrs.push(section(names[0], elf::SHT_PROGBITS, a, plan.site_table, 8));
    shdrs.push(section(names[1], elf::SHT_PROGBITS, a | w, plan.control, 64));
    shdrs.push(section(names[2], elf::SHT_NOBITS, a | w, plan.counters.region, PAGE));
    shdrs.push(section(names[3], elf::SHT_PROGBITS, a | x, plan.text, 16));
    if let Some(eh) = &plan.eh_frame {
        shdrs.push(section(names[4], elf::SHT_PROGBITS, a, eh.entries, 8));
    }
    for s in plan.statics.iter().flat_map(|s| &s.sections) {
        let name = plan.shstrtab.static_names.and_then(|n| n.get(s.name).copied()).unwrap_or(0);
        shdrs.push(section(name, elf::SectionType(s.sh_type), s.flags, s.region, s.align));
    }
    debug_assert_eq!(shdrs.len(), plan.shnum);
    debug_assert_eq!(align(plan.shstrtab.range.offset.0 + plan.shstrtab.range.size, 8), plan.shdrs.offset.0);
    shdrs
}

fn section(name: u32, t: elf::SectionType, flags: u64, r: Region, align: u64) -> Shdr {
    let e = LE;
    Shdr {
        sh_name: object::U32::new(e, name),
        sh_type: object::U32::new(e, t),
        sh_flags: object::U64::new(e, elf::SectionFlags(flags)),
        sh_addr: object::U64::new(e, r.addr.0),
        sh_offset: object::U64::new(e, r.offset.0),
        sh_size: object::U64::new(e, r.size),
        sh_link: object::U32::new(e, 0),
        sh_info: object::U32::new(e, 0),
        sh_addralign: object::U64::new(e, align),
        sh_entsize: object::U64::new(e, 0),
    }
}
