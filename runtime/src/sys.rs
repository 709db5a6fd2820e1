//! System calls and logging usable from signal handlers: no allocation, no
//! locks, errno preserved by the callers that need it.

use std::ffi::CStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A fixed buffer for composing messages and paths without allocating.
pub struct Buf<const N: usize> {
    data: [u8; N],
    len: usize,
}

impl<const N: usize> Buf<N> {
    pub const fn new() -> Self {
        Buf { data: [0; N], len: 0 }
    }
    pub fn push(&mut self, s: &[u8]) -> &mut Self {
        // Keep one byte for the NUL terminator.
        let room = self.data.get_mut(self.len..N.saturating_sub(1)).unwrap_or_default();
        let n = s.len().min(room.len());
        for (d, &c) in room.iter_mut().zip(s) {
            *d = c;
        }
        self.len += n;
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.push(s.as_bytes())
    }
    pub fn num(&mut self, mut v: u64) -> &mut Self {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        for d in digits.iter_mut().rev() {
            *d = b'0' + (v % 10) as u8;
            i -= 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(digits.get(i..).unwrap_or_default())
    }
    /// `v` as 16 lower-case hex digits.
    pub fn hex16(&mut self, v: u64) -> &mut Self {
        let mut digits = [0u8; 16];
        for (i, d) in digits.iter_mut().enumerate() {
            let nibble = (v >> (60 - 4 * i)) & 0xf;
            *d = if nibble < 10 { b'0' + nibble as u8 } else { b'a' + nibble as u8 - 10 };
        }
        self.push(&digits)
    }
    pub fn bytes(&self) -> &[u8] {
        self.data.get(..self.len).unwrap_or_default()
    }
    /// The contents as a NUL-terminated C string.
    pub fn c_str(&mut self) -> &CStr {
        // `push` keeps len < N, so the terminator fits.
        let Some(nul) = self.data.get_mut(self.len) else { return c"" };
        *nul = 0;
        self.data.get(..=self.len).and_then(|b| CStr::from_bytes_with_nul(b).ok()).unwrap_or(c"")
    }
}

impl<const N: usize> Default for Buf<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// Writes one line to stderr: `alloctramp: <msg>\n`, with raw write(2).
pub fn log(msg: &[u8]) {
    let mut b = Buf::<512>::new();
    b.str("alloctramp: ").push(msg).str("\n");
    write_all(2, b.bytes());
}

pub fn write_all(fd: i32, mut data: &[u8]) {
    while !data.is_empty() {
        // SAFETY: writing from a valid buffer of the given length.
        let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
        if n <= 0 {
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            return;
        }
        data = data.get(n as usize..).unwrap_or_default();
    }
}

/// A path (up to 255 bytes) that signal handlers read: words written and
/// read atomically, the length published last.
pub struct PathCell {
    bytes: [AtomicU64; 32],
    len: AtomicUsize,
}

impl PathCell {
    pub const fn new() -> Self {
        PathCell { bytes: [const { AtomicU64::new(0) }; 32], len: AtomicUsize::new(0) }
    }
    pub fn set(&self, p: &[u8]) {
        let n = p.len().min(255);
        for (i, chunk) in self.bytes.iter().enumerate() {
            let mut w = [0u8; 8];
            for (k, b) in w.iter_mut().enumerate() {
                *b = p.get(i * 8 + k).copied().filter(|_| i * 8 + k < n).unwrap_or(0);
            }
            chunk.store(u64::from_le_bytes(w), Ordering::Relaxed);
        }
        self.len.store(n, Ordering::Release);
    }
    pub fn get(&self) -> Buf<256> {
        let n = self.len.load(Ordering::Acquire);
        let mut raw = [0u8; 256];
        for (w, chunk) in raw.chunks_exact_mut(8).zip(&self.bytes) {
            w.copy_from_slice(&chunk.load(Ordering::Relaxed).to_le_bytes());
        }
        let mut b = Buf::new();
        b.push(raw.get(..n).unwrap_or(&raw));
        b
    }
}

/// A descriptor closed when dropped.
pub struct Fd(pub i32);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: the descriptor was opened by its owner and is closed once.
        unsafe { libc::close(self.0) };
    }
}

pub fn errno() -> i32 {
    // SAFETY: __errno_location returns the calling thread's errno.
    unsafe { *libc::__errno_location() }
}

pub fn set_errno(v: i32) {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = v }
}

/// Saves errno for the lifetime of the guard (signal handlers).
pub struct ErrnoGuard(i32);

impl ErrnoGuard {
    pub fn new() -> Self {
        ErrnoGuard(errno())
    }
}

impl Drop for ErrnoGuard {
    fn drop(&mut self) {
        set_errno(self.0)
    }
}

/// Reads up to `buf.len()` bytes of a small file; `None` if it cannot be
/// opened. Refuses symlinks.
pub fn read_small_file(path: &CStr, buf: &mut [u8]) -> Option<usize> {
    // SAFETY: path is NUL-terminated; the buffer is valid for writes.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC);
        if fd < 0 {
            return None;
        }
        let mut total = 0usize;
        while total < buf.len() {
            let n = libc::read(fd, buf.as_mut_ptr().add(total).cast(), buf.len() - total);
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            if n <= 0 {
                break;
            }
            total += n as usize;
        }
        libc::close(fd);
        Some(total)
    }
}

/// membarrier(2) commands.
const MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE: i32 = 1 << 5;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_SYNC_CORE: i32 = 1 << 6;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: i32 = 1 << 3;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: i32 = 1 << 4;

/// Which membarrier serializes every thread of the process.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Barrier {
    SyncCore,
    /// The expedited barrier interrupts every CPU running a thread of the
    /// process; on x86 the return from that interrupt serializes the core.
    Expedited,
    None,
}

fn membarrier(cmd: i32) -> i64 {
    // SAFETY: membarrier takes (cmd, flags, cpu_id) and touches no memory.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) }
}

/// The barrier registered at start-up (0: none, 1: sync-core, 2: expedited).
static BARRIER: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Registers for expedited barriers (at start-up).
pub fn register_barrier() {
    let b = if membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_SYNC_CORE) == 0 {
        1
    } else if membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 {
        2
    } else {
        0
    };
    BARRIER.store(b, std::sync::atomic::Ordering::Release);
}

/// The barrier that serializes every thread of this process.
pub fn barrier() -> Barrier {
    match BARRIER.load(std::sync::atomic::Ordering::Acquire) {
        1 => Barrier::SyncCore,
        2 => Barrier::Expedited,
        _ => Barrier::None,
    }
}

/// Serializes every thread of the process.
pub fn serialize(b: Barrier) -> bool {
    match b {
        Barrier::SyncCore => membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_SYNC_CORE) == 0,
        Barrier::Expedited => membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0,
        Barrier::None => false,
    }
}

/// A clock's time in nanoseconds.
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    // SAFETY: clock_gettime writes the timespec.
    unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(clock, &mut ts);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

pub fn now_secs() -> u64 {
    // SAFETY: time(NULL) has no memory effects.
    unsafe { libc::time(std::ptr::null_mut()) as u64 }
}

/// Waits while the shared futex word holds `expected` (returns at once if
/// it does not; also on a spurious wake-up or a signal).
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32) {
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 with no timeout. Not
    // FUTEX_PRIVATE_FLAG: requesters in other processes wake it through
    // their own mapping of the same file.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, std::ptr::null::<libc::timespec>());
    }
}

/// [`futex_wait`], for at most `ns` nanoseconds.
pub fn futex_wait_for(word: &std::sync::atomic::AtomicU32, expected: u32, ns: u64) {
    let ts = libc::timespec { tv_sec: (ns / 1_000_000_000) as libc::time_t, tv_nsec: (ns % 1_000_000_000) as i64 };
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 with a relative timeout.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec);
    }
}

/// A function a higher layer gives a lower one at start-up (so that the
/// lower one calls up without importing it). Safe in signal context.
pub struct Hook(std::sync::atomic::AtomicUsize);

impl Hook {
    pub const fn new() -> Hook {
        Hook(std::sync::atomic::AtomicUsize::new(0))
    }
    pub fn set(&self, f: fn()) {
        self.0.store(f as usize, std::sync::atomic::Ordering::Release);
    }
    /// Calls the function, if one was set.
    pub fn call(&self) {
        let f = self.0.load(std::sync::atomic::Ordering::Acquire);
        if f != 0 {
            // SAFETY: only ever set from a `fn()` by `set`.
            unsafe { std::mem::transmute::<usize, fn()>(f)() };
        }
    }
}

/// The disposition of signal `sig` (a system call: safe in signal context).
pub fn disposition(sig: i32) -> Option<libc::sigaction> {
    // SAFETY: queries the disposition into a zeroed sigaction.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(sig, std::ptr::null(), &mut cur) == 0).then_some(cur)
    }
}

/// How many threads the process has: the entries of `/proc/self/task`,
/// read with a fixed buffer (safe in signal context; about a third of the
/// time of a process's first read of `/proc/self/stat`, whose other fields
/// the kernel computes too). None if it cannot be read (no /proc).
pub fn threads() -> Option<u64> {
    let mut n = 0;
    for_each_dir_entry("/proc/self/task", |_| n += 1).then_some(n)
}

/// Every signal blocked on this thread while it lives; the mask it
/// replaced comes back when it is dropped. Safe in signal context.
pub struct SignalsBlocked(libc::sigset_t);

impl SignalsBlocked {
    pub fn new() -> SignalsBlocked {
        // SAFETY: plain signal-mask calls on local, initialized sets.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            SignalsBlocked(old)
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: restores the mask `new` saved.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// Calls `f(start, end, prot)` for each mapping of the process, in address
/// order, from `/proc/self/maps` (read with a fixed buffer: safe in signal
/// context). `f` returns false to stop. Returns false if the file could
/// not be read.
pub fn for_each_mapping(mut f: impl FnMut(u64, u64, i32) -> bool) -> bool {
    for_each_maps_line(|line| match parse_maps_line(line) {
        Some((start, end, prot)) => f(start, end, prot),
        None => true,
    })
}

/// The name of every entry of directory `dir` (not `.` and `..`), read
/// with getdents64 on a descriptor of its own. Unlike `std::fs::read_dir`,
/// whose `closedir` aborts the process when the descriptor was closed
/// underneath it, it tolerates a program that closes every descriptor
/// (as daemons do) while it reads: the listing then just ends. Returns
/// false if the directory could not be opened.
pub fn for_each_dir_entry(dir: &str, mut f: impl FnMut(&[u8])) -> bool {
    let mut path = Buf::<4096>::new();
    path.str(dir);
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libc::open(path.c_str().as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: getdents64 fills at most the buffer's length.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), buf.len()) };
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        if n <= 0 {
            break;
        }
        let mut at = 0usize;
        // struct linux_dirent64: d_ino u64, d_off i64, d_reclen u16,
        // d_type u8, then the NUL-terminated name.
        while let Some(rec) = buf.get(at..n as usize) {
            let (Some(&lo), Some(&hi)) = (rec.get(16), rec.get(17)) else { break };
            let len = usize::from(u16::from_ne_bytes([lo, hi]));
            let Some(name) = rec.get(19..len.max(19)) else { break };
            if len == 0 {
                break;
            }
            let name = name.split(|&c| c == 0).next().unwrap_or_default();
            if name != b"." && name != b".." {
                f(name);
            }
            at += len;
        }
    }
    // SAFETY: our descriptor (an error, if the program closed it, is fine).
    unsafe { libc::close(fd) };
    true
}

/// Every line of `/proc/self/maps` (without its newline; a line longer
/// than the buffer is cut), as [`for_each_mapping`] reads them.
pub fn for_each_maps_line(mut f: impl FnMut(&[u8]) -> bool) -> bool {
    // SAFETY: a NUL-terminated path; reads into a local buffer.
    let fd = unsafe { libc::open(c"/proc/self/maps".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    let mut buf = [0u8; 4096];
    let mut have = 0usize;
    // Skipping the rest of a line longer than the buffer.
    let mut skipping = false;
    let mut ok = true;
    'read: loop {
        // SAFETY: reading into the free part of the buffer.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().add(have).cast(), buf.len() - have) };
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        if n < 0 {
            ok = false;
            break;
        }
        if n == 0 {
            break;
        }
        have += n as usize;
        let mut at = 0;
        while let Some(nl) = buf.get(at..have).and_then(|b| b.iter().position(|&c| c == b'\n')) {
            let line = buf.get(at..at + nl).unwrap_or_default();
            at += nl + 1;
            if std::mem::take(&mut skipping) {
                continue;
            }
            if !f(line) {
                break 'read;
            }
        }
        buf.copy_within(at..have, 0);
        have -= at;
        if have == buf.len() {
            // A line longer than the buffer (a very long path): its
            // beginning holds the addresses.
            if !f(buf.get(..have).unwrap_or_default()) {
                break;
            }
            have = 0;
            skipping = true;
        }
    }
    // SAFETY: closing the descriptor opened above.
    unsafe { libc::close(fd) };
    ok
}

/// Makes the page of `word` present and writable before it is read then
/// written. The first read of an untouched anonymous page maps the shared
/// zero page, and the write after it faults again to replace that mapping,
/// which the kernel then flushes from the TLB of every CPU running one of
/// the process's threads (an interrupt to each, waited for). A locked add
/// of zero is one write fault, and changes nothing.
#[inline(always)]
pub fn touch_for_write(word: &std::sync::atomic::AtomicU32) {
    // SAFETY: `word` is a valid, writable, aligned atomic: an atomic add
    // of zero leaves its value as it is for every other access.
    unsafe { std::arch::asm!("lock add dword ptr [{0}], 0", in(reg) word.as_ptr(), options(nostack)) };
}

/// The lowest address of the loaded object whose segments hold `addr`
/// (as `dladdr`'s `dli_fbase`, without the symbol search that makes
/// `dladdr` scan the object's whole symbol table).
pub fn object_of(addr: usize) -> Option<usize> {
    struct Find {
        addr: u64,
        base: Option<usize>,
    }
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut libc::c_void) -> i32 {
        // SAFETY: dl_iterate_phdr passes a valid info, and `data` is the
        // `Find` below, alive for the call.
        let (info, find) = unsafe { (&*info, &mut *(data as *mut Find)) };
        if info.dlpi_phdr.is_null() {
            return 0;
        }
        // SAFETY: dlpi_phnum program headers at dlpi_phdr.
        let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        let loads = || phdrs.iter().filter(|p| p.p_type == libc::PT_LOAD);
        let holds = |p: &libc::Elf64_Phdr| {
            let start = info.dlpi_addr.wrapping_add(p.p_vaddr);
            find.addr >= start && find.addr - start < p.p_memsz
        };
        if !loads().any(holds) {
            return 0;
        }
        let lowest = loads().map(|p| p.p_vaddr & !(p.p_align.max(1) - 1)).min().unwrap_or(0);
        find.base = Some(info.dlpi_addr.wrapping_add(lowest) as usize);
        1
    }
    let mut find = Find { addr: addr as u64, base: None };
    // SAFETY: the callback only reads what dl_iterate_phdr hands it and
    // writes `find`.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut find as *mut Find).cast()) };
    find.base
}

/// A mapping of a file, from a line of `/proc/self/maps`.
pub struct FileMapping<'a> {
    pub start: u64,
    pub end: u64,
    pub prot: i32,
    /// `p` (copy-on-write) rather than `s`.
    pub private: bool,
    /// Offset in the file of `start`.
    pub offset: u64,
    /// The file's inode.
    pub inode: u64,
    /// The file's path as the kernel shows it (it may end in
    /// ` (deleted)`); empty for a mapping of no file.
    pub path: &'a [u8],
}

/// Reads a line of `/proc/self/maps` in full: `start-end perms offset
/// dev inode path`.
pub fn parse_maps_file(line: &[u8]) -> Option<FileMapping<'_>> {
    let (start, end, prot) = parse_maps_line(line)?;
    let mut fields = line.splitn(6, |&c| c == b' ');
    let perms = fields.nth(1)?;
    let offset = fields.next()?;
    let (dev, inode) = (fields.next()?, fields.next()?);
    let path = fields.next().unwrap_or_default();
    let first = path.iter().position(|&c| c != b' ').unwrap_or(path.len());
    let number = |s: &[u8], radix: u32| -> Option<u64> {
        if s.is_empty() || s.len() > 20 {
            return None;
        }
        s.iter().try_fold(0u64, |v, &c| {
            v.checked_mul(u64::from(radix))?.checked_add(u64::from((c as char).to_digit(radix)?))
        })
    };
    // The device (`major:minor`, of the file system) is checked for form only.
    let colon = dev.iter().position(|&c| c == b':')?;
    number(dev.get(..colon)?, 16)?;
    number(dev.get(colon + 1..)?, 16)?;
    Some(FileMapping {
        start,
        end,
        prot,
        private: perms.get(3) == Some(&b'p'),
        offset: number(offset, 16)?,
        inode: number(inode, 10)?,
        path: path.get(first..).unwrap_or_default(),
    })
}

fn parse_maps_line(line: &[u8]) -> Option<(u64, u64, i32)> {
    let hex = |s: &[u8]| -> Option<u64> {
        if s.is_empty() || s.len() > 16 {
            return None;
        }
        s.iter().try_fold(0u64, |v, &c| Some(v << 4 | u64::from((c as char).to_digit(16)?)))
    };
    let dash = line.iter().position(|&c| c == b'-')?;
    let space = line.iter().position(|&c| c == b' ')?;
    let start = hex(line.get(..dash)?)?;
    let end = hex(line.get(dash + 1..space)?)?;
    let &[r, w, x] = line.get(space + 1..space + 4)? else { return None };
    let mut prot = 0;
    if r == b'r' {
        prot |= libc::PROT_READ;
    }
    if w == b'w' {
        prot |= libc::PROT_WRITE;
    }
    if x == b'x' {
        prot |= libc::PROT_EXEC;
    }
    Some((start, end, prot))
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn directory_entries_are_every_name_but_the_dots() {
        let dir = std::env::temp_dir().join(format!("alloctramp-dirents-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut want: Vec<String> =
            (0..300).map(|i| format!("{i}.counters-with-a-long-name-{}", "x".repeat(i % 40))).collect();
        for n in &want {
            std::fs::write(dir.join(n), b"").unwrap();
        }
        let mut got = Vec::new();
        assert!(for_each_dir_entry(dir.to_str().unwrap(), |n| got.push(String::from_utf8(n.to_vec()).unwrap())));
        got.sort();
        want.sort();
        assert_eq!(got, want, "more than one getdents64 buffer's worth");
        assert!(!for_each_dir_entry(dir.join("none").to_str().unwrap(), |_| {}));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn maps_lines_give_offset_inode_and_path() {
        let l = b"7f0e4c000000-7f0e4c021000 r-xp 00002000 fe:01 1234     /usr/lib/x86_64-linux-gnu/libc.so.6";
        let m = parse_maps_file(l).unwrap();
        assert_eq!((m.start, m.end, m.offset), (0x7f0e4c000000, 0x7f0e4c021000, 0x2000));
        assert_eq!((m.prot, m.private), (libc::PROT_READ | libc::PROT_EXEC, true));
        assert_eq!(m.inode, 1234);
        assert_eq!(m.path, b"/usr/lib/x86_64-linux-gnu/libc.so.6");
        let anon = parse_maps_file(b"7ffd1000-7ffd2000 rw-s 00000000 00:00 0 ").unwrap();
        assert_eq!((anon.path, anon.private), (&b""[..], false));
        assert_eq!(parse_maps_file(b"7ffd1000-7ffd2000 rw-p 00000000 00:00 0").unwrap().path, b"");
        let spaced = parse_maps_file(b"1000-2000 r-xp 0 08:01 5 /tmp/a b (deleted)").unwrap();
        assert_eq!(spaced.path, b"/tmp/a b (deleted)");
        assert!(parse_maps_file(b"1000-2000 r-xp 0 0801 5 /x").is_none(), "a device without a colon");
        // Every mapping of this process reads, and one is this test's code.
        let here = maps_lines_give_offset_inode_and_path as *const () as u64;
        let mut code = None;
        assert!(for_each_maps_line(|l| {
            let m = parse_maps_file(l).unwrap();
            if (m.start..m.end).contains(&here) {
                code = Some((m.inode, m.path.to_vec()));
            }
            true
        }));
        let (inode, path) = code.unwrap();
        let meta = std::fs::metadata(std::str::from_utf8(&path).unwrap()).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::ino(&meta), inode);
    }

    #[test]
    fn objects_of_addresses_and_writes_that_change_nothing() {
        let (malloc, free) = (libc::malloc as *const () as usize, libc::free as *const () as usize);
        let here = objects_of_addresses_and_writes_that_change_nothing as *const () as usize;
        let libc_base = object_of(malloc).unwrap();
        assert_eq!(object_of(free), Some(libc_base));
        assert!(object_of(here).is_some_and(|b| b != libc_base && b <= here));
        assert_eq!(object_of(0), None);
        // A word of a fresh page, touched: its page is present (written,
        // not read as the zero page), and its value stays.
        // SAFETY: a fresh private anonymous page of our own.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: 4-aligned, inside the page.
        let w = unsafe { &*(p.cast::<u8>().add(8) as *const std::sync::atomic::AtomicU32) };
        touch_for_write(w);
        let entry = {
            let f = std::fs::File::open("/proc/self/pagemap").unwrap();
            let mut e = [0u8; 8];
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut e, p as u64 / 4096 * 8).unwrap();
            u64::from_le_bytes(e)
        };
        assert!(entry & 1 << 63 != 0, "present after the touch alone: {entry:#x}");
        assert_eq!(w.load(std::sync::atomic::Ordering::Relaxed), 0);
        w.store(7, std::sync::atomic::Ordering::Relaxed);
        touch_for_write(w);
        assert_eq!(w.load(std::sync::atomic::Ordering::Relaxed), 7);
        // SAFETY: our mapping.
        unsafe { libc::munmap(p, 4096) };
    }

    #[test]
    fn thread_counts() {
        assert!(threads().is_some_and(|n| n >= 1));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            ready_tx.send(()).unwrap();
            rx.recv().unwrap();
        });
        ready_rx.recv().unwrap();
        // (The test harness runs other tests on threads of their own.)
        assert!(threads().is_some_and(|n| n >= 2));
        tx.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn maps_lines() {
        assert_eq!(
            parse_maps_line(b"55d0c0a00000-55d0c0a21000 r-xp 00001000 fd:01 123 /usr/bin/x"),
            Some((0x55d0c0a00000, 0x55d0c0a21000, libc::PROT_READ | libc::PROT_EXEC))
        );
        assert_eq!(
            parse_maps_line(b"7ffd1000-7ffd2000 rw-p 00000000 00:00 0 [stack]"),
            Some((0x7ffd1000, 0x7ffd2000, 3))
        );
        assert_eq!(parse_maps_line(b"garbage"), None);
    }

    #[test]
    fn own_mappings_are_listed_in_order() {
        let here = own_mappings_are_listed_in_order as *const () as u64;
        let mut last = 0;
        let mut found = None;
        assert!(for_each_mapping(|s, e, p| {
            assert!(s >= last && e > s);
            last = e;
            if (s..e).contains(&here) {
                found = Some(p);
            }
            true
        }));
        assert_eq!(found.map(|p| p & libc::PROT_EXEC), Some(libc::PROT_EXEC));
    }
}
