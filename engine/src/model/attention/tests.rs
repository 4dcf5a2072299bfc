use super::*;

/// The dot product host attention used before `dots` (the reference).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in a_rest.iter().zip(b_rest) {
        s = x.mul_add(*y, s);
    }
    s
}

#[test]
fn dots_are_the_reference_dot_products() {
    for len in [37, 128] {
        let b: Vec<f32> = (0..len).map(|i| (i as f32).sin()).collect();
        let a: Vec<Vec<f32>> = (0..4)
            .map(|j| (0..len).map(|i| (i + j) as f32 * 0.5 - 3.0).collect())
            .collect();
        let four: [f32; 4] = dots(std::array::from_fn(|j| a[j].as_slice()), &b);
        for (j, a) in a.iter().enumerate() {
            let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!(
                (four[j] - naive).abs() < 1e-3,
                "{len}: {} vs {naive}",
                four[j]
            );
            assert_eq!(four[j].to_bits(), dot(a, &b).to_bits());
            assert_eq!(dots([a.as_slice()], &b)[0].to_bits(), dot(a, &b).to_bits());
        }
    }
}

#[test]
fn equal_scores_average_the_values() {
    // Two keys with equal scores: the output is the mean of their values.
    let keys = [1.0f32, 0.0, 1.0, 0.0];
    let values = [2.0f32, 4.0, 6.0, 8.0];
    let rows = KvRows {
        keys: &keys,
        values: &values,
        stride: 2,
        offset: 0,
        head_dim: 2,
        order: Keys::IN_ORDER,
    };
    let mut dst = [0f32; 2];
    let mut queries = [Query {
        query: &[1.0, 0.0],
        keys: 2,
        dst: &mut dst,
    }];
    attend_rows_of_head(&mut queries, &rows, 1.0, &mut Vec::new());
    assert_eq!(dst, [4.0, 6.0]);
}

/// Attention of one query alone, one cached row after the other: what a decode step
/// computes, and what each grouped query must get too, bit for bit.
fn attend_alone(query: &[f32], rows: &KvRows<'_>, n: usize, scale: f32) -> Vec<f32> {
    let mut dst = vec![0f32; query.len()];
    attend_row(query, rows, 0..n, scale, &mut Vec::new(), &mut dst);
    dst
}

/// Deterministic values in [-2, 2).
fn noise(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 4096) as f32 / 1024.0 - 2.0
        })
        .collect()
}

#[test]
fn grouped_queries_get_what_each_gets_alone() {
    // A head of 40 dims (past the 8 lanes and under a register block) over 23 cached
    // rows, and one of 128 over 150 (whole register blocks, several value blocks);
    // queries reaching different lengths share the head in every grouping.
    for (hd, len) in [(40, 23), (128, 150)] {
        let kvh = 2;
        let keys = noise(len * kvh * hd, 1);
        let values = noise(len * kvh * hd, 2);
        let rows = KvRows {
            keys: &keys,
            values: &values,
            stride: kvh * hd,
            offset: hd,
            head_dim: hd,
            order: Keys::IN_ORDER,
        };
        let lengths = [1, len, 7, 8, len / 2 + 1, len - 7, 16];
        let query_data: Vec<Vec<f32>> = (0..lengths.len())
            .map(|i| noise(hd, 10 + i as u32))
            .collect();
        let alone: Vec<Vec<f32>> = lengths
            .iter()
            .zip(&query_data)
            .map(|(&n, q)| attend_alone(q, &rows, n, 0.3))
            .collect();
        for group in [1, 2, 3, 5, 7] {
            let mut out = vec![vec![0f32; hd]; lengths.len()];
            let mut scores = vec![9.0; 5];
            for (chunk, dsts) in (0..lengths.len())
                .collect::<Vec<_>>()
                .chunks(group)
                .zip(out.chunks_mut(group))
            {
                let mut queries: Vec<Query<'_>> = chunk
                    .iter()
                    .zip(dsts.iter_mut())
                    .map(|(&i, dst)| Query {
                        query: &query_data[i],
                        keys: lengths[i],
                        dst,
                    })
                    .collect();
                attend_rows_of_head(&mut queries, &rows, 0.3, &mut scores);
            }
            for (i, (got, want)) in out.iter().zip(&alone).enumerate() {
                let (got, want): (Vec<u32>, Vec<u32>) = (
                    got.iter().map(|x| x.to_bits()).collect(),
                    want.iter().map(|x| x.to_bits()).collect(),
                );
                assert_eq!(got, want, "head of {hd}, query {i} in groups of {group}");
            }
        }
    }
}

/// Each (row, head) of every span exactly once, in items of at most a block of rows.
fn coverage(spans: &[Span], items: &[Item], group: usize) {
    let mut seen = std::collections::HashMap::new();
    for item in items {
        assert!(item.rows.len() <= ROW_BLOCK && !item.heads.is_empty());
        for i in item.rows.clone() {
            for j in item.heads.clone() {
                *seen.entry((item.span, i, item.kv_head, j)).or_insert(0) += 1;
            }
        }
    }
    let rows: usize = spans.iter().map(|s| s.len).sum();
    assert_eq!(seen.len(), rows * 2 * group, "group {group}");
    assert!(seen.values().all(|&n| n == 1));
}

fn span(row: usize, len: usize, start: usize) -> Span {
    Span {
        row,
        len,
        start,
        paths: None,
    }
}

#[test]
fn long_spans_are_grouped_and_cover_each_row_and_head_once() {
    // Each reaches GROUPED_FROM positions (the last exactly).
    let spans = [span(0, 1, 300), span(1, 9, 256), span(10, 4, 252)];
    for (threads, group) in [(1, 6), (2, 6), (4, 6), (16, 6), (4, 1), (3, 4)] {
        let items = work_items(&spans, 2, group, threads);
        coverage(&spans, &items, group);
        // 5 blocks of rows x 2 key/value heads: heads are split only to give each
        // thread four items (in parts of whole heads, so 2 x 3 heads for 12 wanted).
        let expected = match (threads, group) {
            (4, 6) => 10 * 2,
            (16, 6) => 10 * 6,
            (3, 4) => 10 * 2,
            _ => 10,
        };
        assert_eq!(items.len(), expected, "{threads} threads, group {group}");
    }
}

/// A tree's rows attend to different keys: past GROUPED_FROM each row is an item of its
/// own, with its group's heads together (its keys read once for all of them).
#[test]
fn a_long_trees_rows_are_items_of_their_own_with_their_heads_together() {
    let paths = tree_paths(&[0, 0, 1, 0], 300).unwrap();
    let spans = [Span {
        paths: Some(paths),
        ..span(0, 4, 300)
    }];
    let items = work_items(&spans, 2, 6, 2);
    coverage(&spans, &items, 6);
    assert_eq!(items.len(), 4 * 2);
    assert!(items.iter().all(|i| i.rows.len() == 1 && i.heads == (0..6)));
}

#[test]
fn short_spans_give_an_item_per_row_and_head() {
    // 3 + 1 rows under GROUPED_FROM (the second ends one short of it), beside a long
    // decode row: 4 x 2 x 6 = 48 single items already give 4 threads their share, so
    // the long row's heads are not split.
    let spans = [span(0, 3, 10), span(3, 1, 254), span(4, 1, 400)];
    let items = work_items(&spans, 2, 6, 4);
    coverage(&spans, &items, 6);
    let single = items
        .iter()
        .filter(|i| i.rows.len() == 1 && i.heads.len() == 1)
        .count();
    assert_eq!(single, 48);
    assert_eq!(items.len(), 48 + 2);
    assert!(items.iter().all(|i| (i.span == 2) == (i.heads.len() == 6)));
}
