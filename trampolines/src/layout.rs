//! The site table, the module control block and the counters: the layout the
//! patcher writes into a patched module and the runtime and report read.
//!
//! Everything is little-endian, fixed-size and versioned. A reader checks
//! the magic and the version and refuses anything else.
//!
//! ```text
//! .alloctramp.sites (read-only, right after the program header table; see
//!                    [`table_after_phdrs`])
//!   Header            HEADER_SIZE bytes
//!   Site[site_count]  SITE_SIZE bytes each, sorted by address
//!   Entry[entry_count] ENTRY_SIZE bytes each
//!   strings           NUL-terminated UTF-8, referenced by offset
//! .alloctramp.data (read-write, CONTROL_SIZE bytes): the module control block
//! .alloctramp.counters (read-write, no file bytes, page-aligned):
//!   shard_count shards of shard_stride bytes; a shard holds one Cell per site
//! ```

#![deny(clippy::indexing_slicing)]

use crate::entry::{Kind, Signature};
use crate::pod::{self, Pod};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI64, AtomicU64};

/// Magic at the start of a site table.
pub const MAGIC: [u8; 8] = *b"ATRAMP\x00\x01";
/// Version of the site table, control block and counter layout.
pub const VERSION: u32 = 14;

/// Where the site table is: in a patched file, the ELF header and the
/// program header table start the file and a read-only PT_LOAD that maps
/// them at the top of the address space; the site table follows the program
/// headers (8-byte aligned). Given the first bytes of such a segment (the
/// ELF header onwards), returns the table's offset in them.
pub fn table_after_phdrs(segment: &[u8]) -> Option<usize> {
    if segment.get(..4)? != b"\x7fELF" {
        return None;
    }
    let phoff = usize::try_from(pod::read::<u64>(segment, 32)?).ok()?;
    let phnum = usize::from(pod::read::<u16>(segment, 56)?);
    let at = phoff.checked_add(phnum.checked_mul(56)?)?.checked_next_multiple_of(8)?;
    (segment.get(at..at.checked_add(8)?)? == MAGIC).then_some(at)
}

/// The 5 bytes written over a site to send it to `target` (one of its
/// trampoline's entries): `jmp rel32`. `None` when the target is
/// out of rel32 range.
pub fn site_jump(site: u64, target: u64) -> Option<[u8; 5]> {
    let rel = i32::try_from(i128::from(target) - (i128::from(site) + 5)).ok()?;
    let b = rel.to_le_bytes();
    Some([0xe9, b[0], b[1], b[2], b[3]])
}

/// A patched file's *switched images*: beside the file, one directory per
/// image holds, under the file's name, a copy of the file whose patched
/// sites already jump to one of their trampolines' entries. A process
/// switched on at start-up maps the image of its mode over its code
/// instead of writing every site (which copies every page that holds one),
/// after checking that the image belongs to the file (its time, size and
/// site table: `runtime/src/image.rs`). The same name keeps profilers that
/// name code by its file (`perf report`'s DSO column) showing the
/// program's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Image {
    /// Every site jumps to its trampoline's start, which counts and tracks
    /// live bytes ([`IMAGE_DIR`]).
    Live,
    /// Every site jumps to the entry that only counts ([`Site::count`];
    /// [`COUNT_IMAGE_DIR`]).
    Count,
}

/// The directory of the [`Image::Live`] image.
pub const IMAGE_DIR: &str = ".alloctramp-on";
/// The directory of the [`Image::Count`] image.
pub const COUNT_IMAGE_DIR: &str = ".alloctramp-count";

impl Image {
    /// Every image, in the order `alloctramp patch` writes them.
    pub const ALL: [Image; 2] = [Image::Live, Image::Count];

    /// The directory, beside the patched file, that holds it.
    pub fn dir(self) -> &'static str {
        match self {
            Image::Live => IMAGE_DIR,
            Image::Count => COUNT_IMAGE_DIR,
        }
    }

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Image::Live => "live",
            Image::Count => "count",
        }
    }

    /// The bytes it holds at `site`: `jmp` to the site's entry for the
    /// image, or `None` for a site without a trampoline (or too short to
    /// hold a jump), which keeps its original bytes.
    pub fn site(self, site: &Site) -> Option<[u8; 5]> {
        if site.trampoline == 0 || site.len < 5 {
            return None;
        }
        let entry = match self {
            Image::Live => 0,
            Image::Count => site.count,
        };
        site_jump(site.addr, site.entry_at(entry))
    }
}

/// Section names.
pub const SEC_TEXT: &str = ".alloctramp.text";
pub const SEC_SITES: &str = ".alloctramp.sites";
pub const SEC_DATA: &str = ".alloctramp.data";
pub const SEC_COUNTERS: &str = ".alloctramp.counters";
/// The trampolines' unwind entries (the new `.eh_frame_hdr` follows them).
pub const SEC_EH_FRAME: &str = ".alloctramp.eh_frame";
/// The sections a patched file adds, in the order of their headers (the
/// last only when the file has unwind entries for its trampolines).
pub const NEW_SECTIONS: [&str; 5] = [SEC_SITES, SEC_DATA, SEC_COUNTERS, SEC_TEXT, SEC_EH_FRAME];

/// Name of the data symbol the runtime exports and every patched module
/// imports (through a GOT slot in its control block).
pub const RUNTIME_SYMBOL: &str = "alloctramp_runtime_v1";
/// The runtime's SONAME.
pub const RUNTIME_SONAME: &str = "liballoctramp_rt.so";

/// The C library a patched module needs (`DT_NEEDED`, added where it has
/// none): its init stub calls `dlopen`, which needs the C library
/// initialized first, and the dynamic linker initializes a module after
/// the ones it needs.
pub const LIBC_SONAME: &str = "libc.so.6";

/// A symbol every patched module imports into a slot of its control block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Import {
    pub name: &'static str,
    /// The slot: a field of [`ControlBlock`] (see [`control`]).
    pub slot: u32,
    /// A function (`STT_FUNC`), else data (`STT_OBJECT`).
    pub function: bool,
}

/// The symbols a patched module imports, in their order in its new
/// `.dynsym`, all weak: a module whose runtime is not loaded yet (the
/// patched file does not name it in `DT_NEEDED`) finds `runtime` 0, and its
/// init stub loads the runtime with `dlopen` and finds the table with
/// `dlsym`; without them, or when the runtime cannot be loaded, the module
/// runs unprofiled.
pub const IMPORTS: [Import; 4] = [
    Import { name: RUNTIME_SYMBOL, slot: control::RUNTIME, function: false },
    Import { name: "dlopen", slot: control::DLOPEN, function: true },
    Import { name: "dlsym", slot: control::DLSYM, function: true },
    Import { name: "dlerror", slot: control::DLERROR, function: true },
];

pub const PAGE: u64 = 4096;

/// Fields of a counter cell by byte offset (see [`Cell`]), for the code
/// generator and the runtime's atomic additions.
pub mod cell {
    use super::Cell;
    use std::mem::offset_of;
    pub const CALLS: u32 = offset_of!(Cell, calls) as u32;
    pub const BYTES: u32 = offset_of!(Cell, bytes) as u32;
    pub const FAILED: u32 = offset_of!(Cell, failed) as u32;
    pub const FREED_OBJECTS: u32 = offset_of!(Cell, freed_objects) as u32;
    pub const FREED_BYTES: u32 = offset_of!(Cell, freed_bytes) as u32;
    pub const UNTRACKED_FREES: u32 = offset_of!(Cell, untracked_frees) as u32;
    pub const FAILED_BYTES: u32 = offset_of!(Cell, failed_bytes) as u32;
    pub const INJECTED: u32 = offset_of!(Cell, injected) as u32;
}

/// A thread's shard word, which selects the counter shard its trampolines
/// add to: shard `s` of a module's counters is at `counters + s *
/// shard_stride`, and the freed view's at `freed + s * FREED_SHARD_BYTES`.
///
/// A thread that owns a shard (no other thread adds to it while it lives)
/// adds with plain `add` instructions, which a signal handler on the same
/// thread cannot split; every other thread shares shard 0 and adds with
/// `lock add`. The trampolines tell the two apart without a compare: they
/// multiply the word by the shard stride (`imul`), which overflows exactly
/// for an owned shard's word ([`EXCLUSIVE`] is set) and leaves the shard's
/// offset (the stride is even, so the top bit drops out of the product).
/// The owner's index is in the low bits: a shift by
/// `FREED_SHARD_SHIFT` gives the freed view's offset the same way.
pub mod shard {
    /// The shards of every patched module's counters: shard 0, which
    /// threads share, and one for each of `COUNT - 1` threads at a time.
    pub const COUNT: u32 = 16;
    /// The word of a thread that owns shard `s`: `EXCLUSIVE | s` (`s` >= 1).
    pub const EXCLUSIVE: u64 = 1 << 63;
    /// The word of a thread that shares shard 0 (every shard is owned, or
    /// the thread is exiting).
    pub const SHARED: u64 = 1;
    /// The word of a thread the runtime has not given a shard yet (static
    /// TLS starts zeroed): each of its counted calls calls the control
    /// block's `assign`, then adds to shard 0 with `lock`. `assign` writes
    /// one of the others at the thread's call after its first
    /// [`PROBATION`].
    pub const UNASSIGNED: u64 = 0;
    /// Calls of `assign` a thread makes, counting in shard 0, before the
    /// runtime gives it a shard of its own (one per counted call; an entry
    /// that counts before and after its call makes two): a thread that
    /// allocates little never costs the process a shard's storage.
    pub const PROBATION: u32 = 1024;

    /// The shard a word selects.
    pub fn index(word: u64, shards: u32) -> u32 {
        if word & EXCLUSIVE != 0 { (word & u64::from(shards.saturating_sub(1))) as u32 } else { 0 }
    }
}

/// Fields of the module control block by byte offset (see
/// [`ControlBlock`]), for the code generator and the patcher.
pub mod control {
    use super::ControlBlock;
    use std::mem::offset_of;
    pub const RUNTIME: u32 = offset_of!(ControlBlock, runtime) as u32;
    pub const DLOPEN: u32 = offset_of!(ControlBlock, dlopen) as u32;
    pub const DLSYM: u32 = offset_of!(ControlBlock, dlsym) as u32;
    pub const DLERROR: u32 = offset_of!(ControlBlock, dlerror) as u32;
    pub const SHARD_TLS: u32 = offset_of!(ControlBlock, shard_tls) as u32;
    pub const ASSIGN: u32 = offset_of!(ControlBlock, assign) as u32;
    pub const COUNTERS: u32 = offset_of!(ControlBlock, counters) as u32;
    pub const MODULE_ID: u32 = offset_of!(ControlBlock, module_id) as u32;
    pub const TRACK_ALLOC: u32 = offset_of!(ControlBlock, track_alloc) as u32;
    pub const TRACK_FREE: u32 = offset_of!(ControlBlock, track_free) as u32;
    pub const TRACK_REALLOC_BEGIN: u32 = offset_of!(ControlBlock, track_realloc_begin) as u32;
    pub const TRACK_REALLOC_END: u32 = offset_of!(ControlBlock, track_realloc_end) as u32;
    pub const SHADOW: u32 = offset_of!(ControlBlock, shadow) as u32;
    pub const FREED: u32 = offset_of!(ControlBlock, freed) as u32;
    pub const SHADOW_GRANULES: u32 = offset_of!(ControlBlock, shadow_granules) as u32;
    pub const SHADOW_MASK: u32 = offset_of!(ControlBlock, shadow_mask) as u32;
    pub const INLINE_LIMIT: u32 = offset_of!(ControlBlock, inline_limit) as u32;
    pub const ENTRY_BASE: u32 = offset_of!(ControlBlock, entry_base) as u32;
    pub const CAS_LIMIT: u32 = offset_of!(ControlBlock, cas_limit) as u32;
    pub const DEPTH_TLS: u32 = offset_of!(ControlBlock, depth_tls) as u32;
    pub const CHARGE_TLS: u32 = offset_of!(ControlBlock, charge_tls) as u32;
    pub const CAPTURE: u32 = offset_of!(ControlBlock, capture) as u32;
    pub const PERSONALITY: u32 = offset_of!(ControlBlock, personality) as u32;
    pub const TRACE_TLS: u32 = offset_of!(ControlBlock, trace_tls) as u32;
    pub const TRACE_RECORD: u32 = offset_of!(ControlBlock, trace_record) as u32;
    pub const TRACE_BASE: u32 = offset_of!(ControlBlock, trace_base) as u32;
    pub const TRACE_INLINE_LIMIT: u32 = offset_of!(ControlBlock, trace_inline_limit) as u32;
    pub const TRACE_CAS_LIMIT: u32 = offset_of!(ControlBlock, trace_cas_limit) as u32;
    pub const TRACE_SHADOW_MASK: u32 = offset_of!(ControlBlock, trace_shadow_mask) as u32;
}

/// The instruction with which a trampoline's charge check reads the word
/// below the active hook's stack pointer: `mov r10, [r10 - 8]`. The word
/// lies on the stack the hook's call was made on; a program that switches
/// stacks (fibers, coroutines) may have unmapped that stack since. The
/// runtime's fault handler recognises this instruction in a module's
/// trampolines and completes it with r10 = 0 (never a return address), so
/// the check finds the charge stale and clears it.
pub const CHECK_LOAD: [u8; 4] = [0x4d, 0x8b, 0x52, 0xf8];

/// What an exception or a forced unwind (thread cancellation) that passes
/// a trampoline's call undoes of what the trampoline did before the call,
/// as the code after the call would have. A trampoline's unwind entry
/// names the runtime's personality routine (through the control block's
/// `personality`) and an LSDA of this form: an [`UndoHeader`], then
/// `count` [`UndoCall`]s, one per call of the site's target that has
/// something to undo.
pub mod undo {
    /// The call counted as failed (as a NULL result would), into the
    /// site's cell in the current CPU's shard, or with [`CHARGED`] into the
    /// active hook's cell.
    pub const FAILED: u8 = 1;
    /// With [`FAILED`], on the live path: its requested bytes are failed
    /// bytes too; the size is the word at `size_at` from the stack pointer
    /// at the call (the CFA of the called function).
    pub const LIVE_SIZE: u8 = 2;
    /// The size is the product of that word and the next.
    pub const LIVE_PRODUCT: u8 = 4;
    /// The thread's wrapper depth goes down by one.
    pub const DEPTH: u8 = 8;
    /// The thread's charge is cleared (the hook's call took it).
    pub const HOOK: u8 = 16;
    /// The failure counts into the active hook's cell.
    pub const CHARGED: u8 = 32;

    /// The start of a trampoline's LSDA.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct UndoHeader {
        /// The module's control block, relative to this field.
        pub control: i32,
        /// The site's index (its cell).
        pub index: u32,
        pub count: u32,
    }

    /// One call of a trampoline and what to undo when an unwind passes it.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct UndoCall {
        /// The call's return address, from the trampoline's start.
        pub ret: u32,
        pub what: u8,
        pub pad: u8,
        /// Where the size is, from the stack pointer at the call.
        pub size_at: i16,
    }
}

/// The shadow map: one 32-bit entry per 32-byte granule of the address
/// space below 2^47 (a reservation the runtime makes, materialised only
/// where objects are), naming the allocating site and the size of the
/// object that starts in the granule. The trampolines write and clear
/// entries inline; the runtime keeps objects an entry cannot describe in
/// its pointer table (see the runtime's `live` module). An entry is the
/// low 32 bits of the object's address XOR this word:
///
/// | bits | |
/// |---|---|
/// | 0-1 | zero |
/// | 2 | [`LIVE`](shadow::LIVE): the object is tracked; clear on a freed object's entry |
/// | 3-4 | zero |
/// | 5-21 | the allocating site's id ([`ID_BITS`](shadow::ID_BITS) bits) |
/// | 22-31 | the requested size (below [`SIZE_LIMIT`](shadow::SIZE_LIMIT)), or 0 for a wide record |
///
/// so an entry decoded with the address of its object has bits 0-4 equal
/// to 00100, and decoded with any other 8-aligned address of the granule
/// it has not.
///
/// A **wide record** describes an object of [`SIZE_LIMIT`](shadow::SIZE_LIMIT)
/// bytes or more (below [`WIDE_LIMIT`](shadow::WIDE_LIMIT)): its entry has
/// size 0 and the entry of the next granule, which lies inside the object
/// (so no other live object starts there), holds its size as an
/// [extension](shadow::ext): `size << 3 | 0b111`. An extension's bit 2 is
/// set, so an allocation that lands on its granule takes the runtime's
/// path (the object it belonged to was freed unseen); its bit 1 tells it
/// from a record (bits 0-2 of a live record are 100, of a freed one 000).
/// A free clears bits 1 and 2 (leaving 001, which is neither a record nor
/// an extension) or the whole entry; an entry of size 0 whose next
/// granule holds no extension is an object of 0 bytes.
///
/// A site's id indexes the freed view: [`FREED_SHARDS`](shadow::FREED_SHARDS)
/// shards of [`FREED_SHARD_BYTES`](shadow::FREED_SHARD_BYTES), where the
/// runtime maps each module's counters again so that the cell of id `i` in
/// shard `s` is at `freed + s * FREED_SHARD_BYTES + i * 64`.
pub mod shadow {
    /// log2 of the bytes per entry's granule.
    pub const GRANULE_SHIFT: u32 = 5;
    /// Granules covered at most: addresses below 2^47 (less where the
    /// address space does not leave room for the reservation, as under
    /// valgrind: see `shadow_granules` in the control block).
    pub const GRANULES: u64 = 1 << (ADDRESS_BITS - GRANULE_SHIFT);
    /// The user address space of 4-level paging.
    pub const ADDRESS_BITS: u32 = 47;
    pub const LIVE: u32 = 4;
    /// Bits of a decoded entry that say whose record it is.
    pub const MATCH: u32 = 0x1f;
    pub const ID_SHIFT: u32 = 5;
    pub const ID_BITS: u32 = 17;
    /// Ids 0 to 63 are never given: an entry with id 0 is never a record.
    pub const FIRST_ID: u32 = 64;
    pub const ID_MASK: u32 = ((1 << ID_BITS) - 1) << ID_SHIFT;
    pub const SIZE_SHIFT: u32 = 22;
    /// Objects of this size or more take a wide record.
    pub const SIZE_LIMIT: u64 = 1 << (32 - SIZE_SHIFT);
    /// Objects of this size or more go to the pointer table.
    pub const WIDE_LIMIT: u64 = 1 << (32 - EXT_SHIFT);
    /// The low bits of an extension (see [`ext`]); a free clears bits 1
    /// and 2.
    pub const EXT_TAG: u32 = 0b111;
    /// The bit set in an extension and clear in every record.
    pub const EXT_BIT: u32 = 0b010;
    pub const EXT_SHIFT: u32 = 3;
    pub const FREED_SHARDS: u32 = 16;
    /// log2 of [`FREED_SHARD_BYTES`].
    pub const FREED_SHARD_SHIFT: u32 = ID_BITS + 6;
    pub const FREED_SHARD_BYTES: u64 = 1 << FREED_SHARD_SHIFT;

    /// The entry of an object of `size` bytes at `ptr` from site `id`.
    pub fn entry(ptr: u64, id: u32, size: u64) -> u32 {
        ((size as u32) << SIZE_SHIFT | id << ID_SHIFT | LIVE) ^ ptr as u32
    }
    /// Whether `entry` is the record of a tracked object at `ptr`. Only
    /// 8-aligned objects have records: a pointer 4 past one (which a pool
    /// allocator may return) would otherwise match an empty granule's
    /// entry, or a freed record at the granule's start.
    pub fn is_record_of(entry: u32, ptr: u64) -> bool {
        ptr & 7 == 0 && (entry ^ (ptr as u32).wrapping_add(LIVE)) & MATCH == 0
    }
    /// Whether `entry` is what a free of the object at `ptr` left.
    pub fn is_freed_record_of(entry: u32, ptr: u64) -> bool {
        ptr & 7 == 0 && entry != 0 && (entry ^ ptr as u32) & MATCH == 0 && id(entry, ptr) != 0
    }
    /// Whether `entry` records a live object (at some address).
    pub fn is_live(entry: u32) -> bool {
        entry & LIVE != 0
    }
    /// The site id of `entry`, decoded with its object's address.
    pub fn id(entry: u32, ptr: u64) -> u32 {
        ((entry ^ ptr as u32) & ID_MASK) >> ID_SHIFT
    }
    /// The size of `entry`, decoded with its object's address (0 for a
    /// wide record).
    pub fn size(entry: u32, ptr: u64) -> u64 {
        u64::from((entry ^ ptr as u32) >> SIZE_SHIFT)
    }
    /// The extension of a wide record of `size` bytes (below
    /// [`WIDE_LIMIT`]), in the entry of the granule after the record's.
    pub fn ext(size: u64) -> u32 {
        (size as u32) << EXT_SHIFT | EXT_TAG
    }
    /// Whether `entry` is an extension (of the record of the granule
    /// before).
    pub fn is_ext(entry: u32) -> bool {
        entry & EXT_BIT != 0
    }
    /// The size an extension holds.
    pub fn ext_size(entry: u32) -> u64 {
        u64::from(entry >> EXT_SHIFT)
    }
    /// The address of the object whose live record `entry` (in granule
    /// `granule`) is, if it is one.
    pub fn live_record_at(entry: u32, granule: u64) -> Option<u64> {
        (entry & 7 == LIVE).then(|| granule << GRANULE_SHIFT | u64::from(entry & 0x18))
    }
}

/// Flags in the header.
pub mod flags {
    /// Trampolines keep every register but rax (sites call functions
    /// defined in the module, whose callers may rely on fewer clobbers).
    pub const PRESERVE_DIRECT: u32 = 1;
    /// The module is a program whose own start-up installs a SIGSEGV
    /// handler only where it finds the default disposition (Rust's
    /// standard library, before `main`): the runtime does not install its
    /// fault handler while the disposition is the default, so that the
    /// program's start-up finds what it would have found; a switch after
    /// that (the program's handler in place) installs it, chaining.
    pub const DEFAULT_SEGV_AT_START: u32 = 2;
}

/// Flags of a site.
pub mod site_flags {
    /// The site calls a function whose allocations its callers take (a
    /// hook): its cell counts what the sites inside the function allocate
    /// during its calls, and the site counts nothing of its own.
    pub const HOOK: u8 = 1;
    /// The site is inside such a function: during a hook's call it counts
    /// into the hook's cell (and records no call chain of its own).
    pub const UNDER_HOOK: u8 = 2;
    /// The site is inside an allocation wrapper charged to its callers,
    /// and counts only when the thread's wrapper depth is 0 (and records
    /// no call chain otherwise).
    pub const DEPTH_CHECK: u8 = 4;
    /// The site calls such a wrapper: its trampoline raises the thread's
    /// wrapper depth for the call (fault injection fails the wrapper's own
    /// allocation then, not the call).
    pub const DEPTH_BUMP: u8 = 8;
}

/// How a site's instruction reaches its entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SiteForm {
    CallRel32 = 0,
    JmpRel32 = 1,
    CallRipMem = 2,
    JmpRipMem = 3,
}

impl SiteForm {
    pub fn from_code(c: u8) -> Option<SiteForm> {
        Some(match c {
            0 => SiteForm::CallRel32,
            1 => SiteForm::JmpRel32,
            2 => SiteForm::CallRipMem,
            3 => SiteForm::JmpRipMem,
            _ => return None,
        })
    }
    pub fn is_tail(self) -> bool {
        matches!(self, SiteForm::JmpRel32 | SiteForm::JmpRipMem)
    }
    pub fn through_got(self) -> bool {
        matches!(self, SiteForm::CallRipMem | SiteForm::JmpRipMem)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            SiteForm::CallRel32 => "call rel32",
            SiteForm::JmpRel32 => "jmp rel32",
            SiteForm::CallRipMem => "call [rip+disp]",
            SiteForm::JmpRipMem => "jmp [rip+disp]",
        }
    }
}

/// The site table header. Addresses are virtual addresses as in the ELF
/// file; add the module's load bias for run-time addresses. [`encode`]
/// fills in the magic, version, sizes, counts and offsets.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Header {
    pub magic: [u8; 8],
    pub version: u32,
    pub header_size: u32,
    /// [`flags`].
    pub flags: u32,
    pub site_count: u32,
    pub entry_count: u32,
    /// Counter shards (a power of two).
    pub shard_count: u32,
    /// Bytes per shard: site count x [`CELL_SIZE`], page-aligned.
    pub shard_stride: u64,
    /// Address of the site table itself (to compute the load bias).
    pub table_addr: u64,
    pub control_addr: u64,
    pub counters_addr: u64,
    /// shard_count x shard_stride.
    pub counters_size: u64,
    /// The trampolines.
    pub text_addr: u64,
    pub text_size: u64,
    /// Byte offsets of the arrays from the table's start.
    pub sites_offset: u32,
    pub entries_offset: u32,
    pub strings_offset: u32,
    pub strings_size: u32,
    /// String offset of the module name.
    pub module_name: u32,
    /// Bytes of `build_id` used (at most 20).
    pub build_id_len: u32,
    /// The original file's build-id, zero-padded.
    pub build_id: [u8; 20],
    /// Libraries whose unwind rows the module carries (see
    /// [`ForeignUnwind`]): a directory of that many entries after the
    /// module's own rows and their block index (8-aligned). 0 in a module
    /// without rows of its own.
    pub foreign_count: u32,
    /// Address of the ELF header (and program headers) in memory.
    pub ehdr_addr: u64,
    /// The module's unwind rows ([`UnwindRow`], sorted by address), after
    /// the table's strings (not part of the table's size: a copy of the
    /// table leaves them out); 0 and 0 when the module has none. The rows
    /// are followed by `unwind_blocks` u32s: for each [`UNWIND_BLOCK`]-byte
    /// block of code from the first row's address, the index of the row in
    /// effect at the block's start (a lookup scans from there).
    pub unwind_addr: u64,
    pub unwind_count: u32,
    pub unwind_blocks: u32,
}

/// Unwind rows a module carries for a library it needs, so that a chain
/// that reaches the library's code (unpatched) goes on through it. The
/// runtime uses them for the loaded module with the same build-id.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ForeignUnwind {
    pub build_id: [u8; 20],
    pub build_id_len: u8,
    pub reserved: [u8; 3],
    /// Byte offset of the library's rows from the directory's start
    /// (4-aligned); the rows' addresses are the library's.
    pub rows_offset: u32,
    pub count: u32,
    /// Entries of the rows' block index, which follows them.
    pub blocks: u32,
    /// String offset of the library's path when the module was patched.
    pub name: u32,
}

/// A library's unwind rows, to be carried by a module (see [`ForeignUnwind`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ForeignRows {
    pub build_id: Vec<u8>,
    pub path: String,
    pub rows: Vec<UnwindRow>,
}

/// One site.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Site {
    pub addr: u64,
    /// Its trampoline; 0: not patched, reported only.
    pub trampoline: u64,
    /// The instruction's original bytes (first `len`).
    pub original: [u8; 8],
    pub len: u8,
    /// [`SiteForm`] code.
    pub form: u8,
    /// Index of its entry point.
    pub entry: u16,
    /// String offsets ([`NO_STRING`]: unknown) and line (0: unknown).
    pub function: u32,
    pub file: u32,
    pub line: u32,
    /// Free sites: offset in the trampoline of its entry that tracks the
    /// free without counting it (used while live figures drain after
    /// profiling is off); 0 otherwise.
    pub drain: u16,
    /// Offset in the trampoline of its entry that counts without live
    /// tracking (the trampoline's start counts and tracks).
    pub count: u16,
    /// Offset in the trampoline of its entry that first records the call
    /// chain (callers capture), then continues at the start or the count
    /// entry; 0: none.
    pub callers: u16,
    /// [`site_flags`].
    pub flags: u8,
    pub reserved: [u8; 1],
    /// Offset in the trampoline of its entry that counts, tracks and
    /// records each event in the thread's trace ring itself while a trace
    /// of every site is on (see [`ControlBlock::trace_base`]); 0: none
    /// (the start entry's runtime calls record the events).
    pub traced: u16,
    pub reserved_tail: [u8; 6],
}

impl Site {
    /// Address of the trampoline entry at `offset`.
    pub fn entry_at(&self, offset: u16) -> u64 {
        self.trampoline.wrapping_add(u64::from(offset))
    }
}

/// One entry point.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Entry {
    /// String offset of the display name.
    pub name: u32,
    /// [`Kind`] code.
    pub kind: u8,
    /// Encoded [`Signature`] (see [`encode_sig`]).
    pub sig: [u8; 6],
    /// [`entry_flags`].
    pub flags: u8,
    pub reserved: [u8; 4],
}

/// Bits of [`Entry::flags`].
pub mod entry_flags {
    /// An allocation wrapper the patcher found, whose callers' sites count
    /// what it allocates (not an allocator itself): fault injection fails
    /// its allocation, not its call.
    pub const WRAPPER: u8 = 1;
}

/// The module control block (`.alloctramp.data`): written by the dynamic
/// linker (its first word) and the runtime, read by the trampolines. The
/// patcher writes zeros.
#[repr(C)]
#[derive(Debug, Default)]
pub struct ControlBlock {
    /// GOT slot the dynamic linker fills with the runtime's API table (a
    /// weak import: 0 when no module loaded before exports it; the init
    /// stub then writes what `dlsym` finds after loading the runtime).
    pub runtime: AtomicU64,
    /// Offset from the thread pointer (fs) of the runtime's per-thread
    /// shard word (see [`shard`]), which selects the counter shard the
    /// thread adds to. Written at registration, before any site is
    /// switched.
    pub shard_tls: AtomicI64,
    /// Run-time address of shard 0 of the counters.
    pub counters: AtomicU64,
    /// Module state owned by the runtime.
    pub state: AtomicU64,
    /// The module's identity in the runtime's pointer table (slot and
    /// generation), written by the runtime at registration.
    pub module_id: AtomicU64,
    /// Live-tracking functions the trampolines call; zero while live
    /// tracking is off (the trampolines then only count).
    /// `extern "C" fn(ptr, size, site, control) -> ptr`: an allocation succeeded.
    pub track_alloc: AtomicU64,
    /// `extern "C" fn(ptr, site, control) -> ptr`: a pointer is about to be freed.
    pub track_free: AtomicU64,
    /// `extern "C" fn(old, token, site, control) -> old`: a realloc is about
    /// to run; the old pointer leaves the table into a 16-byte token.
    pub track_realloc_begin: AtomicU64,
    /// `extern "C" fn(result, token, size, site, control) -> result`: the
    /// realloc returned.
    pub track_realloc_end: AtomicU64,
    /// Run-time address of the shadow map (see [`shadow`]). Written with
    /// the live-tracking functions.
    pub shadow: AtomicU64,
    /// Run-time address of the freed view (see [`shadow`]).
    pub freed: AtomicU64,
    /// Offset from the thread pointer (fs) of the runtime's per-thread
    /// wrapper depth: how many calls to allocation wrappers, counted at
    /// their callers' sites, the thread is inside. Written at
    /// registration, before any site is switched.
    pub depth_tls: AtomicI64,
    /// `extern "C" fn(frame, control, rbp, table)`: records the call chain of a
    /// site whose callers are captured (see [`capture`]); the module's
    /// capture stub calls it. Written at registration.
    pub capture: AtomicU64,
    /// Offset from the thread pointer (fs) of the runtime's per-thread
    /// charge: five words, the counter cell of the outermost active hook
    /// site (a call to a function whose allocations its callers take), the
    /// stack pointer at that site (0: none), its call's return address, and
    /// the chain slot callers capture recorded for the call with the hook
    /// stack pointer it belongs to.
    /// A site inside such a function counts into the hook's cell while the
    /// stack pointer is below the hook's and the word below the hook's
    /// still holds the return address. Written at registration, before any
    /// site is switched.
    pub charge_tls: AtomicI64,
    /// The runtime's personality routine (see [`undo`]), which the
    /// trampolines' unwind entries name through this slot. Written at
    /// registration, before any site is switched.
    pub personality: AtomicU64,
    /// Granules the shadow map covers (at most [`shadow::GRANULES`]): an
    /// object at or above is tracked by the runtime.
    pub shadow_granules: AtomicU64,
    /// `granules * 32 - 32`: a free's address AND this, shifted right by
    /// 3, is its entry's offset in the map.
    pub shadow_mask: AtomicU64,
    /// Allocations below this size are recorded inline with a plain store:
    /// [`shadow::SIZE_LIMIT`] once the module has site ids and the
    /// process's malloc is glibc's (never two live objects in a granule),
    /// else 0.
    pub inline_limit: AtomicU64,
    /// `id << ID_SHIFT | LIVE` of the module's site 0 (0: no ids): site
    /// `i`'s entries add `i << ID_SHIFT` and the object's size and address
    /// bits.
    pub entry_base: AtomicU64,
    /// Allocations below this size that `inline_limit` does not take are
    /// recorded inline by compare-and-swap (the process's malloc is
    /// another allocator's, which may start several live objects in a
    /// granule, or the site's allocator is one the user named):
    /// [`shadow::SIZE_LIMIT`] once the module has site ids, else 0. Larger
    /// ones are recorded by the runtime.
    pub cas_limit: AtomicU64,
    /// GOT slots the dynamic linker fills with the C library's `dlopen`,
    /// `dlsym` and `dlerror` (weak: 0 where they are not found), which the
    /// init stub uses to load the runtime when `runtime` is 0.
    pub dlopen: AtomicU64,
    pub dlsym: AtomicU64,
    pub dlerror: AtomicU64,
    /// The runtime's shard assignment routine (see [`shard`]), called by a
    /// trampoline whose thread has no shard word yet; it keeps every
    /// register. Written at registration, before any site is switched.
    pub assign: AtomicU64,
    /// Offset from the thread pointer (fs) of the runtime's per-thread
    /// trace words: the thread's ring header, its window's next record and
    /// end, and the recording flag (see [`trace`](crate::trace)). Written
    /// at registration, before any site is switched.
    pub trace_tls: AtomicI64,
    /// `extern "C" fn(word, ptr, size) -> ptr`: records an event whose
    /// record word ([`Record::word`](crate::trace::Record) with CPU 0) is
    /// `word`, for a traced entry whose thread's window is used up or that
    /// interrupted the recording of another event. Written at registration.
    pub trace_record: AtomicU64,
    /// While every event of the module is recorded (a trace without a site
    /// filter): the record word's site field of the module's site 0
    /// (`first id << 15`), which a traced entry adds its index to.
    pub trace_base: AtomicU64,
    /// While every event is recorded: `inline_limit`, `cas_limit` and
    /// `shadow_mask` as they are without a trace, for the traced entries'
    /// inline paths (the trace zeroes those three, sending the other
    /// entries to the runtime). Zero otherwise: the traced entries then
    /// leave every record to the runtime too.
    pub trace_inline_limit: AtomicU64,
    pub trace_cas_limit: AtomicU64,
    pub trace_shadow_mask: AtomicU64,
}

/// The counters of one site in one shard (every field wraps; a reader sums
/// the shards), or their sum over the shards.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cell {
    /// Calls through the site (allocation, free or realloc).
    pub calls: u64,
    /// Bytes requested (counted before the call, failed calls included).
    pub bytes: u64,
    /// Calls that returned NULL (or a non-zero error).
    pub failed: u64,
    /// Objects allocated here and freed since (live tracking).
    pub freed_objects: u64,
    /// Requested bytes of those objects.
    pub freed_bytes: u64,
    /// Frees through this site of memory the runtime did not track.
    pub untracked_frees: u64,
    /// Calls failed by fault injection (`alloctramp fail`): the allocator
    /// was not called, so they are in none of the other figures.
    pub injected: u64,
    /// Requested bytes of the failed calls, counted while live tracking is
    /// on (live bytes are bytes - failed_bytes - freed_bytes).
    pub failed_bytes: u64,
}

impl Cell {
    /// Adds another shard's cell (wrapping).
    pub fn add(&mut self, o: &Cell) {
        self.calls = self.calls.wrapping_add(o.calls);
        self.bytes = self.bytes.wrapping_add(o.bytes);
        self.failed = self.failed.wrapping_add(o.failed);
        self.freed_objects = self.freed_objects.wrapping_add(o.freed_objects);
        self.freed_bytes = self.freed_bytes.wrapping_add(o.freed_bytes);
        self.untracked_frees = self.untracked_frees.wrapping_add(o.untracked_frees);
        self.injected = self.injected.wrapping_add(o.injected);
        self.failed_bytes = self.failed_bytes.wrapping_add(o.failed_bytes);
    }
    /// Objects allocated here and not freed yet (live tracking; an
    /// allocation site). Never negative: a reading taken while a free is
    /// half-counted is clamped at zero.
    pub fn live_objects(&self) -> u64 {
        non_negative(self.calls.wrapping_sub(self.failed).wrapping_sub(self.freed_objects))
    }
    /// Their requested bytes.
    pub fn live_bytes(&self) -> u64 {
        non_negative(self.bytes.wrapping_sub(self.failed_bytes).wrapping_sub(self.freed_bytes))
    }
}

/// A difference of counters read at slightly different moments: 0 where
/// it went below zero.
fn non_negative(v: u64) -> u64 {
    if (v as i64) < 0 { 0 } else { v }
}

// SAFETY: each is #[repr(C)], made of integers, integer atomics and arrays
// of them with every padding byte declared, and valid for any bits.
unsafe impl Pod for Header {}
// SAFETY: as above.
unsafe impl Pod for Site {}
// SAFETY: as above.
unsafe impl Pod for Entry {}
// SAFETY: as above.
unsafe impl Pod for ControlBlock {}
// SAFETY: as above.
unsafe impl Pod for Cell {}
// SAFETY: as above.
unsafe impl Pod for UnwindRow {}
// SAFETY: repr(C) integers and byte arrays, no padding (size asserted).
unsafe impl Pod for ForeignUnwind {}
// SAFETY: repr(C) integers, no padding (sizes asserted below).
unsafe impl Pod for undo::UndoHeader {}
// SAFETY: as above.
unsafe impl Pod for undo::UndoCall {}
const _: () = assert!(size_of::<undo::UndoHeader>() == 12 && size_of::<undo::UndoCall>() == 8);

/// One row of a module's unwind table, built from `.eh_frame` at patch
/// time (as objtool builds ORC tables for the kernel): from `addr` (a file
/// address, up to the next row's) the caller's frame is found without
/// interpreting DWARF. The return address is always at CFA - 8.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct UnwindRow {
    pub addr: u32,
    /// The CFA is `base + cfa_offset`, `base` given by [`unwind`] kind.
    pub cfa_offset: i16,
    /// Where the caller's rbp was saved (CFA + `rbp_offset`), if `rbp_saved`.
    pub rbp_offset: i16,
    /// [`unwind::STOP`], [`unwind::RSP`] or [`unwind::RBP`].
    pub kind: u8,
    pub rbp_saved: u8,
    pub reserved: [u8; 2],
}

/// [`UnwindRow::kind`].
pub mod unwind {
    /// No frame can be found here (no CFI, or a rule the table cannot
    /// express): a chain ends.
    pub const STOP: u8 = 0;
    /// CFA = rsp + offset.
    pub const RSP: u8 = 1;
    /// CFA = rbp + offset.
    pub const RBP: u8 = 2;
}

/// Callers capture: a trampoline's callers entry pushes the site's index
/// and jumps to the module's capture stub, which saves the registers a
/// call may clobber into a [`capture::Frame`] and calls the runtime's
/// [`ControlBlock::capture`]; the runtime records the chain and writes in
/// `Frame::index` the entry to continue at.
pub mod capture {
    /// What the capture stub saved, lowest address first; the site's stack
    /// pointer is the address just past `index`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct Frame {
        pub r11: u64,
        pub r10: u64,
        pub r9: u64,
        pub r8: u64,
        pub rdi: u64,
        pub rsi: u64,
        pub rdx: u64,
        pub rcx: u64,
        pub rax: u64,
        /// The site's index on entry; the address to continue at on return.
        pub index: u64,
    }
    /// Deepest chain recorded (frames above the site).
    pub const MAX_DEPTH: usize = 8;
    /// Default depth.
    pub const DEFAULT_DEPTH: usize = 4;
}

pub const HEADER_SIZE: usize = size_of::<Header>();
pub const SITE_SIZE: usize = size_of::<Site>();
pub const ENTRY_SIZE: usize = size_of::<Entry>();
pub const CONTROL_SIZE: usize = size_of::<ControlBlock>();
pub const CELL_SIZE: usize = size_of::<Cell>();
pub const UNWIND_ROW_SIZE: usize = 12;
/// Bytes of code per entry of the unwind rows' block index.
pub const UNWIND_BLOCK: u64 = 64;

/// The block index of sorted unwind rows (see [`Header::unwind_blocks`]):
/// one entry per block from the first row's address up to the last's.
pub fn unwind_block_index(rows: &[UnwindRow]) -> Vec<u32> {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else { return Vec::new() };
    let blocks = (u64::from(last.addr - first.addr) / UNWIND_BLOCK + 1) as usize;
    let mut out = Vec::with_capacity(blocks);
    let mut i = 0usize;
    for b in 0..blocks as u64 {
        let start = u64::from(first.addr) + b * UNWIND_BLOCK;
        while rows.get(i + 1).is_some_and(|r| u64::from(r.addr) <= start) {
            i += 1;
        }
        out.push(i as u32);
    }
    out
}

const _: () = {
    assert!(HEADER_SIZE == 160 && offset_of!(Header, build_id) == 112 && offset_of!(Header, unwind_addr) == 144);
    assert!(SITE_SIZE == 56 && offset_of!(Site, drain) == 40 && offset_of!(Site, traced) == 48);
    assert!(size_of::<UnwindRow>() == UNWIND_ROW_SIZE && size_of::<capture::Frame>() == 80);
    assert!(size_of::<ForeignUnwind>() == 40);
    assert!(ENTRY_SIZE == 16 && offset_of!(Entry, sig) == 5);
    assert!(
        CONTROL_SIZE == 240 && offset_of!(ControlBlock, freed) == 80 && offset_of!(ControlBlock, entry_base) == 144
    );
    assert!(CELL_SIZE == 64 && offset_of!(Cell, failed_bytes) == 56);
};

/// Every field of each structure: name, offset, type as docs/formats.md
/// gives them (a test compares the two).
pub const HEADER_FIELDS: &[(&str, usize, &str)] = &[
    ("magic", offset_of!(Header, magic), "[u8; 8]"),
    ("version", offset_of!(Header, version), "u32"),
    ("header_size", offset_of!(Header, header_size), "u32"),
    ("flags", offset_of!(Header, flags), "u32"),
    ("site_count", offset_of!(Header, site_count), "u32"),
    ("entry_count", offset_of!(Header, entry_count), "u32"),
    ("shard_count", offset_of!(Header, shard_count), "u32"),
    ("shard_stride", offset_of!(Header, shard_stride), "u64"),
    ("table_addr", offset_of!(Header, table_addr), "u64"),
    ("control_addr", offset_of!(Header, control_addr), "u64"),
    ("counters_addr", offset_of!(Header, counters_addr), "u64"),
    ("counters_size", offset_of!(Header, counters_size), "u64"),
    ("text_addr", offset_of!(Header, text_addr), "u64"),
    ("text_size", offset_of!(Header, text_size), "u64"),
    ("sites_offset", offset_of!(Header, sites_offset), "u32"),
    ("entries_offset", offset_of!(Header, entries_offset), "u32"),
    ("strings_offset", offset_of!(Header, strings_offset), "u32"),
    ("strings_size", offset_of!(Header, strings_size), "u32"),
    ("module_name", offset_of!(Header, module_name), "u32"),
    ("build_id_len", offset_of!(Header, build_id_len), "u32"),
    ("build_id", offset_of!(Header, build_id), "[u8; 20]"),
    ("foreign_count", offset_of!(Header, foreign_count), "u32"),
    ("ehdr_addr", offset_of!(Header, ehdr_addr), "u64"),
    ("unwind_addr", offset_of!(Header, unwind_addr), "u64"),
    ("unwind_count", offset_of!(Header, unwind_count), "u32"),
    ("unwind_blocks", offset_of!(Header, unwind_blocks), "u32"),
];
pub const FOREIGN_FIELDS: &[(&str, usize, &str)] = &[
    ("build_id", offset_of!(ForeignUnwind, build_id), "[u8; 20]"),
    ("build_id_len", offset_of!(ForeignUnwind, build_id_len), "u8"),
    ("reserved", offset_of!(ForeignUnwind, reserved), "[u8; 3]"),
    ("rows_offset", offset_of!(ForeignUnwind, rows_offset), "u32"),
    ("count", offset_of!(ForeignUnwind, count), "u32"),
    ("blocks", offset_of!(ForeignUnwind, blocks), "u32"),
    ("name", offset_of!(ForeignUnwind, name), "u32"),
];
pub const UNWIND_FIELDS: &[(&str, usize, &str)] = &[
    ("addr", offset_of!(UnwindRow, addr), "u32"),
    ("cfa_offset", offset_of!(UnwindRow, cfa_offset), "i16"),
    ("rbp_offset", offset_of!(UnwindRow, rbp_offset), "i16"),
    ("kind", offset_of!(UnwindRow, kind), "u8"),
    ("rbp_saved", offset_of!(UnwindRow, rbp_saved), "u8"),
    ("reserved", offset_of!(UnwindRow, reserved), "[u8; 2]"),
];
pub const SITE_FIELDS: &[(&str, usize, &str)] = &[
    ("addr", offset_of!(Site, addr), "u64"),
    ("trampoline", offset_of!(Site, trampoline), "u64"),
    ("original", offset_of!(Site, original), "[u8; 8]"),
    ("len", offset_of!(Site, len), "u8"),
    ("form", offset_of!(Site, form), "u8"),
    ("entry", offset_of!(Site, entry), "u16"),
    ("function", offset_of!(Site, function), "u32"),
    ("file", offset_of!(Site, file), "u32"),
    ("line", offset_of!(Site, line), "u32"),
    ("drain", offset_of!(Site, drain), "u16"),
    ("count", offset_of!(Site, count), "u16"),
    ("callers", offset_of!(Site, callers), "u16"),
    ("flags", offset_of!(Site, flags), "u8"),
    ("reserved", offset_of!(Site, reserved), "[u8; 1]"),
    ("traced", offset_of!(Site, traced), "u16"),
    ("reserved_tail", offset_of!(Site, reserved_tail), "[u8; 6]"),
];
pub const ENTRY_FIELDS: &[(&str, usize, &str)] = &[
    ("name", offset_of!(Entry, name), "u32"),
    ("kind", offset_of!(Entry, kind), "u8"),
    ("sig", offset_of!(Entry, sig), "[u8; 6]"),
    ("flags", offset_of!(Entry, flags), "u8"),
    ("reserved", offset_of!(Entry, reserved), "[u8; 4]"),
];
pub const CONTROL_FIELDS: &[(&str, usize, &str)] = &[
    ("runtime", offset_of!(ControlBlock, runtime), "u64"),
    ("shard_tls", offset_of!(ControlBlock, shard_tls), "i64"),
    ("counters", offset_of!(ControlBlock, counters), "u64"),
    ("state", offset_of!(ControlBlock, state), "u64"),
    ("module_id", offset_of!(ControlBlock, module_id), "u64"),
    ("track_alloc", offset_of!(ControlBlock, track_alloc), "fn"),
    ("track_free", offset_of!(ControlBlock, track_free), "fn"),
    ("track_realloc_begin", offset_of!(ControlBlock, track_realloc_begin), "fn"),
    ("track_realloc_end", offset_of!(ControlBlock, track_realloc_end), "fn"),
    ("shadow", offset_of!(ControlBlock, shadow), "u64"),
    ("freed", offset_of!(ControlBlock, freed), "u64"),
    ("depth_tls", offset_of!(ControlBlock, depth_tls), "i64"),
    ("capture", offset_of!(ControlBlock, capture), "fn"),
    ("charge_tls", offset_of!(ControlBlock, charge_tls), "i64"),
    ("personality", offset_of!(ControlBlock, personality), "fn"),
    ("shadow_granules", offset_of!(ControlBlock, shadow_granules), "u64"),
    ("shadow_mask", offset_of!(ControlBlock, shadow_mask), "u64"),
    ("inline_limit", offset_of!(ControlBlock, inline_limit), "u64"),
    ("entry_base", offset_of!(ControlBlock, entry_base), "u64"),
    ("cas_limit", offset_of!(ControlBlock, cas_limit), "u64"),
    ("dlopen", offset_of!(ControlBlock, dlopen), "u64"),
    ("dlsym", offset_of!(ControlBlock, dlsym), "u64"),
    ("dlerror", offset_of!(ControlBlock, dlerror), "u64"),
    ("assign", offset_of!(ControlBlock, assign), "fn"),
    ("trace_tls", offset_of!(ControlBlock, trace_tls), "i64"),
    ("trace_record", offset_of!(ControlBlock, trace_record), "fn"),
    ("trace_base", offset_of!(ControlBlock, trace_base), "u64"),
    ("trace_inline_limit", offset_of!(ControlBlock, trace_inline_limit), "u64"),
    ("trace_cas_limit", offset_of!(ControlBlock, trace_cas_limit), "u64"),
    ("trace_shadow_mask", offset_of!(ControlBlock, trace_shadow_mask), "u64"),
];
pub const UNDO_HEADER_FIELDS: &[(&str, usize, &str)] = &[
    ("control", offset_of!(undo::UndoHeader, control), "i32"),
    ("index", offset_of!(undo::UndoHeader, index), "u32"),
    ("count", offset_of!(undo::UndoHeader, count), "u32"),
];
pub const UNDO_CALL_FIELDS: &[(&str, usize, &str)] = &[
    ("ret", offset_of!(undo::UndoCall, ret), "u32"),
    ("what", offset_of!(undo::UndoCall, what), "u8"),
    ("pad", offset_of!(undo::UndoCall, pad), "u8"),
    ("size_at", offset_of!(undo::UndoCall, size_at), "i16"),
];
pub const CELL_FIELDS: &[(&str, usize, &str)] = &[
    ("calls", offset_of!(Cell, calls), "u64"),
    ("bytes", offset_of!(Cell, bytes), "u64"),
    ("failed", offset_of!(Cell, failed), "u64"),
    ("freed_objects", offset_of!(Cell, freed_objects), "u64"),
    ("freed_bytes", offset_of!(Cell, freed_bytes), "u64"),
    ("untracked_frees", offset_of!(Cell, untracked_frees), "u64"),
    ("injected", offset_of!(Cell, injected), "u64"),
    ("failed_bytes", offset_of!(Cell, failed_bytes), "u64"),
];
pub const NO_STRING: u32 = u32::MAX;

/// Signature encoding in [`Entry::sig`].
pub fn encode_sig(sig: &Signature) -> [u8; 6] {
    use crate::entry::{Returns, Size};
    let (sk, a, b) = match sig.size {
        Size::None => (0, 0, 0),
        Size::Arg(x) => (1, x, 0),
        Size::Product(x, y) => (2, x, y),
        Size::ResultStrlen => (3, 0, 0),
    };
    let (rk, r) = match sig.result {
        Returns::None => (0, 0),
        Returns::Ret => (1, 0),
        Returns::OutArg(x) => (2, x),
    };
    [sk, a, b, rk, r, sig.freed.map_or(0xff, |f| f)]
}

pub fn decode_sig(kind: Kind, s: [u8; 6]) -> Option<Signature> {
    use crate::entry::{Returns, Size};
    let size = match s[0] {
        0 => Size::None,
        1 => Size::Arg(s[1]),
        2 => Size::Product(s[1], s[2]),
        3 => Size::ResultStrlen,
        _ => return None,
    };
    let result = match s[3] {
        0 => Returns::None,
        1 => Returns::Ret,
        2 => Returns::OutArg(s[4]),
        _ => return None,
    };
    let freed = if s[5] == 0xff { None } else { Some(s[5]) };
    Some(Signature { kind, size, result, freed })
}

/// Builds the string area, deduplicating.
#[derive(Default)]
pub struct Strings {
    data: Vec<u8>,
    index: std::collections::HashMap<String, u32>,
}

impl Strings {
    pub fn add(&mut self, s: &str) -> u32 {
        if let Some(&o) = self.index.get(s) {
            return o;
        }
        let o = self.data.len() as u32;
        self.data.extend_from_slice(s.as_bytes());
        self.data.push(0);
        self.index.insert(s.to_string(), o);
        o
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// The strings' bytes, each NUL-terminated.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
    /// The offset of a string added before.
    pub fn offset_of(&self, s: &str) -> Option<u32> {
        self.index.get(s).copied()
    }
}

/// Size in bytes of a table with these counts and string bytes.
pub fn table_size(sites: usize, entries: usize, strings: usize) -> usize {
    HEADER_SIZE + sites * SITE_SIZE + entries * ENTRY_SIZE + strings
}

/// Offset of the unwind rows from the table's start, for a table of
/// `table_len` bytes.
pub fn unwind_offset(table_len: usize) -> usize {
    table_len.next_multiple_of(4)
}

/// Bytes of a site table followed by `rows` unwind rows and their block
/// index of `blocks` entries, then the libraries' rows in `foreign`.
pub fn table_and_unwind_size(table_len: usize, rows: usize, blocks: usize, foreign: &[ForeignRows]) -> usize {
    if rows == 0 {
        return table_len;
    }
    let own = unwind_offset(table_len) + rows * UNWIND_ROW_SIZE + blocks * 4;
    if foreign.is_empty() { own } else { foreign_offset(own) + foreign_size(foreign) }
}

/// Where the directory of carried rows starts, after `own_end` bytes.
pub fn foreign_offset(own_end: usize) -> usize {
    own_end.next_multiple_of(8)
}

/// Bytes of the directory of carried rows and the rows.
pub fn foreign_size(foreign: &[ForeignRows]) -> usize {
    foreign.len() * size_of::<ForeignUnwind>()
        + foreign.iter().map(|f| f.rows.len() * UNWIND_ROW_SIZE + unwind_block_index(&f.rows).len() * 4).sum::<usize>()
}

/// Serializes a site table followed by its unwind rows (`header`'s
/// `unwind_addr` and `unwind_count` are filled in from `header.table_addr`)
/// and the rows it carries for libraries (`foreign`, whose names
/// `strings` holds; left out when the module has no rows of its own).
pub fn encode_with_unwind(
    mut header: Header,
    sites: &[Site],
    entries: &[Entry],
    strings: &Strings,
    rows: &[UnwindRow],
    foreign: &[ForeignRows],
) -> Vec<u8> {
    let len = table_size(sites.len(), entries.len(), strings.len());
    let foreign = if rows.is_empty() { &[][..] } else { foreign };
    if !rows.is_empty() {
        header.unwind_addr = header.table_addr + unwind_offset(len) as u64;
        header.unwind_count = rows.len() as u32;
    }
    let index = unwind_block_index(rows);
    header.unwind_blocks = index.len() as u32;
    header.foreign_count = foreign.len() as u32;
    let mut b = encode(header, sites, entries, strings);
    // (Room for the rest at once, not by doubling: a large library's
    // rows are tens of megabytes.)
    b.reserve_exact(table_and_unwind_size(len, rows.len(), index.len(), foreign).saturating_sub(b.len()));
    if !rows.is_empty() {
        b.resize(unwind_offset(len), 0);
        rows.iter().for_each(|r| b.extend_from_slice(pod::bytes_of(r)));
        index.iter().for_each(|i| b.extend_from_slice(&i.to_le_bytes()));
    }
    if !foreign.is_empty() {
        b.resize(foreign_offset(b.len()), 0);
        b.extend_from_slice(&encode_foreign(foreign, |f| strings.offset_of(&f.path).unwrap_or(0)));
    }
    b
}

/// Serializes a directory of carried rows ([`ForeignUnwind`] entries,
/// then each library's rows and block index, at offsets from the
/// directory's start); `name` gives each library's string offset.
pub fn encode_foreign(foreign: &[ForeignRows], name: impl Fn(&ForeignRows) -> u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(foreign_size(foreign));
    let mut at = foreign.len() * size_of::<ForeignUnwind>();
    let mut data = Vec::new();
    for f in foreign {
        let index = unwind_block_index(&f.rows);
        let mut id = [0u8; 20];
        let n = f.build_id.len().min(20);
        id.iter_mut().zip(&f.build_id).for_each(|(a, &b)| *a = b);
        let e = ForeignUnwind {
            build_id: id,
            build_id_len: n as u8,
            reserved: [0; 3],
            rows_offset: at as u32,
            count: f.rows.len() as u32,
            blocks: index.len() as u32,
            name: name(f),
        };
        b.extend_from_slice(pod::bytes_of(&e));
        f.rows.iter().for_each(|r| data.extend_from_slice(pod::bytes_of(r)));
        index.iter().for_each(|i| data.extend_from_slice(&i.to_le_bytes()));
        at += f.rows.len() * UNWIND_ROW_SIZE + index.len() * 4;
    }
    b.extend_from_slice(&data);
    b
}

/// Serializes a site table. `header`'s magic, version, sizes, counts and
/// offsets are filled in.
pub fn encode(mut header: Header, sites: &[Site], entries: &[Entry], strings: &Strings) -> Vec<u8> {
    header.magic = MAGIC;
    header.version = VERSION;
    header.header_size = HEADER_SIZE as u32;
    header.site_count = sites.len() as u32;
    header.entry_count = entries.len() as u32;
    header.sites_offset = HEADER_SIZE as u32;
    header.entries_offset = (HEADER_SIZE + sites.len() * SITE_SIZE) as u32;
    header.strings_offset = header.entries_offset + (entries.len() * ENTRY_SIZE) as u32;
    header.strings_size = strings.data.len() as u32;
    let mut b = Vec::with_capacity(table_size(sites.len(), entries.len(), strings.len()));
    b.extend_from_slice(pod::bytes_of(&header));
    sites.iter().for_each(|s| b.extend_from_slice(pod::bytes_of(s)));
    entries.iter().for_each(|e| b.extend_from_slice(pod::bytes_of(e)));
    b.extend_from_slice(&strings.data);
    b
}

/// Why a site table could not be read. Plain data: parsing allocates
/// nothing, so a signal handler may parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableError {
    Truncated,
    BadMagic,
    /// Written by another version of the format.
    Version {
        found: u32,
    },
    HeaderSize,
    InconsistentSizes,
    ShardCount,
    /// The counters or the control block are not where the layout puts
    /// them (page-aligned counters of shard_count x shard_stride bytes, a
    /// stride that holds a cell per site, a 64-byte-aligned control block).
    Placement,
    /// The sites are not sorted by address.
    Unsorted,
}

impl TableError {
    /// A fixed description (nothing allocated: a signal handler may log it).
    pub fn as_str(&self) -> &'static str {
        match self {
            TableError::Truncated => "site table truncated",
            TableError::BadMagic => "not an alloctramp site table (bad magic)",
            TableError::Version { .. } => "site table of another version",
            TableError::HeaderSize => "site table header size mismatch",
            TableError::InconsistentSizes => "site table sizes are inconsistent",
            TableError::ShardCount => "site table shard count is not 16",
            TableError::Placement => "site table places its counters or control block wrongly",
            TableError::Unsorted => "site table sites are not sorted by address",
        }
    }
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableError::Version { found } => {
                write!(f, "site table version {found}, this build reads version {VERSION}")
            }
            e => f.write_str(e.as_str()),
        }
    }
}

impl std::error::Error for TableError {}

/// A site table read from bytes (borrowed).
#[derive(Clone, Debug)]
pub struct Table<'a> {
    pub header: Header,
    bytes: &'a [u8],
}

impl<'a> Table<'a> {
    /// Reads and checks the header at the start of `head`: its magic,
    /// version and header size.
    fn header(head: &[u8]) -> Result<Header, TableError> {
        let h: Header = pod::read(head, 0).ok_or(TableError::Truncated)?;
        if h.magic != MAGIC {
            return Err(TableError::BadMagic);
        }
        if h.version != VERSION {
            return Err(TableError::Version { found: h.version });
        }
        if h.header_size as usize != HEADER_SIZE {
            return Err(TableError::HeaderSize);
        }
        Ok(h)
    }

    /// Parses and checks a table. `bytes` may extend past the table.
    pub fn parse(bytes: &'a [u8]) -> Result<Table<'a>, TableError> {
        let h = Self::header(bytes)?;
        let sites = h.site_count as usize;
        let entries = h.entry_count as usize;
        let total = table_size(sites, entries, h.strings_size as usize);
        if h.sites_offset as usize != HEADER_SIZE
            || h.entries_offset as usize != HEADER_SIZE + sites * SITE_SIZE
            || h.strings_offset as usize != h.entries_offset as usize + entries * ENTRY_SIZE
            || h.build_id_len as usize > h.build_id.len()
        {
            return Err(TableError::InconsistentSizes);
        }
        let Some(bytes) = bytes.get(..total) else { return Err(TableError::InconsistentSizes) };
        if h.shard_count != shard::COUNT {
            return Err(TableError::ShardCount);
        }
        let cells = (sites as u64).checked_mul(CELL_SIZE as u64);
        if u64::from(h.shard_count).checked_mul(h.shard_stride) != Some(h.counters_size)
            || cells.is_none_or(|c| c > h.shard_stride)
            || !h.shard_stride.is_multiple_of(PAGE)
            || !h.counters_addr.is_multiple_of(PAGE)
            || !h.control_addr.is_multiple_of(64)
        {
            return Err(TableError::Placement);
        }
        Ok(Table { header: h, bytes })
    }

    /// Checks that the sites are sorted by address and each lies past the
    /// previous one's end (linear in the sites: for registration, not for
    /// every lookup).
    pub fn check_order(&self) -> Result<(), TableError> {
        let mut end = 0u64;
        for s in self.sites() {
            if s.addr < end {
                return Err(TableError::Unsorted);
            }
            end = s.addr.checked_add(u64::from(s.len)).ok_or(TableError::Unsorted)?;
        }
        Ok(())
    }

    /// The total size of the table whose header starts `head` (at least
    /// [`HEADER_SIZE`] bytes), if the header is valid.
    pub fn parse_size(head: &[u8]) -> Option<usize> {
        let h = Self::header(head).ok()?;
        Some(table_size(h.site_count as usize, h.entry_count as usize, h.strings_size as usize))
    }

    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The module's build-id.
    pub fn build_id(&self) -> &[u8] {
        self.header.build_id.get(..self.header.build_id_len as usize).unwrap_or(&[])
    }

    /// Site `i`, if there is one.
    pub fn get_site(&self, i: usize) -> Option<Site> {
        if i >= self.header.site_count as usize {
            return None;
        }
        pod::read(self.bytes, self.header.sites_offset as usize + i * SITE_SIZE)
    }

    /// Site `i` (`i` < site_count; a parsed table holds every site).
    pub fn site(&self, i: usize) -> Site {
        self.get_site(i).unwrap_or_else(|| panic!("site {i} of a table of {}", self.header.site_count))
    }

    pub fn sites(&self) -> impl Iterator<Item = Site> + '_ {
        (0..self.header.site_count as usize).filter_map(|i| self.get_site(i))
    }

    pub fn entry(&self, i: usize) -> Option<Entry> {
        if i >= self.header.entry_count as usize {
            return None;
        }
        pod::read(self.bytes, self.header.entries_offset as usize + i * ENTRY_SIZE)
    }

    /// Whether `site` calls an allocation wrapper whose own allocation a
    /// fault injection fails rather than its call: a hook, or a wrapper
    /// the patcher found ([`entry_flags::WRAPPER`]) whose call raises the
    /// depth. A call of an allocator that raises the depth (an entry the
    /// user names, imported or reached through pointers too) fails itself.
    pub fn calls_wrapper(&self, site: &Site) -> bool {
        let wrapper_entry = || self.entry(usize::from(site.entry)).is_none_or(|e| e.flags & entry_flags::WRAPPER != 0);
        site.flags & site_flags::HOOK != 0 || (site.flags & site_flags::DEPTH_BUMP != 0 && wrapper_entry())
    }

    /// What the entry a site calls does; `None` for an entry the table
    /// does not have or a kind this build does not know.
    pub fn entry_kind(&self, entry: u16) -> Option<Kind> {
        self.entry(entry as usize).and_then(|e| Kind::from_code(e.kind))
    }

    /// A string by offset; `None` for [`NO_STRING`] or a bad offset.
    pub fn string(&self, offset: u32) -> Option<&'a str> {
        if offset == NO_STRING || offset >= self.header.strings_size {
            return None;
        }
        let start = self.header.strings_offset as usize;
        let area = self.bytes.get(start..start + self.header.strings_size as usize)?;
        let rest = area.get(offset as usize..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        std::str::from_utf8(rest.get(..end)?).ok()
    }

    pub fn module_name(&self) -> &'a str {
        self.string(self.header.module_name).unwrap_or("?")
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
pub(crate) mod tests {
    use super::*;
    use crate::entry;

    #[test]
    fn table_round_trip() {
        let mut strings = Strings::default();
        let module = strings.add("libx.so");
        let f = strings.add("main");
        let file = strings.add("x.c");
        assert_eq!(strings.add("main"), f, "deduplicated");
        let sites = vec![Site {
            addr: 0x1139,
            trampoline: 0x9000,
            original: [0xe8, 1, 2, 3, 4, 0, 0, 0],
            len: 5,
            form: SiteForm::CallRel32 as u8,
            entry: 0,
            function: f,
            file,
            line: 12,
            drain: 0x2a,
            count: 0x31,
            ..Site::default()
        }];
        let sig = entry::defaults()[1].sig;
        let entries = vec![Entry {
            name: strings.add("calloc"),
            kind: sig.kind.code(),
            sig: encode_sig(&sig),
            ..Entry::default()
        }];
        let header = Header {
            shard_count: 16,
            shard_stride: 4096,
            counters_size: 16 * 4096,
            counters_addr: 0x20000,
            control_addr: 0x1f040,
            module_name: module,
            ..Header::default()
        };
        let bytes = encode(header, &sites, &entries, &strings);
        let t = Table::parse(&bytes).unwrap();
        assert_eq!(t.check_order(), Ok(()));
        assert_eq!(t.header.site_count, 1);
        assert_eq!(t.site(0), sites[0]);
        assert_eq!(t.string(t.site(0).function), Some("main"));
        assert_eq!(t.module_name(), "libx.so");
        let e = t.entry(0).unwrap();
        assert_eq!(decode_sig(Kind::from_code(e.kind).unwrap(), e.sig), Some(sig));
        assert!(t.entry(1).is_none());

        let mut bad = bytes.clone();
        bad[8] = VERSION as u8 + 1;
        assert_eq!(Table::parse(&bad).unwrap_err(), TableError::Version { found: VERSION + 1 });
        assert!(Table::parse(&bad).unwrap_err().to_string().contains(&format!("version {}", VERSION + 1)));
        assert_eq!(Table::parse(&bytes[..bytes.len() - 1]).unwrap_err(), TableError::InconsistentSizes);
        bad = bytes.clone();
        bad[0] = b'X';
        assert_eq!(Table::parse(&bad).unwrap_err(), TableError::BadMagic);
        bad = bytes.clone();
        bad[offset_of!(Header, build_id_len)] = 21;
        assert_eq!(Table::parse(&bad).unwrap_err(), TableError::InconsistentSizes);
        for (field, value) in [
            (offset_of!(Header, counters_size), 15 * 4096u64),
            (offset_of!(Header, shard_stride), 0),
            (offset_of!(Header, counters_addr), 0x20008),
            (offset_of!(Header, control_addr), 0x1f020),
        ] {
            bad = bytes.clone();
            bad[field..field + 8].copy_from_slice(&value.to_le_bytes());
            assert_eq!(Table::parse(&bad).unwrap_err(), TableError::Placement, "field at {field}");
        }
        let two = [sites[0], Site { addr: 0x1100, ..sites[0] }];
        let unsorted = encode(Header { shard_stride: 4096, ..header }, &two, &entries, &strings);
        assert_eq!(Table::parse(&unsorted).unwrap().check_order(), Err(TableError::Unsorted));
        for cut in 0..bytes.len() {
            assert!(Table::parse(&bytes[..cut]).is_err(), "a table cut at {cut} bytes");
        }
    }

    /// (offset, type, name) of each row of the table that follows `heading`
    /// in docs/formats.md, up to the next blank line after it.
    pub(crate) fn documented(doc: &str, heading: &str) -> Vec<(usize, String, String)> {
        let at = doc.find(heading).unwrap_or_else(|| panic!("docs/formats.md has no {heading:?}"));
        let table = doc[at..].lines().skip_while(|l| !l.starts_with("| offset")).skip(2);
        table
            .take_while(|l| l.starts_with('|'))
            .map(|l| {
                let c: Vec<&str> = l.split('|').map(str::trim).collect();
                (c[1].parse().unwrap(), c[2].to_string(), c[3].trim_matches('`').to_string())
            })
            .collect()
    }

    pub(crate) fn fields(list: &[(&str, usize, &str)]) -> Vec<(usize, String, String)> {
        list.iter().map(|(n, o, t)| (*o, t.to_string(), n.to_string())).collect()
    }

    pub(crate) fn formats_md() -> String {
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/formats.md")).unwrap()
    }

    #[test]
    fn the_documented_module_formats_are_the_structs() {
        let doc = formats_md();
        assert!(doc.contains(&format!("## The site table (`.alloctramp.sites`, version {VERSION})")));
        assert_eq!(documented(&doc, "Header (160 bytes)"), fields(HEADER_FIELDS));
        assert_eq!(documented(&doc, &format!("Site ({SITE_SIZE} bytes")), fields(SITE_FIELDS));
        assert_eq!(documented(&doc, "Entry (16 bytes"), fields(ENTRY_FIELDS));
        assert_eq!(documented(&doc, "## Module control block"), fields(CONTROL_FIELDS));
        assert_eq!(documented(&doc, "## Counters"), fields(CELL_FIELDS));
        assert_eq!(documented(&doc, "Unwind rows (12 bytes each"), fields(UNWIND_FIELDS));
        assert_eq!(documented(&doc, "Library rows entry (40 bytes each)"), fields(FOREIGN_FIELDS));
        assert_eq!(documented(&doc, "Undo header (12 bytes)"), fields(UNDO_HEADER_FIELDS));
        assert_eq!(documented(&doc, "Undo call (8 bytes each)"), fields(UNDO_CALL_FIELDS));
    }
}

/// The runtime's API table, exported as [`RUNTIME_SYMBOL`]: byte offsets of
/// its fields. Each function takes the site table's run-time address.
pub mod api {
    /// u64: [`API_VERSION`](super::API_VERSION).
    pub const VERSION: i32 = 0;
    /// `extern "C" fn(table: *const u8)`: a module was loaded.
    pub const REGISTER: i32 = 8;
    /// `extern "C" fn(table: *const u8)`: a module is being unloaded.
    pub const UNREGISTER: i32 = 16;
}

/// Version of the API table.
pub const API_VERSION: u64 = 1;

/// The runtime a patched static program carries (the static runtime, an
/// object with no C library and nothing needed at load time): the symbols
/// the patcher looks up in it and the words of its host block.
pub mod static_host {
    /// The static runtime's file name, next to [`RUNTIME_SONAME`](super::RUNTIME_SONAME).
    pub const FILE_NAME: &str = "liballoctramp_rt_static.so";
    /// The host block: [`WORDS`] u64 words, which the entry stub and the
    /// patcher fill.
    pub const SYMBOL: &str = "alloctramp_static_host";
    pub const WORDS: usize = 8;
    /// Word 0: the stack pointer at the program's entry (argc, argv, the
    /// environment and the auxiliary vector above it), which the entry stub
    /// stores.
    pub const START_SP: usize = 0;
    /// Word 1: the load bias (0 unless the program is position-independent),
    /// which the entry stub stores.
    pub const BIAS: usize = 1;
    /// Word 2: the address of the program's own fork-handler registration
    /// (`__register_atfork(prepare, parent, child, dso)`, or musl's
    /// `pthread_atfork`), 0 if it has none; the patcher stores it.
    pub const ATFORK: usize = 2;
    /// Word 3: the C library's first real-time signal number (34 for
    /// glibc, 35 for musl); the patcher stores it.
    pub const SIGRTMIN: usize = 3;
    /// Words 4 to 7: the program's own `_Unwind_GetLanguageSpecificData`,
    /// `_Unwind_GetIP`, `_Unwind_GetRegionStart` and `_Unwind_GetCFA` (0:
    /// not linked), which the runtime's personality routine calls with the
    /// program's unwinder's context; the patcher stores them.
    pub const UNWINDER: usize = 4;
    /// `extern "C" fn()`: the runtime's work at exit, which the hook on the
    /// program's last destructor calls.
    pub const EXIT_SYMBOL: &str = "alloctramp_static_exit";
    /// `extern "C" fn(who: i32)`: runs the fork handlers the runtime
    /// registered (who < 0: before the fork; 0: in the parent; 1: in the
    /// child), where a program has no registration function (musl without
    /// `pthread_atfork`): the patcher points `fork`'s calls of the C
    /// library's empty `__fork_handler` at it.
    pub const FORK_HANDLER_SYMBOL: &str = "alloctramp_static_fork_handler";
}
