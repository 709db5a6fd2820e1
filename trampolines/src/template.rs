//! Trampolines made from templates: one generated trampoline per shape,
//! whose operands are then set for each site of that shape.
//!
//! Trampolines of one [shape](crate::codegen::TrampolineSpec::shape) are
//! the same instructions but for the values of some 32- or 64-bit operands:
//! branch and call targets and RIP-relative addresses (which depend on
//! where the trampoline goes and on the site's address and target), and
//! counter displacements and immediates (which depend on the site's index).
//! Generating each with the assembler took most of the time of patching a
//! large library (libLLVM-15, 119,759 sites in 175 shapes: 3.8 s, 2.65 s
//! with templates, for the same bytes).
//!
//! A [`Template`] comes from four generations of one spec with its site,
//! target, index and address moved. Every operand that differs between the
//! first three (found with the decoder's constant offsets) must follow one
//! rule that gives all three exactly: a constant, the site, the target or a
//! multiple of the index, plus a constant, as an absolute value or relative
//! to the instruction's end; no other byte may differ. The template must
//! then give back the second, third and fourth trampolines byte for byte.
//! Otherwise the shape has no template and each of its trampolines is
//! generated. A template also refuses a site whose operands would not fit
//! (the assembler then says why). Where the assembler would pick a shorter
//! encoding for one site (a jump within 128 bytes of its target: never a
//! site's return or target, which are in the original code), a template
//! keeps its shape's: the same instructions, the length the patcher laid
//! the trampoline out by.

use crate::codegen::{self, CodegenError, Trampoline, TrampolineSpec};
use iced_x86::{Decoder, DecoderOptions, Instruction, OpKind};

/// What a varying operand is computed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Base {
    Constant,
    Site,
    Target,
    /// The index times this.
    Index(i64),
}

/// One operand of the template that differs from site to site.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Field {
    /// Offset in the code and size in bytes (4 or 8).
    at: u32,
    size: u8,
    /// Relative to the end of its instruction (this offset), or absolute.
    relative_to: Option<u32>,
    /// The 32-bit immediate of a 32-bit operation: any 32 bits (else the
    /// value is sign-extended by the processor, and must fit).
    bits: bool,
    base: Base,
    addend: i64,
}

/// The per-site values a trampoline of a shape depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Values {
    at: u64,
    site: u64,
    target: u64,
    index: u32,
}

impl Values {
    fn of(spec: &TrampolineSpec, at: u64) -> Values {
        Values { at, site: spec.site, target: spec.target, index: spec.index }
    }

    fn base(&self, b: Base) -> i64 {
        match b {
            Base::Constant => 0,
            Base::Site => self.site as i64,
            Base::Target => self.target as i64,
            Base::Index(k) => k.wrapping_mul(i64::from(self.index)),
        }
    }
}

/// A trampoline of one shape, with the rules for its varying operands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    shape: TrampolineSpec,
    made: Trampoline,
    fields: Vec<Field>,
}

/// Moves of the values (address, site, target, index) for the second and
/// third generations, which the rules are fitted to, and a fourth, which
/// only checks them. A value moves the other way where this way does not
/// fit, and the index only within its shape's class; the moves are such
/// that no two rules give the same values at the first three (the site and
/// target moves differ and are not whole multiples of the index moves).
const MOVES: [(i64, i64, i64, i64); 3] =
    [(0x1_0340, 0x2351, -0x4a73, 7), (-0x2_7a10, -0x1c07, 0x6e3d, 12), (0x3_3330, 0x611d, 0x1d29, 29)];

/// `v` moved by `by`, or the other way if that does not fit.
fn moved(v: u64, by: i64) -> Option<u64> {
    v.checked_add_signed(by).or_else(|| v.checked_add_signed(by.checked_neg()?))
}

impl Template {
    /// The template of `spec`'s shape, from `spec`'s trampoline at `at`;
    /// None if the shape cannot have one.
    pub fn derive(spec: &TrampolineSpec, at: u64) -> Option<Template> {
        let first = codegen::trampoline(spec, at).ok()?;
        let v0 = Values::of(spec, at);
        let mut others = Vec::new();
        for (da, ds, dt, di) in MOVES {
            let index = moved_index(spec.index, di)?;
            let other =
                TrampolineSpec { site: moved(spec.site, ds)?, target: moved(spec.target, dt)?, index, ..spec.clone() };
            if other.shape() != spec.shape() {
                return None;
            }
            let at = moved(at, da)?;
            let t = codegen::trampoline(&other, at).ok()?;
            others.push((Values::of(&other, at), other, t));
        }
        let same_but_code = |t: &Trampoline| {
            t.code.len() == first.code.len()
                && (t.drain, t.count, t.callers, t.flags, t.traced)
                    == (first.drain, first.count, first.callers, first.flags, first.traced)
                && t.undo == first.undo
        };
        if !others.iter().all(|(_, _, t)| same_but_code(t)) {
            return None;
        }
        // The rules from the first three; all four, made again, are what
        // the assembler made.
        let samples: Vec<(Values, &[u8])> = std::iter::once((v0, first.code.as_slice()))
            .chain(others.iter().take(2).map(|(v, _, t)| (*v, t.code.as_slice())))
            .collect();
        let fields = fields(&first.code, at, &samples)?;
        let template = Template { shape: spec.shape(), made: first, fields };
        for (v, moved, t) in &others {
            if template.make(moved, v.at).as_ref() != Some(t) {
                return None;
            }
        }
        Some(template)
    }

    /// The trampoline of `spec` (of the template's shape) at `at`; None if
    /// an operand does not fit (the assembler would refuse it too, or use
    /// another encoding).
    pub fn make(&self, spec: &TrampolineSpec, at: u64) -> Option<Trampoline> {
        if spec.shape() != self.shape {
            return None;
        }
        Some(self.with_code(self.code(&Values::of(spec, at))?))
    }

    /// The trampoline of the template's shape with this code.
    fn with_code(&self, code: Vec<u8>) -> Trampoline {
        let m = &self.made;
        Trampoline {
            code,
            drain: m.drain,
            count: m.count,
            callers: m.callers,
            flags: m.flags,
            traced: m.traced,
            undo: m.undo.clone(),
        }
    }

    /// Whether every operand fits for these values.
    fn fits(&self, v: &Values) -> bool {
        self.fields.iter().all(|f| f.bytes(v).is_some())
    }

    /// The code for these values.
    fn code(&self, v: &Values) -> Option<Vec<u8>> {
        let mut code = self.made.code.clone();
        for f in &self.fields {
            let at = f.at as usize;
            match f.bytes(v)? {
                Encoded::Four(b) => code.get_mut(at..at + 4)?.copy_from_slice(&b),
                Encoded::Eight(b) => code.get_mut(at..at + 8)?.copy_from_slice(&b),
            }
        }
        Some(code)
    }
}

/// An operand's bytes.
enum Encoded {
    Four([u8; 4]),
    Eight([u8; 8]),
}

impl Field {
    /// The operand's bytes for these values; None if the value does not
    /// fit.
    fn bytes(&self, v: &Values) -> Option<Encoded> {
        let mut value = v.base(self.base).wrapping_add(self.addend);
        if let Some(end) = self.relative_to {
            value = value.wrapping_sub(v.at.wrapping_add(u64::from(end)) as i64);
        }
        Some(match (self.size, self.bits) {
            (4, false) => Encoded::Four(i32::try_from(value).ok()?.to_le_bytes()),
            // (Two's complement for a negative value.)
            (4, true) => Encoded::Four(
                u32::try_from(value).ok().or_else(|| i32::try_from(value).ok().map(|v| v as u32))?.to_le_bytes(),
            ),
            _ => Encoded::Eight(value.to_le_bytes()),
        })
    }
}

/// The index moved by `by` within its shape's class.
fn moved_index(index: u32, by: i64) -> Option<u32> {
    if index < 128 {
        // (Each small index is a shape of its own.)
        return Some(index);
    }
    let ids = 1 << crate::layout::shadow::ID_BITS;
    [i64::from(index) + by, i64::from(index) - by]
        .into_iter()
        .filter_map(|i| u32::try_from(i).ok())
        .find(|&i| i >= 128 && (i < ids) == (index < ids))
}

/// The operands of `code` (at `at`, the first sample) that differ between
/// the samples, each with the rule that gives it in all of them; None if
/// one follows no rule.
fn fields(code: &[u8], at: u64, samples: &[(Values, &[u8])]) -> Option<Vec<Field>> {
    let mut out = Vec::new();
    let mut decoder = Decoder::with_ip(64, code, at, DecoderOptions::NONE);
    let mut ins = Instruction::default();
    let mut covered = vec![false; code.len()];
    while decoder.can_decode() {
        decoder.decode_out(&mut ins);
        if ins.is_invalid() {
            return None;
        }
        let start = (ins.ip() - at) as usize;
        let end = start + ins.len();
        let offsets = decoder.get_constant_offsets(&ins);
        let branch = matches!(ins.op0_kind(), OpKind::NearBranch64);
        // (An immediate of a 32-bit operation holds any 32 bits.)
        let bits = (0..ins.op_count()).any(|i| ins.op_kind(i) == OpKind::Immediate32);
        let mut operands = Vec::new();
        if offsets.has_displacement() {
            let relative = ins.is_ip_rel_memory_operand();
            operands.push((offsets.displacement_offset(), offsets.displacement_size(), relative, false));
        }
        if offsets.has_immediate() {
            operands.push((offsets.immediate_offset(), offsets.immediate_size(), branch, bits && !branch));
        }
        if offsets.has_immediate2() {
            operands.push((offsets.immediate_offset2(), offsets.immediate_size2(), false, false));
        }
        for (off, size, relative, bits) in operands {
            let from = start + off;
            let range = from..from + size;
            covered.get_mut(range.clone())?.iter_mut().for_each(|c| *c = true);
            let values: Vec<i64> =
                samples.iter().map(|(_, c)| read(c.get(range.clone())?, bits)).collect::<Option<_>>()?;
            if values.iter().all(|&x| x == values[0]) {
                continue;
            }
            if size != 4 && size != 8 {
                return None;
            }
            let relative_to = relative.then_some(end as u32);
            // Each sample's value as an absolute one.
            let absolute: Vec<i64> = samples
                .iter()
                .zip(&values)
                .map(|((v, _), &x)| match relative_to {
                    Some(e) => x.wrapping_add(v.at.wrapping_add(u64::from(e)) as i64),
                    None => x,
                })
                .collect();
            let field = |base: Base| Field { at: from as u32, size: size as u8, relative_to, bits, base, addend: 0 };
            let fits = |base: Base| {
                let addend = absolute[0].wrapping_sub(samples[0].0.base(base));
                samples
                    .iter()
                    .zip(&absolute)
                    .all(|((v, _), &x)| v.base(base).wrapping_add(addend) == x)
                    .then_some(Field { addend, ..field(base) })
            };
            let per_index = {
                let (di, dx) = (
                    i64::from(samples[1].0.index) - i64::from(samples[0].0.index),
                    absolute[1].wrapping_sub(absolute[0]),
                );
                (di != 0 && dx % di == 0).then(|| Base::Index(dx / di))
            };
            let found = [Some(Base::Constant), Some(Base::Site), Some(Base::Target), per_index]
                .into_iter()
                .flatten()
                .find_map(fits)?;
            out.push(found);
        }
    }
    // Bytes outside every operand (opcodes, registers) must not differ.
    for (i, covered) in covered.iter().enumerate() {
        if !covered && samples.iter().any(|(_, c)| c.get(i) != code.get(i)) {
            return None;
        }
    }
    Some(out)
}

/// A little-endian value of 1, 2, 4 or 8 bytes: signed, but for the 32
/// `bits` of a 32-bit operation's immediate.
fn read(b: &[u8], bits: bool) -> Option<i64> {
    Some(match b.len() {
        1 => i64::from(i8::from_le_bytes(b.try_into().ok()?)),
        2 => i64::from(i16::from_le_bytes(b.try_into().ok()?)),
        4 if bits => i64::from(u32::from_le_bytes(b.try_into().ok()?)),
        4 => i64::from(i32::from_le_bytes(b.try_into().ok()?)),
        8 => i64::from_le_bytes(b.try_into().ok()?),
        _ => return None,
    })
}

/// How a trampoline's code is made again from its shape's template: kept
/// instead of the code (a few dozen bytes instead of hundreds, for each
/// of a hundred thousand trampolines), and made as the file is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Made {
    template: std::sync::Arc<Template>,
    values: Values,
}

impl Made {
    /// The code's length.
    pub fn len(&self) -> usize {
        self.template.made.code.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The code (None never happens: the same values made it before).
    pub fn code(&self) -> Option<Vec<u8>> {
        self.template.code(&self.values)
    }
}

/// Templates by shape (None: the shape has none).
pub type Templates = std::collections::HashMap<TrampolineSpec, Option<std::sync::Arc<Template>>>;

/// A site's trampoline from its shape's template when there is one (found
/// in `templates`, or derived now), with how to make its code: the
/// trampoline's own `code` is then left empty (nothing is copied until the
/// code is written); else from the assembler, with its code.
pub fn trampoline(
    templates: &mut Templates,
    spec: &TrampolineSpec,
    at: u64,
) -> Result<(Trampoline, Option<Made>), CodegenError> {
    let template = templates.entry(spec.shape()).or_insert_with(|| Template::derive(spec, at).map(std::sync::Arc::new));
    let values = Values::of(spec, at);
    match template.as_ref().filter(|t| spec.shape() == t.shape && t.fits(&values)) {
        Some(t) => {
            let made = Made { template: t.clone(), values };
            let trampoline = t.with_code(Vec::new());
            debug_assert_eq!(
                Some(Trampoline { code: made.code().unwrap_or_default(), ..trampoline.clone() }),
                codegen::trampoline(spec, at).ok(),
                "a template's trampoline"
            );
            Ok((trampoline, Some(made)))
        }
        None => Ok((codegen::trampoline(spec, at)?, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::golden::specs;

    const AT: u64 = 0x428000;

    /// Every trampoline form gets a template, at small indices (a shape
    /// each), ones in the shadow map's ids (the traced entry's record word
    /// holds the index shifted left by 15: from 65,536 on, past the sign
    /// bit of its 32-bit immediate) and ones beyond, at the classes' edges,
    /// and makes what the assembler makes for other sites, targets, indices
    /// and places of its shape.
    #[test]
    fn templates_make_what_the_assembler_makes() {
        for (name, spec) in specs() {
            for index in [3, 127, 128, 300, 65_535, 100_000, 131_071, 131_072, 140_000] {
                let spec = TrampolineSpec { index, ..spec.clone() };
                let t = Template::derive(&spec, AT).unwrap_or_else(|| panic!("{name} at index {index}: no template"));
                // (65,535 moved by 901 crosses 65,536.)
                for (da, ds, dt, di) in [(0, 0, 0, 0), (0x88, 0x1000, 0x20, 1), (0x5_0000, -0x301, 0x7777, 901)] {
                    let index = moved_index(index, di).unwrap();
                    let other = TrampolineSpec {
                        site: spec.site.checked_add_signed(ds).unwrap(),
                        target: spec.target.checked_add_signed(dt).unwrap(),
                        index,
                        ..spec.clone()
                    };
                    let at = AT.checked_add_signed(da).unwrap();
                    let want = codegen::trampoline(&other, at).unwrap();
                    assert_eq!(t.make(&other, at), Some(want), "{name}, index {index}, at {at:#x}");
                }
            }
        }
    }

    #[test]
    fn a_template_makes_nothing_of_another_shape_or_out_of_reach() {
        let (_, spec) = specs().into_iter().find(|(n, _)| *n == "malloc-call-rel32").unwrap();
        let spec = TrampolineSpec { index: 300, ..spec };
        let t = Template::derive(&spec, AT).unwrap();
        // Another shape: a small index, or another form.
        assert_eq!(t.make(&TrampolineSpec { index: 3, ..spec.clone() }, AT), None);
        assert_eq!(t.make(&TrampolineSpec { preserve: !spec.preserve, ..spec.clone() }, AT), None);
        // More than 2 GiB from the control block: the operands do not fit
        // (what the assembler makes instead is the patcher's to refuse).
        let far = AT + (3 << 30);
        assert_eq!(t.make(&spec, far), None);
        // Through the cache: the same trampolines.
        let mut cache = Templates::new();
        for index in [300, 301, 5000] {
            let s = TrampolineSpec { index, ..spec.clone() };
            let (t, made) = trampoline(&mut cache, &s, AT).unwrap();
            let want = codegen::trampoline(&s, AT).unwrap();
            // The code is made when asked for.
            assert!(t.code.is_empty());
            let made = made.unwrap();
            assert_eq!((made.len(), made.code().as_ref()), (want.code.len(), Some(&want.code)));
            assert_eq!(Trampoline { code: want.code.clone(), ..t }, want);
        }
        assert_eq!(cache.len(), 1);
        let (t, made) = trampoline(&mut cache, &spec, far).unwrap();
        assert_eq!((Some(t), made), (codegen::trampoline(&spec, far).ok(), None));
    }
}
