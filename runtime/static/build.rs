use std::path::PathBuf;

fn main() {
    // A self-contained object: no C library, no start files, every symbol
    // defined inside (the shim provides what the runtime and Rust's
    // standard library call), nothing needed at load time. The patcher
    // copies its segments into a static program and relocates it there.
    for arg in
        ["-nostartfiles", "-nodefaultlibs", "-Wl,--no-undefined", "-Wl,-z,max-page-size=4096", "-Wl,--build-id=none"]
    {
        println!("cargo:rustc-cdylib-link-arg={arg}");
    }
    // The standard library names `-lgcc_s`. The dynamic runtime's build
    // script points that name at GCC's static unwinder, and Cargo passes a
    // dependency's cdylib link arguments on to this library too; but the
    // shim defines the `_Unwind_*` functions itself. A directory searched
    // first holds a linker script of that name that adds nothing.
    let dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("no-unwinder");
    std::fs::create_dir_all(&dir).expect("creating OUT_DIR/no-unwinder");
    std::fs::write(dir.join("libgcc_s.so"), "/* The shim defines _Unwind_*: nothing from libgcc. */\n")
        .expect("writing the empty linker script");
    println!("cargo:rustc-cdylib-link-arg=-L{}", dir.display());
    println!("cargo:rerun-if-changed=build.rs");
}
