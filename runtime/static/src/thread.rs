//! Threads: the runtime's watcher thread, made with `clone` on a mapping
//! that holds its stack and its thread-local block (the program's PT_TLS,
//! which the patcher grew to hold the runtime's variables in front),
//! followed by a thread control block whose first word points at itself.
//! The thread runs only the runtime's code, never the program's C library,
//! which does not know it. Thread-specific keys exist but their
//! destructors never run (the C library runs them for its own threads).

use crate::sys::{self, call};
use alloctramp_trampolines::layout::static_host;
use core::ffi::c_void;
use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

core::arch::global_asm!(
    ".pushsection .text.alloctramp_static_clone,\"ax\",@progbits",
    ".type alloctramp_static_clone,@function",
    // (flags, stack, tls): the child pops its function and argument from
    // the new stack and calls it, then exits; the parent returns the
    // child's id.
    "alloctramp_static_clone:",
    "mov r8, rdx",
    "xor edx, edx",
    "xor r10d, r10d",
    "mov eax, 56",
    "syscall",
    "test rax, rax",
    "jnz 1f",
    "xor ebp, ebp",
    "pop rax",
    "pop rdi",
    "call rax",
    "xor edi, edi",
    "mov eax, 60",
    "syscall",
    "ud2",
    "1:",
    "ret",
    ".size alloctramp_static_clone, . - alloctramp_static_clone",
    ".popsection",
);

unsafe extern "C" {
    fn alloctramp_static_clone(flags: u64, stack: u64, tls: u64) -> i64;
}

/// The program's PT_TLS as loaded: image address, image size, block size,
/// alignment.
fn tls_segment() -> Option<(u64, u64, u64, u64)> {
    let (phdr, phnum) = (sys::auxval(libc::AT_PHDR), sys::auxval(libc::AT_PHNUM));
    if phdr == 0 {
        return None;
    }
    // SAFETY: the auxiliary vector's program headers, mapped.
    let phdrs = unsafe { core::slice::from_raw_parts(phdr as *const libc::Elf64_Phdr, phnum as usize) };
    let p = phdrs.iter().find(|p| p.p_type == libc::PT_TLS)?;
    Some((sys::host(static_host::BIAS).wrapping_add(p.p_vaddr), p.p_filesz, p.p_memsz, p.p_align.max(1)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_create(
    out: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    f: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
) -> i32 {
    let Some((image, filesz, memsz, align)) = tls_segment() else { return libc::EAGAIN };
    // SAFETY: `attr` is null or initialized by `pthread_attr_init`, whose
    // first word is the stack size.
    let stack = if attr.is_null() { 0 } else { unsafe { *(attr as *const usize) } };
    let stack = if stack == 0 { 256 << 10 } else { stack };
    let tcb_align = align.max(64) as usize;
    let block = (memsz as usize + align as usize - 1) & !(align as usize - 1);
    let len = (stack + block + tcb_align + 4096 + 4095) & !4095;
    let base = call!(
        libc::SYS_mmap,
        0,
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
        -1i64,
        0
    );
    if base < 0 {
        return libc::EAGAIN;
    }
    let base = base as usize;
    let tp = (base + len - 512) & !(tcb_align - 1);
    let block_start = tp - block;
    // SAFETY: all inside the fresh mapping: the image's bytes (the rest of
    // the block is zero), the control block's self pointers (at 0 for musl
    // and glibc's `tcb`, at 16 for glibc's `self`), the child's function
    // and argument on top of its stack.
    unsafe {
        core::ptr::copy_nonoverlapping(image as *const u8, block_start as *mut u8, filesz as usize);
        *(tp as *mut usize) = tp;
        *((tp + 16) as *mut usize) = tp;
        let top = (block_start - 64) & !15;
        *((top - 16) as *mut usize) = f as usize;
        *((top - 8) as *mut usize) = arg as usize;
        let flags = libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS;
        // The thread starts with every signal blocked (the kernel's
        // signals as well as the C library's own, which it must never take
        // for a thread the C library does not know), and keeps them so.
        let (all, mut was) = (u64::MAX, 0u64);
        sys::raw(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK as u64,
            &all as *const u64 as u64,
            &mut was as *mut u64 as u64,
            8,
            0,
            0,
        );
        let id = alloctramp_static_clone(flags as u64, (top - 16) as u64, tp as u64);
        sys::raw(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK as u64, &was as *const u64 as u64, 0, 8, 0, 0);
        if id < 0 {
            call!(libc::SYS_munmap, base, len);
            return libc::EAGAIN;
        }
        if !out.is_null() {
            *out = tp as libc::pthread_t;
        }
    }
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn pthread_self() -> libc::pthread_t {
    let tp: usize;
    // SAFETY: fs:0 holds the thread control block's address.
    unsafe { core::arch::asm!("mov {}, qword ptr fs:0", out(reg) tp, options(nostack, readonly, preserves_flags)) };
    tp as libc::pthread_t
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_attr_init(attr: *mut libc::pthread_attr_t) -> i32 {
    // SAFETY: the caller's attribute object.
    unsafe { core::ptr::write_bytes(attr, 0, 1) };
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn pthread_attr_destroy(_attr: *mut libc::pthread_attr_t) -> i32 {
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_attr_setstacksize(attr: *mut libc::pthread_attr_t, size: usize) -> i32 {
    // SAFETY: the caller's attribute object; its first word holds the size.
    unsafe { *(attr as *mut usize) = size };
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn pthread_attr_setdetachstate(_attr: *mut libc::pthread_attr_t, _state: i32) -> i32 {
    0
}

static KEYS: AtomicU32 = AtomicU32::new(0);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_key_create(
    key: *mut libc::pthread_key_t,
    _dtor: Option<unsafe extern "C" fn(*mut c_void)>,
) -> i32 {
    // SAFETY: the caller's key.
    unsafe { *key = KEYS.fetch_add(1, Ordering::Relaxed) };
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn pthread_key_delete(_key: libc::pthread_key_t) -> i32 {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn pthread_setspecific(_key: libc::pthread_key_t, _value: *const c_void) -> i32 {
    0
}

#[unsafe(no_mangle)]
pub extern "C" fn __cxa_thread_atexit_impl(_dtor: *mut c_void, _obj: *mut c_void, _dso: *mut c_void) -> i32 {
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn __register_atfork(
    prepare: Option<unsafe extern "C" fn()>,
    parent: Option<unsafe extern "C" fn()>,
    child: Option<unsafe extern "C" fn()>,
    dso: *mut c_void,
) -> i32 {
    // The runtime's allocator's lock first: its prepare handler runs last,
    // its child handler first, before the runtime's allocates.
    if !ALLOCATOR_HANDLERS.swap(true, Ordering::AcqRel) {
        // SAFETY: the allocator's handlers, registered once.
        unsafe {
            __register_atfork(
                Some(crate::alloc::before_fork),
                Some(crate::alloc::after_fork),
                Some(crate::alloc::after_fork),
                dso,
            );
        }
    }
    let f = sys::host(static_host::ATFORK);
    if f == 0 {
        // The program has no registration function: keep the handlers for
        // `alloctramp_static_fork_handler`, which its fork calls.
        let at = FORKS.fetch_add(1, Ordering::AcqRel) as usize;
        let Some(slot) = HANDLERS.get(at) else { return libc::ENOMEM };
        for (w, h) in slot.iter().zip([prepare, parent, child]) {
            w.store(h.map_or(0, |h| h as usize), Ordering::Release);
        }
        return 0;
    }
    type Register = unsafe extern "C" fn(
        Option<unsafe extern "C" fn()>,
        Option<unsafe extern "C" fn()>,
        Option<unsafe extern "C" fn()>,
        *mut c_void,
    ) -> i32;
    // SAFETY: the program's own registration function (glibc's
    // `__register_atfork`, or musl's `pthread_atfork`, which ignores the
    // fourth argument), whose address the patcher stored.
    unsafe { core::mem::transmute::<usize, Register>(f as usize)(prepare, parent, child, dso) }
}

/// Fork handlers kept for [`alloctramp_static_fork_handler`]: (prepare,
/// parent, child).
static HANDLERS: [[AtomicUsize; 3]; 4] = [const { [const { AtomicUsize::new(0) }; 3] }; 4];
static ALLOCATOR_HANDLERS: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);
static FORKS: AtomicU32 = AtomicU32::new(0);

/// Runs the kept fork handlers as the C library's `__fork_handler(who)`
/// would: prepare handlers last registered first (who < 0), then parent
/// (0) or child (1) handlers in order.
///
/// `fork` may call it twice before and twice after (musl's path for a
/// process that has had threads calls the same empty function for the
/// dynamic linker too): the calling thread's flag makes the handlers run
/// at the first call before and the first call after.
#[unsafe(no_mangle)]
pub extern "C" fn alloctramp_static_fork_handler(who: i32) {
    let forking = crate::sys::forking_ptr();
    // SAFETY: the calling thread's flag.
    unsafe {
        if (who < 0) == (*forking != 0) {
            return;
        }
        *forking = u8::from(who < 0);
    }
    let n = (FORKS.load(Ordering::Acquire) as usize).min(HANDLERS.len());
    let run = |h: &[AtomicUsize; 3], k: usize| {
        let f = h[k].load(Ordering::Acquire);
        if f != 0 {
            // SAFETY: a handler the runtime registered.
            unsafe { core::mem::transmute::<usize, unsafe extern "C" fn()>(f)() };
        }
    };
    match who {
        w if w < 0 => HANDLERS[..n].iter().rev().for_each(|h| run(h, 0)),
        0 => HANDLERS[..n].iter().for_each(|h| run(h, 1)),
        _ => HANDLERS[..n].iter().for_each(|h| run(h, 2)),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_atfork(
    prepare: Option<unsafe extern "C" fn()>,
    parent: Option<unsafe extern "C" fn()>,
    child: Option<unsafe extern "C" fn()>,
) -> i32 {
    // SAFETY: as `__register_atfork`.
    unsafe { __register_atfork(prepare, parent, child, core::ptr::null_mut()) }
}
