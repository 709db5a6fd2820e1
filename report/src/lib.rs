//! alloctramp's report: per-site allocation figures read from a process's
//! counters file, grouped, selected, compared, and written as text in the
//! `/proc/allocinfo` layout, JSON or CSV.
//!
//! - [`read`]: a counters file's bytes to [`Figures`] (names from the site
//!   tables in the bytes, shared ones read in first, figures summed over the
//!   shards), and consistent
//!   copies of a file that a process is writing (snapshots).
//! - [`model`]: figures ([`Fig`]), rows, grouping, selection and sorting,
//!   totals, and the difference of two sets of figures.
//! - [`text`], [`json`], [`csv`]: one module per output format; each writes
//!   to a `&mut dyn Write`.
//! - [`pprof`]: a gzipped pprof heap profile (bytes out), with the call
//!   chains of [`chains`] as stacks; [`openmetrics`]: the figures of
//!   processes as OpenMetrics or Prometheus text, for `alloctramp serve`.
//!
//! - [`events`]: event traces read back and analysed (lifetimes, leaks
//!   within the trace, temporary allocations, the peak of live bytes).
//!
//! No I/O of its own: finding a process's file, reading it and printing are
//! the caller's (the `alloctramp` command).

pub mod chains;
pub mod csv;
pub mod events;
pub mod history;
pub mod json;
pub mod model;
pub mod openmetrics;
pub mod pprof;
pub mod read;
pub mod text;
pub mod watch;

pub use model::{Diff, Fig, Figures, GroupBy, ModuleInfo, ProcessInfo, Row, Selection, SiteInfo, SortKey};

use std::fmt;

/// An output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The `/proc/allocinfo` layout ([`text`]).
    Text,
    /// One JSON document ([`json`]; schema in docs/formats.md).
    Json,
    /// Comma-separated values with a header row ([`csv`]).
    Csv,
    /// A gzipped pprof heap profile ([`pprof`]).
    Pprof,
}

/// A name that is none of an enum's names (from `FromStr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownName {
    pub name: String,
    pub expected: &'static [&'static str],
}

impl fmt::Display for UnknownName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: expected one of {}", self.name, self.expected.join(", "))
    }
}

impl std::error::Error for UnknownName {}

/// `as_str`, `ALL`, `FromStr`, `Display` and `Serialize` of an enum whose
/// values have one name each (the command line's and the JSON's).
macro_rules! named {
    ($t:ident { $($v:ident => $name:literal,)* }) => {
        impl $t {
            pub const ALL: &'static [$t] = &[$($t::$v),*];
            const NAMES: &'static [&'static str] = &[$($name),*];
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($t::$v => $name,)*
                }
            }
        }
        impl std::str::FromStr for $t {
            type Err = $crate::UnknownName;
            fn from_str(s: &str) -> Result<$t, $crate::UnknownName> {
                match s {
                    $($name => Ok($t::$v),)*
                    _ => Err($crate::UnknownName { name: s.to_string(), expected: $t::NAMES }),
                }
            }
        }
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    };
}
pub(crate) use named;

named!(Format { Text => "text", Json => "json", Csv => "csv", Pprof => "pprof", });

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    #[test]
    fn every_name_parses_back_and_others_are_refused() {
        for &f in Format::ALL {
            assert_eq!(Format::from_str(f.as_str()), Ok(f));
        }
        for &k in SortKey::ALL {
            assert_eq!(k.as_str().parse(), Ok(k));
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
        for &g in GroupBy::ALL {
            assert_eq!(g.as_str().parse(), Ok(g));
        }
        let e = "Site".parse::<GroupBy>().unwrap_err();
        assert_eq!(e.to_string(), "\"Site\": expected one of site, function, file, module");
    }
}
