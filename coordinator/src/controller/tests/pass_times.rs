//! The target's pass time by row count, learnt from passes (one stream's and batches'),
//! and what it makes the controller draft; requests start from what all requests saw.

use super::*;

#[test]
fn the_pass_time_is_learnt_from_passes() {
    let shared = Shared::default();
    assert!(shared.costs(Mode::Greedy).is_none());
    for rows in [1, 2, 5, 9, 17, 5, 1] {
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: 35.0 + 8.0 * rows as f64,
            committed: 1,
            ..RoundCosts::default()
        });
    }
    // At the measured row counts, between them, and past both ends: the line they lie on.
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    for rows in [1.0, 5.0, 17.0, 3.0, 12.5, 0.0, 33.0] {
        let expected = 35.0 + 8.0 * rows;
        assert!(
            (p.ms(rows) - expected).abs() < 1e-9,
            "{rows}: {}",
            p.ms(rows)
        );
    }
    // One row count only: a row is taken to cost a sixth of the pass per row (7 ms at one
    // row of 42 ms), not nothing.
    let once = Shared::default();
    once.observe_round(&RoundCosts {
        pass_rows: 1,
        pass_ms: 42.0,
        ..RoundCosts::default()
    });
    let p = once.costs(Mode::Greedy).unwrap().pass;
    assert!((p.ms(1.0) - 42.0).abs() < 1e-9, "{}", p.ms(1.0));
    assert!((p.row_ms(1.0) - 6.0).abs() < 1e-9, "{}", p.row_ms(1.0));
    // The first of eight reports of a pass of eight calls (an eighth of a pass) prices
    // passes already.
    let batch = Shared::default();
    batch.observe_round(&RoundCosts {
        pass_calls: 8,
        pass_rows: 8,
        pass_ms: 56.0,
        ..RoundCosts::default()
    });
    let p = batch.costs(Mode::Greedy).unwrap().pass;
    assert!((p.ms(8.0) - 56.0).abs() < 1e-9, "{}", p.ms(8.0));
}

/// Noisy passes never make more rows cheaper: a row count whose mean lies below the one
/// before it is pooled with that one.
#[test]
fn more_rows_never_take_less_time() {
    let shared = Shared::default();
    for (rows, ms) in [(1, 40.0), (2, 50.0), (3, 44.0), (4, 60.0)] {
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: ms,
            ..RoundCosts::default()
        });
    }
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    // 2 and 3 rows pooled into one point, each pass weighed by its age.
    let (w2, w3) = (SHARED_KEEP * SHARED_KEEP, SHARED_KEEP);
    let rows = (2.0 * w2 + 3.0 * w3) / (w2 + w3);
    let ms = (50.0 * w2 + 44.0 * w3) / (w2 + w3);
    assert!((p.ms(rows) - ms).abs() < 1e-9, "{}", p.ms(rows));
    assert!(p.ms(2.0) < 50.0 && p.ms(3.0) > 44.0);
    for rows in 0..8 {
        assert!(p.row_ms(rows as f64) >= 0.0, "{rows}");
    }
}

/// The pass time is read at each row count: one stream's small passes give the weights'
/// slope, eight streams' passes of 8 to 14 rows the arithmetic's, each where it holds, and
/// past the largest batch the arithmetic's slope goes on.
#[test]
fn the_pass_time_holds_at_each_row_count() {
    let shared = Shared::default();
    for i in 0..60 {
        pass(&shared, 1 + i % 6);
    }
    for i in 0..40 {
        pass(&shared, 8 + i % 7);
    }
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    for rows in 1..=20 {
        let expected = roofline(rows);
        let rows = rows as f64;
        assert!(
            (p.ms(rows) - expected).abs() < 1e-9,
            "{rows}: {}",
            p.ms(rows)
        );
    }
    assert!((p.row_ms(3.0) - 1.5).abs() < 1e-9);
    assert!((p.row_ms(11.0) - 3.75).abs() < 1e-9);
}

/// A CPU-like target: rows cheap up to four (1.5 ms each), dear past seven (8.6 ms); the
/// shape measured on the reference machine (docs/benchmarks.md), with numbers of its own.
fn cpu_measured(rows: usize) -> f64 {
    let rows = rows as f64;
    (36.0 + 1.5 * rows).max(8.6 * rows - 3.0)
}

/// A lookup whose runs hold for about six tokens drafts 4 where rows past the seventh cost
/// 8.6 ms each; priced by the slope of one stream's small passes (1.5 ms a row), it would
/// draft 10.
#[test]
fn long_lookup_runs_stop_where_rows_get_dear() {
    let shared = Shared::default();
    for i in 0..100 {
        let rows = [1, 1, 2, 3, 4, 1, 5, 9, 17][i % 9];
        shared.observe_round(&RoundCosts {
            pass_rows: rows,
            pass_ms: cpu_measured(rows),
            committed: 1,
            ..RoundCosts::default()
        });
    }
    let costs = shared.costs(Mode::Greedy).unwrap();
    let c = seen(Source::Ngram(2), 20, 16, 6);
    let plan = c.plan(&costs, &lookup_only(8));
    assert_eq!(plan, Plan::exactly(Proposer::Ngram, 4));
    let small_rows = Costs {
        pass: PassTime::line(36.0, 1.5),
        ..costs
    };
    assert_eq!(
        c.plan(&small_rows, &lookup_only(8)),
        Plan::exactly(Proposer::Ngram, 10)
    );
}

/// Row counts the latest passes did not run with fade out: after eight streams' batches,
/// 200 passes of one stream leave a 12-row pass priced along one stream's slope, no longer
/// at what the batches measured.
#[test]
fn a_row_count_not_run_lately_fades_out() {
    let shared = alone_then_in_batches();
    assert!((shared.costs(Mode::Greedy).unwrap().pass.ms(12.0) - roofline(12)).abs() < 1e-9);
    for i in 0..200 {
        pass(&shared, 1 + i % 6);
    }
    let p = shared.costs(Mode::Greedy).unwrap().pass;
    let along = roofline(6) + 1.5 * 6.0;
    assert!((p.ms(12.0) - along).abs() < 1e-9, "{}", p.ms(12.0));
}

/// In a batch of eight, a draft token that the target accepts 60% of the time does not pay
/// for its row on the roofline (a row costs 3.75 ms, an average token 5.25 ms: it would
/// need 71%), which only the line read around the batch shows.
#[test]
fn drafts_that_do_not_pay_for_their_rows_in_a_batch_are_not_made() {
    let shared = alone_then_in_batches();
    let local = shared.costs(Mode::Greedy).unwrap();
    let mut c = Controller::default();
    for i in 0..30 {
        c.observe(Source::Ngram(1), 1, usize::from(i % 5 < 3));
    }
    for _ in 0..20 {
        c.observe_batch(8, 8, 1);
    }
    let options = lookup_only(4);
    assert_eq!(c.plan(&local, &options), Plan::TARGET_ONLY);
    // Priced at what a row costs one stream's small passes, they would be made.
    let cheap = Costs {
        pass: PassTime::line(30.0, 1.5),
        ..local
    };
    assert_eq!(c.plan(&cheap, &options).proposer, Proposer::Ngram);
}

#[test]
fn requests_start_from_what_all_requests_saw() {
    let shared = one_pass_seen();
    let fresh = Controller::default();
    let before = fresh.plan(&shared.costs(Mode::Greedy).unwrap(), &draft_only(16));
    for _ in 0..50 {
        shared.observe_acceptance(Source::DraftModel, 4, 0);
    }
    let after = fresh.plan(&shared.costs(Mode::Greedy).unwrap(), &draft_only(16));
    assert_eq!(before.proposer, Proposer::DraftModel);
    assert_eq!(after, Plan::TARGET_ONLY);
}
