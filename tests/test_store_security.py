"""KV plane security, the store part: private disk files, authenticated entries (a deployment
secret), Redis with a password, ACL users and TLS. Attacks use real files and real redis-py
writes; the engine must recompute and its output must not change."""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from urllib.parse import quote

import httpx
import pytest
import redis
import torch

from engine import LLM
from engine.kv_transfer import serde
from engine.kv_transfer.secret import KVSecret
from engine.kv_transfer.stores import parse_store_spec
from engine.kv_transfer.stores.base import redact, split_store_spec
from engine.kv_transfer.stores.disk import DiskStore
from engine.kv_transfer.stores.redis import RedisStore
from tests.redis_utils import RedisProcess, make_certificates
from tests.server_utils import free_port
from tests.test_kv_store import FMT, GREEDY, _chunk, _prompt, reference  # noqa: F401 (reference: a fixture)

SECRET = KVSecret("victim-deployment-secret-0123456789")
OTHER = KVSecret("attacker-guessed-secret-0123456789")


def _payload(kv: torch.Tensor, key: str, secret: KVSecret | None) -> bytes:
    return b"".join(serde.encode(kv, FMT.fingerprint, 16, key, secret))


def _flip(data: bytes, at: int) -> bytes:
    flipped = bytearray(data)
    flipped[at] ^= 0x01
    return bytes(flipped)


# ---- disk permissions ----------------------------------------------------------------------
def test_disk_tier_is_private_whatever_the_umask(tmp_path, caplog):
    old = os.umask(0o000)
    try:
        store = DiskStore(str(tmp_path / "kv"), 2**30, FMT)
        store.put("k0", _chunk(0))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path("k0")).st_mode) == 0o600
    # A directory that exists keeps its mode (it may be shared, like /tmp): a warning says so.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with caplog.at_level(logging.WARNING, logger="engine.kv_store"):
        DiskStore(str(shared), 2**30, FMT)
    assert "open to other users (mode 777)" in caplog.text and "without a KV secret" in caplog.text
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o777


# ---- the entry format ----------------------------------------------------------------------
def test_signed_entries_refuse_every_forgery_with_a_reason():
    kv = _chunk(0)
    good = _payload(kv, "k0", SECRET)
    assert torch.equal(serde.decode(good, FMT.fingerprint, FMT.dtype, list(FMT.shape), "k0", SECRET), kv)
    unsigned = _payload(kv, "k0", None)
    assert torch.equal(serde.decode(unsigned, FMT.fingerprint, FMT.dtype, list(FMT.shape), "k0"), kv)
    cases = [  # (bytes, key read under, reader's secret, reason)
        (unsigned, "k0", SECRET, "bad_tag"),  # written without the secret (today's CRC format)
        (_payload(kv, "k0", OTHER), "k0", SECRET, "bad_tag"),  # written with another secret
        (good, "k1", SECRET, "bad_tag"),  # a valid entry copied under another key
        (_flip(good, -100), "k0", SECRET, "bad_tag"),  # a KV byte altered
        (_flip(good, -1), "k0", SECRET, "bad_tag"),  # the tag altered
        (good[:-7], "k0", SECRET, "corrupt"),  # truncated
        (good + b"\0", "k0", SECRET, "corrupt"),  # padded
        (good, "k0", None, "wrong_format"),  # a reader without the secret cannot check a tag
        (b"EKV1" + good[4:], "k0", SECRET, "wrong_format"),  # an older format version
        (b"junk" * 20, "k0", SECRET, "corrupt"),
    ]
    for i, (data, key, secret, reason) in enumerate(cases):
        with pytest.raises(serde.CorruptPayload) as info:
            serde.decode(data, FMT.fingerprint, FMT.dtype, list(FMT.shape), key, secret)
        assert info.value.reason == reason, f"case {i}: {info.value}"
    with pytest.raises(serde.CorruptPayload) as info:  # another model's entry
        serde.decode(good, "model-b", FMT.dtype, list(FMT.shape), "k0", SECRET)
    assert info.value.reason == "wrong_format"


# ---- stores: planted and altered entries ---------------------------------------------------
class _DiskEntries:
    """The disk tier's files, written as an attacker with access to the directory would."""

    def __init__(self, store: DiskStore) -> None:
        self.store = store

    def path(self, key: str) -> str:
        return self.store.path(key)

    def read(self, key: str) -> bytes:
        with open(self.path(key), "rb") as f:
            return f.read()

    def write(self, key: str, data: bytes) -> None:
        with open(self.path(key), "wb") as f:
            f.write(data)

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))


class _RedisEntries:
    """The Redis tier's values, written with redis-py as another client of the server would."""

    def __init__(self, store: RedisStore, url: str) -> None:
        self.client, self.prefix = redis.Redis.from_url(url), store.prefix

    def read(self, key: str) -> bytes:
        return self.client.get(self.prefix + key)

    def write(self, key: str, data: bytes) -> None:
        self.client.set(self.prefix + key, data)

    def exists(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + key))


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_bad_entries_are_misses_deleted_and_counted(tier, tmp_path, request):
    if tier == "disk":
        store = DiskStore(str(tmp_path / "kv"), 2**30, FMT, secret=SECRET)
        entries = _DiskEntries(store)
    else:
        url = request.getfixturevalue("redis_server").url
        store = RedisStore(url, FMT, secret=SECRET)
        entries = _RedisEntries(store, url)
    store.put("k0", _chunk(0))
    store.put("k1", _chunk(1))
    good0, good1 = entries.read("k0"), entries.read("k1")
    attacks = [(_payload(_chunk(9), "k0", None), "bad_tag"), (_payload(_chunk(9), "k0", OTHER), "bad_tag"),
               (_flip(good0, -100), "bad_tag"), (good1, "bad_tag"), (good0[:-7], "corrupt"),
               (b"EKV1" + good0[4:], "wrong_format")]
    for data, reason in attacks:
        entries.write("k0", data)
        assert store.contains(["k0"]) == [True]  # found, as a planted entry would be
        assert store.get("k0") is None and not entries.exists("k0"), reason
    assert store.stats.rejected == {"bad_tag": 4, "corrupt": 1, "wrong_format": 1}
    assert torch.equal(store.get("k1"), _chunk(1))  # the genuine entries are untouched
    store.put("k0", _chunk(0))
    assert torch.equal(store.get("k0"), _chunk(0)) and entries.read("k0") == good0
    store.close()


def test_planted_huge_and_non_string_redis_values_are_refused(redis_server):  # noqa: F811
    """Redis's answer to a planted value is bounded (never more than one payload is fetched),
    and a list planted under our key is a refused entry, not a server that is down."""
    store = RedisStore(redis_server.url, FMT, secret=SECRET)
    entries = _RedisEntries(store, redis_server.url)
    entries.write("huge", b"EKV2" + b"\0" * (64 * 2**20))
    entries.client.rpush(store.prefix + "list", b"x")
    fetched = []
    getrange = store._client.getrange
    store._client.getrange = lambda *args: fetched.append(len(value := getrange(*args))) or value
    for key in ("huge", "list"):
        assert store.contains([key]) == [True] and store.get(key) is None and not entries.exists(key)
    assert fetched == [serde.max_size(FMT.nbytes) + 1] and store.stats.rejected == {"corrupt": 2}
    assert store.available  # still on
    store.put("k0", _chunk(0))
    assert torch.equal(store.get("k0"), _chunk(0))
    store.close()


def test_planted_symlinks_fifos_and_huge_files_are_refused(tmp_path, caplog):
    """Without a secret too: a symlink would serve another key's entry, a FIFO would block the
    reader, a huge sparse file would be read into memory. Each is refused and removed."""
    store = DiskStore(str(tmp_path), 2**30, FMT)
    store.put("k0", _chunk(0))
    os.symlink(store.path("k0"), store.path("k1"))
    os.mkfifo(store.path("k2"))
    with open(store.path("k3"), "wb") as f:
        f.truncate(serde.max_size(FMT.nbytes) + 1)
    results = {}
    reader = threading.Thread(target=lambda: results.update((k, store.get(k)) for k in ("k1", "k2", "k3")),
                              daemon=True)
    with caplog.at_level(logging.WARNING, logger="engine.kv_store"):
        reader.start()
        reader.join(5)
    if reader.is_alive():  # blocked on the FIFO: open it for writing once so the reader ends
        with open(store.path("k2"), "wb"):
            pass
        pytest.fail("reading a planted FIFO blocked")
    assert results == {"k1": None, "k2": None, "k3": None}
    assert os.listdir(tmp_path) == [os.path.basename(store.path("k0"))] and torch.equal(store.get("k0"), _chunk(0))
    assert store.stats.rejected == {"corrupt": 3}
    assert caplog.text.count("a symlink, not an entry") == 1
    assert caplog.text.count("not a regular file of at most a payload's size") == 2


# ---- the engine under attack ---------------------------------------------------------------
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_the_engine_recomputes_past_forged_entries(tiny_llama, reference, tmp_path, tier, request,  # noqa: F811
                                                   monkeypatch):
    """A victim with a secret and one slow tier (no CPU tier: every prefix hit reads the tier).
    Its prompt's first chunk is replaced, in turn, by an attacker's entry without the secret,
    with another secret, an altered copy, another chunk's valid entry and a truncated one:
    every time the load fails and the engine recomputes, the output equals the reference, and
    the refusal is counted by reason."""
    url = request.getfixturevalue("redis_server").url if tier == "redis" else None
    spec = url if tier == "redis" else f"disk:{tmp_path}/kv:1GiB"
    llm = LLM(str(tiny_llama), num_blocks=64, kv_store=spec, kv_chunk_tokens=32, kv_secret=SECRET)
    connector = llm.engine.runner.connector
    store = connector.tiers.stores[0]
    entries = _DiskEntries(store) if tier == "disk" else _RedisEntries(store, url)
    written: list[str] = []
    put = store.put
    monkeypatch.setattr(store, "put", lambda key, kv: (written.append(key), put(key, kv)))
    prompt = _prompt(60, 100)  # 3 whole chunks of 32 tokens before the last prompt token
    scheduler = llm.engine.scheduler

    def run() -> tuple[int, int, int]:
        """Serves the prompt (the output must equal the reference) and returns the chunks the
        tier supplied, the failed loads (each one a recomputed prefill) and the prompt tokens
        reported as cached (none when the load failed: they were recomputed)."""
        hits, failures = store.stats.hits, scheduler.stats.num_kv_load_failures
        llm.engine.kv_cache_manager.pool.reset_prefix_cache()  # so the prefix must come from the tier
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference(prompt)
        assert connector.wait_for_saves()
        return store.stats.hits - hits, scheduler.stats.num_kv_load_failures - failures, out.num_cached_tokens

    assert run() == (0, 0, 0) and len(written) == 3
    first, second = written[0], written[1]  # saves are queued in chunk order
    assert run() == (3, 0, 96)  # the genuine entries serve the prefix
    genuine_first, genuine_second = entries.read(first), entries.read(second)
    fp, n = store.fmt.fingerprint, store.fmt.shape[2] * store.fmt.shape[3]
    poison = torch.randn(store.fmt.shape, generator=torch.Generator().manual_seed(7)).to(store.fmt.dtype)
    forgeries = [
        (b"".join(serde.encode(poison, fp, n, first)), "bad_tag"),  # an attacker without the secret
        (b"".join(serde.encode(poison, fp, n, first, OTHER)), "bad_tag"),  # with a wrong secret
        (_flip(genuine_first, -1000), "bad_tag"),  # bytes of a valid entry flipped
        (genuine_second, "bad_tag"),  # a valid entry copied under another key
        (genuine_first[:-100], "corrupt"),  # truncated
    ]
    expected: dict[str, int] = {}
    for data, reason in forgeries:
        entries.write(first, data)
        assert run() == (0, 1, 0), reason  # refused: the load fails and the prefill is recomputed
        expected[reason] = expected.get(reason, 0) + 1
        assert store.stats.rejected == expected
        assert entries.read(first) == genuine_first  # the forgery is gone; the recompute rewrote it
    assert run() == (3, 0, 96)  # and the tier serves again
    assert llm.engine.kv_connector_stats.stores[tier]["rejected"] == expected  # what /metrics and /status export
    llm.shutdown()


def test_rejections_are_exported_per_tier_and_reason():
    from engine.ipc import EngineStats, TierStats
    from entrypoints.metrics import ServerMetrics
    stats = EngineStats(kv_store={"disk": TierStats(rejected={"bad_tag": 2, "corrupt": 1}), "redis": TierStats()})
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'engine:kv_store_rejected_total{model_name="m",reason="bad_tag",tier="disk"} 2.0' in text
    assert 'engine:kv_store_rejected_total{model_name="m",reason="corrupt",tier="disk"} 1.0' in text


# ---- Redis: password, ACL user, TLS --------------------------------------------------------
ADMIN_PASSWORD = "adm1n,pass:with odd/chars?#%@"
USER_PASSWORD = "us3r,pw:;!$&'()*+=~@x"  # raw commas and colons survive the spec; @ must be %40


@pytest.fixture
def redis_with_auth(tmp_path):
    """requirepass for the default user, and an ACL user limited to the engine's keys."""
    port = free_port()
    server = RedisProcess(tmp_path, port, f"redis://:{quote(ADMIN_PASSWORD, safe='')}@127.0.0.1:{port}/0",
                          "--port", str(port), "--requirepass", ADMIN_PASSWORD,
                          "--user", "engine", "on", f">{USER_PASSWORD}", "~engine-kv:*", "+@all")
    yield server
    server.stop()


def test_spec_keeps_redis_urls_whole_and_errors_hide_passwords():
    spec = "cpu:1MiB,redis://u:pa,ss:wo%40rd@h:1/0?client_name=a&ssl_cert_reqs=none, disk:/a:1GiB"
    assert split_store_spec(spec) == ["cpu:1MiB", "redis://u:pa,ss:wo%40rd@h:1/0?client_name=a&ssl_cert_reqs=none",
                                      "disk:/a:1GiB"]
    assert redact(spec) == "cpu:1MiB,redis://u:***@h:1/0?client_name=a&ssl_cert_reqs=none, disk:/a:1GiB"
    assert redact("rediss://secret@h:1/0 and unix://:pw@/run/redis.sock") == \
        "rediss://***@h:1/0 and unix://:***@/run/redis.sock"
    for bad, shown in [("redis://u:hunter2@127.0.0.1:1/0,gpu:1GiB", "path must be"),  # a typo is not swallowed
                       ("redis://u:hunter2@127.0.0.1:1/0?no_such_option=1", "no_such_option"),
                       ("redis://u:hunter2@127.0.0.1:1/0,cpu:1MiB,rediss://u:hunter2@127.0.0.1:2/0", "once"),
                       ("redis:/u:hunter2@127.0.0.1:1/0", "unknown KV store tier 'redis'"),
                       # unencoded / and # in the password, and a comma that splits one off as a "tier"
                       ("redis://admin:hunter2/x@127.0.0.1:1/0", "path must be"),
                       ("redis://admin:top#hunter2@127.0.0.1:1/0", "not valid"),
                       ("cpu:1GiB,redis://u:hunter2,disk:hunter2@h/0", "disk tier needs")]:
        with pytest.raises(ValueError, match=shown) as info:
            parse_store_spec(bad, FMT)
        assert "hunter2" not in str(info.value), info.value


def test_redis_password_and_acl_user_end_to_end(tiny_llama, reference, redis_with_auth, caplog):  # noqa: F811
    """The ACL user's URL (odd characters in the password, a query argument) works through an
    engine: its second run loads the prefix from Redis. A wrong or missing password is a tier
    that is off: the engine serves the same output, and no password reaches a log line."""
    port = redis_with_auth.port
    user_url = f"redis://engine:{USER_PASSWORD.replace('@', '%40')}@127.0.0.1:{port}/0?client_name=engine-kv-test"
    with caplog.at_level(logging.INFO):
        llm = LLM(str(tiny_llama), num_blocks=64, kv_store=user_url, kv_chunk_tokens=32, kv_secret=SECRET)
        prompt = _prompt(61, 100)
        for expected_cached in (0, 96):
            llm.engine.kv_cache_manager.pool.reset_prefix_cache()  # the second run's prefix comes from Redis
            out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference(prompt) and out.num_cached_tokens == expected_cached
            assert llm.engine.runner.connector.wait_for_saves()
        assert llm.engine.kv_connector_stats.stores["redis"]["hits"] == 3
        with redis.Redis.from_url(redis_with_auth.url) as admin:  # the query argument reached the connection
            assert "engine-kv-test" in [c["name"] for c in admin.client_list()]
        llm.shutdown()
        for url in (user_url.replace("us3r", "wrong"), f"redis://127.0.0.1:{port}/0",
                    f"redis://:{quote(ADMIN_PASSWORD, safe='')}x@127.0.0.1:{port}/0"):
            store = RedisStore(url, FMT, secret=SECRET)
            assert not store.available and store.get("k0") is None and store.contains(["k0"]) == [False]
            store.close()
    assert caplog.text.count("unavailable") == 3 and "engine:***@" in caplog.text
    for secret_text in ("us3r", "wrong,pw", "adm1n", quote(ADMIN_PASSWORD, safe="")):
        assert secret_text not in caplog.text


def test_a_server_with_a_wrong_redis_password_serves_and_hides_it(tiny_llama, reference,  # noqa: F811
                                                                 redis_with_auth):
    from tests.server_utils import ServerProcess
    password = "Wr0ng-Redis-Passw0rd"
    server = ServerProcess(str(tiny_llama), "--num-blocks", "64", "--kv-chunk-tokens", "32", "--served-model-name",
                           "tiny", "--kv-store", f"redis://:{password}@127.0.0.1:{redis_with_auth.port}/0")
    try:
        prompt = _prompt(62, 100)
        resp = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
            "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        server.wait_idle()
        status = httpx.get(f"{server.url}/status", timeout=5).text
        metrics = server.metrics()
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert resp.json()["choices"][0]["text"] == _detokenize(tiny_llama, reference(prompt))
    redis_stats = json.loads(status)["kv_store"]["redis"]
    assert redis_stats["misses"] == 3 and redis_stats["hits"] == 0  # off: every lookup is a miss
    assert "unavailable" in log and ":***@127.0.0.1" in log
    for text in (log, status, metrics):
        assert password not in text


def _detokenize(model_dir, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir)).decode(token_ids)


@pytest.fixture
def redis_tls(tmp_path):
    """TLS only (no plain port); clients must present a certificate signed by the test CA."""
    certs = make_certificates(tmp_path)
    port = free_port()
    query = f"ssl_ca_certs={certs['ca.crt']}&ssl_certfile={certs['client.crt']}&ssl_keyfile={certs['client.key']}"
    server = RedisProcess(tmp_path, port, f"rediss://127.0.0.1:{port}/0?{query}&ssl_cert_reqs=required",
                          "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["server.crt"]),
                          "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]),
                          "--tls-auth-clients", "yes")
    yield server, certs
    server.stop()


def test_redis_over_tls(redis_tls, caplog):
    """A round trip over rediss:// (CA and client certificate as query arguments, through the
    spec parser); a client that lacks the CA, its certificate, or TLS fails cleanly: off, misses."""
    server, certs = redis_tls
    port = server.port
    [store] = parse_store_spec(server.url, FMT, secret=SECRET)
    store.put("k0", _chunk(0))
    assert store.available and store.contains(["k0"]) == [True] and torch.equal(store.get("k0"), _chunk(0))
    store.close()
    without_ca = f"rediss://127.0.0.1:{port}/0?ssl_certfile={certs['client.crt']}&ssl_keyfile={certs['client.key']}"
    without_cert = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca.crt']}"
    with caplog.at_level(logging.WARNING, logger="engine.kv_store"):
        for url in (without_ca, without_cert, f"redis://127.0.0.1:{port}/0"):
            start = time.monotonic()
            store = RedisStore(url, FMT, secret=SECRET)
            assert not store.available and store.get("k0") is None and store.contains(["k0"]) == [False]
            assert time.monotonic() - start < 5
            store.close()
    assert caplog.text.count("unavailable") == 3
