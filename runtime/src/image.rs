//! Switching a module on at start-up by mapping one of its switched images
//! over its code (`layout::Image`).
//!
//! Writing a site copies the page it is on, and a program's sites are on
//! most of its code pages: switching git on copies 609 of its 654 code
//! pages in every process it starts, which costs more than the rest of a
//! short command's profiling. An image is a copy of the patched file with
//! its sites switched, written beside it by `alloctramp patch`: one whose
//! sites jump to their trampolines' start (live tracking), one whose sites
//! jump to the entry that only counts. Its pages are in the page cache
//! once, shared by every process that maps them, like the file's own.
//!
//! The image is used only when it is the module's code with its sites
//! switched, checked without reading the code (reading both would cost a
//! third of what the image saves):
//!
//! * it is the image of the file mapped: the file at the mapping's path
//!   has the mapped inode, and the image has its size and its modification
//!   time to the nanosecond (`patch` gives both files one time);
//! * the image's site table is the module's, byte for byte (the same
//!   original file, whose build-id the table holds, the same sites,
//!   trampolines and entries), and the image holds the jumps at its first
//!   and last sites;
//! * it is a regular file that neither group nor others may write, owned
//!   by root, the process's user or the owner of the module's file (who
//!   can change the code the process runs either way), opened without
//!   following a symbolic link;
//! * every page of the code is still the file's (`/proc/self/pagemap`):
//!   nothing, such as a debugger's breakpoint, changed it in memory;
//! * every site wants the image's jump: to its trampoline's start (live
//!   tracking) or to its counting entry (counting only), with no trace,
//!   callers capture or fault injection.
//!
//! It is then mapped privately at a free address with the code's
//! protection and moved over the code with one `mremap`. Anything else,
//! and the sites are written as before. Only a switch on made by a thread
//! alone in the process with its signals blocked, outside a signal handler
//! (at start-up, or as a library loads before the program starts a
//! thread), maps an image; `/proc/self/maps` then names the image for that
//! range (same file name, same offsets, same build-id), so profilers that
//! read it still find the code's symbols.

use crate::sys::{self, Buf};
use alloctramp_trampolines::layout::{Image, PAGE, Table};

/// The module's code mapping: the one private, read-and-execute mapping
/// of a file that holds all its sites.
struct Code {
    start: u64,
    end: u64,
    offset: u64,
    inode: u64,
    path: Buf<4096>,
}

/// Finds the mapping that holds `[lo, hi)`, if it is one mapping of a
/// file, private, readable and executable and not writable.
fn code_mapping(lo: u64, hi: u64) -> Option<Code> {
    let mut found: Option<Code> = None;
    let mut fits = true;
    let read = sys::for_each_maps_line(|line| {
        let Some(f) = sys::parse_maps_file(line) else { return true };
        if f.end <= lo {
            return true;
        }
        if f.start >= hi {
            return false;
        }
        let usable = found.is_none()
            && f.start <= lo
            && f.end >= hi
            && f.prot == libc::PROT_READ | libc::PROT_EXEC
            && f.private
            && f.path.first() == Some(&b'/')
            && !f.path.ends_with(b" (deleted)")
            && f.path.len() < 3000;
        if !usable {
            fits = false;
            return false;
        }
        let mut path = Buf::new();
        path.push(f.path);
        found = Some(Code { start: f.start, end: f.end, offset: f.offset, inode: f.inode, path });
        true
    });
    if read && fits { found } else { None }
}

/// The path of the image `image` of the file at `path`:
/// `DIR/IMAGE-DIR/NAME`.
fn image_path(path: &[u8], image: Image) -> Option<Buf<4096>> {
    let slash = path.iter().rposition(|&c| c == b'/')?;
    let (dir, name) = (path.get(..slash)?, path.get(slash + 1..)?);
    let mut b = Buf::new();
    b.push(dir).push(b"/").str(image.dir()).push(b"/").push(name);
    (b.bytes().len() == dir.len() + image.dir().len() + 2 + name.len() && !name.is_empty()).then_some(b)
}

/// Whether every page of `[start, end)` that is in memory is still a page
/// of the mapped file (`/proc/self/pagemap`: present pages that are not
/// file pages, and swapped pages, were written in this process).
fn unwritten(start: u64, end: u64) -> bool {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const FILE: u64 = 1 << 61;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libc::open(c"/proc/self/pagemap".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    let fd = sys::Fd(fd);
    // (Two reads for git's 2.6 MB of code.)
    let mut entries = [0u64; 512];
    let mut page = start / PAGE;
    while page < end / PAGE {
        let n = ((end / PAGE - page) as usize).min(entries.len());
        // SAFETY: reads at most the buffer's size into it.
        let got = unsafe { libc::pread(fd.0, entries.as_mut_ptr().cast(), n * 8, (page * 8) as libc::off_t) };
        if got != (n * 8) as isize {
            return false;
        }
        if entries.iter().take(n).any(|&e| e & SWAPPED != 0 || (e & PRESENT != 0 && e & FILE == 0)) {
            return false;
        }
        page += n as u64;
    }
    true
}

/// A mapping this module made and still owns.
struct Scratch(u64, usize);

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.1 != 0 {
            // SAFETY: a mapping of our own, not used after this.
            unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1) };
        }
    }
}

/// Opens `path` read-only, with its status.
fn open_file(path: &mut Buf<4096>, flags: i32) -> Option<(sys::Fd, libc::stat)> {
    // SAFETY: a NUL-terminated path; fstat fills a plain struct.
    unsafe {
        let fd = libc::open(path.c_str().as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | flags);
        if fd < 0 {
            return None;
        }
        let fd = sys::Fd(fd);
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd.0, &mut st) == 0).then_some((fd, st))
    }
}

/// Maps `len` bytes of `fd` from `offset` privately, with `prot`, at a
/// free address (`at` 0) or over `[at, at + len)`.
fn map(fd: &sys::Fd, at: u64, len: usize, prot: i32, offset: u64) -> Option<u64> {
    let fixed = if at != 0 { libc::MAP_FIXED } else { 0 };
    // SAFETY: a private mapping of a file we hold open; with MAP_FIXED, the
    // caller replaces a range of its own (see `adopt`).
    let p = unsafe {
        libc::mmap(at as *mut libc::c_void, len, prot, libc::MAP_PRIVATE | fixed, fd.0, offset as libc::off_t)
    };
    (p != libc::MAP_FAILED).then_some(p as u64)
}

/// Maps the switched image `image` of the module whose sites `table` lists
/// (at run-time addresses `bias` plus theirs, within `span`) over its
/// code, if it has one. The caller wants every site with a trampoline to
/// jump to the image's entry ([`Image::site`]). Returns whether it did; on
/// false the code is the module's, its sites as they were (see the end).
///
/// # Safety
/// The caller is the process's only thread, with its signals blocked, and
/// the module stays mapped.
pub unsafe fn adopt(table: &Table, bias: u64, span: (u64, u64), image: Image) -> bool {
    let (lo, hi) = span;
    // The image's first and last jumps, which it must hold.
    let n = table.header.site_count as usize;
    let jump = |i: usize| table.get_site(i).and_then(|s| image.site(&s).map(|j| (s.addr, j)));
    let (Some(first), Some(last)) = ((0..n).find_map(jump), (0..n).rev().find_map(jump)) else { return false };
    let Some(mut code) = code_mapping(lo, hi) else { return false };
    let Some(mut path) = image_path(code.path.bytes(), image) else { return false };
    let len = (code.end - code.start) as usize;
    if code.start % PAGE != 0 || code.offset % PAGE != 0 || len == 0 || !unwritten(code.start, code.end) {
        return false;
    }
    let (Some((fd, img)), Some((module_fd, module))) =
        (open_file(&mut path, libc::O_NOFOLLOW), open_file(&mut code.path, 0))
    else {
        return false;
    };
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    // The file at the path is the one mapped. (Its inode: the device in
    // the maps line is the file system's, which on btrfs and overlayfs is
    // not the one stat gives.)
    let mapped = module.st_ino == code.inode;
    let same =
        img.st_size == module.st_size && img.st_mtime == module.st_mtime && img.st_mtime_nsec == module.st_mtime_nsec;
    let trusted = img.st_uid == 0 || img.st_uid == me || img.st_uid == module.st_uid;
    let safe = img.st_mode & libc::S_IFMT == libc::S_IFREG && img.st_mode & 0o022 == 0;
    let fits = u64::try_from(img.st_size).is_ok_and(|size| size >= code.offset + len as u64);
    if !(mapped && same && trusted && safe && fits) {
        return false;
    }
    // The image's site table is the module's, byte for byte: the same
    // original file (its build-id is in the table's header), sites,
    // trampolines and entries, so the same code with the same jumps. The
    // table follows the program headers in the segment that maps the file
    // from offset 0 at the ELF header (`layout::table_after_phdrs`).
    let bytes = table.bytes();
    let table_at = (bytes.as_ptr() as u64).wrapping_sub(bias.wrapping_add(table.header.ehdr_addr));
    let table_end = table_at.checked_add(bytes.len() as u64).filter(|&e| e <= img.st_size as u64);
    let Some(head_len) = table_end.map(|e| e.next_multiple_of(PAGE) as usize) else { return false };
    let Some(head) = map(&fd, 0, head_len, libc::PROT_READ, 0) else { return false };
    let head = Scratch(head, head_len);
    // SAFETY: `head_len` readable bytes of the image from its start, which
    // cover the table's range (`table_end`).
    let theirs = unsafe { std::slice::from_raw_parts((head.0 + table_at) as *const u8, bytes.len()) };
    if theirs != bytes {
        return false;
    }
    drop(head);
    let Some(at) = map(&fd, 0, len, libc::PROT_READ | libc::PROT_EXEC, code.offset) else { return false };
    drop(fd);
    let mut scratch = Scratch(at, len);
    let holds = |(addr, w): (u64, [u8; 5])| {
        let off = bias.wrapping_add(addr).wrapping_sub(code.start) as usize;
        // SAFETY: the site lies in the code mapping (`code_mapping`), so
        // its five bytes lie in the image's mapping of the same length.
        off.checked_add(5).is_some_and(|e| e <= len)
            && unsafe { std::ptr::read((at as *const u8).add(off) as *const [u8; 5]) } == w
    };
    if !holds(first) || !holds(last) {
        return false;
    }
    // SAFETY: moves our mapping over the module's code, which it equals
    // but for the sites' wanted jumps; this thread is the only one
    // (caller), so no code runs from the range meanwhile.
    let moved = unsafe {
        libc::mremap(
            at as *mut libc::c_void,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            code.start as *mut libc::c_void,
        )
    };
    if moved as u64 == code.start {
        scratch.1 = 0;
        return true;
    }
    // The kernel may fail after unmapping the target (out of memory for
    // its page tables): map the module's own code back, as it was mapped.
    // SAFETY: msync only asks whether the page is mapped.
    let gone = unsafe { libc::msync(code.start as *mut libc::c_void, PAGE as usize, libc::MS_ASYNC) } != 0;
    if gone && map(&module_fd, code.start, len, libc::PROT_READ | libc::PROT_EXEC, code.offset) != Some(code.start) {
        sys::log(b"the switched image could not replace a module's code, nor the module's code be mapped back");
        // SAFETY: the process cannot go on without that code.
        unsafe { libc::abort() };
    }
    false
}
