//! Waiting for KV room. A request's target session reserves its prompt + `max_tokens` of
//! KV on a replica, and the worker refuses the open (Busy) when its `kv_token_budget`,
//! `max_sessions` or model queue is full. Then the request waits here instead of failing:
//! in one line (`line.rs`: by `priority`, then first come first served), its head trying
//! again each time a request of this coordinator gives its sessions back (and, for room
//! that other coordinators free, after a backoff), until `queue_timeout_ms` after it
//! arrived; a head that one going before it passes steps back into line.
//!
//! The workers keep the ledger: several coordinators share them, replicas come and go, and
//! a prefix cache gives way to sessions, so only the worker knows whether a reservation
//! fits; a refusal costs one round trip. While anyone waits, a new request joins the line
//! rather than trying first, so a large reservation is not starved by smaller ones.
//!
//! Preemption (`priority_preemption`, under `scheduling_policy = priority`): the head of the
//! line, refused, asks a running request of this coordinator with a higher `priority`
//! number than its own (the highest, then the latest to arrive) to give its room up. That
//! one closes its sessions at its next round (at once where a send of its waits on a
//! caller that stopped reading), keeping its committed tokens, and waits in this line in
//! its own place (its priority, then its arrival), then opens a session with them and
//! goes on: its output is what it would have been. One request is asked at a
//! time, and only for a strictly lower priority number, so requests of one priority never
//! take each other's room. Where no running request of this coordinator has a higher
//! number (the room is held by other coordinators' requests), the open itself asks: the
//! worker that refuses it asks one of its sessions of a higher number (another
//! coordinator's) to give way (`OpenSessionRequest.ask_for_room`), which learns so from
//! its next call's answer (`VerifyResponse.give_way`) and gives way the same way.

use crate::admission::InQueue;
use crate::line::{Line, Rank};
use crate::workers::{CallError, Failure};
use prometheus_client::metrics::gauge::Gauge;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The first wait before trying again without a session of this coordinator closing.
const FIRST_RETRY: Duration = Duration::from_millis(50);
/// The longest such wait.
const MAX_RETRY: Duration = Duration::from_secs(1);

/// The line of requests waiting for room.
#[derive(Debug)]
pub struct RoomQueue {
    /// The waiting requests; the first tries.
    line: Line,
    /// Notified when a request's sessions are closed (its place is given back).
    freed: Arc<Notify>,
    /// Requests in the line: `duet_num_requests_waiting_for_kv`.
    waiting: Gauge,
    timeout: Duration,
    /// The generations holding target sessions, which the head may ask to give way.
    holders: Arc<Mutex<Holders>>,
    /// Whether the head asks them (`priority_preemption`).
    preempts: bool,
}

/// The generations holding target sessions, by rank (the last to be asked first).
#[derive(Debug, Default)]
struct Holders {
    by_rank: BTreeMap<(Rank, u64), Arc<HolderState>>,
    joins: u64,
}

/// Where a holder stands (`RUNNING`, `ASKED`, `WAITING`; a new one runs), and what wakes it
/// when asked.
#[derive(Debug, Default)]
struct HolderState {
    state: AtomicU8,
    asked: Notify,
}

impl HolderState {
    fn load(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }

    /// Asks a running holder to give its room up.
    fn ask(&self) {
        let asked =
            (self.state).compare_exchange(RUNNING, ASKED, Ordering::AcqRel, Ordering::Acquire);
        if asked.is_ok() {
            self.asked.notify_one();
        }
    }
}

/// Where a holder stands: running, asked to give its room up, or waiting for room again.
const RUNNING: u8 = 0;
const ASKED: u8 = 1;
const WAITING: u8 = 2;

/// A generation's entry among those holding target sessions, given up as it drops.
#[derive(Debug)]
pub struct Holding {
    holders: Arc<Mutex<Holders>>,
    key: (Rank, u64),
    state: Arc<HolderState>,
    freed: Arc<Notify>,
}

impl Holding {
    /// A request waiting for room asked this one to give its room up.
    pub fn asked(&self) -> bool {
        self.state.load() == ASKED
    }

    /// Returns once a request waiting for room has asked this one to give its room up.
    pub async fn wait_until_asked(&self) {
        loop {
            let asked = self.state.asked.notified();
            if self.asked() {
                return;
            }
            asked.await;
        }
    }

    /// Its target session is closed (the worker answered): the head of the line tries again.
    pub fn gave_way(&self) {
        self.state.state.store(WAITING, Ordering::Release);
        self.freed.notify_one();
    }

    /// It gave its room up and holds no target session until it finds room again.
    pub fn waits_for_room(&self) -> bool {
        self.state.load() == WAITING
    }

    /// Its request's place in line: its priority, then its arrival.
    pub fn rank(&self) -> Rank {
        self.key.0
    }

    /// It holds a target session again.
    pub fn resumed(&self) {
        self.state.state.store(RUNNING, Ordering::Release);
    }

    /// Its worker asked it to give its room up (a request of another coordinator waits).
    pub fn ask(&self) {
        self.state.ask();
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        holders.by_rank.remove(&self.key);
    }
}

impl RoomQueue {
    /// A line whose requests wait at most `timeout` after they arrived, counted in
    /// `waiting`; with `preempts`, its head asks requests of a higher priority number to
    /// give their room up.
    pub fn new(timeout: Duration, waiting: Gauge, preempts: bool) -> Self {
        Self {
            line: Line::default(),
            freed: Arc::default(),
            waiting,
            timeout,
            holders: Arc::default(),
            preempts,
        }
    }

    /// Whether requests may take the room of those of a higher priority number: their
    /// target sessions carry their priorities (`OpenSessionRequest.priority`).
    pub fn preempts(&self) -> bool {
        self.preempts
    }

    /// Enters a generation of `rank` that holds a target session among those the head of
    /// the line may ask to give way.
    pub fn hold(&self, rank: Rank) -> Holding {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        holders.joins += 1;
        let key = (rank, holders.joins);
        let state = Arc::new(HolderState::default());
        holders.by_rank.insert(key, state.clone());
        Holding {
            holders: self.holders.clone(),
            key,
            state,
            freed: self.freed.clone(),
        }
    }

    /// Whether an open of `priority` asks the worker to find it room among other
    /// coordinators' sessions (`ask_for_room`): where this coordinator preempts and none of
    /// its own running requests has a higher priority number.
    fn ask_workers(&self, priority: i32) -> bool {
        if !self.preempts {
            return false;
        }
        let holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        let gives_way = |((theirs, _), _): &(Rank, u64), state: &Arc<HolderState>| {
            *theirs > priority && state.load() != WAITING
        };
        !holders.by_rank.iter().any(|(key, s)| gives_way(key, s))
    }

    /// The head of the line, of `priority`, was refused: asks the running holder that goes
    /// last (the highest priority number, then the latest arrival) to give way, where its
    /// priority number is higher than `priority` and no one asked has given way yet.
    fn ask_to_give_way(&self, priority: i32) {
        if !self.preempts {
            return;
        }
        let holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        let states = || holders.by_rank.iter().rev();
        if states().any(|(_, s)| s.load() == ASKED) {
            return;
        }
        let last = states().find(|(_, s)| s.load() == RUNNING);
        if let Some((((theirs, _), _), state)) = last
            && *theirs > priority
        {
            tracing::info!(
                waiting = priority,
                running = theirs,
                "asking a running request to give its KV room up"
            );
            state.ask();
        }
    }

    /// What a request notifies when its sessions are closed.
    pub fn freed(&self) -> Arc<Notify> {
        self.freed.clone()
    }

    /// Runs `open` at once when nobody waits, and again from the head of the line (a
    /// request of `rank`) while it answers Busy, until the deadline `queue_timeout_ms` after
    /// it arrived. With the result, how long the request waited.
    pub async fn open<T, Fut>(
        &self,
        rank: Rank,
        open: impl FnMut(bool) -> Fut,
    ) -> Result<(T, Duration), CallError>
    where
        Fut: Future<Output = Result<T, CallError>>,
    {
        self.wait(rank, Some(rank.1 + self.timeout), open).await
    }

    /// [`RoomQueue::open`] for a request that gave its room up: it was admitted, so it
    /// waits with no deadline of the line's (`limits.request_timeout_ms` bounds it).
    pub async fn resume<T, Fut>(
        &self,
        rank: Rank,
        open: impl FnMut(bool) -> Fut,
    ) -> Result<(T, Duration), CallError>
    where
        Fut: Future<Output = Result<T, CallError>>,
    {
        self.wait(rank, None, open).await
    }

    async fn wait<T, Fut>(
        &self,
        rank: Rank,
        deadline: Option<Instant>,
        mut open: impl FnMut(bool) -> Fut,
    ) -> Result<(T, Duration), CallError>
    where
        Fut: Future<Output = Result<T, CallError>>,
    {
        let started = Instant::now();
        let mut last = None;
        if self.line.is_empty() {
            match open(self.ask_workers(rank.0)).await {
                Err(e) if is_busy(&e) => last = Some(e),
                done => return done.map(|t| (t, Duration::ZERO)),
            }
        }
        self.waiting.inc();
        let _in_queue = InQueue(&self.waiting);
        let in_line = self.line.join(rank);
        let mut retry = FIRST_RETRY;
        loop {
            let first = in_line.first();
            let in_time = match deadline {
                Some(d) => tokio::time::timeout_at(d, first).await.is_ok(),
                None => {
                    first.await;
                    true
                }
            };
            if !in_time {
                return Err(self.no_room(last, started.elapsed()));
            }
            if last.is_some() {
                self.ask_to_give_way(rank.0);
                let next = Instant::now() + retry;
                let next = deadline.map_or(next, |d| d.min(next));
                tokio::select! {
                    _ = tokio::time::timeout_at(next, self.freed.notified()) => {}
                    // One that goes first came: back into line.
                    _ = in_line.passed() => continue,
                }
                retry = (retry * 2).min(MAX_RETRY);
            }
            match open(self.ask_workers(rank.0)).await {
                Err(e) if is_busy(&e) => last = Some(e),
                done => return done.map(|t| (t, started.elapsed())),
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self.no_room(last, started.elapsed()));
            }
        }
    }

    /// The Busy answer of a request that waited `waited` for room in vain.
    fn no_room(&self, last: Option<CallError>, waited: Duration) -> CallError {
        let mut e = last.unwrap_or_else(|| {
            CallError::new(
                crate::workers::Party::Target,
                Failure::Busy("requests before this one wait for KV room".into()),
            )
        });
        let why = match &e.failure {
            Failure::Busy(why) => why.clone(),
            other => other.to_string(),
        };
        e.failure = Failure::Busy(format!(
            "{why}; waited {} ms for room (queue_timeout_ms = {})",
            waited.as_millis(),
            self.timeout.as_millis()
        ));
        e
    }
}

fn is_busy(e: &CallError) -> bool {
    matches!(e.failure, Failure::Busy(_))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::Party;
    use std::sync::Mutex;

    /// A target with room for `room` sessions: an open takes one or answers Busy.
    #[derive(Clone)]
    struct Worker {
        free: Arc<Mutex<usize>>,
        tries: Arc<Mutex<usize>>,
    }

    impl Worker {
        fn with_room(room: usize) -> Self {
            Self {
                free: Arc::new(Mutex::new(room)),
                tries: Arc::default(),
            }
        }

        async fn open(&self) -> Result<(), CallError> {
            *self.tries.lock().unwrap() += 1;
            let mut free = self.free.lock().unwrap();
            match *free {
                0 => Err(CallError::new(
                    Party::Target,
                    Failure::Busy("KV-token budget exhausted".into()),
                )),
                _ => {
                    *free -= 1;
                    Ok(())
                }
            }
        }

        /// A session closes, and its request's place is given back.
        fn close(&self, queue: &RoomQueue) {
            *self.free.lock().unwrap() += 1;
            queue.freed().notify_one();
        }
    }

    fn queue(timeout_ms: u64) -> Arc<RoomQueue> {
        Arc::new(RoomQueue::new(
            Duration::from_millis(timeout_ms),
            Gauge::default(),
            true,
        ))
    }

    /// Opens on `worker` through `queue` in a task, a request of `priority`: how long it
    /// waited, and its order.
    fn request(
        queue: &Arc<RoomQueue>,
        worker: &Worker,
        order: &Arc<Mutex<Vec<&'static str>>>,
        (name, priority): (&'static str, i32),
    ) -> tokio::task::JoinHandle<Duration> {
        let (queue, worker, order) = (queue.clone(), worker.clone(), order.clone());
        tokio::spawn(async move {
            let waiting = (priority, Instant::now());
            let (_, waited) = queue.open(waiting, |_| worker.open()).await.unwrap();
            order.lock().unwrap().push(name);
            waited
        })
    }

    #[tokio::test(start_paused = true)]
    async fn requests_wait_for_room_in_arrival_order_and_go_when_a_place_is_given_back() {
        let (q, worker) = (queue(30_000), Worker::with_room(1));
        let order = Arc::default();
        let first = request(&q, &worker, &order, ("first", 0)).await.unwrap();
        assert_eq!(first, Duration::ZERO);
        let second = request(&q, &worker, &order, ("second", 0));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(q.waiting.get(), 1);
        // The third joins the line behind the second without trying.
        let third = request(&q, &worker, &order, ("third", 0));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(q.waiting.get(), 2);
        tokio::time::sleep(Duration::from_millis(80)).await;
        let tries = *worker.tries.lock().unwrap();
        worker.close(&q);
        assert_eq!(second.await.unwrap(), Duration::from_millis(100));
        tokio::time::sleep(Duration::from_millis(100)).await;
        worker.close(&q);
        assert_eq!(third.await.unwrap(), Duration::from_millis(190));
        assert_eq!(*order.lock().unwrap(), ["first", "second", "third"]);
        assert_eq!(q.waiting.get(), 0);
        // Only the head of the line tried meanwhile (backing off), the third not at all.
        assert_eq!(tries, 3, "the first, the second, and its retry 50 ms later");
    }

    /// A request of a lower priority goes before those waiting already: the head, backing
    /// off, steps back into line.
    #[tokio::test(start_paused = true)]
    async fn a_lower_priority_waits_for_room_in_front() {
        let (q, worker) = (queue(30_000), Worker::with_room(1));
        let order = Arc::default();
        request(&q, &worker, &order, ("first", 0)).await.unwrap();
        let late = request(&q, &worker, &order, ("late", 5));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let urgent = request(&q, &worker, &order, ("urgent", -1));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(q.waiting.get(), 2);
        worker.close(&q);
        assert_eq!(urgent.await.unwrap(), Duration::from_millis(10));
        worker.close(&q);
        late.await.unwrap();
        assert_eq!(*order.lock().unwrap(), ["first", "urgent", "late"]);
        assert_eq!(q.waiting.get(), 0);
    }

    /// The head, refused, asks the running request that goes last to give way: the
    /// highest priority number, then the latest arrival, and only one of a higher number
    /// than its own; a second only once the first has given way and room is still short.
    #[tokio::test(start_paused = true)]
    async fn the_head_asks_the_last_running_request_of_a_higher_priority_number_to_give_way() {
        let (q, worker) = (queue(30_000), Worker::with_room(0));
        let t0 = Instant::now();
        let urgent = q.hold((0, t0));
        let early = q.hold((5, t0));
        let late = q.hold((5, t0 + Duration::from_millis(1)));
        let same = q.hold((2, t0 + Duration::from_millis(2)));
        let order = Arc::default();
        let head = request(&q, &worker, &order, ("head", 2));
        tokio::time::sleep(Duration::from_millis(500)).await;
        let asked = |h: &[&Holding]| h.iter().map(|h| h.asked()).collect::<Vec<_>>();
        // Asked once, though the head tried again meanwhile (at 0, 50, 150 and 350 ms).
        assert_eq!(
            asked(&[&urgent, &early, &late, &same]),
            [false, false, true, false]
        );
        assert_eq!(*worker.tries.lock().unwrap(), 4);
        // `late` closed its session, but the room went elsewhere: the head asks the next.
        late.gave_way();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            asked(&[&urgent, &early, &late, &same]),
            [false, true, false, false]
        );
        early.gave_way();
        worker.close(&q);
        assert_eq!(head.await.unwrap(), Duration::from_millis(510));
        // `late` waits for room again in its own place: before one of its priority that
        // arrived after it, though that one waited first.
        let fresh = request(&q, &worker, &order, ("fresh", 5));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let (q2, w2, order2) = (q.clone(), worker.clone(), order.clone());
        let back = tokio::spawn(async move {
            let rank = (5, t0 + Duration::from_millis(1));
            q2.resume(rank, |_| w2.open()).await.unwrap();
            order2.lock().unwrap().push("late");
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            !same.asked(),
            "its priority number is not higher than the waiting ones'"
        );
        worker.close(&q);
        back.await.unwrap();
        worker.close(&q);
        fresh.await.unwrap();
        assert_eq!(*order.lock().unwrap(), ["head", "late", "fresh"]);
    }

    /// An open asks the workers for room (`ask_for_room`) only where no running request of
    /// this coordinator could give way to it: none of a higher priority number, or only
    /// ones waiting for room themselves.
    #[tokio::test(start_paused = true)]
    async fn an_open_asks_the_workers_only_where_none_of_its_own_can_give_way() {
        let q = queue(1_000);
        let worker = Worker::with_room(1);
        let asks = Arc::new(Mutex::new(Vec::new()));
        let open = |priority| {
            let (worker, asks) = (worker.clone(), asks.clone());
            let rank = (priority, Instant::now());
            q.open(rank, move |ask| {
                asks.lock().unwrap().push(ask);
                let worker = worker.clone();
                async move { worker.open().await }
            })
        };
        let running = q.hold((5, Instant::now()));
        open(5).await.unwrap();
        open(0).await.unwrap_err();
        running.gave_way();
        worker.close(&q);
        open(0).await.unwrap();
        // Of the 0's first wait (its tries at 0, 50, ... 750 ms and at the deadline), none
        // asked the workers: the 5 of its own could give way.
        let asks = asks.lock().unwrap().clone();
        assert_eq!(asks, [vec![true], vec![false; 6], vec![true]].concat());
    }

    /// Without preemption (`scheduling_policy = fcfs`, or `priority_preemption` false)
    /// nobody is asked.
    #[tokio::test(start_paused = true)]
    async fn without_preemption_nobody_is_asked_to_give_way() {
        let q = RoomQueue::new(Duration::from_secs(1), Gauge::default(), false);
        let worker = Worker::with_room(0);
        let running = q.hold((9, Instant::now()));
        q.open((0, Instant::now()), |_| worker.open())
            .await
            .unwrap_err();
        assert!(!running.asked());
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_for_room_ends_at_the_deadline_with_the_workers_answer() {
        let (q, worker) = (queue(1_000), Worker::with_room(0));
        let refused = q
            .open((0, Instant::now()), |_| worker.open())
            .await
            .unwrap_err();
        assert_eq!(
            refused.failure,
            Failure::Busy(
                "KV-token budget exhausted; waited 1000 ms for room (queue_timeout_ms = 1000)"
                    .into()
            )
        );
        // At 0, 50, 150, 350 and 750 ms (the backoff doubling), and at the deadline.
        assert_eq!(*worker.tries.lock().unwrap(), 6);
        assert_eq!(q.waiting.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn other_failures_end_the_open_at_once() {
        let q = queue(1_000);
        let unreachable = |_| async {
            Err::<(), _>(CallError::new(
                Party::Target,
                Failure::Unreachable("connection refused".into()),
            ))
        };
        let started = Instant::now();
        let failed = q.open((0, started), unreachable).await.unwrap_err();
        assert_eq!(
            failed.failure,
            Failure::Unreachable("connection refused".into())
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
