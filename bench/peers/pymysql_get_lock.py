#!/usr/bin/python3
"""The MariaDB GET_LOCK lock teams write by hand, measured like tower-lock's
bench program, same output format (the shared harness and its critical
section: peer_harness.py).

    /usr/bin/python3 bench/peers/pymysql_get_lock.py --backend mysql://root@127.0.0.1:3306/test --workload uncontended --n 2000
    /usr/bin/python3 bench/peers/pymysql_get_lock.py --backend mysql://root@127.0.0.1:3306/test --workload contended --secs 5 --workers 8

PyMySQL in autocommit mode: acquire is `SELECT GET_LOCK(key, 30)`, which
waits in the server, release `SELECT RELEASE_LOCK(key)`; one connection per
worker thread, as the lock lives with the connection.
"""
from urllib.parse import urlparse

import pymysql

from peer_harness import run


class GetLock:
    def __init__(self, conn, key):
        self.cur = conn.cursor()
        self.key = key

    def acquire(self):
        self.cur.execute("SELECT GET_LOCK(%s, 30)", (self.key,))
        if self.cur.fetchone()[0] != 1:
            raise RuntimeError("GET_LOCK timed out")

    def release(self):
        self.cur.execute("SELECT RELEASE_LOCK(%s)", (self.key,))
        self.cur.fetchone()


def connect(url):
    u = urlparse(url)
    return pymysql.connect(
        host=u.hostname,
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        database=u.path.lstrip("/") or None,
        autocommit=True,
    )


def worker_locks(url):
    lock = GetLock(connect(url), "bench:pymysql:contended")
    return lambda: lock


if __name__ == "__main__":
    run(
        impl="pymysql",
        backend="mysql",
        default_n=2000,
        connect=lambda url: url,
        uncontended_lock=lambda url: GetLock(connect(url), "bench:pymysql:uncontended"),
        worker_locks=worker_locks,
        close=lambda url: None,
    )
