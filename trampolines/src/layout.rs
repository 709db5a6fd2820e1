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

use crate::entry::{Kind, Signature};

/// Magic at the start of a site table.
pub const MAGIC: [u8; 8] = *b"ATRAMP\x00\x01";
/// Version of the site table, control block and counter layout.
pub const VERSION: u32 = 4;

/// Where the site table is: in a patched file, the ELF header and the
/// program header table start the file and a read-only PT_LOAD that maps
/// them at the top of the address space; the site table follows the program
/// headers (8-byte aligned). Given the first bytes of such a segment (the
/// ELF header onwards), returns the table's offset in them.
pub fn table_after_phdrs(segment: &[u8]) -> Option<usize> {
    if segment.len() < 64 || segment[..4] != *b"\x7fELF" {
        return None;
    }
    let phoff = u64_at(segment, 32) as usize;
    let phnum = u16::from_le_bytes([segment[56], segment[57]]) as usize;
    let at = phoff.checked_add(phnum.checked_mul(56)?)?.div_ceil(8) * 8;
    (segment.get(at..at + 8)? == MAGIC).then_some(at)
}

/// The 5 bytes written over a site to send it to `target` (one of its
/// trampoline's entries): `jmp rel32`. `None` when the target is
/// out of rel32 range.
pub fn site_jump(site: u64, target: u64) -> Option<[u8; 5]> {
    let rel = i32::try_from(i128::from(target) - (i128::from(site) + 5)).ok()?;
    let b = rel.to_le_bytes();
    Some([0xe9, b[0], b[1], b[2], b[3]])
}

/// Section names.
pub const SEC_TEXT: &str = ".alloctramp.text";
pub const SEC_SITES: &str = ".alloctramp.sites";
pub const SEC_DATA: &str = ".alloctramp.data";
pub const SEC_COUNTERS: &str = ".alloctramp.counters";

/// Name of the data symbol the runtime exports and every patched module
/// imports (through a GOT slot in its control block).
pub const RUNTIME_SYMBOL: &str = "alloctramp_runtime_v1";
/// The runtime's SONAME.
pub const RUNTIME_SONAME: &str = "liballoctramp_rt.so";

pub const HEADER_SIZE: usize = 144;
pub const SITE_SIZE: usize = 48;
pub const ENTRY_SIZE: usize = 16;
pub const CONTROL_SIZE: usize = 128;
pub const CELL_SIZE: usize = 64;
pub const PAGE: u64 = 4096;

/// Fields of a counter cell (u64 each), by byte offset in the cell. Every
/// field is a sum over the shards; additions wrap, so a field the runtime
/// both adds to and subtracts from (a gauge) reads right once summed.
pub mod cell {
    /// Calls through the site (allocation, free or realloc).
    pub const CALLS: u32 = 0;
    /// Bytes requested (counted before the call, failed calls included).
    pub const BYTES: u32 = 8;
    /// Calls that returned NULL (or a non-zero error).
    pub const FAILED: u32 = 16;
    /// Objects allocated here and freed since (live tracking).
    pub const FREED_OBJECTS: u32 = 24;
    /// Requested bytes of those objects.
    pub const FREED_BYTES: u32 = 32;
    /// Frees through this site of memory the runtime did not track.
    pub const UNTRACKED_FREES: u32 = 40;
    /// Gauge: bytes the allocator reserved (malloc_usable_size) for the
    /// site's live objects, when usable-size tracking is on.
    pub const USABLE_BYTES: u32 = 48;
    /// Requested bytes of the failed calls, counted while live tracking is
    /// on (live bytes are BYTES - FAILED_BYTES - FREED_BYTES).
    pub const FAILED_BYTES: u32 = 56;
}

/// Fields of the module control block, by byte offset.
pub mod control {
    /// GOT slot the dynamic linker fills with the runtime's API table.
    pub const RUNTIME: u32 = 0;
    /// Offset from the thread pointer (fs) of glibc's `struct rseq`; its
    /// `cpu_id` field selects the counter shard.
    pub const RSEQ_OFFSET: u32 = 8;
    /// Run-time address of shard 0 of the counters.
    pub const COUNTERS: u32 = 16;
    /// Module state owned by the runtime.
    pub const STATE: u32 = 24;
    /// u64: the module's identity in the runtime's pointer table (slot and
    /// generation), written by the runtime at registration.
    pub const MODULE_ID: u32 = 32;
    /// Live-tracking functions the trampolines call; zero while live
    /// tracking is off (the trampolines then only count).
    /// `extern "C" fn(ptr, size, site, control) -> ptr`: an allocation succeeded.
    pub const TRACK_ALLOC: u32 = 40;
    /// `extern "C" fn(ptr, site, control) -> ptr`: a pointer is about to be freed.
    pub const TRACK_FREE: u32 = 48;
    /// `extern "C" fn(old, site, control) -> token`: a realloc is about to
    /// run; the old pointer leaves the table.
    pub const TRACK_REALLOC_BEGIN: u32 = 56;
    /// `extern "C" fn(result, token, size, site, control) -> result`: the
    /// realloc returned.
    pub const TRACK_REALLOC_END: u32 = 64;
    /// i64: offset from the thread pointer (fs) of the runtime's per-thread
    /// word holding the byte offset of the thread's nursery from
    /// [`NURSERIES`] (0: the inert nursery, which sends every trampoline to
    /// the runtime). Written with the hooks.
    pub const NURSERY_TLS: u32 = 72;
    /// u64: run-time address of the runtime's nursery array.
    pub const NURSERIES: u32 = 80;
}

/// A thread's nursery: a direct-mapped table of the objects the thread
/// allocated recently, which the trampolines insert into and take out of
/// inline (no call, no lock, no atomic instruction). The runtime moves an
/// object that stays live into the shared pointer table when a newer one
/// needs its slot, and finds objects other threads free under the shard
/// lock (see the runtime's `live` module).
pub mod nursery {
    /// u8: non-zero sends the trampolines to the runtime (bit 0: a reset
    /// made the contents stale; bit 7: the inert nursery).
    pub const FLAGS: u32 = 0;
    /// u64: the pointer of the thread's last tracked free. A free of the
    /// same pointer that misses the nursery is a nested layer of that free
    /// (`operator delete` calling `free`, a wrapper calling the allocator's
    /// free): it makes the original call without looking further.
    pub const LAST: u32 = 8;
    /// Offset of the slots.
    pub const SLOTS: u32 = 64;
    /// log2 of the number of slots.
    pub const SLOT_BITS: u32 = 8;
    pub const SLOT_COUNT: usize = 1 << SLOT_BITS;
    /// Bytes per slot: the pointer, its counter cell, the requested size
    /// and a reserved word.
    pub const SLOT_SIZE: u32 = 32;
    pub const KEY: u32 = 0;
    pub const CELL: u32 = 8;
    pub const SIZE: u32 = 16;
    /// Key of an empty slot: not NULL, so that free(NULL) never matches,
    /// and no address an allocator returns or a program frees (unlike a
    /// small sentinel such as 1 that a user-named free might be given);
    /// an 8-bit immediate in the trampolines.
    pub const EMPTY: u64 = u64::MAX;
    /// Bytes per nursery.
    pub const BYTES: usize = SLOTS as usize + SLOT_COUNT * SLOT_SIZE as usize;
    /// The slot multiplier: slot = (low 32 bits of ptr * HASH) >> (32 - SLOT_BITS).
    pub const HASH: u32 = 0x9e37_79b1;

    /// A pointer's slot.
    #[inline(always)]
    pub fn slot_of(ptr: u64) -> usize {
        ((ptr as u32).wrapping_mul(HASH) >> (32 - SLOT_BITS)) as usize
    }
}

/// Flags in the header.
pub mod flags {
    /// Trampolines keep every register but rax (sites call functions
    /// defined in the module, whose callers may rely on fewer clobbers).
    pub const PRESERVE_DIRECT: u32 = 1;
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
/// file; add the module's load bias for run-time addresses.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Header {
    pub flags: u32,
    pub site_count: u32,
    pub entry_count: u32,
    pub shard_count: u32,
    pub shard_stride: u64,
    /// Address of the site table itself (to compute the load bias).
    pub table_addr: u64,
    pub control_addr: u64,
    pub counters_addr: u64,
    pub counters_size: u64,
    pub text_addr: u64,
    pub text_size: u64,
    /// Byte offsets of the arrays from the table's start.
    pub sites_offset: u32,
    pub entries_offset: u32,
    pub strings_offset: u32,
    pub strings_size: u32,
    /// String offset of the module name.
    pub module_name: u32,
    /// The original file's build-id (up to 20 bytes), zero-padded.
    pub build_id: [u8; 20],
    pub build_id_len: u8,
    /// Address of the ELF header (and program headers) in memory.
    pub ehdr_addr: u64,
}

/// One site.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Site {
    pub addr: u64,
    pub trampoline: u64,
    /// The instruction's original bytes (first `len`).
    pub original: [u8; 8],
    pub len: u8,
    pub form: u8,
    pub entry: u16,
    /// String offsets (u32::MAX: unknown) and line (0: unknown).
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
}

impl Site {
    /// Address of the trampoline entry at `offset`.
    pub fn entry_at(&self, offset: u16) -> u64 {
        self.trampoline.wrapping_add(u64::from(offset))
    }
}

/// One entry point.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Entry {
    /// String offset of the display name.
    pub name: u32,
    pub kind: u8,
    /// Encoded [`Signature`]: size kind, size args, result kind, freed arg.
    pub sig: [u8; 6],
}

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

fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
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
}

/// Size in bytes of a table with these counts and string bytes.
pub fn table_size(sites: usize, entries: usize, strings: usize) -> usize {
    HEADER_SIZE + sites * SITE_SIZE + entries * ENTRY_SIZE + strings
}

/// Serializes a site table. `header`'s offsets and counts are filled in.
pub fn encode(mut header: Header, sites: &[Site], entries: &[Entry], strings: &Strings) -> Vec<u8> {
    header.site_count = sites.len() as u32;
    header.entry_count = entries.len() as u32;
    header.sites_offset = HEADER_SIZE as u32;
    header.entries_offset = (HEADER_SIZE + sites.len() * SITE_SIZE) as u32;
    header.strings_offset = header.entries_offset + (entries.len() * ENTRY_SIZE) as u32;
    header.strings_size = strings.data.len() as u32;
    let mut b = Vec::with_capacity(table_size(sites.len(), entries.len(), strings.len()));
    b.extend_from_slice(&MAGIC);
    put_u32(&mut b, VERSION);
    put_u32(&mut b, HEADER_SIZE as u32);
    put_u32(&mut b, header.flags);
    put_u32(&mut b, header.site_count);
    put_u32(&mut b, header.entry_count);
    put_u32(&mut b, header.shard_count);
    put_u64(&mut b, header.shard_stride);
    put_u64(&mut b, header.table_addr);
    put_u64(&mut b, header.control_addr);
    put_u64(&mut b, header.counters_addr);
    put_u64(&mut b, header.counters_size);
    put_u64(&mut b, header.text_addr);
    put_u64(&mut b, header.text_size);
    put_u32(&mut b, header.sites_offset);
    put_u32(&mut b, header.entries_offset);
    put_u32(&mut b, header.strings_offset);
    put_u32(&mut b, header.strings_size);
    put_u32(&mut b, header.module_name);
    put_u32(&mut b, u32::from(header.build_id_len));
    b.extend_from_slice(&header.build_id);
    put_u64(&mut b, header.ehdr_addr);
    b.resize(HEADER_SIZE, 0);
    for s in sites {
        put_u64(&mut b, s.addr);
        put_u64(&mut b, s.trampoline);
        b.extend_from_slice(&s.original);
        b.push(s.len);
        b.push(s.form);
        b.extend_from_slice(&s.entry.to_le_bytes());
        put_u32(&mut b, s.function);
        put_u32(&mut b, s.file);
        put_u32(&mut b, s.line);
        b.extend_from_slice(&s.drain.to_le_bytes());
        b.extend_from_slice(&s.count.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
    }
    for e in entries {
        put_u32(&mut b, e.name);
        b.push(e.kind);
        b.extend_from_slice(&e.sig);
        b.extend_from_slice(&[0; 5]);
    }
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
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableError::Truncated => f.write_str("site table truncated"),
            TableError::BadMagic => f.write_str("not an alloctramp site table (bad magic)"),
            TableError::Version { found } => {
                write!(f, "site table version {found}, this build reads version {VERSION}")
            }
            TableError::HeaderSize => f.write_str("site table header size mismatch"),
            TableError::InconsistentSizes => f.write_str("site table sizes are inconsistent"),
            TableError::ShardCount => f.write_str("site table shard count is not a power of two"),
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

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

impl<'a> Table<'a> {
    /// Parses and checks a table. `bytes` may extend past the table.
    pub fn parse(bytes: &'a [u8]) -> Result<Table<'a>, TableError> {
        if bytes.len() < HEADER_SIZE {
            return Err(TableError::Truncated);
        }
        if bytes[..8] != MAGIC {
            return Err(TableError::BadMagic);
        }
        let version = u32_at(bytes, 8);
        if version != VERSION {
            return Err(TableError::Version { found: version });
        }
        if u32_at(bytes, 12) as usize != HEADER_SIZE {
            return Err(TableError::HeaderSize);
        }
        let mut build_id = [0u8; 20];
        build_id.copy_from_slice(&bytes[112..132]);
        let h = Header {
            flags: u32_at(bytes, 16),
            site_count: u32_at(bytes, 20),
            entry_count: u32_at(bytes, 24),
            shard_count: u32_at(bytes, 28),
            shard_stride: u64_at(bytes, 32),
            table_addr: u64_at(bytes, 40),
            control_addr: u64_at(bytes, 48),
            counters_addr: u64_at(bytes, 56),
            counters_size: u64_at(bytes, 64),
            text_addr: u64_at(bytes, 72),
            text_size: u64_at(bytes, 80),
            sites_offset: u32_at(bytes, 88),
            entries_offset: u32_at(bytes, 92),
            strings_offset: u32_at(bytes, 96),
            strings_size: u32_at(bytes, 100),
            module_name: u32_at(bytes, 104),
            build_id,
            build_id_len: u32_at(bytes, 108).min(20) as u8,
            ehdr_addr: u64_at(bytes, 132),
        };
        let total = table_size(h.site_count as usize, h.entry_count as usize, h.strings_size as usize);
        if h.sites_offset as usize != HEADER_SIZE
            || h.entries_offset as usize != HEADER_SIZE + h.site_count as usize * SITE_SIZE
            || h.strings_offset as usize != h.entries_offset as usize + h.entry_count as usize * ENTRY_SIZE
            || bytes.len() < total
        {
            return Err(TableError::InconsistentSizes);
        }
        if h.shard_count == 0 || !h.shard_count.is_power_of_two() {
            return Err(TableError::ShardCount);
        }
        Ok(Table { header: h, bytes: &bytes[..total] })
    }

    /// The total size of the table whose header starts `head` (at least
    /// [`HEADER_SIZE`] bytes), if the header is valid.
    pub fn parse_size(head: &[u8]) -> Option<usize> {
        if head.len() < HEADER_SIZE || head[..8] != MAGIC || u32_at(head, 8) != VERSION {
            return None;
        }
        Some(table_size(u32_at(head, 20) as usize, u32_at(head, 24) as usize, u32_at(head, 100) as usize))
    }

    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    pub fn site(&self, i: usize) -> Site {
        let at = self.header.sites_offset as usize + i * SITE_SIZE;
        let b = &self.bytes[at..at + SITE_SIZE];
        let mut original = [0u8; 8];
        original.copy_from_slice(&b[16..24]);
        Site {
            addr: u64_at(b, 0),
            trampoline: u64_at(b, 8),
            original,
            len: b[24],
            form: b[25],
            entry: u16::from_le_bytes([b[26], b[27]]),
            function: u32_at(b, 28),
            file: u32_at(b, 32),
            line: u32_at(b, 36),
            drain: u16::from_le_bytes([b[40], b[41]]),
            count: u16::from_le_bytes([b[42], b[43]]),
        }
    }

    pub fn sites(&self) -> impl Iterator<Item = Site> + '_ {
        (0..self.header.site_count as usize).map(|i| self.site(i))
    }

    pub fn entry(&self, i: usize) -> Option<Entry> {
        if i >= self.header.entry_count as usize {
            return None;
        }
        let at = self.header.entries_offset as usize + i * ENTRY_SIZE;
        let b = &self.bytes[at..at + ENTRY_SIZE];
        let mut sig = [0u8; 6];
        sig.copy_from_slice(&b[5..11]);
        Some(Entry { name: u32_at(b, 0), kind: b[4], sig })
    }

    /// A string by offset; `None` for [`NO_STRING`] or a bad offset.
    pub fn string(&self, offset: u32) -> Option<&'a str> {
        if offset == NO_STRING || offset >= self.header.strings_size {
            return None;
        }
        let start = self.header.strings_offset as usize + offset as usize;
        let rest = &self.bytes[start..self.header.strings_offset as usize + self.header.strings_size as usize];
        let end = rest.iter().position(|&c| c == 0)?;
        std::str::from_utf8(&rest[..end]).ok()
    }

    pub fn module_name(&self) -> &'a str {
        self.string(self.header.module_name).unwrap_or("?")
    }
}

#[cfg(test)]
mod tests {
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
        }];
        let sig = entry::defaults()[1].sig;
        let entries = vec![Entry { name: strings.add("calloc"), kind: sig.kind.code(), sig: encode_sig(&sig) }];
        let header = Header { shard_count: 16, shard_stride: 4096, module_name: module, ..Header::default() };
        let bytes = encode(header, &sites, &entries, &strings);
        let t = Table::parse(&bytes).unwrap();
        assert_eq!(t.header.site_count, 1);
        assert_eq!(t.site(0), sites[0]);
        assert_eq!(t.string(t.site(0).function), Some("main"));
        assert_eq!(t.module_name(), "libx.so");
        let e = t.entry(0).unwrap();
        assert_eq!(decode_sig(Kind::from_code(e.kind).unwrap(), e.sig), Some(sig));
        assert!(t.entry(1).is_none());

        let mut bad = bytes.clone();
        bad[8] = 9;
        assert_eq!(Table::parse(&bad).unwrap_err(), TableError::Version { found: 9 });
        assert!(Table::parse(&bad).unwrap_err().to_string().contains("version 9"));
        assert_eq!(Table::parse(&bytes[..bytes.len() - 1]).unwrap_err(), TableError::InconsistentSizes);
        bad = bytes.clone();
        bad[0] = b'X';
        assert_eq!(Table::parse(&bad).unwrap_err(), TableError::BadMagic);
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
