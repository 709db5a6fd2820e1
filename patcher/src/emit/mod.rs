//! The bytes of a patched file, from its [`Plan`]: each emitter writes one
//! part where the plan put it. Nothing here decides a place or can fail:
//! the plan has checked the input and placed every part.
//!
//! * [`dynamic`]: the copies of the dynamic tables and the new .dynamic;
//! * [`sites`]: the site table;
//! * [`text`]: the stubs and trampolines (their unwind information,
//!   built by the plan, follows them);
//! * [`headers`]: the ELF header, the program headers, and (after the
//!   original file) the section name table and section headers;
//! * [`symbols`]: symbols that name a moved table follow it.

mod dynamic;
mod headers;
mod sites;
mod symbols;
mod text;

use crate::Analysis;
use crate::elf::Elf;
use crate::plan::{Plan, Region};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use alloctramp_trampolines::layout;

/// The patched file: `head`, the original with `fixups` applied (offset in
/// the original, new bytes), `tail`.
pub(crate) struct Emitted {
    pub head: Head,
    pub fixups: Vec<(u64, [u8; 8])>,
    pub tail: Vec<u8>,
}

/// The bytes before the original file (the new segments), as the parts
/// the emitters wrote, at their offsets: zeros lie between them. The
/// largest parts (the trampolines, their unwind entries, the site table)
/// are the plan's or the emitters' own buffers, moved here: the head is
/// never copied into one buffer.
#[derive(Debug)]
pub(crate) struct Head {
    len: u64,
    /// In file order, none overlapping another (`finish`).
    parts: Vec<(u64, Part)>,
}

/// A part's bytes: its own, one byte repeated, or a trampoline's made
/// from its template when written.
#[derive(Debug)]
enum Part {
    Bytes(Vec<u8>),
    Fill(u8, u64),
    Made(alloctramp_trampolines::template::Made),
}

impl Part {
    fn len(&self) -> u64 {
        match self {
            Part::Bytes(b) => b.len() as u64,
            Part::Fill(_, n) => *n,
            Part::Made(m) => m.len() as u64,
        }
    }
}

impl Head {
    fn new(len: u64) -> Head {
        Head { len, parts: Vec::new() }
    }

    /// A head of the given bytes (for tests of the writers).
    #[cfg(test)]
    pub(crate) fn from_bytes(bytes: Vec<u8>) -> Head {
        Head { len: bytes.len() as u64, parts: vec![(0, Part::Bytes(bytes))] }
    }

    /// Writes a part: exactly the size the plan gave it (an empty one is
    /// no part).
    fn put(&mut self, r: Region, bytes: Vec<u8>) {
        assert_eq!(
            bytes.len() as u64,
            r.size,
            "a part of {} bytes where the plan has {:#x} at {}",
            bytes.len(),
            r.size,
            r.offset
        );
        if !bytes.is_empty() {
            self.parts.push((r.offset.0, Part::Bytes(bytes)));
        }
    }

    /// Writes a part of code: its bytes, or how they are made.
    fn put_code(&mut self, r: Region, bytes: crate::plan::Bytes) {
        match bytes {
            crate::plan::Bytes::Own(b) => self.put(r, b),
            crate::plan::Bytes::Made(m) => {
                assert_eq!(
                    m.len() as u64,
                    r.size,
                    "a trampoline of {} bytes where the plan has {:#x}",
                    m.len(),
                    r.size
                );
                self.parts.push((r.offset.0, Part::Made(m)));
            }
        }
    }

    /// Room for `n` more parts.
    fn reserve(&mut self, n: usize) {
        self.parts.reserve(n);
    }

    /// `n` bytes `byte` at `offset`.
    fn fill(&mut self, offset: u64, n: u64, byte: u8) {
        if n > 0 {
            self.parts.push((offset, Part::Fill(byte, n)));
        }
    }

    /// Puts the parts in file order; every part lies inside the head and
    /// apart from the others.
    fn finish(mut self) -> Head {
        self.parts.sort_by_key(|p| p.0);
        let mut end = 0;
        for (at, part) in &self.parts {
            assert!(*at >= end, "a part at {at:#x} overlaps the part before it, which ends at {end:#x}");
            end = at + part.len();
        }
        assert!(end <= self.len, "a part ends at {end:#x}, past the new segments' end {:#x}", self.len);
        self
    }

    /// The head's length in the file.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Gives the head's bytes, in order, in pieces.
    pub(crate) fn pieces(&self, put: &mut impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        let mut at = 0;
        for (off, part) in &self.parts {
            repeat(put, 0, off - at)?;
            match part {
                Part::Bytes(b) => put(b)?,
                Part::Fill(byte, n) => repeat(put, *byte, *n)?,
                Part::Made(m) => {
                    put(&m.code().ok_or_else(|| std::io::Error::other("a trampoline's template failed"))?)?
                }
            }
            at = off + part.len();
        }
        repeat(put, 0, self.len - at)
    }
}

/// Gives `n` bytes `byte`, in pieces.
fn repeat(put: &mut impl FnMut(&[u8]) -> std::io::Result<()>, byte: u8, mut n: u64) -> std::io::Result<()> {
    let chunk = [byte; 4096];
    while n > 0 {
        let k = n.min(chunk.len() as u64);
        put(&chunk[..k as usize])?;
        n -= k;
    }
    Ok(())
}

/// A static program's thread-local symbols (values relative to the
/// thread-local image) follow its block, `shift` bytes into the new one.
fn tls_symbols(elf: &Elf, shift: u64) -> Vec<(u64, [u8; 8])> {
    use object::elf;
    let mut out = Vec::new();
    let Some(symtab) = elf.sections.iter().find(|s| s.sh_type == elf::SHT_SYMTAB.0) else { return out };
    for (i, sym) in symtab.data.chunks_exact(24).enumerate() {
        if sym[4] & 0xf == elf::STT_TLS.0 && sym[6..8] != [0, 0] {
            let value = u64::from_le_bytes(sym[8..16].try_into().unwrap_or_default());
            out.push((symtab.offset.0 + i as u64 * 24 + 8, value.wrapping_add(shift).to_le_bytes()));
        }
    }
    out
}

/// The jumps to the entry hooks' stubs, over the functions' first
/// instructions, as fixups of the eight-byte-aligned words of the input
/// that hold them (the other bytes of those words are the input's; no two
/// hooks share a word: `hooks::add`).
fn hook_jumps(elf: &Elf, plan: &Plan) -> Vec<(u64, [u8; 8])> {
    let mut out = Vec::new();
    for (offset, bytes) in plan.sites.iter().filter_map(|s| s.hook.as_ref()).map(|h| &h.jump) {
        let (lo, hi) = (offset.0 as usize, offset.0 as usize + bytes.len());
        for at in (lo & !7..hi).step_by(8) {
            let mut word = [0u8; 8];
            let input = elf.data.get(at..).unwrap_or_default();
            let n = input.len().min(8);
            word[..n].copy_from_slice(&input[..n]);
            for (k, b) in word.iter_mut().enumerate() {
                if (lo..hi).contains(&(at + k)) {
                    *b = bytes[at + k - lo];
                }
            }
            out.push((at as u64, word));
        }
    }
    out
}

/// The patched file's parts. The plan's generated code and unwind entries
/// are moved into the head (the plan keeps empty buffers in their place).
pub(crate) fn emit(elf: &Elf, a: &Analysis, plan: &mut Plan) -> Emitted {
    let mut head = Head::new(plan.shift);
    let follow = symbols::Follow::new(plan);
    head.put(plan.ehdr, headers::elf_header(elf, plan));
    head.put(plan.phdrs, headers::program_headers(elf, plan));
    head.put(plan.site_table, sites::table(elf, a, plan));
    let mut fixups = follow.symtab_fixups(elf);
    match &mut plan.statics {
        None => dynamic::emit(&mut head, plan, &follow),
        Some(s) => {
            // The runtime, and its API table in the control block's slot,
            // where a dynamic linker would have put it.
            head.put(s.runtime.image, std::mem::take(&mut s.runtime.bytes));
            head.put(s.tls_image, std::mem::take(&mut s.runtime.tls_bytes));
            let slot = Region {
                offset: FileOffset(plan.control.offset.0 + u64::from(layout::control::RUNTIME)),
                addr: Vaddr(plan.control.addr.0 + u64::from(layout::control::RUNTIME)),
                size: 8,
            };
            head.put(slot, s.runtime.api.to_le_bytes().to_vec());
            fixups.extend(s.words.iter().copied());
            fixups.extend(tls_symbols(elf, s.runtime.tls_shift));
        }
    }
    fixups.extend(hook_jumps(elf, plan));
    text::fill(plan, &mut head);
    if let Some(eh) = &mut plan.eh_frame {
        head.put(eh.region, std::mem::take(&mut eh.bytes));
    }
    let tail = headers::tail(elf, plan);
    Emitted { head: head.finish(), fixups, tail }
}
