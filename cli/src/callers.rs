//! `report --callers`: the call chains recorded for each site (callers
//! capture), their frames named from the module files the process mapped.

use crate::util::Input;
use alloctramp_patcher::Elf;
use alloctramp_patcher::Location;
use alloctramp_patcher::lines::{DebugSections, Lines};
use alloctramp_patcher::plumbing::Plumbing;
use alloctramp_patcher::symbols::{FunctionIndex, demangle};
pub use alloctramp_report::chains::{ChainRow, Frame};
use alloctramp_report::model::Row;
use alloctramp_trampolines::addr::FileOffset;
use alloctramp_trampolines::process::{Map, ProcessFile};
use std::collections::HashMap;
use std::io::{self, Write};
use std::path::Path;

/// What a module file says of an address in it: its virtual address, the
/// function, and `file:line`.
type Named = (u64, Option<String>, Option<(String, u32)>);

/// Names of return addresses in one module file (file offsets as mapped).
/// A call inside inlined allocation plumbing is named after the first
/// inlined caller outside it (its name and the line of its call), as the
/// patcher names sites.
fn name_in_file(path: &Path, offsets: &[u64], plumbing: &Plumbing) -> HashMap<u64, Named> {
    let mut out = HashMap::new();
    let Ok(input) = Input::open(path) else { return out };
    let Ok(elf) = Elf::parse(&input.map) else { return out };
    let functions = FunctionIndex::new(&elf);
    let sections = DebugSections::load(&elf.file);
    let lines = sections.as_ref().and_then(Lines::new);
    for &off in offsets {
        let Some(vaddr) = elf.vaddr_of(FileOffset(off)).map(|v| v.0) else { continue };
        // A return address is after its call: name the call.
        let at = vaddr.saturating_sub(1);
        let mut function = functions.lookup(at).map(|n| demangle(&n));
        let mut line = lines.as_ref().and_then(|l| l.find(at)).map(|loc| (loc.file, loc.line));
        let inlined = lines.as_ref().map(|l| l.inline_frames(at)).unwrap_or_default();
        let plumbing_fn = |(n, loc): &(Option<String>, Option<Location>)| {
            plumbing.matches_frame(n.as_deref().map(demangle).as_deref(), loc.as_ref().map(|l| l.file.as_str()))
        };
        if inlined.len() > 1
            && inlined.first().is_some_and(plumbing_fn)
            && let Some((Some(name), loc)) = inlined.iter().find(|f| f.0.is_some() && !plumbing_fn(f))
        {
            function = Some(demangle(name));
            line = loc.as_ref().map(|l| (l.file.clone(), l.line));
        }
        out.insert(off, (vaddr, function, line));
    }
    out
}

/// Names every address of `addresses` from the files of the recorded
/// mappings, each file read once.
fn name_frames(addresses: &[u64], maps: &[Map], plumbing: &Plumbing) -> HashMap<u64, Frame> {
    let mut by_file: HashMap<&str, Vec<(u64, u64)>> = HashMap::new();
    let mut out = HashMap::new();
    for &a in addresses {
        let f = Frame { address: a, module: None, module_address: None, function: None, file: None, line: None };
        match maps.iter().find(|m| a >= m.start && a < m.end) {
            Some(m) => {
                by_file.entry(m.path.as_str()).or_default().push((a, a - m.start + m.offset));
                out.insert(a, Frame { module: Some(m.path.clone()), ..f });
            }
            None => {
                out.insert(a, f);
            }
        }
    }
    for (path, addrs) in by_file {
        let offsets: Vec<u64> = addrs.iter().map(|&(_, o)| o).collect();
        let names = name_in_file(Path::new(path), &offsets, plumbing);
        for (a, off) in addrs {
            if let (Some((vaddr, function, line)), Some(f)) = (names.get(&off), out.get_mut(&a)) {
                f.module_address = Some(*vaddr);
                f.function = function.clone();
                if let Some((file, l)) = line {
                    f.file = Some(file.clone());
                    f.line = Some(*l);
                }
            }
        }
    }
    out
}

/// Every chain of the process, its frames named, largest (calls) first.
/// `plumbing` decides each chain's first frame outside allocation
/// plumbing.
/// Chains of one site whose frames have the same names (function, file,
/// line, module: calls at different addresses of one line, as an unrolled
/// loop makes) are one row; its frames give the first one's addresses.
pub fn chains(pf: &ProcessFile, plumbing: &Plumbing) -> Vec<ChainRow> {
    let modules = pf.modules().unwrap_or_default();
    let mut maps = pf.maps();
    // Libraries a running process mapped since the mappings were recorded
    // (`dlopen` of an unpatched library): named from its maps now.
    if crate::control::file_process_running(pf) {
        for m in crate::report::proc_maps(pf.pid) {
            if !maps.iter().any(|r| r.start < m.end && m.start < r.end) {
                maps.push(Map { start: m.start, end: m.end, offset: m.offset, path: m.path });
            }
        }
    }
    let raw = pf.chains();
    let mut addresses: Vec<u64> = raw.iter().flat_map(|c| c.frames.iter().copied()).collect();
    addresses.sort_unstable();
    addresses.dedup();
    let names = name_frames(&addresses, &maps, plumbing);
    let out: Vec<ChainRow> = raw
        .into_iter()
        .filter(|c| c.calls > 0)
        .filter_map(|c| {
            let m = modules.get(c.module as usize)?;
            let site = m.table.get_site(c.site as usize)?;
            let frames: Vec<Frame> = c.frames.iter().filter_map(|a| names.get(a).cloned()).collect();
            let in_plumbing = plumbing.matches_frame(m.table.string(site.function), m.table.string(site.file));
            let outside_plumbing = match in_plumbing {
                true => frames.iter().position(|f| {
                    f.function.is_some() && !plumbing.matches_frame(f.function.as_deref(), f.file.as_deref())
                }),
                false => None,
            };
            Some(ChainRow {
                site: (m.table.module_name().to_string(), site.addr),
                calls: c.calls,
                bytes: c.bytes,
                frames,
                outside_plumbing,
            })
        })
        .collect();
    let mut merged: Vec<ChainRow> = Vec::new();
    let mut at: HashMap<(String, u64, Vec<String>), usize> = HashMap::new();
    for c in out {
        let names = c.frames.iter().map(|f| format!("{}|{:?}", f.describe(), f.module)).collect();
        match at.entry((c.site.0.clone(), c.site.1, names)) {
            std::collections::hash_map::Entry::Occupied(e) => {
                if let Some(m) = merged.get_mut(*e.get()) {
                    m.calls += c.calls;
                    m.bytes += c.bytes;
                }
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(merged.len());
                merged.push(c);
            }
        }
    }
    merged.sort_by(|a, b| b.calls.cmp(&a.calls).then(b.bytes.cmp(&a.bytes)).then(a.frames.len().cmp(&b.frames.len())));
    merged
}

/// What chains missed: calls that found no chain slot, and walks that
/// ended at a library unloaded (or moved) since its rows were built.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lost {
    pub calls: u64,
    pub unloaded: u64,
}

impl Lost {
    pub fn of(pf: &ProcessFile) -> Lost {
        use std::sync::atomic::Ordering::Relaxed;
        Lost { calls: pf.header.callers_lost.load(Relaxed), unloaded: pf.header.callers_unloaded.load(Relaxed) }
    }
}

/// The chains of each row's site, after the table: `#` lines, so that a
/// reader of the allocinfo layout skips them as it skips the header.
pub fn write_text(w: &mut dyn Write, rows: &[Row], chains: &[ChainRow], lost: Lost) -> io::Result<()> {
    writeln!(w, "# callers: calls bytes (totals while capture was on) chain (innermost caller first)")?;
    if chains.is_empty() {
        writeln!(w, "# no call chains recorded (alloctramp callers PID on, or ALLOCTRAMP_CALLERS=on)")?;
    }
    for r in rows {
        let of_site: Vec<&ChainRow> =
            chains.iter().filter(|c| c.site.0 == r.site.module && c.site.1 == r.site.address).collect();
        if of_site.is_empty() {
            continue;
        }
        writeln!(w, "# {}", r.tag())?;
        for c in of_site {
            let chain: Vec<String> = c.frames.iter().map(Frame::describe).collect();
            writeln!(w, "#   {:>10} {:>12}  {}", c.calls, c.bytes, chain.join(" <- "))?;
        }
    }
    // Where the rows' allocations come from when the sites are in
    // allocation plumbing: each chain's first frame outside it.
    let mut by_caller: Vec<(String, u64, u64)> = Vec::new();
    for r in rows.iter().filter(|r| r.allocates) {
        for c in chains.iter().filter(|c| c.site.0 == r.site.module && c.site.1 == r.site.address) {
            let Some(f) = c.outside_plumbing.and_then(|i| c.frames.get(i)) else { continue };
            let name = f.describe();
            match by_caller.iter_mut().find(|e| e.0 == name) {
                Some(e) => (e.1, e.2) = (e.1 + c.calls, e.2 + c.bytes),
                None => by_caller.push((name, c.calls, c.bytes)),
            }
        }
    }
    if !by_caller.is_empty() {
        by_caller.sort_by(|a, b| b.2.cmp(&a.2).then(b.1.cmp(&a.1)));
        writeln!(w, "# sites in allocation plumbing, by their first caller outside it: calls bytes caller")?;
        for (name, calls, bytes) in by_caller {
            writeln!(w, "#   {calls:>10} {bytes:>12}  {name}")?;
        }
    }
    if lost.calls > 0 {
        writeln!(w, "# {} calls found no free chain slot (counted at their sites only)", lost.calls)?;
    }
    if lost.unloaded > 0 {
        writeln!(
            w,
            "# {} unwinds ended early at a library loaded with dlopen that moved since `alloctramp callers \
             PID on` built its rows (run it again)",
            lost.unloaded
        )?;
    }
    Ok(())
}

/// The report's JSON document with `callers` added to each site (and
/// `callers_lost` and `callers_unloaded` at the top).
pub fn write_json(w: &mut dyn Write, doc: &[u8], chains: &[ChainRow], lost: Lost) -> io::Result<()> {
    let mut v: serde_json::Value = serde_json::from_slice(doc).map_err(io::Error::other)?;
    if let Some(sites) = v.get_mut("sites").and_then(|s| s.as_array_mut()) {
        for s in sites {
            let key = (s["module"].as_str().unwrap_or("").to_string(), s["address"].as_u64().unwrap_or(u64::MAX));
            let of_site: Vec<&ChainRow> = chains.iter().filter(|c| c.site == key).collect();
            s["callers"] = serde_json::to_value(of_site).map_err(io::Error::other)?;
        }
    }
    v["callers_lost"] = lost.calls.into();
    v["callers_unloaded"] = lost.unloaded.into();
    serde_json::to_writer_pretty(&mut *w, &v).map_err(io::Error::other)?;
    writeln!(w)
}

/// The source lines of sites of one module file, inlined functions first,
/// for the pprof profile: the sites whose innermost DWARF location is the
/// site's own `file:line` (a site named after a caller outside inlined
/// plumbing keeps the site table's one line).
pub fn site_lines(
    path: &Path,
    sites: &[&alloctramp_report::SiteInfo],
) -> Vec<(u64, Vec<alloctramp_report::pprof::SourceLine>)> {
    use alloctramp_report::pprof::SourceLine;
    let mut out = Vec::new();
    let Ok(input) = Input::open(path) else { return out };
    let Ok(elf) = Elf::parse(&input.map) else { return out };
    let Some(sections) = DebugSections::load(&elf.file) else { return out };
    let Some(lines) = Lines::new(&sections) else { return out };
    for s in sites {
        let frames = lines.inline_frames(s.address);
        if frames.len() < 2 {
            continue;
        }
        let innermost = frames[0].1.as_ref().map(|l| (l.file.as_str(), l.line));
        if innermost.is_none() || innermost != s.file.zip(s.line) {
            continue;
        }
        let named: Vec<SourceLine> = frames
            .iter()
            .map(|(name, loc)| SourceLine {
                function: name.as_deref().map_or_else(|| "?".to_string(), demangle),
                file: loc.as_ref().map(|l| l.file.clone()),
                line: loc.as_ref().map_or(0, |l| l.line),
            })
            .collect();
        out.push((s.address, named));
    }
    out
}

/// The ELF file at `path` has the build id `hex`.
pub fn has_build_id(path: &Path, hex: &str) -> bool {
    let Ok(input) = Input::open(path) else { return false };
    let Ok(elf) = Elf::parse(&input.map) else { return false };
    elf.build_id().is_some_and(|b| b.iter().map(|x| format!("{x:02x}")).collect::<String>() == hex)
}
