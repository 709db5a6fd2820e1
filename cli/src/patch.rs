//! `alloctramp patch`: write a patched copy of an ELF file.

use crate::sites::parse_entries;
use crate::util::{Input, ReleaseBehind, Staged, check_output_path};
use alloctramp_patcher::write::{PatchOptions, patch};
use alloctramp_trampolines::layout::{self, Image};
use anyhow::{Context, Result, anyhow, bail};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// How the patched file names the runtime library.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum RuntimeLink {
    /// `$ORIGIN/liballoctramp_rt.so`, with a copy of the runtime written
    /// beside the output: the two can be moved together.
    Origin,
    /// The runtime's absolute path at patch time (works in setuid programs,
    /// where $ORIGIN is not expanded).
    Absolute,
}

/// A switched image, as `--images` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ImageArg {
    Live,
    Count,
}

impl ImageArg {
    fn image(self) -> Image {
        match self {
            ImageArg::Live => Image::Live,
            ImageArg::Count => Image::Count,
        }
    }
}

/// Write a patched copy of an ELF file: original code untouched, one
/// trampoline per allocator call site, used only while profiling is on.
///
/// Example: alloctramp patch ./server -o ./server.patched --entry xmalloc:alloc
#[derive(clap::Args)]
pub struct Args {
    /// The ELF file to patch (never modified).
    pub input: PathBuf,
    /// Output path [default: ./NAME.patched in the current directory].
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Also count calls to this function (see `alloctramp sites --help`).
    #[arg(long = "entry", value_name = "SPEC")]
    pub entries: Vec<String>,
    /// The runtime library [default: liballoctramp_rt.so next to this
    /// program, or $ALLOCTRAMP_RUNTIME].
    #[arg(long, value_name = "PATH")]
    pub runtime: Option<PathBuf>,
    /// How the patched file finds the runtime.
    #[arg(long, value_enum, default_value = "origin")]
    pub runtime_link: RuntimeLink,
    /// Do not carry the unwind rows of the libraries the file needs (call
    /// chains then end at the first frame in one of them).
    #[arg(long)]
    pub no_library_unwind: bool,
    /// The switched images to write beside the output: copies whose sites
    /// already jump to their trampolines, which processes switched on at
    /// start-up map instead of copying every code page that holds a site.
    /// `live` (DIR/.alloctramp-on/NAME) serves live tracking, `count`
    /// (DIR/.alloctramp-count/NAME) counting only (ALLOCTRAMP_LIVE=0).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "IMAGE,...", default_values = ["live", "count"])]
    pub images: Vec<ImageArg>,
    /// Write no switched image (and remove those an earlier patch wrote).
    #[arg(long, conflicts_with = "images")]
    pub no_image: bool,
    #[command(flatten)]
    pub wrappers: crate::sites::WrapperArgs,
    /// Leave the sites inside the file's own allocator entries unpatched
    /// (`run`, which patches every module: see
    /// `PatchOptions::skip_allocator_layers`).
    #[arg(skip)]
    pub skip_allocator_layers: bool,
}

/// The path of the switched image `image` of the file at `output`.
fn image_path(output: &Path, image: Image) -> Result<std::path::PathBuf> {
    let dir = output.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Ok(dir.join(image.dir()).join(output.file_name().context("output path has no file name")?))
}

/// Removes the switched image `image` of the file at `output`, if there is
/// one.
fn remove_image(output: &Path, image: Image) -> Result<()> {
    let path = image_path(output, image)?;
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_file() => {
            std::fs::remove_file(&path).with_context(|| format!("{}: cannot remove", path.display()))
        }
        _ => Ok(()),
    }
}

/// A switched image written aside, with whether its directory was made
/// for it.
struct StagedImage {
    image: Image,
    staged: Staged,
    made: bool,
}

impl StagedImage {
    /// Removes the image written aside, and the directory made for it.
    fn drop_with_dir(self, output: &Path) {
        drop(self.staged);
        if self.made
            && let Ok(path) = image_path(output, self.image)
        {
            let _ = std::fs::remove_dir(path.parent().unwrap_or(Path::new(".")));
        }
    }

    /// Renames the image into place, with the output's modification time,
    /// by which the runtime knows it belongs to the file.
    fn commit(self, output: &Path) -> Result<()> {
        let path = image_path(output, self.image)?;
        let time =
            std::fs::metadata(output).and_then(|m| m.modified()).with_context(|| format!("{}", output.display()));
        let written = time.and_then(|time| self.staged.set_modified(&path, time)).and_then(|()| self.staged.commit());
        if written.is_err() && self.made {
            let _ = std::fs::remove_dir(path.parent().unwrap_or(Path::new(".")));
        }
        written
    }
}

/// The switched image `image` of the patched file `output`, written aside
/// while the output is (each is about the output's size: a large library's
/// take a quarter of a second each), and renamed into place once the output
/// is ([`StagedImage::commit`]).
fn stage_image(
    output: &Path,
    image: Image,
    mode: u32,
    patched: &alloctramp_patcher::write::Patched,
    input: &Input,
) -> Result<StagedImage> {
    let path = image_path(output, image)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let made = match std::fs::create_dir(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(e) => return Err(e).with_context(|| format!("{}: cannot create the directory", dir.display())),
    };
    let mut staged = Staged::default();
    let original = patched.original_offset();
    let write = |w: &mut _| patched.write_image_sparse(image, &mut ReleaseBehind::new(input, original, w));
    match staged.add_sparse(&path, mode, write) {
        Ok(()) => Ok(StagedImage { image, staged, made }),
        Err(e) => {
            StagedImage { image, staged, made }.drop_with_dir(output);
            Err(e)
        }
    }
}

/// Finds the runtime library.
pub fn find_runtime(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("ALLOCTRAMP_RUNTIME") {
        return Ok(PathBuf::from(p));
    }
    find_next_to_exe(layout::RUNTIME_SONAME)
}

/// Finds the static runtime a static program carries: next to the runtime
/// library, else where the runtime library is looked for.
pub fn find_static_runtime(runtime: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ALLOCTRAMP_STATIC_RUNTIME") {
        return Ok(PathBuf::from(p));
    }
    let beside = runtime.with_file_name(layout::static_host::FILE_NAME);
    let newest = |a: PathBuf, b: PathBuf| {
        let time = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        if time(&b) > time(&a) { b } else { a }
    };
    match find_next_to_exe(layout::static_host::FILE_NAME) {
        Ok(found) => Ok(newest(beside, found)),
        Err(_) if beside.is_file() => Ok(beside),
        Err(e) => Err(e),
    }
}

fn find_next_to_exe(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the alloctramp executable")?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    // Next to the executable, where cargo builds it as a dependency of
    // this program (deps/), or an installed layout. In a cargo target
    // directory both of the first two exist and the one next to the
    // executable is only refreshed by some builds: the newest wins.
    let newest = [
        dir.join(name),
        dir.join("deps").join(name),
        dir.join("../lib/alloctramp").join(name),
        dir.join("..").join(name),
    ]
    .into_iter()
    .filter_map(|c| Some((std::fs::metadata(&c).ok().filter(|m| m.is_file())?.modified().ok()?, c)))
    .max_by_key(|(t, _)| *t);
    if let Some((_, c)) = newest {
        return Ok(c);
    }
    bail!("{name} not found next to {} (build it with `cargo build --workspace`, or pass --runtime)", exe.display())
}

/// Checks that a file is an alloctramp runtime of this version.
fn check_runtime(path: &Path) -> Result<()> {
    let input = Input::open(path)?;
    let elf = alloctramp_patcher::Elf::parse(&input.map).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    if !elf.symbols(true).iter().any(|s| s.defined && s.name == layout::RUNTIME_SYMBOL) {
        bail!("{}: not an alloctramp runtime (no {} symbol)", path.display(), layout::RUNTIME_SYMBOL);
    }
    Ok(())
}

pub fn default_output(input: &Path) -> PathBuf {
    let name = input.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    PathBuf::from(format!("{name}.patched"))
}

/// What `patch` wrote.
pub struct Summary {
    pub output: PathBuf,
    pub sites: usize,
    pub skipped: usize,
    pub unpatchable: usize,
    pub text_size: u64,
}

pub fn run(args: Args) -> Result<()> {
    let s = patch_file(&args)?;
    eprintln!(
        "alloctramp: wrote {} ({} sites patched, {} skipped, {} unpatchable references; trampolines {} bytes)",
        s.output.display(),
        s.sites,
        s.skipped,
        s.unpatchable,
        s.text_size
    );
    Ok(())
}

/// Writes the patched file (and the runtime copy beside it); sites that
/// could not be patched are reported on stderr.
pub fn patch_file(args: &Args) -> Result<Summary> {
    write_patched(args, true)
}

/// [`patch_file`], saying which `--entry` specs name nothing in the file
/// when `warn_entries` (a library `run` patches takes the program's specs,
/// which most libraries do not have).
pub fn write_patched(args: &Args, warn_entries: bool) -> Result<Summary> {
    let user = parse_entries(&args.entries)?;
    let output = args.output.clone().unwrap_or_else(|| default_output(&args.input));
    check_output_path(&output)?;
    let input = Input::open(&args.input)?;
    let in_meta = std::fs::metadata(&args.input)?;
    if let (Ok(a), Ok(b)) = (std::fs::canonicalize(&args.input), std::fs::canonicalize(&output))
        && a == b
    {
        bail!("{}: the output would overwrite the input", output.display());
    }
    let runtime = find_runtime(args.runtime.as_deref())?;
    check_runtime(&runtime)?;
    let runtime = std::fs::canonicalize(&runtime)?;

    let name = args.input.to_string_lossy();
    let debug_dir = Path::new(alloctramp_patcher::debugfile::DEFAULT_DEBUG_DIR);
    let debug_map = crate::sites::find_debug_in(&args.input, &input.map, debug_dir);
    let debug = debug_map
        .as_ref()
        .map(|(p, inp)| alloctramp_patcher::DebugFile { data: &inp.map, label: p.display().to_string() });
    // Without charging, wrappers change nothing in the patched file.
    let wrapper_opts = match args.wrappers.charge() {
        true => args.wrappers.options(&args.input, &input.map, &user)?,
        false => {
            alloctramp_patcher::wrappers::Options { plumbing: args.wrappers.plumbing.clone(), ..Default::default() }
        }
    };
    let analysis = alloctramp_patcher::analyze_with(&input.map, &name, debug, &user, &wrapper_opts)
        .with_context(|| format!("{}", args.input.display()))?;
    if warn_entries {
        crate::sites::warn_unresolved(&args.input, &analysis);
    }
    let needed = match args.runtime_link {
        RuntimeLink::Origin => format!("$ORIGIN/{}", layout::RUNTIME_SONAME),
        RuntimeLink::Absolute => runtime.to_string_lossy().into_owned(),
    };
    // Chains go on through the libraries the file needs (their rows are
    // carried in the patched file).
    let foreign_unwind = match alloctramp_patcher::elf::Elf::parse(&input.map) {
        Ok(elf) if !args.no_library_unwind => alloctramp_patcher::deps::foreign_unwind(&args.input, &elf),
        _ => Vec::new(),
    };
    // A static program carries the static runtime instead.
    let statik =
        alloctramp_patcher::elf::Elf::parse(&input.map).is_ok_and(|e| alloctramp_patcher::statics::is_static(&e));
    let static_runtime = match statik {
        true => {
            let path = find_static_runtime(&runtime)?;
            Some(std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))?)
        }
        false => None,
    };
    let opts = PatchOptions {
        runtime_path: needed,
        foreign_unwind,
        skip_allocator_layers: args.skip_allocator_layers,
        static_runtime,
        threads: 0,
    };
    // The analysis read the input whole, planning reads parts of it, and
    // writing copies it out again, page after page.
    input.release(0, input.map.len());
    let patched = patch(&input.map, &analysis, &opts).with_context(|| format!("{}", args.input.display()))?;
    input.release(0, input.map.len());

    // The runtime copy and the output are renamed into place together,
    // after both are written: a failure leaves neither. Runs of zero pages
    // in the input (a sparse file) stay holes.
    let mode = in_meta.permissions().mode() & 0o7777;
    let original = patched.original_offset();
    let stage_output = || -> Result<Staged> {
        let mut staged = Staged::default();
        if let (RuntimeLink::Origin, false) = (&args.runtime_link, statik) {
            let dir = output.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
            let copy = dir.join(layout::RUNTIME_SONAME);
            check_output_path(&copy)?;
            let same = std::fs::canonicalize(&copy).is_ok_and(|c| c == runtime)
                || std::fs::read(&copy).ok() == std::fs::read(&runtime).ok();
            if !same {
                let bytes = std::fs::read(&runtime).with_context(|| format!("{}: cannot read", runtime.display()))?;
                staged.add(&copy, 0o755, |w| w.write_all(&bytes))?;
            }
        }
        staged.add_sparse(&output, mode, |w| patched.write_sparse(&mut ReleaseBehind::new(&input, original, w)))?;
        Ok(staged)
    };
    // The images are written on a thread of their own meanwhile, one after
    // the other.
    let wanted: Vec<Image> = if args.no_image {
        vec![]
    } else {
        patched.images().filter(|i| args.images.iter().any(|a| a.image() == *i)).collect()
    };
    let (written, images) = std::thread::scope(|scope| {
        let images = (!wanted.is_empty()).then(|| {
            scope.spawn(|| {
                wanted.iter().map(|&i| (i, stage_image(&output, i, mode & 0o755, &patched, &input))).collect::<Vec<_>>()
            })
        });
        let written = stage_output();
        let images = images.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        (written, images.unwrap_or_default())
    });
    let drop_all = |images: Vec<(Image, Result<StagedImage>)>| {
        for (_, staged) in images {
            if let Ok(staged) = staged {
                staged.drop_with_dir(&output);
            }
        }
    };
    let (staged, images) = match written {
        Ok(staged) => (staged, images),
        // The file and its images may not all fit where they go: the file
        // alone, as when the images are what does not fit.
        Err(e) if !images.is_empty() => {
            let kinds: Vec<Image> = images.iter().map(|(i, _)| *i).collect();
            drop_all(images);
            let staged = stage_output()?;
            let why = |i: Image| {
                anyhow!("{}: no room for its switched image ({}) beside it ({e:#})", output.display(), i.name())
            };
            (staged, kinds.into_iter().map(|i| (i, Err(why(i)))).collect())
        }
        Err(e) => return Err(e),
    };
    if let Err(e) = staged.commit() {
        drop_all(images);
        return Err(e);
    }
    // An image not written (not asked, none to write, or one that cannot be
    // written) that an earlier patch wrote goes: the runtime would not use
    // it (its time is not the new file's), and it takes the space of the
    // file. The output is in place by now: what cannot be done is said.
    let mut images = images;
    for image in Image::ALL {
        match images.iter().position(|(i, _)| *i == image).map(|at| images.swap_remove(at).1) {
            None => {
                if let Err(e) = remove_image(&output, image) {
                    eprintln!("alloctramp: {e:#} (an earlier patch's switched image, which no process will use)");
                }
            }
            Some(staged) => {
                if let Err(e) = staged.and_then(|s| s.commit(&output)) {
                    let _ = remove_image(&output, image);
                    eprintln!(
                        "alloctramp: {e:#}; processes switched on at start-up ({}) write their sites instead \
                         (--no-image writes none)",
                        image.name()
                    );
                }
            }
        }
    }
    for s in patched.skipped.iter().filter(|s| s.reason.is_loss()) {
        let site = &analysis.scan.sites[s.site];
        eprintln!("alloctramp: {}: site {} not patched: {}", args.input.display(), site.vaddr, s.reason);
    }
    let summary = Summary {
        output,
        sites: patched.sites,
        skipped: patched.skipped.iter().filter(|s| s.reason.is_loss()).count(),
        unpatchable: analysis.scan.unpatchable.len(),
        text_size: patched.text_size as u64,
    };
    crate::util::free_later(analysis);
    Ok(summary)
}
