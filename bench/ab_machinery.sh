#!/usr/bin/env bash
# What each piece of chatstream's own hot-path machinery buys against the library path
# (issue 37, decision 80): alternating A/B pairs of one build, the piece on (A) and off (B).
#
#   bench/ab_machinery.sh PIECE [PAIRS] [BENCH ARGS...]
#
# PIECE (what B turns off, and how):
#   tick       the wake-up tick and its urgent set   CHATSTREAM_WAKE_TICK_MS=0
#   transport  the httptools transport               CHATSTREAM_HTTP_TRANSPORT=httpx
#
# The bench (default: bench_worker.py --only ours --phase capacity --steps 60,400
# --duration 10; BENCH=bench_start.py for time to first token)
# runs A then B, PAIRS times (default 2), `uptime` printed before each run: the machine is
# shared, so read the pairs side by side and the load beside them.
# The publisher's own reply loop, the chunk templates and the OTLP span encoder were
# measured here too and retired (decision 80): compare against a build from before their
# removal (bench_worker.py --chatstream PATH; bench_otel.py run by that build's python).
set -euo pipefail
cd "$(dirname "$0")/.."
piece=${1:?usage: bench/ab_machinery.sh tick|transport [pairs] [args]}
pairs=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
py=.venv/bin/python
bench=${BENCH:-bench_worker.py}
args=("$@")
if [ "${#args[@]}" -eq 0 ] && [ "$bench" = bench_worker.py ]; then
  args=(--only ours --phase capacity --steps 60,400 --duration 10)
fi

a_env=() b_env=()
case $piece in
  tick) b_env=(CHATSTREAM_WAKE_TICK_MS=0) ;;
  transport) b_env=(CHATSTREAM_HTTP_TRANSPORT=httpx) ;;
  *) echo "unknown piece: $piece" >&2; exit 2 ;;
esac

for i in $(seq "$pairs"); do
  for side in A B; do
    echo "=== $piece pair $i $side: $(uptime)"
    if [ $side = A ]; then
      env "${a_env[@]}" "$py" "bench/$bench" "${args[@]}" || echo "(exit $?)"
    else  # a run that misses its target exits 1: the pairs go on
      env "${b_env[@]}" "$py" "bench/$bench" "${args[@]}" || echo "(exit $?)"
    fi
  done
done
