//! docs/configuration.md lists every key of every service with its default and meaning,
//! generated from the configuration structs (their defaults and doc comments, the same text
//! `--print-config` prints). This test fails when the document and the code drift apart;
//! `DUET_BLESS=1 cargo test -p duet-e2e --test config_doc` writes the tables anew.

use duet_serving::config_doc::{Section, describe, markdown_table};
use duet_worker_core::{Worker, WorkerConfig};
use std::path::{Path, PathBuf};

const DOC: &str = "docs/configuration.md";

/// A worker's defaults as the document shows them: the model under the model cache, whose
/// place depends on the machine.
fn worker(mut config: WorkerConfig) -> Vec<Section> {
    let file = config.model.file_name().unwrap_or_default().to_owned();
    config.model = Path::new("$DUET_MODEL_DIR").join(file);
    describe(&config)
}

/// Each generated table: its name in the markers around it, and the table.
fn tables() -> Vec<(&'static str, String)> {
    let draft = worker(duet_draft_worker::Drafter::service().defaults);
    let target = worker(duet_target_worker::Verifier::service().defaults);
    let coordinator = describe(&duet_coordinator::service().defaults);
    vec![
        (
            "workers",
            markdown_table(&[("draft", draft), ("target", target)]),
        ),
        ("coordinator", markdown_table(&[("", coordinator)])),
    ]
}

/// `doc` with the text between each table's markers replaced by the table.
fn with_tables(doc: &str, tables: &[(&str, String)]) -> Result<String, String> {
    let mut out = doc.to_string();
    for (name, table) in tables {
        let begin = format!("<!-- generated: {name} -->\n");
        let end = format!("<!-- end generated: {name} -->");
        let (Some(b), Some(e)) = (out.find(&begin), out.find(&end)) else {
            return Err(format!("{DOC} lacks the markers `{begin}` and `{end}`"));
        };
        out.replace_range(b + begin.len()..e, table);
    }
    Ok(out)
}

#[test]
fn the_configuration_reference_matches_the_code() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(DOC);
    let doc = std::fs::read_to_string(&path).unwrap();
    let expected = with_tables(&doc, &tables()).unwrap();
    if std::env::var_os("DUET_BLESS").is_some() {
        std::fs::write(&path, &expected).unwrap();
        return;
    }
    let first_difference = doc
        .lines()
        .zip(expected.lines())
        .find(|(a, b)| a != b)
        .map(|(a, b)| format!("\n  document: {a}\n  code:     {b}"))
        .unwrap_or_default();
    assert!(
        doc == expected,
        "{DOC} no longer matches the configuration structs; run \
         `DUET_BLESS=1 cargo test -p duet-e2e --test config_doc` and review the diff{first_difference}"
    );
}

#[test]
fn a_table_between_its_markers_is_replaced_and_missing_markers_are_an_error() {
    let doc = "a\n<!-- generated: t -->\nold\n<!-- end generated: t -->\nb\n";
    let tables = [("t", "new\n".to_string())];
    assert_eq!(
        with_tables(doc, &tables).unwrap(),
        "a\n<!-- generated: t -->\nnew\n<!-- end generated: t -->\nb\n"
    );
    let err = with_tables("a\n", &tables).unwrap_err();
    assert_eq!(
        err,
        "docs/configuration.md lacks the markers `<!-- generated: t -->\n` and `<!-- end generated: t -->`"
    );
}

#[test]
fn every_key_has_a_meaning() {
    for (name, table) in tables() {
        for row in table.lines().skip(2) {
            assert!(
                !row.ends_with("|  |"),
                "{name}: a key without a doc comment: {row}"
            );
        }
    }
}

/// What `--print-config` prints loads back as the defaults it describes.
#[test]
fn printed_defaults_load_back() {
    use duet_serving::config_doc::commented_toml;
    let coordinator = duet_coordinator::service().defaults;
    let text = commented_toml(&describe(&coordinator));
    assert_eq!(
        toml::from_str::<duet_coordinator::CoordinatorConfig>(&text).unwrap(),
        coordinator
    );
    for worker in [
        duet_draft_worker::Drafter::service().defaults,
        duet_target_worker::Verifier::service().defaults,
    ] {
        let text = commented_toml(&describe(&worker));
        assert!(
            text.contains("# prefill_chunk_tokens = (unset)\n"),
            "{text}"
        );
        assert_eq!(toml::from_str::<WorkerConfig>(&text).unwrap(), worker);
    }
}
