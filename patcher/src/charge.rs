//! Charging allocations to the callers of allocation wrappers, as the
//! kernel's `alloc_hooks()` does by hand: a call to a wrapper is a site,
//! and the calls inside the wrapper are not counted when it was reached
//! through such a site.
//!
//! A wrapper is *charged* when every allocation call inside it is to an
//! allocator or to another charged wrapper, of the wrapper's own kind
//! (allocations in an allocation wrapper, frees in a free wrapper), and
//! calls to it carry its size (an argument) and pointer. Its callers'
//! sites then count what it allocates.
//!
//! A charged wrapper is *closed* when nothing but those sites reaches it:
//! the file does not export it and no reference to it is anything but a
//! patchable call. The sites inside a closed wrapper are never patched.
//! Otherwise it is *open* (exported, its address taken, a conditional or
//! short jump to it, or imported from a library): the sites inside count
//! only when the thread's wrapper depth is 0, and calls that reach it
//! through a site raise that depth for their duration. The depth is a
//! per-thread word of the runtime; the trampolines read and write it
//! directly.

use crate::WrapperInfo;
use crate::elf::Elf;
use crate::plumbing::Plumbing;
use crate::scan::{Charge, Keys, Scan, Via};
use crate::wrappers::{Frees, Offsets};
use alloctramp_trampolines::entry::{EntryPoint, Heap, Kind, Signature, Size, Target};
use std::collections::{HashMap, HashSet};

/// A wrapper (or a function of allocation plumbing) whose calls are entry
/// points of the scan.
#[derive(Clone, Debug)]
pub struct Charged {
    /// Its entry point's index.
    pub entry: usize,
    /// Its index in the analysis's wrappers (None: a function of allocation
    /// plumbing, never counted at its callers, maybe a hook).
    pub wrapper: Option<usize>,
    /// Its code (None: imported).
    pub code: Option<(u64, u64)>,
    /// Reachable other than through the file's call sites.
    pub open: bool,
    pub kind: Kind,
    /// Calls to it carry what it allocates.
    pub countable: bool,
    /// The file's own definition of an entry point (`operator new` in a
    /// program that links libstdc++ statically): calls to it are sites
    /// whatever is decided of it; charged, the calls inside are layers.
    pub definition: bool,
    /// Imported, and a hook in its library.
    pub imported_hook: bool,
    /// What it frees besides what it reallocates.
    pub frees: Frees,
    /// The call its result or free comes from, and its pointers relative
    /// to that call's (for an imported wrapper: to the allocator's).
    pub at: Option<u64>,
    pub offsets: Offsets,
    /// More code whose sites are its own: for a definition of an allocator
    /// API that calls its allocator through slots in data (see
    /// [`crate::slots`]), the functions the slots hold at start (CPython's
    /// pymalloc, whose large objects come from `PyMem_RawMalloc`).
    pub also: Vec<(u64, u64)>,
}

/// Functions of an unwinder or of exception handling: a file that names one
/// (or has a `.gcc_except_table`) may unwind through any of its calls.
const UNWINDING: &[&str] =
    &["_Unwind_Resume", "_Unwind_RaiseException", "__cxa_throw", "__gxx_personality_v0", "rust_eh_personality"];

/// Whether exceptions or panics may unwind through the file's calls (C++,
/// Rust with unwinding panics): a hook's trampoline makes its call, so in
/// such a file it needs an unwind entry (`ehframe`), and the file gets
/// hooks only if its `.eh_frame_hdr` can be extended with them. Programs
/// in C (perl, git, redis) unwind only by `longjmp`, which hooks detect.
pub fn unwinds(elf: &Elf) -> bool {
    elf.section_by_name(".gcc_except_table").is_some()
        || elf.symbols(true).iter().chain(elf.symbols(false)).any(|s| UNWINDING.contains(&s.name))
}

/// Whether the file's trampolines get unwind entries (`ehframe`), which
/// let exceptions and panics pass hooks.
pub fn unwind_entries(elf: &Elf) -> bool {
    crate::ehframe::Sources::new(elf).is_ok()
}

/// What exceptions mean for a file's charges, found once per analysis.
#[derive(Clone, Copy, Debug)]
pub struct Unwinding {
    /// Exceptions or panics may unwind through its calls ([`unwinds`]).
    pub unwinds: bool,
    /// Its trampolines get unwind entries ([`unwind_entries`]).
    pub entries: bool,
}

impl Unwinding {
    pub fn of(elf: &Elf) -> Unwinding {
        Unwinding { unwinds: unwinds(elf), entries: unwind_entries(elf) }
    }

    /// Whether calls can be hooks: nothing unwinds through them, or an
    /// unwind passes their trampolines.
    pub fn hooks(self) -> bool {
        !self.unwinds || self.entries
    }
}

/// Adds an entry point for each wrapper that is not one already; returns
/// them. A wrapper whose calls cannot be counted (its size is none of its
/// arguments) gets one too, so that a wrapper calling it is seen to, and
/// is not charged either.
///
/// Functions of allocation plumbing (`plumbing`, matched on demangled
/// symbol names) that are neither get one as well: calls to those that
/// allocate become hooks. So do the functions of `imported_plumbing` the
/// file imports (symbol -> library: plumbing that is a hook in its
/// library).
pub fn entries(
    elf: &Elf,
    entries: &mut Vec<EntryPoint>,
    wrappers: &[WrapperInfo],
    plumbing: &Plumbing,
    imported_plumbing: &HashMap<String, String>,
    unwinding: Unwinding,
) -> Vec<Charged> {
    // What the entry points already reach, by address and name.
    let mut taken: HashSet<u64> = HashSet::new();
    let mut names: HashSet<String> = HashSet::new();
    for e in entries.iter() {
        match &e.target {
            Target::Address(a) => {
                taken.insert(*a);
            }
            Target::Symbol(s) => {
                names.insert(s.clone());
            }
        }
    }
    let symbols: Vec<_> =
        elf.symbols(false).iter().chain(elf.symbols(true)).filter(|s| s.defined && s.is_func).collect();
    for s in &symbols {
        if names.contains(s.name) {
            taken.insert(s.value);
        }
    }
    // An exported wrapper is reached by its name: the file's own calls may
    // go through its PLT (a library whose symbols can be interposed).
    let exported: HashMap<u64, &str> =
        elf.symbols(true).iter().filter(|s| s.defined && s.is_func && s.global).map(|s| (s.value, s.name)).collect();
    let mut out = Vec::new();
    for (i, w) in wrappers.iter().enumerate() {
        let (target, code, open) = match (w.addr, &w.symbol) {
            (Some(a), _) if !taken.contains(&a.0) => {
                let target = match exported.get(&a.0) {
                    Some(name) if !names.contains(*name) => Target::Symbol(name.to_string()),
                    Some(_) => continue,
                    None => Target::Address(a.0),
                };
                (target, Some((a.0, w.end.0)), exported.contains_key(&a.0))
            }
            (None, Some(name)) if !names.contains(name) => (Target::Symbol(name.clone()), None, true),
            _ => continue,
        };
        let countable = w.role.signature().filter(|_| w.chargeable);
        let sig = countable.unwrap_or(Signature::alloc(Size::None));
        out.push(Charged {
            entry: entries.len(),
            wrapper: Some(i),
            code,
            open,
            kind: sig.kind,
            countable: countable.is_some(),
            definition: false,
            imported_hook: w.hook && w.addr.is_none(),
            frees: w.frees,
            at: w.why.and_then(|why| why.at()),
            offsets: w.offsets,
            also: Vec::new(),
        });
        entries.push(EntryPoint { target, display: w.function.clone(), sig, args: 6, heap: Heap::Malloc });
    }
    // The file's own definitions of entry points (a program that links
    // libstdc++ statically: its `operator new` calls `malloc`, its
    // `operator delete[]` calls `operator delete`): a call to one counts
    // at its site, so the calls inside are layers of the same allocation,
    // counted there only when the definition was reached otherwise (from
    // another module, through a pointer).
    for s in symbols.iter().filter(|s| s.size != 0 && names.contains(s.name)) {
        let Some(entry) = entries.iter().position(|e| matches!(&e.target, Target::Symbol(n) if n == s.name)) else {
            continue;
        };
        if out.iter().any(|c| c.entry == entry) {
            continue;
        }
        out.push(Charged {
            entry,
            wrapper: None,
            code: Some((s.value, s.value.saturating_add(s.size))),
            open: exported.contains_key(&s.value),
            kind: entries[entry].sig.kind,
            countable: true,
            definition: true,
            imported_hook: false,
            frees: Frees::default(),
            at: None,
            offsets: Offsets::default(),
            also: Vec::new(),
        });
    }
    // Plumbing that was not inlined (Rust's `finish_grow`, hashbrown's
    // `reserve_rehash`): its own calls are not allocations its callers
    // asked for by size, but its callers decided them. Only where calls to
    // it can be hooks.
    if !unwinding.hooks() {
        return out;
    }
    let imports: std::collections::BTreeSet<&str> = elf
        .symbols(true)
        .iter()
        .filter(|s| !s.defined && s.is_func && imported_plumbing.contains_key(s.name) && !names.contains(s.name))
        .map(|s| s.name)
        .collect();
    // A function of plumbing (its code, None: imported and hooked in its
    // library) as the entry point `target`.
    let mut add = |code: Option<(u64, u64)>, target: Target, display: String| {
        out.push(Charged {
            entry: entries.len(),
            wrapper: None,
            code,
            open: true,
            kind: Kind::Alloc,
            countable: false,
            definition: false,
            imported_hook: code.is_none(),
            frees: Frees::default(),
            at: None,
            offsets: Offsets::default(),
            also: Vec::new(),
        });
        entries.push(EntryPoint { target, display, sig: Signature::alloc(Size::None), args: 6, heap: Heap::Malloc });
    };
    for name in imports {
        add(None, Target::Symbol(name.to_string()), crate::symbols::demangle(name));
    }
    let mut seen: HashSet<u64> = taken;
    seen.extend(wrappers.iter().filter_map(|w| w.addr.map(|a| a.0)));
    for s in &symbols {
        if s.size == 0 || !seen.insert(s.value) {
            continue;
        }
        let name = crate::symbols::demangle(s.name);
        if !plumbing.matches(&name) {
            continue;
        }
        // Reached by its name when exported (its library's own calls may go
        // through the PLT), as a wrapper is.
        let target = match exported.get(&s.value) {
            Some(sym) if !names.contains(*sym) => Target::Symbol(sym.to_string()),
            _ => Target::Address(s.value),
        };
        add(Some((s.value, s.value.saturating_add(s.size))), target, name);
    }
    out
}

/// The offsets of wrapper `k`'s pointers from the allocator's, following
/// the calls it wraps (`None`: a call not found, a cycle, or an offset out
/// of range).
fn key_of(
    k: usize,
    charged: &[Charged],
    by_entry: &HashMap<usize, usize>,
    site_at: &HashMap<u64, usize>,
    scan: &Scan,
    depth: u32,
) -> Option<Keys> {
    let c = charged.get(k)?;
    let (inner_result, inner_ptr) = match (c.code, c.at) {
        _ if depth > 64 => return None,
        (None, _) => (0, 0),
        (Some(_), None) => (0, 0),
        (Some(_), Some(at)) => {
            let site = scan.sites.get(*site_at.get(&at)?)?;
            match by_entry.get(&site.entry) {
                Some(&j) => {
                    let inner = key_of(j, charged, by_entry, site_at, scan, depth + 1)?;
                    (i64::from(inner.result), i64::from(inner.ptr))
                }
                None => (0, 0),
            }
        }
    };
    let result = i32::try_from(c.offsets.result.checked_add(inner_result)?).ok()?;
    let ptr = i32::try_from(c.offsets.ptr.checked_add(inner_ptr)?).ok()?;
    Some(Keys { result, ptr })
}

/// Whether an entry point may throw a C++ exception: the plain (not
/// `nothrow`) `operator new` and `new[]`.
fn may_throw(e: &EntryPoint) -> bool {
    match &e.target {
        Target::Symbol(s) => matches!(s.as_str(), "_Znwm" | "_Znam" | "_ZnwmSt11align_val_t" | "_ZnamSt11align_val_t"),
        Target::Address(_) => false,
    }
}

/// The addresses among `starts` that the file's data holds: function
/// pointers of an executable (not position independent), which need no
/// relocation, and those of relative relocations packed as `DT_RELR`,
/// whose addend is the word itself. Any aligned word equal to one counts (a
/// number that happens to be equal only costs a depth check).
/// Returns them with where each is held, and whether that is program data
/// (`SHT_PROGBITS` or an array of initializers, not a relocation or symbol
/// table).
///
/// Where is kept only for the starts of `placed` (the definitions of entry
/// points, candidates for entry hooks): a library's tables hold its other
/// functions' addresses by the hundred thousand.
fn stored_in_data(elf: &Elf, starts: HashSet<u64>, placed: &HashSet<u64>) -> HashMap<u64, Vec<(u64, bool)>> {
    let mut out: HashMap<u64, Vec<(u64, bool)>> = HashMap::new();
    let (Some(&lo), Some(&hi)) = (starts.iter().min(), starts.iter().max()) else { return out };
    for sec in elf.sections.iter().filter(|s| s.is_alloc() && !s.is_exec()) {
        let skip = (sec.addr.0.wrapping_neg() & 7) as usize;
        for (k, w) in sec.data.get(skip..).unwrap_or_default().chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(w.try_into().unwrap_or_default());
            // (Most words are no code address at all: only those in the
            // wrappers' range are looked up.)
            if (lo..=hi).contains(&v) && starts.contains(&v) {
                let held = out.entry(v).or_default();
                if placed.contains(&v) {
                    let data = matches!(sec.sh_type, 1 | 14 | 15 | 16);
                    held.push((sec.addr.0 + (skip + 8 * k) as u64, data));
                }
            }
        }
    }
    out
}

/// Decides which wrappers are charged and how each site of `scan` nests
/// (see the module's description). Calls to wrappers that are not charged
/// stop being sites.
pub fn assign(elf: &Elf, scan: &mut Scan, charged: &[Charged], unwinding: Unwinding) -> Vec<Hookable> {
    let definitions = charged.iter().filter(|c| c.definition).filter_map(|c| c.code.map(|(s, _)| s)).collect();
    let stored = stored_in_data(elf, charged.iter().filter_map(|c| c.code.map(|(s, _)| s)).collect(), &definitions);
    // With unwind entries for the trampolines, an exception passes a
    // hook's call as it passed the original call.
    decide(scan, charged, &stored, unwinding.hooks(), unwinding.entries)
}

/// A charged definition of an entry point that is reached other than
/// through the file's call sites and call instructions (its address taken
/// or stored in data, a conditional jump to it): a candidate for an entry
/// hook (`crate::hooks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hookable {
    pub entry: usize,
    /// Its code.
    pub start: u64,
    pub end: u64,
    /// As [`Charge::Inside::wrapper`] for the sites inside.
    pub wrapper: usize,
    /// It calls out of the file (see [`Charge::Caller`]).
    pub external: bool,
}

/// The code ranges of the charged wrappers, to find which holds an
/// address without a pass over all of them.
struct CodeIndex {
    /// (start, end, index in the charged wrappers), by start.
    ranges: Vec<(u64, u64, usize)>,
    /// The largest end among `ranges[..=i]`, at `i`: where a walk back
    /// from an address can stop (ranges may overlap).
    reach: Vec<u64>,
}

impl CodeIndex {
    fn new(charged: &[Charged]) -> CodeIndex {
        let mut ranges: Vec<(u64, u64, usize)> = charged
            .iter()
            .enumerate()
            .flat_map(|(k, c)| c.code.into_iter().chain(c.also.iter().copied()).map(move |(s, e)| (s, e, k)))
            .collect();
        ranges.sort_unstable();
        let reach = ranges
            .iter()
            .scan(0, |max, &(_, e, _)| {
                *max = e.max(*max);
                Some(*max)
            })
            .collect();
        CodeIndex { ranges, reach }
    }

    /// The first charged wrapper (in their order) whose code holds `addr`.
    fn first_holding(&self, addr: u64) -> Option<usize> {
        let below = self.ranges.partition_point(|&(s, _, _)| s <= addr);
        let mut first: Option<usize> = None;
        for i in (0..below).rev() {
            if self.reach.get(i).is_none_or(|&r| r <= addr) {
                break;
            }
            if let Some(&(_, e, k)) = self.ranges.get(i)
                && addr < e
            {
                first = Some(first.map_or(k, |f| f.min(k)));
            }
        }
        first
    }
}

/// [`assign`] given the wrapper addresses the file's data holds.
fn decide(
    scan: &mut Scan,
    charged: &[Charged],
    stored: &HashMap<u64, Vec<(u64, bool)>>,
    hooks: bool,
    throwing_hooks: bool,
) -> Vec<Hookable> {
    let by_entry: HashMap<usize, usize> = charged.iter().enumerate().map(|(k, c)| (c.entry, k)).collect();
    let code = CodeIndex::new(charged);
    let inside = |addr: u64| code.first_holding(addr);
    let mut open: Vec<bool> = charged.iter().map(|c| c.open).collect();
    // Reached other than by a call instruction of the file: its address
    // held in data (not in a GOT slot that the file's sites call through,
    // nor a relocation's addend or a symbol's value: `stored` has all
    // three), or a reference that is no site.
    let site_slots: HashSet<u64> = scan.sites.iter().filter(|s| s.via == Via::Got).map(|s| s.target.0).collect();
    let mut reached: Vec<bool> = charged
        .iter()
        .map(|c| {
            let held = c.code.and_then(|(s, _)| stored.get(&s));
            held.is_some_and(|at| at.iter().any(|&(a, data)| data && !site_slots.contains(&a)))
        })
        .collect();
    for r in &scan.unpatchable {
        if let Some(&k) = by_entry.get(&r.entry) {
            open[k] = true;
            reached[k] = true;
        }
    }
    // A definition of an allocator API that calls its allocator through a
    // slot (see `crate::slots`) is open: what the slot holds may count
    // unless the depth says a caller's site counted.
    let api: Vec<bool> = scan
        .entries
        .iter()
        .map(|e| matches!(&e.target, Target::Symbol(n) if alloctramp_trampolines::entry::slot_api(n)))
        .collect();
    for (k, c) in charged.iter().enumerate() {
        if c.code.is_some_and(|(s, _)| stored.contains_key(&s)) || (c.definition && api[c.entry]) {
            open[k] = true;
        }
    }
    // A call through such a slot (see `crate::slots`), and a call of such
    // an API that no charged definition here answers (an import: the
    // definition in the interpreter library checks the depth), raise the
    // depth: the layers under them count nothing more. So does a call of
    // an entry point the user names that the file imports: its library,
    // patched with the same entry, hooks the definition at its entry
    // (`crate::hooks`) and checks the depth inside it.
    let slot_entries: HashSet<usize> = scan.slots.iter().map(|&(_, e)| e).collect();
    let imports_user = |s: &crate::scan::Site| s.via != Via::Direct && scan.user.contains(&s.entry);
    let bumps_alone = |s: &crate::scan::Site| api[s.entry] || slot_entries.contains(&s.entry) || imports_user(s);
    // The sites inside each wrapper: (wrapper, site).
    let within: Vec<(usize, usize)> =
        scan.sites.iter().enumerate().filter_map(|(i, s)| inside(s.vaddr.0).map(|k| (k, i))).collect();
    // The frees inside an allocation wrapper may only free what it returns
    // (on a path that fails), a realloc wrapper's also what it reallocates
    // (size 0): anything else is an object of the wrapper's own, which its
    // callers' counts would miss. A result freed is the one returned only
    // when a single allocation call inside could have made it.
    let mut allocations = vec![0usize; charged.len()];
    for &(k, i) in &within {
        if scan.entries[scan.sites[i].entry].sig.kind != Kind::Free {
            allocations[k] += 1;
        }
    }
    let fits = |k: usize, inner: Kind| {
        let c = &charged[k];
        match c.kind {
            Kind::Alloc | Kind::Realloc => {
                inner != Kind::Free || !(c.frees.other || (c.frees.result && allocations[k] > 1))
            }
            Kind::Free => inner == Kind::Free,
        }
    };
    // Where the allocator's pointers are relative to each wrapper's: its
    // own offsets plus those of the wrapper it calls, if any.
    let site_at: HashMap<u64, usize> = scan.sites.iter().enumerate().map(|(i, s)| (s.vaddr.0, i)).collect();
    let keys: Vec<Option<Keys>> =
        (0..charged.len()).map(|k| key_of(k, charged, &by_entry, &site_at, scan, 0)).collect();
    let mut ok: Vec<bool> = charged.iter().zip(&keys).map(|(c, key)| c.countable && key.is_some()).collect();
    // A reference inside that is not a site (a conditional or short jump,
    // a pointer taken) reaches what it reaches without counting or raising
    // the depth. Not a read of an allocator's slot: a call through the
    // register it fills reaches code whose sites are checked (the slot's
    // function) or a replacement allocator that calls it, and the API's
    // callers counted the call (an interpreter that inlines pymalloc
    // behind a compare of the slot, with link-time optimization).
    for r in &scan.unpatchable {
        if let Some(k) = inside(r.vaddr.0)
            && !slot_entries.contains(&r.entry)
        {
            ok[k] = false;
        }
    }
    // A wrapper of an allocator that throws (`operator new`) is charged
    // only where the trampolines get unwind entries (an exception through
    // the caller's trampoline then counts the call as failed and lowers
    // the depth again).
    for &(k, i) in &within {
        if !throwing_hooks && may_throw(&scan.entries[scan.sites[i].entry]) {
            ok[k] = false;
        }
    }
    // So is the file's own definition of one, which throws itself.
    for (k, c) in charged.iter().enumerate() {
        if c.definition && !throwing_hooks && may_throw(&scan.entries[c.entry]) {
            ok[k] = false;
        }
    }
    loop {
        let mut changed = false;
        for &(k, i) in &within {
            let s = &scan.sites[i];
            let inner = scan.entries[s.entry].sig.kind;
            let callee_ok = by_entry.get(&s.entry).is_none_or(|&j| ok[j]);
            if ok[k] && !(callee_ok && fits(k, inner)) {
                ok[k] = false;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    // A call raises the depth when the wrapper it reaches, or one that
    // wrapper calls, is open.
    let mut bump = open.clone();
    loop {
        let mut changed = false;
        for &(k, i) in &within {
            let s = &scan.sites[i];
            if by_entry.get(&s.entry).map_or(bumps_alone(s), |&j| bump[j]) && ok[k] && !bump[k] {
                bump[k] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    // Wrappers that call out of the file (through the PLT or the GOT, or
    // through another such wrapper): a call to one clobbers every
    // caller-saved register, as the compiler's interprocedural register
    // allocation assumes of a function with an external call in its body.
    // Found from below (a least fixpoint): a wrapper with no call out, or
    // only recursion, is not one.
    let mut external: Vec<bool> = charged.iter().map(|c| c.code.is_none()).collect();
    loop {
        let mut changed = false;
        for &(k, i) in &within {
            let s = &scan.sites[i];
            let out = match by_entry.get(&s.entry) {
                Some(&j) => external[j],
                None => s.via != Via::Direct,
            };
            if ok[k] && out && !external[k] {
                external[k] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    // Hooks: functions that are not charged but allocate, directly, through
    // charged wrappers, or through other hooks (found from below); none
    // that may throw unless the trampolines get unwind entries. Free
    // wrappers are left alone: a free finds its object wherever it was
    // charged.
    // A library's wrapper is one when its library's analysis says so (the
    // sites inside are the library's).
    let mut hook: Vec<bool> = charged.iter().map(|c| hooks && c.imported_hook && c.kind != Kind::Free).collect();
    let mut throws: Vec<bool> = vec![false; charged.len()];
    for &(k, i) in &within {
        if !throwing_hooks && may_throw(&scan.entries[scan.sites[i].entry]) {
            throws[k] = true;
        }
    }
    let hookable = |k: usize| {
        hooks
            && !ok[k]
            && !throws[k]
            && charged[k].kind != Kind::Free
            && charged[k].code.is_some()
            && !charged[k].definition
    };
    loop {
        let mut changed = false;
        for &(k, i) in &within {
            let s = &scan.sites[i];
            if hook[k] || !hookable(k) || scan.entries[s.entry].sig.kind == Kind::Free {
                continue;
            }
            let allocates = by_entry.get(&s.entry).is_none_or(|&j| ok[j] || (hook[j] && !s.form.is_tail()));
            if allocates {
                hook[k] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    // Hooks that call out of the file (through the PLT or the GOT, a
    // charged wrapper that does, or another such hook): clobbering every
    // caller-saved register, as for charged wrappers.
    let mut hook_external: Vec<bool> = charged.iter().map(|c| c.code.is_none()).collect();
    loop {
        let mut changed = false;
        for &(k, i) in &within {
            let s = &scan.sites[i];
            let out = match by_entry.get(&s.entry) {
                Some(&j) if ok[j] => external[j],
                Some(&j) => hook[j] && hook_external[j],
                None => s.via != Via::Direct,
            };
            if hook[k] && out && !hook_external[k] {
                hook_external[k] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let dropped = |s: &crate::scan::Site| {
        by_entry.get(&s.entry).is_some_and(|&j| !ok[j] && !charged[j].definition && (!hook[j] || s.form.is_tail()))
    };
    // The sites inside a definition of an allocator API that calls through
    // a slot check the depth even where it cannot be charged (a reference
    // inside that is not a site: an interpreter that inlines pymalloc
    // behind a compare of the slot with its functions' addresses): its
    // callers raise the depth all the same (`bumps_alone`).
    let layered = |k: usize| ok[k] || (charged[k].definition && api[charged[k].entry]);
    for s in scan.sites.iter_mut() {
        let callee = by_entry.get(&s.entry).copied();
        let holder = inside(s.vaddr.0);
        s.charge = match holder.filter(|&k| layered(k)) {
            Some(k) => Charge::Inside {
                wrapper: charged[k].wrapper.unwrap_or(usize::MAX),
                checked: open[k],
                bump: callee.map_or(bumps_alone(s), |j| bump[j]),
                external: callee.is_some_and(|j| external[j]),
            },
            None => match callee {
                Some(j) if ok[j] => Charge::Caller { bump: bump[j], external: external[j] },
                Some(j) if !charged[j].definition => Charge::Hook { external: hook_external[j] },
                _ if bumps_alone(s) => Charge::Caller { bump: true, external: s.via != Via::Direct },
                _ => Charge::Own,
            },
        };
        s.under_hook = holder.is_some_and(|k| hook[k])
            && matches!(s.charge, Charge::Own | Charge::Caller { .. })
            && scan.entries[s.entry].sig.kind != Kind::Free;
    }
    for (k, c) in charged.iter().enumerate() {
        if let (true, Some(key)) = (ok[k], keys[k])
            && key != Keys::default()
        {
            scan.keys.insert(c.entry, key);
        }
    }
    scan.sites.retain(|s| !dropped(s));
    scan.unpatchable.retain(|r| by_entry.get(&r.entry).is_none_or(|&j| ok[j] || charged[j].definition));
    charged
        .iter()
        .enumerate()
        .filter(|&(k, c)| c.definition && ok[k] && reached[k])
        .filter_map(|(k, c)| {
            let (start, end) = c.code?;
            Some(Hookable {
                entry: c.entry,
                start,
                end,
                wrapper: c.wrapper.unwrap_or(usize::MAX),
                external: external[k],
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scan::{Reason, Reference, Site};
    use alloctramp_trampolines::addr::{FileOffset, Vaddr};
    use alloctramp_trampolines::entry::{Signature, Size, Target};
    use alloctramp_trampolines::layout::SiteForm;

    /// Entry 0 is `malloc` (through the PLT); wrapper k is entry k + 1, its
    /// code at 0x1000 * (k + 1).
    fn setup(wrappers: usize) -> (Scan, Vec<Charged>) {
        let mut entries = vec![EntryPoint {
            target: Target::Symbol("malloc".into()),
            display: "malloc".into(),
            sig: Signature::alloc(Size::Arg(0)),
            args: 1,
            heap: Heap::Malloc,
        }];
        let mut charged = Vec::new();
        for k in 0..wrappers {
            let start = 0x1000 * (k as u64 + 1);
            charged.push(Charged {
                entry: entries.len(),
                wrapper: Some(k),
                code: Some((start, start + 0x100)),
                open: false,
                kind: Kind::Alloc,
                countable: true,
                definition: false,
                imported_hook: false,
                frees: Frees::default(),
                at: None,
                offsets: Offsets::default(),
                also: Vec::new(),
            });
            entries.push(EntryPoint {
                target: Target::Address(start),
                display: format!("w{k}"),
                sig: Signature::alloc(Size::Arg(0)),
                args: 6,
                heap: Heap::Malloc,
            });
        }
        (Scan { entries, ..Scan::default() }, charged)
    }

    fn site(scan: &mut Scan, at: u64, entry: usize, via: Via) {
        scan.sites.push(Site {
            vaddr: Vaddr(at),
            offset: FileOffset(at),
            len: 5,
            original: [0; 8],
            form: SiteForm::CallRel32,
            entry,
            via,
            target: Vaddr(0),
            charge: Charge::Own,
            under_hook: false,
            hook: None,
        });
    }

    fn charges(scan: &Scan) -> Vec<(u64, Charge)> {
        scan.sites.iter().map(|s| (s.vaddr.0, s.charge)).collect()
    }

    #[test]
    fn closed_open_and_nested_wrappers() {
        // w0 calls malloc@plt; w1 (open: its address is taken) calls w0;
        // the program calls both.
        let (mut scan, mut charged) = setup(2);
        charged[1].open = true;
        site(&mut scan, 0x1010, 0, Via::Plt);
        site(&mut scan, 0x2010, 1, Via::Direct);
        site(&mut scan, 0x9000, 1, Via::Direct);
        site(&mut scan, 0x9010, 2, Via::Direct);
        decide(&mut scan, &charged, &HashMap::new(), true, false);
        assert_eq!(
            charges(&scan),
            [
                (0x1010, Charge::Inside { wrapper: 0, checked: false, bump: false, external: false }),
                (0x2010, Charge::Inside { wrapper: 1, checked: true, bump: false, external: true }),
                (0x9000, Charge::Caller { bump: false, external: true }),
                (0x9010, Charge::Caller { bump: true, external: true }),
            ]
        );
    }

    #[test]
    fn calls_of_an_imported_slot_api_raise_the_depth_through_wrappers() {
        // An extension module: w0 (closed) calls PyObject_Malloc@plt, which
        // the interpreter library defines and checks the depth inside; the
        // module calls w0 and PyObject_Malloc itself. Both must raise the
        // depth, or the library's slot site counts the call again.
        let (mut scan, charged) = setup(1);
        scan.entries[0] = EntryPoint {
            target: Target::Symbol("PyObject_Malloc".into()),
            display: "PyObject_Malloc".into(),
            sig: Signature::alloc(Size::Arg(0)),
            args: 1,
            heap: Heap::Other,
        };
        site(&mut scan, 0x1010, 0, Via::Plt);
        site(&mut scan, 0x9000, 1, Via::Direct);
        site(&mut scan, 0x9010, 0, Via::Plt);
        decide(&mut scan, &charged, &HashMap::new(), true, false);
        assert_eq!(
            charges(&scan),
            [
                (0x1010, Charge::Inside { wrapper: 0, checked: false, bump: true, external: false }),
                (0x9000, Charge::Caller { bump: true, external: true }),
                (0x9010, Charge::Caller { bump: true, external: true }),
            ]
        );
    }

    #[test]
    fn the_sites_in_a_slot_api_definition_check_the_depth_even_uncharged() {
        // d0 defines PyObject_Malloc and calls malloc@plt, with a reference
        // inside that is not a site (a compare with a function's address):
        // not charged, yet its callers raise the depth and its malloc
        // counts only at depth 0.
        let (mut scan, mut charged) = setup(1);
        scan.entries[1].target = Target::Symbol("PyObject_Malloc".into());
        charged[0].definition = true;
        charged[0].wrapper = None;
        scan.unpatchable.push(Reference { vaddr: Vaddr(0x1020), offset: None, entry: 0, reason: Reason::AddressTaken });
        site(&mut scan, 0x1010, 0, Via::Plt);
        site(&mut scan, 0x9000, 1, Via::Direct);
        decide(&mut scan, &charged, &HashMap::new(), true, false);
        assert_eq!(
            charges(&scan),
            [
                (0x1010, Charge::Inside { wrapper: usize::MAX, checked: true, bump: false, external: false }),
                (0x9000, Charge::Caller { bump: true, external: false }),
            ]
        );
    }

    #[test]
    fn a_definition_of_an_entry_point_charged_or_not() {
        // d0 and d1 are the file's own definitions of entry points (as an
        // operator new calling malloc@plt): d0 open (exported), d1 with an
        // unpatchable reference inside, so not charged. The program calls
        // both, and d0 is reached from d1.
        let (mut scan, mut charged) = setup(2);
        for c in charged.iter_mut() {
            c.definition = true;
            c.wrapper = None;
        }
        charged[0].open = true;
        scan.unpatchable.push(Reference { vaddr: Vaddr(0x2020), offset: None, entry: 0, reason: Reason::ShortJump });
        site(&mut scan, 0x1010, 0, Via::Plt);
        site(&mut scan, 0x2010, 1, Via::Direct);
        site(&mut scan, 0x9000, 1, Via::Direct);
        site(&mut scan, 0x9010, 2, Via::Direct);
        decide(&mut scan, &charged, &HashMap::new(), true, false);
        // d0's malloc counts only at depth 0; the calls of d1 stay sites
        // of their own (neither dropped nor hooks), d1's call of d0 too.
        let open = Charge::Inside { wrapper: usize::MAX, checked: true, bump: false, external: false };
        assert_eq!(
            charges(&scan),
            [
                (0x1010, open),
                (0x2010, Charge::Caller { bump: true, external: true }),
                (0x9000, Charge::Caller { bump: true, external: true }),
                (0x9010, Charge::Own),
            ]
        );
        assert_eq!(scan.unpatchable.len(), 1);
    }

    #[test]
    fn what_stops_a_wrapper_from_being_charged() {
        // w0: a short jump to malloc inside (an unpatchable reference); w1
        // calls w0; w2 has no call out and recurses into itself.
        let (mut scan, charged) = setup(3);
        scan.unpatchable.push(Reference { vaddr: Vaddr(0x1020), offset: None, entry: 0, reason: Reason::ShortJump });
        site(&mut scan, 0x1010, 0, Via::Plt);
        site(&mut scan, 0x2010, 1, Via::Direct);
        site(&mut scan, 0x3010, 3, Via::Direct);
        site(&mut scan, 0x9000, 1, Via::Direct);
        site(&mut scan, 0x9010, 2, Via::Direct);
        site(&mut scan, 0x9020, 3, Via::Direct);
        decide(&mut scan, &charged, &HashMap::new(), true, false);
        // w0 and w1 are not charged, but they allocate: calls to them are
        // hooks (w1's call of w0 too, which nests), and w0's malloc counts
        // into the outermost hook's cell. w2 is charged but keeps preserve
        // mode (nothing in it calls out).
        assert_eq!(
            charges(&scan),
            [
                (0x1010, Charge::Own),
                (0x2010, Charge::Hook { external: true }),
                (0x3010, Charge::Inside { wrapper: 2, checked: false, bump: false, external: false }),
                (0x9000, Charge::Hook { external: true }),
                (0x9010, Charge::Hook { external: true }),
                (0x9020, Charge::Caller { bump: false, external: false }),
            ]
        );
        let under: Vec<u64> = scan.sites.iter().filter(|s| s.under_hook).map(|s| s.vaddr.0).collect();
        assert_eq!(under, [0x1010]);
    }

    #[test]
    fn what_makes_a_hook() {
        // w0 (not countable) calls malloc; w1 (not countable) calls
        // operator new, which may throw; w2 (a free wrapper, not charged)
        // calls free; w3 (plumbing, no wrapper) tail-calls w0 and calls
        // nothing else.
        let (mut scan, mut charged) = setup(4);
        for c in &mut charged {
            c.countable = false;
        }
        charged[2].kind = Kind::Free;
        charged[3].wrapper = None;
        scan.entries.push(EntryPoint {
            target: Target::Symbol("_Znwm".into()),
            display: "operator new".into(),
            sig: Signature::alloc(Size::Arg(0)),
            args: 1,
            heap: Heap::Malloc,
        });
        scan.entries.push(EntryPoint {
            target: Target::Symbol("free".into()),
            display: "free".into(),
            sig: Signature::free(0),
            args: 1,
            heap: Heap::Malloc,
        });
        site(&mut scan, 0x1010, 0, Via::Plt);
        site(&mut scan, 0x2010, 5, Via::Plt);
        site(&mut scan, 0x3010, 6, Via::Plt);
        site(&mut scan, 0x4010, 1, Via::Direct);
        if let Some(tail) = scan.sites.last_mut() {
            tail.form = SiteForm::JmpRel32;
        }
        for (k, at) in [(1, 0x9000), (2, 0x9010), (3, 0x9020), (4, 0x9030)] {
            site(&mut scan, at, k, Via::Direct);
        }
        decide(&mut scan, &charged, &HashMap::new(), true, false);
        // Only w0 is a hook: w1 may throw, w2 frees, and w3 reaches w0 by a
        // tail jump only (a hook's trampoline must return to it).
        assert_eq!(
            charges(&scan),
            [
                (0x1010, Charge::Own),
                (0x2010, Charge::Own),
                (0x3010, Charge::Own),
                (0x9000, Charge::Hook { external: true })
            ]
        );
        let under: Vec<u64> = scan.sites.iter().filter(|s| s.under_hook).map(|s| s.vaddr.0).collect();
        assert_eq!(under, [0x1010]);
    }

    #[test]
    fn an_address_in_data_opens_a_wrapper_and_headers_add_up() {
        // w1 returns w0's result + 8; w0 returns malloc's + 16.
        let (mut scan, mut charged) = setup(2);
        charged[0].at = Some(0x1010);
        charged[0].offsets = Offsets { result: 16, ptr: 0 };
        charged[1].at = Some(0x2010);
        charged[1].offsets = Offsets { result: 8, ptr: 0 };
        site(&mut scan, 0x1010, 0, Via::Plt);
        site(&mut scan, 0x2010, 1, Via::Direct);
        site(&mut scan, 0x9000, 2, Via::Direct);
        let hookable = decide(&mut scan, &charged, &HashMap::from([(0x1000, vec![(0x5000, true)])]), true, false);
        assert_eq!(scan.keys.get(&1), Some(&Keys { result: 16, ptr: 0 }));
        assert_eq!(scan.keys.get(&2), Some(&Keys { result: 24, ptr: 0 }));
        assert!(matches!(scan.sites[0].charge, Charge::Inside { checked: true, .. }));
        assert_eq!(scan.sites[2].charge, Charge::Caller { bump: true, external: true });
        // Wrappers found are not hooked: only definitions of entry points.
        assert_eq!(hookable, []);
    }

    /// A definition of an entry point is hookable when its address is held
    /// in data, but not when only a GOT slot its callers' sites read, a
    /// relocation's addend or a symbol's value holds it.
    #[test]
    fn a_definition_held_in_data_is_hookable() {
        for (held, hookable) in [
            (vec![(0x5000, true)], true),
            (vec![(0x6000, true)], false),
            (vec![(0x7000, false)], false),
            (vec![(0x6000, true), (0x7000, false)], false),
        ] {
            let (mut scan, mut charged) = setup(1);
            charged[0].definition = true;
            charged[0].wrapper = None;
            site(&mut scan, 0x1010, 0, Via::Plt);
            site(&mut scan, 0x9000, 1, Via::Got);
            if let Some(s) = scan.sites.last_mut() {
                s.target = Vaddr(0x6000);
            }
            let got = decide(&mut scan, &charged, &HashMap::from([(0x1000, held.clone())]), true, false);
            let want = Hookable { entry: 1, start: 0x1000, end: 0x1100, wrapper: usize::MAX, external: true };
            assert_eq!(got, if hookable { vec![want] } else { vec![] }, "{held:?}");
            assert_eq!(
                scan.sites[0].charge,
                Charge::Inside { wrapper: usize::MAX, checked: true, bump: false, external: false }
            );
        }
    }
}
