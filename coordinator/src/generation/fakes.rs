//! Fake workers for the loop's unit tests: a deterministic "target model" (the next token is
//! a hash of the sequence so far, computed from each session's own cache, so wrong
//! `keep`/`append` bookkeeping changes the output) and a draft that predicts it exactly
//! except where a script says otherwise: a wrong token at a chosen position of every
//! round, a failure or a malformed answer on a chosen call.

use crate::workers::{CallError, Failure, Models, Next, Open, Party, SamplingTest, TargetChoice};
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::sampling::{Distribution, rng_at, rng_position};
use duet_engine::verify::{Drafted, rows, test_sampled};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

mod workers;

/// Tokens the fake models produce: byte tokens, never a special one.
pub const FAKE_TOKENS: u32 = 200;

/// What the fake target generates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Target {
    /// A hash of the sequence: text prompt lookup rarely predicts.
    #[default]
    Hash,
    /// The last `n` tokens again and again: text prompt lookup predicts once it has seen
    /// `n` of them.
    Cycle(usize),
    /// The hash for this many tokens of the completion, then the cycle of 3: prose, then a
    /// copy.
    HashThenCycle(usize, usize),
}

impl Target {
    /// The next token after `seq`, whose first `prompt` tokens were the prompt.
    pub fn next(self, seq: &[u32], prompt: usize) -> u32 {
        match self {
            Target::Hash => next_token(seq),
            Target::Cycle(n) => seq[seq.len() - n],
            Target::HashThenCycle(hashed, n) if seq.len() >= prompt + hashed => seq[seq.len() - n],
            Target::HashThenCycle(..) => next_token(seq),
        }
    }
}

/// The hash target's next token after `seq`.
pub fn next_token(seq: &[u32]) -> u32 {
    let mut h = seq.len() as u64;
    for &t in seq.iter().rev().take(3) {
        h = h
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(u64::from(t) + 1);
    }
    ((h >> 33) % u64::from(FAKE_TOKENS)) as u32
}

/// The uncertain draft's `n`-th draw: SplitMix64's output for `n`.
fn splitmix(n: u64) -> u64 {
    let mut z = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The token after `t` in id order (among the fake tokens).
pub fn following(t: u32) -> u32 {
    (t + 1) % FAKE_TOKENS
}

/// The tiny test model's tokenizer and vocabulary, written once per test process.
pub fn models() -> Arc<Models> {
    static MODELS: OnceLock<Arc<Models>> = OnceLock::new();
    MODELS
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("tiny.gguf");
            duet_engine::testing::TinyModel::default()
                .write(&path)
                .unwrap();
            let tokenizer = duet_engine::Tokenizer::load(&path).unwrap();
            let vocab = tokenizer.vocab_size();
            Arc::new(Models::new(
                tokenizer,
                String::new(),
                (vocab, 256),
                "fake".into(),
            ))
        })
        .clone()
}

/// How a draft answer is broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// One token more than asked for.
    ExtraToken,
    /// A token id outside the vocabulary.
    OutOfVocabulary,
    /// No q at all (a sampling session needs one per token).
    NoDistributions,
}

/// What the fakes do.
#[derive(Debug, Clone, Default)]
pub struct Script {
    /// What the target generates (and the draft predicts, but for `wrong_at`).
    pub target: Target,
    /// In every round the draft gets the token at this position wrong.
    pub wrong_at: Option<usize>,
    /// In every round the draft gives the token at this position probability 0.3 (the
    /// others 1; the uncertain draft's, their q), for calls that may stop early.
    pub unsure_at: Option<usize>,
    /// The n-th Propose call (0-based) fails so.
    pub propose_fails: Option<(usize, Failure)>,
    /// The n-th Propose call answers so.
    pub propose_malformed: Option<(usize, Malformed)>,
    /// The n-th Verify calls fail so.
    pub verify_fails: Vec<(usize, Failure)>,
    /// The first this many failover reopens answer Busy (every other replica full).
    pub reopen_busy: usize,
    /// The target has room for this many sessions: an open beyond them answers Busy.
    pub target_room: Option<usize>,
    /// The breaker is open with this reason.
    pub draft_unavailable: Option<String>,
    /// Opening a draft session (its prefill) takes this long.
    pub draft_open: std::time::Duration,
    /// A Verify call takes this long (its target pass).
    pub verify_time: std::time::Duration,
    /// A Propose call takes this long (its draft steps).
    pub propose_time: std::time::Duration,
    /// A Verify call during which a Propose ran reports its pass this much slower (1.0:
    /// twice as long), as on cores the two workers share.
    pub contention: f64,
    /// Sampling sessions are uncertain: the target gives its next token 0.6 and the token
    /// after it (in id order) 0.4; the draft samples the same two at 0.5 each (or the
    /// target's token at `draft_odds`), from draws of its own. (Otherwise both are point
    /// masses on the target's token.)
    pub uncertain: bool,
    pub draft_odds: Option<f32>,
    /// The target sessions' replicas verify chains only (a Verify with `parents` is
    /// refused, as a GPU replica refuses it): all of them, or those a failover reopens.
    pub chains_only: bool,
    pub reopened_chains_only: bool,
    /// The target refuses Decode calls (a target-worker from before them).
    pub no_decode: bool,
    /// The target's Decode streams look nothing up (a target-worker from before
    /// `DecodeRequest.lookup`).
    pub no_stream_lookup: bool,
    /// The target answers every sampling Verify with p, a `SamplingTest` or not (a
    /// target-worker from before them).
    pub no_sampling_test: bool,
    /// The target tests a chain without the q's whole (`SamplingTest::whole`), leaving a
    /// draft model's rejection to the caller (a target-worker from before the field).
    pub no_whole_q: bool,
}

impl Script {
    /// The target's p at a position where its token is `t`.
    fn p(&self, t: u32) -> Distribution {
        match self.uncertain {
            true => Distribution::from_pairs([(t, 0.6), (following(t), 0.4)]).unwrap(),
            false => Distribution::point(t),
        }
    }

    /// A Decode step that verifies `drafts` after `seq` as a target-worker's does: the
    /// target's token at each place (`seq` then the drafts before it), the drafts it
    /// accepts, the tokens the step answers, and where a sampling session's random stream
    /// then stands (its drafts tested as point masses, at `at`).
    pub(super) fn lookup_step(
        &self,
        seq: &[u32],
        prompt: usize,
        drafts: &[u32],
        (seed, at): (Option<u64>, u64),
    ) -> (TargetChoice, Vec<u32>, usize, u64) {
        let mut fed = seq.to_vec();
        let mut targets = Vec::with_capacity(drafts.len() + 1);
        for i in 0..=drafts.len() {
            targets.push(self.target.next(&fed, prompt));
            fed.extend(drafts.get(i));
        }
        let Some(seed) = seed else {
            let accepted = drafts
                .iter()
                .zip(&targets)
                .take_while(|(d, t)| d == t)
                .count();
            let tokens = targets[..=accepted].to_vec();
            let last = TargetChoice::Argmax(vec![tokens[accepted]]);
            return (last, tokens, accepted, at);
        };
        let test = SamplingTest {
            q: &[],
            point_masses: true,
            whole: &[],
            rng_position: at,
        };
        match self.tested(&targets, drafts, test, seed) {
            TargetChoice::Tested {
                accepted,
                next: Next::Drawn(token),
                rng_position,
            } => {
                let tokens = drafts[..accepted].iter().copied().chain([token]).collect();
                let last = TargetChoice::Tested {
                    accepted: 0,
                    next: Next::Drawn(token),
                    rng_position,
                };
                (last, tokens, accepted, rng_position)
            }
            _ => unreachable!("point masses draw their correction"),
        }
    }

    /// A sampling session's chain `drafts` tested as a target-worker tests it, where the
    /// target's tokens are `targets` (one more than the drafts).
    fn tested(
        &self,
        targets: &[u32],
        drafts: &[u32],
        test: SamplingTest,
        seed: u64,
    ) -> TargetChoice {
        let p: Vec<Distribution> = targets.iter().map(|&t| self.p(t)).collect();
        let mut rng = rng_at(seed, test.rng_position);
        let points: Vec<Distribution>;
        let drafted = match (test.point_masses, test.whole) {
            (true, _) => {
                points = drafts.iter().map(|&x| Distribution::point(x)).collect();
                Drafted::Whole(&points)
            }
            (false, []) => Drafted::Probabilities(test.q),
            (false, whole) => Drafted::Whole(whole),
        };
        let (tested, last) = test_sampled(drafts, drafted, rows(&p), &mut rng).unwrap();
        let next = match tested.token {
            Some(token) => Next::Drawn(token),
            None => Next::Rejected(last.into_owned()),
        };
        TargetChoice::Tested {
            accepted: tested.accepted,
            next,
            rng_position: rng_position(&rng),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Each open session's cache.
    caches: HashMap<u64, Vec<u32>>,
    /// The open target sessions, and those closed by `close_target`.
    targets: HashSet<u64>,
    target_closes: usize,
    /// Each target session's priority (`Open::priority`), the one an open asked to give its
    /// room up (`Open::ask_for_room`) while it is open, and the priority of the open that
    /// asked, for which the room is held until an open of that priority or lower opens.
    priorities: HashMap<u64, i32>,
    asked: Option<u64>,
    claim: Option<i32>,
    next_id: u64,
    /// Failover reopens answered Busy so far.
    reopens_refused: usize,
    proposes: usize,
    /// Target passes: Verify calls and Decode steps.
    verifies: usize,
    /// Decode calls, and the tokens each answered.
    decodes: Vec<usize>,
    /// Decode steps whose stream was dropped while they ran.
    steps_dropped: usize,
    /// Drafts per Verify call, in order.
    verified_drafts: Vec<usize>,
    /// Each Verify call's `parents` (empty: a chain).
    verified_parents: Vec<Vec<u32>>,
    /// Verify calls answered with a `SamplingTest`'s verdict, and those of them whose
    /// verdict left the correction to the caller.
    sampling_tests: (usize, usize),
    /// Tokens appended by each call, in order.
    appended: Vec<(Party, usize)>,
    trips: Vec<String>,
    /// The prompt length of each target session opened, and where its generated tokens
    /// begin (`Open::generated_after`), in order.
    target_opens: Vec<(usize, usize)>,
    /// Draft sessions opened so far, being opened now, and Verify calls made meanwhile.
    draft_opens: usize,
    /// Each draft session opened: its prompt length, where its generated tokens begin, and
    /// whether it has a structured output.
    draft_opened: Vec<(usize, usize, bool)>,
    draft_opening: usize,
    verifies_while_draft_opens: usize,
    /// Draft session opens whose caller dropped them before they answered.
    draft_opens_dropped: usize,
    /// Verify calls in progress now, and Propose calls made meanwhile.
    verifying: usize,
    proposes_while_verifying: usize,
    /// Propose calls in progress now (with a `propose_time`), and Verify calls made
    /// meanwhile.
    proposing: usize,
    verifies_while_proposing: usize,
    /// Propose calls (with a `propose_time`) whose caller dropped them before they answered.
    proposes_dropped: usize,
    /// The uncertain draft's draws so far.
    draws: u64,
    /// Each Propose call's K, and the tokens it answered.
    proposals: Vec<(usize, usize)>,
}

/// A call in progress, counted in the first of the two counters `counters` picks until it
/// answers or is dropped; a drop before the answer also counts in the second.
struct InProgress<'a> {
    state: &'a Mutex<State>,
    counters: fn(&mut State) -> (&mut usize, &mut usize),
    answered: bool,
}

impl<'a> InProgress<'a> {
    fn start(
        state: &'a Mutex<State>,
        counters: fn(&mut State) -> (&mut usize, &mut usize),
    ) -> Self {
        *counters(&mut state.lock().unwrap()).0 += 1;
        Self {
            state,
            counters,
            answered: false,
        }
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        let mut s = self.state.lock().unwrap();
        let (now, dropped) = (self.counters)(&mut s);
        *now -= 1;
        *dropped += usize::from(!self.answered);
    }
}

#[derive(Debug, Default)]
pub struct FakeWorkers {
    pub script: Script,
    state: Arc<Mutex<State>>,
}

/// A session on a fake worker; it closes when dropped.
#[derive(Debug)]
pub struct FakeSession {
    id: u64,
    sampling: bool,
    /// Its answers carry the chosen tokens' figures (`figures`), with this many others'.
    logprobs: Option<usize>,
    seed: u64,
    prompt: usize,
    /// Its replica verifies trees of drafts.
    trees: bool,
    state: Arc<Mutex<State>>,
}

impl Drop for FakeSession {
    fn drop(&mut self) {
        self.state.lock().unwrap().closed(self.id);
    }
}

impl State {
    /// Session `id` is closed: it holds no room, and is asked nothing.
    fn closed(&mut self, id: u64) {
        self.caches.remove(&id);
        self.targets.remove(&id);
        self.priorities.remove(&id);
        if self.asked == Some(id) {
            self.asked = None;
        }
    }

    /// A target open's refusal where the target holds `room` sessions already; an open
    /// that asks for room asks the session of the highest priority number above its own
    /// (then the latest) to give way, as a target-worker does.
    fn refused_for_room(&mut self, room: Option<usize>, open: &Open<'_>) -> Option<CallError> {
        let claimed = (self.claim).filter(|&c| open.priority.is_none_or(|p| p > c));
        if let Some(c) = claimed {
            let held = Failure::Busy(format!("the room is held for priority {c}"));
            return Some(CallError::new(Party::Target, held));
        }
        if room.is_none_or(|room| self.targets.len() < room) {
            self.claim = None;
            return None;
        }
        if let (Some(priority), true) = (open.priority, open.ask_for_room) {
            self.claim = Some(self.claim.map_or(priority, |c| c.min(priority)));
            if self.asked.is_none() {
                let above = self
                    .priorities
                    .iter()
                    .filter(|&(_, &theirs)| theirs > priority);
                let last = above.max_by_key(|&(&id, &theirs)| (theirs, id));
                self.asked = last.map(|(&id, _)| id);
            }
        }
        let busy = Failure::Busy("KV-token budget exhausted".into());
        Some(CallError::new(Party::Target, busy))
    }
}

impl FakeWorkers {
    pub fn new(script: Script) -> Arc<Self> {
        Arc::new(Self::owned(script))
    }

    /// Fakes to wrap (in `TakeTurns`) rather than share.
    pub fn owned(script: Script) -> Self {
        Self {
            script,
            state: Arc::default(),
        }
    }

    /// Sessions still open.
    pub fn open_sessions(&self) -> usize {
        self.state.lock().unwrap().caches.len()
    }

    /// Reasons the breaker was tripped with.
    pub fn trips(&self) -> Vec<String> {
        self.state.lock().unwrap().trips.clone()
    }

    /// Tokens each call appended to its session (after cutting it to `keep`).
    pub fn appended(&self, party: Party) -> Vec<usize> {
        let s = self.state.lock().unwrap();
        s.appended
            .iter()
            .filter(|(p, _)| *p == party)
            .map(|(_, n)| *n)
            .collect()
    }

    /// Draft sessions opened (or being opened).
    pub fn draft_opens(&self) -> usize {
        self.state.lock().unwrap().draft_opens
    }

    /// Each draft session opened: its prompt length, where its generated tokens begin
    /// (`Open::generated_after`), and whether it has a structured output.
    pub fn draft_opened(&self) -> Vec<(usize, usize, bool)> {
        self.state.lock().unwrap().draft_opened.clone()
    }

    /// Draft session opens dropped by their caller before they answered.
    pub fn draft_opens_dropped(&self) -> usize {
        self.state.lock().unwrap().draft_opens_dropped
    }

    /// Verify calls made while a draft session was being opened.
    pub fn verifies_while_draft_opens(&self) -> usize {
        self.state.lock().unwrap().verifies_while_draft_opens
    }

    /// Propose calls made while a Verify call was in progress.
    pub fn proposes_while_verifying(&self) -> usize {
        self.state.lock().unwrap().proposes_while_verifying
    }

    /// Verify calls made while a Propose call was in progress.
    pub fn verifies_while_proposing(&self) -> usize {
        self.state.lock().unwrap().verifies_while_proposing
    }

    /// Propose calls (with a `propose_time`) dropped by their caller before they answered.
    pub fn proposes_dropped(&self) -> usize {
        self.state.lock().unwrap().proposes_dropped
    }

    /// The prompt length of each target session opened, and where its generated tokens
    /// begin (`Open::generated_after`), in order.
    pub fn target_opens(&self) -> Vec<(usize, usize)> {
        self.state.lock().unwrap().target_opens.clone()
    }

    /// Target sessions closed by `close_target` (given up for a request of a lower
    /// priority).
    pub fn target_closes(&self) -> usize {
        self.state.lock().unwrap().target_closes
    }

    /// Each Propose call's K, and the tokens it answered.
    pub fn proposals(&self) -> Vec<(usize, usize)> {
        self.state.lock().unwrap().proposals.clone()
    }

    /// Drafts carried by each Verify call.
    pub fn verified_drafts(&self) -> Vec<usize> {
        self.state.lock().unwrap().verified_drafts.clone()
    }

    /// Tokens each Decode call answered, in order.
    pub fn decodes(&self) -> Vec<usize> {
        self.state.lock().unwrap().decodes.clone()
    }

    /// Decode steps whose stream was dropped while they ran.
    pub fn steps_dropped(&self) -> usize {
        self.state.lock().unwrap().steps_dropped
    }

    /// Verify calls answered with a sampling test's verdict, and those of them that left
    /// the correction to the caller.
    pub fn sampling_tests(&self) -> (usize, usize) {
        self.state.lock().unwrap().sampling_tests
    }

    /// Each Verify call's `parents` (empty: a chain).
    pub fn verified_parents(&self) -> Vec<Vec<u32>> {
        self.state.lock().unwrap().verified_parents.clone()
    }

    fn open(&self, open: Open<'_>) -> FakeSession {
        let mut s = self.state.lock().unwrap();
        s.next_id += 1;
        let id = s.next_id;
        s.caches
            .insert(id, open.prompt[..open.prompt.len() - 1].to_vec());
        FakeSession {
            id,
            sampling: !open.sampling.is_greedy(),
            logprobs: open.logprobs,
            seed: open.sampling.seed,
            prompt: open.prompt.len(),
            trees: !self.script.chains_only,
            state: self.state.clone(),
        }
    }

    /// Cuts a session's cache to `keep` and appends `append`, as a worker does; the fake
    /// panics on a `keep` beyond what it holds (a bookkeeping bug in the loop).
    fn rewind(cache: &mut Vec<u32>, keep: usize, append: &[u32]) {
        assert!(
            keep <= cache.len(),
            "keep {keep} beyond the {} cached",
            cache.len()
        );
        cache.truncate(keep);
        cache.extend_from_slice(append);
    }
}

/// The fake target's figures for `token` chosen at `place` of the sequence (a function of
/// both alone, as a real target's are of the row), with `top` made-up alternatives.
pub fn figures(place: usize, token: u32, top: usize) -> TokenLogprobs {
    let logprob = -(((place * 31 + token as usize) % 1000) as f32) / 100.0;
    TokenLogprobs {
        logprob,
        top: (0..top as u32)
            .map(|i| (token + i, logprob - i as f32))
            .collect(),
    }
}
