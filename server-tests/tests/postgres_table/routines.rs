//! Statements sent unnamed (through the pooler) call the functions the
//! backend creates beside its table. The test has a table of its own: it
//! breaks and drops that table's functions.

use super::*;

/// The functions of `table`: their signatures and bodies (which name it).
async fn functions(client: &tokio_postgres::Client, table: &str) -> Vec<(String, String)> {
    client
        .query(
            "SELECT p.oid::regprocedure::text, p.prosrc FROM pg_proc p \
             WHERE p.proname LIKE 'tower_lock\\_%' AND p.prosrc LIKE '%' || $1 || ' %'",
            &[&table],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

async fn drop_all(client: &tokio_postgres::Client, table: &str) {
    for (signature, _) in functions(client, table).await {
        client
            .batch_execute(&format!("DROP FUNCTION IF EXISTS {signature}"))
            .await
            .unwrap();
    }
    client
        .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
        .await
        .unwrap();
}

#[tokio::test]
async fn statements_through_the_pooler_call_the_tables_functions() {
    const OWN: &str = "tower_lock_fn_called";
    let admin = raw().await;
    drop_all(&admin, OWN).await;
    let k = key("routines", "k");
    let backend = connect(
        &bouncer_url(),
        PostgresOptions::default()
            .lease_table(OWN)
            .listen_url(pg_url()),
    )
    .await;
    backend
        .lock(k.as_str())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let made = functions(&admin, OWN).await;
    assert_eq!(made.len(), 5, "one function per statement: {made:?}");
    // The acquire statement's function, made to fail: the next acquire
    // through the pooler fails with it, so it called the function.
    let (acquire, _) = made
        .iter()
        .find(|(_, body)| body.contains(&format!("RETURN QUERY INSERT INTO {OWN} AS l")))
        .expect("the acquire statement's function");
    admin
        .batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION {acquire} RETURNS TABLE (token int8, left_ms int8) \
             LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'sabotaged {OWN} '; END $$"
        ))
        .await
        .unwrap();
    let broken = backend.lock(k.as_str()).await;
    assert!(
        matches!(&broken, Err(LockError::Backend { .. })),
        "{broken:?}"
    );
    drop(broken);
    backend.flush().await;
    drop_all(&admin, OWN).await;
}
