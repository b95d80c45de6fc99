//! Connecting to the instances: one RESP3 connection each, which also
//! carries the release messages its waiters hear.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, PushInfo};

use super::{Node, RedlockBackend, RedlockStore};
use crate::backend::engine::renewal::Renewals;
use crate::backend::redis::connection::{Connection, Link};
use crate::backend::redis::layout::{redis_error, Tokens};
use crate::backend::redis::options::{check_tls_support, resp3};
use crate::backend::redis::pubsub::{sweep_subscriptions, Watches};
use crate::backend::{CohortOptions, RemoteBackend};
use crate::error::LockError;

impl RedlockBackend {
    /// Connects to `redlock://host1:port1,host2:port2,...` (at least three
    /// instances, best an odd number). Instances that are down are connected
    /// to when they come up; the lock works while a majority answers.
    ///
    /// Each instance may be given as `[user][:password@]host:port`, as in a
    /// `redis://` URL (see [`RedisBackend::connect`](crate::backend::redis::RedisBackend::connect)).
    ///
    /// `redlocks://h1:p1,h2:p2,h3:p3` connects to every instance over TLS,
    /// as `rediss://` does (feature `redis-tls`; without it the URL is a
    /// [`LockError::Config`] that says so): each server's certificate must be
    /// valid for its host and chain to a CA of the system's trust store
    /// (OpenSSL's: `/etc/ssl/certs`, or what the `SSL_CERT_FILE` /
    /// `SSL_CERT_DIR` environment variables name, the way to trust a private
    /// CA here). `redlocks://h1:p1,h2:p2,h3:p3#insecure` checks neither
    /// certificates nor host names (for tests). All instances use TLS or
    /// none.
    ///
    /// # Errors
    ///
    /// [`LockError::Config`] for a malformed URL or fewer than three
    /// instances. An instance that cannot be reached, or whose TLS handshake
    /// fails, makes acquisitions fail once no majority answers.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_lock::backend::redis::redlock::RedlockBackend;
    /// use tower_lock::LockError;
    ///
    /// // Refused before anything is connected to: Redlock needs three servers or more.
    /// let two = RedlockBackend::connect("redlock://127.0.0.1:6379,127.0.0.1:6380").await;
    /// assert!(matches!(two, Err(LockError::Config(_))));
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        let (scheme, list) = url.split_once("://").unwrap_or(("", url));
        let tls = match scheme {
            "redlock" => false,
            "redlocks" => {
                check_tls_support("redlocks")?;
                true
            }
            _ => {
                return Err(LockError::Config(format!(
                    "{url:?} is not a redlock:// (or, over TLS, redlocks://) URL"
                )))
            }
        };
        let (list, fragment) = match list.split_once('#') {
            Some((list, fragment)) => (list, Some(fragment)),
            None => (list, None),
        };
        let node_url: fn(&str) -> String = match (tls, fragment) {
            (false, None) => |addr: &str| format!("redis://{addr}/"),
            (true, None) => |addr: &str| format!("rediss://{addr}/"),
            (true, Some("insecure")) => |addr: &str| format!("rediss://{addr}/#insecure"),
            _ => {
                return Err(LockError::Config(format!(
                    "a Redlock URL takes no fragment but #insecure, with redlocks://: {url:?}"
                )))
            }
        };
        let addrs: Vec<&str> = list.trim_end_matches('/').split(',').collect();
        if addrs.len() < 3 || addrs.iter().any(|a| a.is_empty()) {
            return Err(LockError::Config(format!(
                "Redlock needs at least three instances, as redlock://h1:p1,h2:p2,h3:p3; got {url:?}"
            )));
        }
        let tokens = Tokens::new();
        let mut nodes = Vec::with_capacity(addrs.len());
        for given in addrs {
            // For messages: the instance without its user and password.
            let addr = given.rsplit_once('@').map_or(given, |(_, host)| host);
            let invalid = |e| LockError::Config(format!("invalid Redis address {addr:?}: {e}"));
            let info = node_url(given).into_connection_info().map_err(invalid)?;
            let client = redis::Client::open(resp3(info)).map_err(invalid)?;
            let watches = Arc::new(Watches::new(tokens.prefix()));
            let push = {
                let watches = Arc::downgrade(&watches);
                move |info: PushInfo| {
                    if let Some(w) = watches.upgrade() {
                        w.on_push(info);
                    }
                    Ok::<(), ()>(())
                }
            };
            // Short timeouts: a dead instance must not hold up the majority.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(200)))
                .set_response_timeout(Some(Duration::from_millis(200)))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_millis(200))
                .set_push_sender(push)
                .set_automatic_resubscription();
            let conn = ConnectionManager::new_lazy_with_config(client, config)
                .map_err(|e| redis_error(&format!("connecting to {addr}"), e))?;
            let link = Link::Server(conn.clone());
            let link = Arc::new(Connection::new(link, 0, Arc::default(), false));
            tokio::spawn(sweep_subscriptions(
                Arc::downgrade(&watches),
                Arc::downgrade(&link),
            ));
            nodes.push(Node {
                addr: addr.to_owned(),
                conn,
                link,
                watches,
            });
        }
        let store = RedlockStore {
            nodes,
            prefix: "lock:".into(),
            tokens,
            jitter: Default::default(),
            releases: Arc::default(),
            renewals: Renewals::new(None),
        };
        Ok(RemoteBackend::new(store, CohortOptions::default()))
    }

    /// The same backend with another [`Cohort`](crate::backend::Cohort) bound, or
    /// [`CohortOptions::off`] to send every acquisition to the instances.
    /// On by default, as for the [single-instance backend](crate::backend::redis#passing-a-lock-on).
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
    /// use tower_lock::backend::CohortOptions;
    /// use tower_lock::backend::redis::redlock::RedlockBackend;
    ///
    /// let redlock = RedlockBackend::connect("redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379")
    ///     .await?
    ///     .with_cohort(CohortOptions::off());
    /// # Ok(()) }
    /// ```
    pub fn with_cohort(self, options: CohortOptions) -> Self {
        self.recohorted(options)
    }
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes = &self.store().nodes;
        let addrs: Vec<&str> = nodes.iter().map(|n| n.addr.as_str()).collect();
        f.debug_struct("RedlockBackend")
            .field("instances", &addrs)
            .field("cohort", &self.cohort_options())
            .finish_non_exhaustive()
    }
}
