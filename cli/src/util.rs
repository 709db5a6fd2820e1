//! Shared pieces of the command line: mapping input files, one-line errors,
//! and output that tolerates a closed pipe.

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
        let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let meta = file.metadata().with_context(|| format!("{}: cannot stat", path.display()))?;
        if !meta.is_file() {
            anyhow::bail!("{}: not a regular file", path.display());
        }
        // SAFETY: the mapping is read-only and private. A file truncated by
        // another process while mapped would raise SIGBUS; inputs are
        // programs and libraries that are not rewritten in place.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("{}: cannot map", path.display()))?;
        Ok(Input { map })
    }
}

impl Input {
    /// Like [`Input::open`], with every page mapped at once (a counters
    /// file is read whole; one fault per page would cost more).
    pub fn open_populated(path: &Path) -> Result<Input> {
        let file = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let meta = file.metadata().with_context(|| format!("{}: cannot stat", path.display()))?;
        if !meta.is_file() {
            anyhow::bail!("{}: not a regular file", path.display());
        }
        // SAFETY: as in `open`; counters files only grow.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }
            .with_context(|| format!("{}: cannot map", path.display()))?;
        Ok(Input { map })
    }
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
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<()> {
    write_atomic_with(path, mode, |w| w.write_all(data))
}

/// Like [`write_atomic`], with the contents produced by `fill`.
pub fn write_atomic_with(path: &Path, mode: u32, fill: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().context("output path has no file name")?.to_string_lossy().into_owned();
    let tmp = dir.join(format!(".{name}.alloctramp-{}", std::process::id()));
    let res = (|| -> Result<()> {
        let f = File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
        let mut buf = io::BufWriter::with_capacity(1 << 20, f);
        fill(&mut buf).with_context(|| format!("{}: cannot write", tmp.display()))?;
        let f =
            buf.into_inner().map_err(|e| e.into_error()).with_context(|| format!("{}: cannot write", tmp.display()))?;
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        f.sync_all().ok();
        std::fs::rename(&tmp, path).with_context(|| format!("{}: cannot rename into place", path.display()))?;
        Ok(())
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}
