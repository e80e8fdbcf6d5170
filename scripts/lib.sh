# Shell helpers shared by the bench scripts (sourced, not run).

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
