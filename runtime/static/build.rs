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
}
