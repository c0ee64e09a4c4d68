"""Hugging Face model ids: `LLM("ORG/NAME")`, `engine serve ORG/NAME`, with --revision and
--download-dir, from a hub-cache layout built here from a tiny random model (offline, as
HF_HUB_OFFLINE=1 makes it; nothing is downloaded)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub.constants
import pytest

from engine import LLM, SamplingParams
from engine.worker import loader
from engine.worker.loader import resolve_model
from tests.conftest import make_tiny_model
from tests.server_utils import REPO

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [101, 2045, 3055, 4077, 5099]


def add_to_hub_cache(hub: Path, repo_id: str, model_dir: Path, commit: str, ref: str = "main") -> Path:
    """The layout huggingface_hub writes: models--ORG--NAME/snapshots/COMMIT/..., refs/REF."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama) -> Path:
    root = tmp_path_factory.mktemp("hf-home")
    hub = root / "hub"
    add_to_hub_cache(hub, "tiny-org/tiny-llama", tiny_llama, "a" * 40)
    other = make_tiny_model(tmp_path_factory.mktemp("other"), "llama", tie_word_embeddings=True, initializer_range=0.5)
    add_to_hub_cache(hub, "tiny-org/tiny-llama", other, "b" * 40, ref="v2")
    return root


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_an_id_loads_its_cached_snapshot_and_revision(hub, tiny_llama, offline):
    hub_dir = str(hub / "hub")
    assert resolve_model("tiny-org/tiny-llama", download_dir=hub_dir) == hub_dir_snapshot(hub, "a")
    expected = _tokens(LLM(str(tiny_llama), num_blocks=64))
    assert _tokens(LLM("tiny-org/tiny-llama", download_dir=hub_dir, num_blocks=64)) == expected
    v2 = LLM("tiny-org/tiny-llama", revision="v2", download_dir=hub_dir, num_blocks=64)
    assert v2.engine.model_dir == hub_dir_snapshot(hub, "b")
    assert _tokens(v2) != expected  # other weights: the revision really chose them


def hub_dir_snapshot(hub: Path, letter: str) -> Path:
    return hub / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / (letter * 40)


def test_a_local_path_wins_over_an_id(hub, tmp_path, monkeypatch, tiny_llama, offline):
    local = tmp_path / "tiny-org" / "tiny-llama"
    shutil.copytree(tiny_llama, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("tiny-org/tiny-llama", download_dir=str(hub / "hub")) == local


def test_a_hub_that_never_answers_costs_a_bounded_wait_then_the_cache(hub, monkeypatch):
    """A network that swallows packets (a socket that accepts and never answers): the cached
    snapshot is used after loader.HUB_TIMEOUT_S, not never."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setattr(loader, "HUB_TIMEOUT_S", 1.0)
    start = time.monotonic()
    try:
        assert resolve_model("tiny-org/tiny-llama", download_dir=str(hub / "hub")) == hub_dir_snapshot(hub, "a")
    finally:
        silent.close()
    assert time.monotonic() - start < 10


def test_a_missing_local_checkpoint_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, offline):
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        resolve_model("out/ckpt-1000")


def test_an_unknown_id_names_the_id_and_what_was_tried(hub, offline):
    with pytest.raises(FileNotFoundError) as exc:
        resolve_model("nobody/nothing", download_dir=str(hub / "hub"))
    message = str(exc.value)
    assert "'nobody/nothing'" in message and "no local path" in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model id"):
        resolve_model("not//an id", download_dir=str(hub / "hub"))
    with pytest.raises(FileNotFoundError, match="revision 'v9'"):
        resolve_model("tiny-org/tiny-llama", revision="v9", download_dir=str(hub / "hub"))


def test_the_cli_takes_an_id_with_hf_home_and_offline(hub, tiny_llama):
    env = {**os.environ, "HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-m", "entrypoints.cli", "generate", "Hello", "--model",
                          "tiny-org/tiny-llama", "--revision", "v2", "--max-tokens", "4", "--num-blocks", "64"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = subprocess.run([sys.executable, "-m", "entrypoints.cli", "generate", "Hello", "--model",
                              "nobody/nothing", "--num-blocks", "64"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode != 0 and "'nobody/nothing'" in missing.stderr, missing.stderr[-2000:]
