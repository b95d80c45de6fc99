#!/usr/bin/python3
"""redis-py's Lock measured like tower-lock's bench program, same output
format (the shared harness and its critical section: peer_harness.py).

    /usr/bin/python3 bench/peers/redis_py_lock.py --backend redis://127.0.0.1:PORT --workload uncontended --n 5000
    /usr/bin/python3 bench/peers/redis_py_lock.py --backend redis://127.0.0.1:PORT --workload contended --secs 5 --workers 8
    /usr/bin/python3 bench/peers/redis_py_lock.py --backend redis://127.0.0.1:PORT --workload contended --secs 5 --no-lock

Contended workers are threads of one process, each with its own connection,
blocking with redis-py's own retry loop (sleep=0.001 s rather than the
default 0.1 s, which would only make it look slower). Every release is
redis-py's lock.release(), which waits for the server's answer.
"""
import redis

from peer_harness import run


def worker_locks(url):
    r = redis.Redis.from_url(url)
    return lambda: r.lock("bench:redis-py:contended", timeout=30, sleep=0.001)


if __name__ == "__main__":
    run(
        impl="redis-py",
        backend="redis",
        default_n=5000,
        connect=lambda url: url,
        uncontended_lock=lambda url: redis.Redis.from_url(url).lock(
            "bench:redis-py:uncontended", timeout=30
        ),
        worker_locks=worker_locks,
        close=lambda url: None,
    )
