#!/usr/bin/env bash
# Container smoke test: build the serving image, run it, translate through it,
# drain it with SIGTERM while a request is in flight, and check that bad
# configuration stops it at once. Needs the container engine this project's CI
# machines provide (../shared/tools/container-engine/setup.sh, run as root);
# elsewhere it says so and exits 0.
#
#   .ci/container-smoke.sh                       # the shipped models, models/ (en-fr the default)
#   NMT_SMOKE_MODEL=/path/to/en-fr/3 .ci/container-smoke.sh   # one other model version alone
#
# Prints the image size and the time from `docker run` to health SERVING.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SETUP=../shared/tools/container-engine/setup.sh
IMAGE=${NMT_SMOKE_IMAGE:-nmt-serve:smoke}
MAX_IMAGE_MB=500
SERVING_TIMEOUT=180   # seconds from `docker run` to SERVING (model load + warm-up)
GRACE=60              # NMT_GRACE_PERIOD for the drain check; docker stop waits longer
MAX_ROWS=4            # few decoder rows per step: the 32-text beam-4 request below takes
                      # 32 waves, so it is surely in flight when SIGTERM comes, even on a tiny model
PY=.venv/bin/python
NMT=.venv/bin/nmt

if [ ! -f "$SETUP" ]; then
  echo "container smoke test skipped: no container engine here ($SETUP not found)"
  exit 0
fi
bash "$SETUP"

log() { echo "container-smoke: $*"; }
fail() { echo "container-smoke: FAIL: $*" >&2; exit 1; }
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
seconds_since() { local ms=$(( $(now_ms) - $1 )); printf '%d.%02d' $((ms / 1000)) $((ms % 1000 / 10)); }

# ---- build ----------------------------------------------------------------------------------
SHIPPED=models
MODEL=${NMT_SMOKE_MODEL:-$SHIPPED}
CONTEXT=.
DEFAULT_MODEL=()   # the image's own NMT_DEFAULT_MODEL (en-fr)
if [ "$MODEL" != "$SHIPPED" ]; then
  [ -f "$MODEL/manifest.json" ] || fail "no model version at $MODEL (run make model, or unset NMT_SMOKE_MODEL)"
  # Another model: a copy of the context whose models/ holds it alone, as <name>/<version>/.
  CONTEXT=$(mktemp -d)
  cp -r Dockerfile .dockerignore pyproject.toml service "$CONTEXT/"
  [ -f README.md ] && cp README.md "$CONTEXT/"
  mkdir -p "$CONTEXT/deploy"
  cp deploy/healthcheck.py "$CONTEXT/deploy/"
  place=$("$PY" -c 'import json, sys; m = json.load(open(sys.argv[1])); print(f"{m[\"name\"]}/{m[\"version\"]}")' "$MODEL/manifest.json")
  mkdir -p "$CONTEXT/models/$(dirname "$place")"
  cp -r "$MODEL" "$CONTEXT/models/$place"
  DEFAULT_MODEL=(-e NMT_DEFAULT_MODEL=)   # the one model served
fi
EXPECTED=$(cd "$CONTEXT/models" && ls -d */*/ | cut -d/ -f1 | sort -u | tr '\n' ' ')
log "building $IMAGE (model $MODEL)"
started=$(now_ms)
docker build -t "$IMAGE" "$CONTEXT"
log "built in $(seconds_since "$started") s"
[ "$CONTEXT" = . ] || rm -rf "$CONTEXT"
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
size_mb=$((size / 1000 / 1000))
docker image ls "$IMAGE"
log "image size: $size_mb MB (limit $MAX_IMAGE_MB MB)"
[ "$size_mb" -le "$MAX_IMAGE_MB" ] || fail "image is $size_mb MB, over $MAX_IMAGE_MB MB"
docker run --rm --entrypoint python "$IMAGE" -c \
  "import importlib.util as u, sys; found = [m for m in ('torch', 'export') if u.find_spec(m)]; sys.exit(f'found {found}' if found else 0)" \
  || fail "the serving image holds torch or export/"

# ---- run, translate -------------------------------------------------------------------------
PORT=$(free_port)
METRICS_PORT=$(free_port)
NAME=nmt-smoke-$$
cleanup() { docker rm -f "$NAME" > /dev/null 2>&1 || true; }
trap cleanup EXIT
started=$(now_ms)
docker run -d --name "$NAME" --network host --read-only --cap-drop ALL \
  --security-opt no-new-privileges -e NMT_HOST=127.0.0.1 -e NMT_PORT="$PORT" \
  -e NMT_METRICS_PORT="$METRICS_PORT" -e NMT_GRACE_PERIOD="$GRACE" -e NMT_MAX_ROWS="$MAX_ROWS" \
  -e NMT_HTTP_PORT=0 "${DEFAULT_MODEL[@]}" "$IMAGE" > /dev/null
until "$PY" deploy/healthcheck.py --address "127.0.0.1:$PORT" > /dev/null 2>&1; do
  [ "$(docker inspect -f '{{.State.Running}}' "$NAME")" = true ] || { docker logs "$NAME"; fail "container exited"; }
  [ $(( $(now_ms) - started )) -lt $((SERVING_TIMEOUT * 1000)) ] || { docker logs "$NAME"; fail "not SERVING after $SERVING_TIMEOUT s"; }
  sleep 0.1
done
log "time from docker run to SERVING: $(seconds_since "$started") s"

out=$("$NMT" translate --server "127.0.0.1:$PORT" "Open the file" "Delete %s files?")
[ "$(echo "$out" | wc -l)" = 2 ] || fail "expected 2 translations, got: $out"
grep -q '%s' <<< "$out" || fail "placeholder %s lost: $out"
log "translated: $(echo "$out" | tr '\n' '|')"
# Every model of the repository is served, each answering through its own name.
for name in $EXPECTED; do
  one=$("$NMT" translate --server "127.0.0.1:$PORT" --model "$name" "Open the file") \
    || fail "model $name is not served"
  log "$name: $one"
done

for _ in $(seq 60); do  # the image's own HEALTHCHECK (first run after its 10 s interval)
  health=$(docker inspect -f '{{.State.Health.Status}}' "$NAME")
  [ "$health" = healthy ] && break
  sleep 1
done
[ "$health" = healthy ] || fail "docker health status is $health"
log "docker HEALTHCHECK: $health"

# ---- SIGTERM with a request in flight ---------------------------------------------------------
TEXTS=$(mktemp)
"$PY" - "$TEXTS" <<'EOF'
import sys
long = "The server returned an invalid response while downloading %s; the download was cancelled."
open(sys.argv[1], "w").write("\n".join(f"{long} ({i})" for i in range(32)) + "\n")  # one request
EOF
( "$NMT" translate --server "127.0.0.1:$PORT" --beam 4 --timeout 300 < "$TEXTS" > "$TEXTS.out" 2> "$TEXTS.err"
  echo $? > "$TEXTS.rc"; now_ms > "$TEXTS.done" ) &
client=$!
# Poll /metrics until the request holds decoder rows (one process: polling stays fast).
"$PY" - "$METRICS_PORT" "$client" <<'EOF' || fail "the long request never reached the decoder: $(cat "$TEXTS.err")"
import os, sys, time, urllib.request
url, deadline = f"http://127.0.0.1:{sys.argv[1]}/metrics", time.monotonic() + 60
while time.monotonic() < deadline and os.path.exists(f"/proc/{sys.argv[2]}"):  # client alive
    text = urllib.request.urlopen(url).read().decode()
    if any(l.startswith("nmt_inflight_rows ") and float(l.split()[1]) > 0 for l in text.splitlines()):
        sys.exit(0)
    time.sleep(0.02)
sys.exit(1)
EOF
kill -0 "$client" 2> /dev/null || fail "the long request finished before SIGTERM: make it longer"
signalled=$(now_ms)
log "SIGTERM with the request in flight"
docker stop -t $((GRACE + 30)) "$NAME" > /dev/null
wait "$client"
[ "$(cat "$TEXTS.rc")" = 0 ] || fail "the in-flight request failed: $(cat "$TEXTS.err")"
[ "$(cat "$TEXTS.done")" -gt "$signalled" ] || fail "the request was answered before SIGTERM: make it longer"
[ "$(wc -l < "$TEXTS.out")" = 32 ] || fail "expected 32 translations, got $(wc -l < "$TEXTS.out")"
code=$(docker inspect -f '{{.State.ExitCode}}' "$NAME")
[ "$code" = 0 ] || { docker logs "$NAME"; fail "container exited $code after SIGTERM"; }
# Not `docker logs | grep -q`: under pipefail, grep leaving at the first match can SIGPIPE docker logs.
logs=$(docker logs "$NAME" 2>&1)
grep -q draining <<< "$logs" || fail "no drain in the log"
log "drained: the in-flight request completed (32 translations), exit code 0"
rm -f "$TEXTS" "$TEXTS".*

# ---- bad configuration stops the container at once --------------------------------------------
expect_refusal() {  # name, then docker run arguments
  local what=$1; shift
  local logfile; logfile=$(mktemp)
  set +e
  timeout 60 docker run --rm --network host "$@" "$IMAGE" > "$logfile" 2>&1
  local rc=$?
  set -e
  [ "$rc" != 0 ] && [ "$rc" != 124 ] || fail "$what: exit $rc (expected a quick non-zero exit)"
  [ "$(wc -l < "$logfile")" = 1 ] || fail "$what: expected a one-line reason, got: $(cat "$logfile")"
  log "$what: exit $rc: $(cat "$logfile")"
  rm -f "$logfile"
}
expect_refusal "missing model directory" -e NMT_MODEL_REPOSITORY=/opt/nmt/absent -e NMT_PORT="$(free_port)" -e NMT_METRICS_PORT="$(free_port)"
expect_refusal "bad NMT_PORT" -e NMT_PORT=not-a-port
expect_refusal "bad NMT_MAX_ROWS" -e NMT_MAX_ROWS=0
expect_refusal "unknown NMT_PROT (a typo)" -e NMT_PROT=50051
log "PASS"
