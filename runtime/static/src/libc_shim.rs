//! The C library functions the runtime and the standard library call,
//! made of system calls (names and signatures as glibc's).

use crate::sys::{self, call, errno_ptr, set_errno};
use alloctramp_trampolines::layout::static_host;
use core::ffi::{c_char, c_int, c_void};

core::arch::global_asm!(
    ".pushsection .text.alloctramp_static_mem,\"ax\",@progbits",
    ".globl memcpy", ".type memcpy,@function",
    "memcpy:",
    "mov rax, rdi",
    "mov rcx, rdx",
    "rep movsb",
    "ret",
    ".size memcpy, . - memcpy",
    ".globl memmove", ".type memmove,@function",
    "memmove:",
    "mov rax, rdi",
    "mov rcx, rdx",
    "mov r8, rdi",
    "sub r8, rsi",
    "cmp r8, rdx",
    "jb 1f",
    "rep movsb",
    "ret",
    "1:",
    "lea rsi, [rsi + rdx - 1]",
    "lea rdi, [rdi + rdx - 1]",
    "std",
    "rep movsb",
    "cld",
    "ret",
    ".size memmove, . - memmove",
    ".globl memset", ".type memset,@function",
    "memset:",
    "mov r8, rdi",
    "mov eax, esi",
    "mov rcx, rdx",
    "rep stosb",
    "mov rax, r8",
    "ret",
    ".size memset, . - memset",
    ".globl memcmp", ".type memcmp,@function",
    ".globl bcmp", ".type bcmp,@function",
    "memcmp:",
    "bcmp:",
    "xor eax, eax",
    "2:",
    "test rdx, rdx",
    "je 3f",
    "movzx eax, byte ptr [rdi]",
    "movzx ecx, byte ptr [rsi]",
    "sub eax, ecx",
    "jne 3f",
    "inc rdi",
    "inc rsi",
    "dec rdx",
    "jmp 2b",
    "3:",
    "ret",
    ".size memcmp, . - memcmp",
    ".globl strlen", ".type strlen,@function",
    "strlen:",
    "mov rax, rdi",
    "4:",
    "cmp byte ptr [rax], 0",
    "je 5f",
    "inc rax",
    "jmp 4b",
    "5:",
    "sub rax, rdi",
    "ret",
    ".size strlen, . - strlen",
    // syscall(n, a1..a6): -1 and errno for an error.
    ".globl syscall", ".type syscall,@function",
    "syscall:",
    "mov rax, rdi",
    "mov rdi, rsi",
    "mov rsi, rdx",
    "mov rdx, rcx",
    "mov r10, r8",
    "mov r8, r9",
    "mov r9, qword ptr [rsp + 8]",
    "syscall",
    "cmp rax, -4095",
    "jae 6f",
    "ret",
    "6:",
    "neg eax",
    "mov edi, eax",
    "sub rsp, 8",
    "call {set_errno}",
    "add rsp, 8",
    "mov rax, -1",
    "ret",
    ".size syscall, . - syscall",
    // The signal frame's return: rt_sigreturn.
    ".globl alloctramp_static_restore", ".type alloctramp_static_restore,@function",
    "alloctramp_static_restore:",
    "mov eax, 15",
    "syscall",
    "ud2",
    ".size alloctramp_static_restore, . - alloctramp_static_restore",
    ".popsection",
    set_errno = sym errno_from_asm,
);

extern "C" fn errno_from_asm(e: i32) {
    set_errno(e);
}

unsafe extern "C" {
    fn alloctramp_static_restore();
}

#[unsafe(no_mangle)]
pub extern "C" fn __errno_location() -> *mut c_int {
    errno_ptr()
}

const AT_FDCWD: i64 = -100;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: u32) -> c_int {
    call!(libc::SYS_openat, AT_FDCWD, path, flags, mode) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: u32) -> c_int {
    call!(libc::SYS_openat, AT_FDCWD, path, flags, mode) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn close(fd: c_int) -> c_int {
    call!(libc::SYS_close, fd) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: usize) -> isize {
    call!(libc::SYS_read, fd, buf, n) as isize
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: usize) -> isize {
    call!(libc::SYS_write, fd, buf, n) as isize
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> isize {
    call!(libc::SYS_writev, fd, iov, n) as isize
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, n: usize, off: i64) -> isize {
    call!(libc::SYS_pread64, fd, buf, n, off) as isize
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, n: usize, off: i64) -> isize {
    call!(libc::SYS_pread64, fd, buf, n, off) as isize
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: usize, off: i64) -> isize {
    call!(libc::SYS_pwrite64, fd, buf, n, off) as isize
}
#[unsafe(no_mangle)]
pub extern "C" fn lseek(fd: c_int, off: i64, whence: c_int) -> i64 {
    call!(libc::SYS_lseek, fd, off, whence)
}
#[unsafe(no_mangle)]
pub extern "C" fn lseek64(fd: c_int, off: i64, whence: c_int) -> i64 {
    call!(libc::SYS_lseek, fd, off, whence)
}
#[unsafe(no_mangle)]
pub extern "C" fn ftruncate(fd: c_int, len: i64) -> c_int {
    call!(libc::SYS_ftruncate, fd, len) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn fallocate(fd: c_int, mode: c_int, off: i64, len: i64) -> c_int {
    call!(libc::SYS_fallocate, fd, mode, off, len) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn unlink(path: *const c_char) -> c_int {
    call!(libc::SYS_unlinkat, AT_FDCWD, path, 0) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rename(old: *const c_char, new: *const c_char) -> c_int {
    call!(libc::SYS_renameat, AT_FDCWD, old, AT_FDCWD, new) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn fdatasync(fd: c_int) -> c_int {
    call!(libc::SYS_fdatasync, fd) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn futimens(fd: c_int, times: *const libc::timespec) -> c_int {
    call!(libc::SYS_utimensat, fd, 0usize, times, 0) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mkdir(path: *const c_char, mode: u32) -> c_int {
    call!(libc::SYS_mkdirat, AT_FDCWD, path, mode) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn readlink(path: *const c_char, buf: *mut c_char, n: usize) -> isize {
    call!(libc::SYS_readlinkat, AT_FDCWD, path, buf, n) as isize
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getcwd(buf: *mut c_char, n: usize) -> *mut c_char {
    if call!(libc::SYS_getcwd, buf, n) < 0 { core::ptr::null_mut() } else { buf }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stat(path: *const c_char, st: *mut libc::stat) -> c_int {
    call!(libc::SYS_newfstatat, AT_FDCWD, path, st, 0) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stat64(path: *const c_char, st: *mut libc::stat) -> c_int {
    call!(libc::SYS_newfstatat, AT_FDCWD, path, st, 0) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lstat(path: *const c_char, st: *mut libc::stat) -> c_int {
    call!(libc::SYS_newfstatat, AT_FDCWD, path, st, libc::AT_SYMLINK_NOFOLLOW) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fstat(fd: c_int, st: *mut libc::stat) -> c_int {
    call!(libc::SYS_fstat, fd, st) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fstat64(fd: c_int, st: *mut libc::stat) -> c_int {
    call!(libc::SYS_fstat, fd, st) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn statx(dirfd: c_int, path: *const c_char, flags: c_int, mask: u32, buf: *mut c_void) -> c_int {
    call!(libc::SYS_statx, dirfd, path, flags, mask, buf) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: u64, timeout: c_int) -> c_int {
    call!(libc::SYS_poll, fds, n, timeout) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: i64,
) -> *mut c_void {
    call!(libc::SYS_mmap, addr, len, prot, flags, fd, off) as *mut c_void
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: i64,
) -> *mut c_void {
    call!(libc::SYS_mmap, addr, len, prot, flags, fd, off) as *mut c_void
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    call!(libc::SYS_munmap, addr, len) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int {
    call!(libc::SYS_mprotect, addr, len, prot) as c_int
}
/// Variadic in C, with the new address read only under `MREMAP_FIXED` or
/// `MREMAP_DONTUNMAP`; on x86-64 the fifth integer argument is passed in
/// the same register either way.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: c_int,
    new: *mut c_void,
) -> *mut c_void {
    call!(libc::SYS_mremap, old, old_len, new_len, flags, new) as *mut c_void
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn msync(addr: *mut c_void, len: usize, flags: c_int) -> c_int {
    call!(libc::SYS_msync, addr, len, flags) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int {
    call!(libc::SYS_madvise, addr, len, advice) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mincore(addr: *mut c_void, len: usize, vec: *mut u8) -> c_int {
    call!(libc::SYS_mincore, addr, len, vec) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn getpid() -> c_int {
    call!(libc::SYS_getpid) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn getppid() -> c_int {
    call!(libc::SYS_getppid) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn gettid() -> c_int {
    call!(libc::SYS_gettid) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn geteuid() -> u32 {
    call!(libc::SYS_geteuid) as u32
}
#[unsafe(no_mangle)]
pub extern "C" fn sched_yield() -> c_int {
    call!(libc::SYS_sched_yield) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn kill(pid: c_int, sig: c_int) -> c_int {
    call!(libc::SYS_kill, pid, sig) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn raise(sig: c_int) -> c_int {
    call!(libc::SYS_tgkill, getpid(), gettid(), sig) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn abort() -> ! {
    raise(libc::SIGABRT);
    call!(libc::SYS_exit_group, 127);
    loop {
        core::hint::spin_loop();
    }
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getrlimit(resource: c_int, rlim: *mut libc::rlimit) -> c_int {
    call!(libc::SYS_prlimit64, 0, resource, 0, rlim) as c_int
}
#[unsafe(no_mangle)]
pub extern "C" fn prctl(option: c_int, a: u64, b: u64, c: u64, d: u64) -> c_int {
    call!(libc::SYS_prctl, option, a, b, c, d) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getrandom(buf: *mut c_void, n: usize, flags: u32) -> isize {
    call!(libc::SYS_getrandom, buf, n, flags) as isize
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nanosleep(req: *const libc::timespec, rem: *mut libc::timespec) -> c_int {
    call!(libc::SYS_nanosleep, req, rem) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn clock_gettime(clock: c_int, ts: *mut libc::timespec) -> c_int {
    call!(libc::SYS_clock_gettime, clock, ts) as c_int
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn time(out: *mut i64) -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a local timespec; `out` is null or the caller's.
    unsafe {
        clock_gettime(libc::CLOCK_REALTIME, &mut ts);
        if !out.is_null() {
            *out = ts.tv_sec;
        }
    }
    ts.tv_sec
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn realpath(path: *const c_char, out: *mut c_char) -> *mut c_char {
    // The kernel's name of the file, through a descriptor of it.
    let fd = call!(libc::SYS_openat, AT_FDCWD, path, libc::O_PATH | libc::O_CLOEXEC, 0);
    if fd < 0 {
        return core::ptr::null_mut();
    }
    let mut link = *b"/proc/self/fd/\0\0\0\0\0\0\0\0\0\0\0";
    let mut digits = [0u8; 10];
    let (mut n, mut v) = (0, fd as u32);
    loop {
        digits[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for i in 0..n {
        link[14 + i] = digits[n - 1 - i];
    }
    // SAFETY: a buffer of PATH_MAX bytes, the caller's or allocated.
    unsafe {
        let buf = if out.is_null() { crate::alloc::malloc(libc::PATH_MAX as usize) as *mut c_char } else { out };
        if buf.is_null() {
            close(fd as c_int);
            return core::ptr::null_mut();
        }
        let len = call!(libc::SYS_readlinkat, AT_FDCWD, link.as_ptr(), buf, libc::PATH_MAX as usize - 1);
        close(fd as c_int);
        if len < 0 {
            if out.is_null() {
                crate::alloc::free(buf as *mut c_void);
            }
            return core::ptr::null_mut();
        }
        *buf.add(len as usize) = 0;
        buf
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __xpg_strerror_r(err: c_int, buf: *mut c_char, n: usize) -> c_int {
    let mut text = [0u8; 24];
    let prefix = b"error ";
    text[..prefix.len()].copy_from_slice(prefix);
    let mut len = prefix.len();
    let mut digits = [0u8; 10];
    let (mut k, mut v) = (0, err.unsigned_abs());
    loop {
        digits[k] = b'0' + (v % 10) as u8;
        k += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for i in 0..k {
        text[len] = digits[k - 1 - i];
        len += 1;
    }
    if n == 0 {
        return libc::ERANGE;
    }
    let len = len.min(n - 1);
    // SAFETY: `n` bytes at `buf`.
    unsafe {
        core::ptr::copy_nonoverlapping(text.as_ptr(), buf as *mut u8, len);
        *buf.add(len) = 0;
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn getenv(name: *const c_char) -> *mut c_char {
    let mut p = sys::envp();
    if p.is_null() || name.is_null() {
        return core::ptr::null_mut();
    }
    // SAFETY: NUL-terminated strings: the name and the environment's.
    // Each entry is read only as far as it matches (no length of it).
    unsafe {
        let name = core::ffi::CStr::from_ptr(name).to_bytes();
        while !(*p).is_null() {
            let entry = *p;
            let mut i = 0;
            while i < name.len() && *entry.add(i) == name[i] {
                i += 1;
            }
            if i == name.len() && *entry.add(i) == b'=' {
                return entry.add(i + 1) as *mut c_char;
            }
            p = p.add(1);
        }
    }
    core::ptr::null_mut()
}

#[unsafe(no_mangle)]
pub extern "C" fn getauxval(kind: u64) -> u64 {
    sys::auxval(kind)
}

#[unsafe(no_mangle)]
pub extern "C" fn __libc_current_sigrtmin() -> c_int {
    match sys::host(static_host::SIGRTMIN) {
        0 => 34,
        n => n as c_int,
    }
}
#[unsafe(no_mangle)]
pub extern "C" fn __libc_current_sigrtmax() -> c_int {
    64
}

/// The kernel's `struct sigaction`.
#[repr(C)]
struct KernelAction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

const SA_RESTORER: u64 = 0x0400_0000;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    let mut k_old = KernelAction { handler: 0, flags: 0, restorer: 0, mask: 0 };
    // SAFETY: `act` is null or the caller's; sigset_t's first word holds
    // the kernel's 64 signals.
    let k_new = unsafe {
        act.as_ref().map(|a| {
            let own = a.sa_flags as u64 & SA_RESTORER != 0 && a.sa_restorer.is_some();
            KernelAction {
                handler: a.sa_sigaction,
                flags: a.sa_flags as u64 | SA_RESTORER,
                restorer: if own {
                    a.sa_restorer.map_or(0, |f| f as usize)
                } else {
                    alloctramp_static_restore as *const () as usize
                },
                mask: *(&a.sa_mask as *const libc::sigset_t as *const u64),
            }
        })
    };
    let new_ptr = k_new.as_ref().map_or(core::ptr::null(), |k| k as *const KernelAction);
    let r = call!(libc::SYS_rt_sigaction, sig, new_ptr, &mut k_old as *mut KernelAction, 8);
    if r < 0 {
        return -1;
    }
    // SAFETY: `old` is null or the caller's.
    if let Some(o) = unsafe { old.as_mut() } {
        // SAFETY: a zeroed sigaction is valid; then the kernel's fields.
        *o = unsafe { core::mem::zeroed() };
        o.sa_sigaction = k_old.handler;
        o.sa_flags = k_old.flags as c_int;
        // SAFETY: the restorer the kernel held, a function or 0.
        o.sa_restorer = unsafe { core::mem::transmute::<usize, Option<extern "C" fn()>>(k_old.restorer) };
        // SAFETY: sigset_t's first word.
        unsafe { *(&mut o.sa_mask as *mut libc::sigset_t as *mut u64) = k_old.mask };
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: local, zeroed sigaction structures.
    unsafe {
        let mut sa: libc::sigaction = core::mem::zeroed();
        sa.sa_sigaction = handler;
        sa.sa_flags = libc::SA_RESTART;
        let mut old: libc::sigaction = core::mem::zeroed();
        if sigaction(sig, &sa, &mut old) < 0 {
            return libc::SIG_ERR;
        }
        old.sa_sigaction
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn sigemptyset(set: *mut libc::sigset_t) -> c_int {
    // SAFETY: the caller's set.
    unsafe { core::ptr::write_bytes(set, 0, 1) };
    0
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sigfillset(set: *mut libc::sigset_t) -> c_int {
    // SAFETY: the caller's set.
    unsafe { core::ptr::write_bytes(set, 0xff, 1) };
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_sigmask(how: c_int, set: *const libc::sigset_t, old: *mut libc::sigset_t) -> c_int {
    // (Only the runtime calls it: blocking every signal for a moment on a
    // program's thread, or for good on its own.)
    // SAFETY: `set` is null or the caller's; its first word holds the
    // kernel's 64 signals.
    let new = unsafe { set.as_ref() }.map(|s| s as *const libc::sigset_t as *const u64);
    let mut was = 0u64;
    // SAFETY: the two words are local.
    let r = unsafe {
        sys::raw(
            libc::SYS_rt_sigprocmask,
            how as u64,
            new.map_or(0, |p| p as u64),
            &mut was as *mut u64 as u64,
            8,
            0,
            0,
        )
    };
    if r < 0 {
        return -r as c_int;
    }
    // SAFETY: `old` is null or the caller's.
    if let Some(o) = unsafe { old.as_mut() } {
        // SAFETY: a zeroed set, then its first word.
        unsafe {
            core::ptr::write_bytes(o, 0, 1);
            *(o as *mut libc::sigset_t as *mut u64) = was;
        }
    }
    0
}

/// The program as the only loaded object: its load bias and program
/// headers (from the auxiliary vector).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dl_iterate_phdr(
    f: Option<unsafe extern "C" fn(*mut libc::dl_phdr_info, usize, *mut c_void) -> c_int>,
    data: *mut c_void,
) -> c_int {
    let Some(f) = f else { return 0 };
    // SAFETY: a zeroed info is valid; then the program's fields.
    let mut info: libc::dl_phdr_info = unsafe { core::mem::zeroed() };
    info.dlpi_addr = sys::host(static_host::BIAS);
    info.dlpi_name = c"".as_ptr();
    info.dlpi_phdr = sys::auxval(libc::AT_PHDR) as *const libc::Elf64_Phdr;
    info.dlpi_phnum = sys::auxval(libc::AT_PHNUM) as u16;
    info.dlpi_adds = 1;
    // SAFETY: the caller's callback with a valid info.
    unsafe { f(&mut info, core::mem::size_of::<libc::dl_phdr_info>(), data) }
}

#[unsafe(no_mangle)]
pub extern "C" fn dladdr(_addr: *const c_void, _info: *mut libc::Dl_info) -> c_int {
    0
}
#[unsafe(no_mangle)]
pub extern "C" fn dlsym(_handle: *mut c_void, _name: *const c_char) -> *mut c_void {
    core::ptr::null_mut()
}

// Rust's standard library refers to the unwinder; a release build of the
// runtime aborts at a panic and never unwinds. The runtime's personality
// routine, which the program's unwinder calls for a trampoline's frame,
// reads that frame through the program's own functions.
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_Backtrace(_f: *mut c_void, _data: *mut c_void) -> c_int {
    5 // _URC_END_OF_STACK
}
/// The program's unwinder function in host word `w`, called with the
/// unwinder's context (0 without one: nothing unwinds then).
fn unwinder(w: usize, c: *mut c_void) -> usize {
    match sys::host(static_host::UNWINDER + w) {
        0 => 0,
        // SAFETY: the program's `_Unwind_Get*` function, whose address the
        // patcher stored, with the context its unwinder passed.
        f => unsafe { core::mem::transmute::<usize, unsafe extern "C" fn(*mut c_void) -> usize>(f as usize)(c) },
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_GetIP(c: *mut c_void) -> usize {
    unwinder(1, c)
}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn _Unwind_GetIPInfo(_c: *mut c_void, before: *mut c_int) -> usize {
    if !before.is_null() {
        // SAFETY: the caller's flag.
        unsafe { *before = 0 };
    }
    0
}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_GetCFA(c: *mut c_void) -> usize {
    unwinder(3, c)
}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_GetDataRelBase(_c: *mut c_void) -> usize {
    0
}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_GetTextRelBase(_c: *mut c_void) -> usize {
    0
}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_GetRegionStart(c: *mut c_void) -> usize {
    unwinder(2, c)
}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_GetLanguageSpecificData(c: *mut c_void) -> usize {
    unwinder(0, c)
}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_SetGR(_c: *mut c_void, _i: c_int, _v: usize) {}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_SetIP(_c: *mut c_void, _v: usize) {}
#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_Resume(_e: *mut c_void) -> ! {
    abort()
}

/// Thread-local variables of the runtime's standard library: the patcher
/// resolves each module-relative offset to one from the thread pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __tls_get_addr(ti: *const [u64; 2]) -> *mut c_void {
    // SAFETY: the GOT pair the patcher filled: the block's offset from the
    // thread pointer (where a module id would be), the variable's in it.
    let [block, offset] = unsafe { *ti };
    (crate::thread::pthread_self() as u64).wrapping_add(block).wrapping_add(offset) as *mut c_void
}

/// The runtime's work at exit, which the hook on the program's destructors
/// calls.
#[unsafe(no_mangle)]
pub extern "C" fn alloctramp_static_exit() {
    alloctramp_rt::at_exit();
}

#[unsafe(no_mangle)]
pub extern "C" fn _Unwind_RaiseException(_e: *mut c_void) -> c_int {
    5 // _URC_END_OF_STACK: nothing to unwind to
}

#[unsafe(no_mangle)]
pub extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: u64) -> c_int {
    call!(libc::SYS_fcntl, fd, cmd, arg) as c_int
}
