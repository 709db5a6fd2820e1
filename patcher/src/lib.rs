//! alloctramp's patcher: reads an x86-64 ELF file, finds every call site that
//! reaches an allocator entry point, plans the patched file and writes it.
//!
//! The core takes bytes and returns data: [`analyze`] gets the file's bytes
//! (and optionally a separate debug file's) and returns an [`Analysis`].
//! Finding files on disk is left to [`debugfile`], [`deps`] and the command
//! line.

mod bytes;
pub mod charge;
pub mod debugfile;
pub mod deps;
pub mod ehframe;
pub mod elf;
mod emit;
pub mod error;
pub mod hooks;
pub mod image;
pub mod lines;
pub mod output;
pub mod plan;
pub mod plumbing;
pub mod scan;
pub mod slots;
pub mod statics;
pub mod symbols;
pub mod tables;
pub mod unwind;
pub mod wrappers;
pub mod write;

use alloctramp_trampolines::addr::Vaddr;
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
    /// The allocation wrappers the file defines or imports, by address
    /// (imported ones last, by name).
    pub wrappers: Vec<WrapperInfo>,
    /// The unwind rows callers capture uses (from `.eh_frame`).
    pub unwind: Vec<alloctramp_trampolines::layout::UnwindRow>,
}

/// One allocation wrapper of a file.
#[derive(Clone, Debug)]
pub struct WrapperInfo {
    /// Where it is defined in the file (None: imported from a library).
    pub addr: Option<Vaddr>,
    /// The end of its code (`addr` for an imported one).
    pub end: Vaddr,
    /// The symbol it is imported by.
    pub symbol: Option<String>,
    /// Its name (demangled), `fn@0x...` for a function without a symbol.
    pub function: String,
    pub role: wrappers::Callee,
    /// Why it is one.
    pub reason: String,
    /// 0 named by the user, 1 a wrapper of entry points, 2 of wrappers...
    pub depth: u32,
    /// What it frees besides what it reallocates.
    pub frees: wrappers::Frees,
    /// Its callers can be charged with what it allocates (see
    /// [`wrappers::Wrapper::chargeable`]).
    pub chargeable: bool,
    /// Imported: its calls are hooks in its library, and here too.
    pub hook: bool,
    /// Why it is one (the call its result or free comes from).
    pub why: Option<wrappers::Why>,
    /// Its pointers relative to that call's.
    pub offsets: wrappers::Offsets,
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
    analyze_with(data, file_name, debug, user, &wrappers::Options::default())
}

/// [`analyze`], telling the wrapper search what the file's libraries export
/// and what the user says.
pub fn analyze_with(
    data: &[u8],
    file_name: &str,
    debug: Option<DebugFile<'_>>,
    user: &[EntryPoint],
    wrapper_opts: &wrappers::Options,
) -> Result<Analysis> {
    let elf = Elf::parse(data)?;
    let (mut entries, first_user) = entry_set(user);
    let user_entries = first_user..entries.len();
    let found = match (wrapper_opts.search, &wrapper_opts.found) {
        (false, _) => Vec::new(),
        (true, Some(found)) if user.is_empty() => found.clone(),
        (true, _) => wrappers::discover(&elf, &entries, wrapper_opts).0,
    };
    let module = elf.soname().map(str::to_string).unwrap_or_else(|| base_name(file_name).to_string());
    let functions = symbols::FunctionIndex::new(&elf);
    let mut wrappers: Vec<WrapperInfo> = found
        .iter()
        .map(|w| WrapperInfo {
            addr: Some(Vaddr(w.start)),
            end: Vaddr(w.end),
            symbol: None,
            function: functions.lookup(w.start).map_or_else(|| format!("fn@{:#x}", w.start), |f| symbols::demangle(&f)),
            role: w.role,
            reason: w.why.text(),
            depth: w.depth,
            frees: w.frees,
            chargeable: w.chargeable,
            hook: false,
            why: Some(w.why),
            offsets: w.offsets,
        })
        .collect();
    let imports: std::collections::BTreeSet<&str> =
        elf.symbols(true).iter().filter(|s| !s.defined && s.is_func).map(|s| s.name).collect();
    for (name, role) in wrapper_opts.imported.iter().filter(|_| wrapper_opts.search) {
        if imports.contains(name.as_str()) && !wrapper_opts.refused.contains(name) {
            wrappers.push(WrapperInfo {
                addr: None,
                end: Vaddr(0),
                symbol: Some(name.clone()),
                function: symbols::demangle(name),
                role: *role,
                reason: match wrapper_opts.libraries.get(name) {
                    Some(lib) => format!("exported by {lib}"),
                    None => "exported by a library the file needs".to_string(),
                },
                depth: 1,
                frees: Default::default(),
                chargeable: wrapper_opts.imported_charged.contains(name),
                hook: wrapper_opts.imported_hooks.contains(name),
                why: None,
                offsets: wrapper_opts.imported_keys.get(name).map_or_else(Default::default, |k| wrappers::Offsets {
                    result: i64::from(k.result),
                    ptr: i64::from(k.ptr),
                }),
            });
        }
    }
    wrappers[found.len()..].sort_by(|a, b| a.function.cmp(&b.function));
    let plumbing = plumbing::Plumbing::with(&wrapper_opts.plumbing);
    let unwinding = charge::Unwinding::of(&elf);
    let mut charged = if wrapper_opts.charge {
        charge::entries(&elf, &mut entries, &wrappers, &plumbing, &wrapper_opts.imported_plumbing, unwinding)
    } else {
        Vec::new()
    };
    let slots = slots::attach(&elf, &mut entries, &mut charged);
    let mut scan = scan::scan_with(&elf, entries, user_entries, slots)?;
    scan.forward_own_definitions(&found);
    let hookable = charge::assign(&elf, &mut scan, &charged, unwinding);
    if wrapper_opts.entry_hooks {
        hooks::add(&elf, &mut scan, &hookable);
    }

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
        .map(|s| {
            let outside = lines.as_ref().and_then(|l| outside_plumbing(l, s.vaddr.0, &plumbing));
            match outside {
                Some((function, location)) => SiteInfo { function: Some(function), location },
                None => SiteInfo {
                    function: functions.lookup(s.vaddr.0),
                    location: lines.as_ref().and_then(|l| l.find(s.vaddr.0)),
                },
            }
        })
        .collect();
    let unwind = unwind::rows(&elf);
    Ok(Analysis { module, file_type: elf.file_type, scan, info, debug_source, wrappers, unwind })
}

/// When the innermost function inlined at `addr` is allocation plumbing:
/// the first inlined caller that is not, and where in it the call is.
fn outside_plumbing(
    lines: &lines::Lines,
    addr: u64,
    plumbing: &plumbing::Plumbing,
) -> Option<(String, Option<Location>)> {
    let frames = lines.inline_frames(addr);
    let is_plumbing = |(name, loc): &(Option<String>, Option<Location>)| {
        let name = name.as_deref().map(symbols::demangle);
        plumbing.matches_frame(name.as_deref(), loc.as_ref().map(|l| l.file.as_str()))
    };
    if frames.len() < 2 || !is_plumbing(frames.first()?) {
        return None;
    }
    let (name, loc) = frames.into_iter().find(|f| f.0.is_some() && !is_plumbing(f))?;
    Some((name?, loc))
}

pub fn base_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}
