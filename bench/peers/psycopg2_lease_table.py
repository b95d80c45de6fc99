#!/usr/bin/python3
"""The lease-table lock teams write by hand (ShedLock's statement), measured
like tower-lock's bench program, same output format (the shared harness and
its critical section: peer_harness.py).

    /usr/bin/python3 bench/peers/psycopg2_lease_table.py --backend "postgres://postgres@127.0.0.1:5432/test?lease_table" --workload uncontended --n 2000
    /usr/bin/python3 bench/peers/psycopg2_lease_table.py --backend "postgres://postgres@127.0.0.1:5432/test?lease_table" --workload contended --secs 5 --workers 8

psycopg2 in autocommit mode on a table of its own, `(key primary key,
owner, expires_at)`: acquire is one `INSERT ... ON CONFLICT (key) DO UPDATE
... WHERE expires_at <= now() RETURNING key`, tried again every millisecond
while it returns nothing (a table has no way to wait); release deletes the
row by owner. One connection per worker thread.
"""
import sys
import time
import uuid

import psycopg2

from peer_harness import run

TABLE = "bench_psycopg2_leases"


class LeaseRow:
    def __init__(self, conn, key):
        self.cur = conn.cursor()
        self.key = key
        self.owner = uuid.uuid4().hex

    def acquire(self):
        while True:
            self.cur.execute(
                f"INSERT INTO {TABLE} AS l (key, owner, expires_at) "
                "VALUES (%s, %s, now() + interval '10 seconds') "
                "ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, "
                "expires_at = EXCLUDED.expires_at WHERE l.expires_at <= now() RETURNING key",
                (self.key, self.owner),
            )
            if self.cur.fetchone() is not None:
                return
            time.sleep(0.001)

    def release(self):
        self.cur.execute(f"DELETE FROM {TABLE} WHERE key = %s AND owner = %s", (self.key, self.owner))


def plain(url):
    """The URL without tower-lock's own `lease_table` parameter."""
    base, _, query = url.partition("?")
    rest = [p for p in query.split("&") if p and not p.startswith("lease_table")]
    return base + ("?" + "&".join(rest) if rest else "")


def connect(url):
    conn = psycopg2.connect(plain(url))
    conn.autocommit = True
    return conn


def setup(url):
    conn = connect(url)
    cur = conn.cursor()
    # Processes of a group (processes.py) start together; two concurrent
    # CREATE TABLE IF NOT EXISTS can still collide in the catalog.
    cur.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (TABLE,))
    cur.execute(
        f"CREATE TABLE IF NOT EXISTS {TABLE} "
        "(key text PRIMARY KEY, owner text NOT NULL, expires_at timestamptz NOT NULL)"
    )
    conn.close()
    return url


def close(url):
    # One process of a group leaves the table to the others still running;
    # every release has deleted its row.
    if "--section-log" in sys.argv:
        return
    conn = connect(url)
    conn.cursor().execute(f"DROP TABLE IF EXISTS {TABLE}")
    conn.close()


if __name__ == "__main__":
    run(
        impl="psycopg2-lease-table",
        backend="postgres",
        default_n=2000,
        connect=setup,
        uncontended_lock=lambda url: LeaseRow(connect(url), "bench:psycopg2:uncontended"),
        worker_locks=lambda url: (lambda conn: (lambda: LeaseRow(conn, "bench:psycopg2:contended")))(connect(url)),
        close=close,
        setting=" mode=lease-table",
    )
