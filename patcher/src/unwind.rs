//! Compact unwind rows from `.eh_frame`, built at patch time so that the
//! runtime finds a caller's frame with a binary search and two loads,
//! without interpreting DWARF in someone else's process (objtool builds the
//! kernel's ORC tables the same way).
//!
//! A row says, from its address to the next row's, how to find the
//! canonical frame address (rsp or rbp plus an offset) and where the
//! caller's rbp was saved. The return address must be at CFA - 8, as the
//! x86-64 ABI's CIEs say; a row whose rules the table cannot express (a
//! DWARF expression, a CFA in another register, an offset beyond 16 bits)
//! stops a chain there, and so does every address no FDE covers.

use crate::elf::Elf;
use alloctramp_trampolines::layout::{UnwindRow, unwind};
use gimli::{
    BaseAddresses, CfaRule, CieOrFde, EhFrame, EndianSlice, LittleEndian, RegisterRule, UnwindContext, UnwindSection,
    X86_64,
};

/// The rows for `elf`'s `.eh_frame`, sorted by address, consecutive rows
/// with the same rules merged. Empty when the file has no `.eh_frame`, or
/// when its code is not below 4 GiB (rows hold 32-bit addresses). A
/// malformed `.eh_frame` gives the rows read before the damage (the
/// damaged range stops chains).
pub fn rows(elf: &Elf) -> Vec<UnwindRow> {
    let mut ctx = Box::new(UnwindContext::new());
    // (start, end, row) for every CFI row.
    let mut raw: Vec<(u64, u64, UnwindRow)> = Vec::new();
    for_each_fde(elf, |eh, bases, fde| {
        let Ok(mut table) = fde.rows(eh, bases, &mut ctx) else { return };
        while let Ok(Some(row)) = table.next_row() {
            if row.start_address() < row.end_address() {
                raw.push((row.start_address(), row.end_address(), convert(row)));
            }
        }
    });
    if raw.iter().any(|&(_, end, _)| end > u64::from(u32::MAX)) {
        return Vec::new();
    }
    raw.sort_by_key(|&(start, end, _)| (start, end));
    let mut out: Vec<UnwindRow> = Vec::with_capacity(raw.len());
    let mut covered_to = 0u64;
    for (start, end, mut row) in raw {
        if start < covered_to {
            // Overlapping FDEs: the first one read keeps its range.
            continue;
        }
        if start > covered_to && out.last().is_some_and(|r| r.kind != unwind::STOP) {
            out.push(UnwindRow { addr: covered_to as u32, ..UnwindRow::default() });
        }
        row.addr = start as u32;
        if !out.last().is_some_and(|last| same_rules(last, &row)) {
            out.push(row);
        }
        covered_to = end;
    }
    if out.last().is_some_and(|r| r.kind != unwind::STOP) {
        out.push(UnwindRow { addr: covered_to as u32, ..UnwindRow::default() });
    }
    out
}

/// The readable FDEs of `elf`'s `.eh_frame`, in file order, with the
/// section and the base addresses their pointers are relative to (what the
/// function index and the unwind rows both read).
pub fn for_each_fde<'a>(
    elf: &Elf<'a>,
    mut f: impl FnMut(&EhFrame<EndianSlice<'a, LittleEndian>>, &BaseAddresses, &Fde<'a>),
) {
    let Some(sec) = elf.section_by_name(".eh_frame").filter(|s| !s.data.is_empty()) else { return };
    let eh = EhFrame::new(sec.data, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(sec.addr.0);
    for (name, set) in [
        (".text", BaseAddresses::set_text as fn(BaseAddresses, u64) -> BaseAddresses),
        (".eh_frame_hdr", BaseAddresses::set_eh_frame_hdr),
        (".got", BaseAddresses::set_got),
    ] {
        if let Some(s) = elf.section_by_name(name) {
            bases = set(bases, s.addr.0);
        }
    }
    let mut entries = eh.entries(&bases);
    while let Ok(Some(entry)) = entries.next() {
        if let CieOrFde::Fde(partial) = entry
            && let Ok(fde) = partial.parse(|s, b, o| s.cie_from_offset(b, o))
        {
            f(&eh, &bases, &fde);
        }
    }
}

type Fde<'a> = gimli::FrameDescriptionEntry<EndianSlice<'a, LittleEndian>>;

fn same_rules(a: &UnwindRow, b: &UnwindRow) -> bool {
    (a.kind, a.cfa_offset, a.rbp_saved, a.rbp_offset) == (b.kind, b.cfa_offset, b.rbp_saved, b.rbp_offset)
}

fn convert<T: gimli::ReaderOffset>(row: &gimli::UnwindTableRow<T>) -> UnwindRow {
    let stop = UnwindRow::default();
    let (kind, offset) = match *row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if register == X86_64::RSP => (unwind::RSP, offset),
        CfaRule::RegisterAndOffset { register, offset } if register == X86_64::RBP => (unwind::RBP, offset),
        _ => return stop,
    };
    let Ok(cfa_offset) = i16::try_from(offset) else { return stop };
    if !matches!(row.register(X86_64::RA), Some(RegisterRule::Offset(-8))) {
        return stop;
    }
    let (rbp_saved, rbp_offset) = match row.register(X86_64::RBP) {
        None | Some(RegisterRule::SameValue) => (0, 0),
        Some(RegisterRule::Offset(o)) => match i16::try_from(o) {
            Ok(o) => (1, o),
            Err(_) => return stop,
        },
        Some(_) => return stop,
    };
    UnwindRow { addr: 0, cfa_offset, rbp_offset, kind, rbp_saved, reserved: [0; 2] }
}

/// The row that covers `addr`, if any (for tests and tools; the runtime
/// has its own lookup over the rows in memory).
pub fn lookup(rows: &[UnwindRow], addr: u64) -> Option<&UnwindRow> {
    let addr = u32::try_from(addr).ok()?;
    let i = rows.partition_point(|r| r.addr <= addr).checked_sub(1)?;
    rows.get(i).filter(|r| r.kind != unwind::STOP)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every function of a real executable gets rows: at a function's
    /// first instruction the CFA is rsp + 8 and rbp is the caller's.
    #[test]
    fn function_entries_have_the_call_frame_of_a_call() {
        let data = std::fs::read("/proc/self/exe").unwrap();
        let elf = Elf::parse(&data).unwrap();
        let rows = rows(&elf);
        assert!(rows.len() > 100, "{} rows", rows.len());
        assert!(rows.windows(2).all(|w| w[0].addr < w[1].addr), "sorted, one row per address");
        let mut checked = 0;
        for sym in elf.symbols(false).iter().filter(|s| s.size > 0 && s.name == "main") {
            let r = lookup(&rows, sym.value).expect("main has CFI");
            assert_eq!((r.kind, r.cfa_offset, r.rbp_saved), (unwind::RSP, 8, 0));
            checked += 1;
        }
        assert!(checked > 0);
    }

    /// What readelf's interpretation of a CFA and an rbp rule gives as a
    /// row's rules (kind, cfa offset, rbp saved, rbp offset).
    fn expected(cfa: &str, rbp: Option<&str>, ra: &str) -> (u8, i16, u8, i16) {
        let stop = (unwind::STOP, 0, 0, 0);
        let (kind, off) = match cfa.split_once('+') {
            Some(("rsp", n)) => (unwind::RSP, n.parse::<i64>().unwrap()),
            Some(("rbp", n)) => (unwind::RBP, n.parse::<i64>().unwrap()),
            _ => return stop,
        };
        // Offsets beyond 16 bits stop a chain.
        let Ok(off) = i16::try_from(off) else { return stop };
        if ra != "c-8" {
            return stop;
        }
        match rbp {
            None | Some("u") | Some("s") => (kind, off, 0, 0),
            Some(r) => match r.strip_prefix('c') {
                Some(n) => match i16::try_from(n.parse::<i64>().unwrap()) {
                    Ok(n) => (kind, off, 1, n),
                    Err(_) => stop,
                },
                None => stop,
            },
        }
    }

    /// Every CFI row readelf shows for a file (`--debug-dump=frames-interp`)
    /// is what the table gives at its address: the C library's code and a
    /// Rust program's, with and without frame pointers.
    #[test]
    fn rows_agree_with_readelf() {
        let me = std::env::current_exe().unwrap();
        for path in [me.to_str().unwrap(), "/usr/bin/ls"] {
            let data = std::fs::read(path).unwrap();
            let elf = Elf::parse(&data).unwrap();
            let table = rows(&elf);
            let out = std::process::Command::new("readelf")
                .args(["-W", "--debug-dump=frames-interp", path])
                .output()
                .expect("readelf (binutils) runs");
            let text = String::from_utf8_lossy(&out.stdout);
            // CIE offset -> its initial row (columns, values); an FDE
            // without rows of its own keeps its CIE's.
            let mut cies: std::collections::HashMap<String, Vec<(String, String)>> = Default::default();
            let (mut columns, mut cie, mut fde_start, mut fde_rows) = (Vec::<String>::new(), None, None, 0);
            let (mut checked, mut fdes) = (0, 0);
            let mut check = |loc: u64, values: &[(String, String)]| {
                let get = |k: &str| values.iter().find(|(c, _)| c == k).map(|(_, v)| v.as_str());
                let want = expected(get("CFA").unwrap(), get("rbp"), get("ra").unwrap_or("u"));
                let got = lookup(&table, loc)
                    .map_or((unwind::STOP, 0, 0, 0), |r| (r.kind, r.cfa_offset, r.rbp_saved, r.rbp_offset));
                let near: Vec<_> = table.iter().filter(|r| u64::from(r.addr).abs_diff(loc) < 64).collect();
                assert_eq!(got, want, "{path}: at {loc:#x}: {values:?}; rows near: {near:?}");
                checked += 1;
            };
            let mut last_cie_rows: Vec<(String, String)> = Vec::new();
            for line in text.lines() {
                let words: Vec<&str> = line.split_whitespace().collect();
                if words.get(3) == Some(&"CIE") {
                    cie = Some(words[0].to_string());
                    fde_start = None;
                } else if words.get(3) == Some(&"FDE") {
                    if let (Some(start), 0) = (fde_start, fde_rows) {
                        check(start, &last_cie_rows);
                    }
                    let of_cie = words[4].trim_start_matches("cie=").to_string();
                    last_cie_rows = cies.get(&of_cie).cloned().unwrap_or_default();
                    let range = words[5].trim_start_matches("pc=");
                    fde_start = u64::from_str_radix(range.split("..").next().unwrap(), 16).ok();
                    (cie, fde_rows) = (None, 0);
                    fdes += 1;
                } else if words.first() == Some(&"LOC") {
                    columns = words[1..].iter().map(|w| w.to_string()).collect();
                } else if let Some(Ok(loc)) = words.first().map(|w| u64::from_str_radix(w, 16)) {
                    if words.len() != columns.len() + 1 {
                        continue;
                    }
                    let values: Vec<(String, String)> =
                        columns.iter().cloned().zip(words[1..].iter().map(|w| w.to_string())).collect();
                    match &cie {
                        Some(c) => {
                            cies.entry(c.clone()).or_insert(values);
                        }
                        None => {
                            check(loc, &values);
                            fde_rows += 1;
                        }
                    }
                }
            }
            if let (Some(start), 0) = (fde_start, fde_rows) {
                check(start, &last_cie_rows);
            }
            assert!(fdes > 50 && checked > fdes, "{path}: {fdes} FDEs, {checked} rows checked");
        }
    }
}
