"""Shared fixtures: tiny random models that the tests create and save themselves, and the
real SmolLM2 model (converted once per session into a temporary cache)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# What dtype="auto" is on this CPU (bfloat16 where it is native, else float32): tests that know a
# KV dtype or size by name. Tests that compare with transformers in float32 pin float32.
def _auto_dtype() -> torch.dtype:
    from engine.worker.model_runner import resolve_dtype
    return resolve_dtype("auto", torch.device("cpu"))


AUTO_DTYPE = str(_auto_dtype()).removeprefix("torch.")
AUTO_DTYPE_BYTES = _auto_dtype().itemsize

TINY_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   initializer_range=0.2, bos_token_id=1, eos_token_id=2)


def make_tiny_model(path: Path, arch: str = "llama", **overrides) -> Path:
    """Save a tiny random HF model of the given family (with the SmolLM2 tokenizer) to `path`."""
    import transformers as tf
    from engine.worker.loader import resolve_model

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM), "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
               "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM)}
    config_cls, model_cls = classes[arch]
    config = config_cls(**{**TINY_COMMON, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def session_scratch(tmp_path_factory) -> None:
    """One converted copy of the default model per session (unless the caller shares a cache)
    and the logs of the servers the tests start, both under pytest's temporary root, which
    keeps the last three sessions only: a test run leaves no more than that behind."""
    if not os.environ.get("ENGINE_CACHE_DIR"):
        os.environ["ENGINE_CACHE_DIR"] = str(tmp_path_factory.mktemp("engine-cache"))
    os.environ["ENGINE_TEST_LOG_DIR"] = str(tmp_path_factory.mktemp("server-logs"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from engine.worker.loader import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tie_word_embeddings=True)


def hf_float32_model(model_dir: Path):
    """transformers' model of a checkpoint, in float32. For a converted .gguf (whose quantized
    blocks transformers cannot read) it is the .gguf itself, read and dequantized by transformers'
    own GGUF reader (as from_pretrained(gguf_file=...) does, without needing accelerate)."""
    import json
    from transformers import AutoConfig, AutoModelForCausalLM
    manifest = Path(model_dir) / "engine-gguf-blocks.json"
    if not manifest.is_file():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    source = json.loads(manifest.read_text())["source"]
    if not Path(source).is_file():  # a shared cache converted elsewhere: the default model's file
        from engine.worker.loader import default_model_path
        source = str(default_model_path())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    tensors = load_gguf_checkpoint(source, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({name: torch.as_tensor(t) for name, t in tensors.items()}, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys, result
    model.tie_weights()
    # The native kernels multiply Q8_0 weights as llama.cpp does, by activations rounded to Q8_0.
    types = json.loads(manifest.read_text())["tensors"]
    if "lm_head.weight" not in types and model.config.tie_word_embeddings:
        types["lm_head.weight"] = types.get("model.embed_tokens.weight")
    q8_0 = {name.removesuffix(".weight") for name, kind in types.items() if kind == "Q8_0"}
    round_inputs_to_q8_0(model, [n for n, m in model.named_modules() if n in q8_0 and isinstance(m, torch.nn.Linear)])
    return model.eval()


def rounded_to_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded to Q8_0 per row and block of 32, as llama.cpp's quantize_row_q8_0 (with the scale
    kept in float32, round-half-even), in float64."""
    blocks = x.float().unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    d = torch.where(d >= torch.finfo(torch.float32).tiny, d, torch.zeros_like(d))  # too small to scale: zeros
    q = torch.round(blocks * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
    return (q.double() * d.double()).flatten(-2)


def round_inputs_to_q8_0(model: torch.nn.Module, names: list[str]) -> None:
    """The named linears of a transformers model take their input rounded to Q8_0, as the
    engine's native Q8_0 kernel does (not under ENGINE_NATIVE=0, whose dense fallback does not)."""
    from engine.worker import native
    if native.ops() is None:
        return
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(lambda _, args: (rounded_to_q8_0(args[0]).to(args[0].dtype),))


class HFReference:
    """HF transformers on the same weights: greedy generate one prompt at a time, no EOS stop."""

    def __init__(self, model_dir: Path) -> None:
        self.model = hf_float32_model(model_dir)

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [tokens for tokens, _ in self.greedy_with_margins(prompts, max_tokens)]

    @torch.no_grad()
    def greedy_with_margins(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], float]]:
        """Greedy tokens plus the smallest top-1/top-2 logit gap met along the way."""
        outs = []
        for ids in prompts:
            x = torch.tensor([ids])
            y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                    do_sample=False, eos_token_id=None, pad_token_id=0,
                                    output_scores=True, return_dict_in_generate=True)
            margins = [float(t[0] - t[1]) for t in (s[0].topk(2).values for s in y.scores)]
            outs.append((y.sequences[0, len(ids):].tolist(), min(margins)))
        return outs

    @torch.no_grad()
    def top_logprob_errors(self, prompt: list[int], tokens: list[int], logprobs: list[dict]) -> list[float]:
        """Per position, the largest gap between the engine's top-k log-probabilities along
        ``tokens`` (an output's ``logprobs``) and the reference's, teacher-forced on the same tokens."""
        logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        reference = torch.log_softmax(logits.double(), dim=-1)
        assert len(logprobs) == len(tokens)
        return [float((torch.tensor([top[i].logprob for i in top], dtype=torch.float64)
                       - reference[position, list(top)]).abs().max()) for position, top in enumerate(logprobs)]

    def top_logprob_error(self, prompt: list[int], tokens: list[int], logprobs: list[dict]) -> float:
        return max(self.top_logprob_errors(prompt, tokens, logprobs))

    def assert_q8_0_logprobs_close(self, runs: list[tuple[list[int], list[int], list[dict]]], tolerance: float) -> None:
        """For models with Q8_0 layers, whose inputs the native kernel rounds to Q8_0 as the
        reference does (round_inputs_to_q8_0): at 90% of positions the top-k log-probabilities
        are within ``tolerance``; at the others within 0.05, where float summation order put a
        value on the other side of a rounding half (measured up to 0.03; without the rounding
        the reference is 0.09-0.17 away)."""
        errors = sorted(e for prompt, tokens, logprobs in runs for e in self.top_logprob_errors(prompt, tokens, logprobs))
        assert errors[int(0.9 * (len(errors) - 1))] <= tolerance and errors[-1] <= 0.05, errors[-5:]

    def well_conditioned(self, candidates: list[list[int]], max_tokens: int, count: int,
                         min_margin: float = 1e-3) -> tuple[list[list[int]], list[list[int]]]:
        """Prompts whose reference greedy path never meets a near-tie, with their outputs.
        On those, any correct implementation must agree token for token."""
        chosen, outputs = [], []
        for prompt, (tokens, margin) in zip(candidates, self.greedy_with_margins(candidates, max_tokens)):
            if margin >= min_margin and len(chosen) < count:
                chosen.append(prompt)
                outputs.append(tokens)
        assert len(chosen) == count, f"only {len(chosen)} of {len(candidates)} prompts are well conditioned"
        return chosen, outputs

    @torch.no_grad()
    def assert_same(self, prompt: list[int], ours: list[int], ref: list[int], min_prefix: int = 8) -> None:
        """Token-for-token equal, except that a divergence is accepted at an exact numerical tie
        (top-2 logits within 1e-4): float summation order legitimately breaks those either way."""
        if ours == ref:
            return
        i = next((k for k in range(min(len(ours), len(ref))) if ours[k] != ref[k]), min(len(ours), len(ref)))
        assert i < len(ours) and i < len(ref), f"lengths differ: {len(ours)} vs {len(ref)}"
        logits = self.model(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, (
            f"diverged at token {i} without a tie (margin {float(top2[0] - top2[1]):.3g}): {ours} != {ref}")
        assert i >= min_prefix, f"tie at token {i}: too early for a meaningful comparison"


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return HFReference(model_dir).greedy(prompts, max_tokens)


def assert_engine_idle(llm) -> None:
    """No request left anywhere and every block free (cached blocks count as free)."""
    engine = llm.engine
    scheduler = engine.scheduler
    assert not engine.has_unfinished_requests()
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting and not scheduler.held
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.kv_cache_manager.req_to_blocks


class RedisServer:
    """A real redis-server of our own on a free port (never a shared one), restartable on the
    same port to test a server that goes away and comes back."""

    def __init__(self, tmp_dir: Path) -> None:
        import shutil
        from tests.server_utils import free_port
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt install redis-server; .ci/run does this)")
        self.port = free_port()
        self.dir = tmp_dir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        import subprocess
        import time
        import redis
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def receiver():
    """A real OTLP/HTTP trace receiver (tests/otlp_receiver.py) for one module's servers."""
    from tests.otlp_receiver import OTLPReceiver
    rx = OTLPReceiver()
    yield rx
    rx.close()
