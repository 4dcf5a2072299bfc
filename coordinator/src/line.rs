//! A line of waiting requests, the lowest `priority` first (vLLM's), then in order of
//! arrival: the wait for a place among the running requests (`admission.rs`) and the wait
//! for KV room on the target replicas (`room.rs`) both go by it. A request's arrival is
//! when it came to the server, so one that gave its room up (preemption) and waits again
//! goes before those of its priority that came after it. Only the first in line
//! goes on to take what it waits for; it steps back when one that goes before it joins. A
//! place is a value, so a request whose caller goes away (its future dropped) leaves the
//! line at once, and the next moves up.
//!
//! A line may bound what each tenant (bearer token) holds (admission's
//! `max_concurrent_requests_per_token`): a request whose tenant holds that many is passed
//! over, and those behind it go first, until one of its tenant's places is given back.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Where a request stands in a line: its priority, then when it arrived.
pub type Rank = (i32, Instant);

#[derive(Debug, Default)]
pub struct Line {
    state: Mutex<State>,
    /// Wakes the waiting requests when the line changes.
    moved: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// Each waiting request's rank and join number (apart requests that arrived at once),
    /// the first first, and its tenant.
    waiting: BTreeMap<(Rank, u64), u64>,
    joins: u64,
    /// What each tenant holds, and the most it may (0: no bound).
    held: HashMap<u64, usize>,
    cap: usize,
}

impl State {
    fn may_take(&self, tenant: u64) -> bool {
        self.cap == 0 || self.held.get(&tenant).copied().unwrap_or(0) < self.cap
    }

    /// Counts one more taken by `tenant`, where the line bounds tenants.
    fn count(&mut self, tenant: u64) {
        if self.cap > 0 {
            *self.held.entry(tenant).or_default() += 1;
        }
    }

    /// The first waiting request whose tenant may take one more.
    fn first(&self) -> Option<&(Rank, u64)> {
        let mut waiting = self.waiting.iter();
        waiting
            .find(|(_, tenant)| self.may_take(**tenant))
            .map(|(key, _)| key)
    }
}

/// A request's place in a line, given up as it is dropped.
#[derive(Debug)]
pub struct InLine<'a> {
    line: &'a Line,
    key: (Rank, u64),
}

impl Line {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A line whose tenants may each hold at most `cap` (0: no bound).
    pub fn with_cap(cap: usize) -> Self {
        let line = Self::default();
        line.state().cap = cap;
        line
    }

    pub fn is_empty(&self) -> bool {
        self.state().waiting.is_empty()
    }

    /// `take()`'s yield, taken as `tenant`'s, where a request of `tenant` may go without
    /// waiting: nobody who may go waits, and its tenant holds less than the bound. One
    /// look and one count, so that requests of one tenant arriving at once do not pass its
    /// bound together.
    pub fn pass<T>(&self, tenant: u64, take: impl FnOnce() -> Option<T>) -> Option<T> {
        let mut state = self.state();
        if state.first().is_some() || !state.may_take(tenant) {
            return None;
        }
        let taken = take()?;
        state.count(tenant);
        Some(taken)
    }

    /// `tenant` took what the line waits for; [`Line::give_back`] returns it.
    pub fn take(&self, tenant: u64) {
        self.state().count(tenant);
    }

    pub fn give_back(&self, tenant: u64) {
        {
            let mut state = self.state();
            // Unbounded, nothing is counted and nobody waits on a tenant's count.
            let Some(n) = state.held.get_mut(&tenant) else {
                return;
            };
            *n -= 1;
            if *n == 0 {
                state.held.remove(&tenant);
            }
        }
        // A request of that tenant passed over may now go.
        self.moved.notify_waiters();
    }

    /// Whether `tenant` holds as much as the line allows it.
    pub fn at_cap(&self, tenant: u64) -> bool {
        !self.state().may_take(tenant)
    }

    /// A place for a request of `rank`, behind those of a lower priority and those of its
    /// own that arrived before.
    pub fn join(&self, rank: Rank) -> InLine<'_> {
        self.join_as(rank, 0)
    }

    /// [`Line::join`] for a request of `tenant`.
    pub fn join_as(&self, rank: Rank, tenant: u64) -> InLine<'_> {
        let key = {
            let mut state = self.state();
            state.joins += 1;
            let key = (rank, state.joins);
            state.waiting.insert(key, tenant);
            key
        };
        self.moved.notify_waiters();
        InLine { line: self, key }
    }
}

impl InLine<'_> {
    pub fn is_first(&self) -> bool {
        self.line.state().first() == Some(&self.key)
    }

    /// Resolves once this request is first in line.
    pub async fn first(&self) {
        self.until(|first| first).await;
    }

    /// Resolves once it is not (one that goes before it joined).
    pub async fn passed(&self) {
        self.until(|first| !first).await;
    }

    async fn until(&self, done: impl Fn(bool) -> bool) {
        loop {
            // Listening before looking: a change between the two still wakes it.
            let moved = self.line.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            if done(self.is_first()) {
                return;
            }
            moved.await;
        }
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.line.state().waiting.remove(&self.key);
        self.line.moved.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lowest priority goes first, then the first to arrive; one that joins before the
    /// first passes it; leaving moves the next up.
    #[tokio::test]
    async fn the_line_goes_by_priority_then_arrival() {
        let line = Line::default();
        let now = Instant::now();
        let a = line.join((0, now));
        let b = line.join((0, now));
        assert!(a.is_first() && !b.is_first());
        let urgent = {
            let passed = a.passed();
            tokio::pin!(passed);
            assert!(futures::poll!(passed.as_mut()).is_pending());
            let urgent = line.join((-1, now));
            passed.await;
            urgent
        };
        assert!(urgent.is_first() && !a.is_first());
        drop(urgent);
        a.first().await;
        drop(a);
        // One that arrived before `b` joins after it (it gave its room up): it goes first.
        let back = line.join((0, now - std::time::Duration::from_millis(1)));
        assert!(back.is_first() && !b.is_first());
        drop(back);
        b.first().await;
        drop(b);
        assert!(line.is_empty());
    }
}
