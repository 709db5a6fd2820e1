//! `alloctramp trace`: records a running process's allocations and frees
//! as events and drains them from its trace file into a CTF 1.8 trace
//! directory (format in docs/formats.md, "Event traces").

use crate::control::{self, SwitchArgs, counters_dir, pid_file};
use alloctramp_trampolines::process::{ProcessFile, Request};
use alloctramp_trampolines::trace::{self, Record, RingHeader, SiteInfo, TraceHeader, ctf};
use anyhow::{Context, Result, anyhow, bail};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Record every allocation, free and realloc of a running process as an
/// event, into a CTF trace directory (for babeltrace2 and `alloctramp
/// analyze`).
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp trace 12345 -o trace --duration 10\n  \
    babeltrace2 trace | head\n  \
    alloctramp analyze trace\n\n\
Profiling is switched on for the trace if it was off, and off again after. The trace ends after \
--duration, at Ctrl-C, or when the process exits; events the process could not record because its \
buffers were full are counted and reported (CTF's events_discarded).")]
pub struct TraceArgs {
    #[command(flatten)]
    pub switch: SwitchArgs,
    /// The trace directory to write (must not exist).
    #[arg(short = 'o', long, value_name = "DIR")]
    pub output: PathBuf,
    /// Seconds to trace [default: until Ctrl-C or the process exits].
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: i32) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

pub fn run_trace(args: &TraceArgs) -> Result<()> {
    let partial = start_output(&args.output)?;
    let result = trace_process(args, &partial);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    result
}

fn trace_process(args: &TraceArgs, partial: &Path) -> Result<()> {
    let pid = args.switch.pid;
    let dir = counters_dir(args.switch.dir.as_deref());
    let path = pid_file(pid, &dir)?;
    let was_on = {
        let m = crate::util::Snapshot::read(&path)?;
        ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?.on
    };
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a handler that only stores to an atomic.
        unsafe { libc::signal(sig, on_interrupt as extern "C" fn(i32) as libc::sighandler_t) };
    }
    let msg = control::switch(&args.switch, Request::Trace)?;
    eprintln!("alloctramp: {msg}");
    let trace_path = dir.join(trace::file_name(pid));
    let mut file = TraceFile::open(&trace_path)?;
    let mut d = Drainer::new(partial, file.header().start_tsc.load(Ordering::Acquire));
    let deadline = args.duration.map(|s| Instant::now() + Duration::from_secs_f64(s.max(0.0)));
    let alive = |pid: u32| control::process_exists(pid);
    while !INTERRUPTED.load(Ordering::Relaxed) && deadline.is_none_or(|d| Instant::now() < d) && alive(pid) {
        d.drain_and_wait(&mut file)?;
    }
    if alive(pid) {
        let stopped = control::switch(&args.switch, Request::NoTrace);
        if !was_on {
            let _ = control::switch(&args.switch, Request::Off);
        }
        stopped?;
        // Events under way when the trace stopped.
        std::thread::sleep(DRAIN_EVERY);
    }
    let summary = finish_trace(d, &mut file, &trace_path, &path, pid)?;
    finish_output(partial, &args.output)?;
    eprintln!("alloctramp: {}", summary.text(&args.output));
    Ok(())
}

/// How often a drainer reads the rings.
pub const DRAIN_EVERY: Duration = Duration::from_millis(20);

/// Drains the last events, writes the sites and the metadata; removes the
/// trace file of a process that has exited (it keeps it for its drainer).
pub fn finish_trace(
    mut d: Drainer,
    file: &mut TraceFile,
    trace_path: &Path,
    counters: &Path,
    pid: u32,
) -> Result<Summary> {
    d.drain(file)?;
    if !control::process_exists(pid) {
        let _ = std::fs::remove_file(trace_path);
    }
    let m = crate::util::Snapshot::read(counters)?;
    let pf = ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", counters.display()))?;
    d.write_sites(&pf)?;
    d.finish(file, pid, &pf.command)
}

/// The temporary directory a trace is written into (renamed to `output`
/// once complete).
pub fn start_output(output: &Path) -> Result<PathBuf> {
    if output.symlink_metadata().is_ok() {
        bail!("{}: exists (the trace is written into a new directory)", output.display());
    }
    let name = output.file_name().ok_or_else(|| anyhow!("{}: not a directory name", output.display()))?;
    let mut partial_name = name.to_os_string();
    partial_name.push(format!(".partial-{}", std::process::id()));
    let partial = output.with_file_name(partial_name);
    std::fs::create_dir(&partial).with_context(|| format!("{}: cannot create", partial.display()))?;
    Ok(partial)
}

pub fn finish_output(partial: &Path, output: &Path) -> Result<()> {
    std::fs::rename(partial, output).with_context(|| format!("{}: cannot create", output.display()))
}

/// A shared mapping of a process's trace file.
pub struct TraceFile {
    map: memmap2::MmapMut,
}

impl TraceFile {
    pub fn open(path: &Path) -> Result<TraceFile> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("{}: cannot open the trace file", path.display()))?;
        if f.metadata()?.len() < trace::FILE_SIZE {
            bail!("{}: not a trace file (too short)", path.display());
        }
        // SAFETY: a shared mapping, read and written only through atomics
        // (the header, the rings' heads and tails) and as records below a
        // ring's published head.
        let map = unsafe { memmap2::MmapOptions::new().len(trace::FILE_SIZE as usize).map_mut(&f) }
            .with_context(|| format!("{}: cannot map", path.display()))?;
        let t = TraceFile { map };
        if t.header().magic != trace::MAGIC || t.header().version.load(Ordering::Relaxed) != trace::VERSION {
            bail!("{}: not a trace file of this version", path.display());
        }
        Ok(t)
    }

    /// The time stamp counter at the trace's start.
    pub fn start_tsc(&self) -> u64 {
        self.header().start_tsc.load(Ordering::Acquire)
    }

    fn header(&self) -> &TraceHeader {
        // SAFETY: the file's first 4096 bytes (checked length), a Pod of
        // atomics and bytes.
        unsafe { &*(self.map.as_ptr() as *const TraceHeader) }
    }

    fn ring(&self, i: usize) -> &RingHeader {
        // SAFETY: ring i < RINGS lies within the mapping (FILE_SIZE bytes).
        unsafe { &*(self.map.as_ptr().add(trace::ring_offset(i) as usize) as *const RingHeader) }
    }

    fn record(&self, i: usize, n: u64) -> Record {
        let at = trace::records_offset(i) + (n as usize & (trace::RING_RECORDS - 1)) as u64 * 32;
        // SAFETY: a record of ring i, below its published head.
        unsafe { std::ptr::read_volatile(self.map.as_ptr().add(at as usize) as *const Record) }
    }
}

/// One ring's stream while its thread owns it.
struct Open {
    tid: u32,
    stream: ctf::Stream,
    /// The ring's losses written in earlier packets.
    discarded: u64,
    file: std::fs::File,
}

/// Copies the rings' records into CTF streams.
pub struct Drainer {
    dir: PathBuf,
    uuid: [u8; 16],
    start: u64,
    open: HashMap<usize, Open>,
    pub events: u64,
    /// Losses of streams closed.
    lost_closed: u64,
    streams: u32,
    sites: u32,
}

/// What a finished trace holds.
pub struct Summary {
    pub events: u64,
    pub lost: u64,
    pub streams: u32,
    pub sites: u32,
}

impl Summary {
    pub fn text(&self, dir: &Path) -> String {
        format!(
            "{}: {} events in {} thread stream{}, {} sites described; {}",
            dir.display(),
            self.events,
            self.streams,
            if self.streams == 1 { "" } else { "s" },
            self.sites,
            match self.lost {
                0 => "no event lost".to_string(),
                n => format!("{n} events lost (the process's buffers were full)"),
            }
        )
    }
}

fn random_uuid() -> [u8; 16] {
    let mut u = [0u8; 16];
    // SAFETY: getrandom writes at most 16 bytes into the buffer.
    let n = unsafe { libc::getrandom(u.as_mut_ptr() as *mut libc::c_void, 16, 0) };
    if n != 16 {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        u[..16].copy_from_slice(&(t.as_nanos() ^ u128::from(std::process::id())).to_le_bytes());
    }
    u[6] = u[6] & 0x0f | 0x40;
    u[8] = u[8] & 0x3f | 0x80;
    u
}

fn rdtsc() -> u64 {
    let mut aux = 0u32;
    // SAFETY: rdtscp reads the counter.
    unsafe { core::arch::x86_64::__rdtscp(&mut aux) }
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    // SAFETY: clock_gettime writes the timespec.
    unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(clock, &mut ts);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

impl Drainer {
    pub fn new(dir: &Path, start: u64) -> Drainer {
        Drainer {
            dir: dir.to_path_buf(),
            uuid: random_uuid(),
            start,
            open: HashMap::new(),
            events: 0,
            lost_closed: 0,
            streams: 0,
            sites: 0,
        }
    }

    fn append(file: &mut std::fs::File, bytes: &[u8], path: &Path) -> Result<()> {
        file.write_all(bytes).with_context(|| format!("{}: cannot write", path.display()))
    }

    /// Drains, then waits [`DRAIN_EVERY`] unless a ring was filling up
    /// (an eighth of it since the last drain), and a 20th of that if one
    /// had news.
    pub fn drain_and_wait(&mut self, t: &mut TraceFile) -> Result<()> {
        match self.drain(t)? {
            0 => std::thread::sleep(DRAIN_EVERY),
            n if n < trace::RING_RECORDS as u64 / 8 => std::thread::sleep(DRAIN_EVERY / 20),
            _ => {}
        }
        Ok(())
    }

    /// Reads every ring up to its head into its stream, writes a packet per
    /// stream that has news, and frees the rings of threads that exited.
    /// Returns the most records read from one ring.
    pub fn drain(&mut self, t: &mut TraceFile) -> Result<u64> {
        let mut most = 0;
        for i in 0..trace::RINGS {
            let r = t.ring(i);
            let owner = r.owner.load(Ordering::Acquire);
            if self.open.get(&i).is_some_and(|o| o.tid != owner) {
                self.close(i)?;
            }
            if owner == 0 {
                continue;
            }
            if !self.open.contains_key(&i) {
                let name = format!("thread-{owner}");
                let path = self.dir.join(&name);
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .with_context(|| format!("{}: cannot create", path.display()))?;
                self.streams += 1;
                let mut stream = ctf::Stream::new(self.uuid, 0, owner, self.start);
                let mut file = file;
                Self::append(&mut file, &stream.first_packet(), &path)?;
                self.open.insert(i, Open { tid: owner, stream, discarded: 0, file });
            }
            let exited = r.exited.load(Ordering::Acquire) == 1;
            let head = r.head.load(Ordering::Acquire);
            let tail = r.tail.load(Ordering::Relaxed);
            let Some(o) = self.open.get_mut(&i) else { continue };
            most = most.max(head.wrapping_sub(tail));
            for n in tail..head {
                let rec = t.record(i, n);
                if rec.tsc < self.start {
                    continue;
                }
                if rec.kind() != trace::kind::REALLOC_OLD {
                    self.events += 1;
                }
                o.stream.record(&rec);
                if o.stream.pending_bytes() > 1 << 20 {
                    let p = o.stream.finish_packet(0, o.discarded);
                    Self::append(&mut o.file, &p, &self.dir)?;
                    o.discarded = o.stream.discarded;
                }
            }
            r.tail.store(head, Ordering::Release);
            o.stream.discarded = r.lost.load(Ordering::Relaxed);
            let p = o.stream.finish_packet(rdtsc(), o.discarded);
            Self::append(&mut o.file, &p, &self.dir)?;
            o.discarded = o.stream.discarded;
            if exited && r.head.load(Ordering::Acquire) == head {
                self.close(i)?;
                r.lost.store(0, Ordering::Relaxed);
                r.exited.store(0, Ordering::Relaxed);
                r.owner.store(0, Ordering::Release);
            }
        }
        Ok(most)
    }

    fn close(&mut self, i: usize) -> Result<()> {
        if let Some(mut o) = self.open.remove(&i) {
            let p = o.stream.finish_packet(0, o.discarded);
            Self::append(&mut o.file, &p, &self.dir)?;
            self.lost_closed += o.stream.discarded;
        }
        Ok(())
    }

    /// Writes the `sites` stream: every site of every module the process
    /// file holds with ids.
    pub fn write_sites(&mut self, pf: &ProcessFile) -> Result<u32> {
        let sites = site_infos(pf)?;
        let mut s = ctf::Stream::new(self.uuid, 1, 0, self.start);
        for info in &sites {
            s.site(info, self.start);
        }
        let p = s.finish_packet(self.start, 0);
        let path = self.dir.join("sites");
        std::fs::write(&path, &p).with_context(|| format!("{}: cannot write", path.display()))?;
        self.sites = sites.len() as u32;
        Ok(self.sites)
    }

    /// Closes every stream and writes the metadata (the clock measured
    /// against CLOCK_MONOTONIC since the trace's start).
    fn finish(mut self, t: &TraceFile, pid: u32, command: &str) -> Result<Summary> {
        for i in self.open.keys().copied().collect::<Vec<_>>() {
            self.close(i)?;
        }
        let h = t.header();
        let (tsc0, mono0, real0) = (
            h.start_tsc.load(Ordering::Relaxed),
            h.start_monotonic.load(Ordering::Relaxed),
            h.start_realtime.load(Ordering::Relaxed),
        );
        // At least 10 ms between the two readings, for a precise rate.
        let (mut tsc1, mut mono1) = (rdtsc(), clock_ns(libc::CLOCK_MONOTONIC));
        if mono1.saturating_sub(mono0) < 10_000_000 {
            std::thread::sleep(Duration::from_millis(10));
            (tsc1, mono1) = (rdtsc(), clock_ns(libc::CLOCK_MONOTONIC));
        }
        let freq = (u128::from(tsc1.saturating_sub(tsc0)) * 1_000_000_000
            / u128::from(mono1.saturating_sub(mono0).max(1))) as u64;
        let offset_ns = i128::from(real0) - i128::from(tsc0) * 1_000_000_000 / i128::from(freq.max(1));
        let meta = ctf::metadata(&ctf::Meta { uuid: self.uuid, freq, offset_ns, pid, command });
        let path = self.dir.join("metadata");
        std::fs::write(&path, meta).with_context(|| format!("{}: cannot write", path.display()))?;
        Ok(Summary {
            events: self.events,
            lost: self.lost_closed + h.lost_no_ring.load(Ordering::Relaxed),
            streams: self.streams,
            sites: self.sites,
        })
    }
}

/// What the trace says of each site: every site of the modules with ids.
pub fn site_infos(pf: &ProcessFile) -> Result<Vec<SiteInfo>> {
    let mut out = Vec::new();
    for m in pf.modules().map_err(|e| anyhow!("{e}"))? {
        if m.first_id == 0 {
            continue;
        }
        let t = &m.table;
        let module = t.module_name().to_string();
        for (i, s) in t.sites().enumerate() {
            out.push(SiteInfo {
                id: m.first_id + i as u32,
                address: s.addr.wrapping_add(m.bias),
                function: t.string(s.function).unwrap_or("").to_string(),
                file: t.string(s.file).unwrap_or("").to_string(),
                line: s.line,
                module: module.clone(),
            });
        }
    }
    Ok(out)
}
