#!/usr/bin/env python3
"""Draws one run of scripts/bench-all.sh as one self-contained SVG.

    scripts/bench-plot.py RUN.txt [-o bench/figures.svg] [--note TEXT]
    scripts/bench-plot.py --docs [--check]

The second form draws the tables of bench/README.md and docs/guarantees.md
from the run files they name (scripts/benchdocs.py), or checks them.

RUN.txt is the standard output of one run (scripts/bench-all.sh saves it as
bench/last-run.txt). Only result lines count: `key=value` pairs separated by
single spaces, the first `impl=`, in the format bench/README.md describes;
anything else (redis-benchmark's CSV lines, blank lines) is skipped. Where
the run has several lines for one implementation and workload, the bar is
their median and the ticks on it are the single lines. Panels whose lines the
run does not have are left out. Python 3 standard library only.
"""

import argparse
import math
import os
import re
import statistics
import sys
from xml.sax.saxutils import escape

import benchdocs  # the documents' generated tables, beside this script

FIELD = re.compile(r"^[a-z][a-z0-9_]*=\S+$")

def parse(path):
    """The result lines of a run, as dicts (values are strings)."""
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for raw in f:
            fields = raw.strip().split(" ")
            if not fields or not fields[0].startswith("impl="):
                continue
            if not all(FIELD.match(x) for x in fields):
                continue
            lines.append(dict(x.split("=", 1) for x in fields))
    return lines


def num(line, key):
    try:
        return float(line[key])
    except (KeyError, ValueError):
        return None


# Colours: this library, peers written by others (or by hand), and the
# floor or baseline a lock cannot beat.
OURS, OURS_ALT, PEER, FLOOR = "#1f6feb", "#79a8f0", "#e8833a", "#8b949e"


class Bar:
    def __init__(self, label, values, colour, note=""):
        self.label = label
        self.values = values
        self.colour = colour
        self.note = note

    @property
    def value(self):
        return statistics.median(self.values)


class Panel:
    def __init__(self, title, unit, better, bars, note=""):
        self.title = title
        self.unit = unit          # "µs", "cycles/s", "req/s"
        self.better = better      # "lower" or "higher"
        self.bars = [b for b in bars if b.values]
        self.note = note


def select(lines, **want):
    """Lines whose fields equal `want`; a value of None means absent."""
    out = []
    for line in lines:
        if all(line.get(k) == v for k, v in want.items()):
            out.append(line)
    return out


def values(lines, key):
    return [v for v in (num(l, key) for l in lines) if v is not None]


# The settings that mark a line as measured on something other than one
# server in the default mode (bench/README.md): a line is drawn only where
# every one of them is as asked (by default, absent).
SETTINGS = ("servers", "sentinels", "wait_replicas", "mode", "via", "mount")


def settings(**given):
    return {k: given.get(k) for k in SETTINGS}


def uncontended(lines, backend, impl, release=None, **given):
    return values(
        select(lines, impl=impl, backend=backend, workload="uncontended", release=release,
               **settings(**given)),
        "p50_us",
    )


def contended(lines, backend, impl, **given):
    # One process of 8 workers: the `--processes` lines are another figure.
    rows = select(lines, impl=impl, backend=backend, workload="contended", release=None,
                  processes=None, **settings(**given))
    return values(rows, "cycles_per_s")


def panels(lines):
    out = []
    ours_drop = "tower-lock, released as the layer does"
    ours_await = "tower-lock, release().await"
    out.append(Panel(
        "Redis: uncontended acquire + release, p50", "µs", "lower", [
            Bar(ours_drop, uncontended(lines, "redis", "tower-lock"), OURS),
            Bar(ours_await, uncontended(lines, "redis", "tower-lock", "await"), OURS_ALT),
            Bar("rslock", uncontended(lines, "redis", "rslock"), PEER),
            Bar("redis-py Lock", uncontended(lines, "redis", "redis-py"), PEER),
            Bar("floor: 2 × PING, same Rust client", uncontended(lines, "redis", "redis-rs-2xping"), FLOOR),
        ]))
    out.append(Panel(
        "Redis: 8 workers on one key", "cycles/s", "higher", [
            Bar("tower-lock", contended(lines, "redis", "tower-lock"), OURS),
            Bar("rslock", contended(lines, "redis", "rslock"), PEER),
            Bar("redis-py Lock", contended(lines, "redis", "redis-py"), PEER),
        ]))
    out.append(Panel(
        "Redlock (3 servers): uncontended acquire + release, p50", "µs", "lower", [
            Bar(ours_drop, uncontended(lines, "redlock", "tower-lock"), OURS),
            Bar(ours_await, uncontended(lines, "redlock", "tower-lock", "await"), OURS_ALT),
            Bar("rslock", uncontended(lines, "redlock", "rslock"), PEER),
        ]))
    out.append(Panel(
        "Redlock (3 servers): 8 workers on one key", "cycles/s", "higher", [
            Bar("tower-lock", contended(lines, "redlock", "tower-lock"), OURS),
            Bar("rslock", contended(lines, "redlock", "rslock"), PEER),
        ]))
    out.append(Panel(
        "ZooKeeper: uncontended acquire + release, p50", "µs", "lower", [
            Bar(ours_drop, uncontended(lines, "zookeeper", "tower-lock"), OURS),
            Bar(ours_await, uncontended(lines, "zookeeper", "tower-lock", "await"), OURS_ALT),
            Bar("Curator InterProcessMutex", uncontended(lines, "zookeeper", "curator"), PEER),
            Bar("kazoo Lock", uncontended(lines, "zookeeper", "kazoo"), PEER),
            Bar("floor: raw create + delete, same client",
                uncontended(lines, "zookeeper", "raw-create-delete"), FLOOR),
        ]))
    out.append(Panel(
        "ZooKeeper: 8 workers on one key", "cycles/s", "higher", [
            Bar("tower-lock", contended(lines, "zookeeper", "tower-lock"), OURS),
            Bar("Curator InterProcessMutex", contended(lines, "zookeeper", "curator"), PEER),
            Bar("kazoo Lock", contended(lines, "zookeeper", "kazoo"), PEER),
        ]))
    for backend, title, peer, peer_impl, floor in [
        ("postgres", "PostgreSQL advisory locks", "psycopg2 pg_advisory_lock", "psycopg2",
         "tokio-postgres-2xselect"),
        ("mysql", "MariaDB GET_LOCK", "PyMySQL GET_LOCK", "pymysql", "mysql-async-2xselect"),
    ]:
        out.append(Panel(
            f"{title}: uncontended acquire + release, p50", "µs", "lower", [
                Bar(ours_drop, uncontended(lines, backend, "tower-lock"), OURS),
                Bar(ours_await, uncontended(lines, backend, "tower-lock", "await"), OURS_ALT),
                Bar(peer, uncontended(lines, backend, peer_impl), PEER),
                Bar("floor: 2 × prepared SELECT 1, same Rust driver",
                    uncontended(lines, backend, floor), FLOOR),
            ]))
        out.append(Panel(
            f"{title}: 8 workers on one key", "cycles/s", "higher", [
                Bar("tower-lock", contended(lines, backend, "tower-lock"), OURS),
                Bar(peer, contended(lines, backend, peer_impl), PEER),
            ]))
    table = {"mode": "lease-table"}
    out.append(Panel(
        "PostgreSQL lease table: uncontended acquire + release, p50", "µs", "lower", [
            Bar(ours_drop, uncontended(lines, "postgres", "tower-lock", **table), OURS),
            Bar(ours_await, uncontended(lines, "postgres", "tower-lock", "await", **table),
                OURS_ALT),
            Bar("psycopg2, ShedLock's statement",
                uncontended(lines, "postgres", "psycopg2-lease-table", **table), PEER),
            Bar("floor: 2 × committed upsert, same Rust driver",
                uncontended(lines, "postgres", "tokio-postgres-2xupsert", **table), FLOOR),
        ]))
    out.append(Panel(
        "PostgreSQL lease table: 8 workers on one key", "cycles/s", "higher", [
            Bar("tower-lock", contended(lines, "postgres", "tower-lock", **table), OURS),
            Bar("psycopg2, ShedLock's statement",
                contended(lines, "postgres", "psycopg2-lease-table", **table), PEER),
        ]))
    out.append(Panel(
        "etcd: uncontended acquire + release, p50", "µs", "lower", [
            Bar(ours_drop, uncontended(lines, "etcd", "tower-lock"), OURS),
            Bar(ours_await, uncontended(lines, "etcd", "tower-lock", "await"), OURS_ALT),
            Bar("Go concurrency.Mutex (etcdctl lock)",
                uncontended(lines, "etcd", "go-concurrency-mutex"), PEER),
            Bar("floor: put + delete, same Rust client",
                uncontended(lines, "etcd", "etcd-client-put-delete"), FLOOR),
        ]))
    out.append(Panel(
        "etcd: 8 workers on one key", "cycles/s", "higher", [
            Bar("tower-lock", contended(lines, "etcd", "tower-lock"), OURS),
            Bar("Go concurrency.Mutex (etcdctl lock)",
                contended(lines, "etcd", "go-concurrency-mutex"), PEER),
        ]))
    http = select(lines, impl="tower-lock", backend="memory", workload="http", mount=None)
    # The peer's lines of the same runs (they share the bare rate): a run
    # with `--mount route` has its own bare rate, and older runs did not tag
    # its peer line.
    bares = {l.get("rps_bare") for l in http}
    hand = [l for l in select(lines, impl="hand-mutex-map", backend="memory", workload="http",
                              mount=None)
            if l.get("rps_bare") in bares]
    # The floor of a lock layer keyed like PathParam, in runs that measured it.
    floor = [l for l in select(lines, impl="layer-floor", backend="memory", workload="http",
                               mount=None)
             if l.get("rps_bare") in bares]
    calib = select(lines, impl="bare-vs-bare", backend="memory", workload="http")
    note = ""
    if calib:
        ratios = values(calib, "ratio") + values(calib, "ratio_peer")
        note = ("calibration (--calibrate, every route bare): the others measured "
                + ", ".join(f"{r:.3f}" for r in ratios) + " × the first")
    out.append(Panel(
        "Memory backend: POST /orders/{sku} over HTTP, 32 connections", "req/s", "higher", [
            Bar("bare route (no lock)", values(http, "rps_bare"), FLOOR),
            Bar("tower-lock LockLayer on the handler", values(http, "rps_locked"), OURS,
                note=ratio_note(http)),
            Bar("by hand: DashMap of tokio Mutexes", values(hand, "rps_locked"), PEER,
                note=ratio_note(hand)),
            Bar("floor: the least a lock layer does", values(floor, "rps_locked"), FLOOR,
                note=ratio_note(floor)),
        ], note=note))
    out.append(remote_http(lines))
    return [p for p in out if p.bars]


def remote_http(lines):
    """Each remote backend's `http` route beside its raw floor (`rps_floor`)."""
    remote = [l for l in lines if l.get("impl") == "tower-lock" and l.get("workload") == "http"
              and "rps_floor" in l]
    groups = {}
    for l in remote:
        label = benchdocs.BACKENDS.get(l["backend"], l["backend"])
        if l.get("mode") == "lease-table":
            label += " lease table"
        if l.get("via"):
            label += " via pooler"
        if l.get("servers"):
            label += f" ({l['servers']} servers)"
        groups.setdefault(label, []).append(l)
    bars = []
    for label, rows in groups.items():
        ratios = values(rows, "ratio_floor")
        bars.append(Bar(f"{label}: tower-lock", values(rows, "rps_locked"), OURS,
                        note=f"{statistics.median(ratios):.2f} × floor" if ratios else ""))
        bars.append(Bar(f"{label}: floor", values(rows, "rps_floor"), FLOOR))
    return Panel("Remote backends: POST /orders/{sku} on distinct keys, 32 connections",
                 "req/s", "higher", bars,
                 note="floor: the same route locking with the fewest raw commands "
                      "that give the same guarantee (bench/src/raw_locks.rs)")


def ratio_note(lines):
    ratios = values(lines, "ratio")
    return f"{statistics.median(ratios):.3f} × bare" if ratios else ""


def fmt(v, unit):
    if unit == "µs" and v < 10:
        s = f"{v:.2f}"
    else:
        s = f"{v:,.0f}"
    return f"{s} {unit}"


# Layout, in px.
WIDTH = 960
LABEL_W = 300     # bar labels, right-aligned before the bars
BAR_X = LABEL_W + 12
BAR_W = 400
ROW_H = 24
BAR_H = 15
FONT = "-apple-system, BlinkMacSystemFont, 'Segoe UI', Helvetica, Arial, sans-serif"


def text(x, y, s, size=12, anchor="start", weight="normal", fill="#1f2328", extra=""):
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}"{extra}>{escape(s)}</text>')


def scale_for(panel):
    vals = [v for b in panel.bars for v in b.values]
    lo, hi = min(vals), max(vals)
    if lo > 0 and hi / lo > 30:
        a = math.floor(math.log10(lo))
        b = math.ceil(math.log10(hi))
        if b == a:
            b += 1

        def pos(v):
            return BAR_W * (math.log10(max(v, 10 ** a)) - a) / (b - a)
        ticks = [10 ** e for e in range(a, b + 1)]
        return pos, ticks, True
    step = nice_step(hi)
    top = step * math.ceil(hi / step)

    def pos(v):
        return BAR_W * v / top
    return pos, [step * i for i in range(round(top / step) + 1)], False


def nice_step(hi):
    """A round tick step (1, 2 or 5 × a power of ten) giving 3 to 6 ticks up to `hi`."""
    if hi <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(hi))
    for m in (0.1, 0.2, 0.5, 1, 2, 5):
        if hi / (m * e) <= 6:
            return m * e
    return 10 * e


def tick_label(v):
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def draw_panel(panel, y):
    out = []
    pos, ticks, log = scale_for(panel)
    out.append(text(16, y + 16, panel.title, size=15, weight="600"))
    sub = [f"{panel.unit}, {panel.better} is better",
           "log scale (values differ by more than 30×)" if log else "linear scale from 0"]
    reps = max(len(b.values) for b in panel.bars)
    if reps > 1:
        sub.append("bars are medians of the run's lines, ticks the single lines")
    out.append(text(16, y + 34, "; ".join(sub), size=12, fill="#57606a"))
    y += 44
    if panel.note:
        out.append(text(16, y + 6, panel.note, size=12, fill="#57606a"))
        y += 16
    top = y + 4
    height = ROW_H * len(panel.bars)
    # Grid and tick labels.
    for t in ticks:
        x = BAR_X + pos(t)
        out.append(f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{top + height:.1f}" '
                   f'stroke="#d0d7de" stroke-width="1"/>')
        out.append(text(x, top + height + 13, tick_label(t), size=10, anchor="middle",
                        fill="#57606a"))
    for i, bar in enumerate(panel.bars):
        by = top + i * ROW_H + (ROW_H - BAR_H) / 2
        w = max(pos(bar.value), 1.5)
        out.append(text(LABEL_W, by + BAR_H - 3, bar.label, size=12, anchor="end"))
        out.append(f'<rect x="{BAR_X}" y="{by:.1f}" width="{w:.1f}" height="{BAR_H}" '
                   f'fill="{bar.colour}" rx="2"/>')
        if len(bar.values) > 1:
            for v in bar.values:
                x = BAR_X + pos(v)
                out.append(f'<line x1="{x:.1f}" y1="{by - 2:.1f}" x2="{x:.1f}" '
                           f'y2="{by + BAR_H + 2:.1f}" stroke="#1f2328" stroke-width="1.2"/>')
        label = fmt(bar.value, panel.unit)
        if len(bar.values) > 1:
            label += f" (median of {len(bar.values)})"
        if bar.note:
            label += f", {bar.note}"
        end = BAR_X + max(w, max(pos(v) for v in bar.values))
        out.append(text(end + 6, by + BAR_H - 3, label, size=12))
    return out, top + height + 26


def render(lines, source, note):
    body = []
    y = 12
    body.append(text(16, y + 20, "tower-lock beside its peers and the floor", size=18,
                     weight="600"))
    y += 30
    caption = f"From {source}"
    if note:
        caption += f": {note}"
    body.append(text(16, y + 14, caption, size=12, fill="#57606a"))
    y += 22
    ps = panels(lines)
    used = {b.colour for p in ps for b in p.bars}
    # Legend, of the colours in use.
    x = 16
    for colour, what in ((OURS, "tower-lock"), (OURS_ALT, "tower-lock, release awaited"),
                         (PEER, "peer"), (FLOOR, "floor or baseline")):
        if colour not in used:
            continue
        body.append(f'<rect x="{x}" y="{y + 4}" width="12" height="12" fill="{colour}" rx="2"/>')
        body.append(text(x + 17, y + 14, what, size=12))
        x += 30 + 7 * len(what)
    y += 26
    if not ps:
        body.append(text(16, y + 20, "No result lines in this run for any panel.", size=13))
        y += 30
    for p in ps:
        body.append(f'<line x1="16" y1="{y:.1f}" x2="{WIDTH - 16}" y2="{y:.1f}" '
                    f'stroke="#d0d7de"/>')
        drawn, y = draw_panel(p, y + 6)
        body.extend(drawn)
    lock_lines = [l for l in lines if not l["impl"].startswith("no-lock")
                  and l.get("overlaps") is not None]
    overlapped = [l for l in lock_lines if l.get("overlaps") != "0"]
    controls = [l for l in lines if l["impl"].startswith("no-lock")]
    failed_controls = [l for l in controls if l.get("overlaps") in (None, "0")]
    checks = []
    if lock_lines:
        checks.append(f"overlaps=0 on {len(lock_lines) - len(overlapped)} of "
                      f"{len(lock_lines)} lock lines")
    if controls:
        checks.append(f"negative controls (no lock) saw overlaps on "
                      f"{len(controls) - len(failed_controls)} of {len(controls)}")
    if checks:
        bad = overlapped or failed_controls
        body.append(text(16, y + 8, "Checks: " + "; ".join(checks) + ".", size=12,
                         fill="#cf222e" if bad else "#57606a"))
        y += 18
    height = math.ceil(y + 10)
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="{FONT}">\n'
            f'<rect width="100%" height="100%" fill="#ffffff"/>\n')
    return head + "\n".join(body) + "\n</svg>\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", help="the stdout of scripts/bench-all.sh, saved to a file")
    ap.add_argument("-o", "--output", default="bench/figures.svg")
    ap.add_argument("--note", default="", help="appended to the caption (commit, machine)")
    ap.add_argument("--docs", action="store_true",
                    help="draw the documents' generated tables from the run files they name")
    ap.add_argument("--check", action="store_true",
                    help="with --docs: change nothing, fail where a table differs from its run file")
    args = ap.parse_args()
    if args.docs:
        benchdocs.sync(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."), args.check)
        return
    if args.run is None:
        ap.error("give a run file to draw, or --docs")
    lines = parse(args.run)
    if not lines:
        sys.exit(f"bench-plot: no result lines in {args.run}")
    svg = render(lines, args.run, args.note)
    tmp = args.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(svg)
    os.replace(tmp, args.output)
    print(f"bench-plot: {len(lines)} result lines -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
