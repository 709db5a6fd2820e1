//! `alloctramp demo`: build the bundled example program, patch it, run it,
//! switch profiling on while it runs, and show the report, one sentence per
//! step.

use crate::control::{self, SwitchArgs};
use crate::patch::{self, RuntimeLink};
use crate::report::{self, Source, View};
use alloctramp_report::model::SortKey;
use alloctramp_trampolines::process::Request;
use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The example program (also one of the test programs).
pub const DEMO_C: &str = include_str!("../../testbins/demo.c");

/// Requests the example handles before and after profiling is switched on.
const REQUESTS: u32 = 100;

/// Build, patch, run and profile a bundled example program, explaining
/// each step.
#[derive(clap::Args)]
#[command(after_help = "Example:\n  cargo run --release -- demo\n\n\
Needs a C compiler (cc, gcc or clang; or $CC). Everything happens in a temporary directory, removed at the end.")]
pub struct Args {
    /// Keep the temporary directory (the example, its patched copy and its
    /// counters file) and say where it is.
    #[arg(long)]
    pub keep: bool,
}

fn compiler() -> Option<String> {
    if let Some(cc) = std::env::var_os("CC").filter(|c| !c.is_empty()) {
        return Some(cc.to_string_lossy().into_owned());
    }
    ["cc", "gcc", "clang"].into_iter().map(str::to_string).find(|c| crate::run::find_program(&c.into()).is_ok())
}

struct Example {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Example {
    fn ask(&mut self, line: &str) -> Result<String> {
        writeln!(self.child.stdin.as_mut().unwrap(), "{line}").context("writing to the example program")?;
        let mut reply = String::new();
        self.out.read_line(&mut reply).context("reading from the example program")?;
        if reply.is_empty() {
            bail!("the example program ended unexpectedly");
        }
        Ok(reply.trim().to_string())
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(args: Args) -> Result<()> {
    let Some(cc) = compiler() else {
        bail!("the demo needs a C compiler to build its example program: install cc, gcc or clang (or set CC)");
    };
    let tmp = std::env::temp_dir().join(format!("alloctramp-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::DirBuilder::new().mode(0o700).create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    let result = steps(&cc, &tmp);
    if args.keep {
        println!("\nThe example, its patched copy and its counters file are in {}.", tmp.display());
    } else {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn say(text: &str) {
    println!("{text}");
    let _ = std::io::stdout().flush();
}

fn steps(cc: &str, tmp: &Path) -> Result<()> {
    say("alloctramp demo: allocation profiling per call site of a running program, without recompiling it.\n");

    // 1. Build.
    let src = tmp.join("demo.c");
    let bin = tmp.join("demo");
    std::fs::write(&src, DEMO_C)?;
    say(&format!(
        "1. Building the example, a request handler with a cache and a small leak: {cc} -g -O2 demo.c -o demo"
    ));
    let out = Command::new(cc)
        .current_dir(tmp)
        .args(["-g", "-O2", "demo.c", "-o", "demo"])
        .output()
        .with_context(|| format!("running {cc}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!("{cc} could not build the example: {}", err.lines().find(|l| l.contains("error")).unwrap_or(err.trim()));
    }

    // 2. Patch.
    let patched = tmp.join("demo.patched");
    let s = patch::patch_file(&patch::Args {
        wrappers: Default::default(),
        input: bin.clone(),
        output: Some(patched.clone()),
        entries: vec![],
        runtime: None,
        runtime_link: RuntimeLink::Origin,
        no_library_unwind: false,
        images: vec![patch::ImageArg::Live, patch::ImageArg::Count],
        no_image: false,
        skip_allocator_layers: false,
    })?;
    say(&format!(
        "2. Patching a copy: each of its {} allocator call sites gets a trampoline; its own code stays byte for byte \
         as it was: alloctramp patch demo -o demo.patched",
        s.sites
    ));

    // 3. Run with profiling off.
    let counters = tmp.join("counters");
    std::fs::DirBuilder::new().mode(0o700).create(&counters)?;
    let child = Command::new(&patched)
        .env("ALLOCTRAMP_DIR", &counters)
        .env_remove("ALLOCTRAMP")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("{}: cannot run", patched.display()))?;
    let mut child = child;
    let pid = child.id();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut ex = Example { child, out };
    // The runtime creates the counters file before main runs (10 ms after
    // the start, if the example starts with profiling off).
    let file = counters.join(alloctramp_trampolines::process::counters_file_name(pid));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !file.exists() {
        if Instant::now() > deadline {
            bail!("the patched example did not start its profiling runtime (no {})", file.display());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let r = ex.ask(&format!("serve {REQUESTS}"))?;
    say(&format!(
        "3. Running it (pid {pid}) with profiling off: it runs its original instructions, at full speed; it {r} requests."
    ));

    // 4. Switch on.
    let sw = SwitchArgs { pid, dir: Some(counters.clone()), timeout: 10.0 };
    let msg = control::switch(&sw, Request::On)?;
    say(&format!(
        "4. Switching profiling on in the running process, with no restart: alloctramp enable {pid}\n   {msg}"
    ));

    // 5. More work, counted.
    let r = ex.ask(&format!("serve {REQUESTS}"))?;
    say(&format!("5. It {r} more requests, now counted at every allocation and free."));

    // 6. Report.
    let src = Source::open(&pid.to_string(), &counters)?;
    let mut figs = src.figures()?;
    let view = View { sort: Some(SortKey::LiveBytes), ..View::default() };
    let rows = report::rows(&mut figs, &view)?;
    if figs.live() {
        say(&format!(
            "6. The report, read from shared memory while the program runs: bytes and objects still allocated per \
             call site, largest first (alloctramp report {pid} --sort live-bytes):\n"
        ));
    } else {
        say(&format!(
            "6. The report, read from shared memory while the program runs (alloctramp report {pid} --sort \
             live-bytes). This runtime counts without live tracking, so the columns are bytes and calls since \
             profiling was switched on:\n"
        ));
    }
    let mut buf = Vec::new();
    report::write_report(&mut buf, &src, &figs, &rows, &view)?;
    std::io::stdout().write_all(&buf)?;
    if let Some(top) = rows.first() {
        let f = &top.fig;
        let func = top.site.function.unwrap_or("?");
        let loc = top.site.location();
        let loc = loc.rsplit('/').next().unwrap_or(&loc);
        if figs.live() {
            say(&format!(
                "\nThe top row is the leak: {} bytes in {} objects allocated in {func} ({loc}) and never freed; the \
                 request buffers, far more bytes in total, were all freed (see --all-columns).",
                f.size(),
                f.count()
            ));
        } else {
            say(&format!(
                "\nThe top row: {func} ({loc}) requested {} bytes in {} calls while profiling was on.",
                f.size(),
                f.count()
            ));
        }
    }
    let _ = ex.ask("quit");
    let _ = ex.child.wait();
    say("\nOn your own program: alloctramp run --on -- PROGRAM ARGS... (or alloctramp patch, then enable/report).");
    Ok(())
}
