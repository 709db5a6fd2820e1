//! The runtime's own allocator (`malloc` and friends for the runtime and
//! the standard library): power-of-two classes from 16 bytes to 64 KiB
//! carved from mapped arenas, larger blocks mapped one by one. The
//! runtime allocates little and never in a signal handler; a spin lock
//! suffices.

use crate::sys::{call, set_errno};
use core::ffi::c_void;
use core::sync::atomic::{AtomicBool, Ordering};

const HEADER: usize = 16;
const CLASSES: usize = 13; // 16 B .. 64 KiB
const ARENA: usize = 1 << 20;
/// Header tags (the header's first word).
const SMALL: u64 = 0x5a11;
const LARGE: u64 = 0x1a26e;
const ALIGNED: u64 = 0xa119;

struct Heap {
    free: [usize; CLASSES],
    bump: usize,
    end: usize,
}

static LOCK: AtomicBool = AtomicBool::new(false);
static mut HEAP: Heap = Heap { free: [0; CLASSES], bump: 0, end: 0 };

/// Fork handlers: the lock is held across the fork, so the child's copy of
/// the heap is consistent, then released in both processes.
pub unsafe extern "C" fn before_fork() {
    lock();
}
pub unsafe extern "C" fn after_fork() {
    unlock();
}

fn lock() {
    while LOCK.swap(true, Ordering::Acquire) {
        core::hint::spin_loop();
    }
}
fn unlock() {
    LOCK.store(false, Ordering::Release);
}

fn map(len: usize) -> usize {
    let r = call!(
        libc::SYS_mmap,
        0,
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1i64,
        0
    );
    if r < 0 { 0 } else { r as usize }
}

fn class_of(size: usize) -> Option<usize> {
    let need = size.checked_add(HEADER)?.max(32).checked_next_power_of_two()?;
    let c = need.trailing_zeros() as usize - 5;
    (c < CLASSES).then_some(c)
}

unsafe fn small(c: usize) -> *mut c_void {
    let block = 32usize << c;
    lock();
    // SAFETY: the lock is held; HEAP is only touched under it.
    let heap = unsafe { &mut *core::ptr::addr_of_mut!(HEAP) };
    let p = match heap.free.get(c).copied() {
        Some(head) if head != 0 => {
            // SAFETY: a free block's first word after its header links the
            // next free block of its class.
            heap.free[c] = unsafe { *((head + HEADER) as *const usize) };
            head
        }
        _ => {
            if heap.bump + block > heap.end {
                let a = map(ARENA);
                if a == 0 {
                    unlock();
                    return core::ptr::null_mut();
                }
                heap.bump = a;
                heap.end = a + ARENA;
            }
            let p = heap.bump;
            heap.bump += block;
            p
        }
    };
    unlock();
    // SAFETY: `p` starts a block of `block` bytes this allocator owns.
    unsafe {
        *(p as *mut u64) = SMALL;
        *((p + 8) as *mut u64) = c as u64;
    }
    (p + HEADER) as *mut c_void
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    if let Some(c) = class_of(size) {
        // SAFETY: a valid class.
        return unsafe { small(c) };
    }
    let Some(len) = size.checked_add(HEADER + 4095).map(|l| l & !4095) else {
        set_errno(libc::ENOMEM);
        return core::ptr::null_mut();
    };
    let p = map(len);
    if p == 0 {
        set_errno(libc::ENOMEM);
        return core::ptr::null_mut();
    }
    // SAFETY: a fresh mapping of `len` bytes.
    unsafe {
        *(p as *mut u64) = LARGE;
        *((p + 8) as *mut u64) = len as u64;
    }
    (p + HEADER) as *mut c_void
}

/// The usable size of a block and where its mapping or block starts.
unsafe fn usable(ptr: *mut c_void) -> usize {
    let h = ptr as usize - HEADER;
    // SAFETY: `ptr` came from this allocator: a header precedes it.
    let (tag, v) = unsafe { (*(h as *const u64), *((h + 8) as *const u64)) };
    match tag {
        SMALL => (32usize << v) - HEADER,
        LARGE => v as usize - HEADER,
        // SAFETY: the aligned block's header names the block it lies in.
        ALIGNED => (unsafe { usable(v as *mut c_void) }) - (ptr as usize - v as usize),
        _ => 0,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    let h = ptr as usize - HEADER;
    // SAFETY: `ptr` came from this allocator: a header precedes it.
    let (tag, v) = unsafe { (*(h as *const u64), *((h + 8) as *const u64)) };
    match tag {
        SMALL => {
            lock();
            // SAFETY: the lock is held.
            let heap = unsafe { &mut *core::ptr::addr_of_mut!(HEAP) };
            if let Some(head) = heap.free.get_mut(v as usize) {
                // SAFETY: the block is ours again; its first word links.
                unsafe { *(ptr as *mut usize) = *head };
                *head = h;
            }
            unlock();
        }
        LARGE => {
            call!(libc::SYS_munmap, h, v);
        }
        // SAFETY: the block the aligned pointer lies in.
        ALIGNED => unsafe { free(v as *mut c_void) },
        _ => {}
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return core::ptr::null_mut();
    };
    // SAFETY: plain allocation, then zeroing what was allocated.
    unsafe {
        let p = malloc(total);
        if !p.is_null() {
            core::ptr::write_bytes(p as *mut u8, 0, total);
        }
        p
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: `ptr` is null or from this allocator.
    unsafe {
        if ptr.is_null() {
            return malloc(size);
        }
        let have = usable(ptr);
        if size <= have {
            return ptr;
        }
        let p = malloc(size);
        if !p.is_null() {
            core::ptr::copy_nonoverlapping(ptr as *const u8, p as *mut u8, have);
            free(ptr);
        }
        p
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> i32 {
    if !align.is_power_of_two() || align < 8 {
        return libc::EINVAL;
    }
    // SAFETY: plain allocation; an aligned pointer inside it gets a header
    // naming the block.
    unsafe {
        if align <= HEADER {
            let p = malloc(size);
            if p.is_null() {
                return libc::ENOMEM;
            }
            *out = p;
            return 0;
        }
        let Some(room) = size.checked_add(align + HEADER) else { return libc::ENOMEM };
        let raw = malloc(room);
        if raw.is_null() {
            return libc::ENOMEM;
        }
        let p = (raw as usize + HEADER + align - 1) & !(align - 1);
        *((p - HEADER) as *mut u64) = ALIGNED;
        *((p - 8) as *mut u64) = raw as u64;
        *out = p as *mut c_void;
    }
    0
}
