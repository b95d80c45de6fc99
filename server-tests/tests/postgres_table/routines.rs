//! Statements sent unnamed (through the pooler) call the functions the
//! backend creates beside its table, only while they are the ones it
//! made. Each test has a table of its own: it breaks or replaces that
//! table's functions.

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

/// Statements through the pooler, on `table`.
async fn bounced_to(table: &str) -> PostgresBackend {
    let options = PostgresOptions::default().lease_table(table);
    connect(&bouncer_url(), options.listen_url(pg_url())).await
}

/// Gives the acquire statement's function of `table` (among `made`) the
/// body `body` (which names the table, for [`drop_all`]); its signature.
async fn replace_acquire(
    client: &tokio_postgres::Client,
    table: &str,
    made: &[(String, String)],
    body: &str,
) -> String {
    let (acquire, _) = made
        .iter()
        .find(|(_, src)| src.contains(&format!("RETURN QUERY INSERT INTO {table} AS l")))
        .expect("the acquire statement's function");
    client
        .batch_execute(&format!(
            "CREATE OR REPLACE FUNCTION {acquire} RETURNS TABLE (token int8, left_ms int8) \
             LANGUAGE plpgsql AS $$ BEGIN {body} END $$"
        ))
        .await
        .unwrap();
    acquire.clone()
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
    let backend = bounced_to(OWN).await;
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
    let acquire = replace_acquire(
        &admin,
        OWN,
        &made,
        &format!("RAISE EXCEPTION 'sabotaged {OWN} ';"),
    )
    .await;
    let broken = backend.lock(k.as_str()).await;
    assert!(
        matches!(&broken, Err(LockError::Backend { .. })),
        "{broken:?}"
    );
    drop(broken);
    // Dropped (by an operator, say): the backend gives its functions up
    // and sends the statements, without making them again.
    admin
        .batch_execute(&format!("DROP FUNCTION {acquire}"))
        .await
        .unwrap();
    for _ in 0..3 {
        let held = backend.lock(k.as_str()).await.unwrap();
        assert_eq!(rows_of_in(&admin, OWN, &k).await, 1);
        held.release().await.unwrap();
    }
    assert_eq!(functions(&admin, OWN).await.len(), 4);
    backend.flush().await;
    assert_eq!(rows_of_in(&admin, OWN, &k).await, 0);
    drop_all(&admin, OWN).await;
}

/// A function of the right name whose body is not the one this version
/// makes (planted by whoever could create in the schema) is not called.
#[tokio::test]
async fn a_function_with_another_body_is_not_trusted() {
    const OWN: &str = "tower_lock_fn_planted";
    let admin = raw().await;
    drop_all(&admin, OWN).await;
    let maker = connect(&pg_url(), PostgresOptions::default().lease_table(OWN)).await;
    maker.flush().await;
    drop(maker);
    let made = functions(&admin, OWN).await;
    // Grants anything, writes nothing.
    replace_acquire(
        &admin,
        OWN,
        &made,
        &format!("RETURN QUERY SELECT 999999::int8, NULL::int8; PERFORM '{OWN} ';"),
    )
    .await;
    let backend = bounced_to(OWN).await;
    let k = key("planted", "k");
    let held = backend.lock(k.as_str()).await.unwrap();
    assert_ne!(held.token().get(), 999999);
    assert_eq!(rows_of_in(&admin, OWN, &k).await, 1);
    held.release().await.unwrap();
    backend.flush().await;
    drop_all(&admin, OWN).await;
}

async fn rows_of_in(client: &tokio_postgres::Client, table: &str, key: &str) -> i64 {
    client
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE key = $1"),
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}
