//! Fill in the middle: the control tokens a code model reads a prefix, a suffix and the
//! middle to write by (Qwen2.5-Coder's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`,
//! DeepSeek-Coder's `<｜fim▁begin｜>`), found by the GGUF's keys or, where it has none (as
//! most conversions write), by their text, as llama.cpp finds them.

use candle_core::quantized::gguf_file::Content;

/// A code model's fill-in-the-middle tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Infill {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// The padding, which ends a middle.
    pub padding: Option<u32>,
    /// The repository-level tokens (Qwen2.5-Coder's `<|repo_name|>` and `<|file_sep|>`):
    /// a repository's name and its files before the one being completed, each after the
    /// separator. Written in a middle, each starts another file and so ends it.
    pub repository: Option<u32>,
    pub file_separator: Option<u32>,
}

/// The repository around the file being completed: its name, the file's path, and other
/// files (each path and text), read before the file in the model's repository-level format.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Repository {
    pub name: String,
    pub path: String,
    pub files: Vec<RepositoryFile>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepositoryFile {
    pub path: String,
    pub text: String,
}

impl Repository {
    /// Bytes of its texts (name, paths and files).
    pub fn bytes(&self) -> usize {
        let files = self.files.iter().map(|f| f.path.len() + f.text.len());
        self.name.len() + self.path.len() + files.sum::<usize>()
    }
}

/// The GGUF keys of each token (llama.cpp's current and older names), and the texts the
/// model families write it with.
const PREFIX: (&[&str], &[&str]) = (
    &["fim_pre_token_id", "prefix_token_id"],
    &[
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
    ],
);
const SUFFIX: (&[&str], &[&str]) = (
    &["fim_suf_token_id", "suffix_token_id"],
    &[
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
    ],
);
const MIDDLE: (&[&str], &[&str]) = (
    &["fim_mid_token_id", "middle_token_id"],
    &[
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
    ],
);
const PADDING: (&[&str], &[&str]) = (
    &["fim_pad_token_id"],
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>"],
);
const REPOSITORY: (&[&str], &[&str]) = (
    &["fim_rep_token_id"],
    &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<reponame>"],
);
const FILE_SEPARATOR: (&[&str], &[&str]) = (&["fim_sep_token_id"], &["<|file_sep|>", "<file_sep>"]);

impl Infill {
    /// The model's tokens, where it has all three of prefix, suffix and middle.
    pub(crate) fn find(content: &Content, tokens: &[String]) -> Option<Self> {
        let find = |(keys, texts): (&[&str], &[&str])| {
            let vocab = tokens.len() as u32;
            let key = keys.iter().find_map(|k| {
                let value = content.metadata.get(&format!("tokenizer.ggml.{k}"))?;
                value.to_u32().ok().filter(|&id| id < vocab)
            });
            key.or_else(|| {
                let id = tokens.iter().position(|t| texts.contains(&t.as_str()))?;
                Some(id as u32)
            })
        };
        Some(Self {
            prefix: find(PREFIX)?,
            suffix: find(SUFFIX)?,
            middle: find(MIDDLE)?,
            padding: find(PADDING),
            repository: find(REPOSITORY),
            file_separator: find(FILE_SEPARATOR),
        })
    }

    /// Tokens that end a middle, beside the end-of-sequence tokens: the padding, and the
    /// tokens that start another file (llama.cpp ends generation at them too).
    pub fn ends(&self) -> Vec<u32> {
        [self.padding, self.repository, self.file_separator]
            .into_iter()
            .flatten()
            .collect()
    }

    /// Both repository-level tokens, where the model has them.
    pub fn repository_tokens(&self) -> Option<(u32, u32)> {
        self.repository.zip(self.file_separator)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Value;

    fn content(metadata: &[(&str, u32)]) -> Content {
        Content {
            magic: candle_core::quantized::gguf_file::VersionedMagic::GgufV3,
            metadata: (metadata.iter())
                .map(|&(k, v)| (format!("tokenizer.ggml.{k}"), Value::U32(v)))
                .collect(),
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        }
    }

    fn owned(tokens: &[&str]) -> Vec<String> {
        tokens.iter().map(|t| t.to_string()).collect()
    }

    /// Qwen2.5-Coder's tokens by their text (its GGUF files name none), its padding,
    /// repository and file-separator tokens ending a middle.
    #[test]
    fn qwens_tokens_are_found_by_their_text() {
        let tokens = owned(&[
            "a",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ]);
        let infill = Infill::find(&content(&[]), &tokens).unwrap();
        let expected = Infill {
            prefix: 1,
            suffix: 3,
            middle: 2,
            padding: Some(4),
            repository: Some(5),
            file_separator: Some(6),
        };
        assert_eq!(infill, expected);
        assert_eq!(infill.ends(), [4, 5, 6]);
        assert_eq!(infill.repository_tokens(), Some((5, 6)));
    }

    /// The GGUF's keys win over the texts; a key outside the vocabulary is passed over; a
    /// model without all three of prefix, suffix and middle has none.
    #[test]
    fn keys_win_and_all_three_are_needed() {
        let tokens = owned(&["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "x", "y"]);
        let keys = [("fim_pre_token_id", 3), ("suffix_token_id", 4)];
        let infill = Infill::find(&content(&keys), &tokens).unwrap();
        assert_eq!((infill.prefix, infill.suffix, infill.middle), (3, 4, 2));
        assert!(infill.ends().is_empty());
        assert_eq!(infill.repository_tokens(), None);
        let outside = [("fim_mid_token_id", 5)];
        assert_eq!(Infill::find(&content(&outside), &tokens).unwrap().middle, 2);
        let no_middle = owned(&["<fim_prefix>", "<fim_suffix>"]);
        assert_eq!(Infill::find(&content(&[]), &no_middle), None);
    }
}
