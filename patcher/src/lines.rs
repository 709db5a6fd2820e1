//! `file:line` of an address from DWARF line tables, in the file itself or
//! in a separate debug file (the caller finds and maps that file).

use addr2line::Context;
use gimli::{EndianSlice, RunTimeEndian, SectionId};
use object::{Object, ObjectSection};
use std::borrow::Cow;
use std::collections::HashMap;

/// A source location.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Location {
    pub file: String,
    pub line: u32,
}

/// The DWARF sections of one object file, decompressed where needed.
pub struct DebugSections<'a> {
    sections: HashMap<SectionId, Cow<'a, [u8]>>,
}

impl<'a> DebugSections<'a> {
    /// `None` when the file has no line table.
    pub fn load(file: &impl Object<'a>) -> Option<DebugSections<'a>> {
        file.section_by_name(".debug_line")?;
        let ids = [
            SectionId::DebugAbbrev,
            SectionId::DebugAddr,
            SectionId::DebugInfo,
            SectionId::DebugLine,
            SectionId::DebugLineStr,
            SectionId::DebugRanges,
            SectionId::DebugRngLists,
            SectionId::DebugStr,
            SectionId::DebugStrOffsets,
            SectionId::DebugAranges,
        ];
        let sections = ids
            .into_iter()
            .filter_map(|id| {
                let data = file.section_by_name(id.name())?.uncompressed_data().ok()?;
                Some((id, data))
            })
            .collect();
        Some(DebugSections { sections })
    }
}

/// DWARF line lookups.
pub struct Lines<'s> {
    ctx: Context<EndianSlice<'s, RunTimeEndian>>,
}

impl<'s> Lines<'s> {
    pub fn new(sections: &'s DebugSections<'_>) -> Option<Lines<'s>> {
        let load = |id: SectionId| -> Result<EndianSlice<'s, RunTimeEndian>, gimli::Error> {
            let data = sections.sections.get(&id).map(|c| &**c).unwrap_or(&[]);
            Ok(EndianSlice::new(data, RunTimeEndian::Little))
        };
        let dwarf = gimli::Dwarf::load(load).ok()?;
        let ctx = Context::from_dwarf(dwarf).ok()?;
        Some(Lines { ctx })
    }

    /// The inlined functions at an address, innermost first, each with its
    /// (linkage, else plain) name and where in it the address is (for an
    /// outer frame: the call of the inner one). Empty without DWARF
    /// function information there.
    pub fn inline_frames(&self, addr: u64) -> Vec<(Option<String>, Option<Location>)> {
        let mut out = Vec::new();
        let Ok(mut frames) = self.ctx.find_frames(addr).skip_all_loads() else { return out };
        while let Ok(Some(f)) = frames.next() {
            let name = f.function.as_ref().and_then(|n| n.raw_name().ok()).map(|n| n.into_owned());
            let loc = f.location.and_then(|l| Some(Location { file: l.file?.to_string(), line: l.line? }));
            out.push((name, loc));
        }
        out
    }

    /// The innermost source location of an address (for inlined code, the
    /// inlined function's line).
    pub fn find(&self, addr: u64) -> Option<Location> {
        let loc = self.ctx.find_location(addr).ok()??;
        Some(Location { file: loc.file?.to_string(), line: loc.line? })
    }
}
