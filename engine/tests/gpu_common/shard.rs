//! `MEMRA_TEST_SHARD=i/n` splits one long GPU test over n processes, so that a slow tool
//! (compute-sanitizer's racecheck runs some tests for many minutes) can spread it over GPUs:
//! the test asks `mine()` before each independent case, and a shard runs every n-th case from
//! the i-th. Together the n shards run every case exactly once; unset, every case runs. The
//! count is per process, so a sharded run holds one test (`--exact`, as scripts/gpu-sanitize
//! --shards does).
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT_CASE: AtomicUsize = AtomicUsize::new(0);

/// Whether this process runs the next case (and counts it).
pub fn mine() -> bool {
    match shard() {
        None => true,
        Some((i, n)) => NEXT_CASE.fetch_add(1, Ordering::Relaxed) % n == i,
    }
}

fn shard() -> Option<(usize, usize)> {
    let v = std::env::var("MEMRA_TEST_SHARD").ok()?;
    let parse = |s: &str| s.trim().parse::<usize>().ok();
    match v.split_once('/').map(|(i, n)| (parse(i), parse(n))) {
        Some((Some(i), Some(n))) if i < n => Some((i, n)),
        _ => panic!("MEMRA_TEST_SHARD={v:?}: expected i/n with 0 <= i < n"),
    }
}
