//! `contended --processes P --ring`: the floor of a fair hand-off between
//! processes through one Redis server, for the 8 × 1 lines.
//!
//! The processes pass one token around a ring of Redis lists: each waits in
//! `BLPOP` on its own list, runs the critical section, and `LPUSH`es the
//! token on to the next one's list. A hand-off is then one command to the
//! server and one answer to the next process, which the server sends the
//! moment the command runs: a lock that serves processes in turn through
//! one server sends at least that per hand-off, so its rate here, through
//! the same client, runtime and section log, is the reference for such a
//! lock. Nothing here can hand the token to two processes, and the section
//! log checks that it does not.

use super::*;
use crate::contended::{Run, WARM_UP};

/// Where this process sits in the ring: its index, the ring's size, and a
/// name the lists share (the parent's process id).
#[derive(Clone, Copy, Debug)]
pub(super) struct Place {
    index: usize,
    of: usize,
    ring: u32,
}

impl Place {
    pub(super) fn new(index: usize, of: usize) -> Place {
        Place {
            index,
            of,
            ring: std::process::id(),
        }
    }

    /// As `--ring-place` passes it: `index,of,ring`.
    pub(super) fn parse(text: &str) -> Result<Place, String> {
        let bad = || format!("--ring-place: {text:?} is not index,of,ring");
        let mut parts = text.split(',').map(|p| p.parse::<u64>().map_err(|_| bad()));
        let (index, of, ring) = (
            parts.next().ok_or_else(bad)??,
            parts.next().ok_or_else(bad)??,
            parts.next().ok_or_else(bad)??,
        );
        if index >= of || parts.next().is_some() {
            return Err(bad());
        }
        Ok(Place {
            index: index as usize,
            of: of as usize,
            ring: ring as u32,
        })
    }

    pub(super) fn arg(&self) -> String {
        format!("{},{},{}", self.index, self.of, self.ring)
    }

    fn list(&self, index: usize) -> String {
        format!("bench:ring:{}:{index}", self.ring)
    }
}

/// How long a `BLPOP` waits before the process looks at the clock.
const POLL: f64 = 0.1;

/// One process of the ring: takes the token as often as it comes round
/// for `secs` seconds after the warm-up, with `how`'s critical section.
pub(super) async fn run(url: &str, place: Place, secs: u64, how: &How) -> Result<Run, String> {
    // A redis:// URL: `parse_args` refuses `--ring` with any other.
    let url = url.split('?').next().unwrap_or(url);
    let fail = |e: redis::RedisError| format!("ring: {e}");
    let mut conn = redis::Client::open(url)
        .map_err(fail)?
        .get_multiplexed_async_connection()
        .await
        .map_err(fail)?;
    let (own, next) = (
        place.list(place.index),
        place.list((place.index + 1) % place.of),
    );
    if place.index == 0 {
        // One token, whatever an earlier run of the same parent id left.
        let mut start = redis::pipe();
        start.atomic().cmd("DEL");
        for index in 0..place.of {
            start.arg(place.list(index));
        }
        start.ignore().cmd("LPUSH").arg(&own).arg(1u64).ignore();
        let () = start.query_async(&mut conn).await.map_err(fail)?;
    }
    let (inside, overlaps) = (AtomicUsize::new(0), AtomicU64::new(0));
    let counting = Instant::now() + WARM_UP;
    let stop = counting + Duration::from_secs(secs);
    let mut waits = Vec::with_capacity(1 << 16);
    let mut cycles = 0;
    let mut last = stop;
    // When the wait for the token began, across `BLPOP`s that timed out.
    let mut waiting = None;
    loop {
        let now = Instant::now();
        if now >= stop {
            break;
        }
        let t = *waiting.get_or_insert(now);
        let got: Option<(String, u64)> = redis::cmd("BLPOP")
            .arg(&own)
            .arg(POLL)
            .query_async(&mut conn)
            .await
            .map_err(fail)?;
        let Some((_, token)) = got else { continue };
        waiting = None;
        let waited = t.elapsed();
        how.section(&inside, &overlaps, token).await;
        let _: u64 = redis::cmd("LPUSH")
            .arg(&next)
            .arg(token + 1)
            .query_async(&mut conn)
            .await
            .map_err(fail)?;
        if t >= counting {
            waits.push(waited);
            cycles += 1;
            last = last.max(Instant::now());
        }
    }
    // The processes started (so stop) up to some milliseconds apart; once
    // the last one stops the token rests in some list, deleted by its
    // owner after this pause.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _: u64 = redis::cmd("DEL")
        .arg(&own)
        .query_async(&mut conn)
        .await
        .map_err(fail)?;
    Ok(Run {
        cycles,
        // To the stop, or to the end of the last cycle begun before it.
        elapsed: last.saturating_duration_since(counting),
        waits,
        per_worker_min: cycles,
        per_worker_max: cycles,
        overlaps: overlaps.load(Ordering::SeqCst),
    })
}
