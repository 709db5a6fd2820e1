//! The per-process counters file (format in `alloctramp_trampolines::process`):
//! created at start-up (10 ms later in a process that starts with profiling
//! off) in a per-user directory, grown as modules join it
//! (when they first switch on, or at registration in a process that
//! profiled), its counter regions mapped over each module's counters. Every
//! byte the process writes through a mapping has its storage first
//! ([`reserve`]).

use crate::sys::{self, Buf, Fd};
use alloctramp_trampolines::layout::{PAGE, shard};
use alloctramp_trampolines::pod;
use alloctramp_trampolines::process::{self, ModuleSlot, PROC_HEADER_SIZE, ProcHeader};
use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};

pub type Path = Buf<256>;

/// The process file: its mapped header, how far it extends, and how to
/// find it again. No descriptor is held while the program runs: a program
/// may close every descriptor it did not open (daemons do) and get the
/// number back for a file of its own. The runtime reopens the file by path
/// when it must grow it, and checks that it is still the same file.
pub struct ProcFile {
    pub header: &'static ProcHeader,
    pub size: u64,
    path: Path,
    dev: u64,
    ino: u64,
}

/// Creates (or checks) the per-user directory: mode 0700, owned by us, not
/// a symlink.
pub fn ensure_dir(dir: &CStr) -> Result<(), &'static str> {
    // SAFETY: dir is NUL-terminated; stat is a plain out-parameter.
    unsafe {
        libc::mkdir(dir.as_ptr(), 0o700);
        let mut st: libc::stat = std::mem::zeroed();
        if libc::lstat(dir.as_ptr(), &mut st) != 0 {
            return Err("cannot create the counters directory");
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err("the counters directory is not a directory");
        }
        if st.st_uid != libc::geteuid() {
            return Err("the counters directory belongs to another user");
        }
        if st.st_mode & 0o077 != 0 {
            return Err("the counters directory is accessible to other users");
        }
    }
    Ok(())
}

/// `dir/name` as a NUL-terminated path.
pub fn path_in(dir: &[u8], name: &[u8]) -> Path {
    let mut p = Path::new();
    p.push(dir).str("/").push(name);
    p
}

fn pid_name(pid: u32, suffix: &str) -> Buf<32> {
    let mut b = Buf::<32>::new();
    b.num(u64::from(pid)).str(suffix);
    b
}

/// Creates a fresh file (replacing one left by an earlier process with the
/// same pid): 0600, no symlink followed, owned by us.
fn create_file(path: &CStr) -> Result<i32, &'static str> {
    // SAFETY: path is NUL-terminated.
    unsafe {
        libc::unlink(path.as_ptr());
        let fd = libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600,
        );
        if fd < 0 {
            return Err("cannot create the counters file");
        }
        Ok(fd)
    }
}

/// Gives the file storage for `len` bytes from `off`, growing it to at
/// least `off + len`. Every byte the process writes through a shared
/// mapping of the file must have its storage before the mapping is used: a
/// write to a page without it faults, and the kernel answers a fault it
/// cannot back (a full file system, a tmpfs at its size, a quota) with
/// SIGBUS, which would kill the program. Growing the file past the
/// process's file-size limit (`ulimit -f`) would send it SIGXFSZ, which
/// kills too: that is refused before the kernel is asked. On failure the
/// file is cut back to `off` (what was there before stays).
fn reserve(fd: i32, off: u64, len: u64) -> Result<(), &'static str> {
    let end = off.checked_add(len).ok_or("the counters file would be too large")?;
    within_limit(end)?;
    reserve_within(fd, off, len).inspect_err(|_| {
        // SAFETY: fd is the caller's open descriptor; shrinking back to
        // where the new region began.
        unsafe { libc::ftruncate(fd, off as i64) };
    })
}

/// Gives `len` bytes from `off` their storage, in a region no thread has
/// written yet (zeros are written where the file system cannot allocate).
/// The file keeps its size unless the region passes its end.
fn reserve_within(fd: i32, off: u64, len: u64) -> Result<(), &'static str> {
    let (Ok(start), Ok(n)) = (i64::try_from(off), i64::try_from(len)) else {
        return Err("the counters file would be too large");
    };
    // SAFETY: fd is the caller's open descriptor of the counters file.
    let r = unsafe { libc::fallocate(fd, 0, start, n) };
    let e = if r == 0 { 0 } else { sys::errno() };
    let e = if e == libc::EOPNOTSUPP { write_zeros(fd, off, len) } else { e };
    match e {
        0 => Ok(()),
        e => Err(no_space(e).unwrap_or("cannot reserve space for the counters file")),
    }
}

/// Whether the names of shared tables beside the process files in `dir`
/// (`DIR/tables/ID.sites.gc.PID.new`, the longest) fit a [`Path`] whole: a
/// name cut short would be another file's.
fn tables_fit(dir: &[u8]) -> bool {
    dir.len() + process::TABLES_DIR.len() + 48 <= 250
}

/// Writes all of `data` at `off`; the error number if it cannot.
fn write_at(fd: i32, data: &[u8], off: u64) -> Result<(), i32> {
    let mut done = 0usize;
    while let Some(rest) = data.get(done..).filter(|r| !r.is_empty()) {
        // SAFETY: fd is the caller's; pwrite reads `rest`.
        let n = unsafe { libc::pwrite(fd, rest.as_ptr().cast(), rest.len(), (off + done as u64) as i64) };
        if n <= 0 {
            return Err(if n < 0 { sys::errno() } else { libc::ENOSPC });
        }
        done += n as usize;
    }
    Ok(())
}

/// What error `e` of a write or a reservation says, when it says the file
/// system has no room.
fn no_space(e: i32) -> Option<&'static str> {
    match e {
        libc::ENOSPC => Some("no space left for the counters file"),
        libc::EDQUOT => Some("the disk quota leaves no space for the counters file"),
        libc::EFBIG => Some("the counters file would be too large for its file system"),
        _ => None,
    }
}

/// The runs of consecutive shards in `mask` (bit `s`: shard `s`), as
/// `(first, past the last)`, in order.
fn shard_runs(mask: u32) -> impl Iterator<Item = (u32, u32)> {
    let mut s = 0u32;
    std::iter::from_fn(move || {
        let rest = mask.checked_shr(s).unwrap_or(0);
        if s >= shard::COUNT || rest == 0 {
            return None;
        }
        let from = s + rest.trailing_zeros();
        let to = (from + (mask >> from).trailing_ones()).min(shard::COUNT);
        s = to;
        Some((from, to))
    })
}

/// Refuses a file size past the process's file-size limit (`ulimit -f`):
/// growing the file there would send SIGXFSZ.
fn within_limit(end: u64) -> Result<(), &'static str> {
    // SAFETY: getrlimit fills a plain struct.
    let limit = unsafe {
        let mut rl: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_FSIZE, &mut rl) == 0 { rl.rlim_cur } else { libc::RLIM_INFINITY }
    };
    if limit != libc::RLIM_INFINITY && end > limit {
        return Err("the counters file would pass the process's file-size limit (ulimit -f)");
    }
    Ok(())
}

/// Writes zeros over `len` bytes from `off` (a file system without
/// `fallocate`): the blocks are then the file's. Returns 0 or an errno.
fn write_zeros(fd: i32, off: u64, len: u64) -> i32 {
    static ZEROS: [u8; 4096] = [0; 4096];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(ZEROS.len() as u64) as usize;
        // SAFETY: pwrite reads `n` bytes of ZEROS.
        let w = unsafe { libc::pwrite(fd, ZEROS.as_ptr().cast(), n, (off + done) as i64) };
        if w < 0 && sys::errno() == libc::EINTR {
            continue;
        }
        if w <= 0 {
            return if w < 0 { sys::errno() } else { libc::ENOSPC };
        }
        done += w as u64;
    }
    0
}

/// Tells the kernel that a shared mapping of the counters file is written
/// page by page where counting happens, not read in sequence: a fault then
/// brings in only its own page. Without it each first write to a counters
/// page reads the pages around it too (up to 32 on ext4, where the file's
/// reserved pages are unwritten extents, each zero-filled), several times
/// the cost of the counting in a short-lived process.
///
/// # Safety
/// `p..p+len` must be a mapping the caller made.
unsafe fn no_readaround(p: *mut libc::c_void, len: usize) {
    // SAFETY: the caller's mapping; MADV_RANDOM changes only how faults read.
    unsafe { libc::madvise(p, len, libc::MADV_RANDOM) };
}

fn identity(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: fstat fills a plain struct.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut st) == 0).then_some((st.st_dev, st.st_ino))
    }
}

impl ProcFile {
    /// Creates the process file, complete with its header, under its final
    /// name `dir/PID.counters`, and closes it.
    /// `init` completes the header before the file can be seen.
    pub fn create(
        dir: &[u8],
        pid: u32,
        signal: u32,
        watcher: bool,
        command: &[u8],
        init: impl FnOnce(&ProcHeader),
    ) -> Result<ProcFile, &'static str> {
        // Written under a temporary name and renamed once the header is
        // complete, so a reader never sees a partial header.
        let mut name = pid_name(pid, ".counters.new");
        let mut tmp = path_in(dir, name.bytes());
        name = pid_name(pid, ".counters");
        let mut path = path_in(dir, name.bytes());
        let fd = Fd(create_file(tmp.c_str())?);
        UNWIND_PATH.set(path_in(dir, pid_name(pid, ".unwind").bytes()).bytes());
        FAIL_PATH.set(path_in(dir, pid_name(pid, ".fail").bytes()).bytes());
        TRACE_PATH.set(path_in(dir, pid_name(pid, ".trace").bytes()).bytes());
        TRACE_SITES_PATH.set(path_in(dir, pid_name(pid, ".tracesites").bytes()).bytes());
        let Some((dev, ino)) = identity(fd.0) else { return Err("cannot create the counters file") };
        if let Err(e) = reserve(fd.0, 0, PROC_HEADER_SIZE) {
            // SAFETY: tmp is NUL-terminated.
            unsafe { libc::unlink(tmp.c_str().as_ptr()) };
            return Err(e);
        }
        // SAFETY: fd is ours; the mapping covers the file's first
        // PROC_HEADER_SIZE bytes, which `reserve` just gave storage.
        let header = unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                PROC_HEADER_SIZE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.0,
                0,
            );
            if p == libc::MAP_FAILED {
                libc::unlink(tmp.c_str().as_ptr());
                return Err("cannot map the counters file");
            }
            no_readaround(p, PROC_HEADER_SIZE as usize);
            // The magic, while no other process can see the file yet.
            std::ptr::copy_nonoverlapping(process::PROC_MAGIC.as_ptr(), p as *mut u8, 8);
            // SAFETY: a fresh page-aligned mapping of PROC_HEADER_SIZE bytes;
            // on failure below it is unmapped before anyone saw it, and
            // otherwise only by `ProcFile::unmap` (after fork, in the child,
            // once `header()` no longer returns it).
            pod::at::<ProcHeader>(p as usize)
        };
        let r = Ordering::Relaxed;
        header.version.store(process::PROC_VERSION, r);
        header.pid.store(pid, r);
        header.signal.store(signal, r);
        header.watcher.store(u32::from(watcher), r);
        header.start_time.store(sys::now_secs(), r);
        let (exe_dev, exe_ino) = file_identity(c"/proc/self/exe");
        header.exe_dev.store(exe_dev, r);
        header.exe_ino.store(exe_ino, r);
        ProcHeader::set_text(&header.command, command);
        init(header);
        // SAFETY: NUL-terminated paths; on failure the mapping is ours to drop.
        unsafe {
            if libc::rename(tmp.c_str().as_ptr(), path.c_str().as_ptr()) != 0 {
                libc::unlink(tmp.c_str().as_ptr());
                libc::munmap(header as *const ProcHeader as *mut libc::c_void, PROC_HEADER_SIZE as usize);
                return Err("cannot create the counters file");
            }
        }
        Ok(ProcFile { header, size: PROC_HEADER_SIZE, path, dev, ino })
    }

    /// Opens the file again by path, without following a symlink, and only
    /// if it is still the file this process created.
    fn reopen(&mut self) -> Result<Fd, &'static str> {
        // SAFETY: the path is NUL-terminated.
        let fd = unsafe { libc::open(self.path.c_str().as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err("the counters file is gone");
        }
        let fd = Fd(fd);
        if identity(fd.0) != Some((self.dev, self.ino)) {
            return Err("the counters file was replaced by another file");
        }
        Ok(fd)
    }

    /// The file's path (without its NUL).
    pub fn path(&self) -> &[u8] {
        self.path.bytes()
    }

    /// Removes the file (a process that never profiled, at exit).
    pub fn remove(&mut self) {
        if let Ok(fd) = self.reopen() {
            drop(fd);
            // SAFETY: the path is NUL-terminated; the file was just checked
            // to be ours.
            unsafe { libc::unlink(self.path.c_str().as_ptr()) };
        }
    }

    /// Unmaps the header (after fork, in the child, the parent's file).
    /// Drops the header mapping.
    ///
    /// # Safety
    /// Nothing may use the header afterwards: [`header`] must no longer
    /// return it, and no other thread may hold it (a forked child).
    pub unsafe fn unmap(self) {
        // SAFETY: the caller's contract.
        unsafe { libc::munmap(self.header as *const ProcHeader as *mut libc::c_void, PROC_HEADER_SIZE as usize) };
    }

    fn slot(&self, module: u32) -> Option<&'static ModuleSlot> {
        self.header.modules.get(module as usize)
    }

    /// Adds a module: copies its site table into the file and maps the
    /// module's counters (`counters`, `counters_size` bytes at run time) onto
    /// a fresh region of the file, with storage for every byte of it. Returns
    /// the module's slot and a second mapping of the same counters that the
    /// runtime owns (it outlives the module, so a late free of one of its
    /// objects still counts): at `own` if given (replacing the private
    /// counters of a module that never counted, which become the file's
    /// with the same address), else where the system puts it. Called with
    /// the registration lock held.
    pub fn add_module(
        &mut self,
        table: &[u8],
        bias: u64,
        counters: u64,
        counters_size: u64,
        own: Option<u64>,
    ) -> Result<(u32, u64), &'static str> {
        let index = self.header.module_count.load(Ordering::Acquire);
        let Some(s) = self.slot(index) else { return Err("too many patched modules") };
        let shared = self.share_table(table);
        let copied = if shared.is_some() { &[][..] } else { table };
        let (table_off, counters_off, end) = process::module_region(copied.len() as u64, counters_size, self.size);
        let mapped;
        let file = self.reopen()?;
        let fd = file.0;
        let stride = counters_size / u64::from(shard::COUNT);
        within_limit(end)?;
        let undo = |e| {
            // SAFETY: fd is ours; back to the size before the region.
            unsafe { libc::ftruncate(fd, self.size as i64) };
            Err(e)
        };
        // The table is written, which gives it its storage (no thread
        // writes it through a mapping: reserving it first would only zero
        // its pages before the copy). The shards given out so far get
        // their storage; the others get it as threads are given them
        // (`reserve_shard`).
        if let Err(e) = write_at(fd, copied, table_off) {
            return undo(no_space(e).unwrap_or("cannot write the counters file"));
        }
        for (from, to) in shard_runs(crate::shards::RESERVED.load(Ordering::Acquire) | 1) {
            let at = counters_off + u64::from(from) * stride;
            if let Err(e) = reserve_within(fd, at, u64::from(to - from) * stride) {
                return undo(e);
            }
        }
        // SAFETY: fd is ours; the file grows to the end of the region (the
        // rest of the counters, without storage yet, which no thread writes
        // before its shard has it).
        if unsafe { libc::ftruncate(fd, end as i64) } != 0 {
            return undo("cannot grow the counters file");
        }
        // SAFETY: the mapping replaces the module's counters pages
        // (page-aligned and inside one of its writable segments: checked at
        // registration; nothing but the trampolines of this module use
        // them) with the file's region of the same size, which holds what
        // they will count from now on. `own` is the runtime's private
        // mapping of `counters_size` bytes (caller).
        unsafe {
            let p = libc::mmap(
                counters as *mut libc::c_void,
                counters_size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                counters_off as i64,
            );
            if p == libc::MAP_FAILED {
                libc::ftruncate(fd, self.size as i64);
                return Err("cannot map the counters");
            }
            no_readaround(p, counters_size as usize);
            mapped = libc::mmap(
                own.unwrap_or(0) as *mut libc::c_void,
                counters_size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | if own.is_some() { libc::MAP_FIXED } else { 0 },
                fd,
                counters_off as i64,
            );
            if mapped == libc::MAP_FAILED {
                // The runtime never counts through memory the module owns
                // (an unload would take it away from under tracked objects).
                libc::ftruncate(fd, self.size as i64);
                return Err("cannot map the counters a second time");
            }
            no_readaround(mapped, counters_size as usize);
        }
        self.size = end;
        s.table_offset.store(if shared.is_some() { 0 } else { table_off }, Ordering::Relaxed);
        s.table_size.store(table.len() as u64, Ordering::Relaxed);
        s.table_id.store(shared.unwrap_or(0), Ordering::Relaxed);
        s.counters_offset.store(counters_off, Ordering::Relaxed);
        s.counters_size.store(counters_size, Ordering::Relaxed);
        s.bias.store(bias, Ordering::Relaxed);
        self.header.module_count.store(index + 1, Ordering::Release);
        Ok((index, mapped as u64))
    }

    /// Finds `table` among the shared tables beside the file (see
    /// `process::ModuleSlot::table_id`), or makes it one; its id, or None
    /// if it can be neither (the table is then copied into the file).
    /// Every process of a patched file shares one table this way, rather
    /// than each writing a copy of it into its own file at start-up (345 KB
    /// for git, and for every one of the process files kept).
    fn share_table(&self, table: &[u8]) -> Option<u64> {
        let id = process::table_id(table);
        let own = self.path.bytes();
        let dir = own.iter().rposition(|&c| c == b'/').and_then(|i| own.get(..i)).unwrap_or(b".");
        if !tables_fit(dir) {
            return None;
        }
        let mut tables = path_in(dir, process::TABLES_DIR.as_bytes());
        let mut name = Buf::<64>::new();
        name.hex16(id).str(".sites");
        let mut path = path_in(tables.bytes(), name.bytes());
        // SAFETY: the path is NUL-terminated (a FIFO there must not block).
        let fd = unsafe {
            libc::open(path.c_str().as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        };
        if fd >= 0 {
            let fd = Fd(fd);
            // SAFETY: fstat and stat fill plain structs; futimens on our
            // descriptor; the path is NUL-terminated.
            unsafe {
                let (mut st, mut named): (libc::stat, libc::stat) = (std::mem::zeroed(), std::mem::zeroed());
                let ours = libc::fstat(fd.0, &mut st) == 0
                    && st.st_mode & libc::S_IFMT == libc::S_IFREG
                    && st.st_uid == libc::geteuid()
                    && st.st_size as u64 == table.len() as u64;
                if !ours {
                    return None;
                }
                // Its time says it is in use: a clean-up leaves a table
                // used lately, and puts back one it had moved aside to
                // remove if it was used meanwhile. The name must still be
                // the file's after that, or a clean-up took it: then it is
                // written again.
                if libc::futimens(fd.0, std::ptr::null()) == 0
                    && libc::stat(path.c_str().as_ptr(), &mut named) == 0
                    && (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)
                {
                    return Some(id);
                }
            }
        } else if sys::errno() != libc::ENOENT {
            return None;
        }
        within_limit(table.len() as u64).ok()?;
        // Written aside, to the disk if the directory is on one, and
        // renamed into place: a table under its name is always whole. Two
        // processes writing it at once write the same bytes.
        ensure_dir(tables.c_str()).ok()?;
        // SAFETY: getpid has no preconditions.
        name.str(".").num(u64::from(unsafe { libc::getpid() } as u32)).str(".new");
        let mut tmp = path_in(tables.bytes(), name.bytes());
        let fd = Fd(create_file(tmp.c_str()).ok()?);
        // SAFETY: NUL-terminated paths; fd is ours.
        unsafe {
            if write_at(fd.0, table, 0).is_err()
                || libc::fdatasync(fd.0) != 0
                || libc::rename(tmp.c_str().as_ptr(), path.c_str().as_ptr()) != 0
            {
                libc::unlink(tmp.c_str().as_ptr());
                return None;
            }
        }
        Some(id)
    }

    /// Publishes module `index`'s first site id (see
    /// [`ModuleSlot::first_id`]); true (the module's figures stay right
    /// whether or not its slot says).
    pub fn set_first_id(&self, index: u32, first: u32) -> bool {
        if let Some(s) = self.slot(index) {
            s.first_id.store(first, Ordering::Release);
        }
        true
    }

    /// Gives shard `s` of every module in the file its storage.
    pub fn reserve_shard(&mut self, s: u32) -> Result<(), &'static str> {
        if s >= shard::COUNT {
            return Ok(());
        }
        let file = self.reopen()?;
        for m in self.header.published() {
            let (off, size) = (m.counters_offset.load(Ordering::Relaxed), m.counters_size.load(Ordering::Relaxed));
            let stride = size / u64::from(shard::COUNT);
            reserve_within(file.0, off + u64::from(s) * stride, stride)?;
        }
        Ok(())
    }

    /// Maps modules' counters again, shared: for each `(index, stride,
    /// mask, base)` of `modules` and each bit `k` set in `which`, module
    /// `index`'s shard `k & mask` (`stride` bytes) at `base + k * step`,
    /// replacing what is there. The file is opened once.
    pub fn map_module_shards(
        &mut self,
        modules: impl Iterator<Item = (u32, u64, u32, u64)>,
        which: u32,
        step: u64,
    ) -> Result<(), &'static str> {
        let file = self.reopen()?;
        for (index, stride, mask, base) in modules {
            let Some(s) = self.slot(index) else { return Err("no such module in the counters file") };
            let off = s.counters_offset.load(Ordering::Relaxed);
            for k in (0..u32::BITS).filter(|k| which & 1 << k != 0) {
                let at = base.wrapping_add(u64::from(k).wrapping_mul(step));
                // SAFETY: fd is ours; the caller gives addresses of its own
                // reservation, which the shared mapping of the module's
                // shard replaces.
                let p = unsafe {
                    libc::mmap(
                        at as *mut libc::c_void,
                        stride as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED | libc::MAP_FIXED,
                        file.0,
                        (off + u64::from(k & mask) * stride) as i64,
                    )
                };
                if p == libc::MAP_FAILED {
                    return Err("cannot map a module's counters into the freed view");
                }
                // SAFETY: the mapping just made.
                unsafe { no_readaround(p, stride as usize) };
            }
        }
        Ok(())
    }

    /// Adds the callers region (once): the mappings, then `slots` chain
    /// slots, mapped shared. Returns its run-time address.
    pub fn add_callers(&mut self, slots: u64) -> Result<u64, &'static str> {
        let size = process::callers_region_size(slots).div_ceil(PAGE) * PAGE;
        let at = self.size.div_ceil(PAGE) * PAGE;
        let file = self.reopen()?;
        reserve(file.0, self.size, at + size - self.size)?;
        // SAFETY: fd is ours; a fresh shared mapping of the region just
        // added to the file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.0,
                at as i64,
            )
        };
        if p == libc::MAP_FAILED {
            // SAFETY: as above: back to the size before the region.
            unsafe { libc::ftruncate(file.0, self.size as i64) };
            return Err("cannot map the callers region");
        }
        // SAFETY: the mapping just made.
        unsafe { no_readaround(p, size as usize) };
        self.size = at + size;
        self.header.callers_slots.store(slots, Ordering::Relaxed);
        self.header.callers_offset.store(at, Ordering::Release);
        Ok(p as u64)
    }

    pub fn set_module_on(&self, index: u32, on: bool) {
        if let Some(s) = self.slot(index) {
            s.on.store(u32::from(on), Ordering::Release);
        }
    }

    pub fn set_unloaded(&self, index: u32) {
        if let Some(s) = self.slot(index) {
            s.unloaded.store(1, Ordering::Release);
        }
    }
}

/// Device and inode of a file (following symlinks, as `/proc/PID/exe` must
/// be followed).
pub fn file_identity(path: &CStr) -> (u64, u64) {
    // SAFETY: path is NUL-terminated; stat fills a plain struct.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::stat(path.as_ptr(), &mut st) == 0 { (st.st_dev, st.st_ino) } else { (0, 0) }
    }
}

/// Whether process `pid` runs the program whose executable was `exe`.
fn runs(pid: u32, exe: (u64, u64)) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    if pid == 0 || (unsafe { libc::kill(pid as i32, 0) } != 0 && sys::errno() == libc::ESRCH) {
        return false;
    }
    let mut p = Buf::<64>::new();
    p.str("/proc/").num(u64::from(pid)).str("/exe");
    // An executable we cannot see (another user's process): assume the same.
    let now = file_identity(p.c_str());
    now == (0, 0) || exe == (0, 0) || now == exe
}

/// Whether the counters of the process file `f` are all zero (see
/// [`process::counted_nothing`]), reading only the parts of them that are
/// not holes. False when it cannot tell.
fn counted_nothing(f: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let mut header = vec![0u8; process::PROC_HEADER_SIZE as usize];
    if f.read_exact_at(&mut header, 0).is_err() {
        return false;
    }
    let Some(regions) = process::counters_regions(&header) else { return false };
    let mut buf = vec![0u8; 64 << 10];
    for (at, size) in regions {
        let Some(end) = at.checked_add(size) else { return false };
        let mut pos = at;
        while pos < end {
            // The next data at or after `pos`, and the hole after it (a file
            // system without SEEK_DATA: all of it is data).
            // SAFETY: lseek on a descriptor this function borrows.
            let data = unsafe { libc::lseek(f.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
            let (from, to) = match data {
                -1 if sys::errno() == libc::ENXIO => break,
                -1 => (pos, end),
                d => {
                    // SAFETY: as above.
                    let hole = unsafe { libc::lseek(f.as_raw_fd(), d, libc::SEEK_HOLE) };
                    (d as u64, if hole < 0 { end } else { (hole as u64).min(end) })
                }
            };
            let mut at = from;
            while at < to {
                let n = buf.len().min((to - at) as usize);
                let Some(part) = buf.get_mut(..n) else { return false };
                if f.read_exact_at(part, at).is_err() || part.iter().any(|&b| b != 0) {
                    return false;
                }
                at += n as u64;
            }
            pos = to.max(pos + 1);
        }
    }
    true
}

/// Removes what [`process::files_to_remove`] says in `dir`: files of
/// processes that ended without profiling, files of processes that counted
/// nothing before they replaced their program (a forked child that ran
/// another program), and all but the `process::prune_to(keep)` newest of
/// the others, with
/// their leftover control and temporary files; then the shared site tables
/// no remaining file names. Reads each file's header, and the counters of
/// those whose process ended without exiting.
/// A directory with no more than `keep` counters files is left as it is
/// (only its names are read), but for the files of processes with a PID
/// above `children_of`'s, when given: a process that forked looks at the
/// files its children may have left (they were given higher PIDs, unless
/// the PIDs wrapped around meanwhile: such a file waits for a prune past
/// the bound). Of those, only the files of processes that ended without
/// profiling or counting go (the bound is not passed), and the tables stay.
/// Not in signal context.
pub fn prune(dir: &str, keep: usize, children_of: Option<u32>) {
    use std::os::unix::fs::FileExt;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::fs::OpenOptionsExt;
    // (Directories are read with getdents64, not std's read_dir: see
    // `sys::for_each_dir_entry`.) Without children to look for, a
    // directory is first only counted, without allocating: the watcher
    // thread that prunes as it starts then takes no memory from the C
    // library (whose first allocation on a thread makes it an arena of its
    // own) unless the directory is over its bound.
    if children_of.is_none() {
        let mut files = 0usize;
        if !sys::for_each_dir_entry(dir, |n| files += usize::from(n.ends_with(b".counters"))) || files <= keep {
            return;
        }
    }
    let mut names: Vec<String> = Vec::new();
    if !sys::for_each_dir_entry(dir, |n| {
        if let Ok(n) = std::str::from_utf8(n) {
            names.push(n.to_string());
        }
    }) {
        return;
    }
    let over = names.iter().filter(|n| n.ends_with(".counters")).count() > keep;
    if !over && children_of.is_none() {
        return;
    }
    let read = |pid: u32| over || children_of.is_some_and(|me| pid > me);
    let mut found: Vec<(u32, process::FileState, Vec<u64>)> = Vec::new();
    let mut strays: Vec<std::path::PathBuf> = Vec::new();
    for name in &names {
        let path = std::path::Path::new(dir).join(name);
        let Some((pid, kind)) = name.split_once('.') else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if !read(pid) {
            continue;
        }
        match kind {
            "counters" => {}
            // (A trace file of an ended process that a drainer reads is
            // mapped by it already: removing the name loses nothing.)
            "counters.new" | "control" | "unwind" | "fail" | "trace" | "tracesites" => {
                if !runs(pid, (0, 0)) {
                    strays.push(path);
                }
                continue;
            }
            _ => continue,
        }
        let Ok(f) =
            std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(&path)
        else {
            continue;
        };
        let Ok(meta) = f.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let mut head = [0u8; process::MODULE_SLOTS_AT as usize];
        let Some(h) = f.read_exact_at(&mut head, 0).ok().and_then(|()| process::Summary::read(&head)) else {
            continue;
        };
        // The module slots, for the tables the file names (only a prune
        // that reads every file removes tables).
        let tables = match over {
            true => {
                let mut slots = vec![0u8; PROC_HEADER_SIZE as usize];
                f.read_exact_at(&mut slots, 0).map_or(Vec::new(), |()| process::table_ids(&slots))
            }
            false => Vec::new(),
        };
        let current = h.version == process::PROC_VERSION;
        let running = !h.exited && runs(h.pid, h.exe);
        // A file of another version: keep it like a snapshot.
        let profiled = !current || h.flags & process::flags::PROFILED != 0;
        let state = process::FileState {
            running,
            profiled,
            empty: current && profiled && !running && !h.exited && counted_nothing(&f),
            mtime: meta.mtime() * 1_000_000_000 + meta.mtime_nsec(),
        };
        found.push((pid, state, tables));
    }
    let states: Vec<process::FileState> = found.iter().map(|f| f.1).collect();
    let mut named = Vec::new();
    let bound = if over { process::prune_to(keep) } else { usize::MAX };
    for (remove, (pid, _, tables)) in process::files_to_remove(&states, bound).into_iter().zip(&found) {
        if !remove {
            named.extend_from_slice(tables);
        } else {
            let _ = std::fs::remove_file(format!("{dir}/{pid}.counters"));
            let _ = std::fs::remove_file(format!("{dir}/{pid}.control"));
            let _ = std::fs::remove_file(format!("{dir}/{pid}.unwind"));
            let _ = std::fs::remove_file(format!("{dir}/{pid}.fail"));
            let _ = std::fs::remove_file(format!("{dir}/{pid}.trace"));
            let _ = std::fs::remove_file(format!("{dir}/{pid}.tracesites"));
        }
    }
    for p in strays {
        let _ = std::fs::remove_file(p);
    }
    if over {
        remove_unnamed_tables(dir, &named);
    }
}

/// Removes the shared tables in `dir` that no process file there names
/// (`named`: the ids the remaining files name) once unused for
/// `process::TABLE_GRACE_SECS`, and temporary ones as old.
fn remove_unnamed_tables(dir: &str, named: &[u64]) {
    if !tables_fit(dir.as_bytes()) {
        // (No table was shared there: see `share_table`.)
        return;
    }
    let tables = path_in(dir.as_bytes(), process::TABLES_DIR.as_bytes());
    let Ok(tables_dir) = std::str::from_utf8(tables.bytes()) else { return };
    let mtime = |path: &mut Path| {
        // SAFETY: a NUL-terminated path; lstat fills a plain struct.
        unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            (libc::lstat(path.c_str().as_ptr(), &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG)
                .then_some(st.st_mtime)
        }
    };
    let mut found: Vec<(Path, u64, i64)> = Vec::new();
    sys::for_each_dir_entry(tables_dir, |n| {
        let Ok(name) = std::str::from_utf8(n) else { return };
        // (A temporary one is never named: id 0.)
        let id = process::shared_table_id(name).unwrap_or(0);
        if id != 0 || name.ends_with(".new") {
            let mut path = path_in(tables.bytes(), n);
            if let Some(t) = mtime(&mut path) {
                found.push((path, id, t));
            }
        }
    });
    let used: Vec<(u64, i64)> = found.iter().map(|f| (f.1, f.2)).collect();
    let now = sys::now_secs() as i64;
    // SAFETY: getpid has no preconditions.
    let pid = u64::from(unsafe { libc::getpid() } as u32);
    for (remove, (path, id, _)) in process::tables_to_remove(&used, named, now).into_iter().zip(&mut found) {
        if !remove {
            continue;
        }
        if *id == 0 {
            // SAFETY: a NUL-terminated path.
            unsafe { libc::unlink(path.c_str().as_ptr()) };
            continue;
        }
        // Moved aside first: a process that finds the table from now on
        // finds none and writes it again; one that used it since it was
        // looked at has set its time, and it goes back.
        let mut aside = Buf::<32>::new();
        aside.str(".gc.").num(pid).str(".new");
        let mut moved = Path::new();
        moved.push(path.bytes()).push(aside.bytes());
        // SAFETY: NUL-terminated paths.
        unsafe {
            if libc::rename(path.c_str().as_ptr(), moved.c_str().as_ptr()) != 0 {
                continue;
            }
            let unused = mtime(&mut moved).is_some_and(|t| process::tables_to_remove(&[(*id, t)], &[], now) == [true]);
            if unused || libc::rename(moved.c_str().as_ptr(), path.c_str().as_ptr()) != 0 {
                libc::unlink(moved.c_str().as_ptr());
            }
        }
    }
}

/// The process's unwind file (`process::unwind_file_name`), next to its
/// counters file: set when that is created (after fork too), read from
/// signal handlers.
static UNWIND_PATH: sys::PathCell = sys::PathCell::new();

pub fn unwind_path() -> Path {
    UNWIND_PATH.get()
}

/// The process's fail file (`PID.fail`: fault injection specs that
/// `alloctramp fail` writes), next to its counters file.
static FAIL_PATH: sys::PathCell = sys::PathCell::new();

pub fn fail_path() -> Path {
    FAIL_PATH.get()
}

/// The process's trace file (`PID.trace`: see `trace`), next to its
/// counters file.
static TRACE_PATH: sys::PathCell = sys::PathCell::new();

/// The sites a trace records (`PID.tracesites`, written by `alloctramp
/// trace --site`).
static TRACE_SITES_PATH: sys::PathCell = sys::PathCell::new();

pub fn trace_sites_path() -> Path {
    TRACE_SITES_PATH.get()
}

/// Creates the trace file (replacing one an earlier process with the same
/// pid left), `size` bytes of which the first `reserved` have their
/// storage, and maps it shared, not inherited by a forked child: its
/// address. Async-signal-safe.
pub fn create_trace_file(size: u64, reserved: u64) -> Result<u64, &'static str> {
    let mut path = TRACE_PATH.get();
    if path.bytes().is_empty() {
        return Err("no trace file: the process has no counters file");
    }
    within_limit(size)?;
    let fd = Fd(create_file(path.c_str()).map_err(|_| "cannot create the trace file")?);
    // SAFETY: fd is ours; growing the file (within RLIMIT_FSIZE, checked).
    if let Err(e) = reserve(fd.0, 0, reserved).and_then(|()| match unsafe { libc::ftruncate(fd.0, size as i64) } {
        0 => Ok(()),
        _ => Err("cannot grow the trace file"),
    }) {
        // SAFETY: the path is NUL-terminated.
        unsafe { libc::unlink(path.c_str().as_ptr()) };
        return Err(e);
    }
    // SAFETY: fd is ours; what is written before `reserve_trace` gives it
    // storage is the first `reserved` bytes. The mapping is never
    // unmapped (threads keep pointers into it).
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.0,
            0,
        );
        if p == libc::MAP_FAILED {
            libc::unlink(path.c_str().as_ptr());
            return Err("cannot map the trace file");
        }
        libc::madvise(p, size as usize, libc::MADV_DONTFORK);
        Ok(p as u64)
    }
}

/// Gives `len` bytes of the trace file from `off` their storage (a ring's
/// records, as a thread claims it).
pub fn reserve_trace(off: u64, len: u64) -> Result<(), &'static str> {
    let mut path = TRACE_PATH.get();
    // SAFETY: the path is NUL-terminated.
    let fd = unsafe { libc::open(path.c_str().as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err("cannot open the trace file");
    }
    let fd = Fd(fd);
    reserve_within(fd.0, off, len)
}

/// Removes the trace file, if the process made one (at exit).
pub fn remove_trace_file() {
    let mut path = TRACE_PATH.get();
    if !path.bytes().is_empty() {
        // SAFETY: the path is NUL-terminated.
        unsafe { libc::unlink(path.c_str().as_ptr()) };
    }
}

/// The process file's header, once created: readable from signal handlers.
static HEADER: AtomicUsize = AtomicUsize::new(0);

/// The current process file's header (after fork, the child's, or none).
pub fn header() -> Option<&'static ProcHeader> {
    let h = HEADER.load(Ordering::Acquire);
    // SAFETY: set only to a live header mapping, which is unmapped only
    // after `clear_header` or `set_header` replaced it (a forked child's
    // only thread).
    (h != 0).then(|| unsafe { pod::at::<ProcHeader>(h) })
}

/// [`header`] returns nothing from now on (a forked child without a file
/// of its own).
pub fn clear_header() {
    HEADER.store(0, Ordering::Release);
}

/// Publishes the header that [`header`] returns.
pub fn set_header(h: &'static ProcHeader) {
    HEADER.store(h as *const ProcHeader as usize, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_runs_are_the_runs_of_set_bits() {
        let runs = |m: u32| shard_runs(m).collect::<Vec<_>>();
        assert_eq!(runs(0b11), [(0, 2)]);
        assert_eq!(runs(1 | 1 << 15), [(0, 1), (15, 16)]);
        assert_eq!(runs(0b1011_0001), [(0, 1), (4, 6), (7, 8)]);
        assert_eq!(runs(u32::MAX), [(0, shard::COUNT)]);
        assert_eq!(runs(0), []);
    }
}
