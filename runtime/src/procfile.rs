//! The per-process counters file (format in `alloctramp_trampolines::process`):
//! created at start-up in a per-user directory, grown as modules register,
//! its counter regions mapped over each module's counters.

use crate::sys::{self, Buf};
use alloctramp_trampolines::process::{self, MODULE_SLOT_SIZE, MODULE_SLOTS_AT, PROC_HEADER_SIZE, hdr, slot};
use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

pub type Path = Buf<256>;

/// An open process file: its descriptor, the mapped header, and how far it
/// extends.
pub struct ProcFile {
    pub fd: i32,
    pub header: *mut u8,
    pub size: u64,
}

// SAFETY: the header mapping is shared memory accessed only through atomics
// and by the thread that owns the registration lock.
unsafe impl Send for ProcFile {}
unsafe impl Sync for ProcFile {}

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

impl ProcFile {
    /// Creates the process file and its (empty) control file.
    pub fn create(dir: &[u8], pid: u32, signal: u32, watcher: bool, command: &[u8]) -> Result<ProcFile, &'static str> {
        let mut name = pid_name(pid, ".control");
        let mut ctl = path_in(dir, name.bytes());
        let cfd = create_file(ctl.c_str())?;
        // SAFETY: cfd was just opened.
        unsafe { libc::close(cfd) };
        // Written under a temporary name and renamed once the header is
        // complete, so a reader never sees a partial header.
        name = pid_name(pid, ".counters.new");
        let mut tmp = path_in(dir, name.bytes());
        name = pid_name(pid, ".counters");
        let mut path = path_in(dir, name.bytes());
        let fd = create_file(tmp.c_str())?;
        // SAFETY: fd is ours; the mapping covers the file's first
        // PROC_HEADER_SIZE bytes, which ftruncate just created.
        let header = unsafe {
            if libc::ftruncate(fd, PROC_HEADER_SIZE as i64) != 0 {
                libc::close(fd);
                return Err("cannot size the counters file");
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                PROC_HEADER_SIZE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            if p == libc::MAP_FAILED {
                libc::close(fd);
                return Err("cannot map the counters file");
            }
            p as *mut u8
        };
        let f = ProcFile { fd, header, size: PROC_HEADER_SIZE };
        // SAFETY: the header is mapped and PROC_HEADER_SIZE long.
        unsafe {
            std::ptr::copy_nonoverlapping(process::PROC_MAGIC.as_ptr(), header, 8);
            header.add(hdr::VERSION).cast::<u32>().write(process::PROC_VERSION);
            header.add(hdr::PID).cast::<u32>().write(pid);
            header.add(hdr::SIGNAL).cast::<u32>().write(signal);
            header.add(hdr::WATCHER).cast::<u32>().write(u32::from(watcher));
            header.add(hdr::START_TIME).cast::<u64>().write(sys::now_secs());
            let n = command.len().min(111);
            std::ptr::copy_nonoverlapping(command.as_ptr(), header.add(hdr::COMMAND), n);
            if libc::rename(tmp.c_str().as_ptr(), path.c_str().as_ptr()) != 0 {
                libc::unlink(tmp.c_str().as_ptr());
                return Err("cannot create the counters file");
            }
        }
        Ok(f)
    }

    pub fn u32(&self, at: usize) -> &AtomicU32 {
        // SAFETY: `at` is a 4-aligned offset inside the mapped header, which
        // lives as long as self.
        unsafe { &*(self.header.add(at) as *const AtomicU32) }
    }

    pub fn u64(&self, at: usize) -> &AtomicU64 {
        // SAFETY: as above, 8-aligned.
        unsafe { &*(self.header.add(at) as *const AtomicU64) }
    }

    fn slot_u64(&self, module: u32, field: usize) -> &AtomicU64 {
        self.u64(MODULE_SLOTS_AT as usize + module as usize * MODULE_SLOT_SIZE as usize + field)
    }

    fn slot_u32(&self, module: u32, field: usize) -> &AtomicU32 {
        self.u32(MODULE_SLOTS_AT as usize + module as usize * MODULE_SLOT_SIZE as usize + field)
    }

    /// Adds a module: copies its site table into the file and maps the
    /// module's counters (`counters`, `counters_size` bytes at run time) onto
    /// a fresh region of the file. Returns the module's slot and a second
    /// mapping of the same counters that the runtime owns (it outlives the
    /// module, so a late free of one of its objects still counts). Called
    /// with the registration lock held.
    pub fn add_module(
        &mut self,
        table: &[u8],
        bias: u64,
        counters: u64,
        counters_size: u64,
    ) -> Result<(u32, u64), &'static str> {
        let index = self.u32(hdr::MODULE_COUNT).load(Ordering::Acquire);
        if u64::from(index) >= process::MAX_MODULES {
            return Err("too many patched modules");
        }
        let (table_off, counters_off, end) = process::module_region(table.len() as u64, counters_size, self.size);
        let mut own;
        // SAFETY: fd is ours; pwrite reads `table`; the mapping replaces the
        // module's counters pages (page-aligned, its own, zero so far) with
        // the file's region of the same size.
        unsafe {
            if libc::ftruncate(self.fd, end as i64) != 0 {
                return Err("cannot grow the counters file");
            }
            let mut done = 0usize;
            while done < table.len() {
                let n = libc::pwrite(
                    self.fd,
                    table[done..].as_ptr().cast(),
                    table.len() - done,
                    (table_off + done as u64) as i64,
                );
                if n <= 0 {
                    return Err("cannot write the counters file");
                }
                done += n as usize;
            }
            let p = libc::mmap(
                counters as *mut libc::c_void,
                counters_size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                self.fd,
                counters_off as i64,
            );
            if p == libc::MAP_FAILED {
                return Err("cannot map the counters");
            }
            own = libc::mmap(
                std::ptr::null_mut(),
                counters_size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.fd,
                counters_off as i64,
            );
            if own == libc::MAP_FAILED {
                own = p;
            }
        }
        self.size = end;
        self.slot_u64(index, slot::TABLE_OFFSET).store(table_off, Ordering::Relaxed);
        self.slot_u64(index, slot::TABLE_SIZE).store(table.len() as u64, Ordering::Relaxed);
        self.slot_u64(index, slot::COUNTERS_OFFSET).store(counters_off, Ordering::Relaxed);
        self.slot_u64(index, slot::COUNTERS_SIZE).store(counters_size, Ordering::Relaxed);
        self.slot_u64(index, slot::BIAS).store(bias, Ordering::Relaxed);
        self.u32(hdr::MODULE_COUNT).store(index + 1, Ordering::Release);
        Ok((index, own as u64))
    }

    pub fn set_module_on(&self, index: u32, on: bool) {
        self.slot_u32(index, slot::ON).store(u32::from(on), Ordering::Release);
    }

    pub fn set_unloaded(&self, index: u32) {
        self.slot_u32(index, slot::UNLOADED).store(1, Ordering::Release);
    }
}
