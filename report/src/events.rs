//! Event traces (`alloctramp trace`, `run --trace`): their CTF streams
//! read back ([`read_stream`], as alloctramp writes them: the layout in
//! `alloctramp_trampolines::trace::ctf`) and analysed per site
//! ([`analyze`]): lifetimes, what is still live at the trace's end,
//! temporary allocations, the peak of live bytes and who held it, and a
//! timeline of live bytes ([`timeline_svg`]).

use alloctramp_trampolines::trace::SiteInfo;
use alloctramp_trampolines::trace::ctf::{MAGIC, PACKET_HEAD, event};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// What an event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum What {
    Alloc { ptr: u64, size: u64 },
    Free { ptr: u64, alloc_site: u32 },
    Realloc { ptr: u64, old: u64, size: u64, old_size: u64, alloc_site: u32 },
}

/// One event of a thread's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Clock ticks (see [`Trace::freq`]).
    pub ts: u64,
    pub tid: u32,
    pub site: u32,
    pub what: What,
}

/// Why a stream does not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bad {
    pub offset: usize,
    pub what: String,
}

impl fmt::Display for Bad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "offset {:#x}: {}", self.offset, self.what)
    }
}

/// What one stream file holds.
#[derive(Debug, Default)]
pub struct Stream {
    pub events: Vec<Event>,
    pub sites: Vec<SiteInfo>,
    /// Events the process dropped (the last packet's count).
    pub discarded: u64,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
    end: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Bad> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.end);
        let Some(end) = end else {
            let left = self.end.saturating_sub(self.at);
            return Err(Bad { offset: self.at, what: format!("cut short: {n} bytes wanted, {left} left") });
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, Bad> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Bad> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap_or_default()))
    }
    fn u32(&mut self) -> Result<u32, Bad> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64, Bad> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn string(&mut self) -> Result<String, Bad> {
        let rest = &self.b[self.at..self.end];
        let Some(n) = rest.iter().position(|&c| c == 0) else {
            return Err(Bad { offset: self.at, what: "a string without its NUL".into() });
        };
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.at += n + 1;
        Ok(s)
    }
}

/// Reads a stream file of an alloctramp trace whose UUID is `uuid` (None:
/// any).
pub fn read_stream(b: &[u8], uuid: Option<[u8; 16]>) -> Result<Stream, Bad> {
    let mut out = Stream::default();
    let mut at = 0;
    while at < b.len() {
        let mut c = Cursor { b, at, end: b.len() };
        let head = c.take(PACKET_HEAD)?;
        let word = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().unwrap_or_default());
        if u32::from_le_bytes(head[..4].try_into().unwrap_or_default()) != MAGIC {
            return Err(Bad { offset: at, what: "no CTF magic at a packet's start".into() });
        }
        if uuid.is_some_and(|u| head[4..20] != u) {
            return Err(Bad { offset: at + 4, what: "a packet of another trace (its UUID differs)".into() });
        }
        let class = u32::from_le_bytes(head[20..24].try_into().unwrap_or_default());
        let (mut clock, content, size) = (word(24), word(40), word(48));
        out.discarded = word(56);
        let tid = u32::from_le_bytes(head[64..68].try_into().unwrap_or_default());
        if content % 8 != 0 || size % 8 != 0 || content > size || (content / 8) < PACKET_HEAD as u64 {
            return Err(Bad { offset: at + 40, what: format!("packet sizes {content} and {size} bits") });
        }
        let end = at.checked_add((size / 8) as usize).filter(|&e| e <= b.len());
        let Some(end) = end else {
            return Err(Bad { offset: at + 48, what: "a packet past the file's end".into() });
        };
        c.end = at + (content / 8) as usize;
        while c.at < c.end {
            let first = c.u8()?;
            let id5 = first & 31;
            let (id, ts) = if id5 == 31 {
                (c.u32()?, c.u64()?)
            } else {
                c.at -= 1;
                let v = c.u32()?;
                let low = u64::from(v >> 5);
                let mask = (1u64 << 27) - 1;
                let mut ts = clock & !mask | low;
                if low < clock & mask {
                    ts = ts.wrapping_add(1 << 27);
                }
                (u32::from(id5), ts)
            };
            clock = ts;
            let ev_at = c.at;
            match (class, id) {
                (0, event::ALLOC) | (0, event::ALLOC_LARGE) => {
                    let site = c.u32()?;
                    let ptr = c.u64()?;
                    let size = if id == event::ALLOC { u64::from(c.u32()?) } else { c.u64()? };
                    c.u16()?;
                    out.events.push(Event { ts, tid, site, what: What::Alloc { ptr, size } });
                }
                (0, event::FREE) => {
                    let site = c.u32()?;
                    let alloc_site = c.u32()?;
                    let ptr = c.u64()?;
                    c.u16()?;
                    out.events.push(Event { ts, tid, site, what: What::Free { ptr, alloc_site } });
                }
                (0, event::REALLOC) => {
                    let site = c.u32()?;
                    let alloc_site = c.u32()?;
                    let (ptr, old, size, old_size) = (c.u64()?, c.u64()?, c.u64()?, c.u64()?);
                    c.u16()?;
                    out.events.push(Event {
                        ts,
                        tid,
                        site,
                        what: What::Realloc { ptr, old, size, old_size, alloc_site },
                    });
                }
                (1, event::SITE) => {
                    let id = c.u32()?;
                    let address = c.u64()?;
                    let function = c.string()?;
                    let file = c.string()?;
                    let line = c.u32()?;
                    let module = c.string()?;
                    out.sites.push(SiteInfo { id, address, function, file, line, module });
                }
                _ => return Err(Bad { offset: ev_at, what: format!("event id {id} in stream class {class}") }),
            }
        }
        at = end;
    }
    Ok(out)
}

/// The metadata's trace UUID and clock frequency and offset (ns of the
/// epoch at clock value 0), as alloctramp writes them.
pub fn read_metadata(text: &str) -> Result<([u8; 16], u64, i128), String> {
    if !text.contains("trace_format = \"alloctramp-trace\"") {
        return Err("not an alloctramp trace's metadata (no trace_format = \"alloctramp-trace\")".into());
    }
    let value = |key: &str| -> Option<&str> {
        text.lines().map(str::trim).find_map(|l| l.strip_prefix(key)).map(|v| v.trim_end_matches(';').trim())
    };
    let num = |key: &str| value(key).and_then(|v| v.parse::<i128>().ok()).ok_or(format!("no {key}in the metadata"));
    let uuid_text = value("uuid = ").ok_or("no uuid in the metadata")?.trim_matches('"').replace('-', "");
    let mut uuid = [0u8; 16];
    if uuid_text.len() != 32 {
        return Err(format!("bad uuid {uuid_text:?} in the metadata"));
    }
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    for (b, pair) in uuid.iter_mut().zip(uuid_text.as_bytes().chunks(2)) {
        *b = match pair {
            [h, l] => hex(*h).zip(hex(*l)).map(|(h, l)| h << 4 | l).ok_or("bad uuid in the metadata")?,
            _ => return Err("bad uuid in the metadata".into()),
        };
    }
    let freq = num("freq = ")?;
    if freq <= 0 {
        return Err("a clock frequency of 0 in the metadata".into());
    }
    let offset_ns = num("offset_s = ")?
        .checked_mul(1_000_000_000)
        .zip(num("offset = ")?.checked_mul(1_000_000_000))
        .and_then(|(s, c)| s.checked_add(c / freq))
        .ok_or("a clock offset out of range in the metadata")?;
    Ok((uuid, freq as u64, offset_ns))
}

/// A whole trace: its events in time order and its sites.
pub struct Trace {
    pub events: Vec<Event>,
    pub sites: HashMap<u32, SiteInfo>,
    /// Clock ticks per second.
    pub freq: u64,
    pub discarded: u64,
}

impl Trace {
    pub fn new(streams: Vec<Stream>, freq: u64) -> Trace {
        let mut events = Vec::new();
        let mut sites = HashMap::new();
        let mut discarded = 0;
        for s in streams {
            events.extend(s.events);
            sites.extend(s.sites.into_iter().map(|i| (i.id, i)));
            discarded += s.discarded;
        }
        // Stable: a thread's own events keep their order at equal times.
        events.sort_by_key(|e| e.ts);
        Trace { events, sites, freq: freq.max(1), discarded }
    }

    pub fn ns(&self, ticks: u64) -> u64 {
        (u128::from(ticks) * 1_000_000_000 / u128::from(self.freq)) as u64
    }
}

/// What [`analyze`] finds for one allocating site.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SiteStats {
    pub site: u32,
    pub allocations: u64,
    pub bytes: u64,
    /// Objects freed within the trace, and their lifetimes in ns:
    /// median, 90th percentile, maximum.
    pub freed: u64,
    pub lifetime: Option<(u64, u64, u64)>,
    /// Objects allocated in the trace and not freed by its end.
    pub live: u64,
    pub live_bytes: u64,
    /// Allocations freed before the same thread allocated anything else.
    pub temporary: u64,
    /// Its live bytes at the trace's peak.
    pub at_peak: u64,
}

/// What [`analyze`] finds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Analysis {
    pub events: u64,
    pub discarded: u64,
    /// ns from the first event to the last.
    pub duration: u64,
    /// The peak of the live bytes of objects allocated in the trace, and
    /// when (ns after the first event).
    pub peak: u64,
    pub peak_at: u64,
    pub sites: Vec<SiteStats>,
}

/// The nearest-rank percentile `p` of sorted values.
fn percentile(sorted: &[u64], p: u64) -> u64 {
    let rank = (sorted.len() as u64 * p).div_ceil(100).max(1) as usize;
    sorted.get(rank - 1).or(sorted.last()).copied().unwrap_or(0)
}

/// The objects of a trace replayed in time order.
#[derive(Default)]
struct Replay {
    stats: BTreeMap<u32, SiteStats>,
    lifetimes: BTreeMap<u32, Vec<u64>>,
    /// Live objects: pointer -> (site, size, time, thread, the thread's
    /// allocation count then).
    live: HashMap<u64, (u32, u64, u64, u32, u64)>,
    /// Allocations per thread so far.
    per_thread: HashMap<u32, u64>,
    total: u64,
}

impl Replay {
    fn free(&mut self, t: &Trace, ptr: u64, tid: u32, at: u64) {
        if let Some((site, size, when, thread, nth)) = self.live.remove(&ptr) {
            self.total = self.total.saturating_sub(size);
            self.lifetimes.entry(site).or_default().push(t.ns(at.saturating_sub(when)));
            let s = self.stats.entry(site).or_default();
            s.freed += 1;
            if thread == tid && self.per_thread.get(&tid) == Some(&nth) {
                s.temporary += 1;
            }
        }
    }
}

/// Lifetimes, leaks within the trace, temporary allocations and the peak
/// of live bytes, per allocating site (a realloc allocates at its site
/// what it frees from the old object's). Objects allocated before the
/// trace began are not counted live, and their frees move nothing.
pub fn analyze(t: &Trace) -> Analysis {
    let mut st = Replay::default();
    let (mut peak, mut peak_index) = (0u64, None);
    let first = t.events.first().map_or(0, |e| e.ts);
    for (i, e) in t.events.iter().enumerate() {
        match e.what {
            What::Alloc { ptr, size } | What::Realloc { ptr, size, .. } => {
                // The old object of a realloc, unless its address is another
                // site's object by now (events of two threads a realloc's
                // record straddles).
                if let What::Realloc { old, alloc_site, .. } = e.what
                    && old != 0
                    && st.live.get(&old).is_none_or(|l| l.0 == alloc_site || alloc_site == 0)
                {
                    st.free(t, old, e.tid, e.ts);
                }
                if ptr == 0 {
                    continue;
                }
                let n = st.per_thread.entry(e.tid).or_default();
                *n += 1;
                let nth = *n;
                let s = st.stats.entry(e.site).or_default();
                s.allocations += 1;
                s.bytes = s.bytes.saturating_add(size);
                // An address still live was freed unseen: it is gone.
                if let Some(prev) = st.live.insert(ptr, (e.site, size, e.ts, e.tid, nth)) {
                    st.total = st.total.saturating_sub(prev.1);
                }
                st.total = st.total.saturating_add(size);
                if st.total > peak {
                    (peak, peak_index) = (st.total, Some(i));
                }
            }
            What::Free { ptr, .. } => st.free(t, ptr, e.tid, e.ts),
        }
    }
    let Replay { mut stats, mut lifetimes, live, .. } = st;
    for (_, (site, size, ..)) in live {
        let s = stats.entry(site).or_default();
        s.live += 1;
        s.live_bytes = s.live_bytes.saturating_add(size);
    }
    // Who held the peak: the live bytes per site replayed up to it.
    if let Some(p) = peak_index {
        let mut held: HashMap<u64, (u32, u64)> = HashMap::new();
        for e in &t.events[..=p] {
            match e.what {
                What::Alloc { ptr, size } | What::Realloc { ptr, size, .. } => {
                    if let What::Realloc { old, .. } = e.what {
                        held.remove(&old);
                    }
                    if ptr != 0 {
                        held.insert(ptr, (e.site, size));
                    }
                }
                What::Free { ptr, .. } => {
                    held.remove(&ptr);
                }
            }
        }
        for (site, size) in held.into_values() {
            let s = stats.entry(site).or_default();
            s.at_peak = s.at_peak.saturating_add(size);
        }
    }
    let sites = stats
        .into_iter()
        .map(|(site, mut s)| {
            s.site = site;
            if let Some(l) = lifetimes.get_mut(&site) {
                l.sort_unstable();
                s.lifetime = Some((percentile(l, 50), percentile(l, 90), *l.last().unwrap_or(&0)));
            }
            s
        })
        .collect();
    Analysis {
        events: t.events.len() as u64,
        discarded: t.discarded,
        duration: t.ns(t.events.last().map_or(0, |e| e.ts).saturating_sub(first)),
        peak,
        peak_at: peak_index.map_or(0, |i| t.ns(t.events[i].ts - first)),
        sites,
    }
}

/// An SVG chart of live bytes over the trace: the total and the `top`
/// sites that held the most at the peak, `points` samples each.
pub fn timeline_svg(t: &Trace, a: &Analysis, top: usize, name: &dyn Fn(u32) -> String) -> String {
    const W: f64 = 960.0;
    const H: f64 = 420.0;
    const LEFT: f64 = 90.0;
    const BOTTOM: f64 = 40.0;
    const POINTS: usize = 400;
    let mut chosen: Vec<&SiteStats> = a.sites.iter().filter(|s| s.at_peak > 0 || s.live_bytes > 0).collect();
    chosen.sort_by_key(|s| std::cmp::Reverse(s.at_peak.max(s.live_bytes)));
    chosen.truncate(top);
    let ids: Vec<u32> = chosen.iter().map(|s| s.site).collect();
    let (t0, t1) = (t.events.first().map_or(0, |e| e.ts), t.events.last().map_or(0, |e| e.ts));
    let span = (t1 - t0).max(1);
    // Samples of (total, per chosen site) at POINTS times.
    let mut samples = vec![(0u64, vec![0u64; ids.len()]); POINTS + 1];
    let mut held: HashMap<u64, (u32, u64)> = HashMap::new();
    let (mut total, mut per) = (0u64, vec![0u64; ids.len()]);
    let mut k = 0;
    let slot = |site: u32| ids.iter().position(|&s| s == site);
    for e in &t.events {
        let at = ((e.ts - t0) as u128 * POINTS as u128 / span as u128) as usize;
        while k < at.min(POINTS) {
            samples[k] = (total, per.clone());
            k += 1;
        }
        let mut drop = |ptr: u64, total: &mut u64, per: &mut Vec<u64>| {
            if let Some((site, size)) = held.remove(&ptr) {
                *total = total.saturating_sub(size);
                if let Some(j) = slot(site) {
                    per[j] = per[j].saturating_sub(size);
                }
            }
        };
        match e.what {
            What::Alloc { ptr, size } | What::Realloc { ptr, size, .. } => {
                if let What::Realloc { old, .. } = e.what {
                    drop(old, &mut total, &mut per);
                }
                if ptr != 0 {
                    drop(ptr, &mut total, &mut per);
                    held.insert(ptr, (e.site, size));
                    total = total.saturating_add(size);
                    if let Some(j) = slot(e.site) {
                        per[j] = per[j].saturating_add(size);
                    }
                }
            }
            What::Free { ptr, .. } => drop(ptr, &mut total, &mut per),
        }
    }
    while k <= POINTS {
        samples[k] = (total, per.clone());
        k += 1;
    }
    let max = samples.iter().map(|s| s.0).max().unwrap_or(0).max(1) as f64;
    let x = |i: usize| LEFT + (W - LEFT - 20.0) * i as f64 / POINTS as f64;
    let y = |v: u64| (H - BOTTOM) - (H - BOTTOM - 20.0) * v as f64 / max;
    let colors = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{}\" font-family=\"sans-serif\" \
         font-size=\"12\">\n<title>live bytes over the trace</title>\n<rect width=\"100%\" height=\"100%\" \
         fill=\"white\"/>\n",
        H + 20.0 * (ids.len() as f64 + 2.0)
    );
    svg += &format!(
        "<line x1=\"{LEFT}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"black\"/>\n<line x1=\"{LEFT}\" y1=\"20\" \
         x2=\"{LEFT}\" y2=\"{0}\" stroke=\"black\"/>\n",
        H - BOTTOM,
        W - 20.0
    );
    svg += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n<text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>\n",
        LEFT - 6.0,
        y(max as u64) + 4.0,
        max as u64,
        LEFT - 6.0,
        H - BOTTOM + 4.0
    );
    svg += &format!(
        "<text x=\"{}\" y=\"{}\">0 s</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.3} s</text>\n",
        LEFT,
        H - BOTTOM + 16.0,
        W - 20.0,
        H - BOTTOM + 16.0,
        t.ns(span) as f64 / 1e9
    );
    let line = |values: &dyn Fn(usize) -> u64, color: &str, width: f64| {
        let pts: Vec<String> = (0..=POINTS).map(|i| format!("{:.1},{:.1}", x(i), y(values(i)))).collect();
        format!("<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\" points=\"{}\"/>\n", pts.join(" "))
    };
    svg += &line(&|i| samples[i].0, "black", 2.0);
    for j in 0..ids.len() {
        svg += &line(&|i| samples[i].1[j], colors[j % colors.len()], 1.5);
    }
    let legend_y = H + 4.0;
    svg += &format!("<text x=\"{LEFT}\" y=\"{legend_y}\">black: all live bytes (peak {})</text>\n", a.peak);
    for (j, s) in chosen.iter().enumerate() {
        svg += &format!(
            "<text x=\"{LEFT}\" y=\"{}\" fill=\"{}\">{} (at the peak {} bytes; live at the end {})</text>\n",
            legend_y + 20.0 * (j as f64 + 1.0),
            colors[j % colors.len()],
            esc(&name(s.site)),
            s.at_peak,
            s.live_bytes
        );
    }
    svg += "</svg>\n";
    svg
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloctramp_trampolines::trace::{Record, ctf, kind};

    fn rec(tsc: u64, k: u64, site: u32, alloc_site: u32, ptr: u64, size: u64) -> Record {
        Record { tsc, ptr, size, word: Record::pack(k, 0, site, alloc_site) }
    }

    #[test]
    fn streams_read_back_and_analyse() {
        let uuid = [7; 16];
        let mut s = ctf::Stream::new(uuid, 0, 42, 100);
        // Site 70: two objects; the first freed at once (temporary), the
        // second 2^28 ticks later (an extended header); site 71's stays.
        s.record(&rec(110, kind::ALLOC, 70, 0, 0x1000, 48));
        s.record(&rec(120, kind::FREE, 80, 70, 0x1000, 48));
        s.record(&rec(130, kind::ALLOC, 70, 0, 0x2000, 48));
        s.record(&rec(140, kind::ALLOC, 71, 0, 0x3000, 1 << 33));
        s.record(&rec(130 + (1 << 28), kind::FREE, 80, 70, 0x2000, 48));
        let mut bytes = s.first_packet();
        bytes.extend(s.finish_packet(0, 0));
        let read = read_stream(&bytes, Some(uuid)).unwrap();
        assert_eq!(read.events.len(), 5);
        assert_eq!(read.events[4].ts, 130 + (1 << 28));
        assert_eq!(read.events[3].what, What::Alloc { ptr: 0x3000, size: 1 << 33 });
        assert!(read_stream(&bytes, Some([8; 16])).is_err());
        let t = Trace::new(vec![read], 1_000_000_000);
        let a = analyze(&t);
        let s70 = a.sites.iter().find(|s| s.site == 70).unwrap();
        assert_eq!((s70.allocations, s70.freed, s70.temporary, s70.live), (2, 2, 1, 0));
        assert_eq!(s70.lifetime, Some((10, 1 << 28, 1 << 28)));
        let s71 = a.sites.iter().find(|s| s.site == 71).unwrap();
        assert_eq!((s71.live, s71.live_bytes, s71.at_peak), (1, 1 << 33, 1 << 33));
        assert_eq!(a.peak, 48 + (1 << 33));
        // A truncated file names where.
        let e = read_stream(&bytes[..bytes.len() - 3], None).unwrap_err();
        assert!(e.what.contains("past the file's end"), "{e}");
    }
}
