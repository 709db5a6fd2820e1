//! The layout shared by the alloctramp patcher, runtime and report.
//!
//! * [`entry`]: allocator entry points and their calling signatures.
//! * [`addr`]: typed addresses (file offsets, virtual addresses in a file).
//! * [`layout`]: the site table, module control block and counters.
//! * [`fault`]: fault injection specs (which calls of which sites fail).
//! * [`process`]: the per-process counters file the runtime shares.
//! * [`trace`]: event traces: the trace file's rings and the CTF trace.
//! * [`pod`]: plain-data views, the one place bytes become structs.
//! * `codegen` (feature `codegen`): the trampolines and stubs.
//! * `frames` (feature `codegen`): where a trampoline keeps the stack, for
//!   its unwind rows.
//! * `template` (feature `codegen`): trampolines of one shape made from
//!   one generated trampoline.

pub mod addr;
#[cfg(feature = "codegen")]
pub mod codegen;
pub mod entry;
pub mod fault;
#[cfg(feature = "codegen")]
pub mod frames;
pub mod layout;
pub mod pod;
pub mod process;
#[cfg(feature = "codegen")]
pub mod template;
pub mod trace;
