#!/usr/bin/env bash
# What each piece of chatstream's own hot-path machinery buys against the library path
# (issue 37, decision 80): alternating A/B pairs of one build, the piece on (A) and off (B).
#
#   bench/ab_machinery.sh PIECE [PAIRS] [BENCH ARGS...]
#
# PIECE (what B turns off, and how):
#   tick       the wake-up tick and its urgent set   CHATSTREAM_WAKE_TICK_MS=0
#   transport  the httptools transport               CHATSTREAM_HTTP_TRANSPORT=httpx
#   replies    the publisher's own reply loop        a build whose hiredis_reader() finds none
#                                                    (replies read through redis-py)
#   templates  the chunk templates                   a build that never learns a template
#   spans      the OTLP span encoder (bench_otel)    a build whose exporter never encodes
#
# The bench (default: bench_worker.py --only ours --phase capacity --steps 60,400
# --duration 10; bench_otel.py for spans; BENCH=bench_start.py for time to first token)
# runs A then B, PAIRS times (default 2), `uptime` printed before each run: the machine is
# shared, so read the pairs side by side and the load beside them. Builds for B are made
# from HEAD with `git archive` into /tmp/chatstream-ab-<piece> with their own venv (uv).
set -euo pipefail
cd "$(dirname "$0")/.."
piece=${1:?usage: bench/ab_machinery.sh tick|transport|replies|templates|spans [pairs] [args]}
pairs=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
py=.venv/bin/python
bench=${BENCH:-bench_worker.py}
[ "$piece" = spans ] && bench=bench_otel.py
args=("$@")
if [ "${#args[@]}" -eq 0 ] && [ "$bench" = bench_worker.py ]; then
  args=(--only ours --phase capacity --steps 60,400 --duration 10)
fi

variant() {  # a build of HEAD with one edit, its chatstream executable printed
  local name=$1 file=$2 from=$3 to=$4 dir=/tmp/chatstream-ab-$1
  if [ ! -x "$dir/.venv/bin/chatstream" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    git archive HEAD | tar -x -C "$dir"
    "$py" - "$dir/$file" "$from" "$to" <<'EOF'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
assert old in text, f"{path}: {old!r} not found"
open(path, "w").write(text.replace(old, new))
EOF
    .venv/bin/uv venv -q -p "$py" "$dir/.venv"
    VIRTUAL_ENV=$dir/.venv .venv/bin/uv pip install -q "$dir[fast,otel]"
  fi
  echo "$dir/.venv/bin/chatstream"
}

a_env=() b_env=() a_args=() b_args=() b_py=$py
case $piece in
  tick) b_env=(CHATSTREAM_WAKE_TICK_MS=0) ;;
  transport) b_env=(CHATSTREAM_HTTP_TRANSPORT=httpx) ;;
  replies)
    b_args=(--chatstream "$(variant replies worker/store/batch.py \
      '    if reader is None or NOT_ENOUGH_DATA is None' '    if True or NOT_ENOUGH_DATA is None')") ;;
  templates)
    b_args=(--chatstream "$(variant templates worker/protocol/accumulator.py \
      'template = learn(data, chunk, want, _IGNORED, _RANDOM, fast)' 'template = None')") ;;
  spans)  # bench_otel.py runs its workers beside the interpreter that runs it
    b_py=$(dirname "$(variant spans worker/telemetry_sdk.py \
      'self.encodes = callable(getattr(client, "export", None))' 'self.encodes = False')")/python ;;
  *) echo "unknown piece: $piece" >&2; exit 2 ;;
esac

for i in $(seq "$pairs"); do
  for side in A B; do
    echo "=== $piece pair $i $side: $(uptime)"
    if [ $side = A ]; then
      env "${a_env[@]}" "$py" "bench/$bench" "${args[@]}" "${a_args[@]}"
    else
      env "${b_env[@]}" "$b_py" "bench/$bench" "${args[@]}" "${b_args[@]}"
    fi
  done
done
