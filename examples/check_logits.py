"""Load the consolidated model with transformers and compare its logits with the trained model's.

Run: ``python examples/check_logits.py HF_DIR LOGITS.pt``; exits non-zero when they differ.
"""

from __future__ import annotations

import sys

import torch
from train_fsdp2 import probe_input
from transformers import AutoModelForCausalLM


def main() -> None:
    hf_dir, logits_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # the training ranks computed with one thread each
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        got = model(input_ids=probe_input()).logits
    expected = torch.load(logits_path, weights_only=True)
    diff = (got - expected).abs().max().item()
    same = torch.equal(got, expected)
    verdict = "bit-identical to" if same else f"max abs diff {diff:.3g} from"
    verdict = "bit-identical to" if same else f"max abs diff {diff:.3g} from"
    print(f"transformers loaded {hf_dir}: logits {tuple(got.shape)}, {verdict} the trained model's")
    sys.exit(0 if diff < 1e-5 else 1)


if __name__ == "__main__":
    main()
