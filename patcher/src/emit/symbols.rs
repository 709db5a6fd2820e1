//! Symbols that name a moved table follow it: the linker's `_DYNAMIC` (its
//! address, and its size where the linker gave one, as gold does) and the
//! section symbols of the repointed sections (and every symbol of the
//! replaced `.eh_frame_hdr`: the linker's `__GNU_EH_FRAME_HDR`), in .symtab
//! (fixups of the original bytes) and in the new .dynsym.

use crate::bytes::c_str;
use crate::elf::Elf;
use crate::plan::{Plan, Region, Table};
use crate::tables::Sym;
use object::LittleEndian as LE;
use object::elf;
use object::pod::slice_from_all_bytes;

pub(super) struct Follow {
    old_dynamic: u64,
    new_dynamic: Region,
    /// Sections now elsewhere in memory: (index, old address, new address,
    /// whether every symbol in it follows, not only its section symbol).
    moved: Vec<(usize, u64, u64, bool)>,
}

impl Follow {
    pub fn new(plan: &Plan) -> Follow {
        let moved = plan
            .repoints
            .iter()
            .filter(|r| r.old_addr != r.to.addr)
            .map(|r| (r.section, r.old_addr.0, r.to.addr.0, r.table == Table::EhFrameHdr))
            .collect();
        // A static program's .dynamic (a position-independent one's) stays.
        let old_dynamic = if plan.statics.is_some() { u64::MAX } else { plan.tables.dynamic_addr.0 };
        Follow { old_dynamic, new_dynamic: plan.dynamic, moved }
    }

    /// The new value and, for `_DYNAMIC` with a size, the new size.
    fn follow(&self, sym: &Sym, strtab: &[u8]) -> Option<(u64, Option<u64>)> {
        let e = LE;
        if sym.st_value.get(e) == self.old_dynamic && c_str(strtab, sym.st_name.get(e)) == b"_DYNAMIC" {
            let size = (sym.st_size.get(e) != 0).then_some(self.new_dynamic.size);
            return Some((self.new_dynamic.addr.0, size));
        }
        let shndx = usize::from(sym.st_shndx.get(e).0);
        if let Some(&(_, old, new, all)) = self.moved.iter().find(|m| m.0 == shndx)
            && (all || sym.st_type() == elf::STT_SECTION)
        {
            return Some((new.wrapping_add(sym.st_value.get(e).wrapping_sub(old)), None));
        }
        None
    }

    /// The symbol as it must be in the output, if it changes.
    pub fn symbol(&self, sym: &Sym, strtab: &[u8]) -> Option<Sym> {
        let (value, size) = self.follow(sym, strtab)?;
        let mut s = *sym;
        s.st_value.set(LE, value);
        if let Some(size) = size {
            s.st_size.set(LE, size);
        }
        Some(s)
    }

    /// The changes to .symtab, as (offset in the input, new bytes).
    pub fn symtab_fixups(&self, elf: &Elf) -> Vec<(u64, [u8; 8])> {
        let mut fixups = Vec::new();
        let Some(symtab) = elf.sections.iter().find(|s| s.sh_type == elf::SHT_SYMTAB.0) else { return fixups };
        let strtab = elf.sections.get(symtab.link as usize).map_or(&[][..], |s| s.data);
        let syms: &[Sym] = slice_from_all_bytes(&symtab.data[..symtab.data.len() / 24 * 24]).unwrap_or(&[]);
        for (i, sym) in syms.iter().enumerate() {
            if let Some((value, size)) = self.follow(sym, strtab) {
                let at = symtab.offset.0 + i as u64 * 24;
                fixups.push((at + 8, value.to_le_bytes()));
                if let Some(size) = size {
                    fixups.push((at + 16, size.to_le_bytes()));
                }
            }
        }
        fixups
    }
}
