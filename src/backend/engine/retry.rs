//! Retrying a request whose failure left its fate unknown: the one loop the
//! session-based backends (ZooKeeper, etcd) share.

use std::future::Future;
use std::time::Duration;

/// Runs `call` again, with a backoff from 10 ms doubling to 500 ms, while
/// it fails in a way `uncertain` says is worth another try (for most
/// callers: it may not have been applied, as after a broken connection or
/// with a member without a leader) and `go_on()` says the session or lease
/// it belongs to may still hold. The first other outcome is returned.
pub(crate) async fn retry_uncertain<T, E, F, Fut>(
    uncertain: impl Fn(&E) -> bool,
    go_on: impl Fn() -> bool,
    mut call: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut pause = Duration::from_millis(10);
    loop {
        match call().await {
            Err(e) if uncertain(&e) && go_on() => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            result => return result,
        }
    }
}
