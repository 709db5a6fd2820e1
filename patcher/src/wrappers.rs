//! Allocation wrappers: functions that hand their callers what an allocator
//! returned, or give an allocator back what they were given.
//!
//! A function is an allocation wrapper when, on every path that returns,
//! what it returns is the result of a call to an allocator (or to another
//! wrapper), possibly moved between registers, kept in a callee-saved
//! register or a stack slot across other calls, checked for NULL (a path
//! that never returns does not count; returning NULL does not disqualify),
//! or offset by a constant (a size header in front); or when it tail-calls
//! one. It is a realloc wrapper when such a result comes from a realloc
//! whose pointer argument is one of the wrapper's own arguments, offset by
//! a constant; a free wrapper when every free it calls frees one of its own
//! arguments, offset by a constant. Wrappers of wrappers are found to any
//! depth.
//!
//! The analysis is a forward data-flow over each candidate function's
//! instructions (registers and stack slots, relative to the stack pointer
//! at entry), joined at merge points; nothing is executed. A function the
//! analysis cannot follow (an indirect jump, a path that reaches no known
//! end) is not a wrapper. The core takes code bytes and a resolver of call
//! targets, and returns data.

use crate::elf::Elf;
use alloctramp_trampolines::entry::{EntryPoint, Kind, Returns, Signature, Size, Target as EntryTarget};
use iced_x86::{
    ConditionCode, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register, RflagsBits,
};
use std::collections::{HashMap, HashSet};

/// The maps looked up for every call the search follows: hashed with
/// foldhash (addresses from the file being read need no protection against
/// flooding; a crafted file only slows its own search).
type FastMap<K, V> = foldhash::HashMap<K, V>;

/// What a call reaches, as far as wrappers are concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Callee {
    /// Returns a new object (an allocator or an allocation wrapper) of the
    /// bytes `size` says ([`Size::None`]: not known from its arguments).
    Alloc { size: Size },
    /// Frees the object passed in argument `ptr`.
    Free { ptr: u8 },
    /// Returns a new object of `size` bytes for the one passed in argument
    /// `ptr`.
    Realloc { ptr: u8, size: Size },
    /// Never returns (`abort`, `exit`, a `die()` of the program).
    NoReturn,
    /// Never returns: throws a C++ exception (`__cxa_throw`,
    /// `std::__throw_bad_alloc`, a function of the program that only
    /// throws).
    Throws,
    /// Returns its first argument (`memcpy`, `memset`, `strcpy`): a
    /// wrapper may fill the object it returns with one.
    ReturnsFirst,
}

/// Where a call or a jump goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// A code address (a function, or a PLT stub).
    Code(u64),
    /// A pointer-sized slot read by `call/jmp [rip+disp]` (a GOT slot).
    Slot(u64),
}

/// Resolves call targets the caller knows (allocators, their PLT stubs and
/// GOT slots, functions that never return).
pub trait Callees {
    fn callee(&self, target: Target) -> Option<Callee>;
}

impl<F: Fn(Target) -> Option<Callee>> Callees for F {
    fn callee(&self, target: Target) -> Option<Callee> {
        self(target)
    }
}

/// A function's code range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Function {
    pub start: u64,
    pub end: u64,
}

/// Why a function is a wrapper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// It returns the result of the call at `at` (offset by `offset`) on
    /// every path that returns.
    Returns { at: u64, offset: i64 },
    /// It tail-calls an allocator or wrapper at `at`.
    TailCall { at: u64 },
    /// Every free it makes (the first at `at`) frees its argument, offset by
    /// `offset`.
    Frees { at: u64, offset: i64 },
    /// The user named it (`--wrapper`).
    Named,
}

impl Why {
    /// The call the wrapper's result or free comes from.
    pub fn at(&self) -> Option<u64> {
        match *self {
            Why::Returns { at, .. } | Why::TailCall { at } | Why::Frees { at, .. } => Some(at),
            Why::Named => None,
        }
    }

    /// What the reason says, for listings.
    pub fn text(&self) -> String {
        let off = |o: i64| match o {
            0 => String::new(),
            o if o > 0 => format!(" + {o}"),
            o => format!(" - {}", o.unsigned_abs()),
        };
        match *self {
            Why::Returns { at, offset } => format!("returns the result of the call at {at:#x}{}", off(offset)),
            Why::TailCall { at } => format!("tail-calls an allocator at {at:#x}"),
            Why::Frees { at, offset } => format!("frees its argument{} at {at:#x}", off(offset)),
            Why::Named => "named with --wrapper".to_string(),
        }
    }
}

impl Callee {
    /// The role's name: `alloc`, `free`, `realloc` or `noreturn`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Callee::Alloc { .. } => "alloc",
            Callee::Free { .. } => "free",
            Callee::Realloc { .. } => "realloc",
            Callee::NoReturn => "noreturn",
            Callee::Throws => "throws",
            Callee::ReturnsFirst => "returns-first",
        }
    }

    /// What a call of a wrapper of this role counts: `None` for a role
    /// that is not an allocation wrapper's, or an allocation wrapper whose
    /// size is none of its arguments.
    pub fn signature(&self) -> Option<Signature> {
        match *self {
            Callee::Alloc { size: Size::None }
            | Callee::Realloc { size: Size::None, .. }
            | Callee::NoReturn
            | Callee::Throws
            | Callee::ReturnsFirst => None,
            Callee::Alloc { size } => Some(Signature::alloc(size)),
            Callee::Free { ptr } => Some(Signature::free(ptr)),
            Callee::Realloc { ptr, size } => Some(Signature::realloc(ptr, size)),
        }
    }
}

/// A wrapper found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wrapper {
    pub start: u64,
    /// The end of its code (the first byte past it).
    pub end: u64,
    /// [`Callee::Alloc`], [`Callee::Free`] or [`Callee::Realloc`].
    pub role: Callee,
    pub why: Why,
    /// 1 for a wrapper of allocators, 2 for a wrapper of such wrappers, ...
    pub depth: u32,
    /// What an allocation or realloc wrapper frees besides what it
    /// reallocates.
    pub frees: Frees,
    /// Its callers can be charged with what it allocates: it throws no C++
    /// exception unless the file's trampolines carry unwind entries, and
    /// it takes no argument on the stack (a trampoline's frame would move
    /// them).
    pub chargeable: bool,
    /// Its pointers relative to those of the call at `why`'s address.
    pub offsets: Offsets,
    /// Every object it returns comes from one call or tail call, `why`'s:
    /// the only call of an allocator or wrapper its paths make.
    pub one_source: bool,
}

/// What [`analyze`] finds a wrapper to be.
struct Found {
    role: Callee,
    why: Why,
    frees: Frees,
    chargeable: bool,
    offsets: Offsets,
    one_source: bool,
}

/// Where a wrapper's pointers are relative to those of the call it makes
/// (at [`Why`]'s address): a size header in front.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offsets {
    /// An allocation or realloc wrapper returns the callee's result plus
    /// this.
    pub result: i64,
    /// A realloc wrapper reallocates, a free wrapper frees, its pointer
    /// argument plus this.
    pub ptr: i64,
}

/// What an allocation or realloc wrapper frees besides the object it
/// reallocates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Frees {
    /// An object some allocation call inside returned: the one it returns
    /// (on a path that fails) or a temporary.
    pub result: bool,
    /// Anything else.
    pub other: bool,
}

/// Code bytes by address (the executable sections).
pub struct Code<'a> {
    pub ranges: Vec<(u64, &'a [u8])>,
    /// PLT stubs and GOT slots through which the file calls its own
    /// functions, and those functions' addresses.
    pub local: FastMap<Target, u64>,
}

impl<'a> Code<'a> {
    fn bytes(&self, f: Function) -> Option<&'a [u8]> {
        let (addr, bytes) = self.ranges.iter().find(|(a, b)| f.start >= *a && f.end <= a + b.len() as u64)?;
        bytes.get((f.start - addr) as usize..(f.end - addr) as usize)
    }
}

/// Functions larger than this are not analyzed (wrappers are small; this
/// bounds the time spent on huge functions that merely call an allocator).
const MAX_FUNCTION: u64 = 8192;

/// Finds the wrappers among `functions` and the functions that never
/// return, given what `known` resolves. Wrappers come sorted by address.
pub fn find(
    code: &Code,
    functions: &[Function],
    known: &(dyn Callees + Sync),
    refused: &dyn Fn(u64) -> bool,
) -> (Vec<Wrapper>, Vec<u64>) {
    // A first pass keeps only what each function calls and how it ends; the
    // instructions of the few candidates are decoded again when analyzed.
    let decoded: Vec<Decoded> = map_parallel(functions, |&f| Decoded::new(code, f, false));
    let by_start: FastMap<u64, usize> = functions.iter().enumerate().map(|(i, f)| (f.start, i)).collect();
    let mut found: FastMap<u64, (Callee, u32)> = FastMap::default();
    let own = |t: Target| code.local.get(&t).map_or(t, |&a| Target::Code(a));
    let resolve = |found: &FastMap<u64, (Callee, u32)>, t: Target| match own(t) {
        Target::Code(a) => found.get(&a).map(|&(c, _)| c).or_else(|| known.callee(t)),
        Target::Slot(_) => known.callee(t),
    };

    // Functions that return their first argument unchanged.
    for (f, d) in functions.iter().zip(&decoded) {
        if d.identity {
            found.insert(f.start, (Callee::ReturnsFirst, 0));
        }
    }

    // Functions that never return: no `ret`, no indirect jump, and every
    // jump out of the function goes to a function that never returns.
    loop {
        let mut changed = false;
        for (f, d) in functions.iter().zip(&decoded) {
            if found.contains_key(&f.start) || d.returns || d.indirect_jump || d.empty {
                continue;
            }
            let ends: Vec<Option<Callee>> = d.jumps_out.iter().map(|&t| resolve(&found, t)).collect();
            if ends.iter().all(|c| matches!(c, Some(Callee::NoReturn | Callee::Throws))) {
                let throws = ends.contains(&Some(Callee::Throws));
                found.insert(f.start, (if throws { Callee::Throws } else { Callee::NoReturn }, 0));
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }

    // Callers of each function, to analyze again only what a new wrapper
    // may have made a wrapper.
    let mut callers: FastMap<u64, Vec<usize>> = FastMap::default();
    for (i, d) in decoded.iter().enumerate() {
        for &t in d.calls.iter().chain(&d.jumps_out) {
            if let Target::Code(a) = own(t)
                && by_start.contains_key(&a)
            {
                callers.entry(a).or_default().push(i);
            }
        }
    }
    let role =
        |c: Option<Callee>| matches!(c, Some(Callee::Alloc { .. } | Callee::Free { .. } | Callee::Realloc { .. }));
    let mut todo: Vec<usize> = (0..functions.len())
        .filter(|&i| decoded[i].calls.iter().chain(&decoded[i].jumps_out).any(|&t| role(resolve(&found, t))))
        .collect();
    let mut wrappers: FastMap<u64, Wrapper> = FastMap::default();
    let mut depth = 1;
    while !todo.is_empty() {
        let mut next = HashSet::new();
        // What to analyze at this depth, with whether it is a free wrapper
        // analyzed again: a free wrapper found before its callees were
        // known may reallocate (`zrealloc` frees on size 0, and returns
        // what a wrapper found later returns).
        let analyzed: Vec<(Function, bool)> = todo
            .iter()
            .map(|&i| functions[i])
            .filter_map(|f| {
                let again = matches!(found.get(&f.start), Some((Callee::Free { .. }, _)));
                let skip = (found.contains_key(&f.start) && !again) || refused(f.start);
                (!skip).then_some((f, again))
            })
            .collect();
        // The analyses of one depth read only what earlier depths found:
        // they are independent, and run in parallel.
        let results =
            map_parallel(&analyzed, |&(f, _)| analyze(&Decoded::new(code, f, true), f, &|t| resolve(&found, t)));
        let mut new = Vec::new();
        for (&(f, again), a) in analyzed.iter().zip(results) {
            if let Some(a) = a
                && !(again && matches!(a.role, Callee::Free { .. }))
            {
                let Found { role, why, frees, chargeable, offsets, one_source } = a;
                new.push(Wrapper {
                    start: f.start,
                    end: f.end,
                    role,
                    why,
                    depth,
                    frees,
                    chargeable,
                    offsets,
                    one_source,
                });
            }
        }
        for w in &new {
            found.insert(w.start, (w.role, w.depth));
            next.extend(callers.get(&w.start).into_iter().flatten().copied());
        }
        for w in new {
            wrappers.insert(w.start, w);
        }
        todo = next.into_iter().collect();
        todo.sort_unstable();
        depth += 1;
    }
    let mut wrappers: Vec<Wrapper> = wrappers.into_values().collect();
    wrappers.sort_by_key(|w| w.start);
    let mut noreturn: Vec<u64> =
        found.iter().filter(|(_, (c, _))| matches!(c, Callee::NoReturn | Callee::Throws)).map(|(&a, _)| a).collect();
    noreturn.sort_unstable();
    (wrappers, noreturn)
}

/// `f` of each of `items`, in their order, computed on the available
/// cores (the calling thread alone for a few items).
fn map_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    /// Items taken at a time by a thread.
    const CHUNK: usize = 16;
    let chunks = items.len().div_ceil(CHUNK);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(chunks);
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<(usize, Vec<R>)> = std::thread::scope(|scope| {
        let work = || {
            let mut mine = Vec::new();
            loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(chunk) = items.chunks(CHUNK).nth(k) else { break };
                mine.push((k, chunk.iter().map(&f).collect()));
            }
            mine
        };
        let workers: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
        let mut all = work();
        for w in workers {
            // A worker that panicked: its panic goes on in this thread.
            all.extend(w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        all
    });
    done.sort_unstable_by_key(|&(k, _)| k);
    done.into_iter().flat_map(|(_, r)| r).collect()
}

/// A function's instructions and what a linear pass over them shows.
#[derive(Default)]
struct Decoded {
    instructions: Vec<Instruction>,
    /// No instruction decoded.
    empty: bool,
    returns: bool,
    indirect_jump: bool,
    calls: Vec<Target>,
    jumps_out: Vec<Target>,
    /// The function is `mov rax, rdi; ret` (after an optional `endbr64`):
    /// it returns its first argument.
    identity: bool,
}

fn target_of(ins: &Instruction) -> Option<Target> {
    match ins.op0_kind() {
        OpKind::NearBranch64 => Some(Target::Code(ins.near_branch64())),
        OpKind::Memory if ins.is_ip_rel_memory_operand() => Some(Target::Slot(ins.ip_rel_memory_address())),
        _ => None,
    }
}

impl Decoded {
    /// `keep`: keep the instructions (for the data-flow), not only the
    /// summary.
    fn new(code: &Code, f: Function, keep: bool) -> Decoded {
        let mut d = Decoded { empty: true, ..Decoded::default() };
        if f.end <= f.start || f.end - f.start > MAX_FUNCTION {
            return d;
        }
        let Some(bytes) = code.bytes(f) else { return d };
        let mut dec = Decoder::with_ip(64, bytes, f.start, DecoderOptions::NONE);
        // Instructions seen, with `mov rax, rdi` as 1 and the rest as 2.
        let mut shape: Vec<u8> = Vec::new();
        while dec.can_decode() {
            let ins = dec.decode();
            if ins.is_invalid() {
                break;
            }
            if shape.len() < 3 && ins.code() != iced_x86::Code::Endbr64 {
                let moves_arg =
                    ins.code() == iced_x86::Code::Mov_r64_rm64 || ins.code() == iced_x86::Code::Mov_rm64_r64;
                let rax_rdi = ins.op_count() == 2
                    && ins.op0_kind() == OpKind::Register
                    && ins.op1_kind() == OpKind::Register
                    && ins.op0_register() == Register::RAX
                    && ins.op1_register() == Register::RDI;
                shape.push(if moves_arg && rax_rdi {
                    1
                } else if ins.flow_control() == FlowControl::Return {
                    3
                } else {
                    2
                });
            }
            let inside = |a: u64| (f.start..f.end).contains(&a);
            match ins.flow_control() {
                FlowControl::Return => d.returns = true,
                FlowControl::Call | FlowControl::IndirectCall => d.calls.extend(target_of(&ins)),
                FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch => {
                    if let Some(t @ Target::Code(a)) = target_of(&ins)
                        && !inside(a)
                    {
                        d.jumps_out.push(t);
                    }
                }
                FlowControl::IndirectBranch => match target_of(&ins) {
                    Some(t) => d.jumps_out.push(t),
                    None => d.indirect_jump = true,
                },
                _ => {}
            }
            d.empty = false;
            if keep {
                d.instructions.push(ins);
            }
        }
        d.identity = shape.starts_with(&[1, 3]);
        d
    }
}

/// An abstract value: what a register or stack slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Val {
    Unknown,
    /// NULL.
    Zero,
    /// Argument `n` at entry, plus an offset.
    Arg(u8, i64),
    /// On some paths argument `n` plus an offset, on the others a small
    /// constant (`if (n == 0) n = 1`): what a size may be.
    ArgOr(u8, i64),
    /// A constant other than NULL.
    Const(i64),
    /// The stack pointer at entry, plus an offset.
    Stack(i64),
    /// What a call returned, plus an offset.
    Result(Origin, i64),
}

/// Which call a result came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// An allocation of the bytes given.
    Alloc(Asked),
    /// A realloc of the function's argument `n` plus an offset, to the
    /// bytes given.
    ReallocOfArg(u8, i64, Asked),
    /// A realloc of something else.
    Realloc,
}

/// The bytes an allocator is asked for, in terms of the calling function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asked {
    /// Given by its arguments.
    Of(Size),
    /// A constant (`malloc(1)` where `malloc(0)` failed): a path that
    /// does not change what a caller asked for.
    Fixed,
    Unknown,
}

/// The size two paths ask for: the same, the one of a path that is not
/// a constant, or not known.
fn join_size(a: Asked, b: Asked) -> Asked {
    match (a, b) {
        _ if a == b => a,
        (Asked::Fixed, x) | (x, Asked::Fixed) => x,
        _ => Asked::Unknown,
    }
}

impl Asked {
    fn size(self) -> Size {
        match self {
            Asked::Of(s) => s,
            Asked::Fixed | Asked::Unknown => Size::None,
        }
    }
}

impl Origin {
    fn join(self, o: Origin) -> Origin {
        match (self, o) {
            _ if self == o => self,
            (Origin::Alloc(a), Origin::Alloc(b)) => Origin::Alloc(join_size(a, b)),
            (Origin::ReallocOfArg(n, x, a), Origin::ReallocOfArg(m, y, b)) if (n, x) == (m, y) => {
                Origin::ReallocOfArg(n, x, join_size(a, b))
            }
            (Origin::Alloc(a), Origin::ReallocOfArg(n, x, b)) | (Origin::ReallocOfArg(n, x, b), Origin::Alloc(a)) => {
                Origin::ReallocOfArg(n, x, join_size(a, b))
            }
            _ => Origin::Realloc,
        }
    }
}

/// A callee's size in terms of the calling function's arguments, from
/// the argument registers at the call.
fn asked(s: &State, size: Size) -> Asked {
    let val = |a: u8| ARGS.get(usize::from(a)).map_or(Val::Unknown, |&r| s.get(r));
    let arg = |v: Val| match v {
        Val::Arg(n, _) | Val::ArgOr(n, _) => Some(n),
        _ => None,
    };
    let fixed = |v: Val| matches!(v, Val::Const(_) | Val::Zero);
    match size {
        Size::Arg(a) => match val(a) {
            v if fixed(v) => Asked::Fixed,
            v => arg(v).map_or(Asked::Unknown, |n| Asked::Of(Size::Arg(n))),
        },
        Size::Product(a, b) => match (val(a), val(b)) {
            (x, y) if fixed(x) && fixed(y) => Asked::Fixed,
            // A count or size known to be 0 on this path: 0 bytes.
            (Val::Zero, _) | (_, Val::Zero) => Asked::Fixed,
            // calloc(1, n): n bytes.
            (Val::Const(1), v) | (v, Val::Const(1)) => arg(v).map_or(Asked::Unknown, |n| Asked::Of(Size::Arg(n))),
            (x, y) => match (arg(x), arg(y)) {
                (Some(x), Some(y)) => Asked::Of(Size::Product(x, y)),
                _ => Asked::Unknown,
            },
        },
        Size::ResultStrlen => Asked::Of(Size::ResultStrlen),
        Size::None => Asked::Unknown,
    }
}

impl Val {
    fn plus(self, d: i64) -> Val {
        match self {
            Val::Arg(n, o) => Val::Arg(n, o.wrapping_add(d)),
            Val::ArgOr(n, o) => Val::ArgOr(n, o.wrapping_add(d)),
            Val::Const(k) => Val::Const(k.wrapping_add(d)),
            Val::Stack(o) => Val::Stack(o.wrapping_add(d)),
            Val::Result(r, o) => Val::Result(r, o.wrapping_add(d)),
            Val::Zero | Val::Unknown => Val::Unknown,
        }
    }
    fn join(self, o: Val) -> Val {
        match (self, o) {
            _ if self == o => self,
            // A realloc wrapper's paths: one reallocates, another (a NULL
            // pointer) allocates.
            (Val::Result(a, x), Val::Result(b, y)) if x == y => Val::Result(a.join(b), x),
            // A path that found the result NULL and returns NULL.
            (r @ Val::Result(..), Val::Zero) | (Val::Zero, r @ Val::Result(..)) => r,
            // A size replaced by a constant on some path.
            (Val::Arg(n, x) | Val::ArgOr(n, x), Val::Arg(m, y) | Val::ArgOr(m, y)) if (n, x) == (m, y) => {
                Val::ArgOr(n, x)
            }
            // `if (n == 0) n = 1`, redis' `size > 0 ? size : sizeof(long)`:
            // a small constant (at most 16) standing in for an empty
            // request. A request that a larger constant replaces (a
            // minimum of 4096) is not the caller's.
            (Val::Arg(n, x) | Val::ArgOr(n, x), Val::Zero) | (Val::Zero, Val::Arg(n, x) | Val::ArgOr(n, x)) => {
                Val::ArgOr(n, x)
            }
            (Val::Arg(n, x) | Val::ArgOr(n, x), Val::Const(k)) | (Val::Const(k), Val::Arg(n, x) | Val::ArgOr(n, x))
                if (1..=16).contains(&k) =>
            {
                Val::ArgOr(n, x)
            }
            _ => Val::Unknown,
        }
    }
}

const GPRS: [Register; 16] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RBX,
    Register::RSP,
    Register::RBP,
    Register::RSI,
    Register::RDI,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];
const ARGS: [Register; 6] = [Register::RDI, Register::RSI, Register::RDX, Register::RCX, Register::R8, Register::R9];
const CALLER_SAVED: [Register; 9] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RSI,
    Register::RDI,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
];

/// The index of a 64-bit general-purpose register (its full register for
/// a part of one).
fn gpr(r: Register) -> Option<usize> {
    let full = r.full_register();
    GPRS.iter().position(|&g| g == full)
}

/// Stack slots (8 bytes each) by offset from the stack pointer at entry.
///
/// Invariant: sorted by offset, no offset twice (a map). A frame holds a
/// few slots, and the data-flow copies a state at every instruction it
/// follows: a sorted vector is copied with one `memcpy`, and into a state
/// that already has room (`clone_from`) without allocating.
#[derive(Debug, Default, PartialEq, Eq)]
struct Slots(Vec<(i64, Val)>);

impl Clone for Slots {
    fn clone(&self) -> Slots {
        Slots(self.0.clone())
    }
    fn clone_from(&mut self, o: &Slots) {
        self.0.clone_from(&o.0);
    }
}

impl Slots {
    fn find(&self, at: i64) -> Result<usize, usize> {
        self.0.binary_search_by_key(&at, |&(k, _)| k)
    }
    fn get(&self, at: i64) -> Option<Val> {
        self.find(at).ok().and_then(|i| self.0.get(i)).map(|&(_, v)| v)
    }
    /// Sets slot `at`; what it held before.
    fn insert(&mut self, at: i64, v: Val) -> Option<Val> {
        match self.find(at) {
            Ok(i) => self.0.get_mut(i).map(|(_, old)| std::mem::replace(old, v)),
            Err(i) => {
                self.0.insert(i, (at, v));
                None
            }
        }
    }
    /// Keeps the slots `keep` says to keep (in offset order; it may change
    /// their values).
    fn retain(&mut self, mut keep: impl FnMut(i64, &mut Val) -> bool) {
        self.0.retain_mut(|(k, v)| keep(*k, v));
    }
}

#[derive(Debug, PartialEq, Eq)]
struct State {
    regs: [Val; 16],
    stack: Slots,
    /// What the flags say: the zero flag is set exactly when this location
    /// is NULL (after `test r, r`, `cmp r, 0` or `cmp [slot], 0`).
    zero_test: Option<Loc>,
    /// Arguments (bit n: argument n) that every path to here freed or
    /// found NULL.
    settled: u8,
}

impl Clone for State {
    fn clone(&self) -> State {
        State { regs: self.regs, stack: self.stack.clone(), zero_test: self.zero_test, settled: self.settled }
    }
    fn clone_from(&mut self, o: &State) {
        self.regs = o.regs;
        self.stack.clone_from(&o.stack);
        self.zero_test = o.zero_test;
        self.settled = o.settled;
    }
}

/// A register (by index) or a stack slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    Reg(usize),
    Slot(i64),
}

impl State {
    fn entry() -> State {
        let mut regs = [Val::Unknown; 16];
        for (n, &r) in ARGS.iter().enumerate() {
            regs[gpr(r).unwrap_or(0)] = Val::Arg(n as u8, 0);
        }
        regs[4] = Val::Stack(0);
        State { regs, stack: Slots::default(), zero_test: None, settled: 0 }
    }
    fn get(&self, r: Register) -> Val {
        gpr(r).map_or(Val::Unknown, |i| self.regs[i])
    }
    fn set(&mut self, r: Register, v: Val) {
        if let Some(i) = gpr(r) {
            // A write to a 32-bit part zero-extends: only full registers
            // keep what they held.
            self.regs[i] = if r.full_register() == r { v } else { Val::Unknown };
        }
    }
    /// Joins `o` into `self`; whether `self` changed.
    fn join(&mut self, o: &State) -> bool {
        let mut changed = false;
        // (Most registers and slots hold the same on both sides, which
        // their join keeps.)
        for (a, b) in self.regs.iter_mut().zip(&o.regs) {
            if a != b {
                let j = a.join(*b);
                changed |= j != *a;
                *a = j;
            }
        }
        // A slot stays where the join of what the two states know of it
        // is not `Unknown`. Both are sorted: one walk over `o` as `self`
        // is walked.
        let same = self.stack == o.stack && !self.stack.0.iter().any(|&(_, v)| v == Val::Unknown);
        if !same {
            let mut theirs = o.stack.0.iter().peekable();
            self.stack.retain(|k, v| {
                while theirs.next_if(|(t, _)| *t < k).is_some() {}
                let keep = match theirs.peek() {
                    Some(&&(t, w)) if t == k => {
                        let j = v.join(w);
                        changed |= j != *v;
                        *v = j;
                        j != Val::Unknown
                    }
                    _ => false,
                };
                changed |= !keep;
                keep
            });
        }
        if self.zero_test != o.zero_test && self.zero_test.is_some() {
            self.zero_test = None;
            changed = true;
        }
        changed |= self.settled & o.settled != self.settled;
        self.settled &= o.settled;
        changed
    }
    /// The stack slot a memory operand names, if its base is known to point
    /// into the stack.
    fn slot(&self, ins: &Instruction) -> Option<i64> {
        if ins.memory_index() != Register::None {
            return None;
        }
        match self.get(ins.memory_base()) {
            Val::Stack(o) => Some(o.wrapping_add(ins.memory_displacement64() as i64)),
            _ => None,
        }
    }
    /// Forgets the stack slots a memory write may reach. A write through
    /// a pointer not known to point into the stack is taken not to reach
    /// the frame (heap and globals).
    fn clobber_memory(&mut self, ins: &Instruction) {
        if let Some(at) = self.slot(ins) {
            let size = (ins.memory_size().size() as i64).max(8);
            self.stack.retain(|k, _| k + 8 <= at || k >= at + size);
        }
    }
}

/// What one function's paths end in.
#[derive(Default)]
struct Ends {
    /// Values returned (in rax) by paths that return, with the instruction
    /// that ends each.
    returned: Vec<(Val, u64)>,
    /// Results of tail calls: (callee, value of the pointer argument, size
    /// asked for), at.
    tail: Vec<(Callee, Val, Asked, u64)>,
    /// Frees made: value of the pointer argument, at.
    frees: Vec<(Val, u64)>,
    /// Every call whose result is an object (allocators and wrappers), in
    /// the order followed: the first is where results come from.
    calls: Vec<u64>,
    /// A path the analysis cannot follow.
    lost: bool,
    /// A result is stored somewhere other than the frame (a global, a list):
    /// the function keeps the object, it does not hand it over.
    escapes: bool,
    /// Per path that returns (or tail-calls): the arguments freed on it or
    /// known NULL there (see `State::settled`).
    exits: Vec<u8>,
    /// A path throws (a C++ exception), which no trampoline may be on the
    /// stack for.
    throws: bool,
    /// The function reads arguments passed on the stack.
    stack_args: bool,
}

/// Decides whether one function is a wrapper.
fn analyze(d: &Decoded, f: Function, resolve: &dyn Fn(Target) -> Option<Callee>) -> Option<Found> {
    let ends = flow(d, f, resolve, Follow::UntilNoWrapper)?;
    if ends.lost {
        return None;
    }
    if ends.escapes {
        // It returns the object it also keeps: not a wrapper (nor a free
        // wrapper, which hands nothing over but may keep lists too).
        return None;
    }
    let mut alloc = false;
    // The argument every realloc reallocates; `Err` when they differ.
    let mut realloc_of: Option<Result<u8, ()>> = None;
    let mut realloc = |n: Option<u8>| {
        realloc_of = match (realloc_of, n) {
            (None | Some(Ok(_)), Some(n)) if realloc_of.is_none_or(|r| r == Ok(n)) => Some(Ok(n)),
            _ => Some(Err(())),
        }
    };
    // A path returns something other than an object or NULL.
    let mut other = false;
    let mut result: Option<(u64, i64)> = None;
    // The size every path asks for.
    let mut size: Option<Asked> = None;
    let mut ptr_offset: Option<i64> = None;
    let mut ask = |s: Asked| size = Some(size.map_or(s, |t| join_size(s, t)));
    for &(v, _) in &ends.returned {
        match v {
            Val::Zero => {}
            // (Every path returns its object at one offset from the
            // allocator's pointer, or the offset means nothing.)
            Val::Result(_, off) if result.is_some_and(|(_, o)| o != off) => other = true,
            Val::Result(Origin::Alloc(s), off) => {
                alloc = true;
                ask(s);
                result.get_or_insert((ends.calls.first().copied().unwrap_or(f.start), off));
            }
            Val::Result(Origin::ReallocOfArg(n, o, s), off) => {
                realloc(Some(n));
                ptr_offset.get_or_insert(o);
                ask(s);
                result.get_or_insert((ends.calls.first().copied().unwrap_or(f.start), off));
            }
            Val::Result(Origin::Realloc, _) => realloc(None),
            _ => other = true,
        }
    }
    let mut tail_at = None;
    for &(callee, arg, s, at) in &ends.tail {
        match (callee, arg) {
            (Callee::Alloc { .. }, _) => alloc = true,
            (Callee::Realloc { .. }, Val::Arg(n, _)) => realloc(Some(n)),
            (Callee::Realloc { .. }, _) => realloc(None),
            (Callee::Free { .. } | Callee::NoReturn | Callee::Throws | Callee::ReturnsFirst, _) => continue,
        }
        ask(s);
        tail_at.get_or_insert(at);
    }
    let size = size.map_or(Size::None, Asked::size);
    if alloc || realloc_of.is_some() {
        // Every path that returns must return the object (or NULL), and
        // every realloc must reallocate the same argument.
        if other || realloc_of == Some(Err(())) {
            return None;
        }
        let realloc_of = realloc_of.and_then(Result::ok);
        let role = realloc_of.map_or(Callee::Alloc { size }, |ptr| Callee::Realloc { ptr, size });
        let why = match (result, tail_at) {
            (Some((at, offset)), _) => Why::Returns { at, offset },
            (None, Some(at)) => Why::TailCall { at },
            (None, None) => return None,
        };
        let mut frees = Frees::default();
        for &(v, _) in &ends.frees {
            match v {
                Val::Zero => {}
                Val::Result(..) => frees.result = true,
                Val::Arg(n, _) if realloc_of == Some(n) => {}
                _ => frees.other = true,
            }
        }
        let result = match why {
            Why::Returns { offset, .. } => offset,
            _ => 0,
        };
        let offsets = Offsets { result, ptr: ptr_offset.unwrap_or(0) };
        let allocating = |c: &Callee| matches!(c, Callee::Alloc { .. } | Callee::Realloc { .. });
        let tails = ends.tail.iter().filter(|t| allocating(&t.0)).map(|t| t.3);
        let mut sources: Vec<u64> = ends.calls.iter().copied().chain(tails).collect();
        sources.sort_unstable();
        sources.dedup();
        let one_source = sources.len() == 1;
        return Some(Found { role, why, frees, chargeable: !ends.throws, offsets, one_source });
    }
    // A free wrapper: every free frees the same argument, and every path
    // that returns frees it or found it NULL (not a reference count's
    // release, which frees only the last time).
    let (first, at) = *ends.frees.first()?;
    let Val::Arg(n, offset) = first else { return None };
    if ends.frees.iter().any(|(v, _)| !matches!(v, Val::Arg(m, _) if *m == n)) {
        return None;
    }
    let bit = 1u8.checked_shl(u32::from(n)).unwrap_or(0);
    if ends.exits.iter().any(|&m| m & bit == 0) {
        return None;
    }
    if ends.returned.iter().any(|(v, _)| matches!(v, Val::Result(..))) {
        return None;
    }
    let why = Why::Frees { at, offset };
    let offsets = Offsets { result: 0, ptr: offset };
    let (frees, chargeable) = (Frees::default(), !ends.throws);
    Some(Found { role: Callee::Free { ptr: n }, why, frees, chargeable, offsets, one_source: false })
}

/// How far [`flow`] follows a function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Follow {
    /// Every path (to tell whether it reads arguments on the stack).
    All,
    /// Until a path shows that the function is no wrapper (one that
    /// [`Ends::lost`] or [`Ends::escapes`]: [`analyze`] refuses it
    /// whatever the other paths add, or whether it would settle).
    UntilNoWrapper,
}

/// Runs the data-flow over a function; `None` if it does not settle.
///
/// One state per instruction (what holds before it), joined where paths
/// meet; a work stack of instructions whose state changed, each followed
/// again when popped, within a budget of steps (64 per instruction). The
/// order of the steps is part of the result: what `Ends` records comes in
/// the order the paths are followed (the first call, the first free), and
/// a function that uses up the budget is no wrapper.
fn flow(d: &Decoded, f: Function, resolve: &dyn Fn(Target) -> Option<Callee>, follow: Follow) -> Option<Ends> {
    // Any other instruction by address (they come in address order).
    let index = |a: u64| d.instructions.binary_search_by_key(&a, Instruction::ip).ok();
    let mut states: Vec<Option<State>> = vec![None; d.instructions.len()];
    *states.first_mut()? = Some(State::entry());
    let mut work = vec![0usize];
    let mut ends = Ends::default();
    let mut info = InstructionInfoFactory::new();
    let mut budget = d.instructions.len() * 64;
    let inside = |a: u64| (f.start..f.end).contains(&a);
    // The state after the instruction followed, and on a conditional
    // branch's taken edge where it differs (`taken`): reused from step to
    // step, so that a step allocates nothing.
    let mut s = State::entry();
    let mut t = State::entry();
    // Instructions a jump inside the function reaches: where paths join.
    // Any other instruction is reached only from the one before it, so a
    // path that falls through to it goes on with the same state, which is
    // not stored (a state is kept only where paths may join, or after a
    // conditional branch).
    let mut joins = vec![false; d.instructions.len()];
    for ins in &d.instructions {
        if let Some(Target::Code(a)) = target_of(ins)
            && inside(a)
            && matches!(
                ins.flow_control(),
                FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch | FlowControl::IndirectBranch
            )
            && let Some(j) = index(a)
            && let Some(b) = joins.get_mut(j)
        {
            *b = true;
        }
    }
    'paths: while let Some(first) = work.pop() {
        let Some(Some(state)) = states.get(first) else { continue };
        s.clone_from(state);
        let mut i = first;
        loop {
            if follow == Follow::UntilNoWrapper && (ends.lost || ends.escapes) {
                break 'paths;
            }
            budget = budget.checked_sub(1)?;
            let Some(ins) = d.instructions.get(i) else { continue 'paths };
            // Where the path goes on: the next instruction, then a jump's
            // target (the order the work stack receives them).
            let mut next: [Option<u64>; 2] = [None, None];
            let mut taken = false;
            let after = ins.next_ip();
            match ins.flow_control() {
                FlowControl::Return => {
                    ends.returned.push((s.get(Register::RAX), ins.ip()));
                    ends.exits.push(s.settled);
                }
                FlowControl::Call | FlowControl::IndirectCall => {
                    let callee = target_of(ins).and_then(resolve);
                    match callee {
                        Some(Callee::NoReturn) => {}
                        Some(Callee::Throws) => ends.throws = true,
                        _ => {
                            call(&mut s, ins, callee, &mut ends);
                            next[0] = Some(after);
                        }
                    }
                }
                FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch | FlowControl::IndirectBranch => {
                    if ins.flow_control() == FlowControl::ConditionalBranch {
                        next[0] = Some(after);
                        // After a NULL test, the edge where the pointer is NULL
                        // knows it is.
                        if let Some(at) = s.zero_test {
                            match ins.condition_code() {
                                ConditionCode::e => {
                                    t.clone_from(&s);
                                    t.set_zero(at);
                                    taken = true;
                                }
                                ConditionCode::ne => {
                                    t.clone_from(&s);
                                    s.set_zero(at);
                                    taken = true;
                                }
                                _ => {}
                            }
                        }
                    }
                    match target_of(ins) {
                        Some(Target::Code(a)) if inside(a) => next[1] = Some(a),
                        Some(tc) => tail_call(&s, ins, resolve(tc), &mut ends),
                        None => ends.lost = true,
                    }
                }
                FlowControl::Interrupt | FlowControl::Exception => {
                    // int3, ud2, hlt: the path ends here.
                }
                _ => {
                    // Arguments passed on the stack (a seventh and further, or
                    // a structure by value): not a wrapper a trampoline can
                    // call with a frame of its own.
                    if (0..ins.op_count()).any(|k| ins.op_kind(k) == OpKind::Memory)
                        && s.slot(ins).is_some_and(|o| o >= 8)
                    {
                        ends.lost = true;
                        ends.stack_args = true;
                    }
                    if stores_result_away(&s, ins) {
                        ends.escapes = true;
                    }
                    step(&mut s, ins, &mut info);
                    next[0] = Some(after);
                }
            }
            let branch = ins.flow_control() == FlowControl::ConditionalBranch;
            // Straight on to the next instruction, which only this one reaches.
            if let [Some(a), None] = next
                && !branch
                && inside(a)
                && d.instructions.get(i + 1).is_some_and(|n| n.ip() == a)
                && joins.get(i + 1) == Some(&false)
            {
                i += 1;
                continue;
            }
            for a in next.into_iter().flatten() {
                let s = if taken && branch && a != after { &t } else { &s };
                if !inside(a) {
                    // Falling off the end: code after a call that never returns.
                    continue;
                }
                // Where this instruction ends, the next one decoded starts.
                let next_one = d.instructions.get(i + 1).filter(|n| n.ip() == a).map(|_| i + 1);
                let Some(j) = next_one.or_else(|| index(a)) else {
                    ends.lost = true;
                    continue;
                };
                let Some(slot) = states.get_mut(j) else { continue };
                match slot {
                    Some(old) => {
                        if old.join(s) {
                            work.push(j);
                        }
                    }
                    None => {
                        *slot = Some(s.clone());
                        work.push(j);
                    }
                }
            }
            continue 'paths;
        }
    }
    Some(ends)
}

/// Whether a function reads arguments passed on the stack (or cannot be
/// followed far enough to tell).
fn reads_stack_args(code: &Code, f: Function) -> bool {
    match flow(&Decoded::new(code, f, true), f, &|_| None, Follow::All) {
        Some(ends) => ends.stack_args || f.end <= f.start,
        None => true,
    }
}

/// Whether an instruction stores a call's result (the object) to memory
/// outside the frame.
fn stores_result_away(s: &State, ins: &Instruction) -> bool {
    let stored = match (ins.op0_kind(), ins.op1_kind()) {
        (OpKind::Memory, OpKind::Register) if ins.op_count() == 2 => s.get(ins.op1_register().full_register()),
        _ => return false,
    };
    matches!(stored, Val::Result(..)) && s.slot(ins).is_none() && !is_inside_object(s, ins)
}

/// Whether a memory operand points into the object itself (a size header
/// written in front of it, a field): a store there keeps nothing.
fn is_inside_object(s: &State, ins: &Instruction) -> bool {
    ins.memory_index() == Register::None && matches!(s.get(ins.memory_base()), Val::Result(..))
}

/// A call that returns: records frees and what comes back.
fn call(s: &mut State, ins: &Instruction, callee: Option<Callee>, ends: &mut Ends) {
    let arg = |s: &State, n: u8| ARGS.get(usize::from(n)).map_or(Val::Unknown, |&r| s.get(r));
    let result = match callee {
        Some(Callee::Alloc { size }) => Val::Result(Origin::Alloc(asked(s, size)), 0),
        Some(Callee::Realloc { ptr, size }) => match arg(s, ptr) {
            Val::Arg(n, o) => Val::Result(Origin::ReallocOfArg(n, o, asked(s, size)), 0),
            _ => Val::Result(Origin::Realloc, 0),
        },
        Some(Callee::Free { ptr }) => {
            let v = arg(s, ptr);
            ends.frees.push((v, ins.ip()));
            if let Val::Arg(n, _) = v {
                s.settled |= 1u8.checked_shl(u32::from(n)).unwrap_or(0);
            }
            Val::Unknown
        }
        Some(Callee::ReturnsFirst) => arg(s, 0),
        _ => Val::Unknown,
    };
    if matches!(result, Val::Result(..)) {
        ends.calls.push(ins.ip());
    }
    for r in CALLER_SAVED {
        s.set(r, Val::Unknown);
    }
    s.set(Register::RAX, result);
}

/// A jump out of the function: a tail call, which returns what its callee
/// returns.
fn tail_call(s: &State, ins: &Instruction, callee: Option<Callee>, ends: &mut Ends) {
    let arg = |n: u8| ARGS.get(usize::from(n)).map_or(Val::Unknown, |&r| s.get(r));
    match callee {
        Some(Callee::NoReturn) => {}
        Some(Callee::Throws) => ends.throws = true,
        Some(c @ Callee::Alloc { size }) => {
            ends.tail.push((c, Val::Unknown, asked(s, size), ins.ip()));
            ends.exits.push(s.settled);
        }
        Some(c @ Callee::Realloc { ptr, size }) => {
            ends.tail.push((c, arg(ptr), asked(s, size), ins.ip()));
            ends.exits.push(s.settled);
        }
        Some(Callee::Free { ptr }) => {
            let v = arg(ptr);
            ends.frees.push((v, ins.ip()));
            ends.returned.push((Val::Unknown, ins.ip()));
            let freed = match v {
                Val::Arg(n, _) => 1u8.checked_shl(u32::from(n)).unwrap_or(0),
                _ => 0,
            };
            ends.exits.push(s.settled | freed);
        }
        Some(Callee::ReturnsFirst) => {
            ends.returned.push((arg(0), ins.ip()));
            ends.exits.push(s.settled);
        }
        None => {
            ends.returned.push((Val::Unknown, ins.ip()));
            ends.exits.push(s.settled);
        }
    }
}

/// One instruction that neither branches nor calls.
fn step(s: &mut State, ins: &Instruction, info: &mut InstructionInfoFactory) {
    if ins.rflags_modified() != RflagsBits::NONE {
        s.zero_test = zero_test(s, ins);
    }
    transfer(s, ins, info);
}

/// The location a `test r, r`, `cmp r, 0` or `cmp qword [slot], 0` tests
/// for NULL.
fn zero_test(s: &State, ins: &Instruction) -> Option<Loc> {
    let wide_reg = |r: Register| (r.full_register() == r).then(|| gpr(r)).flatten().map(Loc::Reg);
    match (ins.mnemonic(), ins.op0_kind(), ins.op1_kind()) {
        (Mnemonic::Test, OpKind::Register, OpKind::Register) if ins.op0_register() == ins.op1_register() => {
            wide_reg(ins.op0_register())
        }
        (Mnemonic::Cmp, OpKind::Register, OpKind::Immediate8to64 | OpKind::Immediate32to64)
            if ins.immediate(1) == 0 =>
        {
            wide_reg(ins.op0_register())
        }
        (Mnemonic::Cmp, OpKind::Memory, OpKind::Immediate8to64 | OpKind::Immediate32to64)
            if ins.immediate(1) == 0 && ins.memory_size().size() == 8 =>
        {
            s.slot(ins).map(Loc::Slot)
        }
        _ => None,
    }
}

impl State {
    /// Makes `at` hold NULL.
    fn set_zero(&mut self, at: Loc) {
        let was = match at {
            Loc::Reg(i) => self.regs.get_mut(i).map(|r| std::mem::replace(r, Val::Zero)),
            Loc::Slot(o) => self.stack.insert(o, Val::Zero),
        };
        if let Some(Val::Arg(n, 0)) = was {
            self.settled |= 1u8.checked_shl(u32::from(n)).unwrap_or(0);
        }
    }
}

fn transfer(s: &mut State, ins: &Instruction, info: &mut InstructionInfoFactory) {
    let reg0 = || (ins.op_count() > 0 && ins.op0_kind() == OpKind::Register).then(|| ins.op0_register());
    let reg1 = || (ins.op_count() > 1 && ins.op1_kind() == OpKind::Register).then(|| ins.op1_register());
    let imm = || match ins.op1_kind() {
        // `immediate(1)`, not `immediate64()`: the latter is only for
        // 64-bit immediates (a memory operand's displacement shares its
        // storage otherwise).
        OpKind::Immediate8to64 | OpKind::Immediate32to64 => Some(ins.immediate(1) as i64),
        OpKind::Immediate8 | OpKind::Immediate32 => Some(ins.immediate(1) as i64),
        _ => None,
    };
    let wide = |r: Register| r.full_register() == r && gpr(r).is_some();
    match ins.mnemonic() {
        Mnemonic::Mov if ins.op_count() == 2 => match (ins.op0_kind(), ins.op1_kind()) {
            (OpKind::Register, OpKind::Register) => {
                let (d, r) = (ins.op0_register(), ins.op1_register());
                let v = if wide(r) { s.get(r) } else { Val::Unknown };
                s.set(d, v);
            }
            (OpKind::Register, OpKind::Memory) => {
                let d = ins.op0_register();
                let v = match s.slot(ins) {
                    Some(at) if wide(d) => s.stack.get(at).unwrap_or(Val::Unknown),
                    _ => Val::Unknown,
                };
                s.set(d, v);
            }
            (OpKind::Memory, OpKind::Register) => {
                let r = ins.op1_register();
                s.clobber_memory(ins);
                if let Some(at) = s.slot(ins)
                    && wide(r)
                {
                    s.stack.insert(at, s.get(r));
                }
            }
            (OpKind::Memory, _) => {
                s.clobber_memory(ins);
                // A constant stored in a stack slot (a size set to 1).
                if let (Some(at), Some(k)) = (s.slot(ins), imm())
                    && ins.memory_size().size() == 8
                {
                    s.stack.insert(at, if k == 0 { Val::Zero } else { Val::Const(k) });
                }
            }
            (OpKind::Register, _) => {
                let d = ins.op0_register();
                // `mov r32, imm` zero-extends: the whole register holds it.
                match imm() {
                    Some(0) if d.size() >= 4 => s.set(d.full_register(), Val::Zero),
                    Some(k) if d.size() >= 4 => s.set(d.full_register(), Val::Const(k)),
                    _ => s.set(d, Val::Unknown),
                }
            }
            _ => generic(s, ins, info),
        },
        Mnemonic::Xor | Mnemonic::Sub if reg0().is_some() && reg0() == reg1() => {
            if let Some(r) = reg0() {
                s.set(r.full_register(), Val::Zero);
            }
        }
        Mnemonic::Lea => {
            let d = ins.op0_register();
            let v = if ins.memory_index() == Register::None && ins.memory_base() != Register::RIP {
                s.get(ins.memory_base()).plus(ins.memory_displacement64() as i64)
            } else {
                Val::Unknown
            };
            s.set(d, if wide(d) { v } else { Val::Unknown });
        }
        Mnemonic::Add | Mnemonic::Sub if reg0().is_some_and(wide) && imm().is_some() => {
            if let (Some(d), Some(k)) = (reg0(), imm()) {
                let k = if ins.mnemonic() == Mnemonic::Sub { k.wrapping_neg() } else { k };
                s.set(d, s.get(d).plus(k));
            }
        }
        Mnemonic::Push => {
            let v = reg0().filter(|&r| wide(r)).map_or(Val::Unknown, |r| s.get(r));
            let sp = s.get(Register::RSP).plus(-8);
            s.set(Register::RSP, sp);
            if let Val::Stack(at) = sp {
                s.stack.insert(at, v);
            }
        }
        Mnemonic::Pop => {
            let sp = s.get(Register::RSP);
            let v = match sp {
                Val::Stack(at) => s.stack.get(at).unwrap_or(Val::Unknown),
                _ => Val::Unknown,
            };
            s.set(Register::RSP, sp.plus(8));
            if let Some(r) = reg0() {
                s.set(r, v);
            }
        }
        Mnemonic::Leave => {
            let bp = s.get(Register::RBP);
            let v = match bp {
                Val::Stack(at) => s.stack.get(at).unwrap_or(Val::Unknown),
                _ => Val::Unknown,
            };
            s.set(Register::RSP, bp.plus(8));
            s.set(Register::RBP, v);
        }
        Mnemonic::Test | Mnemonic::Cmp | Mnemonic::Nop | Mnemonic::Endbr64 => {}
        Mnemonic::Cmova
        | Mnemonic::Cmovae
        | Mnemonic::Cmovb
        | Mnemonic::Cmovbe
        | Mnemonic::Cmove
        | Mnemonic::Cmovg
        | Mnemonic::Cmovge
        | Mnemonic::Cmovl
        | Mnemonic::Cmovle
        | Mnemonic::Cmovne
        | Mnemonic::Cmovno
        | Mnemonic::Cmovnp
        | Mnemonic::Cmovns
        | Mnemonic::Cmovo
        | Mnemonic::Cmovp
        | Mnemonic::Cmovs => {
            if let (Some(d), Some(r)) = (reg0(), reg1()) {
                let v = if wide(r) && wide(d) { s.get(d).join(s.get(r)) } else { Val::Unknown };
                s.set(d, v);
            } else {
                generic(s, ins, info);
            }
        }
        _ => generic(s, ins, info),
    }
}

/// Any other instruction: every register it writes holds something
/// unknown afterwards, and a stack slot it may write is forgotten.
fn generic(s: &mut State, ins: &Instruction, info: &mut InstructionInfoFactory) {
    let writes = |a: OpAccess| {
        matches!(a, OpAccess::Write | OpAccess::ReadWrite | OpAccess::CondWrite | OpAccess::ReadCondWrite)
    };
    let used = info.info(ins);
    for r in used.used_registers() {
        if writes(r.access())
            && let Some(i) = gpr(r.register())
        {
            s.regs[i] = Val::Unknown;
        }
    }
    if used.used_memory().iter().any(|m| writes(m.access())) {
        s.clobber_memory(ins);
    }
}

/// Functions of the C library and of language runtimes that never return.
const NO_RETURN: &[&str] = &[
    "abort",
    "exit",
    "_exit",
    "_Exit",
    "quick_exit",
    "__assert_fail",
    "__assert_perror_fail",
    "__stack_chk_fail",
    "__fortify_fail",
    "__chk_fail",
    "err",
    "errx",
    "verr",
    "verrx",
    "longjmp",
    "siglongjmp",
    "__longjmp_chk",
    "pthread_exit",
    "__cxa_throw",
    "__cxa_rethrow",
    "_Unwind_Resume",
    "_ZSt9terminatev",
    "_ZSt17__throw_bad_allocv",
    "_ZSt28__throw_bad_array_new_lengthv",
    "_ZSt20__throw_length_errorPKc",
];

/// Functions of the C library that return their first argument.
const RETURNS_FIRST: &[&str] = &[
    "memcpy",
    "memmove",
    "memset",
    "strcpy",
    "strncpy",
    "strcat",
    "strncat",
    "__memcpy_chk",
    "__memmove_chk",
    "__memset_chk",
    "__strcpy_chk",
    "__strncpy_chk",
    "__strcat_chk",
    "__strncat_chk",
];

/// Whether a (mangled) name is a function that throws a C++ exception
/// (or resumes unwinding).
fn throws(name: &str) -> bool {
    matches!(name, "__cxa_throw" | "__cxa_rethrow" | "_Unwind_Resume" | "_Unwind_RaiseException")
        || (name.starts_with("_ZSt") && name.contains("__throw_"))
}

/// Whether a (mangled) name is a function that never returns.
fn never_returns(name: &str) -> bool {
    if NO_RETURN.contains(&name) || (name.starts_with("_ZSt") && name.contains("__throw_")) {
        return true;
    }
    // Rust's panics and allocation-failure handler (legacy or v0 mangling).
    (name.starts_with("_ZN") || name.starts_with("_R")) && {
        let d = crate::symbols::demangle(name);
        d.starts_with("core::panicking::") || d.starts_with("alloc::alloc::handle_alloc_error")
    }
}

/// The functions of a file: its symbols' extents, and for code no symbol
/// covers (a stripped file), the ranges of `.eh_frame`'s FDEs.
pub fn functions(elf: &Elf) -> Vec<Function> {
    let mut out: Vec<Function> = elf
        .symbols(false)
        .iter()
        .chain(elf.symbols(true))
        .filter(|s| s.defined && s.is_func && s.size > 0)
        .filter(|s| elf.section_at(s.value).is_some_and(|sec| sec.is_exec()))
        .map(|s| Function { start: s.value, end: s.value.saturating_add(s.size) })
        .collect();
    out.extend(fde_ranges(elf).into_iter().filter(|f| elf.section_at(f.start).is_some_and(|s| s.is_exec())));
    out.sort_by_key(|f| (f.start, std::cmp::Reverse(f.end)));
    out.dedup_by_key(|f| f.start);
    out
}

/// The code ranges `.eh_frame` describes (empty if it cannot be read).
fn fde_ranges(elf: &Elf) -> Vec<Function> {
    use gimli::UnwindSection;
    let Some(sec) = elf.section_by_name(".eh_frame") else { return Vec::new() };
    let eh = gimli::EhFrame::new(sec.data, gimli::LittleEndian);
    let mut bases = gimli::BaseAddresses::default().set_eh_frame(sec.addr.0);
    if let Some(text) = elf.section_by_name(".text") {
        bases = bases.set_text(text.addr.0);
    }
    if let Some(got) = elf.section_by_name(".got") {
        bases = bases.set_got(got.addr.0);
    }
    let mut out = Vec::new();
    let mut entries = eh.entries(&bases);
    while let Ok(Some(entry)) = entries.next() {
        if let gimli::CieOrFde::Fde(partial) = entry
            && let Ok(fde) = partial.parse(|s, b, o| s.cie_from_offset(b, o))
            && fde.len() > 0
        {
            out.push(Function { start: fde.initial_address(), end: fde.end_address() });
        }
    }
    out
}

/// What the entry points of an analysis are to the wrapper search, by
/// their signature: allocators that return the object, frees and
/// reallocs (entries that hand the object back through an argument, such
/// as `posix_memalign`, make no wrapper of this kind).
fn role_of(e: &EntryPoint) -> Option<Callee> {
    let sig = &e.sig;
    match (sig.kind, sig.result, sig.freed) {
        (Kind::Alloc, Returns::Ret, _) => Some(Callee::Alloc { size: sig.size }),
        (Kind::Free, _, Some(ptr)) => Some(Callee::Free { ptr }),
        (Kind::Realloc, Returns::Ret, Some(ptr)) => Some(Callee::Realloc { ptr, size: sig.size }),
        _ => None,
    }
}

/// What the wrapper search is told besides the file.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Search at all (`alloctramp sites` does; patching does not use
    /// wrappers yet, and the search costs a pass over the code).
    pub search: bool,
    /// Wrappers the file's libraries export, by symbol name (see
    /// [`exported`]).
    pub imported: HashMap<String, Callee>,
    /// Those of `imported` that their library charges to its callers: the
    /// only imported wrappers whose calls are charged.
    pub imported_charged: HashSet<String>,
    /// Those of `imported` whose calls are hooks in their library (its
    /// sites inside take the charge of an active hook): calls to them
    /// from the file are hooks too.
    pub imported_hooks: HashSet<String>,
    /// Where the allocator's pointers are relative to those of imported
    /// wrappers with a size header.
    pub imported_keys: HashMap<String, crate::scan::Keys>,
    /// The library that exports each of `imported` (for listings).
    pub libraries: HashMap<String, String>,
    /// Exported allocation plumbing of the file's libraries whose calls
    /// are hooks there, by symbol: calls to them are hooks in the file too
    /// (see [`crate::deps::Imported::plumbing`]).
    pub imported_plumbing: HashMap<String, String>,
    /// Functions of the file named wrappers by the user, with their role.
    pub named: Vec<(String, Callee)>,
    /// Functions of the file that are not wrappers, whatever they look like.
    pub refused: Vec<String>,
    /// Make calls to wrappers sites, charged with what the wrappers
    /// allocate (see [`crate::charge`]).
    pub charge: bool,
    /// Hook the entry of each charged definition of an entry point that is
    /// reached through pointers (see [`crate::hooks`]).
    pub entry_hooks: bool,
    /// Patterns of allocation plumbing added to the default list
    /// ([`crate::plumbing`]): a site inside inlined plumbing is named
    /// after the first inlined caller outside it.
    pub plumbing: Vec<String>,
    /// What [`discover`] finds in the file with these options and the
    /// default entry points, when already known: not searched again.
    pub found: Option<Vec<Wrapper>>,
}

/// The wrappers in a file whose entry points `entries` are (the defaults
/// and any the user named): calls through PLT stubs, GOT slots and direct
/// calls to definitions are resolved as the site scan resolves them.
/// Functions `opts` names are wrappers (depth 0, [`Why::Named`]) or never
/// are.
pub fn discover(elf: &Elf, entries: &[EntryPoint], opts: &Options) -> (Vec<Wrapper>, Vec<u64>) {
    let mut by_name: HashMap<&str, Callee> =
        opts.imported.iter().filter(|(n, _)| !opts.refused.contains(n)).map(|(n, &c)| (n.as_str(), c)).collect();
    for e in entries {
        if let (EntryTarget::Symbol(name), Some(role)) = (&e.target, role_of(e)) {
            by_name.insert(name.as_str(), role);
        }
    }
    let named = |name: &str| {
        by_name.get(name).copied().or_else(|| {
            if throws(name) {
                Some(Callee::Throws)
            } else if never_returns(name) {
                Some(Callee::NoReturn)
            } else {
                RETURNS_FIRST.contains(&name).then_some(Callee::ReturnsFirst)
            }
        })
    };
    let mut slots: FastMap<u64, Callee> = FastMap::default();
    // The file's own functions that it calls through a GOT slot (an
    // exported function of a library, which may be interposed).
    let defined: HashMap<&str, u64> =
        elf.symbols(true).iter().filter(|s| s.defined && s.is_func).map(|s| (s.name, s.value)).collect();
    let mut own_slots: HashMap<u64, u64> = HashMap::new();
    for r in elf.dynamic_relocations() {
        if let (6 | 7, Some(name)) = (r.r_type, r.symbol) {
            if let Some(c) = named(name) {
                slots.insert(r.offset.0, c);
            } else if let Some(&def) = defined.get(name) {
                own_slots.insert(r.offset.0, def);
            }
        }
    }
    let mut local: FastMap<Target, u64> = own_slots.iter().map(|(&slot, &def)| (Target::Slot(slot), def)).collect();
    let mut code: FastMap<u64, Callee> = FastMap::default();
    for e in entries {
        if let (EntryTarget::Address(a), Some(role)) = (&e.target, role_of(e)) {
            code.insert(*a, role);
        }
    }
    for sym in elf.symbols(false).iter().chain(elf.symbols(true)) {
        if sym.defined
            && sym.is_func
            && let Some(c) = named(sym.name)
        {
            code.entry(sym.value).or_insert(c);
        }
    }
    // GOT slots that a relative relocation fills with the address of a
    // known function the file defines (as `scan` resolves them): Rust's
    // `__rdl_alloc` jumping to the `malloc` of a static-pie program.
    let in_got = |a: u64| elf.sections.iter().any(|s| s.name == ".got" && s.contains(a));
    for r in elf.dynamic_relocations() {
        let (8, Ok(a)) = (r.r_type, u64::try_from(r.addend)) else { continue };
        if !in_got(r.offset.0) {
            continue;
        }
        match code.get(&a) {
            Some(&c) => {
                slots.entry(r.offset.0).or_insert(c);
            }
            // Any other function of the file: a call through the slot is a
            // call of it (a wrapper of a wrapper, `__rust_alloc`).
            None => {
                local.entry(Target::Slot(r.offset.0)).or_insert(a);
            }
        }
    }
    let mut texts = Vec::new();
    for sec in elf.sections.iter().filter(|s| s.is_exec()) {
        texts.push((sec.addr.0, sec.data));
        if crate::scan::is_plt(sec) && !(slots.is_empty() && own_slots.is_empty()) {
            let step = if sec.name == ".plt.got" { 8 } else { 16 };
            // The stubs present in the file (a section without contents
            // has none, whatever its size says).
            for addr in (sec.addr.0..sec.addr.0.saturating_add(sec.data.len() as u64)).step_by(step) {
                let Some(slot) = crate::scan::plt_stub_slot(sec, addr) else { continue };
                if let Some(c) = slots.get(&slot) {
                    code.insert(addr, *c);
                } else if let Some(&def) = own_slots.get(&slot) {
                    local.insert(Target::Code(addr), def);
                }
            }
        }
    }
    // The user's word: named wrappers are known callees, refused functions
    // are neither wrappers nor what makes one.
    let defined = |name: &str| {
        elf.symbols(false)
            .iter()
            .chain(elf.symbols(true))
            .filter(|s| s.defined && s.is_func && (s.name == name || crate::symbols::demangle(s.name) == name))
            .map(|s| s.value)
            .collect::<Vec<u64>>()
    };
    let functions = functions(elf);
    let end_of = |a: u64| functions.iter().find(|f| f.start == a).map_or(a, |f| f.end);
    let text = Code { ranges: texts, local };
    let mut named = Vec::new();
    for (name, role) in &opts.named {
        for a in defined(name) {
            code.insert(a, *role);
            let f = Function { start: a, end: end_of(a) };
            let chargeable = !reads_stack_args(&text, f);
            named.push(Wrapper {
                start: a,
                end: f.end,
                role: *role,
                why: Why::Named,
                depth: 0,
                frees: Frees::default(),
                chargeable,
                offsets: Offsets::default(),
                one_source: false,
            });
        }
    }
    let refused: HashSet<u64> = opts.refused.iter().flat_map(|n| defined(n)).collect();
    let known = |t: Target| match t {
        Target::Code(a) if refused.contains(&a) => None,
        Target::Code(a) => code.get(&a).copied(),
        Target::Slot(a) => slots.get(&a).copied(),
    };
    let (mut wrappers, noreturn) = find(&text, &functions, &known, &|a| refused.contains(&a));
    // A wrapper that may throw can be charged where the trampolines carry
    // unwind entries: an exception through its caller's trampoline counts
    // the call as failed and lowers the depth again (`runtime::unwinding`).
    if crate::charge::unwind_entries(elf) {
        for w in &mut wrappers {
            w.chargeable = true;
        }
    }
    named.retain(|n| !wrappers.iter().any(|w| w.start == n.start));
    wrappers.extend(named);
    wrappers.sort_by_key(|w| w.start);
    (wrappers, noreturn)
}

/// The wrappers a shared library exports: (symbol name, role) of each of
/// `wrappers` (what [`discover`] found in it, sorted by address) that a
/// defined global dynamic symbol names.
pub fn exported(elf: &Elf, entries: &[EntryPoint], wrappers: &[Wrapper]) -> Vec<(String, Callee)> {
    let is_entry = |name: &str| entries.iter().any(|e| e.target == EntryTarget::Symbol(name.to_string()));
    let mut out = Vec::new();
    for sym in elf.symbols(true).iter().filter(|s| s.defined && s.is_func && s.global && !is_entry(s.name)) {
        if let Ok(i) = wrappers.binary_search_by_key(&sym.value, |w| w.start) {
            out.push((sym.name.to_string(), wrappers[i].role));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::code_asm::*;
    use iced_x86::{Code as Op, MemoryOperand};

    fn rip(addr: u64) -> MemoryOperand {
        MemoryOperand::with_base_displ(Register::RIP, addr as i64)
    }

    const ALLOC: Callee = Callee::Alloc { size: Size::Arg(0) };
    const REALLOC_0: Callee = Callee::Realloc { ptr: 0, size: Size::Arg(1) };
    const MALLOC: u64 = 0x10_0000;
    const FREE: u64 = 0x10_0010;
    const REALLOC: u64 = 0x10_0020;
    const ABORT: u64 = 0x10_0030;
    const OTHER: u64 = 0x10_0040;
    const CALLOC: u64 = 0x10_0050;

    fn libc(t: Target) -> Option<Callee> {
        match t {
            Target::Code(MALLOC) => Some(ALLOC),
            Target::Code(FREE) => Some(Callee::Free { ptr: 0 }),
            Target::Code(REALLOC) => Some(REALLOC_0),
            Target::Code(ABORT) => Some(Callee::NoReturn),
            Target::Code(CALLOC) => Some(Callee::Alloc { size: Size::Product(0, 1) }),
            Target::Slot(0x20_0000) => Some(ALLOC),
            _ => None,
        }
    }

    /// Assembles functions one after another from 0x1000; returns their
    /// code and ranges.
    /// A function written with the assembler.
    type Asm<'a> = &'a dyn Fn(&mut CodeAssembler) -> Result<(), IcedError>;
    /// Wrappers found (function index, role, depth), the functions that
    /// never return (indices), and the wrappers.
    type Found = (Vec<(usize, Callee, u32)>, Vec<usize>, Vec<Wrapper>);

    fn build(funcs: &[Asm]) -> (Vec<u8>, Vec<Function>) {
        let mut bytes = Vec::new();
        let mut functions = Vec::new();
        for f in funcs {
            let start = 0x1000 + bytes.len() as u64;
            let mut a = CodeAssembler::new(64).unwrap();
            f(&mut a).unwrap();
            let code = a.assemble(start).unwrap();
            functions.push(Function { start, end: start + code.len() as u64 });
            bytes.extend(code);
            while bytes.len() % 16 != 0 {
                bytes.push(0xcc);
            }
        }
        (bytes, functions)
    }

    fn run(funcs: &[Asm]) -> Found {
        let (bytes, functions) = build(funcs);
        let code = Code { ranges: vec![(0x1000, &bytes)], local: FastMap::default() };
        let (w, noreturn) = find(&code, &functions, &libc, &|_| false);
        let index = |a: u64| functions.iter().position(|f| f.start == a).unwrap();
        (w.iter().map(|w| (index(w.start), w.role, w.depth)).collect(), noreturn.into_iter().map(index).collect(), w)
    }

    #[test]
    fn a_die_on_null_wrapper_and_a_wrapper_of_it() {
        // xmalloc(n) { p = malloc(n); if (!p) abort(); return p; }
        let xmalloc = |a: &mut CodeAssembler| {
            let mut die = a.create_label();
            a.push(rbx)?;
            a.call(MALLOC)?;
            a.mov(rbx, rax)?;
            a.test(rax, rax)?;
            a.je(die)?;
            a.mov(rax, rbx)?;
            a.pop(rbx)?;
            a.ret()?;
            a.set_label(&mut die)?;
            a.call(ABORT)?;
            Ok(())
        };
        // xcalloc-like: a second level that saves the result in a stack
        // slot across an unrelated call.
        let outer = |a: &mut CodeAssembler| {
            a.sub(rsp, 24)?;
            a.call(0x1000u64)?;
            a.mov(qword_ptr(rsp + 8), rax)?;
            a.call(OTHER)?;
            a.mov(rax, qword_ptr(rsp + 8))?;
            a.add(rsp, 24)?;
            a.ret()?;
            Ok(())
        };
        let (found, _, w) = run(&[&xmalloc, &outer]);
        assert_eq!(found, [(0, ALLOC, 1), (1, ALLOC, 2)]);
        assert_eq!(w[0].why, Why::Returns { at: 0x1001, offset: 0 });
    }

    #[test]
    fn a_size_header_in_front_and_returning_null() {
        // zmalloc(n) { p = malloc(n + 16); if (!p) return NULL; *p = n; return p + 16; }
        let z = |a: &mut CodeAssembler| {
            let mut null = a.create_label();
            a.push(rbx)?;
            a.mov(rbx, rdi)?;
            a.add(rdi, 16)?;
            a.call(MALLOC)?;
            a.test(rax, rax)?;
            a.je(null)?;
            a.mov(qword_ptr(rax), rbx)?;
            a.add(rax, 16)?;
            a.pop(rbx)?;
            a.ret()?;
            a.set_label(&mut null)?;
            a.xor(eax, eax)?;
            a.pop(rbx)?;
            a.ret()?;
            Ok(())
        };
        // zfree(p) { if (p) free(p - 16); }
        let zfree = |a: &mut CodeAssembler| {
            let mut out = a.create_label();
            a.test(rdi, rdi)?;
            a.je(out)?;
            a.sub(rdi, 16)?;
            a.jmp(FREE)?;
            a.set_label(&mut out)?;
            a.ret()?;
            Ok(())
        };
        let (found, _, w) = run(&[&z, &zfree]);
        assert_eq!(found, [(0, ALLOC, 1), (1, Callee::Free { ptr: 0 }, 1)]);
        assert!(matches!(w[0].why, Why::Returns { offset: 16, .. }));
        assert!(matches!(w[1].why, Why::Frees { offset: -16, .. }));
    }

    #[test]
    fn a_null_result_shares_the_return_path() {
        // zmalloc_usable as gcc -O2 writes it: the NULL path returns the
        // (NULL) result unchanged through the same `ret`.
        let z = |a: &mut CodeAssembler| {
            let mut out = a.create_label();
            a.push(rbx)?;
            a.mov(rbx, rdi)?;
            a.add(rdi, 16)?;
            a.call(MALLOC)?;
            a.test(rax, rax)?;
            a.je(out)?;
            a.mov(qword_ptr(rax), rbx)?;
            a.add(rax, 16)?;
            a.set_label(&mut out)?;
            a.pop(rbx)?;
            a.ret()?;
            Ok(())
        };
        // The same at -O0: the result in a stack slot compared with 0, and
        // `mov eax, 0` on the NULL path.
        let z0 = |a: &mut CodeAssembler| {
            let (mut ok, mut out) = (a.create_label(), a.create_label());
            a.push(rbp)?;
            a.mov(rbp, rsp)?;
            a.sub(rsp, 32)?;
            a.mov(qword_ptr(rbp - 0x18), rdi)?;
            a.mov(rax, qword_ptr(rbp - 0x18))?;
            a.add(rax, 16)?;
            a.mov(rdi, rax)?;
            a.call(MALLOC)?;
            a.mov(qword_ptr(rbp - 8), rax)?;
            a.cmp(qword_ptr(rbp - 8), 0)?;
            a.jne(ok)?;
            a.mov(eax, 0)?;
            a.jmp(out)?;
            a.set_label(&mut ok)?;
            a.mov(rax, qword_ptr(rbp - 8))?;
            a.add(rax, 16)?;
            a.set_label(&mut out)?;
            a.leave()?;
            a.ret()?;
            Ok(())
        };
        // Without the test, a result and result + 16 do not agree.
        let mixed = |a: &mut CodeAssembler| {
            let mut out = a.create_label();
            a.push(rbx)?;
            a.call(MALLOC)?;
            a.cmp(rbx, 3)?;
            a.je(out)?;
            a.add(rax, 16)?;
            a.set_label(&mut out)?;
            a.pop(rbx)?;
            a.ret()?;
            Ok(())
        };
        let (found, _, w) = run(&[&z, &z0, &mixed]);
        assert_eq!(found, [(0, ALLOC, 1), (1, ALLOC, 1)]);
        assert!(w.iter().all(|w| matches!(w.why, Why::Returns { offset: 16, .. })));
    }

    #[test]
    fn tail_calls_and_realloc_wrappers() {
        // size0to1(n) { if (!n) n = 1; return malloc(n); } as a tail call
        // through a GOT slot.
        let t = |a: &mut CodeAssembler| {
            let mut go = a.create_label();
            a.test(rdi, rdi)?;
            a.jne(go)?;
            a.mov(edi, 1)?;
            a.set_label(&mut go)?;
            a.add_instruction(Instruction::with1(Op::Jmp_rm64, rip(0x20_0000))?)?;
            Ok(())
        };
        // xrealloc(p, n) { q = realloc(p, n); if (!q) abort(); return q; }
        let r = |a: &mut CodeAssembler| {
            let mut die = a.create_label();
            a.sub(rsp, 8)?;
            a.call(REALLOC)?;
            a.test(rax, rax)?;
            a.je(die)?;
            a.add(rsp, 8)?;
            a.ret()?;
            a.set_label(&mut die)?;
            a.call(ABORT)?;
            Ok(())
        };
        let (found, _, w) = run(&[&t, &r]);
        assert_eq!(found, [(0, ALLOC, 1), (1, REALLOC_0, 1)]);
        assert!(matches!(w[0].why, Why::TailCall { .. }));
    }

    #[test]
    fn the_size_a_call_asks_for() {
        // xcalloc(n, size) { p = calloc(n, size); if (!p) abort(); return p; }
        let c = |a: &mut CodeAssembler| {
            let mut die = a.create_label();
            a.sub(rsp, 8)?;
            a.call(CALLOC)?;
            a.test(rax, rax)?;
            a.je(die)?;
            a.add(rsp, 8)?;
            a.ret()?;
            a.set_label(&mut die)?;
            a.call(ABORT)?;
            Ok(())
        };
        // -O0: n kept in a stack slot, set to 1 there when 0.
        // xmalloc0(n) { if (n == 0) n = 1; return malloc(n); }
        let z = |a: &mut CodeAssembler| {
            let mut go = a.create_label();
            a.push(rbp)?;
            a.mov(rbp, rsp)?;
            a.sub(rsp, 16)?;
            a.mov(qword_ptr(rbp - 8), rdi)?;
            a.cmp(qword_ptr(rbp - 8), 0)?;
            a.jne(go)?;
            a.mov(qword_ptr(rbp - 8), 1)?;
            a.set_label(&mut go)?;
            a.mov(rax, qword_ptr(rbp - 8))?;
            a.mov(rdi, rax)?;
            a.call(MALLOC)?;
            a.leave()?;
            a.ret()?;
            Ok(())
        };
        // twice(n) { return malloc(n * 2); }: a size that is no argument.
        let t = |a: &mut CodeAssembler| {
            a.add(rdi, rdi)?;
            a.jmp(MALLOC)?;
            Ok(())
        };
        let (found, _, _) = run(&[&c, &z, &t]);
        assert_eq!(
            found,
            [
                (0, Callee::Alloc { size: Size::Product(0, 1) }, 1),
                (1, ALLOC, 1),
                (2, Callee::Alloc { size: Size::None }, 1)
            ]
        );
        assert_eq!(found[2].1.signature(), None, "calls to it cannot be counted");
    }

    #[test]
    fn a_release_that_frees_only_sometimes_and_a_minimum_size() {
        // unref(o) { if (--o->refs == 0) free(o); }: frees on one path only.
        let unref = |a: &mut CodeAssembler| {
            let mut done = a.create_label();
            a.sub(dword_ptr(rdi), 1)?;
            a.jne(done)?;
            a.jmp(FREE)?;
            a.set_label(&mut done)?;
            a.ret()?;
            Ok(())
        };
        // drop(p) { if (p) free(p); }: frees or found NULL on every path.
        let drop = |a: &mut CodeAssembler| {
            let mut done = a.create_label();
            a.test(rdi, rdi)?;
            a.je(done)?;
            a.jmp(FREE)?;
            a.set_label(&mut done)?;
            a.ret()?;
            Ok(())
        };
        // buf(n) { if (n < 4096) n = 4096; return malloc(n); }: the size is
        // not the caller's.
        let buf = |a: &mut CodeAssembler| {
            let mut go = a.create_label();
            a.cmp(rdi, 4096)?;
            a.jae(go)?;
            a.mov(edi, 4096)?;
            a.set_label(&mut go)?;
            a.jmp(MALLOC)?;
            Ok(())
        };
        let (found, _, _) = run(&[&unref, &drop, &buf]);
        assert_eq!(found, [(1, Callee::Free { ptr: 0 }, 1), (2, Callee::Alloc { size: Size::None }, 1)]);
    }

    #[test]
    fn what_is_not_a_wrapper() {
        // grow(buf) { buf->p = realloc(buf->p, n); }: returns nothing.
        let grow = |a: &mut CodeAssembler| {
            a.push(rbx)?;
            a.mov(rbx, rdi)?;
            a.mov(rdi, qword_ptr(rdi))?;
            a.call(REALLOC)?;
            a.mov(qword_ptr(rbx), rax)?;
            a.pop(rbx)?;
            a.ret()?;
            Ok(())
        };
        // cached(n) { if (cache) return cache; return malloc(n); }
        let cached = |a: &mut CodeAssembler| {
            let mut miss = a.create_label();
            a.add_instruction(Instruction::with2(Op::Mov_r64_rm64, Register::RAX, rip(0x30_0000))?)?;
            a.test(rax, rax)?;
            a.je(miss)?;
            a.ret()?;
            a.set_label(&mut miss)?;
            a.jmp(MALLOC)?;
            Ok(())
        };
        // destroy(n) { free(n->name); free(n); }
        let destroy = |a: &mut CodeAssembler| {
            a.push(rbx)?;
            a.mov(rbx, rdi)?;
            a.mov(rdi, qword_ptr(rdi + 8))?;
            a.call(FREE)?;
            a.mov(rdi, rbx)?;
            a.pop(rbx)?;
            a.jmp(FREE)?;
            Ok(())
        };
        // an unrelated call clobbers rax before the return.
        let clobbered = |a: &mut CodeAssembler| {
            a.sub(rsp, 8)?;
            a.call(MALLOC)?;
            a.mov(rdi, rax)?;
            a.call(OTHER)?;
            a.add(rsp, 8)?;
            a.ret()?;
            Ok(())
        };
        // eight(a, ..., h): its eighth argument is on the stack.
        let eight = |a: &mut CodeAssembler| {
            a.mov(rdi, qword_ptr(rsp + 16))?;
            a.jmp(MALLOC)?;
            Ok(())
        };
        // open_session at -O0: a void function whose last store leaves the
        // object in rax; the object went to a global list.
        let kept = |a: &mut CodeAssembler| {
            a.sub(rsp, 8)?;
            a.call(MALLOC)?;
            a.add_instruction(Instruction::with2(Op::Mov_rm64_r64, rip(0x30_0000), Register::RAX)?)?;
            a.add(rsp, 8)?;
            a.ret()?;
            Ok(())
        };
        let (found, _, _) = run(&[&grow, &cached, &destroy, &clobbered, &eight, &kept]);
        assert_eq!(found, []);
    }

    #[test]
    fn functions_that_never_return() {
        // die() { report(); abort(); } and fatal() { jmp die }
        let die = |a: &mut CodeAssembler| {
            a.sub(rsp, 8)?;
            a.call(OTHER)?;
            a.call(ABORT)?;
            Ok(())
        };
        let fatal = |a: &mut CodeAssembler| {
            a.jmp(0x1000u64)?;
            Ok(())
        };
        // xmalloc that dies through die().
        let x = |a: &mut CodeAssembler| {
            let mut bad = a.create_label();
            a.sub(rsp, 8)?;
            a.call(MALLOC)?;
            a.test(rax, rax)?;
            a.je(bad)?;
            a.add(rsp, 8)?;
            a.ret()?;
            a.set_label(&mut bad)?;
            a.call(0x1010u64)?;
            Ok(())
        };
        let (found, noreturn, _) = run(&[&die, &fatal, &x]);
        assert_eq!(noreturn, [0, 1]);
        assert_eq!(found, [(2, ALLOC, 1)]);
    }
}
