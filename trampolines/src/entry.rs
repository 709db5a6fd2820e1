//! Allocator entry points: which functions count as allocating, freeing or
//! reallocating, and where their size and pointer arguments live.
//!
//! The patcher uses this to recognise call sites; the runtime uses the same
//! signatures to know which register holds the size or the pointer at a site.

use std::fmt;

/// What an entry point does to the heap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Returns new memory.
    Alloc,
    /// Releases memory.
    Free,
    /// Releases one object and returns another (`realloc`).
    Realloc,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Alloc => "alloc",
            Kind::Free => "free",
            Kind::Realloc => "realloc",
        }
    }

    pub fn code(self) -> u8 {
        match self {
            Kind::Alloc => 0,
            Kind::Free => 1,
            Kind::Realloc => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Kind> {
        match code {
            0 => Some(Kind::Alloc),
            1 => Some(Kind::Free),
            2 => Some(Kind::Realloc),
            _ => None,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Index of an integer argument in the System V x86-64 calling convention:
/// 0..=5 are rdi, rsi, rdx, rcx, r8, r9.
pub type Arg = u8;

/// Number of integer arguments passed in registers.
pub const REG_ARGS: u8 = 6;

/// How the number of bytes requested is found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Size {
    /// The entry requests no bytes (frees).
    None,
    /// One argument holds the size.
    Arg(Arg),
    /// The product of two arguments (`calloc`, `reallocarray`).
    Product(Arg, Arg),
    /// The length of the returned string plus one (`strdup`, `strndup`).
    ResultStrlen,
}

/// Where the new object appears.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Returns {
    /// Nothing is allocated.
    None,
    /// The return value; NULL means failure.
    Ret,
    /// Stored through the pointer in an argument; a zero return means
    /// success (`posix_memalign`).
    OutArg(Arg),
}

/// The calling signature that matters for counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    pub kind: Kind,
    pub size: Size,
    pub result: Returns,
    /// The argument holding the pointer released (free, delete, realloc).
    pub freed: Option<Arg>,
}

impl Signature {
    pub const fn alloc(size: Size) -> Signature {
        Signature { kind: Kind::Alloc, size, result: Returns::Ret, freed: None }
    }
    pub const fn free(ptr: Arg) -> Signature {
        Signature { kind: Kind::Free, size: Size::None, result: Returns::None, freed: Some(ptr) }
    }
    pub const fn realloc(ptr: Arg, size: Size) -> Signature {
        Signature { kind: Kind::Realloc, size, result: Returns::Ret, freed: Some(ptr) }
    }

    /// Every argument register the signature reads.
    pub fn args_read(&self) -> impl Iterator<Item = Arg> {
        let size = match self.size {
            Size::Arg(a) => [Some(a), None],
            Size::Product(a, b) => [Some(a), Some(b)],
            Size::None | Size::ResultStrlen => [None, None],
        };
        let out = match self.result {
            Returns::OutArg(a) => Some(a),
            _ => None,
        };
        size.into_iter().chain([out, self.freed]).flatten()
    }
}

/// A function whose calls are counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    /// How it is reached: by symbol name (as written in the symbol tables,
    /// mangled for C++) or by virtual address in the file.
    pub target: Target,
    /// Name shown to people (demangled).
    pub display: String,
    pub sig: Signature,
    /// Argument registers the function reads (6 when unknown): what a
    /// trampoline keeps intact around a call into the runtime made before
    /// the original call.
    pub args: u8,
    /// Whose memory it hands out or takes back.
    pub heap: Heap,
}

/// Whose memory an entry point hands out or takes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Heap {
    /// The process's malloc: the C allocator's functions and C++'s global
    /// operators (and the wrappers found around them), which the runtime
    /// checks are glibc's before it lets trampolines record objects by
    /// plain store.
    Malloc,
    /// An allocator's own API (jemalloc's `mallocx`, mimalloc's
    /// `mi_malloc`, tcmalloc's `tc_malloc`) or an entry the user names: it
    /// may put objects smaller than 32 bytes side by side whatever malloc
    /// is, so its objects are recorded by compare-and-swap.
    Other,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Symbol(String),
    Address(u64),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Symbol(s) => f.write_str(s),
            Target::Address(a) => write!(f, "{a:#x}"),
        }
    }
}

const A0: Size = Size::Arg(0);

/// The entry points known without being named: the C allocator, every
/// C++ global operator new and delete, and the own APIs of jemalloc,
/// tcmalloc (gperftools) and mimalloc ([`allocator_apis`]).
pub fn defaults() -> Vec<EntryPoint> {
    let mut out = process_malloc();
    out.extend(allocator_apis());
    out.extend(python_api());
    out
}

/// Whether an entry name is a C library's internal name for a standard
/// function (`__libc_malloc`): where the standard name is at the same
/// address, sites name the standard one.
pub fn is_alias_name(name: &str) -> bool {
    name.starts_with("__libc_")
}

/// CPython's allocator API. Each function calls its allocator through a
/// slot of a table in data (`_PyObject.free(_PyObject.ctx, p)`), which
/// `PyMem_SetAllocator` may change, and `PyObject_Free` is also reached
/// through pointers (types' `tp_free`): see [`slot_api`].
const PYTHON: Api = &[
    ("PyObject_Malloc", Signature::alloc(A0), 1),
    ("PyObject_Calloc", Signature::alloc(Size::Product(0, 1)), 2),
    ("PyObject_Realloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("PyObject_Free", Signature::free(0), 1),
    ("PyMem_Malloc", Signature::alloc(A0), 1),
    ("PyMem_Calloc", Signature::alloc(Size::Product(0, 1)), 2),
    ("PyMem_Realloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("PyMem_Free", Signature::free(0), 1),
    ("PyMem_RawMalloc", Signature::alloc(A0), 1),
    ("PyMem_RawCalloc", Signature::alloc(Size::Product(0, 1)), 2),
    ("PyMem_RawRealloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("PyMem_RawFree", Signature::free(0), 1),
];

/// [`PYTHON`], entry points by default. Their heap is [`Heap::Other`]
/// (pymalloc puts small objects side by side).
pub fn python_api() -> Vec<EntryPoint> {
    PYTHON
        .iter()
        .map(|&(name, sig, args)| EntryPoint {
            target: Target::Symbol(name.to_string()),
            display: name.to_string(),
            sig,
            args,
            heap: Heap::Other,
        })
        .collect()
}

/// Whether the entry point named `name` is a function of an allocator
/// API that calls its allocator through a slot in data, passing a context
/// first ([`PYTHON`]): in a file that defines it, those calls are sites
/// too (see the patcher's `slots`), so that calls reaching it through
/// pointers count.
pub fn slot_api(name: &str) -> bool {
    PYTHON.iter().any(|&(n, _, _)| n == name)
}

/// The signature of a call through a slot of a [`slot_api`] function with
/// signature `sig`: the same arguments after the context.
pub fn after_context(sig: Signature) -> Signature {
    let shift = |a: Arg| a + 1;
    Signature {
        kind: sig.kind,
        size: match sig.size {
            Size::Arg(a) => Size::Arg(shift(a)),
            Size::Product(a, b) => Size::Product(shift(a), shift(b)),
            other => other,
        },
        result: match sig.result {
            Returns::OutArg(a) => Returns::OutArg(shift(a)),
            other => other,
        },
        freed: sig.freed.map(shift),
    }
}

/// The C allocator (with C23's `free_sized` and `free_aligned_sized`) and
/// C++'s global operators: the process's malloc.
fn process_malloc() -> Vec<EntryPoint> {
    use Size::{Arg, Product, ResultStrlen};
    let c: &[(&str, Signature, u8)] = &[
        ("malloc", Signature::alloc(A0), 1),
        ("calloc", Signature::alloc(Product(0, 1)), 2),
        ("realloc", Signature::realloc(0, Arg(1)), 2),
        ("reallocarray", Signature::realloc(0, Product(1, 2)), 3),
        ("free", Signature::free(0), 1),
        (
            "posix_memalign",
            Signature { kind: Kind::Alloc, size: Arg(2), result: Returns::OutArg(0), freed: Option::None },
            3,
        ),
        ("aligned_alloc", Signature::alloc(Arg(1)), 2),
        ("memalign", Signature::alloc(Arg(1)), 2),
        ("valloc", Signature::alloc(A0), 1),
        ("pvalloc", Signature::alloc(A0), 1),
        ("strdup", Signature::alloc(ResultStrlen), 1),
        ("strndup", Signature::alloc(ResultStrlen), 2),
        ("free_sized", Signature::free(0), 2),
        ("free_aligned_sized", Signature::free(0), 3),
        // The C libraries' internal names (musl's `__libc_malloc` is a
        // function of its own beside `malloc`; glibc's are aliases, which
        // a site names by the standard name: see [`is_alias_name`]).
        ("__libc_malloc", Signature::alloc(A0), 1),
        ("__libc_calloc", Signature::alloc(Product(0, 1)), 2),
        ("__libc_realloc", Signature::realloc(0, Arg(1)), 2),
        ("__libc_free", Signature::free(0), 1),
        ("__libc_memalign", Signature::alloc(Arg(1)), 2),
    ];
    let mut out: Vec<EntryPoint> = c
        .iter()
        .map(|(name, sig, args)| EntryPoint {
            target: Target::Symbol((*name).to_string()),
            display: (*name).to_string(),
            sig: *sig,
            args: *args,
            heap: Heap::Malloc,
        })
        .collect();

    // operator new / new[]: _Znwm / _Znam, optionally followed by
    // std::align_val_t (St11align_val_t) and/or std::nothrow_t const&.
    for (op, arr) in [("nw", ""), ("na", "[]")] {
        for (aligned, aname) in [("", ""), ("St11align_val_t", ", std::align_val_t")] {
            for (nothrow, nname) in [("", ""), ("RKSt9nothrow_t", ", std::nothrow_t const&")] {
                out.push(EntryPoint {
                    target: Target::Symbol(format!("_Z{op}m{aligned}{nothrow}")),
                    display: format!("operator new{arr}(unsigned long{aname}{nname})"),
                    sig: Signature::alloc(A0),
                    args: 1 + u8::from(!aligned.is_empty()) + u8::from(!nothrow.is_empty()),
                    heap: Heap::Malloc,
                });
            }
        }
    }
    // operator delete / delete[]: _ZdlPv / _ZdaPv, optionally sized (m),
    // aligned, nothrow. Sized and nothrow do not combine.
    for (op, arr) in [("dl", ""), ("da", "[]")] {
        for (sized, sname) in [("", ""), ("m", ", unsigned long")] {
            for (aligned, aname) in [("", ""), ("St11align_val_t", ", std::align_val_t")] {
                for (nothrow, nname) in [("", ""), ("RKSt9nothrow_t", ", std::nothrow_t const&")] {
                    if !sized.is_empty() && !nothrow.is_empty() {
                        continue;
                    }
                    out.push(EntryPoint {
                        target: Target::Symbol(format!("_Z{op}Pv{sized}{aligned}{nothrow}")),
                        display: format!("operator delete{arr}(void*{sname}{aname}{nname})"),
                        sig: Signature::free(0),
                        args: 1
                            + u8::from(!sized.is_empty())
                            + u8::from(!aligned.is_empty())
                            + u8::from(!nothrow.is_empty()),
                        heap: Heap::Malloc,
                    });
                }
            }
        }
    }
    out
}

/// An allocator's own API as entry points: `(name, signature, argument
/// registers read)`.
type Api = &'static [(&'static str, Signature, u8)];

const fn out_arg(out: Arg, size: Arg) -> Signature {
    Signature { kind: Kind::Alloc, size: Size::Arg(size), result: Returns::OutArg(out), freed: None }
}

/// jemalloc's non-standard API. Programs that link jemalloc under a prefix
/// (`je_` when built with `--with-jemalloc-prefix`, `_rjem_` in Rust's
/// tikv-jemallocator) reach its standard functions under the prefix too.
const JEMALLOC: Api = &[
    ("mallocx", Signature::alloc(A0), 2),
    ("rallocx", Signature::realloc(0, Size::Arg(1)), 3),
    ("sdallocx", Signature::free(0), 3),
    ("dallocx", Signature::free(0), 2),
];
const JEMALLOC_STANDARD: Api = &[
    ("malloc", Signature::alloc(A0), 1),
    ("calloc", Signature::alloc(Size::Product(0, 1)), 2),
    ("realloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("free", Signature::free(0), 1),
    ("posix_memalign", out_arg(0, 2), 3),
    ("aligned_alloc", Signature::alloc(Size::Arg(1)), 2),
    ("memalign", Signature::alloc(Size::Arg(1)), 2),
    ("valloc", Signature::alloc(A0), 1),
];

/// gperftools' tcmalloc (`gperftools/tcmalloc.h`); its `sdallocx` is
/// jemalloc's.
const TCMALLOC: Api = &[
    ("tc_malloc", Signature::alloc(A0), 1),
    ("tc_malloc_skip_new_handler", Signature::alloc(A0), 1),
    ("tc_calloc", Signature::alloc(Size::Product(0, 1)), 2),
    ("tc_realloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("tc_free", Signature::free(0), 1),
    ("tc_cfree", Signature::free(0), 1),
    ("tc_free_sized", Signature::free(0), 2),
    ("tc_memalign", Signature::alloc(Size::Arg(1)), 2),
    ("tc_posix_memalign", out_arg(0, 2), 3),
    ("tc_valloc", Signature::alloc(A0), 1),
    ("tc_pvalloc", Signature::alloc(A0), 1),
    ("tc_new", Signature::alloc(A0), 1),
    ("tc_newarray", Signature::alloc(A0), 1),
    ("tc_new_nothrow", Signature::alloc(A0), 2),
    ("tc_newarray_nothrow", Signature::alloc(A0), 2),
    ("tc_new_aligned", Signature::alloc(A0), 2),
    ("tc_newarray_aligned", Signature::alloc(A0), 2),
    ("tc_new_aligned_nothrow", Signature::alloc(A0), 3),
    ("tc_newarray_aligned_nothrow", Signature::alloc(A0), 3),
    ("tc_delete", Signature::free(0), 1),
    ("tc_deletearray", Signature::free(0), 1),
    ("tc_delete_sized", Signature::free(0), 2),
    ("tc_deletearray_sized", Signature::free(0), 2),
    ("tc_delete_nothrow", Signature::free(0), 2),
    ("tc_deletearray_nothrow", Signature::free(0), 2),
    ("tc_delete_aligned", Signature::free(0), 2),
    ("tc_deletearray_aligned", Signature::free(0), 2),
    ("tc_delete_sized_aligned", Signature::free(0), 3),
    ("tc_deletearray_sized_aligned", Signature::free(0), 3),
    ("tc_delete_aligned_nothrow", Signature::free(0), 3),
    ("tc_deletearray_aligned_nothrow", Signature::free(0), 3),
];

/// mimalloc (`mimalloc.h`), with its heap functions (the heap is the
/// first argument). Left out: `mi_expand` (resizes in place and returns
/// NULL when it cannot, so no kind here describes it) and `mi_reallocf`
/// (frees its argument when it fails, unlike a realloc).
const MIMALLOC: Api = &[
    ("mi_malloc", Signature::alloc(A0), 1),
    ("mi_zalloc", Signature::alloc(A0), 1),
    ("mi_malloc_small", Signature::alloc(A0), 1),
    ("mi_zalloc_small", Signature::alloc(A0), 1),
    ("mi_calloc", Signature::alloc(Size::Product(0, 1)), 2),
    ("mi_mallocn", Signature::alloc(Size::Product(0, 1)), 2),
    ("mi_realloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("mi_rezalloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("mi_reallocn", Signature::realloc(0, Size::Product(1, 2)), 3),
    ("mi_recalloc", Signature::realloc(0, Size::Product(1, 2)), 3),
    ("mi_reallocarray", Signature::realloc(0, Size::Product(1, 2)), 3),
    ("mi_strdup", Signature::alloc(Size::ResultStrlen), 1),
    ("mi_strndup", Signature::alloc(Size::ResultStrlen), 2),
    ("mi_malloc_aligned", Signature::alloc(A0), 2),
    ("mi_malloc_aligned_at", Signature::alloc(A0), 3),
    ("mi_zalloc_aligned", Signature::alloc(A0), 2),
    ("mi_zalloc_aligned_at", Signature::alloc(A0), 3),
    ("mi_calloc_aligned", Signature::alloc(Size::Product(0, 1)), 3),
    ("mi_calloc_aligned_at", Signature::alloc(Size::Product(0, 1)), 4),
    ("mi_realloc_aligned", Signature::realloc(0, Size::Arg(1)), 3),
    ("mi_realloc_aligned_at", Signature::realloc(0, Size::Arg(1)), 4),
    ("mi_rezalloc_aligned", Signature::realloc(0, Size::Arg(1)), 3),
    ("mi_recalloc_aligned", Signature::realloc(0, Size::Product(1, 2)), 4),
    ("mi_posix_memalign", out_arg(0, 2), 3),
    ("mi_aligned_alloc", Signature::alloc(Size::Arg(1)), 2),
    ("mi_memalign", Signature::alloc(Size::Arg(1)), 2),
    ("mi_valloc", Signature::alloc(A0), 1),
    ("mi_pvalloc", Signature::alloc(A0), 1),
    ("mi_free", Signature::free(0), 1),
    ("mi_cfree", Signature::free(0), 1),
    ("mi_free_size", Signature::free(0), 2),
    ("mi_free_aligned", Signature::free(0), 2),
    ("mi_free_size_aligned", Signature::free(0), 3),
    ("mi_new", Signature::alloc(A0), 1),
    ("mi_new_nothrow", Signature::alloc(A0), 1),
    ("mi_new_aligned", Signature::alloc(A0), 2),
    ("mi_new_aligned_nothrow", Signature::alloc(A0), 2),
    ("mi_new_n", Signature::alloc(Size::Product(0, 1)), 2),
    ("mi_new_realloc", Signature::realloc(0, Size::Arg(1)), 2),
    ("mi_new_reallocn", Signature::realloc(0, Size::Product(1, 2)), 3),
    ("mi_heap_malloc", Signature::alloc(Size::Arg(1)), 2),
    ("mi_heap_zalloc", Signature::alloc(Size::Arg(1)), 2),
    ("mi_heap_malloc_small", Signature::alloc(Size::Arg(1)), 2),
    ("mi_heap_calloc", Signature::alloc(Size::Product(1, 2)), 3),
    ("mi_heap_mallocn", Signature::alloc(Size::Product(1, 2)), 3),
    ("mi_heap_malloc_aligned", Signature::alloc(Size::Arg(1)), 3),
    ("mi_heap_zalloc_aligned", Signature::alloc(Size::Arg(1)), 3),
    ("mi_heap_calloc_aligned", Signature::alloc(Size::Product(1, 2)), 4),
    ("mi_heap_strdup", Signature::alloc(Size::ResultStrlen), 2),
    ("mi_heap_strndup", Signature::alloc(Size::ResultStrlen), 3),
    ("mi_heap_realloc", Signature::realloc(1, Size::Arg(2)), 3),
    ("mi_heap_rezalloc", Signature::realloc(1, Size::Arg(2)), 3),
    ("mi_heap_reallocn", Signature::realloc(1, Size::Product(2, 3)), 4),
    ("mi_heap_realloc_aligned", Signature::realloc(1, Size::Arg(2)), 4),
];

/// The own APIs of other allocators, entry points by default:
/// [`JEMALLOC`] unprefixed and with its prefixes `je_` and `_rjem_` (with
/// its standard functions under them), [`TCMALLOC`] and [`MIMALLOC`].
/// Their heap is [`Heap::Other`].
pub fn allocator_apis() -> Vec<EntryPoint> {
    let mut out = Vec::new();
    let mut add = |prefix: &str, api: Api| {
        for (name, sig, args) in api {
            let name = format!("{prefix}{name}");
            out.push(EntryPoint {
                target: Target::Symbol(name.clone()),
                display: name,
                sig: *sig,
                args: *args,
                heap: Heap::Other,
            });
        }
    };
    add("", JEMALLOC);
    for prefix in ["je_", "_rjem_"] {
        add(prefix, JEMALLOC_STANDARD);
        add(prefix, JEMALLOC);
    }
    add("", TCMALLOC);
    add("", MIMALLOC);
    out
}

/// Whether a call of the entry point named `display` must fail by
/// throwing (C++'s throwing `operator new`, and the allocators' own
/// throwing `new`): it is called with a size it refuses, and throws.
pub fn throws(display: &str) -> bool {
    let new = display.starts_with("operator new") || display.starts_with("tc_new") || display.starts_with("mi_new");
    new && !display.contains("nothrow")
}

/// An error in an `--entry` specification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecError {
    pub spec: String,
    pub what: String,
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "entry spec {:?}: {}", self.spec, self.what)
    }
}

impl std::error::Error for SpecError {}

/// Parses a user-named entry point:
///
/// `TARGET:KIND[:FIELD=VALUE[,FIELD=VALUE]...]`
///
/// * `TARGET`: a symbol name as written in the symbol tables (mangled for
///   C++), or a virtual address in the file written `0x...` (for stripped
///   files).
/// * `KIND`: `alloc`, `free` or `realloc`.
/// * fields: `size=argN` or `size=argN*argM` (bytes requested),
///   `ptr=argN` (the pointer released by `free`/`realloc`), `out=argN`
///   (the new object is stored through that argument and a zero return
///   means success, like `posix_memalign`), `size=strlen` (the length of
///   the returned string plus one), `name=LABEL` (display name).
///   Arguments are `arg0`..`arg5` (rdi, rsi, rdx, rcx, r8, r9).
///
/// Defaults: `alloc` reads `size=arg0` and returns the object; `free`
/// releases `ptr=arg0`; `realloc` releases `ptr=arg0` and reads `size=arg1`.
pub fn parse_spec(spec: &str) -> std::result::Result<EntryPoint, SpecError> {
    let err = |what: String| SpecError { spec: spec.to_string(), what };
    let mut parts = spec.splitn(3, ':');
    let target_s = parts.next().unwrap_or("");
    let kind_s = parts.next().ok_or_else(|| err("missing ':KIND' (alloc, free or realloc)".into()))?;
    let fields = parts.next();

    if target_s.is_empty() {
        return Err(err("empty target: give a symbol name or a 0x address".into()));
    }
    let target = if let Some(hex) = target_s.strip_prefix("0x").or_else(|| target_s.strip_prefix("0X")) {
        let addr = u64::from_str_radix(hex, 16).map_err(|_| err(format!("bad address {target_s:?}")))?;
        Target::Address(addr)
    } else {
        if target_s.chars().any(|c| c.is_whitespace() || c == ',' || c == '=') {
            return Err(err(format!("bad symbol name {target_s:?}")));
        }
        Target::Symbol(target_s.to_string())
    };
    let kind = match kind_s {
        "alloc" => Kind::Alloc,
        "free" => Kind::Free,
        "realloc" => Kind::Realloc,
        other => return Err(err(format!("unknown kind {other:?} (alloc, free or realloc)"))),
    };
    let mut sig = match kind {
        Kind::Alloc => Signature::alloc(A0),
        Kind::Free => Signature::free(0),
        Kind::Realloc => Signature::realloc(0, Size::Arg(1)),
    };
    let mut name = None;
    let parse_arg = |s: &str| -> std::result::Result<Arg, SpecError> {
        let n = s
            .strip_prefix("arg")
            .and_then(|d| d.parse::<u8>().ok())
            .filter(|&n| n < REG_ARGS)
            .ok_or_else(|| err(format!("bad argument {s:?} (arg0..arg5)")))?;
        Ok(n)
    };
    for field in fields.into_iter().flat_map(|f| f.split(',')) {
        let (key, value) = field.split_once('=').ok_or_else(|| err(format!("field {field:?} is not KEY=VALUE")))?;
        match key {
            "size" if kind == Kind::Free => return Err(err("a free entry takes no size".into())),
            "size" => {
                sig.size = if value == "strlen" {
                    Size::ResultStrlen
                } else if let Some((a, b)) = value.split_once('*') {
                    Size::Product(parse_arg(a)?, parse_arg(b)?)
                } else {
                    Size::Arg(parse_arg(value)?)
                }
            }
            "ptr" if kind == Kind::Alloc => return Err(err("an alloc entry releases no pointer".into())),
            "ptr" => sig.freed = Some(parse_arg(value)?),
            "out" if kind != Kind::Alloc => return Err(err("out= applies to alloc entries".into())),
            "out" => sig.result = Returns::OutArg(parse_arg(value)?),
            "name" if value.is_empty() => return Err(err("empty name".into())),
            "name" => name = Some(value.to_string()),
            other => return Err(err(format!("unknown field {other:?} (size, ptr, out, name)"))),
        }
    }
    if let (Returns::OutArg(o), Size::ResultStrlen) = (sig.result, sig.size) {
        return Err(err(format!("size=strlen needs a returned string, not out=arg{o}")));
    }
    let display = name.unwrap_or_else(|| target.to_string());
    Ok(EntryPoint { target, display, sig, args: 6, heap: Heap::Other })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_cover_every_operator_variant() {
        let d = defaults();
        let names: Vec<String> = d
            .iter()
            .map(|e| match &e.target {
                Target::Symbol(s) => s.clone(),
                Target::Address(_) => unreachable!(),
            })
            .collect();
        // 14 C functions and 5 internal names, 8 new, 2 * (2*2*2 - 2) = 12
        // delete, then the other allocators' APIs and CPython's.
        assert_eq!(d.len(), 19 + 8 + 12 + allocator_apis().len() + python_api().len());
        assert!(d[..39].iter().all(|e| e.heap == Heap::Malloc));
        assert!(d[39..].iter().all(|e| e.heap == Heap::Other));
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "an entry point is named twice");
        for must in [
            "_Znwm",
            "_ZnamRKSt9nothrow_t",
            "_ZnwmSt11align_val_tRKSt9nothrow_t",
            "_ZdlPvm",
            "_ZdaPvmSt11align_val_t",
            "_ZdlPvSt11align_val_tRKSt9nothrow_t",
            "free_sized",
            "mallocx",
            "_rjem_sdallocx",
            "je_calloc",
            "tc_delete_sized_aligned",
            "mi_heap_realloc",
        ] {
            assert!(names.iter().any(|n| n == must), "{must} missing");
        }
        let new = d.iter().find(|e| e.target == Target::Symbol("_ZnwmSt11align_val_t".into())).unwrap();
        assert_eq!(new.display, "operator new(unsigned long, std::align_val_t)");
    }

    #[test]
    fn allocator_apis_read_their_arguments() {
        let d = defaults();
        let get = |n: &str| d.iter().find(|e| e.target == Target::Symbol(n.into())).unwrap().clone();
        let e = get("sdallocx");
        assert_eq!((e.sig, e.args, e.heap), (Signature::free(0), 3, Heap::Other));
        assert_eq!(get("_rjem_rallocx").sig, Signature::realloc(0, Size::Arg(1)));
        assert_eq!(get("je_posix_memalign").sig.result, Returns::OutArg(0));
        assert_eq!(get("mi_calloc").sig.size, Size::Product(0, 1));
        let e = get("mi_heap_realloc");
        assert_eq!((e.sig.freed, e.sig.size), (Some(1), Size::Arg(2)));
        assert_eq!(get("free_aligned_sized").heap, Heap::Malloc);
        for e in &d {
            assert!(e.sig.args_read().all(|a| a < e.args), "{}: reads past its {} arguments", e.display, e.args);
        }
        let e = get("PyObject_Realloc");
        assert_eq!((e.heap, slot_api("PyObject_Realloc"), slot_api("malloc")), (Heap::Other, true, false));
        assert_eq!(after_context(e.sig), Signature::realloc(1, Size::Arg(2)));
        assert_eq!(after_context(get("PyMem_Calloc").sig).size, Size::Product(1, 2));
        for (name, throws_) in [
            ("operator new(unsigned long)", true),
            ("operator new(unsigned long, std::nothrow_t const&)", false),
            ("mi_new_n", true),
            ("mi_new_aligned_nothrow", false),
            ("tc_newarray", true),
            ("malloc", false),
        ] {
            assert_eq!(throws(name), throws_, "{name}");
        }
    }

    #[test]
    fn spec_defaults_and_fields() {
        let e = parse_spec("xmalloc:alloc").unwrap();
        assert_eq!(e.target, Target::Symbol("xmalloc".into()));
        assert_eq!(e.sig, Signature::alloc(Size::Arg(0)));
        let e = parse_spec("0x401200:alloc:size=arg0*arg1,name=pool_calloc").unwrap();
        assert_eq!(e.target, Target::Address(0x401200));
        assert_eq!(e.sig.size, Size::Product(0, 1));
        assert_eq!(e.display, "pool_calloc");
        let e = parse_spec("xrealloc:realloc:ptr=arg1,size=arg2").unwrap();
        assert_eq!(e.sig.freed, Some(1));
        assert_eq!(e.sig.size, Size::Arg(2));
        let e = parse_spec("my_memalign:alloc:out=arg0,size=arg2").unwrap();
        assert_eq!(e.sig.result, Returns::OutArg(0));
    }

    #[test]
    fn spec_errors_name_the_problem() {
        for (spec, what) in [
            ("xmalloc", "missing"),
            ("xmalloc:grow", "unknown kind"),
            ("xfree:free:size=arg0", "no size"),
            ("x:alloc:size=arg6", "bad argument"),
            ("x:alloc:sz=arg0", "unknown field"),
            ("0xzz:alloc", "bad address"),
            (":alloc", "empty target"),
        ] {
            let e = parse_spec(spec).unwrap_err();
            assert!(e.to_string().contains(what), "{spec}: {e}");
        }
    }
}
