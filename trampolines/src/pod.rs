//! Plain data: the one place where bytes become typed structs and back.
//!
//! A [`Pod`] type is `#[repr(C)]`, has no padding the format leaves
//! undefined, and is valid for every bit pattern (integers, byte arrays,
//! atomics of integers, arrays of those). Its fields are little-endian on
//! disk and in memory (x86-64 only). The runtime views live shared memory
//! through these types (atomics for every field another process may read
//! or write); readers copy a file's bytes into an owned, aligned value.

#![deny(clippy::indexing_slicing)]

use std::mem::{align_of, size_of};

/// Types that may be viewed over any bytes of their size.
///
/// # Safety
/// The implementing type must be `#[repr(C)]`, contain only integers,
/// integer atomics and arrays of them, be valid for every bit pattern, and
/// have no padding: every byte belongs to a field (reserved bytes are
/// declared as fields).
pub unsafe trait Pod: Sized {}

// SAFETY: integers are valid for every bit pattern.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for u16 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for u64 {}
// SAFETY: as above.
unsafe impl Pod for i64 {}

/// A view of `bytes` as a `T`, if they are long enough and aligned for it.
/// For reading: memory one writes through a `T`'s atomics is viewed with
/// [`view_shared`], which borrows it mutably.
pub fn view<T: Pod>(bytes: &[u8]) -> Option<&T> {
    if bytes.len() < size_of::<T>() || !(bytes.as_ptr() as usize).is_multiple_of(align_of::<T>()) {
        return None;
    }
    // SAFETY: long enough, aligned, and T is valid for any bits (Pod).
    Some(unsafe { &*(bytes.as_ptr() as *const T) })
}

/// A view of memory that is written through `T`'s atomics (by this and
/// other processes: a shared file mapping), if it is long enough and
/// aligned for it. The mutable borrow makes the writes the view's own.
pub fn view_shared<T: Pod>(bytes: &mut [u8]) -> Option<&T> {
    if bytes.len() < size_of::<T>() || !(bytes.as_ptr() as usize).is_multiple_of(align_of::<T>()) {
        return None;
    }
    // SAFETY: long enough, aligned, T is valid for any bits (Pod), and the
    // pointer comes from an exclusive borrow, so writes through T's atomics
    // (interior mutability) do not write through a shared reference.
    Some(unsafe { &*(bytes.as_mut_ptr() as *const T) })
}

/// An owned, aligned copy of the first `size_of::<T>()` bytes, if there are
/// that many.
pub fn copy<T: Pod>(bytes: &[u8]) -> Option<Box<T>> {
    if bytes.len() < size_of::<T>() {
        return None;
    }
    let mut b: Box<std::mem::MaybeUninit<T>> = Box::new_uninit();
    // SAFETY: the box holds size_of::<T>() bytes; every bit pattern is a
    // valid T (Pod), so after the copy it is initialized.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), b.as_mut_ptr() as *mut u8, size_of::<T>());
        Some(b.assume_init())
    }
}

/// A copy of the `T` at byte `at` of `bytes`, if it lies inside them. No
/// alignment is needed and nothing is allocated (a signal handler may read).
pub fn read<T: Pod + Copy>(bytes: &[u8], at: usize) -> Option<T> {
    let b = bytes.get(at..at.checked_add(size_of::<T>())?)?;
    // SAFETY: `b` holds size_of::<T>() bytes; every bit pattern is a valid T
    // (Pod); read_unaligned needs no alignment.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr() as *const T) })
}

/// The bytes of a value (of a value no other thread writes meanwhile: a
/// value with atomics is read byte by byte).
pub fn bytes_of<T: Pod>(v: &T) -> &[u8] {
    // SAFETY: a Pod value has no padding (every byte belongs to a field, so
    // every byte is initialized), and the reference keeps it alive.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, size_of::<T>()) }
}

/// A view of live shared memory at `addr` as a `T`.
///
/// # Safety
/// `addr` must be aligned for `T` and point at `size_of::<T>()` bytes that
/// stay mapped for as long as the reference is used; concurrent writers
/// (other threads or processes) must only touch the atomic fields.
pub unsafe fn at<'a, T: Pod>(addr: usize) -> &'a T {
    // SAFETY: the caller's contract.
    unsafe { &*(addr as *const T) }
}
