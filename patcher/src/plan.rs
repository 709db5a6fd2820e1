//! The plan of a patched file: where every new part goes, in the file and
//! in memory, which section headers are repointed, and what becomes of
//! every site, computed from the input before a byte is written. The
//! emitters ([`crate::emit`]) turn a plan into bytes.
//!
//! The output file is the new read-only segment (the ELF header, the
//! program headers, the site table, the grown dynamic tables), the
//! executable one (init and fini stubs, one trampoline per site), the
//! read-write one (the new .dynamic and the control block; the counters
//! follow in memory only), then the original file, whole, at `shift`, then
//! the grown .shstrtab and the section headers. In memory the new segments
//! lie above every original one: read-only, read-write (counters
//! included), executable.
//!
//! Trampolines are generated while planning: the length of one decides
//! where the next one goes, and generating them again to emit them would
//! double the patcher's main cost. The plan keeps their code.

use crate::bytes::align;
use crate::ehframe;
use crate::elf::Elf;
use crate::error::{Error, ErrorKind, Location, Result};
use crate::scan::{Charge, Site as ScanSite};
use crate::tables::{Jmprel, Phdr, Tables};
use crate::{Analysis, SiteInfo, Via};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use alloctramp_trampolines::codegen::{self, CodegenError, TrampolineSpec};
use alloctramp_trampolines::entry::{Kind, Target};
use alloctramp_trampolines::frames;
use alloctramp_trampolines::layout::{self, PAGE, SiteForm};
use alloctramp_trampolines::template::{self, Templates};
use object::LittleEndian as LE;
use object::elf;
use object::read::elf::ProgramHeader as _;
use std::fmt;

mod dump;

/// Options for patching.
#[derive(Clone, Debug)]
pub struct PatchOptions {
    /// The path the init stub loads the runtime from with `dlopen` when
    /// no loaded module provides it (possibly with `$ORIGIN`, which the
    /// dynamic linker expands to the module's directory).
    pub runtime_path: String,
    /// Unwind rows of libraries the file needs, carried for callers
    /// capture (`deps::foreign_unwind`).
    pub foreign_unwind: Vec<layout::ForeignRows>,
    /// Leave unpatched the sites inside the file's own definitions of
    /// default entry points (a library's `operator new` calling `malloc`,
    /// its `operator delete[]` calling `operator delete`): for a process
    /// whose modules are all patched (`alloctramp run`), where the calls
    /// to those entries are counted at their own sites and the layer
    /// inside would count each allocation again.
    pub skip_allocator_layers: bool,
    /// The static runtime's bytes (`layout::static_host::FILE_NAME`), which
    /// a static program carries (see `statics`); a static program is
    /// refused without it.
    pub static_runtime: Option<Vec<u8>>,
    /// How many threads make the trampolines (at most 8): 0 for one per
    /// core, in files of 512 sites or more; the plan is the same whatever
    /// the number.
    pub threads: usize,
}

impl Default for PatchOptions {
    fn default() -> Self {
        PatchOptions {
            runtime_path: format!("$ORIGIN/{}", layout::RUNTIME_SONAME),
            foreign_unwind: Vec::new(),
            skip_allocator_layers: false,
            static_runtime: None,
            threads: 0,
        }
    }
}

/// A part of the new segments: where it is in the file and in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub offset: FileOffset,
    pub addr: Vaddr,
    pub size: u64,
}

impl Region {
    pub fn end_offset(&self) -> FileOffset {
        self.offset.offset_by(self.size)
    }
    pub fn end_addr(&self) -> Vaddr {
        self.addr.offset_by(self.size)
    }
}

/// A part of the file that no segment loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileRange {
    pub offset: FileOffset,
    pub size: u64,
}

/// A new PT_LOAD segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// PF_R, PF_W, PF_X.
    pub flags: u32,
    pub offset: FileOffset,
    pub addr: Vaddr,
    pub file_size: u64,
    pub mem_size: u64,
    pub align: u64,
}

/// The copies of the input's dynamic tables, in the read-only segment
/// (`None`: the input has no such table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copies {
    /// One symbol more than the input's, the runtime's symbol inserted at
    /// [`Tables::insert_at`].
    pub dynsym: Region,
    /// The input's strings, then the runtime's DT_NEEDED string and its
    /// symbol's name.
    pub dynstr: Region,
    pub versym: Option<Region>,
    pub gnu_hash: Option<Region>,
    /// Rebuilt for the new symbols.
    pub hash: Option<Region>,
    /// The input's RELA relocations (PLT relocations inside their range
    /// included), then the one that fills the runtime slot.
    pub rela: Region,
    /// The PLT relocations, when they are a table of their own.
    pub jmprel: Option<Region>,
}

/// A table whose section header is repointed at its copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table {
    Dynsym,
    Dynstr,
    Versym,
    GnuHash,
    Hash,
    Rela,
    Jmprel,
    Dynamic,
    /// The search table header, replaced by one that lists the
    /// trampolines' unwind entries too.
    EhFrameHdr,
}

impl Table {
    pub fn name(self) -> &'static str {
        match self {
            Table::Dynsym => ".dynsym",
            Table::Dynstr => ".dynstr",
            Table::Versym => ".gnu.version",
            Table::GnuHash => ".gnu.hash",
            Table::Hash => ".hash",
            Table::Rela => ".rela.dyn",
            Table::Jmprel => ".rela.plt",
            Table::Dynamic => ".dynamic",
            Table::EhFrameHdr => ".eh_frame_hdr",
        }
    }
}

/// A section header that is repointed at a copied table: its address,
/// offset and size become the copy's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Repoint {
    /// Index in the section header table.
    pub section: usize,
    pub table: Table,
    /// The copy.
    pub to: Region,
    /// The section's address in the input.
    pub old_addr: Vaddr,
}

/// Why a site is not patched (it stays in the site table, for the report,
/// without a trampoline).
#[derive(Clone, Debug)]
pub enum SkipReason {
    /// The instruction is shorter than the 5-byte `jmp rel32` that would
    /// send it to its trampoline.
    TooShort { len: u8 },
    /// An entry of the trampoline is out of rel32 range of the site.
    OutOfRange,
    /// The trampoline could not be generated.
    Codegen(CodegenError),
    /// A call inside an allocation wrapper that only sites reach: the
    /// wrapper's callers count what it allocates.
    InsideWrapper,
    /// Inside the file's own definition of an allocator entry point
    /// ([`PatchOptions::skip_allocator_layers`]).
    InsideAllocator,
    /// A hook in a file that unwinds through its calls, whose trampoline
    /// cannot get an unwind entry (`ehframe`).
    NoUnwind(&'static str),
    /// An entry hook whose stub cannot be made (see `crate::hooks`).
    HookStub(&'static str),
    /// Its bytes overlap those of an earlier site (by address or in the
    /// file): instructions decoded across each other in a malformed file.
    Overlaps(Vaddr),
}

impl SkipReason {
    /// Whether the site was meant to be patched (a skip worth a warning).
    pub fn is_loss(&self) -> bool {
        !matches!(self, SkipReason::InsideWrapper | SkipReason::InsideAllocator)
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::TooShort { len } => write!(f, "site instruction of {len} bytes is too short for a jump"),
            SkipReason::OutOfRange => f.write_str("trampoline out of rel32 range"),
            SkipReason::Codegen(e) => write!(f, "trampoline: {e}"),
            SkipReason::InsideWrapper => f.write_str("inside an allocation wrapper whose callers are counted"),
            SkipReason::InsideAllocator => {
                f.write_str("inside the file's own definition of an allocator entry, whose callers are counted")
            }
            SkipReason::NoUnwind(why) => write!(f, "hook without an unwind entry for its trampoline ({why})"),
            SkipReason::HookStub(why) => write!(f, "entry hook: {why}"),
            SkipReason::Overlaps(other) => write!(f, "its bytes overlap those of the site at {other}"),
        }
    }
}

/// The trampolines' unwind information: its bytes, where they go, and
/// where the new search table header is among them.
#[derive(Clone, Debug)]
pub struct EhFramePlan {
    pub region: Region,
    pub bytes: Vec<u8>,
    /// The entries (.alloctramp.eh_frame) and the header after them.
    pub entries: Region,
    pub hdr: Region,
}

/// Generated code and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Code {
    pub addr: Vaddr,
    pub offset: FileOffset,
    pub bytes: Bytes,
}

/// Code's bytes: its own, or how a trampoline's are made again from its
/// shape's template as the file is written (the plan of a large library
/// does not hold its tens of megabytes of trampolines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bytes {
    Own(Vec<u8>),
    Made(template::Made),
}

impl Default for Bytes {
    fn default() -> Bytes {
        Bytes::Own(Vec::new())
    }
}

impl From<Vec<u8>> for Bytes {
    fn from(b: Vec<u8>) -> Bytes {
        Bytes::Own(b)
    }
}

impl Bytes {
    pub fn len(&self) -> usize {
        match self {
            Bytes::Own(b) => b.len(),
            Bytes::Made(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, made if they are a template's (None: they cannot be).
    pub fn made(&self) -> Option<std::borrow::Cow<'_, [u8]>> {
        match self {
            Bytes::Own(b) => Some(std::borrow::Cow::Borrowed(b)),
            Bytes::Made(m) => m.code().map(std::borrow::Cow::Owned),
        }
    }

    /// The bytes of code the plan made itself (a stub's; a trampoline's from
    /// a template has none here).
    pub fn own(&self) -> &[u8] {
        match self {
            Bytes::Own(b) => b,
            Bytes::Made(_) => &[],
        }
    }
}

/// A site's trampoline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trampoline {
    pub code: Code,
    /// Offsets of its entries (see `layout::Site`): the drain entry of a
    /// free site (0 otherwise) and the entry that only counts.
    pub drain: u16,
    pub count: u16,
    /// The callers entry and the traced entry (0: none).
    pub callers: u16,
    pub traced: u16,
    /// `layout::site_flags`.
    pub flags: u8,
}

/// What becomes of a site.
#[derive(Clone, Debug)]
pub enum Decision {
    Patched(Trampoline),
    Skipped(SkipReason),
}

/// One site of the analysis and its decision.
#[derive(Clone, Debug)]
pub struct SitePlan {
    pub addr: Vaddr,
    pub len: u8,
    /// The instruction's first bytes (see [`crate::scan::Site::original`]).
    pub original: [u8; 8],
    pub form: SiteForm,
    /// Index in [`Plan::entries`].
    pub entry: usize,
    pub decision: Decision,
    /// An entry hook's (see `crate::hooks`): its stub, and the jump to it
    /// that replaces the function's first instructions (an offset in the
    /// input and the new bytes; the site is that jump), written only when
    /// the site is patched.
    pub hook: Option<Box<HookPlan>>,
}

/// An entry hook's stub and the function's jump to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookPlan {
    pub stub: Code,
    pub jump: (FileOffset, Vec<u8>),
}

impl SitePlan {
    /// The plan of the scan's `site`.
    fn of(site: &ScanSite, decision: Decision, hook: Option<Box<HookPlan>>) -> SitePlan {
        SitePlan {
            addr: site.vaddr,
            len: site.len,
            original: site.original,
            form: site.form,
            entry: site.entry,
            decision,
            hook,
        }
    }

    pub fn trampoline(&self) -> Option<&Trampoline> {
        match &self.decision {
            Decision::Patched(t) => Some(t),
            Decision::Skipped(_) => None,
        }
    }
}

/// The counters: `shards` shards of `stride` bytes, one cell per site in
/// each, on pages of their own with no file bytes (the runtime maps shared
/// memory over them). Their nominal file offset is in the read-write
/// segment's range, before the original file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counters {
    pub region: Region,
    pub shards: u32,
    pub stride: u64,
}

/// The site table's strings, numbered: their size decides the table's.
pub(crate) struct SiteStrings {
    pub strings: layout::Strings,
    pub module: u32,
    /// Per site: function, file, line.
    pub sites: Vec<(u32, u32, u32)>,
    /// The entry points the table lists (those a site calls; the others,
    /// such as the allocator APIs a file does not use, would only add
    /// bytes): their indices in the scan's entries, in its order.
    pub table_entries: Vec<usize>,
    /// Their display names.
    pub entries: Vec<u32>,
    /// A scan entry's index in the table (u16::MAX: not listed).
    pub entry_slot: Vec<u16>,
}

impl fmt::Debug for SiteStrings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SiteStrings").field("bytes", &self.strings.len()).finish_non_exhaustive()
    }
}

impl SiteStrings {
    fn new(a: &Analysis, foreign: &[layout::ForeignRows]) -> SiteStrings {
        let mut strings = layout::Strings::default();
        let module = strings.add(&a.module);
        let sites = a
            .info
            .iter()
            .map(|SiteInfo { function, location }| {
                let f = function.as_deref().map_or(layout::NO_STRING, |f| strings.add(&crate::symbols::demangle(f)));
                let (file, line) = location.as_ref().map_or((layout::NO_STRING, 0), |l| (strings.add(&l.file), l.line));
                (f, file, line)
            })
            .collect();
        let mut entry_slot = vec![u16::MAX; a.scan.entries.len()];
        for site in &a.scan.sites {
            if let Some(slot) = entry_slot.get_mut(site.entry) {
                *slot = 0;
            }
        }
        let table_entries: Vec<usize> = (0..entry_slot.len()).filter(|&i| entry_slot[i] == 0).collect();
        for (k, &i) in table_entries.iter().enumerate() {
            entry_slot[i] = u16::try_from(k).unwrap_or(u16::MAX);
        }
        let entries = table_entries.iter().map(|&i| strings.add(&a.scan.entries[i].display)).collect();
        if !a.unwind.is_empty() {
            for f in foreign {
                strings.add(&f.path);
            }
        }
        SiteStrings { strings, module, sites, table_entries, entries, entry_slot }
    }
}

/// Where the section name table goes, grown by the new sections' names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shstrtab {
    /// Its section (e_shstrndx), when that is a section index.
    pub section: Option<usize>,
    pub range: FileRange,
    /// Offsets of the new sections' names: `layout::SEC_SITES`,
    /// `SEC_DATA`, `SEC_COUNTERS`, `SEC_TEXT`, `SEC_EH_FRAME`.
    pub names: [u32; 5],
    /// A static program's: [`STATIC_SECTION_NAMES`] (none otherwise).
    pub static_names: Option<[u32; 3]>,
}

/// Everything about the patched file but its bytes.
#[derive(Debug)]
pub struct Plan<'a> {
    /// The module's name (for the dump).
    pub module: String,
    /// The input's dynamic tables.
    pub tables: Tables<'a>,
    /// The input's size.
    pub input_size: u64,
    /// Where the input starts in the output: every original offset grows
    /// by this (a multiple of the largest segment alignment); no original
    /// address changes.
    pub shift: u64,
    /// The new segments, in address order: read-only, read-write,
    /// executable.
    pub segments: [Segment; 3],
    /// The ELF header, at offset 0 and the read-only segment's start.
    pub ehdr: Region,
    /// The program header table: the input's entries, then the new
    /// PT_LOADs after the last PT_LOAD.
    pub phdrs: Region,
    pub phnum: usize,
    /// The site table, right after the program headers (the runtime finds
    /// it there: `layout::table_after_phdrs`).
    pub site_table: Region,
    pub copies: Copies,
    /// The stubs DT_INIT and DT_FINI point at, first in the executable
    /// segment.
    pub init: Code,
    pub fini: Code,
    /// The stubs sites' callers entries go through (callers capture):
    /// keeping the vector registers, and for calls of default entries
    /// through the PLT or GOT, not (`codegen::capture_stub`).
    pub capture: Code,
    pub capture_plain: Code,
    /// The stub through which trampolines in preserve mode call the
    /// runtime (`codegen::vector_stub`).
    pub vectors: Code,
    /// The wide-size stub, which free trampolines call for a record of
    /// size 0 (`codegen::wide_stub`).
    pub wide: Code,
    /// The trace stub, which traced entries call to record an event
    /// (`codegen::trace_stub`).
    pub trace: Code,
    /// All of the executable segment's code (.alloctramp.text).
    pub text: Region,
    /// The trampolines' unwind entries and the new .eh_frame_hdr that
    /// PT_GNU_EH_FRAME points at, in the executable segment (`ehframe`).
    pub eh_frame: Option<EhFramePlan>,
    /// The new .dynamic: the input's entries, the runtime's DT_NEEDED after
    /// the last DT_NEEDED, DT_INIT and DT_FINI if the input had none, and
    /// DT_NULL.
    pub dynamic: Region,
    /// The module control block (.alloctramp.data), whose first word is the
    /// runtime's GOT slot.
    pub control: Region,
    pub counters: Counters,
    /// Where the init stub loads the runtime from ([`PatchOptions::runtime_path`]).
    pub runtime_path: String,
    pub shstrtab: Shstrtab,
    /// The section header table: the input's, then the 4 new sections.
    pub shdrs: FileRange,
    pub shnum: usize,
    pub repoints: Vec<Repoint>,
    /// Entry points' display names (every site names one).
    pub entries: Vec<String>,
    /// In the analysis's order.
    pub sites: Vec<SitePlan>,
    /// How many threads made the trampolines (1: one site after another).
    pub threads: usize,
    pub(crate) strings: SiteStrings,
    /// Libraries' unwind rows the site table carries (none when the file
    /// has no rows of its own).
    pub(crate) foreign_unwind: Vec<layout::ForeignRows>,
    /// A static program's runtime and hooks (`statics`); then `init` is
    /// the hook in `.init_array[0]` and `fini` the one in `.fini_array[0]`,
    /// and the file gets no dynamic tables.
    pub statics: Option<StaticPlan>,
}

/// What a static program gets (see `statics`).
#[derive(Clone, Debug)]
pub struct StaticPlan {
    pub runtime: crate::statics::Placed,
    /// The entry stub (the new entry point), in the executable segment.
    pub entry: Code,
    /// The new PT_TLS image, in the read-write segment after the control
    /// block (a position-independent program's relocations of its
    /// thread-local image apply to the copy there: the entry stub's).
    pub tls_image: Region,
    /// Words of the input rewritten: `.init_array[0]` and `.fini_array[0]`
    /// (offset in the input, new value).
    pub words: Vec<(u64, [u8; 8])>,
    /// Section headers for what it adds besides the usual new sections, so
    /// that `strip` and `objcopy` keep it: the runtime's segments, its
    /// thread-local block, and a new search table.
    pub sections: Vec<StaticSection>,
}

/// Names of [`StaticSection`]s, after the usual new sections' names.
pub const STATIC_SECTION_NAMES: [&str; 3] = [".alloctramp.runtime", ".alloctramp.tdata", ".eh_frame_hdr"];

/// A section header a static program gets (see [`StaticPlan::sections`]).
#[derive(Clone, Copy, Debug)]
pub struct StaticSection {
    /// Index in [`STATIC_SECTION_NAMES`].
    pub name: usize,
    pub sh_type: u32,
    pub flags: u64,
    pub region: Region,
    pub align: u64,
}

/// The sections of [`StaticPlan::sections`].
fn static_sections(sp: &StaticPlan, eh_hdr: Option<Region>) -> Vec<StaticSection> {
    let (a, w, x) = (elf::SHF_ALLOC.0, elf::SHF_WRITE.0, elf::SHF_EXECINSTR.0);
    let mut out = Vec::new();
    for s in &sp.runtime.segments {
        let mut flags = a;
        if s.flags & elf::PF_W.0 != 0 {
            flags |= w;
        }
        if s.flags & elf::PF_X.0 != 0 {
            flags |= x;
        }
        let region = Region { offset: s.offset, addr: s.addr, size: s.file_size };
        out.push(StaticSection { name: 0, sh_type: elf::SHT_PROGBITS.0, flags, region, align: 8 });
        if s.mem_size > s.file_size {
            let region = Region {
                offset: s.offset.offset_by(s.file_size),
                addr: s.addr.offset_by(s.file_size),
                size: s.mem_size - s.file_size,
            };
            out.push(StaticSection { name: 0, sh_type: elf::SHT_NOBITS.0, flags, region, align: 1 });
        }
    }
    let block = if sp.runtime.old_tls.is_some() { sp.runtime.tls_shift } else { sp.runtime.tls.filesz };
    if block > 0 {
        let region = Region { size: block, ..sp.tls_image };
        let flags = a | w | elf::SHF_TLS.0;
        let align = sp.runtime.tls.align;
        out.push(StaticSection { name: 1, sh_type: elf::SHT_PROGBITS.0, flags, region, align });
    }
    if let Some(region) = eh_hdr {
        out.push(StaticSection { name: 2, sh_type: elf::SHT_PROGBITS.0, flags: a, region, align: 4 });
    }
    out
}

impl Plan<'_> {
    pub fn ro(&self) -> &Segment {
        &self.segments[0]
    }
    pub fn rw(&self) -> &Segment {
        &self.segments[1]
    }
    pub fn exec(&self) -> &Segment {
        &self.segments[2]
    }
    /// The sites not patched, and why.
    pub fn skipped(&self) -> impl Iterator<Item = (usize, &SkipReason)> {
        self.sites.iter().enumerate().filter_map(|(i, s)| match &s.decision {
            Decision::Skipped(r) => Some((i, r)),
            Decision::Patched(_) => None,
        })
    }
    /// Entries in the new .dynamic, DT_NULL included.
    pub fn dynamic_count(&self) -> usize {
        (self.dynamic.size / 16) as usize
    }
}

fn refuse(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Unsupported, Location::None, what)
}

/// Whether a file already carries alloctramp's site table.
pub fn is_patched(elf: &Elf) -> bool {
    elf.section_by_name(layout::SEC_SITES).is_some() || layout::table_after_phdrs(elf.data).is_some()
}

/// Plans the patching of `elf`, whose analysis is `a`.
pub fn plan<'a>(elf: &Elf<'a>, a: &Analysis, opts: &PatchOptions) -> Result<Plan<'a>> {
    let statik = crate::statics::is_static(elf);
    // A static program's dynamic table (a position-independent one's,
    // which its own start-up code reads) stays as it is.
    let tables = match check_input(elf, statik)? {
        Some(dyn_ph) if !statik => Tables::read(elf, dyn_ph)?,
        _ => Tables::none(),
    };
    // The runtime library is glibc's: a module of a musl process (musl's
    // C library is `libc.so`, its dynamic linker `ld-musl-*`) would load
    // glibc's into it.
    let interp = elf.file.elf_program_headers().iter().find(|p| p.p_type(LE) == elf::PT_INTERP).and_then(|p| {
        let at = p.p_offset(LE) as usize;
        elf.data.get(at..at.checked_add(p.p_filesz(LE) as usize)?)
    });
    if tables.needs("libc.so") || interp.is_some_and(|i| i.windows(7).any(|w| w == b"ld-musl")) {
        return Err(refuse(
            "linked dynamically with musl: the runtime library is built for glibc (a program linked statically \
             with musl, -static, carries a runtime of its own)",
        ));
    }
    let static_input = match (statik, opts.static_runtime.as_deref()) {
        (false, _) => None,
        (true, None) => {
            return Err(refuse(format!(
                "a static program (no PT_DYNAMIC): it must carry the static runtime, {}, which was not found",
                layout::static_host::FILE_NAME
            )));
        }
        (true, Some(bytes)) => Some((crate::statics::Program::read(elf)?, crate::statics::Runtime::parse(bytes)?)),
    };
    let strings = SiteStrings::new(a, &opts.foreign_unwind);
    check_loads(elf)?;
    let (ro_addr, max_align) = new_base(elf, &tables)?;
    // A static program's runtime segments, a PT_TLS if it has none, and a
    // PT_GNU_EH_FRAME if it has none (`emit::headers`).
    let has_eh_hdr = elf.file.elf_program_headers().iter().any(|p| p.p_type(LE) == elf::PT_GNU_EH_FRAME);
    let extra_phdrs = static_input
        .as_ref()
        .map_or(0, |(p, rt)| rt.load_count() + usize::from(p.tls.is_none()) + usize::from(!has_eh_hdr));
    let phnum = elf.file.elf_program_headers().len() + 3 + extra_phdrs;
    let table_len = layout::table_and_unwind_size(
        layout::table_size(a.scan.sites.len(), strings.table_entries.len(), strings.strings.len()),
        a.unwind.len(),
        layout::unwind_block_index(&a.unwind).len(),
        &opts.foreign_unwind,
    );
    let ro = ReadOnly::place(ro_addr, phnum, table_len as u64, &tables, statik);
    // A static program's runtime goes between the counters and the code.
    let gap = static_input.as_ref().map_or(0, |(_, rt)| align(rt.mem_end, PAGE));
    let dyn_count = if statik { 0 } else { new_dynamic_count(&tables) };
    let merged = match &static_input {
        Some((p, rt)) => Some(crate::statics::merge_tls(elf, p, rt)?),
        None => None,
    };
    // (The image at an address of its own alignment: musl pads the block
    // by the image's address.)
    let tls_size = merged.as_ref().map_or((0, 64), |m| (m.bytes.len() as u64, m.tls.align.max(64)));
    let mem = Memory::new(ro.end_addr(), dyn_count, a.scan.sites.len(), layout::shard::COUNT, gap, tls_size)?;
    // File order: read-only, executable, read-write, each from a page.
    let text_start = align(ro.size, PAGE);
    let mut ctx = TextContext {
        control: mem.control,
        table: ro.site_table.addr.0,
        shards: layout::shard::COUNT,
        stride: mem.stride,
        capture: 0,
        capture_plain: 0,
        vectors: 0,
        wide: 0,
        trace: 0,
    };
    let mut cursor = Cursor { offset: text_start, delta: mem.text.wrapping_sub(text_start) };
    let program = !matches!(elf.file_type, crate::elf::FileType::Shared);
    let [init, fini, capture, capture_plain, vectors, wide, trace] = match &static_input {
        None => plan_stubs(&mut cursor, &ctx, &tables, &opts.runtime_path, program)?,
        Some((p, rt)) => plan_static_stubs(&mut cursor, &ctx, p, rt.exit + mem.runtime)?,
    };
    let mut static_parts = match &static_input {
        Some((p, rt)) => {
            let merged = merged.unwrap_or_default();
            Some(plan_static(elf, &mut cursor, &mem, p, rt, merged, [init.addr.0, fini.addr.0])?)
        }
        None => None,
    };
    ctx.vectors = vectors.addr.0;
    ctx.wide = wide.addr.0;
    ctx.trace = trace.addr.0;
    // Callers capture needs the module's unwind rows.
    if !a.unwind.is_empty() {
        ctx.capture = capture.addr.0;
        ctx.capture_plain = capture_plain.addr.0;
    }
    let sources = ehframe::Sources::new(elf).ok();
    let unwinds = crate::charge::unwinds(elf);
    let layers = match opts.skip_allocator_layers {
        true => allocator_definitions(elf, a),
        false => Vec::new(),
    };
    let overlaps = overlapping_sites(&a.scan.sites);
    let input = SitesInput { ctx: &ctx, a, layers: &layers, sources: sources.as_ref(), unwinds, overlaps };
    let (sites, mut programs, threads) = plan_sites(&mut cursor, &input, opts.threads);
    // A walk from inside a runtime function goes on through the vector
    // stub to the trampoline that called it.
    if !programs.is_empty() {
        programs.insert(0, ehframe::vector_stub_program(vectors.addr.0, vectors.bytes.len() as u64));
        programs.insert(1, ehframe::leaf_stub_program(wide.addr.0, wide.bytes.len() as u64));
        programs.insert(2, ehframe::trace_stub_program(trace.addr.0, trace.bytes.own()));
    }
    // A call to a wrapper that counts for what the wrapper allocates must
    // be patched: the calls inside the wrapper may count nothing.
    for (p, site) in sites.iter().zip(&a.scan.sites) {
        if let (Decision::Skipped(reason), Charge::Caller { .. }) = (&p.decision, site.charge) {
            return Err(Error::new(
                ErrorKind::Request,
                Location::Vaddr(site.vaddr),
                format!(
                    "the call to allocation wrapper {} cannot be patched ({reason}); patch with --no-charge-callers",
                    a.scan.entries[site.entry].display
                ),
            ));
        }
    }
    let text = Region { offset: FileOffset(text_start), addr: Vaddr(mem.text), size: cursor.offset - text_start };
    let eh_frame = match &sources {
        Some(src) => place_eh_frame(&mut cursor, mem.control, src, &sites, programs, unwinds)?,
        None => None,
    };
    let exec_end = eh_frame.as_ref().map_or(text.end_offset(), |e| e.region.end_offset());
    let rw = ReadWrite::place(align(exec_end.0, PAGE), &mem);
    // The original file follows at a multiple of the largest alignment, so
    // that every original segment keeps its address and the new segments'
    // file ranges, counters included, never overlap an original one.
    let mut head_end = rw.file_end.max(rw.counters.region.offset.0 + 1);
    if let Some(sp) = &mut static_parts {
        sp.tls_image = rw.tls;
        let at = align(rw.file_end, PAGE);
        let r = &mut sp.runtime;
        r.image.offset = FileOffset(at);
        for seg in &mut r.segments {
            seg.offset = FileOffset(seg.offset.0 + at);
        }
        head_end = head_end.max(at + r.image.size);
    }
    let shift = align(head_end, max_align);
    let segments = [ro.segment(max_align), rw.segment(), exec_segment(text, exec_end)];
    let mut repoints = if statik { Vec::new() } else { plan_repoints(elf, &tables, &ro.copies, rw.dynamic) };
    // The section header of the search table the new one replaces.
    if let (Some(eh), Some(old)) = (&eh_frame, sources.as_ref().and_then(|s| s.hdr_addr())) {
        let at = elf.sections.iter().find(|s| s.index != 0 && s.addr.0 == old && s.name == ".eh_frame_hdr");
        if let Some(section) = at.map(|s| s.index) {
            repoints.push(Repoint { section, table: Table::EhFrameHdr, to: eh.hdr, old_addr: Vaddr(old) });
        }
    }
    let input_size = elf.data.len() as u64;
    if let Some(sp) = &mut static_parts {
        let new_hdr = eh_frame.as_ref().filter(|_| !has_eh_hdr).map(|e| e.hdr);
        sp.sections = static_sections(sp, new_hdr);
    }
    let extra = static_parts.as_ref().map_or(0, |s| s.sections.len());
    let (shstrtab, shdrs, shnum) = plan_section_headers(elf, shift + input_size, eh_frame.is_some(), extra)?;
    Ok(Plan {
        module: a.module.clone(),
        tables,
        input_size,
        shift,
        segments,
        ehdr: ro.ehdr,
        phdrs: ro.phdrs,
        phnum,
        site_table: ro.site_table,
        copies: ro.copies,
        init,
        fini,
        capture,
        capture_plain,
        vectors,
        wide,
        trace,
        text,
        eh_frame,
        dynamic: rw.dynamic,
        control: rw.control,
        counters: rw.counters,
        runtime_path: opts.runtime_path.clone(),
        shstrtab,
        shdrs,
        shnum,
        repoints,
        entries: a.scan.entries.iter().map(|e| e.display.clone()).collect(),
        sites,
        threads,
        strings,
        foreign_unwind: if a.unwind.is_empty() { Vec::new() } else { opts.foreign_unwind.clone() },
        statics: static_parts,
    })
}

/// The read-only segment, from offset 0: the ELF header, the program
/// headers (where strip and every loader expect them, now with room for the
/// new entries), the site table and the grown dynamic tables.
struct ReadOnly {
    ehdr: Region,
    phdrs: Region,
    site_table: Region,
    copies: Copies,
    size: u64,
}

impl ReadOnly {
    fn place(addr: u64, phnum: usize, table_len: u64, tables: &Tables, statik: bool) -> ReadOnly {
        let mut ro = Cursor { offset: 0, delta: addr };
        let ehdr = ro.place(64, 1);
        let phdrs = ro.place(phnum as u64 * 56, 8);
        let site_table = ro.place(table_len, 8);
        let copies = if statik { no_copies(&mut ro) } else { place_copies(&mut ro, tables) };
        ReadOnly { ehdr, phdrs, site_table, copies, size: ro.offset }
    }
    fn end_addr(&self) -> u64 {
        self.ehdr.addr.0 + self.size
    }
    fn segment(&self, max_align: u64) -> Segment {
        let (offset, addr, size) = (self.ehdr.offset, self.ehdr.addr, self.size);
        Segment { flags: elf::PF_R.0, offset, addr, file_size: size, mem_size: size, align: max_align }
    }
}

/// Addresses above the read-only segment: the read-write segment
/// (.dynamic, the control block, then the counters on pages of their own),
/// then the executable one above the counters.
struct Memory {
    rw: u64,
    /// A static program's thread-local image, after the control block, and
    /// its size and alignment.
    tls: u64,
    tls_size: (u64, u64),
    /// Where a static program's runtime's address 0 goes (0: none).
    runtime: u64,
    dyn_count: usize,
    control: u64,
    counters: u64,
    stride: u64,
    shards: u32,
    text: u64,
}

impl Memory {
    fn new(
        ro_end: u64,
        dyn_count: usize,
        n_sites: usize,
        shards: u32,
        gap: u64,
        tls_size: (u64, u64),
    ) -> Result<Memory> {
        let rw = align(ro_end, PAGE);
        let control = align(rw + dyn_count as u64 * 16, 64);
        let tls = align(control + layout::CONTROL_SIZE as u64, tls_size.1);
        let counters = align(tls + tls_size.0, PAGE);
        let stride = align(n_sites.max(1) as u64 * layout::CELL_SIZE as u64, PAGE);
        if stride > i32::MAX as u64 {
            return Err(refuse(format!("{n_sites} sites: too many for one module")));
        }
        let runtime = counters + stride * u64::from(shards);
        let text = runtime + gap;
        let runtime = if gap == 0 { 0 } else { runtime };
        Ok(Memory { rw, tls, tls_size, runtime, dyn_count, control, counters, stride, shards, text })
    }
}

/// The read-write segment's parts, from file offset `start`.
struct ReadWrite {
    dynamic: Region,
    control: Region,
    tls: Region,
    counters: Counters,
    file_end: u64,
}

impl ReadWrite {
    fn place(start: u64, mem: &Memory) -> ReadWrite {
        let mut rw = Cursor { offset: start, delta: mem.rw.wrapping_sub(start) };
        let dynamic = rw.place(mem.dyn_count as u64 * 16, 8);
        let control = rw.place(layout::CONTROL_SIZE as u64, 64);
        let tls = rw.place(mem.tls_size.0, mem.tls_size.1);
        debug_assert_eq!((dynamic.addr.0, control.addr.0, tls.addr.0), (mem.rw, mem.control, mem.tls));
        // The counters' nominal file offset (they have no bytes) stays
        // before the original file too, so no original segment seems to
        // hold them.
        let size = mem.stride * u64::from(mem.shards);
        let region = Region { offset: FileOffset(start + (mem.counters - mem.rw)), addr: Vaddr(mem.counters), size };
        let counters = Counters { region, shards: mem.shards, stride: mem.stride };
        ReadWrite { dynamic, control, tls, counters, file_end: rw.offset }
    }
    fn segment(&self) -> Segment {
        let (offset, addr) = (self.dynamic.offset, self.dynamic.addr);
        let file_size = self.file_end - offset.0;
        let mem_size = self.counters.region.end_addr().0 - addr.0;
        Segment { flags: elf::PF_R.0 | elf::PF_W.0, offset, addr, file_size, mem_size, align: PAGE }
    }
}

/// The executable segment: the code, then the unwind information up to
/// `end`.
fn exec_segment(text: Region, end: FileOffset) -> Segment {
    let (offset, addr, size) = (text.offset, text.addr, end.0 - text.offset.0);
    Segment { flags: elf::PF_R.0 | elf::PF_X.0, offset, addr, file_size: size, mem_size: size, align: PAGE }
}

/// Lays out parts one after another: `offset` is the next free file
/// offset, and a part's address is its offset plus `delta`.
struct Cursor {
    offset: u64,
    delta: u64,
}

impl Cursor {
    fn place(&mut self, size: u64, alignment: u64) -> Region {
        let at = align(self.offset, alignment);
        self.offset = at + size;
        Region { offset: FileOffset(at), addr: Vaddr(at.wrapping_add(self.delta)), size }
    }
}

/// What is refused before any table is read; returns PT_DYNAMIC.
fn check_input<'e>(elf: &'e Elf, statik: bool) -> Result<Option<&'e Phdr>> {
    let e = LE;
    if is_patched(elf) {
        return Err(Error::new(ErrorKind::AlreadyPatched, Location::None, "already patched by alloctramp"));
    }
    let phdrs = elf.file.elf_program_headers();
    let dyn_ph = phdrs.iter().find(|p| p.p_type(e) == elf::PT_DYNAMIC);
    if dyn_ph.is_none() && !statik {
        return Err(refuse("no PT_DYNAMIC in a file that is not a static executable: the runtime cannot be loaded"));
    }
    if elf.sections.is_empty() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            Location::Offset(FileOffset(40)),
            "no section headers (e_shoff is 0): they are needed to find and repoint the dynamic tables",
        ));
    }
    if !phdrs.iter().any(|p| p.p_type(e) == elf::PT_LOAD) {
        return Err(refuse("no PT_LOAD segment"));
    }
    Ok(dyn_ph)
}

/// Every PT_LOAD's alignment is a power of two of at most 1 GiB, and it
/// ends low enough to leave room for the new segments above it.
fn check_loads(elf: &Elf) -> Result<()> {
    let e = LE;
    let phoff = elf.file.elf_header().e_phoff.get(e);
    let phdrs = elf.file.elf_program_headers();
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
    Ok(())
}

/// The read-only segment's address and the largest segment alignment. The
/// new segments go above every original segment, above what relocations
/// reach (unless a symbol size is absurd: then no gap would do) and above
/// every allocated section, loaded or not (a patched file must read as the
/// input did: its sections are checked against the segments that hold
/// their addresses).
fn new_base(elf: &Elf, tables: &Tables) -> Result<(u64, u64)> {
    let e = LE;
    let loads = || elf.file.elf_program_headers().iter().filter(|p| p.p_type(e) == elf::PT_LOAD);
    let max_align = loads().map(|p| p.p_align(e)).max().unwrap_or(PAGE).max(PAGE);
    let max_end = loads().map(|p| p.p_vaddr(e).saturating_add(p.p_memsz(e))).max().unwrap_or(0);
    let reach = tables.reach;
    let mut max_end = if reach >= max_end && reach - max_end < 1 << 30 { reach + 1 } else { max_end };
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
    Ok((align(max_end, max_align), max_align))
}

/// Places the copies of the dynamic tables.
fn place_copies(ro: &mut Cursor, t: &Tables) -> Copies {
    let n = t.symbol_count() + u64::from(crate::tables::IMPORTED);
    let names: u64 = layout::IMPORTS.iter().map(|i| i.name.len() as u64 + 1).sum();
    let libc = if t.needs_libc() { 0 } else { layout::LIBC_SONAME.len() as u64 + 1 };
    let dynstr_size = t.dynstr.size() + names + libc;
    Copies {
        dynsym: ro.place(n * 24, 8),
        dynstr: ro.place(dynstr_size, 1),
        versym: t.versym.map(|_| ro.place(n * 2, 2)),
        gnu_hash: t.gnu_hash.map(|h| ro.place(h.size(), 8)),
        hash: t.hash.map(|(_, nbucket)| ro.place(8 + 4 * (u64::from(nbucket) + n), 8)),
        rela: ro.place(t.rela.map_or(0, |r| r.size()) + 24 * u64::from(crate::tables::IMPORTED), 8),
        jmprel: match t.jmprel {
            Some(Jmprel::Separate(j)) => Some(ro.place(j.size(), 8)),
            _ => None,
        },
    }
}

/// A static program's (empty) table copies.
fn no_copies(ro: &mut Cursor) -> Copies {
    let none = ro.place(0, 8);
    Copies { dynsym: none, dynstr: none, versym: None, gnu_hash: None, hash: None, rela: none, jmprel: None }
}

/// The new .dynamic's entries: the input's, the C library's DT_NEEDED if
/// the input had none, DT_INIT and DT_FINI if the input had none, DT_NULL.
fn new_dynamic_count(t: &Tables) -> usize {
    let (init, fini) = (t.value(elf::DT_INIT).is_none(), t.value(elf::DT_FINI).is_none());
    t.dynamic.len() + usize::from(!t.needs_libc()) + usize::from(init) + usize::from(fini) + 1
}

/// What the code generator needs to know of the module.
struct TextContext {
    control: u64,
    table: u64,
    shards: u32,
    stride: u64,
    /// The capture stubs (0: sites get no callers entry).
    capture: u64,
    capture_plain: u64,
    /// The vector stub.
    vectors: u64,
    /// The wide-size stub.
    wide: u64,
    /// The trace stub.
    trace: u64,
}

/// Places generated code at the cursor; the next code starts 16-byte
/// aligned.
fn place_code(text: &mut Cursor, bytes: impl Into<Bytes>) -> Code {
    let bytes = bytes.into();
    let r = text.place(bytes.len() as u64, 1);
    text.offset = align(text.offset, 16);
    Code { addr: r.addr, offset: r.offset, bytes }
}

fn stub_err(err: CodegenError) -> Error {
    Error::new(ErrorKind::Request, Location::None, format!("stub: {err}"))
}

/// The init and fini stubs, which register the module with the runtime
/// (the init stub loading it from `runtime` first if no loaded module
/// provides it; a program's saying why on stderr when that fails and
/// `ALLOCTRAMP` is set) and continue to the input's DT_INIT and
/// DT_FINI functions, if any; then [`common_stubs`].
fn plan_stubs(text: &mut Cursor, ctx: &TextContext, t: &Tables, runtime: &str, program: bool) -> Result<[Code; 7]> {
    let mut stub = |api: i32, original: Option<u64>, load: Option<codegen::Load>| -> Result<Code> {
        let at = text.offset.wrapping_add(text.delta);
        let bytes = codegen::init_stub(at, ctx.control, ctx.table, api, original, load).map_err(stub_err)?;
        Ok(place_code(text, bytes))
    };
    let load = codegen::Load { path: runtime, say: program };
    let init = stub(layout::api::REGISTER, t.value(elf::DT_INIT), Some(load))?;
    let fini = stub(layout::api::UNREGISTER, t.value(elf::DT_FINI), None)?;
    let [capture, plain, vectors, wide, trace] = common_stubs(text, ctx)?;
    Ok([init, fini, capture, plain, vectors, wide, trace])
}

/// A static program's stubs: the init hook (the module's init stub, which
/// continues to the original first initializer), the exit hook (which
/// calls the runtime's exit function at `exit`), then [`common_stubs`].
fn plan_static_stubs(
    text: &mut Cursor,
    ctx: &TextContext,
    p: &crate::statics::Program,
    exit: u64,
) -> Result<[Code; 7]> {
    let at = text.offset.wrapping_add(text.delta);
    let init = codegen::init_stub(at, ctx.control, ctx.table, layout::api::REGISTER, Some(p.init.target), None);
    let init = place_code(text, init.map_err(stub_err)?);
    let at = text.offset.wrapping_add(text.delta);
    let fini = codegen::static_exit_stub(at, ctx.control, ctx.table, exit, p.fini.target).map_err(stub_err)?;
    let fini = place_code(text, fini);
    let [capture, plain, vectors, wide, trace] = common_stubs(text, ctx)?;
    Ok([init, fini, capture, plain, vectors, wide, trace])
}

/// The stubs every module gets after its init and fini stubs: the two
/// capture stubs, the vector stub, the wide-size stub and the trace stub.
fn common_stubs(text: &mut Cursor, ctx: &TextContext) -> Result<[Code; 5]> {
    let at = text.offset.wrapping_add(text.delta);
    let capture = place_code(text, codegen::capture_stub(at, ctx.control, ctx.table, true).map_err(stub_err)?);
    let at = text.offset.wrapping_add(text.delta);
    let plain = place_code(text, codegen::capture_stub(at, ctx.control, ctx.table, false).map_err(stub_err)?);
    let at = text.offset.wrapping_add(text.delta);
    let vectors = place_code(text, codegen::vector_stub(at).map_err(stub_err)?);
    let at = text.offset.wrapping_add(text.delta);
    let wide = place_code(text, codegen::wide_stub(at, ctx.control).map_err(stub_err)?);
    let at = text.offset.wrapping_add(text.delta);
    let trace = place_code(text, codegen::trace_stub(at, ctx.control, vectors.addr.0).map_err(stub_err)?);
    Ok([capture, plain, vectors, wide, trace])
}

/// A static program's runtime, relocated for `mem.runtime`, its entry stub
/// and thread-local image in the executable segment, and the rewritten
/// initializer and destructor words. The runtime's file offsets are
/// relative to its image until the caller places it.
fn plan_static(
    elf: &Elf,
    text: &mut Cursor,
    mem: &Memory,
    p: &crate::statics::Program,
    rt: &crate::statics::Runtime,
    merged: crate::statics::MergedTls,
    [init, fini]: [u64; 2],
) -> Result<StaticPlan> {
    use crate::statics;
    let base = mem.runtime;
    let crate::statics::MergedTls { mut tls, bytes: tls_bytes, offset: tls_offset, relocated, shift: tls_shift } =
        merged;
    tls.vaddr = mem.tls;
    let (bytes, mut fixups) = statics::relocate(rt, base, tls_offset, p, p.pie)?;
    // The program's relocations of its thread-local image apply to the
    // copy.
    fixups.extend(relocated.iter().map(|r| mem.tls + r));
    if p.pie {
        // The control block's runtime slot, which holds the API table.
        fixups.push(mem.control + u64::from(layout::control::RUNTIME));
    }
    let host = base + rt.host;
    let at = text.offset.wrapping_add(text.delta);
    let entry = place_code(text, codegen::static_entry_stub(at, host, &fixups, p.entry).map_err(stub_err)?);
    // Placed with the read-write segment.
    let tls_image = Region { offset: FileOffset(0), addr: Vaddr(mem.tls), size: tls_bytes.len() as u64 };
    let mut words = vec![p.init.rewrite(init), p.fini.rewrite(fini)];
    let calls = p.fork_calls.iter().map(|&call| statics::redirect_call(elf, call, base + rt.fork_handler));
    words.extend(statics::words_of(elf, calls.collect::<Result<Vec<_>>>()?));
    let size = rt.image_len;
    let runtime = statics::Placed {
        base,
        image: Region { offset: FileOffset(0), addr: Vaddr(base), size },
        bytes,
        segments: statics::segments(rt, base, 0),
        tls,
        tls_bytes,
        tls_phdr: p.tls.map(|(i, _)| i),
        tls_shift,
        old_tls: p.tls.map(|(_, t)| t),
        fixups,
        api: base + rt.api,
        host,
        exit: base + rt.exit,
    };
    Ok(StaticPlan { runtime, entry, tls_image, words, sections: Vec::new() })
}

/// The extents of the file's own definitions of default entry points
/// (sorted, from the symbol tables' function symbols with a size).
fn allocator_definitions(elf: &Elf, a: &Analysis) -> Vec<(u64, u64)> {
    let names: std::collections::HashSet<&str> = a.scan.entries[..a.scan.user.start]
        .iter()
        .filter_map(|e| match &e.target {
            Target::Symbol(n) => Some(n.as_str()),
            Target::Address(_) => None,
        })
        .collect();
    let mut v: Vec<(u64, u64)> = [false, true]
        .into_iter()
        .flat_map(|dynamic| elf.symbols(dynamic))
        .filter(|s| s.defined && s.is_func && s.size > 0 && names.contains(s.name))
        .map(|s| (s.value, s.value.saturating_add(s.size)))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Every site's decision (patched sites get their trampolines one after
/// another), and for each patched one that its file's unwind information
/// covers, its trampoline's unwind entry (to be placed). Sites inside
/// the allocator layers are skipped.
///
/// Trampolines are generated on every core when no site is an entry hook
/// (a hook's stub is placed before its trampoline and its length depends
/// on its address): each site's address is worked out first from the
/// lengths of trampolines of its shape ([`TrampolineSpec::shape`]), and
/// each thread checks that the trampolines it makes have those lengths.
/// If one does not, the sites are planned one after another instead: the
/// plan is the same either way. `threads`: as many (0: one per core, for
/// files of [`PARALLEL_FROM`] sites or more). Returns the threads used.
fn plan_sites(text: &mut Cursor, input: &SitesInput, threads: usize) -> (Vec<SitePlan>, Vec<ehframe::Program>, usize) {
    let a = input.a;
    let threads = match threads {
        0 if a.scan.sites.len() < PARALLEL_FROM => 1,
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS),
        n => n.min(MAX_THREADS),
    };
    // As many runs of sites as threads, each as long (the last shorter).
    let n = a.scan.sites.len();
    let threads = n.div_ceil(n.div_ceil(threads.max(1)).max(1));
    if threads > 1
        && a.scan.sites.iter().all(|s| s.hook.is_none())
        && let Some((sites, programs)) = plan_sites_parallel(text, input, threads)
    {
        return (sites, programs, threads);
    }
    let (sites, programs) = plan_sites_in_turn(text, input);
    (sites, programs, 1)
}

/// One thread per core, up to this many (and no more when asked).
const MAX_THREADS: usize = 8;

/// Fewer sites than this are planned on one thread (by default).
const PARALLEL_FROM: usize = 512;

/// What a site becomes before its code is placed.
enum Made {
    Skipped(SkipReason),
    /// Its trampoline, the trampoline's unwind entry if it has one, and
    /// how its code is made again if it came from a template.
    Code(codegen::Trampoline, Option<ehframe::Program>, Option<template::Made>),
}

/// What planning the sites reads: the module's code context, the
/// analysis, the allocator layers whose sites are skipped (sorted
/// extents), the file's unwind information, and whether the file unwinds
/// through its calls.
struct SitesInput<'s, 'e> {
    ctx: &'s TextContext,
    a: &'s Analysis,
    layers: &'s [(u64, u64)],
    sources: Option<&'s ehframe::Sources<'e>>,
    unwinds: bool,
    /// Per site, the earlier site whose bytes its own overlap.
    overlaps: Vec<Option<Vaddr>>,
}

impl SitesInput<'_, '_> {
    /// What the site's trampoline must do.
    fn spec(&self, i: usize, site: &ScanSite, target: u64) -> TrampolineSpec {
        let (ctx, a) = (self.ctx, self.a);
        let entry = &a.scan.entries[site.entry];
        let (depth_check, depth_bump, external) = match site.charge {
            Charge::Own => (false, false, false),
            Charge::Hook { external } => (false, false, external),
            Charge::Caller { bump, external } => (false, bump, external),
            Charge::Inside { checked, bump, external, .. } => (checked, bump, external),
        };
        TrampolineSpec {
            site: site.vaddr.0,
            len: site.len,
            form: site.form,
            target,
            sig: entry.sig,
            index: i as u32,
            // A free or realloc wrapper's trampoline calls the runtime
            // before the wrapper: preserve mode keeps its vector registers
            // (arguments, for a wrapper that takes floating point ones). A
            // hook's trampoline uses r10 and r11 only.
            preserve: site.via == Via::Direct && !(external && entry.sig.kind == Kind::Alloc),
            vectors: ctx.vectors,
            wide: ctx.wide,
            trace: ctx.trace,
            args: entry.args,
            control: ctx.control,
            shard_mask: ctx.shards - 1,
            shard_stride: ctx.stride as u32,
            depth_check,
            depth_bump,
            key_result: a.scan.keys.get(&site.entry).map_or(0, |k| k.result),
            key_ptr: a.scan.keys.get(&site.entry).map_or(0, |k| k.ptr),
            // A default entry called through the PLT or GOT takes no
            // vector arguments and clobbers every vector register.
            capture: if site.via != Via::Direct && site.entry < a.scan.user.start {
                ctx.capture_plain
            } else {
                ctx.capture
            },
            hook: matches!(site.charge, Charge::Hook { .. }),
            charge_check: site.under_hook,
            plain_store: a.scan.plain_store(site.entry),
            aligned: a.scan.aligned(site.entry),
        }
    }

    /// Why a site gets no trampoline, whatever its address: a call inside a
    /// wrapper that its callers count for, an entry hook whose stub cannot be
    /// made, or a site inside an allocator's own layers (`alloctramp run`).
    fn skipped_before(&self, i: usize, site: &ScanSite, hook: Option<&'static str>) -> Option<SkipReason> {
        let a = self.a;
        if let Some(&Some(other)) = self.overlaps.get(i) {
            return Some(SkipReason::Overlaps(other));
        }
        // (A call through an allocator API's slot counts the calls its
        // callers' sites did not: those through pointers.)
        // (Nor does an entry hook: it counts the calls no site makes.)
        let in_layer = !a.scan.is_slot(site.entry)
            && site.hook.is_none()
            && self.layers.iter().any(|&(lo, hi)| (lo..hi).contains(&site.vaddr.0));
        if matches!(site.charge, Charge::Inside { checked: false, .. }) {
            Some(SkipReason::InsideWrapper)
        } else if let Some(why) = hook {
            Some(SkipReason::HookStub(why))
        } else if in_layer {
            Some(SkipReason::InsideAllocator)
        } else {
            None
        }
    }

    /// The site's trampoline at `at`, with its unwind entry.
    fn make(&self, i: usize, site: &ScanSite, spec: &TrampolineSpec, at: u64, scratch: &mut Scratch) -> Made {
        let (t, made) = match trampoline(spec, at, &mut scratch.templates) {
            Ok(t) => t,
            Err(reason) => return Made::Skipped(reason),
        };
        let entries = t.entries();
        let len = code_len(&t, made.as_ref());
        // (A trampoline from a template has its code made only where its
        // shape's stack rows are not known yet.)
        let code = || match &made {
            Some(m) => m.code().map(std::borrow::Cow::Owned),
            None => Some(std::borrow::Cow::Borrowed(&t.code[..])),
        };
        let found: std::result::Result<_, &'static str> = match self.sources {
            None => Err("the file has no .eh_frame_hdr to extend"),
            Some(src) => scratch
                .frames
                .of(spec, len, code, at, entries)
                .map_err(|_| "the trampoline's stack cannot be followed")
                .and_then(|frames| {
                    ehframe::Entry {
                        addr: at,
                        len: len as u64,
                        frames,
                        ret: site.vaddr.0 + u64::from(site.len),
                        tail: site.form.is_tail(),
                        site: src.site(site.vaddr.0, &mut scratch.cfi).ok(),
                        index: i as u32,
                        undo: &t.undo,
                    }
                    .program()
                }),
        };
        match found {
            // An exception through a hook's call must find an entry: without
            // one the site stays as it is.
            Err(why) if spec.hook && self.unwinds => Made::Skipped(SkipReason::NoUnwind(why)),
            found => Made::Code(t, found.ok(), made),
        }
    }
}

/// What one planning thread keeps from site to site: gimli's unwind
/// context, the stack rows of the trampolines made so far, and the
/// templates of their shapes.
#[derive(Default)]
struct Scratch {
    cfi: gimli::UnwindContext<usize>,
    frames: KnownFrames,
    templates: Templates,
}

/// Stack rows by trampoline shape. Trampolines of one shape and length are
/// the same instructions but for the values of their operands (addresses,
/// counter displacements), so their rows are the same: following the code
/// of each again took a tenth of the time to patch a large library.
#[derive(Default)]
struct KnownFrames(std::collections::HashMap<(TrampolineSpec, usize, [u32; 5]), frames::Frames>);

impl KnownFrames {
    /// The stack rows of `code`, the trampoline of `spec` at `at` with
    /// `entries`, `len` bytes long (see [`frames::frames`]); `code` gives
    /// the code where the rows are not known (None: it cannot be made).
    fn of<'c>(
        &mut self,
        spec: &TrampolineSpec,
        len: usize,
        code: impl FnOnce() -> Option<std::borrow::Cow<'c, [u8]>>,
        at: u64,
        entries: [u32; 5],
    ) -> std::result::Result<&frames::Frames, frames::FramesError> {
        use std::collections::hash_map::Entry;
        let rows = |code: Option<std::borrow::Cow<'c, [u8]>>| {
            frames::frames(&code.unwrap_or_default(), at, &entries, spec.target)
        };
        match self.0.entry((spec.shape(), len, entries)) {
            Entry::Occupied(known) => {
                debug_assert_eq!(Ok(known.get()), rows(code()).as_ref(), "trampolines of one shape have one stack");
                Ok(known.into_mut())
            }
            Entry::Vacant(new) => Ok(new.insert(rows(code())?)),
        }
    }
}

/// The length of a trampoline's code: its own, or what its template
/// makes (the trampoline's own is empty then).
fn code_len(t: &codegen::Trampoline, made: Option<&template::Made>) -> usize {
    made.map_or(t.code.len(), template::Made::len)
}

/// Places a made trampoline's code at the cursor.
/// (A trampoline from a template keeps how to make its code again instead
/// of the code.)
fn place_trampoline(text: &mut Cursor, t: codegen::Trampoline, made: Option<template::Made>) -> Trampoline {
    let (drain, count, callers, traced, flags) = (t.drain, t.count, t.callers, t.traced, t.flags);
    let bytes = match made {
        Some(m) => Bytes::Made(m),
        None => Bytes::Own(t.code),
    };
    Trampoline { code: place_code(text, bytes), drain, count, callers, traced, flags }
}

/// Per site, the earlier one its bytes overlap, by address or by file
/// offset (then it gets no trampoline: the two jumps would overwrite each
/// other). A well-formed file has none; a malformed one can hold calls
/// decoded across each other, or two addresses of the same file bytes.
/// Sites too short for a jump write nothing and overlap nothing.
fn overlapping_sites(sites: &[ScanSite]) -> Vec<Option<Vaddr>> {
    let mut out = vec![None; sites.len()];
    for in_file in [false, true] {
        let bytes = |s: &ScanSite| {
            let at = if in_file { s.offset.0 } else { s.vaddr.0 };
            (at, at.saturating_add(u64::from(s.len)))
        };
        let mut order: Vec<(u64, u64, usize)> = sites
            .iter()
            .zip(&out)
            .enumerate()
            .filter(|(_, (s, skipped))| skipped.is_none() && usize::from(s.len) >= crate::hooks::JUMP_LEN)
            .map(|(i, (s, _))| {
                let (lo, hi) = bytes(s);
                (lo, hi, i)
            })
            .collect();
        order.sort_unstable();
        // The end of the kept site whose bytes reach furthest so far.
        let mut reach: Option<(u64, Vaddr)> = None;
        for (lo, hi, i) in order {
            match reach {
                Some((end, kept)) if lo < end => {
                    if let Some(slot) = out.get_mut(i) {
                        *slot = Some(kept);
                    }
                }
                _ => reach = sites.get(i).map(|s| (hi, s.vaddr)),
            }
        }
    }
    out
}

/// [`plan_sites`] on this thread, site after site.
fn plan_sites_in_turn(text: &mut Cursor, input: &SitesInput) -> (Vec<SitePlan>, Vec<ehframe::Program>) {
    let (a, sources) = (input.a, input.sources);
    let mut sites = Vec::with_capacity(a.scan.sites.len());
    let mut programs = Vec::new();
    let mut scratch = Scratch::default();
    for (i, site) in a.scan.sites.iter().enumerate() {
        // An entry hook's stub goes before its trampoline: the site is the
        // jump to it, whose target is the moved code.
        let hook = site.hook.as_deref().map(|h| {
            let stub_at = text.offset.wrapping_add(text.delta);
            (h, stub_at, h.stub(stub_at))
        });
        let target = match &hook {
            Some((_, stub_at, _)) => *stub_at,
            None => site.target.0,
        };
        let mut stub_unwind = None;
        let hook_plan = hook.map(|(h, stub_at, made)| {
            let (bytes, points) = made?;
            let stub = place_code(text, bytes);
            debug_assert_eq!(stub.addr.0, stub_at);
            stub_unwind = sources.and_then(|src| src.stub_program(stub_at, stub.bytes.len() as u64, &points).ok());
            let jump = h.entry_jump(stub_at).ok_or("the stub is out of the function's reach")?;
            Ok((stub, (site.offset, jump)))
        });
        let at = text.offset.wrapping_add(text.delta);
        let hook_err = match &hook_plan {
            Some(Err(why)) => Some(*why),
            _ => None,
        };
        let mut unwind = None;
        let decision = match input.skipped_before(i, site, hook_err) {
            Some(reason) => Decision::Skipped(reason),
            None => match input.make(i, site, &input.spec(i, site, target), at, &mut scratch) {
                Made::Skipped(reason) => Decision::Skipped(reason),
                Made::Code(t, found, made) => {
                    unwind = found;
                    Decision::Patched(place_trampoline(text, t, made))
                }
            },
        };
        let hook = match (hook_plan, &decision) {
            (Some(Ok((stub, jump))), Decision::Patched(_)) => {
                programs.extend(stub_unwind);
                Some(Box::new(HookPlan { stub, jump }))
            }
            _ => None,
        };
        sites.push(SitePlan::of(site, decision, hook));
        programs.extend(unwind);
    }
    (sites, programs)
}

/// The shape trampolines are laid out by (tests make it wrong, to see
/// the threads' check fall back).
fn shape_of(spec: &TrampolineSpec) -> TrampolineSpec {
    #[cfg(test)]
    if tests::WRONG_SHAPES.get() {
        return TrampolineSpec { index: 0, ..spec.shape() };
    }
    spec.shape()
}

/// [`plan_sites`] on `threads` threads, for sites none of which is an
/// entry hook; `None` if a trampoline's length was not its shape's, or a
/// thread could not start (the cursor is then unchanged).
fn plan_sites_parallel(
    text: &mut Cursor,
    input: &SitesInput,
    threads: usize,
) -> Option<(Vec<SitePlan>, Vec<ehframe::Program>)> {
    let a = input.a;
    // The address each site's trampoline gets: the addresses follow from
    // the lengths of the trampolines before it, known from one trampoline
    // of each shape (none: the site gets none).
    let spec = |i: usize, site: &ScanSite| match input.skipped_before(i, site, None) {
        Some(reason) => Err(reason),
        None => Ok(input.spec(i, site, site.target.0)),
    };
    let n = a.scan.sites.len();
    let mut lengths: std::collections::HashMap<TrampolineSpec, Option<usize>> = std::collections::HashMap::new();
    let mut templates = Templates::new();
    let mut cursor = text.offset;
    let mut expect: Vec<(u64, Option<usize>)> = Vec::with_capacity(n);
    for (i, site) in a.scan.sites.iter().enumerate() {
        let at = cursor.wrapping_add(text.delta);
        let len = match spec(i, site) {
            Err(_) => None,
            Ok(spec) => *lengths.entry(shape_of(&spec)).or_insert_with(|| {
                trampoline(&spec, at, &mut templates).ok().map(|(t, made)| code_len(&t, made.as_ref()))
            }),
        };
        if let Some(len) = len {
            cursor = align(cursor + len as u64, 16);
        }
        expect.push((at, len));
    }
    drop(lengths);
    // Runs of sites, one per thread, made at those addresses, and placed
    // run after run (the cursor goes back where it was if a run's lengths
    // were not those expected).
    let run = n.div_ceil(threads);
    let start = (text.offset, text.delta);
    let mut sites = Vec::with_capacity(n);
    let mut programs = Vec::new();
    let placed = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .step_by(run)
            .map(|first| {
                let (expect, spec, templates) = (&expect, &spec, &templates);
                std::thread::Builder::new().spawn_scoped(scope, move || {
                    let mut scratch = Scratch { templates: templates.clone(), ..Scratch::default() };
                    let mut out = Vec::with_capacity(run);
                    let last = (first + run).min(n);
                    for (i, (&(at, len), site)) in
                        expect[first..last].iter().zip(&a.scan.sites[first..last]).enumerate()
                    {
                        let i = first + i;
                        let m = match spec(i, site) {
                            Err(reason) => Made::Skipped(reason),
                            Ok(spec) => input.make(i, site, &spec, at, &mut scratch),
                        };
                        let as_expected = match (&m, len) {
                            (Made::Code(t, _, made), Some(len)) => code_len(t, made.as_ref()) == len,
                            (Made::Skipped(_), None) => true,
                            _ => false,
                        };
                        if !as_expected {
                            return None;
                        }
                        out.push(m);
                    }
                    Some(out)
                })
            })
            .collect();
        for h in handles {
            // (A thread that panicked: its panic goes on here.)
            let made = h.ok()?.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?;
            for m in made {
                let (i, site) = (sites.len(), &a.scan.sites[sites.len()]);
                let decision = match m {
                    Made::Skipped(reason) => Decision::Skipped(reason),
                    Made::Code(t, unwind, made) => {
                        debug_assert_eq!(text.offset.wrapping_add(text.delta), expect[i].0);
                        programs.extend(unwind);
                        Decision::Patched(place_trampoline(text, t, made))
                    }
                };
                sites.push(SitePlan::of(site, decision, None));
            }
        }
        Some(())
    });
    if placed.is_none() {
        (text.offset, text.delta) = start;
        return None;
    }
    Some((sites, programs))
}

/// Places the trampolines' unwind information after them. In a file that
/// unwinds through its calls, hooks were planned on the promise of their
/// entries, so failing to place them is an error; elsewhere the patched
/// file simply has none.
fn place_eh_frame(
    cursor: &mut Cursor,
    control: u64,
    src: &ehframe::Sources<'_>,
    sites: &[SitePlan],
    entries: Vec<ehframe::Program>,
    unwinds: bool,
) -> Result<Option<EhFramePlan>> {
    if entries.is_empty() {
        return Ok(None);
    }
    let start = align(cursor.offset, 8);
    let at = start.wrapping_add(cursor.delta);
    match src.region(entries, at, control) {
        Ok((bytes, hdr_off)) => {
            let region = cursor.place(bytes.len() as u64, 8);
            debug_assert_eq!(region.addr.0, at);
            let hdr = Region {
                offset: region.offset.offset_by(hdr_off),
                addr: region.addr.offset_by(hdr_off),
                size: bytes.len() as u64 - hdr_off,
            };
            let entries = Region { size: hdr_off, ..region };
            Ok(Some(EhFramePlan { region, bytes, entries, hdr }))
        }
        Err(why)
            if unwinds
                && sites.iter().any(|s| s.trampoline().is_some_and(|t| t.flags & layout::site_flags::HOOK != 0)) =>
        {
            Err(refuse(format!("the trampolines' unwind entries: {why}")))
        }
        Err(_) => Ok(None),
    }
}

/// A site's trampoline at `at` (from its shape's template when it has one:
/// see [`template`]), if every entry of it is in reach of the site's jump
/// (but the traced entry, which is then left unused).
fn trampoline(
    spec: &TrampolineSpec,
    at: u64,
    templates: &mut Templates,
) -> std::result::Result<(codegen::Trampoline, Option<template::Made>), SkipReason> {
    if spec.len < 5 {
        return Err(SkipReason::TooShort { len: spec.len });
    }
    #[cfg(test)]
    let made = match tests::NO_TEMPLATES.get() {
        true => codegen::trampoline(spec, at).map(|t| (t, None)),
        false => template::trampoline(templates, spec, at),
    };
    #[cfg(not(test))]
    let made = template::trampoline(templates, spec, at);
    let (mut t, made) = made.map_err(SkipReason::Codegen)?;
    let reaches = |e: u16| codegen::site_jump(spec.site, at + u64::from(e)).is_some();
    if ![0, t.drain, t.count, t.callers].into_iter().all(reaches) {
        return Err(SkipReason::OutOfRange);
    }
    // A traced entry out of reach is left unused: the site records its
    // events through the runtime.
    if !reaches(t.traced) {
        t.traced = 0;
    }
    Ok((t, made))
}

/// The section headers of the copied tables, found by type and address
/// (any SHT_DYNAMIC section: the loader has one dynamic table).
fn plan_repoints(elf: &Elf, t: &Tables, c: &Copies, dynamic: Region) -> Vec<Repoint> {
    let is = |ty: u32, want: elf::SectionType| ty == want.0;
    let addr_of = |l: Option<Vaddr>, a: u64| l.is_some_and(|v| v.0 == a);
    let jmprel = match t.jmprel {
        Some(Jmprel::Separate(j)) => Some(j.addr),
        _ => None,
    };
    let mut out = Vec::new();
    for s in elf.sections.iter().skip(1).filter(|s| s.addr.0 != 0) {
        let (ty, a) = (s.sh_type, s.addr.0);
        let found = if is(ty, elf::SHT_DYNSYM) && a == t.dynsym.addr.0 {
            Some((Table::Dynsym, c.dynsym))
        } else if is(ty, elf::SHT_STRTAB) && a == t.dynstr.addr.0 {
            Some((Table::Dynstr, c.dynstr))
        } else if is(ty, elf::SHT_GNU_VERSYM) && addr_of(t.versym.map(|v| v.addr), a) {
            c.versym.map(|r| (Table::Versym, r))
        } else if is(ty, elf::SHT_GNU_HASH) && addr_of(t.gnu_hash.map(|h| h.addr), a) {
            c.gnu_hash.map(|r| (Table::GnuHash, r))
        } else if is(ty, elf::SHT_HASH) && addr_of(t.hash.map(|h| h.0), a) {
            c.hash.map(|r| (Table::Hash, r))
        } else if is(ty, elf::SHT_RELA) && addr_of(t.rela.map(|r| r.addr), a) {
            Some((Table::Rela, c.rela))
        } else if is(ty, elf::SHT_RELA) && addr_of(jmprel, a) {
            c.jmprel.map(|r| (Table::Jmprel, r))
        } else if is(ty, elf::SHT_DYNAMIC) {
            Some((Table::Dynamic, dynamic))
        } else {
            None
        };
        if let Some((table, to)) = found {
            out.push(Repoint { section: s.index, table, to, old_addr: s.addr });
        }
    }
    out
}

/// The grown section name table at `end` (the end of the output's copy of
/// the input) and the section header table after it.
/// `extra`: a static program's sections ([`StaticPlan::sections`]), whose
/// names ([`STATIC_SECTION_NAMES`]) follow the usual new ones.
fn plan_section_headers(elf: &Elf, end: u64, eh_frame: bool, extra: usize) -> Result<(Shstrtab, FileRange, usize)> {
    let e = LE;
    let header = elf.file.elf_header();
    let shstrndx = usize::from(header.e_shstrndx.get(e).0);
    let section = elf.sections.get(shstrndx);
    // The writer moves the name table to the end of the file, with the new
    // names appended: a section a PT_LOAD maps would no longer be where its
    // segment maps it from, and a symbol table would no longer hold whole
    // symbols.
    let bad = |what: String| {
        let why =
            "the section name table is moved to the end of the file and grows: it must be a non-allocated SHT_STRTAB";
        Error::malformed_at(62, format!("e_shstrndx {shstrndx} names section [{shstrndx}] {what}; {why}"))
    };
    if let Some(s) = section.filter(|s| s.index != 0) {
        // Empty or not: it has its new names once moved.
        if s.is_alloc() && elf.offset_of(s.addr).is_some() {
            return Err(bad(format!("{:?}, which a PT_LOAD maps (SHF_ALLOC, address {})", s.name, s.addr)));
        }
        if [elf::SHT_SYMTAB.0, elf::SHT_DYNSYM.0].contains(&s.sh_type) {
            return Err(bad(format!("{:?}, a symbol table (type {:#x})", s.name, s.sh_type)));
        }
    }
    let mut size = section.map_or(0, |s| s.data.len() as u64);
    let names = [layout::SEC_SITES, layout::SEC_DATA, layout::SEC_COUNTERS, layout::SEC_TEXT, layout::SEC_EH_FRAME]
        .map(|n| {
            let at = size as u32;
            size += n.len() as u64 + 1;
            at
        });
    let static_names = (extra > 0).then(|| {
        STATIC_SECTION_NAMES.map(|n| {
            let at = size as u32;
            size += n.len() as u64 + 1;
            at
        })
    });
    if let Some(s) = section.filter(|s| s.index != 0 && s.addr.0.checked_add(size).is_none()) {
        return Err(bad(format!(
            "{:?}, whose address {} leaves no room for its {size} bytes once grown",
            s.name, s.addr
        )));
    }
    let shnum = elf.sections.len() + names.len() - usize::from(!eh_frame) + extra;
    if shnum >= 0xff00 {
        return Err(refuse("too many sections"));
    }
    let shstrtab = Shstrtab {
        section: section.map(|s| s.index),
        range: FileRange { offset: FileOffset(end), size },
        names,
        static_names,
    };
    let shdrs = FileRange { offset: FileOffset(align(end + size, 8)), size: shnum as u64 * 64 };
    Ok((shstrtab, shdrs, shnum))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    thread_local! {
        /// Lay trampolines out by shapes that ignore the counter index.
        pub(super) static WRONG_SHAPES: Cell<bool> = const { Cell::new(false) };
        /// Make every trampoline with the assembler.
        pub(super) static NO_TEMPLATES: Cell<bool> = const { Cell::new(false) };
    }

    /// Trampolines made from templates, kept as templates and values and
    /// made again as the file is written: the same file as with every
    /// trampoline from the assembler, in turn and on threads.
    #[test]
    fn templates_give_the_assembler_s_file() {
        for name in ["every_c", "libatshared.so", "cxx_new_delete"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testbins/golden").join(name);
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let a = crate::analyze(&data, name, None, &[]).unwrap();
            let elf = Elf::parse(&data).unwrap();
            let opts = |threads| PatchOptions { threads, ..PatchOptions::default() };
            NO_TEMPLATES.set(true);
            let want = crate::write::patch(&data, &a, &opts(1)).unwrap().to_vec();
            NO_TEMPLATES.set(false);
            for threads in [1, 3] {
                let p = plan(&elf, &a, &opts(threads)).unwrap();
                let made = p
                    .sites
                    .iter()
                    .filter(|s| matches!(s.trampoline().map(|t| &t.code.bytes), Some(Bytes::Made(_))))
                    .count();
                assert!(made > 0, "{name}: no trampoline from a template");
                let file = crate::write::patch(&data, &a, &opts(threads)).unwrap().to_vec();
                assert!(file == want, "{name} on {threads} threads: the files differ");
            }
        }
    }

    /// Shapes that predict wrong lengths: the threads' check sees it, the
    /// sites are planned in turn, and the plan and file are those of one
    /// thread.
    #[test]
    fn a_wrong_length_falls_back_to_planning_in_turn() {
        let mut fell_back = 0;
        for name in ["every_c", "libatshared.so", "cxx_new_delete"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testbins/golden").join(name);
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let a = crate::analyze(&data, name, None, &[]).unwrap();
            let elf = Elf::parse(&data).unwrap();
            let opts =
                |threads| PatchOptions { runtime_path: "liballoctramp_rt.so".into(), threads, ..Default::default() };
            let one = plan(&elf, &a, &opts(1)).unwrap();
            let right = plan(&elf, &a, &opts(3)).unwrap();
            assert!(right.threads > 1, "{name}");
            WRONG_SHAPES.set(true);
            let wrong = plan(&elf, &a, &opts(3));
            let file = crate::write::patch(&data, &a, &opts(3)).map(|p| p.to_vec());
            WRONG_SHAPES.set(false);
            let wrong = wrong.unwrap();
            fell_back += usize::from(wrong.threads == 1);
            assert_eq!(wrong.to_string(), one.to_string(), "{name}");
            let file = file.unwrap();
            assert!(file == crate::write::patch(&data, &a, &opts(1)).unwrap().to_vec(), "{name}: the files differ");
        }
        // (A file whose trampolines do not depend on the index may still
        // be made on threads.)
        assert!(fell_back >= 1, "no file fell back");
    }
}
