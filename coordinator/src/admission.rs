//! Admission: a request runs when it holds one of `max_concurrent_requests` places. When all
//! are taken it waits for one in a bounded FIFO queue (`max_queued`) for at most
//! `queue_timeout_ms`, as the peers' servers queue instead of refusing at once. A request
//! refused here costs nothing more: the queue is full on arrival, or its wait ran out.
//!
//! The places are a fair (FIFO) tokio semaphore; a waiting request is its `acquire`
//! future, so a request whose caller goes away (its call future dropped) leaves the queue
//! at once, and its place in line goes to the next.

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
}

/// A place among `max_concurrent_requests`, held until the generation ends and its
/// sessions are closed (the request's `Lease`).
#[derive(Debug)]
pub struct Admitted {
    _place: OwnedSemaphorePermit,
    /// How long the request waited in the queue for it.
    pub waited: Duration,
    freed: Arc<Notify>,
}

impl Drop for Admitted {
    /// The request's sessions are closed, so their KV is free: the request at the head of
    /// the room queue tries again.
    fn drop(&mut self) {
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
}

/// One request in a queue (this one, or `room::RoomQueue`'s line) counted in a gauge;
/// leaving it (admitted, refused or dropped) counts it out.
pub(crate) struct InQueue<'a>(pub(crate) &'a Gauge);

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Admission {
    /// `limit` places and a queue of `max_queued` for at most `timeout`, counted in
    /// `metrics`; `freed` is notified as each place is given back.
    pub fn new(
        limit: usize,
        max_queued: usize,
        timeout: Duration,
        metrics: &CoordinatorMetrics,
        freed: Arc<Notify>,
    ) -> Self {
        Self {
            places: Arc::new(Semaphore::new(limit)),
            limit,
            waiting: metrics.waiting.clone(),
            queue_time: metrics.queue_time.clone(),
            max_queued,
            timeout,
            freed,
        }
    }

    /// A place at once if one is free, else after the requests queued before this one;
    /// refused when the queue is full or the wait runs past the timeout.
    pub async fn admit(&self) -> Result<Admitted, Refused> {
        let started = tokio::time::Instant::now();
        if let Ok(place) = self.places.clone().try_acquire_owned() {
            self.queue_time.observe(0.0);
            return Ok(Admitted {
                _place: place,
                waited: Duration::ZERO,
                freed: self.freed.clone(),
            });
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
        let place = tokio::time::timeout(self.timeout, self.places.clone().acquire_owned()).await;
        let waited = started.elapsed();
        self.queue_time.observe(waited.as_secs_f64());
        match place {
            Ok(Ok(place)) => Ok(Admitted {
                _place: place,
                waited,
                freed: self.freed.clone(),
            }),
            // The semaphore is never closed; a timeout is the only way out without a place.
            Ok(Err(_)) | Err(_) => Err(Refused::TimedOut {
                limit: self.limit,
                waited_ms: waited.as_millis() as u64,
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
        let m = Arc::new(CoordinatorMetrics::default());
        let freed = Arc::default();
        let a = Admission::new(limit, max_queued, Duration::from_millis(1000), &m, freed);
        (Arc::new(a), m)
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_requests_are_admitted_in_arrival_order() {
        let (a, m) = admission(1, 8);
        let first = a.admit().await.unwrap();
        assert_eq!(first.waited, Duration::ZERO);
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let queued: Vec<_> = (0..3)
            .map(|i| {
                let (a, order) = (a.clone(), order.clone());
                tokio::spawn(async move {
                    let admitted = a.admit().await.unwrap();
                    order.lock().unwrap().push(i);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    drop(admitted);
                })
            })
            .collect();
        // Let each join the queue in turn.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(m.waiting.get(), 3);
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(first);
        for q in queued {
            q.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2]);
        assert_eq!(m.waiting.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_at_once_and_a_long_wait_times_out() {
        let (a, m) = admission(1, 1);
        let _running = a.admit().await.unwrap();
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await.map(|p| p.waited) })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1);
        let full = a.admit().now_or_never().expect("refused without waiting");
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
        let running = a.admit().await.unwrap();
        let gone = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await.map(drop) })
        };
        tokio::task::yield_now().await;
        assert_eq!(m.waiting.get(), 1);
        gone.abort();
        let _ = gone.await;
        assert_eq!(m.waiting.get(), 0);
        // Its place in the queue is free for the next, which gets the running one's place.
        let next = {
            let a = a.clone();
            tokio::spawn(async move { a.admit().await.map(|p| p.waited) })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(running);
        assert_eq!(next.await.unwrap().unwrap(), Duration::from_millis(5));
    }

    #[tokio::test(start_paused = true)]
    async fn no_queue_refuses_at_once() {
        let (a, _m) = admission(1, 0);
        let _running = a.admit().await.unwrap();
        let refused = a.admit().now_or_never().unwrap().unwrap_err();
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
        let admitted = a.admit().await.unwrap();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel();
        let call = tokio::spawn(admitted.run_blocking(move || {
            started.send(()).unwrap();
            wait.recv().unwrap();
        }));
        running.await.unwrap();
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        let refused = a.admit().now_or_never().unwrap();
        assert!(
            matches!(refused, Err(Refused::QueueFull { .. })),
            "{refused:?}"
        );
        release.send(()).unwrap();
        let admitted = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let Some(Ok(place)) = a.admit().now_or_never() {
                    return place;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        admitted.await.expect("the place never came back");
    }
}
