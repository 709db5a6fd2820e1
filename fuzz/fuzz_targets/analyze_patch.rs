//! Any bytes through site and wrapper discovery, charging to wrappers' callers and the patched-file writer: an error
//! or a patched file, never a panic; a patched file is itself an ELF file
//! that analyzes and is refused as already patched.
#![no_main]

use alloctramp_patcher::write::{PatchOptions, patch};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// The static runtime a static input carries, when `ALLOCTRAMP_STATIC_RUNTIME`
/// names one (static inputs are refused without it).
fn static_runtime() -> Option<Vec<u8>> {
    static RT: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    RT.get_or_init(|| std::env::var_os("ALLOCTRAMP_STATIC_RUNTIME").and_then(|p| std::fs::read(p).ok())).clone()
}

fn pool() -> &'static [alloctramp_trampolines::entry::EntryPoint] {
    static POOL: OnceLock<Vec<alloctramp_trampolines::entry::EntryPoint>> = OnceLock::new();
    POOL.get_or_init(|| {
        ["pool_alloc:alloc", "pool_free:free"]
            .iter()
            .map(|s| alloctramp_trampolines::entry::parse_spec(s).expect("an entry spec"))
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    // The wrapper search too: it reads every function's code; and entry
    // hooks, of a pool the user would name (testbins/apis/ptrpool.c).
    let search =
        alloctramp_patcher::wrappers::Options { search: true, charge: true, entry_hooks: true, ..Default::default() };
    let Ok(analysis) = alloctramp_patcher::analyze_with(data, "fuzz", None, pool(), &search) else { return };
    let opts = PatchOptions {
        runtime_path: "liballoctramp_rt.so".into(),
        foreign_unwind: Vec::new(),
        skip_allocator_layers: false,
        static_runtime: static_runtime(),
        threads: 0,
    };
    let Ok(patched) = patch(data, &analysis, &opts) else { return };
    let mut out = Vec::new();
    patched.write_to(&mut out).expect("writing to memory");
    // Trampolines made on several threads give the same file.
    let threads = PatchOptions { threads: 3, ..opts.clone() };
    let mut other = Vec::new();
    patch(data, &analysis, &threads).expect("patches on 3 threads").write_to(&mut other).expect("writing to memory");
    assert!(out == other, "3 threads give another file");
    // The switched images, written with the file or read from it.
    for image in patched.images() {
        let bytes = alloctramp_patcher::image::switched_image(&out, image).expect("a patched file has its images");
        assert!(patched.image_to_vec(image) == bytes, "the image written differs from the one read");
    }
    let again = alloctramp_patcher::analyze(&out, "fuzz.patched", None, &[]).expect("a patched file analyzes");
    assert!(patch(&out, &again, &opts).is_err(), "a patched file is refused");
});
