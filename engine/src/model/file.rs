//! What a model file is, as model lists show it (Ollama's `/api/tags` and `/api/show`): how
//! many weights it holds, how they are stored, and its size.

use super::weights::read_content;
use crate::error::{EngineError, Result};
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::Content;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileFacts {
    /// The weights: `general.parameter_count` where the file has it, else every tensor's
    /// elements.
    pub parameters: u64,
    /// llama.cpp's name of the file's type (`general.file_type`: `Q8_0`, `Q4_K_M`), else the
    /// name of the storage that holds most of its weights.
    pub quantization: String,
    pub bytes: u64,
    /// The converter's label of the model's size (`general.size_label`: `1.5B`), where the
    /// file has one.
    pub size_label: String,
}

/// The facts of the GGUF file at `path`, read from its header (no tensor is loaded).
pub fn file_facts(path: &Path) -> Result<FileFacts> {
    let (content, file) = read_content(path)?;
    facts(path, &content, &file)
}

/// The facts of the GGUF file at `path` and its tokenizer as
/// [`crate::tokenizer::tokenizer_gguf`] writes it, from one read of its header: the header
/// holds the whole vocabulary, slow to read twice at a worker's load.
pub fn describe_file(path: &Path) -> Result<(FileFacts, Vec<u8>)> {
    let (content, file) = read_content(path)?;
    let tokenizer = crate::tokenizer::tokenizer_gguf_of(&content)?;
    Ok((facts(path, &content, &file)?, tokenizer))
}

fn facts(path: &Path, content: &Content, file: &File) -> Result<FileFacts> {
    let bytes = file.metadata().map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut by_type: HashMap<GgmlDType, u64> = HashMap::new();
    for info in content.tensor_infos.values() {
        *by_type.entry(info.ggml_dtype).or_default() += info.shape.elem_count() as u64;
    }
    let metadata = |key: &str| content.metadata.get(key);
    let file_type = metadata("general.file_type").and_then(|t| t.to_u32().ok());
    let most = by_type.iter().max_by_key(|&(t, n)| (n, storage_name(*t)));
    let most = most.map(|(t, _)| storage_name(*t));
    // The converter's count where it wrote one: an output projection tied to the embedding
    // but stored apart counts once there, as model cards count it.
    let counted = metadata("general.parameter_count").and_then(|n| n.to_u64().ok());
    let label = metadata("general.size_label").and_then(|l| l.to_string().ok());
    Ok(FileFacts {
        parameters: counted.unwrap_or_else(|| by_type.values().sum()),
        quantization: file_type
            .and_then(file_type_name)
            .or(most)
            .unwrap_or_default()
            .into(),
        bytes: bytes.len(),
        size_label: label.cloned().unwrap_or_default(),
    })
}

/// llama.cpp's names of its file types (`llama_ftype`), for the types this engine loads.
fn file_type_name(file_type: u32) -> Option<&'static str> {
    let names = [
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (7, "Q8_0"),
        (8, "Q5_0"),
        (9, "Q5_1"),
        (10, "Q2_K"),
        (11, "Q3_K_S"),
        (12, "Q3_K_M"),
        (13, "Q3_K_L"),
        (14, "Q4_K_S"),
        (15, "Q4_K_M"),
        (16, "Q5_K_S"),
        (17, "Q5_K_M"),
        (18, "Q6_K"),
        (21, "Q2_K_S"),
        (32, "BF16"),
    ];
    let found = names.iter().find(|(t, _)| *t == file_type);
    found.map(|(_, name)| *name)
}

/// A tensor storage's name as llama.cpp writes it.
fn storage_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::Value;

    /// The tiny test model: its tensors' elements counted, its file type named, its size.
    #[test]
    fn a_files_weights_are_counted_and_its_type_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        crate::testing::TinyModel::default().write(&path).unwrap();
        let facts = file_facts(&path).unwrap();
        let (content, _) = read_content(&path).unwrap();
        let elements: usize = (content.tensor_infos.values())
            .map(|i| i.shape.elem_count())
            .sum();
        assert_eq!(facts.parameters, elements as u64);
        assert!(facts.parameters > 0);
        // No `general.file_type`: the storage of most of its weights.
        assert_eq!(facts.quantization, "Q8_0");
        assert_eq!(facts.bytes, std::fs::metadata(&path).unwrap().len());
        assert_eq!(facts.size_label, "");
        // One read of the header gives the facts and the tokenizer both.
        let tokenizer = crate::tokenizer::tokenizer_gguf(&path).unwrap();
        assert_eq!(describe_file(&path).unwrap(), (facts.clone(), tokenizer));
        assert_eq!(file_type_name(15), Some("Q4_K_M"));
        assert_eq!(file_type_name(4), None);

        // A converter's count and size label, and its file type, are read where written.
        let labelled = crate::testing::TinyModel {
            metadata: vec![
                ("general.parameter_count".into(), Value::U64(1_543_714_304)),
                ("general.size_label".into(), Value::String("1.5B".into())),
                ("general.file_type".into(), Value::U32(15)),
            ],
            ..Default::default()
        };
        labelled.write(&path).unwrap();
        let facts = file_facts(&path).unwrap();
        assert_eq!(
            (facts.parameters, &*facts.size_label, &*facts.quantization),
            (1_543_714_304, "1.5B", "Q4_K_M")
        );
    }
}
