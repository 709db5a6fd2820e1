//! Live bytes over time, for the charts of `alloctramp serve`'s pages:
//! the server takes a sample of each running process's figures at an
//! interval ([`History::record`]) and keeps the last ones; a page asks
//! for a process's series ([`History::series`]): its total live bytes and
//! those of its largest sites. No I/O: the server reads the files and
//! keeps the clock.

use crate::model::Figures;
use alloctramp_trampolines::entry::Kind;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Sites kept per sample: the largest by live bytes (a process's other
/// sites are not charted).
pub const SITES_PER_SAMPLE: usize = 64;

/// Samples of the processes seen, the last `cap` of each.
#[derive(Debug)]
pub struct History {
    cap: usize,
    processes: BTreeMap<u32, Track>,
}

#[derive(Debug)]
struct Track {
    /// The process's start time: a pid used again starts a new track.
    start_time: u64,
    command: String,
    live: bool,
    /// Site labels, and their numbers.
    names: Vec<SiteName>,
    index: HashMap<(String, u64), u32>,
    samples: VecDeque<Sample>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SiteName {
    /// `file:line`, or the address in the module without line information.
    pub location: String,
    pub function: String,
    pub module: String,
}

#[derive(Debug)]
struct Sample {
    time: f64,
    total: i128,
    sites: Vec<(u32, i128)>,
}

/// One site's live bytes at every sample.
#[derive(Debug, Serialize, PartialEq)]
pub struct SiteSeries {
    #[serde(flatten)]
    pub name: SiteName,
    pub values: Vec<i64>,
}

/// A process's samples: times (seconds since the epoch), total live
/// bytes, and the largest sites' live bytes (by the last sample).
#[derive(Debug, Serialize, PartialEq)]
pub struct Series {
    pub pid: u32,
    pub command: String,
    /// Live tracking is on: the figures are live bytes (else bytes
    /// requested since profiling was switched on).
    pub live: bool,
    pub times: Vec<f64>,
    pub total: Vec<i64>,
    pub sites: Vec<SiteSeries>,
}

fn clamp(v: i128) -> i64 {
    v.clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

impl History {
    /// Keeping the last `cap` samples of each process.
    pub fn new(cap: usize) -> History {
        History { cap: cap.max(1), processes: BTreeMap::new() }
    }

    /// A sample of a process's figures taken at `time` (seconds since the
    /// epoch).
    pub fn record(&mut self, time: f64, figs: &Figures) {
        let p = &figs.process;
        let fresh = || Track {
            start_time: p.start_time,
            command: p.command.clone(),
            live: p.live,
            names: Vec::new(),
            index: HashMap::new(),
            samples: VecDeque::new(),
        };
        let track = self.processes.entry(p.pid).or_insert_with(fresh);
        // A pid reused by another process starts a new track.
        if track.start_time != p.start_time {
            *track = fresh();
        }
        track.live = p.live;
        let mut sites: Vec<(&crate::SiteInfo, i128)> =
            figs.sites.iter().filter(|(s, _)| s.kind != Kind::Free).map(|(s, f)| (s, f.size())).collect();
        let total = sites.iter().map(|s| s.1).sum();
        sites.retain(|s| s.1 != 0);
        // Stable: equal sites keep file order.
        sites.sort_by_key(|s| std::cmp::Reverse(s.1));
        sites.truncate(SITES_PER_SAMPLE);
        let sites = sites
            .into_iter()
            .map(|(s, v)| {
                let key = (s.module.to_string(), s.address);
                let n = match track.index.get(&key) {
                    Some(&n) => n,
                    None => {
                        let n = track.names.len() as u32;
                        track.names.push(SiteName {
                            location: s.location(),
                            function: s.function.unwrap_or("?").to_string(),
                            module: s.module.to_string(),
                        });
                        track.index.insert(key, n);
                        n
                    }
                };
                (n, v)
            })
            .collect();
        track.samples.push_back(Sample { time, total, sites });
        while track.samples.len() > self.cap {
            track.samples.pop_front();
        }
    }

    /// Forgets the processes not in `running`.
    pub fn retain(&mut self, running: &[u32]) {
        self.processes.retain(|pid, _| running.contains(pid));
    }

    /// The samples of process `pid`, with the `top` largest sites of the
    /// last sample.
    pub fn series(&self, pid: u32, top: usize) -> Option<Series> {
        let t = self.processes.get(&pid)?;
        let last: Vec<u32> = t.samples.back().map_or(Vec::new(), |s| s.sites.iter().take(top).map(|x| x.0).collect());
        let sites = last
            .iter()
            .map(|&n| SiteSeries {
                name: t.names[n as usize].clone(),
                values: t.samples.iter().map(|s| s.sites.iter().find(|x| x.0 == n).map_or(0, |x| clamp(x.1))).collect(),
            })
            .collect();
        Some(Series {
            pid,
            command: t.command.clone(),
            live: t.live,
            times: t.samples.iter().map(|s| s.time).collect(),
            total: t.samples.iter().map(|s| clamp(s.total)).collect(),
            sites,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tests::{alloc, figures};

    #[test]
    fn series_give_totals_and_the_largest_sites_of_the_last_sample() {
        let mut h = History::new(3);
        let mut f = figures();
        h.record(100.0, &f);
        // The library's site grows past main's.
        f.sites[4].1 = alloc(50, 64, 0);
        h.record(101.0, &f);
        let s = h.series(42, 1).unwrap();
        assert_eq!(s.times, [100.0, 101.0]);
        assert_eq!(s.total, [2448, 2000 + 3200]);
        assert_eq!(s.sites.len(), 1);
        assert_eq!(s.sites[0].name.location, "lib.c:80");
        assert_eq!((s.sites[0].name.function.as_str(), s.sites[0].name.module.as_str()), ("lib_new", "lib.so"));
        assert_eq!(s.sites[0].values, [448, 3200]);
        let two = h.series(42, 5).unwrap();
        assert_eq!(two.sites.iter().map(|x| x.name.location.as_str()).collect::<Vec<_>>(), ["lib.c:80", "main.c:32"]);
        assert_eq!(two.sites[1].values, [2000, 2000]);
        assert!(h.series(7, 5).is_none());

        // The last `cap` samples.
        h.record(102.0, &f);
        h.record(103.0, &f);
        assert_eq!(h.series(42, 1).unwrap().times, [101.0, 102.0, 103.0]);

        // A pid used again by another process starts afresh; a process
        // not running is forgotten.
        f.process.start_time = 5;
        h.record(104.0, &f);
        assert_eq!(h.series(42, 1).unwrap().times, [104.0]);
        h.retain(&[1]);
        assert!(h.series(42, 1).is_none());
    }
}
