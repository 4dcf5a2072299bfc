//! The session table: limits and the KV budget, a close before its open, the idle TTL and
//! ids, the prefix cache's donors and a tree's rows, rewinds, and the room an open asks
//! for (preemption).

use super::*;
use crate::prefix_cache::{Donated, Exact};
use duet_engine::testing::TinyModel;
use duet_engine::{LoadOptions, Model};

fn session(model: &Model, capacity: usize) -> Arc<Mutex<Session>> {
    let cache = model.new_cache(capacity).unwrap();
    let rng = duet_engine::sampling::rng_for(0);
    Arc::new(Mutex::new(Session::plain(
        cache,
        SamplingParams::greedy(),
        rng,
    )))
}

/// Sessions of at most 4 and `kv_token_budget` tokens, with a prefix cache of `cap` that
/// copies the rows `exact` allows.
fn with_prefix_cache(kv_token_budget: usize, cap: usize, exact: Exact) -> Sessions {
    let sessions = Sessions::new(Limits {
        max_sessions: 4,
        kv_token_budget,
        ttl: Duration::from_secs(60),
    });
    sessions.enable_prefix_cache(cap, exact);
    sessions
}

fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyModel::default().write(&path).unwrap();
    let model = Model::load(
        &path,
        &LoadOptions {
            device: duet_engine::select_device("cpu").unwrap(),
            transcode_q5_0: false,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    (dir, model)
}

#[test]
fn limits_budget_and_close() {
    let (_dir, model) = tiny();
    let sessions = Sessions::new(Limits {
        max_sessions: 2,
        kv_token_budget: 100,
        ttl: Duration::from_secs(60),
    });
    let me = sessions.instance();
    let a = sessions
        .reserve(60, None)
        .unwrap()
        .insert(session(&model, 60), None, None)
        .unwrap();
    assert!(matches!(
        sessions.reserve(50, None),
        Err(WorkerError::KvBudget { free: 40, .. })
    ));
    // A dropped reservation gives its tokens back.
    drop(sessions.reserve(40, None).unwrap());
    let b = sessions
        .reserve(40, None)
        .unwrap()
        .insert(session(&model, 40), None, None)
        .unwrap();
    assert!(matches!(
        sessions.reserve(0, None),
        Err(WorkerError::SessionLimit(2))
    ));
    // Opens still prefilling count against the limit too.
    assert!(sessions.close(b, me));
    let opening = sessions.reserve(40, None).unwrap();
    assert!(matches!(
        sessions.reserve(0, None),
        Err(WorkerError::SessionLimit(2))
    ));
    let b = opening.insert(session(&model, 40), None, None).unwrap();
    assert_eq!(sessions.stats().reserved_tokens, 100);
    // Another instance's call (this worker restarted since) finds nothing.
    assert!(matches!(
        sessions.get(b, me ^ 1),
        Err(WorkerError::OtherInstance { .. })
    ));
    assert!(!sessions.close(a, me ^ 1));
    assert!(sessions.close(a, me));
    assert!(!sessions.close(a, me));
    assert!(matches!(
        sessions.get(a, me),
        Err(WorkerError::SessionNotFound(_))
    ));
    assert!(sessions.get(b, me).is_ok());
    assert_eq!(sessions.stats().active, 1);
    assert_eq!(sessions.stats().reserved_tokens, 40);
}

/// A caller's name for its session: closing it (instance 0) while the session opens fails
/// the open, before the open arrives fails the open when it comes (within the TTL), and
/// after it opened closes it; an id in use is refused.
#[test]
fn a_named_session_closes_before_its_open_answers() {
    let (_dir, model) = tiny();
    let (clock, sessions) = table_on_a_manual_clock();
    let (a, b, c) = (SessionId([1; 16]), SessionId([2; 16]), SessionId([3; 16]));
    // Closed while it opens: the open fails and gives its tokens back.
    let opening = sessions.reserve(10, Some(a)).unwrap();
    assert!(matches!(
        sessions.reserve(10, Some(a)),
        Err(WorkerError::SessionExists(_))
    ));
    assert!(sessions.close(a, 0));
    assert!(matches!(
        opening.insert(session(&model, 10), None, None),
        Err(WorkerError::ClosedWhileOpening(_))
    ));
    assert_eq!(sessions.stats().reserved_tokens, 0);
    // Closed before its open arrived: the open fails, once.
    assert!(!sessions.close(b, 0));
    assert!(matches!(
        sessions.reserve(10, Some(b)),
        Err(WorkerError::ClosedWhileOpening(_))
    ));
    let opened = sessions.reserve(10, Some(b)).unwrap();
    assert_eq!(opened.insert(session(&model, 10), None, None).unwrap(), b);
    assert!(sessions.close(b, 0));
    // Remembered for the TTL only.
    assert!(!sessions.close(c, 0));
    clock.0.store(101, Ordering::Relaxed);
    assert!(!sessions.close(SessionId([4; 16]), 0));
    assert!(sessions.reserve(10, Some(c)).is_ok());
    assert_eq!(sessions.stats().active, 0);
    assert_eq!(sessions.stats().abandoned_opens, 5);
}

/// Time that moves only when the test says.
#[derive(Debug, Default)]
struct ManualClock(AtomicU64);

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Four sessions, 100 tokens, a 100 ms TTL, and the clock that drives it.
fn table_on_a_manual_clock() -> (Arc<ManualClock>, Sessions) {
    let clock = Arc::new(ManualClock::default());
    let limits = Limits {
        max_sessions: 4,
        kv_token_budget: 100,
        ttl: Duration::from_millis(100),
    };
    (clock.clone(), Sessions::with_clock(limits, clock))
}

/// An open refused for room asks the session of the highest priority number above its
/// own (then the latest) to give way, one at a time; sessions without a priority are
/// never asked. The room is held for it: a less urgent open (or one without a
/// priority) does not take it, the open itself does, and the hold lapses when the open
/// stops asking.
#[test]
fn a_refused_open_asks_a_session_of_a_higher_number_and_its_room_is_held_for_it() {
    let (_dir, model) = tiny();
    let (clock, sessions) = table_on_a_manual_clock();
    let open = |capacity, priority| {
        let reserved = sessions.reserve_ranked(capacity, None, priority).unwrap();
        reserved
            .insert(session(&model, capacity), None, priority)
            .unwrap()
    };
    let none = open(20, None);
    let urgent = open(20, Some(0));
    let early = open(20, Some(7));
    let late = open(40, Some(7));
    let refused = sessions.reserve_ranked(30, None, Some(3)).map(|_| ());
    assert_eq!(
        refused.unwrap_err().to_string(),
        "session limit reached (4 open sessions)"
    );
    assert!(sessions.ask_to_give_way(3, 30));
    let asked = [none, urgent, early, late].map(|id| sessions.gives_way(id));
    assert_eq!(asked, [false, false, false, true]);
    // One at a time.
    assert!(!sessions.ask_to_give_way(3, 30));
    assert!(sessions.close(late, sessions.instance()));
    // The room is held for the open of priority 3: not for one of 5, nor one without.
    for priority in [Some(5), None] {
        let held = sessions.reserve_ranked(10, None, priority).map(|_| ());
        let why = "the room freed here is held for a request of priority 3";
        assert_eq!(held.unwrap_err().to_string(), why);
    }
    let taken = sessions.reserve_ranked(30, None, Some(3)).unwrap();
    drop(taken);
    // Taken, the hold ends.
    sessions.reserve_ranked(10, None, None).map(drop).unwrap();
    assert!(sessions.ask_to_give_way(1, 10));
    assert!(sessions.gives_way(early));
    let held = sessions.reserve_ranked(10, None, Some(2)).map(|_| ());
    assert!(matches!(held, Err(WorkerError::RoomClaimed(1))), "{held:?}");
    // The open that asked found room before the session asked closed: that one need
    // not give way any more.
    sessions
        .reserve_ranked(10, None, Some(1))
        .map(drop)
        .unwrap();
    assert!(!sessions.gives_way(early));
    // A hold lapses CLAIM_MS after its open last asked.
    assert!(sessions.ask_to_give_way(1, 10));
    assert!(sessions.reserve_ranked(10, None, Some(2)).is_err());
    clock.0.store(CLAIM_MS, Ordering::Relaxed);
    sessions
        .reserve_ranked(10, None, Some(2))
        .map(drop)
        .unwrap();
}

#[test]
fn idle_sessions_expire_unless_in_use() {
    let (_dir, model) = tiny();
    let (clock, sessions) = table_on_a_manual_clock();
    let me = sessions.instance();
    let busy = sessions
        .reserve(10, None)
        .unwrap()
        .insert(session(&model, 10), None, None)
        .unwrap();
    let idle = sessions
        .reserve(10, None)
        .unwrap()
        .insert(session(&model, 10), None, None)
        .unwrap();
    let held = sessions.get(busy, me).unwrap();
    clock.0.store(100, Ordering::Relaxed);
    assert_eq!(sessions.expire_idle(), 0, "idle for exactly the TTL: kept");
    clock.0.store(101, Ordering::Relaxed);
    // Both are past the TTL, but a call holds `busy`.
    assert_eq!(sessions.expire_idle(), 1);
    assert!(sessions.get(idle, me).is_err());
    drop(held);
    // Its last use was the `get` at 0 ms; a call now, at 101 ms, refreshes it.
    sessions.get(busy, me).unwrap();
    clock.0.store(201, Ordering::Relaxed);
    assert_eq!(sessions.expire_idle(), 0);
    clock.0.store(202, Ordering::Relaxed);
    assert_eq!(sessions.expire_idle(), 1);
    assert_eq!(sessions.stats().active, 0);
    assert_eq!(sessions.stats().expired, 2);
    assert_eq!(sessions.stats().reserved_tokens, 0);
}

/// Ids are random: nothing about one tells the next, and two workers (or one restarted)
/// do not repeat each other's.
#[test]
fn session_ids_are_random_and_instances_differ() {
    let (_dir, model) = tiny();
    let limits = Limits {
        max_sessions: 64,
        kv_token_budget: 64,
        ttl: Duration::from_secs(60),
    };
    let (a, b) = (Sessions::new(limits), Sessions::new(limits));
    assert_ne!(a.instance(), b.instance());
    let ids: std::collections::HashSet<SessionId> = (0..32)
        .map(|_| {
            a.reserve(1, None)
                .unwrap()
                .insert(session(&model, 1), None, None)
                .unwrap()
        })
        .collect();
    assert_eq!(ids.len(), 32);
    let first = ids.iter().next().unwrap();
    // Random bytes: about half the bits differ between any two ids.
    for other in ids.iter().skip(1) {
        let differ: u32 = first
            .0
            .iter()
            .zip(other.0)
            .map(|(x, y)| (x ^ y).count_ones())
            .sum();
        assert!((20..=108).contains(&differ), "{first} vs {other}");
    }
    assert!(SessionId::from_wire(&[0; 8]).is_err());
    assert_eq!(SessionId::from_wire(&first.0).unwrap(), *first);
}

/// A session of `capacity` whose cache holds `tokens`.
fn fed(model: &Model, capacity: usize, tokens: &[u32]) -> Arc<Mutex<Session>> {
    let s = session(model, capacity);
    model
        .forward(
            &mut s.lock().unwrap().cache,
            tokens,
            duet_engine::LogitsFor::None,
        )
        .unwrap();
    s
}

/// Opens `s` (its cache holding `prompt`) as a session of `capacity` whose prompt later
/// sessions may copy, as an open's prefill offers it.
fn open_donor(
    sessions: &Sessions,
    s: Arc<Mutex<Session>>,
    prompt: &[u32],
    capacity: usize,
) -> SessionId {
    let donor = sessions.offer_prompt(&s, prompt);
    let reserved = sessions.reserve(capacity, None).unwrap();
    reserved.insert(s, donor, None).unwrap()
}

/// How many rows a new cache of 50 copies from `sessions`' prefix cache for `tokens`, its
/// prefill covering the first `prefill`.
fn copied(model: &Model, sessions: &Sessions, tokens: &[u32], prefill: usize) -> usize {
    let mut cache = model.new_cache(50).unwrap();
    let source = sessions.prefix_source(tokens, 0).expect("a donor");
    source.copy_into(&mut cache, tokens, prefill).unwrap()
}

/// Closed sessions' caches stay for later sessions within the cap, count against the
/// KV budget (reported apart), and go first, least recently used, when a session or a
/// newer cache needs the room; a cache bigger than the cap, or holding less than one
/// whole block, is not kept.
#[test]
fn cached_prefixes_give_way_to_sessions() {
    let (_dir, model) = tiny();
    let sessions = with_prefix_cache(100, 50, Exact::AnyRow);
    let me = sessions.instance();
    let (x, y): (Vec<u32>, Vec<u32>) = ((1..=33).collect(), (101..=133).collect());
    let open = |capacity: usize, tokens: &[u32]| {
        open_donor(&sessions, fed(&model, capacity, tokens), tokens, capacity)
    };
    let found = |tokens: &[u32]| match sessions.prefix_source(tokens, 0).map(|s| s.rows) {
        Some(Donated::Finished(kept)) => Some(kept.cache.capacity()),
        Some(Donated::Live(_)) => Some(0),
        None => None,
    };
    let a = open(40, &x);
    assert_eq!(found(&x), Some(0), "an open session's prompt");
    assert!(sessions.close(a, me));
    assert_eq!(found(&x), Some(40));
    assert_eq!(sessions.stats().prefix_cached_tokens, 40);
    assert_eq!(sessions.stats().reserved_tokens, 0);
    // y's cache needs room under the cap of 50: x's goes.
    let b = open(40, &y);
    assert!(sessions.close(b, me));
    assert_eq!((found(&x), found(&y)), (None, Some(40)));
    // A session needing 70 of the 100 tokens pushes y's out.
    let c = sessions.reserve(70, None).unwrap();
    assert_eq!(
        (found(&y), sessions.stats().prefix_cached_tokens),
        (None, 0)
    );
    drop(c);
    // Bigger than the cap, or less than a block: not kept.
    let d = open(60, &x);
    assert!(sessions.close(d, me));
    let e = open(40, &x[..31]);
    assert!(sessions.close(e, me));
    assert_eq!(
        (found(&x), sessions.stats().prefix_cached_tokens),
        (None, 0)
    );
    // Closed while a pass still holds it: counted, and kept once the pass lets go.
    let f = open(40, &x);
    let held = sessions.get(f, me).unwrap();
    assert!(sessions.close(f, me));
    assert_eq!(sessions.stats().prefix_cached_tokens, 40);
    assert_eq!(found(&x), None);
    drop(held);
    assert_eq!(found(&x), Some(40));
}

/// A salted session's prompt, and its cache once closed, are found by sessions of its
/// salt only, an unsalted one's by unsalted ones only; a cache does not push out another
/// salt's that it covers.
#[test]
fn a_prefix_is_found_under_its_salt_only() {
    let (_dir, model) = tiny();
    let sessions = with_prefix_cache(200, 100, Exact::AnyRow);
    let me = sessions.instance();
    let x: Vec<u32> = (1..=33).collect();
    let open = |salt| {
        let s = fed(&model, 40, &x);
        s.lock().unwrap().cache_salt = salt;
        open_donor(&sessions, s, &x, 40)
    };
    let found = |salt| sessions.prefix_source(&x, salt).is_some();
    let a = open(7);
    assert_eq!((found(7), found(0), found(8)), (true, false, false));
    assert!(sessions.close(a, me));
    assert_eq!((found(7), found(0)), (true, false));
    let b = open(0);
    assert!(sessions.close(b, me));
    assert_eq!((found(7), found(0)), (true, true));
}

/// A later session copies a cache's rows only as far as they sit at their tokens'
/// places: never a tree's alternative, whose keys are those of its parent's next position,
/// from a live session or from a closed one.
#[test]
fn no_session_starts_from_a_trees_alternative() {
    let (_dir, model) = tiny();
    let sessions = with_prefix_cache(200, 100, Exact::AnyRow);
    let prompt: Vec<u32> = (1..=40).collect();
    let s = fed(&model, 50, &prompt);
    {
        let mut guard = s.lock().unwrap();
        // The Verify's appended 41, then drafts 42 (after 41) and 99 (also after 41).
        let mut tree = [duet_engine::SequenceInput {
            cache: &mut guard.cache,
            tokens: &[41, 42, 99],
            logits: duet_engine::LogitsFor::None,
            extra: None,
            greedy: false,
            draws: &[],
            parents: &[0, 0, 0],
        }];
        model.forward_batch(&mut tree).unwrap();
        guard.tree = vec![(41, 40), (42, 40)];
        assert_eq!(guard.in_place(), 42);
    }
    let id = open_donor(&sessions, s, &prompt, 50);
    let wanted: Vec<u32> = (1..=41).chain([42, 99, 7]).collect();
    let copied = || copied(&model, &sessions, &wanted, wanted.len());
    assert_eq!(copied(), 42, "from the live session");
    assert!(sessions.close(id, sessions.instance()));
    assert_eq!(copied(), 42, "from its closed cache");
}

/// Where rows depend on the pass, a later session copies from a live session or its closed
/// cache only the whole prefill chunks it would cut alike (rows 36 on came from calls), or
/// all of the same prompt prefilled to the same end.
#[test]
fn where_rows_depend_on_the_pass_whole_prefill_chunks_are_copied() {
    let (_dir, model) = tiny();
    let sessions = with_prefix_cache(200, 100, Exact::WholeChunks(8));
    let prompt: Vec<u32> = (1..=40).collect();
    let s = fed(&model, 50, &prompt);
    s.lock().unwrap().prefilled = 36;
    let id = open_donor(&sessions, s, &prompt, 50);
    let copied = |tokens: &[u32], prefill| copied(&model, &sessions, tokens, prefill);
    let longer: Vec<u32> = (1..=48).collect();
    assert_eq!(copied(&longer, 48), 32, "from the live session");
    assert_eq!(copied(&prompt[..36], 36), 36, "the same prompt");
    assert!(sessions.close(id, sessions.instance()));
    assert_eq!(copied(&longer, 48), 32, "from its closed cache");
    assert_eq!(copied(&prompt[..36], 36), 36);
    assert_eq!(copied(&longer, 30), 24, "its own calls from row 30");
}

#[test]
fn a_tree_path_is_kept_once_and_only_where_the_tokens_take_it() {
    let (_dir, model) = tiny();
    let s = session(&model, 16);
    let mut s = s.lock().unwrap();
    // Cache [1, 2] then the tree: 3 (appended), 10 and 20 after 3, 11 after 10.
    let nodes = [3, 10, 20, 11];
    let mut tree = [duet_engine::SequenceInput::chain(
        &mut s.cache,
        &[1, 2],
        duet_engine::LogitsFor::None,
    )];
    model.forward_batch(&mut tree).unwrap();
    tree[0].tokens = &nodes;
    tree[0].parents = &[0, 0, 0, 1];
    model.forward_batch(&mut tree).unwrap();
    let remembered = vec![(3, 2), (4, 2), (5, 3)];
    // 20 then 11: 20 is held, 11 is not after it; the last appended token is fed.
    s.tree = remembered.clone();
    assert_eq!(s.reuse_tree(3, &[20, 11, 7]), 1);
    assert_eq!(s.cache.tokens(), &[1, 2, 3, 20]);
    assert!(s.tree.is_empty(), "a tree serves the next call only");
    assert_eq!(s.reuse_tree(3, &[20, 7]), 0);
    // Rebuilt: 10 then 11 (the whole path), 99 fed.
    s.cache.truncate(2).unwrap();
    let mut again = [duet_engine::SequenceInput {
        cache: &mut s.cache,
        tokens: &nodes,
        logits: duet_engine::LogitsFor::None,
        extra: None,
        greedy: false,
        draws: &[],
        parents: &[0, 0, 0, 1],
    }];
    model.forward_batch(&mut again).unwrap();
    s.tree = remembered;
    assert_eq!(s.reuse_tree(3, &[10, 11, 99]), 2);
    assert_eq!(s.cache.tokens(), &[1, 2, 3, 10, 11]);
}

#[test]
fn rewind_checks_keep_and_capacity() {
    let (_dir, model) = tiny();
    let s = session(&model, 8);
    let mut s = s.lock().unwrap();
    model
        .forward(&mut s.cache, &[1, 2, 3], duet_engine::LogitsFor::None)
        .unwrap();
    s.prefilled = 3;
    assert!(s.rewind(4, 1, 0).is_err());
    assert!(s.rewind(2, 5, 2).is_err());
    assert_eq!(s.prefilled, 3);
    s.rewind(2, 5, 1).unwrap();
    // What is fed again from row 2 on comes from calls.
    assert_eq!((s.cache.len(), s.prefilled), (2, 2));
}
