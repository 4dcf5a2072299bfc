//! Busy polling (`runtime.busy_poll_ms`): for a while after a call's last sign of life (its
//! arrival, each frame of its answer, the answer's end; probes aside: `counts`), every
//! async thread polls for I/O and wake-ups instead of sleeping. A speculative round is two
//! calls one after the other, each arriving at a process that slept through the other's
//! pass, and waking a sleeping thread (the kernel's wake-up, the core's way out of its idle
//! state) costs about as much as the call itself; on a GPU host, whose cores idle while the
//! GPU works, that is a large part of a round. Polling spends a core per async thread while
//! calls come and go, so it is off by default and meant for hosts with cores to spare.
//!
//! Each poller is a task that yields in a loop: tokio's scheduler then polls its I/O driver
//! between runs instead of parking. There is one a thread (work stealing spreads them),
//! because a thread left to park takes the I/O driver with it into the kernel, and every
//! arriving byte would wake that thread as before.

use http_body::{Body, Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Help of the services' gauge of [`BusyPoll::polling`].
pub const BUSY_POLLING: &str =
    "Async threads polling for work instead of sleeping now (runtime.busy_poll_ms after a call)";

/// The pollers of one runtime and the time of the last activity they poll after.
#[derive(Clone, Debug)]
pub struct BusyPoll {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    linger: Duration,
    epoch: Instant,
    /// Nanoseconds from `epoch` to the last activity; `NEVER` before the first.
    last: AtomicU64,
    /// The pollers wait for activity: the next touch wakes them.
    asleep: AtomicBool,
    wake: Notify,
    /// Pollers polling now.
    polling: AtomicUsize,
}

impl Inner {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn recent(&self) -> bool {
        let last = self.last.load(SeqCst);
        last != NEVER && self.now().saturating_sub(last) < self.linger.as_nanos() as u64
    }
}

const NEVER: u64 = u64::MAX;

impl BusyPoll {
    /// Starts `threads` pollers (one per async thread of the current runtime) that poll for
    /// `linger` after each [`touch`](Self::touch). Must be called within the runtime.
    pub fn start(threads: usize, linger: Duration) -> Self {
        let inner = Arc::new(Inner {
            linger,
            epoch: Instant::now(),
            last: AtomicU64::new(NEVER),
            asleep: AtomicBool::new(true),
            wake: Notify::new(),
            polling: AtomicUsize::new(0),
        });
        for _ in 0..threads.max(1) {
            tokio::spawn(poll(inner.clone()));
        }
        Self { inner }
    }

    /// Marks activity: the pollers poll until `linger` has passed without more.
    pub fn touch(&self) {
        let inner = &self.inner;
        inner.last.store(inner.now(), SeqCst);
        if inner.asleep.swap(false, SeqCst) {
            inner.wake.notify_waiters();
        }
    }

    /// Whether calls came or went within `linger`: while they do, threads of the caller's
    /// own (a worker's model thread) may poll too.
    pub fn recent(&self) -> bool {
        self.inner.recent()
    }

    /// How many pollers are polling now.
    pub fn polling(&self) -> usize {
        self.inner.polling.load(SeqCst)
    }
}

/// One poller: asleep until a touch, then yielding until `linger` passes untouched.
async fn poll(inner: Arc<Inner>) {
    loop {
        let woken = inner.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if !inner.recent() {
            inner.asleep.store(true, SeqCst);
            // A touch between the check and `asleep` found it false and notified no one.
            if !inner.recent() {
                woken.await;
            }
            continue;
        }
        inner.polling.fetch_add(1, SeqCst);
        while inner.recent() {
            tokio::task::yield_now().await;
        }
        inner.polling.fetch_sub(1, SeqCst);
    }
}

/// A tower layer that touches `BusyPoll` at each call's arrival and at each frame and end
/// of its answer (calls that `counts`); without one, calls pass through untouched.
#[derive(Clone, Debug, Default)]
pub struct BusyPollLayer {
    poll: Option<BusyPoll>,
}

impl BusyPollLayer {
    pub fn new(poll: Option<BusyPoll>) -> Self {
        Self { poll }
    }
}

impl<S> tower::Layer<S> for BusyPollLayer {
    type Service = Touching<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Touching {
            inner,
            poll: self.poll.clone(),
        }
    }
}

/// Whether a call is a sign of a request at work, whose next call comes soon. Probes,
/// listings, model descriptions and figures (a load balancer's, a coordinator's checks
/// every second: GETs, `grpc.health.v1`, reflection, `Describe`, `Stats`) are not: an idle
/// service would poll after each, for ever.
fn counts<B>(request: &http::Request<B>) -> bool {
    let path = request.uri().path();
    request.method() != http::Method::GET
        && !path.starts_with("/grpc.")
        && !path.ends_with("/Describe")
        && !path.ends_with("/Stats")
}

/// A service whose calls and answers touch the pollers.
#[derive(Clone, Debug)]
pub struct Touching<S> {
    inner: S,
    poll: Option<BusyPoll>,
}

impl<S, Req, B> tower::Service<http::Request<Req>> for Touching<S>
where
    S: tower::Service<http::Request<Req>, Response = http::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<TouchingBody<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Req>) -> Self::Future {
        let poll = self.poll.clone().filter(|_| counts(&request));
        if let Some(p) = &poll {
            p.touch();
        }
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            if let Some(p) = &poll {
                p.touch();
            }
            Ok(response.map(|body| TouchingBody { body, poll }))
        })
    }
}

/// An answer's body that touches the pollers at each frame and at its end.
#[derive(Debug)]
pub struct TouchingBody<B> {
    body: B,
    poll: Option<BusyPoll>,
}

impl<B: Body + Unpin> Body for TouchingBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if let (Poll::Ready(_), Some(p)) = (&frame, &this.poll) {
            p.touch();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Long enough for both pollers to start on a loaded machine.
    const LINGER: Duration = Duration::from_secs(1);

    #[test]
    fn calls_of_requests_at_work_count_and_checks_do_not() {
        let call = |method: &str, path: &str| {
            let request = http::Request::builder().method(method).uri(path);
            counts(&request.body(()).unwrap())
        };
        assert!(call("POST", "/duet.v1.Worker/Verify"));
        assert!(call("POST", "/duet.v1.Worker/Propose"));
        assert!(call("POST", "/v1/chat/completions"));
        assert!(!call("GET", "/metrics"));
        assert!(!call("POST", "/grpc.health.v1.Health/Check"));
        assert!(!call("POST", "/duet.v1.Worker/Describe"));
        assert!(!call("POST", "/duet.v1.Worker/Stats"));
    }

    /// Waits (real time, at most 5 s) until `poll` has `n` pollers polling.
    async fn until_polling(poll: &BusyPoll, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while poll.polling() != n {
            assert!(
                Instant::now() < deadline,
                "{} pollers, not {n}",
                poll.polling()
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pollers_poll_after_a_touch_until_it_lapses() {
        let poll = BusyPoll::start(2, LINGER);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(poll.polling(), 0, "nothing happened yet");
        let touched = Instant::now();
        poll.touch();
        until_polling(&poll, 2).await;
        until_polling(&poll, 0).await;
        assert!(touched.elapsed() >= LINGER);
        // And again: asleep pollers wake at the next touch.
        poll.touch();
        until_polling(&poll, 2).await;
    }

    /// Over real sockets: a request's POST to the HTTP server sets the pollers polling; a
    /// GET (a probe, a listing) and a gRPC health check do not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_set_the_pollers_polling_and_probes_do_not() {
        let poll = BusyPoll::start(2, LINGER);
        let app = axum::Router::new()
            .route("/health", axum::routing::get(|| async { "ok" }))
            .route("/v1/completions", axum::routing::post(|| async { "done" }));
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (http_addr, grpc_addr) = (http.local_addr().unwrap(), grpc.local_addr().unwrap());
        let (_health, routes) = crate::grpc::frame(&[]).await;
        let limits = crate::grpc::Http2Limits::default;
        let (busy, stop) = (Some(poll.clone()), std::future::pending());
        tokio::spawn(
            async move { crate::https::serve(http, None, app, &limits(), busy, stop).await },
        );
        let (busy, stop) = (Some(poll.clone()), std::future::pending());
        let routes = routes.routes();
        tokio::spawn(
            async move { crate::grpc::serve(grpc, None, routes, &limits(), busy, stop).await },
        );
        let url = format!("http://{grpc_addr}");
        let channel = tonic::transport::Endpoint::from_shared(url).unwrap();
        let mut health =
            tonic_health::pb::health_client::HealthClient::new(channel.connect().await.unwrap());
        let check = tonic_health::pb::HealthCheckRequest {
            service: crate::grpc::LIVENESS.into(),
        };
        health.check(check).await.unwrap();
        assert_eq!(send(http_addr, "GET /health").await, "ok");
        tokio::time::sleep(LINGER / 3).await;
        assert_eq!(poll.polling(), 0, "probes");
        assert_eq!(send(http_addr, "POST /v1/completions").await, "done");
        until_polling(&poll, 2).await;
        until_polling(&poll, 0).await;
    }

    /// One HTTP/1.1 request line, headers that close the connection, and the answer's body.
    async fn send(addr: std::net::SocketAddr, line: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{line} HTTP/1.1\r\nHost: duet\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut answer = String::new();
        tcp.read_to_string(&mut answer).await.unwrap();
        answer.split_once("\r\n\r\n").unwrap().1.to_string()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_part_of_an_answer_touches() {
        type Part = Result<axum::body::Bytes, std::io::Error>;
        let poll = BusyPoll::start(2, LINGER);
        let (tx, rx) = tokio::sync::mpsc::channel::<Part>(1);
        let body = axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut body = TouchingBody {
            body,
            poll: Some(poll.clone()),
        };
        let mut next = async || std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
        for part in ["one", "two"] {
            tx.send(Ok(part.into())).await.unwrap();
            let frame = next().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), part);
            until_polling(&poll, 2).await;
            until_polling(&poll, 0).await;
        }
        drop(tx);
        assert!(next().await.is_none());
        until_polling(&poll, 2).await;
    }
}
