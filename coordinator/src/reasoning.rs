//! A thinking model's thought apart from its answer: the text between `<think>` and
//! `</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills) is the reasoning, the rest the
//! content, split as the text streams. A prompt whose chat template opens the thought
//! (`<think>` at the end of the generation prompt) starts inside it.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Where the text stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// At the start: a thought may open.
    Before,
    Thinking,
    /// After a thought, before the answer's first non-blank character (the models write
    /// blank lines between).
    Closed,
    Answering,
}

/// Pieces of text split into the thought's and the answer's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone)]
pub struct Thought {
    state: State,
    /// Text that may still be the start of a tag.
    held: String,
    /// Tokens of the thought so far, its tags' included.
    tokens: usize,
    /// Tokens read while a thought may yet open (they are its tag's if it does).
    pending: usize,
}

impl Thought {
    /// A completion's splitter; `open`: its prompt leaves a thought open.
    pub fn new(open: bool) -> Self {
        let state = match open {
            true => State::Thinking,
            false => State::Before,
        };
        Self {
            state,
            held: String::new(),
            tokens: 0,
            pending: 0,
        }
    }

    /// The tokens of the thought so far, its tags' included (those [`Self::push_token`]
    /// read inside it, or opening or closing it).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// [`Self::push`] of one token's text, counted in [`Self::tokens`] where it belongs to
    /// the thought.
    pub fn push_token(&mut self, text: &str) -> Split {
        let before = self.state;
        let split = self.push(text);
        match (before, self.state) {
            (State::Before, State::Before) => self.pending += 1,
            (State::Before, State::Thinking | State::Closed) => {
                self.tokens += std::mem::take(&mut self.pending) + 1;
            }
            (State::Before, State::Answering) => self.pending = 0,
            (State::Thinking, _) => self.tokens += 1,
            (State::Closed | State::Answering, _) => {}
        }
        split
    }

    /// Whether `bytes` are one of the thought's tags (whole).
    pub fn is_tag(bytes: &[u8]) -> bool {
        bytes == OPEN.as_bytes() || bytes == CLOSE.as_bytes()
    }

    /// Whether a chat template writes thoughts (a thinking model's).
    pub fn in_template(template: &str) -> bool {
        template.contains(CLOSE)
    }

    /// Whether `prompt_tail` (the end of a rendered prompt) leaves a thought open.
    pub fn opened_by(prompt_tail: &str) -> bool {
        prompt_tail.trim_end().ends_with(OPEN)
    }

    /// The next piece of the completion's text, split; what may start a tag is held back.
    pub fn push(&mut self, text: &str) -> Split {
        let mut split = Split::default();
        self.held.push_str(text);
        loop {
            match self.state {
                State::Before if self.held.starts_with(OPEN) => {
                    self.held.drain(..OPEN.len());
                    self.state = State::Thinking;
                }
                State::Before if OPEN.starts_with(self.held.as_str()) => return split,
                State::Before => self.state = State::Answering,
                State::Thinking => match self.held.find(CLOSE) {
                    Some(at) => {
                        split.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.state = State::Closed;
                    }
                    None => {
                        let keep = partial_tag(&self.held, CLOSE);
                        let thought = self.held.len() - keep;
                        split.reasoning.extend(self.held.drain(..thought));
                        return split;
                    }
                },
                State::Closed => {
                    let answer = self.held.trim_start().len();
                    self.held.drain(..self.held.len() - answer);
                    if self.held.is_empty() {
                        return split;
                    }
                    self.state = State::Answering;
                }
                State::Answering => {
                    split.content.push_str(&std::mem::take(&mut self.held));
                    return split;
                }
            }
        }
    }

    /// What was held back, at the end of the completion: an unfinished thought's text is
    /// reasoning.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => Split {
                reasoning: held,
                content: String::new(),
            },
            State::Closed => Split::default(),
            State::Before | State::Answering => Split {
                reasoning: String::new(),
                content: held,
            },
        }
    }
}

/// The length of `text`'s longest suffix that starts `tag` (and may grow into it).
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pieces` pushed in turn, then finished: the reasoning and content in total.
    fn split(open: bool, pieces: &[&str]) -> (String, String) {
        let mut thought = Thought::new(open);
        let mut total = Split::default();
        let splits = pieces.iter().map(|p| thought.push(p)).collect::<Vec<_>>();
        for s in splits.into_iter().chain([thought.finish()]) {
            total.reasoning.push_str(&s.reasoning);
            total.content.push_str(&s.content);
        }
        (total.reasoning, total.content)
    }

    fn owned(reasoning: &str, content: &str) -> (String, String) {
        (reasoning.to_string(), content.to_string())
    }

    #[test]
    fn a_thought_and_its_answer_split_however_the_text_comes() {
        let text = "<think>\nAdd them.\n</think>\n\nIt is 4.";
        let want = owned("\nAdd them.\n", "It is 4.");
        assert_eq!(split(false, &[text]), want);
        // Every cut of the text into two pieces, the tags' included.
        for cut in 1..text.len() {
            let (a, b) = text.split_at(cut);
            assert_eq!(split(false, &[a, b]), want, "cut at {cut}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split(false, &chars), want);
    }

    #[test]
    fn a_prompt_that_opens_the_thought_starts_inside_it() {
        assert!(Thought::opened_by("<|im_start|>assistant\n<think>\n"));
        assert!(!Thought::opened_by(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!Thought::opened_by("<|im_start|>assistant\n"));
        assert_eq!(
            split(true, &["Add them.\n</thi", "nk>\n\nIt is 4."]),
            owned("Add them.\n", "It is 4.")
        );
        // Cut short (max_tokens) inside the thought: all of it is reasoning.
        assert_eq!(split(true, &["Add the"]), owned("Add the", ""));
        assert_eq!(split(false, &["<think>Add </th"]), owned("Add </th", ""));
    }

    /// A thought's tokens are counted from its opening tag's first to its closing tag's
    /// last; an answer's are not, nor text that only looked as if it might open one.
    #[test]
    fn the_thoughts_tokens_are_counted() {
        let count = |open: bool, tokens: &[&str]| {
            let mut thought = Thought::new(open);
            tokens.iter().for_each(|t| drop(thought.push_token(t)));
            thought.tokens()
        };
        let tokens = [
            "<", "think", ">", "Add", " them", "</", "think", ">", "\n\n", "4",
        ];
        assert_eq!(count(false, &tokens), 8);
        assert_eq!(count(true, &tokens[3..]), 5);
        assert_eq!(count(false, &["<", "b", ">", "<think>"]), 0);
        assert_eq!(count(false, &["It", " is"]), 0);
    }

    #[test]
    fn text_without_a_thought_is_all_content() {
        assert_eq!(split(false, &["It is 4."]), owned("", "It is 4."));
        assert_eq!(split(false, &["<thi", "s>"]), owned("", "<this>"));
        assert_eq!(split(false, &["<", "t"]), owned("", "<t"));
        // A tag later in the answer is the answer's text.
        let later = "4. <think>x</think>";
        assert_eq!(split(false, &[later]), owned("", later));
        assert!(Thought::in_template("{{ '<think>\\n\\n</think>\\n\\n' }}"));
        assert!(!Thought::in_template("{{ '<|im_start|>assistant\\n' }}"));
    }
}
