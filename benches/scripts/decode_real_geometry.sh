#!/usr/bin/env bash
# Decode figures of issue 11 on a real-geometry model (e.g. `picchio synth --arch qwen3-30b-a3b
# --model-out DIR`): prompt of 16 fixed ids (bench cache's), 32 greedy tokens, page cache dropped
# before each run, `--json`, load average recorded with each figure.
#
# usage: decode_real_geometry.sh BIN MODEL_DIR OUT_DIR LABEL [PERCENT...] [-- extra `run` flags]
#   BIN      a picchio binary (e.g. /work/main/target/release/picchio for "before")
#   PERCENT  expert-cache sizes in % of all routed experts [default: 10 50 100]; a size whose slots
#            plus the dense part do not fit in MemAvailable is skipped, and said so.
# Writes OUT_DIR/LABEL-PCT.json (the run's --json) and prints one line per run.
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,11p "$0"; exit 2; }
BIN=$1 M=$2 OUT=$3 LABEL=$4; shift 4
PCTS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do PCTS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#PCTS[@]} -gt 0 ] || PCTS=(10 50 100)
mkdir -p "$OUT"
PROMPT=0,74483,20454,94938,40909,138816,61364,7335,81819,27790,125697,48245,146152,92123,14671,112578
read -r LAYERS EXPERTS < <(python3 -c "import json,sys; c=json.load(open(sys.argv[1]+'/config.json')); print(c['num_hidden_layers'], c['num_experts'])" "$M")
TOTAL=$((LAYERS * EXPERTS))
SLOT=$(( $(stat -c %s "$M/experts.picchioflat") / TOTAL ))
for pct in "${PCTS[@]}"; do
  ecap=$(( TOTAL * pct / 100 ))
  avail=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024 ))
  # The slots plus ~6 GB for the dense part (4.8 GB of F32 attention at this geometry) and the rest.
  if [ $(( ecap * SLOT )) -gt $(( avail - 6000000000 )) ]; then
    echo "$LABEL ${pct}%: skipped: ${ecap} slots of ${SLOT} B and ~6 GB of dense part do not fit in MemAvailable ($avail B)"
    continue
  fi
  sync; echo 3 > /proc/sys/vm/drop_caches
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  f="$OUT/$LABEL-$pct.json"
  "$BIN" run --model "$M" --prompt-ids "$PROMPT" -n 32 --ecap "$ecap" --json "$@" > "$f"
  load_end=$(cut -d' ' -f1-3 /proc/loadavg)
  python3 - "$f" "$LABEL" "$pct" "$ecap" "$load" "$load_end" <<'PY'
import json, sys, hashlib
f, label, pct, ecap, load, load_end = sys.argv[1:]
r = json.load(open(f)); s = r["stats"]
sp = s.get("decode_split") or {}
pf = s.get("prefetch_stats") or {}
toks = ",".join(map(str, r["tokens"]))
print(f"{label} {pct}% (ecap {ecap}): decode {s['decode_tok_s']:.2f} tok/s ({1e3/s['decode_tok_s']:.0f} ms/token), "
      f"prefill {s['prefill_ms']:.0f} ms, {s['bytes_read']/1e9:.2f} GB read ({s['prefill_bytes_read']/1e9:.2f} GB in prefill), "
      f"device {s['read_mb_s']:.0f} MB/s, exposed wait {s['read_wait_ms']:.0f} ms, peak RSS {s['peak_rss_bytes']/1e9:.2f} GB, "
      f"load {load} -> {load_end}, tokens {hashlib.sha256(toks.encode()).hexdigest()[:12]}")
if sp:
    print("    split ms/token: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in sp.items() if k.endswith('_ms')))
if pf.get("issued"):
    print(f"    prefetch: {pf['issued']} issued, {pf['used']} used ({100*pf['used']/pf['issued']:.0f}%), {s['prefetch_wasted_bytes']/1e9:.2f} GB wasted")
PY
done
