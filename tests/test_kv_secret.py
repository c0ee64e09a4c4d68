"""The deployment secret (issue 12): where it comes from, what it signs, and `engine serve`
refusing to expose the KV plane without one."""
from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import time

import msgspec
import pytest

from engine.config import EngineConfig, KVTransferConfig
from engine.kv_transfer.params import (
    KVTransferParams, KVTransferParamsError, check_kv_transfer_params_signature, sign_kv_transfer_params, signed_bytes,
)
from engine.kv_transfer.secret import ENV_VAR, KVSecret, KVSecretError, load_kv_secret
from entrypoints.cli import check_kv_exposure
from tests.server_utils import REPO

SECRET = "0123456789abcdef0123456789abcdef"


def test_keys_are_per_purpose_and_the_secret_never_shows():
    secret = KVSecret(SECRET)
    assert len(secret.key("params")) == 32 and secret.key("params") != secret.key("socket")
    assert secret.key("params") == KVSecret(SECRET + "\n").key("params")  # a file's newline is not part of it
    assert secret.key("params") != KVSecret(SECRET[::-1]).key("params")
    # Parts are length-prefixed: moving bytes between them changes the tag.
    assert secret.mac("store", b"ab", b"c") != secret.mac("store", b"a", b"bc")
    assert secret.verify("store", secret.mac("store", b"x"), b"x") and not secret.verify("store", b"\0" * 32, b"x")
    config = EngineConfig(model="m", kv_secret=SECRET)
    assert SECRET not in repr(config) and SECRET not in repr(config.kv_secret)
    copy = pickle.loads(pickle.dumps(config)).kv_secret  # how it reaches the engine core process
    assert copy.key("socket") == secret.key("socket")
    with pytest.raises(KVSecretError, match="at least 16 bytes"):
        KVSecret("short")


def test_secret_file_and_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert load_kv_secret(None) is None
    monkeypatch.setenv(ENV_VAR, SECRET)
    assert load_kv_secret(None).key("x") == KVSecret(SECRET).key("x")
    path = tmp_path / "kv.secret"
    path.write_text("another secret of enough length\n")
    path.chmod(0o644)
    with pytest.raises(KVSecretError, match="readable by others"):
        load_kv_secret(str(path))
    path.chmod(0o600)
    assert load_kv_secret(str(path)).key("x") == KVSecret("another secret of enough length").key("x")  # file wins
    with pytest.raises(KVSecretError, match="cannot read"):
        load_kv_secret(str(tmp_path / "missing"))


def test_engine_secret_writes_a_private_file(tmp_path):
    path = tmp_path / "kv.secret"
    run = [sys.executable, "-m", "entrypoints.cli", "secret", str(path)]
    assert subprocess.run(run, cwd=REPO, capture_output=True).returncode == 0
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(path.read_text().strip()) == 64
    first = path.read_text()
    assert subprocess.run(run, cwd=REPO, capture_output=True).returncode == 2  # never overwritten silently
    assert path.read_text() == first
    load_kv_secret(str(path))


def test_signed_params_verify_and_nothing_else_does():
    secret = KVSecret(SECRET)
    params = KVTransferParams(do_remote_prefill=True, remote_kv_addr="tcp://10.0.0.1:14579", remote_request_id="r",
                              num_tokens=40, token_digest="d" * 64)
    signed = sign_kv_transfer_params(params, secret, ttl_s=30)
    check_kv_transfer_params_signature(signed, secret)
    # As JSON through a proxy and back: still valid.
    check_kv_transfer_params_signature(msgspec.json.decode(msgspec.json.encode(signed), type=KVTransferParams), secret)
    for field, value in [("remote_kv_addr", "tcp://10.6.6.6:1"), ("remote_request_id", "other"), ("num_tokens", 41),
                         ("token_digest", "e" * 64), ("expires_at", signed.expires_at + 3600), ("signature", None)]:
        with pytest.raises(KVTransferParamsError) as err:
            check_kv_transfer_params_signature(msgspec.structs.replace(signed, **{field: value}), secret)
        assert err.value.param == "kv_transfer_params.signature", field
    with pytest.raises(KVTransferParamsError):
        check_kv_transfer_params_signature(signed, KVSecret(SECRET[::-1]))
    with pytest.raises(KVTransferParamsError) as err:
        check_kv_transfer_params_signature(sign_kv_transfer_params(params, secret, ttl_s=-3600), secret)
    assert err.value.param == "kv_transfer_params.expires_at"
    # Nothing to act on, or no secret to check with (loopback only): accepted as they are.
    check_kv_transfer_params_signature(KVTransferParams(do_remote_decode=True), secret)
    check_kv_transfer_params_signature(params, None)


class _OlderParams(msgspec.Struct, omit_defaults=True):
    """kv_transfer_params as another release shapes them: fields in another order, and without
    the ones added since (first tokens, conditional disaggregation)."""
    expires_at: int = 0
    token_digest: str | None = None
    num_tokens: int = 0
    remote_request_id: str | None = None
    remote_kv_addr: str | None = None
    do_remote_prefill: bool = False
    signature: str | None = None


def _previous_release_verifies(params: KVTransferParams, secret: KVSecret) -> bool:
    """The previous release's check: an HMAC over the struct's JSON, re-encoded in field order."""
    unsigned = msgspec.structs.replace(params, signature=None)
    return secret.verify("params", bytes.fromhex(params.signature), msgspec.json.encode(unsigned))


def test_params_verify_between_adjacent_releases():
    """Issue 27, item 9, in two phases: this release signs what the previous one verifies, and
    verifies both that and the canonical form (sorted keys, defaults left out, versioned) that
    the next release will sign, whose field order and added fields may differ."""
    secret = KVSecret(SECRET)
    current = sign_kv_transfer_params(KVTransferParams(
        do_remote_prefill=True, remote_kv_addr="tcp://10.0.0.1:14579", remote_request_id="r", num_tokens=40,
        token_digest="d" * 64, first_token_ids=[7]), secret, ttl_s=60)
    assert _previous_release_verifies(msgspec.json.decode(msgspec.json.encode(current), type=KVTransferParams),
                                      secret)
    # A release that orders its fields otherwise and lacks (or adds, at their defaults) some,
    # signing the canonical form:
    other = _OlderParams(int(time.time()) + 60, "d" * 64, 40, "r", "tcp://10.0.0.1:14579", True)
    other = msgspec.structs.replace(other, signature=secret.mac("params", signed_bytes(other)).hex())
    received = msgspec.json.decode(msgspec.json.encode(other), type=KVTransferParams)
    check_kv_transfer_params_signature(received, secret)
    # Changed after signing, in either form: refused.
    for signed in (received, current):
        with pytest.raises(KVTransferParamsError):
            check_kv_transfer_params_signature(msgspec.structs.replace(signed, num_tokens=41), secret)


def _serve_args(role: str, host: str, kv_ip: str | None = None, insecure: bool = False) -> argparse.Namespace:
    return argparse.Namespace(role=role, host=host, kv_ip=kv_ip, insecure_kv=insecure)


def _config(role: str, host: str, kv_ip: str | None, secret: str | None, encrypt: bool = False) -> EngineConfig:
    transfer = KVTransferConfig(kv_connector="p2p", kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                                kv_ip=kv_ip or host, kv_port=14579 if role == "prefill" else None,
                                extra={"encrypt": encrypt})
    return EngineConfig(model="m", kv_transfer_config=transfer, kv_secret=secret)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_refuses_an_exposed_kv_plane_without_a_secret(role, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    check_kv_exposure(_serve_args(role, "127.0.0.1"), _config(role, "127.0.0.1", None, None))  # loopback: fine
    check_kv_exposure(_serve_args(role, "localhost"), _config(role, "localhost", None, None))
    for host, kv_ip in [("10.1.2.3", None), ("127.0.0.1", "10.1.2.3"), ("node7.example", None),
                        ("0.0.0.0", "127.0.0.1")]:
        with pytest.raises(ValueError, match="without a deployment secret"):
            check_kv_exposure(_serve_args(role, host, kv_ip), _config(role, host, kv_ip, None))
        check_kv_exposure(_serve_args(role, host, kv_ip), _config(role, host, kv_ip, SECRET))
        check_kv_exposure(_serve_args(role, host, kv_ip, insecure=True), _config(role, host, kv_ip, None))
    for kv_ip in ("0.0.0.0", "::", "::0", "0:0::0", "[::]", "*", "fd00::5", None, 7):
        with pytest.raises(ValueError, match="kv_ip"):
            _config(role, "127.0.0.1", kv_ip, SECRET) if kv_ip is not None else KVTransferConfig(kv_ip=None)
    with pytest.raises(ValueError, match="--kv-encrypt needs"):
        check_kv_exposure(_serve_args(role, "127.0.0.1"), _config(role, "127.0.0.1", None, None, encrypt=True))


def test_a_store_user_is_safe_by_default_too(monkeypatch):
    """A colocated instance with KV tiers acts on clients' kv_store_tokens promises and reads
    entries others may write: on a network, or with a remote Redis, it needs the secret too."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    check_kv_exposure(_serve_args("both", "0.0.0.0"), EngineConfig(model="m"))  # no KV plane at all
    for host, store in [("127.0.0.1", "cpu:1GiB"), ("127.0.0.1", "redis://127.0.0.1:6379/0"),
                        ("127.0.0.1", "unix:///run/redis.sock")]:
        check_kv_exposure(_serve_args("both", host), EngineConfig(model="m", kv_store=store))
    for host, store in [("0.0.0.0", "cpu:1GiB"), ("127.0.0.1", "redis://10.0.0.9:6379/0"),
                        ("127.0.0.1", "cpu:1GiB,rediss://u:p@cache.example:6380/0")]:
        with pytest.raises(ValueError, match="without a deployment secret") as err:
            check_kv_exposure(_serve_args("both", host), EngineConfig(model="m", kv_store=store))
        assert ":p@" not in str(err.value)
        check_kv_exposure(_serve_args("both", host), EngineConfig(model="m", kv_store=store, kv_secret=SECRET))
        check_kv_exposure(_serve_args("both", host, insecure=True), EngineConfig(model="m", kv_store=store))


def test_every_subcommand_prints_its_help():
    """argparse formats help texts with %: a stray one breaks --help (it did, once)."""
    for command in ("generate", "serve", "proxy", "disagg", "status", "secret"):
        done = subprocess.run([sys.executable, "-m", "entrypoints.cli", command, "--help"], cwd=REPO,
                              capture_output=True, text=True)
        assert done.returncode == 0 and "usage: engine" in done.stdout, (command, done.stderr[-500:])
