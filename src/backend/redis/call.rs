//! Calling a Lua script: `EVALSHA` with its keys and arguments written
//! straight into the command, and `EVAL` with its text where the server
//! does not have it yet.

use std::io::Write;

use redis::aio::ConnectionLike;
use redis::{
    Arg, Cmd, ErrorKind, FromRedisValue, RedisResult, RedisWrite, Script, ServerErrorKind,
    ToRedisArgs,
};

/// The arguments (past the keys) and bytes a script call is sized for.
const CALL_ARGS: usize = 8;
const CALL_BYTES: usize = 384;

/// A Lua script: its text and SHA1.
pub(super) struct Lua {
    body: String,
    hash: String,
}

impl Lua {
    pub(super) fn new(body: String) -> Self {
        let hash = Script::new(&body).get_hash().to_owned();
        Lua { body, hash }
    }

    /// A call of the script with `keys` keys, which are written first, then
    /// its arguments.
    pub(super) fn call(&self, keys: usize) -> Call<'_> {
        // Sized once for a typical call (a script's keys and arguments come
        // to a few hundred bytes): grown from empty, the buffers were
        // reallocated a dozen times per lock, a fifth of its client cost.
        let mut cmd = Cmd::with_capacity(3 + keys + CALL_ARGS, CALL_BYTES);
        cmd.arg("EVALSHA").arg(&self.hash).arg(keys);
        Call {
            lua: self,
            cmd,
            keys_left: keys,
        }
    }
}

/// A script's call: `EVALSHA`, and `EVAL` with the text where the server
/// does not have it yet (not `SCRIPT LOAD`: a Redis Cluster sends that to
/// every node, and one down fails it).
///
/// Written straight into the command, the keys without formatting: it is
/// built twice for every lock.
pub(super) struct Call<'a> {
    lua: &'a Lua,
    cmd: Cmd,
    /// Keys still to write before the first argument.
    keys_left: usize,
}

impl Call<'_> {
    pub(super) fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        debug_assert!(
            self.keys_left >= key.num_of_args(),
            "more keys than declared"
        );
        self.keys_left = self.keys_left.saturating_sub(key.num_of_args());
        key.write_redis_args(&mut self.cmd);
        self
    }

    /// The key named `name` followed by `suffix`.
    pub(super) fn key_suffixed(&mut self, name: &str, suffix: &str) -> &mut Self {
        self.key(Suffixed(name, suffix))
    }

    pub(super) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        debug_assert_eq!(self.keys_left, 0, "an argument before the last key");
        arg.write_redis_args(&mut self.cmd);
        self
    }

    pub(super) async fn invoke<T: FromRedisValue, C: ConnectionLike>(
        &self,
        conn: &mut C,
    ) -> RedisResult<T> {
        debug_assert_eq!(self.keys_left, 0, "fewer keys than declared");
        match self.cmd.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(&self.lua.body);
                // Past `EVALSHA` and the hash: the key count, keys, args.
                for arg in self.cmd.args_iter().skip(2) {
                    if let Arg::Simple(arg) = arg {
                        eval.arg(arg);
                    }
                }
                eval.query_async(conn).await
            }
            result => result,
        }
    }
}

/// A name and a suffix, written as one argument without formatting.
pub(super) struct Suffixed<'a>(pub(super) &'a str, pub(super) &'a str);

impl ToRedisArgs for Suffixed<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        write_joined(out, &[self.0.as_bytes(), self.1.as_bytes()]);
    }
}

/// Writes `parts` as one argument, joined on the stack: a lock names a
/// dozen keys and a few composite arguments, and the command's writer for
/// an argument in pieces cost some 150 instructions each more.
fn write_joined<W: ?Sized + RedisWrite>(out: &mut W, parts: &[&[u8]]) {
    let mut joined = [0u8; 160];
    let len = parts.iter().map(|p| p.len()).sum::<usize>();
    if len > joined.len() {
        let mut arg = out.writer_for_next_arg();
        for part in parts {
            // Writes to a command's buffer cannot fail.
            let _ = arg.write_all(part);
        }
        return;
    }
    let mut at = 0;
    for part in parts {
        joined[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    out.write_arg(&joined[..len]);
}
