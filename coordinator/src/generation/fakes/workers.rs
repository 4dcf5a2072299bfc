//! The fakes' answers to the loop's calls: `Workers` over the scripted `State`.

use super::{FakeSession, FakeWorkers, InProgress, Malformed, figures, following, splitmix};
use crate::workers::{
    CallError, Decode, Decoded, Failure, LookupPass, Next, Open, Party, Proposal, Propose,
    StreamLookup, TargetChoice, TargetOpened, Verified, Verify, WorkerTiming, Workers,
};
use duet_engine::logprobs::TokenLogprobs;
use duet_engine::ngram::NgramIndex;
use duet_engine::sampling::Distribution;

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

/// The drafts a Decode stream's `lookup` finds after `seq`, at most `room`, and the
/// suffix they followed.
fn looked_up(lookup: &StreamLookup, seq: &[u32], room: usize) -> (Vec<u32>, usize) {
    let mut index = NgramIndex::new(lookup.min_match, lookup.max_match);
    index.extend(seq);
    match index.lookup_by_match(seq, &lookup.drafts, room) {
        Some(found) => (found.tokens, found.matched),
        None => (Vec::new(), 0),
    }
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
            pass: None,
        })
    }

    /// Each step a target pass as a Verify is (`verify_time`, `verify_fails` by the
    /// passes' count), of the drafts the call's lookup finds in the session's tokens (none
    /// without one); a sampling session's drafts tested and its token drawn as a
    /// target-worker does, where the call's random stream stands. The fake feeds each token
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
        let lookup = call
            .lookup
            .filter(|_| !self.script.no_stream_lookup)
            .cloned();
        let steps = futures::stream::unfold((0, call.rng_position), move |(sent, at)| {
            let (state, script, stop) = (state.clone(), script.clone(), stop.clone());
            let lookup = lookup.clone();
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
                let (drafts, matched) = lookup
                    .as_ref()
                    .map_or((Vec::new(), 0), |l| looked_up(l, cache, max - sent - 1));
                let (choice, mut tokens, mut accepted, at) =
                    script.lookup_step(cache, prompt, &drafts, (seed, at));
                if let Some(i) = tokens.iter().position(|t| stop.contains(t)) {
                    tokens.truncate(i + 1);
                    accepted = accepted.min(i + 1);
                }
                let places = cache.len()..;
                let logprobs = Vec::from_iter(top.into_iter().flat_map(|top| {
                    places
                        .clone()
                        .zip(&tokens)
                        .map(move |(p, &t)| figures(p, t, top))
                }));
                let sent = sent + tokens.len();
                let last = sent == max || stop.contains(&tokens[tokens.len() - 1]);
                if !last {
                    cache.extend(&tokens);
                }
                s.decodes[call_index] += tokens.len();
                let rows = 1 + drafts.len();
                let verified = Verified {
                    choice,
                    logprobs,
                    timing: timing(35.0 + 8.0 * rows as f64, rows),
                    give_way: s.asked == Some(id),
                    pass: (!drafts.is_empty()).then_some(LookupPass {
                        drafts,
                        matched,
                        accepted,
                        tokens,
                    }),
                };
                Some((Ok(verified), (if last { max } else { sent }, at)))
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

    fn decodes_with_lookup(&self, _: &FakeSession) -> bool {
        !self.script.no_stream_lookup
    }
}
