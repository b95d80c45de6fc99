#!/usr/bin/python3
"""kazoo's Lock measured like tower-lock's bench program, same output format.

    /usr/bin/python3 bench/peers/kazoo_lock.py --backend zk://127.0.0.1:PORT --workload uncontended --n 2000
    /usr/bin/python3 bench/peers/kazoo_lock.py --backend zk://127.0.0.1:PORT --workload contended --secs 5 --workers 8

Contended workers are threads of one process sharing one client (one
session), as a kazoo application would.
"""
import argparse
import threading
import time

from kazoo.client import KazooClient


def pct(sorted_values, p):
    i = max(1, min(len(sorted_values), int(-(-len(sorted_values) * p // 1)))) - 1
    return sorted_values[i]


def us(seconds):
    v = seconds * 1e6
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def client(url):
    zk = KazooClient(hosts=url.removeprefix("zk://").split("/")[0])
    zk.start()
    return zk


def uncontended(url, n):
    zk = client(url)
    lock = zk.Lock("/bench-kazoo/uncontended")
    for _ in range(50):
        lock.acquire()
        lock.release()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        lock.acquire()
        lock.release()
        samples.append(time.perf_counter() - t)
    samples.sort()
    zk.stop()
    return f"n={n} p50_us={us(pct(samples, 0.5))} p99_us={us(pct(samples, 0.99))}"


def contended(url, workers, secs):
    zk = client(url)
    stop = threading.Event()
    inside = [0]
    overlaps = [0]
    guard = threading.Lock()
    results = []

    def worker():
        cycles, waits = 0, []
        while not stop.is_set():
            lock = zk.Lock("/bench-kazoo/contended")
            t = time.perf_counter()
            lock.acquire()
            waits.append(time.perf_counter() - t)
            with guard:
                inside[0] += 1
                if inside[0] != 1:
                    overlaps[0] += 1
                inside[0] -= 1
            lock.release()
            cycles += 1
        results.append((cycles, waits))

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(secs)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    zk.stop()
    counts = [c for c, _ in results]
    waits = sorted(w for _, ws in results for w in ws)
    return (
        f"workers={workers} secs={secs} cycles_per_s={sum(counts) / elapsed:.0f} "
        f"wait_p50_us={us(pct(waits, 0.5))} wait_p99_us={us(pct(waits, 0.99))} "
        f"per_worker_min={min(counts)} per_worker_max={max(counts)} overlaps={overlaps[0]}"
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--workload", required=True, choices=["uncontended", "contended"])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--secs", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    a = p.parse_args()
    if a.workload == "uncontended":
        line = uncontended(a.backend, a.n)
    else:
        line = contended(a.backend, a.workers, a.secs)
    print(f"impl=kazoo backend=zookeeper workload={a.workload} {line}")


if __name__ == "__main__":
    main()
