#!/usr/bin/env bash
# Counts the instructions one request costs on each route of the `http`
# workload, called through tower in one process (bench/src/bin/http_instructions.rs),
# with valgrind's callgrind: a count that does not drift with the machine's
# load, unlike the bench's rates. Each route runs N and 2N requests; the
# difference over N is the cost per request, start-up excluded. Then, in a
# process apart (its bookkeeping would inflate the instruction count), the
# heap allocations per request, counted by a global allocator
# (bench/src/bin/http_allocations.rs). Prints one line per route, each cost
# and its excess over the bare route's.
#
# With `--backend URL` (repeatable; a running server's), also what one
# lock and its release cost the client on that backend, through the
# library and through the bench's raw floor (`bench --workload cycles`,
# the `http` workload's `rps_floor` commands): M and 2M cycles, M = N/2,
# the difference over M, one line each and the library's excess. These
# counts move with the timing of the server's answers (the event loop
# polls more or less often), by some ±1M instructions a run: hence M
# large.
#
# Usage: scripts/count-instructions.sh [N] [--backend URL]...   (N: 10000)
set -euo pipefail

cd "$(dirname "$0")/.."
n=10000
backends=()
while [ $# -gt 0 ]; do
    case $1 in
    --backend) [ $# -ge 2 ] || { echo "count-instructions: --backend needs a URL" >&2; exit 1; }
        backends+=("$2"); shift 2 ;;
    *) n=$1; shift ;;
    esac
done
die() { echo "count-instructions: $*" >&2; exit 1; }
[[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N must be a positive number, not '$n'"
command -v valgrind >/dev/null || die "needs valgrind (apt-get install valgrind)"
cargo build -q --release -p tower-lock-bench --bin http_instructions --bin http_allocations \
    ${backends:+--bin bench}
bin=${CARGO_TARGET_DIR:-target}/release/http_instructions
allocations=$("${CARGO_TARGET_DIR:-target}/release/http_allocations" "$n") ||
    die "counting allocations failed"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Instructions of one run of route $1 with $2 requests.
count() {
    valgrind --tool=callgrind --log-file="$out/log" --callgrind-out-file="$out/cg" \
        "$bin" "$1" "$2" || die "$1 with $2 requests failed: $(cat "$out/log")"
    local total
    total=$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$out/log")
    [ -n "$total" ] || die "no instruction count from valgrind: $(cat "$out/log")"
    echo "$total"
}

bare=
for route in $("$bin" --routes); do
    one=$(count "$route" "$n")
    two=$(count "$route" $((2 * n)))
    per=$(((two - one) / n))
    bare=${bare:-$per}
    allocs=$(sed -n "s/^route=$route requests=[0-9]* \(allocations_per_request=[0-9.]*\) over_bare=\([0-9.-]*\)$/\1 allocations_over_bare=\2/p" <<<"$allocations")
    [ -n "$allocs" ] || die "no allocation count for $route: $allocations"
    echo "route=$route requests=$n instructions_per_request=$per over_bare=$((per - bare)) $allocs"
done

# Instructions of `bench --workload cycles` on backend $1 with $2 cycles
# (and `--raw`, given as $3).
cycles() {
    valgrind --tool=callgrind --log-file="$out/log" --callgrind-out-file="$out/cg" \
        "${CARGO_TARGET_DIR:-target}/release/bench" --backend "$1" --workload cycles --n "$2" ${3:-} \
        >/dev/null || die "cycles on the backend failed (is its server running?): $(tail -3 "$out/log")"
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$out/log"
}

m=$(((n + 1) / 2))
for url in ${backends[@]+"${backends[@]}"}; do
    scheme=${url%%://*}
    lib=$((($(cycles "$url" $((2 * m))) - $(cycles "$url" "$m")) / m))
    raw=$((($(cycles "$url" $((2 * m)) --raw) - $(cycles "$url" "$m" --raw)) / m))
    echo "backend=$scheme impl=tower-lock cycles=$m instructions_per_lock=$lib over_floor=$((lib - raw))"
    echo "backend=$scheme impl=raw-floor cycles=$m instructions_per_lock=$raw"
done
