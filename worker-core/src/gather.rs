//! Gathering a batch: when a run of calls is about to start, wait a moment for the sessions
//! whose next call is due.
//!
//! Why: a stream's next call reaches the worker only after the coordinator has handled the
//! last answer (and, for a speculative stream, after its drafts were made). Without waiting,
//! the first call back starts a pass alone and every stream that comes a millisecond later
//! waits the whole pass for the next one: eight target-only streams on a CPU ran passes of
//! 1.9 calls on average instead of up to eight, a pass of one row costing nearly what one of
//! eight does.
//!
//! How: for each session the worker remembers when its last call was answered and how long
//! its next call then took to come (its return gap), and expects the next one as long after
//! the next answer. A session is due when it has not called yet and is expected within
//! `window` from now, and not more than `window` ago. A run waits until every due session
//! has called, or until `window` after the latest expected time, and never longer than
//! `window` in all (`Waiting::gather`). A stream that stops (it ended, or drafts longer this
//! time) costs at most one window.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Which session a call belongs to (sessions are told apart by their address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionKey(pub usize);

impl SessionKey {
    pub fn of<T>(session: &std::sync::Arc<T>) -> Self {
        Self(std::sync::Arc::as_ptr(session) as *const () as usize)
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Returns {
    /// When its last call was answered, until its next call comes.
    answered: Option<Instant>,
    /// How long its last call took to come after the answer before it.
    gap: Option<Duration>,
    /// Its last call or answer, for forgetting sessions long gone.
    seen: Option<Instant>,
}

/// Sessions not heard of for this long are forgotten (they have closed, or will be waited
/// for again only after their next gap is measured).
const FORGET: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub struct Gather {
    window: Duration,
    sessions: HashMap<SessionKey, Returns>,
}

impl Gather {
    /// Waits of at most `window` (zero: never wait).
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            sessions: HashMap::new(),
        }
    }

    /// A call of `session` was queued at `at`: its return gap, if its last call was answered.
    pub fn arrived(&mut self, session: SessionKey, at: Instant) {
        let r = self.sessions.entry(session).or_default();
        if let Some(answered) = r.answered.take() {
            r.gap = Some(at.saturating_duration_since(answered));
        }
        r.seen = Some(at);
    }

    /// The calls of `sessions` were answered at `at`.
    pub fn answered(&mut self, sessions: impl IntoIterator<Item = SessionKey>, at: Instant) {
        for s in sessions {
            let r = self.sessions.entry(s).or_default();
            r.answered = Some(at);
            r.seen = Some(at);
        }
        self.sessions.retain(|_, r| {
            r.seen
                .is_some_and(|seen| at.saturating_duration_since(seen) < FORGET)
        });
    }

    /// The longest a run waits.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Until when a run starting `now` waits for the due sessions that have not called yet
    /// (`present`: whether a session's call is already waiting); `None`: none is due.
    pub fn deadline(&self, now: Instant, present: impl Fn(SessionKey) -> bool) -> Option<Instant> {
        if self.window.is_zero() {
            return None;
        }
        self.sessions
            .iter()
            .filter_map(|(&s, r)| Some((s, r.answered? + r.gap?)))
            .filter(|&(s, expected)| {
                expected <= now + self.window && now < expected + self.window && !present(s)
            })
            .map(|(_, expected)| expected + self.window)
            .max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Two streams that come back 1 ms after their answers are waited for until both are
    /// present, and at most a window after they were expected.
    #[test]
    fn waits_for_streams_that_come_back_quickly() {
        let t0 = Instant::now();
        let (a, b) = (SessionKey(1), SessionKey(2));
        let mut g = Gather::new(5 * MS);
        // Never answered: nobody is due.
        g.arrived(a, t0);
        g.arrived(b, t0);
        assert_eq!(g.deadline(t0, |_| false), None);
        // Answered, gaps not known yet: not waited for.
        g.answered([a, b], t0 + MS);
        assert_eq!(g.deadline(t0 + MS, |_| false), None);
        // Both come back 1 ms after their answer: now both gaps are known.
        g.arrived(a, t0 + 2 * MS);
        g.arrived(b, t0 + 2 * MS);
        g.answered([a, b], t0 + 40 * MS);
        // `a` is back first: the run waits for `b` (expected at 41 ms) until 46 ms.
        g.arrived(a, t0 + 41 * MS);
        assert_eq!(g.deadline(t0 + 41 * MS, |s| s == a), Some(t0 + 46 * MS));
        // With `b` present too, or once its window closed, nobody is waited for.
        assert_eq!(g.deadline(t0 + 41 * MS, |_| true), None);
        assert_eq!(g.deadline(t0 + 46 * MS, |s| s == a), None);
    }

    /// A stream that drafts between its calls comes back 30 ms after its answer: a run that
    /// starts right after the answers does not wait for it, one that starts when it is
    /// expected within the window does.
    #[test]
    fn streams_are_waited_for_around_when_they_are_expected() {
        let t0 = Instant::now();
        let (fast, slow) = (SessionKey(1), SessionKey(2));
        let mut g = Gather::new(5 * MS);
        g.answered([fast, slow], t0);
        g.arrived(fast, t0 + MS);
        g.arrived(slow, t0 + 30 * MS);
        g.answered([fast, slow], t0 + 60 * MS);
        assert_eq!(g.deadline(t0 + 60 * MS, |_| false), Some(t0 + 66 * MS));
        assert_eq!(g.deadline(t0 + 60 * MS, |s| s == fast), None);
        // 86 ms: the slow one is expected at 90 ms, within the window.
        assert_eq!(g.deadline(t0 + 86 * MS, |_| false), Some(t0 + 95 * MS));
        assert_eq!(g.deadline(t0 + 94 * MS, |_| false), Some(t0 + 95 * MS));
        assert_eq!(g.deadline(t0 + 95 * MS, |_| false), None);
    }

    #[test]
    fn a_zero_window_never_waits_and_old_sessions_are_forgotten() {
        let t0 = Instant::now();
        let a = SessionKey(1);
        let mut g = Gather::new(Duration::ZERO);
        g.answered([a], t0);
        g.arrived(a, t0);
        g.answered([a], t0 + MS);
        assert_eq!(g.deadline(t0 + MS, |_| false), None);
        let mut g = Gather::new(5 * MS);
        g.answered([a], t0);
        g.answered([SessionKey(2)], t0 + FORGET);
        assert_eq!(g.sessions.len(), 1);
        assert!(g.sessions.contains_key(&SessionKey(2)));
    }
}
