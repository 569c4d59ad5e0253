#!/usr/bin/env bash
# The end-to-end demo: train a tiny Llama with FSDP2 on 4 CPU ranks, then inspect the checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=demo_out
rm -rf "$OUT"
mkdir -p "$OUT"
echo "== 1. train a tiny Llama with FSDP2 on 4 CPU ranks and save a sharded checkpoint"
$PY examples/train_fsdp2.py "$OUT/step-3" --world-size 4 --steps 3
echo
echo "== 2. ckpt inspect (metadata only: no torch import, no code from the checkpoint)"
.venv/bin/ckpt inspect "$OUT/step-3" --limit 12
echo
echo "== 3. ckpt inspect --json, totals only"
.venv/bin/ckpt inspect "$OUT/step-3" --json | $PY -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({k: d[k] for k in ('format','layout','world_size','model_part','totals')}, indent=2))"
