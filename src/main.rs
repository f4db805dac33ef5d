//! The `meshtrain` command: one process per GPU (or CPU rank), started by srun or mpirun.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "meshtrain", version, about = "Train GPT models on supercomputers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let result: meshtrain::Result<()> = match cli.command {};
    if let Err(e) = result {
        eprintln!("meshtrain: error: {e}");
        std::process::exit(e.exit_code());
    }
}
