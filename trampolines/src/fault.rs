//! Fault injection specs: which calls of which sites fail.
//!
//! A spec is `WHERE:HOW`. WHERE names sites by their place in the source
//! (`FILE:LINE`, a file name or a path suffix), by function, or by address
//! (`0xADDRESS`, the site's address in its file, optionally `MODULE:` before
//! it); HOW says which of the calls that reach those sites fail, as
//! comma-separated `nth=N`, `every=N`, `after=N`, `prob=P` (with `seed=S`)
//! and `times=K`. Several specs are separated by `;`.
//!
//! The command line checks a spec with [`Spec::parse`] before sending it;
//! the runtime parses the same text with the same code, in a signal handler
//! if it must: nothing here allocates or can panic.

#![deny(clippy::indexing_slicing)]

use crate::layout::{Site, Table};

/// Specs in effect at once.
pub const MAX_SPECS: usize = 16;
/// Longest WHERE part.
pub const MAX_WHERE: usize = 200;
/// Longest text of a spec list (`ALLOCTRAMP_FAIL`, the fail file).
pub const MAX_TEXT: usize = 4096;

/// What a spec's WHERE names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Where {
    /// `FILE:LINE`: `text` is the file name or path suffix.
    Line(u32),
    /// A function: `text` is its name.
    Function,
    /// `[MODULE:]0xADDRESS`: `text` is the module (empty: any).
    Address(u64),
}

/// Which of the matching calls fail. Every condition given must hold; a
/// call is the spec's `n`th, counted from 1 over every site it names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct How {
    /// Only call `nth` (0: any).
    pub nth: u64,
    /// Only calls whose number is a multiple of `every` (0: any).
    pub every: u64,
    /// Only calls after the first `after`.
    pub after: u64,
    /// At most `times` failures (0: no bound).
    pub times: u64,
    /// With probability `prob / 2^32` (`u64::MAX`: always), drawn from
    /// `seed` and the call's number, so a run repeats.
    pub prob: u64,
    pub seed: u64,
}

/// One parsed spec; the WHERE text is kept inline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Spec {
    pub place: Where,
    text: [u8; MAX_WHERE],
    len: u8,
    pub how: How,
}

impl Default for Spec {
    fn default() -> Spec {
        Spec::EMPTY
    }
}

/// Why a spec cannot be read: a fixed message, and the byte of the spec
/// text it is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecError {
    pub what: &'static str,
    pub at: usize,
}

impl std::fmt::Display for SpecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "at byte {}: {}", self.at, self.what)
    }
}

fn err<T>(what: &'static str, at: usize) -> Result<T, SpecError> {
    Err(SpecError { what, at })
}

/// A decimal or `0x` hexadecimal number.
fn number(s: &[u8]) -> Option<u64> {
    let (digits, radix) = match s {
        [b'0', b'x' | b'X', rest @ ..] => (rest, 16),
        _ => (s, 10),
    };
    if digits.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &c in digits {
        let d = (c as char).to_digit(radix)?;
        v = v.checked_mul(u64::from(radix))?.checked_add(u64::from(d))?;
    }
    Some(v)
}

/// A probability `0`, `1` or `0.DIGITS` (at most 9 decimals) as a
/// fraction of 2^32, or `u64::MAX` for 1.
fn probability(s: &[u8]) -> Option<u64> {
    let (int, frac) = match s.iter().position(|&c| c == b'.') {
        Some(dot) => (s.get(..dot)?, s.get(dot + 1..)?),
        None => (s, &[][..]),
    };
    if frac.len() > 9 || (int.is_empty() && frac.is_empty()) {
        return None;
    }
    let whole = if int.is_empty() { 0 } else { number(int).filter(|_| int.iter().all(u8::is_ascii_digit))? };
    let mut num: u64 = 0;
    let mut den: u64 = 1;
    for &c in frac {
        num = num * 10 + u64::from((c as char).to_digit(10)?);
        den *= 10;
    }
    match (whole, num) {
        (1, 0) => Some(u64::MAX),
        (0, n) => Some((n << 32) / den),
        _ => None,
    }
}

impl Spec {
    /// A spec that names nothing (a free slot).
    pub const EMPTY: Spec = Spec {
        place: Where::Function,
        text: [0; MAX_WHERE],
        len: 0,
        how: How { nth: 0, every: 0, after: 0, times: 0, prob: u64::MAX, seed: 0 },
    };

    /// Parses one `WHERE:HOW` (an error's byte counts from the start of
    /// `s`, white space before the spec included).
    pub fn parse(s: &[u8]) -> Result<Spec, SpecError> {
        let lead = s.len() - s.trim_ascii_start().len();
        Spec::parse_trimmed(s.trim_ascii()).map_err(|e| SpecError { at: e.at + lead, ..e })
    }

    fn parse_trimmed(s: &[u8]) -> Result<Spec, SpecError> {
        let Some(colon) = s.iter().rposition(|&c| c == b':') else {
            return err("expected WHERE:HOW (for example parse.c:120:nth=2)", 0);
        };
        let (place_text, how_text) = (s.get(..colon).unwrap_or_default(), s.get(colon + 1..).unwrap_or_default());
        let how = How::parse(how_text, colon + 1)?;
        Spec::at_place(place_text, how)
    }

    /// Parses a WHERE alone (`alloctramp callers --site`): a spec that
    /// names sites and fails no call.
    pub fn parse_where(s: &[u8]) -> Result<Spec, SpecError> {
        let lead = s.len() - s.trim_ascii_start().len();
        let never = How { prob: 0, ..How::default() };
        Spec::at_place(s.trim_ascii(), never).map_err(|e| SpecError { at: e.at + lead, ..e })
    }

    fn at_place(place_text: &[u8], how: How) -> Result<Spec, SpecError> {
        let mut spec = Spec { how, ..Spec::default() };
        if place_text.is_empty() {
            return err("WHERE is empty (FILE:LINE, a function or 0xADDRESS)", 0);
        }
        let last = place_text.iter().rposition(|&c| c == b':');
        let tail = last.map_or(place_text, |c| place_text.get(c + 1..).unwrap_or_default());
        let head = last.map_or(&[][..], |c| place_text.get(..c).unwrap_or_default());
        let text = if tail.starts_with(b"0x") || tail.starts_with(b"0X") {
            let Some(a) = number(tail) else { return err("bad address (0x and hexadecimal digits)", head.len()) };
            spec.place = Where::Address(a);
            head
        } else if last.is_some() && !tail.is_empty() && tail.iter().all(u8::is_ascii_digit) && !head.ends_with(b":") {
            let Some(line) = number(tail).and_then(|l| u32::try_from(l).ok()).filter(|&l| l > 0) else {
                return err("bad line number", head.len() + 1);
            };
            if head.is_empty() {
                return err("FILE:LINE without a file", 0);
            }
            spec.place = Where::Line(line);
            head
        } else {
            spec.place = Where::Function;
            place_text
        };
        if text.len() > MAX_WHERE {
            return err("WHERE is too long", 0);
        }
        if let Some(dst) = spec.text.get_mut(..text.len()) {
            dst.copy_from_slice(text);
        }
        spec.len = text.len() as u8;
        Ok(spec)
    }

    /// The WHERE text: a file, a function or a module name.
    pub fn text(&self) -> &[u8] {
        self.text.get(..usize::from(self.len)).unwrap_or_default()
    }

    /// Whether the spec names `site` of `table`.
    pub fn names(&self, table: &Table, site: &Site) -> bool {
        let text = self.text();
        match self.place {
            Where::Address(a) => site.addr == a && (text.is_empty() || path_ends_with(table.module_name(), text)),
            Where::Line(line) => site.line == line && table.string(site.file).is_some_and(|f| path_ends_with(f, text)),
            Where::Function => table.string(site.function).is_some_and(|f| function_is(f, text)),
        }
    }

    /// Whether the spec's call number `n` (from 1) fails, before `times`.
    pub fn fails(&self, n: u64) -> bool {
        let h = &self.how;
        (h.nth == 0 || n == h.nth)
            && (h.every == 0 || n.is_multiple_of(h.every))
            && n > h.after
            && (h.prob == u64::MAX || mix(h.seed, n) >> 32 < h.prob)
    }
}

impl How {
    fn parse(s: &[u8], base: usize) -> Result<How, SpecError> {
        let mut how = How { prob: u64::MAX, ..How::default() };
        let mut any = false;
        let mut at = base;
        for part in s.split(|&c| c == b',') {
            let here = at;
            at += part.len() + 1;
            let Some(eq) = part.iter().position(|&c| c == b'=') else {
                return err("expected KEY=VALUE (nth, every, after, prob, seed, times)", here);
            };
            let (key, value) = (part.get(..eq).unwrap_or_default(), part.get(eq + 1..).unwrap_or_default());
            let n = number(value);
            let positive = n.filter(|&n| n > 0);
            match key {
                b"nth" => how.nth = positive.ok_or(SpecError { what: "nth= needs a number from 1", at: here })?,
                b"every" => how.every = positive.ok_or(SpecError { what: "every= needs a number from 1", at: here })?,
                b"after" => how.after = n.ok_or(SpecError { what: "after= needs a number", at: here })?,
                b"times" => how.times = positive.ok_or(SpecError { what: "times= needs a number from 1", at: here })?,
                b"seed" => {
                    how.seed = n.ok_or(SpecError { what: "seed= needs a number", at: here })?;
                    continue;
                }
                b"prob" => {
                    how.prob = probability(value)
                        .ok_or(SpecError { what: "prob= needs a number from 0 to 1 (at most 9 decimals)", at: here })?
                }
                _ => return err("unknown key (nth, every, after, prob, seed, times)", here),
            }
            any = true;
        }
        if !any {
            return err("HOW names no condition (nth, every, after, prob or times)", base);
        }
        Ok(how)
    }
}

/// Parses `SPEC[;SPEC...]` into `out`; empty specs are skipped. Returns
/// how many, or the first error with the spec's index.
pub fn parse_list(text: &[u8], out: &mut [Spec; MAX_SPECS]) -> Result<usize, (usize, SpecError)> {
    if text.len() > MAX_TEXT {
        return Err((0, SpecError { what: "more than 4096 bytes of specs", at: MAX_TEXT }));
    }
    let mut n = 0;
    for (i, part) in text.split(|&c| c == b';' || c == b'\n').filter(|p| !p.trim_ascii().is_empty()).enumerate() {
        let spec = Spec::parse(part).map_err(|e| (i, e))?;
        let Some(slot) = out.get_mut(n) else {
            return Err((i, SpecError { what: "more than 16 specs", at: 0 }));
        };
        *slot = spec;
        n += 1;
    }
    Ok(n)
}

/// `path` is `suffix`, or ends with `/` and `suffix`.
fn path_ends_with(path: &str, suffix: &[u8]) -> bool {
    let p = path.as_bytes();
    let Some(start) = p.len().checked_sub(suffix.len()) else { return false };
    same(p.get(start..).unwrap_or_default(), suffix)
        && (start == 0 || suffix.first() == Some(&b'/') || p.get(start - 1) == Some(&b'/'))
}

/// `name` is `f`, or `f` followed by its parameters (a demangled C++ name).
fn function_is(name: &str, f: &[u8]) -> bool {
    let n = name.as_bytes();
    n.get(..f.len()).is_some_and(|head| same(head, f)) && matches!(n.get(f.len()), None | Some(b'('))
}

/// Byte-wise equality without the C library's `memcmp`, whose vector
/// variants use registers the runtime promises to leave alone (the
/// runtime matches specs on the allocation path; see the runtime's
/// `fault`).
#[inline(never)]
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| std::hint::black_box(*x) == *y)
}

/// A call number's draw: splitmix64 of the seed and the number.
fn mix(seed: u64, n: u64) -> u64 {
    let mut z = seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn wheres() {
        let s = Spec::parse(b"parse.c:120:nth=2").unwrap();
        assert_eq!((s.place, s.text(), s.how.nth), (Where::Line(120), &b"parse.c"[..], 2));
        let s = Spec::parse(b"load_table:every=10,times=3").unwrap();
        assert_eq!((s.place, s.text(), s.how.every, s.how.times), (Where::Function, &b"load_table"[..], 10, 3));
        let s = Spec::parse(b"0x401a2f:after=5").unwrap();
        assert_eq!((s.place, s.text(), s.how.after), (Where::Address(0x401a2f), &b""[..], 5));
        let s = Spec::parse(b"libfoo.so:0x1a2f:nth=1").unwrap();
        assert_eq!((s.place, s.text()), (Where::Address(0x1a2f), &b"libfoo.so"[..]));
        let s = Spec::parse(b"ns::Parser::load:nth=1").unwrap();
        assert_eq!((s.place, s.text()), (Where::Function, &b"ns::Parser::load"[..]));
        let s = Spec::parse_where(b"src/a.c:7").unwrap();
        assert_eq!((s.place, s.text()), (Where::Line(7), &b"src/a.c"[..]));
        assert!((1..100).all(|n| !s.fails(n)), "a WHERE alone fails no call");
        let s = Spec::parse(b"src/a.c:7:prob=0.25,seed=3").unwrap();
        assert_eq!((s.place, s.how.prob, s.how.seed), (Where::Line(7), 1 << 30, 3));
    }

    #[test]
    fn errors_say_where() {
        assert_eq!(Spec::parse(b"main").unwrap_err().at, 0);
        assert_eq!(Spec::parse(b"main:nth=0").unwrap_err().what, "nth= needs a number from 1");
        assert_eq!(Spec::parse(b"main:bogus=1").unwrap_err().at, 5);
        assert_eq!(Spec::parse(b"a.c:12:nth=1,x").unwrap_err().at, 13);
        assert!(Spec::parse(b"main:prob=1.5").is_err());
        assert!(Spec::parse(b"main:seed=4").is_err());
        assert!(Spec::parse(b":nth=1").is_err());
        assert!(Spec::parse(b"0xzz:nth=1").is_err());
        assert_eq!(Spec::parse(b"  main:bogus=1").unwrap_err().at, 7, "counted from the first byte given");
        let mut out = [Spec::default(); MAX_SPECS];
        assert_eq!(parse_list(b"a:nth=1; b:nth=2 ;", &mut out), Ok(2));
        assert_eq!(parse_list(b"a:nth=1;b", &mut out).unwrap_err().0, 1);
    }

    #[test]
    fn which_calls_fail() {
        let fails = |s: &str| {
            let s = Spec::parse(s.as_bytes()).unwrap();
            (1..=12).filter(|&n| s.fails(n)).collect::<Vec<_>>()
        };
        assert_eq!(fails("f:nth=2"), [2]);
        assert_eq!(fails("f:every=4"), [4, 8, 12]);
        assert_eq!(fails("f:after=10"), [11, 12]);
        assert_eq!(fails("f:times=2"), (1..=12).collect::<Vec<_>>());
        assert_eq!(fails("f:prob=0"), Vec::<u64>::new());
        assert_eq!(fails("f:prob=1"), (1..=12).collect::<Vec<_>>());
        let s = Spec::parse(b"f:prob=0.5,seed=9").unwrap();
        let n = (1..=10_000).filter(|&n| s.fails(n)).count();
        assert!((4_700..5_300).contains(&n), "{n}");
    }

    #[test]
    fn paths_and_functions() {
        assert!(path_ends_with("/src/git/parse.c", b"parse.c"));
        assert!(path_ends_with("/src/git/parse.c", b"git/parse.c"));
        assert!(path_ends_with("parse.c", b"parse.c"));
        assert!(!path_ends_with("/src/git/xparse.c", b"parse.c"));
        assert!(function_is("load(int)", b"load"));
        assert!(function_is("load", b"load"));
        assert!(!function_is("loader", b"load"));
    }
}
