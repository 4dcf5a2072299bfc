//! `duet-draft-worker`: configuration, logging, serve until SIGTERM.

fn main() -> anyhow::Result<()> {
    duet_serving::worker::main(
        duet_draft_worker::SERVICE_NAME,
        duet_draft_worker::default_config(),
        duet_draft_worker::ENV_PREFIX,
        duet_draft_worker::DraftHandler,
        duet_draft_worker::DraftService::server,
    )
}
