//! Outputs in the formats other tools read, checked against those tools'
//! expectations: the kernel's newer `/proc/allocinfo` layout.

use crate::patch::patch_to;
use crate::runtime::{counters_dir, only_counters_file};
use crate::util::*;

/// The kernel's newer layout behind an option: `allocinfo - version:
/// 2.0`, and `accurate:no` on every row when live tracking was off.
#[test]
fn allocinfo_version_2() {
    let b = built(Config::default_o2());
    let dir = scratch("export-allocinfo2");
    let bin = dir.join("basic");
    patch_to(&b.path("basic"), &bin, &[OWN]);
    for (live, accurate) in [("1", ""), ("0", " accurate:no")] {
        let counters = counters_dir(&format!("export-allocinfo2-{live}"));
        let env = [("ALLOCTRAMP", "on"), ("ALLOCTRAMP_LIVE", live), ("ALLOCTRAMP_DIR", counters.to_str().unwrap())];
        assert_eq!(run_program(&bin, &[], &env).2, 0);
        let file = only_counters_file(&counters);
        let v1 = alloctramp().args(["report", "-q"]).arg(&file).output().unwrap();
        let v2 = alloctramp().args(["report", "-q", "--allocinfo-version", "2"]).arg(&file).output().unwrap();
        assert!(v2.status.success());
        let (v1, v2) = (String::from_utf8_lossy(&v1.stdout), String::from_utf8_lossy(&v2.stdout));
        assert!(v2.starts_with("allocinfo - version: 2.0\n#     <size>  <calls> <tag info>\n"), "{v2}");
        let rows1: Vec<&str> = v1.lines().skip(2).collect();
        let rows2: Vec<String> = v2.lines().skip(2).map(str::to_string).collect();
        assert_eq!(rows2.len(), rows1.len());
        assert!(!rows1.is_empty());
        for (r1, r2) in rows1.iter().zip(&rows2) {
            assert_eq!(*r2, format!("{r1}{accurate}"), "live={live}");
        }
    }
}
