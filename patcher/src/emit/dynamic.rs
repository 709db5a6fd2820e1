//! The copies of the dynamic tables, each the input's with the runtime's
//! symbol and strings added and symbol indices shifted past it, and the new
//! .dynamic pointing at them.

use super::Head;
use super::symbols::Follow;
use crate::bytes::c_str;
use crate::plan::Plan;
use crate::tables::{Jmprel, Located, Rela, Sym, Tables};
use alloctramp_trampolines::layout;
use object::LittleEndian as LE;
use object::elf;
use object::pod::bytes_of;

pub(super) fn emit(head: &mut Head, plan: &Plan, follow: &Follow) {
    let (t, c) = (&plan.tables, &plan.copies);
    let strtab = dynstr(t, &plan.runtime_needed);
    let syms = dynsym(t, strtab.runtime_symbol);
    if let (Some(r), Some(h)) = (c.hash, t.hash) {
        head.put(r, &hash(&syms, &strtab.bytes, h.1));
    }
    let syms: Vec<Sym> = syms.iter().map(|s| follow.symbol(s, &strtab.bytes).unwrap_or(*s)).collect();
    head.put(c.dynsym, &syms.iter().flat_map(|s| bytes_of(s).to_vec()).collect::<Vec<u8>>());
    head.put(c.dynstr, &strtab.bytes);
    if let (Some(r), Some(v)) = (c.versym, t.versym) {
        head.put(r, &versym(t, v.items));
    }
    if let (Some(r), Some(h)) = (c.gnu_hash, t.gnu_hash) {
        head.put(r, &gnu_hash(h.items));
    }
    let mut rela = t.rela.map_or_else(Vec::new, |r| relocations(t, r));
    rela.extend_from_slice(bytes_of(&runtime_slot(plan)));
    head.put(c.rela, &rela);
    if let (Some(r), Some(Jmprel::Separate(j))) = (c.jmprel, t.jmprel) {
        head.put(r, &relocations(t, j));
    }
    head.put(plan.dynamic, &new_dynamic(plan, strtab.needed));
}

/// The new .dynstr and where the runtime's strings are in it.
struct Dynstr {
    bytes: Vec<u8>,
    needed: u64,
    runtime_symbol: u32,
}

/// The input's strings (every old offset stays valid), then the runtime's
/// DT_NEEDED string and its symbol's name.
fn dynstr(t: &Tables, runtime_needed: &str) -> Dynstr {
    let mut bytes = t.dynstr.items.to_vec();
    let needed = bytes.len() as u64;
    bytes.extend_from_slice(runtime_needed.as_bytes());
    bytes.push(0);
    let runtime_symbol = bytes.len() as u32;
    bytes.extend_from_slice(layout::RUNTIME_SYMBOL.as_bytes());
    bytes.push(0);
    Dynstr { bytes, needed, runtime_symbol }
}

/// The input's symbols with the runtime's undefined data symbol inserted.
fn dynsym(t: &Tables, name: u32) -> Vec<Sym> {
    let e = LE;
    let new_sym = Sym {
        st_name: object::U32::new(e, name),
        st_info: elf::SymbolInfo((elf::STB_GLOBAL.0 << 4) | elf::STT_OBJECT.0),
        st_other: elf::SymbolOther(elf::STV_DEFAULT.0),
        st_shndx: object::U16::new(e, elf::SHN_UNDEF),
        st_value: object::U64::new(e, 0),
        st_size: object::U64::new(e, 0),
    };
    let (before, after) = t.dynsym.items.split_at(t.insert_at as usize);
    before.iter().copied().chain([new_sym]).chain(after.iter().copied()).collect()
}

/// .gnu.version: the new symbol has version 1 (global).
fn versym(t: &Tables, old: &[u8]) -> Vec<u8> {
    let (before, after) = old.split_at(t.insert_at as usize * 2);
    [before, &1u16.to_le_bytes(), after].concat()
}

/// .gnu.hash: the same buckets and chains, symbol indices one higher (the
/// new symbol goes before the hashed ones).
fn gnu_hash(old: &[u8]) -> Vec<u8> {
    let word = |v: &[u8], at: usize| u32::from_le_bytes(v[at..at + 4].try_into().unwrap());
    let mut v = old.to_vec();
    let (nbuckets, bloom) = (word(&v, 0) as usize, word(&v, 8) as usize);
    let symoffset = word(&v, 4);
    v[4..8].copy_from_slice(&(symoffset + 1).to_le_bytes());
    let buckets_at = 16 + bloom * 8;
    for at in (0..nbuckets).map(|b| buckets_at + b * 4) {
        // Checked when read: 0 or a hashed symbol.
        let idx = word(&v, at);
        if idx != 0 {
            v[at..at + 4].copy_from_slice(&(idx + 1).to_le_bytes());
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

/// The relocation that fills the runtime slot (the control block's first
/// word) with the runtime's symbol.
fn runtime_slot(plan: &Plan) -> Rela {
    let e = LE;
    Rela {
        r_offset: object::U64::new(e, plan.control.addr.0 + u64::from(layout::control::RUNTIME)),
        r_info: object::U64::new(e, (plan.tables.insert_at << 32) | u64::from(elf::R_X86_64_GLOB_DAT.0)),
        r_addend: object::I64::new(e, 0),
    }
}

/// The new .dynamic: the input's entries pointing at the copies, the
/// runtime's DT_NEEDED after the last DT_NEEDED (first if there is none),
/// DT_INIT and DT_FINI at the stubs, DT_NULL.
fn new_dynamic(plan: &Plan, needed_off: u64) -> Vec<u8> {
    let t = &plan.tables;
    let last_needed = t.dynamic.iter().rposition(|&(tag, _)| tag == elf::DT_NEEDED.0);
    let needed = (elf::DT_NEEDED.0, needed_off);
    let mut entries: Vec<(i64, u64)> = Vec::with_capacity(plan.dynamic_count());
    if last_needed.is_none() {
        entries.push(needed);
    }
    for (i, &(tag, val)) in t.dynamic.iter().enumerate() {
        entries.push((tag, new_value(plan, tag, val)));
        if Some(i) == last_needed {
            entries.push(needed);
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
