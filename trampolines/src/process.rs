//! The per-process counters file: what the runtime of a patched process
//! shares with `alloctramp report` and `alloctramp enable/disable/reset`.
//!
//! ```text
//! Header       PROC_HEADER_SIZE bytes: magic, version, pid, state, ...
//!              MAX_MODULES module slots
//! per module   a copy of its site table (page-aligned)
//!              its counters (page-aligned), mapped by the runtime over the
//!              module's .alloctramp.counters with MAP_SHARED|MAP_FIXED
//! ```
//!
//! The runtime writes a module's table and counters region before it
//! publishes the module (a release store of `module_count`); a reader loads
//! `module_count` first. Counters are read while the process runs: a reader
//! sees each u64 either before or after an increment.

use crate::layout::{CELL_SIZE, PAGE, Table, TableError};

pub const PROC_MAGIC: [u8; 8] = *b"ATPROC\x00\x01";
pub const PROC_VERSION: u32 = 3;
pub const PROC_HEADER_SIZE: u64 = 16384;
pub const MODULE_SLOT_SIZE: u64 = 64;
pub const MODULE_SLOTS_AT: u64 = 512;
pub const MAX_MODULES: u64 = (PROC_HEADER_SIZE - MODULE_SLOTS_AT) / MODULE_SLOT_SIZE;

/// Header fields (byte offsets).
pub mod hdr {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 8;
    /// u32: the process id.
    pub const PID: usize = 12;
    /// u32: 1 while profiling is on.
    pub const STATE: usize = 16;
    /// u32: the signal that makes the runtime carry out a request (0: the
    /// process listens to no signal).
    pub const SIGNAL: usize = 20;
    /// u64: incremented after every completed switch or reset.
    pub const GENERATION: usize = 24;
    /// u32: number of published module slots.
    pub const MODULE_COUNT: usize = 32;
    /// u32: 1 once the process has exited (the file is its final snapshot).
    pub const EXITED: usize = 36;
    /// u32: 1 if a watcher thread waits for requests on [`WAKE`].
    pub const WATCHER: usize = 40;
    /// u32: [`flags`](super::flags) describing the live figures.
    pub const FLAGS: usize = 44;
    /// u64: time of the last reset (seconds since the epoch).
    pub const RESET_TIME: usize = 48;
    /// u64: start time (seconds since the epoch).
    pub const START_TIME: usize = 56;
    /// [u8; 112]: the command (argv[0]), NUL-padded.
    pub const COMMAND: usize = 64;
    /// u64: nanoseconds the last switch took.
    pub const LAST_SWITCH_NS: usize = 176;
    /// u64: sites rewritten by the last switch.
    pub const LAST_SWITCH_SITES: usize = 184;
    /// [u8; 64]: the last error of a switch, NUL-padded (empty: none).
    pub const LAST_ERROR: usize = 192;
    /// u64: allocations counted but not tracked (the pointer table could
    /// not grow); they were counted as freed at once.
    pub const UNTRACKED_ALLOCS: usize = 256;
    /// u64: bytes of memory the pointer table holds now.
    pub const TABLE_BYTES: usize = 264;
    /// u64: objects the pointer table holds now (updated as it grows and
    /// when a switch completes; exact figures are per site).
    pub const TABLE_OBJECTS: usize = 272;
    /// u32: the pending request ([`Request`](super::Request) code; 0: none).
    /// A requester stores it, then wakes the process (see [`WAKE`]); the
    /// runtime takes it with an atomic swap.
    pub const REQUEST: usize = 280;
    /// u32: a futex word. A requester increments it and wakes its waiters
    /// (`FUTEX_WAKE`, not private: the word is in a shared file mapping);
    /// the watcher thread waits on it.
    pub const WAKE: usize = 284;
    /// u64, u64: device and inode of the process's executable
    /// (`/proc/self/exe`) when the file was created, so that a reader can
    /// tell a process that replaced its program (`exec`) from one still
    /// running it.
    pub const EXE_DEV: usize = 288;
    pub const EXE_INO: usize = 296;
}

/// What a requester asks of a running process (the header's
/// [`hdr::REQUEST`] field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Request {
    /// Every site on.
    On = 1,
    /// Off; with live tracking, free sites stay on until the tracked objects
    /// are freed (or a reset).
    Off = 2,
    /// Every site off at once (live figures become incomplete if tracked
    /// objects remain).
    OffNow = 3,
    /// Zero every figure and forget every tracked object.
    Reset = 4,
}

impl Request {
    pub fn from_code(code: u32) -> Option<Request> {
        match code {
            1 => Some(Request::On),
            2 => Some(Request::Off),
            3 => Some(Request::OffNow),
            4 => Some(Request::Reset),
            _ => None,
        }
    }

    /// The words of the control file (`on`, `off`, `off now`, `reset`).
    pub fn text(self) -> &'static str {
        match self {
            Request::On => "on",
            Request::Off => "off",
            Request::OffNow => "off now",
            Request::Reset => "reset",
        }
    }

    /// Parses a control file's words (surrounding white space ignored).
    pub fn parse(text: &[u8]) -> Option<Request> {
        let t = text.trim_ascii();
        [Request::On, Request::Off, Request::OffNow, Request::Reset].into_iter().find(|r| r.text().as_bytes() == t)
    }
}

/// Bits of the header's FLAGS field.
pub mod flags {
    /// Live tracking: frees are attributed to the allocating site, and the
    /// live figures are meaningful.
    pub const LIVE: u32 = 1;
    /// Profiling is off but the free sites stay on until the tracked
    /// objects are freed (or a reset), so live figures keep coming down.
    pub const DRAINING: u32 = 2;
    /// Live figures may overstate: some tracked objects can no longer be
    /// seen leaving (profiling was switched fully off while they were
    /// live, or allocations could not be tracked).
    pub const INCOMPLETE: u32 = 4;
    /// Usable-size tracking: the USABLE_BYTES cell field is maintained.
    pub const USABLE: u32 = 8;
    /// Profiling was switched on at some time in this process: the file
    /// holds figures. A process that never switched on removes its file
    /// when it exits, and `alloctramp clean` removes such files left by
    /// processes that could not (killed, or ended with `_exit`).
    pub const PROFILED: u32 = 16;
}

/// Module slot fields (byte offsets in the slot).
pub mod slot {
    /// u64: file offset of the module's site table copy.
    pub const TABLE_OFFSET: usize = 0;
    /// u64: its size.
    pub const TABLE_SIZE: usize = 8;
    /// u64: file offset of the module's counters.
    pub const COUNTERS_OFFSET: usize = 16;
    /// u64: their size.
    pub const COUNTERS_SIZE: usize = 24;
    /// u64: the load bias (run-time address minus file address).
    pub const BIAS: usize = 32;
    /// u32: 1 once the module was unloaded (its figures stay).
    pub const UNLOADED: usize = 40;
    /// u32: 1 while the module's sites are switched on.
    pub const ON: usize = 44;
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Page-aligned layout of a module's region in the file.
pub fn module_region(table_size: u64, counters_size: u64, at: u64) -> (u64, u64, u64) {
    let table_off = at.div_ceil(PAGE) * PAGE;
    let counters_off = (table_off + table_size).div_ceil(PAGE) * PAGE;
    (table_off, counters_off, counters_off + counters_size)
}

/// Summed counters of one site.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cell {
    pub calls: u64,
    pub bytes: u64,
    pub failed: u64,
    pub freed_objects: u64,
    pub freed_bytes: u64,
    pub untracked_frees: u64,
    pub usable_bytes: u64,
    /// Requested bytes of failed calls (live tracking only).
    pub failed_bytes: u64,
}

impl Cell {
    /// Objects allocated here and not freed yet (live tracking; an
    /// allocation site). Never negative: a reading taken while a free is
    /// half-counted is clamped at zero.
    pub fn live_objects(&self) -> u64 {
        self.calls.wrapping_sub(self.failed).wrapping_sub(self.freed_objects).min(i64::MAX as u64)
    }
    /// Their requested bytes.
    pub fn live_bytes(&self) -> u64 {
        self.bytes.wrapping_sub(self.failed_bytes).wrapping_sub(self.freed_bytes).min(i64::MAX as u64)
    }
    /// Bytes the allocator reserved for them (usable-size tracking).
    pub fn live_usable_bytes(&self) -> u64 {
        self.usable_bytes.min(i64::MAX as u64)
    }
}

/// One module as read from a process file.
pub struct Module<'a> {
    pub table: Table<'a>,
    pub bias: u64,
    pub unloaded: bool,
    pub on: bool,
    counters: &'a [u8],
}

impl Module<'_> {
    /// The counters of site `i`, summed over all shards.
    pub fn cell(&self, i: usize) -> Cell {
        let h = &self.table.header;
        let mut c = Cell::default();
        for s in 0..h.shard_count as usize {
            let at = s * h.shard_stride as usize + i * CELL_SIZE;
            let Some(b) = self.counters.get(at..at + CELL_SIZE) else { break };
            c.calls = c.calls.wrapping_add(u64_at(b, 0));
            c.bytes = c.bytes.wrapping_add(u64_at(b, 8));
            c.failed = c.failed.wrapping_add(u64_at(b, 16));
            c.freed_objects = c.freed_objects.wrapping_add(u64_at(b, 24));
            c.freed_bytes = c.freed_bytes.wrapping_add(u64_at(b, 32));
            c.untracked_frees = c.untracked_frees.wrapping_add(u64_at(b, 40));
            c.usable_bytes = c.usable_bytes.wrapping_add(u64_at(b, 48));
            c.failed_bytes = c.failed_bytes.wrapping_add(u64_at(b, 56));
        }
        c
    }
}

/// A process file, read from bytes (a live mapping or a saved snapshot).
pub struct ProcessFile<'a> {
    pub bytes: &'a [u8],
    pub pid: u32,
    pub on: bool,
    pub signal: u32,
    pub generation: u64,
    pub exited: bool,
    pub watcher: bool,
    pub command: String,
    pub last_error: String,
    pub module_count: u32,
    pub last_switch_ns: u64,
    pub last_switch_sites: u64,
    /// [`flags`] bits.
    pub flags: u32,
    pub untracked_allocs: u64,
    pub table_bytes: u64,
    pub table_objects: u64,
}

fn c_string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

impl<'a> ProcessFile<'a> {
    /// Live tracking was on in this process: live figures are meaningful.
    pub fn live(&self) -> bool {
        self.flags & flags::LIVE != 0
    }

    pub fn parse(bytes: &'a [u8]) -> Result<ProcessFile<'a>, TableError> {
        if bytes.len() < PROC_HEADER_SIZE as usize || bytes[..8] != PROC_MAGIC {
            return Err(TableError("not an alloctramp process file".into()));
        }
        let v = u32_at(bytes, hdr::VERSION);
        if v != PROC_VERSION {
            return Err(TableError(format!("process file version {v}; this alloctramp reads version {PROC_VERSION}")));
        }
        Ok(ProcessFile {
            bytes,
            pid: u32_at(bytes, hdr::PID),
            on: u32_at(bytes, hdr::STATE) == 1,
            signal: u32_at(bytes, hdr::SIGNAL),
            generation: u64_at(bytes, hdr::GENERATION),
            exited: u32_at(bytes, hdr::EXITED) == 1,
            watcher: u32_at(bytes, hdr::WATCHER) == 1,
            command: c_string(&bytes[hdr::COMMAND..hdr::COMMAND + 112]),
            last_switch_ns: u64_at(bytes, hdr::LAST_SWITCH_NS),
            last_switch_sites: u64_at(bytes, hdr::LAST_SWITCH_SITES),
            last_error: c_string(&bytes[hdr::LAST_ERROR..hdr::LAST_ERROR + 64]),
            module_count: u32_at(bytes, hdr::MODULE_COUNT).min(MAX_MODULES as u32),
            flags: u32_at(bytes, hdr::FLAGS),
            untracked_allocs: u64_at(bytes, hdr::UNTRACKED_ALLOCS),
            table_bytes: u64_at(bytes, hdr::TABLE_BYTES),
            table_objects: u64_at(bytes, hdr::TABLE_OBJECTS),
        })
    }

    /// The published modules. A module whose region is not (yet) within the
    /// bytes is an error.
    pub fn modules(&self) -> Result<Vec<Module<'a>>, TableError> {
        let mut out = Vec::new();
        for m in 0..self.module_count as usize {
            let s = MODULE_SLOTS_AT as usize + m * MODULE_SLOT_SIZE as usize;
            let sl = &self.bytes[s..s + MODULE_SLOT_SIZE as usize];
            let (to, ts) = (u64_at(sl, slot::TABLE_OFFSET) as usize, u64_at(sl, slot::TABLE_SIZE) as usize);
            let (co, cs) = (u64_at(sl, slot::COUNTERS_OFFSET) as usize, u64_at(sl, slot::COUNTERS_SIZE) as usize);
            let tb = to.checked_add(ts).and_then(|e| self.bytes.get(to..e));
            let cb = co.checked_add(cs).and_then(|e| self.bytes.get(co..e));
            let (Some(tb), Some(cb)) = (tb, cb) else {
                return Err(TableError(format!("module {m}: region outside the file (truncated snapshot?)")));
            };
            let table = Table::parse(tb).map_err(|e| TableError(format!("module {m}: {e}")))?;
            out.push(Module {
                table,
                bias: u64_at(sl, slot::BIAS),
                unloaded: u32_at(sl, slot::UNLOADED) == 1,
                on: u32_at(sl, slot::ON) == 1,
                counters: cb,
            });
        }
        Ok(out)
    }
}

/// The directory holding this user's process files: `$XDG_RUNTIME_DIR/alloctramp`
/// when that is set, else `/tmp/alloctramp-UID`.
pub fn default_dir(xdg_runtime_dir: Option<&str>, uid: u32) -> String {
    match xdg_runtime_dir {
        Some(d) if d.starts_with('/') => format!("{d}/alloctramp"),
        _ => format!("/tmp/alloctramp-{uid}"),
    }
}

/// What a clean-up needs to know of one process file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileState {
    /// The process still runs the program that wrote the file.
    pub running: bool,
    /// Profiling was on at some time ([`flags::PROFILED`]).
    pub profiled: bool,
    /// When the file was last written (any monotonic order will do).
    pub mtime: i64,
}

/// Which process files to remove: files of running processes stay; files of
/// processes that ended (or replaced their program) without ever profiling
/// go; of the others, the `keep` most recently written stay. The runtime
/// applies this when a process exits, `alloctramp clean` on request.
pub fn files_to_remove(files: &[FileState], keep: usize) -> Vec<bool> {
    let mut ended: Vec<usize> = (0..files.len()).filter(|&i| !files[i].running && files[i].profiled).collect();
    ended.sort_by_key(|&i| std::cmp::Reverse(files[i].mtime));
    let mut remove: Vec<bool> = files.iter().map(|f| !f.running && !f.profiled).collect();
    for &i in ended.iter().skip(keep) {
        remove[i] = true;
    }
    remove
}

/// How many files of ended processes the runtime keeps by default
/// (`ALLOCTRAMP_KEEP`).
pub const DEFAULT_KEEP: usize = 64;

/// File names in that directory.
pub fn counters_file_name(pid: u32) -> String {
    format!("{pid}.counters")
}
/// The optional control file a person may write for a process that
/// switches on a signal (`ALLOCTRAMP_SWITCH=signal`); the runtime never
/// creates it.
pub fn control_file_name(pid: u32) -> String {
    format!("{pid}.control")
}
