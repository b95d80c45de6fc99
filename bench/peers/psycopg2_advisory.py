#!/usr/bin/python3
"""The PostgreSQL advisory lock teams write by hand, measured like
tower-lock's bench program, same output format (the shared harness and its
critical section: peer_harness.py).

    /usr/bin/python3 bench/peers/psycopg2_advisory.py --backend postgres://postgres@127.0.0.1:5432/test --workload uncontended --n 2000
    /usr/bin/python3 bench/peers/psycopg2_advisory.py --backend postgres://postgres@127.0.0.1:5432/test --workload contended --secs 5 --workers 8

psycopg2 in autocommit mode: acquire is `SELECT pg_advisory_lock(
hashtextextended(key, 0))`, which waits in the server, release is
`SELECT pg_advisory_unlock(...)`; one connection per worker thread, as the
lock lives with the session. Keys are hashed the way tower-lock hashes them,
so the two take the same locks.
"""
import psycopg2

from peer_harness import run


class AdvisoryLock:
    def __init__(self, conn, key):
        self.cur = conn.cursor()
        self.key = key

    def acquire(self):
        self.cur.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (self.key,))
        self.cur.fetchone()

    def release(self):
        self.cur.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (self.key,))
        self.cur.fetchone()


def connect(url):
    conn = psycopg2.connect(url)
    conn.autocommit = True
    return conn


def worker_locks(url):
    lock = AdvisoryLock(connect(url), "bench:psycopg2:contended")
    return lambda: lock


if __name__ == "__main__":
    run(
        impl="psycopg2",
        backend="postgres",
        default_n=2000,
        connect=lambda url: url,
        uncontended_lock=lambda url: AdvisoryLock(connect(url), "bench:psycopg2:uncontended"),
        worker_locks=worker_locks,
        close=lambda url: None,
    )
