//! Site discovery: resolve where each allocator entry point can be reached
//! in a file (PLT stubs, GOT slots, local definitions), then sweep every
//! executable section once and classify each instruction that reaches one.

use crate::elf::{Elf, FileType, Section};
use crate::error::{Error, ErrorKind, Location, Result};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use alloctramp_trampolines::entry::{EntryPoint, Heap, Kind, Target};
use alloctramp_trampolines::layout::SiteForm;
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};
use std::collections::HashMap;

/// What a site's instruction points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// A PLT stub (in .plt, .plt.sec or .plt.got).
    Plt,
    /// A GOT slot filled by the dynamic linker.
    Got,
    /// A function defined in this file.
    Direct,
}

/// A call site that can be patched.
#[derive(Clone, Debug)]
pub struct Site {
    pub vaddr: Vaddr,
    pub offset: FileOffset,
    pub len: u8,
    /// The instruction's first bytes (up to `len`), read while the scan
    /// has them at hand: the site table records them, and the input's
    /// code need not be read again.
    pub original: [u8; 8],
    /// How its instruction reaches the entry point.
    pub form: SiteForm,
    /// Index into [`Scan::entries`].
    pub entry: usize,
    pub via: Via,
    /// The branch target (a PLT stub or a definition) or the GOT slot read.
    pub target: Vaddr,
    /// How its count nests with allocation wrappers.
    pub charge: Charge,
    /// The site (an allocation or realloc, counted here or for a charged
    /// wrapper) is inside a hooked function (see [`Charge::Hook`]): during
    /// a hook's call it counts into the hook's cell instead.
    pub under_hook: bool,
    /// The site is an entry hook's (see `crate::hooks`): at `vaddr`, the
    /// hooked function's first moved instruction, the patched file holds
    /// a jump to the stub the plan places (`target`, known then).
    pub hook: Option<Box<crate::hooks::EntryHook>>,
}

/// How a site's count nests with the allocation wrappers whose callers
/// are charged (see [`crate::charge`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Charge {
    /// Counted here: a call to an allocator outside any charged wrapper.
    #[default]
    Own,
    /// A call to a charged wrapper, counted here for what the wrapper
    /// allocates. `bump`: the wrapper (or one it calls) can also be
    /// reached without such a call, so the call raises the thread's
    /// wrapper depth, which the checked sites inside read. `external`:
    /// every allocation the wrapper makes is a call out of the file
    /// (through the PLT or the GOT, maybe through other such wrappers), so
    /// a call to it clobbers what any external call clobbers, and its
    /// trampoline keeps no more registers than one for `malloc@plt`.
    Caller { bump: bool, external: bool },
    /// A call inside the charged wrapper `wrapper` (an index into
    /// [`crate::Analysis::wrappers`]), counted at the wrapper's callers.
    /// `checked`: the wrapper can be reached other than through a site, so
    /// the call counts here when the thread's wrapper depth is 0 (and
    /// raises it around the call if `bump`); otherwise it is never patched.
    /// `external` as for a caller, when it calls a wrapper.
    Inside { wrapper: usize, checked: bool, bump: bool, external: bool },
    /// A call to a function whose allocations its callers take but whose
    /// calls cannot be counted as one allocation (an allocation wrapper
    /// whose size is not one of its arguments, or allocation plumbing that
    /// was not inlined): as the kernel's `alloc_hooks()`, the outermost
    /// such call on a thread has what the sites inside the function
    /// allocate during it counted in its own cell. `external` as for a
    /// caller: the function calls out of the file on some path.
    Hook { external: bool },
}

/// Why a reference to an entry point cannot be patched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    /// `jcc` to the entry point: a conditional tail call.
    ConditionalJump,
    /// `jmp rel8`: too short to be replaced by a jump to a trampoline.
    ShortJump,
    /// The entry point's address is computed (`lea`) or used as an
    /// immediate: a function pointer is taken.
    AddressTaken,
    /// A GOT slot is read into a register or memory operand: the call that
    /// follows goes through a register.
    GotSlotRead,
    /// A relocation stores the entry point's address in data.
    AddressInData,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::ConditionalJump => "conditional jump",
            Reason::ShortJump => "short jump (rel8)",
            Reason::AddressTaken => "function address taken",
            Reason::GotSlotRead => "GOT slot read into a register",
            Reason::AddressInData => "address stored in data",
        }
    }
}

/// A reference to an entry point that is not patched.
#[derive(Clone, Debug)]
pub struct Reference {
    pub vaddr: Vaddr,
    /// None for references outside the file's loaded contents.
    pub offset: Option<FileOffset>,
    pub entry: usize,
    pub reason: Reason,
}

/// The result of a scan.
#[derive(Clone, Debug, Default)]
pub struct Scan {
    pub entries: Vec<EntryPoint>,
    pub sites: Vec<Site>,
    pub unpatchable: Vec<Reference>,
    /// User-named entry points that the file neither defines nor imports.
    pub unresolved: Vec<usize>,
    /// Bytes of executable code swept.
    pub code_bytes: u64,
    /// For the entries of charged allocation wrappers with a size header:
    /// where the allocator's pointers are relative to the wrapper's (see
    /// [`Keys`]).
    pub keys: HashMap<usize, Keys>,
    /// The entries the user named.
    pub user: std::ops::Range<usize>,
    /// The file defines a default entry that allocates itself (its own
    /// malloc or operator new, which may be another allocator), and not
    /// only as a way to the process's malloc (see
    /// [`Scan::forward_own_definitions`]).
    pub own_allocator: bool,
    /// The file's own definitions of default entries: (address, entry),
    /// sorted.
    pub own_definitions: Vec<(Vaddr, usize)>,
    /// The file reaches a default entry of another heap than the
    /// process's malloc ([`Heap::Other`]: jemalloc's `mallocx`,
    /// mimalloc's `mi_malloc`).
    pub other_heap: bool,
    /// Slots in data that allocator APIs call their allocator through, and
    /// their entries (see `crate::slots`), by address.
    pub slots: Vec<(u64, usize)>,
}

impl Scan {
    /// Whether entry `entry` allocates from the process's malloc (which
    /// the runtime checks is glibc's), in a file that defines no default
    /// entry itself: a default entry of [`Heap::Malloc`], or a wrapper
    /// found where every entry the file reaches is one (a wrapper found
    /// around a user-named allocator or another allocator's API is not
    /// known to be).
    pub fn plain_store(&self, entry: usize) -> bool {
        if self.own_allocator || self.user.contains(&entry) {
            return false;
        }
        if entry < self.user.start {
            return self.entries.get(entry).is_some_and(|e| e.heap == Heap::Malloc);
        }
        self.user.is_empty() && !self.other_heap
    }

    /// Clears [`Scan::own_allocator`] where each of the file's own
    /// definitions of a default entry that allocates is only a way to the
    /// process's malloc: a wrapper found (`wrappers`, by
    /// `crate::wrappers::discover`) whose every path returns, at offset 0,
    /// what its one call of an allocator returns, or tail-calls it
    /// ([`Wrapper::one_source`](crate::wrappers::Wrapper)), where that call
    /// is of a process-malloc entry the file imports (through the PLT or
    /// GOT), or of another such definition. (libstdc++'s operator new,
    /// linked into a program with `-static-libstdc++`: its objects are
    /// malloc's, which the runtime checks is glibc's, and their records can
    /// take a plain store.) Without the search, or with any other
    /// definition (a pool on one path, a size header), the file keeps
    /// compare-and-swap records.
    pub fn forward_own_definitions(&mut self, wrappers: &[crate::wrappers::Wrapper]) {
        use crate::wrappers::{Callee, Why};
        let allocates = |i: usize| self.entries.get(i).is_some_and(|e| e.sig.kind != Kind::Free);
        let own = |i: usize| self.own_definitions.iter().any(|&(_, e)| e == i);
        let mut pending: Vec<u64> =
            self.own_definitions.iter().filter(|&&(_, i)| allocates(i)).map(|(a, _)| a.0).collect();
        let mut forwarding: Vec<u64> = Vec::new();
        loop {
            let before = pending.len();
            pending.retain(|&addr| {
                let Some(w) = wrappers.iter().find(|w| w.start == addr) else { return true };
                let at = match w.why {
                    Why::Returns { at, offset: 0 } | Why::TailCall { at } => at,
                    _ => return true,
                };
                let call =
                    self.sites.binary_search_by_key(&Vaddr(at), |s| s.vaddr).ok().and_then(|k| self.sites.get(k));
                let to_malloc = call.is_some_and(|c| {
                    c.entry < self.user.start
                        && self.entries.get(c.entry).is_some_and(|e| e.heap == Heap::Malloc)
                        && match own(c.entry) {
                            // The file's own definition, called directly.
                            true => c.via == Via::Direct && forwarding.contains(&c.target.0),
                            false => c.via != Via::Direct,
                        }
                });
                let plain = matches!(w.role, Callee::Alloc { .. } | Callee::Realloc { .. }) && w.one_source;
                if plain && to_malloc {
                    forwarding.push(addr);
                }
                !(plain && to_malloc)
            });
            if pending.is_empty() {
                self.own_allocator = false;
                return;
            }
            if pending.len() == before {
                return;
            }
        }
    }

    /// Whether entry `entry`'s allocator returns 8-aligned pointers only:
    /// the process's malloc ([`Heap::Malloc`]: C requires it), and a
    /// wrapper found in a file that reaches no other allocator. Not
    /// another allocator's API (mimalloc's `mi_malloc_aligned_at` returns
    /// a pointer whose sum with an offset is aligned, and any of its frees
    /// may be given it), an entry the user names, or a wrapper that may be
    /// around one of those.
    pub fn aligned(&self, entry: usize) -> bool {
        if entry < self.user.start {
            return self.entries.get(entry).is_some_and(|e| e.heap == Heap::Malloc);
        }
        !self.user.contains(&entry) && self.user.is_empty() && !self.other_heap
    }

    /// Whether entry `entry` is a call through an allocator API's slot.
    pub fn is_slot(&self, entry: usize) -> bool {
        self.slots.iter().any(|&(_, e)| e == entry)
    }
}

/// How a site calling an allocation wrapper with a size header in front
/// finds the allocator's own pointer, which live tracking keys objects by
/// (a free on any path, through the wrapper or not, finds them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Keys {
    /// The wrapper returns the allocator's pointer plus this.
    pub result: i32,
    /// The wrapper frees or reallocates its pointer argument plus this.
    pub ptr: i32,
}

/// Where entry points can be reached in one file. Looked up for every
/// call and jump of the file: hashed with foldhash (std's SipHash resists
/// flooding, which addresses from the file being read need not: a crafted
/// file only slows its own patching).
#[derive(Default)]
struct Targets {
    /// GOT slot address -> entry.
    got: foldhash::HashMap<u64, usize>,
    /// Code address (PLT stub or definition) -> entry and how.
    code: foldhash::HashMap<u64, (usize, Via)>,
    lo: u64,
    hi: u64,
}

impl Targets {
    fn code_target(&self, addr: u64) -> Option<(usize, Via)> {
        if addr < self.lo || addr > self.hi { None } else { self.code.get(&addr).copied() }
    }
}

pub(crate) fn is_plt(s: &Section) -> bool {
    matches!(s.name, ".plt" | ".plt.sec" | ".plt.got" | ".iplt")
}

/// Finds the GOT slot a PLT stub jumps through: the first `jmp [rip+disp]`
/// from the stub's start, past an optional `endbr64` and NOPs.
pub(crate) fn plt_stub_slot(sec: &Section, addr: u64) -> Option<u64> {
    let start = (addr - sec.addr.0) as usize;
    let bytes = sec.data.get(start..)?;
    let mut dec = Decoder::with_ip(64, bytes, addr, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    for _ in 0..4 {
        if !dec.can_decode() {
            return None;
        }
        dec.decode_out(&mut ins);
        match ins.code() {
            Code::Endbr64 => continue,
            _ if ins.mnemonic() == Mnemonic::Nop => continue,
            Code::Jmp_rm64 if ins.memory_base() == Register::RIP => return Some(ins.ip_rel_memory_address()),
            _ => return None,
        }
    }
    None
}

fn resolve_targets(elf: &Elf, entries: &[EntryPoint], slots: &[(u64, usize)]) -> (Targets, Vec<bool>) {
    let mut t = Targets::default();
    let mut found = vec![false; entries.len()];
    for &(slot, i) in slots {
        t.got.insert(slot, i);
        found[i] = true;
    }
    let mut by_name: HashMap<&str, usize> = HashMap::new();
    // Later entries (user-named) take precedence over earlier (defaults).
    for (i, e) in entries.iter().enumerate() {
        match &e.target {
            Target::Symbol(s) => {
                by_name.insert(s.as_str(), i);
            }
            Target::Address(a) => {
                if elf.section_at(*a).is_some_and(|s| s.is_exec()) {
                    t.code.insert(*a, (i, Via::Direct));
                    found[i] = true;
                }
            }
        }
    }

    // GOT slots, from the dynamic relocations that name entry symbols.
    for r in elf.dynamic_relocations() {
        let Some(name) = r.symbol else { continue };
        if !matches!(r.r_type, 6 | 7) {
            // R_X86_64_GLOB_DAT (6), R_X86_64_JUMP_SLOT (7)
            continue;
        }
        if let Some(&i) = by_name.get(name) {
            t.got.insert(r.offset.0, i);
            found[i] = true;
        }
    }

    // Definitions in this file; a C library's internal names
    // (`__libc_malloc`) only where no other entry's name is at the address.
    for aliases in [false, true] {
        for dynamic in [false, true] {
            for sym in elf.symbols(dynamic) {
                if !sym.defined || !sym.is_func || alloctramp_trampolines::entry::is_alias_name(sym.name) != aliases {
                    continue;
                }
                if let Some(&i) = by_name.get(sym.name)
                    && elf.section_at(sym.value).is_some_and(|s| s.is_exec())
                {
                    t.code.entry(sym.value).or_insert((i, Via::Direct));
                    found[i] = true;
                }
            }
        }
    }

    // GOT slots that a relative relocation fills with the address of an
    // entry point the file defines: `call *f@GOTPCREL(%rip)` to a function
    // of the file that the linker did not relax to a direct call (Rust's
    // `__rust_alloc`, code built with -fno-plt).
    let in_got = |a: u64| elf.sections.iter().any(|s| s.name == ".got" && s.contains(a));
    for r in elf.dynamic_relocations() {
        if r.r_type == 8
            && let Ok(a) = u64::try_from(r.addend)
            && let Some(&(i, Via::Direct)) = t.code.get(&a)
            && in_got(r.offset.0)
        {
            t.got.insert(r.offset.0, i);
        }
    }

    // PLT stubs: decode each stub to find its GOT slot.
    if !t.got.is_empty() {
        for sec in elf.sections.iter().filter(|s| is_plt(s) && s.is_exec()) {
            let step = match sec.name {
                ".plt.got" => 8,
                _ => 16,
            };
            let mut off = 0u64;
            // The stubs present in the file (a section without contents has
            // none, whatever its size says).
            while off < sec.data.len() as u64 {
                let addr = sec.addr.0 + off;
                if let Some(slot) = plt_stub_slot(sec, addr)
                    && let Some(&i) = t.got.get(&slot)
                {
                    t.code.insert(addr, (i, Via::Plt));
                }
                off += step;
            }
        }
    }
    t.lo = t.code.keys().copied().min().unwrap_or(u64::MAX);
    t.hi = t.code.keys().copied().max().unwrap_or(0);
    (t, found)
}

/// Scans a file for calls to the given entry points.
///
/// `entries[user]` are the entry points a user named; those the file
/// neither defines nor imports are listed in [`Scan::unresolved`].
pub fn scan(elf: &Elf, entries: Vec<EntryPoint>, user: std::ops::Range<usize>) -> Result<Scan> {
    scan_with(elf, entries, user, Vec::new())
}

/// [`scan`], with calls through `slots` (addresses in data, with their
/// entries: see `crate::slots`) as sites too.
pub fn scan_with(
    elf: &Elf,
    entries: Vec<EntryPoint>,
    user: std::ops::Range<usize>,
    slots: Vec<(u64, usize)>,
) -> Result<Scan> {
    let (targets, found) = resolve_targets(elf, &entries, &slots);
    let mut own_definitions: Vec<(Vaddr, usize)> = targets
        .code
        .iter()
        .filter(|&(_, &(i, via))| via == Via::Direct && i < user.start)
        .map(|(&addr, &(i, _))| (Vaddr(addr), i))
        .collect();
    own_definitions.sort_unstable();
    let own_allocator = own_definitions.iter().any(|&(_, i)| entries.get(i).is_some_and(|e| e.sig.kind != Kind::Free));
    let other_heap = (0..user.start).any(|i| found.get(i) == Some(&true) && entries[i].heap == Heap::Other);
    let mut out = Scan {
        unresolved: user.clone().filter(|&i| !found[i]).collect(),
        entries,
        user,
        own_allocator,
        own_definitions,
        other_heap,
        slots,
        ..Scan::default()
    };
    if targets.got.is_empty() && targets.code.is_empty() {
        return Ok(out);
    }

    let starts = function_starts(elf);
    let absolute_immediates = elf.file_type == FileType::Exec;
    let chunks = plan_chunks(elf, &starts);
    out.code_bytes = chunks.iter().map(|c| c.2 - c.1).sum();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(chunks.len()).max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut results: Vec<(usize, Found)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(sec, lo, hi)) = chunks.get(i) else { break };
                        mine.push((i, sweep(elf, &targets, &starts, &elf.sections[sec], lo, hi, absolute_immediates)));
                    }
                    mine
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
    });
    results.sort_by_key(|r| r.0);
    for (_, found) in results {
        out.sites.extend(found.sites);
        out.unpatchable.extend(found.refs);
    }

    // Addresses of entry points stored in data through relocations.
    let mut by_symbol: HashMap<&str, usize> = HashMap::new();
    for (i, e) in out.entries.iter().enumerate() {
        if let Target::Symbol(name) = &e.target {
            by_symbol.entry(name.as_str()).or_insert(i);
        }
    }
    for r in elf.dynamic_relocations() {
        let entry = match (r.r_type, r.symbol) {
            (1, Some(name)) => by_symbol.get(name).copied(),
            // A GOT slot is read by calls (sites) or loads (references).
            (8, _) if targets.got.contains_key(&r.offset.0) => None,
            (8, _) => u64::try_from(r.addend).ok().and_then(|a| targets.code_target(a)).map(|(i, _)| i),
            _ => None,
        };
        if let Some(entry) = entry {
            out.unpatchable.push(Reference {
                vaddr: r.offset,
                offset: elf.offset_of(r.offset),
                entry,
                reason: Reason::AddressInData,
            });
        }
    }

    out.sites.sort_by_key(|s| s.vaddr);
    out.unpatchable.sort_by_key(|r| (r.vaddr, r.reason, r.entry));
    // Executable sections that overlap (a malformed file's) are swept once
    // each: an instruction at one address is one site, one reference.
    out.sites.dedup_by_key(|s| s.vaddr);
    out.unpatchable.dedup_by_key(|r| (r.vaddr, r.reason, r.entry));
    Ok(out)
}

/// What one sweep of a code range found.
#[derive(Default)]
struct Found {
    sites: Vec<Site>,
    refs: Vec<Reference>,
}

/// Splits the executable sections into ranges that begin at function starts,
/// so they can be swept in parallel with the same result as one sweep (a
/// sweep is realigned at every function start anyway).
fn plan_chunks(elf: &Elf, starts: &[u64]) -> Vec<(usize, u64, u64)> {
    const CHUNK: u64 = 1 << 20;
    let mut chunks = Vec::new();
    // A patched file's trampolines call the entry points too: they are not
    // the program's sites.
    let ours = |s: &Section| s.name == alloctramp_trampolines::layout::SEC_TEXT;
    for sec in elf.sections.iter().filter(|s| s.is_exec() && s.is_alloc() && !is_plt(s) && !ours(s)) {
        if sec.data.len() as u64 != sec.size || sec.size == 0 {
            continue;
        }
        let (base, end) = (sec.addr.0, sec.addr.0 + sec.size);
        let mut lo = base;
        while end - lo > CHUNK {
            // The first function start at least CHUNK bytes further on.
            let i = starts.partition_point(|&a| a < lo + CHUNK);
            match starts.get(i) {
                Some(&cut) if cut < end => {
                    chunks.push((sec.index, lo, cut));
                    lo = cut;
                }
                _ => break,
            }
        }
        chunks.push((sec.index, lo, end));
    }
    chunks
}

/// Decodes `[lo, hi)` of a section linearly and classifies every
/// instruction, realigning at function starts.
fn sweep(elf: &Elf, targets: &Targets, starts: &[u64], sec: &Section, lo: u64, hi: u64, abs_imm: bool) -> Found {
    let mut found = Found::default();
    walk(starts, sec, lo, hi, |ins| classify(elf, targets, ins, abs_imm, &mut found));
    found
}

/// The starts of the file's functions, sorted: where a sweep that lost
/// step realigns, as a disassembler does at every symbol.
pub(crate) fn function_starts(elf: &Elf) -> Vec<u64> {
    let mut starts: Vec<u64> = elf
        .symbols(false)
        .iter()
        .chain(elf.symbols(true))
        .filter(|s| s.defined && s.is_func)
        .map(|s| s.value)
        .collect();
    starts.sort_unstable();
    starts.dedup();
    starts
}

/// Every range of code the scan sweeps (see [`plan_chunks`]), decoded, each
/// instruction given to `f`.
pub(crate) fn for_each_instruction(elf: &Elf, starts: &[u64], mut f: impl FnMut(&Instruction)) {
    for (sec, lo, hi) in plan_chunks(elf, starts) {
        walk(starts, &elf.sections[sec], lo, hi, &mut f);
    }
}

/// Decodes `[lo, hi)` of a section linearly, realigning at the function
/// starts `starts`, and gives each instruction to `f`.
#[inline]
fn walk(starts: &[u64], sec: &Section, lo: u64, hi: u64, mut f: impl FnMut(&Instruction)) {
    let base = sec.addr.0;
    let data = &sec.data[(lo - base) as usize..(hi - base) as usize];
    let mut next_start = starts.partition_point(|&a| a <= lo);
    let mut dec = Decoder::with_ip(64, data, lo, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    while dec.can_decode() {
        dec.decode_out(&mut ins);
        let ip = ins.ip();
        let next = ins.next_ip();
        // Realign at a function start that this instruction overlaps.
        while next_start < starts.len() && starts[next_start] <= ip {
            next_start += 1;
        }
        if next_start < starts.len() && starts[next_start] < next {
            let s = starts[next_start];
            if s >= hi {
                break;
            }
            dec.set_ip(s);
            if dec.set_position((s - lo) as usize).is_err() {
                break;
            }
            continue;
        }
        f(&ins);
    }
}

fn site_offset(elf: &Elf, vaddr: u64) -> Result<FileOffset> {
    elf.offset_of(Vaddr(vaddr)).ok_or_else(|| {
        Error::new(
            ErrorKind::Malformed,
            Location::Vaddr(Vaddr(vaddr)),
            "executable section is not covered by a loadable segment",
        )
    })
}

#[inline]
fn classify(elf: &Elf, t: &Targets, ins: &Instruction, absolute_immediates: bool, out: &mut Found) {
    let ip = ins.ip();
    let site = |form: SiteForm, entry: usize, via: Via, target: u64, out: &mut Found| {
        // A section outside every segment cannot be patched at run time.
        let Ok(offset) = site_offset(elf, ip) else { return };
        let mut original = [0u8; 8];
        let bytes = elf.bytes_at(ip, ins.len()).unwrap_or(&[]);
        for (o, &b) in original.iter_mut().zip(bytes) {
            *o = b;
        }
        out.sites.push(Site {
            vaddr: Vaddr(ip),
            offset,
            len: ins.len() as u8,
            original,
            form,
            entry,
            via,
            target: Vaddr(target),
            charge: Charge::Own,
            under_hook: false,
            hook: None,
        });
    };
    let unpatchable = |entry: usize, reason: Reason, out: &mut Found| {
        out.refs.push(Reference { vaddr: Vaddr(ip), offset: elf.offset_of(Vaddr(ip)), entry, reason });
    };
    match ins.code() {
        Code::Call_rel32_64 | Code::Jmp_rel32_64 | Code::Jmp_rel8_64 => {
            let target = ins.near_branch64();
            if let Some((entry, via)) = t.code_target(target) {
                match ins.code() {
                    Code::Call_rel32_64 => site(SiteForm::CallRel32, entry, via, target, out),
                    Code::Jmp_rel32_64 => site(SiteForm::JmpRel32, entry, via, target, out),
                    _ => unpatchable(entry, Reason::ShortJump, out),
                }
            }
            return;
        }
        Code::Call_rm64 | Code::Jmp_rm64 if ins.op0_kind() == OpKind::Memory && ins.memory_base() == Register::RIP => {
            let slot = ins.ip_rel_memory_address();
            if let Some(&entry) = t.got.get(&slot) {
                let form = if ins.code() == Code::Call_rm64 { SiteForm::CallRipMem } else { SiteForm::JmpRipMem };
                site(form, entry, Via::Got, slot, out);
            }
            return;
        }
        // jcc, loop, jrcxz: the remaining near branches.
        _ if ins.op0_kind() == OpKind::NearBranch64 => {
            if let Some((entry, _)) = t.code_target(ins.near_branch64()) {
                unpatchable(entry, Reason::ConditionalJump, out);
            }
            return;
        }
        _ => {}
    }
    if ins.is_ip_rel_memory_operand() {
        let addr = ins.ip_rel_memory_address();
        if let Some(&entry) = t.got.get(&addr) {
            unpatchable(entry, Reason::GotSlotRead, out);
        } else if ins.mnemonic() == Mnemonic::Lea
            && let Some((entry, _)) = t.code_target(addr)
        {
            unpatchable(entry, Reason::AddressTaken, out);
        }
    } else if absolute_immediates {
        for i in 0..ins.op_count() {
            let value = match ins.op_kind(i) {
                OpKind::Immediate32 => u64::from(ins.immediate32()),
                OpKind::Immediate32to64 => ins.immediate32to64() as u64,
                OpKind::Immediate64 => ins.immediate64(),
                _ => continue,
            };
            if let Some((entry, _)) = t.code_target(value) {
                unpatchable(entry, Reason::AddressTaken, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloctramp_trampolines::entry;

    /// The defaults, two user entries, then two wrappers charging found.
    fn scan(own_allocator: bool, other_heap: bool, user: bool) -> Scan {
        let mut entries = entry::defaults();
        let first_user = entries.len();
        if user {
            entries.push(entry::parse_spec("pool_alloc:alloc").unwrap());
            entries.push(entry::parse_spec("pool_free:free").unwrap());
        }
        let user = first_user..entries.len();
        entries.extend(entries[..2].to_vec());
        Scan { entries, user, own_allocator, other_heap, ..Scan::default() }
    }

    fn index(s: &Scan, name: &str) -> usize {
        s.entries.iter().position(|e| e.target == Target::Symbol(name.into())).unwrap()
    }

    #[test]
    fn plain_stores_only_for_the_process_malloc() {
        let s = scan(false, false, false);
        let wrapper = s.entries.len() - 1;
        assert!(s.plain_store(index(&s, "malloc")));
        assert!(s.plain_store(index(&s, "_ZdlPv")));
        assert!(s.plain_store(wrapper));
        for other in ["mallocx", "mi_malloc", "tc_new", "_rjem_malloc", "je_free"] {
            assert!(!s.plain_store(index(&s, other)), "{other}");
        }
        // A file that reaches another allocator's API: its wrappers may
        // wrap that allocator.
        let s = scan(false, true, false);
        assert!(s.plain_store(index(&s, "malloc")));
        assert!(!s.plain_store(s.entries.len() - 1));
        // Entries the user names, and wrappers around them.
        let s = scan(false, false, true);
        assert!(!s.plain_store(s.user.start));
        assert!(!s.plain_store(s.entries.len() - 1));
        assert!(s.aligned(index(&s, "malloc")) && !s.aligned(index(&s, "mi_free")));
        assert!(!s.aligned(s.user.start) && !s.aligned(s.entries.len() - 1));
        assert!(s.plain_store(index(&s, "calloc")));
        // A file with its own allocator.
        let s = scan(true, false, false);
        assert!(!s.plain_store(index(&s, "malloc")));
    }
}
