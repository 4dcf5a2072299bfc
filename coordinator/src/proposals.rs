//! The proposal cache: what followed a run of tokens in this coordinator's earlier requests,
//! proposed when a request's text ends with the same run. Prompt lookup (`ngram.rs`)
//! searches the request's own text; this carries repetition across requests: the same
//! question from many users, an agent loop that re-emits its tool-call JSON, a templated
//! report. Its drafts are point masses, as prompt lookup's, so the output stays the
//! target's whatever it proposes.
//!
//! A bounded table of (tenant, the last [`MATCH`] tokens) → the continuation seen most
//! often after them, from finished requests' prompts and outputs. After 8 matching tokens
//! one earlier sighting is proposed; after only 4, or where continuations that share
//! nothing followed the same run (the value each request fills in: a tool call's airport),
//! the continuation must have been seen twice (its vote count is the proposal's
//! confidence). "Most often" is a majority vote: a different continuation wears the kept
//! one's count down before it replaces it, so one odd request does not displace what most
//! requests said. Two requests whose continuations start alike and then part (a template's
//! fixed words, then each request's own) keep only what they share: past it, neither is
//! what follows the run, and a shorter proposal that holds costs fewer verified rows than a
//! long one that fails. Past `max_entries` the oldest entry not used since it was last
//! passed over goes (a clock). A tenant's lookups read only its own entries: the tenant is
//! part of every key.

use duet_engine::ngram::mix;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// The lengths of the runs matched, the longest tried first.
pub const MATCH: [usize; 2] = [8, 4];
/// A continuation seen once after a run this short is a guess, not a pattern: it is
/// proposed only once it was seen more often than anything else after that run (a vote
/// count of 2 or more).
const SHORT: usize = 4;
/// The most tokens kept after a run (AUTO's prompt-lookup share, by default).
pub const CONTINUATION: usize = 16;

/// Whose text an entry came from: requests of one tenant never get another's proposals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tenant(pub u64);

/// A proposal from the cache: `tokens` followed the last `matched` tokens `count` more
/// times than any other continuation (at least once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cached {
    pub matched: usize,
    pub tokens: Vec<u32>,
    pub count: u32,
}

#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    count: u32,
    /// Two continuations parted after `tokens`: a later, longer one no longer extends it.
    parted: bool,
    /// Continuations that share nothing followed the run: one sighting is not a pattern.
    contested: bool,
    /// Read since the clock last passed it.
    used: bool,
}

#[derive(Debug, Default)]
struct Table {
    entries: HashMap<u64, Entry>,
    /// Every key, in the order the clock visits them.
    clock: VecDeque<u64>,
}

/// The cache of one coordinator, shared by its requests.
#[derive(Debug)]
pub struct ProposalCache {
    table: Mutex<Table>,
    max_entries: usize,
}

/// The key of the `n` tokens of `seq` ending before `end`, for `tenant`.
fn key(tenant: Tenant, seq: &[u32], end: usize, n: usize) -> u64 {
    let h = mix(tenant.0, n as u32);
    seq[end - n..end].iter().fold(h, |h, &t| mix(h, t))
}

impl ProposalCache {
    /// A cache of at most `max_entries` runs (at least 1).
    pub fn new(max_entries: usize) -> Self {
        Self {
            table: Mutex::new(Table::default()),
            max_entries: max_entries.max(1),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Learns a finished request's text (`seq`: its prompt and output) for `tenant`: at
    /// every position, what followed each run that ends there. With it, the runs now held.
    pub fn learn(&self, tenant: Tenant, seq: &[u32]) -> usize {
        let mut updates = Vec::new();
        for end in 1..seq.len() {
            let after = &seq[end..seq.len().min(end + CONTINUATION)];
            for n in MATCH.into_iter().filter(|&n| n <= end) {
                updates.push((key(tenant, seq, end, n), after));
            }
        }
        let mut t = self.table();
        for (k, after) in updates {
            self.vote(&mut t, k, after);
        }
        t.entries.len()
    }

    /// One vote for `after` following the run `k`.
    fn vote(&self, t: &mut Table, k: u64, after: &[u32]) {
        if let Some(e) = t.entries.get_mut(&k) {
            let shared = e
                .tokens
                .iter()
                .zip(after)
                .take_while(|(a, b)| a == b)
                .count();
            if shared > 0 {
                // The same continuation, as far as both go: keep the longer account of it,
                // or, where they part, what they share.
                e.count = e.count.saturating_add(1);
                if shared < e.tokens.len().min(after.len()) {
                    e.tokens.truncate(shared);
                    e.parted = true;
                } else if after.len() > e.tokens.len() && !e.parted {
                    e.tokens = after.to_vec();
                }
            } else if e.count > 1 {
                e.count -= 1;
                e.contested = true;
            } else {
                (e.tokens, e.count, e.parted, e.contested) = (after.to_vec(), 1, false, true);
            }
            return;
        }
        while t.entries.len() >= self.max_entries {
            evict_one(t);
        }
        let entry = Entry {
            tokens: after.to_vec(),
            count: 1,
            parted: false,
            contested: false,
            used: false,
        };
        t.entries.insert(k, entry);
        t.clock.push_back(k);
    }

    /// Up to `k` tokens that followed the longest run of at least `min_run` tokens `seq`
    /// ends with, for `tenant`.
    pub fn lookup(&self, tenant: Tenant, seq: &[u32], k: usize, min_run: usize) -> Option<Cached> {
        if k == 0 || min_run > MATCH[0] {
            return None;
        }
        let mut t = self.table();
        let mut runs = MATCH
            .into_iter()
            .filter(|&n| min_run <= n && n <= seq.len());
        runs.find_map(|n| {
            let e = t.entries.get_mut(&key(tenant, seq, seq.len(), n))?;
            e.used = true;
            if e.count < 2 && (n <= SHORT || e.contested) {
                return None;
            }
            Some(Cached {
                matched: n,
                tokens: e.tokens[..k.min(e.tokens.len())].to_vec(),
                count: e.count,
            })
        })
    }

    /// Runs held.
    pub fn len(&self) -> usize {
        self.table().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Removes the first entry the clock finds unused since its last pass (clearing the marks
/// of those it passes).
fn evict_one(t: &mut Table) {
    while let Some(k) = t.clock.pop_front() {
        match t.entries.get_mut(&k) {
            Some(e) if e.used => {
                e.used = false;
                t.clock.push_back(k);
            }
            Some(_) => {
                t.entries.remove(&k);
                return;
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Tenant = Tenant(1);
    const B: Tenant = Tenant(2);

    fn seq(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn a_run_seen_before_proposes_what_followed_it_the_longest_match_first() {
        let cache = ProposalCache::new(1_000);
        cache.learn(A, &seq(0..40));
        // Ends with 10..18: the 8-token run matches, and 18.. followed it.
        let found = cache.lookup(A, &seq(10..18), 5, 1).unwrap();
        assert_eq!(found.matched, 8);
        assert_eq!(found.tokens, seq(18..23));
        // Asked only for runs longer than the request's own text matched: 8 is, 9 is none.
        assert_eq!(cache.lookup(A, &seq(10..18), 5, 8).unwrap().matched, 8);
        assert_eq!(cache.lookup(A, &seq(10..18), 5, 9), None);
        // Only the last 4 tokens match an earlier run: seen once, a guess, not proposed;
        // seen twice, proposed.
        let short = [99, 98, 97, 96, 20, 21, 22, 23];
        assert_eq!(cache.lookup(A, &short, 16, 1), None);
        cache.learn(A, &seq(18..40));
        let found = cache.lookup(A, &short, 16, 1).unwrap();
        assert_eq!((found.matched, found.count), (4, 2));
        assert_eq!(found.tokens, seq(24..40));
        assert_eq!(cache.lookup(A, &short, 16, 5), None);
        assert_eq!(cache.lookup(A, &[99, 98, 97, 96], 4, 1), None);
        assert_eq!(cache.lookup(A, &seq(10..18), 0, 1), None);
    }

    #[test]
    fn the_most_frequent_continuation_wins() {
        let cache = ProposalCache::new(1_000);
        let run = [1, 2, 3, 4];
        let with = |after: u32| [&run[..], &[after, after + 1]].concat();
        for _ in 0..3 {
            cache.learn(A, &with(50));
        }
        cache.learn(A, &with(70));
        let found = cache.lookup(A, &run, 2, 1).unwrap();
        assert_eq!((found.tokens, found.count), (vec![50, 51], 2));
        // Two more wear 50's lead down and take its place; a third counts for 70.
        for _ in 0..3 {
            cache.learn(A, &with(70));
        }
        let found = cache.lookup(A, &run, 2, 1).unwrap();
        assert_eq!((found.tokens, found.count), (vec![70, 71], 2));
    }

    #[test]
    fn a_run_followed_by_each_requests_own_value_proposes_nothing_until_one_recurs() {
        let cache = ProposalCache::new(1_000);
        let run = [1, 2, 3, 4, 5, 6, 7, 8];
        let with = |after: u32| [&run[..], &[after, after + 1]].concat();
        cache.learn(A, &with(40));
        assert_eq!(cache.lookup(A, &run, 2, 1).unwrap().tokens, vec![40, 41]);
        // Another value: after eight tokens too, one sighting is a guess now.
        cache.learn(A, &with(50));
        assert_eq!(cache.lookup(A, &run, 2, 1), None);
        cache.learn(A, &with(60));
        assert_eq!(cache.lookup(A, &run, 2, 1), None);
        // The same value again is a pattern.
        cache.learn(A, &with(60));
        let found = cache.lookup(A, &run, 2, 1).unwrap();
        assert_eq!((found.tokens, found.count), (vec![60, 61], 2));
    }

    #[test]
    fn continuations_that_part_are_proposed_as_far_as_they_agree() {
        let cache = ProposalCache::new(1_000);
        let run = [1, 2, 3, 4, 5, 6, 7, 8];
        let with = |after: &[u32]| [&run[..], after].concat();
        cache.learn(A, &with(&[40, 41, 42, 43]));
        cache.learn(A, &with(&[40, 41, 50, 51]));
        let found = cache.lookup(A, &run, 16, 1).unwrap();
        assert_eq!((found.tokens, found.count), (vec![40, 41], 2));
        // A third that agrees further does not grow it back past where two parted.
        cache.learn(A, &with(&[40, 41, 42, 43, 44]));
        let found = cache.lookup(A, &run, 16, 1).unwrap();
        assert_eq!((found.tokens, found.count), (vec![40, 41], 3));
        // One that only goes on from what was kept (a repeat) grows an entry that never
        // parted.
        let other = [9, 10, 11, 12, 13, 14, 15, 16];
        cache.learn(A, &[&other[..], &[60]].concat());
        cache.learn(A, &[&other[..], &[60, 61, 62]].concat());
        let found = cache.lookup(A, &other, 16, 1).unwrap();
        assert_eq!((found.tokens, found.count), (vec![60, 61, 62], 2));
    }

    #[test]
    fn a_tenant_never_gets_another_tenants_text() {
        let cache = ProposalCache::new(1_000);
        cache.learn(A, &seq(0..40));
        assert_eq!(cache.lookup(B, &seq(10..18), 5, 1), None);
        assert!(cache.lookup(A, &seq(10..18), 5, 1).is_some());
    }

    #[test]
    fn the_table_holds_at_most_its_bound_and_keeps_what_is_used() {
        let cache = ProposalCache::new(50);
        cache.learn(A, &seq(0..10));
        for round in 0..20 {
            // Used between every learning: it stays.
            assert!(cache.lookup(A, &seq(0..8), 1, 1).is_some(), "round {round}");
            cache.learn(B, &seq(1_000 + round * 100..1_000 + round * 100 + 30));
            assert!(cache.len() <= 50);
        }
        assert_eq!(cache.len(), 50);
    }
}
