//! The code generated per site: a trampoline that counts, makes the
//! original call, observes its result and returns to the code after the
//! site; and the module's init and fini stubs that register it with the
//! runtime.
//!
//! Trampolines are reached by a `jmp rel32` written over the site while
//! profiling is on, to one of their entries: the start counts and tracks
//! live objects, the count entry only counts, and a free trampoline's drain
//! entry only tracks. No entry tests the mode at run time. They make a real
//! `call` (never push+jmp), so return addresses and the shadow stack stay
//! balanced, and the stack is aligned as the ABI requires at the call. They clobber only what the original call
//! clobbers: for calls through the PLT or the GOT that is every caller-saved
//! register; for direct calls to a function in the same module (whose
//! callers may rely on fewer clobbers) every register they use is saved.

use crate::entry::{Kind, Returns, Signature, Size};
use crate::layout::{SiteForm, cell, control, shadow, undo};
use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, MemoryOperand, Register};

/// Everything a trampoline needs to know about its site and module.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TrampolineSpec {
    /// Address of the site instruction and its length.
    pub site: u64,
    pub len: u8,
    pub form: SiteForm,
    /// Branch target (a PLT stub or a definition), or the GOT slot read.
    pub target: u64,
    pub sig: Signature,
    /// Index of the site's counter cell.
    pub index: u32,
    /// Save every register used (sites that call a function of the module).
    pub preserve: bool,
    /// The module's vector stub (see [`vector_stub`]), through which a
    /// trampoline in preserve mode calls the runtime.
    pub vectors: u64,
    /// The module's wide-size stub (see [`wide_stub`]), which a free's
    /// inline path calls for a record of size 0.
    pub wide: u64,
    /// The module's trace stub (see [`trace_stub`]), which a traced entry
    /// calls to record an event.
    pub trace: u64,
    /// Argument registers the target reads (kept around a runtime call
    /// made before the original call).
    pub args: u8,
    /// Address of the module control block.
    pub control: u64,
    /// Counter shards: `shard_count - 1` and the bytes per shard.
    pub shard_mask: u32,
    pub shard_stride: u32,
    /// The site is inside an allocation wrapper that its callers' sites
    /// count for: every entry first reads the thread's wrapper depth and,
    /// if it is not 0, makes the original call without counting.
    pub depth_check: bool,
    /// The site calls an allocation wrapper whose inner sites check the
    /// depth: the counted call raises it for its duration.
    pub depth_bump: bool,
    /// The site calls an allocation wrapper with a size header in front:
    /// the wrapper returns the allocator's pointer plus `key_result`, and
    /// frees (or reallocates) its pointer argument plus `key_ptr`. Live
    /// tracking keys objects by the allocator's pointer, which a free on
    /// any path finds.
    pub key_result: i32,
    pub key_ptr: i32,
    /// The module's capture stub (see [`capture_stub`]): the trampoline
    /// gets a callers entry that records the call chain through it first.
    /// 0: no callers entry.
    pub capture: u64,
    /// A hook: the site calls a function whose allocations its callers
    /// take (an allocation wrapper whose size is not one of its arguments,
    /// or allocation plumbing). The trampoline counts nothing itself; it
    /// makes the call with the thread's charge set to this site's cell,
    /// unless an outer hook's call is under way (the outermost takes the
    /// charge, as the kernel's nested `alloc_hooks()` do). Every entry is
    /// the start.
    pub hook: bool,
    /// The site is inside a hooked function: every counting entry first
    /// checks for an active hook (the stack pointer below the hook's) and
    /// then counts, with its own size and result, into the hook's cell.
    pub charge_check: bool,
    /// The allocator behind the site is the process's malloc (the C
    /// allocator, operator new, or a wrapper found around them), which
    /// glibc's never starts two live objects in one granule with: the
    /// trampoline may record by plain store when the runtime says malloc
    /// is glibc's. False for entry points the user names (pool allocators
    /// pack objects whatever malloc is): compare-and-swap only.
    pub plain_store: bool,
    /// The allocator behind the site returns 8-aligned pointers only (an
    /// entry alloctramp knows: the C allocator, operator new, another
    /// allocator's API, or a wrapper around them). False for entries the
    /// user names, whose pool may hand out objects 4 past an 8-aligned
    /// address: a free's inline path sends those to the runtime, since
    /// decoded with such a pointer an empty granule's entry (or a freed
    /// record at the granule's start) would pass for a record.
    pub aligned: bool,
}

impl TrampolineSpec {
    /// The spec with what changes only the values in its trampoline's
    /// code, not their lengths, made alike: the addresses of the site and
    /// the target (rel32 operands), and the counter index beyond what
    /// 8-bit operands hold (displacements and immediates; an index beyond
    /// the shadow map's ids takes another path). Specs of one shape give
    /// trampolines of one length wherever their entries are in reach (but
    /// where the assembler shortens a jump to a target within 128 bytes:
    /// never a site's return or target, which are in the original code);
    /// the patcher, which lays trampolines out by these lengths, checks
    /// each, and makes them from one template (`template`).
    pub fn shape(&self) -> TrampolineSpec {
        let index = match self.index {
            i if i < 128 => i,
            i if i < 1 << shadow::ID_BITS => 128,
            _ => 129,
        };
        TrampolineSpec { site: 0, target: 0, index, ..self.clone() }
    }
}

/// Why a trampoline or stub could not be generated.
#[derive(Clone, Debug)]
pub enum CodegenError {
    /// The assembler refused the code: an address it refers to (the site,
    /// the call's target or GOT slot, the control block) out of rel32 range
    /// of where the code goes, typically.
    Assembler(iced_x86::IcedError),
    /// An entry of the trampoline is more than 64 KiB from its start (the
    /// site table holds entry offsets in 16 bits).
    TooLong,
    /// The runtime's path has a NUL byte.
    NulInPath,
}

impl std::fmt::Display for CodegenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CodegenError::Assembler(e) => e.fmt(f),
            CodegenError::TooLong => f.write_str("trampoline too long"),
            CodegenError::NulInPath => f.write_str("the runtime's path contains a NUL byte"),
        }
    }
}

impl std::error::Error for CodegenError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CodegenError::Assembler(e) => Some(e),
            CodegenError::TooLong | CodegenError::NulInPath => None,
        }
    }
}

impl From<iced_x86::IcedError> for CodegenError {
    fn from(e: iced_x86::IcedError) -> Self {
        CodegenError::Assembler(e)
    }
}

type R<T> = Result<T, CodegenError>;

fn rip(addr: u64) -> MemoryOperand {
    MemoryOperand::with_base_displ(Register::RIP, addr as i64)
}

const ARG_REGS: [AsmRegister64; 6] = [rdi, rsi, rdx, rcx, r8, r9];

/// The trace record's fields (see [`crate::trace::Record`]) as a traced
/// entry writes them.
const SITE_FIELD: u32 = crate::trace::SITE_SHIFT;
const RECORD_TSC: i32 = std::mem::offset_of!(crate::trace::Record, tsc) as i32;
const RECORD_PTR: i32 = std::mem::offset_of!(crate::trace::Record, ptr) as i32;
const RECORD_SIZE: i32 = std::mem::offset_of!(crate::trace::Record, size) as i32;
const RECORD_WORD: i32 = std::mem::offset_of!(crate::trace::Record, word) as i32;
const RECORD_BYTES: i32 = std::mem::size_of::<crate::trace::Record>() as i32;
const _: () = assert!(crate::trace::CPU_SHIFT == 3 && crate::trace::ALLOC_SITE_SHIFT == 32);

/// The thread's charge id (the hook's shadow-map entry base, 0: none),
/// from the charge's TLS offset: the runtime's word two below the charge.
const CHARGE_ID: i32 = -16;

struct Gen<'a> {
    a: CodeAssembler,
    s: &'a TrampolineSpec,
    /// Bytes pushed since the live path's frame was set up.
    depth: i32,
    /// Generating the charged paths: the cell is the active hook's, read
    /// from the thread's charge, not this site's.
    charged: bool,
    /// What an unwind through each call of the target undoes (`undo`
    /// flags, size position), in the order the calls are emitted (their
    /// address order).
    undo: Vec<(u8, i32)>,
    /// The flags for the next call of the target.
    undo_next: u8,
    /// Emitting the adds of a thread that shares its shard: `lock add`.
    locked: bool,
    /// Code out of the entries' way, emitted after them: the shared-shard
    /// copies of counting blocks ([`Self::counted`]).
    deferred: Vec<Deferred>,
    /// Generating the traced entry (see [`Self::traceable`]): its inline
    /// paths read the control block's trace limits and have the module's
    /// trace stub record each event.
    traced: bool,
    /// The start entry's live path of an allocation, which the traced entry
    /// joins (same frame): where it calls the runtime with the object, and
    /// where it counts a failed call.
    live_slow: Option<CodeLabel>,
    live_fail: Option<CodeLabel>,
}

/// A block emitted after the entries (see [`Gen::deferred`]).
struct Deferred {
    /// Where the entries jump to it.
    label: CodeLabel,
    /// Where it continues.
    back: CodeLabel,
    /// A counting block, which loads shard 0's address first (and has the
    /// runtime assign the thread's word if it is 0); else the block only
    /// adds, locked.
    counting: bool,
    /// The adds, emitted with `lock`.
    body: Body,
    /// What follows them (None: a jump back to where the entry's copy of
    /// the block ends): a locked copy of the code after the block.
    then: Option<Body>,
}

type Body = Box<dyn Fn(&mut Gen<'_>) -> R<()>>;

impl Gen<'_> {
    fn add(&mut self, i: Result<Instruction, iced_x86::IcedError>) -> R<()> {
        self.a.add_instruction(i?)?;
        Ok(())
    }

    /// On a charged path: r11 = the active hook's cell (where
    /// [`Self::field`] finds it).
    fn charge_cell(&mut self) -> R<()> {
        debug_assert!(self.charged);
        self.charge_word(r11)?;
        Ok(self.a.mov(r11, qword_ptr(r11).fs())?)
    }

    /// Whether a free's inline path can take its shard of the freed view
    /// from the counting's shard word (see [`Self::counted`]): r10 is not
    /// saved around the counting, and the module's shards are shards of
    /// the view.
    fn freed_shard_from_count(&self) -> bool {
        !self.s.preserve && !self.charged && self.s.shard_mask < shadow::FREED_SHARDS
    }

    /// A counting block: r11 = where [`Self::field`] finds the site's cell
    /// in the thread's shard (on a charged path, the active hook's cell),
    /// then `body`, which adds to it. With `freed_shard` (see
    /// [`Self::freed_shard_from_count`]), also r10 = the freed view's
    /// shard of the same number.
    ///
    /// The shard word (see [`layout::shard`](crate::layout::shard)) times
    /// the shard stride overflows exactly for a thread that owns its
    /// shard: the body then adds with plain instructions. Any other thread
    /// goes to the block's copy after the entries, which adds to shard 0
    /// with `lock`, first having the runtime assign the thread's word if it
    /// was 0. A charged path adds with `lock` (the hook's
    /// cell may be shard 0's).
    fn counted(&mut self, freed_shard: bool, body: impl Fn(&mut Gen<'_>) -> R<()> + 'static) -> R<()> {
        self.counted_then(freed_shard, body, None)
    }

    /// [`Self::counted`]; the shared-shard copy continues with `then`
    /// (emitted with `lock`) instead of jumping back.
    fn counted_then(
        &mut self,
        freed_shard: bool,
        body: impl Fn(&mut Gen<'_>) -> R<()> + 'static,
        then: Option<Body>,
    ) -> R<()> {
        if self.charged {
            self.charge_cell()?;
            let was = std::mem::replace(&mut self.locked, true);
            body(self)?;
            self.locked = was;
            return Ok(());
        }
        let s = self.s;
        let (shared, mut back) = (self.a.create_label(), self.a.create_label());
        self.with_control(Code::Mov_r64_rm64, Register::R11, control::SHARD_TLS)?;
        if freed_shard {
            self.freed_shard_base(r11)?;
        }
        self.a.mov(r11, qword_ptr(r11).fs())?;
        self.a.imul_3(r11, r11, s.shard_stride as i32)?;
        self.a.jno(shared)?;
        self.with_control(Code::Add_r64_rm64, Register::R11, control::COUNTERS)?;
        body(self)?;
        self.a.set_label(&mut back)?;
        // (The next instruction may take a label of its own.)
        self.a.zero_bytes()?;
        self.deferred.push(Deferred { label: shared, back, counting: true, body: Box::new(body), then });
        Ok(())
    }

    /// r10 = the thread's shard of the freed view, given `tls` = the
    /// thread-pointer offset of its shard word: the word after it holds
    /// the shard's offset in the view (0: shard 0).
    fn freed_shard_base(&mut self, tls: AsmRegister64) -> R<()> {
        self.a.mov(r10, qword_ptr(tls + 8).fs())?;
        self.with_control(Code::Add_r64_rm64, Register::R10, control::FREED)
    }

    /// Emits the deferred blocks (after every entry).
    fn emit_deferred(&mut self) -> R<()> {
        for mut d in std::mem::take(&mut self.deferred) {
            self.a.set_label(&mut d.label)?;
            if d.counting {
                // r11 = the word times the stride: 0 for a word not yet
                // assigned (the runtime assigns it; this call still counts
                // into shard 0); otherwise the thread shares shard 0.
                let mut assigned = self.a.create_label();
                self.a.test(r11, r11)?;
                self.a.jnz(assigned)?;
                self.add(Instruction::with1(Code::Call_rm64, rip(self.s.control + u64::from(control::ASSIGN))))?;
                self.a.set_label(&mut assigned)?;
                self.with_control(Code::Mov_r64_rm64, Register::R11, control::COUNTERS)?;
            }
            let was = std::mem::replace(&mut self.locked, true);
            (d.body)(self)?;
            match &d.then {
                Some(then) => then(self)?,
                None => self.a.jmp(d.back)?,
            }
            self.locked = was;
        }
        // (A deferred block defers nothing itself.)
        debug_assert!(self.deferred.is_empty());
        Ok(())
    }

    /// The offset of the cell from what [`Self::counted`] loads.
    fn cell_offset(&self) -> i32 {
        if self.charged { 0 } else { (self.s.index as i64 * crate::layout::CELL_SIZE as i64) as i32 }
    }

    fn field(&self, f: u32) -> AsmMemoryOperand {
        qword_ptr(r11 + (self.cell_offset() + f as i32))
    }

    /// `reg` = the thread-pointer offset of the thread's charge (the
    /// hook's cell; the hook's stack pointer is the next word).
    fn charge_word(&mut self, reg: AsmRegister64) -> R<()> {
        let control = self.s.control;
        self.add(Instruction::with2(
            Code::Mov_r64_rm64,
            Register::from(reg),
            rip(control + u64::from(control::CHARGE_TLS)),
        ))
    }

    /// An entry's check at a site inside a hooked function: to `charged`
    /// if a hook's call is under way on the thread: the stack pointer is
    /// below the one the hook recorded (0 when there is none), and the word
    /// below that is still the hook's return address. A hook's call left
    /// without returning (`longjmp`) fails the second test once the stack
    /// is reused; the gate then clears the charge.
    fn charge_gate(&mut self, charged: CodeLabel) -> R<()> {
        if !self.s.charge_check {
            return Ok(());
        }
        let preserve = self.s.preserve;
        let mut cont = self.a.create_label();
        let mut restore = self.a.create_label();
        if preserve {
            self.a.push(r11)?;
            self.a.push(r10)?;
            self.a.lea(r10, qword_ptr(rsp + 16))?;
            self.charge_word(r11)?;
            self.a.cmp(r10, qword_ptr(r11 + 8).fs())?;
            self.a.jae(restore)?;
        } else {
            self.charge_word(r11)?;
            self.a.cmp(rsp, qword_ptr(r11 + 8).fs())?;
            self.a.jae(cont)?;
        }
        let mut stale = self.a.create_label();
        if preserve {
            self.hook_returns_to(stale)?;
            self.a.pop(r10)?;
            self.a.pop(r11)?;
            self.a.jmp(charged)?;
        } else {
            self.a.mov(r10, qword_ptr(r11 + 8).fs())?;
            self.load_hook_word()?;
            self.a.cmp(r10, qword_ptr(r11 + 16).fs())?;
            self.a.je(charged)?;
        }
        self.a.set_label(&mut stale)?;
        self.a.mov(qword_ptr(r11 + 8).fs(), 0)?;
        if preserve {
            self.a.set_label(&mut restore)?;
            self.a.pop(r10)?;
            self.a.pop(r11)?;
        }
        Ok(self.a.set_label(&mut cont)?)
    }

    /// With r11 the thread's charge offset and a hook's stack pointer
    /// recorded: to `stale` unless the word below it is the hook's return
    /// address. Clobbers r10.
    fn hook_returns_to(&mut self, stale: CodeLabel) -> R<()> {
        self.a.mov(r10, qword_ptr(r11 + 8).fs())?;
        self.load_hook_word()?;
        self.a.cmp(r10, qword_ptr(r11 + 16).fs())?;
        Ok(self.a.jne(stale)?)
    }

    /// r10 = the word below the hook's stack pointer in r10, with the one
    /// instruction the runtime's fault handler completes when that word is
    /// no longer mapped ([`CHECK_LOAD`](crate::layout::CHECK_LOAD)).
    fn load_hook_word(&mut self) -> R<()> {
        Ok(self.a.mov(r10, qword_ptr(r10 - 8))?)
    }

    /// Loads the arguments that name the counted cell for a runtime call:
    /// `index` = the site's index and `control` = the control block, or on
    /// a charged path `index` = the hook's cell and `control` = 0.
    fn cell_args(&mut self, index: AsmRegister64, control: AsmRegister64) -> R<()> {
        if self.charged {
            self.charge_word(index)?;
            self.a.mov(index, qword_ptr(index).fs())?;
            self.a.xor(control, control)?;
        } else {
            let index32 = Register::from(index).full_register32();
            self.add(Instruction::with2(Code::Mov_r32_imm32, index32, self.s.index))?;
            self.add(Instruction::with2(Code::Lea_r64_m, Register::from(control), rip(self.s.control)))?;
        }
        Ok(())
    }

    fn count_one(&mut self, f: u32) -> R<()> {
        let m = self.field(f);
        if self.locked {
            self.a.lock().add(m, 1)?;
        } else {
            self.a.add(m, 1)?;
        }
        Ok(())
    }

    fn count_reg(&mut self, f: u32, reg: AsmRegister64) -> R<()> {
        let m = self.field(f);
        if self.locked {
            self.a.lock().add(m, reg)?;
        } else {
            self.a.add(m, reg)?;
        }
        Ok(())
    }

    fn push_all(&mut self, regs: &[AsmRegister64]) -> R<()> {
        for &r in regs {
            self.a.push(r)?;
        }
        Ok(())
    }

    fn pop_all(&mut self, regs: &[AsmRegister64]) -> R<()> {
        for &r in regs.iter().rev() {
            self.a.pop(r)?;
        }
        Ok(())
    }

    /// Registers a counting block clobbers (beyond rax) in preserve mode.
    fn saved(&self, regs: &'static [AsmRegister64]) -> &'static [AsmRegister64] {
        if self.s.preserve { regs } else { &[] }
    }

    /// Counting before the call: calls and bytes requested.
    fn count_before(&mut self) -> R<()> {
        self.count_before_then(false, None)
    }

    /// [`Self::count_before`]; with `freed_shard`, leaving r10 as
    /// [`Self::counted`] does. A thread that shares shard 0 continues with
    /// `then` (see [`Self::counted_then`]), which must follow the counting
    /// directly (no register saved around it, no charge).
    fn count_before_then(&mut self, freed_shard: bool, then: Option<Body>) -> R<()> {
        let sig = self.s.sig;
        let save = self.saved(&[r11]);
        debug_assert!(then.is_none() || (save.is_empty() && !self.charged));
        self.push_all(save)?;
        self.counted_then(
            freed_shard,
            move |g| {
                g.count_one(cell::CALLS)?;
                match sig.size {
                    Size::Arg(a) => g.count_reg(cell::BYTES, ARG_REGS[a as usize])?,
                    Size::Product(x, y) => {
                        // rax is overwritten by the call's result anyway.
                        g.a.mov(rax, ARG_REGS[x as usize])?;
                        g.a.imul_2(rax, ARG_REGS[y as usize])?;
                        g.count_reg(cell::BYTES, rax)?;
                    }
                    Size::None | Size::ResultStrlen => {}
                }
                Ok(())
            },
            then,
        )?;
        let bytes = match sig.size {
            Size::Arg(a) => Some(ARG_REGS[a as usize]),
            Size::Product(..) => Some(rax),
            Size::None | Size::ResultStrlen => None,
        };
        self.chain_add(true, bytes)?;
        self.pop_all(save)
    }

    /// On a charged path, when callers capture recorded the hook's call
    /// chain: adds this call (if `call`) and the bytes in `bytes` to it.
    /// Keeps r11 (the hook's cell) and every register but r10 (that too in
    /// preserve mode).
    fn chain_add(&mut self, call: bool, bytes: Option<AsmRegister64>) -> R<()> {
        use crate::process::ChainSlot;
        if !self.charged {
            return Ok(());
        }
        let save = self.saved(&[r10]);
        self.push_all(save)?;
        let (mut skip, mut other) = (self.a.create_label(), self.a.create_label());
        // No chain (the common case): one compare.
        self.charge_word(r10)?;
        self.a.cmp(qword_ptr(r10 + 32).fs(), 0)?;
        self.a.je(skip)?;
        self.a.mov(r11, qword_ptr(r10 + 32).fs())?;
        self.a.cmp(r11, qword_ptr(r10 + 8).fs())?;
        self.a.jne(other)?;
        self.a.mov(r10, qword_ptr(r10 + 24).fs())?;
        if call {
            self.a.lock().add(qword_ptr(r10 + std::mem::offset_of!(ChainSlot, calls) as i32), 1)?;
        }
        if let Some(b) = bytes {
            self.a.lock().add(qword_ptr(r10 + std::mem::offset_of!(ChainSlot, bytes) as i32), b)?;
        }
        // r11 was used: the hook's cell again.
        self.a.set_label(&mut other)?;
        self.charge_cell()?;
        self.a.set_label(&mut skip)?;
        self.pop_all(save)
    }

    /// Adds `delta` to the thread's wrapper depth (a depth-bumping site's
    /// counted call); keeps every register but r11 (and r11 too in
    /// preserve mode) and rax.
    fn add_depth(&mut self, delta: i32) -> R<()> {
        if !self.s.depth_bump {
            return Ok(());
        }
        let save = self.saved(&[r11]);
        self.push_all(save)?;
        self.depth_word(r11)?;
        self.a.add(qword_ptr(r11).fs(), delta)?;
        self.pop_all(save)
    }

    /// `reg` = the thread-pointer offset of the thread's wrapper depth.
    fn depth_word(&mut self, reg: AsmRegister64) -> R<()> {
        let control = self.s.control;
        self.add(Instruction::with2(
            Code::Mov_r64_rm64,
            Register::from(reg),
            rip(control + u64::from(control::DEPTH_TLS)),
        ))
    }

    /// An entry's first check at a depth-checking site: to `plain` if the
    /// thread is inside a wrapper call that a site counts.
    fn depth_gate(&mut self, plain: CodeLabel) -> R<()> {
        if !self.s.depth_check {
            return Ok(());
        }
        let save = self.saved(&[r11]);
        self.push_all(save)?;
        self.depth_word(r11)?;
        self.a.cmp(qword_ptr(r11).fs(), 0)?;
        self.pop_all(save)?;
        Ok(self.a.jne(plain)?)
    }

    /// The original call or jump, counting nothing (the depth gate's way).
    fn plain(&mut self, mut label: CodeLabel) -> R<()> {
        if !self.s.depth_check {
            return Ok(());
        }
        self.a.set_label(&mut label)?;
        if self.s.form.is_tail() {
            self.jump_target()
        } else {
            self.call_target_plain()?;
            self.leave()
        }
    }

    /// The original call, made from the trampoline (raising the wrapper
    /// depth around it at a bumping site).
    fn call_target(&mut self) -> R<()> {
        self.add_depth(1)?;
        self.undo_next = self.counted_undo();
        self.call_target_plain()?;
        self.add_depth(-1)
    }

    /// What an unwind through a counted call undoes: an allocation that
    /// throws counts as failed, and a raised depth goes down.
    fn counted_undo(&self) -> u8 {
        let failed = match self.s.sig.kind {
            Kind::Alloc if !self.s.hook => undo::FAILED | if self.charged { undo::CHARGED } else { 0 },
            _ => 0,
        };
        failed | if self.s.depth_bump { undo::DEPTH } else { 0 }
    }

    fn call_target_plain(&mut self) -> R<()> {
        let s = self.s;
        let what = std::mem::take(&mut self.undo_next);
        self.undo.push((what, 0));
        if s.form.is_tail() {
            // At a tail jump the stack holds the caller's return address:
            // realign for the call, and return to the caller's caller.
            self.a.sub(rsp, 8)?;
        }
        if s.form.through_got() {
            self.add(Instruction::with1(Code::Call_rm64, rip(s.target)))?;
        } else {
            self.a.call(s.target)?;
        }
        if s.form.is_tail() {
            self.a.add(rsp, 8)?;
        }
        Ok(())
    }

    /// Leaves the trampoline: back after the site, or to the caller's caller.
    fn leave(&mut self) -> R<()> {
        if self.s.form.is_tail() {
            self.a.ret()?;
        } else {
            self.a.jmp(self.s.site + u64::from(self.s.len))?;
        }
        Ok(())
    }

    /// A tail jump to the original target (nothing to observe afterwards).
    fn jump_target(&mut self) -> R<()> {
        let s = self.s;
        if s.form.through_got() {
            self.add(Instruction::with1(Code::Jmp_rm64, rip(s.target)))?;
        } else {
            self.a.jmp(s.target)?;
        }
        Ok(())
    }

    /// An allocation or realloc trampoline: at its start the entry that
    /// counts and tracks the object (live tracking); then the entry that
    /// only counts. Returns the label of the latter.
    fn alloc_like(&mut self) -> R<CodeLabel> {
        let plain = self.a.create_label();
        let (mut charged_start, mut charged_count) = (self.a.create_label(), self.a.create_label());
        self.depth_gate(plain)?;
        self.charge_gate(charged_start)?;
        self.alloc_start()?;
        let mut count = self.a.create_label();
        self.a.set_label(&mut count)?;
        self.depth_gate(plain)?;
        self.charge_gate(charged_count)?;
        self.alloc_count()?;
        self.plain(plain)?;
        if self.s.charge_check {
            // The same two bodies again, counting into the hook's cell.
            self.charged = true;
            self.a.set_label(&mut charged_start)?;
            self.alloc_start()?;
            self.a.set_label(&mut charged_count)?;
            self.alloc_count()?;
            self.charged = false;
        }
        Ok(count)
    }

    /// The traced entry (see [`Self::traceable`]), if the site has one:
    /// the start entry's counting and inline path again, reading the trace
    /// limits and having the module's trace stub record each event, and
    /// joining the start entry for everything else: an allocation's
    /// runtime call and failure (in the same frame), a free's runtime call
    /// (`drain`, the drain entry), which records the event. A thread that
    /// shares shard 0 frees through the runtime too.
    fn traced_entry(&mut self, drain: Option<CodeLabel>) -> R<Option<CodeLabel>> {
        if !self.traceable() {
            return Ok(None);
        }
        let mut entry = self.a.create_label();
        self.a.set_label(&mut entry)?;
        self.traced = true;
        match drain {
            Some(drain) => {
                let shard = self.freed_shard_from_count();
                let then: Option<Body> =
                    shard.then(|| -> Body { Box::new(move |g: &mut Gen<'_>| Ok(g.a.jmp(drain)?)) });
                self.count_before_then(shard, then)?;
                self.free_inline(drain, shard)?;
            }
            None => {
                debug_assert!(self.live_slow.is_some(), "a traceable allocation's start entry records inline");
                self.alloc_start()?;
            }
        }
        self.traced = false;
        Ok(Some(entry))
    }

    /// The body of an allocation's start entry: counts, then tracks.
    fn alloc_start(&mut self) -> R<()> {
        self.count_before()?;
        if self.s.sig.kind == Kind::Realloc { self.realloc_live() } else { self.alloc_live() }
    }

    /// The body of an allocation's count entry.
    fn alloc_count(&mut self) -> R<()> {
        self.count_before()?;
        self.call_target()?;
        let mut fail = self.a.create_label();
        self.test_result(fail)?;
        if self.s.sig.size == Size::ResultStrlen {
            let save = self.saved(&[rcx, rdx, rdi, r11]);
            self.push_all(save)?;
            self.strlen_bytes()?;
            self.pop_all(save)?;
        }
        self.leave()?;
        self.a.set_label(&mut fail)?;
        self.count_failed()?;
        self.leave()
    }

    /// Jumps to `fail` if the call failed (NULL, or non-zero for out-arg
    /// allocators).
    fn test_result(&mut self, fail: CodeLabel) -> R<()> {
        match self.s.sig.result {
            Returns::OutArg(_) => {
                self.a.test(eax, eax)?;
                self.a.jne(fail)?;
            }
            _ => {
                self.a.test(rax, rax)?;
                self.a.je(fail)?;
            }
        }
        Ok(())
    }

    fn count_failed(&mut self) -> R<()> {
        let save = self.saved(&[r11]);
        self.push_all(save)?;
        self.counted(false, |g| g.count_one(cell::FAILED))?;
        self.pop_all(save)
    }

    /// rcx = strlen(rax) + 1, counted as bytes; rax kept. Clobbers rdx,
    /// rdi, r11.
    fn strlen_bytes(&mut self) -> R<()> {
        self.a.mov(rdx, rax)?;
        self.a.mov(rdi, rax)?;
        self.a.xor(eax, eax)?;
        self.a.mov(rcx, -1i64)?;
        self.a.repne().scasb()?;
        self.a.not(rcx)?;
        self.a.mov(rax, rdx)?;
        self.counted(false, |g| g.count_reg(cell::BYTES, rcx))?;
        self.chain_add(false, Some(rcx))
    }

    /// Stack bytes for `slots` saved u64s such that rsp is 16-byte aligned
    /// below them (the stack holds a return address at a tail jump).
    fn frame_size(&self, slots: usize) -> i32 {
        let entry = if self.s.form.is_tail() { 8 } else { 0 };
        let mut f = 8 * slots as i32;
        while (f + entry) % 16 != 0 {
            f += 8;
        }
        f
    }

    /// Saved slot `k` of the live path's frame.
    fn slot(&self, k: usize) -> AsmMemoryOperand {
        qword_ptr(rsp + (self.depth + 8 * k as i32))
    }

    fn open_frame(&mut self, keep: &[AsmRegister64], extra: usize) -> R<i32> {
        let f = self.frame_size(keep.len() + extra);
        if f != 0 {
            self.a.sub(rsp, f)?;
        }
        self.depth = 0;
        for (k, &r) in keep.iter().enumerate() {
            let m = self.slot(k);
            self.a.mov(m, r)?;
        }
        Ok(f)
    }

    fn close_frame(&mut self, f: i32) -> R<()> {
        if f != 0 {
            self.a.add(rsp, f)?;
        }
        Ok(())
    }

    /// Calls the runtime function in control block field `hook` with rsp
    /// 16-byte aligned; `setup` loads its arguments. In preserve mode every
    /// caller-saved register survives the call, and the vector registers
    /// too: the call goes through the module's [`vector_stub`] (the
    /// function's address in rax), which realigns the stack itself.
    fn runtime_call(&mut self, hook: u32, setup: impl FnOnce(&mut Self) -> R<()>) -> R<()> {
        const SAVED: [AsmRegister64; 8] = [rcx, rdx, rsi, rdi, r8, r9, r10, r11];
        let preserve = self.s.preserve;
        if preserve {
            self.push_all(&SAVED)?;
            self.depth += 64;
        }
        setup(self)?;
        let at = rip(self.s.control + u64::from(hook));
        if preserve {
            self.add(Instruction::with2(Code::Mov_r64_rm64, Register::RAX, at))?;
            self.a.call(self.s.vectors)?;
            self.pop_all(&SAVED)?;
            self.depth -= 64;
        } else {
            self.add(Instruction::with1(Code::Call_rm64, at))?;
        }
        Ok(())
    }

    /// The original call with its arguments in the frame.
    fn call_in_frame(&mut self) -> R<()> {
        let s = self.s;
        self.add_depth(1)?;
        let mut what = self.counted_undo();
        if what & undo::FAILED != 0 {
            what |= match s.sig.size {
                Size::Arg(_) => undo::LIVE_SIZE,
                Size::Product(_, _) => undo::LIVE_SIZE | undo::LIVE_PRODUCT,
                _ => 0,
            };
        }
        self.undo.push((what, self.depth));
        if s.form.through_got() {
            self.add(Instruction::with1(Code::Call_rm64, rip(s.target)))?;
        } else {
            self.a.call(s.target)?;
        }
        self.add_depth(-1)
    }

    /// `dst` = the requested size, from frame slots `at` (the size
    /// registers) or rcx (strlen).
    fn size_to(&mut self, dst: AsmRegister64, at: [usize; 2]) -> R<()> {
        match self.s.sig.size {
            Size::Arg(_) => {
                let m = self.slot(at[0]);
                self.a.mov(dst, m)?;
            }
            Size::Product(_, _) => {
                let (m0, m1) = (self.slot(at[0]), self.slot(at[1]));
                self.a.mov(dst, m0)?;
                self.a.imul_2(dst, m1)?;
            }
            Size::ResultStrlen => self.a.mov(dst, rcx)?,
            Size::None => self.a.xor(dst, dst)?,
        }
        Ok(())
    }

    fn size_regs(&self) -> Vec<AsmRegister64> {
        match self.s.sig.size {
            Size::Arg(a) => vec![ARG_REGS[a as usize]],
            Size::Product(a, b) => vec![ARG_REGS[a as usize], ARG_REGS[b as usize]],
            Size::None | Size::ResultStrlen => vec![],
        }
    }

    /// Whether the live path of this allocation records the object in the
    /// shadow map inline: the result in rax, the size in argument
    /// registers, and every caller-saved register free to use.
    fn inline_alloc(&self) -> bool {
        let s = self.s;
        !s.preserve
            && s.sig.kind == Kind::Alloc
            && s.sig.result == Returns::Ret
            && matches!(s.sig.size, Size::Arg(_) | Size::Product(_, _))
    }

    /// A 64-bit load (or other two-operand instruction `code`) from the
    /// control block's field at `field`.
    fn with_control(&mut self, code: Code, reg: Register, field: u32) -> R<()> {
        self.add(Instruction::with2(code, reg, rip(self.s.control + u64::from(field))))
    }

    /// A hook's trampoline: with no hook active on the thread, records this
    /// site's cell and the stack pointer at the site as the thread's
    /// charge, makes the call, and clears the charge; inside an active
    /// hook's call, only makes the call. Keeps every register but r10 and
    /// r11 (all of them in preserve mode). Returns the label of the count
    /// entry: the start.
    fn hook(&mut self) -> R<(CodeLabel, CodeLabel)> {
        let preserve = self.s.preserve;
        // Bytes pushed below the site's stack pointer.
        let pushed = if preserve { 16 } else { 0 };
        let (mut start, mut keep) = (self.a.create_label(), self.a.create_label());
        let (mut take_clear, mut take, mut plain) =
            (self.a.create_label(), self.a.create_label(), self.a.create_label());
        // Two entries: the start, whose call has no chain recorded, and
        // the one callers capture comes back to with the chain it recorded
        // (`keep`). Each leaves r11 = the charge's TLS offset.
        for (entry, to) in [(&mut start, take_clear), (&mut keep, take)] {
            self.a.set_label(entry)?;
            if preserve {
                self.a.push(r11)?;
                self.a.push(r10)?;
            }
            self.charge_word(r11)?;
            let site_sp = if preserve {
                self.a.lea(r10, qword_ptr(rsp + pushed))?;
                r10
            } else {
                rsp
            };
            self.a.cmp(site_sp, qword_ptr(r11 + 8).fs())?;
            self.a.jae(to)?;
            // Below a recorded hook: inside its call, unless that call was
            // left without returning.
            self.hook_returns_to(to)?;
            self.a.jmp(plain)?;
        }
        // Taking the charge from the start: no chain for this call (one
        // left by an earlier call must not take its figures).
        self.a.set_label(&mut take_clear)?;
        self.a.mov(qword_ptr(r11 + 32).fs(), 0)?;
        self.a.set_label(&mut take)?;
        // The cell and the return address first, the stack pointer (which
        // makes the charge active) last: a signal handler that allocates at
        // a site inside a hooked function between the stores must find the
        // charge whole or not at all.
        let mut after = self.a.create_label();
        self.a.mov(r10, r11)?;
        // The hook's entry for the shadow map (0: its module has no ids).
        let mut no_id = self.a.create_label();
        self.with_control(Code::Mov_r32_rm32, Register::R11D, control::ENTRY_BASE)?;
        self.a.test(r11d, r11d)?;
        self.a.je(no_id)?;
        self.a.add(r11d, (self.s.index << shadow::ID_SHIFT) as i32)?;
        self.a.set_label(&mut no_id)?;
        self.a.mov(qword_ptr(r10 + CHARGE_ID).fs(), r11)?;
        self.counted(false, |_| Ok(()))?;
        self.a.add(r11, self.cell_offset())?;
        self.a.mov(qword_ptr(r10).fs(), r11)?;
        self.a.lea(r11, ptr(after))?;
        self.a.mov(qword_ptr(r10 + 16).fs(), r11)?;
        if preserve {
            self.a.lea(r11, qword_ptr(rsp + pushed))?;
            self.a.mov(qword_ptr(r10 + 8).fs(), r11)?;
            self.a.pop(r10)?;
            self.a.pop(r11)?;
        } else {
            self.a.mov(qword_ptr(r10 + 8).fs(), rsp)?;
        }
        self.undo_next = undo::HOOK;
        self.call_target_plain()?;
        self.a.set_label(&mut after)?;
        if preserve {
            self.a.push(r11)?;
        }
        self.charge_word(r11)?;
        self.a.mov(qword_ptr(r11 + 8).fs(), 0)?;
        self.a.mov(qword_ptr(r11 + 32).fs(), 0)?;
        if preserve {
            self.a.pop(r11)?;
        }
        self.leave()?;
        self.a.set_label(&mut plain)?;
        if preserve {
            self.a.pop(r10)?;
            self.a.pop(r11)?;
        }
        self.call_target_plain()?;
        self.leave()?;
        Ok((start, keep))
    }

    /// Live path of an allocation: keeps the size (and out pointer) in a
    /// frame across the call, then records the new object: inline in the
    /// shadow map when an entry can describe it, else through the runtime.
    /// The traced entry's copy records inline only, and joins the start
    /// entry's copy for the rest.
    fn alloc_live(&mut self) -> R<()> {
        let s = self.s;
        let inline = self.inline_alloc();
        let mut keep = self.size_regs();
        let out_at = keep.len();
        if let Returns::OutArg(o) = s.sig.result {
            keep.push(ARG_REGS[o as usize]);
        }
        let f = self.open_frame(&keep, 0)?;
        self.call_in_frame()?;
        // The traced entry joins the start entry's failure and runtime
        // call (the same frame) instead of having its own.
        let joined = if self.traced { self.live_slow.zip(self.live_fail) } else { None };
        let mut fail = joined.map_or_else(|| self.a.create_label(), |(_, fail)| fail);
        self.test_result(fail)?;
        if !self.charged && !self.traced {
            self.live_fail = Some(fail);
        }
        if inline {
            let mut cas = self.a.create_label();
            let mut slow = joined.map_or_else(|| self.a.create_label(), |(slow, _)| slow);
            // The object's key: the allocator's pointer (r8, free after the
            // call, when the wrapper puts a header in front).
            if s.key_result != 0 {
                self.a.lea(r8, qword_ptr(rax - s.key_result))?;
            }
            self.size_to(rsi, [0, 1])?;
            // A plain store where the allocator never starts two live
            // objects in a granule, else a compare-and-swap.
            if s.plain_store {
                self.record_inline(false, cas, slow, f)?;
                self.a.set_label(&mut cas)?;
            }
            self.record_inline(true, slow, slow, f)?;
            if joined.is_some() {
                return Ok(self.a.jmp(slow)?);
            }
            if !self.charged {
                self.live_slow = Some(slow);
            }
            self.a.set_label(&mut slow)?;
        }
        self.runtime_call(control::TRACK_ALLOC, |g| {
            if g.s.sig.size == Size::ResultStrlen {
                g.strlen_bytes()?;
            }
            g.size_to(rsi, [0, 1])?;
            match g.s.sig.result {
                Returns::OutArg(_) => {
                    let m = g.slot(out_at);
                    g.a.mov(rdi, m)?;
                    g.a.mov(rdi, qword_ptr(rdi))?;
                }
                _ if g.s.key_result != 0 => g.a.lea(rdi, qword_ptr(rax - g.s.key_result))?,
                _ => g.a.mov(rdi, rax)?,
            }
            g.cell_args(rdx, rcx)
        })?;
        // The runtime returned the key it was given: the wrapper's pointer again.
        self.key_of_pointer(rax, self.s.key_result)?;
        if let Returns::OutArg(_) = s.sig.result {
            self.a.xor(eax, eax)?;
        }
        self.close_frame(f)?;
        self.leave()?;
        self.a.set_label(&mut fail)?;
        self.count_failed_live()?;
        self.close_frame(f)?;
        self.leave()
    }

    /// Records the object just allocated (key in rax, or r8 for a
    /// wrapper's pointer; size in rsi) in the shadow map and returns, if
    /// its size is below the control block's limit for this way of
    /// writing (`cas`: compare-and-swap, else a plain store), the map
    /// covers it and no live object's record is in its granule. Otherwise
    /// continues at `declined` (size) or `slow` (the rest) with rax, r8
    /// and the frame as they were; rsi holds the size at `declined` only.
    /// The compare-and-swap form ends by falling through to `slow`.
    fn record_inline(&mut self, cas: bool, declined: CodeLabel, slow: CodeLabel, f: i32) -> R<()> {
        let s = self.s;
        let (key, key32) = if s.key_result != 0 { (r8, r8d) } else { (rax, eax) };
        let limit = match (cas, self.traced) {
            (true, false) => control::CAS_LIMIT,
            (false, false) => control::INLINE_LIMIT,
            (true, true) => control::TRACE_CAS_LIMIT,
            (false, true) => control::TRACE_INLINE_LIMIT,
        };
        self.with_control(Code::Cmp_r64_rm64, Register::RSI, limit)?;
        self.a.jae(declined)?;
        // ecx = the entry's site part: the site's id, or the hook's.
        let site = if self.charged {
            self.charge_word(rcx)?;
            self.a.mov(ecx, dword_ptr(rcx + CHARGE_ID).fs())?;
            self.a.test(ecx, ecx)?;
            self.a.je(slow)?;
            0
        } else {
            self.with_control(Code::Mov_r32_rm32, Register::ECX, control::ENTRY_BASE)?;
            (s.index << shadow::ID_SHIFT) as i32
        };
        // The entry: rdi + rdx * 4, rdx the granule, if the map covers it.
        self.a.mov(rdx, key)?;
        if cas {
            // An entry describes 8-aligned objects only (a pool allocator
            // may return others; glibc's malloc never does).
            self.a.test(dl, 7)?;
            self.a.jne(slow)?;
        }
        self.a.shr(rdx, shadow::GRANULE_SHIFT)?;
        self.with_control(Code::Cmp_r64_rm64, Register::RDX, control::SHADOW_GRANULES)?;
        self.a.jae(slow)?;
        self.with_control(Code::Mov_r64_rm64, Register::RDI, control::SHADOW)?;
        if !cas {
            // No tracked object's record is there (LIVE was clear; it is
            // set now, until the store below writes the record: no other
            // thread reads an entry in the granule of an object being
            // allocated). A read-modify-write rather than a read: the
            // first touch of a shadow page is then a write fault, which
            // maps a fresh page, instead of a read fault mapping the zero
            // page and a write fault replacing it, which flushes the TLB
            // of every CPU the process runs on.
            self.a.bts(dword_ptr(rdi + rdx * 4), shadow::LIVE.trailing_zeros() as i32)?;
            self.a.jb(slow)?;
        }
        self.a.shl(esi, shadow::SIZE_SHIFT)?;
        self.a.lea(ecx, qword_ptr(rcx + rsi + site))?;
        self.a.xor(ecx, key32)?;
        if cas {
            // eax = what the entry holds; the result waits in r9.
            let mut taken = self.a.create_label();
            self.a.mov(r9, rax)?;
            self.a.mov(eax, dword_ptr(rdi + rdx * 4))?;
            self.a.test(al, shadow::LIVE as i32)?;
            self.a.jne(taken)?;
            self.a.lock().cmpxchg(dword_ptr(rdi + rdx * 4), ecx)?;
            self.a.mov(rax, r9)?;
            self.a.jne(slow)?;
            self.trace_alloc()?;
            self.close_frame(f)?;
            self.leave()?;
            // Taken: falls through to `slow`, which the caller places next.
            self.a.set_label(&mut taken)?;
            self.a.mov(rax, r9)?;
        } else {
            self.a.mov(dword_ptr(rdi + rdx * 4), ecx)?;
            self.trace_alloc()?;
            self.close_frame(f)?;
            self.leave()?;
        }
        Ok(())
    }

    /// Whether the site gets a traced entry: a copy of its start entry
    /// whose inline paths also record each event in the thread's trace
    /// ring (through the module's [`trace_stub`]). Only the common sites have one:
    /// an allocation recorded inline, or a free of at most two arguments
    /// looked up inline, at a site that calls another module (every
    /// caller-saved register free), outside hooks and wrappers. The others
    /// record every event through the runtime while a trace is on.
    fn traceable(&self) -> bool {
        let s = self.s;
        if s.hook || s.charge_check || s.depth_check || s.depth_bump || s.preserve || s.index >= 1 << shadow::ID_BITS {
            return false;
        }
        match s.sig.kind {
            Kind::Alloc => self.inline_alloc() && s.key_result == 0,
            Kind::Free => s.key_ptr == 0 && s.args.clamp(1, 6) <= 2 && s.sig.freed.unwrap_or(0) < 2,
            Kind::Realloc => false,
        }
    }

    /// In the traced entry, where an allocation was just recorded inline
    /// (the object in rax, the frame open): the trace stub records the
    /// event. Keeps rax.
    fn trace_alloc(&mut self) -> R<()> {
        if !self.traced {
            return Ok(());
        }
        self.size_to(r8, [0, 1])?;
        // (A 32-bit move zero-extends: site fields fit in 32 bits.)
        self.a.mov(r9d, (self.s.index << SITE_FIELD) as i32)?;
        self.with_control(Code::Add_r64_rm64, Register::R9, control::TRACE_BASE)?;
        self.a.call(self.s.trace)?;
        Ok(())
    }

    /// A failed call on the live path: counted with its requested bytes
    /// (live bytes subtract them), the size read from the frame.
    fn count_failed_live(&mut self) -> R<()> {
        if !matches!(self.s.sig.size, Size::Arg(_) | Size::Product(_, _)) {
            return self.count_failed();
        }
        let save = self.saved(&[rsi, r11]);
        self.push_all(save)?;
        self.depth += 8 * save.len() as i32;
        self.size_to(rsi, [0, 1])?;
        self.counted(false, |g| {
            g.count_one(cell::FAILED)?;
            g.count_reg(cell::FAILED_BYTES, rsi)
        })?;
        self.depth -= 8 * save.len() as i32;
        self.pop_all(save)
    }

    /// Live path of a realloc: the old pointer leaves the table before the
    /// call (into a token in the frame); afterwards the runtime settles it.
    fn realloc_live(&mut self) -> R<()> {
        let s = self.s;
        // Every argument register read, and at least those the size and
        // the pointer live in.
        let read = s.sig.args_read().map(|a| a as usize + 1).max().unwrap_or(1);
        let args = usize::from(s.args.clamp(1, 6)).max(read);
        let keep: Vec<AsmRegister64> = ARG_REGS[..args].to_vec();
        let token = keep.len();
        let f = self.open_frame(&keep, 2)?;
        let freed = ARG_REGS[s.sig.freed.unwrap_or(0) as usize];
        self.runtime_call(control::TRACK_REALLOC_BEGIN, |g| {
            if freed != rdi {
                g.a.mov(rdi, freed)?;
            }
            g.key_of_pointer(rdi, g.s.key_ptr)?;
            let t = g.slot(token);
            g.a.lea(rsi, t)?;
            g.cell_args(rdx, rcx)
        })?;
        for (k, &r) in keep.iter().enumerate() {
            let m = self.slot(k);
            self.a.mov(r, m)?;
        }
        self.call_in_frame()?;
        let size_at = match s.sig.size {
            Size::Arg(a) => [a as usize, 0],
            Size::Product(a, b) => [a as usize, b as usize],
            _ => [0, 0],
        };
        self.runtime_call(control::TRACK_REALLOC_END, |g| {
            g.size_to(rdx, size_at)?;
            g.a.mov(rdi, rax)?;
            g.key_of_pointer(rdi, g.s.key_result.wrapping_neg())?;
            let t = g.slot(token);
            g.a.lea(rsi, t)?;
            g.cell_args(rcx, r8)
        })?;
        // The runtime returned the key it was given: the wrapper's pointer again.
        self.key_of_pointer(rax, self.s.key_result)?;
        self.close_frame(f)?;
        let mut fail = self.a.create_label();
        self.test_result(fail)?;
        self.leave()?;
        self.a.set_label(&mut fail)?;
        self.count_failed()?;
        self.leave()
    }

    /// A free trampoline: at its start the entry that counts and tracks
    /// the free; past the counting, the drain entry that only tracks it;
    /// then the entry that only counts. Returns the labels of the drain and
    /// count entries.
    fn free_like(&mut self) -> R<(CodeLabel, CodeLabel)> {
        let plain = self.a.create_label();
        self.depth_gate(plain)?;
        let inline = self.s.key_ptr == 0;
        let shard = inline && self.freed_shard_from_count();
        let mut drain = self.a.create_label();
        // A thread that shares shard 0 continues in a copy of the inline
        // path whose adds take `lock`: the entry's own copy needs no test.
        let then: Option<Body> = shard.then(|| -> Body { Box::new(move |g: &mut Gen<'_>| g.free_inline(drain, true)) });
        self.count_before_then(shard, then)?;
        if inline {
            self.free_inline(drain, shard)?;
        }
        self.a.set_label(&mut drain)?;
        self.free_live()?;
        self.free_target()?;
        let mut count = self.a.create_label();
        self.a.set_label(&mut count)?;
        self.depth_gate(plain)?;
        self.count_before()?;
        self.free_target()?;
        if self.s.depth_check {
            // The drain entry checks the depth too, then joins the body
            // that the live entry's shadow-map misses also reach.
            let mut gated = self.a.create_label();
            self.a.set_label(&mut gated)?;
            self.depth_gate(plain)?;
            self.a.jmp(drain)?;
            drain = gated;
        }
        self.plain(plain)?;
        Ok((drain, count))
    }

    /// The live entry's fast path: if the shadow map holds the record of
    /// the pointer, marks it freed, charges the allocating site (in the
    /// freed view's shard of this CPU) and makes the original call;
    /// otherwise continues at `slow`, the drain entry (the runtime call)
    /// that follows. `shard`: the counting left that shard's address in
    /// r10 (see [`Self::freed_shard_from_count`]).
    /// Uses only rax, r10 and r11 (the latter two saved at sites that
    /// call a function of the module), never argument registers; the
    /// traced entry's copy also rcx, rdx, r8 and r9 (its frees read rdi
    /// and rsi at most).
    fn free_inline(&mut self, slow: CodeLabel, shard: bool) -> R<()> {
        let freed = ARG_REGS[self.s.sig.freed.unwrap_or(0) as usize];
        // rax is the call's result register: never kept.
        let save = self.saved(&[r10, r11]);
        // Where a miss goes with the saved registers restored.
        let mut out = if save.is_empty() { slow } else { self.a.create_label() };
        self.push_all(save)?;
        // `at` = the granule's entry; `v32` = the entry decoded with this
        // pointer, LIVE flipped: a record of this pointer has its low five
        // bits clear. With the shard in r10: rax and r11, else r10 and rax
        // (no r10-based load into r10: that form is the charge check's,
        // see `layout::CHECK_LOAD`).
        // (The address is taken modulo the span the map covers: no object
        // beyond is recorded in it.)
        let (at, v32) = if shard { (rax, r11d) } else { (r10, eax) };
        if !self.s.aligned {
            // Records are of 8-aligned objects only (see `aligned`).
            const LOW: [AsmRegister8; 6] = [dil, sil, dl, cl, r8b, r9b];
            self.a.test(LOW[self.s.sig.freed.unwrap_or(0) as usize], 4)?;
            self.a.jne(out)?;
        }
        self.a.mov(at, freed)?;
        let mask = if self.traced { control::TRACE_SHADOW_MASK } else { control::SHADOW_MASK };
        self.with_control(Code::And_r64_rm64, at.into(), mask)?;
        self.a.shr(at, shadow::GRANULE_SHIFT - 2)?;
        self.with_control(Code::Add_r64_rm64, at.into(), control::SHADOW)?;
        self.a.lea(v32, qword_ptr(freed + shadow::LIVE as i32))?;
        self.a.xor(v32, dword_ptr(at))?;
        if shard {
            self.a.test(r11b, shadow::MATCH as i32)?;
        } else {
            self.a.test(al, shadow::MATCH as i32)?;
        }
        self.a.jne(out)?;
        let (mut wide, mut sized) = (self.a.create_label(), self.a.create_label());
        if self.traced {
            // A wide record (size 0) goes to the runtime before LIVE is
            // cleared: the module's wide stub reads the map through the
            // shadow mask, which a trace zeroes.
            self.a.mov(r8d, v32)?;
            self.a.shr(r8d, shadow::SIZE_SHIFT)?;
            self.a.jz(out)?;
            self.a.and(byte_ptr(at), !(shadow::LIVE as u8) as i8 as i32)?;
            if !shard {
                self.a.mov(r11d, eax)?;
            }
            self.a.mov(eax, r8d)?;
        } else {
            self.a.and(byte_ptr(at), !(shadow::LIVE as u8) as i8 as i32)?;
            // eax = the size, r11d = the id << ID_SHIFT.
            if shard {
                self.a.mov(eax, r11d)?;
            } else {
                self.a.mov(r11d, eax)?;
            }
            self.a.shr(eax, shadow::SIZE_SHIFT)?;
            self.a.jz(wide)?;
        }
        self.a.set_label(&mut sized)?;
        self.a.and(r11d, shadow::ID_MASK as i32)?;
        if self.traced {
            // The allocating site's id << ID_SHIFT, for the record.
            self.a.mov(r9d, r11d)?;
        }
        if !shard {
            self.with_control(Code::Mov_r64_rm64, Register::R10, control::SHARD_TLS)?;
            self.freed_shard_base(r10)?;
        }
        // The cell is id * 64 into the shard. With the shard from the
        // counting, this copy of the path is a thread's that owns its shard
        // (plain adds) or, emitted after the entries, shard 0's (`lock`);
        // otherwise shard 0 (a thread that owns none) takes its adds with
        // `lock` after the entries.
        const _: () = assert!(shadow::ID_SHIFT + 1 == 6);
        self.a.lea(r11, qword_ptr(r10 + r11 * 2))?;
        let freed_adds = |g: &mut Gen<'_>| -> R<()> {
            let (objects, bytes) =
                (qword_ptr(r11 + cell::FREED_OBJECTS as i32), qword_ptr(r11 + cell::FREED_BYTES as i32));
            if g.locked {
                g.a.lock().add(objects, 1)?;
                g.a.lock().add(bytes, rax)?;
            } else {
                g.a.add(objects, 1)?;
                g.a.add(bytes, rax)?;
            }
            Ok(())
        };
        if shard {
            freed_adds(self)?;
        } else {
            let (shared, mut back) = (self.a.create_label(), self.a.create_label());
            self.with_control(Code::Cmp_r64_rm64, Register::R10, control::FREED)?;
            self.a.je(shared)?;
            freed_adds(self)?;
            self.a.set_label(&mut back)?;
            self.a.zero_bytes()?;
            self.deferred.push(Deferred {
                label: shared,
                back,
                counting: false,
                body: Box::new(freed_adds),
                then: None,
            });
        }
        if self.traced {
            // The trace stub records the event (see [`trace_stub`]).
            self.a.mov(r8, rax)?;
            self.a.shl(r9, crate::trace::ALLOC_SITE_SHIFT - shadow::ID_SHIFT)?;
            self.a.mov(ecx, (self.s.index << SITE_FIELD | crate::trace::kind::FREE as u32) as i32)?;
            self.with_control(Code::Add_r64_rm64, Register::RCX, control::TRACE_BASE)?;
            self.a.add(r9, rcx)?;
            self.a.mov(rax, freed)?;
            self.a.call(self.s.trace)?;
        }
        self.pop_all(save)?;
        self.free_target()?;
        if !self.traced {
            self.wide_size(&mut wide, sized, freed)?;
        }
        // Falls through to the runtime call, in the entry's state.
        if !save.is_empty() {
            self.a.set_label(&mut out)?;
            self.pop_all(save)?;
        }
        Ok(())
    }

    /// At `wide`, on the free's inline path with a record of size 0 (see
    /// [`Self::free_inline`]): eax = the object's size from the module's
    /// [`wide_stub`], then back to `sized`.
    fn wide_size(&mut self, wide: &mut CodeLabel, sized: CodeLabel, freed: AsmRegister64) -> R<()> {
        self.a.set_label(wide)?;
        self.a.mov(rax, freed)?;
        self.a.call(self.s.wide)?;
        self.a.jmp(sized)?;
        Ok(())
    }

    /// `reg` += `offset` unless `reg` is NULL (the allocator's pointer for
    /// a wrapper's). Clobbers the flags.
    fn key_of_pointer(&mut self, reg: AsmRegister64, offset: i32) -> R<()> {
        if offset == 0 {
            return Ok(());
        }
        let mut null = self.a.create_label();
        self.a.test(reg, reg)?;
        self.a.je(null)?;
        self.a.add(reg, offset)?;
        self.a.set_label(&mut null)?;
        Ok(())
    }

    /// The original free, then back to the code after the site.
    fn free_target(&mut self) -> R<()> {
        if self.s.form.is_tail() && !self.s.depth_bump {
            self.jump_target()
        } else {
            self.call_target()?;
            self.leave()
        }
    }

    /// Live path of a free: the runtime takes the pointer out of the table
    /// before the original call (after it, another thread may get the same
    /// address from the allocator). Then continues with the original call.
    fn free_live(&mut self) -> R<()> {
        let s = self.s;
        let freed = ARG_REGS[s.sig.freed.unwrap_or(0) as usize];
        let args = usize::from(s.args.clamp(1, 6));
        // The runtime returns the pointer it was given: the freed register
        // is kept in the frame only when that is a key, not the pointer.
        let keyed = s.key_ptr != 0;
        let keep: Vec<AsmRegister64> = ARG_REGS[..args].iter().copied().filter(|&r| r != freed || keyed).collect();
        let f = self.open_frame(&keep, 0)?;
        let (index, control) = (s.index, s.control);
        self.runtime_call(control::TRACK_FREE, |g| {
            if freed != rdi {
                g.a.mov(rdi, freed)?;
            }
            g.key_of_pointer(rdi, g.s.key_ptr)?;
            g.a.mov(esi, index as i32)?;
            g.add(Instruction::with2(Code::Lea_r64_m, Register::RDX, rip(control)))?;
            Ok(())
        })?;
        if !s.preserve && !keyed {
            self.a.mov(freed, rax)?;
        }
        for (k, &r) in keep.iter().enumerate() {
            let m = self.slot(k);
            self.a.mov(r, m)?;
        }
        self.close_frame(f)
    }
}

/// A generated trampoline. Its start is the entry that counts and tracks
/// live objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trampoline {
    pub code: Vec<u8>,
    /// Free sites: offset of the entry that tracks without counting (the
    /// drain entry); hooks: of the entry the callers entry comes back to
    /// (past the start's clearing of the chain); 0 for other sites.
    pub drain: u16,
    /// Offset of the entry that counts without tracking.
    pub count: u16,
    /// Offset of the callers entry (0: none).
    pub callers: u16,
    /// The site's [`site_flags`](crate::layout::site_flags).
    pub flags: u8,
    /// Offset of the traced entry (0: none; see [`crate::layout::Site::traced`]).
    pub traced: u16,
    /// For each call of the target, in address order: what an unwind
    /// through it undoes ([`undo`] flags) and where the size is from the
    /// stack pointer at the call.
    pub undo: Vec<(u8, i32)>,
}

/// Generates the trampoline for one site, to be placed at address `at`.
pub fn trampoline(spec: &TrampolineSpec, at: u64) -> R<Trampoline> {
    let mut g = Gen {
        a: CodeAssembler::new(64)?,
        s: spec,
        depth: 0,
        charged: false,
        undo: Vec::new(),
        undo_next: 0,
        locked: false,
        deferred: Vec::new(),
        traced: false,
        live_slow: None,
        live_fail: None,
    };
    let (drain, count) = match spec.sig.kind {
        _ if spec.hook => {
            let (start, keep) = g.hook()?;
            (Some(keep), start)
        }
        Kind::Alloc | Kind::Realloc => (None, g.alloc_like()?),
        Kind::Free => {
            let (d, c) = g.free_like()?;
            (Some(d), c)
        }
    };
    let traced = if spec.hook { None } else { g.traced_entry(drain)? };
    // The callers entry, last: the site's index for the stub, which comes
    // back to the start or the count entry (the runtime says which). A
    // hook's records the chain that the sites charged to it add to.
    let capture = spec.capture != 0;
    let mut callers = g.a.create_label();
    if capture {
        g.a.set_label(&mut callers)?;
        g.a.push(i32::try_from(spec.index).map_err(|_| CodegenError::TooLong)?)?;
        g.a.jmp(spec.capture)?;
    }
    g.emit_deferred()?;
    let r = g.a.assemble_options(at, iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)?;
    let offset = |l: &CodeLabel| -> R<u16> { u16::try_from(r.label_ip(l)? - at).map_err(|_| CodegenError::TooLong) };
    let drain = match drain {
        Some(l) => offset(&l)?,
        None => 0,
    };
    let count = offset(&count)?;
    let callers = if capture { offset(&callers)? } else { 0 };
    let traced = match traced {
        Some(l) => offset(&l)?,
        None => 0,
    };
    use crate::layout::site_flags;
    let flags = if spec.hook { site_flags::HOOK } else { 0 }
        | if spec.charge_check { site_flags::UNDER_HOOK } else { 0 }
        | if spec.depth_check { site_flags::DEPTH_CHECK } else { 0 }
        | if spec.depth_bump { site_flags::DEPTH_BUMP } else { 0 };
    // (The encoder's buffer has room to spare: a patcher holds a hundred
    // thousand of these.)
    let mut code = r.inner.code_buffer;
    code.shrink_to_fit();
    Ok(Trampoline { code, drain, count, callers, flags, traced, undo: g.undo })
}

impl Trampoline {
    /// The offsets of its entries, the start first (0 where it has none of
    /// a kind: the start again).
    pub fn entries(&self) -> [u32; 5] {
        [0, self.drain, self.count, self.callers, self.traced].map(u32::from)
    }
}

pub use crate::layout::site_jump;

/// How an init stub loads the runtime when no loaded module provides it.
#[derive(Clone, Copy, Debug)]
pub struct Load<'a> {
    /// The path given to `dlopen` (`$ORIGIN` is the module's directory).
    pub path: &'a str,
    /// Whether to say on stderr why profiling is unavailable when the
    /// runtime cannot be loaded and the environment sets `ALLOCTRAMP`
    /// (profiling asked for at start; a program's stub: one line per
    /// process).
    pub say: bool,
}

/// `dlopen` flags of the runtime: bound at once, its symbol visible to the
/// modules loaded after it.
const RTLD_NOW_GLOBAL: i32 = 0x2 | 0x100;

/// What the stub says before `dlerror`'s text.
const UNAVAILABLE: &[u8] = b"alloctramp: profiling unavailable: ";
/// How the environment string that asks for profiling at start begins.
const VARIABLE_PREFIX: &[u8] = b"ALLOCTRAMP=";

/// The module's init (or fini) stub, called by the dynamic linker through
/// DT_INIT (DT_FINI): calls the runtime's `register` (`unregister`) with the
/// site table's address, then continues to the original DT_INIT (DT_FINI)
/// function if there was one. `api_offset` is the offset of the function
/// pointer in the runtime's API table.
///
/// With `load` (the init stub), a module whose runtime slot is 0 (the
/// patched file does not name the runtime in `DT_NEEDED`, and no module
/// loaded before provides it) loads it with `dlopen(load.path)` and finds
/// its API table with `dlsym`, keeping it in the slot for the fini stub.
/// If that fails the module runs unprofiled; with `load.say`, the stub
/// writes one line to stderr with `dlerror`'s text when the environment
/// sets `ALLOCTRAMP`.
pub fn init_stub(
    at: u64,
    control: u64,
    table: u64,
    api_offset: i32,
    original: Option<u64>,
    load: Option<Load>,
) -> R<Vec<u8>> {
    if load.is_some_and(|l| l.path.as_bytes().contains(&0)) {
        return Err(CodegenError::NulInPath);
    }
    let mut a = CodeAssembler::new(64)?;
    let slot = |f: u32| rip(control + u64::from(f));
    a.endbr64()?;
    // DT_INIT functions get (argc, argv, envp): keep them for the original.
    // Three pushes realign the stack to 16 bytes for the calls.
    a.push(rdi)?;
    a.push(rsi)?;
    a.push(rdx)?;
    a.add_instruction(Instruction::with2(Code::Mov_r64_rm64, Register::RAX, slot(control::RUNTIME))?)?;
    let (mut skip, mut have) = (a.create_label(), a.create_label());
    a.test(rax, rax)?;
    let mut data = None;
    match load {
        None => a.je(skip)?,
        Some(load) => {
            let (path, name, mut failed) = (a.create_label(), a.create_label(), a.create_label());
            a.jne(have)?;
            a.add_instruction(Instruction::with2(Code::Mov_r64_rm64, Register::RAX, slot(control::DLOPEN))?)?;
            a.test(rax, rax)?;
            a.je(skip)?;
            a.lea(rdi, qword_ptr(path))?;
            a.mov(esi, RTLD_NOW_GLOBAL)?;
            a.call(rax)?;
            a.test(rax, rax)?;
            a.je(failed)?;
            a.mov(rdi, rax)?;
            a.add_instruction(Instruction::with2(Code::Mov_r64_rm64, Register::RAX, slot(control::DLSYM))?)?;
            a.test(rax, rax)?;
            a.je(skip)?;
            a.lea(rsi, qword_ptr(name))?;
            a.call(rax)?;
            a.test(rax, rax)?;
            a.je(skip)?;
            a.add_instruction(Instruction::with2(Code::Mov_rm64_r64, slot(control::RUNTIME), Register::RAX)?)?;
            a.jmp(have)?;
            a.set_label(&mut failed)?;
            if load.say {
                say_unavailable(&mut a, control, skip)?;
            }
            a.jmp(skip)?;
            data = Some((load.path, path, name));
        }
    }
    a.set_label(&mut have)?;
    a.add_instruction(Instruction::with2(Code::Lea_r64_m, Register::RDI, rip(table))?)?;
    a.call(qword_ptr(rax + api_offset))?;
    a.set_label(&mut skip)?;
    a.pop(rdx)?;
    a.pop(rsi)?;
    a.pop(rdi)?;
    match original {
        Some(f) => a.jmp(f)?,
        None => a.ret()?,
    }
    if let Some((text, mut path, mut name)) = data {
        a.set_label(&mut path)?;
        a.db(&[text.as_bytes(), &[0]].concat())?;
        a.set_label(&mut name)?;
        a.db(&[crate::layout::RUNTIME_SYMBOL.as_bytes(), &[0]].concat())?;
    }
    Ok(a.assemble(at)?)
}

/// A static program's entry stub, where the patched file's entry point
/// is: computes the load bias, adds it to each word at the link-time
/// addresses `fixups` (the static runtime's and the control block's
/// pointers, for a position-independent program; none otherwise), stores
/// the entry stack pointer and the bias in the static runtime's host block
/// (`layout::static_host`), and continues at the program's entry point
/// with every register as the kernel left it but rax, rcx and rsi, which
/// it zeroes as the kernel did. The runtime starts later, from the hook on
/// the program's first initializer: the thread pointer is not set up yet.
pub fn static_entry_stub(at: u64, host: u64, fixups: &[u64], original: u64) -> R<Vec<u8>> {
    use crate::layout::static_host;
    let mut a = CodeAssembler::new(64)?;
    let (mut me, mut table, mut next, mut done) =
        (a.create_label(), a.create_label(), a.create_label(), a.create_label());
    a.set_label(&mut me)?;
    a.lea(rax, qword_ptr(me))?;
    a.mov(rcx, at)?;
    a.sub(rax, rcx)?;
    a.lea(rcx, qword_ptr(table))?;
    a.set_label(&mut next)?;
    a.mov(rsi, qword_ptr(rcx))?;
    a.test(rsi, rsi)?;
    a.je(done)?;
    a.add(qword_ptr(rax + rsi), rax)?;
    a.add(rcx, 8)?;
    a.jmp(next)?;
    a.set_label(&mut done)?;
    let word = |w: usize| rip(host + 8 * w as u64);
    a.add_instruction(Instruction::with2(Code::Mov_rm64_r64, word(static_host::START_SP), Register::RSP)?)?;
    a.add_instruction(Instruction::with2(Code::Mov_rm64_r64, word(static_host::BIAS), Register::RAX)?)?;
    a.xor(eax, eax)?;
    a.xor(ecx, ecx)?;
    a.xor(esi, esi)?;
    a.jmp(original)?;
    a.set_label(&mut table)?;
    for f in fixups.iter().chain(&[0]) {
        a.dq(&[*f])?;
    }
    Ok(a.assemble(at)?)
}

/// A static program's exit hook, in the slot of its last destructor
/// (`.fini_array[0]`, which runs last): unregisters the module, calls the
/// static runtime's exit function `exit`, then continues to `original`.
pub fn static_exit_stub(at: u64, control: u64, table: u64, exit: u64, original: u64) -> R<Vec<u8>> {
    let mut a = CodeAssembler::new(64)?;
    let mut skip = a.create_label();
    a.endbr64()?;
    a.push(rdi)?;
    a.push(rsi)?;
    a.push(rdx)?;
    a.add_instruction(Instruction::with2(
        Code::Mov_r64_rm64,
        Register::RAX,
        rip(control + u64::from(control::RUNTIME)),
    )?)?;
    a.test(rax, rax)?;
    a.je(skip)?;
    a.add_instruction(Instruction::with2(Code::Lea_r64_m, Register::RDI, rip(table))?)?;
    a.call(qword_ptr(rax + crate::layout::api::UNREGISTER))?;
    a.call(exit)?;
    a.set_label(&mut skip)?;
    a.pop(rdx)?;
    a.pop(rsi)?;
    a.pop(rdi)?;
    a.jmp(original)?;
    Ok(a.assemble(at)?)
}

/// The failure path of [`init_stub`]'s load: if a variable of the
/// environment (the stub's third argument, on top of the stack) starts
/// with [`VARIABLE_PREFIX`], writes [`UNAVAILABLE`], `dlerror`'s text and
/// a newline to stderr by system call; then continues at `done`.
fn say_unavailable(a: &mut CodeAssembler, control: u64, done: CodeLabel) -> R<()> {
    let (mut prefix, mut message, mut newline) = (a.create_label(), a.create_label(), a.create_label());
    let (mut next, mut compare, mut found, mut end) =
        (a.create_label(), a.create_label(), a.create_label(), a.create_label());
    // rcx walks envp.
    a.mov(rcx, qword_ptr(rsp))?;
    a.test(rcx, rcx)?;
    a.je(done)?;
    a.set_label(&mut next)?;
    a.mov(rdi, qword_ptr(rcx))?;
    a.test(rdi, rdi)?;
    a.je(done)?;
    a.add(rcx, 8)?;
    a.lea(rsi, qword_ptr(prefix))?;
    a.xor(edx, edx)?;
    a.set_label(&mut compare)?;
    a.movzx(eax, byte_ptr(rsi + rdx))?;
    a.test(al, al)?;
    a.je(found)?;
    a.cmp(al, byte_ptr(rdi + rdx))?;
    a.jne(next)?;
    a.inc(edx)?;
    a.jmp(compare)?;
    a.set_label(&mut found)?;
    a.lea(rsi, qword_ptr(message))?;
    a.mov(edx, UNAVAILABLE.len() as i32)?;
    write_stderr(a)?;
    a.add_instruction(Instruction::with2(
        Code::Mov_r64_rm64,
        Register::RAX,
        rip(control + u64::from(control::DLERROR)),
    )?)?;
    a.test(rax, rax)?;
    a.je(end)?;
    a.call(rax)?;
    a.test(rax, rax)?;
    a.je(end)?;
    // rdx = strlen(rax).
    let mut count = a.create_label();
    a.mov(rsi, rax)?;
    a.xor(edx, edx)?;
    a.set_label(&mut count)?;
    a.cmp(byte_ptr(rsi + rdx), 0)?;
    a.lea(rdx, qword_ptr(rdx + 1))?;
    a.jne(count)?;
    a.dec(rdx)?;
    write_stderr(a)?;
    a.set_label(&mut end)?;
    a.lea(rsi, qword_ptr(newline))?;
    a.mov(edx, 1)?;
    write_stderr(a)?;
    a.jmp(done)?;
    a.set_label(&mut prefix)?;
    a.db(&[VARIABLE_PREFIX, &[0]].concat())?;
    a.set_label(&mut message)?;
    a.db(UNAVAILABLE)?;
    a.set_label(&mut newline)?;
    a.db(b"\n")?;
    Ok(())
}

/// `write(2, rsi, rdx)` by system call. Clobbers rax, rcx, rdi and r11.
fn write_stderr(a: &mut CodeAssembler) -> R<()> {
    a.mov(eax, 1)?;
    a.mov(edi, 2)?;
    a.syscall()?;
    Ok(())
}

/// The module's capture stub, reached from a trampoline's callers entry
/// with the site's index pushed: saves what a call may clobber into a
/// [`capture::Frame`](crate::layout::capture::Frame) (with `vectors`,
/// xmm0-15 too: a direct call's callers may keep values in registers the
/// callee leaves alone, and a wrapper may take vector arguments; a call of
/// a default entry through the PLT or GOT reads none and clobbers them
/// all, so its sites use the stub without), calls the runtime's `capture(frame, control, rbp, table)`
/// (`table`: the module's site table, which names the continuation even
/// before the runtime knows the module), which
/// records the chain and replaces the index with the entry to continue at,
/// restores everything and jumps there with the stack as it was at the
/// site. The jump reads its target just below the stack pointer: the
/// 128-byte red zone, which signal delivery leaves alone.
pub fn capture_stub(at: u64, control: u64, table: u64, vectors: bool) -> R<Vec<u8>> {
    const SAVED: [AsmRegister64; 9] = [rax, rcx, rdx, rsi, rdi, r8, r9, r10, r11];
    let mut a = CodeAssembler::new(64)?;
    for r in SAVED {
        a.push(r)?;
    }
    a.mov(rdi, rsp)?;
    a.add_instruction(Instruction::with2(Code::Lea_r64_m, Register::RSI, rip(control))?)?;
    a.mov(rdx, rbp)?;
    a.add_instruction(Instruction::with2(Code::Lea_r64_m, Register::RCX, rip(table))?)?;
    let kept = if vectors { &VECTORS[..] } else { &[] };
    save_vectors(&mut a, kept)?;
    a.add_instruction(Instruction::with1(Code::Call_rm64, rip(control + u64::from(control::CAPTURE)))?)?;
    restore_vectors(&mut a, kept)?;
    for r in SAVED.iter().rev() {
        a.pop(*r)?;
    }
    a.lea(rsp, qword_ptr(rsp + 8))?;
    a.jmp(qword_ptr(rsp - 8))?;
    Ok(a.assemble(at)?)
}

/// The vector registers a runtime call may change: xmm0-15. The runtime is
/// Rust built for baseline x86-64: it uses no x87 or MMX register, no
/// register above xmm15, and leaves MXCSR and the x87 control word alone,
/// so these 16 registers are all of the floating-point state a call into it
/// can change. Sixteen aligned moves each way cost a fraction of an
/// `fxsave64`/`fxrstor64` pair, which also copies the x87 and MXCSR state
/// through 512 bytes of memory.
const VECTORS: [AsmRegisterXmm; 16] =
    [xmm0, xmm1, xmm2, xmm3, xmm4, xmm5, xmm6, xmm7, xmm8, xmm9, xmm10, xmm11, xmm12, xmm13, xmm14, xmm15];

/// Aligns the stack to 16 bytes (the old rsp in rbx, pushed first) and
/// stores `kept` below it, leaving rsp aligned for a call.
fn save_vectors(a: &mut CodeAssembler, kept: &[AsmRegisterXmm]) -> R<()> {
    a.push(rbx)?;
    a.mov(rbx, rsp)?;
    a.and(rsp, -16)?;
    if !kept.is_empty() {
        a.sub(rsp, 16 * kept.len() as i32)?;
    }
    for (i, &x) in kept.iter().enumerate() {
        a.movaps(xmmword_ptr(rsp + 16 * i as i32), x)?;
    }
    Ok(())
}

/// Undoes [`save_vectors`].
fn restore_vectors(a: &mut CodeAssembler, kept: &[AsmRegisterXmm]) -> R<()> {
    for (i, &x) in kept.iter().enumerate() {
        a.movaps(x, xmmword_ptr(rsp + 16 * i as i32))?;
    }
    a.mov(rsp, rbx)?;
    a.pop(rbx)?;
    Ok(())
}

/// The module's vector stub: calls the function whose address is in rax
/// with the stack 16-byte aligned and xmm0-15 kept, for the trampolines
/// in preserve mode (one copy per module instead of 32 moves in each
/// trampoline). It starts `push rbx; mov rbx, rsp` and ends `mov rsp, rbx;
/// pop rbx; ret` (the patcher's unwind entry for it counts on those
/// lengths: [`VECTOR_STUB_PROLOGUE`], [`VECTOR_STUB_EPILOGUE`]).
pub fn vector_stub(at: u64) -> R<Vec<u8>> {
    let mut a = CodeAssembler::new(64)?;
    save_vectors(&mut a, &VECTORS)?;
    a.call(rax)?;
    restore_vectors(&mut a, &VECTORS)?;
    a.ret()?;
    Ok(a.assemble(at)?)
}

/// The module's wide-size stub, called by a free's inline path that found
/// a record of size 0 (and cleared its LIVE) with the freed pointer in rax:
/// returns in eax the size the next granule's entry holds if it is the
/// record's extension, which it clears (the entry is the freeing thread's
/// alone until the free), else 0 (an object of 0 bytes). Touches nothing
/// but rax and the flags, and never the stack: its unwind entry is the
/// one of a function's first instruction throughout.
pub fn wide_stub(at: u64, control: u64) -> R<Vec<u8>> {
    let mut a = CodeAssembler::new(64)?;
    let mut empty = a.create_label();
    let field = |code: Code, f: u32| Instruction::with2(code, Register::RAX, rip(control + u64::from(f)));
    // rax = the granule's entry (as the inline path computed it).
    a.add_instruction(field(Code::And_r64_rm64, control::SHADOW_MASK)?)?;
    a.shr(rax, shadow::GRANULE_SHIFT - 2)?;
    a.add_instruction(field(Code::Add_r64_rm64, control::SHADOW)?)?;
    a.test(byte_ptr(rax + 4), shadow::EXT_BIT as i32)?;
    a.jz(empty)?;
    a.and(byte_ptr(rax + 4), !((shadow::EXT_BIT | shadow::LIVE) as u8) as i8 as i32)?;
    a.mov(eax, dword_ptr(rax + 4))?;
    a.shr(eax, shadow::EXT_SHIFT)?;
    a.ret()?;
    a.set_label(&mut empty)?;
    a.xor(eax, eax)?;
    a.ret()?;
    Ok(a.assemble(at)?)
}

/// The module's trace stub, called by a traced entry (see
/// [`crate::layout::Site::traced`]) with the object in rax, its size in r8
/// and the record word without the CPU in r9: records the event in the
/// thread's trace ring as the runtime's `trace::record` does (claims the
/// thread's recording flag, writes the record into the thread's window of
/// its ring and publishes it), or, when the window is used up or another
/// event's recording is under way on the thread (a signal handler's
/// event), has the runtime's `trace_record` do so or count the event lost
/// (through the vector stub `vectors`, which realigns the stack). Returns
/// the object in rax; clobbers rcx, rdx, r8 to r11 and the flags, keeps
/// every other register (the vector stub keeps the vector registers
/// across the runtime's call).
pub fn trace_stub(at: u64, control: u64, vectors: u64) -> R<Vec<u8>> {
    use crate::trace::{RingHeader, words};
    let mut a = CodeAssembler::new(64)?;
    let (mut nested, mut window) = (a.create_label(), a.create_label());
    let field = |code: Code, r: Register, f: u32| Instruction::with2(code, r, rip(control + u64::from(f)));
    a.add_instruction(field(Code::Mov_r64_rm64, Register::R10, control::TRACE_TLS)?)?;
    a.bts(qword_ptr(r10 + words::BUSY).fs(), 0)?;
    a.jb(nested)?;
    a.mov(r11, qword_ptr(r10 + words::CUR).fs())?;
    a.cmp(r11, qword_ptr(r10 + words::END).fs())?;
    a.jae(window)?;
    // The record is the thread's until head passes it.
    a.mov(qword_ptr(r11 + RECORD_PTR), rax)?;
    a.mov(qword_ptr(r11 + RECORD_SIZE), r8)?;
    a.mov(r8, rax)?;
    a.rdtscp()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(qword_ptr(r11 + RECORD_TSC), rax)?;
    // The CPU (TSC_AUX's low 12 bits) into the word.
    a.and(ecx, 0xfff)?;
    a.lea(rcx, qword_ptr(r9 + rcx * 8))?;
    a.mov(qword_ptr(r11 + RECORD_WORD), rcx)?;
    a.add(r11, RECORD_BYTES)?;
    a.mov(qword_ptr(r10 + words::CUR).fs(), r11)?;
    // Published: only this thread writes its ring's head.
    a.mov(r11, qword_ptr(r10 + words::RING).fs())?;
    a.add(qword_ptr(r11 + std::mem::offset_of!(RingHeader, head) as i32), 1)?;
    a.mov(qword_ptr(r10 + words::BUSY).fs(), 0)?;
    a.mov(rax, r8)?;
    a.ret()?;
    a.set_label(&mut window)?;
    a.mov(qword_ptr(r10 + words::BUSY).fs(), 0)?;
    a.set_label(&mut nested)?;
    a.push(rdi)?;
    a.push(rsi)?;
    a.mov(rsi, rax)?;
    a.mov(rdi, r9)?;
    a.mov(rdx, r8)?;
    a.add_instruction(field(Code::Mov_r64_rm64, Register::RAX, control::TRACE_RECORD)?)?;
    a.call(vectors)?;
    a.pop(rsi)?;
    a.pop(rdi)?;
    a.ret()?;
    Ok(a.assemble(at)?)
}

/// Bytes of the vector stub's `push rbx; mov rbx, rsp`.
pub const VECTOR_STUB_PROLOGUE: u32 = 4;
/// Bytes of the vector stub's `mov rsp, rbx; pop rbx; ret`.
pub const VECTOR_STUB_EPILOGUE: u32 = 5;

/// Disassembles code in Intel syntax, one instruction per line with its
/// address and bytes (the golden-file format).
pub fn disassemble(code: &[u8], at: u64) -> String {
    use iced_x86::{Decoder, DecoderOptions, Formatter, IntelFormatter};
    let mut out = String::new();
    let mut f = IntelFormatter::new();
    f.options_mut().set_first_operand_char_index(8);
    let mut d = Decoder::with_ip(64, code, at, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    while d.can_decode() {
        d.decode_out(&mut ins);
        let start = (ins.ip() - at) as usize;
        let bytes: String = code[start..start + ins.len()].iter().map(|b| format!("{b:02x}")).collect();
        let mut text = String::new();
        f.format(&ins, &mut text);
        out.push_str(&format!("{:08x}  {bytes:<30} {text}\n", ins.ip()));
    }
    out
}

#[cfg(test)]
pub(crate) mod golden {
    //! The disassembly of every trampoline form, compared with the files in
    //! `trampolines/golden/`. After an intended change, regenerate them with
    //! `ALLOCTRAMP_BLESS=1 cargo test -p alloctramp-trampolines --features codegen golden`.

    use super::*;
    use crate::entry::{self, Target};

    const SITE: u64 = 0x401136;
    const TARGET: u64 = 0x401030;
    const SLOT: u64 = 0x403fd8;
    const CONTROL: u64 = 0x416000;
    const AT: u64 = 0x428000;

    fn entry(name: &str) -> entry::EntryPoint {
        entry::defaults().into_iter().find(|e| e.target == Target::Symbol(name.into())).unwrap()
    }

    fn spec(name: &str, form: SiteForm, preserve: bool) -> TrampolineSpec {
        let len = if form.through_got() { 6 } else { 5 };
        TrampolineSpec {
            site: SITE,
            len,
            form,
            target: if form.through_got() { SLOT } else { TARGET },
            sig: entry(name).sig,
            index: 3,
            preserve,
            vectors: VECTORS_AT,
            wide: WIDE_AT,
            trace: TRACE_AT,
            args: entry(name).args,
            control: CONTROL,
            shard_mask: 15,
            shard_stride: 0x2000,
            depth_check: false,
            depth_bump: false,
            key_result: 0,
            key_ptr: 0,
            capture: 0,
            hook: false,
            charge_check: false,
            plain_store: true,
            aligned: true,
        }
    }

    /// A trampoline's disassembly with its entries.
    fn listing(spec: &TrampolineSpec) -> String {
        let t = trampoline(spec, AT).unwrap();
        let mut text = disassemble(&t.code, AT);
        if t.drain != 0 {
            text.push_str(&format!("drain entry: {:08x}\n", AT + u64::from(t.drain)));
        }
        text.push_str(&format!("count entry: {:08x}\n", AT + u64::from(t.count)));
        if t.callers != 0 {
            text.push_str(&format!("callers entry: {:08x}\n", AT + u64::from(t.callers)));
        }
        if t.traced != 0 {
            text.push_str(&format!("traced entry: {:08x}\n", AT + u64::from(t.traced)));
        }
        // The unwind rows the patcher derives from the code.
        let entries = t.entries();
        let f = crate::frames::frames(&t.code, AT, &entries, spec.target).unwrap();
        for row in &f.rows {
            let at = AT + u64::from(row.offset);
            text.push_str(&format!("stack from {at:08x}: site rsp - {}\n", row.below));
        }
        let mut undo = t.undo.iter();
        for c in &f.calls {
            let at = AT + u64::from(c.offset);
            if c.target {
                let (what, size_at) = undo.next().expect("an undo entry for every call of the target");
                let size = if what & crate::layout::undo::LIVE_SIZE != 0 {
                    format!(", size at rsp+{size_at}")
                } else {
                    String::new()
                };
                text.push_str(&format!("call of the target: {at:08x}, {} bytes, undo {what:#04x}{size}\n", c.len));
            } else {
                text.push_str(&format!("call of the runtime: {at:08x}, {} bytes\n", c.len));
            }
        }
        assert!(undo.next().is_none(), "an undo entry for a call the code does not make");
        text
    }

    /// Every trampoline shape the goldens show, by golden file name.
    pub(crate) fn specs() -> Vec<(&'static str, TrampolineSpec)> {
        let mut v = Vec::new();
        for (file, name, form, preserve) in [
            ("malloc-call-rel32", "malloc", SiteForm::CallRel32, false),
            ("malloc-jmp-rel32", "malloc", SiteForm::JmpRel32, false),
            ("malloc-call-rip", "malloc", SiteForm::CallRipMem, false),
            ("malloc-jmp-rip", "malloc", SiteForm::JmpRipMem, false),
            ("malloc-call-rel32-direct", "malloc", SiteForm::CallRel32, true),
            ("free-call-rel32", "free", SiteForm::CallRel32, false),
            ("free-jmp-rel32", "free", SiteForm::JmpRel32, false),
            ("free-call-rip", "free", SiteForm::CallRipMem, false),
            ("free-jmp-rip", "free", SiteForm::JmpRipMem, false),
            ("calloc-call-rel32", "calloc", SiteForm::CallRel32, false),
            ("realloc-call-rel32", "realloc", SiteForm::CallRel32, false),
            ("realloc-jmp-rip", "realloc", SiteForm::JmpRipMem, false),
            ("realloc-call-rel32-direct", "realloc", SiteForm::CallRel32, true),
            ("reallocarray-call-rel32", "reallocarray", SiteForm::CallRel32, false),
            ("free-call-rel32-direct", "free", SiteForm::CallRel32, true),
            ("delete-sized-aligned-call-rel32", "_ZdlPvmSt11align_val_t", SiteForm::CallRel32, false),
            ("posix_memalign-call-rel32", "posix_memalign", SiteForm::CallRel32, false),
            ("strdup-call-rel32", "strdup", SiteForm::CallRel32, false),
            ("strdup-call-rel32-direct", "strdup", SiteForm::CallRel32, true),
        ] {
            v.push((file, spec(name, form, preserve)));
        }
        // A user-named allocator: records by compare-and-swap only.
        v.push((
            "user-alloc-call-rel32",
            TrampolineSpec { plain_store: false, aligned: false, ..spec("malloc", SiteForm::CallRel32, false) },
        ));
        // Its free: a pointer that is not 8-aligned goes to the runtime.
        v.push((
            "user-free-call-rel32",
            TrampolineSpec { plain_store: false, aligned: false, ..spec("free", SiteForm::CallRel32, false) },
        ));
        // Sites of allocation wrappers (see the patcher's `charge`): a call
        // to an open wrapper raises the depth; a site inside one checks it.
        let charged = |name: &str, form: SiteForm, preserve: bool, check: bool, bump: bool| TrampolineSpec {
            depth_check: check,
            depth_bump: bump,
            ..spec(name, form, preserve)
        };
        for (file, s) in [
            ("wrapper-caller-alloc-bump", charged("malloc", SiteForm::CallRel32, true, false, true)),
            ("wrapper-caller-free-tail-bump", charged("free", SiteForm::JmpRel32, false, false, true)),
            ("wrapper-inside-alloc-checked", charged("malloc", SiteForm::CallRel32, false, true, false)),
            ("wrapper-inside-free-tail-checked", charged("free", SiteForm::JmpRipMem, false, true, false)),
            ("wrapper-inside-realloc-checked-bump", charged("realloc", SiteForm::CallRel32, true, true, true)),
            (
                "wrapper-caller-alloc-header",
                TrampolineSpec { key_result: 16, ..charged("malloc", SiteForm::CallRel32, false, false, false) },
            ),
            (
                "wrapper-caller-free-header",
                TrampolineSpec { key_ptr: -16, ..charged("free", SiteForm::CallRel32, false, false, false) },
            ),
            (
                "wrapper-caller-realloc-header",
                TrampolineSpec {
                    key_result: 16,
                    key_ptr: -16,
                    ..charged("realloc", SiteForm::CallRel32, false, false, false)
                },
            ),
        ] {
            v.push((file, s));
        }
        // Hooks (calls to functions whose allocations their callers take)
        // and the sites inside such functions, which count into the
        // active hook's cell.
        let hook = |form: SiteForm, preserve: bool| TrampolineSpec {
            hook: true,
            sig: entry::Signature::alloc(entry::Size::None),
            capture: AT - 0x40,
            ..spec("malloc", form, preserve)
        };
        let under = |name: &str, preserve: bool| TrampolineSpec {
            charge_check: true,
            ..spec(name, SiteForm::CallRel32, preserve)
        };
        for (file, s) in [
            ("hook-call-rel32", hook(SiteForm::CallRel32, false)),
            ("hook-call-rel32-direct", hook(SiteForm::CallRel32, true)),
            ("hook-call-rip", hook(SiteForm::CallRipMem, false)),
            ("under-hook-malloc", under("malloc", false)),
            ("under-hook-calloc-direct", under("calloc", true)),
            ("under-hook-realloc", under("realloc", false)),
            ("under-hook-strdup", under("strdup", false)),
            (
                "under-hook-wrapper-caller-checked-bump",
                TrampolineSpec { depth_check: true, depth_bump: true, key_result: 16, ..under("malloc", false) },
            ),
        ] {
            v.push((file, s));
        }
        // Callers capture: the entry that goes through the module's stub.
        for (file, name, form) in
            [("callers-malloc-plt", "malloc", SiteForm::CallRel32), ("callers-free-tail", "free", SiteForm::JmpRel32)]
        {
            v.push((file, TrampolineSpec { capture: STUB, ..spec(name, form, false) }));
        }
        v
    }

    const STUB: u64 = AT - 0x40;
    const VECTORS_AT: u64 = AT - 0x200;
    const WIDE_AT: u64 = AT - 0x100;
    const TRACE_AT: u64 = AT - 0x300;

    fn cases() -> Vec<(&'static str, String)> {
        let mut v: Vec<(&'static str, String)> = specs().into_iter().map(|(file, s)| (file, listing(&s))).collect();
        let load = Load { path: "$ORIGIN/liballoctramp_rt.so", say: true };
        let init = init_stub(AT, CONTROL, 0x415040, crate::layout::api::REGISTER, Some(0x401000), Some(load)).unwrap();
        v.push(("init-stub", disassemble(&init, AT)));
        let fini = init_stub(AT, CONTROL, 0x415040, crate::layout::api::UNREGISTER, None, None).unwrap();
        v.push(("fini-stub-no-original", disassemble(&fini, AT)));
        v.push(("capture-stub", disassemble(&capture_stub(STUB, CONTROL, 0x415040, true).unwrap(), STUB)));
        v.push(("capture-stub-plain", disassemble(&capture_stub(STUB, CONTROL, 0x415040, false).unwrap(), STUB)));
        v.push(("vector-stub", disassemble(&vector_stub(VECTORS_AT).unwrap(), VECTORS_AT)));
        v.push(("wide-stub", disassemble(&wide_stub(WIDE_AT, CONTROL).unwrap(), WIDE_AT)));
        v.push(("trace-stub", disassemble(&trace_stub(TRACE_AT, CONTROL, VECTORS_AT).unwrap(), TRACE_AT)));
        v
    }

    /// The patcher's unwind entry for the trace stub follows its stack from
    /// its code: every path returns with the stack it came in with.
    #[test]
    fn trace_stub_stack_is_followed() {
        let code = trace_stub(TRACE_AT, CONTROL, VECTORS_AT).unwrap();
        let f = crate::frames::frames(&code, TRACE_AT, &[0], 0).unwrap();
        let deepest = f.rows.iter().map(|r| r.below).max();
        assert_eq!(deepest, Some(16), "{:?}", f.rows);
        assert_eq!(f.rows.first().map(|r| (r.offset, r.below)), Some((0, 0)));
        assert_eq!(f.calls.len(), 1, "one call: the vector stub");
    }

    /// Every site the common allocators' shapes give (an allocation or a
    /// free calling another module) has a traced entry, which calls the
    /// trace stub; hooks, sites inside hooked functions and reallocs have
    /// none.
    #[test]
    fn traced_entries_are_where_the_inline_paths_are() {
        for (name, spec) in specs() {
            let t = trampoline(&spec, AT).unwrap();
            let simple = !spec.hook && !spec.charge_check && !spec.depth_check && !spec.depth_bump && !spec.preserve;
            let expect = simple
                && spec.key_result == 0
                && spec.key_ptr == 0
                && match spec.sig.kind {
                    Kind::Alloc => {
                        spec.sig.result == Returns::Ret && matches!(spec.sig.size, Size::Arg(_) | Size::Product(_, _))
                    }
                    Kind::Free => spec.args <= 2,
                    Kind::Realloc => false,
                };
            assert_eq!(t.traced != 0, expect, "{name}");
            let calls_stub = disassemble(&t.code, AT).contains(&format!("call    {TRACE_AT:016X}h"));
            assert_eq!(calls_stub, expect, "{name}");
        }
    }

    /// The patcher's unwind entry for the vector stub counts on the
    /// lengths of its prologue and epilogue.
    #[test]
    fn vector_stub_prologue_and_epilogue() {
        use iced_x86::{Decoder, DecoderOptions, Mnemonic};
        let code = vector_stub(VECTORS_AT).unwrap();
        let insns: Vec<Instruction> =
            Decoder::with_ip(64, &code, VECTORS_AT, DecoderOptions::NONE).into_iter().collect();
        let head: Vec<Mnemonic> = insns[..2].iter().map(|i| i.mnemonic()).collect();
        assert_eq!(head, [Mnemonic::Push, Mnemonic::Mov]);
        assert_eq!(insns[2].ip() - VECTORS_AT, u64::from(VECTOR_STUB_PROLOGUE));
        let tail = &insns[insns.len() - 3..];
        let tail_mn: Vec<Mnemonic> = tail.iter().map(|i| i.mnemonic()).collect();
        assert_eq!(tail_mn, [Mnemonic::Mov, Mnemonic::Pop, Mnemonic::Ret]);
        assert_eq!(VECTORS_AT + code.len() as u64 - tail[0].ip(), u64::from(VECTOR_STUB_EPILOGUE));
    }

    const BLESS: &str = "ALLOCTRAMP_BLESS=1 cargo test -p alloctramp-trampolines --features codegen golden";

    fn goldens() -> alloctramp_testkit::Goldens {
        let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        alloctramp_testkit::Goldens::new(here.join("golden"), here.parent().unwrap_or(here), BLESS)
    }

    #[test]
    fn golden_disassembly() {
        let cases: Vec<(String, String)> =
            cases().into_iter().map(|(name, text)| (format!("{name}.txt"), text)).collect();
        goldens().check_all(cases.iter().map(|(n, t)| (n.as_str(), t.clone())));
    }

    /// Every read of the word below a hook's stack pointer is the one
    /// instruction the runtime's fault handler completes, and only the
    /// trampolines that check a charge make it.
    #[test]
    fn hook_words_are_read_by_the_instruction_the_fault_handler_knows() {
        use iced_x86::{Decoder, DecoderOptions, Register};
        for (name, spec) in specs() {
            let t = trampoline(&spec, AT).unwrap();
            let mut d = Decoder::with_ip(64, &t.code, AT, DecoderOptions::NONE);
            let mut loads = 0;
            for ins in &mut d {
                let tls = ins.segment_prefix() == Register::FS;
                if !tls && ins.memory_base() == Register::R10 && ins.op0_register() == Register::R10 {
                    let at = (ins.ip() - AT) as usize;
                    assert_eq!(&t.code[at..at + ins.len()], &crate::layout::CHECK_LOAD, "{name} at {:#x}", ins.ip());
                    loads += 1;
                }
            }
            assert_eq!(loads > 0, spec.hook || spec.charge_check, "{name}: {loads} reads of a hook's word");
        }
    }

    /// A hook's trampoline calls its target with the stack pointer the site
    /// had: callers capture unwinds a return address in it as the site's
    /// own (`registry::return_through_hook` in the runtime).
    #[test]
    fn hooks_call_their_target_with_the_sites_stack_pointer() {
        for (name, spec) in specs().into_iter().filter(|(_, s)| s.hook) {
            let t = trampoline(&spec, AT).unwrap();
            let entries = t.entries();
            let f = crate::frames::frames(&t.code, AT, &entries, spec.target).unwrap();
            let calls: Vec<_> = f.calls.iter().filter(|c| c.target).collect();
            assert!(!calls.is_empty(), "{name}");
            for c in calls {
                let row = f.rows.iter().rev().find(|r| r.offset <= c.offset).unwrap();
                assert_eq!(row.below, 0, "{name}: call at {:#x}", c.offset);
            }
        }
    }

    #[test]
    fn no_orphan_golden_files() {
        let names: Vec<String> = cases().into_iter().map(|(name, _)| format!("{name}.txt")).collect();
        goldens().no_orphans(names.iter().map(String::as_str));
    }

    #[test]
    fn a_got_slot_out_of_reach_is_an_assembler_error() {
        // Neither rip- nor (with an address-size prefix) eip-relative
        // addressing reaches a slot 112 TiB above the code.
        let far = TrampolineSpec { target: 0x7000_0000_0000, ..spec("malloc", SiteForm::CallRipMem, false) };
        let err = trampoline(&far, AT).unwrap_err();
        assert!(matches!(err, CodegenError::Assembler(_)), "{err:?}");
        assert!(std::error::Error::source(&err).is_some(), "the assembler's error is the source");
    }

    #[test]
    fn site_jump_reaches_the_trampoline_or_refuses() {
        let j = site_jump(0x1000, 0x2000).unwrap();
        assert_eq!(j[0], 0xe9);
        assert_eq!(i32::from_le_bytes([j[1], j[2], j[3], j[4]]), 0x2000 - 0x1005);
        assert!(site_jump(0x1000, 0x1_0000_1000).is_none());
        assert!(site_jump(0x1_0000_1000, 0x1000).is_none());
    }
}
