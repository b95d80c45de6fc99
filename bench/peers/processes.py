#!/usr/bin/python3
"""Runs a peer as P independent clients on one key, as tower-lock's bench
program does with `contended --processes P`, and prints one line with the
totals:

    /usr/bin/python3 bench/peers/processes.py 8 /usr/bin/python3 bench/peers/redis_py_lock.py \\
        --backend redis://127.0.0.1:PORT --workload contended --secs 5 --workers 1

The command runs P times, each with `--section-log FILE` added: every holder
appends `E <pid> <unix_ns>` once it holds the lock and `L <pid> <unix_ns>`
before it releases (peer_harness.py). From that file alone this runner
- counts overlaps between processes: an `E` while another holder's `E` has
  no `L` yet (appends are atomic and in the order they happened: a holder
  writes its `L` before it releases, the next one its `E` after it acquires);
- counts each process's cycles over the same span of time, whatever each
  process took to start (a JVM takes seconds, a Rust program milliseconds):
  from 500 ms after the last process's first entry (the warm-up) to the first
  process's last exit.

The line is the peer's own, with `processes=P` before `workers=`, the rate
over that span, the overlaps (between processes, plus those each process saw
inside itself) and `per_process=`, the cycles of each. With `--no-lock` the
same run is the negative control: it must show overlaps.
"""
import os
import subprocess
import sys
import tempfile

WARM_UP_NS = 500_000_000


def field(line, name):
    for kv in line.split(" "):
        if kv.startswith(name + "="):
            return kv[len(name) + 1 :]
    return None


def main():
    if len(sys.argv) < 3 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 2:
        sys.exit("usage: processes.py P COMMAND [ARGS...]   (P >= 2)")
    count, command = int(sys.argv[1]), sys.argv[2:]
    fd, log = tempfile.mkstemp(prefix="peer-sections-")
    os.close(fd)
    try:
        children = [
            subprocess.Popen(command + ["--section-log", log], stdout=subprocess.PIPE, text=True)
            for _ in range(count)
        ]
        lines = []
        for child in children:
            out, _ = child.communicate()
            line = next((l for l in out.splitlines() if l.startswith("impl=")), None)
            if child.returncode != 0 or line is None:
                sys.exit(f"processes.py: a process failed (exit {child.returncode}): {' '.join(command)}")
            lines.append(line)
        with open(log) as f:
            events = [l.split() for l in f if l.strip()]
    finally:
        os.unlink(log)

    # Overlaps, in the order the holders wrote.
    holders, overlaps = set(), 0
    for what, pid, _ in events:
        if what == "E":
            if holders:
                overlaps += 1
            holders.add(pid)
        else:
            holders.discard(pid)
    overlaps += sum(int(field(l, "overlaps") or 0) for l in lines)

    # Cycles over the span every process was running.
    entries, exits = {}, {}
    for what, pid, ns in events:
        (entries if what == "E" else exits).setdefault(pid, []).append(int(ns))
    if len(entries) < count:
        sys.exit(f"processes.py: only {len(entries)} of {count} processes ever held the lock")
    start = max(min(ts) for ts in entries.values()) + WARM_UP_NS
    end = min(max(ts) for ts in exits.values())
    if end <= start:
        sys.exit("processes.py: the processes never ran together past the warm-up")
    per_process = sorted((sum(start <= t < end for t in ts) for ts in entries.values()), reverse=True)
    rate = sum(per_process) / ((end - start) / 1e9)

    first = lines[0]
    prefix = first[: first.index(" workers=")]
    print(
        f"{prefix} processes={count} workers={field(first, 'workers')} secs={field(first, 'secs')} "
        f"cycles_per_s={rate:.0f} window_ms={(end - start) / 1e6:.0f} overlaps={overlaps} "
        f"per_process={','.join(map(str, per_process))}"
    )


if __name__ == "__main__":
    main()
