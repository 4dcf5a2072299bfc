//! Fake workers for the loop's unit tests: a deterministic "target model" (the next token is
//! a hash of the sequence so far, computed from each session's own cache, so wrong
//! `keep`/`append` bookkeeping changes the output) and a draft that predicts it exactly
//! except where a script says otherwise: a wrong token at a chosen position of every
//! round, a failure or a malformed answer on a chosen call.

use crate::workers::{
    CallError, Decode, Decoded, Failure, Models, Next, Open, Party, Proposal, Propose,
    SamplingTest, TargetChoice, TargetOpened, Verified, Verify, WorkerTiming, Workers,
};
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::sampling::{Distribution, rng_at, rng_position};
use duet_engine::verify::{Drafted, rows, test_sampled};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

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

    /// A Decode step at a position where the target's token is `t`: that token, or for a
    /// sampling session of `seed` the token drawn from p at `at` of its random stream, as
    /// a target-worker draws it; and where the stream then stands.
    fn step(&self, t: u32, seed: Option<u64>, at: u64) -> (TargetChoice, u32, u64) {
        let Some(seed) = seed else {
            return (TargetChoice::Argmax(vec![t]), t, at);
        };
        let test = SamplingTest {
            q: &[],
            point_masses: false,
            whole: &[],
            rng_position: at,
        };
        match self.tested(&[t], &[], test, seed) {
            choice @ TargetChoice::Tested {
                next: Next::Drawn(token),
                rng_position,
                ..
            } => (choice, token, rng_position),
            _ => unreachable!("a step without drafts draws its token"),
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

/// What a fake target answers for the tokens it chose (`Verified::logprobs`), where the
/// session asks: each argmax's, at `places`; a tested chain's accepted drafts' and drawn
/// token's; none beside p alone.
fn chosen_figures(
    choice: &TargetChoice,
    drafts: &[u32],
    places: &[usize],
    top: Option<usize>,
) -> Vec<TokenLogprobs> {
    let Some(top) = top else {
        return Vec::new();
    };
    let chosen: Vec<u32> = match choice {
        TargetChoice::Argmax(argmax) => argmax.clone(),
        TargetChoice::Tested {
            accepted,
            next: Next::Drawn(token),
            ..
        } => drafts[..*accepted].iter().chain([token]).copied().collect(),
        TargetChoice::Tested { .. } | TargetChoice::P(_) => Vec::new(),
    };
    let rows = chosen.into_iter().enumerate();
    rows.map(|(row, token)| figures(places[row], token, top))
        .collect()
}

/// The times the fakes report, as on a CPU: a target pass 35 ms plus 8 ms a row, a draft
/// step 14 ms.
fn timing(ms: f64, rows: usize) -> WorkerTiming {
    let t = std::time::Duration::from_secs_f64(ms / 1e3);
    WorkerTiming {
        forward: t,
        share: t,
        batch_calls: 1,
        batch_rows: rows,
        ..WorkerTiming::default()
    }
}

impl Workers for FakeWorkers {
    type Session = FakeSession;

    async fn open_target(&self, open: Open<'_>) -> Result<TargetOpened<FakeSession>, CallError> {
        {
            let mut s = self.state.lock().unwrap();
            if let Some(busy) = s.refused_for_room(self.script.target_room, &open) {
                return Err(busy);
            }
            (s.target_opens).push((open.prompt.len(), open.generated_after));
        }
        // Each prompt token's after the first, as the target would choose it there.
        let prompt = open.prompt.iter().enumerate().skip(1);
        let figures = open.prompt_logprobs.map_or_else(Vec::new, |top| {
            prompt.map(|(at, &t)| figures(at, t, top)).collect()
        });
        let session = self.open(open);
        let mut s = self.state.lock().unwrap();
        s.targets.insert(session.id);
        if let Some(priority) = open.priority {
            s.priorities.insert(session.id, priority);
        }
        drop(s);
        Ok((session, WorkerTiming::default(), figures))
    }

    async fn close_target(&self, session: &FakeSession) {
        let mut s = self.state.lock().unwrap();
        s.target_closes += usize::from(s.targets.contains(&session.id));
        s.closed(session.id);
    }

    async fn reopen_target(
        &self,
        open: Open<'_>,
        lost: &FakeSession,
    ) -> Result<TargetOpened<FakeSession>, CallError> {
        {
            let mut s = self.state.lock().unwrap();
            if s.reopens_refused < self.script.reopen_busy {
                s.reopens_refused += 1;
                let busy = Failure::Busy("KV-token budget exhausted".into());
                return Err(CallError::new(Party::Target, busy));
            }
            // The lost replica's session is gone with it.
            s.closed(lost.id);
        }
        let (mut session, timing, figures) = self.open_target(open).await?;
        session.trees &= !self.script.reopened_chains_only;
        Ok((session, timing, figures))
    }

    fn draft_available(&self) -> Result<(), String> {
        match &self.script.draft_unavailable {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    async fn open_draft(&self, open: Open<'_>) -> Result<(FakeSession, WorkerTiming), CallError> {
        self.state.lock().unwrap().draft_opens += 1;
        let mut call = InProgress::start(&self.state, |s| {
            (&mut s.draft_opening, &mut s.draft_opens_dropped)
        });
        tokio::time::sleep(self.script.draft_open).await;
        call.answered = true;
        drop(call);
        let open = open.for_draft();
        let opened = (
            open.prompt.len(),
            open.generated_after,
            open.format.is_some(),
        );
        self.state.lock().unwrap().draft_opened.push(opened);
        Ok((self.open(open), WorkerTiming::default()))
    }

    async fn propose(
        &self,
        session: &FakeSession,
        call: Propose<'_>,
    ) -> Result<Proposal, CallError> {
        if !self.script.propose_time.is_zero() {
            let mut call =
                InProgress::start(&self.state, |s| (&mut s.proposing, &mut s.proposes_dropped));
            tokio::time::sleep(self.script.propose_time).await;
            call.answered = true;
        }
        let mut s = self.state.lock().unwrap();
        let n = s.proposes;
        s.proposes += 1;
        s.proposes_while_verifying += usize::from(s.verifying > 0);
        if let Some((at, failure)) = &self.script.propose_fails
            && *at == n
        {
            return Err(CallError::new(Party::Draft, failure.clone()));
        }
        s.appended.push((Party::Draft, call.append.len()));
        let uncertain = self.script.uncertain && session.sampling;
        let mut draws = s.draws;
        let cache = s.caches.get_mut(&session.id).expect("an open session");
        Self::rewind(cache, call.keep, call.append);
        let mut tokens = Vec::new();
        let mut q = Vec::new();
        let mut alternatives = Vec::new();
        let mut sure = 1.0;
        for i in 0..call.k {
            let predicted = self.script.target.next(cache, session.prompt);
            let wrong = match uncertain {
                true => {
                    draws += 1;
                    let draw = splitmix(draws);
                    match self.script.draft_odds {
                        None => draw & 1 == 1,
                        // Uniform in [0, 1) from the draw's top 24 bits.
                        Some(odds) => (draw >> 40) as f32 / (1u32 << 24) as f32 >= odds,
                    }
                }
                false => self.script.wrong_at == Some(i),
            };
            let t = if wrong {
                following(predicted)
            } else {
                predicted
            };
            if uncertain {
                let odds = self.script.draft_odds.unwrap_or(0.5);
                let pair = [(predicted, odds), (following(predicted), 1.0 - odds)];
                q.push(Distribution::from_pairs(pair).unwrap());
            } else if session.sampling {
                q.push(Distribution::point(t));
            }
            // Asked for alternatives: greedy, the token it got wrong, or else the one after
            // its own; sampling, one more draw from its q.
            if call.alternatives.1 > 0 {
                let other = match (uncertain, session.sampling) {
                    (true, _) => {
                        draws += 1;
                        let odds = self.script.draft_odds.unwrap_or(0.5);
                        let u = (splitmix(draws) >> 40) as f32 / (1u32 << 24) as f32;
                        if u < odds {
                            predicted
                        } else {
                            following(predicted)
                        }
                    }
                    (false, true) => t,
                    (false, false) if wrong => predicted,
                    (false, false) => following(t),
                };
                alternatives.push(vec![other]);
            }
            tokens.push(t);
            cache.push(t);
            sure *= match (uncertain, self.script.unsure_at == Some(i)) {
                (true, _) => q[i].prob(t),
                (false, true) => 0.3,
                (false, false) => 1.0,
            };
            if sure < call.stop_below {
                break;
            }
        }
        // The last draft token is sampled, never fed.
        cache.pop();
        s.draws = draws;
        match self.script.propose_malformed {
            Some((at, how)) if at == n => match how {
                Malformed::ExtraToken => tokens.push(1),
                Malformed::OutOfVocabulary => tokens[0] = 1_000_000,
                Malformed::NoDistributions => q.clear(),
            },
            _ => {}
        }
        let drafted = tokens.len();
        s.proposals.push((call.k, drafted));
        Ok(Proposal {
            tokens,
            q,
            alternatives,
            timing: timing(14.0 * drafted as f64, call.append.len() + drafted - 1),
        })
    }

    async fn verify(&self, session: &FakeSession, call: Verify<'_>) -> Result<Verified, CallError> {
        let mut contended = false;
        {
            let mut s = self.state.lock().unwrap();
            s.verifies_while_proposing += usize::from(s.proposing > 0);
        }
        if !self.script.verify_time.is_zero() {
            let proposes = {
                let mut s = self.state.lock().unwrap();
                s.verifying += 1;
                s.proposes_while_verifying
            };
            tokio::time::sleep(self.script.verify_time).await;
            let mut s = self.state.lock().unwrap();
            s.verifying -= 1;
            contended = s.proposes_while_verifying > proposes;
        }
        let mut s = self.state.lock().unwrap();
        let n = s.verifies;
        s.verifies += 1;
        s.verifies_while_draft_opens += usize::from(s.draft_opening > 0);
        s.verified_drafts.push(call.drafts.len());
        if let Some((_, failure)) = self.script.verify_fails.iter().find(|(at, _)| *at == n) {
            return Err(CallError::new(Party::Target, failure.clone()));
        }
        if !call.parents.is_empty() && !session.trees {
            let refused = Failure::Refused("this device verifies chains only".into());
            return Err(CallError::new(Party::Target, refused));
        }
        s.appended.push((Party::Target, call.append.len()));
        let cache = s.caches.get_mut(&session.id).expect("an open session");
        Self::rewind(cache, call.keep, call.append);
        let target = self.script.target;
        s.verified_parents.push(call.parents.to_vec());
        let cache = s.caches.get_mut(&session.id).expect("an open session");
        let mut argmax = vec![target.next(cache, session.prompt)];
        // Each draft after its own path (a chain's: all the drafts before it), and the
        // place in the sequence of the token each row chooses.
        let root = cache.len();
        let mut places = vec![root];
        for (j, &d) in call.drafts.iter().enumerate() {
            let mut path = vec![d];
            let mut at = call.parents.get(j).map_or(j, |&p| p as usize);
            while at > 0 {
                path.push(call.drafts[at - 1]);
                at = call.parents.get(at - 1).map_or(at - 1, |&p| p as usize);
            }
            cache.truncate(root);
            cache.extend(path.iter().rev());
            argmax.push(target.next(cache, session.prompt));
            places.push(root + path.len());
        }
        // The cache holds every draft, in order, as a worker's does.
        cache.truncate(root);
        cache.extend_from_slice(call.drafts);
        let choice = match (session.sampling, call.test) {
            (false, _) => TargetChoice::Argmax(argmax),
            (true, Some(mut test)) if !self.script.no_sampling_test => {
                if self.script.no_whole_q {
                    test.whole = &[];
                }
                let choice = self.script.tested(&argmax, call.drafts, test, session.seed);
                let rejected = matches!(
                    &choice,
                    TargetChoice::Tested {
                        next: Next::Rejected(_),
                        ..
                    }
                );
                s.sampling_tests.0 += 1;
                s.sampling_tests.1 += usize::from(rejected);
                choice
            }
            (true, _) => TargetChoice::P(argmax.into_iter().map(|t| self.script.p(t)).collect()),
        };
        let rows = call.append.len() + call.drafts.len();
        let slowed = if contended {
            1.0 + self.script.contention
        } else {
            1.0
        };
        Ok(Verified {
            logprobs: chosen_figures(&choice, call.drafts, &places, session.logprobs),
            choice,
            timing: timing((35.0 + 8.0 * rows as f64) * slowed, rows),
            give_way: s.asked == Some(session.id),
        })
    }

    /// Each step a target pass as a Verify without drafts is (`verify_time`, `verify_fails`
    /// by the passes' count); a sampling session's token drawn from that pass's p as the
    /// loop would draw it, where the call's random stream stands. The fake feeds each token
    /// as it answers it, as a worker may before its caller reads it, so the caller's next
    /// `keep` must drop what it did not take.
    async fn decode(&self, session: &FakeSession, call: Decode<'_>) -> Result<Decoded, CallError> {
        if self.script.no_decode {
            let refused = Failure::Refused("Operation is not implemented or not supported".into());
            return Err(CallError::new(Party::Target, refused));
        }
        let call_index = {
            let mut s = self.state.lock().unwrap();
            s.appended.push((Party::Target, call.append.len()));
            let cache = s.caches.get_mut(&session.id).expect("an open session");
            Self::rewind(cache, call.keep, call.append);
            s.decodes.push(0);
            s.decodes.len() - 1
        };
        let (state, script) = (self.state.clone(), self.script.clone());
        let (id, prompt, stop) = (session.id, session.prompt, call.stop.to_vec());
        let top = session.logprobs;
        let (max, seed) = (call.max_tokens, session.sampling.then_some(session.seed));
        let steps = futures::stream::unfold((0, call.rng_position), move |(sent, at)| {
            let (state, script, stop) = (state.clone(), script.clone(), stop.clone());
            async move {
                if sent == max {
                    return None;
                }
                // In progress as a Verify's pass is, while the stream waits for it.
                let mut step =
                    InProgress::start(&state, |s| (&mut s.verifying, &mut s.steps_dropped));
                {
                    let mut s = state.lock().unwrap();
                    s.verifies_while_proposing += usize::from(s.proposing > 0);
                }
                tokio::time::sleep(script.verify_time).await;
                step.answered = true;
                drop(step);
                let mut s = state.lock().unwrap();
                let n = s.verifies;
                s.verifies += 1;
                if let Some((_, failure)) = script.verify_fails.iter().find(|(at, _)| *at == n) {
                    let failed = CallError::new(Party::Target, failure.clone());
                    return Some((Err(failed), (max, at)));
                }
                // A session closed meanwhile (a failover dropped it) ends the stream.
                let cache = s.caches.get_mut(&id)?;
                let (choice, token, at) = script.step(script.target.next(cache, prompt), seed, at);
                let logprobs = Vec::from_iter(top.map(|top| figures(cache.len(), token, top)));
                let last = sent + 1 == max || stop.contains(&token);
                if !last {
                    cache.push(token);
                }
                s.decodes[call_index] += 1;
                let verified = Verified {
                    choice,
                    logprobs,
                    timing: timing(43.0, 1),
                    give_way: s.asked == Some(id),
                };
                Some((Ok(verified), (if last { max } else { sent + 1 }, at)))
            }
        });
        Ok(Box::pin(steps))
    }

    fn trip_draft(&self, reason: &str) {
        self.state.lock().unwrap().trips.push(reason.to_string());
    }

    fn verifies_trees(&self, session: &FakeSession) -> bool {
        session.trees
    }
}
