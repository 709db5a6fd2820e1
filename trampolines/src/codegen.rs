//! The code generated per site: a trampoline that counts, makes the
//! original call, observes its result and returns to the code after the
//! site; and the module's init and fini stubs that register it with the
//! runtime.
//!
//! Trampolines are reached by a `jmp rel32` written over the site while
//! profiling is on. They make a real `call` (never push+jmp), so return
//! addresses and the shadow stack stay balanced, and the stack is aligned as
//! the ABI requires at the call. They clobber only what the original call
//! clobbers: for calls through the PLT or the GOT that is every caller-saved
//! register; for direct calls to a function in the same module (whose
//! callers may rely on fewer clobbers) every register they use is saved.

use crate::entry::{Kind, Returns, Signature, Size};
use crate::layout::{SiteForm, cell, control};
use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, MemoryOperand, Register};

/// Everything a trampoline needs to know about its site and module.
#[derive(Clone, Debug)]
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
    /// Address of the module control block.
    pub control: u64,
    /// Counter shards: `shard_count - 1` and the bytes per shard.
    pub shard_mask: u32,
    pub shard_stride: u32,
}

/// Error from the assembler (a target out of rel32 range, typically).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodegenError(pub String);

impl std::fmt::Display for CodegenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CodegenError {}

impl From<iced_x86::IcedError> for CodegenError {
    fn from(e: iced_x86::IcedError) -> Self {
        CodegenError(e.to_string())
    }
}

type R<T> = Result<T, CodegenError>;

fn rip(addr: u64) -> MemoryOperand {
    MemoryOperand::with_base_displ(Register::RIP, addr as i64)
}

const ARG_REGS: [AsmRegister64; 6] = [rdi, rsi, rdx, rcx, r8, r9];

struct Gen<'a> {
    a: CodeAssembler,
    s: &'a TrampolineSpec,
}

impl Gen<'_> {
    fn add(&mut self, i: Result<Instruction, iced_x86::IcedError>) -> R<()> {
        self.a.add_instruction(i?)?;
        Ok(())
    }

    /// r11 = address of this site's counter cell in the current CPU's shard.
    fn cell_address(&mut self) -> R<()> {
        let s = self.s;
        self.add(Instruction::with2(
            Code::Mov_r64_rm64,
            Register::R11,
            rip(s.control + u64::from(control::RSEQ_OFFSET)),
        ))?;
        // struct rseq's cpu_id_start (offset 0) is always a valid CPU number.
        let fs_mem = MemoryOperand::new(Register::R11, Register::None, 1, 0, 0, false, Register::FS);
        self.add(Instruction::with2(Code::Mov_r32_rm32, Register::R11D, fs_mem))?;
        self.a.and(r11d, s.shard_mask as i32)?;
        self.a.imul_3(r11, r11, s.shard_stride as i32)?;
        self.add(Instruction::with2(Code::Add_r64_rm64, Register::R11, rip(s.control + u64::from(control::COUNTERS))))?;
        Ok(())
    }

    fn field(&self, f: u32) -> AsmMemoryOperand {
        qword_ptr(r11 + (self.s.index as i64 * crate::layout::CELL_SIZE as i64 + i64::from(f)) as i32)
    }

    fn count_one(&mut self, f: u32) -> R<()> {
        let m = self.field(f);
        self.a.lock().add(m, 1)?;
        Ok(())
    }

    fn count_reg(&mut self, f: u32, reg: AsmRegister64) -> R<()> {
        let m = self.field(f);
        self.a.lock().add(m, reg)?;
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
        let sig = self.s.sig;
        let save = self.saved(&[r11]);
        self.push_all(save)?;
        self.cell_address()?;
        self.count_one(cell::CALLS)?;
        match sig.size {
            Size::Arg(a) => self.count_reg(cell::BYTES, ARG_REGS[a as usize])?,
            Size::Product(x, y) => {
                // rax is overwritten by the call's result anyway.
                self.a.mov(rax, ARG_REGS[x as usize])?;
                self.a.imul_2(rax, ARG_REGS[y as usize])?;
                self.count_reg(cell::BYTES, rax)?;
            }
            Size::None | Size::ResultStrlen => {}
        }
        self.pop_all(save)
    }

    /// The original call, made from the trampoline.
    fn call_target(&mut self) -> R<()> {
        let s = self.s;
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

    fn alloc_like(&mut self) -> R<()> {
        let sig = self.s.sig;
        self.count_before()?;
        self.call_target()?;
        let mut fail = self.a.create_label();
        match sig.result {
            Returns::OutArg(_) => {
                self.a.test(eax, eax)?;
                self.a.jne(fail)?;
            }
            _ => {
                self.a.test(rax, rax)?;
                self.a.je(fail)?;
            }
        }
        if sig.size == Size::ResultStrlen {
            let save = self.saved(&[rcx, rdx, rdi, r11]);
            self.push_all(save)?;
            self.a.mov(rdx, rax)?;
            self.a.mov(rdi, rax)?;
            self.a.xor(eax, eax)?;
            self.a.mov(rcx, -1i64)?;
            self.a.repne().scasb()?;
            self.a.not(rcx)?;
            self.a.mov(rax, rdx)?;
            self.cell_address()?;
            self.count_reg(cell::BYTES, rcx)?;
            self.pop_all(save)?;
        }
        self.leave()?;
        self.a.set_label(&mut fail)?;
        let save = self.saved(&[r11]);
        self.push_all(save)?;
        self.cell_address()?;
        self.count_one(cell::FAILED)?;
        self.pop_all(save)?;
        self.leave()
    }

    fn free_like(&mut self) -> R<()> {
        self.count_before()?;
        if self.s.form.is_tail() {
            return self.jump_target();
        }
        self.call_target()?;
        self.leave()
    }
}

/// Generates the trampoline for one site, to be placed at address `at`.
pub fn trampoline(spec: &TrampolineSpec, at: u64) -> R<Vec<u8>> {
    let mut g = Gen { a: CodeAssembler::new(64)?, s: spec };
    match spec.sig.kind {
        Kind::Alloc | Kind::Realloc => g.alloc_like()?,
        Kind::Free => g.free_like()?,
    }
    Ok(g.a.assemble(at)?)
}

/// The 5 bytes written over a site while profiling is on: `jmp rel32` to the
/// trampoline. `None` when the trampoline is out of rel32 range.
pub fn site_jump(site: u64, trampoline: u64) -> Option<[u8; 5]> {
    let rel = i32::try_from(i128::from(trampoline) - (i128::from(site) + 5)).ok()?;
    let b = rel.to_le_bytes();
    Some([0xe9, b[0], b[1], b[2], b[3]])
}

/// The module's init (or fini) stub, called by the dynamic linker through
/// DT_INIT (DT_FINI): calls the runtime's `register` (`unregister`) with the
/// site table's address, then continues to the original DT_INIT (DT_FINI)
/// function if there was one. `api_offset` is the offset of the function
/// pointer in the runtime's API table.
pub fn init_stub(at: u64, control: u64, table: u64, api_offset: i32, original: Option<u64>) -> R<Vec<u8>> {
    let mut a = CodeAssembler::new(64)?;
    a.endbr64()?;
    // DT_INIT functions get (argc, argv, envp): keep them for the original.
    // Three pushes realign the stack to 16 bytes for the call.
    a.push(rdi)?;
    a.push(rsi)?;
    a.push(rdx)?;
    a.add_instruction(Instruction::with2(Code::Lea_r64_m, Register::RDI, rip(table))?)?;
    a.add_instruction(Instruction::with2(
        Code::Mov_r64_rm64,
        Register::RAX,
        rip(control + u64::from(control::RUNTIME)),
    )?)?;
    let mut skip = a.create_label();
    a.test(rax, rax)?;
    a.je(skip)?;
    a.call(qword_ptr(rax + api_offset))?;
    a.set_label(&mut skip)?;
    a.pop(rdx)?;
    a.pop(rsi)?;
    a.pop(rdi)?;
    match original {
        Some(f) => a.jmp(f)?,
        None => a.ret()?,
    }
    Ok(a.assemble(at)?)
}

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
mod golden {
    //! The disassembly of every trampoline form, compared with the files in
    //! `trampolines/golden/`. After an intended change, regenerate them with
    //! `ALLOCTRAMP_UPDATE_GOLDEN=1 cargo test -p alloctramp-trampolines --features codegen golden`.

    use super::*;
    use crate::entry::{self, Target};

    const SITE: u64 = 0x401136;
    const TARGET: u64 = 0x401030;
    const SLOT: u64 = 0x403fd8;
    const CONTROL: u64 = 0x416000;
    const AT: u64 = 0x428000;

    fn sig(name: &str) -> Signature {
        entry::defaults().into_iter().find(|e| e.target == Target::Symbol(name.into())).unwrap().sig
    }

    fn spec(name: &str, form: SiteForm, preserve: bool) -> TrampolineSpec {
        let len = if form.through_got() { 6 } else { 5 };
        TrampolineSpec {
            site: SITE,
            len,
            form,
            target: if form.through_got() { SLOT } else { TARGET },
            sig: sig(name),
            index: 3,
            preserve,
            control: CONTROL,
            shard_mask: 15,
            shard_stride: 0x2000,
        }
    }

    fn cases() -> Vec<(&'static str, String)> {
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
            ("posix_memalign-call-rel32", "posix_memalign", SiteForm::CallRel32, false),
            ("strdup-call-rel32", "strdup", SiteForm::CallRel32, false),
            ("strdup-call-rel32-direct", "strdup", SiteForm::CallRel32, true),
        ] {
            let code = trampoline(&spec(name, form, preserve), AT).unwrap();
            v.push((file, disassemble(&code, AT)));
        }
        let init = init_stub(AT, CONTROL, 0x415040, crate::layout::api::REGISTER, Some(0x401000)).unwrap();
        v.push(("init-stub", disassemble(&init, AT)));
        let fini = init_stub(AT, CONTROL, 0x415040, crate::layout::api::UNREGISTER, None).unwrap();
        v.push(("fini-stub-no-original", disassemble(&fini, AT)));
        v
    }

    #[test]
    fn golden_disassembly() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("golden");
        let update = std::env::var_os("ALLOCTRAMP_UPDATE_GOLDEN").is_some();
        let mut stale = Vec::new();
        for (name, text) in cases() {
            let path = dir.join(format!("{name}.txt"));
            if update {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &text).unwrap();
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                stale.push(format!("--- {}\n{text}", path.display()));
            }
        }
        assert!(
            stale.is_empty(),
            "generated code differs from the golden files; if intended, run\n  \
             ALLOCTRAMP_UPDATE_GOLDEN=1 cargo test -p alloctramp-trampolines --features codegen golden\n{}",
            stale.join("\n")
        );
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
