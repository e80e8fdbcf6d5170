//! `loadtest` command line; everything lives in the library so tests can drive it.

use std::process::ExitCode;

use clap::Parser;
use loadtest::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match loadtest::cli::build_runtime(cli.threads) {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("loadtest: cannot start the runtime: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(loadtest::cli::execute(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("loadtest: {error:#}");
            ExitCode::FAILURE
        }
    }
}
