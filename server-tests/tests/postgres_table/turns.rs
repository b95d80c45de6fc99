//! Taking turns without a server queue: a release that notified waiters
//! elsewhere gives them the row before this process takes it again.

use super::*;

/// Two processes (two backends), one worker each, lock one key in a loop.
/// Without a hand-off, the releaser's next acquire goes out on the same
/// connection right behind its release and takes the row back before the
/// other, woken by the notification, asks: nearly every hold would follow
/// one of the same side. With it, they alternate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_per_process_alternates_with_the_other() {
    use std::sync::{Arc, Mutex};

    const HOLDS: usize = 400;
    let k = key("turns", "k");
    let (a, b) = (direct().await, direct().await);
    for side in [&a, &b] {
        common::eventually("the listener hears its test notification", || {
            side.hears_releases()
        })
        .await;
    }
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for (side, backend) in [(0u8, &a), (1u8, &b)] {
        let (backend, log, k) = (backend.clone(), log.clone(), k.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let g = backend
                    .lock(k.as_str())
                    .wait(Duration::from_secs(30))
                    .await
                    .unwrap();
                {
                    let mut log = log.lock().unwrap();
                    if log.len() >= HOLDS {
                        return;
                    }
                    log.push((side, g.token().get()));
                }
                tokio::task::yield_now().await;
                drop(g);
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    assert!(log.windows(2).all(|w| w[1].1 > w[0].1), "tokens rise");
    let again = log.windows(2).filter(|w| w[0].0 == w[1].0).count();
    println!("of {HOLDS} holds, {again} followed one of the same process");
    // Without the hand-off more than half do (217 to 278 of 400 seen):
    // the releaser wins whenever the other is not already asking. With
    // it, 89 to 94 of 400 were seen (59 to 75 when every lone release
    // handed off, not only a contended lock's): a
    // hand-off whose grace ends before the other asked (it may be in a
    // hand-off of its own) lets the releaser go.
    assert!(
        again * 100 <= HOLDS * 36,
        "{again} of {HOLDS} holds followed one of the same process: they did not take turns"
    );
    a.flush().await;
    b.flush().await;
    settle_free(&raw().await, &k).await;
}
