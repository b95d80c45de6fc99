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

free_port() {
    /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

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

# start_redis NAME: a redis-server on a free port, left in $redis_port (not
# printed: a command substitution would lose the pid kept for cleanup).
start_redis() {
    local port
    port=$(free_port)
    mkdir -p "$work/$1"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$work/$1" --logfile "$work/$1/redis.log" >/dev/null &
    pids+=("$!")
    wait_for 10 "redis-server on port $port" redis-cli -p "$port" ping
    redis_port=$port
}

# ZooKeeper answers its four-letter words on the client port.
zk_says() {
    local port=$1 word=$2 expect=$3 reply
    # A server still starting may accept and never answer: bounded.
    reply=$(exec 3<>"/dev/tcp/127.0.0.1/$port" && printf '%s' "$word" >&3 && timeout 2 cat <&3) || return 1
    [[ "$reply" == *"$expect"* ]]
}

start_zookeeper() {
    local port
    port=$(free_port)
    mkdir -p "$work/zk/data"
    # A short tick lets session-expiry tests finish in seconds; every
    # four-letter word is allowed so tests can count watches.
    cat >"$work/zk/zoo.cfg" <<EOF
tickTime=200
minSessionTimeout=400
maxSessionTimeout=60000
dataDir=$work/zk/data
clientPort=$port
clientPortAddress=127.0.0.1
admin.enableServer=false
4lw.commands.whitelist=*
maxClientCnxns=0
EOF
    # Empty container parents are reaped every second rather than every minute.
    java -Dzookeeper.log.dir="$work/zk" -Dznode.container.checkIntervalMs=1000 -cp "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar" \
        org.apache.zookeeper.server.quorum.QuorumPeerMain "$work/zk/zoo.cfg" \
        >"$work/zk/zookeeper.log" 2>&1 &
    pids+=("$!")
    wait_for 60 "ZooKeeper on port $port (log: $work/zk/zookeeper.log)" zk_says "$port" isro rw
    export TOWER_LOCK_ZK_ADDR="127.0.0.1:$port"
    echo "ZooKeeper on 127.0.0.1:$port"
}

# start_zk_ensemble NAME: three ZooKeeper servers forming one ensemble, as
# the tests start them (200 ms tick); sets $zk_ensemble (host:port list).
start_zk_ensemble() {
    local name=$1 i ports=() peers=() elections=() cfg
    for i in 1 2 3; do
        ports+=("$(free_port)")
        peers+=("$(free_port)")
        elections+=("$(free_port)")
    done
    for i in 1 2 3; do
        mkdir -p "$work/$name$i/data"
        echo "$i" >"$work/$name$i/data/myid"
        cfg="tickTime=200
initLimit=10
syncLimit=5
minSessionTimeout=400
maxSessionTimeout=60000
dataDir=$work/$name$i/data
clientPort=${ports[i - 1]}
clientPortAddress=127.0.0.1
admin.enableServer=false
4lw.commands.whitelist=*
maxClientCnxns=0"
        for j in 1 2 3; do
            cfg+="
server.$j=127.0.0.1:${peers[j - 1]}:${elections[j - 1]}"
        done
        printf '%s\n' "$cfg" >"$work/$name$i/zoo.cfg"
        java -Dzookeeper.log.dir="$work/$name$i" -cp "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar" \
            org.apache.zookeeper.server.quorum.QuorumPeerMain "$work/$name$i/zoo.cfg" \
            >"$work/$name$i/zookeeper.log" 2>&1 &
        pids+=("$!")
    done
    for i in 1 2 3; do
        wait_for 60 "ZooKeeper $name$i on port ${ports[i - 1]} (log: $work/$name$i/zookeeper.log)" \
            zk_says "${ports[i - 1]}" isro rw
    done
    zk_ensemble=$(for p in "${ports[@]}"; do printf '127.0.0.1:%s,' "$p"; done)
    zk_ensemble=${zk_ensemble%,}
}

# The machine's PostgreSQL when it answers; otherwise a private instance on
# a free port (run as the `postgres` user when this script runs as root,
# which PostgreSQL refuses to run as).
start_postgres() {
    local url=postgres://postgres@127.0.0.1:5432/test
    if [ -z "${TOWER_LOCK_PRIVATE_POSTGRES:-}" ] && psql "$url" -Atqc 'SELECT 1' >/dev/null 2>&1; then
        export TOWER_LOCK_POSTGRES_URL=$url
        echo "PostgreSQL: the machine's, on 127.0.0.1:5432"
        return
    fi
    local bin port dir as_pg=()
    bin=$(find /usr/lib/postgresql -maxdepth 2 -name bin -type d | sort -V | tail -n 1)
    [ -x "$bin/postgres" ] || die "PostgreSQL is neither answering on 127.0.0.1:5432 nor installed (apt-get install postgresql)"
    port=$(free_port)
    dir="$work/pg"
    mkdir -p "$dir"
    if [ "$(id -u)" -eq 0 ]; then
        chmod o+x "$work"
        chown postgres: "$dir"
        as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups)
    fi
    "${as_pg[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 ||
        die "initdb failed (log: $dir/initdb.log)"
    "${as_pg[@]}" "$bin/postgres" -D "$dir/data" -p "$port" -k "$dir" -c listen_addresses=127.0.0.1 \
        -c fsync=off -c max_connections=300 >"$dir/postgres.log" 2>&1 &
    pids+=("$!")
    wait_for 30 "PostgreSQL on port $port (log: $dir/postgres.log)" \
        psql "postgres://postgres@127.0.0.1:$port/postgres" -Atqc 'SELECT 1'
    psql "postgres://postgres@127.0.0.1:$port/postgres" -qc 'CREATE DATABASE test' >/dev/null
    export TOWER_LOCK_POSTGRES_URL="postgres://postgres@127.0.0.1:$port/test"
    echo "PostgreSQL: a private one, on 127.0.0.1:$port"
}

# PgBouncer in transaction pooling in front of $TOWER_LOCK_POSTGRES_URL, on a
# free port, for the lease-table mode (as the `postgres` user when this
# script runs as root, which PgBouncer refuses to run as).
start_pgbouncer() {
    local port dir pg_port as_pg=()
    port=$(free_port)
    dir="$work/pgbouncer"
    mkdir -p "$dir"
    pg_port=${TOWER_LOCK_POSTGRES_URL##*:}
    pg_port=${pg_port%%/*}
    cat >"$dir/pgbouncer.ini" <<EOF
[databases]
test = host=127.0.0.1 port=$pg_port dbname=test user=postgres
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $dir/users.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 20
ignore_startup_parameters = extra_float_digits,options
logfile = $dir/pgbouncer.log
EOF
    echo '"postgres" ""' >"$dir/users.txt"
    if [ "$(id -u)" -eq 0 ]; then
        chmod o+x "$work"
        chown -R postgres: "$dir"
        as_pg=(setpriv --reuid=postgres --regid=postgres --init-groups)
    fi
    "${as_pg[@]}" pgbouncer "$dir/pgbouncer.ini" >"$dir/stdout.log" 2>&1 &
    pids+=("$!")
    wait_for 30 "PgBouncer on port $port (log: $dir/pgbouncer.log)" \
        psql "postgres://postgres@127.0.0.1:$port/test" -Atqc 'SELECT 1'
    export TOWER_LOCK_PGBOUNCER_URL="postgres://postgres@127.0.0.1:$port/test"
    echo "PgBouncer (transaction pooling) on 127.0.0.1:$port, in front of PostgreSQL"
}

# The machine's MariaDB when it answers; otherwise a private instance on a
# free port (as the `mysql` user when this script runs as root).
start_mariadb() {
    if [ -z "${TOWER_LOCK_PRIVATE_MARIADB:-}" ] &&
        mariadb -h 127.0.0.1 -P 3306 -u root test -e 'SELECT 1' >/dev/null 2>&1; then
        export TOWER_LOCK_MYSQL_URL=mysql://root@127.0.0.1:3306/test
        echo "MariaDB: the machine's, on 127.0.0.1:3306"
        return
    fi
    local port dir user=()
    port=$(free_port)
    dir="$work/mariadb"
    mkdir -p "$dir"
    if [ "$(id -u)" -eq 0 ]; then
        chmod o+x "$work"
        chown mysql: "$dir"
        user=(--user=mysql)
    fi
    mariadb-install-db "${user[@]}" --datadir="$dir/data" --auth-root-authentication-method=normal \
        --skip-test-db >"$dir/install.log" 2>&1 || die "mariadb-install-db failed (log: $dir/install.log)"
    mariadbd --no-defaults "${user[@]}" --datadir="$dir/data" --port="$port" --bind-address=127.0.0.1 \
        --socket="$dir/mysqld.sock" --pid-file="$dir/mysqld.pid" --skip-log-bin \
        --max-connections=300 >"$dir/mariadb.log" 2>&1 &
    pids+=("$!")
    wait_for 60 "MariaDB on port $port (log: $dir/mariadb.log)" \
        mariadb -h 127.0.0.1 -P "$port" -u root -e 'SELECT 1'
    mariadb -h 127.0.0.1 -P "$port" -u root -e 'CREATE DATABASE IF NOT EXISTS test'
    export TOWER_LOCK_MYSQL_URL="mysql://root@127.0.0.1:$port/test"
    echo "MariaDB: a private one, on 127.0.0.1:$port"
}

# start_etcd NAME MEMBERS: an etcd cluster of MEMBERS members on free
# loopback ports; its client URLs, comma-separated, are left in $etcd_urls.
# A short heartbeat makes leader elections (and so fault tests) quick.
start_etcd() {
    local name=$1 members=$2 i cluster="" peers=() clients=()
    for ((i = 1; i <= members; i++)); do
        peers+=("$(free_port)")
        clients+=("$(free_port)")
        cluster+="${cluster:+,}$name$i=http://127.0.0.1:${peers[i - 1]}"
    done
    for ((i = 1; i <= members; i++)); do
        mkdir -p "$work/$name$i"
        etcd --name "$name$i" --data-dir "$work/$name$i/data" \
            --listen-client-urls "http://127.0.0.1:${clients[i - 1]}" \
            --advertise-client-urls "http://127.0.0.1:${clients[i - 1]}" \
            --listen-peer-urls "http://127.0.0.1:${peers[i - 1]}" \
            --initial-advertise-peer-urls "http://127.0.0.1:${peers[i - 1]}" \
            --initial-cluster "$cluster" --initial-cluster-state new \
            --heartbeat-interval 50 --election-timeout 500 \
            >"$work/$name$i/etcd.log" 2>&1 &
        pids+=("$!")
    done
    etcd_urls=$(for c in "${clients[@]}"; do printf '127.0.0.1:%s,' "$c"; done)
    etcd_urls=${etcd_urls%,}
    wait_for 60 "etcd $name (logs: $work/$name*/etcd.log)" \
        env ETCDCTL_API=3 etcdctl --endpoints "$etcd_urls" endpoint health --cluster
}

# start_sentinel NAME: a Redis master, two replicas and three Sentinels
# monitoring it as `locks`; sets $sentinel_urls (the Sentinels' host:port
# list).
start_sentinel() {
    local name=$1 i master port sentinels=()
    start_redis "$name-redis0"
    master=$redis_port
    for i in 1 2; do
        port=$(free_port)
        mkdir -p "$work/$name-redis$i"
        redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
            --replicaof 127.0.0.1 "$master" --repl-diskless-sync-delay 0 \
            --dir "$work/$name-redis$i" --logfile "$work/$name-redis$i/redis.log" >/dev/null &
        pids+=("$!")
        wait_for 10 "redis replica on port $port" redis-cli -p "$port" ping
    done
    for i in 1 2 3; do
        port=$(free_port)
        mkdir -p "$work/$name-sentinel$i"
        printf '%s\n' "port $port" "bind 127.0.0.1" "dir $work/$name-sentinel$i" \
            "sentinel monitor locks 127.0.0.1 $master 2" \
            "sentinel down-after-milliseconds locks 1000" \
            "sentinel failover-timeout locks 3000" >"$work/$name-sentinel$i/sentinel.conf"
        redis-server "$work/$name-sentinel$i/sentinel.conf" --sentinel \
            --logfile "$work/$name-sentinel$i/sentinel.log" >/dev/null &
        pids+=("$!")
        sentinels+=("127.0.0.1:$port")
        wait_for 10 "Sentinel on port $port" redis-cli -p "$port" ping
    done
    wait_for 30 "both replicas in sync with the master on port $master" replicas_online "$master" 2
    for i in "${sentinels[@]}"; do
        wait_for 30 "Sentinel $i finding both replicas" sentinel_knows_replicas "${i##*:}" 2
    done
    sentinel_urls=$(IFS=,; echo "${sentinels[*]}")
}

# start_redis_cluster NAME: a Redis Cluster of three masters and a replica
# of each; sets $redis_cluster_urls (every node's host:port).
start_redis_cluster() {
    local name=$1 i port bus nodes=()
    for i in 0 1 2 3 4 5; do
        port=$(free_port)
        bus=$(free_port) # not the default port + 10000, which may be taken
        mkdir -p "$work/$name-node$i"
        redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
            --cluster-enabled yes --cluster-port "$bus" --cluster-node-timeout 2000 --cluster-config-file nodes.conf \
            --repl-diskless-sync-delay 0 \
            --dir "$work/$name-node$i" --logfile "$work/$name-node$i/redis.log" >/dev/null &
        pids+=("$!")
        nodes+=("127.0.0.1:$port")
        wait_for 10 "redis cluster node on port $port" redis-cli -p "$port" ping
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$work/$name-create.log" ||
        die "redis-cli --cluster create failed: $(cat "$work/$name-create.log")"
    for i in "${nodes[@]}"; do
        wait_for 30 "cluster node $i to say the cluster is ok" cluster_ok "${i##*:}"
    done
    redis_cluster_urls=$(IFS=,; echo "${nodes[*]}")
}

# cluster_ok PORT: the cluster node on PORT says the cluster is ok.
cluster_ok() {
    redis-cli -p "$1" cluster info | grep -q '^cluster_state:ok'
}

# replicas_online PORT N: the master on PORT streams to N replicas.
replicas_online() {
    [ "$(redis-cli -p "$1" info replication | grep -c 'state=online')" = "$2" ]
}

# sentinel_knows_replicas PORT N: the Sentinel on PORT knows N replicas.
sentinel_knows_replicas() {
    [ "$(redis-cli -p "$1" sentinel master locks | grep -A1 '^num-slaves$' | tail -1)" = "$2" ]
}

start_servers() {
    step "starting servers"
    start_redis redis
    export TOWER_LOCK_REDIS_URL="redis://127.0.0.1:$redis_port"
    echo "redis-server on 127.0.0.1:$redis_port"
    redlock=()
    for i in 1 2 3; do
        start_redis "redlock$i"
        redlock+=("127.0.0.1:$redis_port")
    done
    TOWER_LOCK_REDLOCK_URL="redlock://$(IFS=,; echo "${redlock[*]}")"
    export TOWER_LOCK_REDLOCK_URL
    echo "Redlock over $TOWER_LOCK_REDLOCK_URL"
    start_zookeeper
    start_postgres
    start_pgbouncer
    start_mariadb
    start_etcd etcd 1
    export TOWER_LOCK_ETCD_URL="etcd://$etcd_urls"
    echo "etcd on $etcd_urls"
}
