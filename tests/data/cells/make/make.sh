#!/bin/bash
# Remake tests/data/cells/*.parquet: each from its own commit's code, in a detached worktree of that commit.
#   tests/data/cells/make/make.sh [NAME-GLOB]     (PY: the Python to use, default /work/main/.venv/bin/python)
# Each run also leaves its server records in <file>.state/ (KEEP_STATE=1); those kept are in tests/data/server-records/.
set -euo pipefail
MAKE=$(cd "$(dirname "$0")" && pwd)
CELLS=$(dirname "$MAKE")
REPO=$(git -C "$MAKE" rev-parse --show-toplevel)
PY=${PY:-/work/main/.venv/bin/python}
ONLY=${1:-*}

one() {  # one SHA NAME CONFIG FILTER [VAR=VALUE...]: NAME is the file's <what>
    local sha=$1 what=$2 config=$3 filter=$4; shift 4
    local date name wt
    date=$(git -C "$REPO" show -s --format=%cd --date=format:%Y%m%d "$sha")
    name="$date-$sha-$what.parquet"
    # shellcheck disable=SC2053
    [[ $name == $ONLY ]] || return 0
    wt=/tmp/past-$sha
    [ -d "$wt" ] || git -C "$REPO" worktree add --detach "$wt" "$sha" >/dev/null
    (cd "$wt" && env "$@" KEEP_STATE=1 FIXTURE_TESTDATA="$wt/tests/data" PYTHONPATH="$wt/workflow:$wt/tests" \
        timeout 300 "$PY" "$MAKE/drive.py" "$CELLS/$name" "$(cat "$MAKE/$config")" "$filter")
}

both() {  # route: both at SHA: the gateway is an existing one (proxy.url), a second calibration server of SHA's
    local sha=$1 what=$2 date name wt port gw
    date=$(git -C "$REPO" show -s --format=%cd --date=format:%Y%m%d "$sha")
    name="$date-$sha-$what.parquet"
    # shellcheck disable=SC2053
    [[ $name == $ONLY ]] || return 0
    wt=/tmp/past-$sha
    [ -d "$wt" ] || git -C "$REPO" worktree add --detach "$wt" "$sha" >/dev/null
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    (cd "$wt" && PYTHONPATH="$wt/workflow" exec "$PY" -m servegrid.testing.calibration --host 127.0.0.1 --port "$port" \
        >/dev/null 2>&1) &
    gw=$!
    sleep 2
    config=$("$PY" -c 'import json, sys; c = json.load(open(sys.argv[1])); c["route"] = "both"
c["proxy"] = {"url": "http://127.0.0.1:" + sys.argv[2], "models": {"honest": "calibration"}}; print(json.dumps(c))' \
        "$MAKE/basic.json" "$port")
    (cd "$wt" && SERVEGRID_PROXY_KEY=fixture-not-a-secret KEEP_STATE=1 PYTHONPATH="$wt/workflow:$wt/tests" \
        timeout 300 "$PY" "$MAKE/drive.py" "$CELLS/$name" "$config" '{"mode": "decode"}') || { kill $gw; exit 1; }
    kill $gw; wait $gw 2>/dev/null || true
}

one 3adb1d4 decode        basic.json  '{"mode": "decode"}' CALIB_ADAPTER=1
one 71a4356 single_turn   basic.json  '{"mode": "single_turn"}'
one 6c98e80 multi_turn    basic.json  '{"mode": "multi_turn"}'
one 26fff94 decode        basic.json  '{"mode": "decode"}'
one 239b721 single_turn   basic.json  '{"mode": "single_turn"}'
one f3cf953 multi_turn    basic.json  '{"mode": "multi_turn"}'
one d459d5d decode        basic.json  '{"mode": "decode"}'
one 9b2d444 single_turn   basic.json  '{"mode": "single_turn"}'
one 8976f12 multi_turn    basic.json  '{"mode": "multi_turn"}'
one 09dedc6 decode        basic.json  '{"mode": "decode"}'
one ac4febd single_turn   basic.json  '{"mode": "single_turn"}'
one ac4febd refused       basic.json  '{"mode": "decode"}' REFUSING=1
one af271fa multi_turn    basic.json  '{"mode": "multi_turn"}'
one f9f8059 rate          rate.json   '{"mode": "decode"}'
one 78e4c8a trace         trace.json  '{"mode": "trace"}'
one 47f9ef4 trace_window  window.json '{"mode": "trace"}'
one 47f9ef4 single_turn   basic.json  '{"mode": "single_turn"}'
both 47f9ef4 decode_both
