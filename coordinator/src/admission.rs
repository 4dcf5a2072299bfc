//! Admission: a request runs when it holds one of `max_concurrent_requests` places. When all
//! are taken it waits for one in a bounded queue (`max_queued`) for at most
//! `queue_timeout_ms`, as the peers' servers queue instead of refusing at once: by its
//! `priority` (vLLM's: the lower first), then in order of arrival. A request refused here
//! costs nothing more: the queue is full on arrival, or its wait ran out.
//!
//! The places are a tokio semaphore, and the queue a line in front of it (`line.rs`): only
//! the line's first request waits on the semaphore, and it steps back into line when a
//! request that goes before it arrives. With `max_concurrent_requests_per_token`, a bearer
//! token's requests hold at most that many places: its others wait, passed over by other
//! tokens' requests, until one of its own is given back.

use crate::line::Line;
use crate::metrics::CoordinatorMetrics;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// The places and the queue in front of them.
#[derive(Debug)]
pub struct Admission {
    places: Arc<Semaphore>,
    limit: usize,
    /// Requests in the queue: the bound's count itself, exported as
    /// `duet_num_requests_waiting`.
    waiting: Gauge,
    /// `duet_request_queue_time_seconds`.
    queue_time: Histogram,
    max_queued: usize,
    timeout: Duration,
    /// Notified as each place is given back (`room::RoomQueue`).
    freed: Arc<Notify>,
    /// The queue, which counts each tenant's places.
    line: Arc<Line>,
    per_tenant: usize,
}

/// A place among `max_concurrent_requests`, held until the generation ends and its
/// sessions are closed (the request's `Lease`).
#[derive(Debug)]
pub struct Admitted {
    _place: OwnedSemaphorePermit,
    /// How long the request waited in the queue for it.
    pub waited: Duration,
    freed: Arc<Notify>,
    /// The line that counts the place as its tenant's.
    line: Arc<Line>,
    tenant: u64,
}

impl Drop for Admitted {
    /// The request's sessions are closed, so their KV is free: the request at the head of
    /// the room queue tries again.
    fn drop(&mut self) {
        self.line.give_back(self.tenant);
        self.freed.notify_one();
    }
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(
        "too many generations running (max_concurrent_requests = {limit}) and the wait queue is full (max_queued = {max_queued})"
    )]
    QueueFull { limit: usize, max_queued: usize },
    #[error(
        "too many generations running (max_concurrent_requests = {limit}): waited {waited_ms} ms for a place (queue_timeout_ms)"
    )]
    TimedOut { limit: usize, waited_ms: u64 },
    #[error(
        "this token's requests hold all the places one token may (max_concurrent_requests_per_token = {limit}): waited {waited_ms} ms for one (queue_timeout_ms)"
    )]
    TenantTimedOut { limit: usize, waited_ms: u64 },
}

/// One request in a queue (this one, or `room::RoomQueue`'s line) counted in a gauge;
/// leaving it (admitted, refused or dropped) counts it out.
pub(crate) struct InQueue<'a>(pub(crate) &'a Gauge);

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// How many places, and what a request may hold of them.
#[derive(Debug, Clone, Copy)]
pub struct Places {
    /// `max_concurrent_requests`.
    pub limit: usize,
    /// `max_concurrent_requests_per_token` (0: no bound).
    pub per_tenant: usize,
    /// `max_queued`.
    pub max_queued: usize,
    /// `queue_timeout_ms`.
    pub timeout: Duration,
}

impl Admission {
    /// The `places` and their queue, counted in `metrics`; `freed` is notified as each place
    /// is given back.
    pub fn new(places: Places, metrics: &CoordinatorMetrics, freed: Arc<Notify>) -> Self {
        Self {
            places: Arc::new(Semaphore::new(places.limit)),
            limit: places.limit,
            waiting: metrics.waiting.clone(),
            queue_time: metrics.queue_time.clone(),
            max_queued: places.max_queued,
            timeout: places.timeout,
            freed,
            line: Arc::new(Line::with_cap(places.per_tenant)),
            per_tenant: places.per_tenant,
        }
    }

    /// A place for a request of `priority` and `tenant`, once no request waiting before it
    /// that may go is left.
    async fn wait_in_line(&self, priority: i32, tenant: u64) -> OwnedSemaphorePermit {
        let in_line = (self.line).join_as((priority, tokio::time::Instant::now()), tenant);
        loop {
            in_line.first().await;
            tokio::select! {
                // The semaphore is never closed.
                Ok(place) = self.places.clone().acquire_owned() => {
                    self.line.take(tenant);
                    return place;
                }
                // One that goes first came: back into line.
                _ = in_line.passed() => {}
            }
        }
    }

    /// The place `place`, counted as `tenant`'s, which waited `waited`.
    fn admitted(&self, place: OwnedSemaphorePermit, tenant: u64, waited: Duration) -> Admitted {
        Admitted {
            _place: place,
            waited,
            freed: self.freed.clone(),
            line: self.line.clone(),
            tenant,
        }
    }

    /// A place at once if one is free, no request that may go waits, and its `tenant`
    /// (bearer token; 0 for all without tokens) holds less than its bound; else after the
    /// requests queued before this one (those of a lower `priority`, then those of its own
    /// that came first; those of tenants at their bound passed over); refused when the
    /// queue is full or the wait runs past the timeout.
    pub async fn admit(&self, priority: i32, tenant: u64) -> Result<Admitted, Refused> {
        let started = tokio::time::Instant::now();
        let free = || self.places.clone().try_acquire_owned().ok();
        if let Some(place) = self.line.pass(tenant, free) {
            self.queue_time.observe(0.0);
            return Ok(self.admitted(place, tenant, Duration::ZERO));
        }
        let joined = self
            .waiting
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_queued as i64).then_some(n + 1)
            });
        if joined.is_err() {
            return Err(Refused::QueueFull {
                limit: self.limit,
                max_queued: self.max_queued,
            });
        }
        let _in_queue = InQueue(&self.waiting);
        let wait = self.wait_in_line(priority, tenant);
        let place = tokio::time::timeout(self.timeout, wait).await;
        let waited = started.elapsed();
        self.queue_time.observe(waited.as_secs_f64());
        let waited_ms = waited.as_millis() as u64;
        match place {
            Ok(place) => Ok(self.admitted(place, tenant, waited)),
            Err(_) if self.line.at_cap(tenant) => Err(Refused::TenantTimedOut {
                limit: self.per_tenant,
                waited_ms,
            }),
            Err(_) => Err(Refused::TimedOut {
                limit: self.limit,
                waited_ms,
            }),
        }
    }
}

impl Admitted {
    /// Runs `work` on a blocking thread that holds this place: a caller that goes away (or
    /// whose deadline passes) meanwhile frees the place only when the work it started is
    /// done, so CPU work in flight never exceeds the places. The place comes back with the
    /// result.
    pub async fn run_blocking<T: Send + 'static>(
        self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<(T, Self), tokio::task::JoinError> {
        tokio::task::spawn_blocking(move || (work(), self)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn admission(limit: usize, max_queued: usize) -> (Arc<Admission>, Arc<CoordinatorMetrics>) {
        admission_of(Places {
            limit,
            per_tenant: 0,
            max_queued,
            timeout: Duration::from_millis(1000),
        })
    }

    fn admission_of(places: Places) -> (Arc<Admission>, Arc<CoordinatorMetrics>) {
        let m = Arc::new(CoordinatorMetrics::default());
        let a = Admission::new(places, &m, Arc::default());
        (Arc::new(a), m)
    }

    /// With the one place held by `first`: a request of each of `priorities` joins the
    /// queue in turn; once all wait, `first` goes, and each holds its place 10 ms. Their
    /// indices in the order they were admitted.
    async fn admitted_order(
        a: &Arc<Admission>,
        m: &CoordinatorMetrics,
        first: Admitted,
        priorities: &[i32],
    ) -> Vec<usize> {
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let queued: Vec<_> = (priorities.iter().copied().enumerate())
            .map(|(i, priority)| {
                let (a, order) = (a.clone(), order.clone());
                tokio::spawn(async move {
                    let admitted = a.admit(priority, 0).await.unwrap();
                    order.lock().unwrap().push(i);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    drop(admitted);
                })
            })
            .collect();
        // Let each join the queue in turn.
        for _ in priorities {
            tokio::task::yield_now().await;
        }
        assert_eq!(m.waiting.get(), priorities.len() as i64);
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(first);
        for q in queued {
            q.await.unwrap();
        }
        assert_eq!(m.waiting.get(), 0);
        let order = order.lock().unwrap();
        order.clone()
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_requests_are_admitted_in_arrival_order() {
        let (a, m) = admission(1, 8);
        let first = a.admit(0, 0).await.unwrap();
        assert_eq!(first.waited, Duration::ZERO);
        assert_eq!(admitted_order(&a, &m, first, &[0, 0, 0]).await, [0, 1, 2]);
    }

    /// Waiting requests go the lowest priority first, then in order of arrival, also past
    /// one that was first in line, waiting for a place, when they came.
    #[tokio::test(start_paused = true)]
    async fn waiting_requests_go_by_priority_then_arrival() {
        let (a, m) = admission(1, 8);
        let first = a.admit(0, 0).await.unwrap();
        let order = admitted_order(&a, &m, first, &[0, 5, -1, -1]).await;
        assert_eq!(order, [2, 3, 0, 1]);
        // With the line empty again, a free place is taken at once.
        let now = a.admit(7, 0).now_or_never().expect("at once").unwrap();
        assert_eq!(now.waited, Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_at_once_and_a_long_wait_times_out() {
        let (a, m) = admission(1, 1);
        let _running = a.admit(0, 0).await.unwrap();
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit(0, 0).await.map(|p| p.waited) })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1);
        let full = a
            .admit(0, 0)
            .now_or_never()
            .expect("refused without waiting");
        assert_eq!(
            full.unwrap_err(),
            Refused::QueueFull {
                limit: 1,
                max_queued: 1
            }
        );
        let timed_out = waiter.await.unwrap().unwrap_err();
        assert_eq!(
            timed_out,
            Refused::TimedOut {
                limit: 1,
                waited_ms: 1000
            }
        );
        assert_eq!(
            timed_out.to_string(),
            "too many generations running (max_concurrent_requests = 1): waited 1000 ms for a place (queue_timeout_ms)"
        );
        assert_eq!(m.waiting.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_dropped_while_queued_leaves_the_queue_at_once() {
        let (a, m) = admission(1, 1);
        let running = a.admit(0, 0).await.unwrap();
        let gone = {
            let a = a.clone();
            tokio::spawn(async move { a.admit(0, 0).await.map(drop) })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1);
        gone.abort();
        let _ = gone.await;
        assert_eq!(m.waiting.get(), 0);
        // Its place in the queue is free for the next, which gets the running one's place.
        let next = {
            let a = a.clone();
            tokio::spawn(async move { a.admit(0, 0).await.map(|p| p.waited) })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(running);
        assert_eq!(next.await.unwrap().unwrap(), Duration::from_millis(5));
    }

    /// With a bound of two places a tenant: its third request waits though places are free,
    /// another tenant's request goes past it at once, and it goes when one of its own ends;
    /// a wait that runs out at its bound says so.
    #[tokio::test(start_paused = true)]
    async fn a_tenant_holds_at_most_its_bound_and_others_go_past_its_waiting_requests() {
        let (a, m) = admission_of(Places {
            limit: 8,
            per_tenant: 2,
            max_queued: 8,
            timeout: Duration::from_millis(1000),
        });
        let (busy, other) = (7, 9);
        let first = a.admit(0, busy).await.unwrap();
        let _second = a.admit(0, busy).await.unwrap();
        let third = {
            let a = a.clone();
            tokio::spawn(async move { a.admit(0, busy).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(m.waiting.get(), 1);
        let passing = a.admit(0, other).now_or_never().expect("at once").unwrap();
        assert_eq!(passing.waited, Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(first);
        let third = third.await.unwrap().unwrap();
        assert_eq!(third.waited, Duration::from_millis(20));
        let refused = a.admit(0, busy).await.unwrap_err();
        assert_eq!(
            refused,
            Refused::TenantTimedOut {
                limit: 2,
                waited_ms: 1000
            }
        );
        assert_eq!(m.waiting.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn no_queue_refuses_at_once() {
        let (a, _m) = admission(1, 0);
        let _running = a.admit(0, 0).await.unwrap();
        let refused = a.admit(0, 0).now_or_never().unwrap().unwrap_err();
        assert_eq!(
            refused.to_string(),
            "too many generations running (max_concurrent_requests = 1) and the wait queue is full (max_queued = 0)"
        );
    }

    /// A caller that goes away while its blocking work runs (a cancel, a `grpc-timeout`)
    /// gives its place back only when the work is done.
    #[tokio::test]
    async fn a_place_stays_taken_until_the_blocking_work_it_started_ends() {
        let (a, _m) = admission(1, 0);
        let admitted = a.admit(0, 0).await.unwrap();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel();
        let call = tokio::spawn(admitted.run_blocking(move || {
            started.send(()).unwrap();
            wait.recv().unwrap();
        }));
        running.await.unwrap();
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        let refused = a.admit(0, 0).now_or_never().unwrap();
        assert!(
            matches!(refused, Err(Refused::QueueFull { .. })),
            "{refused:?}"
        );
        release.send(()).unwrap();
        let admitted = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let Some(Ok(place)) = a.admit(0, 0).now_or_never() {
                    return place;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        admitted.await.expect("the place never came back");
    }
}
