//! `duet-draft-worker`: configuration, logging, serve until SIGTERM.

fn main() -> anyhow::Result<()> {
    duet_worker_core::main::<duet_draft_worker::Drafter>()
}
