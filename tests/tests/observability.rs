//! The monitoring assets against the services' real `/metrics`: every metric that a PromQL
//! expression of the Grafana dashboard or of the alerting rules names must exist in what
//! the three services expose, every exposed metric must have a row in docs/operations.md's
//! metric tables, and every alert's runbook link must land on a heading there.

use duet_e2e::common::*;
use duet_proto::v1 as pb;
use duet_proto::v1::SpeculationMethod::DraftModel;
use std::collections::{BTreeMap, BTreeSet};

const DASHBOARD: &str = include_str!("../../deploy/helm/duet/files/duet-dashboard.json");
const ALERTS: &str = include_str!("../../deploy/helm/duet/files/duet-alerts.yaml");
const OPERATIONS: &str = include_str!("../../docs/operations.md");

/// PromQL's aggregation operators and keywords: words in an expression that name no metric.
const NOT_METRICS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
];

/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names a PromQL expression selects: identifiers outside label matchers
/// (`{…}`), ranges (`[…]`), strings and label lists (`by (…)`), that are neither a
/// function's name (followed by `(`), a keyword, nor a Grafana variable (`$…`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut label_list_next = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '{' | '[' => i = skip_to(&chars, i, if c == '{' { '}' } else { ']' }),
            '"' | '\'' | '`' => i = skip_to(&chars, i, c),
            '(' if label_list_next => {
                label_list_next = false;
                i = skip_to(&chars, i, ')');
            }
            '$' if chars.get(i + 1) == Some(&'{') => i = skip_to(&chars, i + 1, '}'),
            '$' => i = word_end(&chars, i + 1),
            c if c.is_ascii_digit() || c == '.' => i = word_end(&chars, i),
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let end = word_end(&chars, i);
                let word: String = chars[i..end].iter().collect();
                let next = chars[end..].iter().find(|c| !c.is_whitespace());
                // `group_left` may stand without a list: only a parenthesis right after
                // the keyword is one.
                label_list_next = LABEL_LISTS.contains(&word.as_str());
                if !label_list_next && next != Some(&'(') && !NOT_METRICS.contains(&word.as_str()) {
                    names.insert(word);
                }
                i = end;
            }
            _ => i += 1,
        }
    }
    names
}

/// The index just past the `close` that ends what starts at `open` (strings inside label
/// matchers may hold `}`; a backslash escapes inside strings).
fn skip_to(chars: &[char], open: usize, close: char) -> usize {
    let quoted = matches!(close, '"' | '\'' | '`');
    let mut i = open + 1;
    while i < chars.len() && chars[i] != close {
        match chars[i] {
            '\\' if quoted => i += 1,
            q @ ('"' | '\'' | '`') if !quoted => i = skip_to(chars, i, q) - 1,
            _ => {}
        }
        i += 1;
    }
    i + 1
}

/// The end of an identifier or number starting at `start`.
fn word_end(chars: &[char], start: usize) -> usize {
    let mut i = start;
    while i < chars.len() && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':')) {
        i += 1;
    }
    i.max(start + 1)
}

/// Every PromQL expression of the dashboard, named by its panel (or variable), with each
/// panel query checked to have one.
fn dashboard_exprs() -> Vec<(String, String)> {
    let dashboard: serde_json::Value = serde_json::from_str(DASHBOARD).unwrap();
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(!expr.is_empty(), "panel {title:?} has a query without expr");
            out.push((format!("panel {title:?}"), expr.to_string()));
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] != "query" {
            continue;
        }
        // label_values(SELECTOR, label): only the selector is PromQL.
        let query = var["query"]["query"].as_str().unwrap();
        let args = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable query {query:?} is not label_values(…)"));
        let selector = args.rsplit_once(',').unwrap().0;
        out.push((format!("variable {}", var["name"]), selector.to_string()));
    }
    out
}

/// Every `expr` of the rule file with its alert's name: the value on its line, or the
/// block scalar (`|`, `>`) indented below it.
fn rule_exprs(yaml: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut alert = String::new();
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if let Some(name) = trimmed.strip_prefix("- alert:") {
            alert = name.trim().to_string();
        }
        let Some(value) = trimmed.strip_prefix("expr:") else {
            continue;
        };
        let value = value.trim();
        let expr = if value.starts_with('|') || value.starts_with('>') {
            let indent = line.len() - trimmed.len();
            lines[n + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            value.trim_matches(|c| c == '"' || c == '\'').to_string()
        };
        out.push((format!("alert {alert}"), expr));
    }
    out
}

/// The sample names of a scrape (`duet_requests_total`, `…_seconds_bucket`): what a PromQL
/// selector matches once Prometheus has scraped it.
fn sample_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// The names a scrape's `# TYPE` lines declare, as their samples are written: a counter
/// with `_total`, a histogram by its own name (its samples add `_bucket`, `_sum`, `_count`).
fn documented_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| match l.split_once(' ') {
            Some((name, "counter")) => format!("{name}_total"),
            Some((name, _)) => name.to_string(),
            None => panic!("a TYPE line without a type: {l}"),
        })
        .collect()
}

/// The metrics docs/operations.md's tables list: the first cell of each row, one name in
/// code quotes.
fn table_metrics(doc: &str) -> BTreeSet<String> {
    doc.lines()
        .filter_map(|l| l.strip_prefix("| `")?.split_once("` |"))
        .map(|(name, _)| name.to_string())
        .collect()
}

/// The names `exprs` refer to that no scrape holds, each with where it is used.
fn missing(exprs: &[(String, String)], exposed: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (place, expr) in exprs {
        for name in metric_names(expr) {
            if !exposed.contains(&name) {
                out.entry(name).or_insert_with(|| place.clone());
            }
        }
    }
    out
}

#[test]
fn the_extractor_finds_metric_names_and_nothing_else() {
    let expr = r#"histogram_quantile(0.95, sum by (job, le) (rate(duet_worker_forward_seconds_bucket{namespace=~"$namespace", kind="call"}[$__rate_interval])))
        / ignoring (position) group_left () sum without (pod) (duet_made_up_total{a="}"} offset 5m) > bool 1e3
        or on(job) vector(0) and max(duet_worker_kv_token_budget)"#;
    let names: Vec<String> = metric_names(expr).into_iter().collect();
    assert_eq!(
        names,
        [
            "duet_made_up_total",
            "duet_worker_forward_seconds_bucket",
            "duet_worker_kv_token_budget",
        ]
    );
    let exposed: BTreeSet<String> = [
        "duet_worker_forward_seconds_bucket",
        "duet_worker_kv_token_budget",
    ]
    .map(String::from)
    .into();
    let exprs = [("panel \"made up\"".to_string(), expr.to_string())];
    assert_eq!(
        missing(&exprs, &exposed),
        BTreeMap::from([(
            "duet_made_up_total".to_string(),
            "panel \"made up\"".to_string()
        )])
    );
}

#[test]
fn rule_exprs_are_read_from_lines_and_blocks() {
    let yaml = "      - alert: A\n        expr: max(a_total) == 0\n        for: 2m\n      - alert: B\n        expr: |\n          sum(b_total)\n            / sum(c_total)\n\n        labels: {}\n";
    assert_eq!(
        rule_exprs(yaml),
        [
            ("alert A".to_string(), "max(a_total) == 0".to_string()),
            (
                "alert B".to_string(),
                "sum(b_total)\n/ sum(c_total)\n".to_string()
            ),
        ]
    );
}

/// Every alert of the file has its expression read, and a runbook link to a heading of
/// docs/operations.md (GitHub's anchors: lower case, spaces to `-`, punctuation dropped).
#[test]
fn every_alert_has_an_expr_and_a_runbook_heading() {
    let alerts = ALERTS.matches("- alert:").count();
    assert_eq!(rule_exprs(ALERTS).len(), alerts);
    assert_eq!(alerts, 14);
    let anchors: BTreeSet<String> = OPERATIONS
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| {
            l.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    let links: Vec<&str> = ALERTS
        .lines()
        .filter_map(|l| l.trim().strip_prefix("runbook_url: "))
        .collect();
    assert_eq!(links.len(), alerts);
    for link in links {
        let (page, anchor) = link.split_once('#').unwrap();
        assert!(page.ends_with("/docs/operations.md"), "{link}");
        assert!(
            anchors.contains(anchor),
            "no heading of docs/operations.md for {link}"
        );
    }
}

/// A stack after one short speculating generation: every metric the dashboard and the
/// rules name is on some service's `/metrics`, and every metric there is in the docs.
#[tokio::test]
async fn dashboard_and_alerts_name_only_exposed_metrics() {
    let m = tiny_models();
    // An identical draft: every draft token is accepted, so the per-position series exist.
    let stack = Stack::start(&m.target, &m.target);
    wait_stack(&stack).await;
    let mut req = request("the cat", 12, DraftModel);
    req.num_speculative_tokens = 3;
    let g = generate(&stack.coordinator.url(), req).await.unwrap();
    assert_eq!(g.finish_reason, Some(pb::FinishReason::Length as i32));
    assert_eq!(g.usage.draft_tokens_accepted, g.usage.draft_tokens_proposed);
    assert!(g.usage.draft_tokens_accepted > 0, "{:?}", g.usage);
    // One HTTP API call, so its counter has a series.
    http(stack.coordinator.http_addr, "GET", "/health", &[], "").await;

    let call = "duet_worker_forward_seconds_count{kind=\"call\"}";
    let scrapes = [
        scrape(&stack.coordinator).await,
        scrape_until(&stack.draft, call, 1.0).await,
        scrape_until(&stack.target, call, 1.0).await,
    ];
    let exposed: BTreeSet<String> = scrapes.iter().flat_map(|s| sample_names(s)).collect();

    let dashboard = dashboard_exprs();
    let rules = rule_exprs(ALERTS);
    assert_eq!(rules.len(), 14);
    let named: BTreeSet<String> = dashboard
        .iter()
        .chain(&rules)
        .flat_map(|(_, e)| metric_names(e))
        .collect();
    assert_eq!(missing(&dashboard, &exposed), BTreeMap::new(), "dashboard");
    assert_eq!(missing(&rules, &exposed), BTreeMap::new(), "alerts");
    // So that an extractor finding less cannot pass unnoticed: a dashboard or rule that
    // names a new metric changes this count on purpose.
    assert_eq!(named.len(), 51, "{named:?}");

    let tables = table_metrics(OPERATIONS);
    let undocumented: BTreeSet<String> = scrapes
        .iter()
        .flat_map(|s| documented_names(s))
        .filter(|name| !tables.contains(name))
        .collect();
    assert_eq!(
        undocumented,
        BTreeSet::new(),
        "exposed but not in docs/operations.md's metric tables"
    );
}
