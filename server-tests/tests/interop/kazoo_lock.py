#!/usr/bin/python3
"""Holds or tries kazoo's Lock on a path, for the coexistence tests.

    kazoo_lock.py <host:port> <path> hold      prints "held", waits for a
                                                line on stdin, releases
    kazoo_lock.py <host:port> <path> try <ms>  prints "acquired" or "timeout"

The lock is told to treat Curator-style nodes (which tower-lock writes) as
contenders; without extra_lock_patterns kazoo would ignore them.
"""
import sys

from kazoo.client import KazooClient
from kazoo.exceptions import LockTimeout

hosts, path, action = sys.argv[1], sys.argv[2], sys.argv[3]
zk = KazooClient(hosts=hosts)
zk.start()
lock = zk.Lock(path, extra_lock_patterns=["-lock-", "__WRIT__", "__READ__"])
if action == "hold":
    lock.acquire()
    print("held", flush=True)
    sys.stdin.readline()
    lock.release()
    print("released", flush=True)
else:
    try:
        lock.acquire(timeout=int(sys.argv[4]) / 1000)
        print("acquired", flush=True)
        lock.release()
    except LockTimeout:
        print("timeout", flush=True)
zk.stop()
