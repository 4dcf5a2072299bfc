//! Prompt-lookup drafting: propose the tokens that followed the most recent earlier
//! occurrence of the sequence's longest suffix (prompt and completion alike). Free to run (no
//! model), and it wins where the answer copies its input: edits, refactors, retrieval, chat
//! about a given text, and a completion repeating itself.
//!
//! The coordinator looks up for its rounds, the target-worker between a Decode stream's
//! steps (`DecodeRequest.lookup`). The index is built once per sequence and grows with each
//! committed token: for every position it records, per n-gram length, where that n-gram last
//! ended (O(max_n) per token, never a rescan). A lookup tries the longest suffix first; the
//! continuation runs on past the end of the sequence by copying the proposal itself, so a
//! repeating pattern (a table, a loop body) is proposed for as long as asked.

use std::collections::HashMap;

/// One proposal: `tokens`, found after an earlier occurrence of the last `matched` tokens
/// in the request's text, or in earlier requests' (the coordinator's proposal cache), where
/// `cache_votes` is its vote count there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    pub matched: usize,
    pub tokens: Vec<u32>,
    pub cache_votes: Option<u32>,
}

#[derive(Debug)]
pub struct NgramIndex {
    min_n: usize,
    max_n: usize,
    /// (n, hash of the n tokens ending at p) → the latest such p.
    ends: HashMap<(u8, u64), u32>,
    /// Positions before this one are indexed as n-gram ends.
    indexed: usize,
}

/// One token into a running hash of a run of tokens.
pub fn mix(h: u64, token: u32) -> u64 {
    (h ^ u64::from(token))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(29)
}

impl NgramIndex {
    /// Suffixes of `min_n..=max_n` tokens are matched (1 <= min_n <= max_n <= 255).
    pub fn new(min_n: usize, max_n: usize) -> Self {
        assert!(
            1 <= min_n && min_n <= max_n && max_n <= 255,
            "n-gram sizes {min_n}..={max_n}"
        );
        Self {
            min_n,
            max_n,
            ends: HashMap::new(),
            indexed: 0,
        }
    }

    /// Indexes the n-grams ending at every position of `seq` but its last (that one is the
    /// suffix a lookup matches). `seq` only ever grows between calls.
    pub fn extend(&mut self, seq: &[u32]) {
        let last = seq.len().saturating_sub(1);
        for p in self.indexed..last {
            let mut h = 0u64;
            for n in 1..=self.max_n.min(p + 1) {
                h = mix(h, seq[p + 1 - n]);
                if n >= self.min_n {
                    self.ends.insert((n as u8, h), p as u32);
                }
            }
        }
        self.indexed = self.indexed.max(last);
    }

    /// Up to `k` tokens after the most recent earlier occurrence of the longest suffix of
    /// `seq` that occurred before (`extend` must have seen `seq`).
    pub fn lookup(&self, seq: &[u32], k: usize) -> Option<Lookup> {
        self.find(seq, seq, k, true).map(|(_, found)| found)
    }

    /// [`NgramIndex::lookup`] where how many tokens depends on how long a suffix matched:
    /// `by_match[n - min_n]` for a match of n tokens (the last entry for longer ones; 0:
    /// none), at most `room` (a Decode stream's lookup, `DecodeRequest.lookup`).
    pub fn lookup_by_match(&self, seq: &[u32], by_match: &[usize], room: usize) -> Option<Lookup> {
        let most = by_match.iter().copied().max().unwrap_or(0).min(room);
        if most == 0 {
            return None;
        }
        let mut found = self.lookup(seq, most)?;
        let entry = (found.matched - self.min_n).min(by_match.len() - 1);
        found.tokens.truncate(by_match[entry]);
        (!found.tokens.is_empty()).then_some(found)
    }

    /// Up to `k` tokens of another text, `doc` (which `extend` has seen), after the latest
    /// occurrence there of the longest suffix of `seq`, cut at `doc`'s end; and where in
    /// `doc` they start.
    pub fn lookup_in(&self, doc: &[u32], seq: &[u32], k: usize) -> Option<(usize, Lookup)> {
        self.find(doc, seq, k, false)
    }

    /// The lookup of `seq`'s suffix among `doc`'s n-grams: what followed there (and where),
    /// continued past `doc`'s end with the proposal itself where `repeat` (`doc` is `seq`: a
    /// repeating pattern repeats on), else cut there (nothing after it: a shorter suffix is
    /// tried).
    fn find(&self, doc: &[u32], seq: &[u32], k: usize, repeat: bool) -> Option<(usize, Lookup)> {
        let len = seq.len();
        if k == 0 || len < self.min_n + 1 {
            return None;
        }
        let mut hashes = Vec::with_capacity(self.max_n);
        let mut h = 0u64;
        for n in 1..=self.max_n.min(len - 1) {
            h = mix(h, seq[len - n]);
            hashes.push(h);
        }
        for n in (self.min_n..=hashes.len()).rev() {
            let Some(&end) = self.ends.get(&(n as u8, hashes[n - 1])) else {
                continue;
            };
            let end = end as usize;
            // A hash collision proposes nothing rather than something wrong.
            if doc.get(end + 1 - n..=end) != Some(&seq[len - n..]) {
                continue;
            }
            // Continue with what followed the occurrence, and past the sequence's end with
            // the proposal itself (the occurrence ends before the suffix does, so a repeating
            // pattern repeats on).
            let mut tokens = Vec::with_capacity(k);
            for i in 0..k {
                let at = end + 1 + i;
                match doc.get(at) {
                    Some(&t) => tokens.push(t),
                    None if repeat => tokens.push(tokens[at - doc.len()]),
                    None => break,
                }
            }
            if tokens.is_empty() {
                continue;
            }
            let found = Lookup {
                matched: n,
                tokens,
                cache_votes: None,
            };
            return Some((end + 1, found));
        }
        None
    }
}

/// A second text to look up in: the prompt followed by a request's predicted output.
/// Where the completion has followed it since the last proposal taken from it, the next
/// proposal goes on from there (a line the prediction repeats cannot pull the proposal
/// elsewhere); else the index finds the suffix's latest place in it.
#[derive(Debug)]
pub struct Prediction {
    doc: Vec<u32>,
    index: NgramIndex,
    /// Where the last proposal started in `doc`, and the sequence's length then.
    last: Option<(usize, usize)>,
}

impl Prediction {
    pub fn new(prompt: &[u32], predicted: &[u32], min_n: usize, max_n: usize) -> Self {
        let doc: Vec<u32> = prompt.iter().chain(predicted).copied().collect();
        let mut index = NgramIndex::new(min_n, max_n);
        index.extend(&doc);
        Self {
            doc,
            index,
            last: None,
        }
    }

    /// Up to `k` tokens of the prediction after where `seq` stands in it.
    pub fn lookup(&mut self, seq: &[u32], k: usize) -> Option<Lookup> {
        let followed = self.last.and_then(|(at, len)| {
            let since = seq.get(len..)?;
            let end = at + since.len();
            (self.doc.get(at..end) == Some(since) && end < self.doc.len()).then_some(end)
        });
        let found = match followed {
            // Followed all along: as sure as the longest match.
            Some(at) if k > 0 => {
                let tokens = self.doc[at..(at + k).min(self.doc.len())].to_vec();
                let matched = self.index.max_n;
                Some((
                    at,
                    Lookup {
                        matched,
                        tokens,
                        cache_votes: None,
                    },
                ))
            }
            _ => self.index.lookup_in(&self.doc, seq, k),
        };
        self.last = found.as_ref().map(|(at, _)| (*at, seq.len()));
        found.map(|(_, found)| found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn indexed(seq: &[u32], min_n: usize, max_n: usize) -> NgramIndex {
        let mut index = NgramIndex::new(min_n, max_n);
        index.extend(seq);
        index
    }

    /// In another text, the suffix's latest occurrence gives what followed it there, cut at
    /// that text's end; an occurrence at its very end (nothing after it) gives way to a
    /// shorter suffix's.
    #[test]
    fn another_text_proposes_what_followed_there_up_to_its_end() {
        // The prompt 1 2 3, predicted to go on 4 5 6.
        let doc = [1, 2, 3, 4, 5, 6];
        let index = indexed(&doc, 1, 3);
        let found = |seq: &[u32], k| {
            index
                .lookup_in(&doc, seq, k)
                .map(|(_, l)| (l.matched, l.tokens))
        };
        assert_eq!(found(&[1, 2, 3], 2), Some((2, vec![4, 5])));
        assert_eq!(found(&[1, 2, 3, 4, 5], 4), Some((3, vec![6])));
        assert_eq!(found(&[1, 2, 3, 9, 5], 4), Some((1, vec![6])));
        assert_eq!(found(&[7, 8, 6], 4), None);
        assert_eq!(found(&[1, 2, 3], 0), None);
    }

    /// A prediction is followed from where the completion stands in it: after its first
    /// proposal was taken, the next goes on from there, where the index alone (suffixes of
    /// at most two tokens here) finds "5 6" last before 8; once the completion leaves it,
    /// the index looks the suffix up again, and at its end nothing is proposed.
    #[test]
    fn a_prediction_is_followed_from_where_the_completion_stands() {
        let prompt = [1, 2];
        let mut p = Prediction::new(&prompt, &[5, 6, 7, 5, 6, 8], 1, 2);
        let tokens = |l: Option<Lookup>| l.map(|l| l.tokens);
        assert_eq!(tokens(p.lookup(&[1, 2], 2)), Some(vec![5, 6]));
        assert_eq!(tokens(p.lookup(&[1, 2, 5, 6], 3)), Some(vec![7, 5, 6]));
        let left = p.lookup(&[1, 2, 5, 6, 7, 9, 5], 2).unwrap();
        assert_eq!((left.matched, left.tokens), (1, vec![6, 8]));
        assert_eq!(tokens(p.lookup(&[1, 2, 5, 6, 7, 9, 5, 6, 8], 4)), None);
        let mut index_only = NgramIndex::new(1, 2);
        let doc = [1, 2, 5, 6, 7, 5, 6, 8];
        index_only.extend(&doc);
        let lookup = index_only.lookup_in(&doc, &[1, 2, 5, 6], 3).unwrap().1;
        assert_eq!(lookup.tokens, [8]);
    }

    #[test]
    fn proposes_what_followed_the_longest_earlier_match() {
        // "1 2 3 4 5 … 9 2 3 4" → the suffix 2 3 4 was followed by 5 6.
        let seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4];
        let index = indexed(&seq, 1, 4);
        assert_eq!(
            index.lookup(&seq, 2),
            Some(Lookup {
                matched: 3,
                tokens: vec![5, 6],
                cache_votes: None,
            })
        );
        // The longest match wins over a more recent shorter one: 9 3 4 … 7 3 4 … 1 3 4 1.
        let seq = [9, 3, 4, 5, 7, 3, 4, 6, 8, 9, 3, 4];
        assert_eq!(indexed(&seq, 1, 4).lookup(&seq, 1).unwrap().tokens, vec![5]);
        // Of two equally long matches, the most recent one.
        let seq = [3, 4, 5, 0, 3, 4, 6, 0, 3, 4];
        assert_eq!(indexed(&seq, 2, 2).lookup(&seq, 1).unwrap().tokens, vec![6]);
    }

    #[test]
    fn nothing_without_an_earlier_occurrence_of_min_n_tokens() {
        let seq = [1, 2, 3, 4, 5, 3];
        assert_eq!(indexed(&seq, 2, 4).lookup(&seq, 4), None);
        assert_eq!(
            indexed(&seq, 1, 4).lookup(&seq, 2).unwrap().tokens,
            vec![4, 5]
        );
        assert_eq!(indexed(&[7], 1, 4).lookup(&[7], 3), None);
        assert_eq!(indexed(&seq, 1, 4).lookup(&seq, 0), None);
    }

    #[test]
    fn a_repeating_pattern_continues_past_the_end() {
        // Period 3: a b c a b c a b → c a b c a …
        let seq = [1, 2, 3, 1, 2, 3, 1, 2];
        let index = indexed(&seq, 2, 8);
        let l = index.lookup(&seq, 7).unwrap();
        assert_eq!(l.tokens, vec![3, 1, 2, 3, 1, 2, 3]);
        assert_eq!(l.matched, 5);
        // A run of one token.
        let seq = [5, 9, 9, 9];
        assert_eq!(
            indexed(&seq, 1, 3).lookup(&seq, 4).unwrap().tokens,
            vec![9; 4]
        );
    }

    /// How many tokens a match gives depends on its length, the last entry serving longer
    /// ones, and never more than the room; 0 for its length, or no room, gives none.
    #[test]
    fn a_match_gives_as_many_tokens_as_its_length_earns() {
        // "1 2 3 4 5 6 7 8 9 2 3 4": the suffix 2 3 4 (3 tokens) was followed by 5 6 7 8.
        let seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4];
        let index = indexed(&seq, 2, 4);
        let tokens = |by: &[usize], room| index.lookup_by_match(&seq, by, room).map(|l| l.tokens);
        assert_eq!(tokens(&[1, 3], 8), Some(vec![5, 6, 7]));
        assert_eq!(tokens(&[1, 2, 3], 8), Some(vec![5, 6]));
        assert_eq!(tokens(&[1, 3], 2), Some(vec![5, 6]));
        assert_eq!(tokens(&[4, 0], 8), None);
        assert_eq!(tokens(&[4], 0), None);
        // A match of two tokens: "9 2 3 4 8 9 2" → 3 4 8, one of them.
        let seq = [9, 2, 3, 4, 8, 9, 2];
        let found = indexed(&seq, 2, 4)
            .lookup_by_match(&seq, &[1, 3], 8)
            .unwrap();
        assert_eq!((found.matched, found.tokens), (2, vec![3]));
    }

    #[test]
    fn growing_the_sequence_indexes_only_the_new_positions() {
        let full = [4, 8, 15, 16, 23, 42, 4, 8, 15, 16];
        let mut index = NgramIndex::new(2, 4);
        for end in 1..=full.len() {
            index.extend(&full[..end]);
        }
        let whole = indexed(&full, 2, 4);
        assert_eq!(index.ends, whole.ends);
        assert_eq!(index.lookup(&full, 3).unwrap().tokens, vec![23, 42, 4]);
    }
}
