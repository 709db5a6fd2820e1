//! Finding a separate debug file the way gdb does: by build-id under the
//! debug directory, then by .gnu_debuglink next to the file, in its .debug/
//! subdirectory, and under the debug directory. This module does I/O; the
//! rest of the crate does not.

use crate::elf::Elf;
use std::path::{Path, PathBuf};

/// The default global debug directory.
pub const DEFAULT_DEBUG_DIR: &str = "/usr/lib/debug";

/// Candidate paths, in the order gdb tries them.
pub fn candidates(path: &Path, elf: &Elf, debug_dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(id) = elf.build_id().filter(|id| id.len() >= 2) {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        out.push(debug_dir.join(".build-id").join(&hex[..2]).join(format!("{}.debug", &hex[2..])));
    }
    if let Some((name, _crc)) = elf.gnu_debuglink()
        && let Ok(name) = std::str::from_utf8(name)
    {
        let dir = path.parent().unwrap_or(Path::new("."));
        let abs_dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        out.push(dir.join(name));
        out.push(dir.join(".debug").join(name));
        out.push(debug_dir.join(abs_dir.strip_prefix("/").unwrap_or(&abs_dir)).join(name));
    }
    out
}

/// Whether `candidate` belongs to `elf`: same build-id when the file has
/// one, else the CRC32 recorded in .gnu_debuglink.
pub fn matches(elf: &Elf, candidate: &[u8]) -> bool {
    if let Some(id) = elf.build_id() {
        return Elf::parse(candidate).ok().and_then(|d| d.build_id()) == Some(id);
    }
    match elf.gnu_debuglink() {
        Some((_, crc)) => crc32fast::hash(candidate) == crc,
        None => false,
    }
}
