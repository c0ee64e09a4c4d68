"""The API server's handle on the engine-core process: start it, send requests, stream back.

One background task reads everything the core sends and routes it: acks to the waiting add,
stats to `stats`, and the token ids of each step through the front end's output processor
(engine/output_processor.py: text, stop strings, logprob tokens) to each request's queue, as
deltas; stop strings found there are sent back to the core at once. If the core dies, every
request in flight gets an error and `dead` is set.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.ipc import (IPC_DIR_PREFIX, AbortRequests, Ack, AddRequest, EngineDead, EngineInfo, EngineStats,
                        FromCore, Outputs, ReleaseOffer, Shutdown, StopSequences, remove_ipc_dir,
                        remove_stale_ipc_dirs)
from engine.kv_transfer.params import KVTransferParams
from engine.output_processor import IterationStats, OutputKind, OutputProcessor
from engine.outputs import RequestOutput
from engine.request_trace import SequenceTrace
from engine.sampling_params import SamplingParams

logger = logging.getLogger("engine.client")


def _run_engine_core(*args) -> None:
    # The engine-core process's entry point. engine.core (torch, the model code) is imported
    # there only: the server process needs none of it.
    from engine.core import run_engine_core
    run_engine_core(*args)


# (token_id, logprob, rank, decoded token) with the sampled token first.
LogprobEntry = tuple[int, float, int, str]


class ChoiceDelta(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[list[LogprobEntry]] | None = None
    text_offset: int = 0  # logprobs' text_offset of its first token (engine/outputs.py)
    token_ids_shown: int = 0  # lead token_ids the client already saw (engine/outputs.py)


class RequestDelta(msgspec.Struct):
    """What a request's stream yields: the new text and tokens of each of its sequences."""
    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    queue_time: float | None = None
    # Per prompt token (None for the first) its entry, sampled-first order (once per stream).
    prompt_logprobs: list[list[LogprobEntry] | None] | None = None
    traces: dict[int, SequenceTrace] | None = None  # a traced request's, by sequence index

    @classmethod
    def of(cls, out: RequestOutput) -> RequestDelta:
        def entries(entry: dict) -> list[LogprobEntry]:
            return [(tid, lp.logprob, lp.rank, lp.decoded_token or "") for tid, lp in entry.items()]

        choices = []
        for c in out.outputs:
            logprobs = None if c.logprobs is None else [entries(entry) for entry in c.logprobs]
            choices.append(ChoiceDelta(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, logprobs,
                                       c.text_offset, c.token_ids_shown))
        prompt_logprobs = (None if out.prompt_logprobs is None else
                           [None if entry is None else entries(entry) for entry in out.prompt_logprobs])
        return cls(out.request_id, choices, out.finished, out.num_cached_tokens, out.kv_transfer_params,
                   out.error, out.queue_time, prompt_logprobs, out.traces)


class EngineRequestError(Exception):
    """The engine refused or failed a request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class EngineDeadError(EngineRequestError):
    def __init__(self, message: str) -> None:
        super().__init__(503, message)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, max_queue_len: int | None = None) -> None:
        """set_tokenizer() must come before the first request: the front end's text needs it."""
        self.config = config
        self.processor: OutputProcessor | None = None
        self.max_queue_len = max_queue_len
        self.info: EngineInfo | None = None
        self.stats = EngineStats()
        self.dead: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._acks: dict[str, asyncio.Future] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self._process: multiprocessing.Process | None = None
        self._reader: asyncio.Task | None = None
        self.on_dead = None  # callback(str), e.g. to stop the HTTP server
        self._closed = False
        self.on_stats = None  # callback(EngineStats) for every stats message
        # callback(IterationStats) for what the front end measured of requests (output_processor)
        self.on_request_stats = None
        self._ctx: zmq.asyncio.Context | None = None
        self._push = self._pull = None
        self._ipc_dir: str | None = None

    def set_tokenizer(self, tokenizer) -> None:
        self.processor = OutputProcessor(tokenizer, self.config.kv_secret)

    async def start(self, timeout: float = 600.0) -> EngineInfo:
        try:
            return await self._start(timeout)
        except BaseException:
            try:
                await self.shutdown()  # a core that failed to start leaves no process or socket behind
            except Exception:
                logger.exception("cleaning up after a failed start")  # the start's error is the one to raise
            raise

    async def _start(self, timeout: float) -> EngineInfo:
        self._ctx = zmq.asyncio.Context()
        # A private (0700) directory: only this user's processes can reach the core's sockets.
        # Removed by shutdown(), and by the core when it exits (in case this process was killed).
        remove_stale_ipc_dirs()
        self._ipc_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        input_addr, output_addr = f"ipc://{self._ipc_dir}/in", f"ipc://{self._ipc_dir}/out"
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        for sock in (self._push, self._pull):
            sock.setsockopt(zmq.LINGER, 0)
        self._push.bind(input_addr)
        self._pull.bind(output_addr)
        self._process = multiprocessing.get_context("spawn").Process(
            target=_run_engine_core, name="engine-core", daemon=True,
            args=(self.config, input_addr, output_addr, self.max_queue_len, os.getpid(), logging.getLogger().level))
        self._process.start()
        deadline = time.monotonic() + timeout
        while True:
            if await self._pull.poll(timeout=500):
                msg = self._decoder.decode(await self._pull.recv())
                if isinstance(msg, EngineInfo):
                    self.info = msg
                    if msg.stats is not None:
                        self.stats = msg.stats
                    break
                if isinstance(msg, EngineDead):
                    raise RuntimeError(msg.error)
            if not self._process.is_alive():
                raise RuntimeError(f"engine core exited with code {self._process.exitcode} during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine core not ready after {timeout:.0f}s")
        self._reader = asyncio.create_task(self._read_loop())
        return self.info

    async def _read_loop(self) -> None:
        try:
            while True:
                if not await self._pull.poll(timeout=1000):
                    if self._process is not None and not self._process.is_alive():
                        self._set_dead(f"engine core exited unexpectedly (code {self._process.exitcode})")
                        return
                    continue
                msg = self._decoder.decode(await self._pull.recv())
                if isinstance(msg, Outputs):
                    self.stats = msg.stats
                    if self.on_stats is not None:
                        self.on_stats(msg.stats)
                    self._route(msg)
                elif isinstance(msg, Ack):
                    future = self._acks.pop(msg.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(msg)
                elif isinstance(msg, EngineDead):
                    self._set_dead(msg.error)
                    return
        except asyncio.CancelledError:
            pass

    def _route(self, msg: Outputs) -> None:
        if not msg.outputs:
            return  # stats only (an idle core's)
        processed = self.processor.process(msg.outputs, msg.timestamp or None)
        self._report(processed.stats)
        if processed.stop:
            self._push.send(self._encoder.encode(StopSequences(processed.stop)))
        if processed.abort:
            self._push.send(self._encoder.encode(AbortRequests(processed.abort)))
        for out in processed.outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(RequestDelta.of(out))

    def _report(self, stats: IterationStats) -> None:
        if stats and self.on_request_stats is not None:
            try:
                self.on_request_stats(stats)
            except Exception:  # metrics never cost a request its answer
                logger.exception("recording request metrics failed")

    def _set_dead(self, error: str) -> None:
        logger.error("engine core is dead: %s", error)
        self.dead = error
        # In-flight requests fail with 500; new ones get 503 from add_request.
        failure = EngineRequestError(500, f"engine error: {error.splitlines()[0]}")
        for future in self._acks.values():
            if not future.done():
                future.set_exception(failure)
        for queue in self._queues.values():
            queue.put_nowait(failure)
        if self.on_dead is not None:
            self.on_dead(error)

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          kv_transfer_params: KVTransferParams | None = None,
                          first_tokens_shown: bool = False, cache_salt: str | None = None,
                          traced: bool = False, arrival: float | None = None) -> "RequestStream":
        """Queue a request and wait for the engine to accept it (raises EngineRequestError
        with the HTTP status when it refuses). The caller must close() the stream. ``traced``: the
        deltas carry the core's record of its phases (RequestDelta.traces). ``arrival``:
        time.monotonic() when the request reached the server (its latencies start there)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine error: {self.dead.splitlines()[0]}")
        if request_id in self._queues:
            raise EngineRequestError(400, f"request id {request_id!r} is already in use", "request_id")
        try:
            message = self._encoder.encode(AddRequest(request_id, prompt_token_ids, params, time.time(),
                                                      kv_transfer_params, cache_salt, traced))
        except (OverflowError, TypeError, ValueError) as exc:  # validated upstream; a last line of defence
            raise EngineRequestError(400, f"the request cannot be passed to the engine: {exc}") from None
        # Registered before the core can answer: its first outputs may come with the ack.
        try:
            self.processor.add_request(request_id, None, prompt_token_ids, params, OutputKind.DELTA,
                                       first_tokens_shown, arrival)
        except InvalidRequestError as exc:  # its id collides with a live request's sequence
            raise EngineRequestError(400, str(exc), exc.param) from None
        stream = RequestStream(self, request_id)
        ack: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queues[request_id] = stream.queue
        self._acks[request_id] = ack
        try:
            await self._push.send(message)
            answer: Ack = await ack
        except BaseException:
            stream.close()
            raise
        if answer.status != 200:
            stream.finished = True  # refused: nothing to abort
            stream.close()
            raise EngineRequestError(answer.status, answer.message or "refused", answer.param)
        return stream

    def _release(self, request_id: str, client_left: bool = False) -> None:
        self._queues.pop(request_id, None)
        self._acks.pop(request_id, None)
        self._report(self.processor.abort(request_id, client_left))

    def release_offer(self, params: KVTransferParams) -> None:
        """Frees a hand-off's KV that its router will not use (the core checks the signature
        again before it acts)."""
        if self.dead is None:
            self._push.send(self._encoder.encode(ReleaseOffer(params)))

    def abort(self, request_ids: list[str]) -> None:
        # Not awaited: this runs in `finally` blocks of cancelled tasks; zmq queues the frame.
        self._push.send(self._encoder.encode(AbortRequests(request_ids)))

    @property
    def engine_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        process = self._process
        try:
            if process is not None and process.is_alive():
                try:
                    await asyncio.wait_for(self._push.send(self._encoder.encode(Shutdown())), 1.0)
                except (asyncio.TimeoutError, zmq.ZMQError):
                    pass
                deadline = time.monotonic() + timeout
                while process.is_alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
        finally:  # also when interrupted while waiting (a second Ctrl-C): nothing is left behind
            if process is not None and process.is_alive():
                logger.warning("engine core did not stop in %.0fs; killing it", timeout)
                process.kill()
            if process is not None:
                process.join(1)
            for sock in (self._push, self._pull):
                if sock is not None:
                    sock.close(linger=0)
            if self._ctx is not None:
                self._ctx.term()
            if self._ipc_dir is not None:
                remove_ipc_dir(f"ipc://{self._ipc_dir}/in")


class RequestStream:
    """Deltas of one request, in order, ending with the finished one. close() is idempotent
    and aborts the request in the engine if it has not finished (a client went away)."""

    def __init__(self, client: AsyncEngineClient, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._closed = False
        self.on_stats = None  # callback(EngineStats) for every stats message

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        client_left = not self.finished and self.client.dead is None
        self.client._release(self.request_id, client_left)
        if client_left:
            self.client.abort([self.request_id])
