//! `alloctramp patch`: patched programs behave exactly as the originals,
//! keep every original byte at its address, pass ELF checkers, survive
//! strip and can be debugged; bad input and refusals leave nothing behind.

use crate::util::*;
use alloctramp_patcher::Elf;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Patches `input` into `out`, asserting success.
pub fn patch_to(input: &Path, out: &Path, extra: &[&str]) {
    let o = alloctramp().arg("patch").arg(input).arg("-o").arg(out).args(extra).output().unwrap();
    assert!(o.status.success(), "patch {}: {}", input.display(), String::from_utf8_lossy(&o.stderr));
}

/// The test programs of one configuration, patched into `dir/patched`.
fn patch_all(b: &Built) -> PathBuf {
    let dir = b.dir.join("patched");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for p in programs() {
        patch_to(&b.path(&p.name), &dir.join(&p.output), &[]);
    }
    dir
}

fn run_in(path: &Path, args: &[String], lib_dir: Option<&Path>) -> (String, String, i32) {
    let mut env = vec![];
    let lib = lib_dir.map(|d| d.to_string_lossy().into_owned());
    if let Some(l) = &lib {
        env.push(("LD_LIBRARY_PATH", l.as_str()));
    }
    run_program(path, args, &env)
}

fn check_config(config: Config) {
    let b = built(config);
    let dir = patch_all(&b);
    for p in programs().iter().filter(|p| !p.is_library) {
        let original = run_in(&b.path(&p.name), &p.run, None);
        // The patched program with the patched library in place of the
        // original (LD_LIBRARY_PATH comes before DT_RUNPATH).
        let patched = run_in(&dir.join(&p.output), &p.run, Some(&dir));
        assert_eq!(original.2, 0, "{} {}: {:?}", p.name, config.name(), original);
        assert_eq!(patched, original, "{} built {}: patched program behaves differently", p.name, config.name());
    }
    for p in programs() {
        assert_original_bytes_kept(&b.path(&p.name), &dir.join(&p.output));
    }
}

mod same_behaviour {
    crate::matrix!(super::check_config);
}

/// Section types of the dynamic-linking tables, which may move.
fn is_dynamic_table(sh_type: u32, name: &str) -> bool {
    use object::elf::*;
    [SHT_DYNSYM.0, SHT_GNU_VERSYM.0, SHT_GNU_HASH.0, SHT_HASH.0, SHT_RELA.0, SHT_DYNAMIC.0].contains(&sh_type)
        || name == ".dynstr"
}

/// Every allocated section of the input other than the dynamic-linking
/// tables has the same bytes at the same address in the output, read
/// through the output's program headers as the loader would.
pub fn assert_original_bytes_kept(input: &Path, output: &Path) {
    let a = std::fs::read(input).unwrap();
    let b = std::fs::read(output).unwrap();
    let ea = Elf::parse(&a).unwrap();
    let eb = Elf::parse(&b).unwrap();
    let mut compared = 0;
    for s in ea.sections.iter().filter(|s| s.is_alloc() && !s.data.is_empty()) {
        if is_dynamic_table(s.sh_type, s.name) {
            continue;
        }
        let off = eb.offset_of(s.addr).unwrap_or_else(|| panic!("{}: {} not loaded", output.display(), s.name));
        let got = &b[off.0 as usize..off.0 as usize + s.data.len()];
        assert!(got == s.data, "{}: section {} differs at {}", output.display(), s.name, s.addr);
        compared += 1;
    }
    assert!(compared >= 5, "{}: only {compared} sections compared", input.display());
    // And the moved tables say the same: same symbol names (plus the
    // imported ones: the runtime's table, dlopen, dlsym, dlerror).
    let names = |e: &Elf| e.symbols(true).iter().map(|s| s.name.to_string()).collect::<Vec<_>>();
    let mut before = names(&ea);
    before.extend(alloctramp_trampolines::layout::IMPORTS.iter().map(|i| i.name.to_string()));
    let mut after = names(&eb);
    before.sort();
    after.sort();
    assert_eq!(before, after, "{}: dynamic symbols", output.display());
}

fn readelf_stderr(file: &Path) -> String {
    let o = Command::new("readelf").arg("-lSdrsW").arg(file).output().unwrap();
    assert!(o.status.success());
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn elflint(file: &Path) -> BTreeSet<String> {
    let o = Command::new("eu-elflint").arg("--gnu-ld").arg(file).output().expect("eu-elflint (elfutils) is installed");
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    text.lines().filter(|l| !l.contains("No errors")).map(|l| l.replace(&file.display().to_string(), "")).collect()
}

#[test]
fn elf_checkers_accept_and_strip_keeps_it_running() {
    for config in [Config::default_o2(), Config { opt: "-O0", pie: false, extra: "-fcf-protection=full" }] {
        let b = built(config);
        let dir = scratch(&format!("lint-{}", config.name()));
        for p in programs() {
            let input = b.path(&p.name);
            let out = dir.join(&p.output);
            patch_to(&input, &out, &[]);
            assert_eq!(readelf_stderr(&out), "", "{}: readelf warnings", out.display());
            let before = elflint(&input);
            let after = elflint(&out);
            assert!(
                after.is_subset(&before),
                "{}: new eu-elflint complaints: {:?}",
                out.display(),
                after.difference(&before)
            );
            let stripped = dir.join(format!("{}.stripped", p.output));
            let st = Command::new("strip").arg("-o").arg(&stripped).arg(&out).output().unwrap();
            assert!(
                st.status.success() && st.stderr.is_empty(),
                "strip {}: {}",
                out.display(),
                String::from_utf8_lossy(&st.stderr)
            );
            if !p.is_library {
                let original = run_in(&input, &p.run, None);
                assert_eq!(run_in(&stripped, &p.run, None), original, "{} stripped", p.name);
            }
        }
    }
}

#[test]
fn patch_writes_the_switched_images_beside_the_output() {
    use alloctramp_trampolines::layout::Image;
    use std::os::unix::fs::MetadataExt;
    let b = built(Config::default_o2());
    let dir = scratch("image-out");
    let out = dir.join("basic");
    patch_to(&b.path("basic"), &out, &[]);
    let path = |image: Image| dir.join(image.dir()).join("basic");
    let bytes = std::fs::read(&out).unwrap();
    let file = std::fs::metadata(&out).unwrap();
    for image in Image::ALL {
        let img = std::fs::metadata(path(image)).unwrap();
        assert_eq!((img.len(), img.mtime(), img.mtime_nsec()), (file.len(), file.mtime(), file.mtime_nsec()));
        assert_eq!(img.mode() & 0o7777, file.mode() & 0o755);
        let written = std::fs::read(path(image)).unwrap();
        assert!(written == alloctramp_patcher::image::switched_image(&bytes, image).unwrap(), "{image:?}");
        assert!(written != bytes);
    }
    assert!(std::fs::read(path(Image::Live)).unwrap() != std::fs::read(path(Image::Count)).unwrap());
    // Only the images asked for: an earlier patch's other image goes.
    patch_to(&b.path("basic"), &out, &["--images", "live"]);
    assert!(path(Image::Live).exists() && !path(Image::Count).exists());
    patch_to(&b.path("basic"), &out, &["--images=count,live"]);
    assert!(path(Image::Live).exists() && path(Image::Count).exists());
    // Without any, the images left by an earlier patch go too.
    patch_to(&b.path("basic"), &out, &["--no-image"]);
    assert!(!path(Image::Live).exists() && !path(Image::Count).exists());
    assert!(std::fs::read(&out).unwrap() == bytes, "the same output");
    // An image that cannot be written (its directory's name is a file's)
    // is a warning: the output and the other image are written.
    let dir = scratch("image-blocked");
    std::fs::write(dir.join(Image::Count.dir()), b"").unwrap();
    let o = alloctramp().arg("patch").arg(b.path("basic")).arg("-o").arg(dir.join("basic")).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("switched on at start-up (count) write their sites instead"), "{err}");
    assert!(err.contains("--no-image writes none"), "{err}");
    assert_eq!(err.matches("write their sites instead").count(), 1, "{err}");
    assert!(std::fs::read(dir.join("basic")).unwrap() == bytes, "the output is written");
    assert!(dir.join(Image::Live.dir()).join("basic").is_file(), "the other image is written");
}

#[test]
fn a_file_with_room_for_itself_but_not_its_image_is_written_without_it() {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip(test_name(), "needs root, to mount a small tmpfs");
        return;
    }
    let b = built(Config::default_o2());
    let roomy = scratch("image-room-sizes");
    patch_to(&b.path("basic"), &roomy.join("basic"), &[]);
    let expected = std::fs::read(roomy.join("basic")).unwrap();
    let used = |p: &Path| std::fs::metadata(p).unwrap().blocks() * 512;
    let runtime_file = roomy.join(alloctramp_trampolines::layout::RUNTIME_SONAME);
    let (file, runtime) = (used(&roomy.join("basic")), used(&runtime_file));
    // Room for the file and the runtime beside it, and half the image.
    let dir = scratch("image-room");
    let size = (file + runtime + file / 2).next_multiple_of(4096);
    let mounted =
        Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}")]).arg("tmpfs").arg(&dir).status();
    if !mounted.is_ok_and(|s| s.success()) {
        skip(test_name(), "mount -t tmpfs refused");
        return;
    }
    let outcome = std::panic::catch_unwind(|| {
        for _ in 0..4 {
            let o = alloctramp().arg("patch").arg(b.path("basic")).arg("-o").arg(dir.join("basic")).output().unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "{err}");
            assert!(err.contains("write their sites instead"), "{err}");
            assert!(std::fs::read(dir.join("basic")).unwrap() == expected, "the file, whole");
            let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(left.len(), 2, "the file and the runtime, no image, nothing temporary: {left:?}");
            std::fs::remove_file(dir.join("basic")).unwrap();
        }
    });
    let _ = Command::new("umount").arg(&dir).status();
    if let Err(p) = outcome {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn gdb_sets_breakpoints_and_shows_source_lines() {
    let b = built(Config { opt: "-O0", pie: true, extra: "" });
    let dir = scratch("gdb");
    let out = dir.join("basic");
    patch_to(&b.path("basic"), &out, &[]);
    let line = program("basic").markers[0].line;
    let o = Command::new("gdb")
        .args(["-nx", "-batch", "-ex", &format!("break basic.c:{line}"), "-ex", "run", "-ex", "bt 1", "-ex", "list"])
        .arg(&out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("Breakpoint 1, main () at "), "{text}");
    assert!(text.contains(&format!("basic.c:{line}")), "{text}");
    assert!(text.contains("@site malloc"), "gdb lists the source: {text}");
}

fn sh(cmd: &str, dir: &Path, env: &[(&str, &str)]) -> (String, i32) {
    let o = Command::new("bash")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .envs(env.iter().copied())
        .env("GIT_AUTHOR_DATE", "2026-01-01T00:00:00Z")
        .env("GIT_COMMITTER_DATE", "2026-01-01T00:00:00Z")
        .env("HOME", dir)
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
        o.status.code().unwrap_or(-1),
    )
}

#[test]
fn installed_programs_patched_still_work() {
    let dir = scratch("installed");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let mut checked = 0;
    // Each workload runs with the original and the patched program; the
    // output must be the same.
    let workloads: &[(&str, &str)] = &[
        (
            "git",
            "rm -rf r && git init -q r && cd r && git config user.email t@e && git config user.name T && \
             for i in 1 2 3; do echo line$i >> f; git add f; git commit -qm c$i; done && git log --format='%H %s' && \
             git rev-list --count HEAD && git gc -q && git fsck 2>&1 | sort",
        ),
        (
            "bash",
            "$PROG -c 'declare -A m; for i in $(seq 1 200); do m[$i]=$((i*i)); done; echo ${#m[@]} ${m[150]}; printf \"%s\\n\" {a..e}'",
        ),
        (
            "perl",
            "$PROG -e 'my %h; $h{$_} = $_ x 3 for 1..5000; print scalar(keys %h), \" \", length(join(\"\", values %h)), \"\\n\"'",
        ),
        (
            "python3",
            "$PROG -c 'import json, zlib; d = {str(i): list(range(i)) for i in range(300)}; s = json.dumps(d); print(len(s), zlib.crc32(s.encode()))'",
        ),
    ];
    for (name, script) in workloads {
        let Ok(path) = which(name) else { continue };
        let patched = bin.join(name);
        patch_to(&path, &patched, &[]);
        let (orig, rc1) =
            if *name == "git" { sh(script, &dir, &[]) } else { sh(script, &dir, &[("PROG", path.to_str().unwrap())]) };
        let (new, rc2) = if *name == "git" {
            let p = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
            sh(script, &dir, &[("PATH", &p)])
        } else {
            sh(script, &dir, &[("PROG", patched.to_str().unwrap())])
        };
        assert_eq!((rc1, orig.clone()), (rc2, new), "{name}: patched program behaves differently");
        assert_eq!(rc1, 0, "{name}: {orig}");
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} installed programs found");

    // A shared library patched and loaded in place of the original.
    let lib_dir = dir.join("lib");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let libz = ["/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1"]
        .iter()
        .map(Path::new)
        .find(|p| p.exists());
    if let (Some(libz), Ok(py)) = (libz, which("python3")) {
        patch_to(libz, &lib_dir.join("libz.so.1"), &[]);
        let script = "$PROG -c 'import zlib; d = zlib.compress(bytes(range(256)) * 400); print(len(d), zlib.crc32(zlib.decompress(d))); print(any(\"alloctramp\" in l for l in open(\"/proc/self/maps\")))'";
        let (orig, _) = sh(script, &dir, &[("PROG", py.to_str().unwrap())]);
        let (new, rc) =
            sh(script, &dir, &[("PROG", py.to_str().unwrap()), ("LD_LIBRARY_PATH", lib_dir.to_str().unwrap())]);
        assert_eq!(rc, 0, "{new}");
        assert_eq!(orig.replace("False", ""), new.replace("True", ""), "patched libz");
        assert!(new.trim_end().ends_with("True"), "the patched libz (and the runtime) were loaded: {new}");
    }
}

fn which(name: &str) -> Result<PathBuf, ()> {
    // The system's programs, not wrapper scripts earlier in PATH.
    for dir in ["/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return std::fs::canonicalize(p).map_err(|_| ());
        }
    }
    let o = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().map_err(|_| ())?;
    if !o.status.success() {
        return Err(());
    }
    std::fs::canonicalize(String::from_utf8_lossy(&o.stdout).trim()).map_err(|_| ())
}

fn expect_refused(args: &[&std::ffi::OsStr], out: &Path, what: &str) {
    let o = alloctramp().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains(what), "expected {what:?}: {stderr}");
    assert!(!out.exists(), "no output left behind: {}", out.display());
    let images = out.parent().unwrap().join(alloctramp_trampolines::layout::IMAGE_DIR);
    let counting = out.parent().unwrap().join(alloctramp_trampolines::layout::COUNT_IMAGE_DIR);
    for dir in [&images, &counting] {
        assert!(!dir.join(out.file_name().unwrap()).exists(), "no image left behind: {}", out.display());
    }
    // Temporary files (`.NAME.alloctramp-PID-N`), beside the output and
    // among the images of the files patched before.
    let leftovers: Vec<_> = [out.parent().unwrap(), &images, &counting]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten())
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name().to_string_lossy().contains(".alloctramp-") && e.path() != images && e.path() != counting
        })
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn refusals_and_bad_input_leave_no_output() {
    let dir = scratch("refusals");
    let b = built(Config::default_o2());
    let input = b.path("basic");
    let before = std::fs::read(&input).unwrap();
    let once = dir.join("once");
    patch_to(&input, &once, &[]);
    assert_eq!(std::fs::read(&input).unwrap(), before, "the input is never modified");
    let mode = |p: &Path| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions());
    assert_eq!(mode(&once), mode(&input), "the input's mode is kept");

    let out = dir.join("twice");
    expect_refused(&["patch".as_ref(), once.as_os_str(), "-o".as_ref(), out.as_os_str()], &out, "already patched");

    // A static program carries the static runtime: a file that is not
    // one (the dynamic runtime, which needs the C library) is refused.
    let src = dir.join("static.c");
    std::fs::write(&src, "#include <stdlib.h>\nint main(void){return malloc(1)==0;}\n").unwrap();
    let stat = dir.join("static");
    assert!(Command::new("gcc").arg("-static").arg(&src).arg("-o").arg(&stat).status().unwrap().success());
    let exe_dir = Path::new(env!("CARGO_BIN_EXE_alloctramp")).parent().unwrap();
    let dynamic_runtime = [exe_dir.join("liballoctramp_rt.so"), exe_dir.join("deps/liballoctramp_rt.so")]
        .into_iter()
        .find(|p| p.is_file())
        .expect("the runtime library next to alloctramp");
    let o = alloctramp()
        .env("ALLOCTRAMP_STATIC_RUNTIME", dynamic_runtime)
        .args(["patch".as_ref(), stat.as_os_str(), "-o".as_ref(), out.as_os_str()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains("the static runtime (liballoctramp_rt_static.so): it needs other libraries"), "{stderr}");
    assert!(!out.exists(), "no output left behind");

    let text = dir.join("text");
    std::fs::write(&text, "hello").unwrap();
    expect_refused(&["patch".as_ref(), text.as_os_str(), "-o".as_ref(), out.as_os_str()], &out, "not an ELF file");

    let cut = dir.join("cut");
    std::fs::write(&cut, &before[..before.len() / 2]).unwrap();
    expect_refused(&["patch".as_ref(), cut.as_os_str(), "-o".as_ref(), out.as_os_str()], &out, "extends past the end");

    let same = dir.join("same");
    std::fs::copy(&input, &same).unwrap();
    let o = alloctramp().arg("patch").arg(&same).arg("-o").arg(&same).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("would overwrite the input"));
    assert_eq!(std::fs::read(&same).unwrap(), before);

    let bad_rt = dir.join("rt");
    std::fs::copy(&input, &bad_rt).unwrap();
    expect_refused(
        &[
            "patch".as_ref(),
            input.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
            "--runtime".as_ref(),
            bad_rt.as_os_str(),
        ],
        &out,
        "not an alloctramp runtime",
    );
}

#[test]
fn moved_together_with_the_runtime_it_still_starts() {
    let b = built(Config::default_o2());
    let dir = scratch("moved");
    let first = dir.join("a");
    std::fs::create_dir_all(&first).unwrap();
    patch_to(&b.path("basic"), &first.join("basic"), &[]);
    assert!(first.join("liballoctramp_rt.so").exists(), "the runtime is copied beside the output");
    let second = dir.join("elsewhere");
    std::fs::rename(&first, &second).unwrap();
    let expected = run_program(&b.path("basic"), &[], &[]);
    assert_eq!(run_program(&second.join("basic"), &[], &[]), expected);

    // With an absolute runtime path, no copy is needed.
    let abs = dir.join("abs");
    std::fs::create_dir_all(&abs).unwrap();
    patch_to(&b.path("basic"), &abs.join("basic"), &["--runtime-link", "absolute"]);
    assert!(!abs.join("liballoctramp_rt.so").exists());
    assert_eq!(run_program(&abs.join("basic"), &[], &[]), expected);
}

/// A patched file does not name its runtime in `DT_NEEDED`: its init stub
/// loads it with `dlopen`. Without it the program runs as the original,
/// and only the program (not each patched library) says why, on stderr,
/// and only when `ALLOCTRAMP` is set (other variables of alloctramp's, like
/// the test tiers' `ALLOCTRAMP_SLOW`, do not ask for profiling).
#[test]
fn a_program_whose_runtime_is_missing_runs_unprofiled_and_says_why_once() {
    const RUNTIME: &str = alloctramp_trampolines::layout::RUNTIME_SONAME;
    let b = built(Config::default_o2());
    let dir = scratch("no-runtime");
    let counters = dir.join("counters");
    std::fs::create_dir_all(&counters).unwrap();
    std::fs::set_permissions(&counters, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    patch_to(&b.path("uses_lib"), &dir.join("uses_lib"), &[]);
    patch_to(&b.path("libatshared"), &dir.join("libatshared.so"), &[]);
    let needed: Vec<String> = readelf_dynamic(&dir.join("uses_lib"));
    assert!(!needed.iter().any(|n| n.contains(RUNTIME)), "the runtime is not a DT_NEEDED: {needed:?}");
    let saved = dir.join("runtime-elsewhere.so");
    std::fs::rename(dir.join(RUNTIME), &saved).unwrap();

    let d = dir.to_str().unwrap();
    let c = counters.to_str().unwrap();
    let (out, err, code) = run_program(&b.path("uses_lib"), &[], &[("LD_LIBRARY_PATH", b.dir.to_str().unwrap())]);
    assert_eq!((err.as_str(), code), ("", 0));
    let off = run_program(&dir.join("uses_lib"), &[], &[("LD_LIBRARY_PATH", d), ("ALLOCTRAMP_DIR", c)]);
    assert_eq!(off, (out.clone(), String::new(), 0), "profiling off: as the original, silent");
    let on =
        run_program(&dir.join("uses_lib"), &[], &[("LD_LIBRARY_PATH", d), ("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", c)]);
    assert_eq!((on.0.as_str(), on.2), (out.as_str(), 0), "profiling asked for: the program still runs");
    let lines: Vec<&str> = on.1.lines().collect();
    assert_eq!(lines.len(), 1, "one line for the program and its patched library: {:?}", on.1);
    assert!(
        lines[0].starts_with("alloctramp: profiling unavailable: ")
            && lines[0].contains(RUNTIME)
            && lines[0].contains("cannot open shared object file"),
        "{}",
        lines[0]
    );
    assert_eq!(std::fs::read_dir(&counters).unwrap().count(), 0, "no counters file without a runtime");
    // A patched library in an unpatched program says nothing.
    let lib_only =
        run_program(&b.path("uses_lib"), &[], &[("LD_LIBRARY_PATH", d), ("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", c)]);
    assert_eq!(lib_only, (out.clone(), String::new(), 0));

    // With the runtime back, the first stub to run loads it and the
    // other finds it loaded: both modules register.
    std::fs::rename(&saved, dir.join(RUNTIME)).unwrap();
    let on =
        run_program(&dir.join("uses_lib"), &[], &[("LD_LIBRARY_PATH", d), ("ALLOCTRAMP", "on"), ("ALLOCTRAMP_DIR", c)]);
    assert_eq!(on, (out, String::new(), 0));
    let files = counters_files(&counters);
    assert_eq!(files.len(), 1, "{files:?}");
    let tables = std::fs::read_dir(counters.join("tables")).unwrap().count();
    assert_eq!(tables, 2, "the program's site table and the library's");
    let o = alloctramp().args(["report", "--format", "json"]).arg(&files[0]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut calls: BTreeMap<String, u64> = BTreeMap::new();
    for s in doc["sites"].as_array().unwrap() {
        *calls.entry(s["module"].as_str().unwrap().to_string()).or_default() += s["calls"].as_u64().unwrap();
    }
    // (The library's allocations are charged to the program's calls of its
    // wrappers: both modules registered, the program's rows count.)
    assert_eq!(calls.keys().collect::<Vec<_>>(), ["libatshared.so", "uses_lib"], "{calls:?}");
    assert!(calls["uses_lib"] > 0, "{calls:?}");
}

/// The DT_NEEDED names of a file, from `readelf -d`.
fn readelf_dynamic(file: &Path) -> Vec<String> {
    let o = Command::new("readelf").arg("-dW").arg(file).output().unwrap();
    assert!(o.status.success());
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split_once('[').map(|(_, r)| r.trim_end_matches(']').to_string()))
        .collect()
}

/// The libraries alloctramp loads into other programs (the runtime, and
/// the loader's audit library of `alloctramp run`) need the C library and
/// its loader alone: the unwinder Rust's standard library calls is linked
/// in from GCC's `libgcc_eh.a`, so a patched process does not load
/// `libgcc_s.so.1` (and run its constructor) for them, profiling off or on.
#[test]
fn the_libraries_loaded_into_programs_need_only_the_c_library() {
    let exe_dir = Path::new(env!("CARGO_BIN_EXE_alloctramp")).parent().unwrap();
    for name in ["liballoctramp_rt.so", "liballoctramp_audit.so"] {
        let lib = [exe_dir.join(name), exe_dir.join("deps").join(name)]
            .into_iter()
            .find(|p| p.is_file())
            .unwrap_or_else(|| panic!("{name} next to alloctramp"));
        let o = Command::new("readelf").arg("-dW").arg(&lib).output().unwrap();
        assert!(o.status.success(), "readelf: {}", String::from_utf8_lossy(&o.stderr));
        let needed: Vec<String> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.contains("(NEEDED)"))
            .filter_map(|l| Some(l.split_once('[')?.1.trim_end_matches(']').to_string()))
            .collect();
        assert_eq!(needed, ["libc.so.6", "ld-linux-x86-64.so.2"], "{}", lib.display());
    }
}
