//! The draft-worker's circuit breaker. After a failure (unreachable, too slow, an error)
//! requests skip the draft-worker and run target-only, while one probe task checks it every
//! `interval` until the check passes. Then it is half-open: one trial request uses the
//! draft-worker, and only its success closes the breaker (a health check can pass while the
//! worker still cannot serve); its failure trips it again. Its whole state sits under one
//! lock, so a trip racing the probe's success can neither leave it open with nobody probing
//! nor close it on a check that started before the trip.

use duet_serving::grpc::Health;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The coordinator's health service reports the breaker under the draft-worker's service
/// name: SERVING while requests use the draft-worker.
pub const DRAFT_HEALTH_NAME: &str = duet_proto::v1::draft_worker_server::SERVICE_NAME;

/// Whether the draft-worker is usable: `Err(why)` when not.
pub type Check =
    Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync>;

/// Half-open: the check passed after a trip; one trial request may use the draft-worker.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Trial {
    /// No request has taken the trial yet.
    Waiting,
    /// A request took it then (another may after `trial_timeout`: that one never proposed).
    Since(Instant),
}

#[derive(Debug)]
struct State {
    /// Requests skip the draft-worker (but for a half-open breaker's trial).
    open: bool,
    /// Set while half-open.
    trial: Option<Trial>,
    /// A probe task is running.
    probing: bool,
    /// Why the breaker is open.
    reason: String,
    /// Trips so far: a check that started before the latest trip does not close it.
    trips: u64,
}

/// What `/metrics` shows of a breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerState {
    /// Requests skip the draft-worker (open, or half-open until a trial succeeds).
    pub open: bool,
    /// Trips so far.
    pub trips: u64,
}

pub struct Breaker {
    state: Mutex<State>,
    interval: Duration,
    trial_timeout: Duration,
    check: Check,
    /// `true` while closed (requests use the draft-worker); watched by the health report.
    closed: watch::Sender<bool>,
    reporting: OnceLock<()>,
}

impl std::fmt::Debug for Breaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Breaker")
            .field("state", &*self.lock())
            .finish()
    }
}

impl Breaker {
    /// A breaker that starts open until its first successful check (which closes it: nothing
    /// has failed yet). A trial request that has not succeeded within `trial_timeout` hands
    /// the trial to the next request.
    pub fn new(interval: Duration, trial_timeout: Duration, check: Check) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State {
                open: true,
                trial: None,
                probing: false,
                reason: "the draft-worker has not been checked yet".into(),
                trips: 0,
            }),
            interval,
            trial_timeout,
            check,
            closed: watch::channel(false).0,
            reporting: OnceLock::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is a few field writes: a panic cannot leave them half done.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes the breaker on `health` as [`DRAFT_HEALTH_NAME`], in the order it changes.
    pub fn report_to(&self, health: Health) {
        if self.reporting.set(()).is_err() {
            return;
        }
        let mut closed = self.closed.subscribe();
        tokio::spawn(async move {
            loop {
                let now = *closed.borrow_and_update();
                health.set_named(DRAFT_HEALTH_NAME, now).await;
                if closed.changed().await.is_err() {
                    return;
                }
            }
        });
    }

    /// Whether it is open now, and how often it has tripped.
    pub fn state(&self) -> BreakerState {
        let s = self.lock();
        BreakerState {
            open: s.open,
            trips: s.trips,
        }
    }

    /// `Err(why)` while the breaker is open; half-open, `Ok` for the one trial request.
    pub fn available(&self) -> Result<(), String> {
        let mut s = self.lock();
        match s.trial {
            _ if !s.open => Ok(()),
            None => Err(s.reason.clone()),
            Some(Trial::Since(at)) if at.elapsed() < self.trial_timeout => {
                Err("circuit half-open: a trial request is testing the draft-worker".into())
            }
            Some(_) => {
                s.trial = Some(Trial::Since(Instant::now()));
                Ok(())
            }
        }
    }

    /// A call on the draft-worker succeeded: a half-open breaker closes.
    pub fn succeeded(&self) {
        let mut s = self.lock();
        if s.open && s.trial.is_some() {
            s.open = false;
            s.trial = None;
            tracing::info!("draft-worker trial request succeeded; speculation on");
            self.closed.send_replace(true);
        }
    }

    /// Opens the breaker (requests skip the draft-worker) and makes sure a probe runs.
    pub fn trip(self: &Arc<Self>, reason: &str) {
        let mut s = self.lock();
        s.trips += 1;
        s.trial = None;
        s.reason = reason.to_string();
        if !s.open {
            s.open = true;
            tracing::warn!(%reason, "draft-worker circuit breaker opened; running target-only");
            self.closed.send_replace(false);
        }
        self.start_probe(s);
    }

    /// Checks the draft-worker once now (so a coordinator that reports ready has tried it);
    /// while it fails, a probe goes on checking.
    pub async fn check_now(self: &Arc<Self>) {
        let trips = self.lock().trips;
        let outcome = (self.check)().await;
        let s = self.settle(outcome, trips);
        self.start_probe(s);
    }

    /// Takes a check's outcome: on success, unless a trip came after the check started,
    /// closes the breaker (nothing failed yet) or makes it half-open (after a failure).
    fn settle(&self, outcome: Result<(), String>, trips_before: u64) -> MutexGuard<'_, State> {
        let mut s = self.lock();
        match outcome {
            Ok(()) if s.open && s.trips == trips_before && s.trips == 0 => {
                s.open = false;
                tracing::info!("draft-worker healthy; speculation on");
                self.closed.send_replace(true);
            }
            Ok(()) if s.open && s.trips == trips_before && s.trial.is_none() => {
                s.trial = Some(Trial::Waiting);
                tracing::info!("draft-worker healthy again; half-open: the next request tries it");
            }
            Ok(()) => {}
            Err(reason) => {
                if s.reason != reason {
                    tracing::warn!(%reason, "draft-worker unusable; running target-only");
                    s.reason = reason;
                }
            }
        }
        s
    }

    /// Starts the probe task unless one runs or the breaker is closed or half-open.
    fn start_probe(self: &Arc<Self>, mut s: MutexGuard<'_, State>) {
        if !s.open || s.trial.is_some() || s.probing {
            return;
        }
        s.probing = true;
        drop(s);
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(this.interval).await;
                let trips = {
                    let mut s = this.lock();
                    if !s.open || s.trial.is_some() {
                        s.probing = false;
                        return;
                    }
                    s.trips
                };
                let outcome = (this.check)().await;
                let mut s = this.settle(outcome, trips);
                if !s.open || s.trial.is_some() {
                    s.probing = false;
                    return;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A check that passes when `healthy` says so, counting checks that run at once.
    fn check(healthy: Arc<AtomicBool>, running: Arc<AtomicUsize>, most: Arc<AtomicUsize>) -> Check {
        Arc::new(move || {
            let (healthy, running, most) = (healthy.clone(), running.clone(), most.clone());
            Box::pin(async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::task::yield_now().await;
                running.fetch_sub(1, Ordering::SeqCst);
                if healthy.load(Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err("sick".to_string())
                }
            })
        })
    }

    const TRIAL: Duration = Duration::from_secs(10);
    const HALF_OPEN: &str = "circuit half-open: a trial request is testing the draft-worker";

    #[tokio::test(start_paused = true)]
    async fn opens_on_a_trip_and_closes_after_a_successful_trial() {
        let healthy = Arc::new(AtomicBool::new(false));
        let b = Breaker::new(
            Duration::from_millis(100),
            TRIAL,
            check(healthy.clone(), Default::default(), Default::default()),
        );
        assert_eq!(
            b.available(),
            Err("the draft-worker has not been checked yet".to_string())
        );
        b.check_now().await;
        assert_eq!(b.available(), Err("sick".to_string()));
        healthy.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(150)).await;
        // Nothing has failed yet: the first passing check closes it.
        assert_eq!(b.available(), Ok(()));
        assert_eq!(b.available(), Ok(()));
        let state = |open, trips| BreakerState { open, trips };
        assert_eq!(b.state(), state(false, 0));
        b.trip("slow");
        assert_eq!(b.available(), Err("slow".to_string()));
        assert_eq!(b.state(), state(true, 1));
        tokio::time::sleep(Duration::from_millis(150)).await;
        // Half-open: one trial request, the others skip the draft-worker meanwhile.
        assert_eq!(b.available(), Ok(()));
        assert_eq!(b.available(), Err(HALF_OPEN.to_string()));
        assert!(!b.lock().probing, "no probe while half-open");
        assert_eq!(b.state(), state(true, 1), "open until the trial succeeds");
        b.succeeded();
        assert_eq!(b.state(), state(false, 1));
        assert_eq!(b.available(), Ok(()));
        assert_eq!(b.available(), Ok(()));
        assert!(!b.lock().probing, "the probe ended with the breaker closed");
    }

    /// The trial fails: open again, probing; a trial whose request never used the worker
    /// hands the trial on after `trial_timeout`.
    #[tokio::test(start_paused = true)]
    async fn a_failed_or_lost_trial_keeps_it_from_closing() {
        let b = Breaker::new(
            Duration::from_millis(100),
            TRIAL,
            check(
                Arc::new(AtomicBool::new(true)),
                Default::default(),
                Default::default(),
            ),
        );
        b.check_now().await;
        b.trip("slow");
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(b.available(), Ok(()), "the trial");
        b.trip("still slow");
        assert_eq!(b.available(), Err("still slow".to_string()));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(b.available(), Ok(()), "the next trial");
        tokio::time::sleep(TRIAL - Duration::from_millis(1)).await;
        assert_eq!(b.available(), Err(HALF_OPEN.to_string()));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(b.available(), Ok(()), "the trial passed on");
        assert_eq!(b.available(), Err(HALF_OPEN.to_string()));
    }

    /// Trips from many threads racing the probe's successful checks: after the last trip
    /// the breaker always closes again (never stays open with no probe running), and never
    /// more than one check runs at a time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn trips_racing_the_probe_never_leave_it_open() {
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let b = Breaker::new(
            Duration::from_micros(50),
            TRIAL,
            check(Arc::new(AtomicBool::new(true)), running, most.clone()),
        );
        for round in 0..300 {
            let trippers = (0..4).map(|_| {
                let b = b.clone();
                tokio::spawn(async move {
                    for _ in 0..8 {
                        b.trip("flaky");
                        tokio::task::yield_now().await;
                    }
                })
            });
            for t in trippers {
                t.await.unwrap();
            }
            let closed = tokio::time::timeout(Duration::from_secs(5), async {
                while b.available().is_err() {
                    tokio::time::sleep(Duration::from_micros(100)).await;
                }
                b.succeeded();
            })
            .await;
            assert!(
                closed.is_ok(),
                "round {round}: the breaker stayed open: {b:?}"
            );
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "checks ran concurrently");
    }

    /// A check that started before a trip does not close the breaker on that trip.
    #[tokio::test(start_paused = true)]
    async fn a_check_from_before_the_trip_does_not_close_it() {
        let b = Breaker::new(
            Duration::from_secs(3600),
            TRIAL,
            Arc::new(|| Box::pin(async { Ok(()) })),
        );
        let trips = b.lock().trips;
        b.trip("failed");
        drop(b.settle(Ok(()), trips));
        assert_eq!(b.available(), Err("failed".to_string()));
    }
}
