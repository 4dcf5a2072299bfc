//! What handing a pass's reads to rayon costs when its threads have slept (as between a
//! GPU's passes, where nothing else keeps them busy): `par_iter` over one and over several
//! trivial items from a thread outside the pool, after idling, against a plain `iter`.
//! `read_side_by_side` (worker-core) keeps reads here where that costs more than it saves.
//!
//!   cargo run --release --example rayon-hand-off -p duet-draft-worker

use rayon::prelude::*;
use std::time::{Duration, Instant};

const RUNS: u32 = 200;

fn main() {
    for items in [1u64, 2, 8] {
        let items: Vec<u64> = (0..items).collect();
        for idle_ms in [0, 1, 5, 13] {
            let (mut side_by_side, mut here) = (Duration::ZERO, Duration::ZERO);
            for _ in 0..RUNS {
                std::thread::sleep(Duration::from_millis(idle_ms));
                let start = Instant::now();
                let read: Vec<u64> = items.par_iter().map(|x| x * 2).collect();
                side_by_side += start.elapsed();
                std::hint::black_box(read);
                let start = Instant::now();
                let read: Vec<u64> = items.iter().map(|x| x * 2).collect();
                here += start.elapsed();
                std::hint::black_box(read);
            }
            let us = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(RUNS);
            println!(
                "{} items after {idle_ms:>2} ms idle: par_iter {:.1} us, iter {:.2} us",
                items.len(),
                us(side_by_side),
                us(here)
            );
        }
    }
}
