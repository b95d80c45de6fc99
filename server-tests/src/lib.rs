//! The tests of tower-lock that need a server, in `tests/`: this package
//! holds no library code of its own. It is a workspace member so that the
//! drivers the tests use to look at each server (redis, zookeeper-client,
//! tokio-postgres, mysql_async, etcd-client) are built only when these tests
//! are, never for the library's own examples.
//!
//! ```text
//! scripts/test-all.sh                                   # starts the servers, runs everything
//! cargo test -p tower-lock-server-tests --test postgres # one suite, against a running server
//! ```
