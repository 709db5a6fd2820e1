//! The model of `alloctramp top`: readings of a process's figures taken
//! one after another, and the rows a live view shows of the last two:
//! grouped (site, function, file, module), filtered by text, with their
//! change per second, sorted by live bytes, growth or calls per second.
//! No I/O: the caller reads the file and draws.

use crate::model::{Fig, Figures, GroupBy};
use alloctramp_trampolines::entry::Kind;
use std::collections::HashMap;

/// How the rows are sorted, largest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sort {
    /// Live bytes (bytes requested when live tracking is off).
    LiveBytes,
    /// Change of live bytes per second.
    Growth,
    /// Calls per second.
    Calls,
}

impl Sort {
    pub const ALL: [Sort; 3] = [Sort::LiveBytes, Sort::Growth, Sort::Calls];
    pub fn as_str(self) -> &'static str {
        match self {
            Sort::LiveBytes => "live bytes",
            Sort::Growth => "growth",
            Sort::Calls => "calls/s",
        }
    }
    /// The next order (a key cycles through them).
    pub fn next(self) -> Sort {
        let i = Sort::ALL.iter().position(|&s| s == self).unwrap_or(0);
        Sort::ALL[(i + 1) % Sort::ALL.len()]
    }
}

/// The next grouping (a key cycles through them).
pub fn next_group(g: GroupBy) -> GroupBy {
    let i = GroupBy::ALL.iter().position(|&x| x == g).unwrap_or(0);
    GroupBy::ALL[(i + 1) % GroupBy::ALL.len()]
}

/// One site's names and figures at one moment, owned (the file they were
/// read from is read again at the next moment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteNow {
    pub module: String,
    /// The site's address in its module's file.
    pub address: u64,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
    /// An allocation or realloc site (free sites are not shown).
    pub allocates: bool,
    pub fig: Fig,
}

/// The figures of a process at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reading {
    /// Seconds on a monotonic clock.
    pub at: f64,
    pub live: bool,
    pub sites: Vec<SiteNow>,
}

impl Reading {
    pub fn new(at: f64, figs: &Figures) -> Reading {
        let sites = figs
            .sites
            .iter()
            .map(|(s, fig)| SiteNow {
                module: s.module.to_string(),
                address: s.address,
                function: s.function.map(str::to_string),
                file: s.file.map(str::to_string),
                line: s.line,
                allocates: s.kind != Kind::Free,
                fig: *fig,
            })
            .collect();
        Reading { at, live: figs.live(), sites }
    }

    /// Live bytes of every site (bytes requested without live tracking).
    pub fn total_size(&self) -> i128 {
        self.sites.iter().map(|s| s.fig.size()).sum()
    }
    /// Objects live (successful calls without live tracking).
    pub fn total_count(&self) -> i128 {
        self.sites.iter().map(|s| s.fig.count()).sum()
    }
    /// Calls of allocation, realloc and free sites.
    pub fn total_calls(&self) -> i128 {
        self.sites.iter().map(|s| s.fig.calls + s.fig.free_calls).sum()
    }
}

/// What the view shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub sort: Sort,
    pub group: GroupBy,
    /// Only rows whose location, function or module contains this
    /// (ignoring case; empty: every row).
    pub filter: String,
}

impl Default for Options {
    fn default() -> Options {
        Options { sort: Sort::LiveBytes, group: GroupBy::Site, filter: String::new() }
    }
}

/// One row of the view: a site or a group of sites.
#[derive(Clone, Debug, PartialEq)]
pub struct ViewRow {
    /// `file:line` (a site), the file (a file), or empty.
    pub location: String,
    pub function: String,
    pub module: String,
    /// The site (module, address) when the row is one site.
    pub site: Option<(String, u64)>,
    pub sites: u64,
    /// Live bytes and objects (bytes requested and calls without live
    /// tracking).
    pub size: i128,
    pub count: i128,
    /// Change of `size` per second since the previous reading (0 without
    /// one).
    pub growth: f64,
    /// Calls per second since the previous reading (0 after a reset).
    pub calls_per_s: f64,
}

/// The key of a site's group, and what the row of the group shows.
fn group_of(s: &SiteNow, by: GroupBy) -> (Key, String, String) {
    let function = s.function.clone().unwrap_or_else(|| "?".to_string());
    let file = s.file.clone().unwrap_or_else(|| "?".to_string());
    let location = match (&s.file, s.line) {
        (Some(f), Some(l)) => format!("{f}:{l}"),
        _ => format!("{:#x}", s.address),
    };
    match by {
        GroupBy::Site => ((s.module.clone(), format!("{:x}", s.address)), location, function),
        GroupBy::Function => ((s.module.clone(), function.clone()), String::new(), function),
        GroupBy::File => ((s.module.clone(), file.clone()), file, String::new()),
        GroupBy::Module => ((s.module.clone(), String::new()), String::new(), String::new()),
    }
}

/// A group: its module and function, file or address.
type Key = (String, String);

/// Sums per group, and the groups in order of first appearance: key ->
/// (row without rates, calls).
fn sums(r: &Reading, by: GroupBy) -> (Vec<Key>, HashMap<Key, (ViewRow, i128)>) {
    let mut order = Vec::new();
    let mut out: HashMap<Key, (ViewRow, i128)> = HashMap::new();
    for s in r.sites.iter().filter(|s| s.allocates) {
        let (key, location, function) = group_of(s, by);
        let calls = s.fig.calls;
        match out.get_mut(&key) {
            Some((row, c)) => {
                row.size += s.fig.size();
                row.count += s.fig.count();
                row.sites += 1;
                row.site = None;
                *c += calls;
            }
            None => {
                order.push(key.clone());
                let row = ViewRow {
                    location,
                    function,
                    module: s.module.clone(),
                    site: Some((s.module.clone(), s.address)),
                    sites: 1,
                    size: s.fig.size(),
                    count: s.fig.count(),
                    growth: 0.0,
                    calls_per_s: 0.0,
                };
                out.insert(key, (row, calls));
            }
        }
    }
    (order, out)
}

/// The rows of `now` per `opts`, with rates since `before` (the previous
/// reading; none: rates 0). Rows with nothing counted and no change are
/// left out; equal rows keep site order.
pub fn rows(before: Option<&Reading>, now: &Reading, opts: &Options) -> Vec<ViewRow> {
    let (order, mut cur) = sums(now, opts.group);
    let prev = before.map(|b| (now.at - b.at, sums(b, opts.group).1));
    let needle = opts.filter.to_lowercase();
    let mut out = Vec::new();
    for key in order {
        let Some((mut row, calls)) = cur.remove(&key) else { continue };
        if let Some((dt, prev)) = &prev
            && *dt > 0.0
        {
            let (size0, calls0) = prev.get(&key).map_or((0, 0), |(r, c)| (r.size, *c));
            row.growth = (row.size - size0) as f64 / dt;
            // Fewer calls than before: the counters were reset.
            row.calls_per_s = if calls >= calls0 { (calls - calls0) as f64 / dt } else { 0.0 };
        }
        if row.size == 0 && calls == 0 && row.growth == 0.0 {
            continue;
        }
        if !needle.is_empty()
            && ![&row.location, &row.function, &row.module].iter().any(|t| t.to_lowercase().contains(&needle))
        {
            continue;
        }
        out.push(row);
    }
    let key = |r: &ViewRow| match opts.sort {
        Sort::LiveBytes => r.size as f64,
        Sort::Growth => r.growth,
        Sort::Calls => r.calls_per_s,
    };
    out.sort_by(|a, b| key(b).total_cmp(&key(a)));
    out
}

/// The change per second of a total between two readings.
pub fn rate(before: Option<&Reading>, now: &Reading, total: impl Fn(&Reading) -> i128) -> f64 {
    match before {
        Some(b) if now.at > b.at => (total(now) - total(b)) as f64 / (now.at - b.at),
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{alloc, figures};

    fn reading(at: f64) -> Reading {
        Reading::new(at, &figures())
    }

    #[test]
    fn rows_are_allocating_sites_by_live_bytes_without_a_previous_reading() {
        let r = reading(0.0);
        let rows = rows(None, &r, &Options::default());
        let got: Vec<(&str, i128)> = rows.iter().map(|r| (r.location.as_str(), r.size)).collect();
        // The site freeing all it allocated (0x10, 0x40) shows: it counted
        // calls.
        assert_eq!(got, [("main.c:32", 2000), ("lib.c:80", 448), ("main.c:16", 0), ("main.c:64", 0)]);
        assert!(rows.iter().all(|r| r.growth == 0.0 && r.calls_per_s == 0.0));
        assert_eq!(rows[0].site, Some(("prog".to_string(), 0x20)));
        assert_eq!((rows[0].function.as_str(), rows[0].module.as_str(), rows[0].count), ("main", "prog", 2));
        assert_eq!(r.total_size(), 2448);
        assert_eq!(r.total_count(), 9);
    }

    #[test]
    fn growth_and_calls_are_per_second_since_the_previous_reading() {
        let before = reading(10.0);
        let mut now = reading(12.0);
        // 0x50: 4 more calls of 64 bytes, none freed; 0x20: one freed.
        now.sites[4].fig = alloc(11, 64, 0);
        now.sites[1].fig = alloc(3, 1000, 2);
        let opts = Options { sort: Sort::Growth, ..Options::default() };
        let rows = rows(Some(&before), &now, &opts);
        let got: Vec<(&str, f64, f64)> = rows.iter().map(|r| (r.location.as_str(), r.growth, r.calls_per_s)).collect();
        assert_eq!(got[0], ("lib.c:80", 128.0, 2.0));
        assert_eq!(got.last().copied(), Some(("main.c:32", -500.0, 0.0)));
        assert_eq!(rate(Some(&before), &now, Reading::total_size), (256.0 - 1000.0) / 2.0);

        let calls = super::rows(Some(&before), &now, &Options { sort: Sort::Calls, ..Options::default() });
        assert_eq!(calls[0].location, "lib.c:80");

        // A reset: fewer calls than before is no negative rate.
        let mut reset = reading(13.0);
        reset.sites[4].fig = alloc(1, 64, 0);
        let rows = super::rows(Some(&now), &reset, &Options::default());
        let lib = rows.iter().find(|r| r.location == "lib.c:80").unwrap();
        assert_eq!((lib.calls_per_s, lib.growth), (0.0, (64.0 - 704.0) / 1.0));
    }

    #[test]
    fn groups_sum_their_sites_and_the_filter_matches_any_name() {
        let r = reading(0.0);
        let by = |group: GroupBy, filter: &str| {
            let opts = Options { group, filter: filter.to_string(), ..Options::default() };
            rows(None, &r, &opts).into_iter().map(|r| (r.module, r.function, r.location, r.size, r.sites)).collect()
        };
        let f: Vec<(String, String, String, i128, u64)> = by(GroupBy::Function, "");
        assert_eq!(f[0], ("prog".into(), "main".into(), "".into(), 2000, 2));
        assert_eq!(f[1], ("lib.so".into(), "lib_new".into(), "".into(), 448, 1));
        assert_eq!(f.len(), 3, "no row of free sites alone: {f:?}");
        let m = by(GroupBy::Module, "");
        assert_eq!(m.iter().map(|r| (r.0.as_str(), r.3)).collect::<Vec<_>>(), [("prog", 2000), ("lib.so", 448)]);
        let files = by(GroupBy::File, "");
        assert_eq!(files.iter().map(|r| r.2.as_str()).collect::<Vec<_>>(), ["main.c", "lib.c"]);
        assert!(rows(None, &r, &Options { group: GroupBy::Function, ..Options::default() })[0].site.is_none());

        assert_eq!(by(GroupBy::Site, "LIB").len(), 1, "module and function names match, ignoring case");
        assert_eq!(by(GroupBy::Site, "main.c:3").len(), 1, "file:line matches");
        assert_eq!(by(GroupBy::Site, "work").len(), 1);
        assert!(by(GroupBy::Site, "nothing").is_empty());
    }

    #[test]
    fn keys_cycle_through_orders_and_groupings() {
        assert_eq!(Sort::LiveBytes.next(), Sort::Growth);
        assert_eq!(Sort::Calls.next(), Sort::LiveBytes);
        assert_eq!(next_group(GroupBy::Site), GroupBy::Function);
        assert_eq!(next_group(GroupBy::Module), GroupBy::Site);
    }
}
