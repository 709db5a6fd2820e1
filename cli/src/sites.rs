//! `alloctramp sites`: list every allocator call site in an ELF file.

use crate::debuginfod;
use crate::util::{Input, emit};
use alloctramp_patcher::wrappers::{self, Callee};
use alloctramp_patcher::{DebugFile, debugfile, deps, output};
use alloctramp_trampolines::entry::{self, EntryPoint, Size};
use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};

/// List every call site that reaches an allocator entry point.
///
/// Example: alloctramp sites /usr/bin/git --entry xmalloc:alloc --entry xfree:free
#[derive(clap::Args)]
#[command(
    after_help = "ENTRY SPEC: TARGET:KIND[:FIELD=VALUE,...]\n  TARGET  a symbol name (mangled for C++) or a 0x address in the file\n  KIND    alloc, free or realloc\n  FIELDS  size=argN | size=argN*argM | size=strlen, ptr=argN, out=argN, name=LABEL\n  e.g. --entry xmalloc:alloc --entry xcalloc:alloc:size=arg0*arg1 --entry xfree:free"
)]
pub struct Args {
    /// The ELF file (executable, PIE or shared library).
    pub file: PathBuf,
    /// Also count calls to this function (see ENTRY SPEC below).
    #[arg(long = "entry", value_name = "SPEC")]
    pub entries: Vec<String>,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Where separate debug files live (gdb's debug-file-directory). Files
    /// with a build-id and no debug file are then asked of the debuginfod
    /// servers in DEBUGINFOD_URLS.
    #[arg(long, value_name = "DIR", default_value = debugfile::DEFAULT_DEBUG_DIR)]
    pub debug_dir: PathBuf,
    #[command(flatten)]
    pub wrappers: WrapperArgs,
}

/// How allocation wrappers are found and charged (`sites` and `patch`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct WrapperArgs {
    /// This function (a symbol of the file) is an allocation wrapper, of
    /// KIND alloc (the default), free or realloc, whatever its code looks
    /// like.
    #[arg(long = "wrapper", value_name = "NAME[:KIND]")]
    pub wrappers: Vec<String>,
    /// This function is not an allocation wrapper (nor are wrappers that
    /// only wrap it).
    #[arg(long = "not-wrapper", value_name = "NAME")]
    pub not_wrappers: Vec<String>,
    /// Do not look for allocation wrappers (the search reads every
    /// function's code, and the libraries the file needs).
    #[arg(long, conflicts_with_all = ["wrappers", "not_wrappers"])]
    pub no_wrappers: bool,
    /// Count every allocator call where it is made, inside wrappers too.
    /// By default each call to an allocation wrapper is a site that counts
    /// what the wrapper allocates, and the calls inside the wrapper count
    /// only when it is reached without one (as the kernel's alloc_hooks
    /// nest).
    #[arg(long)]
    pub no_charge_callers: bool,
    /// Do not hook the entry of an allocator function the file defines and
    /// reaches through pointers (a pool's free in a table of operations):
    /// by default its first instructions move to a stub whose jump the
    /// runtime switches, so that calls no site sees count too.
    #[arg(long)]
    pub no_entry_hooks: bool,
    /// Also allocation plumbing (a glob over demangled names, `*` any
    /// text), besides the default list: a site in inlined plumbing is named
    /// after the first inlined caller outside it.
    #[arg(long = "plumbing", value_name = "PATTERN")]
    pub plumbing: Vec<String>,
}

impl WrapperArgs {
    /// Whether calls to wrappers are sites that take the charge.
    pub fn charge(&self) -> bool {
        !self.no_wrappers && !self.no_charge_callers
    }

    /// The wrapper search's options for the file at `path`, whose bytes
    /// are `data`: what its libraries export, what the user says.
    pub fn options(&self, path: &Path, data: &[u8], user: &[EntryPoint]) -> Result<wrappers::Options> {
        let named = self.wrappers.iter().map(|s| parse_wrapper(s)).collect::<Result<Vec<_>>>()?;
        let entries = alloctramp_patcher::entry_set(user).0;
        let imported = match alloctramp_patcher::Elf::parse(data) {
            Ok(elf) if !self.no_wrappers => deps::imported_wrappers(path, &elf, &entries, self.charge()),
            _ => Default::default(),
        };
        Ok(wrappers::Options {
            search: !self.no_wrappers,
            imported: imported.roles,
            imported_charged: imported.charged,
            imported_hooks: imported.hooks,
            imported_plumbing: imported.plumbing,
            imported_keys: imported.keys,
            libraries: imported.from,
            named,
            refused: self.not_wrappers.clone(),
            charge: self.charge(),
            entry_hooks: self.charge() && !self.no_entry_hooks,
            plumbing: self.plumbing.clone(),
            found: None,
        })
    }
}

/// `NAME[:KIND]` of `--wrapper`.
fn parse_wrapper(spec: &str) -> Result<(String, Callee)> {
    let (name, kind) =
        spec.rsplit_once(':').filter(|(n, _)| !n.is_empty() && !n.ends_with(':')).unwrap_or((spec, "alloc"));
    let role = match kind {
        "alloc" => Callee::Alloc { size: Size::Arg(0) },
        "free" => Callee::Free { ptr: 0 },
        "realloc" => Callee::Realloc { ptr: 0, size: Size::Arg(1) },
        _ => bail!("--wrapper {spec}: the kind must be alloc, free or realloc"),
    };
    Ok((name.to_string(), role))
}

pub fn parse_entries(specs: &[String]) -> Result<Vec<EntryPoint>> {
    specs.iter().map(|s| entry::parse_spec(s).map_err(|e| anyhow!(e))).collect()
}

/// A separate debug file for `data` (read from `path`), found the way gdb
/// does, else fetched from the debuginfod servers of `DEBUGINFOD_URLS` by
/// build-id; only looked for when the file has no DWARF line table.
pub fn find_debug_in(path: &Path, data: &[u8], debug_dir: &Path) -> Option<(PathBuf, Input)> {
    let elf = alloctramp_patcher::Elf::parse(data).ok()?;
    if elf.has_dwarf_lines() {
        return None;
    }
    let local = debugfile::candidates(path, &elf, debug_dir).into_iter().find_map(|cand| {
        let inp = Input::open(&cand).ok()?;
        debugfile::matches(&elf, &inp.map).then_some((cand, inp))
    });
    local.or_else(|| {
        let id = elf.build_id()?;
        debuginfod::Config::from_env()?.find(id, &|bytes| debugfile::matches(&elf, bytes))
    })
}

/// One warning line per `--entry` the file neither defines nor imports
/// (its calls cannot be found: probably a misspelt name).
pub fn warn_unresolved(path: &Path, analysis: &alloctramp_patcher::Analysis) {
    for &i in &analysis.scan.unresolved {
        eprintln!(
            "alloctramp: warning: {}: entry {} is neither defined nor imported",
            path.display(),
            analysis.scan.entries[i].target
        );
    }
}

pub fn run(args: Args) -> Result<()> {
    let user = parse_entries(&args.entries)?;
    let path = &args.file;
    let input = Input::open(path)?;
    let name = path.to_string_lossy();
    let data: &[u8] = &input.map;

    let debug_map = find_debug_in(path, data, &args.debug_dir);
    let debug = debug_map.as_ref().map(|(p, inp)| DebugFile { data: &inp.map, label: p.display().to_string() });
    let opts = args.wrappers.options(path, data, &user)?;
    let analysis = alloctramp_patcher::analyze_with(data, &name, debug, &user, &opts)
        .with_context(|| format!("{}", path.display()))?;
    warn_unresolved(path, &analysis);
    let doc = output::document(&analysis, &name);
    emit(|w| if args.json { output::write_json(w, &doc) } else { output::write_text(w, &doc) })
}
