"""What the Python peers share: the workloads of tower-lock's bench program,
its critical section and its output format. A peer supplies only how it
connects and makes a lock (see run()).

The critical section of a contended cycle has no client-side lock around its
check: the thread adds its id to a set shared by all workers (set operations
are atomic under the GIL), counts an overlap if another thread is in the set,
then yields once (time.sleep(0), `--hold-us 0`, the default) or sleeps
`--hold-us` µs so that a second holder could run while it is inside, then
discards its id and releases. Cycles begun in the first 500 ms are a warm-up
and not counted; cycles_per_s is the counted cycles over the time they took
(end of warm-up until the last of them ended). Overlaps are counted over the
whole run. Uncontended times N acquire+release after 50 untimed ones.

`--no-lock` is the negative control: the same loop without the lock. It must
report overlaps>0, which proves the check can fail.

`--section-log FILE` makes the process one of several on the same key, run by
bench/peers/processes.py: each holder also appends `E <pid> <unix_ns>` to FILE
once it holds the lock and `L <pid> <unix_ns>` before it releases, in one
write each (O_APPEND), so that the runner sees overlaps between processes and
counts every process's cycles over the same span of time.
"""
import argparse
import os
import threading
import time

# Cycles begun this long after the workers start are the first counted, as in
# tower-lock's bench program.
WARM_UP_S = 0.5


def pct(sorted_values, p):
    i = max(1, min(len(sorted_values), int(-(-len(sorted_values) * p // 1)))) - 1
    return sorted_values[i]


def us(seconds):
    v = seconds * 1e6
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def uncontended(lock, n):
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
    return f"n={n} p50_us={us(pct(samples, 0.5))} p99_us={us(pct(samples, 0.99))}"


def contended(worker_locks, workers, secs, hold_us, use_lock, section_log=None):
    """worker_locks() is called in each worker thread and returns a function
    that makes a fresh lock for one cycle; section_log, a file descriptor
    opened for appending, or None."""
    pid = os.getpid()

    def log(what):
        if section_log is not None:
            os.write(section_log, f"{what} {pid} {time.time_ns()}\n".encode())
    stop = threading.Event()
    counting = threading.Event()
    # The ids of the threads inside the critical section. set.add, set.discard
    # and len are each atomic under the GIL; nothing else guards the check.
    inside = set()
    # One entry per overlap: list.append is atomic under the GIL, where
    # `n += 1` could lose a count.
    overlaps = []
    hold = hold_us / 1e6
    results = []

    def worker():
        new_lock = worker_locks()
        me = threading.get_ident()
        cycles, waits = 0, []
        while not stop.is_set():
            counted = counting.is_set()
            lock = new_lock()
            t = time.perf_counter()
            if use_lock:
                lock.acquire()
            waited = time.perf_counter() - t
            log("E")
            inside.add(me)
            if len(inside) > 1:
                overlaps.append(me)
            time.sleep(hold)
            inside.discard(me)
            log("L")
            if use_lock:
                lock.release()
            if counted:
                waits.append(waited)
                cycles += 1
        results.append((cycles, waits))

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    time.sleep(WARM_UP_S)
    counting.set()
    started = time.perf_counter()
    time.sleep(secs)
    stop.set()
    for t in threads:
        t.join()
    # Cycles begun before the stop are counted, so is the time they took.
    elapsed = time.perf_counter() - started
    counts = [c for c, _ in results]
    waits = sorted(w for _, ws in results for w in ws)
    return (
        f"workers={workers} secs={secs} cycles_per_s={sum(counts) / elapsed:.0f} "
        f"wait_p50_us={us(pct(waits, 0.5))} wait_p99_us={us(pct(waits, 0.99))} "
        f"per_worker_min={min(counts)} per_worker_max={max(counts)} overlaps={len(overlaps)}"
    )


def run(impl, backend, default_n, connect, uncontended_lock, worker_locks, close, setting=""):
    """Parses the command line, runs the workload, prints the result line.

    connect(url) opens what the run shares; uncontended_lock(shared) is the
    lock the uncontended workload cycles; worker_locks(shared) is called in
    each contended worker and returns a function making one cycle's lock;
    close(shared) ends the run. setting (" name=value") follows the
    workload on the line, as the bench program's settings do.
    """
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--workload", required=True, choices=["uncontended", "contended"])
    p.add_argument("--n", type=int, default=default_n)
    p.add_argument("--secs", type=int, default=5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--hold-us", type=int, default=0)
    p.add_argument("--no-lock", action="store_true")
    p.add_argument("--section-log", help="one of several processes: see processes.py")
    a = p.parse_args()
    if a.hold_us < 0:
        p.error("--hold-us must be at least 0")
    if (a.no_lock or a.section_log) and a.workload != "contended":
        p.error("--no-lock and --section-log apply to the contended workload")
    shared = connect(a.backend)
    if a.workload == "uncontended":
        line = uncontended(uncontended_lock(shared), a.n)
    else:
        log = os.open(a.section_log, os.O_WRONLY | os.O_APPEND) if a.section_log else None
        line = contended(lambda: worker_locks(shared), a.workers, a.secs, a.hold_us, not a.no_lock, log)
    close(shared)
    name = f"no-lock-{impl}" if a.no_lock else impl
    # An ensemble or cluster says so, as the bench program's lines do.
    hosts = a.backend.split("://", 1)[-1].split("/")[0].split(",")
    servers = f" servers={len(hosts)}" if len(hosts) > 1 else ""
    print(f"impl={name} backend={backend} workload={a.workload}{servers}{setting} {line}")
