"""The engine-core process: owns the LLMEngine and runs the step loop.

It talks to the API server over two zmq PUSH/PULL sockets. Between steps it drains incoming
messages, so an abort takes effect within one engine step, and HTTP handling never stalls
the model loop. Every socket has a LINGER; every wait has a timeout.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
import traceback

import msgspec
import zmq

from engine.config import EngineConfig
from engine import timeline
from engine.core_lending import core_lending
from engine.kv_events import KVEventPublisher
from engine.errors import InvalidRequestError, PrefillElsewhere
from engine.engine_core import EngineCore
from engine.kv_transfer.params import KVTransferParamsError
from engine.ipc import (Ack, AbortRequests, AddRequest, EngineDead, EngineInfo, EngineStats, Outputs, PeerPulls,
                        ReleaseOffer, Shutdown, StopSequences, TierStats, ToCore, remove_ipc_dir)
from engine.outputs import EngineCoreOutput

logger = logging.getLogger("engine.core")

IDLE_POLL_MS = 100
STATS_INTERVAL_S = 1.0
# Only waiting on transfers (nothing scheduled): check on them this often instead of spinning.
WAIT_POLL_MS = 2
TRIM_INTERVAL_S = 5.0
# A SIGTERM is the server's to act on; one that reaches the core alone stops it after this long
# (longer than the server's 10 s drain plus the 10 s it gives the core to stop).
TERM_GRACE_S = 25.0


class EngineCoreProc:
    """The engine core as a process: requests in over one socket, token ids and stats out over
    the other (text is made in the API server's process: engine/output_processor.py)."""

    def __init__(self, engine: EngineCore, max_queue_len: int | None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.lending = core_lending(engine.config)
        config = engine.config
        self.kv_events = (KVEventPublisher(config.kv_events_config, config.kv_secret)
                          if config.kv_events_config is not None else None)
        if self.kv_events is not None:
            engine.enable_kv_events()  # collected per step, drained in step()

    def handle_add(self, msg: AddRequest) -> Ack:
        ack = self._admit(msg)
        if ack.status != 200 and msg.kv_transfer_params is not None:
            # Refused with a peer's hand-off: that peer frees the KV now, not at its lease's end
            # (a router that does not release it itself, as vLLM's do not).
            self.engine.release_peer_offer(msg.kv_transfer_params)
        return ack

    def _admit(self, msg: AddRequest) -> Ack:
        scheduler = self.engine.scheduler
        if self.max_queue_len is not None and scheduler.num_waiting + msg.params.n > self.max_queue_len:
            return Ack(msg.request_id, 503, f"the server is busy: {scheduler.num_waiting} requests are waiting "
                                            f"(--max-queue-len {self.max_queue_len}); try again later")
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                    kv_transfer_params=msg.kv_transfer_params, cache_salt=msg.cache_salt,
                                    traced=msg.traced)
        except InvalidRequestError as exc:
            return Ack(msg.request_id, 400, str(exc), exc.param)
        except PrefillElsewhere as exc:
            return Ack(msg.request_id, 409, str(exc), "kv_transfer_params.max_local_prefill_tokens")
        except ValueError as exc:
            return Ack(msg.request_id, 400, str(exc))
        except Exception as exc:  # a bug met by one request: that request fails, the core goes on
            logger.exception("admitting request %s failed", msg.request_id)
            self.engine.discard_request(msg.request_id, msg.params.n)
            return Ack(msg.request_id, 500, f"the engine failed to admit the request: {type(exc).__name__}: {exc}")
        return Ack(msg.request_id)

    def step(self) -> list[EngineCoreOutput]:
        outputs = self.engine.step()
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.drain_kv_events())
        return outputs

    def queue_state(self) -> tuple[int, int, int, int]:
        scheduler = self.engine.scheduler
        return (scheduler.num_running, scheduler.num_waiting, len(scheduler.held),
                self.engine.kv_cache_manager.pool.num_free_blocks)

    def stats(self) -> EngineStats:
        """Built once per step that has output (more often is never needed: see _loop), so it
        stays a few microseconds, whatever the blocks held requests have (counted, not listed)."""
        scheduler = self.engine.scheduler
        kv = self.engine.kv_cache_manager
        connector = self.engine.drain_kv_connector_stats()
        return EngineStats(
            kv_blocks_held=sum(kv.num_blocks_of(r) for r in scheduler.held),
            num_waiting_for_remote_kv=scheduler.num_waiting_for_remote_kv, num_held=len(scheduler.held),
            num_tracked_requests=self.engine.num_tracked_requests(),
            kv_transfer_bytes=connector.transfer_bytes, kv_transfer_failures=connector.transfer_failures,
            kv_transfer_seconds=connector.transfer_seconds, kv_auth_failures=connector.auth_failures,
            kv_store={tier: TierStats(**t) for tier, t in connector.stores.items()},
            kv_pulls={peer: PeerPulls(**p) for peer, p in connector.pulls.items()},
            kv_load_decision=self.engine.load_decision(),
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_blocks=kv.num_blocks, num_free_blocks=kv.pool.num_free_blocks,
            num_cached_blocks=kv.pool.num_cached_blocks, kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            num_preemptions=scheduler.stats.num_preemptions)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, max_queue_len: int | None,
                    parent_pid: int, log_level: int = logging.INFO) -> None:
    """Process entry point. Exits when told to, when the parent dies, or when a step fails."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The API server owns Ctrl-C/SIGTERM handling and tells the core to stop over the socket.
    # A SIGTERM sent to the whole process group (`make serve` stopped, `kill -TERM -PGID`, a
    # container stop) reaches the core too: dying of it there and then would cut off the
    # responses the server is draining and skip engine.shutdown(), leaving a prefill's KV
    # socket file (/tmp/engine-kv-PORT.sock) and shm files behind. So it is only noted: the
    # core stops when the server says so, when the server is gone, or TERM_GRACE_S later.
    # While the engine starts (weights, the backend probe, CUDA graphs: up to minutes) a SIGTERM
    # still ends the core at once: there is nothing to drain yet, and an orphan would hold
    # the model's memory until it reached its loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminated: list[float] = []  # when a SIGTERM came (time.monotonic())
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 1000)
    pull.connect(input_addr)
    push.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToCore)
    try:
        try:
            engine = EngineCore(config)
            core = EngineCoreProc(engine, max_queue_len)
            signal.signal(signal.SIGTERM, lambda *_: terminated.append(time.monotonic()))
        except Exception as exc:  # a bad model or flag, a port in use: tell the server why, then exit
            logger.exception("engine failed to start")
            push.send(encoder.encode(EngineDead(f"engine failed to start: {exc}")))
            raise SystemExit(1)
        push.send(encoder.encode(EngineInfo(engine.max_model_len, engine.vocab_size, config.block_size,
                                            engine.runner.num_blocks, engine.fingerprint,
                                            config.max_num_seqs, core.stats(),
                                            *((core.kv_events.endpoint, core.kv_events.replay_endpoint)
                                              if core.kv_events is not None else ()))))
        try:
            _loop(core, pull, push, encoder, decoder, parent_pid, terminated)
        finally:
            if core.kv_events is not None:
                core.kv_events.shutdown()
            engine.shutdown()
    finally:
        pull.close()
        push.close()
        ctx.term()
        remove_ipc_dir(input_addr)  # the server's too, should it have been killed


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _loop(core: EngineCoreProc, pull, push, encoder, decoder, parent_pid: int, terminated: list[float]) -> None:
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    last_stats, last_state, last_trim = 0.0, None, 0.0
    while True:
        busy = core.engine.has_unfinished_requests()
        # Waiting only for remote KV (nothing was scheduled): poll briefly instead of spinning.
        timeout = IDLE_POLL_MS if not busy else (0 if core.engine.last_num_scheduled_tokens else WAIT_POLL_MS)
        while poller.poll(timeout):
            timeout = 0
            try:
                msg = decoder.decode(pull.recv())
            except (msgspec.DecodeError, msgspec.ValidationError):  # never from our API server, which checks
                logger.exception("dropped a message the engine core cannot decode")
                continue
            if isinstance(msg, AddRequest):
                push.send(encoder.encode(core.handle_add(msg)))
            elif isinstance(msg, AbortRequests):
                core.engine.abort_request(msg.request_ids)
            elif isinstance(msg, StopSequences):
                core.engine.stop_sequences(msg.sequence_ids)
            elif isinstance(msg, ReleaseOffer):
                try:
                    core.engine.release_offer(msg.kv_transfer_params)
                except KVTransferParamsError as exc:  # the API server checked; never from it
                    logger.warning("refused a KV release: %s", exc)
            elif isinstance(msg, Shutdown):
                logger.info("engine core shutting down")
                return
        if os.getppid() != parent_pid:
            logger.warning("API server process is gone; engine core exiting")
            return
        if terminated and time.monotonic() - terminated[0] > TERM_GRACE_S:
            logger.warning("engine core got SIGTERM and the API server did not stop it in %.0f s; exiting",
                           TERM_GRACE_S)
            return
        if core.lending is not None:
            # Computing, not merely holding KV for a transfer: only then are the cores in use.
            scheduler = core.engine.scheduler
            try:
                core.lending.before_step(scheduler.num_running + scheduler.num_waiting > 0)
            except Exception:  # placement is an optimisation: never worth the engine
                logger.exception("core lending failed; the engine keeps its own cores")
                core.lending = None
            # On borrowed cores too a whole prompt's step is short: the prefill chunk limit
            # protects the running streams only while this instance computes on its own cores.
            borrowing = core.lending is not None and core.lending.borrowing
            scheduler.long_prefill_token_threshold = 0 if borrowing else core.engine.config.long_prefill_token_threshold
        outputs = []
        # Idle, a step still runs once per stats interval: the connector's counters (a KV
        # server's refusals, bytes a peer pulled) come back only with a step's output.
        stats_due = time.monotonic() - last_stats > STATS_INTERVAL_S
        if core.engine.has_unfinished_requests() or stats_due:
            try:
                outputs = core.step()
            except Exception as exc:
                logger.exception("engine step failed")
                push.send(encoder.encode(EngineDead(f"engine step failed: {type(exc).__name__}: {exc}\n"
                                                    + traceback.format_exc(limit=3))))
                raise SystemExit(1)
        now = time.monotonic()
        # Stats go out with every output, when the queues change, and once a second otherwise:
        # never once per spin while only waiting on a transfer (that flood costs a core).
        state = core.queue_state()
        if outputs or state != last_state or now - last_stats > STATS_INTERVAL_S:
            push.send(encoder.encode(Outputs(outputs, core.stats(), now)))
            last_stats, last_state = now, state
            timeline.mark("core.sent", *(o.req_id for o in outputs))
        # Only now the step's KV offers and tier saves: a prefill's first token never waits on them.
        core.engine.save_kv()
        if not busy and now - last_trim > TRIM_INTERVAL_S:
            # Idle: hand freed heap pages back to the OS, so varied batch shapes do not leave
            # the process's memory fragmented and growing.
            _malloc_trim()
            last_trim = now
