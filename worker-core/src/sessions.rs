//! The session table: one KV cache per request, bounded by a session limit and a KV-token
//! budget (capacity is reserved when a session opens), closed by the idle TTL when its
//! coordinator goes away. A caller may name the session it opens, and close it by that name
//! before the open has answered (or even arrived), so that an open whose caller went away
//! leaks nothing. The table also holds the prefix cache (`prefix_cache`): sessions'
//! rows that later sessions start from, finished ones counted against the same budget.

use crate::WorkerError;
use crate::prefix_cache::{Exact, PrefixPool, Source};
use duet_engine::KvCache;
use duet_engine::bias::LogitBias;
use duet_engine::penalties::{MinTokens, Penalties, PromptTokens};
use duet_engine::sampling::SamplingParams;
use duet_engine::structured::Constraint;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One request's state on one worker. The model thread locks it for each forward pass.
#[derive(Debug)]
pub struct Session {
    pub cache: KvCache,
    pub sampling: SamplingParams,
    /// The draft's sampler (unused by the target, whose tokens the coordinator samples).
    pub rng: ChaCha8Rng,
    /// A shortlisted draft's extra ids: the rare tokens of the session's prompt and text.
    pub extra: duet_engine::ExtraLogits,
    /// After a Verify of a tree of drafts: each draft's cache row and its parent's, for the
    /// next call to keep the accepted path's rows (`Session::reuse_tree`). Empty otherwise.
    pub tree: Vec<(usize, usize)>,
    /// The target-worker's number of the latest call that ran on the session: a Decode
    /// call's later steps give way to any call after it (`TargetWorker.Decode`).
    pub last_call: u64,
    /// Whether calls answer their chosen tokens' log-probabilities, and with how many most
    /// likely tokens' (`OpenSessionRequest.top_logprobs`).
    pub logprobs: Option<usize>,
    /// The request's penalties, and where its completion starts in the session's tokens
    /// (what they count).
    pub penalties: Penalties,
    pub completion_from: usize,
    /// The prompt's tokens, where a repetition penalty counts them as seen.
    pub prompt_tokens: PromptTokens,
    /// The request's logit bias, added to every row before the session's choice.
    pub logit_bias: LogitBias,
    /// No end-of-sequence token chosen (target-worker) or proposed (draft-worker) before
    /// this many completion tokens.
    pub min_tokens: MinTokens,
    /// A structured output's constraint: each verified row (target-worker) and each
    /// proposal (draft-worker) keeps only the tokens that continue the completion within
    /// the format.
    pub constraint: Option<Constraint>,
    /// The prefix cache's salt: the session copies from, and leaves its rows to, sessions
    /// of the same salt only.
    pub cache_salt: u64,
    /// The cache's leading rows that its prompt's prefill computed (or copied in their
    /// stead), in chunks cut from the first token: what a later session may copy where
    /// rows depend on the pass ([`Exact`]).
    pub prefilled: usize,
}

impl Session {
    /// A session on `cache` with `sampling` and the random stream `rng`, and nothing else
    /// shaping its rows: no shortlist, penalties, bias, minimum or constraint; its
    /// completion starts at the cache's first token.
    pub fn plain(cache: KvCache, sampling: SamplingParams, rng: ChaCha8Rng) -> Self {
        Self {
            cache,
            sampling,
            rng,
            extra: Default::default(),
            tree: Vec::new(),
            last_call: 0,
            logprobs: None,
            penalties: Default::default(),
            completion_from: 0,
            prompt_tokens: Default::default(),
            logit_bias: Default::default(),
            min_tokens: Default::default(),
            constraint: None,
            cache_salt: 0,
            prefilled: 0,
        }
    }

    /// Keeps `keep` tokens and, from the tree of the last call, the rows of the path that
    /// `append`'s leading tokens take from there (all but its last token, whose row gives
    /// the first verified position). Returns how many of `append` it kept; the caller feeds
    /// the rest. A path whose rows the cache does not hold keeps nothing.
    pub fn reuse_tree(&mut self, keep: usize, append: &[u32]) -> usize {
        let tree = std::mem::take(&mut self.tree);
        let (Some(mut at), Some((_, leading))) = (keep.checked_sub(1), append.split_last()) else {
            return 0;
        };
        let held = self.cache.tokens();
        let mut path = Vec::new();
        for &token in leading {
            let child = tree
                .iter()
                .find(|&&(row, parent)| parent == at && row < held.len() && held[row] == token);
            match child {
                Some(&(row, _)) => {
                    path.push(row);
                    at = row;
                }
                None => break,
            }
        }
        match path.is_empty() || self.cache.keep_path(keep, &path).is_err() {
            true => 0,
            false => {
                self.prefilled = self.prefilled.min(keep);
                path.len()
            }
        }
    }

    /// How many of the cache's rows a later session may copy as the keys and values of
    /// their tokens: all but those from the first row of the last call's tree that does not
    /// follow the row before it (an alternative to a chain token: its keys were computed at
    /// the position after its parent, not at its place in the cache).
    pub fn in_place(&self) -> usize {
        let moved = self.tree.iter().filter(|&&(row, parent)| parent + 1 != row);
        let len = self.cache.len();
        moved
            .map(|&(row, _)| row)
            .min()
            .map_or(len, |row| row.min(len))
    }

    /// Cuts the cache back to `keep` tokens and checks that `append` plus `extra` more tokens
    /// fit, before any forward pass touches it.
    pub fn rewind(&mut self, keep: usize, append: usize, extra: usize) -> Result<(), WorkerError> {
        let len = self.cache.len();
        if keep > len {
            return Err(WorkerError::invalid(
                "keep",
                format!("{keep} exceeds the {len} tokens the session holds"),
            ));
        }
        let needed = keep + append + extra;
        if needed > self.cache.capacity() {
            return Err(WorkerError::invalid(
                "append",
                format!(
                    "the session would need {needed} tokens but was opened with capacity {}",
                    self.cache.capacity()
                ),
            ));
        }
        // Rows fed again from `keep` on come from calls.
        self.prefilled = self.prefilled.min(keep);
        self.cache
            .truncate(keep)
            .map_err(|e| WorkerError::invalid("keep", e.to_string()))
    }
}

/// A session's name: 16 random bytes from a cryptographically secure generator, so that
/// reaching a worker is not enough to drive or close another caller's session.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId(pub [u8; 16]);

impl SessionId {
    fn random() -> Self {
        Self(rand::rng().random())
    }

    pub fn from_wire(bytes: &[u8]) -> Result<Self, WorkerError> {
        bytes.try_into().map(Self).map_err(|_| {
            WorkerError::invalid(
                "session_id",
                format!("{} bytes; a session id has 16", bytes.len()),
            )
        })
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&duet_serving::wire::hex(&self.0))
    }
}

impl std::fmt::Debug for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionId({self})")
    }
}

/// Milliseconds since some fixed start: the table's time, which tests drive by hand.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> u64;
}

/// The real clock.
#[derive(Debug)]
pub struct SystemClock(Instant);

impl SystemClock {
    pub fn new() -> Self {
        Self(Instant::now())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.0.elapsed().as_millis() as u64
    }
}

/// Limits that bound the table.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_sessions: usize,
    pub kv_token_budget: usize,
    pub ttl: Duration,
}

#[derive(Debug)]
struct Entry {
    session: Arc<Mutex<Session>>,
    capacity: usize,
    /// Milliseconds since the table's epoch at the last call.
    last_used: AtomicU64,
    /// Its prompt's place in the prefix cache.
    donor: Option<u64>,
    /// Its request's priority (`OpenSessionRequest.priority`), its place in the order of
    /// opens, and whether an open of a lower priority number asked it to give its room up
    /// (its calls' answers say so, `VerifyResponse.give_way`, until it closes).
    priority: Option<i32>,
    opened: u64,
    give_way: bool,
}

#[derive(Debug, Default)]
struct Table {
    entries: HashMap<SessionId, Entry>,
    /// Sessions being opened (reserved, prefilling). A close takes the id out, and the open
    /// then fails instead of adding the session.
    opening: std::collections::HashSet<SessionId>,
    /// Ids closed before their open arrived, with the time of the close (oldest first): an
    /// open with one of them fails. Kept for the idle TTL, at most [`MAX_CLOSED_EARLY`].
    closed_early: std::collections::VecDeque<(SessionId, u64)>,
    reserved: usize,
    pool: PrefixPool,
    /// Sessions inserted so far: each entry's place in the order of opens.
    inserted: u64,
    /// Room an open asked a session to give up, held for it (see [`Claim`]).
    claim: Option<Claim>,
}

/// The room of a session asked to give way, held for the open that asked: until it (or an
/// open of a lower priority number) takes it, or [`CLAIM_MS`] after the open last asked,
/// others open only where they leave that open's capacity and a session free. Without it
/// the session's own coordinator, whose line does not hold the open that asked, would take
/// its room back at once.
#[derive(Debug, Clone, Copy)]
struct Claim {
    priority: i32,
    capacity: usize,
    until_ms: u64,
}

/// How long a claim holds without its open asking again: past the longest pause between a
/// coordinator's tries for room (one second).
const CLAIM_MS: u64 = 3_000;

/// Ids a worker remembers as closed before their open arrived. Only a caller that gave up on
/// an open leaves one (a rare event), so this bounds memory, not a working set.
const MAX_CLOSED_EARLY: usize = 4096;

impl Table {
    fn in_use(&self, id: &SessionId) -> bool {
        self.entries.contains_key(id) || self.opening.contains(id)
    }

    /// Forgets the close of `id` if one came before its open; whether it did.
    fn take_closed_early(&mut self, id: &SessionId) -> bool {
        let at = self.closed_early.iter().position(|(c, _)| c == id);
        at.and_then(|i| self.closed_early.remove(i)).is_some()
    }

    fn remember_closed_early(&mut self, id: SessionId, now: u64, ttl: u64) {
        while let Some(&(_, at)) = self.closed_early.front() {
            if now.saturating_sub(at) <= ttl && self.closed_early.len() < MAX_CLOSED_EARLY {
                break;
            }
            self.closed_early.pop_front();
        }
        self.closed_early.push_back((id, now));
    }

    /// Takes `id`'s entry out; its tokens leave the reservations and its cache goes to the
    /// prefix cache.
    fn remove(&mut self, id: &SessionId) -> bool {
        let Some(e) = self.entries.remove(id) else {
            return false;
        };
        self.reserved -= e.capacity;
        self.pool.finish(e.donor, e.session, e.capacity);
        true
    }
}

fn lock(table: &Mutex<Table>) -> MutexGuard<'_, Table> {
    // A panic while holding this lock cannot leave the table half-updated (every update is
    // a single insert/remove plus a counter), so a poisoned lock is still usable.
    table.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug)]
pub struct Sessions {
    limits: Limits,
    table: Arc<Mutex<Table>>,
    clock: Arc<dyn Clock>,
    /// This worker process, named on every call (random per start).
    instance: u64,
    expired: AtomicU64,
    /// Closes naming instance 0: opens their caller gave up on.
    abandoned_opens: AtomicU64,
}

/// Counters for Stats and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionStats {
    pub active: usize,
    pub reserved_tokens: usize,
    /// Finished sessions' KV tokens the prefix cache holds (within the KV budget too).
    pub prefix_cached_tokens: usize,
    pub expired: u64,
    /// Opens their caller gave up on and closed by the id it named (instance 0).
    pub abandoned_opens: u64,
}

impl Sessions {
    pub fn new(limits: Limits) -> Self {
        Self::with_clock(limits, Arc::new(SystemClock::new()))
    }

    pub fn with_clock(limits: Limits, clock: Arc<dyn Clock>) -> Self {
        // Never 0: a close naming instance 0 means "whichever instance holds the id".
        let instance = loop {
            let i: u64 = rand::rng().random();
            if i != 0 {
                break i;
            }
        };
        Self {
            limits,
            table: Arc::default(),
            clock,
            instance,
            expired: AtomicU64::new(0),
            abandoned_opens: AtomicU64::new(0),
        }
    }

    /// This worker process's instance id.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        lock(&self.table)
    }

    /// Turns the prefix cache on, holding finished sessions' caches of up to `cap` tokens,
    /// from which later sessions copy the rows `exact` allows.
    pub(crate) fn enable_prefix_cache(&self, cap: usize, exact: Exact) {
        self.lock().pool.enable(cap, exact);
    }

    pub fn prefix_cache_on(&self) -> bool {
        self.lock().pool.is_on()
    }

    /// Offers a session's prompt rows (`prompt`, just prefilled) to later opens, before its
    /// open answers: opens of the same prompt queued behind it copy them. The donor id goes
    /// to [`Reservation::insert`]; a session that never opens leaves a dead donor, which the
    /// next lookup that meets it drops.
    pub(crate) fn offer_prompt(
        &self,
        session: &Arc<Mutex<Session>>,
        prompt: &[u32],
    ) -> Option<u64> {
        let salt = session.lock().unwrap_or_else(|e| e.into_inner()).cache_salt;
        self.lock().pool.add_live(session, prompt, salt)
    }

    /// The session or finished cache of `salt` sharing the longest block prefix with
    /// `tokens`.
    pub(crate) fn prefix_source(&self, tokens: &[u32], salt: u64) -> Option<Source> {
        self.lock().pool.find(tokens, salt)
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// An open of `priority` and `capacity` was refused for room: holds the room it asks
    /// for (its [`Claim`], unless a more urgent open holds it) and asks the open session with
    /// the highest priority number above its own (then the latest opened) to give its room
    /// up, unless one asked before is still open. Sessions opened without a priority are
    /// never asked. Whether it asked one.
    pub fn ask_to_give_way(&self, priority: i32, capacity: usize) -> bool {
        let now = self.now_ms();
        let mut t = self.lock();
        let claim = t.claim.filter(|c| now < c.until_ms);
        if claim.is_none_or(|c| priority <= c.priority) {
            let until_ms = now + CLAIM_MS;
            t.claim = Some(Claim {
                priority,
                capacity,
                until_ms,
            });
        }
        if t.entries.values().any(|e| e.give_way) {
            return false;
        }
        let last = (t.entries.values_mut())
            .filter(|e| e.priority.is_some_and(|theirs| theirs > priority))
            .max_by_key(|e| (e.priority, e.opened));
        match last {
            Some(e) => {
                tracing::info!(
                    waiting = priority,
                    running = e.priority,
                    "asking a session to give its KV room up"
                );
                e.give_way = true;
                true
            }
            None => false,
        }
    }

    /// Whether session `id` was asked to give its room up (false for one not open).
    pub fn gives_way(&self, id: SessionId) -> bool {
        let t = self.lock();
        t.entries.get(&id).is_some_and(|e| e.give_way)
    }

    /// Reserves `capacity` KV tokens under the caller's id, or a fresh random one; the
    /// session is added by [`Reservation::insert`]. The reservation goes with the memory it
    /// stands for (a queued prefill holds it). A caller's id in use is refused, and one
    /// closed before this open arrived fails the open.
    pub fn reserve(
        &self,
        capacity: usize,
        id: Option<SessionId>,
    ) -> Result<Reservation, WorkerError> {
        self.reserve_ranked(capacity, id, None)
    }

    /// [`Sessions::reserve`] for an open of `priority` (`None`: none). While a [`Claim`]
    /// holds room for an open of a lower priority number, others take only what leaves it.
    pub fn reserve_ranked(
        &self,
        capacity: usize,
        id: Option<SessionId>,
        priority: Option<i32>,
    ) -> Result<Reservation, WorkerError> {
        let now = self.now_ms();
        let mut t = self.lock();
        let claim = t.claim.filter(|c| now < c.until_ms);
        // The claim's own open, or a more urgent one, takes the room (and ends the claim).
        let held = claim.filter(|c| priority.is_none_or(|p| p > c.priority));
        if let Some(id) = id {
            if t.in_use(&id) {
                return Err(WorkerError::SessionExists(id));
            }
            if t.take_closed_early(&id) {
                return Err(WorkerError::ClosedWhileOpening(id));
            }
        }
        // Opens in flight count: each holds its memory from here on.
        let sessions = t.entries.len() + t.opening.len();
        if sessions >= self.limits.max_sessions {
            return Err(WorkerError::SessionLimit(self.limits.max_sessions));
        }
        // Cached prefixes give way to sessions: they count as free here.
        let free = self.limits.kv_token_budget.saturating_sub(t.reserved);
        if capacity > free {
            return Err(WorkerError::KvBudget {
                requested: capacity,
                free,
            });
        }
        if let Some(c) = held
            && (sessions + 1 >= self.limits.max_sessions || capacity + c.capacity > free)
        {
            return Err(WorkerError::RoomClaimed(c.priority));
        }
        if claim.is_some() && held.is_none() {
            // The room is taken: a session asked for it and still open need not give way.
            t.claim = None;
            for e in t.entries.values_mut() {
                e.give_way = false;
            }
        }
        t.pool.evict_to(free - capacity);
        let id = id.unwrap_or_else(|| {
            loop {
                let id = SessionId::random();
                if !t.in_use(&id) {
                    break id;
                }
            }
        });
        t.reserved += capacity;
        t.opening.insert(id);
        Ok(Reservation {
            table: self.table.clone(),
            clock: self.clock.clone(),
            id,
            capacity,
            done: false,
        })
    }

    /// The session `id` opened by worker `instance` (this one, unless it restarted since).
    pub fn get(&self, id: SessionId, instance: u64) -> Result<Arc<Mutex<Session>>, WorkerError> {
        self.check_instance(instance)?;
        let t = self.lock();
        let entry = t.entries.get(&id).ok_or(WorkerError::SessionNotFound(id))?;
        entry.last_used.store(self.now_ms(), Ordering::Relaxed);
        Ok(entry.session.clone())
    }

    fn check_instance(&self, asked: u64) -> Result<(), WorkerError> {
        match asked == self.instance {
            true => Ok(()),
            false => Err(WorkerError::OtherInstance {
                asked,
                this: self.instance,
            }),
        }
    }

    /// Removes a session, returning whether it existed. A forward pass already running on it
    /// finishes on its own reference; the memory goes with the last one. A session still being
    /// opened is closed too: its open fails. Instance 0 stands for this one, and a close so
    /// named of an id not seen yet fails the open of that id should it arrive within the TTL
    /// (the caller gave up on an open whose answer it never saw).
    pub fn close(&self, id: SessionId, instance: u64) -> bool {
        match instance {
            0 => _ = self.abandoned_opens.fetch_add(1, Ordering::Relaxed),
            _ if self.check_instance(instance).is_err() => return false,
            _ => {}
        }
        let now = self.now_ms();
        let mut t = self.lock();
        if t.remove(&id) {
            return true;
        }
        if t.opening.remove(&id) {
            return true;
        }
        if instance == 0 {
            t.remember_closed_early(id, now, self.limits.ttl.as_millis() as u64);
        }
        false
    }

    /// Closes sessions idle for longer than the TTL that no call is using right now.
    pub fn expire_idle(&self) -> usize {
        let ttl = self.limits.ttl.as_millis() as u64;
        let now = self.now_ms();
        let mut t = self.lock();
        let stale: Vec<SessionId> = t
            .entries
            .iter()
            .filter(|(_, e)| {
                now.saturating_sub(e.last_used.load(Ordering::Relaxed)) > ttl
                    && Arc::strong_count(&e.session) == 1
            })
            .map(|(&id, _)| id)
            .collect();
        for id in &stale {
            t.remove(id);
        }
        self.expired
            .fetch_add(stale.len() as u64, Ordering::Relaxed);
        stale.len()
    }

    pub fn stats(&self) -> SessionStats {
        let t = self.lock();
        SessionStats {
            active: t.entries.len(),
            reserved_tokens: t.reserved,
            prefix_cached_tokens: t.pool.held(),
            expired: self.expired.load(Ordering::Relaxed),
            abandoned_opens: self.abandoned_opens.load(Ordering::Relaxed),
        }
    }
}

/// KV tokens and an id held for a session being opened; released on drop unless the session
/// is inserted.
#[derive(Debug)]
pub struct Reservation {
    table: Arc<Mutex<Table>>,
    clock: Arc<dyn Clock>,
    id: SessionId,
    capacity: usize,
    done: bool,
}

impl Reservation {
    /// Adds the session under the reserved id; the reservation becomes the session's, and
    /// `donor` (its prompt's place in the prefix cache, [`Sessions::offer_prompt`]) goes
    /// with it. Fails if the session was closed while it opened (the reservation is then
    /// released).
    pub fn insert(
        mut self,
        session: Arc<Mutex<Session>>,
        donor: Option<u64>,
        priority: Option<i32>,
    ) -> Result<SessionId, WorkerError> {
        let id = self.id;
        let mut t = lock(&self.table);
        if !t.opening.remove(&id) {
            return Err(WorkerError::ClosedWhileOpening(id));
        }
        t.inserted += 1;
        let opened = t.inserted;
        t.entries.insert(
            id,
            Entry {
                session,
                capacity: self.capacity,
                last_used: AtomicU64::new(self.clock.now_ms()),
                donor,
                priority,
                opened,
                give_way: false,
            },
        );
        self.done = true;
        Ok(id)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            let mut t = lock(&self.table);
            t.reserved -= self.capacity;
            t.opening.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests;
