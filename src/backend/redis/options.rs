//! Connection settings and TLS.

use std::time::Duration;

use redis::{ConnectionInfo, IntoConnectionInfo, ProtocolVersion};

use super::replicas::Replicas;
use crate::backend::CohortOptions;
use crate::error::LockError;

/// Connection settings of a [`RedisBackend`](super::RedisBackend).
///
/// # Examples
///
/// ```no_run
/// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
/// use std::time::Duration;
/// use tower_lock::backend::redis::{RedisBackend, RedisOptions};
///
/// let options = RedisOptions::default()
///     .prefix("orders:lock:")
///     .connect_timeout(Duration::from_secs(2))
///     .response_timeout(Duration::from_millis(500))
///     // Every client of this server uses leases of at most 30 s.
///     .restart_quarantine(Duration::from_secs(30));
/// let redis = RedisBackend::connect_with("redis://127.0.0.1:6379/", options).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub(super) prefix: String,
    pub(super) connect_timeout: Duration,
    pub(super) response_timeout: Duration,
    pub(super) restart_quarantine: Option<Duration>,
    pub(super) replicas: Option<Replicas>,
    pub(super) cohort: CohortOptions,
    #[cfg(feature = "redis-tls")]
    tls_root_certificate: Option<Vec<u8>>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            prefix: "lock:".into(),
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            restart_quarantine: None,
            replicas: None,
            cohort: CohortOptions::default(),
            #[cfg(feature = "redis-tls")]
            tls_root_certificate: None,
        }
    }
}

impl RedisOptions {
    /// The prefix of every Redis key (default `lock:`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How this process's waiters share a lock (see
    /// [`Cohort`](crate::backend::Cohort)): on by default, up to
    /// [`CohortOptions::DEFAULT_MAX_GRANTS`] holders or
    /// [`CohortOptions::DEFAULT_MAX_HOLD`] per Redis acquisition;
    /// [`CohortOptions::off`] makes every acquisition go to Redis.
    pub fn cohort(mut self, cohort: CohortOptions) -> Self {
        self.cohort = cohort;
        self
    }

    /// How long to wait for a connection (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long to wait for a reply (default 1 s). A backend that does not
    /// answer in time makes the acquisition fail (503 through the layer).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// After the server comes back empty (restarted without persistence, or
    /// flushed), grant no lock for `longest_lease`: a holder from before
    /// cannot still be inside its lease when the next one starts. Set it to
    /// the longest lease any client of this server uses. Off by default.
    ///
    /// The server is recognised as empty by a marker key under the prefix
    /// (`<prefix>~alive`), which the first acquisition writes; so a new
    /// server also waits once. Not for Redis Cluster (the marker lives in
    /// one slot).
    pub fn restart_quarantine(mut self, longest_lease: Duration) -> Self {
        self.restart_quarantine = Some(longest_lease);
        self
    }

    /// Counts a lock taken or renewed only once `replicas` replicas have
    /// it, waiting up to `timeout` for them: `WAIT replicas timeout` sent
    /// behind each acquire and renewal, in the same round trip (what
    /// Redisson's `syncSlaves` does). Off by default; a
    /// `redis+sentinel://` URL can ask for it with
    /// `?wait_replicas=N&wait_timeout_ms=T` (this option wins).
    ///
    /// Replication is asynchronous: without this, a failover to a replica
    /// that had not yet received a lock loses it, and the next client is
    /// granted the lock while its holder still counts on it (its fencing
    /// token stays below the new holder's). With it, an acquisition that
    /// too few replicas acknowledge in time is released and fails
    /// ([`LockError::Backend`], 503 through the layer), and a renewal that
    /// too few acknowledge tells the holder the lock is lost. Give the
    /// number of replicas the master has: Sentinel promotes one of them,
    /// and only a write all of them have survives any choice. Fewer is not
    /// safe even when Sentinel promotes the replica with the most data: a
    /// master paused through a failover serves again until the Sentinels
    /// convert it, and a replica not yet moved to the new master
    /// acknowledges its grants, then drops them as it follows the new one
    /// (the torture harness met this with one of two). The replica being
    /// promoted no longer follows the old master, so waiting for all of
    /// them refuses those grants. The price is availability: while any
    /// replica is down (not only the master), every acquisition is refused
    /// and every holder is told its lock is lost at its next renewal. A
    /// master that restarts empty (no persistence) before the Sentinels
    /// fail it over wipes its replicas too, whatever they acknowledged:
    /// use persistence or [`restart_quarantine`](Self::restart_quarantine).
    /// It costs the
    /// replicas' acknowledgement on every acquire and renewal, and the
    /// `WAIT` holds up the commands behind it on the backend's connection.
    /// `timeout` must be at least 1 ms and below the response timeout
    /// (else [`connect_with`](super::RedisBackend::connect_with) refuses it
    /// with [`LockError::Config`]): `WAIT n 0` would wait forever.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # #[tokio::main] async fn main() -> Result<(), tower_lock::LockError> {
    /// use std::time::Duration;
    /// use tower_lock::backend::redis::{RedisBackend, RedisOptions};
    ///
    /// let options = RedisOptions::default().wait_for_replicas(2, Duration::from_millis(100));
    /// let redis = RedisBackend::connect_with(
    ///     "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,10.0.0.3:26379/orders",
    ///     options,
    /// )
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replicas = (replicas > 0).then_some(Replicas {
            count: replicas,
            timeout,
        });
        self
    }

    /// For a `rediss://` URL: trust the CA certificate(s) in `pem` (PEM
    /// text, one or more certificates), and only them, instead of the
    /// system's trust store. For a server whose certificate a private CA
    /// signed. The host name in the URL must still match the certificate.
    /// [`connect_with`](super::RedisBackend::connect_with) refuses it with a URL
    /// that does not use TLS, and a `pem` that does not parse, as
    /// [`LockError::Config`]. Needs the `redis-tls` feature.
    #[cfg(feature = "redis-tls")]
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_certificate = Some(pem.into());
        self
    }
}

impl RedisOptions {
    /// Refuses options a Sentinel URL cannot honour (TLS is not supported
    /// there yet).
    pub(super) fn check_sentinel(&self) -> Result<(), LockError> {
        self.refuse_tls_root("redis+sentinel://")
    }

    /// Refuses options a Cluster URL cannot honour: the restart
    /// quarantine's marker would live in one slot, on one master, and TLS
    /// is not supported there yet.
    pub(super) fn check_cluster(&self) -> Result<(), LockError> {
        if self.restart_quarantine.is_some() {
            return Err(LockError::Config(
                "the restart quarantine is not available with redis+cluster://: its marker key \
                 lives on one master, and cannot tell that another came back empty"
                    .into(),
            ));
        }
        self.refuse_tls_root("redis+cluster://")
    }

    /// A TLS root certificate, given for a `scheme` that connects without TLS.
    fn refuse_tls_root(&self, scheme: &str) -> Result<(), LockError> {
        #[cfg(feature = "redis-tls")]
        if self.tls_root_certificate.is_some() {
            return Err(LockError::Config(format!(
                "a TLS root certificate was given, but {scheme} connects without TLS"
            )));
        }
        #[cfg(not(feature = "redis-tls"))]
        let _ = scheme;
        Ok(())
    }

    /// The client for `url`, over TLS if it asks for it.
    pub(super) fn client(&self, url: &str) -> Result<redis::Client, LockError> {
        if wants_tls(url) {
            check_tls_support("rediss")?;
        }
        let info = url
            .into_connection_info()
            .map_err(|e| LockError::Config(format!("invalid Redis URL {url:?}: {e}")))?;
        let info = resp3(info);
        #[cfg(feature = "redis-tls")]
        if let Some(pem) = &self.tls_root_certificate {
            if !wants_tls(url) {
                return Err(LockError::Config(format!(
                    "a TLS root certificate was given, but {url:?} does not use TLS: use rediss://"
                )));
            }
            return redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            )
            .map_err(|e| LockError::Config(format!("invalid TLS root certificate: {e}")));
        }
        redis::Client::open(info)
            .map_err(|e| LockError::Config(format!("invalid Redis URL {url:?}: {e}")))
    }
}

/// `info` speaking RESP3: release messages arrive as pushes on the
/// connection the commands go on.
pub(super) fn resp3(info: ConnectionInfo) -> ConnectionInfo {
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    info.set_redis_settings(settings)
}

/// Whether `url` asks for TLS: `rediss://`, or the redis crate's
/// `valkeys://`.
fn wants_tls(url: &str) -> bool {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}

/// Refuses a URL whose `scheme` asks for TLS when this build has none,
/// naming the feature that adds it (the redis crate's own error names its
/// features, not ours).
pub(crate) fn check_tls_support(scheme: &str) -> Result<(), LockError> {
    tls_support(scheme, cfg!(feature = "redis-tls"))
}

/// The likely cause of a failed connection that failed the way one to a
/// server expecting TLS fails without it (the server drops it), or the other
/// way round (no answer to the TLS handshake).
pub(super) fn tls_mismatch_hint(url: &str, e: &redis::RedisError) -> &'static str {
    let dropped = e.is_connection_dropped() && !e.is_connection_refusal();
    match wants_tls(url) {
        false if dropped => {
            " (the server dropped the connection: if it expects TLS, use rediss://)"
        }
        true if dropped || e.is_timeout() => {
            " (no TLS handshake: if the server does not speak TLS, use redis://)"
        }
        _ => "",
    }
}

fn tls_support(scheme: &str, built_in: bool) -> Result<(), LockError> {
    if built_in {
        return Ok(());
    }
    Err(LockError::Config(format!(
        "`{scheme}://` URLs connect over TLS, which this build of tower-lock leaves out: \
         enable its `redis-tls` feature (features = [\"redis-tls\"] in Cargo.toml)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_url_without_the_feature_is_a_config_error_naming_the_feature() {
        assert!(wants_tls("rediss://127.0.0.1:6379/"));
        assert!(wants_tls("REDISS://127.0.0.1/#insecure"));
        assert!(wants_tls("valkeys://127.0.0.1/"));
        assert!(!wants_tls("redis://127.0.0.1:6379/"));
        assert!(!wants_tls("redis://rediss:6379/"));
        assert!(tls_support("rediss", true).is_ok());
        match tls_support("rediss", false) {
            Err(LockError::Config(m)) => {
                assert!(m.contains("`rediss://`"), "{m}");
                assert!(m.contains("`redis-tls` feature"), "{m}");
            }
            other => panic!("expected a Config error, got {other:?}"),
        }
        assert_eq!(
            check_tls_support("rediss").is_ok(),
            cfg!(feature = "redis-tls")
        );
    }
}
