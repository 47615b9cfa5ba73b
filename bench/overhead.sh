#!/usr/bin/env bash
# Added latency of the gateway over an instant fake engine, measured with hey (Debian
# package 'hey').  Interim form of 'luftpause bench overhead' (issue 2): starts a fake
# engine (--instant) and a gateway on free loopback ports, stops both by PID at exit.
# Run from a checkout after 'make test' built .venv:  bash bench/overhead.sh
set -euo pipefail
command -v hey >/dev/null || { echo "bench/overhead.sh needs hey: apt-get install hey" >&2; exit 2; }
TMP=$(mktemp -d)
V="${VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}/bin"
port() { $V/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P1=$(port); P2=$(port)
cat > "$TMP"/ov.toml <<T
[[endpoints]]
name = "fake"
url = "http://127.0.0.1:$P1"
kind = "sglang"
models = ["llama-3.2-1b"]
T
$V/luftpause fake-engine --flavor sglang --port $P1 --instant > "$TMP"/ov_engine.log 2>&1 & E=$!
$V/luftpause gateway --config "$TMP"/ov.toml --port $P2 > "$TMP"/ov_gw.log 2>&1 & G=$!
trap 'kill $E $G 2>/dev/null; wait $E $G 2>/dev/null || true; rm -rf "$TMP"' EXIT
for i in $(seq 1 200); do curl -sf http://127.0.0.1:$P2/health >/dev/null && curl -sf http://127.0.0.1:$P1/health >/dev/null && break; sleep 0.05; done
echo '{"model":"llama-3.2-1b","messages":[{"role":"user","content":"hi"}],"max_tokens":16}' > "$TMP"/ov_plain.json
echo '{"model":"llama-3.2-1b","messages":[{"role":"user","content":"hi"}],"max_tokens":16,"stream":true}' > "$TMP"/ov_stream.json
run() { # name url body conc n
  out=$(hey -n $5 -c $4 -m POST -T application/json -D $3 $2/v1/chat/completions)
  p50=$(echo "$out" | awk '/50% in/{print $3}'); p99=$(echo "$out" | awk '/99% in/{print $3}')
  rps=$(echo "$out" | awk '/Requests\/sec/{print $2}'); codes=$(echo "$out" | awk '/\[[0-9]+\]/{printf "%s%s ", $1, $2}')
  printf "%-9s %-7s c=%-3s p50 %7.2f ms  p99 %7.2f ms  %8s req/s  %s\n" "$1" "$(basename $3 .json | sed s/ov_//)" "$4" "$(echo "$p50*1000" | bc -l)" "$(echo "$p99*1000" | bc -l)" "$rps" "$codes"
}
for body in "$TMP"/ov_plain.json "$TMP"/ov_stream.json; do
  for c in 1 20; do
    n=$([ $c = 1 ] && echo 2000 || echo 6000)
    run warmup http://127.0.0.1:$P1 $body $c 200 >/dev/null 2>&1 || true; run warmup http://127.0.0.1:$P2 $body $c 200 >/dev/null 2>&1 || true
    run direct http://127.0.0.1:$P1 $body $c $n
    run gateway http://127.0.0.1:$P2 $body $c $n
  done
done
