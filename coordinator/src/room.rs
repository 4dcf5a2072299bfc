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

use crate::admission::InQueue;
use crate::line::Line;
use crate::workers::{CallError, Failure};
use prometheus_client::metrics::gauge::Gauge;
use std::future::Future;
use std::sync::Arc;
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
}

impl RoomQueue {
    /// A line whose requests wait at most `timeout` after they arrived, counted in
    /// `waiting`.
    pub fn new(timeout: Duration, waiting: Gauge) -> Self {
        Self {
            line: Line::default(),
            freed: Arc::default(),
            waiting,
            timeout,
        }
    }

    /// What a request notifies when its sessions are closed.
    pub fn freed(&self) -> Arc<Notify> {
        self.freed.clone()
    }

    /// Runs `open` at once when nobody waits, and again from the head of the line (a
    /// request of `priority`) while it answers Busy, until the deadline `queue_timeout_ms`
    /// after `arrived`. With the result, how long the request waited.
    pub async fn open<T, Fut>(
        &self,
        (arrived, priority): (Instant, i32),
        mut open: impl FnMut() -> Fut,
    ) -> Result<(T, Duration), CallError>
    where
        Fut: Future<Output = Result<T, CallError>>,
    {
        let started = Instant::now();
        let mut last = None;
        if self.line.is_empty() {
            match open().await {
                Err(e) if is_busy(&e) => last = Some(e),
                done => return done.map(|t| (t, Duration::ZERO)),
            }
        }
        self.waiting.inc();
        let _in_queue = InQueue(&self.waiting);
        let in_line = self.line.join(priority);
        let deadline = arrived + self.timeout;
        let mut retry = FIRST_RETRY;
        loop {
            if tokio::time::timeout_at(deadline, in_line.first())
                .await
                .is_err()
            {
                return Err(self.no_room(last, started.elapsed()));
            }
            if last.is_some() {
                let next = deadline.min(Instant::now() + retry);
                tokio::select! {
                    _ = tokio::time::timeout_at(next, self.freed.notified()) => {}
                    // One that goes first came: back into line.
                    _ = in_line.passed() => continue,
                }
                retry = (retry * 2).min(MAX_RETRY);
            }
            match open().await {
                Err(e) if is_busy(&e) => last = Some(e),
                done => return done.map(|t| (t, started.elapsed())),
            }
            if Instant::now() >= deadline {
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
            let waiting = (Instant::now(), priority);
            let (_, waited) = queue.open(waiting, || worker.open()).await.unwrap();
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

    #[tokio::test(start_paused = true)]
    async fn a_wait_for_room_ends_at_the_deadline_with_the_workers_answer() {
        let (q, worker) = (queue(1_000), Worker::with_room(0));
        let refused = q
            .open((Instant::now(), 0), || worker.open())
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
        let unreachable = || async {
            Err::<(), _>(CallError::new(
                Party::Target,
                Failure::Unreachable("connection refused".into()),
            ))
        };
        let started = Instant::now();
        let failed = q.open((started, 0), unreachable).await.unwrap_err();
        assert_eq!(
            failed.failure,
            Failure::Unreachable("connection refused".into())
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
