"""The KV-aware Serve router's load count (entrypoints/ray_serve/call_ledger.py) under generated
sequences of what Serve reports, in the orders it can report them: each request's /tokenize
call (its completion late at will), then its generation calls: chosen (again while no probe
answers, and after a rejection), sent to the choice, to another replica (the choice missed its
queue probe) or to a replica chosen for another request, and completed in any order, a
rejected call's completion after its retry's send too. Checked after every step: each
replica's load is the generation calls sent there and not completed plus the requests' fresh
choices not sent yet (a request choosing again does not see its own), once no /tokenize
completion is outstanding where a generation call of its request completed; and when every
call has completed, nothing is left. Needs no Ray. CI runs a pinned number of examples;
ENGINE_FUZZ_EXAMPLES=N runs more."""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from entrypoints.ray_serve.call_ledger import CHOICE_EXPIRY_S, GENERATION, OTHER, CallLedger

REPLICAS = ("a", "b")
EXAMPLES = int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "1000"))
MAX_REQUESTS = 6  # not answered at a time: the other steps work on them


@dataclass
class Request:
    id: str
    tokenize_on: str | None = None  # its /tokenize call's completion is not reported yet
    choice: tuple[str, float] | None = None  # (replica, when), until sent, replaced or expired
    sent_to: list[str] = field(default_factory=list)  # its generation calls not completed
    # A generation call completed where its /tokenize call's completion is still to come: the
    # ledger took it for the /tokenize call's until that comes.
    crossed: bool = False
    answered: bool = False


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

    @precondition(lambda self: sum(not r.answered for r in self.requests) < MAX_REQUESTS)
    @rule(replica=st.sampled_from(REPLICAS), tokenized=st.booleans())
    def a_request_arrives(self, replica, tokenized):
        request = Request(f"req-{len(self.requests)}")
        if tokenized:  # sent, and answered, before the ingress goes on to its generation call
            self.ledger.sent(request.id, replica, OTHER)
            request.tokenize_on = replica
        self.requests.append(request)

    @precondition(lambda self: self._any(lambda r: r.tokenize_on))
    @rule(index=st.integers(0, 99))
    def a_tokenize_completion_arrives(self, index):
        request = self._pick(index, lambda r: r.tokenize_on)
        self.ledger.completed(request.id, request.tokenize_on)
        request.tokenize_on, request.crossed = None, False

    @precondition(lambda self: self._any(lambda r: not r.answered))
    @rule(index=st.integers(0, 99), replica=st.sampled_from(REPLICAS))
    def the_router_chooses(self, index, replica):
        request = self._pick(index, lambda r: not r.answered)
        if not any(r.crossed for r in self.requests):
            assert +self.ledger.loads(excluding=request.id) == self.expected(excluding=request)
        self.ledger.chosen(request.id, replica)
        request.choice = (replica, self.now)

    @precondition(lambda self: self._any(lambda r: not r.answered))
    @rule(index=st.integers(0, 99), elsewhere=st.sampled_from((None,) + REPLICAS))
    def serve_sends(self, index, elsewhere):
        """To the choice; or elsewhere: the choice missed its probe, or the replica was chosen
        for another request (Serve hands a found replica to the oldest request waiting)."""
        request = self._pick(index, lambda r: not r.answered)
        sent = elsewhere or (request.choice[0] if request.choice else REPLICAS[0])
        self.ledger.sent(request.id, sent, GENERATION)
        request.choice = None
        request.sent_to.append(sent)

    @precondition(lambda self: self._any(lambda r: r.sent_to))
    @rule(index=st.integers(0, 99), which=st.integers(0, 9), answered=st.booleans())
    def a_generation_call_completes(self, index, which, answered):
        """Answered, failed or cancelled (the request is done), or rejected (it goes on)."""
        request = self._pick(index, lambda r: r.sent_to)
        replica = request.sent_to.pop(which % len(request.sent_to))
        self.ledger.completed(request.id, replica)
        request.crossed |= replica == request.tokenize_on
        if answered and request.choice is None:  # (a request chosen again had its calls rejected)
            request.answered = True

    @rule(seconds=st.sampled_from((0.5, CHOICE_EXPIRY_S + 0.1)))
    def time_passes(self, seconds):
        self.now += seconds
        for request in self.requests:
            if request.choice and request.choice[1] < self.now - CHOICE_EXPIRY_S:
                request.choice = None  # a lost choice: the request was cancelled, or its replica went to another

    def expected(self, excluding: Request | None = None) -> Counter:
        load = Counter(replica for r in self.requests for replica in r.sent_to)
        load.update(r.choice[0] for r in self.requests if r.choice and r is not excluding)
        return +load

    @precondition(lambda self: not any(r.crossed for r in self.requests))
    @invariant()
    def each_replica_holds_its_generation_calls(self):
        assert +self.ledger.loads() == self.expected()

    def teardown(self):
        # Every call Serve sent completes: then nothing is left, whatever the order was.
        for request in self.requests:
            if request.tokenize_on:
                self.ledger.completed(request.id, request.tokenize_on)
            for replica in request.sent_to:
                self.ledger.completed(request.id, replica)
        self.now += CHOICE_EXPIRY_S + 1
        assert not +self.ledger.loads()
        assert not self.ledger._chosen and not self.ledger._open


TestCallLedger = LedgerMachine.TestCase
TestCallLedger.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None, derandomize=True)
