//! A line of waiting requests, the lowest `priority` first (vLLM's), then in order of
//! arrival: the wait for a place among the running requests (`admission.rs`) and the wait
//! for KV room on the target replicas (`room.rs`) both go by it. A request's arrival is
//! when it came to the server, so one that gave its room up (preemption) and waits again
//! goes before those of its priority that came after it. Only the first in line
//! goes on to take what it waits for; it steps back when one that goes before it joins. A
//! place is a value, so a request whose caller goes away (its future dropped) leaves the
//! line at once, and the next moves up.

use std::collections::BTreeSet;
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
    /// the first first.
    waiting: BTreeSet<(Rank, u64)>,
    joins: u64,
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

    pub fn is_empty(&self) -> bool {
        self.state().waiting.is_empty()
    }

    /// A place for a request of `rank`, behind those of a lower priority and those of its
    /// own that arrived before.
    pub fn join(&self, rank: Rank) -> InLine<'_> {
        let key = {
            let mut state = self.state();
            state.joins += 1;
            let key = (rank, state.joins);
            state.waiting.insert(key);
            key
        };
        self.moved.notify_waiters();
        InLine { line: self, key }
    }
}

impl InLine<'_> {
    pub fn is_first(&self) -> bool {
        self.line.state().waiting.first() == Some(&self.key)
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
