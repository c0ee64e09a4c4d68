"""The KV-aware Serve router's load count (entrypoints/ray_serve/call_ledger.py) under generated
sequences of Serve's hooks, in the orders Serve can report them: each request's /tokenize call
(routed before the ingress goes on, its completion late at will), then its generation call,
chosen (again after a rejection or a lost choice), sent to the choice or, when the choice
missed its queue probe, to another replica, accepted (its completion reported before or after
the routing) or rejected. Checked after every step: each replica's load is the generation calls
open there plus the requests' fresh choices not yet routed, whatever the order, once no
/tokenize completion is outstanding; and when every call has completed, nothing is left.
Needs no Ray. CI runs a pinned number of examples; ENGINE_FUZZ_EXAMPLES=N runs more."""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from entrypoints.ray_serve.call_ledger import CHOICE_EXPIRY_S, EARLY_EXPIRY_S, GENERATION, OTHER, CallLedger

REPLICAS = ("a", "b")
EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "1000"))
MAX_REQUESTS = 6  # not done at a time: the other steps work on them


@dataclass
class Request:
    id: str
    tokenize_open_on: str | None = None  # its /tokenize call's completion is not reported yet
    choice: tuple[str, float] | None = None  # (replica, when), until routed, replaced or rejected there
    open_on: str | None = None  # its generation call, accepted and open
    rejected_by: dict[str, float] = field(default_factory=dict)  # replica -> when
    # A generation call was sent where its /tokenize call's completion is still to come: until
    # it comes, a completion there may be taken for the other call's.
    crossed: bool = False
    done: bool = False


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.ledger = CallLedger(clock=lambda: self.now)
        self.requests: list[Request] = []

    def _pick(self, index: int, wanted) -> Request | None:
        matching = [r for r in self.requests if wanted(r)]
        return matching[index % len(matching)] if matching else None

    def _any(self, wanted) -> bool:
        return any(wanted(r) for r in self.requests)

    @precondition(lambda self: sum(not r.done for r in self.requests) < MAX_REQUESTS)
    @rule(replica=st.sampled_from(REPLICAS), tokenized=st.booleans())
    def a_request_arrives(self, replica, tokenized):
        request = Request(f"req-{len(self.requests)}")
        if tokenized:  # routed before the ingress reads the tokens, so before any choice
            self.ledger.routed(request.id, replica, OTHER)
            request.tokenize_open_on = replica
        self.requests.append(request)

    @precondition(lambda self: self._any(lambda r: r.tokenize_open_on))
    @rule(index=st.integers(0, 99))
    def a_tokenize_completion_arrives(self, index):
        request = self._pick(index, lambda r: r.tokenize_open_on)
        if request:
            self.ledger.completed(request.id, request.tokenize_open_on)
            request.tokenize_open_on, request.crossed = None, False

    @precondition(lambda self: self._any(lambda r: not r.done and r.open_on is None))
    @rule(index=st.integers(0, 99), replica=st.sampled_from(REPLICAS))
    def the_router_chooses(self, index, replica):
        request = self._pick(index, lambda r: not r.done and r.open_on is None)
        if request:
            self.ledger.chosen(request.id, replica)
            request.choice = (replica, self.now)

    @precondition(lambda self: self._any(lambda r: r.choice and r.open_on is None))
    @rule(index=st.integers(0, 99), elsewhere=st.sampled_from((None,) + REPLICAS), completion_first=st.booleans(),
          ends_now=st.booleans())
    def serve_sends_and_the_replica_accepts(self, index, elsewhere, completion_first, ends_now):
        request = self._pick(index, lambda r: r.choice and r.open_on is None)
        if request is None:
            return
        sent = elsewhere or request.choice[0]  # elsewhere: the choice missed its queue probe
        if self.now - request.rejected_by.get(sent, -1e9) <= EARLY_EXPIRY_S:
            return  # (the documented blind spot: a retry accepted where a call was just rejected)
        request.choice = None
        request.crossed |= sent == request.tokenize_open_on
        if completion_first:  # a short call: Serve reports its completion before its routing
            self.ledger.completed(request.id, sent)
            self.ledger.routed(request.id, sent, GENERATION)
            request.done = True
        else:
            self.ledger.routed(request.id, sent, GENERATION)
            request.open_on = sent
            if ends_now:
                self.ledger.completed(request.id, sent)
                request.open_on, request.done = None, True

    @precondition(lambda self: self._any(lambda r: r.choice and r.open_on is None))
    @rule(index=st.integers(0, 99), elsewhere=st.sampled_from((None,) + REPLICAS))
    def serve_sends_and_the_replica_rejects(self, index, elsewhere):
        request = self._pick(index, lambda r: r.choice and r.open_on is None)
        if request is None:
            return
        sent = elsewhere or request.choice[0]
        if sent == request.tokenize_open_on:
            return  # (blind spot: its completion would be taken for the /tokenize call's)
        self.ledger.completed(request.id, sent)  # Serve cancels it, then chooses again
        request.rejected_by[sent] = self.now
        if request.choice[0] == sent:
            request.choice = None

    @precondition(lambda self: self._any(lambda r: r.open_on))
    @rule(index=st.integers(0, 99))
    def a_generation_call_completes(self, index):
        request = self._pick(index, lambda r: r.open_on)
        if request:
            self.ledger.completed(request.id, request.open_on)
            request.open_on, request.done = None, True

    @rule(seconds=st.sampled_from((0.5, CHOICE_EXPIRY_S + 0.1, EARLY_EXPIRY_S + 0.1)))
    def time_passes(self, seconds):
        self.now += seconds
        for request in self.requests:
            if request.choice and request.choice[1] < self.now - CHOICE_EXPIRY_S:
                request.choice = None  # a lost choice: the request was cancelled before its send

    def expected(self) -> Counter:
        load = Counter(r.open_on for r in self.requests if r.open_on)
        load.update(r.choice[0] for r in self.requests if r.choice and r.open_on is None)
        return +load

    @precondition(lambda self: not any(r.crossed for r in self.requests))
    @invariant()
    def each_replica_holds_its_generation_calls(self):
        assert +self.ledger.loads() == self.expected()

    def teardown(self):
        # Every call Serve sent completes: then nothing is left, whatever the order was.
        for request in self.requests:
            if request.tokenize_open_on:
                self.ledger.completed(request.id, request.tokenize_open_on)
            if request.open_on:
                self.ledger.completed(request.id, request.open_on)
        self.now += max(CHOICE_EXPIRY_S, EARLY_EXPIRY_S) + 1
        assert not +self.ledger.loads()
        self.ledger.routed("one-more", "a", OTHER)  # (forgets what expired)
        assert not self.ledger._chosen and not self.ledger._completed_early
        assert self.ledger._open == {("one-more", "a"): [OTHER]}


TestCallLedger = LedgerMachine.TestCase
TestCallLedger.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None, derandomize=True)
