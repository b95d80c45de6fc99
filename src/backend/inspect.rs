//! [`Inspection`]: who holds a key, as its store can tell, for
//! [`Backend::inspect`](crate::Backend::inspect).

use std::fmt;
use std::time::Duration;

use crate::json;
use crate::key::LockKey;
use crate::mode::LockMode;
use crate::token::FencingToken;

/// Who holds a key and who waits for it, as the store can tell at one
/// moment: any process, not only this one.
///
/// What a store keeps differs, so every field but the key is optional; each
/// backend's module says what it fills in.
///
/// # Examples
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tower_lock::LockError> {
/// use tower_lock::{Backend, BackendExt, LockKey, MemoryBackend};
///
/// let backend = MemoryBackend::new();
/// let held = backend.lock("sku-1").await?;
/// let seen = backend.inspect(LockKey::new("sku-1")?).await?;
/// assert_eq!(seen.holders.len(), 1);
/// assert_eq!(seen.holders[0].token, Some(held.token()));
/// assert_eq!(seen.waiters, Some(0));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// The key inspected.
    pub key: LockKey,
    /// Its holders: none when free, one for an exclusive or write lock,
    /// any number for read locks and semaphores.
    pub holders: Vec<Holder>,
    /// How many acquisitions wait for it, where the server knows (a
    /// queue it keeps); `None` where waiters only retry.
    pub waiters: Option<u32>,
}

impl Inspection {
    /// A key nobody holds, with `waiters` as the store tells.
    pub fn free(key: LockKey, waiters: Option<u32>) -> Self {
        Inspection {
            key,
            holders: Vec::new(),
            waiters,
        }
    }

    /// Whether someone holds the key.
    pub fn is_held(&self) -> bool {
        !self.holders.is_empty()
    }

    /// As JSON: `{"key", "holders": [{"token", "mode", "lease_left_ms",
    /// "identity"}], "waiters"}`, `null` where the store does not tell.
    ///
    /// ```
    /// use tower_lock::backend::Inspection;
    /// use tower_lock::LockKey;
    ///
    /// let free = Inspection::free(LockKey::new("sku:1").unwrap(), None);
    /// assert_eq!(free.to_json(), r#"{"key":"sku:1","holders":[],"waiters":null}"#);
    /// ```
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"key\":");
        json::string(&mut out, self.key.as_str());
        out.push_str(",\"holders\":");
        holders_json(&mut out, &self.holders);
        out.push_str(",\"waiters\":");
        json::number(&mut out, self.waiters);
        out.push('}');
        out
    }
}

/// Appends `holders` as a JSON array.
fn holders_json(out: &mut String, holders: &[Holder]) {
    out.push('[');
    for (i, h) in holders.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"token\":");
        json::number(out, h.token);
        out.push_str(",\"mode\":");
        match h.mode {
            Some(m) => json::string(out, &m.to_string()),
            None => out.push_str("null"),
        }
        out.push_str(",\"lease_left_ms\":");
        json::number(out, h.lease_left.map(|l| l.as_millis()));
        out.push_str(",\"identity\":");
        match &h.identity {
            Some(who) => json::string(out, who),
            None => out.push_str("null"),
        }
        out.push('}');
    }
    out.push(']');
}

/// One holder of a key, as its store keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Holder {
    /// Its fencing token, where the store keeps one per holder.
    pub token: Option<FencingToken>,
    /// The mode it holds the key in, where the store tells.
    pub mode: Option<LockMode>,
    /// How long the store keeps the lock if it is not renewed: the lease
    /// or session left.
    pub lease_left: Option<Duration>,
    /// Who holds it, where the store carries it: a host, a process id, a
    /// connection, a label.
    pub identity: Option<String>,
}

impl Holder {
    /// A holder with `token`, everything else unknown: set the rest with
    /// the other builders.
    pub fn new(token: Option<FencingToken>) -> Self {
        Holder {
            token,
            ..Holder::default()
        }
    }

    /// Its mode.
    pub fn mode(mut self, mode: LockMode) -> Self {
        self.mode = Some(mode);
        self
    }

    /// The lease or session it has left.
    pub fn lease_left(mut self, left: Duration) -> Self {
        self.lease_left = Some(left);
        self
    }

    /// Who holds it.
    pub fn identity(mut self, identity: impl Into<String>) -> Self {
        self.identity = Some(identity.into());
        self
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        let mut field = |f: &mut fmt::Formatter<'_>, text: fmt::Arguments<'_>| {
            let r = write!(f, "{sep}{text}");
            sep = ", ";
            r
        };
        if let Some(t) = self.token {
            field(f, format_args!("token {t}"))?;
        }
        if let Some(m) = self.mode {
            field(f, format_args!("{m}"))?;
        }
        if let Some(l) = self.lease_left {
            field(f, format_args!("{} ms left", l.as_millis()))?;
        }
        if let Some(who) = &self.identity {
            field(f, format_args!("held by {who}"))?;
        }
        if sep.is_empty() {
            f.write_str("a holder the store does not describe")?;
        }
        Ok(())
    }
}

/// How far [`Backend::break_lock`](crate::Backend::break_lock) may go to
/// free a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BreakScope {
    /// Free the key's locks and nothing else. Where only ending the
    /// holder's session frees a lock (PostgreSQL advisory locks, MariaDB),
    /// breaking is refused with [`LockError::Unsupported`](crate::LockError::Unsupported)
    /// saying so.
    #[default]
    LocksOnly,
    /// Also end the holders' sessions where that is the only way to free
    /// the lock: every other lock those sessions hold is freed with it, and
    /// the user needs the right to end them (PostgreSQL's
    /// `pg_signal_backend`, MariaDB's `CONNECTION ADMIN`).
    Sessions,
}

/// What [`Backend::break_lock`](crate::Backend::break_lock) did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Broken {
    /// The key.
    pub key: LockKey,
    /// The holders freed, as [`Inspection::holders`] shows them: none when
    /// the key was free.
    pub holders: Vec<Holder>,
    /// The key's fencing floor: above every token the store granted for
    /// the key before the break, and at most every token it grants after
    /// (a waiter queued in the server included). A broken process may
    /// still pass on tokens from a block it reserved before: they are
    /// below the floor, and refused. Write it to the fenced store (as a holder's write
    /// would) and the broken holders' later writes are refused, even
    /// before a new holder writes.
    pub floor: FencingToken,
}

impl Broken {
    /// As JSON: `{"key", "holders": [..], "floor"}`, the holders as in
    /// [`Inspection::to_json`].
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"key\":");
        json::string(&mut out, self.key.as_str());
        out.push_str(",\"holders\":");
        holders_json(&mut out, &self.holders);
        out.push_str(",\"floor\":");
        json::number(&mut out, Some(self.floor));
        out.push('}');
        out
    }
}
