fn main() {
    // The runtime installs signal handlers, fork handlers and a thread-exit
    // destructor, and counters outlive the modules that count into them:
    // it must stay loaded even when the last patched library that pulled it
    // in is unloaded.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    static_unwinder();
}

include!("../build-support/static_unwinder.rs");
