//! Golden files: outputs compared byte for byte with files in a directory,
//! under one update switch for the whole workspace. With
//! `ALLOCTRAMP_BLESS=1` a test writes what it produced instead of failing,
//! and deletes the directory's files that no test produces (orphans);
//! without it, a difference fails with a unified diff and the command that
//! accepts it, and an orphan fails naming the file.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Whether golden files are being rewritten (`ALLOCTRAMP_BLESS=1`).
pub fn blessing() -> bool {
    std::env::var_os("ALLOCTRAMP_BLESS").is_some_and(|v| v == "1")
}

/// A directory of golden files.
pub struct Goldens {
    dir: PathBuf,
    /// Where paths in messages start from (the workspace).
    root: PathBuf,
    /// The command that accepts new outputs.
    bless: String,
}

impl Goldens {
    /// `dir`: the golden files; `root`: paths in messages are shown from
    /// there; `bless`: the command that rewrites them.
    pub fn new(dir: impl Into<PathBuf>, root: impl Into<PathBuf>, bless: &str) -> Goldens {
        Goldens { dir: dir.into(), root: root.into(), bless: bless.to_string() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn shown(&self, p: &Path) -> String {
        p.strip_prefix(&self.root).unwrap_or(p).display().to_string()
    }

    /// Compares (or, blessing, writes) one golden file.
    pub fn check(&self, name: &str, actual: &str) -> Result<(), String> {
        let path = self.dir.join(name);
        let expected = std::fs::read_to_string(&path).ok();
        if expected.as_deref() == Some(actual) {
            return Ok(());
        }
        if blessing() {
            std::fs::create_dir_all(path.parent().unwrap_or(&self.dir)).map_err(|e| e.to_string())?;
            std::fs::write(&path, actual).map_err(|e| e.to_string())?;
            eprintln!("blessed {}", self.shown(&path));
            return Ok(());
        }
        match expected {
            None => Err(format!(
                "golden file {} does not exist (the output would be {} lines)",
                self.shown(&path),
                actual.lines().count()
            )),
            Some(expected) => Err(format!(
                "golden file {} differs from the output:\n--- {0} (golden)\n+++ output\n{}",
                self.shown(&path),
                unified_diff(&expected, actual, 3)
            )),
        }
    }

    /// Checks every (name, output) and fails with every difference at once.
    pub fn check_all<'a>(&self, outputs: impl IntoIterator<Item = (&'a str, String)>) {
        let mut failures = Vec::new();
        let mut checked = 0;
        for (name, actual) in outputs {
            checked += 1;
            if let Err(e) = self.check(name, &actual) {
                failures.push(e);
            }
        }
        assert!(checked > 0, "no golden file was checked");
        assert!(failures.is_empty(), "{}\nTo accept the new output: {}", failures.join("\n"), self.bless);
    }

    /// Fails on files of the directory that `listed` (paths relative to it)
    /// does not name; blessing, deletes them.
    pub fn no_orphans<'a>(&self, listed: impl IntoIterator<Item = &'a str>) {
        let listed: BTreeSet<&str> = listed.into_iter().collect();
        let mut orphans = Vec::new();
        walk(&self.dir, &mut |p| {
            let name = p.strip_prefix(&self.dir).unwrap_or(p).to_string_lossy().into_owned();
            if !listed.contains(name.as_str()) {
                orphans.push(p.to_path_buf());
            }
        });
        if blessing() {
            for p in &orphans {
                std::fs::remove_file(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                eprintln!("removed orphan golden file {}", self.shown(p));
            }
            remove_empty_dirs(&self.dir);
            return;
        }
        let names: Vec<String> = orphans.iter().map(|p| self.shown(p)).collect();
        assert!(
            orphans.is_empty(),
            "golden files that no test produces (orphans):\n  {}\ndelete them, or run: {}",
            names.join("\n  "),
            self.bless
        );
    }
}

/// Line differences as unified-diff hunks with `context` lines around each
/// change (a longest common subsequence: the files are small).
pub fn unified_diff(a: &str, b: &str, context: usize) -> String {
    let a: Vec<&str> = a.lines().collect();
    let b: Vec<&str> = b.lines().collect();
    // lcs[i][j]: the longest common subsequence of a[i..] and b[j..].
    let mut lcs = vec![vec![0u32; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    // The edit script: (' ' | '-' | '+', line in a, line in b).
    let mut ops = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            ops.push((' ', i, j));
            i += 1;
            j += 1;
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            ops.push(('-', i, j));
            i += 1;
        } else {
            ops.push(('+', i, j));
            j += 1;
        }
    }
    let changed: Vec<usize> = (0..ops.len()).filter(|&k| ops[k].0 != ' ').collect();
    let mut out = String::new();
    let mut k = 0;
    while k < changed.len() {
        // A hunk: changes closer than twice the context, with context.
        let start = changed[k].saturating_sub(context);
        let mut end = changed[k];
        while k < changed.len() && changed[k] <= end + 2 * context {
            end = changed[k];
            k += 1;
        }
        let end = (end + context + 1).min(ops.len());
        let hunk = &ops[start..end];
        let (a0, b0) = (hunk[0].1, hunk[0].2);
        let a_len = hunk.iter().filter(|o| o.0 != '+').count();
        let b_len = hunk.iter().filter(|o| o.0 != '-').count();
        writeln!(out, "@@ -{},{a_len} +{},{b_len} @@", a0 + 1, b0 + 1).unwrap();
        for &(op, i, j) in hunk {
            let line = if op == '+' { b[j] } else { a[i] };
            writeln!(out, "{op}{line}").unwrap();
        }
    }
    out
}

fn walk(dir: &Path, f: &mut dyn FnMut(&Path)) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries {
        let p = e.map(|e| e.path()).unwrap_or_default();
        if p.is_dir() {
            walk(&p, f);
        } else {
            f(&p);
        }
    }
}

fn remove_empty_dirs(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries {
        let p = e.map(|e| e.path()).unwrap_or_default();
        if p.is_dir() {
            remove_empty_dirs(&p);
            let _ = std::fs::remove_dir(&p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_diff_shows_changes_with_context() {
        let a = "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n11\n12\n";
        let b = "1\n2\n3\n4\nfive\n6\n7\n8\n9\n10\n11\n12\n13\n";
        assert_eq!(
            unified_diff(a, b, 2),
            "@@ -3,5 +3,5 @@\n 3\n 4\n-5\n+five\n 6\n 7\n@@ -11,2 +11,3 @@\n 11\n 12\n+13\n"
        );
        assert_eq!(unified_diff("x\n", "", 3), "@@ -1,1 +1,0 @@\n-x\n");
        assert_eq!(unified_diff(a, a, 3), "");
    }
}
