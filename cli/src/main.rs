//! The `alloctramp` command: glue between the command line, files, and the
//! libraries that do the work.

mod patch;
mod report;
mod sites;
mod util;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "alloctramp",
    version,
    about = "Per-call-site allocation profiling for x86-64 ELF programs, without recompiling them"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Sites(sites::Args),
    Patch(patch::Args),
    Report(report::Args),
    /// Switch profiling on in a running process.
    Enable(report::SwitchArgs),
    /// Switch profiling off in a running process.
    Disable(report::SwitchArgs),
    /// Zero the counters of a running process.
    Reset(report::SwitchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sites(args) => sites::run(args),
        Command::Patch(args) => patch::run(args),
        Command::Report(args) => report::run(args),
        Command::Enable(args) => report::switch(args, "on"),
        Command::Disable(args) => report::switch(args, "off"),
        Command::Reset(args) => report::switch(args, "reset"),
    };
    util::finish(result)
}
