//! The report's data: figures per site ([`Fig`], [`SiteInfo`]), rows
//! (sites, or sums per function, file or module), their selection and
//! order, totals, and the difference of two sets of figures.

use crate::named;
use alloctramp_trampolines::entry::Kind;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt;
use std::io::{self, Write};
use std::rc::Rc;

/// The order of rows (largest first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortKey {
    /// Live bytes (totals when live tracking is off).
    LiveBytes,
    /// Live objects (calls minus failures when live tracking is off).
    LiveCalls,
    /// Bytes requested in total.
    Bytes,
    /// Calls in total.
    Calls,
}

named!(SortKey { LiveBytes => "live-bytes", LiveCalls => "live-calls", Bytes => "bytes", Calls => "calls", });

/// What one row stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupBy {
    Site,
    Function,
    File,
    Module,
}

named!(GroupBy { Site => "site", Function => "function", File => "file", Module => "module", });

/// Figures of one row: a site, a group of sites, or a difference. Signed so
/// that differences use the same type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fig {
    /// Calls of allocation and realloc sites.
    pub calls: i128,
    /// Bytes requested through them (failed calls included).
    pub bytes: i128,
    pub failed: i128,
    /// Bytes the failed calls requested.
    pub failed_bytes: i128,
    /// Live objects and their bytes (None: live tracking was off).
    pub live_calls: Option<i128>,
    pub live_bytes: Option<i128>,
    pub freed_objects: i128,
    pub freed_bytes: i128,
    /// Calls of free sites.
    pub free_calls: i128,
    pub untracked_frees: i128,
    /// Calls failed by fault injection (the allocator was not called).
    pub injected: i128,
}

fn add_opt(a: Option<i128>, b: Option<i128>) -> Option<i128> {
    Some(a? + b?)
}
fn sub_opt(a: Option<i128>, b: Option<i128>) -> Option<i128> {
    Some(a? - b?)
}

impl Fig {
    /// Zero, with live figures (zero) when `live`.
    pub fn zero(live: bool) -> Fig {
        Fig { live_calls: live.then_some(0), live_bytes: live.then_some(0), ..Fig::default() }
    }
    pub fn add(&mut self, o: &Fig) {
        self.calls += o.calls;
        self.bytes += o.bytes;
        self.failed += o.failed;
        self.failed_bytes += o.failed_bytes;
        self.live_calls = add_opt(self.live_calls, o.live_calls);
        self.live_bytes = add_opt(self.live_bytes, o.live_bytes);
        self.freed_objects += o.freed_objects;
        self.freed_bytes += o.freed_bytes;
        self.free_calls += o.free_calls;
        self.untracked_frees += o.untracked_frees;
        self.injected += o.injected;
    }
    pub fn sub(&self, o: &Fig) -> Fig {
        Fig {
            calls: self.calls - o.calls,
            bytes: self.bytes - o.bytes,
            failed: self.failed - o.failed,
            failed_bytes: self.failed_bytes - o.failed_bytes,
            live_calls: sub_opt(self.live_calls, o.live_calls),
            live_bytes: sub_opt(self.live_bytes, o.live_bytes),
            freed_objects: self.freed_objects - o.freed_objects,
            freed_bytes: self.freed_bytes - o.freed_bytes,
            free_calls: self.free_calls - o.free_calls,
            untracked_frees: self.untracked_frees - o.untracked_frees,
            injected: self.injected - o.injected,
        }
    }
    /// The allocinfo size column: live bytes, else the bytes requested.
    pub fn size(&self) -> i128 {
        self.live_bytes.unwrap_or(self.bytes)
    }
    /// The allocinfo calls column: live objects, else successful calls.
    pub fn count(&self) -> i128 {
        self.live_calls.unwrap_or(self.calls - self.failed)
    }
    pub fn key(&self, k: SortKey) -> i128 {
        match k {
            SortKey::LiveBytes => self.size(),
            SortKey::LiveCalls => self.count(),
            SortKey::Bytes => self.bytes,
            SortKey::Calls => self.calls + self.free_calls,
        }
    }
    pub fn is_zero(&self) -> bool {
        let z =
            Fig { live_calls: self.live_calls.map(|_| 0), live_bytes: self.live_bytes.map(|_| 0), ..Fig::default() };
        *self == z
    }
    /// Without the live figures (live tracking was off on one side).
    fn without_live(self) -> Fig {
        Fig { live_calls: None, live_bytes: None, ..self }
    }
}

/// A site's identity and names, all from the site table.
#[derive(Clone, Debug)]
pub struct SiteInfo<'a> {
    pub module: &'a str,
    pub build_id: Rc<str>,
    pub address: u64,
    pub function: Option<&'a str>,
    pub file: Option<&'a str>,
    pub line: Option<u32>,
    pub entry: &'a str,
    pub kind: Kind,
    pub form: &'static str,
}

impl SiteInfo<'_> {
    /// `file:line`, or the module-relative address without line information.
    pub fn location(&self) -> String {
        match (&self.file, self.line) {
            (Some(f), Some(l)) => format!("{f}:{l}"),
            _ => format!("{:#x}", self.address),
        }
    }
}

/// A module of a process file.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct ModuleInfo {
    pub name: String,
    /// Hex.
    pub build_id: String,
    pub sites: u32,
    pub on: bool,
    pub unloaded: bool,
    /// Bytes of the module's site table (in the process file or shared) and
    /// of its counters in the process file.
    pub table_size: u64,
    pub counters_size: u64,
    /// Where the module is loaded (run-time address minus file address;
    /// not in the JSON document).
    #[serde(skip)]
    pub bias: u64,
}

impl ProcessInfo {
    /// The command line for people to read (see
    /// [`alloctramp_trampolines::process::command_line`]).
    pub fn command_line(&self) -> String {
        alloctramp_trampolines::process::command_line(&self.command, &self.arguments)
    }
}

/// The process a file describes, and its state when the file was read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: u32,
    /// `argv[0]`.
    pub command: String,
    /// The other arguments, as many as the counters file holds.
    pub arguments: Vec<String>,
    /// Profiling was on.
    pub on: bool,
    /// The process exited: the file is its final snapshot.
    pub exited: bool,
    /// Live tracking was on: the live figures are known.
    pub live: bool,
    /// Profiling is off, free sites stay on until tracked objects are freed.
    pub draining: bool,
    /// Live figures may overstate.
    pub incomplete: bool,
    pub generation: u64,
    /// Seconds since the epoch (0: unknown, or never reset).
    pub start_time: u64,
    pub reset_time: u64,
    pub last_switch_ns: u64,
    pub last_switch_sites: u64,
    pub last_switch_time: u64,
    pub last_error: String,
    pub untracked_allocs: u64,
    pub table_bytes: u64,
    pub table_objects: u64,
}

/// Everything read from one process file.
#[derive(Clone, Debug)]
pub struct Figures<'a> {
    pub process: ProcessInfo,
    pub modules: Vec<ModuleInfo>,
    /// Every site of every module, in file order.
    pub sites: Vec<(SiteInfo<'a>, Fig)>,
}

impl Figures<'_> {
    /// Live tracking was on: the live figures are known.
    pub fn live(&self) -> bool {
        self.process.live
    }
    /// Bytes of every live object (None without live tracking).
    pub fn live_bytes(&self) -> Option<i128> {
        self.live().then(|| self.sites.iter().filter_map(|(_, f)| f.live_bytes).sum())
    }
    /// Objects live (None without live tracking).
    pub fn live_objects(&self) -> Option<i128> {
        self.live().then(|| self.sites.iter().filter_map(|(_, f)| f.live_calls).sum())
    }
}

/// A row of output: a site or a group.
#[derive(Clone, Debug)]
pub struct Row<'a> {
    pub group: GroupBy,
    /// The site (for groups: the first site of the group).
    pub site: SiteInfo<'a>,
    pub sites: u64,
    /// Some site of the row allocates (shown without --all-columns).
    pub allocates: bool,
    pub fig: Fig,
    /// For differences: whether the row's sites exist in the old and new
    /// files.
    pub presence: Option<(bool, bool)>,
}

impl Row<'_> {
    /// The allocinfo tag.
    pub fn tag(&self) -> String {
        let mut v = Vec::new();
        let _ = self.write_tag(&mut v);
        String::from_utf8_lossy(&v).into_owned()
    }

    pub fn write_tag(&self, w: &mut dyn Write) -> io::Result<()> {
        let s = &self.site;
        let func = s.function.unwrap_or("?");
        match self.group {
            GroupBy::Site => match (s.file, s.line) {
                (Some(f), Some(l)) => write!(w, "{f}:{l} module:{} func:{func}", s.module),
                _ => write!(w, "{:#x} module:{} func:{func}", s.address, s.module),
            },
            GroupBy::Function => write!(w, "module:{} func:{func}", s.module),
            GroupBy::File => write!(w, "{} module:{}", s.file.unwrap_or("?"), s.module),
            GroupBy::Module => write!(w, "module:{}", s.module),
        }
    }
}

/// One row per site, or sums per group (in the order groups first appear).
pub fn group<'a>(sites: Vec<(SiteInfo<'a>, Fig)>, by: GroupBy) -> Vec<Row<'a>> {
    let row = |(site, fig): (SiteInfo<'a>, Fig)| Row {
        group: by,
        allocates: site.kind != Kind::Free,
        site,
        sites: 1,
        fig,
        presence: None,
    };
    if by == GroupBy::Site {
        return sites.into_iter().map(row).collect();
    }
    let mut index: HashMap<(&str, Option<&str>), usize> = HashMap::new();
    let mut out: Vec<Row> = Vec::new();
    for (site, fig) in sites {
        let key = match by {
            GroupBy::Function => (site.module, site.function),
            GroupBy::File => (site.module, site.file),
            _ => (site.module, None),
        };
        match index.get(&key) {
            Some(&i) => {
                let r = &mut out[i];
                r.fig.add(&fig);
                r.sites += 1;
                r.allocates |= site.kind != Kind::Free;
            }
            None => {
                index.insert(key, out.len());
                out.push(row((site, fig)));
            }
        }
    }
    out
}

/// Which rows, and in what order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection<'s> {
    /// Only sites of this module.
    pub module: Option<&'s str>,
    pub group_by: GroupBy,
    /// Only rows with an allocating site (no rows of free sites alone).
    pub allocating_only: bool,
    /// Only rows whose size column is at least this (in magnitude, for
    /// differences).
    pub min_bytes: Option<u64>,
    /// Sort rows, largest first (None: site order, unless `top`).
    pub sort: Option<SortKey>,
    /// Only the first N rows (sorted by `sort`, else live bytes; 0: all).
    pub top: Option<usize>,
}

impl Default for Selection<'_> {
    fn default() -> Self {
        Selection {
            module: None,
            group_by: GroupBy::Site,
            allocating_only: false,
            min_bytes: None,
            sort: None,
            top: None,
        }
    }
}

impl Selection<'_> {
    /// The order the rows are in: `sort`, else live bytes when cut to
    /// `top`, else site order (None).
    pub fn order(&self) -> Option<SortKey> {
        self.sort.or(self.top.map(|_| SortKey::LiveBytes))
    }
}

/// A module named in a [`Selection`] that the figures do not have.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoModule {
    pub name: String,
    /// The modules there are.
    pub modules: Vec<String>,
}

impl fmt::Display for NoModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no module {:?} here (modules: {})", self.name, self.modules.join(", "))
    }
}

impl std::error::Error for NoModule {}

/// Filters (module), groups, filters (kind, size), sorts and cuts per the
/// selection. `changes`: the figures are differences (`min_bytes` compares
/// their magnitude).
pub fn select<'a>(
    sites: Vec<(SiteInfo<'a>, Fig)>,
    modules: &[ModuleInfo],
    sel: &Selection,
    changes: bool,
) -> Result<Vec<Row<'a>>, NoModule> {
    let sites = match sel.module {
        None => sites,
        Some(name) => {
            if !modules.iter().any(|m| m.name == name) {
                let modules = modules.iter().map(|m| m.name.clone()).collect();
                return Err(NoModule { name: name.to_string(), modules });
            }
            sites.into_iter().filter(|(s, _)| s.module == name).collect()
        }
    };
    let mut rows = group(sites, sel.group_by);
    if sel.allocating_only {
        rows.retain(|r| r.allocates);
    }
    if let Some(min) = sel.min_bytes {
        let min = min as i128;
        rows.retain(|r| if changes { r.fig.size().abs() >= min } else { r.fig.size() >= min });
    }
    if let Some(k) = sel.order() {
        // Stable: equal rows stay in site order.
        rows.sort_by_key(|r| std::cmp::Reverse(r.fig.key(k)));
    }
    if let Some(n) = sel.top.filter(|&n| n > 0) {
        rows.truncate(n);
    }
    Ok(rows)
}

/// The sum of the rows shown, as a module-level group.
pub fn totals(rows: &[Row], live: bool) -> Row<'static> {
    let mut fig = Fig::zero(live);
    let mut sites = 0;
    for r in rows {
        fig.add(&r.fig);
        sites += r.sites;
    }
    Row {
        group: GroupBy::Module,
        site: SiteInfo {
            module: "",
            build_id: "".into(),
            address: 0,
            function: None,
            file: None,
            line: None,
            entry: "",
            kind: Kind::Alloc,
            form: "",
        },
        sites,
        allocates: true,
        fig,
        presence: None,
    }
}

/// A site's identity across two files: its module and address.
type SiteKey<'a> = (&'a str, u64);

/// Per-site change from one set of figures to another (NEW minus OLD).
#[derive(Clone, Debug)]
pub struct Diff<'a> {
    /// The sites of the new figures, then those only in the old ones (a
    /// module unloaded and gone), each with its change.
    pub sites: Vec<(SiteInfo<'a>, Fig)>,
    /// Per site: whether it is in the old and in the new figures.
    presence: HashMap<SiteKey<'a>, (bool, bool)>,
    /// The new figures' modules, then those only in the old ones.
    pub modules: Vec<ModuleInfo>,
    /// Live tracking was on on both sides (else the changes have no live
    /// figures).
    pub live: bool,
    /// Modules that are a different build in the two files.
    pub rebuilt: Vec<String>,
}

/// The figures of several processes as one (a process tree), the first
/// (the tree's root) giving the process's description: a site met in
/// several processes (the same module, build id and address) is one, its
/// figures summed, and so is a module. Live figures are known only if
/// every process tracked them; they may overstate if any may.
pub fn merge<'a>(all: Vec<Figures<'a>>) -> Option<Figures<'a>> {
    let mut all = all.into_iter();
    let mut out = all.next()?;
    let mut sites: HashMap<(&'a str, Rc<str>, u64), usize> = HashMap::new();
    for (i, (s, _)) in out.sites.iter().enumerate() {
        sites.entry((s.module, s.build_id.clone(), s.address)).or_insert(i);
    }
    for f in all {
        let p = &mut out.process;
        p.live &= f.process.live;
        p.incomplete |= f.process.incomplete;
        p.draining |= f.process.draining;
        p.on |= f.process.on;
        p.untracked_allocs += f.process.untracked_allocs;
        p.table_bytes += f.process.table_bytes;
        p.table_objects += f.process.table_objects;
        for m in f.modules {
            if !out.modules.iter().any(|o| o.name == m.name && o.build_id == m.build_id) {
                out.modules.push(m);
            }
        }
        for (s, fig) in f.sites {
            match sites.get(&(s.module, s.build_id.clone(), s.address)) {
                Some(&i) => out.sites[i].1.add(&fig),
                None => {
                    sites.insert((s.module, s.build_id.clone(), s.address), out.sites.len());
                    out.sites.push((s, fig));
                }
            }
        }
    }
    if !out.process.live {
        for (_, f) in &mut out.sites {
            *f = f.without_live();
        }
    }
    Some(out)
}

/// The change of every site from `old` to `new`; sites that did not change
/// are left out unless `unchanged`.
pub fn diff<'a>(old: &Figures<'a>, new: &Figures<'a>, unchanged: bool) -> Diff<'a> {
    let live = old.live() && new.live();
    let strip = |f: Fig| if live { f } else { f.without_live() };
    let mut old_sites: HashMap<SiteKey, Fig> = HashMap::new();
    for (s, f) in &old.sites {
        old_sites.insert((s.module, s.address), strip(*f));
    }
    let zero = Fig::zero(live);
    let mut sites: Vec<(SiteInfo, Fig)> = Vec::new();
    let mut presence: HashMap<SiteKey, (bool, bool)> = HashMap::new();
    for (s, f) in &new.sites {
        let key = (s.module, s.address);
        let o = old_sites.remove(&key);
        presence.insert(key, (o.is_some(), true));
        sites.push((s.clone(), strip(*f).sub(&o.unwrap_or(zero))));
    }
    for (s, f) in &old.sites {
        let key = (s.module, s.address);
        if let Some(o) = old_sites.remove(&key) {
            debug_assert_eq!(o, strip(*f));
            presence.insert(key, (true, false));
            sites.push((s.clone(), zero.sub(&o)));
        }
    }
    if !unchanged {
        sites.retain(|(_, f)| !f.is_zero());
    }
    let mut modules = new.modules.clone();
    for m in &old.modules {
        if !modules.iter().any(|n| n.name == m.name) {
            modules.push(m.clone());
        }
    }
    let rebuilt = new
        .modules
        .iter()
        .filter(|m| old.modules.iter().find(|o| o.name == m.name).is_some_and(|o| o.build_id != m.build_id))
        .map(|m| m.name.clone())
        .collect();
    Diff { sites, presence, modules, live, rebuilt }
}

impl<'a> Diff<'a> {
    /// The rows `sel` selects; site rows say whether the site is in each
    /// file.
    pub fn select(self, sel: &Selection) -> Result<Vec<Row<'a>>, NoModule> {
        let mut rows = select(self.sites, &self.modules, sel, true)?;
        if sel.group_by == GroupBy::Site {
            for r in &mut rows {
                r.presence = self.presence.get(&(r.site.module, r.site.address)).copied();
            }
        }
        Ok(rows)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A site of module `m` at `address` in `function` (file `f.c`, line =
    /// address).
    pub fn site(m: &'static str, address: u64, function: &'static str, kind: Kind) -> SiteInfo<'static> {
        SiteInfo {
            module: m,
            build_id: "b1d".into(),
            address,
            function: Some(function),
            file: Some(if m == "lib.so" { "lib.c" } else { "main.c" }),
            line: Some(address as u32),
            entry: match kind {
                Kind::Free => "free",
                Kind::Realloc => "realloc",
                _ => "malloc",
            },
            kind,
            form: "call rel32",
        }
    }

    /// Figures of an allocation site: `calls` of `size` bytes, `freed` of
    /// them freed.
    pub fn alloc(calls: i128, size: i128, freed: i128) -> Fig {
        Fig {
            calls,
            bytes: calls * size,
            live_calls: Some(calls - freed),
            live_bytes: Some((calls - freed) * size),
            freed_objects: freed,
            freed_bytes: freed * size,
            ..Fig::default()
        }
    }

    pub fn free(calls: i128, untracked: i128) -> Fig {
        Fig { free_calls: calls, untracked_frees: untracked, ..Fig::zero(true) }
    }

    pub fn module(name: &str, sites: u32) -> ModuleInfo {
        ModuleInfo {
            name: name.to_string(),
            build_id: "b1d".to_string(),
            sites,
            on: true,
            unloaded: false,
            table_size: 4096,
            counters_size: 4096,
            bias: 0,
        }
    }

    /// A program `prog` with four sites (two functions) and a library with
    /// two.
    pub fn figures() -> Figures<'static> {
        Figures {
            process: ProcessInfo { pid: 42, command: "prog".into(), on: true, live: true, ..ProcessInfo::default() },
            modules: vec![module("prog", 4), module("lib.so", 2)],
            sites: vec![
                (site("prog", 0x10, "main", Kind::Alloc), alloc(10, 16, 10)),
                (site("prog", 0x20, "main", Kind::Alloc), alloc(3, 1000, 1)),
                (site("prog", 0x30, "main", Kind::Free), free(11, 0)),
                (site("prog", 0x40, "work", Kind::Realloc), alloc(5, 100, 5)),
                (site("lib.so", 0x50, "lib_new", Kind::Alloc), alloc(7, 64, 0)),
                (site("lib.so", 0x60, "lib_free", Kind::Free), free(2, 2)),
            ],
        }
    }

    fn keys(rows: &[Row]) -> Vec<String> {
        rows.iter().map(Row::tag).collect()
    }

    #[test]
    fn a_tree_is_one_set_of_figures_a_site_met_twice_is_one_row() {
        // The same program twice, and a child with a site of its own.
        let mut child = figures();
        child.process.pid = 43;
        child.modules.push(ModuleInfo { name: "child".into(), ..module("child", 1) });
        child.sites.truncate(1);
        child.sites.push((site("child", 0x10, "main", Kind::Alloc), alloc(1, 8, 0)));
        let merged = merge(vec![figures(), figures(), child]).unwrap();
        assert_eq!(merged.process.pid, 42, "the root's description");
        assert_eq!(merged.modules.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["prog", "lib.so", "child"]);
        assert_eq!(merged.sites.len(), 7);
        assert_eq!(merged.sites[0].1, Fig { calls: 30, bytes: 480, ..alloc(30, 16, 30) });
        assert_eq!(merged.sites[4].1, alloc(14, 64, 0));
        assert_eq!(merged.sites[6].1, alloc(1, 8, 0));
        assert_eq!(merged.live_objects(), Some(2 * 2 + 2 * 7 + 1));

        // One process without live tracking: no live figure is known.
        let mut blind = figures();
        blind.process.live = false;
        let merged = merge(vec![figures(), blind]).unwrap();
        assert!(!merged.live());
        assert!(merged.sites.iter().all(|(_, f)| f.live_calls.is_none() && f.live_bytes.is_none()));
        assert_eq!(merged.sites[1].1.calls, 6);
        assert!(merge(Vec::new()).is_none());
    }

    #[test]
    fn groups_sum_their_sites_in_order_of_first_appearance() {
        let rows = group(figures().sites, GroupBy::Function);
        assert_eq!(
            keys(&rows),
            [
                "module:prog func:main",
                "module:prog func:work",
                "module:lib.so func:lib_new",
                "module:lib.so func:lib_free"
            ]
        );
        let main = &rows[0];
        assert_eq!(main.sites, 3);
        assert!(main.allocates);
        assert_eq!(main.fig.calls, 13);
        assert_eq!(main.fig.bytes, 10 * 16 + 3000);
        assert_eq!((main.fig.live_calls, main.fig.live_bytes), (Some(2), Some(2000)));
        assert_eq!(main.fig.free_calls, 11);
        assert!(!rows[3].allocates, "a group of free sites only");

        let rows = group(figures().sites, GroupBy::Module);
        assert_eq!(keys(&rows), ["module:prog", "module:lib.so"]);
        assert_eq!(rows.iter().map(|r| r.sites).collect::<Vec<_>>(), [4, 2]);
        assert_eq!(rows[1].fig.untracked_frees, 2);

        let rows = group(figures().sites, GroupBy::File);
        assert_eq!(keys(&rows), ["main.c module:prog", "lib.c module:lib.so"]);

        let rows = group(figures().sites, GroupBy::Site);
        assert_eq!(rows.len(), 6);
        assert_eq!(rows[0].tag(), "main.c:16 module:prog func:main");
    }

    #[test]
    fn selection_filters_sorts_and_cuts() {
        let f = figures();
        let sel = Selection { allocating_only: true, ..Selection::default() };
        let rows = select(f.sites.clone(), &f.modules, &sel, false).unwrap();
        assert_eq!(rows.iter().map(|r| r.site.address).collect::<Vec<_>>(), [0x10, 0x20, 0x40, 0x50]);

        // --top alone sorts by live bytes; equal rows keep site order.
        let sel = Selection { top: Some(3), ..Selection::default() };
        assert_eq!(sel.order(), Some(SortKey::LiveBytes));
        let rows = select(f.sites.clone(), &f.modules, &sel, false).unwrap();
        assert_eq!(rows.iter().map(|r| r.site.address).collect::<Vec<_>>(), [0x20, 0x50, 0x10]);

        let sel = Selection { sort: Some(SortKey::Calls), top: Some(0), ..Selection::default() };
        let rows = select(f.sites.clone(), &f.modules, &sel, false).unwrap();
        assert_eq!(rows.iter().map(|r| r.site.address).collect::<Vec<_>>(), [0x30, 0x10, 0x50, 0x40, 0x20, 0x60]);

        let sel = Selection { module: Some("lib.so"), min_bytes: Some(1), ..Selection::default() };
        let rows = select(f.sites.clone(), &f.modules, &sel, false).unwrap();
        assert_eq!(rows.iter().map(|r| r.site.address).collect::<Vec<_>>(), [0x50]);

        let sel = Selection { module: Some("libc.so.6"), ..Selection::default() };
        let e = select(f.sites.clone(), &f.modules, &sel, false).unwrap_err();
        assert_eq!(e.to_string(), "no module \"libc.so.6\" here (modules: prog, lib.so)");
    }

    #[test]
    fn totals_sum_the_rows_shown() {
        let f = figures();
        let rows = group(f.sites, GroupBy::Site);
        let t = totals(&rows, true);
        assert_eq!(t.sites, 6);
        assert_eq!(t.fig.calls, 25);
        assert_eq!(t.fig.free_calls, 13);
        assert_eq!(t.fig.live_bytes, Some(2000 + 7 * 64));
        assert_eq!(t.fig.live_calls, Some(2 + 7));
        assert_eq!(totals(&[], false).fig, Fig::default());
        assert_eq!(totals(&[], true).fig, Fig::zero(true));
    }

    #[test]
    fn a_diff_is_new_minus_old_per_site_with_presence() {
        let old = figures();
        let mut new = figures();
        // More calls at 0x20; the library gone; a new module.
        new.sites[1].1 = alloc(5, 1000, 1);
        new.sites.truncate(4);
        new.sites.push((site("new.so", 0x70, "f", Kind::Alloc), alloc(1, 8, 0)));
        new.modules = vec![module("prog", 4), module("new.so", 1)];
        new.modules[0].build_id = "other".into();

        let d = diff(&old, &new, false);
        assert!(d.live);
        assert_eq!(d.rebuilt, ["prog"]);
        assert_eq!(d.modules.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["prog", "new.so", "lib.so"]);
        let got: Vec<(u64, Fig)> = d.sites.iter().map(|(s, f)| (s.address, *f)).collect();
        assert_eq!(
            got,
            [
                (0x20, alloc(2, 1000, 0)),
                (0x70, alloc(1, 8, 0)),
                (0x50, Fig::zero(true).sub(&alloc(7, 64, 0))),
                (0x60, Fig::zero(true).sub(&free(2, 2))),
            ]
        );
        let rows = d.select(&Selection { sort: Some(SortKey::LiveBytes), ..Selection::default() }).unwrap();
        let got: Vec<(u64, Option<(bool, bool)>)> = rows.iter().map(|r| (r.site.address, r.presence)).collect();
        assert_eq!(
            got,
            [
                (0x20, Some((true, true))),
                (0x70, Some((false, true))),
                (0x60, Some((true, false))),
                (0x50, Some((true, false)))
            ]
        );

        // With every site, and without live figures when one side had none.
        new.process.live = false;
        let d = diff(&old, &new, true);
        assert!(!d.live);
        assert_eq!(d.sites.len(), 7);
        assert!(d.sites.iter().all(|(_, f)| f.live_bytes.is_none() && f.live_calls.is_none()));
        assert!(d.sites[0].1.is_zero());

        // --min-bytes compares the magnitude of a change.
        let d = diff(&old, &figures_without_lib(), false);
        let rows = d.select(&Selection { min_bytes: Some(400), ..Selection::default() }).unwrap();
        assert_eq!(rows.iter().map(|r| r.site.address).collect::<Vec<_>>(), [0x50]);
    }

    fn figures_without_lib() -> Figures<'static> {
        let mut f = figures();
        f.sites.truncate(4);
        f
    }
}
