//! `duet-coordinator`: configuration, logging, serve until SIGTERM.

use clap::Parser;
use duet_serving::startup::CommonArgs;

#[derive(Debug, Parser)]
#[command(
    about = "duet's coordinator: the public Generate API over a draft-worker and a target-worker"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// gRPC listen address (key `listen`).
    #[arg(long)]
    listen: Option<String>,
    /// Target-worker URL (key `target.address`).
    #[arg(long)]
    target: Option<String>,
    /// Draft-worker URL (key `draft.address`; empty for none).
    #[arg(long)]
    draft: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let flags = [
        ("listen", args.listen.as_deref()),
        ("target.address", args.target.as_deref()),
        ("draft.address", args.draft.as_deref()),
    ];
    duet_coordinator::service().main(&args.common, &flags, duet_coordinator::run)
}
