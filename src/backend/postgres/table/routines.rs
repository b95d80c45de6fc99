//! The per-lock statements as functions ([`Routine`]): made at start-up,
//! checked before they are trusted, and given up if they stop working.

use std::sync::atomic::Ordering;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::LeaseTable;
use crate::backend::postgres::session::{create_racing, pg_error};
use crate::backend::postgres::table_sql::Routine;

/// The table's schema, as PostgreSQL writes it.
const SCHEMA: &str = "SELECT relnamespace::regnamespace::text FROM pg_class \
     WHERE oid = to_regclass($1)";

/// Whether the function `$1` is the one this version made (body `$2`),
/// owned by this role or by the table's (`$3`) owner, and runs here: a
/// function of the same name anyone else put there could grant anything.
const TRUSTED: &str = "SELECT 1 FROM pg_proc p WHERE p.oid = to_regprocedure($1) \
     AND p.prosrc = $2 AND has_function_privilege(p.oid, 'EXECUTE') \
     AND p.proowner IN (SELECT oid FROM pg_roles WHERE rolname = current_user \
     UNION ALL SELECT relowner FROM pg_class WHERE oid = to_regclass($3))";

impl LeaseTable {
    /// Makes the functions where missing and uses them if they are
    /// trusted; else the statements are sent as they are, which costs the
    /// server more only where they go unnamed (through a pooler).
    pub(super) async fn create_routines(&self, client: &Client) {
        match self.trusted_routines(client).await {
            Ok(routines) => {
                // Set once, at start-up.
                let _ = self.routines.set(routines);
                self.routines_on.store(true, Ordering::Release);
            }
            Err(why) => tracing::info!(
                reason = %why,
                "the lease table's statements are sent as they are, not as functions"
            ),
        }
    }

    async fn trusted_routines(&self, client: &Client) -> Result<[Routine; 5], String> {
        let text = |e| pg_error("making the lease table's functions", e).to_string();
        let table = || (&self.table as &(dyn ToSql + Sync), Type::TEXT);
        let rows = client.query_typed(SCHEMA, &[table()]).await.map_err(text)?;
        let schema: String = rows.first().ok_or("the table is not found")?.get(0);
        let routines = self.sql.routines(&schema);
        let create: Vec<&str> = routines.iter().map(|r| &*r.create).collect();
        create_racing(client, &create.join("; "))
            .await
            .map_err(text)?;
        for r in &routines {
            let trusted = client
                .query_typed(
                    TRUSTED,
                    &[(&r.signature, Type::TEXT), (&r.source, Type::TEXT), table()],
                )
                .await
                .map_err(text)?;
            if trusted.is_empty() {
                return Err(format!(
                    "{} is not the function this version makes, or is owned by neither this \
                     role nor the table's owner, or may not be run by this role",
                    r.signature
                ));
            }
        }
        Ok(routines)
    }

    /// The call of statement `i`'s function, while they are used.
    pub(super) fn routine(&self, i: usize) -> Option<&str> {
        if !self.routines_on.load(Ordering::Acquire) {
            return None;
        }
        Some(&self.routines.get()?[i].call)
    }

    /// Whether a call failed because its function is gone or may not be
    /// run here any more (an operator dropped it or revoked the right):
    /// then the functions are given up, and the statement, which the
    /// failed call did not run, may be sent itself.
    pub(super) fn gives_up_routines(&self, e: &tokio_postgres::Error) -> bool {
        let gone = [
            SqlState::UNDEFINED_FUNCTION,
            SqlState::INSUFFICIENT_PRIVILEGE,
        ];
        if !e.code().is_some_and(|c| gone.contains(c)) {
            return false;
        }
        if self.routines_on.swap(false, Ordering::AcqRel) {
            tracing::info!(
                error = %e,
                "the lease table's functions are given up: its statements are sent as they are"
            );
        }
        true
    }
}
