//! Errors that say where: every problem in an input names the file offset
//! or virtual address it was found at.

use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use std::fmt;

/// Where in the input a problem was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    None,
    Offset(FileOffset),
    Vaddr(Vaddr),
    Both(FileOffset, Vaddr),
}

/// What kind of problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The input is not an ELF file at all.
    NotElf,
    /// An ELF file this tool does not handle (32-bit, another machine, a
    /// relocatable object...).
    Unsupported,
    /// Headers or tables that contradict each other or the file size.
    Malformed,
    /// The file was already patched by alloctramp.
    AlreadyPatched,
    /// A request that cannot be met (an entry point that does not exist...).
    Request,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub at: Location,
    pub what: String,
}

impl Error {
    pub fn new(kind: ErrorKind, at: Location, what: impl Into<String>) -> Error {
        Error { kind, at, what: what.into() }
    }
    pub fn malformed_at(offset: u64, what: impl Into<String>) -> Error {
        Error::new(ErrorKind::Malformed, Location::Offset(FileOffset(offset)), what)
    }
    pub fn malformed(what: impl Into<String>) -> Error {
        Error::new(ErrorKind::Malformed, Location::None, what)
    }
    pub fn unsupported(what: impl Into<String>) -> Error {
        Error::new(ErrorKind::Unsupported, Location::None, what)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Location::None => {}
            Location::Offset(o) => write!(f, "offset {o}: ")?,
            Location::Vaddr(v) => write!(f, "address {v}: ")?,
            Location::Both(o, v) => write!(f, "offset {o} (address {v}): ")?,
        }
        f.write_str(&self.what)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
