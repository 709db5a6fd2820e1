//! Unwind rows for libraries that are not patched, so that callers capture
//! goes on through a library's frames: a chain from a callback called by
//! the C library's `qsort`, or from a thread, reaches the code that called
//! into the library.
//!
//! Two sources. An executable carries rows for the libraries it needs (see
//! `layout::ForeignUnwind`): they live in its read-only segment, which is
//! never unmapped, and describe libraries that are never unloaded before
//! it. The unwind file (`process::UnwindFileHeader`), which `alloctramp
//! callers PID on` writes, carries rows for libraries loaded later with
//! `dlopen`, which may be unloaded: a frame is unwound by those only while
//! glibc's `_dl_find_object` (lock-free, async-signal-safe) still finds the
//! library they were opened for at the frame's address.
//!
//! Rows are opened when callers capture first needs them (or when the
//! file is mapped), for the loaded library with the carried path's file
//! name and the same build-id. Lookups run in signal context too: reads of
//! memory the process's own maps name, atomics, no allocation. A slot is
//! written under a sequence count (odd while written); a lookup that sees
//! it move ignores the slot, and the rows it points to stay mapped.
//!
//! Also the row lookup and checks that a patched module's own rows share.

use crate::sys;
use alloctramp_trampolines::layout::{self, ForeignUnwind, UNWIND_ROW_SIZE, UnwindRow};
use alloctramp_trampolines::process::{self, UnwindFileHeader};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};

/// Libraries whose rows can be open at once.
const MAX_FOREIGN: usize = 64;

/// The owner of rows opened from the unwind file.
const FILE_OWNER: usize = usize::MAX;

struct Foreign {
    /// The registry slot of the executable carrying the rows, plus one, or
    /// [`FILE_OWNER`] (0: free).
    owner: AtomicUsize,
    /// Odd while the fields below are written.
    seq: AtomicU32,
    rows: AtomicUsize,
    count: AtomicU32,
    bias: AtomicU64,
    code_lo: AtomicU64,
    /// Published last (0: not open).
    code_hi: AtomicU64,
    /// Rows from the unwind file: the start of the library's mapping as
    /// `_dl_find_object` gave it when they were opened (0 for an
    /// executable's rows, which need no check), where its build-id lies in
    /// memory, and the entry's build-id (in the file's mapping).
    map_start: AtomicU64,
    id_at: AtomicU64,
    id: AtomicUsize,
    id_len: AtomicU32,
}

static FOREIGN: [Foreign; MAX_FOREIGN] = [const {
    Foreign {
        owner: AtomicUsize::new(0),
        seq: AtomicU32::new(0),
        rows: AtomicUsize::new(0),
        count: AtomicU32::new(0),
        bias: AtomicU64::new(0),
        code_lo: AtomicU64::new(0),
        code_hi: AtomicU64::new(0),
        map_start: AtomicU64::new(0),
        id_at: AtomicU64::new(0),
        id: AtomicUsize::new(0),
        id_len: AtomicU32::new(0),
    }
}; MAX_FOREIGN];

/// What one slot holds, read consistently.
#[derive(Clone, Copy)]
struct Open {
    rows: usize,
    count: usize,
    bias: u64,
    lo: u64,
    hi: u64,
    map_start: u64,
    id_at: u64,
    id: usize,
    id_len: usize,
}

impl Open {
    /// Whether the object mapped at `pc` is still the library these rows
    /// were opened for: the same mapping start, and its build-id there.
    fn still_loaded(&self, pc: u64) -> bool {
        if find_object(pc) != Some(self.map_start) {
            return false;
        }
        // SAFETY: `open_entries` placed the build-id within the page that
        // holds `map_start`, the start of the first segment of whatever
        // object `_dl_find_object` finds there now (mapped while it is);
        // the entry's build-id lies in the unwind file's copy, never
        // unmapped once opened.
        unsafe {
            let now = std::slice::from_raw_parts(self.id_at as *const u8, self.id_len);
            let want = std::slice::from_raw_parts(self.id as *const u8, self.id_len);
            now == want
        }
    }
}

impl Foreign {
    /// The slot's rows, if open and not being written.
    fn read(&self) -> Option<Open> {
        let s = self.seq.load(Ordering::Acquire);
        if s & 1 != 0 {
            return None;
        }
        let o = Open {
            hi: self.code_hi.load(Ordering::Acquire),
            lo: self.code_lo.load(Ordering::Relaxed),
            rows: self.rows.load(Ordering::Relaxed),
            count: self.count.load(Ordering::Relaxed) as usize,
            bias: self.bias.load(Ordering::Relaxed),
            map_start: self.map_start.load(Ordering::Relaxed),
            id_at: self.id_at.load(Ordering::Relaxed),
            id: self.id.load(Ordering::Relaxed),
            id_len: self.id_len.load(Ordering::Relaxed) as usize,
        };
        fence(Ordering::Acquire);
        (o.hi != 0 && self.seq.load(Ordering::Relaxed) == s).then_some(o)
    }

    /// Writes the slot (claimed by the caller) and opens it.
    fn write(&self, o: Open) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        fence(Ordering::Release);
        self.code_hi.store(0, Ordering::Relaxed);
        self.rows.store(o.rows, Ordering::Relaxed);
        self.count.store(o.count as u32, Ordering::Relaxed);
        self.bias.store(o.bias, Ordering::Relaxed);
        self.code_lo.store(o.lo, Ordering::Relaxed);
        self.map_start.store(o.map_start, Ordering::Relaxed);
        self.id_at.store(o.id_at, Ordering::Relaxed);
        self.id.store(o.id, Ordering::Relaxed);
        self.id_len.store(o.id_len as u32, Ordering::Relaxed);
        self.code_hi.store(o.hi, Ordering::Release);
        self.seq.fetch_add(1, Ordering::Release);
    }

    /// Closes the slot and frees it.
    fn clear(&self) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        fence(Ordering::Release);
        self.code_hi.store(0, Ordering::Release);
        self.seq.fetch_add(1, Ordering::Release);
        self.owner.store(0, Ordering::Release);
    }
}

/// The row in effect at `pc` of sorted rows `p` (`n` of them, their block
/// index after them), whose first row is at run-time address `lo` and
/// whose addresses are relative to `bias`; `None` for a stop row.
///
/// # Safety
/// The rows and the index must be mapped and have passed
/// [`rows_are_sound`], and `pc` must lie within the rows' range.
#[inline(always)]
pub unsafe fn row_at(p: *const UnwindRow, n: usize, bias: u64, lo: u64, pc: u64) -> Option<UnwindRow> {
    // The rows' addresses are u32 and `pc` lies within them.
    let at = pc.wrapping_sub(bias) as u32;
    let block = ((pc - lo) / layout::UNWIND_BLOCK) as usize;
    // SAFETY: the index has an entry for every block of the rows' range,
    // each naming a row (caller); `i + 1 < n` bounds the scan.
    unsafe {
        let mut i = *(p.add(n) as *const u32).add(block) as usize;
        while i + 1 < n && (*p.add(i + 1)).addr <= at {
            i += 1;
        }
        let r = *p.add(i);
        (r.kind != layout::unwind::STOP).then_some(r)
    }
}

/// Whether rows and their block index can be looked up: sorted, an index
/// entry for every block of their range, each naming a row; then their
/// run-time range from `bias` (addresses that fit 32 bits from it).
pub fn rows_are_sound(rows: &[UnwindRow], index: &[u32], bias: u64) -> Option<(u64, u64)> {
    let (first, last) = (rows.first()?, rows.last()?);
    let need = (u64::from(last.addr.checked_sub(first.addr)?) / layout::UNWIND_BLOCK + 1) as usize;
    if !rows.windows(2).all(|w| w.first().map(|a| a.addr) < w.get(1).map(|b| b.addr))
        || index.len() != need
        || index.iter().any(|&i| i as usize >= rows.len())
    {
        return None;
    }
    let (lo, hi) = (bias.wrapping_add(u64::from(first.addr)), bias.wrapping_add(u64::from(last.addr)));
    // A range that wraps is not looked up.
    (hi >= lo && hi.wrapping_sub(bias) <= u64::from(u32::MAX)).then_some((lo, hi))
}

/// A lookup among the libraries' rows.
pub struct Lookup {
    pub row: Option<UnwindRow>,
    /// Whether the answer may be cached: not for an address within rows
    /// from the unwind file, whose library may be unloaded.
    pub cacheable: bool,
}

/// The row at `pc` of an open library, if one covers it.
pub fn row(pc: u64) -> Lookup {
    let mut stale = false;
    for f in &FOREIGN {
        let Some(o) = f.read() else { continue };
        if pc < o.lo || pc >= o.hi {
            continue;
        }
        let from_file = o.map_start != 0;
        if from_file && !o.still_loaded(pc) {
            // Rows opened since for what is loaded there now may follow.
            stale = true;
            continue;
        }
        // SAFETY: checked by `open` before it published code_hi; in the
        // owner's read-only segment, mapped for the process's life, or in
        // the unwind file's copy, never unmapped once rows were opened
        // from it.
        let row = unsafe { row_at(o.rows as *const UnwindRow, o.count, o.bias, o.lo, pc) };
        return Lookup { row, cacheable: !from_file && !stale };
    }
    if stale && let Some(h) = crate::procfile::header() {
        h.callers_unloaded.fetch_add(1, Ordering::Relaxed);
    }
    Lookup { row: None, cacheable: !stale }
}

/// glibc's `struct dl_find_object` (x86-64).
#[repr(C)]
struct DlFindObject {
    flags: u64,
    map_start: u64,
    map_end: u64,
    link_map: u64,
    eh_frame: u64,
    reserved: [u64; 7],
}

type FindObject = unsafe extern "C" fn(u64, *mut DlFindObject) -> i32;

/// `_dl_find_object`: 0 not looked up yet, [`NONE`] when this C library
/// has none.
static FIND_OBJECT: AtomicUsize = AtomicUsize::new(0);
const NONE: usize = 1;
/// Set when requests are carried out in a signal handler, where `dlsym`
/// is not for calling: the lookup is made at start-up then.
static LOOKED_UP_AT_START: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Looks `_dl_find_object` up now (at start-up, in signal mode).
pub fn look_up_now() {
    LOOKED_UP_AT_START.store(true, Ordering::Release);
    look_up();
}

fn look_up() {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_find_object".as_ptr()) };
    FIND_OBJECT.store(if f.is_null() { NONE } else { f as usize }, Ordering::Release);
}

/// Where the object that `_dl_find_object` finds at `addr` is mapped.
fn find_object(addr: u64) -> Option<u64> {
    let f = FIND_OBJECT.load(Ordering::Acquire);
    if f <= NONE {
        return None;
    }
    // SAFETY: the C library's `_dl_find_object`, found by `look_up`.
    let f: FindObject = unsafe { std::mem::transmute::<usize, FindObject>(f) };
    let mut r = DlFindObject { flags: 0, map_start: 0, map_end: 0, link_map: 0, eh_frame: 0, reserved: [0; 7] };
    // SAFETY: it fills the struct it is given (lock-free, async-signal-safe).
    (unsafe { f(addr, &mut r) } == 0 && r.map_start != 0).then_some(r.map_start)
}

/// Opens the rows an executable (registry slot `owner`) carries: `count`
/// directory entries at `dir`, within memory that ends at `end`; `string`
/// gives the table's string at an offset.
pub fn open<'a>(owner: usize, dir: u64, count: u32, end: u64, string: impl Fn(u32) -> Option<&'a [u8]>) {
    open_entries(owner + 1, dir, count, end, string);
}

/// Opens a directory's entries for `owner` ([`FILE_OWNER`] or an
/// executable's slot plus one); returns how many it opened.
fn open_entries<'a>(owner: usize, dir: u64, count: u32, end: u64, string: impl Fn(u32) -> Option<&'a [u8]>) -> u32 {
    let mut opened = 0;
    for k in 0..u64::from(count) {
        let at = dir + k * size_of::<ForeignUnwind>() as u64;
        if at + size_of::<ForeignUnwind>() as u64 > end {
            break;
        }
        // SAFETY: within the owner's read-only memory (checked above).
        let e: ForeignUnwind = unsafe { std::ptr::read_unaligned(at as *const ForeignUnwind) };
        let rows = dir + u64::from(e.rows_offset);
        let (n, blocks) = (e.count as usize, e.blocks as usize);
        let size = n as u64 * UNWIND_ROW_SIZE as u64 + blocks as u64 * 4;
        if !rows.is_multiple_of(4) || rows.checked_add(size).is_none_or(|e| e > end) || e.build_id_len as usize > 20 {
            continue;
        }
        let Some(name) = string(e.name) else { continue };
        let id = e.build_id.get(..usize::from(e.build_id_len)).unwrap_or_default();
        let Some((bias, id_at)) = loaded_bias(name, id) else { continue };
        // SAFETY: within the owner's read-only memory (checked above).
        let (r, index) = unsafe {
            (
                std::slice::from_raw_parts(rows as *const UnwindRow, n),
                std::slice::from_raw_parts((rows as *const UnwindRow).add(n) as *const u32, blocks),
            )
        };
        let Some((lo, hi)) = rows_are_sound(r, index, bias) else { continue };
        // Rows from the file are checked against the loaded object at each
        // use: what it is now.
        let map_start = if owner == FILE_OWNER {
            // The build-id must lie in the page of the mapping's start,
            // which every object loaded there maps readable.
            match find_object(lo) {
                Some(s) if !id.is_empty() && id_at + id.len() as u64 <= (s & !0xfff) + 0x1000 && id_at >= s => s,
                _ => continue,
            }
        } else {
            0
        };
        // One library's rows once (several owners may carry them, and
        // the unwind file those the modules carry).
        if FOREIGN.iter().any(|f| f.read().is_some_and(|o| o.lo <= hi && lo <= o.hi)) {
            continue;
        }
        let Some(f) =
            FOREIGN.iter().find(|f| f.owner.compare_exchange(0, owner, Ordering::AcqRel, Ordering::Relaxed).is_ok())
        else {
            break;
        };
        let entry_id = (at + std::mem::offset_of!(ForeignUnwind, build_id) as u64) as usize;
        f.write(Open { rows: rows as usize, count: n, bias, lo, hi, map_start, id_at, id: entry_id, id_len: id.len() });
        opened += 1;
    }
    opened
}

/// Closes the rows from the unwind file whose library was unloaded, or
/// another loaded in its place. Only the file's opener (a request's
/// handling, one at a time) writes or clears slots it owns.
fn close_stale_file_rows() {
    for f in &FOREIGN {
        if f.owner.load(Ordering::Acquire) == FILE_OWNER && f.read().is_some_and(|o| !o.still_loaded(o.lo)) {
            f.clear();
        }
    }
}

/// Closes the rows an executable carried (its unloading, which an
/// executable sees only at exit).
pub fn close(owner: usize) {
    for f in &FOREIGN {
        if f.owner.load(Ordering::Acquire) == owner + 1 {
            f.clear();
        }
    }
}

/// Reads the unwind file at `path` (see `process::UnwindFileHeader`) and
/// opens its rows, after closing those of libraries unloaded since; returns
/// how many libraries' rows it opened. A missing file opens none; one that
/// is not this user's own regular file, or is unsound, is an error. Called
/// by a request's handling (one at a time, in signal context too: system
/// calls only). The file is copied into memory of the runtime's own, read
/// only, which a later change of the file cannot alter.
pub fn open_file(path: &std::ffi::CStr) -> Result<u32, &'static str> {
    close_stale_file_rows();
    // SAFETY: a NUL-terminated path; O_NONBLOCK: a FIFO put there does not
    // hold the request up.
    let fd =
        unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return if sys::errno() == libc::ENOENT { Ok(0) } else { Err("the unwind file cannot be opened") };
    }
    let fd = sys::Fd(fd);
    // SAFETY: fstat fills a plain struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: an open descriptor and the struct above.
    if unsafe { libc::fstat(fd.0, &mut st) } != 0
        || st.st_mode & libc::S_IFMT != libc::S_IFREG
        // SAFETY: geteuid has no preconditions.
        || st.st_uid != unsafe { libc::geteuid() }
        || st.st_mode & 0o022 != 0
    {
        return Err("the unwind file is not this user's own regular file");
    }
    let len = st.st_size as u64;
    if len < size_of::<UnwindFileHeader>() as u64 || len > process::MAX_UNWIND_FILE {
        return Err("the unwind file has a bad size");
    }
    // Outside signal mode a request is carried out by the watcher thread
    // (or at start-up): `dlsym` may be called, once there is a file to
    // read rather than at every program's start-up.
    if FIND_OBJECT.load(Ordering::Acquire) == 0 && !LOOKED_UP_AT_START.load(Ordering::Acquire) {
        look_up();
    }
    if FIND_OBJECT.load(Ordering::Acquire) <= NONE {
        return Ok(0);
    }
    let Some(base) = read_into_memory(&fd, len as usize) else {
        return Err("the unwind file cannot be read");
    };
    // SAFETY: the copy, `len` bytes, read only, ours until unmapped.
    let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, len as usize) };
    let header = process::unwind_file_header(bytes)
        // SAFETY: getpid has no preconditions.
        .filter(|h| h.pid == unsafe { libc::getpid() } as u32);
    let opened = header.map_or(0, |h| {
        let (strings, size) = (h.strings_offset, h.strings_size);
        let string = |o: u32| {
            let s = bytes.get(strings as usize..(strings + size) as usize)?.get(o as usize..)?;
            s.get(..s.iter().position(|&c| c == 0)?)
        };
        let dir = base as u64 + h.dir_offset;
        open_entries(FILE_OWNER, dir, h.count, dir + h.dir_size, string)
    });
    if opened == 0 {
        // SAFETY: our mapping, which no slot names.
        unsafe { libc::munmap(base, len as usize) };
    }
    if header.is_none() { Err("the unwind file is damaged or not this process's") } else { Ok(opened) }
}

/// The first `len` bytes of the open file in a fresh anonymous mapping,
/// made read-only; `None` (and nothing left mapped) if it reads short.
fn read_into_memory(fd: &sys::Fd, len: usize) -> Option<*mut libc::c_void> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: a fresh private anonymous mapping.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    if base == libc::MAP_FAILED {
        return None;
    }
    let mut done = 0usize;
    while done < len {
        // SAFETY: within the mapping above.
        let n = unsafe { libc::pread(fd.0, (base as *mut u8).add(done).cast(), len - done, done as i64) };
        if n > 0 {
            done += n as usize;
        } else if n == 0 || sys::errno() != libc::EINTR {
            break;
        }
    }
    // SAFETY: our mapping.
    if done < len || unsafe { libc::mprotect(base, len, libc::PROT_READ) } != 0 {
        // SAFETY: our mapping, which nothing names.
        unsafe { libc::munmap(base, len) };
        return None;
    }
    Some(base)
}

/// The load bias of the mapped library whose path's file name is that of
/// `path` and whose build-id is `id`, and where that build-id lies in
/// memory, from its ELF header and program headers in memory (only that
/// library's mappings are read).
fn loaded_bias(path: &[u8], id: &[u8]) -> Option<(u64, u64)> {
    fn base(p: &[u8]) -> &[u8] {
        p.rsplit(|&c| c == b'/').next().unwrap_or_default()
    }
    let want = base(path);
    let mut found = None;
    sys::for_each_maps_line(|line| {
        let Some(sys::FileMapping { start, end, prot, offset, path: p, .. }) = sys::parse_maps_file(line) else {
            return true;
        };
        if offset != 0 || prot & libc::PROT_READ == 0 || base(p) != want {
            return true;
        }
        found = bias_if_build_id(start, end, id);
        found.is_none()
    });
    found
}

/// Reads `T` at `addr` if it lies within `[start, end)`.
fn read_in<T: Copy>(addr: u64, start: u64, end: u64) -> Option<T> {
    let last = addr.checked_add(size_of::<T>() as u64)?;
    // SAFETY: within a readable mapping of the process (caller).
    (addr >= start && last <= end).then(|| unsafe { std::ptr::read_unaligned(addr as *const T) })
}

/// The bias of the ELF file mapped from offset 0 at `[start, end)`, and
/// the address of its build-id, if its GNU build-id note (in that mapping)
/// is `id`.
fn bias_if_build_id(start: u64, end: u64, id: &[u8]) -> Option<(u64, u64)> {
    let ident: [u8; 8] = read_in(start, start, end)?;
    if ident.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let phoff: u64 = read_in(start + 32, start, end)?;
    let (phentsize, phnum): (u16, u16) = (read_in(start + 54, start, end)?, read_in(start + 56, start, end)?);
    if phentsize != 56 {
        return None;
    }
    let ph = |i: u16| -> Option<(u32, u64, u64, u64)> {
        let at = start.checked_add(phoff)?.checked_add(u64::from(i) * 56)?;
        Some((
            read_in(at, start, end)?,
            read_in(at + 8, start, end)?,
            read_in(at + 16, start, end)?,
            read_in(at + 32, start, end)?,
        ))
    };
    // The segment mapped from offset 0 gives the bias.
    let bias = (0..phnum)
        .filter_map(ph)
        .find(|&(t, off, _, _)| t == libc::PT_LOAD && off == 0)
        .map(|(_, _, vaddr, _)| start.wrapping_sub(vaddr))?;
    for (t, _, vaddr, size) in (0..phnum).filter_map(ph) {
        if t != libc::PT_NOTE {
            continue;
        }
        let (mut at, stop) = (bias.wrapping_add(vaddr), bias.wrapping_add(vaddr).saturating_add(size));
        while at + 12 <= stop {
            let (namesz, descsz, kind): (u32, u32, u32) =
                (read_in(at, start, end)?, read_in(at + 4, start, end)?, read_in(at + 8, start, end)?);
            let name = at + 12;
            let desc = name + u64::from(namesz).next_multiple_of(4);
            if kind == 3 && namesz == 4 && read_in::<[u8; 4]>(name, start, end)? == *b"GNU\0" {
                let n = descsz as usize;
                if n != id.len() || n > 20 {
                    return None;
                }
                let got: [u8; 20] = read_in(desc, start, end).or_else(|| {
                    // A short note at the mapping's end: byte by byte.
                    let mut b = [0u8; 20];
                    for (i, x) in b.iter_mut().enumerate().take(n) {
                        *x = read_in(desc + i as u64, start, end)?;
                    }
                    Some(b)
                })?;
                return (got.get(..n)? == id).then_some((bias, desc));
            }
            at = desc + u64::from(descsz).next_multiple_of(4);
        }
    }
    None
}
