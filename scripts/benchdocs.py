"""The generated sections of the documents: tables drawn from the run files
the repository keeps, never typed by hand. Used by scripts/bench-plot.py
(`--docs` writes them, `--docs --check` fails where a document differs).

A generated section sits between two markers in a Markdown file:

    <!-- generated: TABLE from RUN-FILE (scripts/bench-plot.py --docs) -->
    ...
    <!-- end generated -->

TABLE is one of GENERATORS below; RUN-FILE is relative to the repository.
Python 3 standard library only.
"""

import os
import re
import statistics

FIELD = re.compile(r"^[a-z][a-z0-9_]*=\S+$")
BEGIN = re.compile(r"^<!-- generated: (\S+) from (\S+) \(scripts/bench-plot\.py --docs\) -->$")
END = "<!-- end generated -->"

# The documents that hold generated sections.
DOCUMENTS = ("bench/README.md", "docs/guarantees.md")


def result_lines(path, first="impl="):
    """The `key=value` lines of a run file whose first field starts with `first`."""
    out = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            fields = raw.strip().split(" ")
            if fields and fields[0].startswith(first) and all(FIELD.match(x) for x in fields):
                out.append(dict(x.split("=", 1) for x in fields))
    return out


def number(v):
    """Thousands separated, two decimals below 10 (as the bench prints)."""
    x = float(v)
    if x < 10 and x != int(x):
        return f"{x:.2f}"
    if x < 10:
        return f"{x:.0f}"
    return f"{x:,.0f}"


def spread(values, fmt=number):
    if len(values) == 1:
        return fmt(values[0]), ""
    return fmt(statistics.median(values)), f"{fmt(min(values))}–{fmt(max(values))}"


# --- bench lines ------------------------------------------------------------

BACKENDS = {
    "memory": "Memory",
    "redis": "Redis",
    "redlock": "Redlock",
    "zookeeper": "ZooKeeper",
    "postgres": "PostgreSQL",
    "mysql": "MariaDB",
    "etcd": "etcd",
}


def group_name(line):
    b, name = line["backend"], BACKENDS.get(line["backend"], line["backend"])
    if b == "redis" and "sentinels" in line:
        name += f" through {line['sentinels']} Sentinels"
    elif b == "redis" and "servers" in line:
        name += f" Cluster of {line['servers']} nodes"
    elif b == "redlock":
        name += ", 3 servers"
    elif "servers" in line:
        name += f", {line['servers']} servers"
    elif b == "redis":
        name += ", one server"
    if line.get("mode") == "lease-table":
        name += ", lease table"
    elif b == "postgres":
        name += ", advisory locks"
    if line.get("via") == "pooler":
        name += ", through PgBouncer"
    if "wait_replicas" in line:
        k = line["wait_replicas"]
        name += f", waiting for {k} replica{'' if k == '1' else 's'}"
    return name


def workload(line):
    w = line["workload"]
    if w == "contended" and "processes" in line:
        workers = "1 worker" if line["workers"] == "1" else f"{line['workers']} workers"
        return f"contended, {line['processes']} processes × {workers}"
    if w == "contended":
        return f"contended, {line['workers']} workers"
    if w == "keys":
        return f"keys, {line['workers']} workers on {line['keys']}"
    if w == "http":
        on = "`route_layer`" if line.get("mount") == "route" else "the handler"
        return f"http, {line['conns']} connections, layer on {on}"
    if w == "flash-sale":
        return f"flash sale, {line['conns']} connections on one key, admission {line['admission']}"
    return w


def who(line):
    name = f"`{line['impl']}`"
    if line.get("release") == "await":
        name += ", release awaited"
    return name


# What each workload is measured by: (field, unit, also-field, also-unit).
MEASURES = {
    "uncontended": ("p50_us", "µs p50", "p99_us", "µs p99"),
    "contended": ("cycles_per_s", "cycles/s", "overlaps", "overlaps (most in a line)"),
    "keys": ("cycles_per_s", "cycles/s", "overlaps", "overlaps (most in a line)"),
    "http": ("ratio", "× bare", "rps_locked", "req/s locked"),
    "flash-sale": ("ok_per_s", "ok/s", "ok_p99_ms", "ms p99 of successes"),
}


def grouped(items, key):
    """`items` by `key(item)`, in the order each key first appears."""
    out = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return out


def peers(rows):
    """The peers' rows by implementation (no floor, control or ours)."""
    return grouped(
        (r for r in rows if r["impl"] not in NOT_PEERS and not r["impl"].startswith("no-lock")),
        lambda r: r["impl"],
    )


def bench_table(path):
    groups = {
        g: grouped(rows, lambda line: (workload(line), who(line)))
        for g, rows in grouped(result_lines(path), group_name).items()
    }
    csv = redis_benchmark_p50(path)
    out = []
    for g in groups:
        out += [f"#### {g}", "", "| workload | who | lines | median | range | also |", "|---|---|---|---|---|---|"]
        if g == "Redis, one server" and csv:
            med, rng = spread(csv)
            out.append(f"| one PING | `redis-benchmark -c 1 -t ping` | {len(csv)} | {med} µs p50 | {rng} | the floor of a round trip |")
        for (w, name), rows in groups[g].items():
            field, unit, also, also_unit = MEASURES[rows[0]["workload"]]
            fmt = (lambda x: f"{x:.3f}") if field == "ratio" else number
            med, rng = spread([float(r[field]) for r in rows], fmt)
            extra = [float(r[also]) for r in rows if also in r]
            if also == "overlaps" and extra:
                note = f"{number(max(extra))} {also_unit}"
            elif extra:
                note = f"{spread(extra)[0]} {also_unit}"
            else:
                note = ""
            if "refused_p99_ms" in rows[0]:
                refused = spread([float(r["refused_p99_ms"]) for r in rows])[0]
                per_s = spread([float(r["refused_per_s"]) for r in rows])[0]
                note += f"; {per_s} refused/s, answered in {refused} ms p99"
            if "rps_floor" in rows[0]:
                floor = spread([float(r["rps_floor"]) for r in rows])[0]
                share = spread([float(r["ratio_floor"]) for r in rows], lambda x: f"{x:.3f}")[0]
                note += f"; raw lock commands {floor} req/s, locked {share} × that"
            if "per_process" in rows[0]:
                note += "; per process " + " / ".join(r["per_process"].replace(",", ", ") for r in rows)
            out.append(f"| {w} | {name} | {len(rows)} | {med} {unit} | {rng} | {note} |")
        out.append("")
    return out[:-1]


# The floor lines of each backend (`--workload floor`), and the peers.
FLOORS = ("redis-rs-2xping", "raw-create-delete", "tokio-postgres-2xselect",
          "tokio-postgres-2xupsert", "mysql-async-2xselect", "etcd-client-put-delete")
NOT_PEERS = FLOORS + ("tower-lock", "bare-vs-bare", "layer-floor", "ring-floor")


def ratio(a, b):
    return f"{a / b:.2f} ×" if a and b else ""


def bench_summary(path):
    """Per backend: this library beside the floor and the best peer."""
    groups = grouped(result_lines(path), group_name)

    def med(rows, field):
        v = [float(r[field]) for r in rows if field in r]
        return statistics.median(v) if v else None

    out = [
        "| backend | uncontended p50, released as the layer does | floor | × floor "
        "| best peer (awaits its release) | × best peer | 8 workers on one key | best peer | × best peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g, rows in groups.items():
        unc = [r for r in rows if r["workload"] == "uncontended"]
        ours = med([r for r in unc if r["impl"] == "tower-lock" and "release" not in r], "p50_us")
        if ours is None:
            continue
        floor = med([r for r in unc if r["impl"] in FLOORS], "p50_us")
        best = min(((med(v, "p50_us"), k) for k, v in peers(unc).items()), default=(None, ""))
        con = [r for r in rows if r["workload"] == "contended" and "processes" not in r]
        ours_c = med([r for r in con if r["impl"] == "tower-lock"], "cycles_per_s")
        best_c = max(((med(v, "cycles_per_s"), k) for k, v in peers(con).items()), default=(None, ""))
        cell = lambda v, unit: f"{number(v)} {unit}" if v is not None else ""
        named = lambda v, k, unit: f"{number(v)} {unit} (`{k}`)" if v is not None else ""
        out.append(
            f"| {g} | {cell(ours, 'µs')} | {cell(floor, 'µs')} | {ratio(ours, floor)} "
            f"| {named(best[0], best[1], 'µs')} | {ratio(ours, best[0])} "
            f"| {cell(ours_c, 'cycles/s')} | {named(best_c[0], best_c[1], 'cycles/s')} "
            f"| {ratio(ours_c, best_c[0])} |"
        )
    return out


def bench_replicas(path):
    """Per backend: eight independent clients on one key, this library
    beside each peer, and how evenly the processes were served; beside
    them the fair floor where the run has one (`--ring`: a token passed
    round the processes through the server, bench/README.md)."""
    out = [
        "| backend | tower-lock | fewest ÷ most per process | peer | peer's fewest ÷ most "
        "| tower-lock ÷ peer | fair floor | tower-lock ÷ floor |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def evenness(line):
        counts = [int(c) for c in line["per_process"].split(",")]
        return f"{min(counts) / max(counts):.2f}" if max(counts) else "0"

    for g, rows in grouped(result_lines(path), group_name).items():
        eight = [r for r in rows if r["workload"] == "contended" and r.get("processes") == "8"
                 and r.get("workers") == "1" and not r["impl"].startswith("no-lock")]
        ours = [r for r in eight if r["impl"] == "tower-lock"]
        if not ours:
            continue
        mine = float(ours[0]["cycles_per_s"])
        rings = [float(r["cycles_per_s"]) for r in eight if r["impl"] == "ring-floor"]
        ring = rings[0] if rings else None
        floor = (f"| {number(ring)} cycles/s | {ratio(mine, ring)} |" if ring else "| | |")
        others = [r for r in eight if r["impl"] not in NOT_PEERS] or [None]
        for peer in others:
            theirs = float(peer["cycles_per_s"]) if peer else None
            out.append(
                f"| {g} | {number(mine)} cycles/s | {evenness(ours[0])} "
                + (f"| `{peer['impl']}` {number(theirs)} cycles/s | {evenness(peer)} | {ratio(mine, theirs)} "
                   if peer else "| | | ")
                + floor
            )
    return out


def redis_benchmark_p50(path):
    """p50 of redis-benchmark's PING lines (CSV, ms in the fifth column), in µs."""
    out = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if raw.startswith('"PING_MBULK"'):
                out.append(float(raw.split(",")[4].strip('"')) * 1000)
    return out


# --- instruction counts -----------------------------------------------------

ROUTES = {
    "bare": "the handler alone",
    "layer-handler": "`LockLayer` on the handler, `post(order.layer(lock))`",
    "layer-route": "`LockLayer` under `route_layer`",
    "identity-handler": "a layer that does nothing, on the handler: what the mount costs",
    "identity-route": "a layer that does nothing, under `route_layer`",
    "hand-mutex-map": "the hand-written map of per-key mutexes, in the handler",
    "layer-floor": "the floor layer: the least a lock layer keyed by `PathParam` does",
}


def instructions_table(path):
    rows = result_lines(path, first="route=")
    out = ["| route | what | instructions per request | over the bare route "
           "| heap allocations per request | over the bare route |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        allocations = r.get("allocations_per_request", "–")
        over = r.get("allocations_over_bare", "–")
        out.append(f"| `{r['route']}` | {ROUTES.get(r['route'], '')} "
                   f"| {number(r['instructions_per_request'])} | {number(r['over_bare'])} "
                   f"| {allocations} | {over} |")
    return out


# --- torture summary lines --------------------------------------------------

TORTURE_NAMES = [
    # (predicate, label), first match wins
    (lambda l: l["backend"] == "memory", "memory"),
    (lambda l: "sentinels" in l and "wait_replicas" in l, "Redis through Sentinel, waiting for replicas"),
    (lambda l: "sentinels" in l, "Redis through Sentinel"),
    (lambda l: "masters" in l and "wait_replicas" in l, "Redis Cluster, waiting for replicas"),
    (lambda l: "masters" in l, "Redis Cluster"),
    (lambda l: l["backend"] == "redis" and l.get("quarantine") == "1", "Redis, `restart_quarantine`"),
    (lambda l: l["backend"] == "redis" and l.get("lease_ms") == "60", "Redis, 60 ms leases"),
    (lambda l: l["backend"] == "redis", "Redis"),
    (lambda l: l["backend"] == "redlock", "Redlock, 3 servers"),
    (lambda l: l["backend"] == "zookeeper" and "servers" in l, "ZooKeeper, 3 servers"),
    (lambda l: l["backend"] == "zookeeper", "ZooKeeper"),
    (lambda l: l["backend"] == "postgres" and l.get("mode") == "lease-table", "PostgreSQL, lease table"),
    (lambda l: l["backend"] == "postgres", "PostgreSQL"),
    (lambda l: l["backend"] == "mysql", "MariaDB"),
    (lambda l: l["backend"] == "etcd" and "servers" in l, "etcd, 3 members"),
    (lambda l: l["backend"] == "etcd", "etcd"),
]


def torture_name(line):
    for pred, label in TORTURE_NAMES:
        if pred(line):
            return label
    return line["backend"]


def faults(line):
    """`faults=N faults_by_kind=a:n,b:m` as `N (a n, b m)`."""
    total, kinds = line.get("faults", "0"), line.get("faults_by_kind", "none")
    if kinds == "none":
        return total
    return f"{total} ({', '.join(k.replace(':', ' ') for k in kinds.split(','))})"


MODE_NAMES = {"x": "mutex", "r": "read", "w": "write", "a": "lock_all"}


def by_mode(line):
    """` (mutex N, read N, ...)` from `holds_by_mode=x:N,r:N,...`."""
    kinds = line.get("holds_by_mode")
    if not kinds:
        return ""
    parts = []
    for kind in kinds.split(","):
        tag, n = kind.split(":")
        name = MODE_NAMES.get(tag, f"semaphore({tag[1:]})" if tag.startswith("s") else tag)
        parts.append(f"{name} {number(n)}")
    return f" ({', '.join(parts)})"


def ms(line, key):
    v = line.get(key)
    return "" if v in (None, "", "none") else f"{number(v)} ms"


def torture_table(path):
    rows = result_lines(path, first="impl=")
    out = [
        "| backend | secs | seed | faults injected | holds (by mode) | told lost | stale writes refused "
        "| overlaps unwarned | overlaps excused (outside the guarantee) | stale accepted "
        "| lost updates | leaked | tokens backwards | worst margin told → next grant "
        "| paused holder told after | crashed holder's key back after | hand-offs kept back (lease not surely fresh) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        excused = int(r.get("overlaps_outside", "0")) + int(r.get("overlaps_paused", "0"))
        out.append(
            f"| {torture_name(r)} | {r.get('secs', '')} | {r.get('seed', '')} | {faults(r)} "
            f"| {number(r.get('holds', '0'))}{by_mode(r)} | {number(r.get('told_lost', '0'))} "
            f"| {number(r.get('stale_refused', '0'))} | {r.get('overlaps_unwarned', '')} "
            f"| {excused} | {r.get('stale_accepted', '')} | {r.get('lost_updates', '')} "
            f"| {r.get('leaked', '')} | {r.get('tokens_backwards', '')} "
            f"| {ms(r, 'worst_margin_ms')} | {ms(r, 'told_after_resume_ms')} | {ms(r, 'kill_recovery_ms')} "
            f"| {r.get('handoffs_kept_back', '')} |"
        )
    return out


GENERATORS = {
    "bench-summary": bench_summary,
    "bench-tables": bench_table,
    "instruction-counts": instructions_table,
    "torture-table": torture_table,
    "bench-replicas": bench_replicas,
}


# --- the documents ----------------------------------------------------------

def regenerate(root, doc):
    """The document's text with every generated section drawn again."""
    with open(os.path.join(root, doc), encoding="utf-8") as f:
        old = f.read().split("\n")
    new, i = [], 0
    while i < len(old):
        new.append(old[i])
        m = BEGIN.match(old[i])
        i += 1
        if not m:
            continue
        table, run = m.groups()
        if table not in GENERATORS:
            raise SystemExit(f"{doc}: no generator named {table!r} (have {', '.join(GENERATORS)})")
        while i < len(old) and old[i] != END:
            i += 1
        if i == len(old):
            raise SystemExit(f"{doc}: generated section {table} has no {END!r}")
        new += GENERATORS[table](os.path.join(root, run))
        new.append(END)
        i += 1
    return "\n".join(old), "\n".join(new)


def sync(root, check):
    """Writes the generated sections, or (check) fails where one differs."""
    stale = []
    for doc in DOCUMENTS:
        old, new = regenerate(root, doc)
        if old == new:
            continue
        if check:
            stale.append(doc)
        else:
            with open(os.path.join(root, doc), "w", encoding="utf-8") as f:
                f.write(new)
            print(f"bench-plot: rewrote the generated sections of {doc}")
    if stale:
        raise SystemExit(
            "bench-plot: a generated section differs from its run file in "
            + ", ".join(stale)
            + ": edit the run file, not the table, and run `python3 scripts/bench-plot.py --docs`"
        )
