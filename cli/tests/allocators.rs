//! Allocators other than malloc: programs calling jemalloc's, mimalloc's
//! and tcmalloc's own APIs directly (testbins/apis/, built here) are
//! profiled with no option, with exact calls, bytes and live figures at
//! every marked site.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, only_counters_file, report};
use crate::util::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::Command;

/// (line, entry) -> (calls, bytes, live objects and bytes; None for frees).
type Rows = BTreeMap<(u32, String), (u64, u64, Option<(u64, u64)>)>;

fn marks(rel: &str) -> Rows {
    site_marks(rel).into_iter().map(|m| ((m.line, m.entry), (m.calls, m.bytes, m.live))).collect()
}

fn rows(doc: &Value, file: &str) -> Rows {
    let mut m = Rows::new();
    for s in doc["sites"].as_array().unwrap() {
        if !s["file"].as_str().is_some_and(|f| f.ends_with(file)) {
            continue;
        }
        let n = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k} of {s}"));
        let key = (n("line") as u32, s["entry"].as_str().unwrap().to_string());
        let row = if s["kind"] == "free" {
            (n("calls"), 0, None)
        } else {
            (n("calls"), n("bytes"), Some((n("live_calls"), n("live_bytes"))))
        };
        assert!(m.insert(key, row).is_none(), "one row per line: {s}");
    }
    m
}

/// Builds testbins/apis/SRC (which links `library`, from the Debian
/// `package`), patches it with no option and checks that it prints what
/// it printed before, off and on, and that on, every marked site counts
/// exactly what its marker says.
fn exact_without_options(src: &str, library: &str, package: &str) {
    ensure_library(library, package);
    exact(src, &[]);
}

/// [`exact_without_options`] for a program that links nothing more,
/// patched with `options`.
fn exact(src: &str, options: &[&str]) {
    let rel = format!("apis/{src}");
    let dir = scratch(&format!("apis-{src}"));
    let counters = counters_dir(&format!("apis-{src}"));
    let bin = build_source(&rel, &dir);
    let patched = dir.join("patched");
    patch_to(&bin, &patched, options);
    let plain = Command::new(&bin).output().unwrap();
    assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
    for on in [false, true] {
        let mut c = Command::new(&patched);
        c.env("ALLOCTRAMP_DIR", &counters);
        if on {
            c.env("ALLOCTRAMP", "on");
        }
        let o = c.output().unwrap();
        assert_eq!(o.status.code(), Some(0), "on {on}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, plain.stdout, "on {on}: the same output");
        assert_eq!(String::from_utf8_lossy(&o.stderr), "", "on {on}: nothing on stderr");
    }
    let file = only_counters_file(&counters);
    let doc = report(file.to_str().unwrap(), &counters);
    assert_eq!(rows(&doc, &rel), marks(&rel), "{src}: (line, entry) -> (calls, bytes, live)");
}

#[test]
fn jemalloc_api_calls_count_exactly_with_no_option() {
    exact_without_options("jemalloc_api.c", "libjemalloc.so", "libjemalloc-dev");
}

#[test]
fn mimalloc_api_calls_count_exactly_with_no_option() {
    exact_without_options("mimalloc_api.c", "libmimalloc.so", "libmimalloc-dev");
}

#[test]
fn tcmalloc_api_calls_count_exactly_with_no_option() {
    exact_without_options("tcmalloc_api.cpp", "libtcmalloc.so", "libgoogle-perftools-dev");
}

/// A pool allocator the user names whose objects start 4 past an
/// 8-aligned address: a free of one must not take the empty entry of its
/// granule, or a freed record at the granule's start, for its record
/// (which would leave it live and charge a site made up of its address
/// bits).
#[test]
fn a_user_named_pool_of_4_aligned_objects_has_exact_live_figures() {
    exact("pool4.c", &["--entry", "pool_alloc:alloc", "--entry", "pool_free:free"]);
}
