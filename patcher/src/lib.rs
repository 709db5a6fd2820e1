//! alloctramp's patcher: reads an x86-64 ELF file, finds every call site that
//! reaches an allocator entry point, plans the patched file and writes it.
//!
//! The core takes bytes and returns data: [`analyze`] gets the file's bytes
//! (and optionally a separate debug file's) and returns an [`Analysis`].
//! Finding files on disk is left to [`debugfile`], [`deps`] and the command
//! line.

mod bytes;
pub mod debugfile;
pub mod deps;
pub mod elf;
mod emit;
pub mod error;
pub mod lines;
pub mod output;
pub mod plan;
pub mod scan;
pub mod symbols;
pub mod tables;
pub mod wrappers;
pub mod write;

use alloctramp_trampolines::entry::{self, EntryPoint};
pub use alloctramp_trampolines::layout::SiteForm;
pub use elf::{Elf, FileType};
pub use error::{Error, ErrorKind, Result};
pub use lines::Location;
pub use scan::{Reason, Scan, Site, Via};

/// What is known about one site beyond its instruction.
#[derive(Clone, Debug, Default)]
pub struct SiteInfo {
    /// Mangled name of the containing function (or `fn@0x...`).
    pub function: Option<String>,
    pub location: Option<Location>,
}

/// Everything `alloctramp sites` shows about a file.
#[derive(Debug)]
pub struct Analysis {
    /// SONAME, else the file name.
    pub module: String,
    pub file_type: FileType,
    pub scan: Scan,
    /// Parallel to `scan.sites`.
    pub info: Vec<SiteInfo>,
    /// Where line information came from: "" (none), "embedded" or a path.
    pub debug_source: String,
}

/// The default entry points followed by the user's.
pub fn entry_set(user: &[EntryPoint]) -> (Vec<EntryPoint>, usize) {
    let mut all = entry::defaults();
    let first_user = all.len();
    all.extend_from_slice(user);
    (all, first_user)
}

/// Separate debug information for [`analyze`].
pub struct DebugFile<'a> {
    pub data: &'a [u8],
    pub label: String,
}

/// Scans `data` (an ELF file named `file_name`) and symbolizes every site.
pub fn analyze(data: &[u8], file_name: &str, debug: Option<DebugFile<'_>>, user: &[EntryPoint]) -> Result<Analysis> {
    let elf = Elf::parse(data)?;
    let (entries, first_user) = entry_set(user);
    let scan = scan::scan(&elf, entries, first_user)?;
    let module = elf.soname().map(str::to_string).unwrap_or_else(|| base_name(file_name).to_string());

    let functions = symbols::FunctionIndex::new(&elf);
    let embedded = elf.has_dwarf_lines().then(|| lines::DebugSections::load(&elf.file));
    let debug_parsed = match (&embedded, &debug) {
        (Some(Some(_)), _) | (_, None) => None,
        (_, Some(d)) => object::File::parse(d.data).ok().and_then(|f| lines::DebugSections::load(&f)),
    };
    let (sections, debug_source) = match (embedded.flatten(), debug_parsed) {
        (Some(s), _) => (Some(s), "embedded".to_string()),
        (None, Some(s)) => (Some(s), debug.map(|d| d.label).unwrap_or_default()),
        (None, None) => (None, String::new()),
    };
    let lines = sections.as_ref().and_then(lines::Lines::new);

    let info = scan
        .sites
        .iter()
        .map(|s| SiteInfo {
            function: functions.lookup(s.vaddr.0),
            location: lines.as_ref().and_then(|l| l.find(s.vaddr.0)),
        })
        .collect();
    Ok(Analysis { module, file_type: elf.file_type, scan, info, debug_source })
}

pub fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}
