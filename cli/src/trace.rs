//! `alloctramp trace`: records a running process's allocations and frees
//! as events and drains them from its trace file into a CTF 1.8 trace
//! directory (format in docs/formats.md, "Event traces").

use crate::control::{self, SwitchArgs, counters_dir, pid_file};
use alloctramp_trampolines::process::{ProcessFile, Request};
use alloctramp_trampolines::trace::{self, Rings, SiteInfo, ctf};
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
    /// Record only the sites SPEC names (FILE:LINE, a function, or
    /// [MODULE:]0xADDRESS, as `alloctramp fail` names them), and the frees
    /// of what they allocate; repeatable [default: every site].
    #[arg(long = "site", value_name = "SPEC")]
    pub sites: Vec<String>,
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
    // The sites to record, for the runtime to read with the request.
    let sites_path = dir.join(trace::sites_file_name(pid));
    if args.sites.is_empty() {
        let _ = std::fs::remove_file(&sites_path);
    } else {
        // Sites have their ids once profiling went on (a process that
        // never profiled has none yet).
        if !was_on {
            control::switch(&args.switch, Request::On)?;
        }
        let m = crate::util::Snapshot::read(&path)?;
        let pf = ProcessFile::parse(&m.bytes).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let ids = select_ids(&pf, &args.sites, pid).inspect_err(|_| {
            if !was_on {
                let _ = control::switch(&args.switch, Request::Off);
            }
        })?;
        let text: String = ids.iter().map(|id| format!("{id}\n")).collect();
        let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&path)?);
        let give = (control::euid() == 0 && owner != 0).then_some(owner);
        crate::util::write_atomic_as(&sites_path, text.as_bytes(), 0o600, give)?;
    }
    let trace_path = dir.join(trace::file_name(pid));
    // A trace the process records already (`ALLOCTRAMP_TRACE=on`) goes
    // on after this command, as it found it.
    let traced_before = TraceFile::open(&trace_path).is_ok_and(|f| f.rings.header().on.load(Ordering::Acquire) == 1);
    let msg = control::switch(&args.switch, Request::Trace)?;
    eprintln!("alloctramp: {msg}");
    // Undoes the requests when the trace cannot be drained.
    let undo = |e: anyhow::Error| {
        if !traced_before {
            let _ = control::switch(&args.switch, Request::NoTrace);
        }
        if !was_on {
            let _ = control::switch(&args.switch, Request::Off);
        }
        let _ = std::fs::remove_file(&sites_path);
        e
    };
    let mut file = TraceFile::open(&trace_path).and_then(|f| f.claim()).map_err(undo)?;
    let mut d = Drainer::new(partial, file.start_tsc());
    let deadline = args.duration.map(|s| Instant::now() + Duration::from_secs_f64(s.max(0.0)));
    let alive = |pid: u32| control::process_exists(pid);
    while !INTERRUPTED.load(Ordering::Relaxed) && deadline.is_none_or(|d| Instant::now() < d) && alive(pid) {
        d.drain_and_wait(&mut file).map_err(undo)?;
    }
    if alive(pid) {
        let stopped = if traced_before { Ok(String::new()) } else { control::switch(&args.switch, Request::NoTrace) };
        if !was_on {
            let _ = control::switch(&args.switch, Request::Off);
        }
        stopped?;
        // Events under way when the trace stopped.
        std::thread::sleep(DRAIN_EVERY);
    }
    let _ = std::fs::remove_file(&sites_path);
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
    _map: memmap2::MmapMut,
    rings: Rings,
}

impl TraceFile {
    pub fn open(path: &Path) -> Result<TraceFile> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .with_context(|| format!("{}: cannot open the trace file", path.display()))?;
        // The magic and the version first: a file of another version has
        // another size.
        let mut head = [0u8; 12];
        use std::os::unix::fs::FileExt;
        if f.read_exact_at(&mut head, 0).is_err() || head[..8] != trace::MAGIC[..] {
            bail!("{}: not a trace file", path.display());
        }
        let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        if version != trace::VERSION {
            bail!("{}: a trace file of version {version}, not {}", path.display(), trace::VERSION);
        }
        if f.metadata()?.len() < trace::FILE_SIZE {
            bail!("{}: not a trace file (too short)", path.display());
        }
        // SAFETY: a shared mapping, read and written only through atomics
        // (the header, the rings' heads and tails) and as records below a
        // ring's published head.
        let map = unsafe { memmap2::MmapOptions::new().len(trace::FILE_SIZE as usize).map_mut(&f) }
            .with_context(|| format!("{}: cannot map", path.display()))?;
        // SAFETY: the mapping of FILE_SIZE bytes, kept with the view.
        let rings = unsafe { Rings::new(map.as_ptr()) };
        let t = TraceFile { _map: map, rings };
        // (The magic and the version were read above.)
        let h = t.rings.header();
        if h.rings.load(Ordering::Relaxed) as usize != trace::RINGS
            || h.ring_records.load(Ordering::Relaxed) as usize != trace::RING_RECORDS
        {
            bail!("{}: not a trace file of this version", path.display());
        }
        Ok(t)
    }

    /// Makes this process the file's drainer: an error if another one that
    /// is still running drains it.
    pub fn claim(self) -> Result<TraceFile> {
        let me = std::process::id();
        let h = self.rings.header();
        loop {
            let held = h.drainer.load(Ordering::Acquire);
            if held != 0 && held != me && control::process_exists(held) {
                bail!("process {held} drains this trace already (one drainer at a time)");
            }
            if h.drainer.compare_exchange(held, me, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Ok(self);
            }
        }
    }

    /// The traced process.
    pub fn pid(&self) -> u32 {
        self.rings.header().pid.load(Ordering::Acquire)
    }

    /// The time stamp counter at the trace's start.
    pub fn start_tsc(&self) -> u64 {
        self.rings.header().start_tsc.load(Ordering::Acquire)
    }
}

impl Drop for TraceFile {
    fn drop(&mut self) {
        let _ =
            self.rings.header().drainer.compare_exchange(std::process::id(), 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Drains a trace file into a trace directory's stream files.
pub struct Drainer {
    dir: PathBuf,
    d: trace::Drainer,
    files: HashMap<String, std::fs::File>,
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
                n => format!("{n} events lost (a thread's buffer was full, or it had none)"),
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
    trace::uuid_v4(u)
}

fn rdtsc() -> u64 {
    // SAFETY: rdtsc is on every x86-64 CPU.
    unsafe { core::arch::x86_64::_rdtsc() }
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
            d: trace::Drainer::new(random_uuid(), start),
            files: HashMap::new(),
            sites: 0,
        }
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

    fn drain(&mut self, t: &mut TraceFile) -> Result<u64> {
        let (dir, files) = (&self.dir, &mut self.files);
        let mut sink = |name: &str, bytes: &[u8]| append(dir, files, name, bytes);
        self.d.drain(&t.rings, rdtsc(), &mut sink)
    }

    /// Writes the `sites` stream: every site of every module the process
    /// file holds with ids.
    fn write_sites(&mut self, pf: &ProcessFile) -> Result<()> {
        let sites = site_infos(pf)?;
        let path = self.dir.join("sites");
        std::fs::write(&path, self.d.sites(&sites)).with_context(|| format!("{}: cannot write", path.display()))?;
        self.sites = sites.len() as u32;
        Ok(())
    }

    /// Closes every stream and writes the metadata.
    fn finish(mut self, t: &TraceFile, pid: u32, command: &str) -> Result<Summary> {
        let (dir, files) = (&self.dir, &mut self.files);
        let mut sink = |name: &str, bytes: &[u8]| append(dir, files, name, bytes);
        self.d.close_all(&mut sink)?;
        let h = t.rings.header();
        if clock_ns(libc::CLOCK_MONOTONIC).saturating_sub(h.start_monotonic.load(Ordering::Relaxed)) < 10_000_000 {
            std::thread::sleep(Duration::from_millis(10));
        }
        let (freq, offset_ns) = trace::clock(h, rdtsc(), clock_ns(libc::CLOCK_MONOTONIC));
        let meta = ctf::metadata(&ctf::Meta { uuid: self.d.uuid(), freq, offset_ns, pid, command });
        let path = self.dir.join("metadata");
        std::fs::write(&path, meta).with_context(|| format!("{}: cannot write", path.display()))?;
        Ok(Summary { events: self.d.events, lost: self.d.lost(&t.rings), streams: self.d.streams, sites: self.sites })
    }
}

/// Appends a packet to a stream file of `dir` (opened once).
fn append(dir: &Path, files: &mut HashMap<String, std::fs::File>, name: &str, bytes: &[u8]) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    let path = dir.join(name);
    let f = match files.entry(name.to_string()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("{}: cannot create", path.display()))?,
        ),
    };
    f.write_all(bytes).with_context(|| format!("{}: cannot write", path.display()))
}

/// The ids of the sites `specs` name in the process file's modules with
/// ids (an error for a spec that names none).
fn select_ids(pf: &ProcessFile, specs: &[String], pid: u32) -> Result<Vec<u32>> {
    let modules = pf.modules().map_err(|e| anyhow!("{e}"))?;
    let mut out = Vec::new();
    for spec in specs {
        let before = out.len();
        let with_ids = modules.iter().filter(|m| m.first_id != 0);
        out.extend(control::sites_named(with_ids, spec)?.map(|(m, i, _)| m.first_id + i as u32));
        if out.len() == before {
            bail!("--site {spec}: no site of process {pid} with live tracking matches");
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// What the trace says of each site: every site of the modules with ids.
pub fn site_infos(pf: &ProcessFile) -> Result<Vec<SiteInfo>> {
    let modules = pf.modules().map_err(|e| anyhow!("{e}"))?;
    Ok(modules
        .iter()
        .filter(|m| m.first_id != 0)
        .flat_map(|m| trace::site_infos(&m.table, m.first_id, m.bias))
        .collect())
}
