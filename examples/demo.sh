#!/usr/bin/env bash
# The end-to-end demo: train a tiny Llama with FSDP2 on 4 CPU ranks with ckptools'
# CheckpointManager, resume it once, then consolidate -> reshard to 16 -> verify, and load the
# result with transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
CKPT=.venv/bin/ckpt
OUT=demo_out
rm -rf "$OUT"
mkdir -p "$OUT"
export CKPTOOLS_NO_PROGRESS=1

echo "== 1. train 3 steps with FSDP2 on 4 CPU ranks, a checkpoint every step (keep the last 2)"
$PY examples/train_fsdp2.py "$OUT/run" --world-size 4 --steps 3
echo
echo "== 2. a new job resumes from the newest complete checkpoint and trains to step 5"
$PY examples/train_fsdp2.py "$OUT/run" --world-size 4 --steps 5 --logits "$OUT/logits.pt"
echo
echo "== 3. ckpt list"
$CKPT list "$OUT/run"
echo
echo "== 4. ckpt inspect (metadata only: no torch import, no code from the checkpoint)"
$CKPT inspect "$OUT/run/step-5" --limit 8
echo
echo "== 5. ckpt verify (structure, CRC-32 of every item, the checksum manifest)"
$CKPT verify "$OUT/run/step-5"
echo
echo "== 6. ckpt consolidate -> a Hugging Face model directory (config.json saved by the manager)"
$CKPT consolidate "$OUT/run/step-5" "$OUT/hf" --max-shard-size 300KB
echo
echo "== 7. ckpt reshard to 16 ranks, then verify it and diff it against the consolidated model"
$CKPT reshard "$OUT/run/step-5" "$OUT/step-5-ws16" --world-size 16
$CKPT verify "$OUT/step-5-ws16"
$CKPT diff "$OUT/step-5-ws16" "$OUT/hf"
echo
echo "== 8. transformers loads the consolidated model: logits equal the trained model's"
(cd examples && ../$PY check_logits.py "../$OUT/hf" "../$OUT/logits.pt")
