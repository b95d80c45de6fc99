#!/usr/bin/env bash
# Runs every check and test of tower-lock, on a fresh machine too:
#   1. installs the Debian packages it needs when they are missing (as root;
#      otherwise it says which to install),
#   2. starts its own Redis, ZooKeeper and etcd on free loopback ports, and uses
#      the machine's PostgreSQL and MariaDB (or starts its own),
#   3. runs cargo fmt --check, clippy with -D warnings, the whole test suite,
#      and the order_service and bench examples end to end,
#   4. stops the servers, whatever happened.
#
# Usage: scripts/test-all.sh            (from anywhere in the repository)
# Tests that need a server read TOWER_LOCK_REDIS_URL, TOWER_LOCK_ZK_ADDR,
# TOWER_LOCK_POSTGRES_URL and TOWER_LOCK_MYSQL_URL, which this script exports; run alone, such a test fails and says how to
# start the server.
set -euo pipefail

cd "$(dirname "$0")/.."
# shellcheck source=scripts/servers.sh
source scripts/servers.sh
install_packages
start_servers

# --- 3. checks and tests ---------------------------------------------------

# Where cargo puts what it builds (the binaries run below).
target=${CARGO_TARGET_DIR:-target}

step "cargo fmt --check"
cargo fmt --all -- --check

step "the documents' generated tables match the run files they are drawn from"
python3 scripts/bench-plot.py --docs --check

step "one public path per type, no module circle (scripts/check-layout.py)"
python3 scripts/check-layout.py

step "cargo clippy --workspace --all-targets --all-features -- -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings
# A user's build has only the features they chose: it must not warn either.
step "cargo clippy --lib -- -D warnings (default features, none, each backend alone)"
cargo clippy -p tower-lock --lib -- -D warnings
cargo clippy -p tower-lock --lib --no-default-features -- -D warnings
for feature in redis zookeeper postgres mysql etcd; do
    cargo clippy -p tower-lock --lib --no-default-features --features "$feature" -- -D warnings
done
step "cargo doc (no broken links in the docs.rs pages)"
RUSTDOCFLAGS="-D warnings" cargo doc -p tower-lock --no-deps --all-features

step "the package holds the library, its docs and licences; the declared MSRV builds it"
files=$(cargo package -p tower-lock --list)
echo "cargo package --list: $(echo "$files" | wc -l) files"
extra=$(echo "$files" | grep -Ev '^(src/.*|README\.md|CHANGELOG\.md|LICENSE-MIT|LICENSE-APACHE|Cargo\.toml(\.orig)?|Cargo\.lock|\.cargo_vcs_info\.json)$' || true)
[ -z "$extra" ] || die "the package holds more than the library: $extra"
out=$(cargo package -p tower-lock --no-verify 2>&1) || die "cargo package failed: $out"
# The examples and tests stay out of the package by design: cargo says so
# for each ("ignoring ... not included in the published package"); any
# other warning fails.
if grep -i warning <<<"$out" | grep -qv "not included in the published package"; then
    die "cargo package warned: $out"
fi
msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml)
if ! rustup run "$msrv" rustc --version >/dev/null 2>&1; then
    rustup toolchain install "$msrv" --profile minimal || die "could not install Rust $msrv (the declared MSRV) for its check"
fi
cargo "+$msrv" check -q -p tower-lock --all-features --lib || die "tower-lock does not build with Rust $msrv, its declared rust-version"
echo "Rust $msrv (the declared MSRV) builds the library with every feature"

step "cargo test --workspace --all-features (the library, the server suites, the members)"
cargo test --workspace --all-features

# The allocation count is for the layer as built by default (metrics off):
# the --all-features run above leaves it aside.
step "heap allocations per request, default features"
out=$(cargo test -p tower-lock-bench --test allocations -- --nocapture 2>&1) || die "the allocation test failed: $out"
grep -q "test result: ok. 1 passed" <<<"$out" || die "the allocation test did not run: $out"
grep "a request" <<<"$out" || true

# Every lock node is ephemeral: once the tests' sessions are closed (or, for
# the processes a test killed, expired) none may be left on the server.
no_ephemerals() { zk_says "${TOWER_LOCK_ZK_ADDR#*:}" dump "Sessions with Ephemerals (0)"; }
wait_for 30 "no ZooKeeper lock node left after the tests" no_ephemerals
echo "no ZooKeeper lock node left after the tests"

# Every Redis lock key carries a `{key}` hash tag and expires with its lease
# (a killed holder's within a second or two); only fencing counters stay.
redis_lock_keys() {
    local port
    for port in "${TOWER_LOCK_REDIS_URL##*:}" "${redlock[@]##*:}"; do
        redis-cli -p "$port" --scan | grep '{' | grep -v ':fence$' || true
    done
}
no_redis_locks() { [ -z "$(redis_lock_keys)" ]; }
check_no_redis_locks() {
    local deadline=$((SECONDS + 30))
    until no_redis_locks; do
        [ "$SECONDS" -lt "$deadline" ] || die "Redis lock keys left $1: $(redis_lock_keys | head -n 5 | tr '\n' ' ')"
        sleep 0.2
    done
    echo "no Redis lock key left $1"
}
check_no_redis_locks "after the tests"

# Advisory locks live with their sessions: none may be left, held or
# waiting, once the tests' connections are closed.
pg_locks_left() { psql "$TOWER_LOCK_POSTGRES_URL" -Atqc "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"; }
no_pg_locks() { [ "$(pg_locks_left)" = 0 ]; }
wait_for 30 "no PostgreSQL advisory lock left after the tests ($(pg_locks_left) left)" no_pg_locks
echo "no PostgreSQL advisory lock left after the tests"
# Lease rows are deleted on release (an expired one by the next backend's
# sweep, within a second): none may be left.
lease_rows_left() { psql "$TOWER_LOCK_POSTGRES_URL" -Atqc "SELECT count(*) FROM tower_lock_leases"; }
no_lease_rows() { [ "$(lease_rows_left)" = 0 ]; }
wait_for 30 "no PostgreSQL lease row left after the tests ($(lease_rows_left) left)" no_lease_rows
echo "no PostgreSQL lease row left after the tests"

# Every etcd lock key is attached to its backend's lease, revoked when the
# backend goes (a killed process's lease expires within its TTL).
# (order_service keeps its order numbers under /order_service/: not locks.)
etcd_keys_left() { ETCDCTL_API=3 etcdctl --endpoints "${TOWER_LOCK_ETCD_URL#etcd://}" get "" --from-key --keys-only | grep . | grep -vc '^/order_service/' || true; }
no_etcd_keys() { [ "$(etcd_keys_left)" = 0 ]; }
wait_for 30 "no etcd lock key left after the tests ($(etcd_keys_left) left)" no_etcd_keys
echo "no etcd lock key left after the tests"

step "loom models of the in-process core (src/loom/models/), every interleaving up to 3 preemptions"
# A target of their own: --cfg loom changes every crate's build.
loom_run() { RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR="$target/loom" "$@"; }
loom_run cargo clippy -q -p tower-lock --lib --no-default-features -- -D warnings
loom_run cargo clippy -q -p tower-lock-loom --all-targets -- -D warnings
out=$(loom_run cargo test -p tower-lock-loom --release 2>&1) || die "a loom model failed: $out"
models=$(grep -c '^fn ' loom/tests/models.rs)
grep -q "test result: ok. $models passed" <<<"$out" || die "expected $models loom models to run: $out"
echo "$models loom models passed"

step "the main command on a machine with only Rust: an empty target, PROTOC pointing nowhere"
scripts/first-build.sh

step "order_service example, end to end"
# The workspace's binaries with every feature, as the tests built them (one
# feature set: nothing is compiled twice).
cargo build -q --workspace --all-features --bins --examples
order_service=$target/debug/examples/order_service
bench=$target/debug/bench
http_instructions=$target/debug/http_instructions
expected="serialised: 10/10 requests, 10 unique order codes, max concurrent in critical section = 1"
locked=$("$order_service")
echo "$locked" | tail -n 3
[ "$(echo "$locked" | tail -n 1)" = "$expected" ] || die "order_service did not serialise: $(echo "$locked" | tail -n 1)"
unlocked=$("$order_service" --no-lock | tail -n 1)
echo "$unlocked"
[[ "$unlocked" =~ max\ concurrent\ in\ critical\ section\ =\ ([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -gt 1 ] ||
    die "order_service --no-lock should overlap: $unlocked"
shared=$("$order_service" --backend "$TOWER_LOCK_REDIS_URL" --instances 2)
echo "$shared" | tail -n 1
[ "$(echo "$shared" | tail -n 1)" = "$expected" ] || die "order_service over Redis with 2 instances did not serialise"
[ "$(echo "$shared" | grep -o 'server pid [0-9]*' | sort -u | wc -l)" -eq 2 ] || die "the requests did not reach both instances"
shared=$("$order_service" --backend "$TOWER_LOCK_REDLOCK_URL" --instances 2 | tail -n 1)
echo "$shared"
[ "$shared" = "$expected" ] || die "order_service over Redlock with 2 instances did not serialise"
shared=$("$order_service" --backend "zk://$TOWER_LOCK_ZK_ADDR" --instances 2)
echo "$shared" | tail -n 1
[ "$(echo "$shared" | tail -n 1)" = "$expected" ] || die "order_service over ZooKeeper with 2 instances did not serialise"
[ "$(echo "$shared" | grep -o 'server pid [0-9]*' | sort -u | wc -l)" -eq 2 ] || die "the requests did not reach both instances"
shared=$("$order_service" --backend "$TOWER_LOCK_POSTGRES_URL" --instances 2)
echo "$shared" | tail -n 1
[ "$(echo "$shared" | tail -n 1)" = "$expected" ] || die "order_service over PostgreSQL with 2 instances did not serialise"
[ "$(echo "$shared" | grep -o 'server pid [0-9]*' | sort -u | wc -l)" -eq 2 ] || die "the requests did not reach both instances"
# The lease-table mode, through PgBouncer in transaction pooling.
shared=$("$order_service" --backend "$TOWER_LOCK_PGBOUNCER_URL?lease_table" --instances 2)
echo "$shared" | tail -n 1
[ "$(echo "$shared" | tail -n 1)" = "$expected" ] || die "order_service over PostgreSQL's lease table through PgBouncer with 2 instances did not serialise"
shared=$("$order_service" --backend "$TOWER_LOCK_MYSQL_URL" --instances 2)
echo "$shared" | tail -n 1
[ "$(echo "$shared" | tail -n 1)" = "$expected" ] || die "order_service over MariaDB with 2 instances did not serialise"
[ "$(echo "$shared" | grep -o 'server pid [0-9]*' | sort -u | wc -l)" -eq 2 ] || die "the requests did not reach both instances"
shared=$("$order_service" --backend "$TOWER_LOCK_ETCD_URL" --instances 2)
echo "$shared"
[ "$(echo "$shared" | tail -n 1)" = "$expected" ] || die "order_service over etcd with 2 instances did not serialise"
if "$order_service" --backend nonsense:// 2>/dev/null; then
    die "order_service accepted an unknown backend"
fi

# Built with default features (this replaces the all-features build above),
# the example names the feature a remote backend needs.
if missing=$(cargo run -q --example order_service -- --backend "$TOWER_LOCK_REDIS_URL" 2>&1); then
    die "order_service without the redis feature accepted a Redis URL"
fi
[[ "$missing" == *"--features"* && "$missing" == *'`redis` feature'* ]] || die "order_service without the redis feature said: $missing"

step "plain tower and gRPC examples, end to end"
cargo run -q --example plain_tower -- --self-test || die "plain_tower self-test failed"
"$target/debug/grpc" | tail -n 1 | grep -qx "every lock released" || die "grpc example failed"

step "bench example, short runs"
for workload in "uncontended --n 2000" "contended --secs 1 --workers 8" "keys --secs 1 --workers 8 --keys 16" "http --secs 1 --conns 4" \
    "http --secs 1 --conns 4 --mount route"; do
    # shellcheck disable=SC2086
    line=$("$bench" --backend memory --workload $workload)
    echo "$line"
    # The http workload adds the hand-written peer's and the floor layer's
    # lines after ours.
    first=${line%%$'\n'*}
    [[ "$first" == impl=tower-lock\ backend=memory\ * ]] || die "bench printed an unexpected line: $line"
    if [[ "$workload" == http* ]]; then
        [[ "$line" == *$'\n'impl=hand-mutex-map\ *$'\n'impl=layer-floor\ * ]] ||
            die "bench's http run lacks the peer's or the floor's line: $line"
    fi
    if [[ "$workload" == *--mount\ route* ]]; then
        # Every line of the run, ours, the peer's and the floor's, says how
        # it was mounted.
        while read -r each; do
            [[ "$each" == *\ mount=route\ * ]] || die "bench did not tag --mount route: $line"
        done <<<"$line"
    else
        [[ "$line" != *mount=* ]] || die "bench tagged a run it did not mount with route_layer: $line"
    fi
    [[ "$line" != *overlaps=* || "$line" == *overlaps=0* ]] || die "bench saw overlapping holders: $line"
done
for backend in "$TOWER_LOCK_REDIS_URL" "$TOWER_LOCK_REDLOCK_URL" "zk://$TOWER_LOCK_ZK_ADDR" "$TOWER_LOCK_POSTGRES_URL" "$TOWER_LOCK_MYSQL_URL" "$TOWER_LOCK_ETCD_URL"; do
    for workload in "uncontended --n 300" "uncontended --n 300 --release await" "contended --secs 1 --workers 8" \
        "contended --secs 1 --workers 4 --processes 2" "keys --secs 1 --workers 8 --keys 16"; do
        # shellcheck disable=SC2086
        line=$("$bench" --backend "$backend" --workload $workload)
        echo "$line"
        [[ "$line" == impl=tower-lock\ backend=* && ("$line" != *overlaps=* || "$line" == *overlaps=0*) ]] ||
            die "bench over $backend printed: $line"
    done
done
# Negative controls: the same workloads with a lock that excludes nobody must
# show overlaps, or the overlaps=0 above prove nothing.
for backend in memory "$TOWER_LOCK_REDIS_URL" "zk://$TOWER_LOCK_ZK_ADDR" "$TOWER_LOCK_POSTGRES_URL" "$TOWER_LOCK_MYSQL_URL" "$TOWER_LOCK_ETCD_URL"; do
    for workload in "contended --secs 1 --workers 8" "keys --secs 1 --workers 8 --keys 4"; do
        # shellcheck disable=SC2086
        line=$("$bench" --backend "$backend" --workload $workload --no-lock)
        echo "$line"
        [[ "$line" =~ overlaps=([0-9]+) ]] && [ "${BASH_REMATCH[1]}" -gt 0 ] ||
            die "the negative control over $backend saw no overlap: $line"
    done
done
line=$("$bench" --backend "$TOWER_LOCK_REDIS_URL" --workload contended --secs 1 --workers 4 --processes 2 --no-lock)
echo "$line"
[[ "$line" =~ overlaps=([0-9]+) ]] && [ "${BASH_REMATCH[1]}" -gt 0 ] ||
    die "the negative control across processes saw no overlap: $line"
for bad in "--workload http --mount bogus" "--workload keys --mount route" "--workload http --calibrate --mount route"; do
    set +e
    # shellcheck disable=SC2086
    "$bench" --backend memory $bad 2>/dev/null
    code=$?
    set -e
    [ "$code" -eq 2 ] || die "bench $bad should exit 2, got $code"
done
# The routes scripts/count-instructions.sh counts under callgrind answer.
routes=$("$http_instructions" --routes)
[ -n "$routes" ] || die "http_instructions --routes listed nothing"
for route in $routes; do
    "$http_instructions" "$route" 10 || die "http_instructions $route failed"
done
line=$("$bench" --backend memory --workload http --secs 1 --conns 4 --calibrate)
echo "$line"
[[ "$line" == impl=bare-vs-bare\ * ]] || die "bench --calibrate printed: $line"
set +e
"$bench" --backend zk://127.0.0.1:1 --workload uncontended 2>/dev/null
code=$?
set -e
[ "$code" -eq 2 ] || die "bench with an unreachable backend should exit 2, got $code"
check_no_redis_locks "after the examples"
wait_for 30 "no PostgreSQL advisory lock left after the examples ($(pg_locks_left) left)" no_pg_locks
wait_for 30 "no etcd lock key left after the examples ($(etcd_keys_left) left)" no_etcd_keys

step "torture harness, a short run on each backend (a random seed each; replay with --seed N)"
# Each run starts its own servers, injects every fault that applies to the
# backend and exits 1 if a guarantee was broken. The ensembles (zk3, etcd3)
# are left to scripts/torture-all.sh: their server tests kill and pause
# members already.
cargo build -q --release -p tower-lock-torture
scripts/torture-all.sh 30 "$target/torture-run.txt" memory redis redis-quarantine redis-short-lease redlock \
    zk postgres postgres-table mysql mysql-restarts etcd sentinel sentinel-wait cluster cluster-wait

step "the torture harness's negative controls: each sabotage makes a run fail"
# Each breaks one promise on purpose; the checker must see it and the run
# exit 1, or the zeros above prove nothing.
sabotaged() {
    local line
    if line=$("$target/release/torture" "$@"); then
        die "torture $* passed: the checker missed the sabotage: $line"
    fi
    echo "$line"
}
for sabotage in early-release same-token ignore-lease; do
    sabotaged --backend memory --secs 5 --seed 1 --sabotage "$sabotage"
done
# A lost signal is only missed where locks are lost: ZooKeeper (on Redis
# without quarantine, the server-kill excuse still hides it), under pauses,
# which the nemesis gives to a process holding a lock in its critical
# section for longer than the session, on two keys so that another process
# takes a lost one at once. Each such pause is an untold overlap under the
# sabotage (11 to 36 per run seen); a run that meets none fails the control.
sabotaged --backend zk --secs 30 --keys 2 --seed 1 --nemesis pause --sabotage no-lost

step "all checks passed in $((SECONDS - started))s"
