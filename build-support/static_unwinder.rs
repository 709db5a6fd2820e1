// Included by the build scripts of the libraries alloctramp loads into
// other programs (`runtime/build.rs`, `audit/build.rs`).

use std::path::PathBuf;

/// Links the unwinder that Rust's standard library calls (`_Unwind_*`)
/// into the library from GCC's static `libgcc_eh.a`, so that a process
/// loading it does not also load `libgcc_s.so.1`: a second library to map
/// and relocate, whose constructor runs CPUID a few dozen times (tens of
/// microseconds in a virtual machine, where each traps), in every patched
/// process, profiling off or on.
///
/// The standard library names `-lgcc_s` itself. A directory given with
/// `-L` holds a linker script of that name that names the static archive
/// instead; the linker searches `-L` directories before its own. The
/// unwinder's symbols stay local to the library. (The argument is for
/// cdylibs only; Cargo passes it on to the static runtime too, which
/// links the runtime's crate and brings its own `_Unwind_*`: its build
/// script points the name at nothing first.)
fn static_unwinder() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../build-support/static_unwinder.rs");
    // `cc` is the compiler driver rustc links with on this target.
    let archive = std::process::Command::new("cc")
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .filter(|a| a.is_absolute() && a.is_file() && !a.to_string_lossy().contains('"'));
    let Some(archive) = archive else {
        // No static unwinder here: the library needs libgcc_s as before.
        println!("cargo:warning=libgcc_eh.a not found (cc -print-file-name): the library will load libgcc_s.so.1");
        return;
    };
    // A compiler upgrade moves the archive: the script is written again.
    println!("cargo:rerun-if-changed={}", archive.display());
    let dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("unwinder");
    std::fs::create_dir_all(&dir).expect("creating OUT_DIR/unwinder");
    std::fs::write(dir.join("libgcc_s.so"), format!("INPUT(\"{}\")\n", archive.display()))
        .expect("writing the unwinder's linker script");
    println!("cargo:rustc-cdylib-link-arg=-L{}", dir.display());
}
