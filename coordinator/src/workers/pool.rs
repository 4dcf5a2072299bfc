//! The replicas behind one worker address. A worker session lives on one replica, so the
//! coordinator balances per *session*, client-side: it resolves the configured address(es)
//! to every replica (all the A records of a Kubernetes headless Service, re-resolved every
//! `discovery_interval_ms`), keeps a connection to each, opens each session on the least
//! loaded one and sends every later call of that session to the same replica.
//!
//! A replica that leaves DNS (scaled down, not ready) gets no new sessions; its sessions in
//! flight keep their connection until they end or the pod goes away.
//!
//! With prefix routing the pool remembers, per replica, the block hashes of the prompts it
//! opened sessions with there (`prefix_block_hashes`): the prefixes the replica's prefix
//! cache may hold. A new session goes to the replica holding the longest prefix of its
//! prompt, if that prefix is at least `min_share` of the prompt and that replica holds at
//! most `max_imbalance` sessions over the least loaded one; a conversation's turns, and
//! requests sharing a document, thus meet their cached rows instead of being spread over
//! the replicas, while requests that share only a short system prompt go by load.

use crate::config::PrefixRouting;
use duet_serving::telemetry::inject_interceptor;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tonic::Status;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// A channel whose calls carry the caller's trace context (`traceparent`).
pub type Traced =
    InterceptedService<Channel, fn(tonic::Request<()>) -> Result<tonic::Request<()>, Status>>;

/// One replica: its connection, how many sessions it holds for this coordinator, and how
/// many prompt tokens this coordinator's opens in flight there have it prefill.
#[derive(Debug, Clone)]
pub struct Replica {
    pub addr: SocketAddr,
    pub channel: Channel,
    sessions: Arc<AtomicUsize>,
    prefilling: Arc<AtomicUsize>,
    prefixes: PrefixMemory,
    /// Whether it serves the expected model, once asked (`WorkerClient::check_model`), and
    /// the worker instance that answered.
    model: Arc<Mutex<Option<ModelCheck>>>,
}

/// A replica's answer to "which model do you serve": whether it is the expected one, and
/// the worker instance (process) that answered. Another instance at the same address (a
/// replaced pod) is asked again.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCheck {
    pub instance: u64,
    pub verdict: Result<(), String>,
    /// The replica verifies trees of drafts (`ModelDescription.verifies_trees`): replicas
    /// of one model may differ here (a CPU replica does, a GPU replica does not yet).
    pub verifies_trees: bool,
    /// The replica looks up drafts inside its Decode streams
    /// (`ModelDescription.decodes_with_lookup`).
    pub decodes_with_lookup: bool,
    /// The replica applies penalties (`ModelDescription.applies_penalties`): one from before
    /// them gets no session of a request with penalties, nor (they came together) of one
    /// that asks for log-probabilities.
    pub applies_penalties: bool,
    /// The replica answers a prompt's figures (`ModelDescription.scores_prompts`).
    pub scores_prompts: bool,
    /// The replica applies a logit bias (`ModelDescription.applies_logit_bias`).
    pub applies_logit_bias: bool,
    /// The replica applies `min_tokens` (`ModelDescription.applies_min_tokens`).
    pub applies_min_tokens: bool,
    /// The replica takes a structured output (`ModelDescription.applies_structured_output`).
    pub applies_structured_output: bool,
    /// The replica takes `min_p` (`ModelDescription.applies_min_p`).
    pub applies_min_p: bool,
    /// The replica applies a repetition penalty
    /// (`ModelDescription.applies_repetition_penalty`).
    pub applies_repetition_penalty: bool,
    /// The replica holds a request's stop tokens back until `min_tokens`
    /// (`ModelDescription.holds_stop_tokens`).
    pub holds_stop_tokens: bool,
    /// The LoRA adapters the replica loads (`ModelDescription.adapters`): only it gets
    /// sessions of their requests, unless it reads adapters from a directory
    /// (`ModelDescription.adapters_from_dir`: it answers an open of one it lacks itself).
    pub adapters: Vec<String>,
    pub adapters_from_dir: bool,
}

/// What one replica's prefix cache may hold, as far as this coordinator knows (shared by
/// its replica entry and the sessions open there).
#[derive(Debug, Clone, Default)]
pub struct PrefixMemory(Arc<Mutex<Prefixes>>);

impl PrefixMemory {
    /// Notes that the replica holds the rows of sequences with block hashes `blocks`.
    pub fn remember(&self, blocks: &[u64]) {
        lock(&self.0).remember(blocks);
    }

    fn matched(&self, blocks: &[u64]) -> usize {
        lock(&self.0).matched(blocks)
    }
}

/// Block hashes of the prompts this coordinator opened sessions with on one replica, the
/// most recent [`REMEMBERED_BLOCKS`] of them.
#[derive(Debug, Default)]
struct Prefixes {
    seen: HashMap<u64, u64>,
    tick: u64,
}

/// Blocks remembered per replica: 2M prompt tokens' worth, more than a replica's prefix
/// cache holds, in about 1 MiB.
const REMEMBERED_BLOCKS: usize = 1 << 16;

impl Prefixes {
    /// Leading blocks of `blocks` seen here.
    fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.seen.contains_key(b))
            .count()
    }

    fn remember(&mut self, blocks: &[u64]) {
        self.tick += 1;
        for &b in blocks {
            self.seen.insert(b, self.tick);
        }
        if self.seen.len() > REMEMBERED_BLOCKS {
            // Forget the older half at once, so that the cost is spread over many opens.
            let mut ticks: Vec<u64> = self.seen.values().copied().collect();
            let half = ticks.len() / 2;
            let (_, &mut median, _) = ticks.select_nth_unstable(half);
            self.seen.retain(|_, &mut t| t > median);
        }
    }
}

fn lock(prefixes: &Mutex<Prefixes>) -> std::sync::MutexGuard<'_, Prefixes> {
    // Every update leaves the set usable: a poisoned lock is still good.
    prefixes.lock().unwrap_or_else(|e| e.into_inner())
}

impl Replica {
    /// Sessions this coordinator holds there.
    fn load(&self) -> usize {
        self.sessions.load(Ordering::Relaxed)
    }

    /// Notes that a session opened here with a prompt of block hashes `blocks`.
    pub fn remember(&self, blocks: &[u64]) {
        self.prefixes.remember(blocks);
    }

    pub fn prefix_memory(&self) -> PrefixMemory {
        self.prefixes.clone()
    }

    pub fn model_check(&self) -> Option<ModelCheck> {
        self.model.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Remembers `check`, or (`None`) forgets the last one: the replica is asked again.
    pub fn set_model_check(&self, check: Option<ModelCheck>) {
        *self.model.lock().unwrap_or_else(|e| e.into_inner()) = check;
    }

    pub fn traced(&self) -> Traced {
        InterceptedService::new(self.channel.clone(), inject_interceptor)
    }

    /// Counts a session on this replica until the guard drops.
    pub fn hold(&self) -> Hold {
        Hold::add(&self.sessions, 1).0
    }

    /// Counts an open's `tokens` as prefilling on this replica until the guard drops; with
    /// it, the tokens of this coordinator's opens in flight there that started before
    /// (which the replica may prefill first).
    pub fn prefill(&self, tokens: usize) -> (Hold, usize) {
        Hold::add(&self.prefilling, tokens)
    }
}

/// One session's, or one open's, share of a replica's load.
#[derive(Debug)]
pub struct Hold {
    count: Arc<AtomicUsize>,
    n: usize,
}

impl Hold {
    /// Adds `n` to `count` until the guard drops; with it, the count before.
    fn add(count: &Arc<AtomicUsize>, n: usize) -> (Self, usize) {
        let before = count.fetch_add(n, Ordering::Relaxed);
        let hold = Self {
            count: count.clone(),
            n,
        };
        (hold, before)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.count.fetch_sub(self.n, Ordering::Relaxed);
    }
}

#[derive(Debug)]
pub struct Pool {
    /// `host:port` per configured URL.
    names: Vec<String>,
    /// TLS toward every replica (the URLs were `https://`), or plaintext; replaced when its
    /// files change ([`Pool::set_tls`]).
    tls: RwLock<Option<ClientTlsConfig>>,
    connect_timeout: Duration,
    replicas: RwLock<Vec<Replica>>,
    next: AtomicUsize,
    /// Prefix routing's bounds; `None`: off.
    prefix_routing: Option<PrefixRouting>,
}

fn build_channel(
    addr: SocketAddr,
    tls: Option<&ClientTlsConfig>,
    connect_timeout: Duration,
) -> Channel {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .expect("a socket address is a valid URI");
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(tls.clone())
            .expect("an https endpoint takes a TLS configuration");
    }
    endpoint
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .connect_lazy()
}

impl Pool {
    /// `address`: one or more comma-separated `http://host:port` (or, with `tls`,
    /// `https://`) URLs, checked by the configuration.
    /// `prefix_routing`: its bounds (see the module docs), `None` for none.
    pub fn new(
        address: &str,
        tls: Option<ClientTlsConfig>,
        connect_timeout: Duration,
        prefix_routing: Option<PrefixRouting>,
    ) -> Arc<Self> {
        let names = address
            .split(',')
            .map(|url| {
                let url = url.trim();
                url.split_once("://")
                    .map_or(url, |(_, rest)| rest)
                    .trim_end_matches('/')
                    .to_string()
            })
            .collect();
        Arc::new(Self {
            names,
            tls: RwLock::new(tls),
            connect_timeout,
            replicas: RwLock::new(Vec::new()),
            next: AtomicUsize::new(0),
            prefix_routing,
        })
    }

    /// Resolves the names again: new replicas get a connection, vanished ones are dropped
    /// (their sessions in flight keep theirs). A failed lookup keeps what was known.
    pub async fn refresh(&self) {
        let mut found = Vec::new();
        for name in &self.names {
            match tokio::net::lookup_host(name.as_str()).await {
                Ok(addrs) => found.extend(addrs),
                Err(e) => {
                    tracing::warn!(%name, error = %e, "resolving worker replicas");
                    return;
                }
            }
        }
        found.sort();
        found.dedup();
        let tls = self.tls.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut replicas = self.replicas.write().unwrap_or_else(|e| e.into_inner());
        let known: HashMap<SocketAddr, Replica> = replicas.drain(..).map(|r| (r.addr, r)).collect();
        let mut added = 0;
        *replicas = found
            .into_iter()
            .map(|addr| {
                known.get(&addr).cloned().unwrap_or_else(|| {
                    added += 1;
                    Replica {
                        addr,
                        channel: build_channel(addr, tls.as_ref(), self.connect_timeout),
                        sessions: Arc::new(AtomicUsize::new(0)),
                        prefilling: Arc::new(AtomicUsize::new(0)),
                        prefixes: PrefixMemory::default(),
                        model: Arc::default(),
                    }
                })
            })
            .collect();
        if added > 0 || known.len() != replicas.len() {
            tracing::info!(replicas = replicas.len(), names = ?self.names, "worker replicas");
        }
    }

    /// From now on connections to every replica use `tls` (renewed certificate files):
    /// each replica gets a new channel, and sessions open on the old ones keep them until
    /// they end.
    pub fn set_tls(&self, tls: ClientTlsConfig) {
        let mut replicas = self.replicas.write().unwrap_or_else(|e| e.into_inner());
        for r in replicas.iter_mut() {
            r.channel = build_channel(r.addr, Some(&tls), self.connect_timeout);
        }
        *self.tls.write().unwrap_or_else(|e| e.into_inner()) = Some(tls);
    }

    /// Re-resolves every `interval` while the pool is alive.
    pub fn keep_resolving(self: &Arc<Self>, interval: Duration) {
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                match pool.upgrade() {
                    Some(p) => p.refresh().await,
                    None => return,
                }
                tokio::time::sleep(interval).await;
            }
        });
    }

    pub fn replicas(&self) -> Vec<Replica> {
        self.replicas
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The replicas in the order to try a new session on: fewest sessions first, ties
    /// taken in turn.
    pub fn by_load(&self) -> Vec<Replica> {
        let mut all = self.replicas();
        if all.is_empty() {
            return all;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % all.len();
        all.rotate_left(start);
        all.sort_by_key(Replica::load);
        all
    }

    /// The replicas in the order to try a new session with a prompt of `tokens` tokens and
    /// block hashes `blocks` on: with prefix routing, the one holding the longest prefix
    /// of them first (of those within `max_imbalance` sessions of the least loaded, and if
    /// that prefix is at least `min_share` of the prompt; the less loaded of equals), then
    /// the others by load.
    pub fn for_prompt(&self, tokens: usize, blocks: &[u64]) -> Vec<Replica> {
        let mut all = self.by_load();
        let (Some(routing), Some(least)) = (self.prefix_routing, all.first().map(Replica::load))
        else {
            return all;
        };
        let enough = (routing.min_share * tokens as f64).max(1.0);
        let best = all
            .iter()
            .enumerate()
            .filter(|(_, r)| r.load() <= least + routing.max_imbalance)
            .map(|(i, r)| (r.prefixes.matched(blocks), std::cmp::Reverse(i)))
            .filter(|&(matched, _)| (matched * duet_engine::PREFIX_BLOCK_TOKENS) as f64 >= enough)
            .max();
        if let Some((_, std::cmp::Reverse(i))) = best {
            let preferred = all.remove(i);
            all.insert(0, preferred);
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_address_of_every_url_is_a_replica() {
        let pool = Pool::new(
            "http://127.0.0.1:7001, http://127.0.0.1:7002/,http://127.0.0.1:7001",
            None,
            Duration::from_millis(100),
            None,
        );
        pool.refresh().await;
        let addrs: Vec<_> = pool.replicas().iter().map(|r| r.addr.port()).collect();
        assert_eq!(addrs, [7001, 7002]);
    }

    #[tokio::test]
    async fn new_sessions_go_to_the_least_loaded_replica() {
        let pool = Pool::new(
            "http://127.0.0.1:7001,http://127.0.0.1:7002",
            None,
            Duration::from_millis(100),
            None,
        );
        pool.refresh().await;
        let first = pool.by_load()[0].clone();
        let _held = first.hold();
        for _ in 0..4 {
            assert_ne!(pool.by_load()[0].addr, first.addr);
        }
        drop(_held);
        let picks: std::collections::HashSet<_> = (0..4).map(|_| pool.by_load()[0].addr).collect();
        assert_eq!(picks.len(), 2, "idle replicas are taken in turn");
    }

    /// The replicas four prompts of `tokens` tokens and block hashes `blocks` would go to
    /// first.
    fn firsts(pool: &Pool, tokens: usize, blocks: &[u64]) -> std::collections::HashSet<SocketAddr> {
        (0..4)
            .map(|_| pool.for_prompt(tokens, blocks)[0].addr)
            .collect()
    }

    /// Prefix routing: a prompt goes where its longest prefix went, however the idle
    /// replicas would take turns, until that replica holds more than `max_imbalance`
    /// sessions over the least loaded; a prompt sharing nothing, or less than
    /// `min_share` of itself, goes by load.
    #[tokio::test]
    async fn a_prompt_goes_where_its_longest_prefix_went() {
        let pool = Pool::new(
            "http://127.0.0.1:7001,http://127.0.0.1:7002",
            None,
            Duration::from_millis(100),
            Some(PrefixRouting {
                max_imbalance: 1,
                min_share: 0.5,
            }),
        );
        pool.refresh().await;
        let (a, b) = (pool.replicas()[0].clone(), pool.replicas()[1].clone());
        a.remember(&[1, 2]);
        b.remember(&[1, 2, 3]);
        for _ in 0..4 {
            assert_eq!(pool.for_prompt(128, &[1, 2, 3, 4])[0].addr, b.addr);
        }
        let picks = firsts(&pool, 96, &[1, 2, 9]);
        assert_eq!(picks.len(), 2, "equals, equally loaded: in turn");
        let picks = firsts(&pool, 192, &[1, 2, 3, 9, 9, 9]);
        assert_eq!(picks, [b.addr].into(), "half the prompt: followed");
        let picks = firsts(&pool, 224, &[1, 2, 3, 9, 9, 9, 9]);
        assert_eq!(picks.len(), 2, "less than half the prompt: by load");
        let _first = b.hold();
        assert_eq!(
            pool.for_prompt(96, &[1, 2, 9])[0].addr,
            a.addr,
            "the less loaded of equals"
        );
        assert_eq!(
            pool.for_prompt(96, &[1, 2, 3])[0].addr,
            b.addr,
            "one over: within the bound"
        );
        let _second = b.hold();
        assert_eq!(
            pool.for_prompt(96, &[1, 2, 3])[0].addr,
            a.addr,
            "two over: by load"
        );
        drop(_second);
        let picks = firsts(&pool, 64, &[7, 8]);
        assert_eq!(picks, [a.addr].into(), "nothing shared: the least loaded");
        // Without prefix routing, by load alone.
        let plain = Pool::new(
            "http://127.0.0.1:7001,http://127.0.0.1:7002",
            None,
            Duration::from_millis(100),
            None,
        );
        plain.refresh().await;
        plain.replicas()[1].remember(&[1]);
        let picks = firsts(&plain, 32, &[1]);
        assert_eq!(picks.len(), 2);
    }

    /// The remembered blocks are bounded: past the bound the older half goes.
    #[test]
    fn a_replicas_remembered_blocks_are_bounded() {
        let mut p = Prefixes::default();
        for i in 0..REMEMBERED_BLOCKS as u64 {
            p.remember(&[i]);
        }
        assert_eq!(p.seen.len(), REMEMBERED_BLOCKS);
        p.remember(&[u64::MAX]);
        assert_eq!(p.seen.len(), REMEMBERED_BLOCKS / 2);
        assert_eq!(p.matched(&[u64::MAX]), 1);
        assert_eq!(p.matched(&[0]), 0, "the oldest went");
        assert_eq!(p.matched(&[REMEMBERED_BLOCKS as u64 - 1, u64::MAX]), 2);
    }

    #[tokio::test]
    async fn an_open_counts_the_prompts_prefilling_before_it() {
        let pool = Pool::new(
            "http://127.0.0.1:7001",
            None,
            Duration::from_millis(100),
            None,
        );
        pool.refresh().await;
        let replica = pool.replicas()[0].clone();
        let (first, before) = replica.prefill(300);
        assert_eq!(before, 0);
        let (second, before) = replica.prefill(50);
        assert_eq!(before, 300);
        drop(first);
        let (_third, before) = replica.prefill(20);
        assert_eq!(before, 50);
        drop(second);
        assert_eq!(replica.prefill(1).1, 20);
    }

    #[tokio::test]
    async fn a_failed_lookup_keeps_the_known_replicas() {
        let pool = Pool::new(
            "http://127.0.0.1:7001",
            None,
            Duration::from_millis(100),
            None,
        );
        pool.refresh().await;
        let broken = Pool {
            names: vec!["no-such-host.invalid:1".into()],
            tls: RwLock::default(),
            connect_timeout: Duration::from_millis(100),
            replicas: RwLock::new(pool.replicas()),
            next: AtomicUsize::new(0),
            prefix_routing: None,
        };
        broken.refresh().await;
        assert_eq!(broken.replicas().len(), 1);
    }
}
