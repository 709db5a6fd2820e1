//! The layout shared by the alloctramp patcher, runtime and report.
//!
//! * [`entry`]: allocator entry points and their calling signatures.
//! * [`addr`]: typed addresses (file offsets, virtual addresses in a file).

pub mod addr;
pub mod entry;
