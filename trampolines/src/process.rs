//! The per-process counters file: what the runtime of a patched process
//! shares with `alloctramp report` and `alloctramp enable/disable/reset`.
//!
//! ```text
//! Header       PROC_HEADER_SIZE bytes: magic, version, pid, state, ...
//!              MAX_MODULES module slots
//! per module   a copy of its site table (page-aligned), unless the table
//!              is shared: `tables/ID.sites` beside the file
//!              its counters (page-aligned), mapped by the runtime over the
//!              module's .alloctramp.counters with MAP_SHARED|MAP_FIXED
//! callers      (once callers capture was first switched on, page-aligned)
//!              MAX_MAPS mappings of the process, then callers_slots chains
//! ```
//!
//! The runtime writes a module's table and counters region before it
//! publishes the module (a release store of `module_count`); a reader loads
//! `module_count` first. Counters are read while the process runs: a reader
//! sees each u64 either before or after an increment.

#![deny(clippy::indexing_slicing)]

use crate::layout::{CELL_SIZE, PAGE, Table, TableError};

/// Why a process file could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessFileError {
    /// No process-file magic: damaged, or another kind of file.
    NotProcessFile,
    /// Written by another version of alloctramp.
    Version { found: u32 },
    /// A module's region lies outside the bytes (a truncated copy).
    ModuleOutside { module: usize },
    /// A module's site table copy is unreadable.
    ModuleTable { module: usize, error: TableError },
    /// A module's site table is a shared table (see [`shared_table_name`])
    /// that was not read into the bytes: missing, or not the table its id
    /// names.
    SharedTable { module: usize, id: u64 },
}

impl ProcessFileError {
    /// The file (or a table in it) was written by another version.
    pub fn is_version(&self) -> bool {
        matches!(
            self,
            ProcessFileError::Version { .. } | ProcessFileError::ModuleTable { error: TableError::Version { .. }, .. }
        )
    }
}

impl std::fmt::Display for ProcessFileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessFileError::NotProcessFile => f.write_str("not an alloctramp process file"),
            ProcessFileError::Version { found } => {
                write!(f, "process file version {found}; this alloctramp reads version {PROC_VERSION}")
            }
            ProcessFileError::ModuleOutside { module } => {
                write!(f, "module {module}: region outside the file (truncated snapshot?)")
            }
            ProcessFileError::ModuleTable { module, error } => write!(f, "module {module}: {error}"),
            ProcessFileError::SharedTable { module, id } => write!(
                f,
                "module {module}: its site table, {TABLES_DIR}/{} beside the counters file, is missing or \
                 damaged (copy a process's figures with `alloctramp snapshot`, which includes its tables)",
                shared_table_name(*id)
            ),
        }
    }
}

impl std::error::Error for ProcessFileError {}
use crate::pod::{self, Pod};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

/// The value `alloctramp enable|disable|reset` sends with the control
/// signal (`sigqueue`, `si_code` SI_QUEUE): a signal carrying it only
/// carries out the request in the header, and never toggles, so that it
/// cannot turn into a toggle when another signal's handling took its
/// request first. A bare signal (`kill`) toggles, or does what the
/// control file says.
pub const REQUEST_SIGNAL_VALUE: usize = 0x6174_7271; // "atrq"

pub const PROC_MAGIC: [u8; 8] = *b"ATPROC\x00\x01";
pub const PROC_VERSION: u32 = 5;
pub const PROC_HEADER_SIZE: u64 = size_of::<ProcHeader>() as u64;
pub const MODULE_SLOT_SIZE: u64 = size_of::<ModuleSlot>() as u64;
pub const MODULE_SLOTS_AT: u64 = offset_of!(ProcHeader, modules) as u64;
pub const MAX_MODULES: u64 = (PROC_HEADER_SIZE - MODULE_SLOTS_AT) / MODULE_SLOT_SIZE;

/// The header of a process file, as the runtime maps it (shared with every
/// reader) and as a reader copies it. Every field another process may read
/// while the runtime writes it is atomic.
#[repr(C)]
pub struct ProcHeader {
    /// [`PROC_MAGIC`].
    pub magic: [u8; 8],
    /// [`PROC_VERSION`].
    pub version: AtomicU32,
    /// The process id.
    pub pid: AtomicU32,
    /// 1 while profiling is on.
    pub state: AtomicU32,
    /// The signal that makes the runtime carry out a request (0: the
    /// process listens to no signal).
    pub signal: AtomicU32,
    /// Incremented after every completed switch or reset.
    pub generation: AtomicU64,
    /// Number of published module slots (a release store, after the
    /// module's region is written).
    pub module_count: AtomicU32,
    /// 1 once the process has exited (the file is its final snapshot).
    pub exited: AtomicU32,
    /// 1 if a watcher thread waits for requests on [`wake`](Self::wake).
    pub watcher: AtomicU32,
    /// [`flags`] describing the figures.
    pub flags: AtomicU32,
    /// Time of the last reset (seconds since the epoch).
    pub reset_time: AtomicU64,
    /// Start time (seconds since the epoch).
    pub start_time: AtomicU64,
    /// The command line: argv[0], then each argument, each ended by a NUL
    /// (cut to leave a NUL at the end), NUL-padded.
    pub command: [AtomicU8; COMMAND_LEN],
    /// Nanoseconds the last switch took.
    pub last_switch_ns: AtomicU64,
    /// Sites rewritten by the last switch.
    pub last_switch_sites: AtomicU64,
    /// The last error of a switch, NUL-padded (empty: none).
    pub last_error: [AtomicU8; 64],
    /// Allocations counted but not tracked (the pointer table could not
    /// grow); they were counted as freed at once.
    pub untracked_allocs: AtomicU64,
    /// Bytes of memory the pointer table holds now.
    pub table_bytes: AtomicU64,
    /// Objects the pointer table holds now (updated as it grows and when a
    /// switch completes; exact figures are per site).
    pub table_objects: AtomicU64,
    /// The pending request ([`Request`] code; 0: none). A requester stores
    /// it, then wakes the process; the runtime takes it with a swap.
    pub request: AtomicU32,
    /// A futex word: a requester increments it and wakes its waiters
    /// (`FUTEX_WAKE`, not private: the word is in a shared file mapping);
    /// the watcher thread waits on it.
    pub wake: AtomicU32,
    /// Device and inode of the process's executable (`/proc/self/exe`)
    /// when the file was created, so that a reader can tell a process that
    /// replaced its program (`exec`) from one still running it.
    pub exe_dev: AtomicU64,
    pub exe_ino: AtomicU64,
    /// File offset of the callers region (0: none yet): [`MAX_MAPS`]
    /// [`MapEntry`]s, then `callers_slots` [`ChainSlot`]s.
    pub callers_offset: AtomicU64,
    /// Chain slots (a power of two).
    pub callers_slots: AtomicU64,
    /// Calls whose chain found no free slot (counted at their site only).
    pub callers_lost: AtomicU64,
    /// Frames recorded per chain while callers capture is on; 0: off.
    pub callers_depth: AtomicU32,
    /// Published map entries (a release store after they are written).
    pub maps_count: AtomicU32,
    /// The depth a requester asks for with [`Request::Callers`] (0: the
    /// default).
    pub callers_request_depth: AtomicU32,
    /// The sites (run-time addresses) whose chains a request 5 asks for,
    /// `callers_request_sites` of them; 0: every site.
    pub callers_request_sites: AtomicU32,
    pub callers_sites: [AtomicU64; MAX_CALLERS_SITES],
    /// When the last switch completed (seconds since the epoch; 0: none
    /// yet, or a file written before the field).
    pub last_switch_time: AtomicU64,
    /// Libraries whose rows the runtime opened from the process's unwind
    /// file ([`UnwindFileHeader`]) at the last [`Request::Callers`].
    pub unwind_file_libraries: AtomicU32,
    /// Patched modules registered but not in this file yet: a process
    /// that never profiled keeps its modules out of its file until they
    /// first switch on (they have counted nothing).
    pub pending_modules: AtomicU32,
    /// Walks that ended at rows from the unwind file because their library
    /// was unloaded, or another loaded in its place, since they were built.
    pub callers_unloaded: AtomicU64,
    /// The sites of those modules.
    pub pending_sites: AtomicU64,
    /// Fault injection specs in effect (`alloctramp fail`).
    pub fail_specs: AtomicU32,
    /// Sites of the registered modules they name, routed through the
    /// runtime: counted at start-up and at each change of specs.
    pub fail_sites: AtomicU32,
    /// The modules, [`module_count`](Self::module_count) of them published.
    pub modules: [ModuleSlot; 248],
}

/// One module's place in the process file.
#[repr(C)]
pub struct ModuleSlot {
    /// File offset and size of the module's site table copy; offset 0: the
    /// table is the shared one [`table_id`](Self::table_id) names.
    pub table_offset: AtomicU64,
    pub table_size: AtomicU64,
    /// File offset and size of the module's counters.
    pub counters_offset: AtomicU64,
    pub counters_size: AtomicU64,
    /// The load bias (run-time address minus file address).
    pub bias: AtomicU64,
    /// 1 once the module was unloaded (its figures stay).
    pub unloaded: AtomicU32,
    /// 1 while the module's sites are switched on.
    pub on: AtomicU32,
    /// The process-wide id of its site 0 (site `i` is `first_id + i`, as
    /// event traces name sites); 0: none (no live tracking, or a file
    /// written before the field).
    pub first_id: AtomicU32,
    pub reserved: [u8; 4],
    /// The [`table_id`] of the module's site table (0: none computed). With
    /// `table_offset` 0 the table is the file [`shared_table_name`] in
    /// the [`TABLES_DIR`] directory beside the process file, which every
    /// process of the same patched file shares.
    pub table_id: AtomicU64,
}

// SAFETY: repr(C), integers, atomics of integers and byte arrays only.
unsafe impl Pod for ProcHeader {}
// SAFETY: as above.
unsafe impl Pod for ModuleSlot {}

/// Every field of the header: name, offset, type as docs/formats.md gives
/// them (a test checks that document against this list).
pub const HEADER_FIELDS: &[(&str, usize, &str)] = &[
    ("magic", offset_of!(ProcHeader, magic), "[u8; 8]"),
    ("version", offset_of!(ProcHeader, version), "u32"),
    ("pid", offset_of!(ProcHeader, pid), "u32"),
    ("state", offset_of!(ProcHeader, state), "u32"),
    ("signal", offset_of!(ProcHeader, signal), "u32"),
    ("generation", offset_of!(ProcHeader, generation), "u64"),
    ("module_count", offset_of!(ProcHeader, module_count), "u32"),
    ("exited", offset_of!(ProcHeader, exited), "u32"),
    ("watcher", offset_of!(ProcHeader, watcher), "u32"),
    ("flags", offset_of!(ProcHeader, flags), "u32"),
    ("reset_time", offset_of!(ProcHeader, reset_time), "u64"),
    ("start_time", offset_of!(ProcHeader, start_time), "u64"),
    ("command", offset_of!(ProcHeader, command), "[u8; 112]"),
    ("last_switch_ns", offset_of!(ProcHeader, last_switch_ns), "u64"),
    ("last_switch_sites", offset_of!(ProcHeader, last_switch_sites), "u64"),
    ("last_error", offset_of!(ProcHeader, last_error), "[u8; 64]"),
    ("untracked_allocs", offset_of!(ProcHeader, untracked_allocs), "u64"),
    ("table_bytes", offset_of!(ProcHeader, table_bytes), "u64"),
    ("table_objects", offset_of!(ProcHeader, table_objects), "u64"),
    ("request", offset_of!(ProcHeader, request), "u32"),
    ("wake", offset_of!(ProcHeader, wake), "u32"),
    ("exe_dev", offset_of!(ProcHeader, exe_dev), "u64"),
    ("exe_ino", offset_of!(ProcHeader, exe_ino), "u64"),
    ("callers_offset", offset_of!(ProcHeader, callers_offset), "u64"),
    ("callers_slots", offset_of!(ProcHeader, callers_slots), "u64"),
    ("callers_lost", offset_of!(ProcHeader, callers_lost), "u64"),
    ("callers_depth", offset_of!(ProcHeader, callers_depth), "u32"),
    ("maps_count", offset_of!(ProcHeader, maps_count), "u32"),
    ("callers_request_depth", offset_of!(ProcHeader, callers_request_depth), "u32"),
    ("callers_request_sites", offset_of!(ProcHeader, callers_request_sites), "u32"),
    ("callers_sites", offset_of!(ProcHeader, callers_sites), "[u64; 16]"),
    ("last_switch_time", offset_of!(ProcHeader, last_switch_time), "u64"),
    ("unwind_file_libraries", offset_of!(ProcHeader, unwind_file_libraries), "u32"),
    ("pending_modules", offset_of!(ProcHeader, pending_modules), "u32"),
    ("callers_unloaded", offset_of!(ProcHeader, callers_unloaded), "u64"),
    ("pending_sites", offset_of!(ProcHeader, pending_sites), "u64"),
    ("fail_specs", offset_of!(ProcHeader, fail_specs), "u32"),
    ("fail_sites", offset_of!(ProcHeader, fail_sites), "u32"),
    ("modules", offset_of!(ProcHeader, modules), "[slot; 248]"),
];

/// Every field of a module slot, likewise.
pub const SLOT_FIELDS: &[(&str, usize, &str)] = &[
    ("table_offset", offset_of!(ModuleSlot, table_offset), "u64"),
    ("table_size", offset_of!(ModuleSlot, table_size), "u64"),
    ("counters_offset", offset_of!(ModuleSlot, counters_offset), "u64"),
    ("counters_size", offset_of!(ModuleSlot, counters_size), "u64"),
    ("bias", offset_of!(ModuleSlot, bias), "u64"),
    ("unloaded", offset_of!(ModuleSlot, unloaded), "u32"),
    ("on", offset_of!(ModuleSlot, on), "u32"),
    ("first_id", offset_of!(ModuleSlot, first_id), "u32"),
    ("reserved", offset_of!(ModuleSlot, reserved), "[u8; 4]"),
    ("table_id", offset_of!(ModuleSlot, table_id), "u64"),
];

// The layout is a file format: these offsets are documented and must not
// move.
const _: () = {
    assert!(size_of::<ProcHeader>() == 16384);
    assert!(size_of::<ModuleSlot>() == 64);
    assert!(offset_of!(ProcHeader, generation) == 24);
    assert!(offset_of!(ProcHeader, command) == 64);
    assert!(offset_of!(ProcHeader, last_error) == 192);
    assert!(offset_of!(ProcHeader, untracked_allocs) == 256);
    assert!(offset_of!(ProcHeader, request) == 280);
    assert!(offset_of!(ProcHeader, exe_ino) == 296);
    assert!(offset_of!(ProcHeader, modules) == 512);
    assert!(offset_of!(ModuleSlot, unloaded) == 40);
    assert!(offset_of!(ModuleSlot, table_id) == 56);
    assert!(offset_of!(ProcHeader, callers_offset) == 304 && offset_of!(ProcHeader, callers_request_depth) == 336);
    assert!(offset_of!(ProcHeader, callers_sites) == 344);
    assert!(size_of::<ChainSlot>() == 96 && size_of::<MapEntry>() == 256);
};

/// Sites a request for call chains may name (more: every site).
pub const MAX_CALLERS_SITES: usize = 16;

/// Mappings of the process recorded in the callers region (from
/// `/proc/self/maps`: file-backed executable ones), so that a reader names
/// the frames of a chain after the process is gone.
pub const MAX_MAPS: u64 = 512;
/// Chain slots of a callers region.
pub const CALLERS_SLOTS: u64 = 1 << 16;

/// One mapping: run-time range, file offset, path.
#[repr(C)]
pub struct MapEntry {
    pub start: AtomicU64,
    pub end: AtomicU64,
    pub offset: AtomicU64,
    /// NUL-padded path.
    pub path: [AtomicU8; 232],
}

/// One distinct call chain that reached a site. `key` is written last (a
/// release store) once the other identity fields are: 0 empty, 1 being
/// written, otherwise a hash of the identity. A reader skips slots whose
/// key is 0 or 1, and adds up slots with the same identity (two threads
/// may record the same new chain at once).
#[repr(C)]
pub struct ChainSlot {
    pub key: AtomicU64,
    /// Module (its index in the process file) and site index.
    pub module: AtomicU32,
    pub site: AtomicU32,
    /// Return addresses, innermost first (run-time addresses); 0 ends a
    /// chain shorter than the depth.
    pub frames: [AtomicU64; crate::layout::capture::MAX_DEPTH],
    pub calls: AtomicU64,
    /// Bytes requested (allocations and reallocs).
    pub bytes: AtomicU64,
}

// SAFETY: repr(C), atomics of integers only.
unsafe impl Pod for ChainSlot {}
// SAFETY: as above.
unsafe impl Pod for MapEntry {}

/// Every field of a map entry and of a chain slot, likewise.
pub const MAP_FIELDS: &[(&str, usize, &str)] = &[
    ("start", offset_of!(MapEntry, start), "u64"),
    ("end", offset_of!(MapEntry, end), "u64"),
    ("offset", offset_of!(MapEntry, offset), "u64"),
    ("path", offset_of!(MapEntry, path), "[u8; 232]"),
];
pub const CHAIN_FIELDS: &[(&str, usize, &str)] = &[
    ("key", offset_of!(ChainSlot, key), "u64"),
    ("module", offset_of!(ChainSlot, module), "u32"),
    ("site", offset_of!(ChainSlot, site), "u32"),
    ("frames", offset_of!(ChainSlot, frames), "[u64; 8]"),
    ("calls", offset_of!(ChainSlot, calls), "u64"),
    ("bytes", offset_of!(ChainSlot, bytes), "u64"),
];

/// Bytes of a callers region.
pub fn callers_region_size(slots: u64) -> u64 {
    MAX_MAPS * size_of::<MapEntry>() as u64 + slots * size_of::<ChainSlot>() as u64
}

impl ProcHeader {
    /// A NUL-padded text field.
    pub fn text(field: &[AtomicU8]) -> String {
        let b: Vec<u8> = field.iter().map(|c| c.load(Ordering::Relaxed)).take_while(|&c| c != 0).collect();
        String::from_utf8_lossy(&b).into_owned()
    }

    /// The arguments of a command line field ([`ProcHeader::command`]):
    /// the NUL-ended strings after the first (empty ones at the end are
    /// padding).
    pub fn arguments(field: &[AtomicU8]) -> Vec<String> {
        let b: Vec<u8> = field.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let mut parts: Vec<String> =
            b.split(|&c| c == 0).skip(1).map(|p| String::from_utf8_lossy(p).into_owned()).collect();
        while parts.last().is_some_and(|p| p.is_empty()) {
            parts.pop();
        }
        parts
    }

    /// Stores `text` into a NUL-padded field (cut to leave one NUL).
    pub fn set_text(field: &[AtomicU8], text: &[u8]) {
        for (i, c) in field.iter().enumerate() {
            let v = if i + 1 < field.len() { text.get(i).copied().unwrap_or(0) } else { 0 };
            c.store(v, Ordering::Relaxed);
        }
    }

    /// The published module slots.
    pub fn published(&self) -> &[ModuleSlot] {
        let n = (self.module_count.load(Ordering::Acquire) as usize).min(self.modules.len());
        self.modules.get(..n).unwrap_or_default()
    }
}

/// A command line for people to read: `command` and `arguments` separated
/// by spaces, an argument quoted as a shell would need it (`'...'`) when
/// it is empty or holds white space, quotes or backslashes.
pub fn command_line(command: &str, arguments: &[String]) -> String {
    let mut s = command.to_string();
    for a in arguments {
        s.push(' ');
        if !a.is_empty() && !a.chars().any(|c| c.is_whitespace() || matches!(c, '\'' | '"' | '\\' | '$' | '`')) {
            s.push_str(a);
        } else {
            s.push('\'');
            s.push_str(&a.replace('\'', "'\\''"));
            s.push('\'');
        }
    }
    s
}

/// What a requester asks of a running process (the header's
/// [`request`](ProcHeader::request) field).
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
    /// Record the call chains of every site (depth from
    /// `callers_request_depth`).
    Callers = 5,
    /// Stop recording call chains.
    NoCallers = 6,
    /// Replace the fault injection specs with the fail file's
    /// (`PID.fail` beside the process file; missing or empty: none).
    Fail = 7,
    /// Record every allocation, free and realloc as an event in the trace
    /// file (`PID.trace` beside the process file; see `trace`), and switch
    /// profiling on.
    Trace = 8,
    /// Stop recording events.
    NoTrace = 9,
}

impl Request {
    pub fn from_code(code: u32) -> Option<Request> {
        match code {
            1 => Some(Request::On),
            2 => Some(Request::Off),
            3 => Some(Request::OffNow),
            4 => Some(Request::Reset),
            5 => Some(Request::Callers),
            6 => Some(Request::NoCallers),
            7 => Some(Request::Fail),
            8 => Some(Request::Trace),
            9 => Some(Request::NoTrace),
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
            Request::Callers => "callers",
            Request::NoCallers => "no callers",
            Request::Fail => "fail",
            Request::Trace => "trace",
            Request::NoTrace => "no trace",
        }
    }

    /// Parses a control file's words (surrounding white space ignored).
    pub fn parse(text: &[u8]) -> Option<Request> {
        let t = text.trim_ascii();
        [
            Request::On,
            Request::Off,
            Request::OffNow,
            Request::Reset,
            Request::Callers,
            Request::NoCallers,
            Request::Trace,
            Request::NoTrace,
        ]
        .into_iter()
        .find(|r| r.text().as_bytes() == t)
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
    /// Profiling was switched on at some time in this process: the file
    /// holds figures. A process that never switched on removes its file
    /// when it exits, and `alloctramp clean` removes such files left by
    /// processes that could not (killed, or ended with `_exit`).
    pub const PROFILED: u32 = 16;
}

/// Page-aligned layout of a module's region in the file.
pub fn module_region(table_size: u64, counters_size: u64, at: u64) -> (u64, u64, u64) {
    let table_off = at.div_ceil(PAGE) * PAGE;
    let counters_off = (table_off + table_size).div_ceil(PAGE) * PAGE;
    (table_off, counters_off, counters_off + counters_size)
}

pub use crate::layout::Cell;

/// A call chain as read from a process file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub module: u32,
    pub site: u32,
    /// Return addresses, innermost first.
    pub frames: Vec<u64>,
    pub calls: u64,
    pub bytes: u64,
}

/// A mapping of the process as recorded in the callers region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Map {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub path: String,
}

/// One module as read from a process file.
pub struct Module<'a> {
    pub table: Table<'a>,
    pub bias: u64,
    pub unloaded: bool,
    pub on: bool,
    /// See [`ModuleSlot::first_id`].
    pub first_id: u32,
    counters: &'a [u8],
}

impl Module<'_> {
    /// The counters of site `i`, summed over all shards.
    pub fn cell(&self, i: usize) -> Cell {
        let h = &self.table.header;
        let mut c = Cell::default();
        for s in 0..h.shard_count as usize {
            let at = s * h.shard_stride as usize + i * CELL_SIZE;
            let Some(shard) = pod::read::<Cell>(self.counters, at) else { break };
            c.add(&shard);
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
    /// argv[0].
    pub command: String,
    /// The other arguments (as many as the header holds).
    pub arguments: Vec<String>,
    pub last_error: String,
    pub module_count: u32,
    /// Modules registered but not in the file yet, and their sites (see
    /// [`ProcHeader::pending_modules`]).
    pub pending_modules: u32,
    pub pending_sites: u64,
    pub last_switch_ns: u64,
    pub last_switch_sites: u64,
    pub last_switch_time: u64,
    /// [`flags`] bits.
    pub flags: u32,
    pub untracked_allocs: u64,
    pub table_bytes: u64,
    pub table_objects: u64,
    /// Seconds since the epoch (0: unknown).
    pub start_time: u64,
    pub reset_time: u64,
    /// Device and inode of the process's executable.
    pub exe: (u64, u64),
    /// The header as read.
    pub header: Box<ProcHeader>,
}

impl<'a> ProcessFile<'a> {
    /// The command line for people to read (see [`command_line`]).
    pub fn command_line(&self) -> String {
        command_line(&self.command, &self.arguments)
    }

    /// Live tracking was on in this process: live figures are meaningful.
    pub fn live(&self) -> bool {
        self.flags & flags::LIVE != 0
    }

    pub fn parse(bytes: &'a [u8]) -> Result<ProcessFile<'a>, ProcessFileError> {
        let Some(h) = crate::pod::copy::<ProcHeader>(bytes).filter(|h| h.magic == PROC_MAGIC) else {
            return Err(ProcessFileError::NotProcessFile);
        };
        let v = h.version.load(Ordering::Relaxed);
        if v != PROC_VERSION {
            return Err(ProcessFileError::Version { found: v });
        }
        let get32 = |a: &AtomicU32| a.load(Ordering::Relaxed);
        let get64 = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Ok(ProcessFile {
            bytes,
            pid: get32(&h.pid),
            on: get32(&h.state) == 1,
            signal: get32(&h.signal),
            generation: get64(&h.generation),
            exited: get32(&h.exited) == 1,
            watcher: get32(&h.watcher) == 1,
            command: ProcHeader::text(&h.command),
            arguments: ProcHeader::arguments(&h.command),
            last_switch_ns: get64(&h.last_switch_ns),
            last_switch_sites: get64(&h.last_switch_sites),
            last_switch_time: get64(&h.last_switch_time),
            last_error: ProcHeader::text(&h.last_error),
            module_count: h.published().len() as u32,
            pending_modules: get32(&h.pending_modules),
            pending_sites: get64(&h.pending_sites),
            flags: get32(&h.flags),
            untracked_allocs: get64(&h.untracked_allocs),
            table_bytes: get64(&h.table_bytes),
            table_objects: get64(&h.table_objects),
            start_time: get64(&h.start_time),
            reset_time: get64(&h.reset_time),
            exe: (get64(&h.exe_dev), get64(&h.exe_ino)),
            header: h,
        })
    }

    /// The call chains recorded (callers capture), the slots of one chain
    /// added up, in no particular order. Empty when capture never ran or
    /// the region is not within the bytes.
    pub fn chains(&self) -> Vec<Chain> {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (at, slots) = (get(&self.header.callers_offset), get(&self.header.callers_slots));
        if at == 0 {
            return Vec::new();
        }
        let Some(first) = at.checked_add(MAX_MAPS * size_of::<MapEntry>() as u64) else { return Vec::new() };
        let mut merged: std::collections::HashMap<(u32, u32, Vec<u64>), (u64, u64)> = Default::default();
        for i in 0..slots.min(1 << 24) {
            let Some(off) = first.checked_add(i * size_of::<ChainSlot>() as u64).and_then(|o| usize::try_from(o).ok())
            else {
                break;
            };
            let Some(s) = crate::pod::copy::<ChainSlot>(self.bytes.get(off..).unwrap_or_default()) else { break };
            if get(&s.key) <= 1 {
                continue;
            }
            let frames: Vec<u64> = s.frames.iter().map(get).take_while(|&f| f != 0).collect();
            let e =
                merged.entry((s.module.load(Ordering::Relaxed), s.site.load(Ordering::Relaxed), frames)).or_default();
            e.0 = e.0.wrapping_add(get(&s.calls));
            e.1 = e.1.wrapping_add(get(&s.bytes));
        }
        merged
            .into_iter()
            .map(|((module, site, frames), (calls, bytes))| Chain { module, site, frames, calls, bytes })
            .collect()
    }

    /// The mappings recorded for naming the frames of chains: of entries
    /// that overlap, the last recorded (the runtime appends what changed).
    pub fn maps(&self) -> Vec<Map> {
        let at = self.header.callers_offset.load(Ordering::Relaxed);
        let n = u64::from(self.header.maps_count.load(Ordering::Acquire)).min(MAX_MAPS);
        if at == 0 {
            return Vec::new();
        }
        let all: Vec<Map> = (0..n)
            .filter_map(|i| {
                let off = usize::try_from(at.checked_add(i * size_of::<MapEntry>() as u64)?).ok()?;
                let m = crate::pod::copy::<MapEntry>(self.bytes.get(off..)?)?;
                let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
                Some(Map {
                    start: get(&m.start),
                    end: get(&m.end),
                    offset: get(&m.offset),
                    path: ProcHeader::text(&m.path),
                })
            })
            .collect();
        all.iter()
            .enumerate()
            .filter(|(i, m)| !all.iter().skip(i + 1).any(|l| l.start < m.end && m.start < l.end))
            .map(|(_, m)| m.clone())
            .collect()
    }

    /// The published modules. A module whose region is not (yet) within the
    /// bytes is an error.
    pub fn modules(&self) -> Result<Vec<Module<'a>>, ProcessFileError> {
        let mut out = Vec::new();
        for (m, sl) in self.header.published().iter().enumerate() {
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as usize;
            let (to, ts) = (get(&sl.table_offset), get(&sl.table_size));
            if to == 0 {
                return Err(ProcessFileError::SharedTable { module: m, id: sl.table_id.load(Ordering::Relaxed) });
            }
            let (co, cs) = (get(&sl.counters_offset), get(&sl.counters_size));
            let tb = to.checked_add(ts).and_then(|e| self.bytes.get(to..e));
            let cb = co.checked_add(cs).and_then(|e| self.bytes.get(co..e));
            let (Some(tb), Some(cb)) = (tb, cb) else {
                return Err(ProcessFileError::ModuleOutside { module: m });
            };
            let table = Table::parse(tb).map_err(|error| ProcessFileError::ModuleTable { module: m, error })?;
            out.push(Module {
                table,
                bias: sl.bias.load(Ordering::Relaxed),
                unloaded: sl.unloaded.load(Ordering::Relaxed) == 1,
                on: sl.on.load(Ordering::Relaxed) == 1,
                first_id: sl.first_id.load(Ordering::Relaxed),
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

/// The directory, beside the process files, of the site tables they share
/// (see [`ModuleSlot::table_id`]).
pub const TABLES_DIR: &str = "tables";

/// The largest shared table a reader reads (a table takes about 60 bytes
/// a site: this is millions of sites).
pub const MAX_SHARED_TABLE: u64 = 1 << 30;

/// The file name of the shared site table with id `id` in [`TABLES_DIR`].
pub fn shared_table_name(id: u64) -> String {
    format!("{id:016x}.sites")
}

/// The id of a site table: a 64-bit hash of its bytes, never 0. Four lanes
/// of 8-byte little-endian words (the last block zero-padded), each
/// `lane = rotl(mul(lane ^ word, K[i]), 31)` from `K[i]`; then the length
/// and the lanes folded together. Fast enough for every process to compute
/// at start-up (about 40 us for a table of 1 MB); not a defence against
/// a forged table, which only a user who can write the directory could
/// place there.
pub fn table_id(bytes: &[u8]) -> u64 {
    const K: [u64; 4] = [0x9e37_79b9_7f4a_7c15, 0xc2b2_ae3d_27d4_eb4f, 0x1656_67b1_9e37_79f9, 0x85eb_ca77_c2b2_ae63];
    let mut lanes = K;
    let mix = |lanes: &mut [u64; 4], block: &[u8]| {
        for ((lane, k), word) in lanes.iter_mut().zip(K).zip(block.chunks_exact(8)) {
            let w = u64::from_le_bytes(word.try_into().unwrap_or_default());
            *lane = (*lane ^ w).wrapping_mul(k).rotate_left(31);
        }
    };
    let mut blocks = bytes.chunks_exact(32);
    for block in &mut blocks {
        mix(&mut lanes, block);
    }
    let rest = blocks.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 32];
        for (d, &b) in last.iter_mut().zip(rest) {
            *d = b;
        }
        mix(&mut lanes, &last);
    }
    let mut h = bytes.len() as u64;
    for lane in lanes {
        h = (h ^ lane).wrapping_mul(K[0]).rotate_left(27);
    }
    h ^= h >> 31;
    h = h.wrapping_mul(K[1]);
    h ^= h >> 29;
    h.max(1)
}

/// The shared tables a process file's published modules name: (module,
/// id, size) of each whose table is not in the file.
pub fn shared_tables(bytes: &[u8]) -> Vec<(usize, u64, u64)> {
    let Some(h) = crate::pod::copy::<ProcHeader>(bytes)
        .filter(|h| h.magic == PROC_MAGIC && h.version.load(Ordering::Relaxed) == PROC_VERSION)
    else {
        return Vec::new();
    };
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    h.published()
        .iter()
        .enumerate()
        .filter(|(_, sl)| get(&sl.table_offset) == 0)
        .map(|(m, sl)| (m, get(&sl.table_id), get(&sl.table_size)))
        .collect()
}

/// Reads shared tables into the bytes of a process file (of this version),
/// so that they read as one self-contained file: each table `table(id,
/// size)` gives whose bytes have that id and size goes after the end,
/// page-aligned, and its modules' slots point at it (keeping the id). A
/// table it does not give stays shared: [`ProcessFile::modules`] then
/// says which is missing. Bytes that end before a region their header
/// names (a module that joined the file after the bytes were read, a cut
/// copy) get no table: what went after their end would read as that
/// region, and the region's error says the copy is short.
pub fn read_in_shared_tables(bytes: &mut Vec<u8>, mut table: impl FnMut(u64, u64) -> Option<Vec<u8>>) {
    if !regions_within(bytes) {
        return;
    }
    for (m, id, size) in shared_tables(bytes).into_iter().filter(|t| t.2 <= MAX_SHARED_TABLE) {
        let Some(t) = table(id, size).filter(|t| t.len() as u64 == size && table_id(t) == id) else { continue };
        let at = (bytes.len() as u64).div_ceil(PAGE) * PAGE;
        let slot = MODULE_SLOTS_AT as usize + m * MODULE_SLOT_SIZE as usize + offset_of!(ModuleSlot, table_offset);
        let Some(field) = bytes.get_mut(slot..slot + 8) else { continue };
        field.copy_from_slice(&at.to_le_bytes());
        bytes.resize(at as usize, 0);
        bytes.extend_from_slice(&t);
    }
}

/// Whether every region the header of the process file in `bytes` names
/// (each published module's counters and table copy, the callers region)
/// ends within them.
fn regions_within(bytes: &[u8]) -> bool {
    let Some(h) = crate::pod::copy::<ProcHeader>(bytes) else { return false };
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let within = |at: u64, size: u64| at.checked_add(size).is_some_and(|end| end <= bytes.len() as u64);
    let callers = get(&h.callers_offset);
    h.published().iter().all(|sl| {
        within(get(&sl.counters_offset), get(&sl.counters_size))
            && (get(&sl.table_offset) == 0 || within(get(&sl.table_offset), get(&sl.table_size)))
    }) && (callers == 0 || within(callers, callers_region_size(get(&h.callers_slots).min(1 << 24))))
}

/// The ids of the site tables a process file's published modules name,
/// shared or read in (see [`ModuleSlot::table_id`]).
pub fn table_ids(bytes: &[u8]) -> Vec<u64> {
    let Some(h) = crate::pod::copy::<ProcHeader>(bytes).filter(|h| h.magic == PROC_MAGIC) else {
        return Vec::new();
    };
    if h.version.load(Ordering::Relaxed) != PROC_VERSION {
        return Vec::new();
    }
    h.published().iter().map(|sl| sl.table_id.load(Ordering::Relaxed)).filter(|&id| id != 0).collect()
}

/// The id a shared table's file name gives ([`shared_table_name`]).
pub fn shared_table_id(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".sites").filter(|h| h.len() == 16)?;
    u64::from_str_radix(hex, 16).ok().filter(|&id| id != 0)
}

/// Seconds a shared table stays after it was last used (written, or found
/// by a process starting) although no process file names it: a process
/// that has just found it names it in its file a moment later.
pub const TABLE_GRACE_SECS: i64 = 60;

/// Which shared tables to remove, given each one's id and when it was last
/// used (seconds since the epoch), the ids the process files that stay
/// name, and the time now: those none of them names, unused for
/// [`TABLE_GRACE_SECS`].
pub fn tables_to_remove(tables: &[(u64, i64)], named: &[u64], now: i64) -> Vec<bool> {
    tables.iter().map(|&(id, used)| !named.contains(&id) && now.saturating_sub(used) >= TABLE_GRACE_SECS).collect()
}

/// What a clean-up needs to know of one process file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileState {
    /// The process still runs the program that wrote the file.
    pub running: bool,
    /// Profiling was on at some time ([`flags::PROFILED`]).
    pub profiled: bool,
    /// Its process ended without exiting (it replaced its program, or was
    /// killed) and counted nothing ([`counted_nothing`]): a forked child
    /// that ran another program at once leaves such a file.
    pub empty: bool,
    /// When the file was last written (any monotonic order will do).
    pub mtime: i64,
}

/// Which process files to remove: files of running processes stay; files of
/// processes that ended (or replaced their program) without ever profiling,
/// or without counting anything before they replaced their program, go; of
/// the others, the `keep` most recently written stay. The runtime applies
/// this when a process exits, `alloctramp clean` on request.
pub fn files_to_remove(files: &[FileState], keep: usize) -> Vec<bool> {
    let gone = |f: &FileState| !f.running && (!f.profiled || f.empty);
    let mut ended: Vec<(usize, i64)> =
        files.iter().enumerate().filter(|(_, f)| !f.running && !gone(f)).map(|(i, f)| (i, f.mtime)).collect();
    ended.sort_by_key(|&(_, mtime)| std::cmp::Reverse(mtime));
    let mut remove: Vec<bool> = files.iter().map(gone).collect();
    for &(i, _) in ended.iter().skip(keep) {
        if let Some(r) = remove.get_mut(i) {
            *r = true;
        }
    }
    remove
}

/// Where a process file's counters are (file offset and size, one region per
/// published module), read from its first [`PROC_HEADER_SIZE`] bytes: all
/// zero in a process that counted nothing. None: not a process file of this
/// version, or one whose process counted an allocation it could not track.
pub fn counters_regions(header: &[u8]) -> Option<Vec<(u64, u64)>> {
    let h = crate::pod::copy::<ProcHeader>(header)?;
    if h.magic != PROC_MAGIC || h.version.load(Ordering::Relaxed) != PROC_VERSION {
        return None;
    }
    if h.untracked_allocs.load(Ordering::Relaxed) != 0 {
        return None;
    }
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Some(h.published().iter().map(|s| (get(&s.counters_offset), get(&s.counters_size))).collect())
}

/// Whether the process file in `bytes` counted nothing: every counter of
/// every module is zero (a counter only grows, so any call leaves one that
/// is not). False for bytes that are not a whole process file.
pub fn counted_nothing(bytes: &[u8]) -> bool {
    counters_regions(bytes).is_some_and(|regions| {
        regions.iter().all(|&(at, size)| {
            let range = usize::try_from(at).ok().zip(usize::try_from(size).ok());
            range.and_then(|(a, n)| bytes.get(a..a.checked_add(n)?)).is_some_and(|cells| cells.iter().all(|&b| b == 0))
        })
    })
}

/// What the first [`MODULE_SLOTS_AT`] bytes of a process file say about its
/// process, read without copying the whole header (a clean-up reads many).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    pub version: u32,
    pub pid: u32,
    pub exited: bool,
    pub flags: u32,
    /// Device and inode of the executable (0, 0 in another version).
    pub exe: (u64, u64),
}

impl Summary {
    pub fn read(head: &[u8]) -> Option<Summary> {
        if head.len() < MODULE_SLOTS_AT as usize || head.get(..8)? != PROC_MAGIC {
            return None;
        }
        let u32_at = |at: usize| pod::read::<u32>(head, at);
        let u64_at = |at: usize| pod::read::<u64>(head, at);
        let version = u32_at(offset_of!(ProcHeader, version))?;
        let current = version == PROC_VERSION;
        Some(Summary {
            version,
            pid: u32_at(offset_of!(ProcHeader, pid))?,
            exited: u32_at(offset_of!(ProcHeader, exited))? == 1,
            flags: u32_at(offset_of!(ProcHeader, flags))?,
            exe: if current {
                (u64_at(offset_of!(ProcHeader, exe_dev))?, u64_at(offset_of!(ProcHeader, exe_ino))?)
            } else {
                (0, 0)
            },
        })
    }
}

/// How many files of ended processes the runtime keeps by default
/// (`ALLOCTRAMP_KEEP`).
pub const DEFAULT_KEEP: usize = 64;

/// How many files of ended processes a runtime's prune leaves, for a bound
/// of `keep`: an eighth fewer (rounded down), so that a storm of short
/// processes that profile (a build, `git gc`) reads the directory's files
/// about once every `keep / 8` exits rather than at each one.
/// `alloctramp clean --keep N` keeps N.
pub fn prune_to(keep: usize) -> usize {
    keep - keep / 8
}

/// File names in that directory.
pub fn counters_file_name(pid: u32) -> String {
    format!("{pid}.counters")
}
/// Unwind rows `alloctramp callers PID on` writes for the libraries the
/// process has loaded without rows (see [`UnwindFileHeader`]).
pub fn unwind_file_name(pid: u32) -> String {
    format!("{pid}.unwind")
}

/// The fail file `alloctramp fail` writes next to a process's counters
/// file: fault injection specs (`SPEC;SPEC...`, text, at most
/// [`crate::fault::MAX_TEXT`] bytes), which a [`Request::Fail`] puts in
/// effect.
pub fn fail_file_name(pid: u32) -> String {
    format!("{pid}.fail")
}
/// The optional control file a person may write for a process that
/// switches on a signal (`ALLOCTRAMP_SWITCH=signal`); the runtime never
/// creates it.
pub fn control_file_name(pid: u32) -> String {
    format!("{pid}{CONTROL_SUFFIX}")
}

/// What follows the pid in a control file's name.
pub const CONTROL_SUFFIX: &str = ".control";

/// Bytes of the command line a process file keeps ([`ProcHeader::command`]).
pub const COMMAND_LEN: usize = 112;

/// The unwind file's magic and version.
pub const UNWIND_MAGIC: [u8; 8] = *b"ATUNWD\x00\x01";
pub const UNWIND_VERSION: u32 = 1;
/// Where the unwind file's directory starts.
pub const UNWIND_DIR_AT: u64 = 64;
/// The largest unwind file the runtime maps.
pub const MAX_UNWIND_FILE: u64 = 1 << 30;

/// The header of a process's unwind file (`PID.unwind`, next to its
/// counters file): rows for libraries the process loaded without carried
/// rows (`dlopen`), built from their `.eh_frame` by `alloctramp callers
/// PID on` and mapped read-only by the runtime when it carries out that
/// request. The directory at `dir_offset` is the one a patched executable
/// carries ([`crate::layout::ForeignUnwind`] entries, rows at offsets from
/// the directory's start); each entry's `name` is an offset into the
/// strings, NUL-terminated paths as the process's maps name the library.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct UnwindFileHeader {
    /// [`UNWIND_MAGIC`].
    pub magic: [u8; 8],
    /// [`UNWIND_VERSION`].
    pub version: u32,
    /// The process the rows were built for.
    pub pid: u32,
    /// Directory entries.
    pub count: u32,
    pub reserved: u32,
    /// [`UNWIND_DIR_AT`]; the directory's bytes, rows included.
    pub dir_offset: u64,
    pub dir_size: u64,
    pub strings_offset: u64,
    pub strings_size: u64,
    pub reserved2: u64,
}

// SAFETY: repr(C) integers and byte arrays, no padding (size asserted).
unsafe impl Pod for UnwindFileHeader {}
const _: () = assert!(size_of::<UnwindFileHeader>() == 64);

/// Every field of the unwind file's header, likewise.
pub const UNWIND_FIELDS: &[(&str, usize, &str)] = &[
    ("magic", offset_of!(UnwindFileHeader, magic), "[u8; 8]"),
    ("version", offset_of!(UnwindFileHeader, version), "u32"),
    ("pid", offset_of!(UnwindFileHeader, pid), "u32"),
    ("count", offset_of!(UnwindFileHeader, count), "u32"),
    ("dir_offset", offset_of!(UnwindFileHeader, dir_offset), "u64"),
    ("dir_size", offset_of!(UnwindFileHeader, dir_size), "u64"),
    ("strings_offset", offset_of!(UnwindFileHeader, strings_offset), "u64"),
    ("strings_size", offset_of!(UnwindFileHeader, strings_size), "u64"),
];

/// Serializes the unwind file of process `pid` for `libraries`.
pub fn encode_unwind_file(pid: u32, libraries: &[crate::layout::ForeignRows]) -> Vec<u8> {
    let mut strings = crate::layout::Strings::default();
    for f in libraries {
        strings.add(&f.path);
    }
    let dir = crate::layout::encode_foreign(libraries, |f| strings.offset_of(&f.path).unwrap_or(0));
    let h = UnwindFileHeader {
        magic: UNWIND_MAGIC,
        version: UNWIND_VERSION,
        pid,
        count: libraries.len() as u32,
        dir_offset: UNWIND_DIR_AT,
        dir_size: dir.len() as u64,
        strings_offset: UNWIND_DIR_AT + dir.len() as u64,
        strings_size: strings.len() as u64,
        ..Default::default()
    };
    let mut b = Vec::with_capacity(h.strings_offset as usize + strings.len());
    b.extend_from_slice(crate::pod::bytes_of(&h));
    b.extend_from_slice(&dir);
    b.extend_from_slice(strings.data());
    b
}

/// The header of an unwind file, if its magic, version and regions are
/// sound for `len` bytes.
pub fn unwind_file_header(bytes: &[u8]) -> Option<UnwindFileHeader> {
    let h = crate::pod::copy::<UnwindFileHeader>(bytes)?;
    let len = bytes.len() as u64;
    let within = |at: u64, size: u64| at.checked_add(size).is_some_and(|end| end <= len);
    (h.magic == UNWIND_MAGIC
        && h.version == UNWIND_VERSION
        && h.dir_offset == UNWIND_DIR_AT
        && within(h.dir_offset, h.dir_size)
        && h.strings_offset >= h.dir_offset + h.dir_size
        && within(h.strings_offset, h.strings_size)
        && u64::from(h.count) * size_of::<crate::layout::ForeignUnwind>() as u64 <= h.dir_size)
        .then_some(*h)
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::layout::tests::{documented, fields, formats_md};

    #[test]
    fn an_unwind_file_reads_back_and_a_damaged_one_does_not() {
        use crate::layout::{ForeignRows, UnwindRow};
        let row = |addr| UnwindRow { addr, kind: crate::layout::unwind::RSP, cfa_offset: 8, ..Default::default() };
        let libs = [
            ForeignRows { build_id: vec![1; 20], path: "/lib/a.so".into(), rows: vec![row(0x1000), row(0x1010)] },
            ForeignRows { build_id: vec![2; 8], path: "/lib/b.so".into(), rows: vec![row(0x2000)] },
        ];
        let b = encode_unwind_file(42, &libs);
        let h = unwind_file_header(&b).expect("sound");
        assert_eq!((h.pid, h.count, h.dir_offset), (42, 2, UNWIND_DIR_AT));
        let strings = &b[h.strings_offset as usize..][..h.strings_size as usize];
        let dir = &b[h.dir_offset as usize..][..h.dir_size as usize];
        for (k, lib) in libs.iter().enumerate() {
            let e = *crate::pod::copy::<crate::layout::ForeignUnwind>(&dir[k * 40..]).unwrap();
            assert_eq!(&e.build_id[..e.build_id_len as usize], &lib.build_id[..]);
            assert_eq!(e.count as usize, lib.rows.len());
            let name = &strings[e.name as usize..];
            assert_eq!(&name[..name.iter().position(|&c| c == 0).unwrap()], lib.path.as_bytes());
            let first = *crate::pod::copy::<UnwindRow>(&dir[e.rows_offset as usize..]).unwrap();
            assert_eq!(first, lib.rows[0]);
        }
        assert!(unwind_file_header(&b[..b.len() - 1]).is_none(), "truncated");
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(unwind_file_header(&bad).is_none(), "magic");
        let mut bad = b.clone();
        bad[16] = 200;
        assert!(unwind_file_header(&bad).is_none(), "more entries than the directory holds");
    }

    #[test]
    fn the_documented_process_file_is_the_struct() {
        let doc = formats_md();
        assert!(doc.contains(&format!("## The process counters file (`PID.counters`, version {PROC_VERSION})")));
        assert_eq!(documented(&doc, "## The process counters file"), fields(HEADER_FIELDS));
        assert_eq!(documented(&doc, "Module slot (64 bytes)"), fields(SLOT_FIELDS));
        assert_eq!(documented(&doc, "Map entry (256 bytes)"), fields(MAP_FIELDS));
        assert_eq!(documented(&doc, "Chain slot (96 bytes)"), fields(CHAIN_FIELDS));
        assert!(doc.contains(&format!("## The unwind file (`PID.unwind`, version {UNWIND_VERSION})")));
        assert_eq!(documented(&doc, "## The unwind file"), fields(UNWIND_FIELDS));
    }

    #[test]
    fn a_copy_reads_back() {
        let h = crate::pod::copy::<ProcHeader>(&vec![0u8; PROC_HEADER_SIZE as usize]).unwrap();
        h.pid.store(42, Ordering::Relaxed);
        h.module_count.store(1, Ordering::Relaxed);
        h.modules[0].bias.store(7, Ordering::Relaxed);
        ProcHeader::set_text(&h.command, b"server --port 1");
        let bytes = crate::pod::bytes_of(&*h);
        assert_eq!(bytes[12..16], 42u32.to_le_bytes());
        assert_eq!(bytes[512 + 32..512 + 40], 7u64.to_le_bytes());
        let again = crate::pod::copy::<ProcHeader>(bytes).unwrap();
        assert_eq!(ProcHeader::text(&again.command), "server --port 1");
        // A command line: argv[0] and the arguments, each ended by a NUL;
        // cut where the field ends.
        ProcHeader::set_text(&h.command, b"git\0pack-objects\0\0--stdout\0");
        assert_eq!(ProcHeader::text(&h.command), "git");
        assert_eq!(ProcHeader::arguments(&h.command), ["pack-objects", "", "--stdout"]);
        assert_eq!(command_line("git", &ProcHeader::arguments(&h.command)), "git pack-objects '' --stdout");
        let long: Vec<u8> = (0..200).map(|i| if i % 10 == 9 { 0 } else { b'a' }).collect();
        ProcHeader::set_text(&h.command, &long);
        let args = ProcHeader::arguments(&h.command);
        assert_eq!((args.len(), args[9].as_str(), args[10].as_str()), (11, "aaaaaaaaa", "a"));
        assert_eq!(again.published().len(), 1);
        assert!(crate::pod::copy::<ProcHeader>(&bytes[..100]).is_none());
    }

    #[test]
    fn a_table_id_is_the_hash_of_every_byte() {
        let table: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let id = table_id(&table);
        assert_eq!(id, table_id(&table.clone()));
        for at in [0, 31, 32, 500, 999] {
            let mut other = table.clone();
            other[at] ^= 1;
            assert_ne!(table_id(&other), id, "byte {at}");
        }
        assert_ne!(table_id(&table[..999]), id);
        let mut longer = table.clone();
        longer.push(0);
        assert_ne!(table_id(&longer), id, "a zero byte more (the last block is zero-padded)");
        assert_ne!(table_id(&[]), 0);
        // The values docs/formats.md gives: the id is a file format.
        let hundred: Vec<u8> = (0..100).collect();
        assert_eq!(
            [table_id(b""), table_id(b"alloctramp"), table_id(&hundred)],
            [0x262250effd64ee51, 0x4c825a04492dfcbe, 0x5cc454b3ab54279b]
        );
        let doc = formats_md();
        assert!(doc.contains("`table_id(\"alloctramp\")` is `0x4c825a04492dfcbe`"));
        assert_eq!(shared_table_name(0xab), "00000000000000ab.sites");
        assert_eq!(shared_table_id(&shared_table_name(id)), Some(id));
        for name in ["ab.sites", "00000000000000ab.sites.1.new", "000000000000000g.sites", "0000000000000000.sites"] {
            assert_eq!(shared_table_id(name), None, "{name}");
        }
    }

    #[test]
    fn only_unnamed_tables_unused_for_a_while_go() {
        let now = 1_000_000;
        let tables = [(1, now - 3600), (2, now - 3600), (3, now - 10), (0, now - 3600), (0, now)];
        assert_eq!(tables_to_remove(&tables, &[2], now), [true, false, false, true, false]);
        assert_eq!(tables_to_remove(&tables, &[], now + TABLE_GRACE_SECS), [true, true, true, true, true]);
    }

    #[test]
    fn only_files_of_ended_processes_go() {
        let f = |running, profiled, mtime| FileState { running, profiled, empty: false, mtime };
        let files = [f(true, false, 1), f(false, false, 2), f(false, true, 3), f(false, true, 4), f(false, true, 5)];
        assert_eq!(files_to_remove(&files, 2), [false, true, true, false, false]);
        assert_eq!(files_to_remove(&files, 0), [false, true, true, true, true]);
        // Empty files go whatever the bound, and leave the bound to others;
        // a running process's file stays, empty or not.
        let empty = |running, mtime| FileState { running, profiled: true, empty: true, mtime };
        let files = [f(false, true, 1), empty(false, 9), f(false, true, 3), empty(true, 8)];
        assert_eq!(files_to_remove(&files, 2), [false, true, false, false]);
        assert_eq!(files_to_remove(&files, 1), [true, true, false, false]);
        assert_eq!([prune_to(64), prune_to(8), prune_to(7), prune_to(2), prune_to(0)], [56, 7, 7, 2, 0]);
    }

    #[test]
    fn a_file_counted_nothing_while_every_counter_is_zero() {
        let (t, c) = (PROC_HEADER_SIZE, PROC_HEADER_SIZE + 4096);
        let mut h = crate::pod::copy::<ProcHeader>(&vec![0u8; PROC_HEADER_SIZE as usize]).unwrap();
        h.magic = PROC_MAGIC;
        h.version.store(PROC_VERSION, Ordering::Relaxed);
        h.modules[0].table_offset.store(t, Ordering::Relaxed);
        h.modules[0].table_size.store(4096, Ordering::Relaxed);
        h.modules[0].counters_offset.store(c, Ordering::Relaxed);
        h.modules[0].counters_size.store(4096, Ordering::Relaxed);
        h.module_count.store(1, Ordering::Release);
        let mut bytes = crate::pod::bytes_of(&*h).to_vec();
        bytes.extend_from_slice(&[7u8; 4096]);
        bytes.extend_from_slice(&[0u8; 4096]);
        assert_eq!(counters_regions(&bytes), Some(vec![(c, 4096)]));
        assert!(counted_nothing(&bytes), "the site table is not a counter");
        bytes[c as usize + 4000] = 1;
        assert!(!counted_nothing(&bytes));
        assert!(!counted_nothing(&bytes[..c as usize + 100]), "cut short");
        bytes[c as usize + 4000] = 0;
        h.untracked_allocs.store(1, Ordering::Relaxed);
        bytes[..PROC_HEADER_SIZE as usize].copy_from_slice(crate::pod::bytes_of(&*h));
        assert!(!counted_nothing(&bytes), "an allocation it could not track");
        assert!(!counted_nothing(&[0u8; 100]));
    }
}
