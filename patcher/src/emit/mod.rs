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
    pub head: Vec<u8>,
    pub fixups: Vec<(u64, [u8; 8])>,
    pub tail: Vec<u8>,
}

/// The bytes before the original file: the new segments.
struct Head(Vec<u8>);

impl Head {
    /// Writes a part: exactly the size the plan gave it.
    fn put(&mut self, r: Region, bytes: &[u8]) {
        assert_eq!(
            bytes.len() as u64,
            r.size,
            "a part of {} bytes where the plan has {:#x} at {}",
            bytes.len(),
            r.size,
            r.offset
        );
        let at = r.offset.0 as usize;
        self.0[at..at + bytes.len()].copy_from_slice(bytes);
    }

    /// A part's bytes, for an emitter that writes them in place.
    fn part(&mut self, r: Region) -> &mut [u8] {
        let at = r.offset.0 as usize;
        &mut self.0[at..at + r.size as usize]
    }
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

pub(crate) fn emit(elf: &Elf, a: &Analysis, plan: &Plan) -> Emitted {
    let mut head = Head(vec![0u8; plan.shift as usize]);
    let follow = symbols::Follow::new(plan);
    head.put(plan.ehdr, &headers::elf_header(elf, plan));
    head.put(plan.phdrs, &headers::program_headers(elf, plan));
    head.put(plan.site_table, &sites::table(elf, a, plan));
    let mut fixups = follow.symtab_fixups(elf);
    match &plan.statics {
        None => dynamic::emit(&mut head, plan, &follow),
        Some(s) => {
            // The runtime, and its API table in the control block's slot,
            // where a dynamic linker would have put it.
            head.put(s.runtime.image, &s.runtime.bytes);
            head.put(s.tls_image, &s.runtime.tls_bytes);
            let slot = Region {
                offset: FileOffset(plan.control.offset.0 + u64::from(layout::control::RUNTIME)),
                addr: Vaddr(plan.control.addr.0 + u64::from(layout::control::RUNTIME)),
                size: 8,
            };
            head.put(slot, &s.runtime.api.to_le_bytes());
            fixups.extend(s.words.iter().copied());
            fixups.extend(tls_symbols(elf, s.runtime.tls_shift));
        }
    }
    fixups.extend(hook_jumps(elf, plan));
    text::fill(plan, head.part(plan.text));
    if let Some(eh) = &plan.eh_frame {
        head.put(eh.region, &eh.bytes);
    }
    Emitted { head: head.0, fixups, tail: headers::tail(elf, plan) }
}
