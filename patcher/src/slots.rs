//! Allocator APIs that call their allocator through a slot in data.
//!
//! CPython's `PyObject_Free(p)` is `_PyObject.free(_PyObject.ctx, p)`: a
//! `jmp [rip+disp]` through a function pointer that `PyMem_SetAllocator`
//! may change. Calls to `PyObject_Free` are sites, but most frees reach it
//! through pointers (every type's `tp_free`), which no site sees. In a file
//! that defines such a function ([`entry::slot_api`]), each call or jump
//! through a slot its code reads is a site too, of an entry of its own
//! (the API's signature after the context: [`entry::after_context`]),
//! wherever the file makes it. Inside the definition the site is checked
//! by the wrapper depth like any site of a charged definition: it counts
//! the calls that no site counted (through pointers, from a module not
//! patched), and raises the depth for the layers under it. The function a
//! slot holds at start (pymalloc, whose large objects come from
//! `PyMem_RawMalloc`) is code of the definition too ([`Charged::also`]),
//! so that those layers count nothing more.

use crate::charge::Charged;
use crate::elf::{DynReloc, Elf};
use crate::wrappers::Function;
use alloctramp_trampolines::entry::{self, EntryPoint, Target};
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Register};
use std::collections::HashMap;

/// `SHF_WRITE`.
const WRITE: u64 = 0x1;

/// Adds an entry for each slot that the file's definitions of slot APIs
/// call through, and to each definition the code its slots hold at start.
/// Returns the slots' addresses with their entries, by address (for the
/// scan: a call or jump through one is a site).
pub fn attach(elf: &Elf, entries: &mut Vec<EntryPoint>, charged: &mut [Charged]) -> Vec<(u64, usize)> {
    // Read once, when a definition has a slot.
    let mut functions: Option<Vec<Function>> = None;
    let mut relocations: Option<Vec<DynReloc>> = None;
    let mut slots: HashMap<u64, usize> = HashMap::new();
    let mut out = Vec::new();
    for c in charged.iter_mut().filter(|c| c.definition) {
        let api = &entries[c.entry];
        let (Target::Symbol(name), Some((lo, hi))) = (&api.target, c.code) else { continue };
        if !entry::slot_api(name) {
            continue;
        }
        let (display, sig, args, heap) = (api.display.clone(), entry::after_context(api.sig), api.args + 1, api.heap);
        for slot in slots_read(elf, lo, hi) {
            if slots.contains_key(&slot) {
                continue;
            }
            let e = entries.len();
            entries.push(EntryPoint {
                target: Target::Address(slot),
                display: display.clone(),
                sig,
                args: args.min(entry::REG_ARGS),
                heap,
            });
            slots.insert(slot, e);
            out.push((slot, e));
            let functions = functions.get_or_insert_with(|| crate::wrappers::functions(elf));
            let relocations = relocations.get_or_insert_with(|| elf.dynamic_relocations());
            if let Some(f) = initial_target(elf, relocations, slot).and_then(|t| function_at(functions, t)) {
                for part in std::iter::once(f).chain(parts_apart(elf, f, functions)) {
                    if !c.also.contains(&(part.start, part.end)) {
                        c.also.push((part.start, part.end));
                    }
                }
            }
        }
    }
    out.sort_unstable();
    out
}

/// The slots that the code in `[lo, hi)` calls or jumps through: words of
/// writable data that are not the GOT's (a GOT slot is an import).
fn slots_read(elf: &Elf, lo: u64, hi: u64) -> Vec<u64> {
    let Some(code) = hi.checked_sub(lo).and_then(|n| elf.bytes_at(lo, n as usize)) else { return Vec::new() };
    let mut dec = Decoder::with_ip(64, code, lo, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    let mut out = Vec::new();
    while dec.can_decode() {
        dec.decode_out(&mut ins);
        if !matches!(ins.code(), Code::Jmp_rm64 | Code::Call_rm64)
            || ins.memory_base() != Register::RIP
            || ins.memory_index() != Register::None
        {
            continue;
        }
        let slot = ins.ip_rel_memory_address();
        let data = elf.section_at(slot).is_some_and(|s| {
            s.flags & WRITE != 0
                && !s.is_exec()
                && !s.name.starts_with(".got")
                && slot.checked_add(8).is_some_and(|end| end <= s.addr.0.saturating_add(s.size))
        });
        if data && !out.contains(&slot) {
            out.push(slot);
        }
    }
    out
}

/// The address a slot holds at start: from its relocation among the
/// file's `relocations` (a position-independent file), else from the
/// file's bytes.
fn initial_target(elf: &Elf, relocations: &[DynReloc], slot: u64) -> Option<u64> {
    for r in relocations {
        if r.offset.0 != slot {
            continue;
        }
        return match (r.r_type, r.symbol) {
            // R_X86_64_RELATIVE
            (8, _) => u64::try_from(r.addend).ok(),
            // R_X86_64_64 of a function the file defines
            (1, Some(name)) => elf
                .symbols(true)
                .iter()
                .find(|s| s.name == name && s.defined && s.is_func)
                .map(|s| s.value.wrapping_add(r.addend as u64)),
            _ => None,
        };
    }
    let word = elf.bytes_at(slot, 8)?;
    Some(u64::from_le_bytes(word.try_into().ok()?)).filter(|&a| a != 0)
}

/// The code that `f` jumps to outside itself and that is no function of
/// its own: the parts a compiler moved away from it (`.cold`), which unwind
/// information describes as functions (a tail call's target is one, with a
/// symbol).
fn parts_apart(elf: &Elf, f: Function, functions: &[Function]) -> Vec<Function> {
    let named = |addr: u64| {
        elf.symbols(true).iter().any(|s| s.defined && s.is_func && s.value == addr)
            || elf.symbols(false).iter().any(|s| s.defined && s.is_func && s.value == addr && !s.name.contains(".cold"))
    };
    let Some(code) = f.end.checked_sub(f.start).and_then(|n| elf.bytes_at(f.start, n as usize)) else {
        return Vec::new();
    };
    let mut dec = Decoder::with_ip(64, code, f.start, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    let mut out: Vec<Function> = Vec::new();
    while dec.can_decode() {
        dec.decode_out(&mut ins);
        let jump = ins.is_jmp_short_or_near() || ins.is_jcc_short_or_near();
        let to = ins.near_branch_target();
        if !jump || (f.start..f.end).contains(&to) {
            continue;
        }
        let i = functions.partition_point(|g| g.start <= to);
        if let Some(&g) = i.checked_sub(1).and_then(|i| functions.get(i)).filter(|g| to < g.end)
            && g != f
            && !out.contains(&g)
            && !named(g.start)
        {
            out.push(g);
        }
    }
    out
}

/// The function that starts at `addr` (`functions` sorted by start).
fn function_at(functions: &[Function], addr: u64) -> Option<Function> {
    let i = functions.partition_point(|f| f.start < addr);
    functions.get(i).filter(|f| f.start == addr).copied()
}
