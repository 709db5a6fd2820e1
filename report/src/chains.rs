//! Call chains of sites (callers capture), their frames named: what
//! `report --callers` shows and the pprof profile's stacks are made of.
//! The naming itself (reading the mapped files' symbols and DWARF) is the
//! caller's.

use serde::Serialize;

/// One frame of a chain.
#[derive(Serialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    /// Run-time return address.
    pub address: u64,
    /// The file mapped there, and the address in it.
    pub module: Option<String>,
    pub module_address: Option<u64>,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
}

impl Frame {
    /// `function (file:line)`, what is known of it.
    pub fn describe(&self) -> String {
        let name = self.function.clone().unwrap_or_else(|| format!("{:#x}", self.address));
        match (&self.file, self.line, &self.module) {
            (Some(f), Some(l), _) => format!("{name} ({f}:{l})"),
            (_, _, Some(m)) => format!("{name} ({})", base(m)),
            _ => name,
        }
    }
}

fn base(p: &str) -> &str {
    p.rsplit('/').next().unwrap_or(p)
}

/// One chain of one site.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct ChainRow {
    /// The site: its module's name and address, as the report's rows give
    /// them.
    #[serde(skip)]
    pub site: (String, u64),
    pub calls: u64,
    pub bytes: u64,
    /// Innermost first: the return address out of the site's function,
    /// then its caller's, and so on.
    pub frames: Vec<Frame>,
    /// The first frame outside allocation plumbing (an index of
    /// `frames`), when the site is in plumbing (by its function's name or
    /// its source file); null when it is not (the site names the code) or
    /// every frame is.
    pub outside_plumbing: Option<usize>,
}
