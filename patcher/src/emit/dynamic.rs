//! The copies of the dynamic tables, each the input's with the imported
//! symbols ([`layout::IMPORTS`]) and their names added and symbol indices
//! shifted past them, and the new .dynamic pointing at them.

use super::Head;
use super::symbols::Follow;
use crate::bytes::c_str;
use crate::plan::Plan;
use crate::tables::{IMPORTED, Jmprel, Located, Rela, Sym, Tables};
use alloctramp_trampolines::layout;
use object::LittleEndian as LE;
use object::elf;
use object::pod::bytes_of;

pub(super) fn emit(head: &mut Head, plan: &Plan, follow: &Follow) {
    let (t, c) = (&plan.tables, &plan.copies);
    let strtab = dynstr(t);
    let syms = dynsym(t, &strtab.names);
    if let (Some(r), Some(h)) = (c.hash, t.hash) {
        head.put(r, hash(&syms, &strtab.bytes, h.1));
    }
    let syms: Vec<Sym> = syms.iter().map(|s| follow.symbol(s, &strtab.bytes).unwrap_or(*s)).collect();
    head.put(c.dynsym, syms.iter().flat_map(|s| bytes_of(s).to_vec()).collect::<Vec<u8>>());
    head.put(c.dynstr, strtab.bytes.clone());
    if let (Some(r), Some(v)) = (c.versym, t.versym) {
        head.put(r, versym(t, v.items));
    }
    if let (Some(r), Some(h)) = (c.gnu_hash, t.gnu_hash) {
        head.put(r, gnu_hash(h.items));
    }
    let mut rela = t.rela.map_or_else(Vec::new, |r| relocations(t, r));
    for (k, import) in layout::IMPORTS.iter().enumerate() {
        rela.extend_from_slice(bytes_of(&import_slot(plan, k as u64, import)));
    }
    head.put(c.rela, rela);
    if let (Some(r), Some(Jmprel::Separate(j))) = (c.jmprel, t.jmprel) {
        head.put(r, relocations(t, j));
    }
    head.put(plan.dynamic, new_dynamic(plan, strtab.libc));
}

/// The new .dynstr and where the imported symbols' names are in it.
struct Dynstr {
    bytes: Vec<u8>,
    names: Vec<u32>,
    /// The C library's name, if the input does not need it.
    libc: Option<u64>,
}

/// The input's strings (every old offset stays valid), then the imported
/// symbols' names and, if the input does not need it, the C library's.
fn dynstr(t: &Tables) -> Dynstr {
    let mut bytes = t.dynstr.items.to_vec();
    let mut names = Vec::with_capacity(layout::IMPORTS.len());
    for import in &layout::IMPORTS {
        names.push(bytes.len() as u32);
        bytes.extend_from_slice(import.name.as_bytes());
        bytes.push(0);
    }
    let libc = (!t.needs_libc()).then(|| {
        let at = bytes.len() as u64;
        bytes.extend_from_slice(layout::LIBC_SONAME.as_bytes());
        bytes.push(0);
        at
    });
    Dynstr { bytes, names, libc }
}

/// The input's symbols with the imported ones inserted: undefined and
/// weak (a module runs unprofiled where they are missing).
fn dynsym(t: &Tables, names: &[u32]) -> Vec<Sym> {
    let e = LE;
    let new = layout::IMPORTS.iter().zip(names).map(|(import, &name)| {
        let kind = if import.function { elf::STT_FUNC } else { elf::STT_OBJECT };
        Sym {
            st_name: object::U32::new(e, name),
            st_info: elf::SymbolInfo((elf::STB_WEAK.0 << 4) | kind.0),
            st_other: elf::SymbolOther(elf::STV_DEFAULT.0),
            st_shndx: object::U16::new(e, elf::SHN_UNDEF),
            st_value: object::U64::new(e, 0),
            st_size: object::U64::new(e, 0),
        }
    });
    let (before, after) = t.dynsym.items.split_at(t.insert_at as usize);
    before.iter().copied().chain(new).chain(after.iter().copied()).collect()
}

/// .gnu.version: the new symbols have version 1 (global: the loader binds
/// each to the default version of its definition).
fn versym(t: &Tables, old: &[u8]) -> Vec<u8> {
    let (before, after) = old.split_at(t.insert_at as usize * 2);
    let new = 1u16.to_le_bytes().repeat(layout::IMPORTS.len());
    [before, &new, after].concat()
}

/// .gnu.hash: the same buckets and chains, symbol indices past the new
/// symbols (they go before the hashed ones).
fn gnu_hash(old: &[u8]) -> Vec<u8> {
    let word = |v: &[u8], at: usize| u32::from_le_bytes(v[at..at + 4].try_into().unwrap());
    let mut v = old.to_vec();
    let (nbuckets, bloom) = (word(&v, 0) as usize, word(&v, 8) as usize);
    let symoffset = word(&v, 4);
    v[4..8].copy_from_slice(&(symoffset + IMPORTED).to_le_bytes());
    let buckets_at = 16 + bloom * 8;
    for at in (0..nbuckets).map(|b| buckets_at + b * 4) {
        // Checked when read: 0 or a hashed symbol.
        let idx = word(&v, at);
        if idx != 0 {
            v[at..at + 4].copy_from_slice(&(idx + IMPORTED).to_le_bytes());
        }
    }
    v
}

/// The ELF hash function of the SysV hash table.
fn sysv_hash(name: &[u8]) -> u32 {
    let mut h: u32 = 0;
    for &c in name {
        h = (h << 4).wrapping_add(u32::from(c));
        let g = h & 0xf000_0000;
        if g != 0 {
            h ^= g >> 24;
        }
        h &= !g;
    }
    h
}

/// .hash, rebuilt for the new symbols with the input's bucket count.
fn hash(syms: &[Sym], strtab: &[u8], nbucket: u32) -> Vec<u8> {
    let n = syms.len() as u32;
    let mut buckets = vec![0u32; nbucket as usize];
    let mut chains = vec![0u32; n as usize];
    for i in (1..n).rev() {
        let name = c_str(strtab, syms[i as usize].st_name.get(LE));
        let b = (sysv_hash(name) % nbucket) as usize;
        chains[i as usize] = buckets[b];
        buckets[b] = i;
    }
    [nbucket, n].iter().chain(&buckets).chain(&chains).flat_map(|x| x.to_le_bytes()).collect()
}

/// A relocation table with symbol indices shifted.
fn relocations(t: &Tables, old: Located<Rela>) -> Vec<u8> {
    let e = LE;
    let mut v = Vec::with_capacity(old.items.len() * 24 + 24);
    for r in old.items {
        let info = r.r_info.get(e);
        let (sym, typ) = ((info >> 32) as u32, info as u32);
        let nr = Rela {
            r_offset: r.r_offset,
            r_info: object::U64::new(e, (u64::from(t.new_symbol_index(sym)) << 32) | u64::from(typ)),
            r_addend: r.r_addend,
        };
        v.extend_from_slice(bytes_of(&nr));
    }
    v
}

/// The relocation that fills import `k`'s slot in the control block with
/// its symbol (the `k`th inserted).
fn import_slot(plan: &Plan, k: u64, import: &layout::Import) -> Rela {
    let e = LE;
    let sym = plan.tables.insert_at + k;
    Rela {
        r_offset: object::U64::new(e, plan.control.addr.0 + u64::from(import.slot)),
        r_info: object::U64::new(e, (sym << 32) | u64::from(elf::R_X86_64_GLOB_DAT.0)),
        r_addend: object::I64::new(e, 0),
    }
}

/// The new .dynamic: the input's entries pointing at the copies, the C
/// library's DT_NEEDED (string at `libc`) after the last DT_NEEDED (first
/// if there is none) if the input had none, DT_INIT and DT_FINI at the
/// stubs, DT_NULL. (No DT_NEEDED for the runtime: the init stub loads it,
/// once the C library is initialized.)
fn new_dynamic(plan: &Plan, libc: Option<u64>) -> Vec<u8> {
    let t = &plan.tables;
    let last_needed = t.dynamic.iter().rposition(|&(tag, _)| tag == elf::DT_NEEDED.0);
    let mut entries: Vec<(i64, u64)> = Vec::with_capacity(plan.dynamic_count());
    let needed = libc.map(|at| (elf::DT_NEEDED.0, at));
    if last_needed.is_none() {
        entries.extend(needed);
    }
    for (i, &(tag, val)) in t.dynamic.iter().enumerate() {
        entries.push((tag, new_value(plan, tag, val)));
        if Some(i) == last_needed {
            entries.extend(needed);
        }
    }
    if t.value(elf::DT_INIT).is_none() {
        entries.push((elf::DT_INIT.0, plan.init.addr.0));
    }
    if t.value(elf::DT_FINI).is_none() {
        entries.push((elf::DT_FINI.0, plan.fini.addr.0));
    }
    entries.push((elf::DT_NULL.0, 0));
    entries.iter().flat_map(|&(tag, val)| [tag.to_le_bytes(), val.to_le_bytes()]).flatten().collect()
}

/// A dynamic entry's value in the new .dynamic.
fn new_value(plan: &Plan, tag: i64, val: u64) -> u64 {
    let (t, c) = (&plan.tables, &plan.copies);
    let moved = |r: Option<crate::plan::Region>| r.map_or(val, |r| r.addr.0);
    match elf::DynamicTag(tag) {
        elf::DT_STRTAB => c.dynstr.addr.0,
        elf::DT_STRSZ => c.dynstr.size,
        elf::DT_SYMTAB => c.dynsym.addr.0,
        elf::DT_VERSYM => moved(c.versym),
        elf::DT_GNU_HASH => moved(c.gnu_hash),
        elf::DT_HASH => moved(c.hash),
        elf::DT_RELA => c.rela.addr.0,
        elf::DT_RELASZ => c.rela.size,
        elf::DT_JMPREL => match (c.jmprel, t.jmprel, t.rela) {
            (Some(r), _, _) => r.addr.0,
            // Inside the RELA range: at the same place in its copy. (Of a
            // repeated tag only the last entry counts; an earlier one may
            // point anywhere.)
            (None, Some(Jmprel::InsideRela { .. }), Some(rela)) => {
                c.rela.addr.0.wrapping_add(val.wrapping_sub(rela.addr.0))
            }
            _ => val,
        },
        elf::DT_INIT => plan.init.addr.0,
        elf::DT_FINI => plan.fini.addr.0,
        _ => val,
    }
}
