//! The input's dynamic-linking tables, read as the dynamic linker reads
//! them (not as their section headers describe them) and checked for
//! everything the patched file's copies could not reproduce. Nothing is
//! copied: a [`Tables`] borrows the input.

use crate::bytes::{u16_at, u32_at, u64_at};
use crate::elf::Elf;
use crate::error::{Error, ErrorKind, Location, Result};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use alloctramp_trampolines::layout;
use object::LittleEndian as LE;
use object::elf;
use object::pod::slice_from_all_bytes;
use object::read::elf::ProgramHeader as _;

pub(crate) type Phdr = elf::ProgramHeader64<LE>;
pub(crate) type Sym = elf::Sym64<LE>;
pub(crate) type Rela = elf::Rela64<LE>;

/// A table of the input where the loader finds it.
#[derive(Clone, Copy, Debug)]
pub struct Located<'a, T> {
    pub addr: Vaddr,
    pub items: &'a [T],
}

impl<T> Located<'_, T> {
    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        std::mem::size_of_val(self.items) as u64
    }
}

/// Where the PLT relocations (DT_JMPREL) are.
#[derive(Clone, Copy, Debug)]
pub enum Jmprel<'a> {
    /// Inside the DT_RELA range (some linkers): copied as part of it.
    InsideRela { addr: Vaddr },
    /// A table of their own, as far as DT_PLTRELSZ or the section header
    /// reaches, whichever is further (see [`Tables::read`]).
    Separate(Located<'a, Rela>),
}

impl Jmprel<'_> {
    pub fn addr(&self) -> Vaddr {
        match self {
            Jmprel::InsideRela { addr } => *addr,
            Jmprel::Separate(t) => t.addr,
        }
    }
}

/// The dynamic-linking tables of an input, checked.
#[derive(Clone, Debug)]
pub struct Tables<'a> {
    /// PT_DYNAMIC's address, and the file offset the loader reads it from.
    pub dynamic_addr: Vaddr,
    pub dynamic_offset: FileOffset,
    /// The dynamic entries before DT_NULL, in order: (tag, value).
    pub dynamic: Vec<(i64, u64)>,
    /// DT_STRTAB, DT_STRSZ bytes.
    pub dynstr: Located<'a, u8>,
    /// DT_SYMTAB, with as many symbols as the SHT_DYNSYM section header at
    /// that address says.
    pub dynsym: Located<'a, Sym>,
    /// Index the first imported symbol ([`layout::IMPORTS`]) gets in the
    /// new .dynsym: before the symbols the GNU hash table covers, else at
    /// the end.
    pub insert_at: u64,
    /// DT_VERSYM: one entry per symbol.
    pub versym: Option<Located<'a, u8>>,
    /// DT_GNU_HASH, as far as the loader can read it.
    pub gnu_hash: Option<Located<'a, u8>>,
    /// DT_HASH and its bucket count (at least 1).
    pub hash: Option<(Vaddr, u32)>,
    /// DT_RELA, DT_RELASZ bytes.
    pub rela: Option<Located<'a, Rela>>,
    pub jmprel: Option<Jmprel<'a>>,
    /// How far relocated data reaches: the largest relocation offset plus
    /// its symbol's size (0 without relocations).
    pub reach: u64,
}

impl<'a> Tables<'a> {
    /// Reads the tables the dynamic table at PT_DYNAMIC (`dyn_ph`) names.
    /// Refuses, with the offset and what would be right, whatever a copy
    /// with one more symbol and a few more strings could not reproduce.
    pub fn read(elf: &Elf<'a>, dyn_ph: &Phdr) -> Result<Tables<'a>> {
        let e = LE;
        let dynamic_addr = Vaddr(dyn_ph.p_vaddr(e));
        let (dyn_off, dynamic) = read_dynamic(elf, dyn_ph)?;
        for (tag, what) in [
            (elf::DT_REL.0, "REL relocations"),
            (elf::DT_SYMTAB_SHNDX.0, "DT_SYMTAB_SHNDX"),
            (elf::DT_TEXTREL.0, "text relocations"),
        ] {
            if dyn_val(&dynamic, tag).is_some() {
                let k = dynamic.iter().position(|&(t, _)| t == tag).unwrap_or(0) as u64;
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    Location::Offset(FileOffset(dyn_off + k * 16)),
                    format!("{what} are not supported (only RELA dynamic relocations, as x86-64 linkers emit)"),
                ));
            }
        }
        let need = |tag: i64, what: &str| {
            dyn_val(&dynamic, tag).ok_or_else(|| {
                Error::new(
                    ErrorKind::Malformed,
                    Location::Both(FileOffset(dyn_off), dynamic_addr),
                    format!("the dynamic table has no {what} entry; a dynamically linked file needs one"),
                )
            })
        };
        let strtab_addr = need(elf::DT_STRTAB.0, "DT_STRTAB")?;
        let strsz = need(elf::DT_STRSZ.0, "DT_STRSZ")?;
        let symtab_addr = need(elf::DT_SYMTAB.0, "DT_SYMTAB")?;
        let (dynsym, dynstr, gnu_hash, hash) = read_symbols(elf, &dynamic, symtab_addr, strtab_addr, strsz)?;
        check_strings(elf, &dynamic, dyn_off, dynamic_addr, &dynsym, dynstr.items)?;
        let mut version_high = 1u16;
        for (tag, need) in [(elf::DT_VERNEED.0, true), (elf::DT_VERDEF.0, false)] {
            if let Some(addr) = dyn_val(&dynamic, tag) {
                version_high = version_high.max(walk_versions(elf, addr, dynstr.items, need)?);
            }
        }
        let nsyms = dynsym.items.len() as u64;
        let insert_at = insertion_index(gnu_hash.as_ref(), nsyms)?;
        let versym =
            dyn_val(&dynamic, elf::DT_VERSYM.0).map(|addr| read_versym(elf, addr, nsyms, version_high)).transpose()?;
        if let Some(h) = &gnu_hash {
            check_gnu_hash_buckets(h)?;
        }
        let hash = match hash {
            Some((addr, nbucket)) => {
                // The rebuilt table keeps the bucket count, whose buckets the
                // original holds in the file: a count read from a damaged
                // header must not size a table larger than the input.
                let _: &[u8] = table_at(elf, addr.0, 8 + 4 * u64::from(nbucket), ".hash with its buckets")?;
                Some((addr, nbucket))
            }
            None => None,
        };
        let (rela, jmprel, reach) = read_relocations(elf, &dynamic, dynsym.items)?;
        Ok(Tables {
            dynamic_addr,
            dynamic_offset: FileOffset(dyn_off),
            dynamic,
            dynstr,
            dynsym,
            insert_at,
            versym,
            gnu_hash,
            hash,
            rela,
            jmprel,
            reach,
        })
    }

    /// A static program's: none.
    pub fn none() -> Tables<'a> {
        Tables {
            dynamic_addr: Vaddr(0),
            dynamic_offset: FileOffset(0),
            dynamic: Vec::new(),
            dynstr: Located { addr: Vaddr(0), items: &[] },
            dynsym: Located { addr: Vaddr(0), items: &[] },
            insert_at: 0,
            versym: None,
            gnu_hash: None,
            hash: None,
            rela: None,
            jmprel: None,
            reach: 0,
        }
    }

    /// A dynamic entry's value (the last entry of the tag, as the loader
    /// reads it).
    pub fn value(&self, tag: elf::DynamicTag) -> Option<u64> {
        dyn_val(&self.dynamic, tag.0)
    }

    /// Whether a DT_NEEDED entry names the C library
    /// ([`layout::LIBC_SONAME`]).
    pub fn needs_libc(&self) -> bool {
        self.needs(layout::LIBC_SONAME)
    }

    /// Whether a DT_NEEDED entry names `soname`.
    pub fn needs(&self, soname: &str) -> bool {
        self.dynamic.iter().any(|&(tag, val)| {
            tag == elf::DT_NEEDED.0
                && usize::try_from(val)
                    .ok()
                    .and_then(|v| self.dynstr.items.get(v..))
                    .is_some_and(|s| s.starts_with(soname.as_bytes()) && s.get(soname.len()) == Some(&0))
        })
    }

    /// Symbols in the input's .dynsym.
    pub fn symbol_count(&self) -> u64 {
        self.dynsym.items.len() as u64
    }

    /// A symbol index in the new .dynsym: past the imported symbols from
    /// where they are inserted on. An index past the table (in a
    /// relocation that ignores its symbol) stays.
    pub fn new_symbol_index(&self, i: u32) -> u32 {
        if u64::from(i) >= self.insert_at && u64::from(i) < self.symbol_count() { i + IMPORTED } else { i }
    }
}

/// Symbols a patched file adds to its .dynsym.
pub const IMPORTED: u32 = layout::IMPORTS.len() as u32;

type Symbols<'a> = (Located<'a, Sym>, Located<'a, u8>, Option<Located<'a, u8>>, Option<(Vaddr, u32)>);

/// .dynsym and .dynstr, and the hash tables' headers. The loader knows the
/// symbol count only from the hash tables. The GNU table is copied as far
/// as the loader can read it (every chain to its end, at least one entry
/// per hashed symbol); the SysV table is rebuilt, so where it is the only
/// one, its count must match the section's.
fn read_symbols<'a>(
    elf: &Elf<'a>,
    dynamic: &[(i64, u64)],
    symtab_addr: u64,
    strtab_addr: u64,
    strsz: u64,
) -> Result<Symbols<'a>> {
    let dynsym_sec = elf
        .sections
        .iter()
        .find(|s| s.sh_type == elf::SHT_DYNSYM.0 && s.addr.0 == symtab_addr)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Malformed,
                Location::Vaddr(Vaddr(symtab_addr)),
                "no SHT_DYNSYM section header at DT_SYMTAB's address: the section headers must describe the dynamic symbol table",
            )
        })?;
    let nsyms = dynsym_sec.size / 24;
    let gnu_hash_addr = dyn_val(dynamic, elf::DT_GNU_HASH.0);
    let gnu_hash = gnu_hash_addr.map(|addr| gnu_hash_table(elf, addr, nsyms)).transpose()?;
    let hash_addr = dyn_val(dynamic, elf::DT_HASH.0);
    let hash_head = hash_addr.map(|addr| table_at::<u8>(elf, addr, 8, ".hash")).transpose()?;
    let word = |h: &[u8], i: usize| u32::from_le_bytes(h[i * 4..i * 4 + 4].try_into().unwrap());
    if gnu_hash.is_none()
        && let Some(count) = hash_head.map(|h| u64::from(word(h, 1))).filter(|&c| c != nsyms)
    {
        return Err(Error::new(
            ErrorKind::Malformed,
            Location::Offset(FileOffset(dynsym_sec.offset.0)),
            format!(
                "the .dynsym section header gives {nsyms} symbols ({:#x} bytes) but .hash covers {count}; they must agree",
                dynsym_sec.size
            ),
        ));
    }
    let syms: &[Sym] = table_at(elf, symtab_addr, nsyms * 24, ".dynsym")?;
    let strtab: &[u8] = table_at(elf, strtab_addr, strsz, ".dynstr")?;
    Ok((
        Located { addr: Vaddr(symtab_addr), items: syms },
        Located { addr: Vaddr(strtab_addr), items: strtab },
        gnu_hash.zip(gnu_hash_addr).map(|(items, addr)| Located { addr: Vaddr(addr), items }),
        hash_head.zip(hash_addr).map(|(h, addr)| (Vaddr(addr), word(h, 0).max(1))),
    ))
}

/// Every string the loader reads must lie inside the string table: the
/// patched file's table is a copy with strings appended, and bytes past
/// the original table are not copied.
fn check_strings(
    elf: &Elf,
    dynamic: &[(i64, u64)],
    dyn_off: u64,
    dynamic_addr: Vaddr,
    dynsym: &Located<Sym>,
    strtab: &[u8],
) -> Result<()> {
    for (k, &(tag, val)) in dynamic.iter().enumerate() {
        if let Some((_, name)) = STRING_TAGS.iter().find(|(t, _)| *t == tag) {
            let at = dyn_off + k as u64 * 16;
            let loc = Location::Both(FileOffset(at), dynamic_addr.offset_by(k as u64 * 16));
            check_string(strtab, val, loc, name)?;
        }
    }
    let dynsym_off = elf.offset_of(dynsym.addr).map_or(0, |o| o.0);
    for (i, sym) in dynsym.items.iter().enumerate().skip(1) {
        let loc = Location::Offset(FileOffset(dynsym_off + i as u64 * 24));
        check_string(strtab, sym.st_name.get(LE).into(), loc, &format!("dynamic symbol {i}"))?;
    }
    Ok(())
}

/// Where the imported symbols go: before the hashed symbols of a GNU hash
/// table, else at the end.
fn insertion_index(gnu_hash: Option<&Located<u8>>, nsyms: u64) -> Result<u64> {
    let insert_at = match gnu_hash {
        Some(h) if h.items.len() >= 16 => u64::from(u32::from_le_bytes(h.items[4..8].try_into().unwrap())),
        Some(h) => {
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Vaddr(h.addr),
                format!(".gnu.hash is {} bytes, shorter than its 16-byte header", h.items.len()),
            ));
        }
        None => nsyms,
    };
    if insert_at > nsyms || insert_at == 0 {
        return Err(Error::new(
            ErrorKind::Malformed,
            Location::Vaddr(gnu_hash.map_or(Vaddr(0), |h| h.addr.offset_by(4))),
            format!(".gnu.hash symoffset {insert_at}: it must be between 1 and the {nsyms} dynamic symbols"),
        ));
    }
    Ok(insert_at)
}

/// .gnu.version: the loader indexes an array of `version_high + 1`
/// entries with its entries; a larger index reads past it.
fn read_versym<'a>(elf: &Elf<'a>, addr: u64, nsyms: u64, version_high: u16) -> Result<Located<'a, u8>> {
    let old: &[u8] = table_at(elf, addr, nsyms * 2, ".gnu.version")?;
    let versym_off = elf.offset_of(Vaddr(addr)).map_or(0, |o| o.0);
    for (i, v) in old.chunks_exact(2).enumerate() {
        let v = u16::from_le_bytes([v[0], v[1]]) & 0x7fff;
        if v > version_high {
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Offset(FileOffset(versym_off + i as u64 * 2)),
                format!(
                    ".gnu.version entry of dynamic symbol {i}: version index {v} is out of range; the version tables define indices up to {version_high}"
                ),
            ));
        }
    }
    Ok(Located { addr: Vaddr(addr), items: old })
}

/// The GNU hash table holds every bucket its header counts.
fn check_gnu_hash_buckets(h: &Located<u8>) -> Result<()> {
    let nbuckets = u32::from_le_bytes(h.items[0..4].try_into().unwrap()) as usize;
    let bloom = u32::from_le_bytes(h.items[8..12].try_into().unwrap()) as usize;
    let buckets_at = 16 + bloom * 8;
    if h.items.len() < buckets_at + nbuckets * 4 {
        return Err(Error::new(
            ErrorKind::Malformed,
            Location::Vaddr(h.addr),
            format!(
                ".gnu.hash is {} bytes; its header ({nbuckets} buckets, {bloom} bloom words) needs {}",
                h.items.len(),
                buckets_at + nbuckets * 4
            ),
        ));
    }
    Ok(())
}

type Relocations<'a> = (Option<Located<'a, Rela>>, Option<Jmprel<'a>>, u64);

/// DT_RELA and DT_JMPREL, and how far relocated data reaches.
fn read_relocations<'a>(elf: &Elf<'a>, dynamic: &[(i64, u64)], syms: &[Sym]) -> Result<Relocations<'a>> {
    let rela_addr = dyn_val(dynamic, elf::DT_RELA.0);
    let relasz = dyn_val(dynamic, elf::DT_RELASZ.0).unwrap_or(0);
    let jmprel_addr = dyn_val(dynamic, elf::DT_JMPREL.0);
    let pltrelsz = dyn_val(dynamic, elf::DT_PLTRELSZ.0).unwrap_or(0);
    // Lazy binding reads .rela.plt at the index a PLT stub pushes, not
    // within DT_PLTRELSZ: the copy covers the section header's extent too,
    // and every index a stub pushes must be inside it.
    let jmprel_size = jmprel_addr.map_or(0, |j| {
        let sec = elf.sections.iter().filter(|s| s.sh_type == elf::SHT_RELA.0 && s.addr.0 == j).map(|s| s.size);
        sec.max().unwrap_or(0).max(pltrelsz)
    });
    check_plt_indices(elf, jmprel_size / 24)?;
    // JMPREL inside the RELA range (some linkers): copied as part of RELA.
    let jmprel_inside = match (rela_addr, jmprel_addr) {
        (Some(r), Some(j)) => {
            let end = r.saturating_add(relasz);
            j >= r && j < end && j.saturating_add(jmprel_size) <= end
        }
        _ => false,
    };
    let mut reach = 0u64;
    let rela = rela_addr.map(|addr| relocations(elf, addr, relasz, ".rela.dyn", syms, &mut reach)).transpose()?;
    let jmprel = match jmprel_addr {
        Some(addr) if jmprel_inside => Some(Jmprel::InsideRela { addr: Vaddr(addr) }),
        Some(addr) => Some(Jmprel::Separate(relocations(elf, addr, jmprel_size, ".rela.plt", syms, &mut reach)?)),
        None => None,
    };
    Ok((rela, jmprel, reach))
}

/// A relocation table, every symbol index checked; `reach` grows to the
/// furthest byte a relocation writes (its offset plus its symbol's size:
/// elflint's test of whether a relocation writes to a read-only segment).
fn relocations<'a>(
    elf: &Elf<'a>,
    addr: u64,
    size: u64,
    what: &str,
    syms: &[Sym],
    reach: &mut u64,
) -> Result<Located<'a, Rela>> {
    let e = LE;
    let nsyms = syms.len() as u64;
    let table: &[Rela] = table_at(elf, addr, size, what)?;
    for (k, r) in table.iter().enumerate() {
        let info = r.r_info.get(e);
        let (sym, typ) = ((info >> 32) as u32, info as u32);
        let sym_size = syms.get(sym as usize).map_or(0, |s| s.st_size.get(e));
        let ignores_symbol = [elf::R_X86_64_NONE.0, elf::R_X86_64_RELATIVE.0, elf::R_X86_64_IRELATIVE.0].contains(&typ);
        if u64::from(sym) >= nsyms && !ignores_symbol {
            let at = elf.offset_of(Vaddr(addr)).map_or(0, |o| o.0) + k as u64 * 24;
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Offset(FileOffset(at)),
                format!("{what}: relocation of type {typ} names symbol {sym}, but .dynsym has {nsyms} symbols"),
            ));
        }
        *reach = (*reach).max(r.r_offset.get(e).saturating_add(sym_size));
    }
    Ok(Located { addr: Vaddr(addr), items: table })
}

/// Reads `size` bytes of records of `T` at virtual address `addr`.
fn table_at<'a, T: object::Pod>(elf: &Elf<'a>, addr: u64, size: u64, what: &str) -> Result<&'a [T]> {
    let off = elf.offset_of(Vaddr(addr)).ok_or_else(|| {
        Error::new(
            ErrorKind::Malformed,
            Location::Vaddr(Vaddr(addr)),
            format!("{what} at address {addr:#x} is not in the file contents of any PT_LOAD segment; the loader reads it there"),
        )
    })?;
    let bytes = elf
        .data
        .get(off.0 as usize..(off.0 as usize).saturating_add(size as usize))
        .ok_or_else(|| {
            Error::malformed_at(
                off.0,
                format!(
                    "{what} of {size:#x} bytes extends past the end of the file ({:#x} bytes); its size or address is wrong",
                    elf.data.len()
                ),
            )
        })?;
    slice_from_all_bytes::<T>(bytes).map_err(|_| {
        Error::malformed_at(
            off.0,
            format!(
                "{what}: size {size:#x} is not a whole number of {}-byte entries, or the table is not {}-byte aligned",
                std::mem::size_of::<T>(),
                std::mem::align_of::<T>()
            ),
        )
    })
}

/// A dynamic entry's value. The loader keeps the last entry of each tag
/// (DT_NEEDED aside, which it reads one by one), so this does too.
fn dyn_val(dynamic: &[(i64, u64)], tag: i64) -> Option<u64> {
    dynamic.iter().rev().find(|(t, _)| *t == tag).map(|&(_, v)| v)
}

/// Reads the dynamic table the way the dynamic linker does: at PT_DYNAMIC's
/// address, through the loadable segment that holds it, up to the DT_NULL
/// entry (PT_DYNAMIC's sizes are not used by the loader, so a table longer
/// than they say is read whole). Returns the table's file offset and its
/// entries before DT_NULL.
fn read_dynamic(elf: &Elf, ph: &Phdr) -> Result<(u64, Vec<(i64, u64)>)> {
    let e = LE;
    let addr = ph.p_vaddr(e);
    if let Some(s) = elf.sections.iter().find(|s| s.sh_type == elf::SHT_NOBITS.0 && s.name == ".dynamic") {
        return Err(Error::new(
            ErrorKind::Unsupported,
            Location::Vaddr(Vaddr(s.addr.0)),
            "a separate debug information file (.dynamic has no contents): patch the program or library it belongs to",
        ));
    }
    let seg = elf
        .file
        .elf_program_headers()
        .iter()
        .find(|p| p.p_type(e) == elf::PT_LOAD && addr >= p.p_vaddr(e) && addr - p.p_vaddr(e) < p.p_filesz(e));
    let Some(seg) = seg else {
        return Err(Error::new(
            ErrorKind::Malformed,
            Location::Both(FileOffset(ph.p_offset(e)), Vaddr(addr)),
            "PT_DYNAMIC's address is not in the file contents of any PT_LOAD segment: the dynamic linker could not read it",
        ));
    };
    let start = seg.p_offset(e) + (addr - seg.p_vaddr(e));
    let end = seg.p_offset(e) + seg.p_filesz(e);
    let mut entries = Vec::new();
    let mut at = start;
    while at + 16 <= end {
        let (Some(tag), Some(val)) = (u64_at(elf.data, at), u64_at(elf.data, at + 8)) else { break };
        if tag as i64 == elf::DT_NULL.0 {
            return Ok((start, entries));
        }
        entries.push((tag as i64, val));
        at += 16;
    }
    Err(Error::new(
        ErrorKind::Malformed,
        Location::Both(FileOffset(start), Vaddr(addr)),
        format!(
            "the dynamic table has no DT_NULL entry before the end of its segment (offset {end:#x}); it must end with DT_NULL"
        ),
    ))
}

/// The GNU hash table at `addr`, read from its own header (not from its
/// section header, which the loader never reads), as far as the loader can
/// read it: every chain to its end, and a chain entry for each of `nsyms`
/// symbols. Every bucket must be empty or name a hashed symbol.
fn gnu_hash_table<'a>(elf: &Elf<'a>, addr: u64, nsyms: u64) -> Result<&'a [u8]> {
    let head: &[u8] = table_at(elf, addr, 16, ".gnu.hash")?;
    let word = |b: &[u8], i: usize| u64::from(u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().unwrap()));
    let (nbuckets, symoffset, bloom) = (word(head, 0), word(head, 1), word(head, 2));
    let buckets_at = 16 + bloom * 8;
    let chains_at = buckets_at + nbuckets * 4;
    let fixed: &[u8] = table_at(elf, addr, chains_at, ".gnu.hash")?;
    let mut high = None;
    for b in 0..nbuckets as usize {
        let idx = word(&fixed[buckets_at as usize..], b);
        if idx != 0 && idx < symoffset {
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Vaddr(Vaddr(addr + buckets_at + b as u64 * 4)),
                format!(
                    ".gnu.hash bucket {b} holds symbol {idx}, below the first hashed symbol {symoffset}; it must be 0 or at least {symoffset}"
                ),
            ));
        }
        high = high.max((idx != 0).then_some(idx));
    }
    // The chain that starts last ends last: follow it to its end (the
    // entry with bit 0 set).
    let mut end = symoffset.max(nsyms);
    if let Some(high) = high {
        let mut i = high;
        loop {
            let at = addr + chains_at + (i - symoffset) * 4;
            let w = elf.offset_of(Vaddr(at)).and_then(|o| elf.data.get(o.0 as usize));
            let Some(&w) = w else {
                return Err(Error::new(
                    ErrorKind::Malformed,
                    Location::Vaddr(Vaddr(addr + buckets_at)),
                    format!(
                        ".gnu.hash: the chain of symbol {high} has no end marker before its segment ends at address {at:#x}; every chain must end"
                    ),
                ));
            };
            if w & 1 != 0 {
                break;
            }
            i += 1;
        }
        end = end.max(i + 1);
        if i >= nsyms && nsyms >= symoffset {
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Vaddr(Vaddr(addr + chains_at + (i - symoffset) * 4)),
                format!(
                    ".gnu.hash: a chain reaches symbol {i}, but the .dynsym section header gives {nsyms} symbols; they must agree"
                ),
            ));
        }
    }
    table_at(elf, addr, chains_at + (end - symoffset) * 4, ".gnu.hash")
}

/// Checks that every lazy-binding stub in .plt pushes the index of a
/// relocation the copied .rela.plt has (`count` of them): the loader reads
/// the relocation at that index, and past the copy it would read other
/// bytes than past the original.
fn check_plt_indices(elf: &Elf, count: u64) -> Result<()> {
    use iced_x86::{Code, Decoder, DecoderOptions};
    for s in elf.sections.iter().filter(|s| s.name == ".plt" && s.is_exec()) {
        let mut dec = Decoder::with_ip(64, s.data, s.addr.0, DecoderOptions::NONE);
        for ins in &mut dec {
            if matches!(ins.code(), Code::Pushq_imm32 | Code::Pushq_imm8) {
                let index = ins.immediate(0);
                if index >= count {
                    let at = s.offset.0 + (ins.ip() - s.addr.0);
                    return Err(Error::new(
                        ErrorKind::Malformed,
                        Location::Both(FileOffset(at), Vaddr(ins.ip())),
                        format!(
                            "PLT stub pushes relocation index {index:#x}, but .rela.plt (DT_JMPREL) has {count} relocations; the index must be below {count}"
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Dynamic tags whose value is an offset in the dynamic string table.
const STRING_TAGS: [(i64, &str); 9] = [
    (elf::DT_NEEDED.0, "DT_NEEDED"),
    (elf::DT_SONAME.0, "DT_SONAME"),
    (elf::DT_RPATH.0, "DT_RPATH"),
    (elf::DT_RUNPATH.0, "DT_RUNPATH"),
    (elf::DT_AUXILIARY.0, "DT_AUXILIARY"),
    (elf::DT_FILTER.0, "DT_FILTER"),
    (elf::DT_CONFIG.0, "DT_CONFIG"),
    (elf::DT_DEPAUDIT.0, "DT_DEPAUDIT"),
    (elf::DT_AUDIT.0, "DT_AUDIT"),
];

/// Checks that a string offset names a NUL-terminated string inside the
/// dynamic string table. The patched file's table is the original one with
/// strings appended, so a string that ran past the original table's end
/// would read different bytes there.
fn check_string(strtab: &[u8], off: u64, at: Location, what: &str) -> Result<()> {
    let size = strtab.len() as u64;
    if off >= size {
        return Err(Error::new(
            ErrorKind::Malformed,
            at,
            format!(
                "{what}: string offset {off:#x} is outside the dynamic string table (DT_STRSZ {size:#x}); it must be below {size:#x}"
            ),
        ));
    }
    if !strtab[off as usize..].contains(&0) {
        return Err(Error::new(
            ErrorKind::Malformed,
            at,
            format!(
                "{what}: the string at offset {off:#x} is not NUL-terminated before the end of the dynamic string table (DT_STRSZ {size:#x})"
            ),
        ));
    }
    Ok(())
}

/// Walks the version needs (`need == true`) or definitions at `addr` as the
/// dynamic linker does (until a zero `next`), checking every name's string
/// offset; returns the highest version index they define.
fn walk_versions(elf: &Elf, addr: u64, strtab: &[u8], need: bool) -> Result<u16> {
    let what = if need { "DT_VERNEED" } else { "DT_VERDEF" };
    let d = elf.data;
    let bad = |off: u64, msg: String| Error::new(ErrorKind::Malformed, Location::Offset(FileOffset(off)), msg);
    let mut off = elf
        .offset_of(Vaddr(addr))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Malformed,
                Location::Vaddr(Vaddr(addr)),
                format!("{what} is not in the file contents of a loadable segment"),
            )
        })?
        .0;
    let past = |off: u64, n: u64| bad(off, format!("{what}: entry of {n} bytes extends past the end of the file"));
    let mut high = 0u16;
    loop {
        let next = if need {
            // Elf64_Verneed: version, cnt, file, aux, next; then every
            // Elf64_Vernaux (hash, flags, other, name, next) in its chain.
            let file = u32_at(d, off + 4).ok_or_else(|| past(off, 16))?;
            check_string(strtab, file.into(), Location::Offset(FileOffset(off + 4)), "version need file name")?;
            let aux = u32_at(d, off + 8).ok_or_else(|| past(off, 16))?;
            let next = u32_at(d, off + 12).ok_or_else(|| past(off, 16))?;
            let mut a = off + u64::from(aux);
            loop {
                let other = u16_at(d, a + 6).ok_or_else(|| past(a, 16))?;
                let name = u32_at(d, a + 8).ok_or_else(|| past(a, 16))?;
                check_string(strtab, name.into(), Location::Offset(FileOffset(a + 8)), "version need name")?;
                high = high.max(other & 0x7fff);
                let an = u32_at(d, a + 12).ok_or_else(|| past(a, 16))?;
                if an == 0 {
                    break;
                }
                a += u64::from(an);
            }
            next
        } else {
            // Elf64_Verdef: version, flags, ndx, cnt, hash, aux, next; the
            // loader reads the first Elf64_Verdaux's name only.
            let ndx = u16_at(d, off + 4).ok_or_else(|| past(off, 20))?;
            let aux = u32_at(d, off + 12).ok_or_else(|| past(off, 20))?;
            let next = u32_at(d, off + 16).ok_or_else(|| past(off, 20))?;
            high = high.max(ndx & 0x7fff);
            let a = off + u64::from(aux);
            let name = u32_at(d, a).ok_or_else(|| past(a, 8))?;
            check_string(strtab, name.into(), Location::Offset(FileOffset(a)), "version definition name")?;
            next
        };
        if next == 0 {
            return Ok(high);
        }
        off += u64::from(next);
    }
}
