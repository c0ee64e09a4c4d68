"""Memory it takes to load a bf16 checkpoint: ours against HF transformers, each in a fresh process.

    python benchmarks/load_memory.py [--model DIR] [--rounds 2]

A bf16 copy of the model (SmolLM2 by default) is written to a temporary directory as safetensors.
Each load runs in its own process, alternating ours and transformers', while a thread samples
the process's anonymous resident memory (RssAnon: what the process allocated, without the
safetensors file's page-cache pages, which the kernel can drop at any time) every 2 ms. Printed:
the parameters' size, and for each loader the peak RssAnon growth during the load over the
RssAnon just before it, and the peak RSS (VmHWM) for completeness. A loader that goes through
fp32 on the way shows a peak growth near 3x the bf16 parameters.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[3])

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

import torch  # imports happen before the baseline: only the load is measured
if sys.argv[2] == "ours":
    from engine import LLM
else:
    from transformers import AutoModelForCausalLM
peak, stop = [0], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], status("RssAnon"))
        time.sleep(0.002)
base = status("RssAnon")
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
if sys.argv[2] == "ours":
    model = LLM(sys.argv[1], dtype="bfloat16", num_blocks=16, enable_prefix_caching=False)
else:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
seconds = time.perf_counter() - start
stop.set()
time.sleep(0.01)
print(json.dumps({"growth": max(peak[0], status("RssAnon")) - base, "hwm": status("VmHWM"),
                  "seconds": seconds}))
"""


def bf16_copy(model_dir: Path, out: Path) -> int:
    """Writes a bf16 copy of ``model_dir`` to ``out``; returns the parameters' bytes."""
    import torch
    from safetensors.torch import load_file, save_file
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, out / item.name)
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(file).items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure(model: Path, who: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, str(model), who, str(REPO)], capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2, converted)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.float_model import default_float_checkpoint
    source = Path(args.model) if args.model else default_float_checkpoint()
    with tempfile.TemporaryDirectory(prefix="bf16-") as tmp:
        param_bytes = bf16_copy(source, Path(tmp))
        runs: dict[str, list[dict]] = {"ours": [], "transformers": []}
        for _ in range(args.rounds):
            for who in runs:  # interleaved
                runs[who].append(measure(Path(tmp), who))
    mib = 2 ** 20
    print(f"bf16 parameters: {param_bytes / mib:.0f} MiB ({source.name})")
    print("| loader | peak RssAnon growth MiB | x parameters | peak RSS (VmHWM) MiB | load s |")
    print("|---|---|---|---|---|")
    for who, results in runs.items():
        growth = statistics.median(r["growth"] for r in results)
        print(f"| {who} | {growth / mib:.0f} | {growth / param_bytes:.2f} | "
              f"{statistics.median(r['hwm'] for r in results) / mib:.0f} | "
              f"{statistics.median(r['seconds'] for r in results):.2f} |")


if __name__ == "__main__":
    main()
