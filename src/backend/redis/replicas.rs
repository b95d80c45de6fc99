//! Waiting for replicas: `WAIT` after each write, in the same round trip
//! (see [`RedisOptions::wait_for_replicas`](super::RedisOptions::wait_for_replicas)).

use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, RedisFuture, Value};

use super::connection::Link;
use crate::error::LockError;

/// How many replicas must have a write, and how long to wait for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Replicas {
    pub(super) count: u32,
    pub(super) timeout: Duration,
}

/// A connection that sends `WAIT count timeout` right behind every
/// command, pipelined on the same connection (on a Redis Cluster, to the
/// master of the command's keys), and keeps the number of
/// replicas that acknowledged. A script the server does not have yet
/// (`NOSCRIPT`, answered before the `WAIT`) is sent again as `EVAL`
/// through this same wrapper, so the last `WAIT` always follows the
/// write.
pub(super) struct Acked<'a> {
    conn: &'a mut Link,
    replicas: Replicas,
    acked: u32,
}

impl<'a> Acked<'a> {
    pub(super) fn new(conn: &'a mut Link, replicas: Replicas) -> Self {
        Acked {
            conn,
            replicas,
            acked: 0,
        }
    }

    /// Fails unless enough replicas acknowledged the last command.
    pub(super) fn check(&self, what: &str) -> Result<(), LockError> {
        if self.acked >= self.replicas.count {
            return Ok(());
        }
        Err(LockError::backend(
            "redis",
            format!(
                "{} of {} replicas acknowledged {what} within {} ms: a failover could lose it",
                self.acked,
                self.replicas.count,
                self.replicas.timeout.as_millis()
            ),
            None,
        ))
    }
}

impl ConnectionLike for Acked<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut pipe = redis::pipe();
            pipe.add_command(cmd.clone())
                .cmd("WAIT")
                .arg(self.replicas.count)
                .arg(self.replicas.timeout.as_millis() as u64);
            let mut answers = self.conn.req_packed_commands(&pipe, 0, 2).await?;
            let wait = answers.pop();
            let answer = answers.pop().unwrap_or(Value::Nil).extract_error()?;
            self.acked = match wait {
                Some(Value::Int(n)) => u32::try_from(n).unwrap_or(0),
                _ => 0,
            };
            Ok(answer)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        // Not used: every lock command is a single script call.
        self.conn.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}
