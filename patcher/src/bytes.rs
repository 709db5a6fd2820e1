//! Little-endian reads that return `None` past the end instead of
//! panicking, NUL-terminated strings, and alignment.

pub(crate) fn align(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

pub(crate) fn u16_at(d: &[u8], at: u64) -> Option<u16> {
    Some(u16::from_le_bytes(d.get(at as usize..(at as usize).checked_add(2)?)?.try_into().ok()?))
}

pub(crate) fn u32_at(d: &[u8], at: u64) -> Option<u32> {
    Some(u32::from_le_bytes(d.get(at as usize..(at as usize).checked_add(4)?)?.try_into().ok()?))
}

pub(crate) fn u64_at(d: &[u8], at: u64) -> Option<u64> {
    Some(u64::from_le_bytes(d.get(at as usize..(at as usize).checked_add(8)?)?.try_into().ok()?))
}

/// The string at `off` in a string table, without its NUL (empty past the
/// end).
pub(crate) fn c_str(strtab: &[u8], off: u32) -> &[u8] {
    let rest = strtab.get(off as usize..).unwrap_or(&[]);
    &rest[..rest.iter().position(|&c| c == 0).unwrap_or(rest.len())]
}
