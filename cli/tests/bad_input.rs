//! Bad input gets one line naming the file and what is wrong, and exit
//! status 2; never a panic.

use crate::util::*;
use std::path::Path;

fn expect_refusal(file: &Path, what: &str) {
    let out = run_alloctramp(["sites".as_ref(), file.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}: {stderr}", file.display());
    assert!(out.stdout.is_empty(), "no partial output");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains(&file.display().to_string()), "names the file: {stderr}");
    assert!(stderr.contains(what), "expected {what:?} in {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

fn patched(dir: &Path, name: &str, base: &[u8], edit: impl FnOnce(&mut Vec<u8>)) -> std::path::PathBuf {
    let mut data = base.to_vec();
    edit(&mut data);
    let p = dir.join(name);
    std::fs::write(&p, data).unwrap();
    p
}

#[test]
fn malformed_and_foreign_files_are_refused_with_one_line() {
    let dir = scratch("bad_input");
    let real = std::fs::read(built(Config::default_o2()).path("basic")).unwrap();
    let le16 = |d: &mut Vec<u8>, at: usize, v: u16| d[at..at + 2].copy_from_slice(&v.to_le_bytes());
    let le64 = |d: &mut Vec<u8>, at: usize, v: u64| d[at..at + 8].copy_from_slice(&v.to_le_bytes());
    let shoff = u64::from_le_bytes(real[40..48].try_into().unwrap()) as usize;

    expect_refusal(&patched(&dir, "empty", &[], |_| {}), "not an ELF file");
    expect_refusal(&patched(&dir, "text", b"#!/bin/sh\necho hi\n", |_| {}), "not an ELF file");
    expect_refusal(&patched(&dir, "short", &real[..40], |_| {}), "truncated ELF header");
    expect_refusal(&patched(&dir, "elf32", &real, |d| d[4] = 1), "32-bit");
    expect_refusal(&patched(&dir, "bigendian", &real, |d| d[5] = 2), "big-endian");
    expect_refusal(&patched(&dir, "arm", &real, |d| le16(d, 18, 183)), "machine 183 is not x86-64");
    expect_refusal(&patched(&dir, "core", &real, |d| le16(d, 16, 4)), "core dump");
    expect_refusal(&patched(&dir, "phoff", &real, |d| le64(d, 32, 0xffff_ffff_0000)), "program headers");
    expect_refusal(&patched(&dir, "shoff", &real, |d| le64(d, 40, 0xffff_0000)), "section headers");
    // Section 1's sh_offset pointing far past the end of the file.
    expect_refusal(
        &patched(&dir, "secoff", &real, |d| le64(d, shoff + 64 + 24, 0x7fff_0000)),
        "extends past the end of the file",
    );
    expect_refusal(&dir.join("does-not-exist"), "cannot open");
    expect_refusal(&dir, "not a regular file");

    // A relocatable object.
    let obj = dir.join("obj.o");
    let src = testbins_dir().join("basic.c");
    assert!(std::process::Command::new("gcc").arg("-c").arg(&src).arg("-o").arg(&obj).status().unwrap().success());
    expect_refusal(&obj, "relocatable object");
}

#[test]
fn truncated_binaries_never_panic() {
    let dir = scratch("truncated");
    let real = std::fs::read(built(Config::default_o2()).path("cxx_new_delete")).unwrap();
    let n = real.len();
    let mut cuts: Vec<usize> = (0..64).map(|i| i * n / 64).collect();
    cuts.extend([1, 4, 16, 63, 64, 65, 0x40 + 56, 0x200, n - 1, n - 64, n - 65]);
    let file = dir.join("cut");
    for cut in cuts {
        std::fs::write(&file, &real[..cut]).unwrap();
        let out = run_alloctramp(["sites".as_ref(), file.as_os_str()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "cut at {cut}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "cut at {cut}: {stderr}");
        assert!(!stderr.contains("panicked"), "cut at {cut}: {stderr}");
    }
}

#[test]
fn corrupted_bytes_never_panic() {
    // Deterministic byte flips over the headers and tables.
    let real = std::fs::read(built(Config::default_o2()).path("basic")).unwrap();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..3000 {
        let mut d = real.clone();
        for _ in 0..4 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let at = (seed as usize) % d.len();
            d[at] = (seed >> 32) as u8;
        }
        // In-process: any panic fails the test.
        let _ = alloctramp_patcher::analyze(&d, "fuzzed", None, &[]);
    }
}
