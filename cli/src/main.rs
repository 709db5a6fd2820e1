//! The `alloctramp` command: glue between the command line, files, and the
//! libraries that do the work.

mod analyze;
mod callers;
mod clean;
mod control;
mod debuginfod;
mod demo;
mod fault;
mod patch;
mod report;
mod run;
mod serve;
mod sites;
mod snapshot;
mod top;
mod trace;
mod util;

use alloctramp_trampolines::process::Request;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "alloctramp",
    version,
    about = "Per-call-site allocation profiling for x86-64 ELF programs, without recompiling them",
    after_help = "Start here:\n  \
        alloctramp demo                       # a guided run on a bundled example\n  \
        alloctramp run --on -- PROGRAM ARGS   # profile a program, report when it exits\n  \
        alloctramp report                     # your processes running patched code\n  \
        alloctramp report PID | sort -g -r | head\n  \
        alloctramp top PID                    # a live view of a process's sites\n  \
        alloctramp serve                      # /metrics and /debug/pprof/heap for Prometheus and pprof"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Sites(sites::Args),
    Patch(patch::Args),
    Run(run::Args),
    Report(report::Args),
    Serve(serve::Args),
    Top(top::Args),
    Snapshot(snapshot::SnapshotArgs),
    Diff(snapshot::DiffArgs),
    /// Switch profiling on in a running process.
    Enable(control::SwitchArgs),
    Disable(control::DisableArgs),
    /// Zero the counters of a running process.
    Reset(control::SwitchArgs),
    Callers(control::CallersArgs),
    Fail(fault::FailArgs),
    Faultsweep(fault::SweepArgs),
    Trace(trace::TraceArgs),
    Analyze(analyze::Args),
    Demo(demo::Args),
    Clean(clean::Args),
    /// Patch a library into `run`'s cache (run by the loader's audit
    /// library, not by hand).
    #[command(name = "cache-library", hide = true)]
    CacheLibrary {
        file: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() || e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            e.exit()
        }
        Err(e) => {
            // A usage error: one line, status 2, like every other error.
            // The message's first line and the indented lines under it
            // (the arguments a missing-argument error names).
            let text = e.render().to_string();
            let mut lines = text.lines();
            let mut said = lines.next().unwrap_or("invalid arguments").trim_start_matches("error: ").to_string();
            for l in lines.take_while(|l| l.starts_with(' ')) {
                said.push(' ');
                said.push_str(l.trim());
            }
            eprintln!("alloctramp: {said} (see --help)");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Sites(args) => sites::run(args),
        Command::Patch(args) => patch::run(args),
        Command::Run(args) => run::run(args),
        Command::Report(args) => report::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Top(args) => top::run(args),
        Command::Snapshot(args) => snapshot::run_snapshot(args),
        Command::Diff(args) => snapshot::run_diff(args),
        Command::Enable(args) => control::run_switch(&args, Request::On),
        Command::Disable(args) => {
            control::run_switch(&args.switch, if args.now { Request::OffNow } else { Request::Off })
        }
        Command::Reset(args) => control::run_switch(&args, Request::Reset),
        Command::Callers(args) => control::run_callers(&args),
        Command::Fail(args) => fault::run_fail(&args),
        Command::Faultsweep(args) => fault::run_sweep(args),
        Command::Trace(args) => trace::run_trace(&args),
        Command::Analyze(args) => analyze::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Clean(args) => clean::run(args),
        Command::CacheLibrary { file } => run::cache_library(&file),
    };
    util::finish(result)
}
