//! A plan as text: every segment, every part in file order, every
//! repointed section header and every site's decision, addresses in hex.
//! Stable (golden files compare it) and meant to be read.

use super::{Decision, FileRange, Plan, Region, Segment};
use std::fmt::{self, Display, Formatter, Write as _};

/// A row of the parts table.
struct Part {
    name: String,
    offset: u64,
    addr: Option<u64>,
    size: u64,
    note: String,
}

impl Part {
    fn loaded(name: impl Into<String>, r: Region, note: impl Into<String>) -> Part {
        Part { name: name.into(), offset: r.offset.0, addr: Some(r.addr.0), size: r.size, note: note.into() }
    }
    fn unloaded(name: impl Into<String>, r: FileRange, note: impl Into<String>) -> Part {
        Part { name: name.into(), offset: r.offset.0, addr: None, size: r.size, note: note.into() }
    }
}

fn flags(s: &Segment) -> String {
    let f = |bit: u32, c: char| if s.flags & bit != 0 { c } else { '-' };
    [f(4, 'R'), f(2, 'W'), f(1, 'X')].iter().collect()
}

impl Plan<'_> {
    /// Every part of the output in file order (the input as one part). A
    /// static program has no dynamic tables, and its runtime, entry stub
    /// and thread-local image (`StaticPlan`).
    fn parts(&self) -> Vec<Part> {
        let c = &self.copies;
        let n = self.tables.symbol_count();
        let statics = self.statics.as_ref();
        let mut parts = vec![
            Part::loaded("ELF header", self.ehdr, ""),
            Part::loaded("program headers", self.phdrs, format!("{} entries", self.phnum)),
            Part::loaded(".alloctramp.sites", self.site_table, format!("{} sites", self.sites.len())),
        ];
        if statics.is_none() {
            parts.push(Part::loaded(
                ".dynsym",
                c.dynsym,
                format!(
                    "{} symbols, the {} imported at index {}",
                    n + u64::from(crate::tables::IMPORTED),
                    crate::tables::IMPORTED,
                    self.tables.insert_at
                ),
            ));
            parts.push(Part::loaded(
                ".dynstr",
                c.dynstr,
                format!(
                    "{:#x} bytes of the input's, then the imported names{}",
                    self.tables.dynstr.size(),
                    if self.tables.needs_libc() { "" } else { " and the C library's" }
                ),
            ));
            let optional = [(".gnu.version", c.versym), (".gnu.hash", c.gnu_hash), (".hash", c.hash)];
            parts.extend(optional.into_iter().filter_map(|(name, r)| r.map(|r| Part::loaded(name, r, ""))));
            let relas = self.tables.rela.map_or(0, |r| r.items.len());
            parts.push(Part::loaded(".rela.dyn", c.rela, format!("{relas} relocations, then the import slots'")));
            if let Some(r) = c.jmprel {
                parts.push(Part::loaded(".rela.plt", r, format!("{} relocations", r.size / 24)));
            }
        }
        let code = |name: &str, c: &super::Code| {
            Part::loaded(name, Region { offset: c.offset, addr: c.addr, size: c.bytes.len() as u64 }, "")
        };
        let patched = self.sites.iter().filter(|s| s.trampoline().is_some()).count();
        parts.push(Part::loaded(".alloctramp.text", self.text, format!("stubs and {patched} trampolines")));
        match statics {
            None => {
                parts.push(code("  init stub", &self.init));
                parts.push(code("  fini stub", &self.fini));
            }
            Some(s) => {
                parts.push(code("  init stub (.init_array[0])", &self.init));
                parts.push(code("  exit stub (.fini_array[0])", &self.fini));
                parts.push(code("  entry stub (e_entry)", &s.entry));
            }
        }
        if let Some(eh) = &self.eh_frame {
            parts.push(Part::loaded(
                ".alloctramp.eh_frame",
                eh.entries,
                format!("unwind entries of {patched} trampolines"),
            ));
            parts.push(Part::loaded(".eh_frame_hdr", eh.hdr, "the input's search table and the new entries"));
        }
        if statics.is_none() {
            parts.push(Part::loaded(".dynamic", self.dynamic, format!("{} entries", self.dynamic_count())));
        }
        parts.push(Part::loaded(".alloctramp.data", self.control, "control block"));
        if let Some(s) = statics {
            let t = &s.runtime.tls;
            let note = format!("PT_TLS: {:#x} bytes, the program's block {:#x} in", t.memsz, s.runtime.tls_shift);
            parts.push(Part::loaded(".alloctramp.tdata", s.tls_image, note));
        }
        let k = &self.counters;
        let note = format!("no file bytes; {} shards of {:#x}", k.shards, k.stride);
        parts.push(Part::loaded(".alloctramp.counters", k.region, note));
        let input = FileRange { offset: alloctramp_trampolines::addr::FileOffset(self.shift), size: self.input_size };
        match statics {
            None => {
                parts.push(Part::unloaded("input", input, "the input file"));
                let new = if self.eh_frame.is_some() { 5 } else { 4 };
                parts.push(Part::unloaded(".shstrtab", self.shstrtab.range, format!("the input's names, then {new}")));
            }
            Some(s) => {
                let (n, fixups) = (s.runtime.segments.len(), s.runtime.fixups.len());
                let note = format!("{n} segments, relocated; {fixups} words for the entry stub");
                parts.push(Part::loaded(".alloctramp.runtime", s.runtime.image, note));
                let note = format!("the input file, {} words rewritten", s.words.len());
                parts.push(Part::unloaded("input", input, note));
                let new = alloctramp_trampolines::layout::NEW_SECTIONS.len() + super::STATIC_SECTION_NAMES.len();
                parts.push(Part::unloaded(".shstrtab", self.shstrtab.range, format!("the input's names, then {new}")));
            }
        }
        parts.push(Part::unloaded("section headers", self.shdrs, format!("{} entries", self.shnum)));
        parts
    }
}

impl Display for Plan<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        writeln!(f, "plan for {}", self.module)?;
        writeln!(f, "input: {:#x} bytes, at offset {:#x} in the output", self.input_size, self.shift)?;
        writeln!(f, "runtime: loaded from {:?}", self.runtime_path)?;
        writeln!(f, "\nsegments (new PT_LOADs):")?;
        for s in &self.segments {
            writeln!(
                f,
                "  {} offset {:<#10x} addr {:<#14x} filesz {:<#10x} memsz {:<#10x} align {:#x}",
                flags(s),
                s.offset.0,
                s.addr.0,
                s.file_size,
                s.mem_size,
                s.align
            )?;
        }
        writeln!(f, "\nparts (file order):")?;
        for p in self.parts() {
            let addr = p.addr.map_or("-".to_string(), |a| format!("{a:#x}"));
            let mut line =
                format!("  {:<20} offset {:<#10x} addr {:<14} size {:<#10x}", p.name, p.offset, addr, p.size);
            if !p.note.is_empty() {
                write!(line, " {}", p.note)?;
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        writeln!(f, "\nsection headers repointed:")?;
        for r in &self.repoints {
            writeln!(
                f,
                "  {:<5} {:<12} {:#x} -> {:#x} (offset {:#x}, size {:#x})",
                format!("[{}]", r.section),
                r.table.name(),
                r.old_addr.0,
                r.to.addr.0,
                r.to.offset.0,
                r.to.size
            )?;
        }
        // One line per site: index, address, form, decision, entry point.
        writeln!(f, "\nsites:")?;
        let decisions: Vec<String> = self
            .sites
            .iter()
            .map(|s| match &s.decision {
                Decision::Patched(t) => {
                    let drain = if t.drain != 0 { format!("+{:#x}", t.drain) } else { "-".into() };
                    let (at, size) = (t.code.addr.0, t.code.bytes.len());
                    format!("trampoline {at:#x} size {size:#x} drain {drain} count +{:#x}", t.count)
                }
                Decision::Skipped(reason) => format!("skipped: {reason}"),
            })
            .collect();
        let width = decisions.iter().map(String::len).max().unwrap_or(0);
        for (i, (s, decision)) in self.sites.iter().zip(&decisions).enumerate() {
            let entry = self.entries.get(s.entry).map_or("?", String::as_str);
            writeln!(f, "  {i:<4} {:<#10x} {:<15} {decision:<width$}  {entry}", s.addr.0, s.form.as_str())?;
        }
        Ok(())
    }
}
