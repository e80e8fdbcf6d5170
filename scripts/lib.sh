# Shell helpers shared by the bench scripts (sourced, not run).

# temp_workdir NAME: WORK, a new temporary directory, and PIDS, an empty list; when the
# script exits, every process in PIDS is killed and WORK removed.
temp_workdir() {
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")"
    PIDS=()
    trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
}

# require_tool TOOL: exits the script, saying why, unless TOOL is installed.
require_tool() {
    command -v "$1" >/dev/null || { echo "$(basename "$0"): $1 is not installed" >&2; exit 1; }
}

# build_release [no-router]: the release builds of vllm-sim and loadtest and, unless told
# `no-router`, of the router, the router on its own: built in one cargo run, the three get
# their dependencies' features unified, and the next `cargo build --release -p quantrouter`
# (README, scripts/bench-ab) rebuilds the router and its dependencies.
build_release() {
    cargo build --release -p vllm-sim -p loadtest
    [[ "${1:-}" == no-router ]] || cargo build --release -p quantrouter
}

# build_if_missing ROUTER: the release builds unless BIN already has vllm-sim and loadtest
# and ROUTER exists.
build_if_missing() {
    [[ -x "$BIN/vllm-sim" && -x "$BIN/loadtest" && -x "$1" ]] || build_release
}

# free_port: prints a TCP port free on loopback right now.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# wait_ready URL [TRIES]: polls URL every 0.1 s until it answers 2xx; exits the script if it
# never does.
wait_ready() {
    local i
    for i in $(seq "${2:-100}"); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
    echo "$(basename "$0"): $1 never answered" >&2
    exit 1
}

# start_zero_sim [MODEL]: starts a zero-latency vllm-sim serving MODEL (default `sim-model`)
# on a free port (its pid joins PIDS, the port is in sim_port) and writes
# $WORK/profiles.json: one profile that sends everything there. Needs BIN and WORK.
start_zero_sim() {
    local model=${1:-sim-model}
    sim_port="$(free_port)"
    "$BIN/vllm-sim" --listen "127.0.0.1:$sim_port" --model "$model" --ttft-ms 0 --itl-ms 0 \
        --max-num-seqs 1024 >>"$WORK/sim.log" 2>&1 &
    PIDS+=($!)
    wait_ready "http://127.0.0.1:$sim_port/health"
    cat >"$WORK/profiles.json" <<JSON
{"version":1,"default_profile":"sim","policy":{},"profiles":[
{"id":"sim","model":"$model","quantization":"fp16","tier":"fp16",
 "upstream":{"urls":["http://127.0.0.1:$sim_port"]},
 "cost_per_1m_input_tokens":0.1,"cost_per_1m_output_tokens":0.2,"latency":{"ttft_ms":10,"itl_ms":1},
 "quality":{"default":0.99},"max_context_tokens":16384,"max_concurrency":4096,"chars_per_token":4.0}]}
JSON
}

# serve_router PROFILES COMMAND...: runs `COMMAND... serve` (the router binary, or a wrapper
# such as `env QUANTROUTER_WORKERS=1 valgrind ... BINARY`) on free loopback ports with the
# profile file PROFILES and no KEDA port, logging to $WORK/router.log; waits until it is
# ready (READY_TRIES polls of 0.1 s, default 100). Sets router_pid (joins PIDS), router_url
# and router_admin_url.
serve_router() {
    local profiles=$1 port admin
    shift
    port="$(free_port)" admin="$(free_port)"
    "$@" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
        --profiles "$profiles" --log-format text --keda-scaler-listen off \
        >>"$WORK/router.log" 2>&1 &
    router_pid=$!
    PIDS+=("$router_pid")
    router_url="http://127.0.0.1:$port"
    router_admin_url="http://127.0.0.1:$admin"
    wait_ready "$router_admin_url/readyz" "${READY_TRIES:-100}"
}

# settle: waits, at most SETTLE_MAX_S (default 120) seconds, until the machine is quiet —
# under 10% of its CPU time busy over one second — so that a backlog one target is still
# working through (LiteLLM after an overload) does not slow the run that comes next.
settle() {
    local i busy=0
    for i in $(seq "${SETTLE_MAX_S:-120}"); do
        busy="$(cpu_busy_percent)"
        ((busy < 10)) && return 0
    done
    echo "$(basename "$0"): the machine stayed busy (${busy}% of CPU time) before the next run" >&2
}

# cpu_busy_percent: the share of all CPUs' time, in percent, spent busy over the next second.
cpu_busy_percent() {
    local before after
    before="$(head -1 /proc/stat)"
    sleep 1
    after="$(head -1 /proc/stat)"
    awk -v a="$before" -v b="$after" 'BEGIN {
        n = split(a, x); split(b, y); total = 0
        for (i = 2; i <= n; i++) total += y[i] - x[i]
        idle = (y[5] - x[5]) + (y[6] - x[6])
        print (total > 0) ? int(100 * (total - idle) / total) : 0
    }'
}
