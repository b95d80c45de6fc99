#!/usr/bin/env bash
# A new user's first minute, measured: the README's main command built and
# run from an empty target directory with PROTOC pointing nowhere (so any
# build script that needs protoc, or any other tool beyond a Rust toolchain,
# fails it), then the minimal app (examples/minimal: tower-lock, axum, tokio,
# a hyper client) built the same way, for the yardstick. Each build gets a
# target directory of its own; downloaded crates are shared, as on a
# machine that has fetched them once.
#
# Prints one line: first_build_order_service_s=.. first_build_minimal_s=..
# ratio=.. (the goal is a ratio of at most 2.5), after the main
# command's last line. Exits non-zero if either build or run fails.
#
# Usage: scripts/first-build.sh
set -euo pipefail

cd "$(dirname "$0")/.."
die() { echo "first-build: $*" >&2; exit 1; }
dirs=$(mktemp -d)
trap 'rm -rf "$dirs"' EXIT
export PROTOC=/nonexistent/protoc

# Seconds, to a tenth, that "$@" takes.
timed() {
    local start end
    start=$(date +%s.%N)
    "$@" >"$dirs/log" 2>&1 || { tail -n 30 "$dirs/log" >&2; die "failed: $*"; }
    end=$(date +%s.%N)
    echo "$start $end" | awk '{ printf "%.1f", $2 - $1 }'
}

cargo fetch -q
main=$(CARGO_TARGET_DIR=$dirs/main timed cargo build --example order_service)
last=$(CARGO_TARGET_DIR=$dirs/main cargo run -q --example order_service | tail -n 1)
echo "$last"
[ "$last" = "serialised: 10/10 requests, 10 unique order codes, max concurrent in critical section = 1" ] ||
    die "the main command did not serialise: $last"
rm -rf "$dirs/main"
minimal=$(CARGO_TARGET_DIR=$dirs/minimal timed cargo build -p example-minimal)
reply=$(CARGO_TARGET_DIR=$dirs/minimal cargo run -q -p example-minimal)
[[ "$reply" == "200 OK: order for sku-1 "* ]] || die "the minimal app answered: $reply"
ratio=$(echo "$main $minimal" | awk '{ printf "%.2f", $1 / $2 }')
echo "first_build_order_service_s=$main first_build_minimal_s=$minimal ratio=$ratio"
