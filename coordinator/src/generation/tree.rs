//! A round's drafts as the target verifies them: the draft model's chain and, beside it,
//! other candidates (`ProposeResponse.alternatives`), each after the chain's tokens
//! before its position. One pass verifies them all (`VerifyRequest.parents`); where the
//! target rejects a chain token for one of its alternatives, the round commits that token
//! and the target's token after it: one more than the chain alone.

use crate::workers::Next;
use duet_engine::sampling::Distribution;
use duet_engine::verify::{VerifyError, draw_correction, verify_greedy_tree, verify_sampling_tree};
use duet_proto::MAX_DRAFT_TOKENS;
use std::borrow::Cow;

/// The drafts of one Verify: the chain first, then the alternatives.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Tree {
    pub(super) drafts: Vec<u32>,
    /// Empty for a chain; else each draft's parent (`VerifyRequest.parents`).
    pub(super) parents: Vec<u32>,
    /// The chain's drafts: `drafts[..chain]`.
    pub(super) chain: usize,
    /// A sampling session's: what the target tests the chain with.
    pub(super) drawn: Option<Drawn>,
}

/// What the target needs to test a sampling session's chain (`SamplingTest`): the draft's
/// probability of each chain draft when it drew it, whether each q is the point mass on
/// its draft (a lookup's proposal), and each q whole where they are small enough to send
/// (the target then draws a rejection's correction too; empty otherwise).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Drawn {
    pub(super) q: Vec<f32>,
    pub(super) point_masses: bool,
    pub(super) whole: Vec<Distribution>,
}

impl Drawn {
    pub(super) fn of(tokens: &[u32], q: &[Distribution], point_masses: bool, vocab: usize) -> Self {
        // A draft's q leaves out its tail, so it is mostly a few tokens: sent whole, the
        // q's spare a rejection the target's p coming back (dense, 4 bytes a token of the
        // vocabulary) and the correction drawn here. Where they are larger (flat rows),
        // they go only while they cost at most an eighth of that p (8 bytes an entry).
        let small = q.iter().map(Distribution::len).sum::<usize>() <= vocab / 16;
        Self {
            q: tokens.iter().zip(q).map(|(&x, q)| q.prob(x)).collect(),
            point_masses,
            whole: match small && !point_masses {
                true => q.to_vec(),
                false => Vec::new(),
            },
        }
    }

    /// As [`Drawn::of`], with every q whole however large (a lookup's point masses aside):
    /// the target then draws each token a round commits, a rejection's correction too.
    pub(super) fn all_on_the_target(
        tokens: &[u32],
        q: &[Distribution],
        point_masses: bool,
    ) -> Self {
        Self {
            whole: match point_masses {
                true => Vec::new(),
                false => q.to_vec(),
            },
            ..Self::of(tokens, q, point_masses, 0)
        }
    }
}

impl Tree {
    pub(super) fn chain(drafts: &[u32]) -> Self {
        Self {
            drafts: drafts.to_vec(),
            parents: Vec::new(),
            chain: drafts.len(),
            drawn: None,
        }
    }

    /// `chain` with `alternatives[i]` beside its token `i`, as many as a Verify takes and
    /// at most `room` drafts in all (what the session's capacity has room for after the
    /// committed tokens); a chain alone where there are none.
    pub(super) fn of(chain: &[u32], alternatives: &[Vec<u32>], room: usize) -> Self {
        let mut tree = Self::chain(chain);
        let beside = alternatives
            .iter()
            .take(chain.len())
            .enumerate()
            .flat_map(|(i, others)| others.iter().map(move |&t| (i as u32, t)))
            .take(MAX_DRAFT_TOKENS.min(room).saturating_sub(chain.len()));
        for (i, token) in beside {
            if tree.parents.is_empty() {
                tree.parents = (0..chain.len() as u32).collect();
            }
            tree.drafts.push(token);
            tree.parents.push(i);
        }
        tree
    }

    /// Only the chain, for a target replica that verifies chains only (a failover moved the
    /// session to one after the round's tree was built).
    pub(super) fn keep_chain(&mut self) {
        self.drafts.truncate(self.chain);
        self.parents.clear();
    }

    /// Each draft's parent; a chain's drafts follow one another.
    fn parents(&self) -> Cow<'_, [u32]> {
        match self.parents.is_empty() {
            true => Cow::Owned((0..self.chain as u32).collect()),
            false => Cow::Borrowed(&self.parents),
        }
    }

    /// Alternatives verified beside the chain.
    pub(super) fn alternatives(&self) -> usize {
        self.drafts.len() - self.chain
    }

    /// The outcome of an accepted `path` (drafts, in order) and the target's token after it.
    fn outcome(&self, path: &[usize], token: u32) -> Outcome {
        // The chain's drafts come first, so an accepted alternative is the path's last.
        let accepted = path.iter().take_while(|&&j| j < self.chain).count();
        Outcome {
            accepted,
            alternative: path.get(accepted).map(|&j| (self.drafts[j], j)),
            token,
        }
    }
}

/// What the target made of a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Outcome {
    /// The chain's drafts accepted, from the first.
    pub(super) accepted: usize,
    /// The alternative the target chose where it rejected the chain's next token, and its
    /// place among the drafts.
    pub(super) alternative: Option<(u32, usize)>,
    /// The target's own token after them.
    pub(super) token: u32,
}

impl Outcome {
    /// The tokens the round commits.
    pub(super) fn committed(&self, tree: &Tree) -> Vec<u32> {
        let mut out = tree.drafts[..self.accepted].to_vec();
        out.extend(self.alternative.map(|(token, _)| token));
        out.push(self.token);
        out
    }

    /// The pass's row that chose each committed token (0: the one after the last appended
    /// token; draft `j`'s is `j + 1`): the root's and the accepted chain drafts', then an
    /// accepted alternative's, which chose the token after it.
    pub(super) fn rows(&self) -> impl Iterator<Item = usize> {
        (0..=self.accepted).chain(self.alternative.map(|(_, j)| j + 1))
    }
}

/// Greedy verification of `tree` against the target's argmax after its last appended token
/// and after each draft.
pub(super) fn verify(tree: &Tree, argmax: &[u32]) -> Result<Outcome, VerifyError> {
    let (path, token) = verify_greedy_tree(&tree.drafts, &tree.parents(), argmax)?;
    Ok(tree.outcome(&path, token))
}

/// A chain's rejection sampling as the target tested it: its `accepted` drafts, then the
/// token it drew or, where it rejected a draft whose q only the caller holds, the
/// correction drawn here from p there and that q (the stream where the target's draws
/// stopped).
pub(super) fn tested(
    tree: &Tree,
    q: &[Distribution],
    (accepted, next): (usize, &Next),
    rng: &mut impl rand::Rng,
) -> Result<Outcome, VerifyError> {
    let token = match next {
        Next::Drawn(token) => *token,
        Next::Rejected(p) => {
            let q = q
                .get(accepted)
                .ok_or(VerifyError::DraftDistributionsLength {
                    expected: tree.chain,
                    actual: q.len(),
                })?;
            draw_correction(p, q, rng)
        }
    };
    let path: Vec<usize> = (0..accepted).collect();
    Ok(tree.outcome(&path, token))
}

/// Rejection sampling of `tree` (multi-candidate where it has alternatives) with the
/// chain's q and the target's p after its last appended token and after each draft. An
/// alternative was drawn from its position's q, the chain token's there.
pub(super) fn verify_sampled(
    tree: &Tree,
    q: &[Distribution],
    p: &[Distribution],
    rng: &mut impl rand::Rng,
) -> Result<Outcome, VerifyError> {
    if q.len() != tree.chain {
        return Err(VerifyError::DraftDistributionsLength {
            expected: tree.chain,
            actual: q.len(),
        });
    }
    let parents = tree.parents();
    // An alternative beside chain token i has parent i: q[i] is its position's.
    let qs: Vec<&Distribution> = (0..tree.drafts.len())
        .map(|j| {
            &q[if j < tree.chain {
                j
            } else {
                parents[j] as usize
            }]
        })
        .collect();
    let (path, token) = verify_sampling_tree(&tree.drafts, &parents, &qs, p, rng)?;
    Ok(tree.outcome(&path, token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alternatives_follow_the_chain_and_an_accepted_one_commits_the_token_after_it() {
        let tree = Tree::of(&[10, 11, 12], &[vec![], vec![21, 22], vec![]], 9);
        assert_eq!(tree.drafts, vec![10, 11, 12, 21, 22]);
        assert_eq!(tree.parents, vec![0, 1, 2, 1, 1]);
        assert_eq!(tree.alternatives(), 2);
        // Argmax after: root, 10, 11, 12, 21, 22.
        let outcome = verify(&tree, &[10, 22, 0, 0, 0, 7]).unwrap();
        assert_eq!(
            outcome,
            Outcome {
                accepted: 1,
                alternative: Some((22, 4)),
                token: 7
            }
        );
        assert_eq!(outcome.committed(&tree), vec![10, 22, 7]);
        // 10 is the root's argmax, 22 the row of 10's, 7 the row of 22's (draft 4).
        assert_eq!(outcome.rows().collect::<Vec<_>>(), [0, 1, 5]);
        let all = verify(&tree, &[10, 11, 12, 5, 0, 0]).unwrap();
        assert_eq!(all.committed(&tree), vec![10, 11, 12, 5]);
        assert_eq!(all.rows().collect::<Vec<_>>(), [0, 1, 2, 3]);
        // No alternatives: a chain, verified as one.
        let chain = Tree::of(&[10, 11], &[vec![], vec![]], 9);
        assert_eq!(chain, Tree::chain(&[10, 11]));
        let v = verify(&chain, &[10, 3, 0]).unwrap();
        assert_eq!((v.accepted, v.alternative, v.token), (1, None, 3));
    }

    /// The q's go whole while they add up to at most a sixteenth of the vocabulary in
    /// entries; a lookup's point masses never (the flag says them).
    #[test]
    fn a_chains_q_go_to_the_target_whole_only_while_small() {
        let q = |n: u32| Distribution::from_pairs((0..n).map(|t| (t, 1.0 / n as f32))).unwrap();
        let (small, large) = ([q(2), q(4)], [q(2), q(5)]);
        let drawn = Drawn::of(&[1, 3], &small, false, 96);
        assert_eq!((drawn.q, drawn.whole), (vec![0.5, 0.25], small.to_vec()));
        assert_eq!(Drawn::of(&[1, 3], &large, false, 96).whole, []);
        let all = Drawn::all_on_the_target(&[1, 3], &large, false);
        assert_eq!((all.q, all.whole), (vec![0.5, 0.2], large.to_vec()));
        let points = [Distribution::point(1), Distribution::point(3)];
        let drawn = Drawn::of(&[1, 3], &points, true, 96);
        assert_eq!((drawn.q, drawn.whole), (vec![1.0, 1.0], vec![]));
    }

    #[test]
    fn a_tree_never_carries_more_drafts_than_a_verify_or_the_session_takes() {
        let chain: Vec<u32> = (0..60).collect();
        let others = vec![vec![100, 101]; 60];
        let tree = Tree::of(&chain, &others, 100);
        assert_eq!(tree.drafts.len(), MAX_DRAFT_TOKENS);
        assert_eq!(tree.parents[60..], [0, 0, 1, 1]);
        let tree = Tree::of(&chain[..3], &others[..3], 4);
        assert_eq!(
            (tree.drafts, tree.parents),
            (vec![0, 1, 2, 100], vec![0, 1, 2, 0])
        );
    }
}
