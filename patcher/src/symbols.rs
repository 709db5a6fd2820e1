//! Which function contains an address: from .symtab, else .dynsym, else the
//! function boundaries recorded in .eh_frame (named `fn@0x...`).

use crate::elf::Elf;

#[derive(Clone, Debug)]
struct Range {
    start: u64,
    end: u64,
    name: Option<String>,
    /// Global symbols win over local aliases at the same address.
    rank: u8,
}

/// Sorted, searchable function boundaries of one file.
pub struct FunctionIndex {
    tables: [Vec<Range>; 3],
}

impl FunctionIndex {
    pub fn new(elf: &Elf) -> FunctionIndex {
        let symbols = |dynamic: bool| -> Vec<Range> {
            let mut v: Vec<Range> = elf
                .symbols(dynamic)
                .iter()
                .filter(|s| s.defined && s.is_func && s.size > 0)
                .map(|s| Range {
                    start: s.value,
                    end: s.value.saturating_add(s.size),
                    name: Some(s.name.to_string()),
                    rank: if s.global { 0 } else { 1 },
                })
                .collect();
            v.sort_by(|a, b| a.start.cmp(&b.start).then(a.rank.cmp(&b.rank)).then(a.name.cmp(&b.name)));
            v
        };
        let symtab = symbols(false);
        let dynsym = symbols(true);
        let mut fdes = eh_frame_ranges(elf);
        fdes.sort_by_key(|r| r.start);
        FunctionIndex { tables: [symtab, dynsym, fdes] }
    }

    /// The mangled name of the function containing `addr`, or `fn@0x...`
    /// from unwind information, or `None`.
    pub fn lookup(&self, addr: u64) -> Option<String> {
        for table in &self.tables {
            let upto = table.partition_point(|r| r.start <= addr);
            // Nested or overlapping ranges are rare; look back a little.
            let best = table[..upto]
                .iter()
                .rev()
                .take(64)
                .filter(|r| addr < r.end)
                .max_by(|a, b| a.start.cmp(&b.start).then(b.rank.cmp(&a.rank)));
            if let Some(r) = best {
                return Some(r.name.clone().unwrap_or_else(|| format!("fn@{:#x}", r.start)));
            }
        }
        None
    }
}

fn eh_frame_ranges(elf: &Elf) -> Vec<Range> {
    let mut out = Vec::new();
    crate::unwind::for_each_fde(elf, |_, _, fde| {
        let start = fde.initial_address();
        out.push(Range { start, end: start.saturating_add(fde.len()), name: None, rank: 2 });
    });
    out
}

/// Demangles C++ (Itanium) and Rust symbol names; returns others unchanged.
pub fn demangle(name: &str) -> String {
    if (name.starts_with("_R") || (name.starts_with("_ZN") && name.ends_with('E') && name.contains("17h")))
        && let Ok(d) = rustc_demangle::try_demangle(name)
    {
        return format!("{d:#}");
    }
    if name.starts_with("_Z")
        && let Ok(sym) = cpp_demangle::Symbol::new(name)
        && let Ok(d) = sym.demangle()
    {
        return d;
    }
    name.to_string()
}
