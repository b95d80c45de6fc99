//! The history of a run and the checker over it.
//!
//! Times are nanoseconds of CLOCK_MONOTONIC, one clock shared by every
//! process on the machine, so that events from the harness and from every
//! client process can be compared directly.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

pub use crate::mode::Mode;

pub use tower_lock_servers::now_ns;

/// What a client reports, one line each: `G hold key token t asked mode`, `T hold t`,
/// `X hold t`, `W hold ok|stale|skip t`, `F t` (a failed acquisition),
/// `K t` (a hand-off kept back: the lease not surely fresh).
#[derive(Debug, Clone)]
pub enum Event {
    Granted {
        hold: String,
        key: String,
        token: u64,
        at: u64,
        /// When the acquisition began: any grant seen before it was made
        /// before this one, on every server.
        asked: u64,
        mode: Mode,
    },
    ToldLost {
        hold: String,
        at: u64,
    },
    Released {
        hold: String,
        at: u64,
    },
    /// The critical section's last act (its write, or the decision to
    /// skip it), and when it began (the write sent).
    Wrote {
        hold: String,
        outcome: String,
        at: u64,
    },
    Failed,
    /// A client's cohort kept a lock from its next local waiter because its
    /// lease was no longer surely fresh (past half its validity).
    KeptBack {
        at: u64,
    },
}

impl Event {
    pub fn line(&self) -> String {
        match self {
            Event::Granted {
                hold,
                key,
                token,
                at,
                asked,
                mode,
            } => format!("G {hold} {key} {token} {at} {asked} {}", mode.tag()),
            Event::ToldLost { hold, at } => format!("T {hold} {at}"),
            Event::Released { hold, at } => format!("X {hold} {at}"),
            Event::Wrote { hold, outcome, at } => format!("W {hold} {outcome} {at}"),
            Event::Failed => "F".into(),
            Event::KeptBack { at } => format!("K {at}"),
        }
    }

    pub fn parse(line: &str) -> Option<Event> {
        let f: Vec<&str> = line.split(' ').collect();
        Some(match f.as_slice() {
            ["G", hold, key, token, at, asked, mode] => Event::Granted {
                hold: hold.to_string(),
                key: key.to_string(),
                token: token.parse().ok()?,
                at: at.parse().ok()?,
                asked: asked.parse().ok()?,
                mode: Mode::parse(mode)?,
            },
            ["T", hold, at] => Event::ToldLost {
                hold: hold.to_string(),
                at: at.parse().ok()?,
            },
            ["X", hold, at] => Event::Released {
                hold: hold.to_string(),
                at: at.parse().ok()?,
            },
            ["W", hold, outcome, at] => Event::Wrote {
                hold: hold.to_string(),
                outcome: outcome.to_string(),
                at: at.parse().ok()?,
            },
            ["F"] => Event::Failed,
            ["K", at] => Event::KeptBack {
                at: at.parse().ok()?,
            },
            _ => return None,
        })
    }
}

/// What the harness did to a client process, for the checker.
#[derive(Debug, Clone, Copy)]
pub enum ProcessFault {
    /// SIGSTOP at the first time, SIGCONT at the second.
    Paused(u64, u64),
    /// SIGKILL sent at the first time; the process was reaped (dead) by
    /// the second.
    Killed { sent: u64, reaped: u64 },
}

#[derive(Debug, Default)]
struct Hold {
    key: String,
    token: u64,
    mode: Mode,
    process: String,
    /// When the acquisition began.
    asked: u64,
    granted: u64,
    told: Option<u64>,
    released: Option<u64>,
    /// When its critical section's last act was done.
    wrote: Option<u64>,
}

/// A fault's window: its name, when it may have had an effect, and the
/// processes whose links it hit (`None`: the servers, so everyone).
#[derive(Debug)]
struct Window {
    name: &'static str,
    start: u64,
    end: u64,
    hit: Option<Vec<String>>,
}

/// The whole history: events from every client, and the faults done to them.
#[derive(Default)]
pub struct History {
    holds: HashMap<String, Hold>,
    faults: HashMap<String, Vec<ProcessFault>>,
    /// Every fault the nemesis injected: its name and the window in which
    /// it may have had an effect.
    windows: Vec<Window>,
    pub failed_acquisitions: u64,
    pub writes_skipped: u64,
    /// Hand-offs a cohort refused because the lease was not surely fresh.
    pub kept_back: u64,
}

impl History {
    /// Every hold in grant order, and the fault windows, one per line
    /// (times in ms from the first grant): kept beside the logs of a run
    /// that broke a guarantee.
    pub fn dump(&self) -> String {
        let mut holds: Vec<_> = self.holds.iter().collect();
        holds.sort_by_key(|(_, h)| h.granted);
        let zero = holds.first().map_or(0, |(_, h)| h.granted);
        let ms = |t: Option<u64>| {
            t.map_or("-".into(), |t| {
                format!("{:.1}", (t as f64 - zero as f64) / 1e6)
            })
        };
        let mut out = String::from("hold key token granted told wrote released\n");
        for (id, h) in holds {
            out += &format!(
                "{id} {} {} {} {} {} {}\n",
                h.key,
                h.token,
                ms(Some(h.granted)),
                ms(h.told),
                ms(h.wrote),
                ms(h.released)
            );
        }
        for w in &self.windows {
            let hit = w
                .hit
                .as_ref()
                .map_or("every process".into(), |ids| ids.join(","));
            out += &format!(
                "fault {} {} {} {hit}\n",
                w.name,
                ms(Some(w.start)),
                ms(Some(w.end))
            );
        }
        for (process, faults) in &self.faults {
            out += &format!("process {process} {faults:?}\n");
        }
        out
    }
}

/// What the checker found.
#[derive(Debug, Default)]
pub struct Verdict {
    pub holds: u64,
    pub told_lost: u64,
    /// Holds of one key that overlapped while neither holder had been told.
    pub overlaps_unwarned: u64,
    /// Overlaps excused because the earlier holder was paused by the harness
    /// and told as soon as it ran again.
    pub overlaps_paused: u64,
    /// Overlaps while a fault the backend documents as outside its
    /// guarantees was in effect (an emptied Redis without quarantine, a
    /// stepped Redlock clock).
    pub overlaps_outside: u64,
    /// The smallest time from a holder being told lost to the next grant of
    /// its key, in ms (negative: told after); `None` when no one was told.
    pub worst_margin_ms: Option<f64>,
    /// The longest a paused holder ran before being told, in ms.
    pub told_after_resume_ms: Option<f64>,
    /// The longest from a holder's process being killed to the next grant of
    /// its key, in ms: how long a crashed replica blocks its keys.
    pub kill_recovery_ms: Option<f64>,
    /// Grants whose fencing token is not above that of a grant of the same
    /// key seen before they were asked for (so made before them).
    pub tokens_backwards: u64,
    /// The same while a fault the backend documents as outside its
    /// guarantees was in effect (a replaced Redis master still serving: its
    /// tokens are below the new master's, and fencing refuses them).
    pub tokens_backwards_outside: u64,
    /// Holds by mode (`Mode::tag`): which modes the run exercised.
    pub by_mode: BTreeMap<String, u64>,
    pub examples: Vec<String>,
    /// Examples of tokens going backwards, apart so as not to crowd out
    /// the overlaps'.
    pub token_examples: Vec<String>,
}

impl History {
    /// Adds one event reported by `process` (a client's id).
    pub fn record(&mut self, process: &str, event: Event) {
        match event {
            Event::Granted {
                hold,
                key,
                token,
                at,
                asked,
                mode,
            } => {
                self.holds.insert(
                    hold,
                    Hold {
                        key,
                        token,
                        mode,
                        process: process.to_owned(),
                        asked,
                        granted: at,
                        ..Hold::default()
                    },
                );
            }
            Event::ToldLost { hold, at } => {
                if let Some(h) = self.holds.get_mut(&hold) {
                    h.told = Some(h.told.map_or(at, |t| t.min(at)));
                }
            }
            Event::Released { hold, at } => {
                if let Some(h) = self.holds.get_mut(&hold) {
                    h.released = Some(at);
                }
            }
            Event::Wrote { hold, outcome, at } => {
                if outcome == "skip" {
                    self.writes_skipped += 1;
                }
                if let Some(h) = self.holds.get_mut(&hold) {
                    h.wrote = Some(at);
                }
            }
            Event::Failed => self.failed_acquisitions += 1,
            Event::KeptBack { .. } => self.kept_back += 1,
        }
    }

    /// Records that fault `name` was injected from `start` to `end`. Its
    /// effect may outlast it by a lease (a lock an emptied server forgot is
    /// noticed at the holder's next renewal; a stepped clock expires keys a
    /// lease early), so the window runs until `end + lease`.
    pub fn fault_window(&mut self, name: &'static str, start: u64, end: u64, lease: u64) {
        self.windows.push(Window {
            name,
            start,
            end: end + lease,
            hit: None,
        });
    }

    /// The same for a fault done to the links of the processes `hit` only
    /// (a partition, a dropped connection): it excuses nothing of the
    /// others, and no token going backwards.
    pub fn link_fault_window(
        &mut self,
        name: &'static str,
        start: u64,
        end: u64,
        lease: u64,
        hit: Vec<String>,
    ) {
        self.windows.push(Window {
            name,
            start,
            end: end + lease,
            hit: Some(hit),
        });
    }

    /// The processes with a hold in its critical section now: granted,
    /// its last act not yet done, not released.
    pub fn in_critical_section(&self) -> Vec<String> {
        let mut processes: Vec<String> = self
            .holds
            .values()
            .filter(|h| h.wrote.is_none() && h.released.is_none())
            .map(|h| h.process.clone())
            .collect();
        processes.sort();
        processes.dedup();
        processes
    }

    pub fn process_fault(&mut self, process: &str, fault: ProcessFault) {
        self.faults
            .entry(process.to_owned())
            .or_default()
            .push(fault);
    }

    /// When a hold stopped acting on its lock, as far as the checker can
    /// tell (told lost, released, or its process killed), and from when on
    /// a pause excuses an overlap with it: the earliest stop after which it
    /// did nothing before being told. A grant made before that stop, while
    /// both ran, is never excused by it; an unexcused pause excuses nothing.
    fn end(&self, h: &Hold, verdict: &mut Verdict) -> (u64, Option<u64>) {
        let mut end = u64::MAX;
        for t in [h.told, h.released].into_iter().flatten() {
            end = end.min(t);
        }
        if let Some(died) = self.killed_holding(h) {
            end = end.min(died);
        }
        let faults = self.faults.get(&h.process).into_iter().flatten();
        let mut excused_from: Option<u64> = None;
        for fault in faults {
            // Stopped while holding: it could not act until continued.
            // Excused if, once running again, it was told before it did
            // anything (how soon is reported), or it had done its
            // section's last act before it was stopped and only released
            // after.
            let ProcessFault::Paused(stop, cont) = *fault else {
                continue;
            };
            if stop < h.granted || stop >= end {
                continue;
            }
            let told_first = h
                .told
                .filter(|&t| t >= cont && h.wrote.is_none_or(|w| w < stop || t <= w));
            if let Some(told) = told_first {
                let after = (told - cont) as f64 / 1e6;
                verdict.told_after_resume_ms =
                    Some(verdict.told_after_resume_ms.map_or(after, |m| m.max(after)));
            }
            if told_first.is_some() || h.wrote.is_some_and(|w| w < stop) {
                excused_from = Some(excused_from.map_or(stop, |e| e.min(stop)));
            }
        }
        (end, excused_from)
    }

    /// When `h`'s process died holding `h`, if it did: it ran no code once
    /// SIGKILL was sent, except as far as its own lines show (a grant or a
    /// write dated after the signal went out), and was dead when reaped.
    /// Dating the death at the reaping would count as overlaps the grants
    /// that backends freeing a dead client's locks at once (PostgreSQL,
    /// MariaDB) make in between.
    fn killed_holding(&self, h: &Hold) -> Option<u64> {
        self.faults.get(&h.process)?.iter().find_map(|f| match *f {
            ProcessFault::Killed { sent, reaped }
                if h.granted <= reaped && h.released.is_none_or(|r| r > sent) =>
            {
                Some(sent.max(h.granted).max(h.wrote.unwrap_or(0)))
            }
            _ => None,
        })
    }

    /// Checks the history; an overlap during a fault named in `outside` is
    /// counted apart, as one the backend does not promise to prevent.
    pub fn check(&self, outside: &[&str]) -> Verdict {
        let mut verdict = Verdict {
            holds: self.holds.len() as u64,
            told_lost: self.holds.values().filter(|h| h.told.is_some()).count() as u64,
            ..Verdict::default()
        };
        for h in self.holds.values() {
            *verdict.by_mode.entry(h.mode.tag()).or_default() += 1;
        }
        let mut by_key: HashMap<&str, Vec<(&str, &Hold)>> = HashMap::new();
        for (id, h) in &self.holds {
            by_key.entry(&h.key).or_default().push((id, h));
        }
        for holds in by_key.values_mut() {
            self.tokens_backwards(holds, outside, &mut verdict);
            holds.sort_by_key(|(_, h)| h.granted);
            // The holds still reaching past the grant at hand, with their
            // ends, the stop from which a pause excuses each, and modes.
            let mut active: Vec<(&str, u64, Option<u64>, Mode)> = Vec::new();
            for (i, (id, h)) in holds.iter().enumerate() {
                active.retain(|&(_, end, _, _)| end > h.granted);
                // The holds it may not overlap, and how many of them it
                // may overlap all the same: none of those its mode
                // excludes; of a semaphore's holders, one fewer than its
                // permits. Each is excused by a pause, by a fault outside
                // the guarantees, or by neither: an excused holder frees
                // its place, and the overlap is unwarned when those
                // excused by neither are still too many. (The holder
                // reaching furthest is not the one to judge by: a paused
                // semaphore holder beside one that still holds makes one
                // holder too many, and a paused reader hides nothing of
                // a reader that ran.)
                let (conflicting, room): (Vec<_>, usize) = match h.mode.permits() {
                    Some(permits) => (active.iter().collect(), permits.saturating_sub(1) as usize),
                    None => (active.iter().filter(|a| a.3.excludes(h.mode)).collect(), 0),
                };
                if conflicting.len() > room {
                    let mut unexcused: Vec<(&str, u64)> = Vec::new();
                    let mut outside_only = 0;
                    for &&(before, end, excused_from, _) in &conflicting {
                        let b = &self.holds[before];
                        if excused_from.is_some_and(|stop| h.granted >= stop) {
                            continue;
                        }
                        if self.outside_between(outside, b.granted, h.granted, Some(&b.process)) {
                            outside_only += 1;
                        } else {
                            unexcused.push((before, end));
                        }
                    }
                    if unexcused.len() + outside_only <= room {
                        verdict.overlaps_paused += 1;
                    } else if unexcused.len() <= room {
                        verdict.overlaps_outside += 1;
                    } else {
                        verdict.overlaps_unwarned += 1;
                        if verdict.examples.len() < 5 {
                            let (before, _) = *unexcused
                                .iter()
                                .max_by_key(|u| u.1)
                                .expect("more unexcused holds than room");
                            let b = &self.holds[before];
                            let ms = |t: Option<u64>| {
                                t.map_or("never".into(), |t| {
                                    format!("{:+.1} ms", (t as f64 - h.granted as f64) / 1e6)
                                })
                            };
                            verdict.examples.push(format!(
                                "key {}: {id} (token {}) granted while {before} (token {}, granted {}) \
                                 still acted; {before} told {}, released {}; its process's faults: {:?}",
                                h.key,
                                h.token,
                                b.token,
                                ms(Some(b.granted)),
                                ms(b.told),
                                ms(b.released),
                                self.faults.get(&b.process).map(|f| f
                                    .iter()
                                    .map(|f| match *f {
                                        ProcessFault::Paused(s, c) => format!("paused {} to {}", ms(Some(s)), ms(Some(c))),
                                        ProcessFault::Killed { sent, .. } => format!("killed {}", ms(Some(sent))),
                                    })
                                    .collect::<Vec<_>>()),
                            ));
                        }
                    }
                }
                // The margin of every earlier hold told lost before this
                // grant, where the two exclude each other.
                if let Some((_, prev)) = i
                    .checked_sub(1)
                    .map(|p| holds[p])
                    .filter(|(_, p)| p.mode.permits().is_none() && p.mode.excludes(h.mode))
                {
                    let excused = self
                        .end(prev, &mut Verdict::default())
                        .1
                        .is_some_and(|stop| h.granted >= stop);
                    // Margins measure what the backend promises.
                    let excused = excused
                        || self.outside_between(
                            outside,
                            prev.granted,
                            h.granted,
                            Some(&prev.process),
                        );
                    if let Some(told) = prev.told.filter(|_| !excused).filter(|_| {
                        prev.released
                            .is_none_or(|r| prev.told.is_some_and(|t| t <= r))
                    }) {
                        let margin = (h.granted as f64 - told as f64) / 1e6;
                        verdict.worst_margin_ms =
                            Some(verdict.worst_margin_ms.map_or(margin, |m| m.min(margin)));
                    }
                }
                if let Some(killed) = self.killed_holding(h) {
                    if let Some((_, next)) = holds[i + 1..].iter().find(|(_, n)| n.granted > killed)
                    {
                        let took = (next.granted - killed) as f64 / 1e6;
                        verdict.kill_recovery_ms =
                            Some(verdict.kill_recovery_ms.map_or(took, |m| m.max(took)));
                    }
                }
                let (end, excused_from) = self.end(h, &mut verdict);
                active.push((id, end, excused_from, h.mode));
            }
        }
        verdict
    }

    /// Whether a fault named in `outside` was in effect (its window, which
    /// runs a lease past its end) at some time between `from` and `to`, and
    /// touched `holder`'s process: a fault on some processes' links touches
    /// only them, and with no holder named (tokens) only a fault on the
    /// servers counts.
    fn outside_between(&self, outside: &[&str], from: u64, to: u64, holder: Option<&str>) -> bool {
        self.windows.iter().any(|w| {
            outside.contains(&w.name)
                && w.start <= to
                && w.end >= from
                && match &w.hit {
                    None => true,
                    Some(hit) => holder.is_some_and(|p| hit.iter().any(|h| h == p)),
                }
        })
    }

    /// Counts in `verdict` the holds of one key whose token is not above
    /// every token granted before they were asked for. A grant seen before
    /// another was asked for was made before it on the servers, whatever the
    /// network did to the answers; tokens must rise in that order. Counted
    /// apart when a fault named in `outside` was in effect between the two
    /// grants.
    fn tokens_backwards(
        &self,
        holds: &mut [(&str, &Hold)],
        outside: &[&str],
        verdict: &mut Verdict,
    ) {
        holds.sort_by_key(|(_, h)| h.asked);
        let mut by_grant: Vec<&(&str, &Hold)> = holds.iter().collect();
        by_grant.sort_by_key(|(_, h)| h.granted);
        let mut seen = by_grant.iter().peekable();
        // The highest token among the grants seen so far, and its hold.
        let mut highest: Option<(&str, &Hold)> = None;
        for (id, h) in holds.iter() {
            while let Some((before, b)) = seen.next_if(|(_, b)| b.granted < h.asked) {
                if highest.is_none_or(|(_, top)| b.token > top.token) {
                    highest = Some((before, b));
                }
            }
            let Some((before, top)) = highest.filter(|(_, top)| h.token <= top.token) else {
                continue;
            };
            if self.outside_between(outside, top.granted, h.granted, None) {
                verdict.tokens_backwards_outside += 1;
                continue;
            }
            verdict.tokens_backwards += 1;
            if verdict.token_examples.len() < 5 {
                verdict.token_examples.push(format!(
                    "key {}: {id} was granted token {} though {before} had been granted token {} \
                     before {id} asked",
                    h.key, h.token, top.token
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests;
