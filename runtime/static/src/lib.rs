//! The runtime as a static program carries it: alloctramp's runtime linked
//! with a C library of its own, so that the object needs nothing at load
//! time. The patcher copies its segments into the program, resolves its
//! relocations, places its thread-local block in front of the program's,
//! and points the program's entry and first initializer at stubs that
//! start it (see docs/architecture.md, "Static programs").
//!
//! What the runtime and Rust's standard library call of a C library is
//! here, made of system calls: files, memory, signals, a thread made with
//! `clone`, an allocator of its own (the program's allocator is what the
//! runtime counts; it never calls it). The program's own C library is
//! never called, except its fork-handler registration, whose address the
//! patcher finds ([`alloctramp_trampolines::layout::static_host`]).
//!
//! Everything runs after the program's C library set up the thread
//! pointer: the entry stub only records the initial stack pointer and the
//! load bias.

#![allow(clippy::missing_safety_doc, non_camel_case_types)]

extern crate alloctramp_rt;

mod alloc;
mod libc_shim;
mod sys;
mod thread;
