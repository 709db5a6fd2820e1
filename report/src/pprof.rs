//! A report as a pprof heap profile: google/pprof's `profile.proto`,
//! gzipped, as `go tool pprof`, Grafana Pyroscope and Parca read it.
//!
//! - Sample types `alloc_objects/count`, `alloc_space/bytes`,
//!   `inuse_objects/count`, `inuse_space/bytes` (alloc first, as Go
//!   writes them; `inuse_space` is the default), or only the two `alloc_`
//!   types when the process had no live tracking (`alloc_space` the
//!   default). Values are the counters themselves: no sampling, period 1.
//! - One location per allocating site, with the site's source lines
//!   (inlined functions first, as pprof orders a location's lines) and the
//!   mapping of its module (file name, build id); one sample per site with
//!   its calls, bytes, live objects and live bytes.
//! - With call chains (callers capture), one sample per chain whose stack
//!   is the site's location then the chain's frames, with the chain's
//!   calls and bytes (chains count no frees: their live figures stay on
//!   the site's own sample), and the site's sample keeps what the chains
//!   do not account for. Each site's figures add up exactly.
//! - Ids are index + 1 and `string_table[0]` is "" (what Parca checks).
//!
//! Bytes in, bytes out: the caller reads the counters file and names
//! the frames.

use crate::chains::ChainRow;
use crate::model::{Figures, SiteInfo};
use alloctramp_trampolines::entry::Kind;
use std::collections::HashMap;
use std::io::Write;

/// The messages of google/pprof's `proto/profile.proto` that a heap
/// profile uses (field numbers as there).
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "7")]
        pub drop_frames: i64,
        #[prost(int64, tag = "8")]
        pub keep_frames: i64,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
        #[prost(int64, tag = "4")]
        pub num_unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(int64, tag = "6")]
        pub build_id: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
        #[prost(bool, tag = "8")]
        pub has_filenames: bool,
        #[prost(bool, tag = "9")]
        pub has_line_numbers: bool,
        #[prost(bool, tag = "10")]
        pub has_inline_frames: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
        #[prost(bool, tag = "5")]
        pub is_folded: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
        #[prost(int64, tag = "3")]
        pub column: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

/// An executable mapping of the process (from its counters file or
/// `/proc/PID/maps`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapped {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub path: String,
}

/// One source line of a location: a function and the line in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceLine {
    pub function: String,
    pub file: Option<String>,
    pub line: u32,
}

/// What a profile is made of besides the figures.
#[derive(Default)]
pub struct Extra<'a> {
    /// The process's executable mappings, where known: they give the
    /// modules' file names and address ranges.
    pub maps: &'a [Mapped],
    /// Per site (module name, address in the module's file): its source
    /// lines, innermost inlined function first, where the module's DWARF
    /// gave them; other sites get one line from the site table.
    pub inlined: HashMap<(String, u64), Vec<SourceLine>>,
    /// The sites' call chains (empty without callers capture).
    pub chains: &'a [ChainRow],
    /// When the figures were read (nanoseconds since the epoch).
    pub time_nanos: i64,
    /// Only sites of this module.
    pub module: Option<&'a str>,
}

/// The mapping that holds run-time address `at`.
pub fn mapping_at(maps: &[Mapped], at: u64) -> Option<&Mapped> {
    maps.iter().find(|m| at >= m.start && at < m.end)
}

/// The mapped file of each module of `figs` (by the run-time address of
/// its first site), where `maps` holds it.
pub fn module_files<'m>(figs: &Figures, maps: &'m [Mapped]) -> HashMap<String, &'m Mapped> {
    let mut out = HashMap::new();
    for m in &figs.modules {
        if let Some((s, _)) = figs.sites.iter().find(|(s, _)| s.module == m.name)
            && let Some(map) = mapping_at(maps, m.bias.wrapping_add(s.address))
        {
            out.insert(m.name.clone(), map);
        }
    }
    out
}

#[derive(Default)]
struct Builder {
    p: proto::Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<(String, Option<String>), u64>,
    /// Mappings by file name.
    mappings: HashMap<String, u64>,
    /// Locations by run-time address.
    locations: HashMap<u64, u64>,
}

impl Builder {
    fn string(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.p.string_table.len() as i64;
        self.p.string_table.push(s.to_string());
        self.strings.insert(s.to_string(), i);
        i
    }

    fn value_type(&mut self, t: &str, unit: &str) -> proto::ValueType {
        proto::ValueType { r#type: self.string(t), unit: self.string(unit) }
    }

    fn function(&mut self, name: &str, file: Option<&str>) -> u64 {
        let key = (name.to_string(), file.map(str::to_string));
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.p.function.len() as u64 + 1;
        let f = proto::Function {
            id,
            name: self.string(name),
            system_name: self.string(name),
            filename: file.map_or(0, |f| self.string(f)),
            start_line: 0,
        };
        self.p.function.push(f);
        self.functions.insert(key, id);
        id
    }

    fn mapping(&mut self, file: &str, build_id: &str, range: (u64, u64, u64)) -> u64 {
        if let Some(&id) = self.mappings.get(file) {
            return id;
        }
        let id = self.p.mapping.len() as u64 + 1;
        let m = proto::Mapping {
            id,
            memory_start: range.0,
            memory_limit: range.1,
            file_offset: range.2,
            filename: self.string(file),
            build_id: if build_id.is_empty() { 0 } else { self.string(build_id) },
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        };
        self.p.mapping.push(m);
        self.mappings.insert(file.to_string(), id);
        id
    }

    fn location(&mut self, address: u64, mapping_id: u64, lines: &[SourceLine]) -> u64 {
        if let Some(&id) = self.locations.get(&address) {
            return id;
        }
        let id = self.p.location.len() as u64 + 1;
        let line = lines
            .iter()
            .map(|l| proto::Line {
                function_id: self.function(&l.function, l.file.as_deref()),
                line: i64::from(l.line),
                column: 0,
            })
            .collect();
        self.p.location.push(proto::Location { id, mapping_id, address, line, is_folded: false });
        self.locations.insert(address, id);
        id
    }
}

/// The site table's names of a site, as one source line.
fn site_line(s: &SiteInfo) -> SourceLine {
    SourceLine {
        function: s.function.map_or_else(|| format!("{}+{:#x}", s.module, s.address), str::to_string),
        file: s.file.map(str::to_string),
        line: s.line.unwrap_or(0),
    }
}

fn clamp(v: i128) -> i64 {
    v.clamp(0, i128::from(i64::MAX)) as i64
}

/// The profile of `figs` (not yet encoded).
pub fn profile(figs: &Figures, extra: &Extra) -> proto::Profile {
    let mut b = Builder::default();
    b.string("");
    let live = figs.live();
    let mut types = vec![b.value_type("alloc_objects", "count"), b.value_type("alloc_space", "bytes")];
    if live {
        types.push(b.value_type("inuse_objects", "count"));
        types.push(b.value_type("inuse_space", "bytes"));
    }
    b.p.sample_type = types;
    b.p.default_sample_type = b.string(if live { "inuse_space" } else { "alloc_space" });
    b.p.period_type = Some(b.value_type("space", "bytes"));
    b.p.period = 1;
    b.p.time_nanos = extra.time_nanos;
    let p = &figs.process;
    let comment = format!("alloctramp: process {} ({})", p.pid, p.command);
    b.p.comment = vec![b.string(&comment)];

    // Mappings: the modules first (in file order: the program is first),
    // then the other files chains pass through.
    let files = module_files(figs, extra.maps);
    let mut module_mapping: HashMap<&str, u64> = HashMap::new();
    for m in &figs.modules {
        let range = match files.get(&m.name) {
            Some(map) => (map.start, map.end, map.offset),
            None => {
                let addrs = figs.sites.iter().filter(|(s, _)| s.module == m.name).map(|(s, _)| s.address);
                let (lo, hi) = addrs.fold((u64::MAX, 0), |(lo, hi), a| (lo.min(a), hi.max(a)));
                if lo > hi { (0, 0, 0) } else { (m.bias.wrapping_add(lo), m.bias.wrapping_add(hi).wrapping_add(1), 0) }
            }
        };
        let file = files.get(&m.name).map_or(m.name.as_str(), |map| map.path.as_str());
        let id = b.mapping(file, &m.build_id, range);
        module_mapping.insert(&m.name, id);
    }

    let bias: HashMap<&str, u64> = figs.modules.iter().map(|m| (m.name.as_str(), m.bias)).collect();
    let mut chains_of: HashMap<(&str, u64), Vec<&ChainRow>> = HashMap::new();
    for c in extra.chains {
        chains_of.entry((c.site.0.as_str(), c.site.1)).or_default().push(c);
    }
    for (s, f) in &figs.sites {
        if s.kind == Kind::Free || extra.module.is_some_and(|m| m != s.module) {
            continue;
        }
        let at = bias.get(s.module).copied().unwrap_or(0).wrapping_add(s.address);
        let lines = match extra.inlined.get(&(s.module.to_string(), s.address)) {
            Some(l) if !l.is_empty() => l.clone(),
            _ => vec![site_line(s)],
        };
        let mapping = module_mapping.get(s.module).copied().unwrap_or(0);
        let site_loc = b.location(at, mapping, &lines);
        let (mut calls, mut bytes) = (f.calls, f.bytes);
        for c in chains_of.get(&(s.module, s.address)).map(Vec::as_slice).unwrap_or_default() {
            let mut stack = vec![site_loc];
            for fr in &c.frames {
                let mapping = match (&fr.module, mapping_at(extra.maps, fr.address)) {
                    (Some(path), Some(map)) => b.mapping(path, "", (map.start, map.end, map.offset)),
                    (Some(path), None) => b.mapping(path, "", (0, 0, 0)),
                    _ => 0,
                };
                let line = SourceLine {
                    function: fr.function.clone().unwrap_or_else(|| format!("{:#x}", fr.address)),
                    file: fr.file.clone(),
                    line: fr.line.unwrap_or(0),
                };
                stack.push(b.location(fr.address, mapping, &[line]));
            }
            calls -= i128::from(c.calls);
            bytes -= i128::from(c.bytes);
            let mut value = vec![c.calls as i64, c.bytes as i64];
            if live {
                value.extend([0, 0]);
            }
            if c.calls > 0 || c.bytes > 0 {
                b.p.sample.push(proto::Sample { location_id: stack, value, label: vec![] });
            }
        }
        let mut value = vec![clamp(calls), clamp(bytes)];
        if live {
            value.extend([clamp(f.live_calls.unwrap_or(0)), clamp(f.live_bytes.unwrap_or(0))]);
        }
        if value.iter().any(|&v| v != 0) {
            b.p.sample.push(proto::Sample { location_id: vec![site_loc], value, label: vec![] });
        }
    }
    b.p
}

/// The profile of `figs`, encoded and gzipped (what `go tool pprof`
/// reads).
pub fn write(figs: &Figures, extra: &Extra) -> Vec<u8> {
    use prost::Message;
    let raw = profile(figs, extra).encode_to_vec();
    let mut gz = flate2::write::GzEncoder::new(Vec::with_capacity(raw.len() / 2 + 64), flate2::Compression::default());
    // Writing to a Vec cannot fail.
    let _ = gz.write_all(&raw);
    gz.finish().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chains::{ChainRow, Frame};
    use crate::model::tests::figures;
    use prost::Message;

    fn decode(bytes: &[u8]) -> proto::Profile {
        let mut raw = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(bytes), &mut raw).unwrap();
        proto::Profile::decode(raw.as_slice()).unwrap()
    }

    fn s(p: &proto::Profile, i: i64) -> &str {
        &p.string_table[i as usize]
    }

    /// Ids are index + 1 everywhere, every index is in range, and
    /// `string_table[0]` is empty (what Parca checks).
    fn check_ids(p: &proto::Profile) {
        assert_eq!(p.string_table[0], "");
        for (i, m) in p.mapping.iter().enumerate() {
            assert_eq!(m.id, i as u64 + 1);
        }
        for (i, f) in p.function.iter().enumerate() {
            assert_eq!(f.id, i as u64 + 1);
            assert!((f.name as usize) < p.string_table.len());
        }
        for (i, l) in p.location.iter().enumerate() {
            assert_eq!(l.id, i as u64 + 1);
            assert!(l.mapping_id as usize <= p.mapping.len());
            assert!(l.line.iter().all(|x| x.function_id >= 1 && x.function_id as usize <= p.function.len()));
        }
        for sm in &p.sample {
            assert_eq!(sm.value.len(), p.sample_type.len());
            assert!(sm.location_id.iter().all(|&id| id >= 1 && id as usize <= p.location.len()));
        }
    }

    #[test]
    fn sites_are_locations_and_their_figures_samples() {
        let f = figures();
        let p = decode(&write(&f, &Extra { time_nanos: 7, ..Extra::default() }));
        check_ids(&p);
        let types: Vec<(&str, &str)> = p.sample_type.iter().map(|t| (s(&p, t.r#type), s(&p, t.unit))).collect();
        assert_eq!(
            types,
            [
                ("alloc_objects", "count"),
                ("alloc_space", "bytes"),
                ("inuse_objects", "count"),
                ("inuse_space", "bytes")
            ]
        );
        assert_eq!(s(&p, p.default_sample_type), "inuse_space");
        assert_eq!((p.period, p.time_nanos), (1, 7));
        // Allocating sites with figures: 0x10, 0x20, 0x40, 0x50 (free sites
        // are not samples).
        let values: Vec<Vec<i64>> = p.sample.iter().map(|x| x.value.clone()).collect();
        assert_eq!(values, [vec![10, 160, 0, 0], vec![3, 3000, 2, 2000], vec![5, 500, 0, 0], vec![7, 448, 7, 448]]);
        let loc = &p.location[p.sample[1].location_id[0] as usize - 1];
        assert_eq!(loc.line.len(), 1);
        let func = &p.function[loc.line[0].function_id as usize - 1];
        assert_eq!((s(&p, func.name), s(&p, func.filename), loc.line[0].line), ("main", "main.c", 32));
        let maps: Vec<(&str, &str)> = p.mapping.iter().map(|m| (s(&p, m.filename), s(&p, m.build_id))).collect();
        assert_eq!(maps, [("prog", "b1d"), ("lib.so", "b1d")]);
        assert_eq!(p.location[3].mapping_id, 2, "lib_new is in lib.so");

        // Without live tracking: the alloc types only.
        let mut f = figures();
        f.process.live = false;
        let p = decode(&write(&f, &Extra { module: Some("lib.so"), ..Extra::default() }));
        check_ids(&p);
        assert_eq!(p.sample_type.len(), 2);
        assert_eq!(s(&p, p.default_sample_type), "alloc_space");
        assert_eq!(p.sample.len(), 1, "one module's sites");
    }

    #[test]
    fn inlined_lines_and_chains_make_stacks_that_add_up() {
        let mut f = figures();
        f.modules[0].bias = 0x1000;
        let maps = [
            Mapped { start: 0x1000, end: 0x2000, offset: 0, path: "/bin/prog".into() },
            Mapped { start: 0x7000, end: 0x8000, offset: 0x1000, path: "/lib/libc.so.6".into() },
        ];
        let mut inlined = HashMap::new();
        let line = |function: &str, line| SourceLine { function: function.into(), file: Some("main.c".into()), line };
        inlined.insert(("prog".to_string(), 0x20), vec![line("helper", 5), line("main", 32)]);
        let frame = |address, function: &str, l| Frame {
            address,
            module: Some(if address < 0x2000 { "/bin/prog" } else { "/lib/libc.so.6" }.into()),
            function: Some(function.into()),
            line: Some(l),
            ..Frame::default()
        };
        let chains = [
            ChainRow {
                site: ("prog".into(), 0x20),
                calls: 2,
                bytes: 2000,
                frames: vec![frame(0x1100, "caller", 70), frame(0x7100, "__libc_start_main", 0)],
                outside_plumbing: None,
            },
            ChainRow {
                site: ("prog".into(), 0x20),
                calls: 1,
                bytes: 500,
                frames: vec![frame(0x1200, "other", 80)],
                outside_plumbing: None,
            },
        ];
        let extra = Extra { maps: &maps, inlined, chains: &chains, ..Extra::default() };
        let p = decode(&write(&f, &extra));
        check_ids(&p);
        let of_site: Vec<&proto::Sample> =
            p.sample.iter().filter(|x| x.location_id[0] == p.sample[1].location_id[0]).collect();
        let stacks: Vec<(usize, Vec<i64>)> = of_site.iter().map(|x| (x.location_id.len(), x.value.clone())).collect();
        assert_eq!(stacks, [(3, vec![2, 2000, 0, 0]), (2, vec![1, 500, 0, 0]), (1, vec![0, 500, 2, 2000])]);
        let sum = |i: usize| of_site.iter().map(|x| x.value[i]).sum::<i64>();
        assert_eq!((sum(0), sum(1), sum(2), sum(3)), (3, 3000, 2, 2000), "the site's own figures");
        let loc = &p.location[of_site[0].location_id[0] as usize - 1];
        let names: Vec<(&str, i64)> =
            loc.line.iter().map(|l| (s(&p, p.function[l.function_id as usize - 1].name), l.line)).collect();
        assert_eq!(names, [("helper", 5), ("main", 32)], "inlined function first");
        assert_eq!(loc.address, 0x1020, "the run-time address");
        let maps: Vec<(&str, u64)> = p.mapping.iter().map(|m| (s(&p, m.filename), m.memory_start)).collect();
        assert_eq!(maps, [("/bin/prog", 0x1000), ("lib.so", 0x50), ("/lib/libc.so.6", 0x7000)]);
    }
}
