#!/usr/bin/env bash
# Sourced by scripts/test-all.sh and scripts/bench-all.sh: installs the
# Debian packages the servers and peers need (as root; otherwise says which
# to install), starts private servers on free loopback ports, and stops them
# on exit, whatever happened.
#
# After `start_servers`: TOWER_LOCK_REDIS_URL (one redis-server),
# TOWER_LOCK_REDLOCK_URL (three more), TOWER_LOCK_ZK_ADDR (ZooKeeper) and
# TOWER_LOCK_POSTGRES_URL, TOWER_LOCK_PGBOUNCER_URL (PgBouncer in
# transaction pooling in front of it), TOWER_LOCK_MYSQL_URL and TOWER_LOCK_ETCD_URL
# (one etcd member) are exported; `redlock`
# holds the three Redlock addresses. PostgreSQL and MariaDB are the
# machine's (127.0.0.1:5432, trust auth, database `test`; 127.0.0.1:3306,
# root without password, database `test`) when they answer, otherwise
# private ones.

started=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/tower-lock-test.XXXXXX")
# The servers run as `postgres` or `mysql` (as root) reach theirs through it.
chmod o+x "$work"
pids=()

cleanup() {
    local code=$?
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Each step says when it began, in seconds since the script started: the
# test command's time, step by step.
step() { printf '\n==> [%ss] %s\n' "$((SECONDS - started))" "$*"; }
die() { printf '%s: %s\n' "$(basename "$0" .sh)" "$*" >&2; exit 1; }

# --- packages ----------------------------------------------------------------

# Each line: a file that proves the package is there, and the package.
# openssl makes the TLS tests' throw-away certificates; libssl-dev and
# pkg-config build the `redis-tls` feature (native-tls over OpenSSL).
required_packages() {
    cat <<'EOF'
/usr/bin/redis-server redis-server
/usr/bin/redis-cli redis-tools
/usr/bin/openssl openssl
/usr/include/openssl/ssl.h libssl-dev
/usr/bin/pkg-config pkg-config
/usr/share/java/zookeeper.jar zookeeper
/usr/bin/java default-jre-headless
/usr/bin/javac default-jdk-headless
/usr/share/java/curator-recipes.jar libcurator-recipes-java
/usr/share/java/slf4j-nop.jar libslf4j-java
/usr/bin/python3 python3
/usr/lib/python3/dist-packages/redis/__init__.py python3-redis
/usr/lib/python3/dist-packages/kazoo/__init__.py python3-kazoo
/usr/share/doc/postgresql/copyright postgresql
/usr/lib/python3/dist-packages/psycopg2/__init__.py python3-psycopg2
/usr/sbin/pgbouncer pgbouncer
/usr/sbin/mariadbd mariadb-server
/usr/bin/mariadb mariadb-client
/usr/lib/python3/dist-packages/pymysql/__init__.py python3-pymysql
/usr/bin/etcd etcd-server
/usr/bin/etcdctl etcd-client
/usr/bin/protoc protobuf-compiler
EOF
}

# What only the benchmark's peers need: Go and etcd's Go client sources, for
# the Go peer of the etcd backend (built without any download).
bench_packages() {
    cat <<'EOF'
/usr/bin/go golang-go
/usr/share/gocode/src/go.etcd.io/etcd/clientv3/concurrency/mutex.go golang-etcd-server-dev
EOF
}

# install_packages [bench]: the test command's packages, and with `bench`
# the benchmark peers' too.
install_packages() {
    local missing=() file package
    while read -r file package; do
        [ -e "$file" ] || missing+=("$package")
    done < <(required_packages; [ "${1:-}" != bench ] || bench_packages)
    [ "${#missing[@]}" -gt 0 ] || return 0
    if [ "$(id -u)" -eq 0 ]; then
        step "installing missing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        die "missing Debian packages: ${missing[*]}; run as root, or: sudo apt-get install ${missing[*]}"
    fi
}

# --- servers -----------------------------------------------------------------
#
# The servers themselves are started by the project's one server harness
# (the `tower-lock-servers` crate, `servers/`), which the torture harness
# and the Rust tests use too; this script only runs it and reads back the
# addresses.

# wait_for SECONDS DESCRIPTION COMMAND...: retries COMMAND until it succeeds.
wait_for() {
    local limit=$1 what=$2
    shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || die "$what did not come up within ${limit}s"
        sleep 0.2
    done
}

# zk_says PORT WORD EXPECT: ZooKeeper's answer to a four-letter word on PORT
# holds EXPECT.
zk_says() {
    local port=$1 word=$2 expect=$3 reply
    # A server still starting may accept and never answer: bounded.
    reply=$(exec 3<>"/dev/tcp/127.0.0.1/$port" && printf '%s' "$word" >&3 && timeout 2 cat <&3) || return 1
    [[ "$reply" == *"$expect"* ]]
}

# start_set SET...: the servers of each SET (`tower-lock-servers DIR SET...`:
# base, sentinel, redis-cluster, zk-ensemble, etcd3), stopped on exit; their
# addresses are read into this shell.
start_set() {
    local dir pid
    if [ -z "${servers_bin:-}" ]; then
        cargo build -q -p tower-lock-servers || die "building tower-lock-servers failed"
        servers_bin=${CARGO_TARGET_DIR:-target}/debug/tower-lock-servers
    fi
    dir=$(mktemp -d "$work/servers.XXXXXX")
    "$servers_bin" "$dir" "$@" >"$dir/servers.log" 2>&1 &
    pid=$!
    pids+=("$pid")
    until [ -f "$dir/env" ]; do
        kill -0 "$pid" 2>/dev/null || die "starting the servers ($*) failed: $(tail -n 20 "$dir/servers.log")"
        sleep 0.2
    done
    # shellcheck disable=SC1091 # written by tower-lock-servers
    source "$dir/env"
}

# The extra sets the bench uses; each sets the variable it names.
start_sentinel() { start_set sentinel; }           # $sentinel_urls
start_redis_cluster() { start_set redis-cluster; } # $redis_cluster_urls
start_zk_ensemble() { start_set zk-ensemble; }     # $zk_ensemble
start_etcd_cluster() { start_set etcd3; }          # $etcd_urls

start_servers() {
    step "starting servers"
    start_set base
    echo "redis-server on ${TOWER_LOCK_REDIS_URL#redis://}"
    echo "Redlock over $TOWER_LOCK_REDLOCK_URL"
    echo "ZooKeeper on $TOWER_LOCK_ZK_ADDR"
    echo "PostgreSQL on ${TOWER_LOCK_POSTGRES_URL#*@}, PgBouncer (transaction pooling) on ${TOWER_LOCK_PGBOUNCER_URL#*@}"
    echo "MariaDB on ${TOWER_LOCK_MYSQL_URL#*@}"
    echo "etcd on ${TOWER_LOCK_ETCD_URL#etcd://}"
}
