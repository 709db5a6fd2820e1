//! Event traces: the trace file a traced process records its events in
//! (`PID.trace`: one ring of fixed records per thread, in shared memory),
//! and the CTF 1.8 trace a drainer writes from it ([`ctf`]).
//!
//! Layout: the header (4096 bytes), the rings' headers ([`RINGS`] of 64
//! bytes), then each ring's [`RING_RECORDS`] records.
//!
//! A ring has one writer, its thread, and one reader, the drainer: the
//! writer fills the record at `head` and publishes it by advancing `head`
//! (release); the reader copies records up to `head` (acquire) and gives
//! them back by advancing `tail` (release). A writer that finds its ring
//! full drops the event and counts it in the ring's `lost`.

use crate::pod::Pod;
use std::sync::atomic::{AtomicU32, AtomicU64};

pub const MAGIC: [u8; 8] = *b"ATRACE\0\x01";
pub const VERSION: u32 = 2;
/// Threads with a ring at once; a thread that finds none counts its events
/// in [`TraceHeader::lost_no_ring`]. Only the rings claimed have storage:
/// the file is as large as all of them (512 MiB), but sparse.
pub const RINGS: usize = 1024;
/// Records per ring (a power of two): 512 KiB of records, which the
/// drainer, reading every millisecond while rings have news, empties long
/// before a thread fills them.
pub const RING_RECORDS: usize = 16384;
pub const HEADER_SIZE: u64 = 4096;
pub const RING_HEADER_SIZE: u64 = 64;
/// The ring headers follow the header; the rings' records follow them.
pub const RECORDS_OFFSET: u64 = HEADER_SIZE + RINGS as u64 * RING_HEADER_SIZE;
pub const RING_BYTES: u64 = (RING_RECORDS * std::mem::size_of::<Record>()) as u64;
/// The trace file's size. Only the header and the ring headers have their
/// storage from the start; a ring's records get theirs when a thread
/// claims the ring (a write to a page without storage could raise
/// SIGBUS).
pub const FILE_SIZE: u64 = RECORDS_OFFSET + RINGS as u64 * RING_BYTES;

/// The trace file's header (4096 bytes).
#[repr(C)]
pub struct TraceHeader {
    pub magic: [u8; 8],
    pub version: AtomicU32,
    pub rings: AtomicU32,
    pub ring_records: AtomicU32,
    pub record_size: AtomicU32,
    /// 1 while a trace is recorded.
    pub on: AtomicU32,
    pub pid: AtomicU32,
    /// Raised at each start and stop of a trace.
    pub generation: AtomicU64,
    /// At the trace's start: the time stamp counter, CLOCK_MONOTONIC and
    /// CLOCK_REALTIME (ns). Events older than `start_tsc` are from an
    /// earlier trace and are dropped.
    pub start_tsc: AtomicU64,
    pub start_monotonic: AtomicU64,
    pub start_realtime: AtomicU64,
    /// Events of threads that found no free ring.
    pub lost_no_ring: AtomicU64,
    /// The process draining the rings (0: none): one drainer at a time,
    /// taken with a compare-and-swap.
    pub drainer: AtomicU32,
    /// One more than the highest ring ever claimed: the drainer reads the
    /// rings below it (threads take the lowest free ring).
    pub rings_used: AtomicU32,
    pub reserved: [u8; 4016],
}

/// The runtime's per-thread trace words, by byte offset from the first
/// (the control block's `trace_tls` gives its offset from the thread
/// pointer), as the traced entries read them.
pub mod words {
    /// The thread's ring header's address (0: none claimed yet; 1: none
    /// free).
    pub const RING: i32 = 0;
    /// The thread's window in its ring: the next record's address and the
    /// end of the records it may write before it looks at the ring's tail
    /// again (both 0: none open).
    pub const CUR: i32 = 8;
    pub const END: i32 = 16;
    /// Bit 0 set while the thread records an event: an event of a signal
    /// handler that interrupts it is counted lost.
    pub const BUSY: i32 = 24;
}

/// A ring's header (64 bytes), followed by its records.
#[repr(C)]
pub struct RingHeader {
    /// The thread writing it (0: free).
    pub owner: AtomicU32,
    /// 1 once its thread exited: the drainer frees it once it is empty.
    pub exited: AtomicU32,
    /// Records written, and records read (both only grow).
    pub head: AtomicU64,
    pub tail: AtomicU64,
    /// Events dropped because the ring was full.
    pub lost: AtomicU64,
    pub reserved: [u8; 32],
}

/// One event as the runtime records it (32 bytes). A realloc takes two
/// records: [`kind::REALLOC_OLD`] (the old pointer, the site that
/// allocated it and its size) then [`kind::REALLOC`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The time stamp counter (`rdtscp`).
    pub tsc: u64,
    pub ptr: u64,
    pub size: u64,
    /// Bits 0-2 the kind, 3-14 the CPU, 15-31 the site, 32-48 the site
    /// that allocated the object freed (0: not known).
    pub word: u64,
}

pub mod kind {
    pub const ALLOC: u64 = 0;
    pub const FREE: u64 = 1;
    pub const REALLOC_OLD: u64 = 2;
    pub const REALLOC: u64 = 3;
}

/// Where [`Record::word`]'s fields start.
pub const CPU_SHIFT: u32 = 3;
pub const SITE_SHIFT: u32 = 15;
pub const ALLOC_SITE_SHIFT: u32 = 32;

impl Record {
    pub fn pack(kind: u64, cpu: u64, site: u32, alloc_site: u32) -> u64 {
        kind & 7
            | (cpu & 0xfff) << CPU_SHIFT
            | u64::from(site & 0x1ffff) << SITE_SHIFT
            | u64::from(alloc_site & 0x1ffff) << ALLOC_SITE_SHIFT
    }
    pub fn kind(&self) -> u64 {
        self.word & 7
    }
    pub fn cpu(&self) -> u16 {
        (self.word >> 3 & 0xfff) as u16
    }
    pub fn site(&self) -> u32 {
        (self.word >> 15 & 0x1ffff) as u32
    }
    pub fn alloc_site(&self) -> u32 {
        (self.word >> 32 & 0x1ffff) as u32
    }
}

// SAFETY: repr(C) structures of integers and atomics, every bit pattern
// valid, no padding (checked below).
unsafe impl Pod for TraceHeader {}
// SAFETY: as above.
unsafe impl Pod for RingHeader {}
// SAFETY: as above.
unsafe impl Pod for Record {}

const _: () = assert!(std::mem::size_of::<TraceHeader>() == HEADER_SIZE as usize);
const _: () = assert!(std::mem::size_of::<RingHeader>() == RING_HEADER_SIZE as usize);
const _: () = assert!(std::mem::size_of::<Record>() == 32);
const _: () = assert!(RING_RECORDS.is_power_of_two());

/// Offset of ring `i`'s header in the trace file.
pub const fn ring_offset(i: usize) -> u64 {
    HEADER_SIZE + i as u64 * RING_HEADER_SIZE
}

/// Offset of ring `i`'s records in the trace file.
pub const fn records_offset(i: usize) -> u64 {
    RECORDS_OFFSET + i as u64 * RING_BYTES
}

/// The trace file's name beside the process's counters file.
pub fn file_name(pid: u32) -> String {
    format!("{pid}.trace")
}

/// The file `alloctramp trace --site` writes beside the process's counters
/// file before it asks for a trace: the ids of the sites to record
/// (decimal, separated by white space; missing: every site).
pub fn sites_file_name(pid: u32) -> String {
    format!("{pid}.tracesites")
}

/// Reads a sites file's text in pieces: its site ids, each passed to
/// `set`. Allocates nothing.
#[derive(Default)]
pub struct SitesParser {
    n: Option<u32>,
    bad: bool,
}

impl SitesParser {
    /// The next piece of the text.
    pub fn feed(&mut self, text: &[u8], set: &mut impl FnMut(u32)) {
        for &c in text {
            match c {
                _ if self.bad => return,
                b'0'..=b'9' => {
                    let v = self.n.unwrap_or(0).saturating_mul(10).saturating_add(u32::from(c - b'0'));
                    self.bad = v >= 1 << 17;
                    self.n = Some(v);
                }
                b' ' | b'\n' | b'\t' | b'\r' => {
                    if let Some(v) = self.n.take() {
                        set(v);
                    }
                }
                _ => self.bad = true,
            }
        }
    }

    /// The end of the text: false if it held anything but ids below 2^17.
    pub fn finish(mut self, set: &mut impl FnMut(u32)) -> bool {
        self.feed(b" ", set);
        !self.bad
    }
}

/// What a trace says about one site (the `site` event).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SiteInfo {
    pub id: u32,
    pub address: u64,
    pub function: String,
    pub file: String,
    pub line: u32,
    pub module: String,
}

/// A view of a trace file's mapping: its header, ring headers and records.
pub struct Rings {
    base: usize,
}

impl Rings {
    /// # Safety
    /// `base` must be a mapping of [`FILE_SIZE`] bytes of a trace file
    /// (shared with its writer), live as long as the view.
    pub unsafe fn new(base: *const u8) -> Rings {
        Rings { base: base as usize }
    }

    pub fn header(&self) -> &TraceHeader {
        // SAFETY: the file's first 4096 bytes (caller of `new`).
        unsafe { &*(self.base as *const TraceHeader) }
    }

    pub fn ring(&self, i: usize) -> &RingHeader {
        // SAFETY: ring i % RINGS's header lies within the mapping.
        unsafe { &*((self.base + ring_offset(i % RINGS) as usize) as *const RingHeader) }
    }

    /// Record `n` of ring `i` (read below the ring's published head).
    pub fn record(&self, i: usize, n: u64) -> Record {
        let at = records_offset(i % RINGS) as usize + (n as usize & (RING_RECORDS - 1)) * std::mem::size_of::<Record>();
        // SAFETY: a record of the ring, within the mapping; the writer
        // published it before moving the head the caller read.
        unsafe { std::ptr::read_volatile((self.base + at) as *const Record) }
    }
}

/// The name of the stream file of thread `tid`.
pub fn stream_name(tid: u32) -> String {
    format!("thread-{tid}")
}

/// The clock's rate (ticks per second) and the epoch time (ns) of its
/// value 0, from the trace's start stamps and a later reading of the
/// counter and CLOCK_MONOTONIC (10 ms apart at least, for precision).
pub fn clock(h: &TraceHeader, now_tsc: u64, now_monotonic: u64) -> (u64, i128) {
    use std::sync::atomic::Ordering::Relaxed;
    let (tsc0, mono0, real0) =
        (h.start_tsc.load(Relaxed), h.start_monotonic.load(Relaxed), h.start_realtime.load(Relaxed));
    let ticks = u128::from(now_tsc.saturating_sub(tsc0));
    let freq = (ticks * 1_000_000_000 / u128::from(now_monotonic.saturating_sub(mono0).max(1))) as u64;
    let offset_ns = i128::from(real0) - i128::from(tsc0) * 1_000_000_000 / i128::from(freq.max(1));
    (freq, offset_ns)
}

/// One ring's stream while its thread owns it.
struct Open {
    tid: u32,
    /// Its file's name: `thread-TID`, with `-N` for the Nth stream of a
    /// thread id used again.
    name: String,
    stream: ctf::Stream,
    /// The ring's losses written in earlier packets.
    discarded: u64,
}

/// Copies the rings' records into CTF streams, handing each packet to a
/// sink with its stream file's name (the caller's I/O).
pub struct Drainer {
    uuid: [u8; 16],
    start: u64,
    open: Vec<Option<Open>>,
    /// Events written.
    pub events: u64,
    /// Losses of streams closed.
    lost_closed: u64,
    /// Streams opened.
    pub streams: u32,
    names: std::collections::HashSet<String>,
}

/// Where a drainer's packets go: the stream file's name and the bytes to
/// append to it.
pub type Sink<'a, E> = &'a mut dyn FnMut(&str, &[u8]) -> Result<(), E>;

impl Drainer {
    pub fn new(uuid: [u8; 16], start: u64) -> Drainer {
        Drainer {
            uuid,
            start,
            open: (0..RINGS).map(|_| None).collect(),
            events: 0,
            lost_closed: 0,
            streams: 0,
            names: Default::default(),
        }
    }

    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// Reads every ring up to its head into its stream and writes a
    /// packet per stream that has news (ending at `now`), and frees the
    /// rings of threads that exited. Returns the most records read from
    /// one ring.
    pub fn drain<E>(&mut self, r: &Rings, now: u64, out: Sink<'_, E>) -> Result<u64, E> {
        use std::sync::atomic::Ordering;
        let mut most = 0;
        let used = (r.header().rings_used.load(Ordering::Acquire) as usize).min(RINGS);
        for i in 0..used {
            let ring = r.ring(i);
            let owner = ring.owner.load(Ordering::Acquire);
            if self.open[i].as_ref().is_some_and(|o| o.tid != owner) {
                self.close(i, out)?;
            }
            if owner == 0 {
                continue;
            }
            if self.open[i].is_none() {
                let mut name = stream_name(owner);
                let mut k = 1;
                while self.names.contains(&name) {
                    k += 1;
                    name = format!("{}-{k}", stream_name(owner));
                }
                self.names.insert(name.clone());
                let mut stream = ctf::Stream::new(self.uuid, 0, owner, self.start);
                out(&name, &stream.first_packet())?;
                self.streams += 1;
                self.open[i] = Some(Open { tid: owner, name, stream, discarded: 0 });
            }
            let exited = ring.exited.load(Ordering::Acquire) == 1;
            let head = ring.head.load(Ordering::Acquire);
            let tail = ring.tail.load(Ordering::Relaxed);
            let Some(o) = self.open[i].as_mut() else { continue };
            most = most.max(head.wrapping_sub(tail));
            let name = o.name.clone();
            for n in tail..head {
                let rec = r.record(i, n);
                if rec.tsc < self.start {
                    continue;
                }
                if rec.kind() != kind::REALLOC_OLD {
                    self.events += 1;
                }
                o.stream.record(&rec);
                if o.stream.pending_bytes() > 1 << 20 {
                    out(&name, &o.stream.finish_packet(0, o.discarded))?;
                    o.discarded = o.stream.discarded;
                }
            }
            ring.tail.store(head, Ordering::Release);
            o.stream.discarded = ring.lost.load(Ordering::Relaxed);
            let p = o.stream.finish_packet(now, o.discarded);
            out(&name, &p)?;
            o.discarded = o.stream.discarded;
            if exited && ring.head.load(Ordering::Acquire) == head {
                self.close(i, out)?;
                ring.lost.store(0, Ordering::Relaxed);
                ring.exited.store(0, Ordering::Relaxed);
                ring.owner.store(0, Ordering::Release);
            }
        }
        Ok(most)
    }

    fn close<E>(&mut self, i: usize, out: Sink<'_, E>) -> Result<(), E> {
        if let Some(mut o) = self.open[i].take() {
            let p = o.stream.finish_packet(0, o.discarded);
            out(&o.name, &p)?;
            self.lost_closed += o.stream.discarded;
        }
        Ok(())
    }

    /// Closes every stream.
    pub fn close_all<E>(&mut self, out: Sink<'_, E>) -> Result<(), E> {
        for i in 0..RINGS {
            self.close(i, out)?;
        }
        Ok(())
    }

    /// Events lost so far: those of the streams (closed or open) and of
    /// threads that found no ring.
    pub fn lost(&self, r: &Rings) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        let open: u64 = self.open.iter().flatten().map(|o| o.stream.discarded).sum();
        self.lost_closed + open + r.header().lost_no_ring.load(Relaxed)
    }

    /// The `sites` stream file's bytes.
    pub fn sites(&self, sites: &[SiteInfo]) -> Vec<u8> {
        let mut s = ctf::Stream::new(self.uuid, 1, 0, self.start);
        for info in sites {
            s.site(info, self.start);
        }
        s.finish_packet(self.start, 0)
    }
}

/// What a trace says of the sites of one module's table: site `i` is id
/// `first_id + i`, at its address plus `bias`.
pub fn site_infos(t: &crate::layout::Table<'_>, first_id: u32, bias: u64) -> impl Iterator<Item = SiteInfo> {
    let module = t.module_name().to_string();
    t.sites().enumerate().map(move |(i, s)| SiteInfo {
        id: first_id + i as u32,
        address: s.addr.wrapping_add(bias),
        function: t.string(s.function).unwrap_or("").to_string(),
        file: t.string(s.file).unwrap_or("").to_string(),
        line: s.line,
        module: module.clone(),
    })
}

/// A trace's UUID (version 4) from 16 random bytes.
pub fn uuid_v4(mut random: [u8; 16]) -> [u8; 16] {
    random[6] = random[6] & 0x0f | 0x40;
    random[8] = random[8] & 0x3f | 0x80;
    random
}

/// The CTF 1.8 trace written from the records (format in docs/formats.md,
/// "Event traces"): a metadata file in TSDL, a stream file per thread
/// (stream class 0: `alloc`, `alloc_large`, `free`, `realloc`) and the
/// `sites` stream (class 1: `site` events), every packet headed by the CTF
/// magic, the trace's UUID and the stream class.
pub mod ctf {
    use super::{Record, SiteInfo, kind};

    pub const MAGIC: u32 = 0xc1fc_1fc1;
    /// The format's version, in the metadata's `env`.
    pub const FORMAT_VERSION: u32 = 1;
    pub mod event {
        pub const ALLOC: u32 = 0;
        pub const ALLOC_LARGE: u32 = 1;
        pub const FREE: u32 = 2;
        pub const REALLOC: u32 = 3;
        pub const SITE: u32 = 4;
    }
    /// The compact event header's id that says an extended header follows.
    const EXTENDED: u8 = 31;
    /// Bytes of a packet's header and context.
    pub const PACKET_HEAD: usize = 24 + 44;

    /// What the metadata says of the trace.
    pub struct Meta<'a> {
        pub uuid: [u8; 16],
        /// Time stamp counter ticks per second.
        pub freq: u64,
        /// The epoch time (ns) of counter value 0.
        pub offset_ns: i128,
        pub pid: u32,
        pub command: &'a str,
    }

    fn uuid_text(u: &[u8; 16]) -> String {
        let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "{}-{}-{}-{}-{}",
            h[..4].concat(),
            h[4..6].concat(),
            h[6..8].concat(),
            h[8..10].concat(),
            h[10..].concat()
        )
    }

    fn escape(s: &str) -> String {
        s.chars()
            .flat_map(|c| match c {
                '"' | '\\' => vec!['\\', c],
                c if c.is_control() => vec!['?'],
                c => vec![c],
            })
            .collect()
    }

    /// The TSDL metadata.
    pub fn metadata(m: &Meta<'_>) -> String {
        let offset_s = m.offset_ns.div_euclid(1_000_000_000);
        let offset_cycles = (m.offset_ns.rem_euclid(1_000_000_000) * i128::from(m.freq) / 1_000_000_000) as u64;
        format!(
            r#"/* CTF 1.8 */

typealias integer {{ size = 8; align = 8; signed = false; }} := uint8_t;
typealias integer {{ size = 16; align = 8; signed = false; }} := uint16_t;
typealias integer {{ size = 32; align = 8; signed = false; }} := uint32_t;
typealias integer {{ size = 64; align = 8; signed = false; }} := uint64_t;
typealias integer {{ size = 64; align = 8; signed = false; base = 16; }} := hex64_t;
typealias integer {{ size = 5; align = 1; signed = false; }} := uint5_t;

trace {{
	major = 1;
	minor = 8;
	uuid = "{uuid}";
	byte_order = le;
	packet.header := struct {{
		uint32_t magic;
		uint8_t uuid[16];
		uint32_t stream_id;
	}};
}};

env {{
	tracer_name = "alloctramp";
	trace_format = "alloctramp-trace";
	trace_format_version = {version};
	pid = {pid};
	procname = "{command}";
}};

clock {{
	name = "tsc";
	uuid = "{uuid}";
	description = "x86-64 time stamp counter (rdtscp)";
	freq = {freq};
	precision = 1;
	offset_s = {offset_s};
	offset = {offset_cycles};
	absolute = false;
}};

typealias integer {{ size = 27; align = 1; signed = false; map = clock.tsc.value; }} := uint27_clock_tsc_t;
typealias integer {{ size = 64; align = 8; signed = false; map = clock.tsc.value; }} := uint64_clock_tsc_t;

struct packet_context {{
	uint64_clock_tsc_t timestamp_begin;
	uint64_clock_tsc_t timestamp_end;
	uint64_t content_size;
	uint64_t packet_size;
	uint64_t events_discarded;
	uint32_t tid;
}};

struct event_header_compact {{
	enum : uint5_t {{ compact = 0 ... 30, extended = 31 }} id;
	variant <id> {{
		struct {{
			uint27_clock_tsc_t timestamp;
		}} compact;
		struct {{
			uint32_t id;
			uint64_clock_tsc_t timestamp;
		}} extended;
	}} v;
}} align(8);

stream {{
	id = 0;
	event.header := struct event_header_compact;
	packet.context := struct packet_context;
}};

stream {{
	id = 1;
	event.header := struct event_header_compact;
	packet.context := struct packet_context;
}};

event {{
	name = "alloc";
	id = {alloc};
	stream_id = 0;
	fields := struct {{
		uint32_t site;
		hex64_t ptr;
		uint32_t size;
		uint16_t cpu;
	}};
}};

event {{
	name = "alloc_large";
	id = {alloc_large};
	stream_id = 0;
	fields := struct {{
		uint32_t site;
		hex64_t ptr;
		uint64_t size;
		uint16_t cpu;
	}};
}};

event {{
	name = "free";
	id = {free};
	stream_id = 0;
	fields := struct {{
		uint32_t site;
		uint32_t alloc_site;
		hex64_t ptr;
		uint16_t cpu;
	}};
}};

event {{
	name = "realloc";
	id = {realloc};
	stream_id = 0;
	fields := struct {{
		uint32_t site;
		uint32_t alloc_site;
		hex64_t ptr;
		hex64_t old_ptr;
		uint64_t size;
		uint64_t old_size;
		uint16_t cpu;
	}};
}};

event {{
	name = "site";
	id = {site};
	stream_id = 1;
	fields := struct {{
		uint32_t site;
		hex64_t address;
		string function;
		string file;
		uint32_t line;
		string module;
	}};
}};
"#,
            uuid = uuid_text(&m.uuid),
            version = FORMAT_VERSION,
            pid = m.pid,
            command = escape(m.command),
            freq = m.freq.max(1),
            alloc = event::ALLOC,
            alloc_large = event::ALLOC_LARGE,
            free = event::FREE,
            realloc = event::REALLOC,
            site = event::SITE,
        )
    }

    /// One stream's writer: events go into a packet, which
    /// [`Stream::finish_packet`] closes into bytes for the stream's file.
    pub struct Stream {
        uuid: [u8; 16],
        class: u32,
        tid: u32,
        /// The clock's value after the last event written (the packets'
        /// timestamps and compact headers follow it).
        last: u64,
        begin: u64,
        events: Vec<u8>,
        /// Events discarded in the stream so far.
        pub discarded: u64,
        /// Events written in the current packet.
        pub count: u64,
        /// The old half of a realloc, waiting for the new half.
        pending: Option<Record>,
    }

    impl Stream {
        pub fn new(uuid: [u8; 16], class: u32, tid: u32, start: u64) -> Stream {
            Stream {
                uuid,
                class,
                tid,
                last: start,
                begin: start,
                events: Vec::new(),
                discarded: 0,
                count: 0,
                pending: None,
            }
        }

        fn header(&mut self, id: u32, ts: u64) {
            // A later time than the last: the reader adds whole wraps of
            // the compact header's 27 bits, so a gap of 2^27 or more
            // takes the extended header's full value.
            let ts = ts.max(self.last);
            if id < u32::from(EXTENDED) && ts - self.last < 1 << 27 {
                let v = id | ((ts & ((1 << 27) - 1)) as u32) << 5;
                self.events.extend_from_slice(&v.to_le_bytes());
            } else {
                self.events.push(EXTENDED);
                self.events.extend_from_slice(&id.to_le_bytes());
                self.events.extend_from_slice(&ts.to_le_bytes());
            }
            if self.count == 0 {
                self.begin = self.last;
            }
            self.last = ts;
            self.count += 1;
        }

        /// Appends a record's event (a realloc's old half waits for its
        /// new half).
        pub fn record(&mut self, r: &Record) {
            let cpu = r.cpu().to_le_bytes();
            match r.kind() {
                kind::ALLOC => {
                    let small = u32::try_from(r.size).ok();
                    self.header(if small.is_some() { event::ALLOC } else { event::ALLOC_LARGE }, r.tsc);
                    self.events.extend_from_slice(&r.site().to_le_bytes());
                    self.events.extend_from_slice(&r.ptr.to_le_bytes());
                    match small {
                        Some(s) => self.events.extend_from_slice(&s.to_le_bytes()),
                        None => self.events.extend_from_slice(&r.size.to_le_bytes()),
                    }
                    self.events.extend_from_slice(&cpu);
                }
                kind::FREE => {
                    self.header(event::FREE, r.tsc);
                    self.events.extend_from_slice(&r.site().to_le_bytes());
                    self.events.extend_from_slice(&r.alloc_site().to_le_bytes());
                    self.events.extend_from_slice(&r.ptr.to_le_bytes());
                    self.events.extend_from_slice(&cpu);
                }
                kind::REALLOC_OLD => self.pending = Some(*r),
                _ => {
                    let old = self.pending.take().unwrap_or_default();
                    self.header(event::REALLOC, r.tsc);
                    self.events.extend_from_slice(&r.site().to_le_bytes());
                    self.events.extend_from_slice(&old.alloc_site().to_le_bytes());
                    self.events.extend_from_slice(&r.ptr.to_le_bytes());
                    self.events.extend_from_slice(&old.ptr.to_le_bytes());
                    self.events.extend_from_slice(&r.size.to_le_bytes());
                    self.events.extend_from_slice(&old.size.to_le_bytes());
                    self.events.extend_from_slice(&cpu);
                }
            }
        }

        /// Appends a site's description.
        pub fn site(&mut self, s: &SiteInfo, ts: u64) {
            self.header(event::SITE, ts);
            self.events.extend_from_slice(&s.id.to_le_bytes());
            self.events.extend_from_slice(&s.address.to_le_bytes());
            for text in [&s.function, &s.file] {
                self.events.extend(text.bytes().filter(|&b| b != 0));
                self.events.push(0);
            }
            self.events.extend_from_slice(&s.line.to_le_bytes());
            self.events.extend(s.module.bytes().filter(|&b| b != 0));
            self.events.push(0);
        }

        /// Bytes in the current packet's events.
        pub fn pending_bytes(&self) -> usize {
            self.events.len()
        }

        /// The current packet, closed (its header, context and events),
        /// ending at `end` (not before its last event); empty when it holds
        /// no event and nothing was discarded since the last packet.
        pub fn finish_packet(&mut self, end: u64, discarded_before: u64) -> Vec<u8> {
            if self.count == 0 && self.discarded == discarded_before {
                return Vec::new();
            }
            self.packet(end)
        }

        /// An empty packet at the stream's start, with nothing discarded
        /// yet: the reader counts later losses from it.
        pub fn first_packet(&mut self) -> Vec<u8> {
            let discarded = std::mem::take(&mut self.discarded);
            let p = self.packet(self.last);
            self.discarded = discarded;
            p
        }

        fn packet(&mut self, end: u64) -> Vec<u8> {
            if self.count == 0 {
                self.begin = self.last;
            }
            let end = end.max(self.last);
            let size = (PACKET_HEAD + self.events.len()) as u64 * 8;
            let mut p = Vec::with_capacity(PACKET_HEAD + self.events.len());
            p.extend_from_slice(&MAGIC.to_le_bytes());
            p.extend_from_slice(&self.uuid);
            p.extend_from_slice(&self.class.to_le_bytes());
            p.extend_from_slice(&self.begin.to_le_bytes());
            p.extend_from_slice(&end.to_le_bytes());
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&self.discarded.to_le_bytes());
            p.extend_from_slice(&self.tid.to_le_bytes());
            debug_assert_eq!(p.len(), PACKET_HEAD);
            p.append(&mut self.events);
            self.last = end;
            self.begin = end;
            self.count = 0;
            p
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_files_list_ids() {
        let parse = |pieces: &[&[u8]]| {
            let mut got = Vec::new();
            let mut p = SitesParser::default();
            for piece in pieces {
                p.feed(piece, &mut |v| got.push(v));
            }
            p.finish(&mut |v| got.push(v)).then_some(got)
        };
        assert_eq!(parse(&[b"70 7", b"1\n131071"]), Some(vec![70, 71, 131071]));
        assert_eq!(parse(&[b"131072"]), None);
        assert_eq!(parse(&[b"7x"]), None);
        assert_eq!(parse(&[b""]), Some(vec![]));
    }

    #[test]
    fn records_pack_their_fields() {
        let w = Record::pack(kind::FREE, 4095, 0x1_2345, 0x1_fffe);
        let r = Record { tsc: 1, ptr: 2, size: 3, word: w };
        assert_eq!((r.kind(), r.cpu(), r.site(), r.alloc_site()), (kind::FREE, 4095, 0x1_2345, 0x1_fffe));
    }

    #[test]
    fn compact_headers_until_a_gap_of_2_27() {
        let mut s = ctf::Stream::new([0; 16], 0, 7, 1000);
        let rec = |tsc, k| Record { tsc, ptr: 0x10, size: 24, word: Record::pack(k, 1, 70, 0) };
        s.record(&rec(1000 + 5, kind::ALLOC));
        assert_eq!(s.pending_bytes(), 4 + 4 + 8 + 4 + 2);
        s.record(&rec(1000 + 5 + (1 << 27), kind::FREE));
        assert_eq!(s.pending_bytes(), 22 + 13 + 4 + 4 + 8 + 2);
        let p = s.finish_packet(0, 0);
        assert_eq!(u32::from_le_bytes(p[..4].try_into().unwrap()), ctf::MAGIC);
        assert_eq!(p.len(), ctf::PACKET_HEAD + 22 + 31);
        assert!(s.finish_packet(0, 0).is_empty());
    }
}
