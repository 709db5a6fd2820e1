//! Typed addresses. A file offset, a virtual address in an ELF file, and a
//! run-time address in a process are different things; mixing them up is a
//! classic source of patching bugs, so each has its own type.

use std::fmt;

macro_rules! address_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub u64);

        impl $name {
            pub fn get(self) -> u64 {
                self.0
            }
            pub fn offset_by(self, n: u64) -> Self {
                $name(self.0.wrapping_add(n))
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({:#x})"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:#x}", self.0)
            }
        }
    };
}

address_type!(
    /// A virtual address as written in the ELF file (before any load bias).
    Vaddr
);
address_type!(
    /// A byte offset in the ELF file.
    FileOffset
);
