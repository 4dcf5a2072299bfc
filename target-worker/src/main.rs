//! `duet-target-worker`: configuration, logging, serve until SIGTERM.

fn main() -> anyhow::Result<()> {
    duet_serving::worker::main(
        duet_target_worker::SERVICE_NAME,
        duet_target_worker::default_config(),
        duet_target_worker::ENV_PREFIX,
        duet_target_worker::TargetHandler,
        duet_target_worker::TargetService::server,
    )
}
