//! Static programs: no dynamic linker loads a runtime there, so the
//! patched file carries one. The static runtime
//! (`layout::static_host::FILE_NAME`, built with a C library of its own
//! and needing nothing at load time) is copied in as segments of its own
//! above the new ones and relocated here, at patch time.
//!
//! * Its thread-local block goes in front of the program's: the new
//!   PT_TLS image is the runtime's, padding, then the program's, so every
//!   offset from the thread pointer the program's linker computed stays
//!   right (x86-64 places the executable's block just below the thread
//!   pointer, offsets negative from its end), and the C library gives
//!   every thread both.
//! * The entry point goes to a stub that records the entry stack pointer
//!   and the load bias for the runtime (and, in a position-independent
//!   program, adds the bias to the runtime's pointers), then continues at
//!   the program's entry.
//! * The first initializer (`.init_array[0]`) becomes the module's init
//!   stub, which registers the module with the runtime once the C library
//!   has set up the thread pointer, then continues to the original
//!   initializer: the runtime starts before the program's initializers,
//!   as it does in a dynamic program.
//! * The last destructor to run (`.fini_array[0]`) becomes a stub that
//!   does the runtime's work at exit, then continues to the original.

use crate::bytes::{align, u64_at};
use crate::elf::Elf;
use crate::error::{Error, ErrorKind, Location, Result};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use alloctramp_trampolines::layout::{self, static_host};
use object::LittleEndian as LE;
use object::elf;
use object::read::elf::{Dyn as _, ProgramHeader as _};

/// A PT_TLS segment's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tls {
    pub vaddr: u64,
    pub filesz: u64,
    pub memsz: u64,
    pub align: u64,
}

/// A word of an initializer or destructor array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub addr: Vaddr,
    /// Where its value is in the input: the word, or in a
    /// position-independent program the addend of its RELATIVE relocation.
    pub value_at: FileOffset,
    /// The function it holds.
    pub target: u64,
}

impl Slot {
    /// The input's bytes that make it hold `f` (offset, new bytes).
    pub fn rewrite(&self, f: u64) -> (u64, [u8; 8]) {
        (self.value_at.0, f.to_le_bytes())
    }
}

/// What the patcher needs of a static program.
#[derive(Clone, Debug)]
pub struct Program {
    /// Its PT_TLS and that program header's index.
    pub tls: Option<(usize, Tls)>,
    pub init: Slot,
    pub fini: Slot,
    pub entry: u64,
    /// The C library's fork-handler registration (0: none linked).
    pub atfork: u64,
    /// The C library's first real-time signal.
    pub sigrtmin: u64,
    /// Position-independent (`-static-pie`).
    pub pie: bool,
    /// The program's unwinder functions the runtime's personality routine
    /// calls ([`UNWINDER`]; 0: not linked, and then nothing unwinds).
    pub unwinder: [u64; 4],
    /// Without a registration function (musl without `pthread_atfork`):
    /// `fork`'s calls of the empty `__fork_handler` (see
    /// [`fork_handler_calls`]), which the patched file points at the
    /// runtime's fork handler.
    pub fork_calls: Vec<u64>,
}

/// The unwinder's functions the runtime's personality routine calls, in
/// the order of their host-block words (`static_host::UNWINDER`).
pub const UNWINDER: [&str; 4] =
    ["_Unwind_GetLanguageSpecificData", "_Unwind_GetIP", "_Unwind_GetRegionStart", "_Unwind_GetCFA"];

fn refuse(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Unsupported, Location::None, what)
}

/// Whether `elf` is a static program: an executable no dynamic linker
/// loads (no PT_INTERP): without PT_DYNAMIC, or position-independent
/// (`-static-pie`: DF_1_PIE, nothing needed), relocating itself.
pub fn is_static(elf: &Elf) -> bool {
    let e = LE;
    let phdrs = elf.file.elf_program_headers();
    if phdrs.iter().any(|p| p.p_type(e) == elf::PT_INTERP) {
        return false;
    }
    let exec = elf.file.elf_header().e_type.get(e) == elf::ET_EXEC;
    if !phdrs.iter().any(|p| p.p_type(e) == elf::PT_DYNAMIC) {
        return exec;
    }
    // (An executable with a dynamic table and nothing to load: `-static
    // -rdynamic`.)
    is_static_pie(elf) || exec && dynamic_value(elf, elf::DT_NEEDED.0).is_none()
}

/// A dynamic entry's value.
fn dynamic_value(elf: &Elf, tag: i64) -> Option<u64> {
    let e = LE;
    let table = elf.file.elf_dynamic_table().ok()?;
    let dynamics = table.dynamics();
    let mut entries = dynamics.iter().take_while(|d| d.d_tag(e) != elf::DT_NULL);
    entries.find(|d| d.d_tag(e).0 == tag).map(|d| d.d_val(e))
}

/// The addresses packed relative relocations (DT_RELR, DT_RELRSZ: tags 36
/// and 35) fill: each holds its addend in the file.
fn packed_relative(elf: &Elf) -> Vec<u64> {
    let (Some(at), Some(size)) = (dynamic_value(elf, 36), dynamic_value(elf, 35)) else { return Vec::new() };
    let Some(words) = elf.bytes_at(at, size as usize) else { return Vec::new() };
    let mut out = Vec::new();
    let mut next = 0u64;
    for w in words.chunks_exact(8).filter_map(|w| u64_at(w, 0)) {
        if w & 1 == 0 {
            out.push(w);
            next = w.wrapping_add(8);
        } else {
            for bit in 1..64 {
                if w >> bit & 1 != 0 {
                    out.push(next.wrapping_add((bit - 1) * 8));
                }
            }
            next = next.wrapping_add(63 * 8);
        }
    }
    out
}

fn is_static_pie(elf: &Elf) -> bool {
    let e = LE;
    let Ok(table) = elf.file.elf_dynamic_table() else { return false };
    let dynamics = table.dynamics();
    let entries = || dynamics.iter().take_while(|d| d.d_tag(e) != elf::DT_NULL);
    elf.file.elf_header().e_type.get(e) == elf::ET_DYN
        && !entries().any(|d| d.d_tag(e) == elf::DT_NEEDED)
        && entries().any(|d| d.d_tag(e) == elf::DT_FLAGS_1 && d.d_val(e) & elf::DF_1_PIE.0 != 0)
}

/// The RELATIVE relocations of a position-independent program: target
/// address -> (file offset of the addend, addend).
fn relative_addends(elf: &Elf) -> std::collections::HashMap<u64, (u64, u64)> {
    let mut m = std::collections::HashMap::new();
    for s in elf.sections.iter().filter(|s| s.sh_type == elf::SHT_RELA.0) {
        for (k, r) in s.data.chunks_exact(24).enumerate() {
            let word = |i: usize| u64_at(r, i as u64 * 8).unwrap_or(0);
            if word(1) & 0xffff_ffff == u64::from(elf::R_X86_64_RELATIVE.0) {
                m.insert(word(0), (s.offset.0 + k as u64 * 24 + 16, word(2)));
            }
        }
    }
    m
}

fn slot(elf: &Elf, section: &str, relative: &std::collections::HashMap<u64, (u64, u64)>) -> Result<Slot> {
    let s = elf.section_by_name(section).filter(|s| s.size >= 8 && s.data.len() >= 8).ok_or_else(|| {
        refuse(format!(
            "a static program with no {section} entry: the runtime it carries starts from the first initializer and \
             finishes at the last destructor"
        ))
    })?;
    // A position-independent program's word is filled by its relocation
    // (RELA: the addend; RELR: the word itself, plus the bias).
    let (value_at, target) = match relative.get(&s.addr.0) {
        Some(&(at, addend)) => (FileOffset(at), addend),
        None => (s.offset, u64_at(s.data, 0).unwrap_or(0)),
    };
    if target == 0 || target == u64::MAX {
        return Err(Error::new(
            ErrorKind::Unsupported,
            Location::Both(s.offset, s.addr),
            format!("{section}[0] holds {target:#x}, not a function"),
        ));
    }
    Ok(Slot { addr: s.addr, value_at, target })
}

impl Program {
    pub fn read(elf: &Elf) -> Result<Program> {
        let e = LE;
        let tls = elf.file.elf_program_headers().iter().enumerate().find(|(_, p)| p.p_type(e) == elf::PT_TLS).map(
            |(i, p)| {
                let t =
                    Tls { vaddr: p.p_vaddr(e), filesz: p.p_filesz(e), memsz: p.p_memsz(e), align: p.p_align(e).max(1) };
                (i, t)
            },
        );
        if let Some((i, t)) = tls
            && (!t.align.is_power_of_two()
                || t.align > 1 << 20
                || t.filesz > t.memsz
                || t.memsz > 1 << 40
                || elf.bytes_at(t.vaddr, t.filesz as usize).is_none() && t.filesz > 0)
        {
            let phoff = elf.file.elf_header().e_phoff.get(e);
            return Err(Error::new(
                ErrorKind::Malformed,
                Location::Offset(FileOffset(phoff + i as u64 * 56)),
                format!(
                    "program header {i}: PT_TLS (align {:#x}, file size {:#x}, memory size {:#x}) is not one a C library could set up",
                    t.align, t.filesz, t.memsz
                ),
            ));
        }
        let symbol = |names: &[&str]| {
            let syms = elf.symbols(false);
            names.iter().find_map(|n| syms.iter().find(|s| s.defined && s.is_func && s.name == *n)).map(|s| s.value)
        };
        // The C library's functions the runtime needs are found by name.
        if elf.symbols(false).is_empty() {
            return Err(refuse(
                "a static program without a symbol table (.symtab): its allocator and its C library's fork \
                 handling cannot be found",
            ));
        }
        let musl = symbol(&["__init_libc"]).is_some();
        let atfork = symbol(&["__register_atfork", "pthread_atfork"]).unwrap_or(0);
        let fork_calls = match (
            atfork,
            symbol(&["fork"]),
            elf.symbols(false).iter().find(|s| s.defined && s.name == "__fork_handler"),
        ) {
            (0, Some(_), Some(handler)) => fork_handler_calls(elf, handler.value)?,
            _ => Vec::new(),
        };
        let pie = is_static_pie(elf);
        let relative = if pie { relative_addends(elf) } else { Default::default() };
        Ok(Program {
            tls,
            init: slot(elf, ".init_array", &relative)?,
            fini: slot(elf, ".fini_array", &relative)?,
            pie,
            entry: elf.file.elf_header().e_entry.get(e),
            atfork,
            sigrtmin: if musl { 35 } else { 34 },
            fork_calls,
            unwinder: UNWINDER.map(|n| symbol(&[n]).unwrap_or(0)),
        })
    }
}

/// The direct calls of `handler` in `fork`: musl's `__fork_handler(-1)`
/// and `__fork_handler(!ret)` around the fork, and, on the path for a
/// process that has had threads, `__ldso_atfork`'s, the same empty
/// function, nested inside them (the runtime's handler runs once per
/// fork: at the first call before, at the first call after).
fn fork_handler_calls(elf: &Elf, handler: u64) -> Result<Vec<u64>> {
    let fork = elf.symbols(false).iter().find(|s| s.defined && s.is_func && s.name == "fork" && s.size > 0);
    let Some(fork) = fork else { return Ok(Vec::new()) };
    let Some(code) = elf.bytes_at(fork.value, fork.size as usize) else { return Ok(Vec::new()) };
    let mut decoder = iced_x86::Decoder::with_ip(64, code, fork.value, iced_x86::DecoderOptions::NONE);
    let calls: Vec<u64> = std::iter::from_fn(|| decoder.can_decode().then(|| decoder.decode()))
        .filter(|i| i.code() == iced_x86::Code::Call_rel32_64 && i.near_branch_target() == handler)
        .map(|i| i.ip())
        .collect();
    match calls.len() {
        2.. => Ok(calls),
        _ => Err(Error::new(
            ErrorKind::Unsupported,
            Location::Vaddr(Vaddr(fork.value)),
            "fork calls __fork_handler fewer than twice: a forked child could not get its own counters file",
        )),
    }
}

/// The `call rel32` at `at` pointed at `target`: its file offset and new
/// bytes.
pub fn redirect_call(elf: &Elf, at: u64, target: u64) -> Result<(u64, [u8; 5])> {
    let bad = || Error::new(ErrorKind::Malformed, Location::Vaddr(Vaddr(at)), "a call to redirect is not in the file");
    let offset = elf.offset_of(Vaddr(at)).ok_or_else(bad)?;
    let rel = i32::try_from(target.wrapping_sub(at.wrapping_add(5)) as i64).map_err(|_| {
        Error::new(ErrorKind::Unsupported, Location::Vaddr(Vaddr(at)), "the runtime is out of a call's reach")
    })?;
    let mut w = [0xe8; 5];
    w[1..].copy_from_slice(&rel.to_le_bytes());
    Ok((offset.0, w))
}

/// Byte edits of the input as the words the writer takes (offset, 8
/// bytes, no two overlapping): each word from an edit's start, with the
/// input's bytes where nothing is edited.
pub fn words_of(elf: &Elf, edits: Vec<(u64, [u8; 5])>) -> Vec<(u64, [u8; 8])> {
    let mut bytes = std::collections::BTreeMap::new();
    for (at, b) in edits {
        for (i, &x) in b.iter().enumerate() {
            bytes.insert(at.saturating_add(i as u64), x);
        }
    }
    let mut out = Vec::new();
    let mut next = 0;
    for &at in bytes.keys() {
        if at < next {
            continue;
        }
        let mut w = [0u8; 8];
        for (i, x) in w.iter_mut().enumerate() {
            let o = at.saturating_add(i as u64);
            *x = bytes.get(&o).copied().or_else(|| elf.data.get(o as usize).copied()).unwrap_or(0);
        }
        out.push((at, w));
        next = at.saturating_add(8);
    }
    out
}

/// The static runtime, checked.
pub struct Runtime<'a> {
    data: &'a [u8],
    /// Its PT_LOADs: (file offset, address, file size, memory size, flags).
    loads: Vec<(u64, u64, u64, u64, u32)>,
    tls: Option<Tls>,
    relocations: Vec<Reloc>,
    /// Link-time addresses of its API table, host block and exit function.
    pub api: u64,
    pub host: u64,
    pub exit: u64,
    pub fork_handler: u64,
    /// Bytes of the file its PT_LOADs map.
    pub image_len: u64,
    /// The end of its highest segment in memory.
    pub mem_end: u64,
}

struct Reloc {
    offset: u64,
    kind: u32,
    /// The symbol's value if it has one and it is defined; `Some(None)`:
    /// an undefined weak symbol.
    symbol: Option<Option<u64>>,
    addend: i64,
}

fn bad_runtime(what: impl Into<String>) -> Error {
    Error::new(
        ErrorKind::Request,
        Location::None,
        format!("the static runtime ({}): {}", static_host::FILE_NAME, what.into()),
    )
}

impl<'a> Runtime<'a> {
    pub fn parse(data: &'a [u8]) -> Result<Runtime<'a>> {
        let elf = Elf::parse(data).map_err(|e| bad_runtime(e.what))?;
        let e = LE;
        let phdrs = elf.file.elf_program_headers();
        if phdrs.iter().any(|p| p.p_type(e) == elf::PT_INTERP) {
            return Err(bad_runtime("it names a dynamic linker"));
        }
        if elf.file.elf_dynamic_table().is_ok_and(|t| t.dynamics().iter().any(|d| d.d_tag(e) == elf::DT_NEEDED)) {
            return Err(bad_runtime("it needs other libraries (DT_NEEDED)"));
        }
        let loads: Vec<_> = phdrs
            .iter()
            .filter(|p| p.p_type(e) == elf::PT_LOAD)
            .map(|p| (p.p_offset(e), p.p_vaddr(e), p.p_filesz(e), p.p_memsz(e), p.p_flags(e).0))
            .collect();
        if loads.is_empty() || loads.iter().any(|l| l.0 % layout::PAGE != l.1 % layout::PAGE) {
            return Err(bad_runtime("its segments are not page-congruent"));
        }
        let image_len = loads.iter().map(|l| l.0 + l.2).max().unwrap_or(0);
        let mem_end = loads.iter().map(|l| l.1 + l.3).max().unwrap_or(0);
        if image_len > data.len() as u64 {
            return Err(bad_runtime("its segments reach past the file's end"));
        }
        let tls = phdrs.iter().find(|p| p.p_type(e) == elf::PT_TLS).map(|p| Tls {
            vaddr: p.p_vaddr(e),
            filesz: p.p_filesz(e),
            memsz: p.p_memsz(e),
            align: p.p_align(e).max(1),
        });
        if tls.is_some_and(|t| t.align > 8) {
            return Err(bad_runtime("its thread-local block needs more than 8-byte alignment"));
        }
        let syms = elf.symbols(true);
        let find = |name: &str| {
            syms.iter()
                .find(|s| s.defined && s.name == name)
                .map(|s| s.value)
                .ok_or_else(|| bad_runtime(format!("no symbol {name}")))
        };
        let (api, host, exit) =
            (find(layout::RUNTIME_SYMBOL)?, find(static_host::SYMBOL)?, find(static_host::EXIT_SYMBOL)?);
        let fork_handler = find(static_host::FORK_HANDLER_SYMBOL)?;
        let relocations = elf
            .dynamic_relocations()
            .into_iter()
            .map(|r| Reloc {
                offset: r.offset.0,
                kind: r.r_type,
                symbol: r.symbol.map(|n| syms.iter().find(|s| s.name == n && s.defined).map(|s| s.value)),
                addend: r.addend,
            })
            .collect();
        Ok(Runtime { data, loads, tls, relocations, api, host, exit, fork_handler, image_len, mem_end })
    }

    /// Its PT_LOADs.
    pub fn load_count(&self) -> usize {
        self.loads.len()
    }

    fn file_offset(&self, addr: u64) -> Option<u64> {
        self.loads.iter().find(|l| addr >= l.1 && addr + 8 <= l.1 + l.2).map(|l| l.0 + (addr - l.1))
    }
}

/// The static runtime placed in a program: where, and the bytes.
#[derive(Clone, Debug)]
pub struct Placed {
    /// The address its address 0 goes to (page-aligned).
    pub base: u64,
    /// Its file image in the output (the file offset is page-aligned).
    pub image: crate::plan::Region,
    pub bytes: Vec<u8>,
    /// Its PT_LOADs in the output.
    pub segments: Vec<crate::plan::Segment>,
    /// The new PT_TLS, its image in the output, and the program header it
    /// replaces (None: a new one).
    pub tls: Tls,
    pub tls_bytes: Vec<u8>,
    pub tls_phdr: Option<usize>,
    /// Where the program's thread-local block starts in the new one, and
    /// where its image was (its sections and symbols follow).
    pub tls_shift: u64,
    pub old_tls: Option<Tls>,
    /// The words the entry stub adds the load bias to (a position-
    /// independent program only).
    pub fixups: Vec<u64>,
    /// Run-time addresses in the runtime.
    pub api: u64,
    pub host: u64,
    pub exit: u64,
}

/// The merged thread-local image.
#[derive(Clone, Debug, Default)]
pub struct MergedTls {
    /// Its PT_TLS (the address is the caller's to set).
    pub tls: Tls,
    pub bytes: Vec<u8>,
    /// The runtime block's offset from the thread pointer.
    pub offset: i64,
    /// Offsets in `bytes` of words a position-independent program's
    /// relocations fill (each holds its addend; the entry stub adds the
    /// bias).
    pub relocated: Vec<u64>,
    /// Where the program's block starts in the merged one (`k`).
    pub shift: u64,
}

/// The merged thread-local image: the runtime's block, padding to `k`,
/// then the program's.
pub fn merge_tls(elf: &Elf, program: &Program, rt: &Runtime) -> Result<MergedTls> {
    let r = rt.tls.unwrap_or(Tls { vaddr: 0, filesz: 0, memsz: 0, align: 8 });
    let rt_image = rt
        .file_offset(r.vaddr)
        .and_then(|o| rt.data.get(o as usize..(o + r.filesz) as usize))
        .or_else(|| (r.filesz == 0).then_some(&[][..]))
        .ok_or_else(|| bad_runtime("its thread-local image is not in the file"))?;
    match program.tls {
        None => {
            // The whole block in the file (its zeros too), so that a section
            // covers all of it: `strip` sizes PT_TLS by its sections.
            let tls = Tls { vaddr: 0, filesz: r.memsz, memsz: r.memsz, align: r.align.max(8) };
            let offset = -(align(r.memsz, tls.align) as i64);
            let mut bytes = rt_image.to_vec();
            bytes.resize(r.memsz as usize, 0);
            Ok(MergedTls { tls, bytes, offset, relocated: Vec::new(), shift: 0 })
        }
        Some((_, p)) => {
            // `k`: a multiple of both alignments, so the program's block
            // keeps its alignment and every offset, and the runtime's
            // starts aligned (`Program::read` bounds the sizes).
            let old = align(p.memsz, p.align);
            let k = align(old + r.memsz, p.align.max(r.align)) - old;
            let image = elf.bytes_at(p.vaddr, p.filesz as usize).unwrap_or_default();
            let mut bytes = rt_image.to_vec();
            bytes.resize(k as usize, 0);
            bytes.extend_from_slice(image);
            let mut relocated = Vec::new();
            if program.pie {
                // The word's offset in the merged image, if the program's
                // image holds all of it.
                let inside = |at: u64| {
                    at.checked_sub(p.vaddr).filter(|&d| d.checked_add(8).is_some_and(|e| e <= p.filesz)).map(|d| k + d)
                };
                for (at, (_, addend)) in relative_addends(elf) {
                    if let Some(o) = inside(at)
                        && let Some(w) = bytes.get_mut(o as usize..o as usize + 8)
                    {
                        w.copy_from_slice(&addend.to_le_bytes());
                        relocated.push(o);
                    }
                }
                // (Packed ones' addends are the words themselves, copied.)
                relocated.extend(packed_relative(elf).into_iter().filter_map(inside));
                relocated.sort_unstable();
                relocated.dedup();
                // Any other relocation of the image (IRELATIVE, symbolic)
                // would apply to the original only.
                if let Some(r) =
                    elf.dynamic_relocations().iter().find(|r| r.r_type != 8 && inside(r.offset.0).is_some())
                {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        Location::Vaddr(r.offset),
                        format!("a relocation of type {} in the thread-local image: not supported", r.r_type),
                    ));
                }
            }
            let tls = Tls { vaddr: 0, filesz: k + p.filesz, memsz: k + p.memsz, align: p.align };
            Ok(MergedTls { tls, bytes, offset: -((old + k) as i64), relocated, shift: k })
        }
    }
}

/// Relocates the runtime for `base`, with its thread-local block at
/// `tls_offset` from the thread pointer, and fills its host block.
/// Returns the image and, for a position-independent program (`pie`),
/// the addresses the entry stub must add the load bias to.
pub fn relocate(rt: &Runtime, base: u64, tls_offset: i64, program: &Program, pie: bool) -> Result<(Vec<u8>, Vec<u64>)> {
    let mut image = rt.data[..rt.image_len as usize].to_vec();
    let mut fixups = Vec::new();
    let mut put = |image: &mut Vec<u8>, addr: u64, value: u64, biased: bool| -> Result<()> {
        let off = rt
            .file_offset(addr)
            .ok_or_else(|| bad_runtime(format!("a relocation at {addr:#x} outside its file image")))?;
        image[off as usize..off as usize + 8].copy_from_slice(&value.to_le_bytes());
        if biased && pie {
            fixups.push(base + addr);
        }
        Ok(())
    };
    // The runtime's thread-local image is copied as it is in the file.
    if let Some(t) = rt.tls
        && rt.relocations.iter().any(|r| r.offset >= t.vaddr && r.offset < t.vaddr + t.filesz)
    {
        return Err(bad_runtime("a relocation in its thread-local image"));
    }
    for r in &rt.relocations {
        let a = r.addend as u64;
        // A symbol's value: None for no symbol (index 0), Some(None) for an
        // undefined weak one.
        let tls_value = |what: &str| match r.symbol {
            None => Ok(a),
            Some(Some(s)) => Ok(s.wrapping_add(a)),
            Some(None) => Err(bad_runtime(format!("a {what} relocation at {:#x} names an undefined symbol", r.offset))),
        };
        match elf::RelocationType(r.kind) {
            elf::R_X86_64_RELATIVE => put(&mut image, r.offset, base.wrapping_add(a), true)?,
            elf::R_X86_64_64 | elf::R_X86_64_GLOB_DAT | elf::R_X86_64_JUMP_SLOT => match r.symbol {
                None => put(&mut image, r.offset, a, false)?,
                Some(Some(s)) => put(&mut image, r.offset, base.wrapping_add(s).wrapping_add(a), true)?,
                Some(None) => put(&mut image, r.offset, 0, false)?,
            },
            elf::R_X86_64_TPOFF64 => {
                put(&mut image, r.offset, (tls_offset as u64).wrapping_add(tls_value("TPOFF64")?), false)?
            }
            // `__tls_get_addr` adds the pair's two words to the thread
            // pointer: the block's offset, and the variable's in the block.
            elf::R_X86_64_DTPMOD64 => put(&mut image, r.offset, tls_offset as u64, false)?,
            elf::R_X86_64_DTPOFF64 => put(&mut image, r.offset, tls_value("DTPOFF64")?, false)?,
            other => {
                return Err(bad_runtime(format!("relocation type {} at {:#x} is not supported", other.0, r.offset)));
            }
        }
    }
    let word = |w: usize| rt.host + 8 * w as u64;
    put(&mut image, word(static_host::ATFORK), program.atfork, program.atfork != 0)?;
    put(&mut image, word(static_host::SIGRTMIN), program.sigrtmin, false)?;
    for (k, &f) in program.unwinder.iter().enumerate() {
        put(&mut image, word(static_host::UNWINDER + k), f, f != 0)?;
    }
    Ok((image, fixups))
}

/// The runtime's segments at `base`, their file bytes at `offset`.
pub fn segments(rt: &Runtime, base: u64, offset: u64) -> Vec<crate::plan::Segment> {
    rt.loads
        .iter()
        .map(|&(off, vaddr, filesz, memsz, flags)| crate::plan::Segment {
            flags,
            offset: FileOffset(offset + off),
            addr: Vaddr(base + vaddr),
            file_size: filesz,
            mem_size: memsz,
            align: layout::PAGE,
        })
        .collect()
}
