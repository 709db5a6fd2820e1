//! The switched images of a patched file (`layout::Image`): the same
//! bytes, with every patched site already a jump to one of its
//! trampoline's entries (its start, or the entry that only counts). A
//! process switched on at start-up maps its mode's image's code over its
//! own rather than writing each site (`runtime/src/image.rs`).

use crate::elf::Elf;
use crate::error::{Error, Result};
use alloctramp_trampolines::addr::{FileOffset, Vaddr};
use alloctramp_trampolines::layout::{self, Image, Table};

/// The writes, in file order, that turn the patched file `data` into its
/// switched image `image`: five bytes at the file offset of each site with
/// a trampoline ([`Image::site`]).
pub fn switched_writes(data: &[u8], image: Image) -> Result<Vec<(FileOffset, [u8; 5])>> {
    let at = layout::table_after_phdrs(data).ok_or_else(|| Error::malformed("not a file patched by alloctramp"))?;
    let table = data
        .get(at..)
        .and_then(|t| Table::parse(t).ok())
        .ok_or_else(|| Error::malformed_at(at as u64, "the site table cannot be read"))?;
    let elf = Elf::parse(data)?;
    let mut writes = Vec::with_capacity(table.header.site_count as usize);
    for site in table.sites() {
        let Some(jump) = image.site(&site) else { continue };
        let (first, last) = (elf.offset_of(Vaddr(site.addr)), elf.offset_of(Vaddr(site.addr + 4)));
        match (first, last) {
            (Some(f), Some(l)) if l.0 == f.0 + 4 => writes.push((f, jump)),
            _ => {
                return Err(Error::new(
                    crate::error::ErrorKind::Malformed,
                    crate::error::Location::Vaddr(Vaddr(site.addr)),
                    "a site of the table is not in the file's loaded bytes",
                ));
            }
        }
    }
    writes.sort_unstable_by_key(|w| w.0);
    if writes.windows(2).any(|w| matches!(w, [a, b] if a.0.0 + 5 > b.0.0)) {
        return Err(Error::malformed_at(at as u64, "sites of the table overlap"));
    }
    Ok(writes)
}

/// The switched image `image` of the patched file `data`, whole (for
/// tests and small files: the command line copies the file and writes the
/// sites).
pub fn switched_image(data: &[u8], image: Image) -> Result<Vec<u8>> {
    let mut out = data.to_vec();
    for (at, jump) in switched_writes(data, image)? {
        if let Some(dst) = out.get_mut(at.0 as usize..at.0 as usize + 5) {
            dst.copy_from_slice(&jump);
        }
    }
    Ok(out)
}
