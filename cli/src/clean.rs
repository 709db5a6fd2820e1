//! `alloctramp clean`: remove the files of processes that have ended.

use crate::control::{counters_dir, file_process_running, process_exists};
use crate::util::Snapshot;
use alloctramp_trampolines::process::{self, FileState, ProcessFile, flags};
use anyhow::{Result, anyhow};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Remove the counters files of processes that have ended (or replaced
/// their program), keeping the newest few if asked. Files of running
/// processes always stay.
///
/// Example: alloctramp clean --keep 10
#[derive(clap::Args)]
pub struct Args {
    /// Where process counters files are [default: $ALLOCTRAMP_DIR, else
    /// $XDG_RUNTIME_DIR/alloctramp, else /tmp/alloctramp-UID].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Keep the files of this many ended processes that profiled (the most
    /// recently written).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub keep: usize,
    /// Say what would be removed, remove nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// One file in the directory.
struct Found {
    path: PathBuf,
    bytes: u64,
    state: FileState,
    /// The site tables the file names.
    tables: Vec<u64>,
}

fn examine(path: &Path, pid: u32) -> Option<Found> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    let mtime = meta.mtime() * 1_000_000_000 + meta.mtime_nsec();
    let read = Snapshot::read(path).ok();
    let tables = read.as_ref().map_or(Vec::new(), |s| process::table_ids(&s.bytes));
    let state = match read.as_ref().and_then(|s| {
        ProcessFile::parse(&s.bytes).ok().map(|pf| {
            let running = file_process_running(&pf);
            let profiled = pf.flags & flags::PROFILED != 0;
            FileState {
                running,
                profiled,
                empty: profiled && !running && !pf.exited && process::counted_nothing(&s.bytes),
                mtime,
            }
        })
    }) {
        Some(s) => s,
        // Damaged, or written by another version: its process decides.
        None => FileState { running: process_exists(pid), profiled: true, empty: false, mtime },
    };
    Some(Found { path: path.to_path_buf(), bytes: meta.blocks() * 512, state, tables })
}

pub fn run(args: Args) -> Result<()> {
    let dir = counters_dir(args.dir.as_deref());
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("alloctramp: nothing to clean ({} does not exist)", dir.display());
            return Ok(());
        }
        Err(e) => return Err(anyhow!("{}: {e}", dir.display())),
    };
    let mut found = Vec::new();
    let mut strays = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((pid, kind)) = name.to_str().and_then(|n| n.split_once('.')) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        match kind {
            "counters" => found.extend(examine(&e.path(), pid)),
            "counters.new" | "control" | "unwind" | "fail" | "trace" | "tracesites" if !process_exists(pid) => {
                strays.push(e.path())
            }
            _ => {}
        }
    }
    let states: Vec<FileState> = found.iter().map(|f| f.state).collect();
    let remove = process::files_to_remove(&states, args.keep);
    let (mut n, mut bytes) = (0usize, 0u64);
    for (f, _) in found.iter().zip(&remove).filter(|(_, r)| **r) {
        if !args.dry_run {
            std::fs::remove_file(&f.path).map_err(|e| anyhow!("{}: cannot remove: {e}", f.path.display()))?;
            let _ = std::fs::remove_file(f.path.with_extension("control"));
            let _ = std::fs::remove_file(f.path.with_extension("unwind"));
            let _ = std::fs::remove_file(f.path.with_extension("fail"));
            let _ = std::fs::remove_file(f.path.with_extension("trace"));
            let _ = std::fs::remove_file(f.path.with_extension("tracesites"));
        }
        n += 1;
        bytes += f.bytes;
    }
    for p in &strays {
        if !args.dry_run {
            let _ = std::fs::remove_file(p);
        }
    }
    // The shared site tables that only removed files named.
    let named: Vec<u64> = found.iter().zip(&remove).filter(|(_, r)| !**r).flat_map(|(f, _)| f.tables.clone()).collect();
    let (tables, table_bytes) = remove_unnamed_tables(&dir, &named, args.dry_run);
    let running = found.iter().filter(|f| f.state.running).count();
    let kept = found.len() - n - running;
    eprintln!(
        "alloctramp: {} {n} counters file{} of ended processes ({} KiB on disk) in {}; kept {running} of running processes and {kept} of ended ones",
        if args.dry_run { "would remove" } else { "removed" },
        if n == 1 { "" } else { "s" },
        bytes.div_ceil(1024),
        dir.display()
    );
    if tables > 0 {
        eprintln!(
            "alloctramp: {} {tables} shared site table{} that no remaining counters file names ({} KiB on disk)",
            if args.dry_run { "would remove" } else { "removed" },
            if tables == 1 { "" } else { "s" },
            table_bytes.div_ceil(1024)
        );
    }
    Ok(())
}

/// Removes the shared site tables in `dir` that no remaining counters file
/// names, once unused for `process::TABLE_GRACE_SECS` (a process starting
/// may have just found one), with temporary ones as old; how many and
/// their bytes on disk. As the runtime does: each table is moved aside
/// first, and put back if a process used it meanwhile. Only a tables
/// directory that is one (not a link) of the counters directory's owner.
fn remove_unnamed_tables(dir: &Path, named: &[u64], dry_run: bool) -> (usize, u64) {
    let tables = dir.join(process::TABLES_DIR);
    let owner = std::fs::symlink_metadata(dir).ok().map(|m| m.uid());
    let real = std::fs::symlink_metadata(&tables).is_ok_and(|m| m.is_dir() && Some(m.uid()) == owner);
    let Some(entries) = real.then(|| std::fs::read_dir(&tables).ok()).flatten() else { return (0, 0) };
    let mut found = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let id = process::shared_table_id(name).unwrap_or(0);
        if id == 0 && !name.ends_with(".new") {
            continue;
        }
        if let Some(meta) = e.path().symlink_metadata().ok().filter(|m| m.is_file()) {
            found.push((e.path(), id, meta));
        }
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    let used: Vec<(u64, i64)> = found.iter().map(|(_, id, m)| (*id, m.mtime())).collect();
    let (mut n, mut bytes) = (0, 0);
    for (remove, (path, id, meta)) in process::tables_to_remove(&used, named, now).into_iter().zip(&found) {
        if !remove {
            continue;
        }
        let gone = dry_run
            || if *id == 0 {
                std::fs::remove_file(path).is_ok()
            } else {
                let aside = path.with_extension(format!("sites.gc.{}.new", std::process::id()));
                std::fs::rename(path, &aside).is_ok() && {
                    let t = aside.symlink_metadata().map_or(now, |m| m.mtime());
                    let unused = process::tables_to_remove(&[(*id, t)], &[], now) == [true];
                    if !unused && std::fs::rename(&aside, path).is_ok() {
                        false
                    } else {
                        std::fs::remove_file(&aside).is_ok()
                    }
                }
            };
        if gone {
            n += 1;
            bytes += meta.blocks() * 512;
        }
    }
    (n, bytes)
}
