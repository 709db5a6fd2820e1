//! System calls, errno, and what the entry stub recorded.

use alloctramp_trampolines::layout::static_host;
use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicU64, Ordering};

/// The host block the entry stub and the patcher fill (layout in
/// `layout::static_host`), in the file's data (not .bss) so that the
/// patcher has bytes to write.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".data.alloctramp_static_host")]
#[allow(non_upper_case_globals)]
pub static alloctramp_static_host: [AtomicU64; static_host::WORDS] = [const { AtomicU64::new(0) }; static_host::WORDS];

pub fn host(word: usize) -> u64 {
    alloctramp_static_host.get(word).map_or(0, |w| w.load(Ordering::Relaxed))
}

// The static runtime's own thread-local words, in the block the patcher
// places in front of the program's: errno (an int at 0) and the forking
// flag (a byte at 4). Global but hidden: code inlined into another
// codegen unit than this one's names it too.
global_asm!(
    ".pushsection .tbss,\"awT\",@nobits",
    ".p2align 2",
    ".globl alloctramp_static_tls",
    ".hidden alloctramp_static_tls",
    "alloctramp_static_tls:",
    ".zero 8",
    ".popsection",
);

/// The calling thread's words.
fn words() -> *mut u8 {
    let p: *mut u8;
    // SAFETY: reads the GOT slot the patcher filled with the block's
    // offset from the thread pointer, and the thread pointer (fs:0 holds
    // the thread control block's own address in glibc and musl alike).
    unsafe {
        asm!(
            "mov {p}, qword ptr [rip + alloctramp_static_tls@GOTTPOFF]",
            "add {p}, qword ptr fs:0",
            p = out(reg) p,
            options(nostack, readonly, preserves_flags),
        );
    }
    p
}

pub fn errno_ptr() -> *mut i32 {
    words().cast()
}

/// The calling thread's flag: a fork is under way (its handlers before it
/// ran).
pub fn forking_ptr() -> *mut u8 {
    words().wrapping_add(4)
}

pub fn set_errno(e: i32) {
    // SAFETY: the calling thread's errno.
    unsafe { *errno_ptr() = e };
}

#[inline(always)]
pub unsafe fn raw(n: i64, a: u64, b: u64, c: u64, d: u64, e: u64, f: u64) -> i64 {
    let r: i64;
    // SAFETY: the caller passes what system call `n` expects.
    unsafe {
        asm!("syscall", inlateout("rax") n => r, in("rdi") a, in("rsi") b, in("rdx") c, in("r10") d,
            in("r8") e, in("r9") f, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    r
}

/// A system call's result as the C library returns it: -1 with errno set
/// for an error.
pub fn ret(r: i64) -> i64 {
    if (-4095..0).contains(&r) {
        set_errno(-r as i32);
        -1
    } else {
        r
    }
}

macro_rules! call {
    ($n:expr) => {
        $crate::sys::ret(
            #[allow(unused_unsafe)]
            unsafe {
                $crate::sys::raw(($n) as i64, 0, 0, 0, 0, 0, 0)
            },
        )
    };
    ($n:expr, $a:expr) => {
        $crate::sys::ret(
            #[allow(unused_unsafe)]
            unsafe {
                $crate::sys::raw(($n) as i64, ($a) as u64, 0, 0, 0, 0, 0)
            },
        )
    };
    ($n:expr, $a:expr, $b:expr) => {
        $crate::sys::ret(
            #[allow(unused_unsafe)]
            unsafe {
                $crate::sys::raw(($n) as i64, ($a) as u64, ($b) as u64, 0, 0, 0, 0)
            },
        )
    };
    ($n:expr, $a:expr, $b:expr, $c:expr) => {
        $crate::sys::ret(
            #[allow(unused_unsafe)]
            unsafe {
                $crate::sys::raw(($n) as i64, ($a) as u64, ($b) as u64, ($c) as u64, 0, 0, 0)
            },
        )
    };
    ($n:expr, $a:expr, $b:expr, $c:expr, $d:expr) => {
        $crate::sys::ret(
            #[allow(unused_unsafe)]
            unsafe {
                $crate::sys::raw(($n) as i64, ($a) as u64, ($b) as u64, ($c) as u64, ($d) as u64, 0, 0)
            },
        )
    };
    ($n:expr, $a:expr, $b:expr, $c:expr, $d:expr, $e:expr) => {
        $crate::sys::ret(
            #[allow(unused_unsafe)]
            unsafe {
                $crate::sys::raw(($n) as i64, ($a) as u64, ($b) as u64, ($c) as u64, ($d) as u64, ($e) as u64, 0)
            },
        )
    };
    ($n:expr, $a:expr, $b:expr, $c:expr, $d:expr, $e:expr, $f:expr) => {
        $crate::sys::ret(
            #[allow(unused_unsafe)]
            unsafe {
                $crate::sys::raw(
                    ($n) as i64,
                    ($a) as u64,
                    ($b) as u64,
                    ($c) as u64,
                    ($d) as u64,
                    ($e) as u64,
                    ($f) as u64,
                )
            },
        )
    };
}
pub(crate) use call;

/// The words above the entry stack pointer: argc, argv..., 0, envp..., 0,
/// then the auxiliary vector.
fn start() -> Option<*const u64> {
    let sp = host(static_host::START_SP);
    (sp != 0).then_some(sp as *const u64)
}

/// The environment's first entry.
pub fn envp() -> *const *const u8 {
    let Some(sp) = start() else { return core::ptr::null() };
    // SAFETY: the kernel's layout of the initial stack.
    unsafe {
        let argc = *sp as usize;
        sp.add(1 + argc + 1) as *const *const u8
    }
}

pub fn auxval(kind: u64) -> u64 {
    let mut p = envp() as *const u64;
    if p.is_null() {
        return 0;
    }
    // SAFETY: the environment ends with a null word; the auxiliary vector
    // follows, pairs ending with AT_NULL.
    unsafe {
        while *p != 0 {
            p = p.add(1);
        }
        p = p.add(1);
        while *p != 0 {
            if *p == kind {
                return *p.add(1);
            }
            p = p.add(2);
        }
    }
    0
}
