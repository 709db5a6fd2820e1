//! Writing a patched ELF file.
//!
//! Every byte of the input stays where it is, except the ELF header's table
//! pointers. Everything new goes into three PT_LOAD segments appended above
//! the highest address (read-only, executable, read-write):
//!
//! * read-only: the program header table (moved here so it can grow), copies
//!   of the dynamic-linking tables that must grow (.dynsym with one more
//!   symbol, .dynstr, .gnu.version, .gnu.hash, .hash, .rela.dyn, .rela.plt)
//!   and the site table (.alloctramp.sites);
//! * executable: one trampoline per site plus the init and fini stubs
//!   (.alloctramp.text);
//! * read-write: the new .dynamic (one more DT_NEEDED, DT_INIT and DT_FINI
//!   pointing at the stubs), the module control block with the GOT slot for
//!   the runtime's API table (.alloctramp.data), and the counters
//!   (.alloctramp.counters, no file bytes, page-aligned so the runtime can map
//!   shared memory over them).
//!
//! The section headers of the moved tables point at their copies; the old
//! bytes stay in place, unreferenced. New section headers and a new
//! .shstrtab follow at the end of the file.

use crate::elf::Elf;
use crate::error::{Error, ErrorKind, Location, Result};
use crate::{Analysis, SiteInfo};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use alloctramp_trampolines::codegen::{self, TrampolineSpec};
use alloctramp_trampolines::layout::{self, PAGE};
use object::LittleEndian as LE;
use object::elf;
use object::pod::{bytes_of, slice_from_all_bytes};
use object::read::elf::ProgramHeader as _;

type Phdr = elf::ProgramHeader64<LE>;
type Shdr = elf::SectionHeader64<LE>;
type Sym = elf::Sym64<LE>;
type Rela = elf::Rela64<LE>;

/// Options for [`patch`].
#[derive(Clone, Debug)]
pub struct PatchOptions {
    /// The DT_NEEDED string naming the runtime (a path, possibly with
    /// `$ORIGIN`, or a SONAME).
    pub runtime_needed: String,
    /// Counter shards (a power of two).
    pub shards: u32,
}

impl Default for PatchOptions {
    fn default() -> Self {
        PatchOptions { runtime_needed: format!("$ORIGIN/{}", layout::RUNTIME_SONAME), shards: 16 }
    }
}

/// A site that was not patched, and why.
#[derive(Clone, Debug)]
pub struct Skipped {
    pub site: usize,
    pub reason: String,
}

/// The patched file and what was done. The file is `head`, then the
/// original file with `fixups` applied, then `tail`: the original is
/// borrowed, not copied.
#[derive(Debug)]
pub struct Patched<'a> {
    pub head: Vec<u8>,
    pub original: &'a [u8],
    /// (offset in the original, new bytes).
    pub fixups: Vec<(u64, [u8; 8])>,
    pub tail: Vec<u8>,
    pub sites: usize,
    pub skipped: Vec<Skipped>,
    pub text_size: u64,
    pub table_size: u64,
    pub counters_size: u64,
}

impl Patched<'_> {
    /// Gives the patched file's bytes, in order, in pieces.
    fn pieces(&self, mut put: impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        put(&self.head)?;
        let mut at = 0usize;
        let mut fixups = self.fixups.clone();
        fixups.sort();
        for (off, bytes) in fixups {
            let off = off as usize;
            if off < at || off + bytes.len() > self.original.len() {
                continue;
            }
            put(&self.original[at..off])?;
            put(&bytes)?;
            at = off + bytes.len();
        }
        put(&self.original[at..])?;
        put(&self.tail)
    }

    /// Writes the patched file.
    pub fn write_to(&self, w: &mut (impl std::io::Write + ?Sized)) -> std::io::Result<()> {
        self.pieces(|p| w.write_all(p))
    }

    /// Writes the patched file from the writer's start, seeking over every
    /// whole 4 KiB block (at a 4 KiB-aligned output offset) of zeros instead
    /// of writing it, so that holes of a sparse input stay holes. Returns
    /// the file's length: the caller sets it (`File::set_len`), since a
    /// trailing hole is never written.
    pub fn write_sparse<W: std::io::Write + std::io::Seek>(&self, w: &mut W) -> std::io::Result<u64> {
        const BLOCK: usize = 4096;
        // `pos` bytes given so far; `written` where the writer stands; a
        // block that spans pieces is gathered in `partial` first.
        let (mut pos, mut written) = (0u64, 0u64);
        let mut partial: Vec<u8> = Vec::with_capacity(BLOCK);
        let mut emit = |block: &[u8], at: u64, written: &mut u64| -> std::io::Result<()> {
            if !is_zero(block) {
                if *written != at {
                    w.seek(std::io::SeekFrom::Start(at))?;
                }
                w.write_all(block)?;
                *written = at + block.len() as u64;
            }
            Ok(())
        };
        self.pieces(|mut p| {
            while !p.is_empty() {
                if partial.is_empty() && p.len() >= BLOCK && pos % BLOCK as u64 == 0 {
                    let (block, rest) = p.split_at(BLOCK);
                    emit(block, pos, &mut written)?;
                    pos += BLOCK as u64;
                    p = rest;
                    continue;
                }
                let n = (BLOCK - (pos as usize + partial.len()) % BLOCK).min(p.len());
                partial.extend_from_slice(&p[..n]);
                p = &p[n..];
                if (pos as usize + partial.len()).is_multiple_of(BLOCK) {
                    emit(&partial, pos, &mut written)?;
                    pos += partial.len() as u64;
                    partial.clear();
                }
            }
            Ok(())
        })?;
        // A last, partial block: zeros are left to the length.
        emit(&partial, pos, &mut written)?;
        Ok(pos + partial.len() as u64)
    }

    /// The patched file in one buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.head.len() + self.original.len() + self.tail.len());
        self.write_to(&mut v).expect("writing to a Vec");
        v
    }
}

fn is_zero(b: &[u8]) -> bool {
    let (words, rest) = b.split_at(b.len() / 8 * 8);
    words.chunks_exact(8).all(|w| u64::from_ne_bytes(w.try_into().unwrap()) == 0) && rest.iter().all(|&x| x == 0)
}

fn align(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

fn refuse(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Unsupported, Location::None, what)
}

/// Whether a file already carries alloctramp's site table.
pub fn is_patched(elf: &Elf) -> bool {
    elf.section_by_name(layout::SEC_SITES).is_some() || layout::table_after_phdrs(elf.data).is_some()
}

/// Reads `count` records of `T` at virtual address `addr`.
fn table_at<'a, T: object::Pod>(elf: &Elf<'a>, addr: u64, size: u64, what: &str) -> Result<&'a [T]> {
    let off = elf.offset_of(alloctramp_trampolines::addr::Vaddr(addr)).ok_or_else(|| {
        Error::new(
            ErrorKind::Malformed,
            Location::Vaddr(alloctramp_trampolines::addr::Vaddr(addr)),
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

fn u16_at(d: &[u8], at: u64) -> Option<u16> {
    Some(u16::from_le_bytes(d.get(at as usize..(at as usize).checked_add(2)?)?.try_into().ok()?))
}

fn u32_at(d: &[u8], at: u64) -> Option<u32> {
    Some(u32::from_le_bytes(d.get(at as usize..(at as usize).checked_add(4)?)?.try_into().ok()?))
}

fn u64_at(d: &[u8], at: u64) -> Option<u64> {
    Some(u64::from_le_bytes(d.get(at as usize..(at as usize).checked_add(8)?)?.try_into().ok()?))
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
                let index = ins.immediate64();
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

/// The ELF hash function of the SysV hash table.
fn sysv_hash(name: &[u8]) -> u32 {
    let mut h: u32 = 0;
    for &c in name {
        h = (h << 4).wrapping_add(u32::from(c));
        let g = h & 0xf000_0000;
        if g != 0 {
            h ^= g >> 24;
        }
        h &= !g;
    }
    h
}

fn c_str(strtab: &[u8], off: u32) -> &[u8] {
    let rest = strtab.get(off as usize..).unwrap_or(&[]);
    &rest[..rest.iter().position(|&c| c == 0).unwrap_or(rest.len())]
}

/// One block placed in the new region.
struct Placed {
    off: u64,
    addr: u64,
    size: u64,
}

/// Lays out blocks one after another in the new region.
struct Region {
    base_off: u64,
    delta: u64,
    bytes: Vec<u8>,
}

impl Region {
    fn put(&mut self, data: &[u8], alignment: u64) -> Placed {
        let at = align(self.base_off + self.bytes.len() as u64, alignment);
        self.bytes.resize((at - self.base_off) as usize, 0);
        self.bytes.extend_from_slice(data);
        Placed { off: at, addr: at.wrapping_add(self.delta), size: data.len() as u64 }
    }
    fn here(&self) -> u64 {
        self.base_off + self.bytes.len() as u64
    }
    fn pad_to(&mut self, alignment: u64) {
        let at = align(self.here(), alignment);
        self.bytes.resize((at - self.base_off) as usize, 0);
    }
}

/// Patches a file: `data` is the input, `a` its analysis.
pub fn patch<'a>(data: &'a [u8], a: &Analysis, opts: &PatchOptions) -> Result<Patched<'a>> {
    let e = LE;
    let elf = Elf::parse(data)?;
    if is_patched(&elf) {
        return Err(Error::new(ErrorKind::AlreadyPatched, Location::None, "already patched by alloctramp"));
    }
    if !opts.shards.is_power_of_two() || opts.shards > 1024 {
        return Err(Error::new(ErrorKind::Request, Location::None, "shard count must be a power of two up to 1024"));
    }
    let phdrs = elf.file.elf_program_headers();
    let dyn_ph = phdrs
        .iter()
        .find(|p| p.p_type(e) == elf::PT_DYNAMIC)
        .ok_or_else(|| refuse("statically linked (no PT_DYNAMIC): the runtime library cannot be loaded"))?;
    if elf.sections.is_empty() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            Location::Offset(FileOffset(40)),
            "no section headers (e_shoff is 0): they are needed to find and repoint the dynamic tables",
        ));
    }
    let loads: Vec<&Phdr> = phdrs.iter().filter(|p| p.p_type(e) == elf::PT_LOAD).collect();
    if loads.is_empty() {
        return Err(refuse("no PT_LOAD segment"));
    }

    // The dynamic table, read as the dynamic linker reads it: from
    // PT_DYNAMIC's address up to DT_NULL, whatever PT_DYNAMIC's size says.
    let (dyn_off, dynamic) = read_dynamic(&elf, dyn_ph)?;
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
                Location::Both(FileOffset(dyn_off), Vaddr(dyn_ph.p_vaddr(e))),
                format!("the dynamic table has no {what} entry; a dynamically linked file needs one"),
            )
        })
    };
    let strtab_addr = need(elf::DT_STRTAB.0, "DT_STRTAB")?;
    let strsz = need(elf::DT_STRSZ.0, "DT_STRSZ")?;
    let symtab_addr = need(elf::DT_SYMTAB.0, "DT_SYMTAB")?;
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
    // The loader knows the symbol count only from the hash tables. The GNU
    // table is copied as far as the loader can read it (every chain to its
    // end, at least one entry per hashed symbol); the SysV table is rebuilt,
    // so where it is the only one, its count must match the section's.
    let gnu_hash_addr = dyn_val(&dynamic, elf::DT_GNU_HASH.0);
    let gnu_hash_old = gnu_hash_addr.map(|addr| gnu_hash_table(&elf, addr, nsyms)).transpose()?;
    let hash_addr = dyn_val(&dynamic, elf::DT_HASH.0);
    let hash_count = hash_addr
        .map(|addr| {
            table_at::<u8>(&elf, addr, 8, ".hash").map(|h| u64::from(u32::from_le_bytes(h[4..8].try_into().unwrap())))
        })
        .transpose()?;
    if gnu_hash_old.is_none() {
        let what = ".hash";
        if let Some(count) = hash_count.filter(|&c| c != nsyms) {
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Offset(FileOffset(dynsym_sec.offset.0)),
                format!(
                    "the .dynsym section header gives {nsyms} symbols ({:#x} bytes) but {what} covers {count}; they must agree",
                    dynsym_sec.size
                ),
            ));
        }
    }
    let old_syms: &[Sym] = table_at(&elf, symtab_addr, nsyms * 24, ".dynsym")?;
    let old_strtab: &[u8] = table_at(&elf, strtab_addr, strsz, ".dynstr")?;

    // Every string the loader reads must lie inside the string table: the
    // patched file's table is a copy with strings appended, and bytes past
    // the original table are not copied.
    for (k, &(tag, val)) in dynamic.iter().enumerate() {
        if let Some((_, name)) = STRING_TAGS.iter().find(|(t, _)| *t == tag) {
            let at = dyn_off + k as u64 * 16;
            let loc = Location::Both(FileOffset(at), Vaddr(dyn_ph.p_vaddr(e) + k as u64 * 16));
            check_string(old_strtab, val, loc, name)?;
        }
    }
    let dynsym_off = elf.offset_of(Vaddr(symtab_addr)).map_or(0, |o| o.0);
    for (i, sym) in old_syms.iter().enumerate().skip(1) {
        let loc = Location::Offset(FileOffset(dynsym_off + i as u64 * 24));
        check_string(old_strtab, sym.st_name.get(e).into(), loc, &format!("dynamic symbol {i}"))?;
    }
    let mut version_high = 1u16;
    for (tag, need) in [(elf::DT_VERNEED.0, true), (elf::DT_VERDEF.0, false)] {
        if let Some(addr) = dyn_val(&dynamic, tag) {
            version_high = version_high.max(walk_versions(&elf, addr, old_strtab, need)?);
        }
    }

    // Where the imported symbol goes: before the hashed symbols of a GNU
    // hash table, else at the end.
    let insert_at = match gnu_hash_old {
        Some(h) if h.len() >= 16 => u64::from(u32::from_le_bytes(h[4..8].try_into().unwrap())),
        Some(h) => {
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Vaddr(Vaddr(gnu_hash_addr.unwrap_or(0))),
                format!(".gnu.hash is {} bytes, shorter than its 16-byte header", h.len()),
            ));
        }
        None => nsyms,
    };
    if insert_at > nsyms || insert_at == 0 {
        return Err(Error::new(
            ErrorKind::Malformed,
            Location::Vaddr(Vaddr(gnu_hash_addr.map_or(0, |a| a + 4))),
            format!(".gnu.hash symoffset {insert_at}: it must be between 1 and the {nsyms} dynamic symbols"),
        ));
    }
    // Symbol indices at and above the new symbol move up by one; an index
    // past the table (in a relocation that ignores its symbol) stays.
    let shift = |i: u32| if u64::from(i) >= insert_at && u64::from(i) < nsyms { i + 1 } else { i };

    // New .dynstr: old strings plus the runtime's name and symbol.
    let mut strtab = old_strtab.to_vec();
    let needed_off = strtab.len() as u64;
    strtab.extend_from_slice(opts.runtime_needed.as_bytes());
    strtab.push(0);
    let sym_name_off = strtab.len() as u32;
    strtab.extend_from_slice(layout::RUNTIME_SYMBOL.as_bytes());
    strtab.push(0);

    // New .dynsym.
    let mut syms: Vec<u8> = Vec::with_capacity((nsyms as usize + 1) * 24);
    for s in &old_syms[..insert_at as usize] {
        syms.extend_from_slice(bytes_of(s));
    }
    let new_sym = Sym {
        st_name: object::U32::new(e, sym_name_off),
        st_info: elf::SymbolInfo((elf::STB_GLOBAL.0 << 4) | elf::STT_OBJECT.0),
        st_other: elf::SymbolOther(elf::STV_DEFAULT.0),
        st_shndx: object::U16::new(e, elf::SHN_UNDEF),
        st_value: object::U64::new(e, 0),
        st_size: object::U64::new(e, 0),
    };
    syms.extend_from_slice(bytes_of(&new_sym));
    for s in &old_syms[insert_at as usize..] {
        syms.extend_from_slice(bytes_of(s));
    }

    // New .gnu.version.
    let versym_addr = dyn_val(&dynamic, elf::DT_VERSYM.0);
    let versym = match versym_addr {
        Some(addr) => {
            let old: &[u8] = table_at(&elf, addr, nsyms * 2, ".gnu.version")?;
            // The loader indexes an array of version_high + 1 entries with
            // these: a larger index reads past it.
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
            let mut v = old[..insert_at as usize * 2].to_vec();
            v.extend_from_slice(&1u16.to_le_bytes());
            v.extend_from_slice(&old[insert_at as usize * 2..]);
            Some(v)
        }
        None => None,
    };

    // New .gnu.hash: same buckets and chains, symbol indices one higher.
    let gnu_hash = match gnu_hash_old {
        Some(h) => {
            let nbuckets = u32::from_le_bytes(h[0..4].try_into().unwrap()) as usize;
            let bloom = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
            let buckets_at = 16 + bloom * 8;
            if h.len() < buckets_at + nbuckets * 4 {
                return Err(Error::new(
                    ErrorKind::Malformed,
                    Location::Vaddr(Vaddr(gnu_hash_addr.unwrap_or(0))),
                    format!(
                        ".gnu.hash is {} bytes; its header ({nbuckets} buckets, {bloom} bloom words) needs {}",
                        h.len(),
                        buckets_at + nbuckets * 4
                    ),
                ));
            }
            let mut v = h.to_vec();
            v[4..8].copy_from_slice(&(insert_at as u32 + 1).to_le_bytes());
            for b in 0..nbuckets {
                let at = buckets_at + b * 4;
                let idx = u32::from_le_bytes(v[at..at + 4].try_into().unwrap());
                // Checked by gnu_hash_table: 0 or a hashed symbol.
                if idx != 0 {
                    v[at..at + 4].copy_from_slice(&(idx + 1).to_le_bytes());
                }
            }
            Some(v)
        }
        None => None,
    };

    // New SysV .hash, rebuilt for the new symbol list.
    let hash = match hash_addr {
        Some(addr) => {
            let head: &[u8] = table_at(&elf, addr, 8, ".hash")?;
            let nbucket = u32::from_le_bytes(head[0..4].try_into().unwrap()).max(1);
            // The rebuilt table keeps the bucket count, whose buckets the
            // original holds in the file: a count read from a damaged header
            // must not size a table larger than the input.
            let _: &[u8] = table_at(&elf, addr, 8 + 4 * u64::from(nbucket), ".hash with its buckets")?;
            let n = nsyms as u32 + 1;
            let mut buckets = vec![0u32; nbucket as usize];
            let mut chains = vec![0u32; n as usize];
            let sym_list: &[Sym] = slice_from_all_bytes(&syms).unwrap();
            for i in (1..n).rev() {
                let name = c_str(&strtab, sym_list[i as usize].st_name.get(e));
                let b = (sysv_hash(name) % nbucket) as usize;
                chains[i as usize] = buckets[b];
                buckets[b] = i;
            }
            let mut v = Vec::with_capacity(8 + 4 * (buckets.len() + chains.len()));
            v.extend_from_slice(&nbucket.to_le_bytes());
            v.extend_from_slice(&n.to_le_bytes());
            for x in buckets.iter().chain(&chains) {
                v.extend_from_slice(&x.to_le_bytes());
            }
            Some(v)
        }
        None => None,
    };

    // Relocation tables, with symbol indices shifted.
    // How far relocated data reaches: a relocation's offset plus its
    // symbol's size (elflint's test of whether a relocation writes to a
    // read-only segment); the new segments are placed above it.
    let mut reach = 0u64;
    let mut copy_relas = |addr: u64, size: u64, what: &str| -> Result<Vec<u8>> {
        let old: &[Rela] = table_at(&elf, addr, size, what)?;
        let mut v = Vec::with_capacity(size as usize + 24);
        for r in old {
            let info = r.r_info.get(e);
            let (sym, typ) = ((info >> 32) as u32, info as u32);
            let sym_size = old_syms.get(sym as usize).map_or(0, |s| s.st_size.get(e));
            let ignores_symbol =
                [elf::R_X86_64_NONE.0, elf::R_X86_64_RELATIVE.0, elf::R_X86_64_IRELATIVE.0].contains(&typ);
            if u64::from(sym) >= nsyms && !ignores_symbol {
                let at = elf.offset_of(Vaddr(addr)).map_or(0, |o| o.0)
                    + (r as *const Rela as usize - old.as_ptr() as usize) as u64;
                return Err(Error::new(
                    ErrorKind::Malformed,
                    Location::Offset(FileOffset(at)),
                    format!("{what}: relocation of type {typ} names symbol {sym}, but .dynsym has {nsyms} symbols"),
                ));
            }
            reach = reach.max(r.r_offset.get(e).saturating_add(sym_size));
            let nr = Rela {
                r_offset: r.r_offset,
                r_info: object::U64::new(e, (u64::from(shift(sym)) << 32) | u64::from(typ)),
                r_addend: r.r_addend,
            };
            v.extend_from_slice(bytes_of(&nr));
        }
        Ok(v)
    };
    let rela_addr = dyn_val(&dynamic, elf::DT_RELA.0);
    let relasz = dyn_val(&dynamic, elf::DT_RELASZ.0).unwrap_or(0);
    let jmprel_addr = dyn_val(&dynamic, elf::DT_JMPREL.0);
    let pltrelsz = dyn_val(&dynamic, elf::DT_PLTRELSZ.0).unwrap_or(0);
    // Lazy binding reads .rela.plt at the index a PLT stub pushes, not
    // within DT_PLTRELSZ: the copy covers the section header's extent too,
    // and every index a stub pushes must be inside it.
    let jmprel_size = jmprel_addr.map_or(0, |j| {
        let sec = elf.sections.iter().filter(|s| s.sh_type == elf::SHT_RELA.0 && s.addr.0 == j).map(|s| s.size);
        sec.max().unwrap_or(0).max(pltrelsz)
    });
    check_plt_indices(&elf, jmprel_size / 24)?;
    // JMPREL inside the RELA range (some linkers): copied as part of RELA.
    let jmprel_inside = match (rela_addr, jmprel_addr) {
        (Some(r), Some(j)) => {
            let end = r.saturating_add(relasz);
            j >= r && j < end && j.saturating_add(jmprel_size) <= end
        }
        _ => false,
    };
    let mut rela = match rela_addr {
        Some(addr) => copy_relas(addr, relasz, ".rela.dyn")?,
        None => Vec::new(),
    };
    let jmprel = match jmprel_addr {
        Some(addr) if !jmprel_inside => Some(copy_relas(addr, jmprel_size, ".rela.plt")?),
        _ => None,
    };

    // The import's relocation goes last in .rela.dyn; its slot's address is
    // known once the read-write segment is placed.
    rela.extend_from_slice(&[0u8; 24]);

    // Site table contents that do not depend on addresses.
    let n_sites = a.scan.sites.len();
    let mut strings = layout::Strings::default();
    let module_name = strings.add(&a.module);
    let site_strings: Vec<(u32, u32, u32)> = a
        .info
        .iter()
        .map(|SiteInfo { function, location }| {
            let f = function.as_deref().map_or(layout::NO_STRING, |f| strings.add(&crate::symbols::demangle(f)));
            let (file, line) = location.as_ref().map_or((layout::NO_STRING, 0), |l| (strings.add(&l.file), l.line));
            (f, file, line)
        })
        .collect();
    let entry_names: Vec<u32> = a.scan.entries.iter().map(|en| strings.add(&en.display)).collect();
    let table_len = layout::table_size(n_sites, a.scan.entries.len(), strings.len());

    // Layout. The file starts with a new read-only segment: the ELF header,
    // the program header table (where strip and every loader expect it,
    // right after the ELF header, now with room for the new entries) and the
    // grown dynamic tables. The original file follows, shifted by a multiple
    // of the largest segment alignment so that every original segment keeps
    // its address. Then the read-write and executable segments, and the
    // section headers.
    let phoff = elf.file.elf_header().e_phoff.get(e);
    for (i, p) in phdrs.iter().enumerate().filter(|(_, p)| p.p_type(e) == elf::PT_LOAD) {
        let a = p.p_align(e);
        let at = Location::Offset(FileOffset(phoff + i as u64 * 56 + 48));
        if a > 1 && !a.is_power_of_two() {
            return Err(Error::new(
                ErrorKind::Malformed,
                at,
                format!("program header {i}: PT_LOAD alignment {a:#x} is not a power of two (0x1000 is usual)"),
            ));
        }
        if a > 1 << 30 {
            return Err(Error::new(
                ErrorKind::Unsupported,
                at,
                format!("program header {i}: PT_LOAD alignment {a:#x} is larger than the 1 GiB (0x40000000) supported"),
            ));
        }
        let end = p.p_vaddr(e).checked_add(p.p_memsz(e)).filter(|&end| end <= 1 << 46);
        if end.is_none() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                Location::Offset(FileOffset(phoff + i as u64 * 56)),
                format!(
                    "program header {i}: PT_LOAD at address {:#x} of size {:#x} ends above 0x400000000000: no room for the new segments above it",
                    p.p_vaddr(e),
                    p.p_memsz(e)
                ),
            ));
        }
    }
    let max_align = loads.iter().map(|p| p.p_align(e)).max().unwrap_or(PAGE).max(PAGE);
    let max_end = loads.iter().map(|p| p.p_vaddr(e).saturating_add(p.p_memsz(e))).max().unwrap_or(0);
    // Leave a gap above what relocations reach, unless a symbol size is
    // absurd (then no gap would do).
    let max_end = if reach >= max_end && reach - max_end < 1 << 30 { reach + 1 } else { max_end };
    // Nor may they cover an allocated section that no segment loads (a
    // patched file must read as the input did: its sections are checked
    // against the segments that hold their addresses).
    let mut max_end = max_end;
    for s in elf.sections.iter().filter(|s| s.is_alloc() && !s.data.is_empty()) {
        let end = s.addr.0.saturating_add(s.size);
        if end > max_end {
            if end - max_end >= 1 << 30 {
                return Err(Error::malformed_at(
                    elf.file.elf_header().e_shoff.get(e) + s.index as u64 * 64 + 16,
                    format!(
                        "section [{}] {}: its addresses end at {end:#x}, far above every loadable segment (they end at {max_end:#x}); an allocated section lies within a PT_LOAD",
                        s.index, s.name
                    ),
                ));
            }
            max_end = end;
        }
    }
    let ro_addr = align(max_end, max_align);
    let new_phnum = phdrs.len() + 3; // the new PT_LOADs
    let mut region = Region { base_off: 0, delta: ro_addr, bytes: Vec::new() };
    region.bytes.resize(64, 0);
    let phdr_place = region.put(&vec![0u8; new_phnum * 56], 8);
    // The site table follows the program headers: the runtime finds it
    // there (see `layout::table_after_phdrs`).
    let table_place = region.put(&vec![0u8; table_len], 8);
    let table_addr = table_place.addr;
    let dynsym_place = region.put(&syms, 8);
    let dynstr_place = region.put(&strtab, 1);
    let versym_place = versym.as_ref().map(|v| region.put(v, 2));
    let gnu_hash_place = gnu_hash.as_ref().map(|v| region.put(v, 8));
    let hash_place = hash.as_ref().map(|v| region.put(v, 8));
    let rela_place = region.put(&rela, 8);
    let jmprel_place = jmprel.as_ref().map(|v| region.put(v, 8));
    let ro_size = region.here();

    // Addresses: read-write segment (.dynamic, the control block, then the
    // counters, with no file bytes, on pages of their own), then the
    // executable segment above the counters.
    let has_init = dyn_val(&dynamic, elf::DT_INIT.0);
    let has_fini = dyn_val(&dynamic, elf::DT_FINI.0);
    // Old entries, DT_NEEDED, maybe DT_INIT and DT_FINI, DT_NULL.
    let dyn_count = dynamic.len() + 1 + usize::from(has_init.is_none()) + usize::from(has_fini.is_none()) + 1;
    let rw_addr = align(ro_addr + ro_size, PAGE);
    let control_addr = align(rw_addr + dyn_count as u64 * 16, 64);
    let counters_addr = align(control_addr + layout::CONTROL_SIZE as u64, PAGE);
    let shard_stride = align(n_sites.max(1) as u64 * layout::CELL_SIZE as u64, PAGE);
    if shard_stride > i32::MAX as u64 {
        return Err(refuse(format!("{n_sites} sites: too many for one module")));
    }
    let counters_size = shard_stride * u64::from(opts.shards);
    let text_addr = counters_addr + counters_size;

    let stub_err = |err: codegen::CodegenError| Error::new(ErrorKind::Request, Location::None, format!("stub: {err}"));
    let init_addr = text_addr;
    let mut text =
        codegen::init_stub(init_addr, control_addr, table_addr, layout::api::REGISTER, has_init).map_err(stub_err)?;
    text.resize(align(text.len() as u64, 16) as usize, 0xcc);
    let fini_addr = init_addr + text.len() as u64;
    text.extend_from_slice(
        &codegen::init_stub(fini_addr, control_addr, table_addr, layout::api::UNREGISTER, has_fini)
            .map_err(stub_err)?,
    );
    text.resize(align(text.len() as u64, 16) as usize, 0xcc);

    let mut table_sites = Vec::with_capacity(n_sites);
    let mut skipped = Vec::new();
    for (i, site) in a.scan.sites.iter().enumerate() {
        let at = text_addr + text.len() as u64;
        let entry = &a.scan.entries[site.entry];
        let form = site.form;
        let spec = TrampolineSpec {
            site: site.vaddr.0,
            len: site.len,
            form,
            target: site.target.0,
            sig: entry.sig,
            index: i as u32,
            preserve: site.via == crate::Via::Direct,
            args: entry.args,
            control: control_addr,
            shard_mask: opts.shards - 1,
            shard_stride: shard_stride as u32,
        };
        let code = if site.len < 5 {
            Err(format!("site instruction of {} bytes is too short for a jump", site.len))
        } else {
            match codegen::trampoline(&spec, at) {
                // Every entry of the trampoline must be in reach of the site.
                Ok(t)
                    if [0, t.drain, t.count]
                        .iter()
                        .all(|&e| codegen::site_jump(site.vaddr.0, at + u64::from(e)).is_some()) =>
                {
                    Ok(t)
                }
                Ok(_) => Err("trampoline out of rel32 range".to_string()),
                Err(err) => Err(format!("trampoline: {err}")),
            }
        };
        let mut original = [0u8; 8];
        let orig = elf.bytes_at(site.vaddr.0, site.len as usize).unwrap_or(&[]);
        let n = orig.len().min(8);
        original[..n].copy_from_slice(&orig[..n]);
        let (f, file, line) = site_strings[i];
        let (trampoline, drain, count) = match code {
            Ok(t) => {
                text.extend_from_slice(&t.code);
                text.resize(align(text.len() as u64, 16) as usize, 0xcc);
                (at, t.drain, t.count)
            }
            // Sites that cannot be patched stay in the table for the report,
            // without a trampoline: the runtime never rewrites them.
            Err(reason) => {
                skipped.push(Skipped { site: i, reason });
                (0, 0, 0)
            }
        };
        table_sites.push(layout::Site {
            addr: site.vaddr.0,
            trampoline,
            original,
            len: site.len,
            form: form as u8,
            entry: site.entry as u16,
            function: f,
            file,
            line,
            drain,
            count,
            ..layout::Site::default()
        });
    }
    // File order: the read-only segment, the executable one, the
    // read-write one, then the original file shifted to a multiple of the
    // largest alignment (so the new segments' file ranges, counters
    // included, never overlap an original segment's).
    region.pad_to(PAGE);
    let text_start = region.here();
    region.delta = text_addr.wrapping_sub(text_start);
    let text_place = region.put(&text, 16);
    let text_end = region.here();
    region.pad_to(PAGE);
    let rw_start = region.here();
    region.delta = rw_addr.wrapping_sub(rw_start);
    let dynamic_place = region.put(&vec![0u8; dyn_count * 16], 8);
    let control_place = region.put(&[0u8; layout::CONTROL_SIZE], 64);
    debug_assert_eq!(dynamic_place.addr, rw_addr);
    debug_assert_eq!(control_place.addr, control_addr);
    let rw_file_end = region.here();
    // The counters' nominal file offset (they have no bytes) stays before
    // the original file too, so no original segment seems to hold them.
    let counters_off = rw_start + (counters_addr - rw_addr);
    let shift = align(rw_file_end.max(counters_off + 1), max_align);
    region.bytes.resize(shift as usize, 0);
    // The original file is not copied: the output is head, original, tail.
    let mut head = std::mem::take(&mut region.bytes);
    region.base_off = shift + data.len() as u64;

    // New .dynamic.
    let last_needed = dynamic.iter().rposition(|&(t, _)| t == elf::DT_NEEDED.0);
    let replace = |tag: i64, val: u64| -> u64 {
        let moved = |p: &Option<Placed>| p.as_ref().map_or(val, |p| p.addr);
        match tag {
            x if x == elf::DT_STRTAB.0 => dynstr_place.addr,
            x if x == elf::DT_STRSZ.0 => strtab.len() as u64,
            x if x == elf::DT_SYMTAB.0 => dynsym_place.addr,
            x if x == elf::DT_VERSYM.0 => moved(&versym_place),
            x if x == elf::DT_GNU_HASH.0 => moved(&gnu_hash_place),
            x if x == elf::DT_HASH.0 => moved(&hash_place),
            x if x == elf::DT_RELA.0 => rela_place.addr,
            x if x == elf::DT_RELASZ.0 => rela_place.size,
            x if x == elf::DT_JMPREL.0 => match (&jmprel_place, rela_addr) {
                (Some(p), _) => p.addr,
                (None, Some(r)) if jmprel_inside => rela_place.addr + (val - r),
                _ => val,
            },
            x if x == elf::DT_INIT.0 => init_addr,
            x if x == elf::DT_FINI.0 => fini_addr,
            _ => val,
        }
    };
    let mut new_dynamic: Vec<(i64, u64)> = Vec::with_capacity(dyn_count);
    let needed = (elf::DT_NEEDED.0, needed_off);
    if last_needed.is_none() {
        new_dynamic.push(needed);
    }
    for (i, &(tag, val)) in dynamic.iter().enumerate() {
        new_dynamic.push((tag, replace(tag, val)));
        if Some(i) == last_needed {
            new_dynamic.push(needed);
        }
    }
    if has_init.is_none() {
        new_dynamic.push((elf::DT_INIT.0, init_addr));
    }
    if has_fini.is_none() {
        new_dynamic.push((elf::DT_FINI.0, fini_addr));
    }
    new_dynamic.push((0, 0));
    debug_assert_eq!(new_dynamic.len(), dyn_count);
    let d_at = dynamic_place.off as usize;
    for (k, (t, v)) in new_dynamic.iter().enumerate() {
        head[d_at + k * 16..d_at + k * 16 + 8].copy_from_slice(&t.to_le_bytes());
        head[d_at + k * 16 + 8..d_at + k * 16 + 16].copy_from_slice(&v.to_le_bytes());
    }

    // The relocation that fills the runtime slot.
    let glob_dat = Rela {
        r_offset: object::U64::new(e, control_addr + u64::from(layout::control::RUNTIME)),
        r_info: object::U64::new(e, (insert_at << 32) | u64::from(elf::R_X86_64_GLOB_DAT.0)),
        r_addend: object::I64::new(e, 0),
    };
    let rela_slot = (rela_place.off + rela_place.size - 24) as usize;
    head[rela_slot..rela_slot + 24].copy_from_slice(bytes_of(&glob_dat));

    // Site table.
    let build_id = elf.build_id().unwrap_or(&[]);
    let id_len = build_id.len().min(20);
    let mut id = [0u8; 20];
    id[..id_len].copy_from_slice(&build_id[..id_len]);
    let header = layout::Header {
        flags: layout::flags::PRESERVE_DIRECT,
        shard_count: opts.shards,
        shard_stride,
        table_addr,
        control_addr,
        counters_addr,
        counters_size,
        text_addr: text_place.addr,
        text_size: text_place.size,
        module_name,
        build_id: id,
        build_id_len: id_len as u32,
        ehdr_addr: ro_addr,
        ..layout::Header::default()
    };
    let entries: Vec<layout::Entry> = a
        .scan
        .entries
        .iter()
        .zip(&entry_names)
        .map(|(en, &name)| layout::Entry {
            name,
            kind: en.sig.kind.code(),
            sig: layout::encode_sig(&en.sig),
            ..layout::Entry::default()
        })
        .collect();
    let table = layout::encode(header, &table_sites, &entries, &strings);
    debug_assert_eq!(table.len(), table_len);
    head[table_place.off as usize..table_place.off as usize + table.len()].copy_from_slice(&table);

    // Program headers: the original ones shifted, PT_PHDR and PT_DYNAMIC
    // pointing at the new tables, the new PT_LOADs after the last one.
    let mk = |p_type: elf::ProgramType, flags: u32, off: u64, addr: u64, filesz: u64, memsz: u64, align_: u64| Phdr {
        p_type: object::U32::new(e, p_type),
        p_flags: object::U32::new(e, elf::ProgramFlags(flags)),
        p_offset: object::U64::new(e, off),
        p_vaddr: object::U64::new(e, addr),
        p_paddr: object::U64::new(e, addr),
        p_filesz: object::U64::new(e, filesz),
        p_memsz: object::U64::new(e, memsz),
        p_align: object::U64::new(e, align_),
    };
    let (pf_r, pf_w, pf_x) = (elf::PF_R.0, elf::PF_W.0, elf::PF_X.0);
    let new_loads = [
        mk(elf::PT_LOAD, pf_r, 0, ro_addr, ro_size, ro_size, max_align),
        mk(
            elf::PT_LOAD,
            pf_r | pf_w,
            rw_start,
            rw_addr,
            rw_file_end - rw_start,
            counters_addr + counters_size - rw_addr,
            PAGE,
        ),
        mk(elf::PT_LOAD, pf_r | pf_x, text_start, text_place.addr, text_end - text_start, text_end - text_start, PAGE),
    ];
    let last_load = phdrs.iter().rposition(|p| p.p_type(e) == elf::PT_LOAD).unwrap();
    let mut new_phdrs: Vec<Phdr> = Vec::with_capacity(new_phnum);
    for (i, p) in phdrs.iter().enumerate() {
        let mut p = *p;
        let t = p.p_type(e);
        if t == elf::PT_PHDR {
            p = mk(elf::PT_PHDR, pf_r, phdr_place.off, phdr_place.addr, phdr_place.size, phdr_place.size, 8);
        } else if t == elf::PT_DYNAMIC {
            let (o, a_, sz) = (dynamic_place.off, dynamic_place.addr, dynamic_place.size);
            p = mk(elf::PT_DYNAMIC, pf_r | pf_w, o, a_, sz, sz, 8);
        } else if p.p_filesz(e) > 0 || p.p_offset(e) > 0 {
            p.p_offset.set(e, p.p_offset(e) + shift);
        }
        new_phdrs.push(p);
        if i == last_load {
            new_phdrs.extend_from_slice(&new_loads);
        }
    }
    debug_assert_eq!(new_phdrs.len(), new_phnum);
    let ph_at = phdr_place.off as usize;
    for (k, p) in new_phdrs.iter().enumerate() {
        head[ph_at + k * 56..ph_at + (k + 1) * 56].copy_from_slice(bytes_of(p));
    }

    // Section headers (the original ones shifted, the moved tables
    // repointed, the new sections appended) and a new .shstrtab.
    let header_raw = elf.file.elf_header();
    let shstrndx = usize::from(header_raw.e_shstrndx.get(e).0);
    let old_shstrtab = elf.sections.get(shstrndx).map(|s| s.data).unwrap_or(&[]);
    let mut shstrtab = old_shstrtab.to_vec();
    let mut name = |n: &str| -> u32 {
        let o = shstrtab.len() as u32;
        shstrtab.extend_from_slice(n.as_bytes());
        shstrtab.push(0);
        o
    };
    let new_names =
        [name(layout::SEC_SITES), name(layout::SEC_DATA), name(layout::SEC_COUNTERS), name(layout::SEC_TEXT)];
    let shstrtab_place = region.put(&shstrtab, 1);

    let old_shdrs: &[Shdr] = {
        let shoff = header_raw.e_shoff.get(e) as usize;
        let n = elf.sections.len();
        slice_from_all_bytes(&data[shoff..shoff + n * 64]).map_err(|_| Error::malformed("section headers"))?
    };
    let mut shdrs: Vec<Shdr> = old_shdrs.to_vec();
    let repoint = |sh: &mut Shdr, p: &Placed| {
        sh.sh_addr.set(e, p.addr);
        sh.sh_offset.set(e, p.off);
        sh.sh_size.set(e, p.size);
    };
    for (i, sh) in shdrs.iter_mut().enumerate() {
        if i == 0 {
            continue;
        }
        sh.sh_offset.set(e, sh.sh_offset.get(e).wrapping_add(shift));
        let addr = sh.sh_addr.get(e);
        let t = sh.sh_type.get(e);
        if addr == 0 {
            continue;
        }
        if t == elf::SHT_DYNSYM && addr == symtab_addr {
            repoint(sh, &dynsym_place);
            if u64::from(sh.sh_info.get(e)) > insert_at {
                sh.sh_info.set(e, sh.sh_info.get(e) + 1);
            }
        } else if t == elf::SHT_STRTAB && addr == strtab_addr {
            repoint(sh, &dynstr_place);
        } else if t == elf::SHT_GNU_VERSYM && Some(addr) == versym_addr {
            repoint(sh, versym_place.as_ref().unwrap());
        } else if t == elf::SHT_GNU_HASH && Some(addr) == gnu_hash_addr {
            repoint(sh, gnu_hash_place.as_ref().unwrap());
        } else if t == elf::SHT_HASH && Some(addr) == hash_addr {
            repoint(sh, hash_place.as_ref().unwrap());
        } else if t == elf::SHT_RELA && Some(addr) == rela_addr {
            repoint(sh, &rela_place);
        } else if t == elf::SHT_RELA && Some(addr) == jmprel_addr && !jmprel_inside {
            repoint(sh, jmprel_place.as_ref().unwrap());
        } else if t == elf::SHT_DYNAMIC {
            repoint(sh, &dynamic_place);
        }
    }
    // Sections now elsewhere in memory: (index, old address, new address).
    let moved: Vec<(usize, u64, u64)> = old_shdrs
        .iter()
        .zip(&shdrs)
        .enumerate()
        .filter(|(_, (o, n))| o.sh_addr.get(e) != n.sh_addr.get(e))
        .map(|(i, (o, n))| (i, o.sh_addr.get(e), n.sh_addr.get(e)))
        .collect();
    if let Some(sh) = shdrs.get_mut(shstrndx) {
        sh.sh_offset.set(e, shstrtab_place.off);
        sh.sh_size.set(e, shstrtab_place.size);
    }
    let mksec = |name: u32, t: elf::SectionType, flags: u64, p: &Placed, align_: u64| Shdr {
        sh_name: object::U32::new(e, name),
        sh_type: object::U32::new(e, t),
        sh_flags: object::U64::new(e, elf::SectionFlags(flags)),
        sh_addr: object::U64::new(e, p.addr),
        sh_offset: object::U64::new(e, p.off),
        sh_size: object::U64::new(e, p.size),
        sh_link: object::U32::new(e, 0),
        sh_info: object::U32::new(e, 0),
        sh_addralign: object::U64::new(e, align_),
        sh_entsize: object::U64::new(e, 0),
    };
    let (shf_a, shf_x, shf_w) = (elf::SHF_ALLOC.0, elf::SHF_EXECINSTR.0, elf::SHF_WRITE.0);
    let counters_place = Placed { off: counters_off, addr: counters_addr, size: counters_size };
    shdrs.push(mksec(new_names[0], elf::SHT_PROGBITS, shf_a, &table_place, 8));
    shdrs.push(mksec(new_names[1], elf::SHT_PROGBITS, shf_a | shf_w, &control_place, 64));
    shdrs.push(mksec(new_names[2], elf::SHT_NOBITS, shf_a | shf_w, &counters_place, PAGE));
    shdrs.push(mksec(new_names[3], elf::SHT_PROGBITS, shf_a | shf_x, &text_place, 16));
    let shnum = shdrs.len();
    if shnum >= 0xff00 {
        return Err(refuse("too many sections"));
    }
    let mut shdr_bytes = Vec::with_capacity(shnum * 64);
    for sh in &shdrs {
        shdr_bytes.extend_from_slice(bytes_of(sh));
    }
    let shdr_place = region.put(&shdr_bytes, 8);

    // The ELF header: the original with the tables' new places.
    let out = &mut head;
    out[..64].copy_from_slice(&data[..64]);
    out[32..40].copy_from_slice(&phdr_place.off.to_le_bytes());
    out[40..48].copy_from_slice(&shdr_place.off.to_le_bytes());
    out[56..58].copy_from_slice(&(new_phnum as u16).to_le_bytes());
    out[60..62].copy_from_slice(&(shnum as u16).to_le_bytes());

    // Symbols that name a moved table follow it: the linker's _DYNAMIC
    // (its address, and its size where the linker gave one, as gold does)
    // and the section symbols of the moved sections, in .symtab (fixups of
    // the original) and in the new .dynsym.
    let old_dynamic_addr = dyn_ph.p_vaddr(e);
    let new_dynamic_size = dynamic_place.size;
    let follow = |sym: &Sym, strtab: &[u8]| -> Option<(u64, Option<u64>)> {
        if sym.st_value.get(e) == old_dynamic_addr && c_str(strtab, sym.st_name.get(e)) == b"_DYNAMIC" {
            let size = (sym.st_size.get(e) != 0).then_some(new_dynamic_size);
            return Some((dynamic_place.addr, size));
        }
        if sym.st_type() == elf::STT_SECTION {
            let shndx = usize::from(sym.st_shndx.get(e).0);
            if let Some(&(_, old, new)) = moved.iter().find(|m| m.0 == shndx) {
                return Some((new.wrapping_add(sym.st_value.get(e).wrapping_sub(old)), None));
            }
        }
        None
    };
    let mut fixups = Vec::new();
    if let Some(symtab) = elf.sections.iter().find(|s| s.sh_type == elf::SHT_SYMTAB.0) {
        let strtab = elf.sections.get(old_shdrs[symtab.index].sh_link.get(e) as usize).map_or(&[][..], |s| s.data);
        let syms: &[Sym] = slice_from_all_bytes(&symtab.data[..symtab.data.len() / 24 * 24]).unwrap_or(&[]);
        for (i, sym) in syms.iter().enumerate() {
            if let Some((value, size)) = follow(sym, strtab) {
                let at = symtab.offset.0 + i as u64 * 24;
                fixups.push((at + 8, value.to_le_bytes()));
                if let Some(size) = size {
                    fixups.push((at + 16, size.to_le_bytes()));
                }
            }
        }
    }
    let new_syms: &[Sym] = slice_from_all_bytes(&syms).unwrap_or(&[]);
    for (i, sym) in new_syms.iter().enumerate() {
        if let Some((value, size)) = follow(sym, &strtab) {
            let at = dynsym_place.off as usize + i * 24;
            head[at + 8..at + 16].copy_from_slice(&value.to_le_bytes());
            if let Some(size) = size {
                head[at + 16..at + 24].copy_from_slice(&size.to_le_bytes());
            }
        }
    }

    Ok(Patched {
        head,
        original: data,
        fixups,
        tail: region.bytes,
        sites: n_sites - skipped.len(),
        skipped,
        text_size: text_place.size,
        table_size: table_len as u64,
        counters_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Cursor, Read, Seek, SeekFrom, Write};

    /// A writer that records which byte ranges were written.
    struct Recorder {
        inner: Cursor<Vec<u8>>,
        written: u64,
    }

    impl Write for Recorder {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.written += b.len() as u64;
            self.inner.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Seek for Recorder {
        fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
            self.inner.seek(to)
        }
    }

    #[test]
    fn sparse_writer_skips_zero_blocks_and_keeps_bytes() {
        // An original of 64 KiB: zeros but for a few bytes, a fixup inside
        // a zero block, and head and tail of odd lengths.
        let mut original = vec![0u8; 64 << 10];
        original[5000] = 1;
        original[40_000] = 2;
        let p = Patched {
            head: vec![7u8; 4096 + 100],
            original: &original,
            fixups: vec![(20_000, [9; 8])],
            tail: vec![0u8; 5000],
            sites: 0,
            skipped: vec![],
            text_size: 0,
            table_size: 0,
            counters_size: 0,
        };
        let mut r = Recorder { inner: Cursor::new(Vec::new()), written: 0 };
        let len = p.write_sparse(&mut r).unwrap();
        let dense = p.to_vec();
        assert_eq!(len, dense.len() as u64);
        let mut got = r.inner.into_inner();
        got.resize(len as usize, 0); // set_len
        assert!(got == dense, "same bytes as the dense writer");
        // Written: the head's 2 blocks (the second shared with the
        // original) and the 3 blocks holding a non-zero byte; the rest,
        // blocks spanning pieces and the trailing partial block included,
        // are holes.
        assert_eq!(r.written, 5 * 4096);
        let mut c = Cursor::new(got);
        let mut b = [0u8; 1];
        c.seek(SeekFrom::Start(4196 + 20_000)).unwrap();
        c.read_exact(&mut b).unwrap();
        assert_eq!(b[0], 9);
    }
}
