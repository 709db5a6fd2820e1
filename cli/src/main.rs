//! The `alloctramp` command: glue between the command line, files, and the
//! libraries that do the work.

mod patch;
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sites(args) => sites::run(args),
        Command::Patch(args) => patch::run(args),
    };
    util::finish(result)
}
