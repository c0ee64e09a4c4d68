"""CLI flag handling that needs no model: --role / --kv-transfer-config."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from entrypoints.cli import kv_transfer_config


def _args(**kw) -> argparse.Namespace:
    base = dict(kv_transfer_config=None, role="both", kv_ip=None, host="127.0.0.1", kv_port=None,
                kv_load_failure_policy="recompute", kv_lease_s=30.0, kv_load_timeout_s=30.0, kv_encrypt=False)
    return argparse.Namespace(**{**base, **kw})


def test_roles_map_to_connector_configs():
    assert kv_transfer_config(_args()) is None
    p = kv_transfer_config(_args(role="prefill", kv_lease_s=5.0))
    assert (p.kv_connector, p.kv_role, p.kv_port, p.extra["lease_s"]) == ("p2p", "kv_producer", 14579, 5.0)
    d = kv_transfer_config(_args(role="decode", kv_load_failure_policy="fail"))
    assert (d.kv_role, d.kv_port, d.kv_load_failure_policy) == ("kv_consumer", None, "fail")


def test_json_config_vllm_style():
    c = kv_transfer_config(_args(kv_transfer_config='{"kv_connector": "p2p", "kv_role": "kv_consumer", '
                                                   '"kv_connector_extra_config": {"load_timeout_s": 3}}'))
    assert (c.kv_role, c.extra) == ("kv_consumer", {"load_timeout_s": 3})
    with pytest.raises(ValueError, match="not valid JSON"):
        kv_transfer_config(_args(kv_transfer_config="{oops"))
    with pytest.raises(ValueError, match="unknown keys"):
        kv_transfer_config(_args(kv_transfer_config='{"kv_buffer_sise": 1}'))
    with pytest.raises(ValueError, match="kv_role"):
        kv_transfer_config(_args(kv_transfer_config='{"kv_connector": "p2p", "kv_role": "leader"}'))


def test_serve_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "entrypoints.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=60).stdout
    for flag in ["--block-size", "--kv-cache-memory", "--num-blocks", "--max-num-seqs", "--max-num-batched-tokens",
                 "--max-model-len", "--dtype", "--seed", "--served-model-name", "--api-key", "--max-queue-len",
                 "--role", "--kv-port", "--kv-transfer-config", "--kv-load-failure-policy", "--kv-store",
                 "--kv-chunk-tokens", "--kv-store-ttl-s", "--kv-always-load", "--small-rows-linear"]:
        assert flag in out, flag


@pytest.mark.parametrize("flags", [
    [],  # `make serve`: engine disagg with every default
    ["--no-kv-always-load", "--no-enable-prefix-caching", "--enforce-eager", "--dtype", "float32",
     "--kv-store", "cpu:1GiB", "--max-num-seqs", "7", "--seed", "3", "--kv-chunk-tokens", "64",
     "--small-rows-linear"],
], ids=["defaults", "non-defaults"])
def test_engine_disagg_hands_its_instances_the_engine_flags_it_was_given(monkeypatch, flags):
    """Each instance's `engine serve` must read what `engine disagg` read: a flag handed on in a
    form serve does not parse (a boolean as its value, `--kv-always-load True`) once made
    `make serve` (every default) take "True" for its model and exit."""
    from entrypoints import cli, launcher
    handed, served, read = [], [], {}
    monkeypatch.setattr(launcher, "run_disagg",
                        lambda model, host, port, engine_args, *a, **k: handed.append((model, engine_args)) or 0)
    assert cli.main(["disagg", *flags]) == 0
    model, engine_args = handed[0]
    monkeypatch.setattr(cli, "cmd_serve", lambda args: served.append(args) or 0)
    assert cli.main(["serve", model, *engine_args]) == 0
    assert served[0].model_path == model
    monkeypatch.setattr(cli, "cmd_disagg", lambda args: read.update(cli.engine_kwargs(args)) or 0)
    assert cli.main(["disagg", *flags]) == 0
    # --long-prefill-token-threshold is the decode instance's alone; the GPU share is halved for
    # two instances on one device (vLLM's meaning of the flag: each instance's own share)
    apart = ("long_prefill_token_threshold", "gpu_memory_utilization")
    got = cli.engine_kwargs(served[0])
    assert got["gpu_memory_utilization"] == read["gpu_memory_utilization"] / 2
    assert {k: v for k, v in got.items() if k not in apart} == {k: v for k, v in read.items() if k not in apart}


def test_engine_status_through_a_proxy(tiny_llama):
    """`engine status URL` on a proxy prints the proxy and the live state of every instance
    behind it; an unreachable URL is reported and makes the exit status 1."""
    from tests.disagg_utils import Disagg
    from tests.server_utils import free_port
    cluster = Disagg(str(tiny_llama), "--num-blocks", "64", "--max-model-len", "1024")
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        result = subprocess.run([sys.executable, "-m", "entrypoints.cli", "status", cluster.url, dead],
                                capture_output=True, text=True, timeout=60)
        out = result.stdout
        assert result.returncode == 1 and f"{dead}  UNREACHABLE" in out
        assert "proxy (least-loaded routing)" in out and "decisions  local/prefill_busy 0" in out
        assert cluster.prefill.url in out and cluster.decode.url in out
        assert out.count("requests   running 0  waiting 0 (for remote KV 0)  held for transfer 0") == 2
        assert out.count("kv blocks  total 64  free 64") == 2 and "transfers  in flight 0" in out
    finally:
        cluster.stop()


def test_ray_serve_hands_the_flags_after_a_bare_dashdash_to_its_replicas(monkeypatch):
    from entrypoints import cli
    seen = {}
    monkeypatch.setattr(cli, "cmd_ray_serve", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(["ray-serve", "M", "--port", "9", "--decode-replicas", "1:8", "--",
                     "--max-model-len", "64", "--port", "1"]) == 0
    assert (seen["model_path"], seen["port"], seen["decode_replicas"]) == ("M", 9, "1:8")
    assert seen["engine_args"] == ["--max-model-len", "64", "--port", "1"]
    seen.clear()
    assert cli.main(["ray-serve"]) == 0 and seen["engine_args"] == [] and seen["model_path"] is None
