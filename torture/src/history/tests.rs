//! The checker on hand-made histories: every verdict, every excuse, and
//! the cases that must not be excused. Times are in ms for reading.
use super::*;

const MS: u64 = 1_000_000;

struct Make(History, Mode);

impl Make {
    fn new() -> Self {
        Make(History::default(), Mode::Exclusive)
    }
    fn grant(
        mut self,
        process: &str,
        hold: &str,
        key: &str,
        token: u64,
        asked: u64,
        at: u64,
    ) -> Self {
        self.0.record(
            process,
            Event::Granted {
                hold: hold.into(),
                key: key.into(),
                token,
                at: at * MS,
                asked: asked * MS,
                mode: self.1,
            },
        );
        self
    }
    /// The grants after this are in `mode`.
    fn mode(mut self, mode: Mode) -> Self {
        self.1 = mode;
        self
    }
    fn told(mut self, process: &str, hold: &str, at: u64) -> Self {
        self.0.record(
            process,
            Event::ToldLost {
                hold: hold.into(),
                at: at * MS,
            },
        );
        self
    }
    fn wrote(mut self, process: &str, hold: &str, at: u64) -> Self {
        self.0.record(
            process,
            Event::Wrote {
                hold: hold.into(),
                outcome: "ok".into(),
                at: at * MS,
            },
        );
        self
    }
    fn released(mut self, process: &str, hold: &str, at: u64) -> Self {
        self.0.record(
            process,
            Event::Released {
                hold: hold.into(),
                at: at * MS,
            },
        );
        self
    }
    fn paused(mut self, process: &str, stop: u64, cont: u64) -> Self {
        self.0
            .process_fault(process, ProcessFault::Paused(stop * MS, cont * MS));
        self
    }
    fn killed(self, process: &str, at: u64) -> Self {
        self.killed_reaped(process, at, at)
    }
    /// SIGKILL sent at `sent`, the process reaped at `reaped`.
    fn killed_reaped(mut self, process: &str, sent: u64, reaped: u64) -> Self {
        self.0.process_fault(
            process,
            ProcessFault::Killed {
                sent: sent * MS,
                reaped: reaped * MS,
            },
        );
        self
    }
    fn window(mut self, name: &'static str, start: u64, end: u64) -> Self {
        self.0.fault_window(name, start * MS, end * MS, 0);
        self
    }
    fn link_window(mut self, name: &'static str, start: u64, end: u64, hit: &[&str]) -> Self {
        let hit = hit.iter().map(|p| p.to_string()).collect();
        self.0.link_fault_window(name, start * MS, end * MS, 0, hit);
        self
    }
    fn check(&self, outside: &[&str]) -> Verdict {
        self.0.check(outside)
    }
}

#[test]
fn holds_one_after_another_are_clean() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 5)
        .grant("q", "b", "k", 2, 2, 6)
        .released("q", "b", 9)
        .check(&[]);
    assert_eq!(
        (
            v.holds,
            v.overlaps_unwarned,
            v.overlaps_paused,
            v.tokens_backwards
        ),
        (2, 0, 0, 0)
    );
}

#[test]
fn a_grant_while_another_holds_is_an_unwarned_overlap() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 10)
        .grant("q", "b", "k", 2, 2, 5)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 1, "{v:?}");
    assert_eq!(v.examples.len(), 1);
}

#[test]
fn other_keys_never_overlap() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 10)
        .grant("q", "b", "j", 1, 0, 5)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 0);
}

#[test]
fn a_grant_after_the_holder_was_told_is_no_overlap_and_its_margin_is_kept() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .told("p", "a", 4)
        .released("p", "a", 10)
        .grant("q", "b", "k", 2, 2, 6)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 0, "{v:?}");
    assert_eq!(v.worst_margin_ms, Some(2.0));
}

#[test]
fn a_killed_holder_ends_when_it_is_killed() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .killed("p", 3)
        .grant("q", "b", "k", 2, 2, 6)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 0, "{v:?}");
    assert_eq!(v.kill_recovery_ms, Some(3.0));
}

#[test]
fn a_grant_between_the_kill_signal_and_the_reaping_ends_with_the_process() {
    // Granted after SIGKILL was sent but before the process died: it never
    // acted on it, and the lock is freed by its death, so the next grant
    // is no overlap.
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 2)
        .grant("p", "b", "k", 2, 2, 4)
        .killed_reaped("p", 3, 8)
        .grant("q", "c", "k", 3, 3, 6)
        .released("q", "c", 12)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 0, "{v:?}");
    assert_eq!(v.kill_recovery_ms, Some(2.0));
}

#[test]
fn a_holder_that_acted_after_the_kill_signal_ends_no_sooner() {
    // It wrote at 7, so it was alive then: a grant at 6 overlaps it.
    let v = Make::new()
        .grant("p", "b", "k", 2, 2, 4)
        .wrote("p", "b", 7)
        .killed_reaped("p", 3, 8)
        .grant("q", "c", "k", 3, 3, 6)
        .released("q", "c", 12)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 1, "{v:?}");
}

#[test]
fn a_pause_excuses_a_grant_after_the_stop_when_the_holder_is_told_first() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .paused("p", 2, 20)
        .told("p", "a", 21)
        .released("p", "a", 22)
        .grant("q", "b", "k", 2, 3, 10)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (0, 1), "{v:?}");
    assert_eq!(v.told_after_resume_ms, Some(1.0));
}

#[test]
fn a_pause_never_excuses_an_overlap_before_it() {
    // q was granted at 5 while p still ran (p stopped only at 8).
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .paused("p", 8, 20)
        .told("p", "a", 21)
        .released("p", "a", 22)
        .grant("q", "b", "k", 2, 3, 5)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (1, 0), "{v:?}");
}

#[test]
fn an_unexcused_pause_before_an_excused_one_excuses_nothing_between() {
    // p was paused 2..4 and acted after (wrote at 5), untold: that pause
    // is no excuse. Its second pause (from 8) is: told at 21 before
    // acting again. q's grant at 6 falls between them.
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .paused("p", 2, 4)
        .wrote("p", "a", 5)
        .paused("p", 8, 20)
        .told("p", "a", 21)
        .released("p", "a", 22)
        .grant("q", "b", "k", 2, 3, 6)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (1, 0), "{v:?}");
}

#[test]
fn a_pause_the_holder_acted_after_untold_excuses_nothing() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 1)
        .paused("p", 2, 20)
        .wrote("p", "a", 21)
        .released("p", "a", 22)
        .grant("q", "b", "k", 2, 3, 10)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (1, 0), "{v:?}");
}

#[test]
fn an_outside_fault_excuses_only_its_window() {
    let during = Make::new()
        .window("drop", 2, 6)
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 10)
        .grant("q", "b", "k", 2, 2, 5)
        .released("q", "b", 12)
        .check(&["drop"]);
    assert_eq!(
        (during.overlaps_unwarned, during.overlaps_outside),
        (0, 1),
        "{during:?}"
    );
    let named_elsewhere = Make::new()
        .window("drop", 2, 6)
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 10)
        .grant("q", "b", "k", 2, 2, 5)
        .released("q", "b", 12)
        .check(&["clock"]);
    assert_eq!(named_elsewhere.overlaps_unwarned, 1, "{named_elsewhere:?}");
    let after = Make::new()
        .window("drop", 20, 30)
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 10)
        .grant("q", "b", "k", 2, 2, 5)
        .released("q", "b", 12)
        .check(&["drop"]);
    assert_eq!(after.overlaps_unwarned, 1, "{after:?}");
}

#[test]
fn tokens_must_rise_in_grant_order() {
    let v = Make::new()
        .grant("p", "a", "k", 5, 0, 1)
        .released("p", "a", 2)
        .grant("q", "b", "k", 3, 3, 4)
        .released("q", "b", 5)
        .check(&[]);
    assert_eq!(v.tokens_backwards, 1, "{v:?}");
    // Asked before the other was granted: no order between them.
    let concurrent = Make::new()
        .grant("p", "a", "k", 5, 0, 2)
        .released("p", "a", 3)
        .grant("q", "b", "k", 3, 1, 4)
        .released("q", "b", 5)
        .check(&[]);
    assert_eq!(concurrent.tokens_backwards, 0, "{concurrent:?}");
    let excused = Make::new()
        .window("server-kill", 1, 4)
        .grant("p", "a", "k", 5, 0, 1)
        .released("p", "a", 2)
        .grant("q", "b", "k", 3, 3, 4)
        .released("q", "b", 5)
        .check(&["server-kill"]);
    assert_eq!(
        (excused.tokens_backwards, excused.tokens_backwards_outside),
        (0, 1)
    );
}

#[test]
fn a_fault_on_some_links_excuses_only_holders_it_hit_and_no_token() {
    // p's link dropped: q's grant while p held is excused.
    let hit = Make::new()
        .link_window("drop", 2, 6, &["p"])
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 10)
        .grant("q", "b", "k", 2, 2, 5)
        .released("q", "b", 12)
        .check(&["drop"]);
    assert_eq!(
        (hit.overlaps_unwarned, hit.overlaps_outside),
        (0, 1),
        "{hit:?}"
    );
    // Only r's link dropped: p's and q's overlap stands.
    let elsewhere = Make::new()
        .link_window("drop", 2, 6, &["r"])
        .grant("p", "a", "k", 1, 0, 1)
        .released("p", "a", 10)
        .grant("q", "b", "k", 2, 2, 5)
        .released("q", "b", 12)
        .check(&["drop"]);
    assert_eq!(
        (elsewhere.overlaps_unwarned, elsewhere.overlaps_outside),
        (1, 0),
        "{elsewhere:?}"
    );
    // A dropped link never excuses a token going backwards.
    let tokens = Make::new()
        .link_window("drop", 1, 4, &["p", "q"])
        .grant("p", "a", "k", 5, 0, 1)
        .released("p", "a", 2)
        .grant("q", "b", "k", 3, 3, 4)
        .released("q", "b", 5)
        .check(&["drop"]);
    assert_eq!(
        (tokens.tokens_backwards, tokens.tokens_backwards_outside),
        (1, 0),
        "{tokens:?}"
    );
}

#[test]
fn readers_overlapping_are_clean() {
    let v = Make::new()
        .mode(Mode::Read)
        .grant("p", "a", "k", 1, 0, 1)
        .grant("q", "b", "k", 2, 0, 2)
        .released("p", "a", 5)
        .released("q", "b", 6)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 0);
    assert_eq!(v.by_mode.get("r"), Some(&2));
}

#[test]
fn a_writer_granted_while_a_reader_holds_is_an_overlap() {
    let v = Make::new()
        .mode(Mode::Read)
        .grant("p", "a", "k", 1, 0, 1)
        .mode(Mode::Write)
        .grant("q", "b", "k", 2, 0, 2)
        .released("p", "a", 5)
        .released("q", "b", 6)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 1);
}

#[test]
fn a_reader_granted_while_a_writer_holds_is_an_overlap() {
    let v = Make::new()
        .mode(Mode::Write)
        .grant("p", "a", "k", 1, 0, 1)
        .mode(Mode::Read)
        .grant("q", "b", "k", 2, 0, 2)
        .released("p", "a", 5)
        .released("q", "b", 6)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 1);
}

/// A writer after readers overlaps the one that reaches furthest, even
/// when the reader granted last ended first.
#[test]
fn a_writer_overlapping_an_earlier_reader_is_found_past_a_later_one() {
    let v = Make::new()
        .mode(Mode::Read)
        .grant("p", "a", "k", 1, 0, 1)
        .grant("q", "b", "k", 2, 0, 2)
        .released("q", "b", 3)
        .mode(Mode::Write)
        .grant("r", "c", "k", 3, 3, 4)
        .released("p", "a", 6)
        .released("r", "c", 7)
        .check(&[]);
    assert_eq!(v.overlaps_unwarned, 1);
}

#[test]
fn a_semaphore_within_its_permits_is_clean_and_one_more_is_an_overlap() {
    let within = Make::new()
        .mode(Mode::Semaphore(2))
        .grant("p", "a", "s", 1, 0, 1)
        .grant("q", "b", "s", 2, 0, 2)
        .released("p", "a", 5)
        .released("q", "b", 6)
        .check(&[]);
    assert_eq!(within.overlaps_unwarned, 0);
    let over = Make::new()
        .mode(Mode::Semaphore(2))
        .grant("p", "a", "s", 1, 0, 1)
        .grant("q", "b", "s", 2, 0, 2)
        .grant("r", "c", "s", 3, 0, 3)
        .released("p", "a", 5)
        .released("q", "b", 6)
        .released("r", "c", 7)
        .check(&[]);
    assert_eq!(over.overlaps_unwarned, 1);
}

/// A pause excuses a semaphore holder as it does a mutex's: told first
/// once it ran again.
#[test]
fn a_paused_semaphore_holder_told_first_is_excused() {
    let v = Make::new()
        .mode(Mode::Semaphore(1))
        .grant("p", "a", "s", 1, 0, 1)
        .paused("p", 2, 10)
        .grant("q", "b", "s", 2, 3, 5)
        .told("p", "a", 11)
        .released("p", "a", 12)
        .released("q", "b", 13)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (0, 1));
}

#[test]
fn events_keep_their_mode_through_a_line() {
    for mode in [
        Mode::Exclusive,
        Mode::Read,
        Mode::Write,
        Mode::Semaphore(2),
        Mode::All,
    ] {
        let line = Event::Granted {
            hold: "w1.3+1".into(),
            key: "k0:rw".into(),
            token: 7,
            at: 10,
            asked: 9,
            mode,
        }
        .line();
        match Event::parse(&line) {
            Some(Event::Granted { mode: m, .. }) => assert_eq!(m, mode, "{line}"),
            other => panic!("{line} parsed as {other:?}"),
        }
    }
}

#[test]
fn hand_offs_kept_back_are_counted() {
    let mut h = History::default();
    let line = Event::KeptBack { at: 12 }.line();
    h.record("p", Event::parse(&line).expect("a K line parses"));
    h.record("p", Event::parse("K 13").unwrap());
    assert_eq!(h.kept_back, 2);
}

/// Three holders of a two-permit semaphore, one of them paused and told
/// first once it ran again: its permit is free, and the two that ran are
/// within the permits, whichever reaches furthest (a 60 ms Redis run
/// counted this as unwarned: the checker judged by the holder that held
/// longest, which was no one's fault).
#[test]
fn a_paused_semaphore_holder_frees_its_permit_beside_one_that_holds_on() {
    let v = Make::new()
        .mode(Mode::Semaphore(2))
        .grant("p", "a", "s", 1, 0, 1)
        .paused("p", 2, 20)
        .told("p", "a", 21)
        .released("p", "a", 21)
        .grant("q", "b", "s", 2, 0, 3)
        .grant("r", "c", "s", 3, 4, 10)
        .released("r", "c", 12)
        .released("q", "b", 30)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (0, 1), "{v:?}");
    // Granted before p's pause began: three ran at once.
    let before = Make::new()
        .mode(Mode::Semaphore(2))
        .grant("p", "a", "s", 1, 0, 1)
        .paused("p", 8, 20)
        .told("p", "a", 21)
        .released("p", "a", 21)
        .grant("q", "b", "s", 2, 0, 3)
        .grant("r", "c", "s", 3, 4, 5)
        .released("r", "c", 12)
        .released("q", "b", 30)
        .check(&[]);
    assert_eq!(
        (before.overlaps_unwarned, before.overlaps_paused),
        (1, 0),
        "{before:?}"
    );
}

/// A writer granted while two readers hold, one paused and told first and
/// reaching further, the other running: the running one is an unwarned
/// overlap, which the paused one must not hide.
#[test]
fn a_paused_reader_hides_no_reader_that_ran() {
    let v = Make::new()
        .mode(Mode::Read)
        .grant("p", "a", "k", 1, 0, 1)
        .paused("p", 2, 20)
        .told("p", "a", 21)
        .released("p", "a", 22)
        .grant("q", "b", "k", 2, 0, 3)
        .released("q", "b", 15)
        .mode(Mode::Write)
        .grant("r", "c", "k", 3, 4, 10)
        .released("r", "c", 12)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (1, 0), "{v:?}");
}

/// A grant dated after a pause's start is not excused by that pause: the
/// process ran then, so the pause began later, when no one can tell. The
/// nemesis dates a pause once the process is seen stopped, so that this
/// does not happen (`tower_lock_servers::stop_pid`).
#[test]
fn a_pause_dated_before_the_grant_excuses_nothing() {
    let v = Make::new()
        .grant("p", "a", "k", 1, 0, 3)
        .paused("p", 2, 20)
        .told("p", "a", 21)
        .released("p", "a", 22)
        .grant("q", "b", "k", 2, 4, 10)
        .released("q", "b", 12)
        .check(&[]);
    assert_eq!((v.overlaps_unwarned, v.overlaps_paused), (1, 0), "{v:?}");
}
