"""Perplexity of the default model's weights on a small public-domain text that ships with the
project (benchmarks/data/perplexity.txt: Dickens, Lincoln, the Declaration, Melville), in
independent 512-token windows, teacher-forced through this engine's own model:

    python benchmarks/perplexity.py

Rows: the .gguf as stored (Q4_1 layers, Q8_0 embedding, bf16 activations); its float32
dequantization (benchmarks/gguf_peers.py's float checkpoint) run dense in float32 and bfloat16,
and quantized at load with --quantization int8 and int4 (bf16 activations). The int rows are
compared with the dense bfloat16 row: the quantization's own cost.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.float_model import default_float_checkpoint  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.loader import default_model_path  # noqa: E402

WINDOW = 512


def perplexity(model: str, **engine_args) -> float:
    llm = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=WINDOW, num_blocks=64, **engine_args)
    ids = llm.get_tokenizer().encode((HERE / "data" / "perplexity.txt").read_text())
    runner = llm.engine.core.runner
    captured: list[torch.Tensor] = []
    hook = runner.model.register_forward_hook(lambda module, args, out: captured.append(out.detach().clone()))
    nll, count = 0.0, 0
    try:
        for start in range(0, len(ids) - 1, WINDOW):
            window = ids[start:start + WINDOW]
            captured.clear()
            llm.generate([{"prompt_token_ids": window}], SamplingParams(max_tokens=1), use_tqdm=False)
            hidden = captured[0][:len(window) - 1]  # the prefill: one forward over the whole window
            with torch.inference_mode():
                logprobs = torch.log_softmax(runner.model.compute_logits(hidden).double(), dim=-1)
            nll -= float(logprobs[torch.arange(len(window) - 1), torch.tensor(window[1:])].sum())
            count += len(window) - 1
    finally:
        hook.remove()
    return math.exp(nll / count)


def main() -> None:
    float_dir = str(default_float_checkpoint())
    rows = {"gguf Q4_1 as stored (bf16)": perplexity(str(default_model_path()), dtype="bfloat16"),
            "float32 dense": perplexity(float_dir, dtype="float32"),
            "bfloat16 dense": perplexity(float_dir, dtype="bfloat16"),
            "int8 (bf16)": perplexity(float_dir, dtype="bfloat16", quantization="int8"),
            "int4 (bf16)": perplexity(float_dir, dtype="bfloat16", quantization="int4")}
    base = rows["bfloat16 dense"]
    print(f"{'weights':30s} {'perplexity':>10s}  vs bf16 dense")
    for name, value in rows.items():
        print(f"{name:30s} {value:10.3f}  {100 * (value / base - 1):+6.2f}%")


if __name__ == "__main__":
    main()
