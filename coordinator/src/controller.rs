//! The adaptive controller behind AUTO: before each round it picks who proposes (the draft
//! model, prompt lookup, or nobody) and how many tokens (K, 0 included), to get the most
//! committed tokens per unit of time (for a request that named its proposer but no K, only
//! that proposer's K, at least 1: [`Controller::plan_for`]), from
//! - how well each proposer has done for this request: the chance its first draft token is
//!   accepted, and the chance each next one is given the one before was (two Beta
//!   estimates that forget old rounds, started from what the proposer does for all
//!   requests); prompt lookup is judged separately by how long its match is, and is
//!   scored on every round, used or not, by comparing its proposal with what was committed;
//! - what a round costs: the target's pass time as a function of its token rows (measured
//!   at each row count of the Verify passes: [`PassTime`]), the draft-worker's time per
//!   draft token, and the coordinator's and network's time per round;
//! - with drafting ahead on (`overlap_drafting`), how much a target pass slows while the
//!   draft drafts beside it: nothing on separate devices, much on shared cores. Drafting
//!   ahead is chosen only where the draft time it saves beats that, and the draft model's
//!   drafting is then counted only on the rounds whose drafts were not made ahead;
//! - what the other sessions in the target's passes do: their rows, their committed tokens
//!   and their draft work. A round's value is the tokens all of them commit over the time
//!   the pass and the drafting take, so a row is worth verifying only when the chance it
//!   commits a token beats what that row's time would earn the whole batch. Alone on the
//!   target, that is the request's own tokens per second; in a batch of eight on a CPU,
//!   where a verified row costs about as much as a decoded one, only near-certain drafts
//!   pay.

mod estimate;
mod pass;
mod plan;
mod shared;

pub use estimate::{Acceptance, CACHE_BUCKET, Odds, Seen, lookup_bucket, ngram_bucket};
pub use pass::PassTime;
pub use plan::{Controller, DraftOption, Options, Overlap, Plan};
pub use shared::{Costs, Mode, RoundCosts, Shared, Source};

#[cfg(test)]
mod tests;
