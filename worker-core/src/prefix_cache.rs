//! The prefix cache: sessions' KV rows that a new session may start from instead of
//! computing its prompt again. Donors are the live sessions (their prompts) and, once
//! closed, the finished sessions' whole caches (prompt and text), found by the chained
//! hashes of their whole token blocks (`prefix_block_hashes`). A new session copies the
//! longest prefix it shares with a donor, checked token by token, and prefills the rest.
//!
//! A copied row must be what the new session would have computed itself ([`Exact`]): any
//! row where a token's rows do not depend on the pass that computed them
//! (`Model::kv_rows_invariant`: the CPU); elsewhere (a GPU, whose prefill kernels go by the
//! pass's shape) only the rows of whole prefill chunks, which a fresh prefill cuts alike.
//! Finished caches count against the KV-token budget by their capacity, are bounded by
//! `prefix_cache_tokens`, and go first, least recently used, when a session needs room.

use crate::sessions::Session;
use duet_engine::{KvCache, prefix_block_hashes};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};

/// Which of a donor's rows a new session may copy and still hold bit for bit what its own
/// prefill would have computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Exact {
    /// Every row at its token's place: a row does not depend on the pass that computed it.
    #[default]
    AnyRow,
    /// Only rows a prefill computed, in whole chunks of this many tokens cut from the first
    /// (0: whole prompts): where a pass's rows depend on its shape, a fresh prefill of a
    /// prompt sharing them cuts the same chunks and computes them alike. A prompt's last,
    /// partial chunk is alike only for a prompt prefilled to the same end.
    WholeChunks(usize),
}

impl Exact {
    /// Of the `shared` leading tokens, how many rows a session whose prefill covers
    /// `prefill` tokens may copy from a donor whose first `prefilled` rows a prefill
    /// computed (the rest, calls'; `shared` is within the donor's rows in place).
    pub fn rows(self, shared: usize, prefilled: usize, prefill: usize) -> usize {
        let Exact::WholeChunks(chunk) = self else {
            return shared;
        };
        let n = shared.min(prefilled).min(prefill);
        if n == prefill && prefilled == prefill {
            return n;
        }
        match chunk {
            0 => 0,
            chunk => n / chunk * chunk,
        }
    }
}

/// A closed session's cache, kept whole, with how many of its rows a prefill computed.
#[derive(Debug)]
pub(crate) struct Kept {
    pub cache: KvCache,
    pub prefilled: usize,
}

/// Where a donor's rows are.
#[derive(Debug)]
enum Rows {
    /// An open session: its prompt's rows, read under its lock.
    Live(Weak<Mutex<Session>>),
    Finished(Arc<Kept>),
}

#[derive(Debug)]
struct Donor {
    rows: Rows,
    hashes: Vec<u64>,
    /// Its session's salt: the hashes start from it.
    salt: u64,
    last_used: u64,
}

/// What a new session may copy its prefix from (see [`PrefixPool::find`]).
#[derive(Debug)]
pub(crate) struct Source {
    pub rows: Donated,
    exact: Exact,
}

#[derive(Debug)]
pub(crate) enum Donated {
    Live(Arc<Mutex<Session>>),
    Finished(Arc<Kept>),
}

impl Source {
    /// Copies into `cache` the longest prefix of `tokens` the source holds that is exact
    /// for a session whose prefill covers the first `prefill` of `tokens`; how many tokens.
    pub fn copy_into(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        prefill: usize,
    ) -> duet_engine::Result<usize> {
        let copy = |from: &KvCache, in_place: usize, prefilled: usize, cache: &mut KvCache| {
            let shared = common_prefix(from.tokens(), tokens).min(in_place);
            let n = self
                .exact
                .rows(shared.min(cache.capacity()), prefilled, prefill);
            cache.copy_prefix(from, n).map(|()| n)
        };
        match &self.rows {
            Donated::Finished(kept) => copy(&kept.cache, kept.cache.len(), kept.prefilled, cache),
            Donated::Live(session) => {
                let from = session.lock().unwrap_or_else(|e| e.into_inner());
                copy(&from.cache, from.in_place(), from.prefilled, cache)
            }
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Donors by id, and for each block hash the donors holding that block (latest last).
#[derive(Debug, Default)]
pub(crate) struct PrefixPool {
    /// Finished caches' tokens (capacity) at most; 0: the cache is off.
    cap: usize,
    exact: Exact,
    /// Finished caches' tokens (capacity) held now.
    held: usize,
    donors: HashMap<u64, Donor>,
    index: HashMap<u64, Vec<u64>>,
    /// Closed sessions a pass still held, with their capacity (see [`PrefixPool::finish`]).
    closing: VecDeque<(Arc<Mutex<Session>>, usize)>,
    next_id: u64,
    tick: u64,
}

impl PrefixPool {
    pub fn enable(&mut self, cap: usize, exact: Exact) {
        self.cap = cap;
        self.exact = exact;
    }

    pub fn is_on(&self) -> bool {
        self.cap > 0
    }

    /// Finished caches' tokens held, those closing included (counted against the KV
    /// budget).
    pub fn held(&self) -> usize {
        self.held
    }

    fn add(&mut self, rows: Rows, tokens: &[u32], salt: u64) -> Option<u64> {
        let hashes = prefix_block_hashes(tokens, salt);
        if !self.is_on() || hashes.is_empty() {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.tick += 1;
        for h in &hashes {
            self.index.entry(*h).or_default().push(id);
        }
        let last_used = self.tick;
        self.donors.insert(
            id,
            Donor {
                rows,
                hashes,
                salt,
                last_used,
            },
        );
        Some(id)
    }

    /// Offers an open session's prompt rows (`tokens`) to later sessions of its `salt`; its
    /// donor id.
    pub fn add_live(
        &mut self,
        session: &Arc<Mutex<Session>>,
        tokens: &[u32],
        salt: u64,
    ) -> Option<u64> {
        self.add(Rows::Live(Arc::downgrade(session)), tokens, salt)
    }

    /// A session of `capacity` tokens closed: its live donor goes, and its cache stays as a
    /// finished one, within the cap. A pass that answered its caller may still hold the
    /// session for a moment: until it lets go the session waits in `closing`, counted.
    pub fn finish(&mut self, donor: Option<u64>, session: Arc<Mutex<Session>>, capacity: usize) {
        if let Some(id) = donor {
            self.remove(id);
        }
        if !self.is_on() || capacity > self.cap {
            return;
        }
        self.held += capacity;
        self.closing.push_back((session, capacity));
        self.settle();
    }

    /// Keeps the caches of closed sessions nothing else holds any more.
    fn settle(&mut self) {
        for _ in 0..self.closing.len() {
            let Some((session, capacity)) = self.closing.pop_front() else {
                break;
            };
            match Arc::try_unwrap(session) {
                Ok(session) => {
                    self.held -= capacity;
                    let mut session = session.into_inner().unwrap_or_else(|e| e.into_inner());
                    // A tree's alternatives are no one's keys at their places.
                    let in_place = session.in_place();
                    if session.cache.truncate(in_place).is_ok() {
                        let prefilled = session.prefilled.min(in_place);
                        let (cache, salt) = (session.cache, session.cache_salt);
                        self.keep(Kept { cache, prefilled }, salt);
                    }
                }
                Err(session) => self.closing.push_back((session, capacity)),
            }
        }
    }

    /// Adds a closed session's cache, pushing out the finished donors it makes redundant
    /// and then the least recently used.
    fn keep(&mut self, kept: Kept, salt: u64) {
        let size = kept.cache.capacity();
        self.drop_covered(kept.cache.tokens(), salt);
        self.evict_to(self.cap - size);
        let tokens = kept.cache.tokens().to_vec();
        if self
            .add(Rows::Finished(Arc::new(kept)), &tokens, salt)
            .is_some()
        {
            self.held += size;
        }
    }

    /// Drops finished donors of `salt` that hold less than a block beyond the prefix they
    /// share with `tokens` (an earlier turn of the same conversation).
    fn drop_covered(&mut self, tokens: &[u32], salt: u64) {
        let covered: Vec<u64> = self
            .donors
            .iter()
            .filter(|(_, d)| d.salt == salt)
            .filter_map(|(&id, d)| match &d.rows {
                Rows::Finished(kept) => {
                    let c = &kept.cache;
                    let extra = c.tokens().len() - common_prefix(c.tokens(), tokens);
                    (extra < duet_engine::PREFIX_BLOCK_TOKENS).then_some(id)
                }
                Rows::Live(_) => None,
            })
            .collect();
        for id in covered {
            self.remove(id);
        }
    }

    /// Evicts finished donors, the least recently used first and those still closing (the
    /// most recent) last, until they hold at most `room`.
    pub fn evict_to(&mut self, room: usize) {
        while self.held > room {
            let oldest = self
                .donors
                .iter()
                .filter(|(_, d)| matches!(d.rows, Rows::Finished(_)))
                .min_by_key(|(_, d)| d.last_used)
                .map(|(&id, _)| id);
            if let Some(id) = oldest {
                self.remove(id);
                continue;
            }
            match self.closing.pop_front() {
                Some((_, capacity)) => self.held -= capacity,
                None => break,
            }
        }
    }

    fn remove(&mut self, id: u64) {
        let Some(donor) = self.donors.remove(&id) else {
            return;
        };
        for h in &donor.hashes {
            if let Some(ids) = self.index.get_mut(h) {
                ids.retain(|&i| i != id);
                if ids.is_empty() {
                    self.index.remove(h);
                }
            }
        }
        if let Rows::Finished(kept) = donor.rows {
            self.held -= kept.cache.capacity();
        }
    }

    /// The latest donor holding block `hash`, dropping on the way those of sessions that
    /// never opened (their open failed after the prefill offered them).
    fn holder(&mut self, hash: u64) -> Option<u64> {
        let ids = self.index.get(&hash)?.clone();
        for id in ids.into_iter().rev() {
            match &self.donors[&id].rows {
                Rows::Live(w) if w.strong_count() == 0 => self.remove(id),
                _ => return Some(id),
            }
        }
        None
    }

    /// The donor of `salt` sharing the most whole blocks with `tokens` (the latest of those
    /// that share as many), marked as used; `None` when none shares the first block.
    pub fn find(&mut self, tokens: &[u32], salt: u64) -> Option<Source> {
        if !self.is_on() {
            return None;
        }
        self.settle();
        let mut best = None;
        for h in prefix_block_hashes(tokens, salt) {
            match self.holder(h) {
                Some(id) => best = Some(id),
                None => break,
            }
        }
        let id = best?;
        self.tick += 1;
        let donor = self.donors.get_mut(&id)?;
        donor.last_used = self.tick;
        let rows = match &donor.rows {
            Rows::Live(w) => Donated::Live(w.upgrade()?),
            Rows::Finished(kept) => Donated::Finished(kept.clone()),
        };
        Some(Source {
            rows,
            exact: self.exact,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Exact;

    /// Where rows depend on the pass, a session copies the whole chunks of a donor's prefill
    /// that its own prefill would cut alike, or all of a prompt prefilled to the same end;
    /// nothing past the donor's prefill (calls computed those) or past its own (it feeds
    /// those as calls).
    #[test]
    fn whole_chunks_are_what_a_fresh_prefill_cuts_alike() {
        let eight = Exact::WholeChunks(8);
        assert_eq!(eight.rows(20, 20, 30), 16);
        assert_eq!(eight.rows(20, 20, 20), 20, "the same prompt");
        assert_eq!(
            eight.rows(20, 20, 21),
            16,
            "a longer one cuts [16, 21) whole"
        );
        assert_eq!(eight.rows(20, 12, 30), 8, "the donor's calls from row 12");
        assert_eq!(
            eight.rows(30, 40, 20),
            16,
            "the session's own calls from row 20"
        );
        assert_eq!(eight.rows(7, 20, 30), 0);
        let whole = Exact::WholeChunks(0);
        assert_eq!((whole.rows(20, 20, 30), whole.rows(20, 20, 20)), (0, 20));
        assert_eq!(Exact::AnyRow.rows(20, 0, 5), 20);
    }
}
