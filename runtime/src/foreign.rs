//! Unwind rows an executable carries for the libraries it needs (see
//! `layout::ForeignUnwind`), so that callers capture goes on through a
//! library's frames although the library is not patched: a chain from a
//! callback called by the C library's `qsort`, or from a thread, reaches
//! the code that called into the library.
//!
//! Rows are opened when callers capture first needs them, for the loaded
//! library with the carried path's file name and the same build-id; they
//! live in the executable's read-only segment, which is never unmapped,
//! and describe a library the executable needs, which is never unloaded
//! before it. Everything here runs in signal context too: reads of memory
//! the process's own maps name, atomics, no allocation.
//!
//! Also the row lookup and checks that a patched module's own rows share.

use crate::sys;
use alloctramp_trampolines::layout::{self, ForeignUnwind, UNWIND_ROW_SIZE, UnwindRow};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Libraries whose rows can be open at once.
const MAX_FOREIGN: usize = 64;

struct Foreign {
    /// The registry slot of the executable carrying the rows, plus one
    /// (0: free).
    owner: AtomicUsize,
    rows: AtomicUsize,
    count: AtomicU32,
    bias: AtomicU64,
    code_lo: AtomicU64,
    /// Published last (0: not open).
    code_hi: AtomicU64,
}

static FOREIGN: [Foreign; MAX_FOREIGN] = [const {
    Foreign {
        owner: AtomicUsize::new(0),
        rows: AtomicUsize::new(0),
        count: AtomicU32::new(0),
        bias: AtomicU64::new(0),
        code_lo: AtomicU64::new(0),
        code_hi: AtomicU64::new(0),
    }
}; MAX_FOREIGN];

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

/// The row at `pc` of an open library, if one covers it.
pub fn row(pc: u64) -> Option<UnwindRow> {
    FOREIGN.iter().find_map(|f| {
        let hi = f.code_hi.load(Ordering::Acquire);
        let lo = f.code_lo.load(Ordering::Relaxed);
        if pc < lo || pc >= hi {
            return None;
        }
        let (p, n) = (f.rows.load(Ordering::Relaxed) as *const UnwindRow, f.count.load(Ordering::Relaxed) as usize);
        // SAFETY: checked by `open` before it published code_hi; in the
        // owner's read-only segment, mapped for the process's life.
        unsafe { row_at(p, n, f.bias.load(Ordering::Relaxed), lo, pc) }
    })
}

/// Opens the rows an executable (registry slot `owner`) carries: `count`
/// directory entries at `dir`, within memory that ends at `end`; `string`
/// gives the table's string at an offset.
pub fn open<'a>(owner: usize, dir: u64, count: u32, end: u64, string: impl Fn(u32) -> Option<&'a [u8]>) {
    for k in 0..u64::from(count) {
        let at = dir + k * size_of::<ForeignUnwind>() as u64;
        if at + size_of::<ForeignUnwind>() as u64 > end {
            break;
        }
        // SAFETY: within the owner's read-only segment (checked above).
        let e: ForeignUnwind = unsafe { std::ptr::read_unaligned(at as *const ForeignUnwind) };
        let rows = dir + u64::from(e.rows_offset);
        let (n, blocks) = (e.count as usize, e.blocks as usize);
        let size = n as u64 * UNWIND_ROW_SIZE as u64 + blocks as u64 * 4;
        if !rows.is_multiple_of(4) || rows.checked_add(size).is_none_or(|e| e > end) || e.build_id_len as usize > 20 {
            continue;
        }
        let Some(name) = string(e.name) else { continue };
        let id = e.build_id.get(..usize::from(e.build_id_len)).unwrap_or_default();
        let Some(bias) = loaded_bias(name, id) else { continue };
        // SAFETY: within the owner's read-only segment (checked above).
        let (r, index) = unsafe {
            (
                std::slice::from_raw_parts(rows as *const UnwindRow, n),
                std::slice::from_raw_parts((rows as *const UnwindRow).add(n) as *const u32, blocks),
            )
        };
        let Some((lo, hi)) = rows_are_sound(r, index, bias) else { continue };
        // One library's rows once (several owners may carry them).
        if FOREIGN.iter().any(|f| f.code_hi.load(Ordering::Acquire) != 0 && f.code_lo.load(Ordering::Relaxed) == lo) {
            continue;
        }
        let Some(f) = FOREIGN
            .iter()
            .find(|f| f.owner.compare_exchange(0, owner + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok())
        else {
            break;
        };
        f.rows.store(rows as usize, Ordering::Relaxed);
        f.count.store(n as u32, Ordering::Relaxed);
        f.bias.store(bias, Ordering::Relaxed);
        f.code_lo.store(lo, Ordering::Relaxed);
        f.code_hi.store(hi, Ordering::Release);
    }
}

/// Closes the rows an executable carried (its unloading, which an
/// executable sees only at exit).
pub fn close(owner: usize) {
    for f in &FOREIGN {
        if f.owner.load(Ordering::Acquire) == owner + 1 {
            f.code_hi.store(0, Ordering::Release);
            f.owner.store(0, Ordering::Release);
        }
    }
}

/// The load bias of the mapped library whose path's file name is that of
/// `path` and whose build-id is `id`, from its ELF header and program
/// headers in memory (only that library's mappings are read: the
/// executable needs it, so it stays loaded).
fn loaded_bias(path: &[u8], id: &[u8]) -> Option<u64> {
    let base = |p: &[u8]| p.rsplit(|&c| c == b'/').next().map(<[u8]>::to_vec).unwrap_or_default();
    let want = base(path);
    let mut found = None;
    sys::for_each_maps_line(|line| {
        let Some((start, end, prot, offset, p)) = sys::parse_maps_file_line(line) else { return true };
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

/// The bias of the ELF file mapped from offset 0 at `[start, end)`, if its
/// GNU build-id note (in that mapping) is `id`.
fn bias_if_build_id(start: u64, end: u64, id: &[u8]) -> Option<u64> {
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
                return (got.get(..n)? == id).then_some(bias);
            }
            at = desc + u64::from(descsz).next_multiple_of(4);
        }
    }
    None
}
