//! The lease table's statements, with the table, sequence and channel
//! names written into them (names checked before they get here).

/// The statements, with the table, sequence and channel names in them.
pub(super) struct Sql {
    pub(super) create: String,
    pub(super) acquire: String,
    /// Every try of a waiter after its first: insert the row, or nothing
    /// at all.
    pub(super) join: String,
    /// Then, if the row was there: the acquire statement, which writes
    /// nothing while the row is held and already marked wanted.
    pub(super) acquire_waiting: String,
    pub(super) renew: String,
    pub(super) release: String,
    pub(super) sweep: String,
    pub(super) probe: String,
    pub(super) listen: String,
    /// The holder of a key and its time left, for inspection.
    pub(super) inspect: String,
    /// The held keys that start with a prefix.
    pub(super) list: String,
}

/// A statement as a PL/pgSQL function in the table's schema, for
/// statements sent unnamed (through a pooler in transaction mode, each is
/// parsed and planned again on every call): the server then plans a
/// one-line call, and the function keeps the statement's plan for the
/// server session. An acquire through PgBouncer measured as costly as the
/// floor's simpler statement this way, a third less than sent itself.
pub(super) struct Routine {
    /// Creates the function unless it exists. Its name is a hash of its
    /// text (schema, table and sequence names included), so that a changed
    /// statement is a new function, never one replaced under another
    /// version's callers, and two processes creating it at once collide on
    /// a unique index (tried again) rather than on a row being replaced.
    pub(super) create: String,
    /// The call, with the statement's parameters.
    pub(super) call: String,
    /// Its name and argument types, as `to_regprocedure` reads them.
    pub(super) signature: String,
    /// Its body as `pg_proc.prosrc` keeps it: a function of that name
    /// with another body is not this one.
    pub(super) source: String,
}

impl Routine {
    /// `statement` (parameters `$1`… of the types in `params`), returning
    /// the columns `returns`, as a function of `schema` (as PostgreSQL
    /// writes it: quoted where it must be).
    fn new(schema: &str, statement: &str, params: &[&str], returns: &str) -> Routine {
        let args = params.join(", ");
        // Its result columns are variables in the body: where a name is
        // also a column's, the column is meant.
        let body = format!("#variable_conflict use_column\nBEGIN RETURN QUERY {statement}; END");
        let hash = fnv1a(&format!("{schema} {args} {returns} {body}"));
        let name = format!("{schema}.tower_lock_{hash:016x}");
        let signature = format!("{name}({args})");
        let create = format!(
            "DO $tower_lock$ BEGIN IF to_regprocedure('{signature}') IS NULL THEN \
             CREATE FUNCTION {signature} RETURNS TABLE ({returns}) LANGUAGE plpgsql \
             AS $body$ {body} $body$; END IF; END $tower_lock$"
        );
        let placeholders: Vec<String> = (1..=params.len()).map(|i| format!("${i}")).collect();
        let call = format!("SELECT * FROM {name}({})", placeholders.join(", "));
        Routine {
            create,
            call,
            signature,
            source: format!(" {body} "),
        }
    }
}

/// FNV-1a, 64 bits: a hash that stays the same from one build to the next.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Sql {
    pub(super) fn new(table: &str, sequence: &str, channel: &str) -> Self {
        let expiry = "clock_timestamp() + $3 * interval '1 millisecond'";
        let then = "(EXCLUDED.expires_at - $3 * interval '1 millisecond')";
        let left = "ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::int8";
        // Takes the row over if expired, or else marks it wanted. Every
        // test of expiry compares with one instant, the statement's
        // `VALUES` time (the new expiry less the lease): asked once per
        // column, the clock could move between them and keep the old owner
        // with the new expiry. The token is drawn once the row is written
        // and locked (`RETURNING` runs after the write), so any later grant
        // of the key draws after it; a value drawn in `VALUES` could
        // predate a grant made meanwhile. So it is not stored in the row.
        // Also returns the holder's time left, for a busy key.
        let take = format!(
            "ON CONFLICT (key) DO UPDATE SET \
             owner = CASE WHEN l.expires_at <= {then} THEN EXCLUDED.owner ELSE l.owner END, \
             expires_at = CASE WHEN l.expires_at <= {then} \
             THEN EXCLUDED.expires_at ELSE l.expires_at END, \
             wanted = l.expires_at > {then} \
             RETURNING CASE WHEN l.owner = $2 THEN nextval('{sequence}') END AS token, \
             {left} AS left_ms"
        );
        // One statement: insert the row, or take it over if expired, or
        // else mark it wanted (so that its release notifies).
        let acquire = format!(
            "INSERT INTO {table} AS l (key, owner, expires_at) VALUES ($1, $2, {expiry}) {take}"
        );
        // A waiter's tries (every one after its first): the row is
        // inserted, or nothing happens. A conflict with the row of
        // whoever won locks nothing and writes nothing, so the waiters a
        // release wakes do not queue on the row, each with a commit and
        // its WAL flush, ahead of the winner's release. A waiter's row
        // is marked wanted from the start, as others likely wait too:
        // its release notifies (once, in vain, if none is left).
        let join = format!(
            "INSERT INTO {table} (key, owner, expires_at, wanted) \
             VALUES ($1, $2, {expiry}, true) \
             ON CONFLICT (key) DO NOTHING RETURNING nextval('{sequence}')"
        );
        // Then, if the row was there: the acquire statement (its row
        // marked, as `join`'s), unless the row is seen held, unexpired
        // and already marked wanted. Its release then notifies, and the
        // statement only reads the holder's time left. Seen in the
        // statement's snapshot: a release committed since then notifies
        // too, after the waiter armed its wake-up.
        let acquire_waiting = format!(
            "WITH seen AS (SELECT {left} AS left_ms FROM {table} \
             WHERE key = $1 AND wanted AND expires_at > clock_timestamp()), \
             tried AS (INSERT INTO {table} AS l (key, owner, expires_at, wanted) \
             SELECT $1, $2, {expiry}, true WHERE NOT EXISTS (SELECT FROM seen) {take}) \
             SELECT token, left_ms FROM tried UNION ALL SELECT NULL::int8, left_ms FROM seen"
        );
        let renew = format!(
            "UPDATE {table} SET expires_at = {expiry} \
             WHERE key = $1 AND owner = $2 AND expires_at > clock_timestamp() RETURNING 1"
        );
        // Notifies only if a waiter marked the row.
        let release = format!(
            "DELETE FROM {table} WHERE key = $1 AND owner = $2 \
             RETURNING CASE WHEN wanted THEN pg_notify('{channel}', key) END IS NULL"
        );
        Sql {
            list: format!(
                "SELECT key FROM {table} WHERE starts_with(key, $1) \
                 AND expires_at > clock_timestamp() ORDER BY key"
            ),
            inspect: format!(
                "SELECT owner, (EXTRACT(EPOCH FROM expires_at - clock_timestamp()) * 1000)::bigint \
                 FROM {table} WHERE key = $1 AND expires_at > clock_timestamp()"
            ),
            create: format!(
                "CREATE SEQUENCE IF NOT EXISTS {sequence}; \
                 CREATE TABLE IF NOT EXISTS {table} (\
                 key text PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL, \
                 wanted boolean NOT NULL DEFAULT false); \
                 ALTER TABLE {table} ADD COLUMN IF NOT EXISTS wanted boolean NOT NULL DEFAULT false"
            ),
            acquire,
            join,
            acquire_waiting,
            renew,
            release,
            sweep: format!(
                "DELETE FROM {table} WHERE expires_at < clock_timestamp() \
                 RETURNING CASE WHEN wanted THEN pg_notify('{channel}', key) END IS NULL"
            ),
            probe: format!("SELECT pg_notify('{channel}', $1)"),
            listen: format!("LISTEN \"{channel}\""),
        }
    }
}

impl Sql {
    /// The per-lock statements as functions of `schema` (the table's), in
    /// the order of `Stmt`: `acquire`, `join`, `acquire_waiting`, `renew`,
    /// `release`.
    pub(super) fn routines(&self, schema: &str) -> [Routine; 5] {
        let (key_owner_lease, key_owner) = (["text", "text", "int8"], ["text", "text"]);
        let both = "token int8, left_ms int8";
        [
            Routine::new(schema, &self.acquire, &key_owner_lease, both),
            Routine::new(schema, &self.join, &key_owner_lease, "token int8"),
            Routine::new(schema, &self.acquire_waiting, &key_owner_lease, both),
            Routine::new(schema, &self.renew, &key_owner_lease, "renewed int4"),
            Routine::new(schema, &self.release, &key_owner, "quiet boolean"),
        ]
    }
}
