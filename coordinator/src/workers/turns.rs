//! Taking turns on a shared device (`speculation.take_turns`). Where the draft and the
//! target run on the same CPU cores (or one GPU), a pass of one beside a pass of the other
//! slows both many times over: each model's thread pool waits at every operation for
//! threads the other process holds. Measured on two cores, eight streams: target passes
//! several times slower, 4-token Propose calls up to 2 s. [`TakeTurns`] wraps the workers so
//! that the draft's calls and the target's calls never run at once, while calls to the same
//! worker still run together (and batch there), as both models would on one GPU.
//!
//! The turns are phase-fair: once a call waits for the other worker, no new call joins the
//! side that runs, so neither worker starves the other however busy it is. A prefill is the
//! exception: it holds its worker's turn for long, and while one runs that worker's other
//! calls still join (the workers interleave them with the prefill's chunks), so other
//! streams do not stall behind a long prompt.
//!
//! A Decode stream (target-only steps, one after another on the worker) holds the target's
//! turn while it runs, and ends after its next token once a draft call waits: the request
//! then starts another, which waits for the target's next turn.
//!
//! A call waits at most `speculation.turn_wait_ms` for its turn. Past it, the calls holding
//! the other worker's turn have overrun (a long prefill, or a worker that stopped
//! answering): this worker's calls then run beside them until they end, so a stuck worker
//! slows the other streams for one wait instead of stopping them until its deadline.

use super::{
    CallError, Decode, Decoded, Open, Party, Proposal, Propose, TargetOpened, Verified, Verify,
    WorkerTiming, Workers,
};
use futures::StreamExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

fn index(party: Party) -> usize {
    match party {
        Party::Target => 0,
        Party::Draft => 1,
    }
}

fn other(party: Party) -> Party {
    match party {
        Party::Target => Party::Draft,
        Party::Draft => Party::Target,
    }
}

/// How long a call holds its worker's turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// One round's call (Propose, Verify).
    Step,
    /// A prompt's prefill (OpenSession): the worker's other calls may join it.
    Prefill,
}

#[derive(Debug, Default)]
struct State {
    /// Whose turn it is; `None` while no call runs or waits.
    turn: Option<Party>,
    /// The worker whose calls held the turn past the wait bound: the other's calls start
    /// beside them until none of them runs.
    overrun: Option<Party>,
    /// Per worker (by `index`): calls running, prefills among them, calls waiting.
    running: [usize; 2],
    prefills: [usize; 2],
    waiting: [usize; 2],
    /// Tickets handed to waiting calls, in order of arrival.
    tickets: [u64; 2],
    /// When a worker's turn came, the calls waiting for it then (tickets below this) may all
    /// start, even once the other worker waits again.
    admit_below: [u64; 2],
}

impl State {
    fn may_start(&self, party: Party, ticket: Option<u64>) -> bool {
        let (i, o) = (index(party), index(other(party)));
        match self.turn {
            None => true,
            Some(turn) if turn == party => {
                self.waiting[o] == 0
                    || self.prefills[i] > 0
                    || ticket.is_some_and(|t| t < self.admit_below[i])
            }
            Some(turn) => self.overrun == Some(turn),
        }
    }

    /// Passes the turn on once no call of the worker whose turn it is runs: to the other
    /// worker if its calls wait (or run, having overrun the wait), else to the same one's
    /// waiting calls, else to nobody. Returns the worker whose waiting calls should look
    /// again.
    fn settle(&mut self) -> Option<Party> {
        let turn = self.turn?;
        if self.running[index(turn)] > 0 {
            return None;
        }
        if self.overrun == Some(turn) {
            self.overrun = None;
        }
        let o = other(turn);
        let next = if self.waiting[index(o)] > 0 || self.running[index(o)] > 0 {
            Some(o)
        } else {
            (self.waiting[index(turn)] > 0).then_some(turn)
        };
        self.turn = next;
        if let Some(p) = next {
            self.admit_below[index(p)] = self.tickets[index(p)];
        }
        next
    }
}

/// The turn-taking between the two workers' calls.
#[derive(Debug)]
pub struct Turns {
    state: Mutex<State>,
    /// Per worker: its waiting calls look again.
    wake: [Notify; 2],
    /// Per worker: one of its calls started waiting (for a stream of the other's to end).
    waits: [Notify; 2],
    /// How long a call waits for its turn at most.
    max_wait: Duration,
}

/// A call's turn: its worker's calls may run until this drops.
#[derive(Debug)]
pub struct Turn {
    turns: Arc<Turns>,
    party: Party,
    hold: Hold,
}

/// A call waiting for its turn; if it gives up (its request ends), it stops counting.
struct Waiting<'a> {
    turns: &'a Turns,
    party: Party,
    ticket: Option<u64>,
}

impl Turns {
    pub fn new(max_wait: Duration) -> Self {
        Self {
            state: Mutex::default(),
            wake: Default::default(),
            waits: Default::default(),
            max_wait,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake(&self, party: Option<Party>) {
        if let Some(p) = party {
            self.wake[index(p)].notify_waiters();
        }
    }

    /// Waits until a call to `party`'s worker may run, or `max_wait` has passed.
    pub async fn take(self: &Arc<Self>, party: Party, hold: Hold) -> Turn {
        let mut waiting = Waiting {
            turns: self,
            party,
            ticket: None,
        };
        let deadline = Instant::now() + self.max_wait;
        loop {
            // Registered before the state is read, so no wake-up is missed in between.
            let woken = self.wake[index(party)].notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            {
                let mut s = self.lock();
                let may_start = s.may_start(party, waiting.ticket);
                if may_start || Instant::now() >= deadline {
                    if !may_start {
                        self.overran(&mut s, party);
                    }
                    if waiting.ticket.take().is_some() {
                        s.waiting[index(party)] -= 1;
                    }
                    s.turn.get_or_insert(party);
                    s.running[index(party)] += 1;
                    s.prefills[index(party)] += usize::from(hold == Hold::Prefill);
                    return Turn {
                        turns: self.clone(),
                        party,
                        hold,
                    };
                }
                if waiting.ticket.is_none() {
                    let i = index(party);
                    waiting.ticket = Some(s.tickets[i]);
                    s.tickets[i] += 1;
                    s.waiting[i] += 1;
                    self.waits[i].notify_waiters();
                }
            }
            let _ = tokio::time::timeout_at(deadline, woken).await;
        }
    }

    /// A call of `party` has waited `max_wait`: where the other worker holds the turn, its
    /// calls have overrun, and `party`'s start beside them from now on.
    fn overran(&self, s: &mut State, party: Party) {
        let Some(holder) = s.turn.filter(|&t| t != party) else {
            return;
        };
        if s.overrun.replace(holder).is_none() {
            tracing::warn!(
                holder = %holder,
                waited_ms = self.max_wait.as_millis() as u64,
                "the other worker's calls held the turn past the wait bound; calls go ahead \
                 beside them until they end"
            );
        }
        self.wake(Some(party));
    }
}

impl Turn {
    /// Returns once a call of the other worker waits for its turn.
    async fn until_the_other_waits(&self) {
        let o = index(other(self.party));
        loop {
            let waits = self.turns.waits[o].notified();
            tokio::pin!(waits);
            waits.as_mut().enable();
            if self.turns.lock().waiting[o] > 0 {
                return;
            }
            waits.await;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let next = {
            let mut s = self.turns.lock();
            let i = index(self.party);
            s.running[i] -= 1;
            s.prefills[i] -= usize::from(self.hold == Hold::Prefill);
            s.settle()
        };
        self.turns.wake(next);
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.ticket.is_none() {
            return;
        }
        let next = {
            let mut s = self.turns.lock();
            s.waiting[index(self.party)] -= 1;
            s.settle()
        };
        self.turns.wake(next);
        // Calls held back only because this one waited may join the running side now.
        self.turns.wake(Some(other(self.party)));
    }
}

/// The workers, with the draft's and the target's calls taking turns (or not: `turns` is
/// `None` where the workers run on separate devices).
#[derive(Debug)]
pub struct TakeTurns<W> {
    pub inner: W,
    turns: Option<Arc<Turns>>,
}

impl<W> TakeTurns<W> {
    /// The calls take turns where `max_wait` is set, each waiting that long at most.
    pub fn new(inner: W, max_wait: Option<Duration>) -> Self {
        Self {
            inner,
            turns: max_wait.map(|wait| Arc::new(Turns::new(wait))),
        }
    }

    /// Runs `call` in its worker's turn; the wait counts as the call's queueing.
    async fn in_turn<T>(
        &self,
        party: Party,
        hold: Hold,
        call: impl Future<Output = Result<T, CallError>>,
        timing: impl FnOnce(&mut T) -> &mut WorkerTiming,
    ) -> Result<T, CallError> {
        let Some(turns) = &self.turns else {
            return call.await;
        };
        let start = Instant::now();
        let _turn = turns.take(party, hold).await;
        let waited: Duration = start.elapsed();
        let mut answer = call.await?;
        timing(&mut answer).queue += waited;
        Ok(answer)
    }
}

impl<W: Workers> Workers for TakeTurns<W> {
    type Session = W::Session;

    async fn open_target(&self, open: Open<'_>) -> Result<TargetOpened<Self::Session>, CallError> {
        let call = self.inner.open_target(open);
        self.in_turn(Party::Target, Hold::Prefill, call, |a| &mut a.1)
            .await
    }

    async fn reopen_target(
        &self,
        open: Open<'_>,
        lost: &Self::Session,
    ) -> Result<TargetOpened<Self::Session>, CallError> {
        let call = self.inner.reopen_target(open, lost);
        self.in_turn(Party::Target, Hold::Prefill, call, |a| &mut a.1)
            .await
    }

    async fn close_target(&self, session: &Self::Session) {
        self.inner.close_target(session).await;
    }

    fn draft_available(&self) -> Result<(), String> {
        self.inner.draft_available()
    }

    async fn open_draft(&self, open: Open<'_>) -> Result<(Self::Session, WorkerTiming), CallError> {
        let call = self.inner.open_draft(open);
        self.in_turn(Party::Draft, Hold::Prefill, call, |a| &mut a.1)
            .await
    }

    async fn propose(
        &self,
        session: &Self::Session,
        call: Propose<'_>,
    ) -> Result<Proposal, CallError> {
        let call = self.inner.propose(session, call);
        self.in_turn(Party::Draft, Hold::Step, call, |p| &mut p.timing)
            .await
    }

    async fn verify(
        &self,
        session: &Self::Session,
        call: Verify<'_>,
    ) -> Result<Verified, CallError> {
        let call = self.inner.verify(session, call);
        self.in_turn(Party::Target, Hold::Step, call, |v| &mut v.timing)
            .await
    }

    /// The stream holds the target's turn while it runs and ends once a draft call waits
    /// for its turn, after its first token (the request then starts another, which waits
    /// for the target's next turn); the wait for the turn counts as its first token's
    /// queueing.
    async fn decode(
        &self,
        session: &Self::Session,
        call: Decode<'_>,
    ) -> Result<Decoded, CallError> {
        let Some(turns) = &self.turns else {
            return self.inner.decode(session, call).await;
        };
        let start = Instant::now();
        let turn = turns.take(Party::Target, Hold::Step).await;
        let waited = start.elapsed();
        let tokens = self.inner.decode(session, call).await?;
        // `waited`: before the first token only.
        let in_turn = futures::stream::unfold(
            (tokens, turn, Some(waited)),
            |(mut tokens, turn, waited)| async move {
                let mut next = tokio::select! {
                    next = tokens.next() => next?,
                    () = turn.until_the_other_waits(), if waited.is_none() => return None,
                };
                if let (Ok(v), Some(waited)) = (&mut next, waited) {
                    v.timing.queue += waited;
                }
                Some((next, (tokens, turn, None)))
            },
        );
        Ok(Box::pin(in_turn))
    }

    fn trip_draft(&self, reason: &str) {
        self.inner.trip_draft(reason)
    }

    fn verifies_trees(&self, session: &Self::Session) -> bool {
        self.inner.verifies_trees(session)
    }

    fn decodes_with_lookup(&self, session: &Self::Session) -> bool {
        self.inner.decodes_with_lookup(session)
    }

    fn hold_prefix(&self, sessions: &[&Self::Session], tokens: &[u32], salt: u64) {
        self.inner.hold_prefix(sessions, tokens, salt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A call in a test's timeline: it arrives at `.0` ms, takes `.2`'s turn as `.3`, and
    /// holds it `.4` ms.
    type Call = (u64, &'static str, Party, Hold, u64);
    /// When calls ran: name, start and end in ms.
    type Log = Arc<Mutex<Vec<(&'static str, u64, u64)>>>;

    fn spawn(turns: &Arc<Turns>, log: &Log, call: Call) -> tokio::task::JoinHandle<()> {
        let (turns, log) = (turns.clone(), log.clone());
        let (at, name, party, hold, ms) = call;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at)).await;
            let _turn = turns.take(party, hold).await;
            let start = since_start();
            tokio::time::sleep(Duration::from_millis(ms)).await;
            log.lock().unwrap().push((name, start, since_start()));
        })
    }

    /// Milliseconds since the test's start (time is paused: it moves only by sleeps).
    fn since_start() -> u64 {
        thread_local!(static START: Instant = Instant::now());
        START.with(|t| t.elapsed().as_millis() as u64)
    }

    fn by_start(log: &Log) -> Vec<(&'static str, u64, u64)> {
        let mut v = log.lock().unwrap().clone();
        v.sort_by_key(|&(name, start, _)| (start, name));
        v
    }

    /// Runs `calls` on one `Turns`; when each ran, by start.
    async fn timeline(calls: &[Call]) -> Vec<(&'static str, u64, u64)> {
        since_start();
        let (turns, log) = (Arc::new(Turns::new(WAIT)), Log::default());
        let tasks: Vec<_> = calls.iter().map(|&c| spawn(&turns, &log, c)).collect();
        for t in tasks {
            t.await.unwrap();
        }
        by_start(&log)
    }

    use Hold::{Prefill, Step};
    use Party::{Draft, Target};

    /// The wait bound in these tests: longer than any wait but the overrun test's.
    const WAIT: Duration = Duration::from_millis(1000);

    #[tokio::test(start_paused = true)]
    async fn one_workers_calls_run_together_and_the_other_waits_for_all_of_them() {
        let ran = timeline(&[
            (0, "verify a", Target, Step, 100),
            (0, "verify b", Target, Step, 60),
            (10, "propose", Draft, Step, 30),
        ])
        .await;
        assert_eq!(
            ran,
            vec![
                ("verify a", 0, 100),
                ("verify b", 0, 60),
                ("propose", 100, 130),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_waiting_for_the_other_worker_stops_new_ones_joining() {
        // The Verify calls arriving at 20 ms, while the Propose waits, run after it.
        let ran = timeline(&[
            (0, "verify a", Target, Step, 100),
            (10, "propose", Draft, Step, 30),
            (20, "verify b", Target, Step, 50),
            (20, "verify c", Target, Step, 40),
        ])
        .await;
        assert_eq!(
            ran,
            vec![
                ("verify a", 0, 100),
                ("propose", 100, 130),
                ("verify b", 130, 180),
                ("verify c", 130, 170),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn calls_join_a_prefill_even_while_the_other_worker_waits() {
        let ran = timeline(&[
            (0, "prefill", Target, Prefill, 300),
            (10, "propose", Draft, Step, 30),
            (20, "verify", Target, Step, 50),
        ])
        .await;
        assert_eq!(
            ran,
            vec![
                ("prefill", 0, 300),
                ("verify", 20, 70),
                ("propose", 300, 330),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_call_that_gives_up_holds_nobody_up() {
        since_start();
        let (turns, log) = (Arc::new(Turns::new(WAIT)), Log::default());
        let a = spawn(&turns, &log, (0, "verify a", Target, Step, 100));
        let d = spawn(&turns, &log, (10, "propose", Draft, Step, 30));
        let b = spawn(&turns, &log, (20, "verify b", Target, Step, 50));
        let c = spawn(&turns, &log, (30, "verify c", Target, Step, 20));
        // The Propose's request ends at 30 ms, while it waits.
        tokio::time::sleep(Duration::from_millis(30)).await;
        d.abort();
        assert!(d.await.unwrap_err().is_cancelled());
        for t in [a, b, c] {
            t.await.unwrap();
        }
        // Nobody waits for the draft now: the held-back Verify and a new one join the
        // running one.
        assert_eq!(
            by_start(&log),
            vec![
                ("verify a", 0, 100),
                ("verify b", 30, 80),
                ("verify c", 30, 50),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_passed_to_a_call_that_gave_up_passes_on() {
        let turns = Arc::new(Turns::new(WAIT));
        let verify = turns.take(Target, Step).await;
        let waiter = turns.clone();
        let propose = tokio::spawn(async move {
            let _turn = waiter.take(Draft, Step).await;
        });
        tokio::task::yield_now().await;
        assert_eq!(turns.lock().waiting, [0, 1]);
        drop(verify);
        assert_eq!(turns.lock().turn, Some(Draft));
        // Its request ends before it starts.
        propose.abort();
        assert!(propose.await.unwrap_err().is_cancelled());
        {
            let s = turns.lock();
            assert_eq!((s.turn, s.running, s.waiting), (None, [0, 0], [0, 0]));
        }
        let verify = tokio::time::timeout(Duration::ZERO, turns.take(Target, Step));
        assert!(verify.await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn calls_go_ahead_beside_a_call_that_overruns_the_wait_until_it_ends() {
        let ran = timeline(&[
            (0, "stuck prefill", Draft, Prefill, 60_000),
            (10, "verify a", Target, Step, 100),
            (20, "verify b", Target, Step, 100),
            (2000, "verify c", Target, Step, 100),
            (3000, "propose", Draft, Step, 30),
            (59_990, "verify d", Target, Step, 100),
            (60_010, "propose late", Draft, Step, 30),
        ])
        .await;
        // Verify a waits the bound and starts, b with it; later calls start at once, until
        // the prefill ends: then turns resume, and the Propose waits for Verify d.
        assert_eq!(
            ran,
            vec![
                ("stuck prefill", 0, 60_000),
                ("verify a", 1010, 1110),
                ("verify b", 1010, 1110),
                ("verify c", 2000, 2100),
                ("propose", 3000, 3030),
                ("verify d", 59_990, 60_090),
                ("propose late", 60_090, 60_120),
            ]
        );
    }
}
