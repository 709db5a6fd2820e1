//! Where a generated trampoline keeps the stack, instruction by
//! instruction: what its unwind rows must say so that an exception or a
//! panic thrown by the function a trampoline calls unwinds through it into
//! the site's function, and so that profilers and debuggers walk past it.
//!
//! A trampoline runs on its site's frame: every entry starts with the stack
//! pointer as it was at the site. The analysis follows the code from its
//! entries and tracks how many bytes lie below the site's stack pointer (a
//! trampoline never realigns the stack: the module's vector stub does that
//! for the runtime calls that need it, under an unwind entry of its own).
//! Every instruction that moves the stack pointer is one the generator
//! emits; anything else is refused, so a change to the generator that the
//! rows cannot describe fails loudly.

use iced_x86::{Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, OpKind, Register};

/// The frame from an offset of a trampoline to the next row's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub offset: u32,
    /// The stack pointer is this many bytes below the site's.
    pub below: u32,
}

/// A trampoline's stack, from each listed offset to the next.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frames {
    /// Ascending; the first is at offset 0.
    pub rows: Vec<Row>,
    /// Every call the trampoline makes, ascending.
    pub calls: Vec<Call>,
}

/// A call instruction of a trampoline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Call {
    pub offset: u32,
    pub len: u32,
    /// A call of the site's own target (which an exception may pass),
    /// not of the runtime.
    pub target: bool,
}

/// Why a trampoline's stack could not be followed (a generator defect).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FramesError {
    pub offset: u32,
    pub what: &'static str,
}

impl std::fmt::Display for FramesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "trampoline offset {:#x}: {}", self.offset, self.what)
    }
}

/// Follows the trampoline `code` placed at `at` from its `entries`
/// (offsets; each starts on the site's stack), tracking the bytes pushed
/// below the site's stack pointer (a trampoline never realigns the stack:
/// runtime calls that need it go through the module's vector stub). `target` is the site's call
/// target: a near branch's destination, or the GOT slot a
/// `call [rip+...]` reads.
pub fn frames(code: &[u8], at: u64, entries: &[u32], target: u64) -> Result<Frames, FramesError> {
    let mut insns: Vec<Instruction> = Vec::new();
    let mut decoder = Decoder::with_ip(64, code, at, DecoderOptions::NONE);
    while decoder.can_decode() {
        let i = decoder.decode();
        if i.is_invalid() {
            // int3 padding and the like never run; anything undecodable
            // inside the code is a defect the walk below reports if it is
            // reached.
            continue;
        }
        insns.push(i);
    }
    let index_of = |addr: u64| insns.binary_search_by_key(&addr, |i| i.ip()).ok();
    let err = |i: &Instruction, what| FramesError { offset: (i.ip() - at) as u32, what };
    let mut states: Vec<Option<u32>> = vec![None; insns.len()];
    let mut work: Vec<(usize, u32)> = Vec::new();
    for &e in entries {
        let k = index_of(at + u64::from(e)).ok_or(FramesError { offset: e, what: "entry is not an instruction" })?;
        work.push((k, 0));
    }
    let mut calls = Vec::new();
    let mut info = InstructionInfoFactory::new();
    while let Some((k, s)) = work.pop() {
        if let Some(seen) = states[k] {
            if seen != s {
                return Err(err(&insns[k], "reached with two different stacks"));
            }
            continue;
        }
        states[k] = Some(s);
        let i = &insns[k];
        let next = step(&mut info, i, s).map_err(|what| err(i, what))?;
        if matches!(i.flow_control(), FlowControl::Call | FlowControl::IndirectCall) {
            calls.push(Call { offset: (i.ip() - at) as u32, len: i.len() as u32, target: calls_target(i, target) });
        }
        let follow = |addr: u64, work: &mut Vec<(usize, u32)>| -> Result<(), FramesError> {
            match index_of(addr) {
                Some(j) => {
                    work.push((j, next));
                    Ok(())
                }
                None if addr < at || addr >= at + code.len() as u64 => Ok(()),
                None => Err(err(i, "jumps into an instruction")),
            }
        };
        match i.flow_control() {
            FlowControl::Next | FlowControl::Call | FlowControl::IndirectCall => follow(i.next_ip(), &mut work)?,
            FlowControl::ConditionalBranch => {
                follow(i.next_ip(), &mut work)?;
                follow(i.near_branch_target(), &mut work)?;
            }
            FlowControl::UnconditionalBranch => follow(i.near_branch_target(), &mut work)?,
            FlowControl::IndirectBranch | FlowControl::Return => {}
            _ => return Err(err(i, "an instruction the trampolines do not use")),
        }
    }
    calls.sort_unstable();
    let mut rows: Vec<Row> = Vec::new();
    for (i, s) in insns.iter().zip(&states) {
        let Some(below) = *s else { continue };
        if rows.last().is_none_or(|last| last.below != below) {
            rows.push(Row { offset: (i.ip() - at) as u32, below });
        }
    }
    if let Some(first) = rows.first_mut() {
        first.offset = 0;
    }
    Ok(Frames { rows, calls })
}

/// Whether `i` calls the site's target.
fn calls_target(i: &Instruction, target: u64) -> bool {
    match i.op0_kind() {
        OpKind::NearBranch64 => i.near_branch_target() == target,
        OpKind::Memory => i.is_ip_rel_memory_operand() && i.ip_rel_memory_address() == target,
        _ => false,
    }
}

/// The bytes below the site's stack pointer after `i`, from `below`
/// before it.
fn step(info: &mut InstructionInfoFactory, i: &Instruction, below: u32) -> Result<u32, &'static str> {
    let imm = || i.immediate(1) as i64;
    let moved = |by: i64| -> Result<u32, &'static str> {
        u32::try_from(i64::from(below) + by).map_err(|_| "the stack pointer rises above the site's")
    };
    match i.code() {
        Code::Push_r64 | Code::Pushq_imm32 | Code::Pushq_imm8 | Code::Pushfq | Code::Push_rm64 => moved(8),
        Code::Pop_r64 | Code::Popfq => moved(-8),
        Code::Sub_rm64_imm32 | Code::Sub_rm64_imm8 if i.op0_register() == Register::RSP => moved(imm()),
        Code::Add_rm64_imm32 | Code::Add_rm64_imm8 if i.op0_register() == Register::RSP => moved(-imm()),
        Code::Lea_r64_m if i.op0_register() == Register::RSP => {
            if i.memory_base() != Register::RSP || i.memory_index() != Register::None {
                return Err("rsp loaded from another register");
            }
            moved(-(i.memory_displacement64() as i64))
        }
        _ if writes(info, i, Register::RSP) && i.flow_control() == FlowControl::Next => {
            Err("rsp written in a way the rows cannot describe")
        }
        _ => Ok(below),
    }
}

/// Whether `i` writes `reg` (or a part of it). Only an instruction that
/// names a register of `reg`'s family explicitly is asked of iced's
/// instruction information (the trampolines change rsp implicitly only by
/// push, pop and calls, which `step` handles).
fn writes(info: &mut InstructionInfoFactory, i: &Instruction, reg: Register) -> bool {
    let named = (0..i.op_count()).any(|k| i.op_kind(k) == OpKind::Register && i.op_register(k).full_register() == reg);
    named
        && info.info(i).used_registers().iter().any(|u| {
            u.register().full_register() == reg
                && !matches!(
                    u.access(),
                    iced_x86::OpAccess::Read | iced_x86::OpAccess::CondRead | iced_x86::OpAccess::None
                )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen;

    #[test]
    fn every_trampoline_shape_is_followed_and_calls_its_target_on_an_aligned_stack() {
        for (name, s) in codegen::golden::specs() {
            let at = 0x800000;
            let t = codegen::trampoline(&s, at).unwrap();
            let f = frames(&t.code, at, &t.entries(), s.target).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(f.rows[0], Row { offset: 0, below: 0 }, "{name}");
            // A tail jump that observes nothing after it jumps to its target.
            assert!(s.form.is_tail() || f.calls.iter().any(|c| c.target), "{name}: no call of the target");
            // A call's stack is 16-byte aligned as at the site (8 below it
            // at a tail jump, where the caller's return address is on top).
            let tail = if s.form.is_tail() { 8 } else { 0 };
            for c in f.calls.iter().filter(|c| c.target) {
                let row = f.rows.iter().rev().find(|r| r.offset <= c.offset).unwrap();
                assert_eq!((row.below + tail) % 16, 0, "{name}: call at {:#x}", c.offset);
            }
        }
    }

    #[test]
    fn a_stack_the_rows_cannot_describe_is_refused() {
        // mov rsp, rax
        let code = [0x48, 0x89, 0xc4, 0xc3];
        let e = frames(&code, 0x1000, &[0], 0x2000).unwrap_err();
        assert_eq!(e.offset, 0);
        // push rbx; mov rbx, rsp; and rsp, -16 (a realignment)
        let code = [0x53, 0x48, 0x89, 0xe3, 0x48, 0x83, 0xe4, 0xf0, 0xc3];
        let e = frames(&code, 0x1000, &[0], 0x2000).unwrap_err();
        assert_eq!((e.offset, e.what), (4, "rsp written in a way the rows cannot describe"));
        // Two paths that meet with different stacks: push; jz L; push; L: ret
        let code = [0x50, 0x74, 0x01, 0x50, 0xc3];
        assert_eq!(frames(&code, 0x1000, &[0], 0x2000).unwrap_err().what, "reached with two different stacks");
    }
}
