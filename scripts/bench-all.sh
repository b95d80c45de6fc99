#!/usr/bin/env bash
# Measures everything bench/README.md's tables show, in one run on one
# machine: this library on every backend, the floor through the same client,
# the peers with the same workloads, and the negative controls. Starts its
# own servers (as scripts/test-all.sh does) and prints one line per result,
# in the format bench/README.md describes. A complete run also saves its
# output as bench/last-run.txt and draws it into bench/figures.svg with
# scripts/bench-plot.py.
#
# Usage: scripts/bench-all.sh [SECS]     (SECS per timed workload, default 5)
# Build first: cargo build --release -p tower-lock-bench, and for the rslock peer
# cargo build --release --manifest-path bench/peers/rslock/Cargo.toml --target-dir target
set -euo pipefail

cd "$(dirname "$0")/.."
secs=${1:-5}
# shellcheck source=scripts/servers.sh
source scripts/servers.sh
install_packages bench
start_servers >&2

bench=${CARGO_TARGET_DIR:-target}/release/bench
rslock=${CARGO_TARGET_DIR:-target}/release/rslock-peer-bench
[ -x "$bench" ] && [ -x "$rslock" ] || die "build first: cargo build --release -p tower-lock-bench; cargo build --release --manifest-path bench/peers/rslock/Cargo.toml --target-dir target"
redis=$TOWER_LOCK_REDIS_URL
zk="zk://$TOWER_LOCK_ZK_ADDR"
contended=(--workload contended --secs "$secs" --workers 8)
# The flash sale the admission-control issue names: 20 s whatever SECS.
flash_sale=(--workload flash-sale --secs 20 --conns 256 --hold-us 5000 --wait-ms 2000)
# Eight independent clients on one key (bench/README.md): this library as
# `--processes 8`, a peer through peers/processes.py.
replicas=(--workload contended --secs "$secs" --workers 1)
eight() { run "$bench" --backend "$1" "${replicas[@]}" --processes 8 "${@:2}"; }
peer8() { run /usr/bin/python3 bench/peers/processes.py 8 "$@" "${replicas[@]}"; }
# Two processes of four workers, three rounds: evenness must hold in each.
pairs() { for _ in 1 2 3; do run "$bench" --backend "$1" --workload contended --secs "$secs" --workers 4 --processes 2; done; }

run() { "$@" || die "failed: $*"; }

# From here on, stdout goes to the terminal and to a file, which replaces
# bench/last-run.txt only once the whole run has succeeded.
run_file=bench/last-run.txt
exec 3>&1 > >(tee "$run_file.partial")
tee_pid=$!

# Redis: redis-benchmark's PING (p50 is the fifth column, in ms) and the
# same two PINGs through the Rust client, then three interleaved rounds.
redis_port=${redis##*:}
for _ in 1 2 3; do
    redis-benchmark -p "$redis_port" -c 1 -n 20000 -t ping -q --csv | grep PING_MBULK
    run "$bench" --backend "$redis" --workload floor --n 5000
    run "$bench" --backend "$redis" --workload uncontended --n 5000
    run "$bench" --backend "$redis" --workload uncontended --n 5000 --release await
    run "$rslock" --backend "$redis" --workload uncontended --n 5000
    run /usr/bin/python3 bench/peers/redis_py_lock.py --backend "$redis" --workload uncontended --n 5000
done
for _ in 1 2; do
    run "$bench" --backend "$redis" "${contended[@]}"
    run "$rslock" --backend "$redis" "${contended[@]}"
    run /usr/bin/python3 bench/peers/redis_py_lock.py --backend "$redis" "${contended[@]}"
done
run "$bench" --backend "$redis" "${contended[@]}" --no-lock
run "$rslock" --backend "$redis" "${contended[@]}" --no-lock
run /usr/bin/python3 bench/peers/redis_py_lock.py --backend "$redis" "${contended[@]}" --no-lock
pairs "$redis"
eight "$redis"
# The fair floor: a token passed round the eight through Redis lists.
eight "$redis" --ring
peer8 "$rslock" --backend "$redis"
peer8 /usr/bin/python3 bench/peers/redis_py_lock.py --backend "$redis"
eight "$redis" --no-lock
peer8 "$rslock" --backend "$redis" --no-lock
run "$bench" --backend "$redis" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$redis" --workload http --secs "$secs" --conns 32
# One hot key, without and with admission control (bench/README.md).
for _ in 1 2 3; do
    run "$bench" --backend "$redis" "${flash_sale[@]}"
done

# Redis through three Sentinels (a master and two replicas): the floor is
# the master's, and the cost of waiting for both replicas (WAIT) beside it.
start_sentinel >&2
sentinel="redis+sentinel://$sentinel_urls/locks"
acked="$sentinel?wait_replicas=2&wait_timeout_ms=100"
for _ in 1 2 3; do
    run "$bench" --backend "$sentinel" --workload floor --n 5000
    run "$bench" --backend "$sentinel" --workload uncontended --n 5000
    run "$bench" --backend "$acked" --workload uncontended --n 5000
done
for _ in 1 2; do
    run "$bench" --backend "$sentinel" "${contended[@]}"
    run "$bench" --backend "$acked" "${contended[@]}"
done

# Redis Cluster (three masters, a replica of each): the floor is one
# master's, and the cost of waiting for the key's replica beside it.
start_redis_cluster >&2
rcluster="redis+cluster://$redis_cluster_urls"
rcluster_acked="$rcluster?wait_replicas=1&wait_timeout_ms=100"
for _ in 1 2 3; do
    run "$bench" --backend "$rcluster" --workload floor --n 5000
    run "$bench" --backend "$rcluster" --workload uncontended --n 5000
    run "$bench" --backend "$rcluster_acked" --workload uncontended --n 5000
done
for _ in 1 2; do
    run "$bench" --backend "$rcluster" "${contended[@]}"
    run "$bench" --backend "$rcluster_acked" "${contended[@]}"
done
run "$bench" --backend "$rcluster" "${contended[@]}" --no-lock
pairs "$rcluster"
run "$bench" --backend "$rcluster" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$rcluster" --workload http --secs "$secs" --conns 32

# Redlock over three servers.
for _ in 1 2 3; do
    run "$bench" --backend "$TOWER_LOCK_REDLOCK_URL" --workload uncontended --n 5000
    run "$bench" --backend "$TOWER_LOCK_REDLOCK_URL" --workload uncontended --n 5000 --release await
    run "$rslock" --backend "$TOWER_LOCK_REDLOCK_URL" --workload uncontended --n 5000
done
run "$bench" --backend "$TOWER_LOCK_REDLOCK_URL" "${contended[@]}"
run "$rslock" --backend "$TOWER_LOCK_REDLOCK_URL" "${contended[@]}"
pairs "$TOWER_LOCK_REDLOCK_URL"
eight "$TOWER_LOCK_REDLOCK_URL"
peer8 "$rslock" --backend "$TOWER_LOCK_REDLOCK_URL"
run "$bench" --backend "$TOWER_LOCK_REDLOCK_URL" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$TOWER_LOCK_REDLOCK_URL" --workload http --secs "$secs" --conns 32

# ZooKeeper: the floor is a raw create + delete through the same client.
for _ in 1 2 3; do
    run "$bench" --backend "$zk" --workload floor --n 2000
    run "$bench" --backend "$zk" --workload uncontended --n 2000
    run "$bench" --backend "$zk" --workload uncontended --n 2000 --release await
    run bench/peers/curator/run --backend "$zk" --workload uncontended --n 2000
    run /usr/bin/python3 bench/peers/kazoo_lock.py --backend "$zk" --workload uncontended --n 2000
done
for _ in 1 2; do
    run "$bench" --backend "$zk" "${contended[@]}"
    run bench/peers/curator/run --backend "$zk" "${contended[@]}"
    run /usr/bin/python3 bench/peers/kazoo_lock.py --backend "$zk" "${contended[@]}"
done
run "$bench" --backend "$zk" "${contended[@]}" --no-lock
run bench/peers/curator/run --backend "$zk" "${contended[@]}" --no-lock
run /usr/bin/python3 bench/peers/kazoo_lock.py --backend "$zk" "${contended[@]}" --no-lock
pairs "$zk"
eight "$zk"
peer8 bench/peers/curator/run --backend "$zk"
peer8 /usr/bin/python3 bench/peers/kazoo_lock.py --backend "$zk"
peer8 /usr/bin/python3 bench/peers/kazoo_lock.py --backend "$zk" --no-lock
run "$bench" --backend "$zk" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$zk" --workload http --secs "$secs" --conns 32

# The same on a three-server ensemble (clients may connect to any server;
# writes go through the leader): floor, ours and the peers.
start_zk_ensemble >&2
zk3="zk://$zk_ensemble"
for _ in 1 2 3; do
    run "$bench" --backend "$zk3" --workload floor --n 2000
    run "$bench" --backend "$zk3" --workload uncontended --n 2000
    run bench/peers/curator/run --backend "$zk3" --workload uncontended --n 2000
    run /usr/bin/python3 bench/peers/kazoo_lock.py --backend "$zk3" --workload uncontended --n 2000
done
for _ in 1 2; do
    run "$bench" --backend "$zk3" "${contended[@]}"
    run bench/peers/curator/run --backend "$zk3" "${contended[@]}"
    run /usr/bin/python3 bench/peers/kazoo_lock.py --backend "$zk3" "${contended[@]}"
done
pairs "$zk3"
run "$bench" --backend "$zk3" --workload keys --secs "$secs" --workers 8 --keys 100

# PostgreSQL advisory locks: the floor is two prepared SELECT 1 through the
# same driver; the peer is psycopg2 calling pg_advisory_lock/unlock.
pg=$TOWER_LOCK_POSTGRES_URL
for _ in 1 2 3; do
    run "$bench" --backend "$pg" --workload floor --n 2000
    run "$bench" --backend "$pg" --workload uncontended --n 2000
    run "$bench" --backend "$pg" --workload uncontended --n 2000 --release await
    run /usr/bin/python3 bench/peers/psycopg2_advisory.py --backend "$pg" --workload uncontended --n 2000
done
for _ in 1 2; do
    run "$bench" --backend "$pg" "${contended[@]}"
    run /usr/bin/python3 bench/peers/psycopg2_advisory.py --backend "$pg" "${contended[@]}"
done
run "$bench" --backend "$pg" "${contended[@]}" --no-lock
run /usr/bin/python3 bench/peers/psycopg2_advisory.py --backend "$pg" "${contended[@]}" --no-lock
pairs "$pg"
eight "$pg"
peer8 /usr/bin/python3 bench/peers/psycopg2_advisory.py --backend "$pg"
peer8 /usr/bin/python3 bench/peers/psycopg2_advisory.py --backend "$pg" --no-lock
run "$bench" --backend "$pg" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$pg" --workload http --secs "$secs" --conns 32

# PostgreSQL's lease-table mode: the floor is two committed single-row
# upserts through the same driver (each acquire and release is a commit);
# the peer is psycopg2 running ShedLock's statement. Then through PgBouncer
# in transaction pooling.
pgt="$pg?lease_table"
for _ in 1 2 3; do
    run "$bench" --backend "$pgt" --workload floor --n 2000
    run "$bench" --backend "$pgt" --workload uncontended --n 2000
    run "$bench" --backend "$pgt" --workload uncontended --n 2000 --release await
    run /usr/bin/python3 bench/peers/psycopg2_lease_table.py --backend "$pgt" --workload uncontended --n 2000
done
for _ in 1 2; do
    run "$bench" --backend "$pgt" "${contended[@]}"
    run /usr/bin/python3 bench/peers/psycopg2_lease_table.py --backend "$pgt" "${contended[@]}"
done
run "$bench" --backend "$pgt" "${contended[@]}" --no-lock
run /usr/bin/python3 bench/peers/psycopg2_lease_table.py --backend "$pgt" "${contended[@]}" --no-lock
pairs "$pgt"
eight "$pgt"
peer8 /usr/bin/python3 bench/peers/psycopg2_lease_table.py --backend "$pgt"
run "$bench" --backend "$pgt" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$pgt" --workload http --secs "$secs" --conns 32
# Through PgBouncer: its lines and its floor's carry via=pooler. Waiters
# listen for releases on the server itself (`listen=`), as the module docs
# advise behind a pooler in transaction mode, where `LISTEN` hears nothing.
pg_hosts=${pg#*://}; pg_hosts=${pg_hosts#*@}; pg_hosts=${pg_hosts%%[/?]*}
pgb="$TOWER_LOCK_PGBOUNCER_URL?lease_table&listen=$pg_hosts"
for _ in 1 2 3; do
    run "$bench" --backend "$pgb" --workload floor --n 2000
    run "$bench" --backend "$pgb" --workload uncontended --n 2000
done
pairs "$pgb"
run "$bench" --backend "$pgb" --workload http --secs "$secs" --conns 32

# MariaDB GET_LOCK: the floor is two prepared SELECT 1 through the same
# driver; the peer is PyMySQL calling GET_LOCK/RELEASE_LOCK.
my=$TOWER_LOCK_MYSQL_URL
for _ in 1 2 3; do
    run "$bench" --backend "$my" --workload floor --n 2000
    run "$bench" --backend "$my" --workload uncontended --n 2000
    run "$bench" --backend "$my" --workload uncontended --n 2000 --release await
    run /usr/bin/python3 bench/peers/pymysql_get_lock.py --backend "$my" --workload uncontended --n 2000
done
for _ in 1 2; do
    run "$bench" --backend "$my" "${contended[@]}"
    run /usr/bin/python3 bench/peers/pymysql_get_lock.py --backend "$my" "${contended[@]}"
done
run "$bench" --backend "$my" "${contended[@]}" --no-lock
run /usr/bin/python3 bench/peers/pymysql_get_lock.py --backend "$my" "${contended[@]}" --no-lock
pairs "$my"
eight "$my"
peer8 /usr/bin/python3 bench/peers/pymysql_get_lock.py --backend "$my"
peer8 /usr/bin/python3 bench/peers/pymysql_get_lock.py --backend "$my" --no-lock
run "$bench" --backend "$my" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$my" --workload http --secs "$secs" --conns 32

# etcd: the floor is one put and one delete through the same client; the
# peer is Go's concurrency.Mutex, etcd's own client (what `etcdctl lock`
# runs).
etcd=$TOWER_LOCK_ETCD_URL
for _ in 1 2 3; do
    run "$bench" --backend "$etcd" --workload floor --n 2000
    run "$bench" --backend "$etcd" --workload uncontended --n 2000
    run "$bench" --backend "$etcd" --workload uncontended --n 2000 --release await
    run bench/peers/etcd_go/run --backend "$etcd" --workload uncontended --n 2000
done
for _ in 1 2; do
    run "$bench" --backend "$etcd" "${contended[@]}"
    run bench/peers/etcd_go/run --backend "$etcd" "${contended[@]}"
done
run "$bench" --backend "$etcd" "${contended[@]}" --no-lock
run bench/peers/etcd_go/run --backend "$etcd" "${contended[@]}" --no-lock
pairs "$etcd"
eight "$etcd"
peer8 bench/peers/etcd_go/run --backend "$etcd"
peer8 bench/peers/etcd_go/run --backend "$etcd" --no-lock
run "$bench" --backend "$etcd" --workload keys --secs "$secs" --workers 8 --keys 100
run "$bench" --backend "$etcd" --workload http --secs "$secs" --conns 32
# The same on a three-member cluster, the client balanced over all three.
start_etcd_cluster >&2
etcd3="etcd://$etcd_urls"
run "$bench" --backend "$etcd3" --workload floor --n 2000
run "$bench" --backend "$etcd3" --workload uncontended --n 2000
run bench/peers/etcd_go/run --backend "$etcd3" --workload uncontended --n 2000
run "$bench" --backend "$etcd3" "${contended[@]}"
run bench/peers/etcd_go/run --backend "$etcd3" "${contended[@]}"

# Memory.
run "$bench" --backend memory --workload uncontended --n 5000
run "$bench" --backend memory "${contended[@]}"
run "$bench" --backend memory "${contended[@]}" --no-lock
run "$bench" --backend memory --workload keys --secs "$secs" --workers 8 --keys 100
# Three rounds: one run cannot tell apart routes two points apart.
for _ in 1 2 3; do
    run "$bench" --backend memory --workload http --secs "$secs" --conns 32
    run "$bench" --backend memory --workload http --secs "$secs" --conns 32 --mount route
    run "$bench" --backend memory --workload http --secs "$secs" --conns 32 --calibrate
done
for _ in 1 2 3; do
    run "$bench" --backend memory "${flash_sale[@]}"
done

# Close tee's input and let it finish writing, then draw the figures.
exec >&3 3>&-
wait "$tee_pid"
mv "$run_file.partial" "$run_file"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- src examples bench/src torture/src Cargo.toml 2>/dev/null || commit+=" with local changes"
note="scripts/bench-all.sh, commit $commit, $(nproc) cores, ${secs} s per timed workload"
/usr/bin/python3 scripts/bench-plot.py "$run_file" -o bench/figures.svg --note "$note"
