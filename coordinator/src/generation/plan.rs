//! Planning a round: prompt lookup's proposal (the request's own text, its predicted output,
//! what followed the same text in earlier requests), and who drafts how many tokens (the
//! method the request named, or for AUTO the controller, on the costs measured so far).

use super::{DraftState, Drafted, Generation};
use crate::controller::{self, Plan, lookup_bucket};
use crate::method::{Method, Proposer};
use crate::workers::{Proposal, WorkerTiming, Workers};
use duet_engine::ngram::Lookup;
use duet_engine::sampling::Distribution;

impl<W: Workers> Generation<W> {
    /// Prompt lookup's proposal for this round (NGRAM and AUTO), at most `limit` tokens
    /// (AUTO: also at most its configured share).
    pub(super) fn lookup(&mut self, limit: usize) -> Option<Lookup> {
        let index = self.ngram.as_ref()?;
        let cap = match self.req.method {
            Method::Auto => limit.min(self.ctx.speculation.adaptive.max_ngram_tokens as usize),
            _ => limit,
        };
        let own = index.lookup(&self.seq, cap);
        // The predicted output wins where it matched as long a run as the request's text.
        let predicted = (self.predicted.as_mut()).and_then(|p| p.lookup(&self.seq, cap));
        let own = match (own, predicted) {
            (Some(own), Some(p)) if own.matched > p.matched => Some(own),
            (own, predicted) => predicted.or(own),
        };
        // What followed the same run in earlier requests wins where it matched a longer run
        // than the request's own text: a prompt that describes the output's format (a
        // tool's JSON schema) matches two tokens of almost every line of it, where the
        // cache holds what such outputs really went on with.
        let longer = own.as_ref().map_or(0, |o| o.matched + 1);
        let cached = self.ctx.proposals.as_ref().and_then(|(cache, tenant)| {
            let found = cache.lookup(*tenant, &self.seq, cap, longer)?;
            self.ctx.metrics.proposal_cache_hits.inc();
            Some(Lookup {
                matched: found.matched,
                tokens: found.tokens,
                cache_votes: Some(found.count),
            })
        });
        cached.or(own)
    }

    /// Who drafts this round, and how many tokens, with `remaining` completion tokens to go.
    pub(super) fn plan(&self, limit: usize, remaining: usize, lookup: Option<&Lookup>) -> Plan {
        let draft_open = self.draft.session().is_some() && limit > 0;
        match self.req.method {
            Method::NONE => Plan::TARGET_ONLY,
            Method::DRAFT_MODEL if draft_open || (self.may_open_draft() && limit > 0) => {
                self.named(Proposer::DraftModel, limit, limit, remaining, lookup)
            }
            Method::DRAFT_MODEL => Plan::TARGET_ONLY,
            // A stream that looks up itself makes the rounds of the request's own text.
            Method::NGRAM => match lookup.filter(|l| self.beside_stream_lookup(l)) {
                Some(l) => self.named(Proposer::Ngram, l.tokens.len(), limit, remaining, lookup),
                None => Plan::TARGET_ONLY,
            },
            Method::Auto => match (&self.controller, self.ctx.shared.costs(self.mode())) {
                (Some(controller), Some(costs)) => {
                    controller.plan(&costs, &self.options(limit, remaining, lookup))
                }
                // Nothing is known of the costs yet: one plain step measures them.
                _ => Plan::TARGET_ONLY,
            },
        }
    }

    /// A round by the method the request named, which offers `k` tokens: where the request
    /// left K to the server (`choose_k`), as many as the controller finds pay best (at least
    /// one; before any cost is measured, the configured K); otherwise exactly `k`.
    fn named(
        &self,
        proposer: Proposer,
        k: usize,
        limit: usize,
        remaining: usize,
        lookup: Option<&Lookup>,
    ) -> Plan {
        // A request with its own K reads no shared estimate (a lock and a copy a round).
        let Some(controller) = &self.controller else {
            return Plan::exactly(proposer, k);
        };
        match self.ctx.shared.costs(self.mode()) {
            Some(costs) => {
                let options = self.options(limit, remaining, lookup);
                controller.plan_for(proposer, &costs, &options)
            }
            None => {
                let configured = self.ctx.speculation.num_speculative_tokens as usize;
                Plan::exactly(proposer, k.min(configured))
            }
        }
    }

    /// What the controller may choose from this round.
    fn options(
        &self,
        limit: usize,
        remaining: usize,
        lookup: Option<&Lookup>,
    ) -> controller::Options {
        let max_k = self.ctx.speculation.adaptive.max_draft_model_tokens as usize;
        // Committed tokens the draft model's cache would first have to take in: the ones it
        // lacks, or, before its session is open, all of them.
        let catch_up = match &self.draft {
            DraftState::Open(_) => Some((self.seq.len() - self.synced.draft - 1, false)),
            DraftState::Closed if self.may_open_draft() => Some((self.seq.len() - 1, true)),
            DraftState::Closed | DraftState::Opening(_) | DraftState::Unused => None,
        };
        controller::Options {
            limit,
            remaining,
            draft: catch_up.filter(|_| limit > 0).map(|(catch_up, opening)| {
                controller::DraftOption {
                    max_k,
                    catch_up,
                    opening,
                }
            }),
            // A stream that looks up itself ends for the cache's proposals alone.
            ngram: lookup
                .filter(|l| self.beside_stream_lookup(l))
                .map(|l| (lookup_bucket(l), l.tokens.len())),
            overlap: self.overlap(),
            stop_early: self.ctx.speculation.adaptive.stop_early,
            trees: self.tree_width() > 0,
            streaming: self.decoding.is_some(),
        }
    }

    /// The most alternatives a draft position may carry: `tree_alternatives` where the
    /// target replica holding the session verifies trees, else 0 (chains).
    pub(super) fn tree_width(&self) -> usize {
        match self.ctx.workers.verifies_trees(&self.target) {
            true => self.ctx.speculation.adaptive.tree_alternatives as usize,
            false => 0,
        }
    }

    /// The first `k` tokens of a lookup as a proposal: point masses for rejection sampling
    /// (a token is then accepted with the target's own probability of it).
    pub(super) fn lookup_proposal(&self, lookup: &Lookup, k: usize) -> Drafted {
        let tokens = lookup.tokens[..k.min(lookup.tokens.len())].to_vec();
        let q = match self.req.sampling.is_greedy() {
            true => Vec::new(),
            false => tokens.iter().map(|&t| Distribution::point(t)).collect(),
        };
        Drafted {
            proposer: Proposer::Ngram,
            proposal: Proposal {
                tokens,
                q,
                alternatives: Vec::new(),
                timing: WorkerTiming::default(),
            },
        }
    }

    /// Greedy or sampling: the shared estimates of a round's overhead are the mode's.
    pub(super) fn mode(&self) -> controller::Mode {
        controller::Mode::of(self.req.sampling.is_greedy())
    }
}
