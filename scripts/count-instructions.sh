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
# Usage: scripts/count-instructions.sh [N]     (default 10000)
set -euo pipefail

cd "$(dirname "$0")/.."
n=${1:-10000}
die() { echo "count-instructions: $*" >&2; exit 1; }
[[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N must be a positive number, not '$n'"
command -v valgrind >/dev/null || die "needs valgrind (apt-get install valgrind)"
cargo build -q --release -p tower-lock-bench --bin http_instructions --bin http_allocations
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
