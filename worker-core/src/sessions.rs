//! The session table: one KV cache per request, bounded by a session limit and a KV-token
//! budget (capacity is reserved when a session opens), closed by the idle TTL when its
//! coordinator goes away.

use crate::WorkerError;
use duet_engine::KvCache;
use duet_engine::sampling::SamplingParams;
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
}

impl Session {
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
}

#[derive(Debug, Default)]
struct Table {
    entries: HashMap<u64, Entry>,
    reserved: usize,
}

#[derive(Debug)]
pub struct Sessions {
    limits: Limits,
    table: Mutex<Table>,
    clock: Arc<dyn Clock>,
    next_id: AtomicU64,
    expired: AtomicU64,
}

/// Counters for Stats and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionStats {
    pub active: usize,
    pub reserved_tokens: usize,
    pub expired: u64,
}

impl Sessions {
    pub fn new(limits: Limits) -> Self {
        Self::with_clock(limits, Arc::new(SystemClock::new()))
    }

    pub fn with_clock(limits: Limits, clock: Arc<dyn Clock>) -> Self {
        Self {
            limits,
            table: Mutex::new(Table::default()),
            clock,
            // Ids start from the process id, so a restarted worker is unlikely to hand out an
            // id a coordinator still holds from before the restart.
            next_id: AtomicU64::new(u64::from(std::process::id()) << 32 | 1),
            expired: AtomicU64::new(0),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding this lock cannot leave the table half-updated (every update
        // is a single insert/remove plus a counter), so a poisoned lock is still usable.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Reserves `capacity` KV tokens; the session is added by [`Sessions::insert`].
    pub fn reserve(&self, capacity: usize) -> Result<Reservation<'_>, WorkerError> {
        let mut t = self.lock();
        if t.entries.len() >= self.limits.max_sessions {
            return Err(WorkerError::SessionLimit(self.limits.max_sessions));
        }
        if t.reserved + capacity > self.limits.kv_token_budget {
            return Err(WorkerError::KvBudget {
                requested: capacity,
                free: self.limits.kv_token_budget.saturating_sub(t.reserved),
            });
        }
        t.reserved += capacity;
        Ok(Reservation {
            sessions: self,
            capacity,
            done: false,
        })
    }

    pub fn get(&self, id: u64) -> Result<Arc<Mutex<Session>>, WorkerError> {
        let t = self.lock();
        let entry = t.entries.get(&id).ok_or(WorkerError::SessionNotFound(id))?;
        entry.last_used.store(self.now_ms(), Ordering::Relaxed);
        Ok(entry.session.clone())
    }

    /// Removes a session, returning whether it existed. A forward pass already running on it
    /// finishes on its own reference; the memory goes with the last one.
    pub fn close(&self, id: u64) -> bool {
        let mut t = self.lock();
        match t.entries.remove(&id) {
            Some(e) => {
                t.reserved -= e.capacity;
                true
            }
            None => false,
        }
    }

    /// Closes sessions idle for longer than the TTL that no call is using right now.
    pub fn expire_idle(&self) -> usize {
        let ttl = self.limits.ttl.as_millis() as u64;
        let now = self.now_ms();
        let mut t = self.lock();
        let stale: Vec<u64> = t
            .entries
            .iter()
            .filter(|(_, e)| {
                now.saturating_sub(e.last_used.load(Ordering::Relaxed)) > ttl
                    && Arc::strong_count(&e.session) == 1
            })
            .map(|(&id, _)| id)
            .collect();
        for id in &stale {
            if let Some(e) = t.entries.remove(id) {
                t.reserved -= e.capacity;
            }
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
            expired: self.expired.load(Ordering::Relaxed),
        }
    }
}

/// KV tokens held for a session being opened; released on drop unless the session is inserted.
#[derive(Debug)]
pub struct Reservation<'a> {
    sessions: &'a Sessions,
    capacity: usize,
    done: bool,
}

impl Reservation<'_> {
    /// Adds the session under a fresh id; the reservation becomes the session's.
    pub fn insert(mut self, session: Arc<Mutex<Session>>) -> u64 {
        let s = self.sessions;
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        let mut t = s.lock();
        t.entries.insert(
            id,
            Entry {
                session,
                capacity: self.capacity,
                last_used: AtomicU64::new(s.now_ms()),
            },
        );
        self.done = true;
        id
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.sessions.lock().reserved -= self.capacity;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_engine::testing::TinyModel;
    use duet_engine::{LoadOptions, Model};

    fn session(model: &Model, capacity: usize) -> Arc<Mutex<Session>> {
        Arc::new(Mutex::new(Session {
            cache: model.new_cache(capacity).unwrap(),
            sampling: SamplingParams::greedy(),
            rng: duet_engine::sampling::rng_for(0),
        }))
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
        let a = sessions.reserve(60).unwrap().insert(session(&model, 60));
        assert!(matches!(
            sessions.reserve(50),
            Err(WorkerError::KvBudget { free: 40, .. })
        ));
        // A dropped reservation gives its tokens back.
        drop(sessions.reserve(40).unwrap());
        let b = sessions.reserve(40).unwrap().insert(session(&model, 40));
        assert!(matches!(
            sessions.reserve(0),
            Err(WorkerError::SessionLimit(2))
        ));
        assert_eq!(sessions.stats().reserved_tokens, 100);
        assert!(sessions.close(a));
        assert!(!sessions.close(a));
        assert!(matches!(
            sessions.get(a),
            Err(WorkerError::SessionNotFound(_))
        ));
        assert!(sessions.get(b).is_ok());
        assert_eq!(sessions.stats().active, 1);
        assert_eq!(sessions.stats().reserved_tokens, 40);
    }

    /// Time that moves only when the test says.
    #[derive(Debug, Default)]
    struct ManualClock(AtomicU64);

    impl Clock for ManualClock {
        fn now_ms(&self) -> u64 {
            self.0.load(Ordering::Relaxed)
        }
    }

    #[test]
    fn idle_sessions_expire_unless_in_use() {
        let (_dir, model) = tiny();
        let clock = Arc::new(ManualClock::default());
        let sessions = Sessions::with_clock(
            Limits {
                max_sessions: 4,
                kv_token_budget: 100,
                ttl: Duration::from_millis(100),
            },
            clock.clone(),
        );
        let busy = sessions.reserve(10).unwrap().insert(session(&model, 10));
        let idle = sessions.reserve(10).unwrap().insert(session(&model, 10));
        let held = sessions.get(busy).unwrap();
        clock.0.store(100, Ordering::Relaxed);
        assert_eq!(sessions.expire_idle(), 0, "idle for exactly the TTL: kept");
        clock.0.store(101, Ordering::Relaxed);
        // Both are past the TTL, but a call holds `busy`.
        assert_eq!(sessions.expire_idle(), 1);
        assert!(sessions.get(idle).is_err());
        drop(held);
        // Its last use was the `get` at 0 ms; a call now, at 101 ms, refreshes it.
        sessions.get(busy).unwrap();
        clock.0.store(201, Ordering::Relaxed);
        assert_eq!(sessions.expire_idle(), 0);
        clock.0.store(202, Ordering::Relaxed);
        assert_eq!(sessions.expire_idle(), 1);
        assert_eq!(sessions.stats().active, 0);
        assert_eq!(sessions.stats().expired, 2);
        assert_eq!(sessions.stats().reserved_tokens, 0);
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
