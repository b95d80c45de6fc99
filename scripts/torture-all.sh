#!/usr/bin/env bash
# Runs the torture harness once on each backend configuration, each with a
# random seed (printed in its line, to replay with --seed N), and prints
# the summary lines. A run that breaks a guarantee stops everything, with
# the examples and the kept run directory on stderr.
#
# Usage: scripts/torture-all.sh SECS [OUT [CONFIG...]]
#   SECS    seconds per run (600 for the runs docs/guarantees.md shows)
#   OUT     where to save the lines once every run has passed; with
#           torture/last-run.txt, `python3 scripts/bench-plot.py --docs`
#           then redraws the table of docs/guarantees.md from them
#   CONFIG  the configurations to run, as in ALL below (default: all)
# Build first: cargo build --release -p tower-lock-torture
set -euo pipefail

cd "$(dirname "$0")/.."
die() { printf 'torture-all: %s\n' "$*" >&2; exit 1; }
secs=${1:?usage: scripts/torture-all.sh SECS [OUT [CONFIG...]]}
[[ "$secs" =~ ^[1-9][0-9]*$ ]] || die "SECS must be a positive number, not '$secs'"
out=${2:-}
shift $(($# < 2 ? $# : 2))
torture=${CARGO_TARGET_DIR:-target}/release/torture
[ -x "$torture" ] || die "build first: cargo build --release -p tower-lock-torture"

# Each configuration: a name and its arguments. The short-lease Redis run
# (60 ms, near the cohort's 50 ms hold bound) makes the cohort keep back
# hand-offs whose lease is no longer surely fresh (`handoffs_kept_back`).
# MariaDB's server-kill-only
# run is there because a killed MariaDB's InnoDB sequence can come back below
# the tokens it handed out, and a run of every fault meets few restarts.
declare -A ARGS=(
    [memory]="--backend memory"
    [redis]="--backend redis"
    [redis-quarantine]="--backend redis --quarantine"
    [redis-short-lease]="--backend redis --lease-ms 60"
    [redlock]="--backend redlock"
    [zk]="--backend zk"
    [zk3]="--backend zk3"
    [postgres]="--backend postgres"
    [postgres-table]="--backend postgres-table"
    [mysql]="--backend mysql"
    [mysql-restarts]="--backend mysql --nemesis server-kill"
    [etcd]="--backend etcd"
    [etcd3]="--backend etcd3"
    [sentinel]="--backend sentinel"
    [sentinel-wait]="--backend sentinel-wait"
    [cluster]="--backend cluster"
    [cluster-wait]="--backend cluster-wait"
)
ALL=(memory redis redis-quarantine redis-short-lease redlock zk zk3 postgres postgres-table mysql
    mysql-restarts etcd etcd3 sentinel sentinel-wait cluster cluster-wait)
(($# > 0)) || set -- "${ALL[@]}"

lines=()
for config in "$@"; do
    [ -n "${ARGS[$config]:-}" ] || die "no configuration '$config' (have: ${ALL[*]})"
    # shellcheck disable=SC2086 # the arguments are words by design
    line=$("$torture" ${ARGS[$config]} --secs "$secs") || die "$config: ${line:-no summary}"
    [[ "$line" == *workload=torture* && "$line" == *stale_accepted=0\ lost_updates=0\ leaked=0\ unavailable_keys=0* ]] ||
        die "$config: $line"
    echo "$line"
    lines+=("$line")
done
[ -z "$out" ] || printf '%s\n' "${lines[@]}" > "$out"
