//! `duet-target-worker`: configuration, logging, serve until SIGTERM.

fn main() -> anyhow::Result<()> {
    duet_worker_core::main(
        duet_target_worker::service(),
        duet_target_worker::TargetHandler,
        duet_target_worker::TargetService::server,
    )
}
