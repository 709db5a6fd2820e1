//! Writing a patched ELF file: [`patch`] parses the input, plans the
//! output ([`crate::plan`]) and emits its parts ([`crate::emit`]).
//!
//! Every byte of the input stays where it is in memory; in the file, the
//! input follows the new segments, whole, and only its .symtab entries that
//! name a moved table change. Everything new goes into three PT_LOAD
//! segments above the highest address (read-only, read-write,
//! executable), the section name table and headers after the input.

use crate::elf::Elf;
use crate::error::Result;
use crate::{Analysis, emit, plan};
use alloctramp_trampolines::addr::Vaddr;
use alloctramp_trampolines::layout::{self, Image};

pub use crate::plan::{PatchOptions, SkipReason, is_patched};

/// A site that was not patched, and why.
#[derive(Clone, Debug)]
pub struct Skipped {
    /// Index in the analysis's sites.
    pub site: usize,
    pub reason: SkipReason,
}

/// The patched file and what was done. The file is the new segments
/// (`head`, parts at their offsets), then the original file with `fixups`
/// applied, then `tail`: the original is borrowed, not copied, and the new
/// segments are never gathered in one buffer.
#[derive(Debug)]
pub struct Patched<'a> {
    head: emit::Head,
    pub original: &'a [u8],
    /// (offset in the original, new bytes).
    pub fixups: Vec<(u64, [u8; 8])>,
    pub tail: Vec<u8>,
    pub sites: usize,
    pub skipped: Vec<Skipped>,
    pub text_size: u64,
    pub table_size: u64,
    pub counters_size: u64,
    /// Each switched image's jumps ([`Image::site`]): (offset in the
    /// patched file, bytes), in file order; no entry for an image the file
    /// does not have (no patched site, or one the image could not switch).
    pub switched: Vec<(Image, Vec<Jump>)>,
}

/// A switched image's jump: (offset in the patched file, bytes).
pub type Jump = (u64, [u8; 5]);

impl Patched<'_> {
    /// Where the original file starts in the patched file (and in its
    /// image): byte `i` of the original is written at this offset plus `i`,
    /// after every byte of the original before it.
    pub fn original_offset(&self) -> u64 {
        self.head.len()
    }

    /// Gives the patched file's bytes, in order, in pieces.
    fn pieces(&self, mut put: impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        self.head.pieces(&mut put)?;
        let mut at = 0usize;
        let mut fixups = self.fixups.clone();
        fixups.sort();
        for (off, bytes) in fixups {
            let off = off as usize;
            if off < at || off + bytes.len() > self.original.len() {
                continue;
            }
            put(&self.original[at..off])?;
            put(&bytes)?;
            at = off + bytes.len();
        }
        put(&self.original[at..])?;
        put(&self.tail)
    }

    /// The bytes of `pieces`, with `over` (offset, bytes; in file order,
    /// apart) in place of the bytes they cover.
    fn pieces_over(&self, over: &[Jump], mut put: impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        let (mut pos, mut k) = (0u64, 0usize);
        self.pieces(|mut p| {
            while !p.is_empty() {
                let end = pos + p.len() as u64;
                while over.get(k).is_some_and(|&(o, _)| o + 5 <= pos) {
                    k += 1;
                }
                match over.get(k) {
                    Some(&(o, bytes)) if o < end => {
                        let (lo, hi) = (o.max(pos), (o + 5).min(end));
                        put(&p[..(lo - pos) as usize])?;
                        put(&bytes[(lo - o) as usize..(hi - o) as usize])?;
                        p = &p[(hi - pos) as usize..];
                        pos = hi;
                    }
                    _ => {
                        put(p)?;
                        pos = end;
                        p = &[];
                    }
                }
            }
            Ok(())
        })
    }

    /// Writes the patched file.
    pub fn write_to(&self, w: &mut (impl std::io::Write + ?Sized)) -> std::io::Result<()> {
        self.pieces(|p| w.write_all(p))
    }

    /// Writes the patched file from the writer's start, seeking over every
    /// whole 4 KiB block (at a 4 KiB-aligned output offset) of zeros instead
    /// of writing it, so that holes of a sparse input stay holes. Returns
    /// the file's length: the caller sets it (`File::set_len`), since a
    /// trailing hole is never written.
    pub fn write_sparse<W: std::io::Write + std::io::Seek>(&self, w: &mut W) -> std::io::Result<u64> {
        self.sparse(w, &[])
    }

    /// The switched images the file has.
    pub fn images(&self) -> impl Iterator<Item = Image> + '_ {
        self.switched.iter().map(|(image, _)| *image)
    }

    /// The jumps of the switched image `image` (none if the file has no
    /// such image).
    fn jumps(&self, image: Image) -> &[Jump] {
        self.switched.iter().find(|(i, _)| *i == image).map_or(&[], |(_, jumps)| jumps)
    }

    /// Writes the patched file's switched image `image` as
    /// [`write_sparse`](Self::write_sparse) writes the file.
    pub fn write_image_sparse<W: std::io::Write + std::io::Seek>(
        &self,
        image: Image,
        w: &mut W,
    ) -> std::io::Result<u64> {
        self.sparse(w, self.jumps(image))
    }

    fn sparse<W: std::io::Write + std::io::Seek>(&self, w: &mut W, over: &[Jump]) -> std::io::Result<u64> {
        const BLOCK: usize = 4096;
        // `pos` bytes given so far; `written` where the writer stands; a
        // block that spans pieces is gathered in `partial` first.
        let (mut pos, mut written) = (0u64, 0u64);
        let mut partial: Vec<u8> = Vec::with_capacity(BLOCK);
        let mut emit = |block: &[u8], at: u64, written: &mut u64| -> std::io::Result<()> {
            if !is_zero(block) {
                if *written != at {
                    w.seek(std::io::SeekFrom::Start(at))?;
                }
                w.write_all(block)?;
                *written = at + block.len() as u64;
            }
            Ok(())
        };
        self.pieces_over(over, |mut p| {
            while !p.is_empty() {
                if partial.is_empty() && p.len() >= BLOCK && pos % BLOCK as u64 == 0 {
                    let (block, rest) = p.split_at(BLOCK);
                    emit(block, pos, &mut written)?;
                    pos += BLOCK as u64;
                    p = rest;
                    continue;
                }
                let n = (BLOCK - (pos as usize + partial.len()) % BLOCK).min(p.len());
                partial.extend_from_slice(&p[..n]);
                p = &p[n..];
                if (pos as usize + partial.len()).is_multiple_of(BLOCK) {
                    emit(&partial, pos, &mut written)?;
                    pos += partial.len() as u64;
                    partial.clear();
                }
            }
            Ok(())
        })?;
        // A last, partial block: zeros are left to the length.
        emit(&partial, pos, &mut written)?;
        Ok(pos + partial.len() as u64)
    }

    /// The patched file in one buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        self.gather(&[])
    }

    /// The switched image `image` in one buffer.
    pub fn image_to_vec(&self, image: Image) -> Vec<u8> {
        self.gather(self.jumps(image))
    }

    fn gather(&self, over: &[Jump]) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.head.len() as usize + self.original.len() + self.tail.len());
        self.pieces_over(over, |p| {
            v.extend_from_slice(p);
            Ok(())
        })
        .expect("writing to a Vec");
        v
    }
}

fn is_zero(b: &[u8]) -> bool {
    let (words, rest) = b.split_at(b.len() / 8 * 8);
    words.chunks_exact(8).all(|w| u64::from_ne_bytes(w.try_into().unwrap()) == 0) && rest.iter().all(|&x| x == 0)
}

/// Patches a file: `data` is the input, `a` its analysis.
pub fn patch<'a>(data: &'a [u8], a: &Analysis, opts: &PatchOptions) -> Result<Patched<'a>> {
    let elf = Elf::parse(data)?;
    let mut plan = plan::plan(&elf, a, opts)?;
    let skipped: Vec<Skipped> = plan.skipped().map(|(site, reason)| Skipped { site, reason: reason.clone() }).collect();
    let out = emit::emit(&elf, a, &mut plan);
    // Every byte of the input is at its offset plus the head's length. A
    // site whose five bytes are not together in the file (never seen) or
    // that cannot jump to its image's entry leaves the file without that
    // image.
    let jumps = |image: Image| -> Option<Vec<Jump>> {
        let mut jumps: Vec<Jump> = plan
            .sites
            .iter()
            .filter_map(|site| {
                let t = site.trampoline()?;
                let s = layout::Site {
                    addr: site.addr.0,
                    trampoline: t.code.addr.0,
                    len: site.len,
                    count: t.count,
                    ..layout::Site::default()
                };
                let at = elf.offset_of(site.addr).map(|o| o.0);
                let together = at.is_some() && elf.offset_of(Vaddr(site.addr.0 + 4)).map(|o| o.0) == at.map(|o| o + 4);
                Some(at.filter(|_| together).zip(image.site(&s)).map(|(at, j)| (at + out.head.len(), j)))
            })
            .collect::<Option<_>>()?;
        jumps.sort_unstable_by_key(|j| j.0);
        (!jumps.is_empty()).then_some(jumps)
    };
    let switched = Image::ALL.into_iter().filter_map(|image| Some((image, jumps(image)?))).collect();
    Ok(Patched {
        head: out.head,
        original: data,
        fixups: out.fixups,
        tail: out.tail,
        sites: plan.sites.len() - skipped.len(),
        skipped,
        text_size: plan.text.size,
        table_size: plan.site_table.size,
        counters_size: plan.counters.region.size,
        switched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Cursor, Read, Seek, SeekFrom, Write};

    /// A writer that records which byte ranges were written.
    struct Recorder {
        inner: Cursor<Vec<u8>>,
        written: u64,
    }

    impl Write for Recorder {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.written += b.len() as u64;
            self.inner.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Seek for Recorder {
        fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
            self.inner.seek(to)
        }
    }

    #[test]
    fn sparse_writer_skips_zero_blocks_and_keeps_bytes() {
        // An original of 64 KiB: zeros but for a few bytes, a fixup inside
        // a zero block, and head and tail of odd lengths.
        let mut original = vec![0u8; 64 << 10];
        original[5000] = 1;
        original[40_000] = 2;
        let p = Patched {
            head: emit::Head::from_bytes(vec![7u8; 4096 + 100]),
            original: &original,
            fixups: vec![(20_000, [9; 8])],
            tail: vec![0u8; 5000],
            sites: 0,
            skipped: vec![],
            text_size: 0,
            table_size: 0,
            counters_size: 0,
            switched: vec![],
        };
        let mut r = Recorder { inner: Cursor::new(Vec::new()), written: 0 };
        let len = p.write_sparse(&mut r).unwrap();
        let dense = p.to_vec();
        assert_eq!(len, dense.len() as u64);
        let mut got = r.inner.into_inner();
        got.resize(len as usize, 0); // set_len
        assert!(got == dense, "same bytes as the dense writer");
        // Written: the head's 2 blocks (the second shared with the
        // original) and the 3 blocks holding a non-zero byte; the rest,
        // blocks spanning pieces and the trailing partial block included,
        // are holes.
        assert_eq!(r.written, 5 * 4096);
        let mut c = Cursor::new(got);
        let mut b = [0u8; 1];
        c.seek(SeekFrom::Start(4196 + 20_000)).unwrap();
        c.read_exact(&mut b).unwrap();
        assert_eq!(b[0], 9);
    }
}
