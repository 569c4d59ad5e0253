#!/usr/bin/env bash
# The end-to-end demo: train a tiny Llama with FSDP2 on 4 CPU ranks with ckptools'
# CheckpointManager, resume it once, then consolidate -> reshard to 16 -> verify, load the result
# with transformers, a push dry run, a reshard under torchrun, and the same commands on s3:// (a
# local moto server).
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
echo
echo "== 9. ckpt push --dry-run: what would go to the Hub (completeness and size checks, no network)"
$CKPT push "$OUT/hf" my-user/tiny-llama-demo --source "$OUT/run/step-5" --dry-run
echo
echo "== 10. torchrun: reshard to 8 ranks with 2 processes, each writing its own files"
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \
    -m ckptools reshard "$OUT/run/step-5" "$OUT/step-5-ws8" --world-size 8
$CKPT diff "$OUT/step-5-ws8" "$OUT/step-5-ws16"
echo
echo "== 11. object storage: the same commands on s3:// (a local S3-compatible server, moto)"
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
.venv/bin/moto_server -H 127.0.0.1 -p "$PORT" > "$OUT/moto.log" 2>&1 &
MOTO=$!
trap 'kill $MOTO 2>/dev/null || true' EXIT
export AWS_ENDPOINT_URL="http://127.0.0.1:$PORT" AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo \
    AWS_DEFAULT_REGION=us-east-1
$PY - <<'PYEOF'
import os, time, urllib.error, urllib.request
for _ in range(100):  # wait for the server to listen
    try:
        urllib.request.urlopen(os.environ["AWS_ENDPOINT_URL"], timeout=1)
        break
    except urllib.error.HTTPError:
        break  # it answers
    except OSError:
        time.sleep(0.2)
import s3fs
s3fs.S3FileSystem().mkdir("demo")
PYEOF
$CKPT reshard "$OUT/run/step-5" s3://demo/step-5-ws4 --world-size 4
$CKPT verify s3://demo/step-5-ws4
$CKPT consolidate s3://demo/step-5-ws4 "$OUT/hf-from-s3" --max-shard-size 300KB
$CKPT diff "$OUT/hf-from-s3" "$OUT/hf"
