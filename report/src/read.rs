//! From a counters file's bytes to [`Figures`]: every site's names (from the
//! site table in the bytes: a shared one is read in first, see
//! `process::read_in_shared_tables`) and figures (its cell summed over the
//! shards); and consistent copies of a file that a process is writing.

use crate::model::{Fig, Figures, ModuleInfo, ProcessInfo, SiteInfo};
use alloctramp_trampolines::entry::Kind;
use alloctramp_trampolines::layout::SiteForm;
use alloctramp_trampolines::pod;
use alloctramp_trampolines::process::{PROC_HEADER_SIZE, ProcessFile, ProcessFileError, flags};
use std::fmt;
use std::rc::Rc;

/// A counters file that cannot be read, with what that suggests (another
/// version of alloctramp, or a damaged or foreign file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadError(pub ProcessFileError);

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_version() {
            write!(f, "{} (written by another version of alloctramp)", self.0)
        } else {
            write!(f, "{} (damaged or foreign file)", self.0)
        }
    }
}

impl std::error::Error for ReadError {}

/// Parses a counters file's header.
pub fn parse(bytes: &[u8]) -> Result<ProcessFile<'_>, ReadError> {
    ProcessFile::parse(bytes).map_err(ReadError)
}

/// The process a file describes.
pub fn process_info(pf: &ProcessFile) -> ProcessInfo {
    ProcessInfo {
        pid: pf.pid,
        command: pf.command.clone(),
        arguments: pf.arguments.clone(),
        on: pf.on,
        exited: pf.exited,
        live: pf.live(),
        draining: pf.flags & flags::DRAINING != 0,
        incomplete: pf.flags & flags::INCOMPLETE != 0,
        generation: pf.generation,
        start_time: pf.start_time,
        reset_time: pf.reset_time,
        last_switch_ns: pf.last_switch_ns,
        last_switch_sites: pf.last_switch_sites,
        last_switch_time: pf.last_switch_time,
        last_error: pf.last_error.clone(),
        untracked_allocs: pf.untracked_allocs,
        table_bytes: pf.table_bytes,
        table_objects: pf.table_objects,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn signed(v: u64) -> i128 {
    v as i128
}

/// Reads every module and every site's names and figures. An error names
/// the module whose region or table cannot be read.
pub fn figures<'a>(pf: &ProcessFile<'a>) -> Result<Figures<'a>, ProcessFileError> {
    let live = pf.live();
    let mut sites = Vec::new();
    let mut modules = Vec::new();
    for m in pf.modules()? {
        let t = &m.table;
        let h = &t.header;
        let name = t.module_name();
        let build_id: Rc<str> = hex(&h.build_id[..h.build_id_len as usize]).into();
        modules.push(ModuleInfo {
            name: name.to_string(),
            build_id: build_id.to_string(),
            sites: h.site_count,
            on: m.on,
            unloaded: m.unloaded,
            table_size: t.bytes().len() as u64,
            counters_size: h.counters_size,
            bias: m.bias,
        });
        // Entry names and kinds, once per module.
        let entries: Vec<(&str, Kind)> = (0..h.entry_count as usize)
            .map(|i| match t.entry(i) {
                Some(e) => (t.string(e.name).unwrap_or("?"), Kind::from_code(e.kind).unwrap_or(Kind::Alloc)),
                None => ("?", Kind::Alloc),
            })
            .collect();
        sites.reserve(h.site_count as usize);
        for (i, s) in t.sites().enumerate() {
            let c = m.cell(i);
            let (entry, kind) = entries.get(s.entry as usize).copied().unwrap_or(("?", Kind::Alloc));
            let fig = if kind != Kind::Free {
                Fig {
                    calls: signed(c.calls),
                    bytes: signed(c.bytes),
                    failed: signed(c.failed),
                    failed_bytes: signed(c.failed_bytes),
                    live_calls: live.then(|| signed(c.live_objects())),
                    live_bytes: live.then(|| signed(c.live_bytes())),
                    freed_objects: signed(c.freed_objects),
                    freed_bytes: signed(c.freed_bytes),
                    free_calls: 0,
                    untracked_frees: signed(c.untracked_frees),
                    injected: signed(c.injected),
                }
            } else {
                Fig { free_calls: signed(c.calls), untracked_frees: signed(c.untracked_frees), ..Fig::zero(live) }
            };
            let info = SiteInfo {
                module: name,
                build_id: build_id.clone(),
                address: s.addr,
                function: t.string(s.function),
                file: t.string(s.file),
                line: (s.line != 0).then_some(s.line),
                entry,
                kind,
                form: SiteForm::from_code(s.form).map_or("?", SiteForm::as_str),
            };
            sites.push((info, fig));
        }
    }
    Ok(Figures { process: process_info(pf), modules, sites })
}

/// Why a consistent copy could not be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyError {
    /// The file (or what was copied of it) does not read.
    Unreadable(ProcessFileError),
    /// A published module's region lies outside the file.
    RegionOutside { module: usize },
}

impl fmt::Display for CopyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CopyError::Unreadable(e) => e.fmt(f),
            CopyError::RegionOutside { module } => write!(f, "module {module}: region outside the file"),
        }
    }
}

impl std::error::Error for CopyError {}

/// A consistent copy of a counters file: the header with the modules
/// published when the copy started, and exactly their regions (the rest
/// zero).
pub fn consistent_copy(bytes: &[u8]) -> Result<Vec<u8>, CopyError> {
    use std::sync::atomic::Ordering;
    let pf = ProcessFile::parse(bytes).map_err(CopyError::Unreadable)?;
    let h = &pf.header;
    let head = PROC_HEADER_SIZE as usize;
    // The copy publishes the modules the parsed header had published.
    h.module_count.store(pf.module_count, Ordering::Relaxed);
    let mut out = pod::bytes_of(&**h).to_vec();
    let mut regions = Vec::new();
    for (m, sl) in h.published().iter().enumerate() {
        let regions_of_slot = [(&sl.table_offset, &sl.table_size), (&sl.counters_offset, &sl.counters_size)];
        for (k, (at, size)) in regions_of_slot.into_iter().enumerate() {
            let (at, size) = (at.load(Ordering::Relaxed) as usize, size.load(Ordering::Relaxed) as usize);
            if k == 0 && at == 0 {
                // A shared table not read in: the copy's modules say so.
                continue;
            }
            let end = at.checked_add(size).filter(|&e| e <= bytes.len() && at >= head);
            let Some(end) = end else {
                return Err(CopyError::RegionOutside { module: m });
            };
            regions.push((at, end));
        }
    }
    let len = regions.iter().map(|r| r.1).max().unwrap_or(head).max(head);
    out.resize(len, 0);
    for (a, e) in regions {
        out[a..e].copy_from_slice(&bytes[a..e]);
    }
    // What was copied must read back.
    let copy = ProcessFile::parse(&out).map_err(CopyError::Unreadable)?;
    copy.modules().map_err(CopyError::Unreadable)?;
    Ok(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use alloctramp_trampolines::layout::{self, CELL_SIZE, Entry, Header, Site, Strings};
    use alloctramp_trampolines::process::{self, PROC_MAGIC, PROC_VERSION, ProcHeader};
    use std::sync::atomic::Ordering;

    /// One site of a synthetic module: (entry index, function, line, cell
    /// words per shard).
    pub struct SynthSite {
        pub entry: u16,
        pub function: &'static str,
        pub line: u32,
        pub shards: Vec<[u64; 8]>,
    }

    /// A counters file of process 4242 (`./prog`) with one module `prog`
    /// whose entries are malloc (alloc) and free (free); `extra` bytes
    /// (a module registering) follow the last region, unpublished.
    pub fn counters_file(live: bool, sites: &[SynthSite], extra: usize) -> Vec<u8> {
        // Every module has 16 shards; the sites give the first few.
        let shards = alloctramp_trampolines::layout::shard::COUNT as usize;
        let mut strings = Strings::default();
        let name = strings.add("prog");
        let file = strings.add("src/prog.c");
        let entries = [
            Entry { name: strings.add("malloc"), kind: Kind::Alloc.code(), ..Entry::default() },
            Entry { name: strings.add("free"), kind: Kind::Free.code(), ..Entry::default() },
        ];
        let table_sites: Vec<Site> = sites
            .iter()
            .enumerate()
            .map(|(i, s)| Site {
                addr: 0x1000 + 0x10 * i as u64,
                len: 5,
                form: 0,
                entry: s.entry,
                function: strings.add(s.function),
                file: if s.line == 0 { layout::NO_STRING } else { file },
                line: s.line,
                ..Site::default()
            })
            .collect();
        let stride = ((sites.len() * CELL_SIZE) as u64).next_multiple_of(layout::PAGE);
        let mut build_id = [0u8; 20];
        build_id[..4].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        let header = Header {
            shard_count: shards as u32,
            shard_stride: stride,
            counters_size: stride * shards as u64,
            module_name: name,
            build_id,
            build_id_len: 4,
            ..Header::default()
        };
        let table = layout::encode(header, &table_sites, &entries, &strings);
        let mut counters = vec![0u8; stride as usize * shards];
        for (i, s) in sites.iter().enumerate() {
            for (shard, words) in s.shards.iter().enumerate() {
                let at = shard * stride as usize + i * CELL_SIZE;
                for (w, v) in words.iter().enumerate() {
                    counters[at + w * 8..at + w * 8 + 8].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        let (table_at, counters_at, end) =
            process::module_region(table.len() as u64, counters.len() as u64, PROC_HEADER_SIZE);
        let mut h = pod::copy::<ProcHeader>(&vec![0u8; PROC_HEADER_SIZE as usize]).unwrap();
        h.magic = PROC_MAGIC;
        h.version.store(PROC_VERSION, Ordering::Relaxed);
        h.pid.store(4242, Ordering::Relaxed);
        h.state.store(1, Ordering::Relaxed);
        h.flags.store(if live { process::flags::LIVE } else { 0 }, Ordering::Relaxed);
        h.generation.store(3, Ordering::Relaxed);
        h.start_time.store(1_700_000_000, Ordering::Relaxed);
        ProcHeader::set_text(&h.command, b"./prog");
        h.module_count.store(1, Ordering::Relaxed);
        let slot = &h.modules[0];
        slot.table_offset.store(table_at, Ordering::Relaxed);
        slot.table_size.store(table.len() as u64, Ordering::Relaxed);
        slot.counters_offset.store(counters_at, Ordering::Relaxed);
        slot.counters_size.store(counters.len() as u64, Ordering::Relaxed);
        slot.on.store(1, Ordering::Relaxed);
        let mut bytes = pod::bytes_of(&*h).to_vec();
        bytes.resize(end as usize + extra, 0);
        bytes[table_at as usize..table_at as usize + table.len()].copy_from_slice(&table);
        bytes[counters_at as usize..end as usize].copy_from_slice(&counters);
        if extra > 0 {
            bytes[end as usize..].fill(0xa5);
        }
        bytes
    }

    /// Cell words: calls, bytes, failed, freed objects, freed bytes,
    /// untracked frees, (reserved), failed bytes.
    pub fn cell(calls: u64, bytes: u64, failed: u64, freed: u64, freed_bytes: u64, untracked: u64) -> [u64; 8] {
        [calls, bytes, failed, freed, freed_bytes, untracked, 0, 0]
    }

    pub fn three_sites() -> Vec<SynthSite> {
        vec![
            SynthSite {
                entry: 0,
                function: "main",
                line: 10,
                shards: vec![cell(3, 48, 0, 1, 16, 0), cell(2, 32, 1, 0, 0, 0)],
            },
            SynthSite {
                entry: 0,
                function: "grow",
                line: 0,
                shards: vec![cell(1, 4096, 0, 0, 0, 0), cell(0, 0, 0, 0, 0, 0)],
            },
            SynthSite {
                entry: 1,
                function: "main",
                line: 20,
                shards: vec![cell(1, 0, 0, 0, 0, 1), cell(1, 0, 0, 0, 0, 0)],
            },
        ]
    }

    #[test]
    fn figures_sum_the_shards_and_name_every_site() {
        let bytes = counters_file(true, &three_sites(), 0);
        let pf = parse(&bytes).unwrap();
        let f = figures(&pf).unwrap();
        assert_eq!(f.process.pid, 4242);
        assert_eq!(f.process.command, "./prog");
        assert!(f.process.on && f.live() && !f.process.exited && !f.process.draining);
        assert_eq!(f.modules.len(), 1);
        assert_eq!(f.modules[0].name, "prog");
        assert_eq!(f.modules[0].build_id, "deadbeef");
        assert_eq!(f.modules[0].sites, 3);
        let (s, fig) = &f.sites[0];
        assert_eq!(
            (s.module, s.address, s.function, s.line, s.entry),
            ("prog", 0x1000, Some("main"), Some(10), "malloc")
        );
        assert_eq!(s.location(), "src/prog.c:10");
        assert_eq!(s.form, "call rel32");
        assert_eq!(
            *fig,
            Fig {
                calls: 5,
                bytes: 80,
                failed: 1,
                failed_bytes: 0,
                live_calls: Some(3),
                live_bytes: Some(64),
                freed_objects: 1,
                freed_bytes: 16,
                free_calls: 0,
                untracked_frees: 0,
                injected: 0
            }
        );
        assert_eq!(f.sites[1].0.location(), "0x1010", "no line: the address");
        let (s, fig) = &f.sites[2];
        assert_eq!((s.kind, s.entry), (Kind::Free, "free"));
        assert_eq!(*fig, Fig { free_calls: 2, untracked_frees: 1, ..Fig::zero(true) });
        assert_eq!(f.live_bytes(), Some(64 + 4096));

        let bytes = counters_file(false, &three_sites(), 0);
        let f = figures(&parse(&bytes).unwrap()).unwrap();
        assert!(!f.live());
        assert!(f.sites.iter().all(|(_, f)| f.live_bytes.is_none() && f.live_calls.is_none()));
        assert_eq!(f.live_bytes(), None);
    }

    #[test]
    fn unreadable_files_say_why() {
        let e = parse(&[0u8; 100]).err().unwrap();
        assert_eq!(e.to_string(), "not an alloctramp process file (damaged or foreign file)");
        let mut bytes = counters_file(true, &three_sites(), 0);
        bytes[8] = 99;
        let e = parse(&bytes).err().unwrap();
        assert!(e.to_string().ends_with("(written by another version of alloctramp)"), "{e}");

        let bytes = counters_file(true, &three_sites(), 0);
        let short = &bytes[..bytes.len() - 1];
        let e = figures(&parse(short).unwrap()).err().unwrap();
        assert_eq!(e, ProcessFileError::ModuleOutside { module: 0 });
    }

    #[test]
    fn a_consistent_copy_holds_the_published_modules_and_nothing_else() {
        let bytes = counters_file(true, &three_sites(), 100);
        let copy = consistent_copy(&bytes).unwrap();
        assert_eq!(copy.len(), bytes.len() - 100, "the unpublished tail is left out");
        assert_eq!(copy[..], bytes[..copy.len()]);
        let a = figures(&parse(&bytes).unwrap()).unwrap();
        let b = figures(&parse(&copy).unwrap()).unwrap();
        assert_eq!(format!("{:?}", a.sites), format!("{:?}", b.sites));

        // A region past the end of what was read.
        let short = &bytes[..bytes.len() - 200];
        assert_eq!(consistent_copy(short), Err(CopyError::RegionOutside { module: 0 }));
        assert_eq!(CopyError::RegionOutside { module: 0 }.to_string(), "module 0: region outside the file");
        assert_eq!(consistent_copy(b"short"), Err(CopyError::Unreadable(ProcessFileError::NotProcessFile)));
    }

    /// `bytes` (from [`counters_file`]) with module 0's table moved out, as
    /// a process that shares it writes its file; and the table.
    pub fn sharing(bytes: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let pf = parse(bytes).unwrap();
        let slot = &pf.header.modules[0];
        let (at, size) = (slot.table_offset.load(Ordering::Relaxed), slot.table_size.load(Ordering::Relaxed));
        let table = bytes[at as usize..(at + size) as usize].to_vec();
        let mut shared = bytes.to_vec();
        shared[at as usize..(at + size) as usize].fill(0);
        let slot_at = process::MODULE_SLOTS_AT as usize;
        shared[slot_at..slot_at + 8].copy_from_slice(&0u64.to_le_bytes());
        shared[slot_at + 56..slot_at + 64].copy_from_slice(&process::table_id(&table).to_le_bytes());
        (shared, table)
    }

    #[test]
    fn a_shared_table_reads_in_when_its_bytes_have_its_id() {
        let bytes = counters_file(true, &three_sites(), 0);
        let expected = format!("{:?}", figures(&parse(&bytes).unwrap()).unwrap().sites);
        let (shared, table) = sharing(&bytes);
        let id = process::table_id(&table);
        assert_eq!(process::shared_tables(&shared), [(0, id, table.len() as u64)]);
        // Not read in: the module's table is missing, and the message says
        // where it was looked for.
        let e = figures(&parse(&shared).unwrap()).err().unwrap();
        assert_eq!(e, ProcessFileError::SharedTable { module: 0, id });
        assert!(e.to_string().contains(&format!("tables/{id:016x}.sites beside the counters file")), "{e}");
        assert_eq!(consistent_copy(&shared), Err(CopyError::Unreadable(e)));
        // Bytes that are not the table its id names stay out.
        for wrong in [table[..table.len() - 1].to_vec(), [&table[..100], &[1u8], &table[101..]].concat()] {
            let mut read = shared.clone();
            process::read_in_shared_tables(&mut read, |_, _| Some(wrong.clone()));
            assert_eq!(read, shared);
        }
        // Read in: the figures of the file that held its table, and a
        // consistent copy that holds it too.
        let mut read = shared.clone();
        process::read_in_shared_tables(&mut read, |i, size| {
            (i == id && size == table.len() as u64).then(|| table.clone())
        });
        assert_eq!(read.len() as u64 % layout::PAGE, table.len() as u64 % layout::PAGE);
        assert_eq!(format!("{:?}", figures(&parse(&read).unwrap()).unwrap().sites), expected);
        let copy = consistent_copy(&read).unwrap();
        assert_eq!(format!("{:?}", figures(&parse(&copy).unwrap()).unwrap().sites), expected);
        assert_eq!(process::table_ids(&copy), [id], "the copy keeps the table's id");
        assert!(process::shared_tables(&copy).is_empty());

        // A module that joined the file after the copy was made: the
        // runtime put its counters where the copy ends, which is where a
        // table read in would go. None is read in, and the copy is short.
        let mut late = shared.clone();
        let end = late.len() as u64;
        let slot1 = process::MODULE_SLOTS_AT as usize + process::MODULE_SLOT_SIZE as usize;
        for (field, v) in [(0usize, 0u64), (8, table.len() as u64), (16, end), (24, 4096), (56, id)] {
            late[slot1 + field..slot1 + field + 8].copy_from_slice(&v.to_le_bytes());
        }
        late[32..36].copy_from_slice(&2u32.to_le_bytes());
        let before = late.clone();
        process::read_in_shared_tables(&mut late, |_, _| Some(table.clone()));
        assert_eq!(late, before, "nothing read in");
        assert_eq!(consistent_copy(&late), Err(CopyError::RegionOutside { module: 1 }));
    }
}
