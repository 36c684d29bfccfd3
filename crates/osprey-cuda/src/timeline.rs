//! A decode step's timeline, from kernels built with the probe of `tools/timeline_kernels.py`:
//! the first thread of every block records the global clock when the block starts (mark 0,
//! reserving a record for each mark: unused ones keep mark 0xFFFFFFFF and are skipped),
//! passes `griddepcontrol.wait` (mark 1), reaches the phases its source marks (`step_phase`, marks
//! 2 to 8) and ends (mark 9). Grouped into launches, the marks give each launch's real cost inside
//! the replayed graph: from the previous launch's last block out to its own, how long after that
//! its inputs were released, and when its blocks reached each phase.

use std::collections::HashMap;

/// Per-SM record slots and SMs covered (the probe's TIMELINE_PER_SM and TIMELINE_SMS).
pub(crate) const PER_SM: usize = 16384;
pub(crate) const SMS: usize = 256;
/// Symbols of the probe in an instrumented module.
pub(crate) const COUNTS_SYMBOL: &str = "timeline_counts";
pub(crate) const RECORDS_SYMBOL: &str = "timeline_records";

/// The probe's `TimelineRecord`, as the kernels store it.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub(crate) struct RawRecord {
    pub time_ns: u64,
    pub mark: u32,
    /// blockIdx.x | blockIdx.y << 16
    pub block: u32,
    /// gridDim.x | gridDim.y << 16
    pub grid: u32,
    pub sm: u32,
}

// SAFETY: plain old data, laid out as the kernels store it
unsafe impl cudarc::driver::DeviceRepr for RawRecord {}

/// One mark of one block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mark {
    /// The kernel family (`.cu` file) of the launch.
    pub module: &'static str,
    pub time_ns: u64,
    /// 0: the block started; 1: it passed the wait for its predecessor; 2-8: it reached a phase
    /// its kernel marks; 9: it ended.
    pub mark: u32,
    pub block: u32,
    pub grid: u32,
}

/// One launch of the step, its blocks' marks gathered (nanoseconds on the GPU's global clock).
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub module: &'static str,
    /// gridDim.x | gridDim.y << 16
    pub grid: u32,
    /// Every block's start (one per block; a launch is made at its first).
    pub starts: Vec<u64>,
    /// The first block past its wait: the predecessor had finished and flushed.
    pub release_ns: Option<u64>,
    pub last_end_ns: Option<u64>,
    /// Every block's phase marks (2-8): (mark, time).
    pub phases: Vec<(u32, u64)>,
}

/// When a launch's blocks reached one phase, in microseconds after its release (its first start
/// when it has none): the first block, the median block and the last.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseTime {
    pub mark: u32,
    pub first_us: f64,
    pub median_us: f64,
    pub last_us: f64,
}

impl Launch {
    /// Its blocks (each started once).
    pub fn blocks(&self) -> usize {
        self.starts.len()
    }

    /// When its first block started.
    pub fn first_start_ns(&self) -> u64 {
        self.starts.iter().copied().min().unwrap_or(0)
    }
}

/// How many of a launch's blocks started before `t_ns` (before its predecessor's last block
/// ended: landed beside that launch's blocks, under programmatic dependent launch).
pub fn started_before(l: &Launch, t_ns: u64) -> usize {
    l.starts.iter().filter(|&&t| t < t_ns).count()
}

/// Sorts `v` and returns its upper median (the middle element, or the upper of the two middle
/// ones); None when empty. Every median of the timeline is this one.
fn sort_for_median(v: &mut [f64]) -> Option<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied()
}

/// A launch's phases, in mark order.
pub fn phase_times(l: &Launch) -> Vec<PhaseTime> {
    let origin = l.release_ns.unwrap_or(l.first_start_ns()) as f64;
    let mut marks: Vec<u32> = l.phases.iter().map(|p| p.0).collect();
    marks.sort_unstable();
    marks.dedup();
    marks
        .into_iter()
        .filter_map(|mark| {
            let mut us: Vec<f64> = l
                .phases
                .iter()
                .filter(|p| p.0 == mark)
                .map(|p| (p.1 as f64 - origin) / 1e3)
                .collect();
            let median_us = sort_for_median(&mut us)?;
            Some(PhaseTime {
                mark,
                first_us: us[0],
                median_us,
                last_us: *us.last()?,
            })
        })
        .collect()
}

/// One start of a block index: whether its release (mark 1) and its end (mark 9) have been seen.
type BlockRun = [bool; 2];

/// Groups marks into launches, in the order they started. A block's n-th start in a (module,
/// grid) belongs to that kind's n-th launch (launches of one kind start in order), and its
/// release and end marks to its earliest start still without one (with programmatic launch the
/// next launch's block of the same index may start before this one ends).
pub fn launches(marks: &[Mark]) -> Vec<Launch> {
    let mut sorted: Vec<&Mark> = marks.iter().collect();
    sorted.sort_by_key(|m| m.time_ns);
    // per (module, grid, block): its starts so far
    let mut starts: HashMap<(&str, u32, u32), Vec<BlockRun>> = HashMap::new();
    let mut by_launch: HashMap<(&'static str, u32, usize), Launch> = HashMap::new();
    for m in sorted {
        let mine = starts.entry((m.module, m.grid, m.block)).or_default();
        let n = match m.mark {
            0 => {
                mine.push(BlockRun::default());
                mine.len() - 1
            }
            1 | 9 => {
                let seen = usize::from(m.mark == 9);
                match mine.iter().position(|r| !r[seen]) {
                    Some(i) => {
                        mine[i][seen] = true;
                        i
                    }
                    None => continue,
                }
            }
            // a phase belongs to the block's earliest start that has not ended
            2..=8 => match mine.iter().position(|r| !r[1]) {
                Some(i) => i,
                None => continue,
            },
            _ => continue,
        };
        let l = by_launch
            .entry((m.module, m.grid, n))
            .or_insert_with(|| Launch {
                module: m.module,
                grid: m.grid,
                starts: Vec::new(),
                release_ns: None,
                last_end_ns: None,
                phases: Vec::new(),
            });
        match m.mark {
            0 => l.starts.push(m.time_ns),
            1 => l.release_ns = Some(l.release_ns.map_or(m.time_ns, |t| t.min(m.time_ns))),
            9 => l.last_end_ns = Some(l.last_end_ns.map_or(m.time_ns, |t| t.max(m.time_ns))),
            _ => l.phases.push((m.mark, m.time_ns)),
        }
    }
    let mut out: Vec<Launch> = by_launch.into_values().collect();
    // (the first start is a minimum over the launch's blocks: taken once per launch)
    out.sort_by_cached_key(|l| l.first_start_ns());
    out
}

/// A kernel family's share of the step: the sum over its launches of (its last block out - the
/// previous launch's last block out), and the median of (its release - the previous launch's
/// last block out): what handing over to it cost.
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyTime {
    pub kernel: String,
    pub launches: usize,
    pub micros: f64,
    pub median_release_after_predecessor_us: Option<f64>,
}

/// Each launch's family name: `names` (the step's launches in issue order) when there are as
/// many, else "module/grid".
pub fn launch_names(launches: &[Launch], names: &[&str]) -> Vec<String> {
    if names.len() == launches.len() {
        names.iter().map(|n| n.to_string()).collect()
    } else {
        launches
            .iter()
            .map(|l| format!("{}/{}", l.module, l.grid))
            .collect()
    }
}

/// One phase of a kernel family: over its launches, the median of each launch's first, median
/// and last block (microseconds after the launch's release, as `phase_times`).
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyPhase {
    pub kernel: String,
    pub mark: u32,
    pub first_block_us: f64,
    pub median_block_us: f64,
    pub last_block_us: f64,
}

/// `phase_times` of every launch (in launch order), gathered by family (named as `launch_names`
/// names them) and phase mark, in the order they first appear.
pub fn family_phases(launches: &[Launch], names: &[&str]) -> Vec<FamilyPhase> {
    // (kernel, mark, [first, median, last] of each launch)
    let mut gathered: Vec<(String, u32, [Vec<f64>; 3])> = Vec::new();
    for (l, kernel) in launches.iter().zip(launch_names(launches, names)) {
        for p in phase_times(l) {
            let at = match gathered.iter().position(|f| f.0 == kernel && f.1 == p.mark) {
                Some(i) => i,
                None => {
                    gathered.push((kernel.clone(), p.mark, Default::default()));
                    gathered.len() - 1
                }
            };
            let times = &mut gathered[at].2;
            times[0].push(p.first_us);
            times[1].push(p.median_us);
            times[2].push(p.last_us);
        }
    }
    gathered
        .into_iter()
        .filter_map(|(kernel, mark, [mut first, mut med, mut last])| {
            Some(FamilyPhase {
                kernel,
                mark,
                first_block_us: sort_for_median(&mut first)?,
                median_block_us: sort_for_median(&mut med)?,
                last_block_us: sort_for_median(&mut last)?,
            })
        })
        .collect()
}

/// Sums launches by family, named as `launch_names` names them.
pub fn family_times(launches: &[Launch], names: &[&str]) -> Vec<FamilyTime> {
    let mut out: Vec<FamilyTime> = Vec::new();
    let mut releases: Vec<Vec<f64>> = Vec::new();
    let mut prev_end: Option<u64> = None;
    for (l, kernel) in launches.iter().zip(launch_names(launches, names)) {
        let Some(end) = l.last_end_ns else { continue };
        let start = prev_end.unwrap_or(l.first_start_ns());
        let slot = match out.iter().position(|f| f.kernel == kernel) {
            Some(s) => s,
            None => {
                out.push(FamilyTime {
                    kernel,
                    launches: 0,
                    micros: 0.0,
                    median_release_after_predecessor_us: None,
                });
                releases.push(Vec::new());
                out.len() - 1
            }
        };
        out[slot].launches += 1;
        out[slot].micros += end.saturating_sub(start) as f64 / 1e3;
        if let (Some(r), Some(p)) = (l.release_ns, prev_end) {
            releases[slot].push((r as f64 - p as f64) / 1e3);
        }
        prev_end = Some(end);
    }
    for (f, mut r) in out.iter_mut().zip(releases) {
        f.median_release_after_predecessor_us = sort_for_median(&mut r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(module: &'static str, time_ns: u64, mark: u32, block: u32, grid: u32) -> Mark {
        Mark {
            module,
            time_ns,
            mark,
            block,
            grid,
        }
    }

    #[test]
    fn record_layout_matches_the_probe() {
        // unsigned long long + four unsigned ints (tools/timeline_kernels.py)
        assert_eq!(std::mem::size_of::<RawRecord>(), 24);
    }

    #[test]
    fn consecutive_launches_of_one_kind_stay_apart_and_families_sum_exit_to_exit() {
        // two launches of gemv/2 back to back, then one of moe/1; marks arrive out of order
        let marks = vec![
            mark("gemv", 100, 0, 0, 2),
            mark("gemv", 105, 0, 1, 2),
            mark("gemv", 110, 1, 1, 2),
            mark("gemv", 112, 1, 0, 2),
            mark("gemv", 300, 9, 0, 2),
            mark("gemv", 310, 9, 1, 2),
            mark("gemv", 250, 0, 0, 2), // block 0's second start, before the first launch ended
            mark("gemv", 320, 0, 1, 2),
            mark("gemv", 330, 1, 0, 2),
            mark("gemv", 331, 1, 1, 2),
            mark("gemv", 600, 9, 0, 2),
            mark("gemv", 650, 9, 1, 2),
            mark("moe", 640, 0, 0, 1),
            mark("moe", 700, 1, 0, 1),
            mark("moe", 1650, 9, 0, 1),
            // phases: block 0's first run (not yet ended at 200), block 1's second run
            mark("gemv", 200, 2, 0, 2),
            mark("gemv", 400, 2, 1, 2),
            mark("moe", 1200, 3, 0, 1),
        ];
        let l = launches(&marks);
        assert_eq!(l.len(), 3);
        let times = |l: &Launch| (l.blocks(), l.first_start_ns(), l.release_ns, l.last_end_ns);
        assert_eq!(times(&l[0]), (2, 100, Some(110), Some(310)));
        assert_eq!(times(&l[1]), (2, 250, Some(330), Some(650)));
        assert_eq!(
            (l[2].module, l[2].release_ns, l[2].last_end_ns),
            ("moe", Some(700), Some(1650))
        );

        // the second gemv launch's block 0 started at 250, before the first launch ended (310),
        // its block 1 at 320; the moe block at 640, before the second ended (650)
        assert_eq!(started_before(&l[1], 310), 1);
        assert_eq!(started_before(&l[2], 650), 1);
        assert_eq!(started_before(&l[2], 600), 0);

        assert_eq!(l[0].phases, vec![(2, 200)]);
        assert_eq!(l[1].phases, vec![(2, 400)]);
        assert_eq!(
            phase_times(&l[2]),
            vec![PhaseTime {
                mark: 3,
                first_us: 0.5,
                median_us: 0.5,
                last_us: 0.5
            }]
        );

        let named = family_times(&l, &["in_proj", "in_proj", "experts"]);
        assert_eq!(named.len(), 2);
        assert_eq!(
            (named[0].kernel.as_str(), named[0].launches),
            ("in_proj", 2)
        );
        // (310 - 100) + (650 - 310) ns
        assert!((named[0].micros - 0.55).abs() < 1e-9);
        assert_eq!(named[0].median_release_after_predecessor_us, Some(0.02));
        assert!((named[1].micros - 1.0).abs() < 1e-9);
        assert_eq!(named[1].median_release_after_predecessor_us, Some(0.05));

        // phases by family: the in_proj launches at 0.09 and 0.07 us after release (median: the upper)
        let phases = family_phases(&l, &["in_proj", "in_proj", "experts"]);
        assert_eq!(phases.len(), 2);
        assert_eq!((phases[0].kernel.as_str(), phases[0].mark), ("in_proj", 2));
        assert!((phases[0].median_block_us - 0.09).abs() < 1e-9);
        assert_eq!((phases[1].kernel.as_str(), phases[1].mark), ("experts", 3));
        assert!((phases[1].last_block_us - 0.5).abs() < 1e-9);

        let unnamed = family_times(&l, &["too", "few"]);
        assert_eq!(unnamed[0].kernel, "gemv/2");
        assert_eq!(unnamed[1].kernel, "moe/1");
    }

    #[test]
    fn a_phase_reports_its_first_median_and_last_block() {
        // one launch of three blocks, released at 1000 ns; they reach phase 4 at 1300, 1800, 3100
        let mut marks = Vec::new();
        for b in 0..3 {
            marks.push(mark("moe", 900 + b as u64, 0, b, 3));
            marks.push(mark("moe", 1000, 1, b, 3));
            marks.push(mark("moe", 4000, 9, b, 3));
        }
        marks.push(mark("moe", 1800, 4, 0, 3));
        marks.push(mark("moe", 3100, 4, 1, 3));
        marks.push(mark("moe", 1300, 4, 2, 3));
        let l = launches(&marks);
        assert_eq!(l.len(), 1);
        let p = &phase_times(&l[0])[0];
        assert_eq!(p.mark, 4);
        assert!((p.first_us - 0.3).abs() < 1e-9);
        assert!((p.median_us - 0.8).abs() < 1e-9);
        assert!((p.last_us - 2.1).abs() < 1e-9);
        let f = &family_phases(&l, &["experts"])[0];
        assert!((f.first_block_us - 0.3).abs() < 1e-9 && (f.median_block_us - 0.8).abs() < 1e-9);
        assert!((f.last_block_us - 2.1).abs() < 1e-9);
    }
}
