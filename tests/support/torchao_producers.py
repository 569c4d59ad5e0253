"""torchao's Float8 weight-only model as transformers saves it, and torchao's own reading of it.

``python -m tests.support.torchao_producers OUT``: a tiny Llama (hidden 200, intermediate 300)
saved in bf16, loaded by ``from_pretrained(..., quantization_config=TorchAoConfig(
Float8WeightOnlyConfig()))`` (torchao 0.18 on CPU) and saved with ``save_pretrained`` into
``OUT/quant`` (safetensors: ``_weight_qdata`` + ``_weight_scale``, ``_type`` in the header
metadata; config.json's ``quantization_config: {quant_method: torchao}``), then each weight as
torchao reads it (``Float8Tensor.dequantize(dtype)``, the others ``Tensor.to(dtype)``) into
``OUT/expected.<dtype>.safetensors``.
"""

from __future__ import annotations

import os
import sys


def main(out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from torchao.quantization import Float8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TorchAoConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=200, intermediate_size=300, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=50, vocab_size=128, tie_word_embeddings=False,
    )  # fmt: skip
    plain = os.path.join(out, "plain")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(plain)
    model = AutoModelForCausalLM.from_pretrained(
        plain, dtype=torch.bfloat16,
        quantization_config=TorchAoConfig(Float8WeightOnlyConfig()),
    )  # fmt: skip
    model.save_pretrained(os.path.join(out, "quant"), safe_serialization=True)
    for dtype in (torch.bfloat16, torch.float32):
        expected = {}
        for name, t in model.state_dict().items():
            read = t.dequantize(dtype) if hasattr(t, "qdata") else t.to(dtype)
            expected[name] = read.contiguous()
        name = str(dtype).removeprefix("torch.")
        save_file(expected, os.path.join(out, f"expected.{name}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
