//! The session table: one KV cache per request, bounded by a session limit and a KV-token
//! budget (capacity is reserved when a session opens), closed by the idle TTL when its
//! coordinator goes away. A caller may name the session it opens, and close it by that name
//! before the open has answered (or even arrived), so that an open whose caller went away
//! leaks nothing. The table also holds the prefix cache (`prefix_cache`): sessions'
//! rows that later sessions start from, finished ones counted against the same budget.

use crate::WorkerError;
use crate::prefix_cache::{PrefixPool, Source};
use duet_engine::KvCache;
use duet_engine::bias::LogitBias;
use duet_engine::penalties::{MinTokens, Penalties, PromptTokens};
use duet_engine::sampling::SamplingParams;
use duet_engine::structured::Constraint;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
}

impl Session {
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
            false => path.len(),
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
    give_way: AtomicBool,
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

    /// Turns the prefix cache on, holding finished sessions' caches of up to `cap` tokens.
    pub fn enable_prefix_cache(&self, cap: usize) {
        self.lock().pool.enable(cap);
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
        let asked = |e: &&Entry| e.give_way.load(Ordering::Acquire);
        if t.entries.values().any(|e| asked(&e)) {
            return false;
        }
        let last = (t.entries.values())
            .filter(|e| e.priority.is_some_and(|theirs| theirs > priority))
            .max_by_key(|e| (e.priority, e.opened));
        match last {
            Some(e) => {
                tracing::info!(
                    waiting = priority,
                    running = e.priority,
                    "asking a session to give its KV room up"
                );
                e.give_way.store(true, Ordering::Release);
                true
            }
            None => false,
        }
    }

    /// Whether session `id` was asked to give its room up (false for one not open).
    pub fn gives_way(&self, id: SessionId) -> bool {
        let t = self.lock();
        (t.entries.get(&id)).is_some_and(|e| e.give_way.load(Ordering::Acquire))
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
            for e in t.entries.values() {
                e.give_way.store(false, Ordering::Release);
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
                give_way: AtomicBool::new(false),
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
mod tests {
    use super::*;
    use crate::prefix_cache::Source;
    use duet_engine::testing::TinyModel;
    use duet_engine::{LoadOptions, Model};

    fn session(model: &Model, capacity: usize) -> Arc<Mutex<Session>> {
        Arc::new(Mutex::new(Session {
            cache: model.new_cache(capacity).unwrap(),
            sampling: SamplingParams::greedy(),
            rng: duet_engine::sampling::rng_for(0),
            tree: Vec::new(),
            last_call: 0,
            extra: Default::default(),
            logprobs: None,
            penalties: Default::default(),
            completion_from: 0,
            prompt_tokens: Default::default(),
            logit_bias: Default::default(),
            min_tokens: Default::default(),
            constraint: None,
            cache_salt: 0,
        }))
    }

    /// Sessions of at most 4 and `kv_token_budget` tokens, with a prefix cache of `cap`.
    fn with_prefix_cache(kv_token_budget: usize, cap: usize) -> Sessions {
        let sessions = Sessions::new(Limits {
            max_sessions: 4,
            kv_token_budget,
            ttl: Duration::from_secs(60),
        });
        sessions.enable_prefix_cache(cap);
        sessions
    }

    fn tiny() -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        TinyModel::default().write(&path).unwrap();
        let model = Model::load(
            &path,
            &LoadOptions {
                device: duet_engine::select_device("cpu").unwrap(),
                transcode_q5_0: false,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        (dir, model)
    }

    #[test]
    fn limits_budget_and_close() {
        let (_dir, model) = tiny();
        let sessions = Sessions::new(Limits {
            max_sessions: 2,
            kv_token_budget: 100,
            ttl: Duration::from_secs(60),
        });
        let me = sessions.instance();
        let a = sessions
            .reserve(60, None)
            .unwrap()
            .insert(session(&model, 60), None, None)
            .unwrap();
        assert!(matches!(
            sessions.reserve(50, None),
            Err(WorkerError::KvBudget { free: 40, .. })
        ));
        // A dropped reservation gives its tokens back.
        drop(sessions.reserve(40, None).unwrap());
        let b = sessions
            .reserve(40, None)
            .unwrap()
            .insert(session(&model, 40), None, None)
            .unwrap();
        assert!(matches!(
            sessions.reserve(0, None),
            Err(WorkerError::SessionLimit(2))
        ));
        // Opens still prefilling count against the limit too.
        assert!(sessions.close(b, me));
        let opening = sessions.reserve(40, None).unwrap();
        assert!(matches!(
            sessions.reserve(0, None),
            Err(WorkerError::SessionLimit(2))
        ));
        let b = opening.insert(session(&model, 40), None, None).unwrap();
        assert_eq!(sessions.stats().reserved_tokens, 100);
        // Another instance's call (this worker restarted since) finds nothing.
        assert!(matches!(
            sessions.get(b, me ^ 1),
            Err(WorkerError::OtherInstance { .. })
        ));
        assert!(!sessions.close(a, me ^ 1));
        assert!(sessions.close(a, me));
        assert!(!sessions.close(a, me));
        assert!(matches!(
            sessions.get(a, me),
            Err(WorkerError::SessionNotFound(_))
        ));
        assert!(sessions.get(b, me).is_ok());
        assert_eq!(sessions.stats().active, 1);
        assert_eq!(sessions.stats().reserved_tokens, 40);
    }

    /// A caller's name for its session: closing it (instance 0) while the session opens fails
    /// the open, before the open arrives fails the open when it comes (within the TTL), and
    /// after it opened closes it; an id in use is refused.
    #[test]
    fn a_named_session_closes_before_its_open_answers() {
        let (_dir, model) = tiny();
        let (clock, sessions) = table_on_a_manual_clock();
        let (a, b, c) = (SessionId([1; 16]), SessionId([2; 16]), SessionId([3; 16]));
        // Closed while it opens: the open fails and gives its tokens back.
        let opening = sessions.reserve(10, Some(a)).unwrap();
        assert!(matches!(
            sessions.reserve(10, Some(a)),
            Err(WorkerError::SessionExists(_))
        ));
        assert!(sessions.close(a, 0));
        assert!(matches!(
            opening.insert(session(&model, 10), None, None),
            Err(WorkerError::ClosedWhileOpening(_))
        ));
        assert_eq!(sessions.stats().reserved_tokens, 0);
        // Closed before its open arrived: the open fails, once.
        assert!(!sessions.close(b, 0));
        assert!(matches!(
            sessions.reserve(10, Some(b)),
            Err(WorkerError::ClosedWhileOpening(_))
        ));
        let opened = sessions.reserve(10, Some(b)).unwrap();
        assert_eq!(opened.insert(session(&model, 10), None, None).unwrap(), b);
        assert!(sessions.close(b, 0));
        // Remembered for the TTL only.
        assert!(!sessions.close(c, 0));
        clock.0.store(101, Ordering::Relaxed);
        assert!(!sessions.close(SessionId([4; 16]), 0));
        assert!(sessions.reserve(10, Some(c)).is_ok());
        assert_eq!(sessions.stats().active, 0);
        assert_eq!(sessions.stats().abandoned_opens, 5);
    }

    /// Time that moves only when the test says.
    #[derive(Debug, Default)]
    struct ManualClock(AtomicU64);

    impl Clock for ManualClock {
        fn now_ms(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }
    }

    /// Four sessions, 100 tokens, a 100 ms TTL, and the clock that drives it.
    fn table_on_a_manual_clock() -> (Arc<ManualClock>, Sessions) {
        let clock = Arc::new(ManualClock::default());
        let limits = Limits {
            max_sessions: 4,
            kv_token_budget: 100,
            ttl: Duration::from_millis(100),
        };
        (clock.clone(), Sessions::with_clock(limits, clock))
    }

    /// An open refused for room asks the session of the highest priority number above its
    /// own (then the latest) to give way, one at a time; sessions without a priority are
    /// never asked. The room is held for it: a less urgent open (or one without a
    /// priority) does not take it, the open itself does, and the hold lapses when the open
    /// stops asking.
    #[test]
    fn a_refused_open_asks_a_session_of_a_higher_number_and_its_room_is_held_for_it() {
        let (_dir, model) = tiny();
        let (clock, sessions) = table_on_a_manual_clock();
        let open = |capacity, priority| {
            let reserved = sessions.reserve_ranked(capacity, None, priority).unwrap();
            reserved
                .insert(session(&model, capacity), None, priority)
                .unwrap()
        };
        let none = open(20, None);
        let urgent = open(20, Some(0));
        let early = open(20, Some(7));
        let late = open(40, Some(7));
        let refused = sessions.reserve_ranked(30, None, Some(3)).map(|_| ());
        assert_eq!(
            refused.unwrap_err().to_string(),
            "session limit reached (4 open sessions)"
        );
        assert!(sessions.ask_to_give_way(3, 30));
        let asked = [none, urgent, early, late].map(|id| sessions.gives_way(id));
        assert_eq!(asked, [false, false, false, true]);
        // One at a time.
        assert!(!sessions.ask_to_give_way(3, 30));
        assert!(sessions.close(late, sessions.instance()));
        // The room is held for the open of priority 3: not for one of 5, nor one without.
        for priority in [Some(5), None] {
            let held = sessions.reserve_ranked(10, None, priority).map(|_| ());
            let why = "the room freed here is held for a request of priority 3";
            assert_eq!(held.unwrap_err().to_string(), why);
        }
        let taken = sessions.reserve_ranked(30, None, Some(3)).unwrap();
        drop(taken);
        // Taken, the hold ends.
        sessions.reserve_ranked(10, None, None).map(drop).unwrap();
        assert!(sessions.ask_to_give_way(1, 10));
        assert!(sessions.gives_way(early));
        let held = sessions.reserve_ranked(10, None, Some(2)).map(|_| ());
        assert!(matches!(held, Err(WorkerError::RoomClaimed(1))), "{held:?}");
        // The open that asked found room before the session asked closed: that one need
        // not give way any more.
        sessions
            .reserve_ranked(10, None, Some(1))
            .map(drop)
            .unwrap();
        assert!(!sessions.gives_way(early));
        // A hold lapses CLAIM_MS after its open last asked.
        assert!(sessions.ask_to_give_way(1, 10));
        assert!(sessions.reserve_ranked(10, None, Some(2)).is_err());
        clock.0.store(CLAIM_MS, Ordering::Relaxed);
        sessions
            .reserve_ranked(10, None, Some(2))
            .map(drop)
            .unwrap();
    }

    #[test]
    fn idle_sessions_expire_unless_in_use() {
        let (_dir, model) = tiny();
        let (clock, sessions) = table_on_a_manual_clock();
        let me = sessions.instance();
        let busy = sessions
            .reserve(10, None)
            .unwrap()
            .insert(session(&model, 10), None, None)
            .unwrap();
        let idle = sessions
            .reserve(10, None)
            .unwrap()
            .insert(session(&model, 10), None, None)
            .unwrap();
        let held = sessions.get(busy, me).unwrap();
        clock.0.store(100, Ordering::Relaxed);
        assert_eq!(sessions.expire_idle(), 0, "idle for exactly the TTL: kept");
        clock.0.store(101, Ordering::Relaxed);
        // Both are past the TTL, but a call holds `busy`.
        assert_eq!(sessions.expire_idle(), 1);
        assert!(sessions.get(idle, me).is_err());
        drop(held);
        // Its last use was the `get` at 0 ms; a call now, at 101 ms, refreshes it.
        sessions.get(busy, me).unwrap();
        clock.0.store(201, Ordering::Relaxed);
        assert_eq!(sessions.expire_idle(), 0);
        clock.0.store(202, Ordering::Relaxed);
        assert_eq!(sessions.expire_idle(), 1);
        assert_eq!(sessions.stats().active, 0);
        assert_eq!(sessions.stats().expired, 2);
        assert_eq!(sessions.stats().reserved_tokens, 0);
    }

    /// Ids are random: nothing about one tells the next, and two workers (or one restarted)
    /// do not repeat each other's.
    #[test]
    fn session_ids_are_random_and_instances_differ() {
        let (_dir, model) = tiny();
        let limits = Limits {
            max_sessions: 64,
            kv_token_budget: 64,
            ttl: Duration::from_secs(60),
        };
        let (a, b) = (Sessions::new(limits), Sessions::new(limits));
        assert_ne!(a.instance(), b.instance());
        let ids: std::collections::HashSet<SessionId> = (0..32)
            .map(|_| {
                a.reserve(1, None)
                    .unwrap()
                    .insert(session(&model, 1), None, None)
                    .unwrap()
            })
            .collect();
        assert_eq!(ids.len(), 32);
        let first = ids.iter().next().unwrap();
        // Random bytes: about half the bits differ between any two ids.
        for other in ids.iter().skip(1) {
            let differ: u32 = first
                .0
                .iter()
                .zip(other.0)
                .map(|(x, y)| (x ^ y).count_ones())
                .sum();
            assert!((20..=108).contains(&differ), "{first} vs {other}");
        }
        assert!(SessionId::from_wire(&[0; 8]).is_err());
        assert_eq!(SessionId::from_wire(&first.0).unwrap(), *first);
    }

    /// A session of `capacity` whose cache holds `tokens`.
    fn fed(model: &Model, capacity: usize, tokens: &[u32]) -> Arc<Mutex<Session>> {
        let s = session(model, capacity);
        model
            .forward(
                &mut s.lock().unwrap().cache,
                tokens,
                duet_engine::LogitsFor::None,
            )
            .unwrap();
        s
    }

    /// Closed sessions' caches stay for later sessions within the cap, count against the
    /// KV budget (reported apart), and go first, least recently used, when a session or a
    /// newer cache needs the room; a cache bigger than the cap, or holding less than one
    /// whole block, is not kept.
    #[test]
    fn cached_prefixes_give_way_to_sessions() {
        let (_dir, model) = tiny();
        let sessions = with_prefix_cache(100, 50);
        let me = sessions.instance();
        let (x, y): (Vec<u32>, Vec<u32>) = ((1..=33).collect(), (101..=133).collect());
        let open = |capacity: usize, tokens: &[u32]| {
            let s = fed(&model, capacity, tokens);
            let donor = sessions.offer_prompt(&s, tokens);
            sessions
                .reserve(capacity, None)
                .unwrap()
                .insert(s, donor, None)
                .unwrap()
        };
        let found = |tokens: &[u32]| match sessions.prefix_source(tokens, 0) {
            Some(Source::Finished(c)) => Some(c.capacity()),
            Some(Source::Live(_)) => Some(0),
            None => None,
        };
        let a = open(40, &x);
        assert_eq!(found(&x), Some(0), "an open session's prompt");
        assert!(sessions.close(a, me));
        assert_eq!(found(&x), Some(40));
        assert_eq!(sessions.stats().prefix_cached_tokens, 40);
        assert_eq!(sessions.stats().reserved_tokens, 0);
        // y's cache needs room under the cap of 50: x's goes.
        let b = open(40, &y);
        assert!(sessions.close(b, me));
        assert_eq!((found(&x), found(&y)), (None, Some(40)));
        // A session needing 70 of the 100 tokens pushes y's out.
        let c = sessions.reserve(70, None).unwrap();
        assert_eq!(
            (found(&y), sessions.stats().prefix_cached_tokens),
            (None, 0)
        );
        drop(c);
        // Bigger than the cap, or less than a block: not kept.
        let d = open(60, &x);
        assert!(sessions.close(d, me));
        let e = open(40, &x[..31]);
        assert!(sessions.close(e, me));
        assert_eq!(
            (found(&x), sessions.stats().prefix_cached_tokens),
            (None, 0)
        );
        // Closed while a pass still holds it: counted, and kept once the pass lets go.
        let f = open(40, &x);
        let held = sessions.get(f, me).unwrap();
        assert!(sessions.close(f, me));
        assert_eq!(sessions.stats().prefix_cached_tokens, 40);
        assert_eq!(found(&x), None);
        drop(held);
        assert_eq!(found(&x), Some(40));
    }

    /// A salted session's prompt, and its cache once closed, are found by sessions of its
    /// salt only, an unsalted one's by unsalted ones only; a cache does not push out another
    /// salt's that it covers.
    #[test]
    fn a_prefix_is_found_under_its_salt_only() {
        let (_dir, model) = tiny();
        let sessions = with_prefix_cache(200, 100);
        let me = sessions.instance();
        let x: Vec<u32> = (1..=33).collect();
        let open = |salt| {
            let s = fed(&model, 40, &x);
            s.lock().unwrap().cache_salt = salt;
            let donor = sessions.offer_prompt(&s, &x);
            sessions
                .reserve(40, None)
                .unwrap()
                .insert(s, donor, None)
                .unwrap()
        };
        let found = |salt| sessions.prefix_source(&x, salt).is_some();
        let a = open(7);
        assert_eq!((found(7), found(0), found(8)), (true, false, false));
        assert!(sessions.close(a, me));
        assert_eq!((found(7), found(0)), (true, false));
        let b = open(0);
        assert!(sessions.close(b, me));
        assert_eq!((found(7), found(0)), (true, true));
    }

    /// A later session copies a cache's rows only as far as they sit at their tokens'
    /// places: never a tree's alternative, whose keys are those of its parent's next position,
    /// from a live session or from a closed one.
    #[test]
    fn no_session_starts_from_a_trees_alternative() {
        let (_dir, model) = tiny();
        let sessions = with_prefix_cache(200, 100);
        let prompt: Vec<u32> = (1..=40).collect();
        let s = fed(&model, 50, &prompt);
        {
            let mut guard = s.lock().unwrap();
            // The Verify's appended 41, then drafts 42 (after 41) and 99 (also after 41).
            let mut tree = [duet_engine::SequenceInput {
                cache: &mut guard.cache,
                tokens: &[41, 42, 99],
                logits: duet_engine::LogitsFor::None,
                extra: None,
                greedy: false,
                parents: &[0, 0, 0],
            }];
            model.forward_batch(&mut tree).unwrap();
            guard.tree = vec![(41, 40), (42, 40)];
            assert_eq!(guard.in_place(), 42);
        }
        let donor = sessions.offer_prompt(&s, &prompt);
        let id = sessions
            .reserve(50, None)
            .unwrap()
            .insert(s, donor, None)
            .unwrap();
        let wanted: Vec<u32> = (1..=41).chain([42, 99, 7]).collect();
        let copied = || {
            let mut cache = model.new_cache(50).unwrap();
            let source = sessions.prefix_source(&wanted, 0).expect("a donor");
            source.copy_into(&mut cache, &wanted).unwrap()
        };
        assert_eq!(copied(), 42, "from the live session");
        assert!(sessions.close(id, sessions.instance()));
        assert_eq!(copied(), 42, "from its closed cache");
    }

    #[test]
    fn a_tree_path_is_kept_once_and_only_where_the_tokens_take_it() {
        let (_dir, model) = tiny();
        let s = session(&model, 16);
        let mut s = s.lock().unwrap();
        // Cache [1, 2] then the tree: 3 (appended), 10 and 20 after 3, 11 after 10.
        let nodes = [3, 10, 20, 11];
        let mut tree = [duet_engine::SequenceInput {
            cache: &mut s.cache,
            tokens: &[1, 2],
            logits: duet_engine::LogitsFor::None,
            extra: None,
            greedy: false,
            parents: &[],
        }];
        model.forward_batch(&mut tree).unwrap();
        tree[0].tokens = &nodes;
        tree[0].parents = &[0, 0, 0, 1];
        model.forward_batch(&mut tree).unwrap();
        let remembered = vec![(3, 2), (4, 2), (5, 3)];
        // 20 then 11: 20 is held, 11 is not after it; the last appended token is fed.
        s.tree = remembered.clone();
        assert_eq!(s.reuse_tree(3, &[20, 11, 7]), 1);
        assert_eq!(s.cache.tokens(), &[1, 2, 3, 20]);
        assert!(s.tree.is_empty(), "a tree serves the next call only");
        assert_eq!(s.reuse_tree(3, &[20, 7]), 0);
        // Rebuilt: 10 then 11 (the whole path), 99 fed.
        s.cache.truncate(2).unwrap();
        let mut again = [duet_engine::SequenceInput {
            cache: &mut s.cache,
            tokens: &nodes,
            logits: duet_engine::LogitsFor::None,
            extra: None,
            greedy: false,
            parents: &[0, 0, 0, 1],
        }];
        model.forward_batch(&mut again).unwrap();
        s.tree = remembered;
        assert_eq!(s.reuse_tree(3, &[10, 11, 99]), 2);
        assert_eq!(s.cache.tokens(), &[1, 2, 3, 10, 11]);
    }

    #[test]
    fn rewind_checks_keep_and_capacity() {
        let (_dir, model) = tiny();
        let s = session(&model, 8);
        let mut s = s.lock().unwrap();
        model
            .forward(&mut s.cache, &[1, 2, 3], duet_engine::LogitsFor::None)
            .unwrap();
        assert!(s.rewind(4, 1, 0).is_err());
        assert!(s.rewind(2, 5, 2).is_err());
        s.rewind(2, 5, 1).unwrap();
        assert_eq!(s.cache.len(), 2);
    }
}
