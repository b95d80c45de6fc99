#!/usr/bin/python3
"""kazoo's Lock measured like tower-lock's bench program, same output format
(the shared harness and its critical section: peer_harness.py).

    /usr/bin/python3 bench/peers/kazoo_lock.py --backend zk://127.0.0.1:PORT --workload uncontended --n 2000
    /usr/bin/python3 bench/peers/kazoo_lock.py --backend zk://127.0.0.1:PORT --workload contended --secs 5 --workers 8
    /usr/bin/python3 bench/peers/kazoo_lock.py --backend zk://127.0.0.1:PORT --workload contended --secs 5 --no-lock

Contended workers are threads of one process sharing one client (one
session), as a kazoo application would. Every release is kazoo's
lock.release(), which deletes the lock node and waits for the answer.
"""
from kazoo.client import KazooClient

from peer_harness import run


def connect(url):
    zk = KazooClient(hosts=url.removeprefix("zk://").split("/")[0])
    zk.start()
    return zk


if __name__ == "__main__":
    run(
        impl="kazoo",
        backend="zookeeper",
        default_n=2000,
        connect=connect,
        uncontended_lock=lambda zk: zk.Lock("/bench-kazoo/uncontended"),
        worker_locks=lambda zk: lambda: zk.Lock("/bench-kazoo/contended"),
        close=lambda zk: zk.stop(),
    )
