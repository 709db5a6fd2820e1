//! Shared pieces of the command line: mapping input files, one-line errors,
//! and output that tolerates a closed pipe.

use alloctramp_trampolines::process;
use anyhow::{Context, Result};
use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::process::ExitCode;

/// An input file, memory-mapped read-only.
pub struct Input {
    pub map: memmap2::Mmap,
}

impl Input {
    pub fn open(path: &Path) -> Result<Input> {
        let file = open_regular(path)?;
        Input::of(&file, path)
    }

    /// Maps an opened file (`path` names it in errors).
    fn of(file: &File, path: &Path) -> Result<Input> {
        let meta = file.metadata().with_context(|| format!("{}: cannot stat", path.display()))?;
        if !meta.is_file() {
            anyhow::bail!("{}: not a regular file", path.display());
        }
        // SAFETY: the mapping is read-only (and shared). A file truncated by
        // another process while mapped would raise SIGBUS; inputs are
        // programs and libraries that are not rewritten in place.
        let map = unsafe { memmap2::Mmap::map(file) }.with_context(|| format!("{}: cannot map", path.display()))?;
        Ok(Input { map })
    }
}

impl Input {
    /// Lets the system take back the pages of the mapping from `from` to
    /// `to` (rounded inwards to pages) that the process holds: a later read
    /// maps them again from the file. A large input is read whole while it
    /// is analysed, then in parts, then once more as it is copied out: its
    /// pages need not stay in the process all along (117 MB of the
    /// 400 MB patching libLLVM took).
    pub fn release(&self, from: usize, to: usize) {
        let (from, to) = (from.next_multiple_of(4096), to.min(self.map.len()) / 4096 * 4096);
        if from < to {
            // SAFETY: a shared, read-only mapping of a file: the pages
            // dropped are those of the page cache, mapped again when touched
            // (the file is not rewritten in place: see `of`).
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from) };
        }
    }
}

/// A writer of a patched file that lets the input's pages go as soon as it
/// has copied them out (see [`Input::release`]): the patched file holds the
/// input whole from `original` on, in order. Another writer of the same
/// input (the switched image, written at the same time) maps again what it
/// still needs, from the page cache.
pub struct ReleaseBehind<'a, W> {
    inner: W,
    input: &'a Input,
    original: u64,
    pos: u64,
    released: u64,
}

impl<'a, W> ReleaseBehind<'a, W> {
    /// `inner`, writing a patched file whose original starts at `original`.
    pub fn new(input: &'a Input, original: u64, inner: W) -> ReleaseBehind<'a, W> {
        ReleaseBehind { inner, input, original, pos: 0, released: 0 }
    }

    fn moved(&mut self, pos: u64) {
        const STEP: u64 = 8 << 20;
        self.pos = pos;
        let done = pos.saturating_sub(self.original);
        if done >= self.released + STEP {
            self.input.release(self.released as usize, done as usize);
            self.released = done;
        }
    }
}

impl<W: Write> Write for ReleaseBehind<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.moved(self.pos + n as u64);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<W: io::Seek> io::Seek for ReleaseBehind<'_, W> {
    fn seek(&mut self, to: io::SeekFrom) -> io::Result<u64> {
        let pos = self.inner.seek(to)?;
        self.moved(pos);
        Ok(pos)
    }
}

/// Opens a file for reading without blocking on a FIFO or a device (they
/// are refused: only regular files are read).
pub fn open_regular(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .with_context(|| format!("{}: cannot open", path.display()))?;
    let meta = file.metadata().with_context(|| format!("{}: cannot stat", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{}: not a regular file ({})", path.display(), file_kind(&meta));
    }
    Ok(file)
}

/// What kind of file a path names, in words.
pub fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a regular file"
    }
}

/// Frees `v` on a thread of its own: a large file's analysis is millions
/// of allocations, a fraction of a second to free, which the command need
/// not wait for (a process that exits first never frees it). If no thread
/// can start, `v` is freed here.
pub fn free_later<T: Send + 'static>(v: T) {
    let _ = std::thread::Builder::new().name("free".into()).spawn(move || drop(v));
}

/// Refuses an output path that exists and is not a regular file (a device,
/// a FIFO, a directory: renaming over it would replace it).
pub fn check_output_path(path: &Path) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        anyhow::bail!("{}: cannot create the output: {} is not a directory", path.display(), dir.display());
    }
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => {
            anyhow::bail!(
                "{}: output path is {}, not a regular file; nothing was written",
                path.display(),
                file_kind(&m)
            )
        }
        _ => Ok(()),
    }
}

/// A counters file, copied into memory.
///
/// Counters files are sparse (cells take space only once touched) and
/// usually live on tmpfs, where faulting a hole in through a mapping, even
/// to read it, allocates a page for the file: reading every page would give
/// the profiled process's counters their full size in memory. So only the
/// file's data extents (`SEEK_DATA`, `SEEK_HOLE`) are copied out of the
/// mapping, a word at a time (see [`copy_words`]); holes stay zero in a
/// buffer whose untouched pages cost nothing.
pub struct Snapshot {
    pub bytes: Vec<u8>,
}

impl Snapshot {
    pub fn read(path: &Path) -> Result<Snapshot> {
        use std::os::unix::io::AsRawFd;
        let file = open_regular(path)?;
        let input = Input::of(&file, path)?;
        let map: &[u8] = &input.map;
        let len = map.len() as u64;
        let mut bytes = vec![0u8; map.len()];
        let fd = file.as_raw_fd();
        let mut at = 0u64;
        while at < len {
            // SAFETY: lseek on our own descriptor.
            let data = unsafe { libc::lseek(fd, at as i64, libc::SEEK_DATA) };
            let (data, end) = if data < 0 {
                // ENXIO: only a hole from `at` on. Another error: the file
                // system cannot tell holes; copy the rest.
                if io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                    break;
                }
                (at, len)
            } else {
                let data = (data as u64).min(len);
                // SAFETY: as above.
                let hole = unsafe { libc::lseek(fd, data as i64, libc::SEEK_HOLE) };
                (data, if hole < 0 { len } else { (hole as u64).min(len) })
            };
            let (a, e) = (data as usize, end as usize);
            copy_words(&mut bytes[a..e], &map[a..e]);
            at = end.max(data + 1);
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        process::read_in_shared_tables(&mut bytes, |id, size| shared_table(dir, id, size));
        Ok(Snapshot { bytes })
    }
}

/// The shared site table `id` of `size` bytes in `dir`'s tables directory
/// (see `process::ModuleSlot::table_id`), if it is there and its bytes are
/// the ones its id names. A table's bytes never change (its id is their
/// hash), so each is read once per command (`serve` and `top` read the
/// same files again and again), up to a bound on what is kept.
fn shared_table(dir: &Path, id: u64, size: u64) -> Option<Vec<u8>> {
    use std::collections::HashMap;
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::Mutex;
    /// Bytes of tables kept at most (a table is about 60 bytes a site).
    const KEPT: usize = 256 << 20;
    static READ: Mutex<Option<HashMap<u64, Vec<u8>>>> = Mutex::new(None);
    if size > process::MAX_SHARED_TABLE {
        return None;
    }
    let mut read = READ.lock().unwrap_or_else(|e| e.into_inner());
    let read = read.get_or_insert_with(HashMap::new);
    if let Some(t) = read.get(&id) {
        return Some(t.clone());
    }
    let path = dir.join(process::TABLES_DIR).join(process::shared_table_name(id));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY)
        .open(&path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() != size {
        return None;
    }
    let mut t = Vec::with_capacity(size as usize);
    io::Read::read_to_end(&mut io::Read::take(file, size), &mut t).ok()?;
    if process::table_id(&t) != id {
        return None;
    }
    if read.values().map(Vec::len).sum::<usize>() + t.len() > KEPT {
        read.clear();
    }
    read.insert(id, t.clone());
    Some(t)
}

/// Copies 8-byte words with single loads: a counter changing while it is
/// copied is seen before or after the change, never torn.
fn copy_words(dst: &mut [u8], src: &[u8]) {
    use std::sync::atomic::{AtomicU64, Ordering};
    debug_assert_eq!(dst.len(), src.len());
    let words = src.len() / 8;
    let aligned = (src.as_ptr() as usize).is_multiple_of(8);
    for i in 0..words {
        let v = if aligned {
            // SAFETY: in bounds and 8-aligned; the runtime updates these
            // words with atomic instructions.
            unsafe { (*(src.as_ptr().add(i * 8) as *const AtomicU64)).load(Ordering::Relaxed) }
        } else {
            u64::from_ne_bytes(src[i * 8..i * 8 + 8].try_into().unwrap())
        };
        dst[i * 8..i * 8 + 8].copy_from_slice(&v.to_ne_bytes());
    }
    dst[words * 8..].copy_from_slice(&src[words * 8..]);
}

/// Writes command output; a closed pipe (`| head`) ends the program quietly.
pub fn emit(f: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<()> {
    let stdout = io::stdout();
    let mut lock = io::BufWriter::new(stdout.lock());
    let r = f(&mut lock).and_then(|()| lock.flush());
    match r {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => std::process::exit(0),
        r => r.context("writing output"),
    }
}

/// Prints an error as one line and maps it to exit status 2.
pub fn finish(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("{e}");
            for cause in e.chain().skip(1) {
                msg.push_str(&format!(": {cause}"));
            }
            eprintln!("alloctramp: {}", msg.replace('\n', " "));
            ExitCode::from(2)
        }
    }
}

/// Writes `<path>` atomically: a temporary file in the same directory,
/// renamed over the target once complete.
/// Creates `dir` and its missing parents, readable by this user alone.
pub fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("{}: cannot create the directory", dir.display()))
}

pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    write_atomic_with(path, mode, |w| w.write_all(data))
}

/// Like [`write_atomic`], the file given to user `owner` through its
/// descriptor before it has its name (root writing into a directory that
/// user controls: a path there is not to be trusted).
pub fn write_atomic_as(path: &Path, data: &[u8], mode: u32, owner: Option<u32>) -> Result<()> {
    let mut staged = Staged { files: Vec::new(), written: Vec::new(), owner };
    staged.add(path, mode, |w| w.write_all(data))?;
    staged.commit()
}

/// Like [`write_atomic`], with the contents produced by `fill`.
pub fn write_atomic_with(path: &Path, mode: u32, fill: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<()> {
    let mut staged = Staged::default();
    staged.add(path, mode, fill)?;
    staged.commit()
}

/// Files written under temporary names in their target directories and
/// renamed into place together, in the order they were added: either every
/// file is in place, or none of them is and no temporary file remains (a
/// target that did not exist before is removed again if a later rename
/// fails).
#[derive(Default)]
pub struct Staged {
    /// (temporary, target, whether the target existed before)
    files: Vec<(std::path::PathBuf, std::path::PathBuf, bool)>,
    /// The temporary files, written (in the order of `files`).
    written: Vec<File>,
    /// The user the files are given to (none: they stay ours).
    owner: Option<u32>,
}

impl Staged {
    pub fn add(&mut self, path: &Path, mode: u32, fill: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<()> {
        self.add_with(path, mode, |w| fill(w).map(|()| None))
    }

    /// Like [`add`](Self::add), for a writer that seeks over runs of zeros
    /// (keeping them holes on disk) and returns the file's length.
    pub fn add_sparse(
        &mut self,
        path: &Path,
        mode: u32,
        fill: impl FnOnce(&mut io::BufWriter<File>) -> io::Result<u64>,
    ) -> Result<()> {
        self.add_with(path, mode, |w| fill(w).map(Some))
    }

    fn add_with(
        &mut self,
        path: &Path,
        mode: u32,
        fill: impl FnOnce(&mut io::BufWriter<File>) -> io::Result<Option<u64>>,
    ) -> Result<()> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        check_output_path(path)?;
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = path.file_name().context("output path has no file name")?.to_string_lossy().into_owned();
        let tmp = dir.join(format!(".{name}.alloctramp-{}-{}", std::process::id(), self.files.len()));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .with_context(|| format!("{}: cannot create the output in {}", path.display(), dir.display()))?;
        self.files.push((tmp.clone(), path.to_path_buf(), std::fs::symlink_metadata(path).is_ok()));
        let mut buf = io::BufWriter::with_capacity(1 << 20, f);
        let len = fill(&mut buf).with_context(|| format!("{}: cannot write", path.display()))?;
        let f = buf
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("{}: cannot write", path.display()))?;
        if let Some(len) = len {
            // A file that ends in zeros: they were skipped, the length
            // makes them.
            f.set_len(len).with_context(|| format!("{}: cannot write", path.display()))?;
        }
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        if let Some(uid) = self.owner {
            std::os::unix::fs::fchown(&f, Some(uid), None)
                .with_context(|| format!("{}: cannot give it to uid {uid}", path.display()))?;
        }
        f.sync_all().ok();
        self.written.push(f);
        Ok(())
    }

    /// Gives the staged file `path` the modification time `time`.
    pub fn set_modified(&self, path: &Path, time: std::time::SystemTime) -> Result<()> {
        let Some((_, f)) = self.files.iter().zip(&self.written).find(|((_, target, _), _)| target == path) else {
            anyhow::bail!("{}: not staged", path.display());
        };
        f.set_modified(time).with_context(|| format!("{}: cannot set its time", path.display()))
    }

    pub fn commit(mut self) -> Result<()> {
        let files = std::mem::take(&mut self.files);
        for (i, (tmp, path, _)) in files.iter().enumerate() {
            // Checked again: the path may have changed since it was staged.
            let r = check_output_path(path).and_then(|()| {
                std::fs::rename(tmp, path).with_context(|| format!("{}: cannot rename into place", path.display()))
            });
            if let Err(e) = r {
                for (tmp, _, _) in &files[i..] {
                    let _ = std::fs::remove_file(tmp);
                }
                for (_, path, existed) in &files[..i] {
                    if !existed {
                        let _ = std::fs::remove_file(path);
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _, _) in &self.files {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sparse output that ends in zeros gets its full length (the
    /// section header table of /usr/bin/editres ended in eight zero bytes
    /// past the last 4 KiB block, and the output came out eight bytes
    /// short).
    #[test]
    fn a_sparse_output_ending_in_zeros_keeps_its_length() {
        let dir = std::env::temp_dir().join(format!("alloctramp-staged-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("out");
        let mut staged = Staged::default();
        staged
            .add_sparse(&out, 0o644, |w| {
                w.write_all(b"abc")?;
                Ok(4096 + 8)
            })
            .unwrap();
        staged.commit().unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(bytes.len(), 4104);
        assert_eq!(&bytes[..3], b"abc");
        assert!(bytes[3..].iter().all(|&b| b == 0));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("alloctramp-staged-fail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut staged = Staged::default();
        staged.add(&dir.join("first"), 0o644, |w| w.write_all(b"one")).unwrap();
        assert!(staged.add(&dir.join("second"), 0o644, |_| Err(io::Error::other("disk full"))).is_err());
        drop(staged);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "no temporary file is left");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
