//! The shared libraries a file needs, found as the dynamic linker finds
//! them (ld.so(8)): for each `DT_NEEDED` name without a slash, the
//! directories of the file's `DT_RPATH` (when it has no `DT_RUNPATH`), then
//! `LD_LIBRARY_PATH`, then `DT_RUNPATH`, then `/etc/ld.so.cache`, then the
//! default directories; `$ORIGIN` is the directory of the file that names
//! the path. Libraries that libraries need are found the same way, breadth
//! first, each once.
//!
//! This module reads files (the libraries and the cache); the rest of the
//! patcher takes bytes.

use crate::elf::Elf;
use object::ReadRef;
use object::elf;
use object::read::elf::{Dyn, ElfFile64};
use std::path::{Path, PathBuf};

/// The default directories of the x86-64 dynamic linker on Debian and
/// Fedora (multiarch first).
const DEFAULT_DIRS: &[&str] =
    &["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];

/// What a file's dynamic section says about finding its libraries.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Needs {
    pub needed: Vec<String>,
    pub rpath: Vec<String>,
    pub runpath: Vec<String>,
}

/// `DT_NEEDED`, `DT_RPATH` and `DT_RUNPATH` of a file.
pub fn needs<'d, R: ReadRef<'d>>(file: &ElfFile64<'d, object::LittleEndian, R>) -> Needs {
    let mut n = Needs::default();
    let Ok(table) = file.elf_dynamic_table() else { return n };
    let e = object::LittleEndian;
    for d in table.dynamics().iter().take_while(|d| d.d_tag(e) != elf::DT_NULL) {
        let tag = d.d_tag(e);
        let Ok(at) = u32::try_from(d.d_val(e)) else { continue };
        let Some(s) = table.strings().get(at).ok().and_then(|s| std::str::from_utf8(s).ok()) else { continue };
        match tag {
            elf::DT_NEEDED => n.needed.push(s.to_string()),
            elf::DT_RPATH => n.rpath.extend(s.split(':').filter(|p| !p.is_empty()).map(str::to_string)),
            elf::DT_RUNPATH => n.runpath.extend(s.split(':').filter(|p| !p.is_empty()).map(str::to_string)),
            _ => {}
        }
    }
    n
}

/// Where the dynamic linker would find each library `path` needs, directly
/// or through other libraries (breadth first, each once). Libraries it
/// cannot find are left out.
pub fn libraries(path: &Path, elf: &Elf) -> Vec<PathBuf> {
    let cache = std::fs::read("/etc/ld.so.cache").map(|b| ld_so_cache(&b)).unwrap_or_default();
    let env: Vec<String> = std::env::var("LD_LIBRARY_PATH")
        .map(|v| v.split([':', ';']).filter(|p| !p.is_empty()).map(str::to_string).collect())
        .unwrap_or_default();
    let mut found: Vec<PathBuf> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut queue: Vec<(PathBuf, Needs)> = vec![(path.to_path_buf(), needs(&elf.file))];
    let mut next = 0;
    while let Some((from, n)) = queue.get(next) {
        next += 1;
        let origin = from.parent().map(Path::to_path_buf).unwrap_or_default();
        let expand = |dir: &str| {
            PathBuf::from(dir.replace("${ORIGIN}", "$ORIGIN").replace("$ORIGIN", &origin.to_string_lossy()))
        };
        let mut dirs: Vec<PathBuf> = Vec::new();
        if n.runpath.is_empty() {
            dirs.extend(n.rpath.iter().map(|d| expand(d)));
        }
        dirs.extend(env.iter().map(PathBuf::from));
        dirs.extend(n.runpath.iter().map(|d| expand(d)));
        let mut more = Vec::new();
        for name in &n.needed {
            if names.contains(name) {
                continue;
            }
            let lib = if name.contains('/') {
                Some(expand(name))
            } else {
                dirs.iter()
                    .map(|d| d.join(name))
                    .find(|p| is_x86_64_library(p))
                    .or_else(|| cache.iter().find(|(n, _)| n == name).map(|(_, p)| PathBuf::from(p)))
                    .or_else(|| DEFAULT_DIRS.iter().map(|d| Path::new(d).join(name)).find(|p| is_x86_64_library(p)))
            };
            names.push(name.clone());
            let Some(lib) = lib else { continue };
            // (Only the parts parsed are read: the library may be large,
            // libicudata's 31 MB of data.)
            let cache = std::fs::File::open(&lib).map(object::ReadCache::new);
            if let Ok(cache) = &cache
                && let Ok(file) = ElfFile64::<object::LittleEndian, _>::parse(cache)
            {
                more.push((lib.clone(), needs(&file)));
                found.push(lib);
            }
        }
        queue.extend(more);
    }
    found
}

/// Rows carried per patched file at most (12 bytes each): libraries past
/// it are left out.
const MAX_FOREIGN_ROWS: usize = 1 << 20;

/// The unwind rows of the libraries `path` needs, named in its
/// `DT_NEEDED` or in theirs (found as the dynamic linker finds them), for
/// the patched file to carry: a chain
/// that reaches their code goes on through it (the runtime uses them for
/// the loaded library with the same build-id). Libraries without a
/// build-id or `.eh_frame`, and patched ones (they carry rows of their
/// own), are left out; so is everything for a file that is not an
/// executable.
pub fn foreign_unwind(path: &Path, elf: &Elf) -> Vec<alloctramp_trampolines::layout::ForeignRows> {
    // Only an executable's are used (see the runtime's `foreign`).
    if !matches!(elf.file_type, crate::elf::FileType::Exec | crate::elf::FileType::Pie) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut total = 0;
    for lib in libraries(path, elf) {
        let Ok(data) = std::fs::read(&lib) else { continue };
        let Some(f) = library_rows(&lib.to_string_lossy(), &data) else { continue };
        if total + f.rows.len() > MAX_FOREIGN_ROWS {
            continue;
        }
        total += f.rows.len();
        out.push(f);
    }
    out
}

/// The unwind rows of the library `data` (named `path`) for a module or a
/// process's unwind file to carry; `None` for one that is patched (it
/// carries rows of its own), has no build-id (the runtime could not tell
/// it is the file loaded), or no `.eh_frame`.
pub fn library_rows(path: &str, data: &[u8]) -> Option<alloctramp_trampolines::layout::ForeignRows> {
    let elf = Elf::parse(data).ok()?;
    let build_id = elf.build_id().filter(|b| !b.is_empty())?;
    if crate::plan::is_patched(&elf) {
        return None;
    }
    let rows = crate::unwind::rows(&elf);
    (!rows.is_empty()).then(|| alloctramp_trampolines::layout::ForeignRows {
        build_id: build_id.to_vec(),
        path: path.to_string(),
        rows,
    })
}

/// Libraries whose exported functions are not searched for wrappers: the
/// C library and the dynamic linker (their allocating functions are the
/// entry points themselves, or return objects such as `FILE` that their
/// own unpatched code allocates), by SONAME prefix.
const NOT_SEARCHED: &[&str] = &["libc.so", "ld-linux", "libm.so", "libpthread.so", "libdl.so", "librt.so"];

/// What the libraries a file needs export, for [`crate::wrappers::Options`].
#[derive(Clone, Debug, Default)]
pub struct Imported {
    /// Wrapper symbol -> role.
    pub roles: std::collections::HashMap<String, crate::wrappers::Callee>,
    /// Wrapper symbol -> library file name.
    pub from: std::collections::HashMap<String, String>,
    /// The wrappers the library charges to its callers when it is patched
    /// charging callers (the sites inside check the thread's
    /// wrapper depth): the only ones a program may charge to its own
    /// calls. Filled when asked for.
    pub charged: std::collections::HashSet<String>,
    /// The wrappers whose calls are hooks in the library patched charging
    /// callers (the sites inside take the charge of an active hook).
    pub hooks: std::collections::HashSet<String>,
    /// Where the allocator's pointers are relative to those of the charged
    /// wrappers with a size header.
    pub keys: std::collections::HashMap<String, crate::scan::Keys>,
    /// Exported functions of allocation plumbing (libstdc++'s
    /// `basic_string::_M_construct`) whose calls are hooks in their library
    /// patched charging callers: calls to them are hooks in the file too.
    /// Symbol -> library file name.
    pub plumbing: std::collections::HashMap<String, String>,
}

/// The wrappers the libraries `path` needs export. Libraries are searched
/// in the dynamic linker's order, so a library's wrappers may wrap those of
/// the libraries it needs. With `charge`, each library is also analyzed as
/// `patch` would (a sweep of its code) to tell which of
/// its wrappers it charges.
pub fn imported_wrappers(
    path: &Path,
    elf: &Elf,
    entries: &[alloctramp_trampolines::entry::EntryPoint],
    charge: bool,
) -> Imported {
    let mut roles = std::collections::HashMap::new();
    let mut from = std::collections::HashMap::new();
    let mut charged = std::collections::HashSet::new();
    let mut hooks = std::collections::HashSet::new();
    let mut keys = std::collections::HashMap::new();
    let mut plumbing = std::collections::HashMap::new();
    let default_plumbing = crate::plumbing::Plumbing::default();
    let mut libs = libraries(path, elf);
    // Wrappers of wrappers across libraries: the ones needed last first.
    libs.reverse();
    for lib in libs {
        let name = lib.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if NOT_SEARCHED.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let Ok(data) = std::fs::read(&lib) else { continue };
        let Ok(lib_elf) = Elf::parse(&data) else { continue };
        let search = crate::wrappers::Options { imported: roles.clone(), ..Default::default() };
        let (wrappers, _) = crate::wrappers::discover(&lib_elf, entries, &search);
        let exported = crate::wrappers::exported(&lib_elf, entries, &wrappers);
        // Its exported plumbing (code, symbol): a hook in the library when
        // the sites inside are under a hook, or it calls hooks.
        let wrapper_names: std::collections::HashSet<&str> = exported.iter().map(|(n, _)| n.as_str()).collect();
        let pipes: Vec<(u64, u64, &str)> = lib_elf
            .symbols(true)
            .iter()
            .filter(|s| s.defined && s.is_func && s.global && s.size > 0 && s.name.starts_with("_Z"))
            .filter(|s| !wrapper_names.contains(s.name))
            .filter(|s| default_plumbing.matches(&crate::symbols::demangle(s.name)))
            .map(|s| (s.value, s.value.saturating_add(s.size), s.name))
            .collect();
        if charge && (!exported.is_empty() || !pipes.is_empty()) {
            // The library analyzed as `patch` would, with the default entry
            // points: the search just made is the one it would make when
            // those are the entry points here too.
            let found = (entries == crate::entry_set(&[]).0.as_slice()).then_some(wrappers);
            let opts = crate::wrappers::Options { search: true, charge: true, found, ..search };
            if let Ok(a) = crate::analyze_with(&data, &name, None, &[], &opts) {
                // Sites in [start, end) take a hook's charge, or call hooks.
                let hooked = |start: u64, end: u64| {
                    a.scan.sites.iter().any(|s| {
                        (s.under_hook || matches!(s.charge, crate::scan::Charge::Hook { .. }))
                            && start <= s.vaddr.0
                            && s.vaddr.0 < end
                    })
                };
                for (symbol, _) in &exported {
                    let function = crate::symbols::demangle(symbol);
                    let charges = a.scan.sites.iter().any(|s| {
                        matches!(s.charge, crate::scan::Charge::Inside { wrapper, checked: true, .. }
                            if a.wrappers.get(wrapper).is_some_and(|w| w.function == function))
                    });
                    if a.wrappers
                        .iter()
                        .filter(|w| w.function == function)
                        .any(|w| w.addr.is_some_and(|start| hooked(start.0, w.end.0)))
                    {
                        hooks.insert(symbol.clone());
                    }
                    if charges {
                        charged.insert(symbol.clone());
                        let target = alloctramp_trampolines::entry::Target::Symbol(symbol.clone());
                        if let Some(key) =
                            a.scan.entries.iter().position(|e| e.target == target).and_then(|i| a.scan.keys.get(&i))
                        {
                            keys.insert(symbol.clone(), *key);
                        }
                    }
                }
                for &(start, end, symbol) in &pipes {
                    if hooked(start, end) {
                        plumbing.entry(symbol.to_string()).or_insert_with(|| name.clone());
                    }
                }
            }
        }
        for (symbol, role) in exported {
            from.entry(symbol.clone()).or_insert_with(|| name.clone());
            roles.entry(symbol).or_insert(role);
        }
    }
    Imported { roles, from, charged, hooks, keys, plumbing }
}

/// Whether `p` is an x86-64 ELF shared object (the dynamic linker skips
/// files of other machines in a search path).
fn is_x86_64_library(p: &Path) -> bool {
    let mut head = [0u8; 20];
    let Ok(mut f) = std::fs::File::open(p) else { return false };
    use std::io::Read;
    f.read_exact(&mut head).is_ok()
        && head.starts_with(b"\x7fELF\x02\x01")
        && u16::from_le_bytes([head[18], head[19]]) == elf::EM_X86_64.0
}

/// The x86-64 libc6 entries of an `/etc/ld.so.cache` (glibc's "new"
/// format, alone or after the old one): (name, path), in the cache's order.
pub fn ld_so_cache(bytes: &[u8]) -> Vec<(String, String)> {
    const MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
    let Some(at) = bytes.windows(MAGIC.len()).position(|w| w == MAGIC) else { return Vec::new() };
    let Some(cache) = bytes.get(at..) else { return Vec::new() };
    let u32_at = |o: usize| cache.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let string = |o: u32| {
        let rest = cache.get(o as usize..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        std::str::from_utf8(rest.get(..end)?).ok()
    };
    let Some(count) = u32_at(20) else { return Vec::new() };
    let mut out = Vec::new();
    for i in 0..count as usize {
        let e = 48 + i * 24;
        let (Some(flags), Some(key), Some(value)) = (u32_at(e), u32_at(e + 4), u32_at(e + 8)) else { break };
        // FLAG_ELF_LIBC6 (3) with FLAG_X8664_LIB64 (0x0300).
        if flags & 0xffff != 0x0303 {
            continue;
        }
        if let (Some(k), Some(v)) = (string(key), string(value)) {
            out.push((k.to_string(), v.to_string()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of the new format with the given (flags, name, path).
    fn cache(entries: &[(u32, &str, &str)]) -> Vec<u8> {
        let mut strings = Vec::new();
        let base = 48 + entries.len() * 24;
        let mut table = Vec::new();
        for &(flags, name, path) in entries {
            let k = (base + strings.len()) as u32;
            strings.extend_from_slice(name.as_bytes());
            strings.push(0);
            let v = (base + strings.len()) as u32;
            strings.extend_from_slice(path.as_bytes());
            strings.push(0);
            table.extend_from_slice(&flags.to_le_bytes());
            table.extend_from_slice(&k.to_le_bytes());
            table.extend_from_slice(&v.to_le_bytes());
            table.extend_from_slice(&[0; 12]);
        }
        let mut b = b"glibc-ld.so.cache1.1".to_vec();
        b.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        b.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        b.extend_from_slice(&[0; 20]);
        b.extend(table);
        b.extend(strings);
        b
    }

    #[test]
    fn the_cache_lists_x86_64_libraries() {
        let b = cache(&[
            (0x0303, "libz.so.1", "/lib/x86_64-linux-gnu/libz.so.1"),
            (0x0003, "libz.so.1", "/lib/i386-linux-gnu/libz.so.1"),
            (0x0303, "libm.so.6", "/lib/x86_64-linux-gnu/libm.so.6"),
        ]);
        assert_eq!(
            ld_so_cache(&b),
            [
                ("libz.so.1".to_string(), "/lib/x86_64-linux-gnu/libz.so.1".to_string()),
                ("libm.so.6".to_string(), "/lib/x86_64-linux-gnu/libm.so.6".to_string())
            ]
        );
        // After an old-format cache, and cut short: what can be read.
        let mut old = b"ld.so-1.7.0\0\0\0\0\0".to_vec();
        old.extend_from_slice(&b);
        assert_eq!(ld_so_cache(&old).len(), 2);
        assert_eq!(ld_so_cache(&b[..48 + 24]), []);
        assert_eq!(ld_so_cache(b"not a cache"), []);
    }
}
