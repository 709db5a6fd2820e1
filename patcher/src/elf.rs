//! Reading an x86-64 ELF file: header checks that name the offset of what is
//! wrong, then the few views the scanner needs (sections, symbols, dynamic
//! relocations, the dynamic table), built on `object`'s ELF reader.

use crate::error::{Error, ErrorKind, Location, Result};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use object::LittleEndian as LE;
use object::elf;
use object::read::elf::{Dyn as _, ElfFile64, FileHeader, ProgramHeader as _, Rela as _, SectionHeader as _, Sym as _};
use object::{Object, ObjectSection};

type Header = elf::FileHeader64<LE>;
pub type SectionHeader = elf::SectionHeader64<LE>;

/// What sort of ELF file this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FileType {
    /// ET_EXEC: a position-dependent executable.
    Exec,
    /// ET_DYN with PT_INTERP: a position-independent executable.
    Pie,
    /// ET_DYN without PT_INTERP: a shared library.
    Shared,
}

/// A section as the scanner sees it.
#[derive(Clone, Debug)]
pub struct Section<'a> {
    pub index: usize,
    pub name: &'a str,
    pub addr: Vaddr,
    pub offset: FileOffset,
    pub size: u64,
    pub flags: u64,
    pub sh_type: u32,
    pub link: u32,
    pub info: u32,
    /// File contents (empty for SHT_NOBITS).
    pub data: &'a [u8],
}

impl Section<'_> {
    pub fn is_exec(&self) -> bool {
        self.flags & elf::SHF_EXECINSTR.0 != 0
    }
    pub fn is_alloc(&self) -> bool {
        self.flags & elf::SHF_ALLOC.0 != 0
    }
    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.addr.0 && addr - self.addr.0 < self.size
    }
}

/// A symbol from .symtab or .dynsym.
#[derive(Clone, Debug)]
pub struct Symbol<'a> {
    pub name: &'a str,
    pub value: u64,
    pub size: u64,
    pub defined: bool,
    pub is_func: bool,
    pub global: bool,
}

/// A dynamic relocation naming a symbol (or carrying an addend).
#[derive(Clone, Copy, Debug)]
pub struct DynReloc<'a> {
    pub offset: Vaddr,
    pub r_type: u32,
    pub symbol: Option<&'a str>,
    pub addend: i64,
}

/// A parsed, checked ELF file.
pub struct Elf<'a> {
    pub data: &'a [u8],
    pub file: ElfFile64<'a, LE>,
    pub file_type: FileType,
    pub sections: Vec<Section<'a>>,
    symtab: std::sync::OnceLock<Vec<Symbol<'a>>>,
    dynsym: std::sync::OnceLock<Vec<Symbol<'a>>>,
}

fn read_u16(d: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([d[at], d[at + 1]])
}

/// Checks the parts of the header that decide whether this is a file we
/// handle, with a message that names what is wrong.
fn check_ident(data: &[u8]) -> Result<()> {
    if data.len() < 4 || &data[..4] != b"\x7fELF" {
        return Err(Error::new(ErrorKind::NotElf, Location::None, "not an ELF file (bad magic)"));
    }
    if data.len() < 64 {
        return Err(Error::malformed_at(0, format!("truncated ELF header: {} bytes, 64 needed", data.len())));
    }
    match data[4] {
        2 => {}
        1 => return Err(Error::unsupported("32-bit ELF file: only x86-64 (ELFCLASS64) is supported")),
        c => return Err(Error::malformed_at(4, format!("ELF class {c} (EI_CLASS); it must be 2 (ELFCLASS64)"))),
    }
    if data[5] != 1 {
        return Err(Error::unsupported("big-endian ELF file: only x86-64 is supported"));
    }
    if data[6] != 1 {
        return Err(Error::malformed_at(
            6,
            format!("ELF identification version {} (EI_VERSION); it must be 1 (EV_CURRENT)", data[6]),
        ));
    }
    let machine = read_u16(data, 18);
    if machine != elf::EM_X86_64.0 {
        return Err(Error::unsupported(format!("ELF machine {machine} is not x86-64 (62)")));
    }
    match read_u16(data, 16) {
        2 | 3 => Ok(()),
        1 => Err(Error::unsupported("relocatable object file (ET_REL): link it first")),
        4 => Err(Error::unsupported("core dump (ET_CORE)")),
        t => Err(Error::unsupported(format!("ELF type {t}: only executables and shared libraries"))),
    }
}

/// Checks what `object` needs of the section headers' links before it
/// reads symbol and relocation tables, so that a bad link is reported at
/// its section header with what is wrong, not as the library's bare text.
fn check_links(sections: &[Section], count: usize, shoff: u64, shstrndx: u64) -> Result<()> {
    let at = |i: usize, field: u64| shoff + i as u64 * 64 + field;
    for s in sections {
        let (i, name) = (s.index, s.name);
        let sh = |f| at(i, f);
        let is_sym = s.sh_type == elf::SHT_SYMTAB.0 || s.sh_type == elf::SHT_DYNSYM.0;
        let is_rel = s.sh_type == elf::SHT_RELA.0 || s.sh_type == elf::SHT_REL.0;
        if !is_sym && !is_rel {
            continue;
        }
        if is_sym && s.size % 24 != 0 {
            return Err(Error::malformed_at(
                sh(32),
                format!(
                    "section [{i}] {name}: symbol table size {:#x} is not a multiple of 24 (one Elf64_Sym)",
                    s.size
                ),
            ));
        }
        if is_sym && s.offset.0 % 8 != 0 {
            return Err(Error::malformed_at(
                sh(24),
                format!("section [{i}] {name}: symbol table offset {} is not 8-byte aligned", s.offset),
            ));
        }
        let link = s.link as usize;
        if link >= count {
            return Err(Error::malformed_at(
                sh(40),
                format!("section [{i}] {name}: sh_link {link} is not a section index (the file has {count} sections)"),
            ));
        }
        if is_sym && link != 0 && sections[link].sh_type != elf::SHT_STRTAB.0 {
            return Err(Error::malformed_at(
                sh(40),
                format!(
                    "section [{i}] {name}: sh_link {link} names a section of type {:#x}; it must be a string table (SHT_STRTAB)",
                    sections[link].sh_type
                ),
            ));
        }
        if is_rel && s.info as usize >= count && s.flags & elf::SHF_INFO_LINK.0 != 0 {
            return Err(Error::malformed_at(
                sh(44),
                format!(
                    "section [{i}] {name}: sh_info {} is not a section index (the file has {count} sections)",
                    s.info
                ),
            ));
        }
    }
    if count > 0 && shstrndx as usize >= count && shstrndx != u64::from(elf::SHN_XINDEX.0) {
        return Err(Error::malformed_at(
            62,
            format!("e_shstrndx {shstrndx} is not a section index (the file has {count} sections)"),
        ));
    }
    Ok(())
}

fn range_end(offset: u64, size: u64) -> Option<u64> {
    offset.checked_add(size)
}

impl<'a> Elf<'a> {
    pub fn parse(data: &'a [u8]) -> Result<Elf<'a>> {
        check_ident(data)?;
        let len = data.len() as u64;
        let header =
            Header::parse(data).map_err(|e| Error::malformed_at(0, format!("ELF header cannot be read: {e}")))?;
        let e = LE;

        // Program headers.
        let phoff = header.e_phoff.get(e);
        let phnum = u64::from(header.e_phnum.get(e));
        if phnum > 0 {
            let phentsize = u64::from(header.e_phentsize.get(e));
            if phentsize != 56 {
                return Err(Error::malformed_at(54, format!("program header entry size {phentsize}, expected 56")));
            }
            if range_end(phoff, phnum * 56).is_none_or(|end| end > len) {
                return Err(Error::malformed_at(
                    phoff,
                    format!("{phnum} program headers at offset {phoff:#x} extend past the end of the file ({len:#x})"),
                ));
            }
        }
        let phdrs = header
            .program_headers(e, data)
            .map_err(|err| Error::malformed_at(phoff, format!("program headers: {err}")))?;
        for (i, ph) in phdrs.iter().enumerate() {
            let (off, filesz) = (ph.p_offset(e), ph.p_filesz(e));
            if range_end(off, filesz).is_none_or(|end| end > len) {
                return Err(Error::malformed_at(
                    phoff + i as u64 * 56,
                    format!(
                        "program header {i}: segment at offset {off:#x} size {filesz:#x} extends past the end of the file ({len:#x})"
                    ),
                ));
            }
            if ph.p_type(e) == elf::PT_LOAD && ph.p_memsz(e) < filesz {
                return Err(Error::malformed_at(
                    phoff + i as u64 * 56,
                    format!(
                        "program header {i}: PT_LOAD memory size {:#x} is smaller than its file size {filesz:#x}; it must be at least that",
                        ph.p_memsz(e)
                    ),
                ));
            }
        }

        // Section headers.
        let shoff = header.e_shoff.get(e);
        let shnum_raw = u64::from(header.e_shnum.get(e));
        if shoff != 0 {
            let shentsize = u64::from(header.e_shentsize.get(e));
            if shentsize != 64 {
                return Err(Error::malformed_at(58, format!("section header entry size {shentsize}, expected 64")));
            }
            if range_end(shoff, shnum_raw.max(1) * 64).is_none_or(|end| end > len) {
                return Err(Error::malformed_at(
                    shoff,
                    format!("section headers at offset {shoff:#x} extend past the end of the file ({len:#x})"),
                ));
            }
        }
        // The section name table's index, checked before `object` reads
        // the names (its error would not say which field is wrong).
        let shstrndx = u64::from(header.e_shstrndx.get(e).0);
        let shnum = if shoff != 0 && shnum_raw == 0 {
            // More than 0xff00 sections: the count is section 0's sh_size.
            data.get(shoff as usize + 32..shoff as usize + 40).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()))
        } else {
            shnum_raw
        };
        if shoff != 0 && shstrndx != u64::from(elf::SHN_XINDEX.0) && shstrndx >= shnum.max(1) {
            return Err(Error::malformed_at(
                62,
                format!("e_shstrndx {shstrndx} is not a section index (e_shnum is {shnum}); it must be below {shnum}"),
            ));
        }
        let table = header.sections(e, data).map_err(|err| {
            Error::malformed_at(
                shoff,
                format!("the section header table cannot be read ({err}); check e_shoff, e_shnum and e_shstrndx"),
            )
        })?;
        let mut sections = Vec::with_capacity(table.len());
        for (index, sh) in table.iter().enumerate() {
            let name = table.section_name(e, sh).ok().and_then(|n| std::str::from_utf8(n).ok()).unwrap_or("");
            // Section 0 is reserved (SHN_UNDEF): whatever its fields say, it
            // describes no section (tools and the writer ignore it).
            let sh_type = if index == 0 { elf::SHT_NULL.0 } else { sh.sh_type(e).0 };
            let (offset, size) = (sh.sh_offset(e), sh.sh_size(e));
            let at = shoff + index as u64 * 64;
            let file_data: &[u8] = if sh_type == elf::SHT_NOBITS.0 || sh_type == elf::SHT_NULL.0 {
                &[]
            } else {
                let end = range_end(offset, size).filter(|&end| end <= len).ok_or_else(|| {
                    Error::malformed_at(
                        at,
                        format!(
                            "section [{index}] {name}: offset {offset:#x} size {size:#x} extends past the end of the file ({len:#x})"
                        ),
                    )
                })?;
                &data[offset as usize..end as usize]
            };
            let addr = sh.sh_addr(e);
            if addr.checked_add(size).is_none() {
                return Err(Error::malformed_at(at, format!("section [{index}] {name}: address range overflows")));
            }
            sections.push(Section {
                index,
                name,
                addr: Vaddr(addr),
                offset: FileOffset(offset),
                size,
                flags: if index == 0 { 0 } else { sh.sh_flags(e).0 },
                sh_type,
                link: sh.sh_link(e),
                info: sh.sh_info(e),
                data: file_data,
            });
        }

        check_links(&sections, table.len(), shoff, u64::from(header.e_shstrndx.get(e).0))?;
        // What is scanned is what is loaded: an allocated section's file
        // offset must be where the loadable segment holding its address
        // maps it from (the code is read through the section headers).
        for s in sections.iter().filter(|s| s.is_alloc() && !s.data.is_empty()) {
            let load = phdrs.iter().find(|p| {
                p.p_type(e) == elf::PT_LOAD && s.addr.0 >= p.p_vaddr(e) && s.addr.0 - p.p_vaddr(e) < p.p_filesz(e)
            });
            if let Some(p) = load {
                let mapped = p.p_offset(e) + (s.addr.0 - p.p_vaddr(e));
                if mapped != s.offset.0 {
                    return Err(Error::malformed_at(
                        shoff + s.index as u64 * 64 + 24,
                        format!(
                            "section [{}] {}: file offset {} but its address {} is loaded from offset {mapped:#x}; they must agree",
                            s.index, s.name, s.offset, s.addr
                        ),
                    ));
                }
            }
        }
        let file = ElfFile64::<LE>::parse(data)
            .map_err(|err| Error::malformed_at(shoff, format!("section header table: {err}")))?;
        let file_type = match header.e_type.get(e).0 {
            2 => FileType::Exec,
            _ if phdrs.iter().any(|p| p.p_type(e) == elf::PT_INTERP) => FileType::Pie,
            _ => FileType::Shared,
        };
        Ok(Elf { data, file, file_type, sections, symtab: Default::default(), dynsym: Default::default() })
    }

    /// Whether the file is a program built by rustc with the standard
    /// library's start-up: an executable whose `.comment` names rustc, or
    /// that defines `rust_eh_personality` or Rust's `lang_start`.
    pub fn is_rust_program(&self) -> bool {
        if self.file_type == FileType::Shared {
            return false;
        }
        let comment = self.section_by_name(".comment").is_some_and(|c| c.data.windows(6).any(|w| w == b"rustc "));
        comment
            || [false, true].iter().any(|&dynamic| {
                self.symbols(dynamic).iter().any(|s| {
                    s.defined && (s.name == "rust_eh_personality" || s.name.starts_with("_ZN3std2rt10lang_start"))
                })
            })
    }

    pub fn section_by_name(&self, name: &str) -> Option<&Section<'a>> {
        self.sections.iter().find(|s| s.name == name)
    }

    /// The section (with file contents) that holds a virtual address.
    pub fn section_at(&self, addr: u64) -> Option<&Section<'a>> {
        self.sections.iter().find(|s| s.is_alloc() && !s.data.is_empty() && s.contains(addr))
    }

    /// The file offset of a virtual address, from the loadable segments.
    pub fn offset_of(&self, addr: Vaddr) -> Option<FileOffset> {
        let e = LE;
        self.file.elf_program_headers().iter().find_map(|ph| {
            let (va, filesz) = (ph.p_vaddr(e), ph.p_filesz(e));
            (ph.p_type(e) == elf::PT_LOAD && addr.0 >= va && addr.0 - va < filesz)
                .then(|| FileOffset(ph.p_offset(e) + (addr.0 - va)))
        })
    }

    /// The virtual address a file offset is loaded at, from the loadable
    /// segments (the inverse of [`offset_of`](Self::offset_of)).
    pub fn vaddr_of(&self, offset: FileOffset) -> Option<Vaddr> {
        let e = LE;
        self.file.elf_program_headers().iter().find_map(|ph| {
            let (off, filesz) = (ph.p_offset(e), ph.p_filesz(e));
            (ph.p_type(e) == elf::PT_LOAD && offset.0 >= off && offset.0 - off < filesz)
                .then(|| Vaddr(ph.p_vaddr(e) + (offset.0 - off)))
        })
    }

    /// Symbols of .symtab (`dynamic == false`) or .dynsym, read once.
    pub fn symbols(&self, dynamic: bool) -> &[Symbol<'a>] {
        let cell = if dynamic { &self.dynsym } else { &self.symtab };
        cell.get_or_init(|| self.read_symbols(dynamic))
    }

    fn read_symbols(&self, dynamic: bool) -> Vec<Symbol<'a>> {
        let e = LE;
        let table = if dynamic { self.file.elf_dynamic_symbol_table() } else { self.file.elf_symbol_table() };
        let strings = table.strings();
        table
            .symbols()
            .iter()
            .filter_map(|sym| {
                let name = sym.name(e, strings).ok().and_then(|n| std::str::from_utf8(n).ok())?;
                if name.is_empty() {
                    return None;
                }
                let st_type = sym.st_type();
                Some(Symbol {
                    name,
                    value: sym.st_value(e),
                    size: sym.st_size(e),
                    defined: !sym.is_undefined(e),
                    is_func: st_type == elf::STT_FUNC || st_type == elf::STT_GNU_IFUNC,
                    global: sym.st_bind() != elf::STB_LOCAL,
                })
            })
            .collect()
    }

    /// Dynamic relocations (every SHT_RELA section linked to .dynsym).
    pub fn dynamic_relocations(&self) -> Vec<DynReloc<'a>> {
        let e = LE;
        let dynsym = self.file.elf_dynamic_symbol_table();
        let strings = dynsym.strings();
        let table = self.file.elf_section_table();
        let mut out = Vec::new();
        for sh in table.iter() {
            if sh.sh_type(e) != elf::SHT_RELA {
                continue;
            }
            let link = sh.sh_link(e) as usize;
            if link == 0 || link != dynsym.section().0 {
                continue;
            }
            let Ok(Some((relas, _))) = sh.rela(e, self.data) else { continue };
            for r in relas {
                let sym_index = r.r_sym(e, false);
                let symbol = if sym_index == 0 {
                    None
                } else {
                    dynsym
                        .symbol(object::SymbolIndex(sym_index as usize))
                        .ok()
                        .and_then(|s| s.name(e, strings).ok())
                        .and_then(|n| std::str::from_utf8(n).ok())
                };
                out.push(DynReloc {
                    offset: Vaddr(r.r_offset(e)),
                    r_type: r.r_type(e, false).0,
                    symbol,
                    addend: r.r_addend(e),
                });
            }
        }
        out
    }

    /// DT_SONAME, if the file has one.
    pub fn soname(&self) -> Option<&'a str> {
        let table = self.file.elf_dynamic_table().ok()?;
        let e = LE;
        table.dynamics().iter().take_while(|d| d.d_tag(e) != elf::DT_NULL).find_map(|d| {
            if d.d_tag(e) == elf::DT_SONAME {
                let v = d.d_val(e);
                let s = table.strings().get(u32::try_from(v).ok()?).ok()?;
                std::str::from_utf8(s).ok()
            } else {
                None
            }
        })
    }

    pub fn build_id(&self) -> Option<&'a [u8]> {
        self.file.build_id().ok().flatten()
    }

    pub fn gnu_debuglink(&self) -> Option<(&'a [u8], u32)> {
        self.file.gnu_debuglink().ok().flatten()
    }

    /// True when the file carries DWARF line information of its own.
    pub fn has_dwarf_lines(&self) -> bool {
        self.file.section_by_name(".debug_line").is_some_and(|s| s.size() > 0)
    }

    /// Virtual address of the section data at a given address, `len` bytes.
    pub fn bytes_at(&self, addr: u64, len: usize) -> Option<&'a [u8]> {
        let s = self.section_at(addr)?;
        let start = (addr - s.addr.0) as usize;
        s.data.get(start..start.checked_add(len)?)
    }
}
