//! `alloctramp sites` output: a tab-separated table with a summary, or one
//! JSON document (schema in docs/formats.md).

use crate::scan::{Charge, Reason};
use crate::symbols::demangle;
use crate::{Analysis, Location};
use alloctramp_trampolines::entry::Size;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{self, Write};

/// The JSON document's version; bump on incompatible changes.
pub const SITES_JSON_VERSION: u32 = 1;

#[derive(Serialize)]
pub struct SitesDoc<'a> {
    pub format: &'static str,
    pub version: u32,
    pub file: &'a str,
    pub module: &'a str,
    #[serde(rename = "type")]
    pub file_type: crate::FileType,
    pub debug_info: &'a str,
    pub sites: Vec<SiteDoc<'a>>,
    pub unpatchable: Vec<RefDoc<'a>>,
    pub unresolved_entries: Vec<String>,
    pub wrappers: Vec<WrapperDoc<'a>>,
    pub summary: Summary,
}

/// An allocation wrapper the file defines (with its address) or imports.
#[derive(Serialize)]
pub struct WrapperDoc<'a> {
    pub address: Option<u64>,
    pub function: &'a str,
    /// `alloc`, `free` or `realloc`.
    pub kind: &'static str,
    pub reason: &'a str,
    pub depth: u32,
    /// What a call asks for: `argN`, `argN*argM`, `strlen` (of the
    /// result), or null (a free wrapper, or none of its arguments).
    pub size: Option<String>,
    /// Calls to it can be charged (it frees, or its size is known).
    pub countable: bool,
    /// How its allocations are charged: `callers` (its callers' sites
    /// count what it allocates), `hook` (calls to it are hooks: they take
    /// what the sites inside allocate), or `none` (its sites count where
    /// they are).
    pub charge: &'static str,
}

#[derive(Serialize)]
pub struct SiteDoc<'a> {
    pub address: u64,
    pub offset: u64,
    pub length: u8,
    /// The form as `SiteForm::as_str` names it (`call rel32`...).
    pub form: &'static str,
    pub via: crate::Via,
    pub target: u64,
    pub entry: String,
    pub entry_display: &'a str,
    pub kind: &'static str,
    pub function: Option<String>,
    pub function_mangled: Option<&'a str>,
    pub file: Option<&'a str>,
    pub line: Option<u32>,
    pub module: &'a str,
    /// How its count nests with allocation wrappers (charging callers,
    /// the default): `own`, `caller` (a call to a wrapper, counted
    /// for what it allocates), `inside` (in a wrapper: never counted) or
    /// `inside-checked` (counted when the wrapper is reached otherwise),
    /// `hook` (a call to a function whose allocations it takes: an
    /// allocation wrapper whose size is not an argument, or plumbing).
    pub charge: &'static str,
    /// Inside a hooked function: counts for the outermost hook's call.
    pub under_hook: bool,
    /// A caller's call raises the thread's wrapper depth; a site inside
    /// counts with it raised.
    pub raises_depth: bool,
    /// The wrapper a site inside belongs to.
    pub wrapper: Option<&'a str>,
}

#[derive(Serialize)]
pub struct RefDoc<'a> {
    pub address: u64,
    pub offset: Option<u64>,
    pub entry: String,
    pub entry_display: &'a str,
    pub reason: Reason,
    pub reason_text: &'static str,
}

#[derive(Serialize, Default)]
pub struct Summary {
    pub sites: usize,
    /// Bytes of executable code swept.
    pub code_bytes: u64,
    pub by_entry: BTreeMap<String, usize>,
    pub by_form: BTreeMap<&'static str, usize>,
    pub by_kind: BTreeMap<&'static str, usize>,
    pub unpatchable: usize,
    pub unpatchable_by_reason: BTreeMap<&'static str, usize>,
}

/// Builds the JSON document (also the single source of the text output).
pub fn document<'a>(a: &'a Analysis, file: &'a str) -> SitesDoc<'a> {
    let entries = &a.scan.entries;
    let mut summary = Summary { sites: a.scan.sites.len(), code_bytes: a.scan.code_bytes, ..Summary::default() };
    // Many sites share a function: demangle each name once.
    let mut demangled: std::collections::HashMap<&str, String> = std::collections::HashMap::new();
    let sites = a
        .scan
        .sites
        .iter()
        .zip(&a.info)
        .map(|(s, info)| {
            let e = &entries[s.entry];
            *summary.by_entry.entry(e.display.clone()).or_default() += 1;
            // An entry hook's site is the jump to its stub that replaces
            // the hooked function's first instructions.
            let form = if s.hook.is_some() { "entry hook" } else { s.form.as_str() };
            *summary.by_form.entry(form).or_default() += 1;
            *summary.by_kind.entry(e.sig.kind.as_str()).or_default() += 1;
            SiteDoc {
                address: s.vaddr.0,
                offset: s.offset.0,
                length: s.len,
                form,
                via: s.via,
                target: s.target.0,
                entry: e.target.to_string(),
                entry_display: &e.display,
                kind: e.sig.kind.as_str(),
                function: info.function.as_deref().map(|f| demangled.entry(f).or_insert_with(|| demangle(f)).clone()),
                function_mangled: info.function.as_deref(),
                file: info.location.as_ref().map(|l: &Location| l.file.as_str()),
                line: info.location.as_ref().map(|l| l.line),
                module: &a.module,
                charge: match s.charge {
                    Charge::Own => "own",
                    Charge::Caller { .. } => "caller",
                    Charge::Inside { checked: false, .. } => "inside",
                    Charge::Inside { checked: true, .. } => "inside-checked",
                    Charge::Hook { .. } => "hook",
                },
                under_hook: s.under_hook,
                raises_depth: matches!(s.charge, Charge::Caller { bump: true, .. } | Charge::Inside { bump: true, .. }),
                wrapper: match s.charge {
                    Charge::Inside { wrapper, .. } => a.wrappers.get(wrapper).map(|w| w.function.as_str()),
                    _ => None,
                },
            }
        })
        .collect();
    let unpatchable = a
        .scan
        .unpatchable
        .iter()
        .map(|r| {
            let e = &entries[r.entry];
            *summary.unpatchable_by_reason.entry(r.reason.as_str()).or_default() += 1;
            RefDoc {
                address: r.vaddr.0,
                offset: r.offset.map(|o| o.0),
                entry: e.target.to_string(),
                entry_display: &e.display,
                reason: r.reason,
                reason_text: r.reason.as_str(),
            }
        })
        .collect::<Vec<_>>();
    summary.unpatchable = unpatchable.len();
    let charges = WrapperCharges::new(a);
    SitesDoc {
        format: "alloctramp-sites",
        version: SITES_JSON_VERSION,
        file,
        module: &a.module,
        file_type: a.file_type,
        debug_info: &a.debug_source,
        sites,
        unpatchable,
        unresolved_entries: a.scan.unresolved.iter().map(|&i| entries[i].target.to_string()).collect(),
        wrappers: a
            .wrappers
            .iter()
            .map(|w| WrapperDoc {
                address: w.addr.map(|a| a.0),
                function: &w.function,
                kind: w.role.as_str(),
                reason: &w.reason,
                depth: w.depth,
                size: w.role.signature().and_then(|sig| match sig.size {
                    Size::Arg(a) => Some(format!("arg{a}")),
                    Size::Product(a, b) => Some(format!("arg{a}*arg{b}")),
                    Size::ResultStrlen => Some("strlen".to_string()),
                    Size::None => None,
                }),
                countable: w.role.signature().is_some(),
                charge: charges.of(w),
            })
            .collect(),
        summary,
    }
}

/// How the calls of each wrapper are charged (see [`WrapperDoc::charge`]),
/// from the sites that call it or lie inside it; built once for the
/// listing (a library has thousands of wrappers and sites).
struct WrapperCharges<'a> {
    /// Per entry display name: (some call is a caller site, some is a hook).
    calls: std::collections::HashMap<&'a str, (bool, bool)>,
    /// Sites by address: (address, inside a charged wrapper, under a hook).
    by_addr: Vec<(u64, bool, bool)>,
}

impl<'a> WrapperCharges<'a> {
    fn new(a: &'a Analysis) -> WrapperCharges<'a> {
        let mut calls: std::collections::HashMap<&str, (bool, bool)> = std::collections::HashMap::new();
        let mut by_addr = Vec::with_capacity(a.scan.sites.len());
        for s in &a.scan.sites {
            if let Some(e) = a.scan.entries.get(s.entry) {
                let c = calls.entry(e.display.as_str()).or_default();
                c.0 |= matches!(s.charge, Charge::Caller { .. });
                c.1 |= matches!(s.charge, Charge::Hook { .. });
            }
            by_addr.push((s.vaddr.0, matches!(s.charge, Charge::Inside { .. }), s.under_hook));
        }
        by_addr.sort_unstable_by_key(|&(at, ..)| at);
        WrapperCharges { calls, by_addr }
    }

    fn of(&self, w: &crate::WrapperInfo) -> &'static str {
        let (caller, hook) = self.calls.get(w.function.as_str()).copied().unwrap_or_default();
        let inside = w.addr.map_or(&[][..], |start| {
            let lo = self.by_addr.partition_point(|&(at, ..)| at < start.0);
            let hi = self.by_addr.partition_point(|&(at, ..)| at < w.end.0);
            self.by_addr.get(lo..hi.max(lo)).unwrap_or_default()
        });
        if caller || inside.iter().any(|&(_, charged, _)| charged) {
            "callers"
        } else if hook || inside.iter().any(|&(.., under)| under) {
            "hook"
        } else {
            "none"
        }
    }
}

/// The text form: a header line, one tab-separated line per site, then the
/// summary as `#` comment lines.
pub fn write_text(w: &mut (impl Write + ?Sized), doc: &SitesDoc) -> io::Result<()> {
    writeln!(w, "# address\toffset\tlen\tform\tkind\tentry\tfunction\tlocation\tmodule")?;
    for s in &doc.sites {
        let location = match (s.file, s.line) {
            (Some(f), Some(l)) => format!("{f}:{l}"),
            _ => "?".to_string(),
        };
        writeln!(
            w,
            "{:#x}\t{:#x}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            s.address,
            s.offset,
            s.length,
            s.form,
            s.kind,
            s.entry_display,
            s.function.as_deref().unwrap_or("?"),
            location,
            s.module
        )?;
    }
    let sum = &doc.summary;
    writeln!(
        w,
        "# {} sites in {} ({}, line info: {})",
        sum.sites,
        doc.module,
        match doc.file_type {
            crate::FileType::Exec => "executable",
            crate::FileType::Pie => "PIE executable",
            crate::FileType::Shared => "shared library",
        },
        if doc.debug_info.is_empty() { "none" } else { doc.debug_info }
    )?;
    for (name, n) in &sum.by_entry {
        writeln!(w, "#   entry {name}: {n}")?;
    }
    for (form, n) in &sum.by_form {
        writeln!(w, "#   form {form}: {n}")?;
    }
    let count = |charge: &str| doc.sites.iter().filter(|s| s.charge == charge).count();
    let (callers, hooks) = (count("caller"), count("hook"));
    if callers > 0 {
        let inside = count("inside") + count("inside-checked");
        writeln!(
            w,
            "# {callers} calls to allocation wrappers count what they allocate; {inside} sites are inside them"
        )?;
    }
    if hooks > 0 {
        let under = doc.sites.iter().filter(|s| s.under_hook).count();
        writeln!(
            w,
            "# {hooks} calls to functions that allocate for their callers take what {under} sites inside them allocate"
        )?;
    }
    writeln!(w, "# {} references that cannot be patched", sum.unpatchable)?;
    for r in &doc.unpatchable {
        let off = r.offset.map(|o| format!("{o:#x}")).unwrap_or_else(|| "-".into());
        writeln!(w, "#   {:#x}\t{off}\t{}\t{}", r.address, r.entry_display, r.reason_text)?;
    }
    for e in &doc.unresolved_entries {
        writeln!(w, "# entry {e}: not defined or imported by this file")?;
    }
    writeln!(w, "# {} allocation wrappers", doc.wrappers.len())?;
    for x in &doc.wrappers {
        let at = x.address.map_or_else(|| "imported".to_string(), |a| format!("{a:#x}"));
        let charge = match x.charge {
            "callers" => "\tcharged to its callers",
            "hook" => "\tcalls are hooks",
            _ => "",
        };
        writeln!(w, "#   {at}\t{}\t{}\t{}{charge}", x.kind, x.function, x.reason)?;
    }
    Ok(())
}

pub fn write_json(w: &mut (impl Write + ?Sized), doc: &SitesDoc) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *w, doc)?;
    writeln!(w)
}
