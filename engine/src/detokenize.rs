//! Streaming text out of generated tokens: whole UTF-8 characters only, and stop strings that
//! may span several tokens.

/// Turns token bytes into text as tokens arrive. A byte-level token can end in the middle of
/// a character (an emoji is often split over several tokens); those bytes wait for the rest.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `bytes` and returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // from_utf8 validated this prefix.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that can never become a character: replace them, as a lossy
                        // decode would, and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Text of the bytes still waiting (replacement characters for an unfinished character).
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// What [`StopStrings::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text safe to send: it cannot be part of a stop string.
    pub text: String,
    /// A stop string matched; `text` ends right before it (right after it, where the stop
    /// strings are kept) and generation should end.
    pub stopped: bool,
}

/// Finds stop strings in streamed text. Text that could still turn out to be the start of a
/// stop string is held back until the next push decides it.
#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    /// The text a match releases ends with the stop string (vLLM's
    /// `include_stop_str_in_output`).
    keep_stop: bool,
    /// The stop string that matched, once one has.
    matched: Option<usize>,
}

impl StopStrings {
    /// Empty stop strings are ignored.
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            keep_stop: false,
            matched: None,
        }
    }

    /// The same, the text released at a match ending with the stop string where `keep`.
    pub fn keeping_stop(self, keep: bool) -> Self {
        Self {
            keep_stop: keep,
            ..self
        }
    }

    pub fn push(&mut self, text: &str) -> Released {
        self.held.push_str(text);
        // The earliest match; of several there, the first stop string given.
        let first = (self.stops.iter().enumerate())
            .filter_map(|(i, s)| Some((self.held.find(s.as_str())?, i)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, i)) = first {
            self.matched = Some(i);
            let end = match self.keep_stop {
                true => at + self.stops[i].len(),
                false => at,
            };
            let text = self.held[..end].to_string();
            self.held.clear();
            return Released {
                text,
                stopped: true,
            };
        }
        let keep = self.longest_partial_match();
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.drain(..release);
        Released {
            text,
            stopped: false,
        }
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// The held text, once no more tokens come.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn longest_partial_match(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().saturating_sub(1).min(self.held.len());
            for len in (best + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start) && stop.starts_with(&self.held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_stream_holds_split_characters() {
        let mut s = Utf8Stream::new();
        let smile = "🙂".as_bytes();
        assert_eq!(s.push(b"hi "), "hi ");
        assert_eq!(s.push(&smile[..1]), "");
        assert_eq!(s.push(&smile[1..3]), "");
        assert_eq!(s.push(&[smile[3], b'!']), "🙂!");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn utf8_stream_replaces_invalid_bytes_and_flushes_leftovers() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&[b'a', 0xff, b'b']), "a\u{fffd}b");
        assert_eq!(s.push(&"é".as_bytes()[..1]), "");
        assert_eq!(s.finish(), "\u{fffd}");
    }

    #[test]
    fn stop_string_spanning_pushes() {
        let mut s = StopStrings::new(["\n\n".to_string(), "END".to_string()]);
        assert_eq!(
            s.push("def f():"),
            Released {
                text: "def f():".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.push("\n"),
            Released {
                text: "".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.push("    return 1\nE"),
            Released {
                text: "\n    return 1\n".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.push("N"),
            Released {
                text: "".into(),
                stopped: false
            }
        );
        assert_eq!(s.matched(), None);
        assert_eq!(
            s.push("Dxyz"),
            Released {
                text: "".into(),
                stopped: true
            }
        );
        assert_eq!(s.matched(), Some("END"));
    }

    /// Kept, the stop string ends the released text: the earliest match's, of two at the
    /// same place the first given's, and nothing after it.
    #[test]
    fn a_kept_stop_string_ends_the_text() {
        let kept = |stops: &[&str], pushes: &[&str]| {
            let stops = stops.iter().map(|s| s.to_string());
            let mut s = StopStrings::new(stops).keeping_stop(true);
            let texts: Vec<Released> = pushes.iter().map(|p| s.push(p)).collect();
            (texts, s.matched().map(String::from))
        };
        let (released, matched) = kept(&["END", "\n\n"], &["a\n", "\nbEND c"]);
        assert_eq!(matched.as_deref(), Some("\n\n"));
        assert_eq!(released[0].text, "a");
        assert_eq!(
            released[1],
            Released {
                text: "\n\n".into(),
                stopped: true
            }
        );
        let (same_place, matched) = kept(&["ab", "a"], &["xabc"]);
        assert_eq!(
            (same_place[0].text.as_str(), matched.as_deref()),
            ("xab", Some("ab"))
        );
        let (same_place, matched) = kept(&["a", "ab"], &["xabc"]);
        assert_eq!(
            (same_place[0].text.as_str(), matched.as_deref()),
            ("xa", Some("a"))
        );
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching_or_at_the_end() {
        let mut s = StopStrings::new(["</answer>".to_string(), String::new()]);
        assert_eq!(s.push("a </ans").text, "a ");
        assert_eq!(s.push("wer? no").text, "</answer? no");
        assert_eq!(s.push(" </").text, " ");
        assert_eq!(s.finish(), "</");
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_text_is_safe() {
        let mut s = StopStrings::new(["世界".to_string(), "b".to_string()]);
        let r = s.push("你好世界 ab");
        assert_eq!(
            r,
            Released {
                text: "你好".into(),
                stopped: true
            }
        );
        let mut s = StopStrings::new(["é!".to_string()]);
        assert_eq!(
            s.push("café"),
            Released {
                text: "caf".into(),
                stopped: false
            }
        );
        assert_eq!(
            s.push("?"),
            Released {
                text: "é?".into(),
                stopped: false
            }
        );
    }
}
