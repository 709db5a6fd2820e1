//! Entry hooks: allocator functions a file defines and reaches through
//! pointers (a pool's free stored in a table of operations, called as
//! `ops->free(p)`) are seen at their own entry, as ftrace sees a kernel
//! function at its first instruction.
//!
//! No call site sees a call through a pointer, so such a function gets a
//! site of its own. The patcher moves the function's first instructions
//! (after an `endbr64`, which stays as the target of indirect branches)
//! into a stub in `.alloctramp.text` and puts a jump to the stub in their
//! place:
//!
//! ```text
//! f:     endbr64                    stub:  <the moved instructions>
//!        jmp stub   ; the site             jmp f+4+n
//!        int3 ...
//! f+4+n: <the rest of f>
//! ```
//!
//! Moved branches and memory operands relative to rip are encoded anew
//! for their new place (a `ja` of a size check becomes a `ja rel32` to the
//! same target); a function whose own branches reach into the moved bytes
//! is not hooked.
//!
//! The jump to the stub is an ordinary tail-jump site whose target is the
//! moved code, and the file holds it as its original instruction. The
//! runtime switches it as it switches any site, so while profiling is on
//! every call of the function passes its trampoline, which treats it as a
//! tail call: it counts (and tracks) the call, calls the moved code and
//! returns to the caller. The move is made once, in the file, while no
//! thread runs it: the only code rewritten in a live process is that one
//! instruction, from one jump to another. With profiling off a call costs
//! two direct jumps.
//!
//! The site is checked by the wrapper depth like the sites inside any
//! definition of an entry point that is reached other than through a site
//! (`crate::charge`): a call from a site of the file raised the depth, so
//! only the calls no site counted (through pointers) count at the hook,
//! and the hook raises the depth for the sites inside the function.
//!
//! Hooked: definitions whose address is taken or stored in data, of the
//! user's entry points, exported or not (another module's call of one
//! raises the depth), and of other allocators' APIs that the file does not
//! export (a call of one from another module's site raises no depth here);
//! not of the process's `malloc` family, whose calls through pointers a
//! dynamic program's C library makes unseen too; not a definition that
//! calls its allocator through a slot (whose site counts the same calls);
//! and only where the first instructions can move: at least five bytes of
//! whole instructions of the function that nothing branches into.

use crate::charge::Hookable;
use crate::elf::Elf;
use crate::scan::{Charge, Scan, Site, Via};
use alloctramp_trampolines::addr::Vaddr;
use alloctramp_trampolines::entry::Heap;
use alloctramp_trampolines::layout::SiteForm;
use iced_x86::{
    BlockEncoder, BlockEncoderOptions, Decoder, DecoderOptions, FlowControl, Instruction, InstructionBlock, OpKind,
};

const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
const JMP_REL32: u8 = 0xe9;
/// The length of the jump at the entry (the site).
pub const JUMP_LEN: usize = 5;

/// An instruction of a stub: its offset in the stub, and the address in the
/// function whose unwind row it has.
pub type StubPoint = (u32, u64);

/// The moved head of a hooked function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryHook {
    /// The function.
    pub function: Vaddr,
    /// The first moved instruction (past an `endbr64`): where the jump to
    /// the stub goes.
    pub at: Vaddr,
    /// The moved instructions' bytes (at least [`JUMP_LEN`]).
    pub bytes: Vec<u8>,
    /// Each moved instruction's length, in order.
    pub lens: Vec<u8>,
}

impl EntryHook {
    /// Where the function goes on after the moved instructions.
    pub fn resume(&self) -> u64 {
        self.at.0 + self.bytes.len() as u64
    }

    /// The bytes that replace the moved ones at [`EntryHook::at`]: a jump
    /// to the stub at `stub` (the site), then `int3` (never reached).
    pub fn entry_jump(&self, stub: u64) -> Option<Vec<u8>> {
        let rel = i32::try_from(stub.wrapping_sub(self.at.0 + JUMP_LEN as u64) as i64).ok()?;
        let mut out = vec![0xcc; self.bytes.len()];
        out[0] = JMP_REL32;
        out[1..JUMP_LEN].copy_from_slice(&rel.to_le_bytes());
        Some(out)
    }

    /// The stub at `stub`: the moved instructions (branches and memory
    /// operands relative to rip encoded anew for their place), and a jump
    /// back. Also, per moved instruction and for the jump back, its offset
    /// in the stub and the address it came from (where the function's
    /// unwind rows describe its frame).
    pub fn stub(&self, stub: u64) -> Result<(Vec<u8>, Vec<StubPoint>), &'static str> {
        let mut dec = Decoder::with_ip(64, &self.bytes, self.at.0, DecoderOptions::NONE);
        let moved: Vec<Instruction> = dec.iter().collect();
        if moved.len() != self.lens.len() || moved.iter().zip(&self.lens).any(|(i, &l)| i.len() != usize::from(l)) {
            return Err("the moved instructions decode differently");
        }
        let block = InstructionBlock::new(&moved, stub);
        let encoded = BlockEncoder::encode(64, block, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)
            .map_err(|_| "a moved instruction's target is out of reach")?;
        // (An instruction iced had to rewrite as several has no offset.)
        let mut points: Vec<(u32, u64)> = encoded
            .new_instruction_offsets
            .iter()
            .zip(&moved)
            .map(|(&off, i)| (off != u32::MAX).then_some((off, i.ip())))
            .collect::<Option<_>>()
            .ok_or("a moved branch's target is out of reach")?;
        let mut out = encoded.code_buffer;
        points.push((out.len() as u32, self.resume()));
        let back = stub + out.len() as u64 + JUMP_LEN as u64;
        let rel = i32::try_from(self.resume().wrapping_sub(back) as i64).map_err(|_| "the function is out of reach")?;
        out.push(JMP_REL32);
        out.extend_from_slice(&rel.to_le_bytes());
        Ok((out, points))
    }
}

/// Adds a site for each hookable definition whose head can move, at the
/// first moved instruction, in address order among the scan's sites. The
/// references to a hooked function that are no site (its address taken or
/// stored, a conditional jump to it) are dropped: whatever they reach
/// passes the hook.
pub fn add(elf: &Elf, scan: &mut Scan, hookable: &[Hookable]) {
    let exported = |addr: u64| elf.symbols(true).iter().any(|s| s.defined && s.is_func && s.global && s.value == addr);
    let mut hooked = Vec::new();
    // The eight-byte windows of the input that the hooks' jumps rewrite
    // (`emit`): two hooks never share one.
    let mut windows: Vec<(u64, u64)> = Vec::new();
    let mut heads = Vec::new();
    for h in hookable {
        let user = scan.user.contains(&h.entry);
        let other_heap = scan.entries.get(h.entry).is_some_and(|e| e.heap == Heap::Other);
        // A definition that calls its allocator through a slot (CPython's
        // API, see `crate::slots`) has a site there that counts the same
        // calls.
        let slot_site = scan.sites.iter().any(|s| scan.is_slot(s.entry) && (h.start..h.end).contains(&s.vaddr.0));
        // An exported definition is hooked only when the user names it:
        // the other modules' calls of such an entry raise the depth
        // (`crate::charge`), so the hook counts only what no site counted.
        let wanted = user || (other_heap && !exported(h.start));
        if !wanted || slot_site {
            continue;
        }
        // (Aliases of one function are hooked once.)
        if heads.iter().any(|(g, _, _): &(&Hookable, EntryHook, _)| g.start == h.start) {
            continue;
        }
        let Some(hook) = movable_head(elf, h.start, h.end) else { continue };
        let Some(offset) = elf.offset_of(hook.at) else { continue };
        heads.push((h, hook, offset));
    }
    // No code of the file reaches into the moved bytes, nor past the
    // `endbr64` to the first of them (only a loop of the function's own
    // does that; `movable_head` checked the function and its named parts).
    let reached =
        reached_inside(elf, &heads.iter().map(|(h, hook, _)| (h.start, hook.at.0, hook.resume())).collect::<Vec<_>>());
    for ((h, hook, offset), reached) in heads.into_iter().zip(reached) {
        if reached {
            continue;
        }
        // A site or a reference among the moved bytes would be rewritten
        // (the runtime writes sites) or lost.
        let (lo, hi) = (hook.at.0, hook.resume());
        let overlaps = |a: u64, len: u64| a < hi && a + len > lo;
        if scan.sites.iter().any(|s| overlaps(s.vaddr.0, u64::from(s.len)))
            || scan.unpatchable.iter().any(|r| overlaps(r.vaddr.0, 1))
        {
            continue;
        }
        let window = (offset.0 & !7, (offset.0 + hook.bytes.len() as u64).next_multiple_of(8));
        if windows.iter().any(|&(s, e)| s < window.1 && window.0 < e) || window.1 > elf.data.len() as u64 {
            continue;
        }
        windows.push(window);
        scan.sites.push(Site {
            vaddr: hook.at,
            offset,
            len: JUMP_LEN as u8,
            // (The table records the jump the plan makes, once patched:
            // see `emit`.)
            original: {
                let mut o = [0u8; 8];
                for (d, &b) in o.iter_mut().zip(elf.bytes_at(hook.at.0, JUMP_LEN).unwrap_or(&[])) {
                    *d = b;
                }
                o
            },
            form: SiteForm::JmpRel32,
            entry: h.entry,
            via: Via::Direct,
            target: hook.at,
            charge: Charge::Inside { wrapper: h.wrapper, checked: true, bump: true, external: h.external },
            under_hook: false,
            hook: Some(Box::new(hook)),
        });
        hooked.push(h.entry);
    }
    scan.unpatchable.retain(|r| !hooked.contains(&r.entry));
    if !hooked.is_empty() {
        scan.sites.sort_by_key(|s| s.vaddr);
    }
}

/// For each of `heads` (a function's start, its first moved instruction
/// and the end of the moved bytes), whether a direct branch or a reference
/// relative to rip anywhere in the file's code reaches inside the moved
/// bytes, or a branch reaches the first of them past an `endbr64`: the
/// code the scan sweeps, decoded as it decodes it (realigned at every
/// function start).
fn reached_inside(elf: &Elf, heads: &[(u64, u64, u64)]) -> Vec<bool> {
    let mut hit = vec![false; heads.len()];
    if heads.is_empty() {
        return hit;
    }
    let mut order: Vec<usize> = (0..heads.len()).collect();
    order.sort_by_key(|&k| heads[k].1);
    let mut check = |t: u64, branch: bool| {
        // The last head whose moved bytes start at or before `t`.
        let i = order.partition_point(|&k| heads[k].1 <= t);
        if let Some(&k) = i.checked_sub(1).and_then(|i| order.get(i)) {
            let (start, lo, hi) = heads[k];
            if (t > lo && t < hi) || (branch && t == lo && lo != start) {
                hit[k] = true;
            }
        }
    };
    let starts = crate::scan::function_starts(elf);
    crate::scan::for_each_instruction(elf, &starts, |ins| {
        if near_branch(ins) {
            check(ins.near_branch_target(), true);
        } else if ins.is_ip_rel_memory_operand() {
            check(ins.ip_rel_memory_address(), false);
        }
    });
    hit
}

/// The instructions at the start of the function `[start, end)` that a
/// jump can replace: past an `endbr64`, at least [`JUMP_LEN`] bytes of
/// whole instructions of the function, none a call (whose return address
/// would be in the stub, outside the exception tables) or a far branch;
/// nothing of the function or of its parts the compiler moved away
/// (`.cold`) branches into them or refers to them, and no jump goes back
/// to the function's start (a loop would pass the hook again, whose
/// checks push below the stack pointer, into a leaf function's red zone).
pub fn movable_head(elf: &Elf, start: u64, end: u64) -> Option<EntryHook> {
    let code = elf.bytes_at(start, usize::try_from(end.checked_sub(start)?).ok()?)?;
    let skip = if code.starts_with(&ENDBR64) { ENDBR64.len() } else { 0 };
    let at = start + skip as u64;
    let mut dec = Decoder::with_ip(64, &code[skip..], at, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    let mut lens = Vec::new();
    let mut n = 0usize;
    while n < JUMP_LEN {
        if !dec.can_decode() {
            return None;
        }
        dec.decode_out(&mut ins);
        let movable = matches!(
            ins.flow_control(),
            FlowControl::Next
                | FlowControl::UnconditionalBranch
                | FlowControl::ConditionalBranch
                | FlowControl::Return
                | FlowControl::IndirectBranch
        );
        if ins.is_invalid() || !movable || far(&ins) {
            return None;
        }
        lens.push(ins.len() as u8);
        n += ins.len();
    }
    let (lo, hi) = (at, at + n as u64);
    let inside = |a: u64| a > lo && a < hi;
    // Nothing in the function or its parts moved away reaches into the
    // moved instructions, and no jump goes back to its start.
    let name = elf.symbols(false).iter().find(|s| s.defined && s.is_func && s.value == start).map(|s| s.name);
    let parts = elf.symbols(false).iter().filter(|s| {
        s.defined && s.size != 0 && name.is_some_and(|n| s.name.strip_prefix(n).is_some_and(|r| r.starts_with(".cold")))
    });
    for (from, len) in std::iter::once((start, code.len() as u64)).chain(parts.map(|s| (s.value, s.size))) {
        let bytes = elf.bytes_at(from, usize::try_from(len).ok()?)?;
        let mut dec = Decoder::with_ip(64, bytes, from, DecoderOptions::NONE);
        while dec.can_decode() {
            dec.decode_out(&mut ins);
            let branch = near_branch(&ins);
            let target = ins.near_branch_target();
            let jump = branch && ins.flow_control() != FlowControl::Call;
            if (branch && inside(target))
                || (jump && (start..=lo).contains(&target))
                || (ins.is_ip_rel_memory_operand() && inside(ins.ip_rel_memory_address()))
            {
                return None;
            }
        }
    }
    let symbol_inside = elf.symbols(false).iter().chain(elf.symbols(true)).any(|s| s.defined && inside(s.value));
    if symbol_inside {
        return None;
    }
    Some(EntryHook { function: Vaddr(start), at: Vaddr(at), bytes: code[skip..skip + n].to_vec(), lens })
}

/// A direct near branch: a call, jump or conditional jump to an address.
fn near_branch(ins: &Instruction) -> bool {
    (0..ins.op_count())
        .any(|i| matches!(ins.op_kind(i), OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64))
}

/// A far branch (never in 64-bit code a compiler makes).
fn far(ins: &Instruction) -> bool {
    (0..ins.op_count()).any(|i| matches!(ins.op_kind(i), OpKind::FarBranch16 | OpKind::FarBranch32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hook(bytes: &[u8], lens: &[u8]) -> EntryHook {
        EntryHook { function: Vaddr(0x1000), at: Vaddr(0x1004), bytes: bytes.to_vec(), lens: lens.to_vec() }
    }

    #[test]
    fn a_stub_moves_the_head_and_jumps_back() {
        // push rbp; mov rbp, rsp; push rbx
        let h = hook(&[0x55, 0x48, 0x89, 0xe5, 0x53], &[1, 3, 1]);
        let (code, points) = h.stub(0x20_0000).unwrap();
        assert_eq!(&code[..5], &h.bytes[..]);
        let back = 0x20_0000 + code.len() as u64;
        assert_eq!(code[5], 0xe9);
        let rel = i32::from_le_bytes(code[6..10].try_into().unwrap());
        assert_eq!(back.wrapping_add(rel as i64 as u64), 0x1009);
        assert_eq!(points, vec![(0, 0x1004), (1, 0x1005), (4, 0x1008), (5, 0x1009)]);
        let jump = h.entry_jump(0x20_0000).unwrap();
        assert_eq!(jump[0], 0xe9);
        assert_eq!(i32::from_le_bytes(jump[1..5].try_into().unwrap()) as i64, 0x20_0000 - 0x1009);
    }

    #[test]
    fn a_moved_memory_operand_relative_to_rip_still_reaches_its_data() {
        // mov rax, [rip + 0x100] at 0x1004: reads 0x110b.
        let h = hook(&[0x48, 0x8b, 0x05, 0x00, 0x01, 0x00, 0x00], &[7]);
        let (code, _) = h.stub(0x3000).unwrap();
        let mut dec = Decoder::with_ip(64, &code[..7], 0x3000, DecoderOptions::NONE);
        assert_eq!(dec.decode().ip_rel_memory_address(), 0x110b);
        assert!(hook(&h.bytes, &h.lens).stub(0x1_0000_0000_0000).is_err());
    }

    #[test]
    fn a_moved_branch_still_reaches_its_target() {
        // test rdi, rdi; je 0x1016 (rel8) at 0x1004.
        let h = hook(&[0x48, 0x85, 0xff, 0x74, 0x0d], &[3, 2]);
        let (code, points) = h.stub(0x40_0000).unwrap();
        let mut dec = Decoder::with_ip(64, &code, 0x40_0000, DecoderOptions::NONE);
        let (test, je) = (dec.decode(), dec.decode());
        assert_eq!(test.len(), 3);
        assert!(je.is_jcc_short_or_near());
        assert_eq!(je.near_branch_target(), 0x1016);
        assert_eq!(points.first(), Some(&(0, 0x1004)));
        assert_eq!(points[1].1, 0x1007);
        let back = dec.decode();
        assert_eq!(back.near_branch_target(), 0x1009);
        assert_eq!(points[2], (back.ip() as u32 - 0x40_0000, 0x1009));
    }
}
