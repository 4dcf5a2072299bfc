//! The target's pass time as a function of its rows, measured at each row count.
//!
//! A pass's time is not one line in its rows. Up to a few rows it is reading the weights
//! (rows nearly free), past that the arithmetic (each row costs its share), on a CPU and on
//! a GPU alike, only at different row counts (docs/benchmarks.md, "A target pass priced by
//! its measured time"). One line takes the slope of one regime for the other: fitted where
//! one stream's passes mostly run it prices a long lookup too low, fitted where a batch runs
//! it makes a stream's own rows look dear. So each
//! row count keeps its own mean time (counts past 16 in groups a quarter of an octave
//! wide), and the time at any row count is read off those means: straight between the
//! measured counts, past them along the nearest measured slope. All of them fade with each
//! pass, so the row counts the latest passes ran with are what is measured (another
//! workload's passes, say longer contexts, do not linger).

/// Row counts kept apart up to this many; past it, grouped.
const EXACT_ROWS: usize = 16;
/// Groups past `EXACT_ROWS` per doubling of the rows.
const GROUPS_PER_OCTAVE: f64 = 4.0;
/// A row count is measured while its passes weigh this much (a pass counts once, whatever
/// the calls in it, and less with each pass after it: one pass of a row count stays
/// measured for the next 34 passes).
const MEASURED: f64 = 0.5;

/// The mean time of the passes of one group of row counts, forgetting old passes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Group {
    weight: f64,
    rows: f64,
    ms: f64,
}

/// The passes seen, by row count.
#[derive(Debug, Clone, Default)]
pub(super) struct PassTimes {
    groups: Vec<Group>,
}

fn group(rows: usize) -> usize {
    match rows {
        0..=EXACT_ROWS => rows,
        _ => {
            let octaves = (rows as f64 / EXACT_ROWS as f64).log2();
            EXACT_ROWS + (octaves * GROUPS_PER_OCTAVE).ceil() as usize
        }
    }
}

impl PassTimes {
    /// A pass of `rows` rows took `ms`; it weighs `w`, and all older passes are first scaled
    /// by `keep` to the power `w` (a pass seen by several requests, each adding its share,
    /// is forgotten like one). A row count the latest passes did not run with fades out of
    /// the measured ones: what it cost under another load is not what it costs now.
    pub(super) fn observe(&mut self, rows: usize, ms: f64, keep: f64, w: f64) {
        let at = group(rows);
        if self.groups.len() <= at {
            self.groups.resize(at + 1, Group::default());
        }
        let keep = keep.powf(w);
        for g in &mut self.groups {
            g.weight *= keep;
            g.rows *= keep;
            g.ms *= keep;
        }
        let g = &mut self.groups[at];
        g.weight += w;
        g.rows += w * rows as f64;
        g.ms += w * ms;
    }

    /// The passes' weight in all (forgotten ones less).
    #[cfg(test)]
    pub(super) fn weight(&self) -> f64 {
        self.groups.iter().map(|g| g.weight).sum()
    }

    /// The pass time read off the measured row counts (before any is, the most seen one:
    /// the first report of a pass of eight calls weighs an eighth), or `None` before any
    /// pass.
    pub(super) fn time(&self) -> Option<PassTime> {
        let mut groups: Vec<&Group> = self
            .groups
            .iter()
            .filter(|g| g.weight >= MEASURED)
            .collect();
        if groups.is_empty() {
            let seen = self.groups.iter().filter(|g| g.weight > 0.0);
            groups.extend(seen.max_by(|a, b| a.weight.total_cmp(&b.weight)));
        }
        // (rows, ms, weight) of the measured groups, rows rising. More rows never take less
        // time: a mean below the one before it is noise, pooled with that one (weighted,
        // into one point) until the means rise.
        let mut points: Vec<(f64, f64, f64)> = Vec::new();
        for g in groups {
            let (mut rows, mut ms, mut weight) = (g.rows / g.weight, g.ms / g.weight, g.weight);
            while let Some(&(last_rows, last_ms, last_w)) = points.last() {
                if last_ms <= ms {
                    break;
                }
                points.pop();
                let total = weight + last_w;
                rows = (rows * weight + last_rows * last_w) / total;
                ms = (ms * weight + last_ms * last_w) / total;
                weight = total;
            }
            points.push((rows, ms, weight));
        }
        PassTime::through(points.iter().map(|&(r, m, _)| (r, m)).collect())
    }
}

/// The pass time at any row count.
#[derive(Debug, Clone, PartialEq)]
pub struct PassTime {
    /// Measured (rows, ms), rows rising.
    points: Vec<(f64, f64)>,
    /// Per-row slopes before the first point and past the last.
    below: f64,
    above: f64,
}

impl PassTime {
    /// `ms = a + b * rows` (synthetic costs).
    #[cfg(test)]
    pub fn line(a: f64, b: f64) -> PassTime {
        PassTime {
            points: vec![(1.0, a + b)],
            below: b,
            above: b,
        }
    }

    /// Through `points` (rows rising, times not falling). With one point the slope is not
    /// measured: it is taken as a sixth of the pass time per row, between a GPU's nearly
    /// free rows and a CPU's costly ones, until passes of other sizes say.
    fn through(points: Vec<(f64, f64)>) -> Option<PassTime> {
        let (&first, &last) = (points.first()?, points.last()?);
        let slope = |(r0, m0): (f64, f64), (r1, m1): (f64, f64)| (m1 - m0) / (r1 - r0);
        let (below, above) = match points.len() {
            1 => {
                let guess = first.1 / (6.0 + first.0);
                (guess, guess)
            }
            n => (slope(first, points[1]), slope(points[n - 2], last)),
        };
        Some(PassTime {
            points,
            below,
            above,
        })
    }

    /// The time of a pass of `rows` rows, ms.
    pub fn ms(&self, rows: f64) -> f64 {
        let (first, last) = (self.points[0], self.points[self.points.len() - 1]);
        if rows <= first.0 {
            return (first.1 - self.below * (first.0 - rows)).max(0.0);
        }
        if rows >= last.0 {
            return last.1 + self.above * (rows - last.0);
        }
        let i = self.points.partition_point(|p| p.0 <= rows);
        let ((r0, m0), (r1, m1)) = (self.points[i - 1], self.points[i]);
        m0 + (m1 - m0) * (rows - r0) / (r1 - r0)
    }

    /// What one more row adds to a pass of `rows` rows, ms.
    pub fn row_ms(&self, rows: f64) -> f64 {
        self.ms(rows + 1.0) - self.ms(rows)
    }
}
