//! The `quantrouter` binary.

use std::process::ExitCode;

fn main() -> ExitCode {
    quantrouter::cli::main()
}
