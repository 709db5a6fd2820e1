//! Unwind information for trampolines: an `.eh_frame` entry for each and a
//! new `.eh_frame_hdr` whose search table holds the input's entries and the
//! new ones (PT_GNU_EH_FRAME points at it).
//!
//! A trampoline runs on its site's frame (`frames` follows what it pushes).
//! While it is inside a call, its entry describes it as a frame of its own
//! called from the site: its canonical frame address is 8 bytes above the
//! site's stack pointer, as a callee's would be, every register is the
//! site's (rsp by an explicit rule), and the return address is the one after the
//! site, computed from the call's own return address by a constant
//! (`DW_CFA_val_expression`). An exception or panic thrown by the function
//! a trampoline calls therefore unwinds into the site's function at the
//! address after the site, where that function's own entry and LSDA find
//! the landing pad the original call had, on the frame it was compiled for;
//! a backtrace shows the trampoline between the callee and the site's
//! function. Elsewhere (a profiler's interrupt inside the trampoline's own
//! code) the entry copies the site's row, with the bytes the trampoline
//! pushed added to a stack-pointer-based CFA, so a walk goes on to the
//! site function's caller; where that row cannot be copied, the walk ends
//! there. A tail jump's trampoline is an ordinary frame whose return
//! address is on top of the site's stack.
//!
//! All pointers written are pc-relative: a position-independent file
//! needs no relocation for them.

use crate::elf::Elf;
use alloctramp_trampolines::frames::{Call, Frames};
use alloctramp_trampolines::layout::{control, undo::UndoCall, undo::UndoHeader};
use alloctramp_trampolines::pod;
use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EndianSlice, LittleEndian, Pointer, Register, RegisterRule,
    UnwindContext, UnwindSection, X86_64,
};
use object::elf;
use object::read::elf::ProgramHeader as _;

type Slice<'a> = EndianSlice<'a, LittleEndian>;

/// Why a trampoline gets no unwind entry.
pub type Why = &'static str;

/// The input's unwind information, read once.
pub struct Sources<'a> {
    eh: EhFrame<Slice<'a>>,
    bases: BaseAddresses,
    /// The search table: (start address, FDE address), sorted.
    table: Vec<(u64, u64)>,
    hdr_addr: Option<u64>,
    /// Where the input's `.eh_frame` starts (what the new header's
    /// `eh_frame_ptr` keeps pointing at).
    eh_frame: u64,
}

/// The site's row, which a trampoline's entry copies where it is not
/// inside a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteRow {
    cfa: Cfa,
    /// Every register rule of the site's row, as DWARF call frame
    /// instructions, and the registers they name.
    rules: Vec<u8>,
    regs: Vec<u16>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Cfa {
    /// rsp plus an offset: moves with what the trampoline pushes.
    Rsp(u64),
    /// Another register plus an offset, or an expression: as at the site.
    Fixed(Vec<u8>),
}

/// A trampoline and what its entry is made of.
pub struct Entry<'f> {
    pub addr: u64,
    pub len: u64,
    pub frames: &'f Frames,
    /// The address after the site: where the site's call returns.
    pub ret: u64,
    /// The site is a tail jump.
    pub tail: bool,
    pub site: Option<SiteRow>,
    /// The site's index and, per call of the target in address order,
    /// what an unwind through it undoes (`codegen::Trampoline::undo`).
    pub index: u32,
    pub undo: &'f [(u8, i32)],
}

/// A trampoline's entry before it is placed: its code's place, the call
/// frame instructions (which do not depend on where the entry goes) and
/// what its LSDA lists (none: the entry names no personality routine).
#[derive(Clone, Debug)]
pub struct Program {
    pub addr: u64,
    pub len: u64,
    pub instructions: Vec<u8>,
    pub index: u32,
    pub undo: Vec<UndoCall>,
}

impl Entry<'_> {
    /// The entry's call frame instructions and undo list.
    pub fn program(&self) -> Result<Program, Why> {
        let mut instructions = Vec::new();
        self::instructions(&mut instructions, self)?;
        let calls: Vec<&Call> = self.frames.calls.iter().filter(|c| c.target).collect();
        if calls.len() != self.undo.len() {
            return Err("the trampoline's calls of its target and its undo list differ");
        }
        let mut undo = Vec::new();
        for (c, &(what, size_at)) in calls.into_iter().zip(self.undo) {
            if what != 0 {
                let size_at = i16::try_from(size_at).map_err(|_| "a size slot out of reach")?;
                undo.push(UndoCall { ret: c.offset + c.len, what, pad: 0, size_at });
            }
        }
        Ok(Program { addr: self.addr, len: self.len, instructions, index: self.index, undo })
    }
}

const DW_EH_PE_PCREL_SDATA4: u8 = 0x1b;

impl<'a> Sources<'a> {
    /// The input's unwind tables, if a new header can carry them: a
    /// PT_GNU_EH_FRAME with a search table in the usual encodings, or, in a
    /// static program (whose start files register `.eh_frame` with the
    /// unwinder, with no header), `.eh_frame` itself, whose entries make
    /// the table.
    pub fn new(elf: &Elf<'a>) -> Result<Sources<'a>, Why> {
        let e = object::LittleEndian;
        let ph = elf.file.elf_program_headers().iter().find(|p| p.p_type(e) == elf::PT_GNU_EH_FRAME);
        let Some(ph) = ph else {
            if crate::statics::is_static(elf) {
                return Self::section(elf, ".eh_frame");
            }
            return Err("no PT_GNU_EH_FRAME");
        };
        let hdr_addr = ph.p_vaddr(e);
        let hdr_bytes = segment_rest(elf, hdr_addr)
            .and_then(|b| b.get(..usize::try_from(ph.p_filesz(e)).ok()?))
            .ok_or("PT_GNU_EH_FRAME outside the file")?;
        if hdr_bytes.len() < 4 || hdr_bytes[..4] != [1, DW_EH_PE_PCREL_SDATA4, 0x03, 0x3b] {
            return Err(".eh_frame_hdr in an unusual encoding");
        }
        let bases = BaseAddresses::default().set_eh_frame_hdr(hdr_addr);
        let hdr = EhFrameHdr::new(hdr_bytes, LittleEndian).parse(&bases, 8).map_err(|_| "unreadable .eh_frame_hdr")?;
        let eh_frame = match hdr.eh_frame_ptr() {
            Pointer::Direct(a) => a,
            Pointer::Indirect(_) => return Err(".eh_frame_hdr in an unusual encoding"),
        };
        // The .eh_frame section, or what its segment holds from its start.
        let data = match elf.sections.iter().find(|s| s.addr.0 == eh_frame && !s.data.is_empty()) {
            Some(s) => s.data,
            None => segment_rest(elf, eh_frame).ok_or(".eh_frame outside the file")?,
        };
        let bases = with_sections(elf, bases.set_eh_frame(eh_frame));
        // Every entry of the table must name an FDE inside .eh_frame (gimli
        // computes offsets from it without checking).
        let end = eh_frame.saturating_add(data.len() as u64);
        let old = hdr.table().ok_or(".eh_frame_hdr without a search table")?;
        let mut table = Vec::new();
        let mut it = old.iter(&bases);
        while let Some(pair) = it.next().map_err(|_| "unreadable .eh_frame_hdr")? {
            match pair {
                (Pointer::Direct(pc), Pointer::Direct(fde)) if fde >= eh_frame && fde < end => table.push((pc, fde)),
                _ => return Err("a search table entry outside .eh_frame"),
            }
        }
        // (Sorted as the loader requires; a crafted table may not be.)
        table.sort_unstable();
        let eh = EhFrame::new(data, LittleEndian);
        Ok(Sources { eh, bases, table, hdr_addr: Some(hdr_addr), eh_frame })
    }

    /// The unwind entries of the section `name` (a static program's
    /// `.eh_frame`; a patched file's `.alloctramp.eh_frame`), with the table
    /// made from them.
    pub fn section(elf: &Elf<'a>, name: &str) -> Result<Sources<'a>, Why> {
        let s = elf
            .sections
            .iter()
            .find(|s| s.name == name && s.is_alloc() && !s.data.is_empty())
            .ok_or("no such section of unwind entries")?;
        let eh_frame = s.addr.0;
        let bases = with_sections(elf, BaseAddresses::default().set_eh_frame(eh_frame));
        let eh = EhFrame::new(s.data, LittleEndian);
        let mut table = Vec::new();
        let mut entries = eh.entries(&bases);
        while let Some(entry) = entries.next().map_err(|_| "unreadable .eh_frame")? {
            // (An entry that does not parse is left out of the table, as the
            // unwinder would not use it either.)
            if let gimli::CieOrFde::Fde(partial) = entry
                && let Ok(fde) = partial.parse(|eh, b, o| eh.cie_from_offset(b, o))
                && fde.len() > 0
            {
                table.push((fde.initial_address(), eh_frame + fde.offset() as u64));
            }
        }
        table.sort_unstable();
        Ok(Sources { eh, bases, table, hdr_addr: None, eh_frame })
    }

    /// Where the input's `.eh_frame_hdr` is (None: it has none).
    pub fn hdr_addr(&self) -> Option<u64> {
        self.hdr_addr
    }

    /// The CFI row at `at` (as [`Sources::site`], with a context of its
    /// own).
    pub fn row(&self, at: u64) -> Result<SiteRow, Why> {
        self.site(at, &mut UnwindContext::new())
    }

    /// The CFI row at `site`, if an entry can copy it.
    pub fn site(&self, site: u64, ctx: &mut UnwindContext<usize>) -> Result<SiteRow, Why> {
        let k = self.table.partition_point(|&(pc, _)| pc <= site);
        let &(_, fde_addr) =
            k.checked_sub(1).and_then(|k| self.table.get(k)).ok_or("no unwind entry covers the site")?;
        let offset =
            gimli::EhFrameOffset(usize::try_from(fde_addr - self.eh_frame).map_err(|_| "an FDE out of reach")?);
        let fde = self
            .eh
            .fde_from_offset(&self.bases, offset, |s, b, o| s.cie_from_offset(b, o))
            .map_err(|_| "no unwind entry covers the site")?;
        if !fde.contains(site) {
            return Err("no unwind entry covers the site");
        }
        let row = fde.unwind_info_for_address(&self.eh, &self.bases, ctx, site).map_err(|_| "unreadable CFI")?;
        let cfa = match row.cfa() {
            CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => {
                Cfa::Rsp(u64::try_from(*offset).map_err(|_| "negative CFA offset")?)
            }
            CfaRule::RegisterAndOffset { register, offset } => {
                if !KEPT.contains(register) {
                    return Err("CFA in a register trampolines use");
                }
                let mut v = vec![0x12];
                uleb(&mut v, u64::from(register.0));
                // def_cfa_sf: the offset is factored by the data alignment.
                if offset % DATA_ALIGN != 0 {
                    return Err("CFA offset not a multiple of 8");
                }
                sleb(&mut v, offset / DATA_ALIGN);
                Cfa::Fixed(v)
            }
            CfaRule::Expression(x) => {
                let bytes = expression(&self.eh, x)?;
                let mut v = vec![0x0f];
                uleb(&mut v, bytes.len() as u64);
                v.extend_from_slice(bytes);
                Cfa::Fixed(v)
            }
        };
        let mut rules = Vec::new();
        let mut regs = Vec::new();
        for (reg, rule) in row.registers() {
            self.rule(&mut rules, *reg, rule)?;
            regs.push(reg.0);
        }
        Ok(SiteRow { cfa, rules, regs })
    }

    /// The entry of an entry hook's stub at `addr` (`crate::hooks`), from
    /// `points`: each moved instruction's offset in the stub and its
    /// original address (the first at offset 0), then the jump back's and
    /// the address it goes back to. Each instruction has the row it had
    /// where it came from: the stub unwinds as the function's head did.
    pub fn stub_program(&self, addr: u64, len: u64, points: &[(u32, u64)]) -> Result<Program, Why> {
        if points.first().is_none_or(|p| p.0 != 0) {
            return Err("a stub without its first instruction");
        }
        let mut ctx = UnwindContext::new();
        let mut out = Vec::new();
        let (mut last, mut prev): (u32, Vec<u16>) = (0, Vec::new());
        for &(offset, orig) in points {
            let row = self.site(orig, &mut ctx)?;
            advance(&mut out, offset - last);
            last = offset;
            match &row.cfa {
                Cfa::Rsp(off) => {
                    out.extend_from_slice(&[0x0c, 7]); // DW_CFA_def_cfa rsp
                    uleb(&mut out, *off);
                }
                Cfa::Fixed(v) => out.extend_from_slice(v),
            }
            out.extend_from_slice(&row.rules);
            // A register whose rule the function's row no longer has is
            // the caller's again.
            for r in prev.iter().filter(|r| !row.regs.contains(r)) {
                out.push(0x08); // DW_CFA_same_value
                uleb(&mut out, u64::from(*r));
            }
            prev = row.regs;
        }
        Ok(Program { addr, len, instructions: out, index: u32::MAX, undo: Vec::new() })
    }

    /// Appends the instruction that sets `reg`'s rule.
    fn rule(&self, out: &mut Vec<u8>, reg: Register, rule: &RegisterRule<usize>) -> Result<(), Why> {
        let r = u64::from(reg.0);
        let factored = |n: i64| if n % DATA_ALIGN == 0 { Ok(n / DATA_ALIGN) } else { Err("unaligned save slot") };
        match rule {
            RegisterRule::Undefined => {
                out.push(0x07);
                uleb(out, r);
            }
            RegisterRule::SameValue => {
                out.push(0x08);
                uleb(out, r);
            }
            RegisterRule::Offset(n) => {
                out.push(0x11);
                uleb(out, r);
                sleb(out, factored(*n)?);
            }
            RegisterRule::ValOffset(n) => {
                out.push(0x15);
                uleb(out, r);
                sleb(out, factored(*n)?);
            }
            RegisterRule::Register(from) => {
                if !KEPT.contains(from) {
                    return Err("a register rule names a register trampolines use");
                }
                out.push(0x09);
                uleb(out, r);
                uleb(out, u64::from(from.0));
            }
            RegisterRule::Expression(x) | RegisterRule::ValExpression(x) => {
                let bytes = expression(&self.eh, x)?;
                out.push(if matches!(rule, RegisterRule::Expression(_)) { 0x10 } else { 0x16 });
                uleb(out, r);
                uleb(out, bytes.len() as u64);
                out.extend_from_slice(bytes);
            }
            _ => return Err("a register rule the entry cannot copy"),
        }
        Ok(())
    }

    /// The region holding the trampolines' entries, their LSDAs and the
    /// new header, placed at `at`, for the module whose control block is
    /// at `control_block`; and the header's offset in it.
    /// The programs are consumed as they are copied, so that the patcher
    /// does not hold both at their full size.
    pub fn region(&self, entries: Vec<Program>, at: u64, control_block: u64) -> Result<(Vec<u8>, u64), Why> {
        // (Room for it all at once: a large library's is tens of
        // megabytes, which growing would hold twice for a moment.) An
        // entry is at most 28 bytes and its instructions, its undo list
        // (if any) a header and its calls; the search table 8 bytes per
        // entry, the input's and these.
        let undo = |e: &Program| match e.undo.len() {
            0 => 0,
            n => size_of::<UndoHeader>() + n * size_of::<UndoCall>(),
        };
        let size = entries.iter().map(|e| e.instructions.len() + 28 + undo(e)).sum::<usize>()
            + 8 * (self.table.len() + entries.len())
            + 64;
        let mut out: Vec<u8> = Vec::with_capacity(size);
        cie(&mut out, at, None)?;
        // The CIE naming the runtime's personality routine, through the
        // control block's slot.
        let personality = if entries.iter().any(|e| !e.undo.is_empty()) {
            let pos = out.len();
            cie(&mut out, at, Some(control_block + u64::from(control::PERSONALITY)))?;
            Some(pos)
        } else {
            None
        };
        let mut fdes: Vec<(u64, u64)> = Vec::with_capacity(entries.len());
        // (position of an FDE's LSDA pointer, its entry): LSDAs follow.
        let mut lsdas: Vec<(usize, Program)> = Vec::new();
        for mut e in entries {
            let pos = out.len();
            let fde_addr = at + pos as u64;
            out.extend_from_slice(&[0; 4]);
            // The CIE pointer: back from this field to the CIE.
            let cie_at = match personality {
                Some(p) if !e.undo.is_empty() => p,
                _ => 0,
            };
            out.extend_from_slice(&((pos + 4 - cie_at) as u32).to_le_bytes());
            let field = at + out.len() as u64;
            out.extend_from_slice(&rel32(e.addr, field)?.to_le_bytes());
            out.extend_from_slice(&u32::try_from(e.len).map_err(|_| "trampoline too long")?.to_le_bytes());
            let lsda_field = (!e.undo.is_empty()).then_some(out.len() + 1);
            out.push(if lsda_field.is_some() { 4 } else { 0 });
            out.extend_from_slice(if lsda_field.is_some() { &[0; 4] } else { &[] });
            out.extend_from_slice(&std::mem::take(&mut e.instructions));
            pad_entry(&mut out, pos);
            fdes.push((e.addr, fde_addr));
            if let Some(field) = lsda_field {
                lsdas.push((field, e));
            }
        }
        out.extend_from_slice(&[0; 4]);
        for (field, e) in lsdas {
            let lsda = at + out.len() as u64;
            let v = rel32(lsda, at + field as u64)?;
            out[field..field + 4].copy_from_slice(&v.to_le_bytes());
            let header =
                UndoHeader { control: rel32(control_block, lsda)?, index: e.index, count: e.undo.len() as u32 };
            out.extend_from_slice(pod::bytes_of(&header));
            for u in &e.undo {
                out.extend_from_slice(pod::bytes_of(u));
            }
        }
        // The header: the input's search table with the new entries merged.
        let hdr_off = out.len() as u64;
        let hdr = at + hdr_off;
        let mut table = self.table.clone();
        table.extend_from_slice(&fdes);
        table.sort_unstable();
        out.extend_from_slice(&[1, DW_EH_PE_PCREL_SDATA4, 0x03, 0x3b]);
        let field = at + out.len() as u64;
        out.extend_from_slice(&rel32(self.eh_frame, field)?.to_le_bytes());
        out.extend_from_slice(&u32::try_from(table.len()).map_err(|_| "too many unwind entries")?.to_le_bytes());
        for (pc, fde) in table {
            out.extend_from_slice(&rel32(pc, hdr)?.to_le_bytes());
            out.extend_from_slice(&rel32(fde, hdr)?.to_le_bytes());
        }
        Ok((out, hdr_off))
    }
}

/// `bases` with the file's `.text` and `.got` (for entries whose pointers
/// are relative to them).
fn with_sections(elf: &Elf, mut bases: BaseAddresses) -> BaseAddresses {
    for (name, set) in [
        (".text", BaseAddresses::set_text as fn(BaseAddresses, u64) -> BaseAddresses),
        (".got", BaseAddresses::set_got),
    ] {
        if let Some(s) = elf.section_by_name(name) {
            bases = set(bases, s.addr.0);
        }
    }
    bases
}

/// Registers no trampoline changes: rules and CFAs naming them hold in a
/// trampoline as at its site (rsp is tracked).
const KEPT: [Register; 5] = [X86_64::RBP, X86_64::R12, X86_64::R13, X86_64::R14, X86_64::R15];

const DATA_ALIGN: i64 = -8;

/// An expression's bytes, refused when it reads rsp or rbx (whose values
/// in a trampoline differ from the site's). The test is on bytes, so an
/// operand that happens to look like such an operation refuses too.
fn expression<'a>(eh: &EhFrame<Slice<'a>>, x: &gimli::UnwindExpression<usize>) -> Result<&'a [u8], Why> {
    let e = x.get(eh).map_err(|_| "unreadable expression")?;
    let bytes = e.0.slice();
    // DW_OP_reg3/7, DW_OP_breg3/7, DW_OP_regx, DW_OP_bregx.
    if bytes.iter().any(|b| matches!(b, 0x53 | 0x57 | 0x73 | 0x77 | 0x90 | 0x92)) {
        return Err("an expression that may read rsp or rbx");
    }
    Ok(bytes)
}

/// The bytes of `elf` from `addr` to the end of its segment's file image.
fn segment_rest<'a>(elf: &Elf<'a>, addr: u64) -> Option<&'a [u8]> {
    let e = object::LittleEndian;
    let ph = elf
        .file
        .elf_program_headers()
        .iter()
        .find(|p| p.p_type(e) == elf::PT_LOAD && addr >= p.p_vaddr(e) && addr - p.p_vaddr(e) < p.p_filesz(e))?;
    let start = ph.p_offset(e).checked_add(addr - ph.p_vaddr(e))?;
    let end = ph.p_offset(e).checked_add(ph.p_filesz(e))?;
    elf.data.get(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
}

fn rel32(to: u64, from: u64) -> Result<i32, Why> {
    i32::try_from(to.wrapping_sub(from) as i64).map_err(|_| "unwind entry out of 32-bit reach")
}

fn uleb(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn sleb(out: &mut Vec<u8>, mut v: i64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if (v == 0 && b & 0x40 == 0) || (v == -1 && b & 0x40 != 0) {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// Pads an entry that starts at `pos` (its length word) to 8 bytes with
/// DW_CFA_nop and sets its length.
fn pad_entry(out: &mut Vec<u8>, pos: usize) {
    while !(out.len() - pos).is_multiple_of(8) {
        out.push(0);
    }
    let len = (out.len() - pos - 4) as u32;
    out[pos..pos + 4].copy_from_slice(&len.to_le_bytes());
}

/// A CIE at the end of `out` (the region starts at `at`): code alignment
/// 1, data alignment -8, return address in column 16, pc-relative
/// pointers, no initial instructions (every entry states its rules); with
/// the address of the slot holding a personality routine, `zPLR`.
fn cie(out: &mut Vec<u8>, at: u64, personality: Option<u64>) -> Result<(), Why> {
    let pos = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&0u32.to_le_bytes());
    out.push(1);
    match personality {
        None => {
            out.extend_from_slice(b"zR\0");
            out.extend_from_slice(&[1, 0x78, 16, 1, DW_EH_PE_PCREL_SDATA4]);
        }
        Some(slot) => {
            out.extend_from_slice(b"zPLR\0");
            // Augmentation data: the personality's encoding and pointer,
            // the LSDA's encoding, the FDE pointers' encoding.
            out.extend_from_slice(&[1, 0x78, 16, 7, 0x80 | DW_EH_PE_PCREL_SDATA4]);
            let field = at + out.len() as u64;
            out.extend_from_slice(&rel32(slot, field)?.to_le_bytes());
            out.extend_from_slice(&[DW_EH_PE_PCREL_SDATA4, DW_EH_PE_PCREL_SDATA4]);
        }
    }
    pad_entry(out, pos);
    Ok(())
}

/// The CFA rule as the instructions so far left it: `DW_CFA_def_cfa`
/// only when the register changes, `DW_CFA_def_cfa_offset` otherwise.
#[derive(Clone, Copy, Default)]
struct CfaState(Option<(u16, u64)>);

impl CfaState {
    fn set(&mut self, out: &mut Vec<u8>, reg: Register, off: u64) {
        match self.0 {
            Some((r, o)) if r == reg.0 && o == off => {}
            Some((r, _)) if r == reg.0 => {
                out.push(0x0e);
                uleb(out, off);
            }
            _ => {
                out.push(0x0c);
                uleb(out, u64::from(reg.0));
                uleb(out, off);
            }
        }
        self.0 = Some((reg.0, off));
    }

    /// The CFA at a row `below` bytes under the site's stack pointer, with
    /// the site's own CFA `site_off` above it (8 inside a call, where the
    /// trampoline is a frame of its own).
    fn stack(&mut self, out: &mut Vec<u8>, below: u32, site_off: u64) {
        self.set(out, X86_64::RSP, site_off + u64::from(below))
    }
}

/// The call frame instructions of a trampoline's entry.
fn instructions(out: &mut Vec<u8>, e: &Entry) -> Result<(), Why> {
    // What a row outside calls says: the site's row moved by the stack,
    // or (a tail jump without a copyable row) an ordinary frame, or the
    // end of the walk.
    let (site_off, outside): (Option<u64>, Vec<u8>) = match (&e.site, e.tail) {
        (Some(s), _) => {
            let mut v = Vec::new();
            if let Cfa::Fixed(f) = &s.cfa {
                v.extend_from_slice(f);
            }
            v.extend_from_slice(&s.rules);
            (if let Cfa::Rsp(off) = s.cfa { Some(off) } else { None }, v)
        }
        (None, true) => (Some(8), vec![0x11, 16, 1]),
        (None, false) => (Some(0), vec![0x07, 16]),
    };
    out.extend_from_slice(&outside);
    // Change points: rows, and (but at a tail jump, whose trampoline is an
    // ordinary frame throughout) the start and end of every call of the
    // target (an unwind from a runtime function, which never throws, goes
    // on by the site's row).
    let calls: Vec<Call> =
        if e.tail { Vec::new() } else { e.frames.calls.iter().copied().filter(|c| c.target).collect() };
    let mut points: Vec<u32> = e.frames.rows.iter().map(|r| r.offset).collect();
    // A call's state starts after its first byte: an unwinder looks up a
    // return address less one, and a walk from a signal taken at the call
    // itself (nothing pushed yet) needs the row outside.
    for c in &calls {
        points.push(c.offset + 1);
        points.push(c.offset + c.len);
    }
    points.sort_unstable();
    points.dedup();
    let mut last = 0u32;
    let mut in_call = false;
    // A copied CFA in another register or an expression is unknown here.
    let mut cfa = CfaState::default();
    let mut outside_cfa = cfa;
    for &p in &points {
        let row = e.frames.rows.iter().rev().find(|r| r.offset <= p).copied().ok_or("no row at the start")?;
        let call = calls.iter().find(|c| c.offset < p && p < c.offset + c.len);
        advance(out, p - last);
        last = p;
        if in_call {
            out.push(0x0b); // DW_CFA_restore_state
            in_call = false;
            cfa = outside_cfa;
        }
        if let Some(c) = call {
            out.push(0x0a); // DW_CFA_remember_state
            in_call = true;
            outside_cfa = cfa;
            // The CFA sits 8 bytes above the site's stack pointer, as a
            // called function's does, and rsp's rule gives the site's: a
            // frame whose CFA equaled its caller's stack pointer would
            // share its identity with its caller in the unwinder's phase 2
            // (libgcc compares CFAs to find the handler's frame).
            cfa.stack(out, row.below, 8);
            out.extend_from_slice(&[0x15, 7, 1]); // DW_CFA_val_offset_sf rsp, CFA - 8
            // Every register is the site's: the trampoline changed none
            // (rsp's and the return address's rules are set here).
            for &r in e.site.iter().flat_map(|s| &s.regs) {
                if ![3, 7, 16].contains(&r) {
                    out.push(0x08);
                    uleb(out, u64::from(r));
                }
            }
            out.extend_from_slice(&[0x08, 3]); // DW_CFA_same_value rbx
            // The return address: the call's own, at [rsp - 8] in this
            // frame, moved to the address after the site.
            let after_call = e.addr + u64::from(c.offset + c.len);
            let k = e.ret.wrapping_sub(after_call) as i64;
            let mut x = vec![0x77];
            sleb(&mut x, -8);
            x.push(0x06);
            x.push(0x11);
            sleb(&mut x, k);
            x.push(0x22);
            out.push(0x16);
            uleb(out, 16);
            uleb(out, x.len() as u64);
            out.extend_from_slice(&x);
            continue;
        }
        if let Some(off) = site_off {
            cfa.stack(out, row.below, off);
        }
    }
    Ok(())
}

/// The vector stub's entry (`codegen::vector_stub`): an ordinary frame
/// that saves rbx and then finds its CFA through it while the stack is
/// realigned.
pub fn vector_stub_program(addr: u64, len: u64) -> Program {
    use alloctramp_trampolines::codegen::{VECTOR_STUB_EPILOGUE, VECTOR_STUB_PROLOGUE};
    let mut out = vec![0x0c, 7, 8, 0x90, 1]; // CFA = rsp + 8; return address at CFA - 8
    advance(&mut out, 1); // push rbx
    out.extend_from_slice(&[0x0e, 16, 0x83, 2]); // CFA = rsp + 16; rbx at CFA - 16
    advance(&mut out, VECTOR_STUB_PROLOGUE - 1); // mov rbx, rsp
    out.extend_from_slice(&[0x0d, 3]); // CFA = rbx + 16
    let restore = len as u32 - VECTOR_STUB_EPILOGUE;
    advance(&mut out, restore + 3 - VECTOR_STUB_PROLOGUE); // mov rsp, rbx
    out.extend_from_slice(&[0x0d, 7]); // CFA = rsp + 16
    advance(&mut out, 1); // pop rbx
    out.extend_from_slice(&[0x0e, 8, 0xc3]); // CFA = rsp + 8; rbx restored
    Program { addr, len, instructions: out, index: u32::MAX, undo: Vec::new() }
}

/// The entry of a stub that never moves the stack pointer (the wide-size
/// stub, `codegen::wide_stub`): the CFA is rsp + 8 throughout.
pub fn leaf_stub_program(addr: u64, len: u64) -> Program {
    let out = vec![0x0c, 7, 8, 0x90, 1]; // CFA = rsp + 8; return address at CFA - 8
    Program { addr, len, instructions: out, index: u32::MAX, undo: Vec::new() }
}

/// The trace stub's entry (`codegen::trace_stub`): an ordinary frame whose
/// CFA follows the registers its way to the runtime pushes, from the
/// stub's own code.
pub fn trace_stub_program(addr: u64, code: &[u8]) -> Program {
    let mut out = vec![0x0c, 7, 8, 0x90, 1]; // CFA = rsp + 8; return address at CFA - 8
    // The generator's stub always follows (a test holds it to that); rows
    // from an unfollowable stub would be wrong, so it keeps the first.
    let rows = alloctramp_trampolines::frames::frames(code, addr, &[0], 0).map(|f| f.rows).unwrap_or_default();
    let mut at = 0;
    for r in rows.iter().filter(|r| r.offset != 0) {
        advance(&mut out, r.offset - at);
        at = r.offset;
        out.push(0x0e); // DW_CFA_def_cfa_offset
        uleb(&mut out, 8 + u64::from(r.below));
    }
    Program { addr, len: code.len() as u64, instructions: out, index: u32::MAX, undo: Vec::new() }
}

fn advance(out: &mut Vec<u8>, delta: u32) {
    match delta {
        0 => {}
        1..0x40 => out.push(0x40 | delta as u8),
        0x40..0x100 => out.extend_from_slice(&[0x02, delta as u8]),
        0x100..0x10000 => {
            out.push(0x03);
            out.extend_from_slice(&(delta as u16).to_le_bytes());
        }
        _ => {
            out.push(0x04);
            out.extend_from_slice(&delta.to_le_bytes());
        }
    }
}
