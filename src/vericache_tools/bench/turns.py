"""Methods side by side in one process, taking turns in slices of time, each timed only while it runs
(`--paired`).

On a shared 2-core machine, speed drifts by up to 10% over tens of seconds (memory bandwidth shared with other
machines' jobs: a fixed matrix-vector product of the model's size ran 50-62 ms within one minute), and a whole call
moves with it, so calls run one after another that do the same work differ by up to 10%. Calls that take turns
(every half second, and at every layer's attention until their first token, so a prefill is interleaved too) share
the same drift: two full-cache calls taking turns at every token read 0.986-1.005 of each other.

Only one call runs at a time, and each is timed while it holds the turn. A call passes the turn at the first
token per row its streamer has (a stock step's; VeriCache emits row by row) once it has held the turn for `QUANTUM`
seconds. VeriCache's loop emits between a round's verify pass and its commit, so the timers the cost-aware schedule
prices rounds by never include another call's turn. Taking turns costs each call more than running alone (caches
refill after the other's turn: a fifth more at every token), so a call that ended leaves its partner a stand-in
(the same method again, untimed, stopped when every timed call has ended): no timed call runs its last steps
alone, faster. Only ratios between the calls mean anything.

Each call runs on its own thread, and each such thread (and the main one, which loaded the model) would keep an
OpenMP team while it waits: more teams' threads than cores, and libgomp stops spinning between parallel ops in every
team, which slowed a batch-4 draft step by half (82-86 ms against 53-60) and a full-cache step by a quarter, so a
paired run understated VeriCache (`vericache_hf._threads`). So a thread gives its team back before it waits for the
turn (`release_workers`), as does the main thread before the calls start: only the running call holds a team, as a
call on the main thread alone does.

Turns are slices of time, not single tokens, so that every call pays for refilled caches at the same rate. Passed
at every token, the full-cache partner of a call emitting n tokens a round ran n - 1 steps warm for each cold one
while its partner ran every round cold: at batch 4 and 2k tokens the partners of VeriCache composed with prompt
lookup (more tokens a round) ran 3-15% faster than VeriCache alone's in the same runs, which lowered
the composed method's ratio by as much.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from vericache_hf import release_workers
from vericache_hf.pass_model import attention_layers, pass_model

from .methods import Generation, Method
from .workloads import PromptBatch

#: Seconds a call holds the turn before passing it at its next token: a few decode steps of the embedded model on
#: 2 cores at 2k tokens, and far below the tens of seconds over which the machine's speed drifts.
QUANTUM = 0.5


class TakeTurns:
    """A turn passed around a ring of parties (threads); `held[i]` is the time party i has held it. A party that
    ends leaves the ring, so the others go on alone."""

    def __init__(self, parties: int) -> None:
        self.held = [0.0] * parties
        self._turn, self._since, self._ended, self._timed_ended = 0, 0.0, set(), set()
        self._changed = threading.Condition()

    def timed_ended(self, party: int) -> None:
        """`party`'s timed call has ended (it may go on as a stand-in)."""
        with self._changed:
            self._timed_ended.add(party)

    def all_timed_ended(self) -> bool:
        with self._changed:
            return len(self._timed_ended) == len(self.held)

    def begin(self, party: int) -> None:
        """Wait for `party`'s first turn (party 0 goes first)."""
        with self._changed:
            self._wait(party)

    def pass_turn(self, party: int) -> None:
        """Hand the turn to the next party still running, and wait for it to come back."""
        with self._changed:
            self._hand_on(party)
            self._wait(party)

    def end(self, party: int) -> None:
        with self._changed:
            self._ended.add(party)
            self._hand_on(party)

    def running(self, party: int) -> float:
        """Seconds `party` has held the turn so far, the current turn included (call it while holding it)."""
        return self.held[party] + self.holding()

    def holding(self) -> float:
        """Seconds the current turn has lasted (call it while holding it)."""
        return time.perf_counter() - self._since

    def _wait(self, party: int) -> None:
        self._changed.wait_for(lambda: self._turn == party)
        self._since = time.perf_counter()

    def _hand_on(self, party: int) -> None:
        self.held[party] += time.perf_counter() - self._since
        parties = len(self.held)
        ring = [(party + step) % parties for step in range(1, parties + 1)]
        self._turn = next((p for p in ring if p not in self._ended), party)
        self._changed.notify_all()


class _StandInDone(Exception):
    """Raised into a stand-in call once every timed call has ended."""


class TurnStreamer(BaseStreamer):
    """A call's streamer: the first `put` is the prompt; after that the turn passes when the call has emitted a
    token per row and held the turn for `quantum` seconds. `first_token_seconds` is the call's held time when its
    first token came. A stand-in's streamer stops its call once every timed call has ended."""

    def __init__(
        self, turns: TakeTurns, party: int, rows: int, stand_in: bool = False, quantum: float = QUANTUM
    ) -> None:
        self.turns, self.party, self.rows, self.stand_in = turns, party, rows, stand_in
        self.quantum = quantum
        self.puts = self.tokens = 0
        self.first_token_seconds: float | None = None

    @property
    def before_first_token(self) -> bool:
        return self.puts < 2

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 1:
            return  # the prompt
        if self.first_token_seconds is None:
            self.first_token_seconds = self.turns.running(self.party)
        before, self.tokens = self.tokens, self.tokens + value.numel()
        if self.tokens // self.rows > before // self.rows and self.turns.holding() >= self.quantum:
            self.pass_turn()

    def pass_turn(self) -> None:
        release_workers()  # this thread's OpenMP team, idle until the turn comes back
        self.turns.pass_turn(self.party)
        if self.stand_in and self.turns.all_timed_ended():
            raise _StandInDone

    def end(self) -> None:
        pass


@dataclass
class TurnResult:
    generation: Generation
    seconds: float  # held time, the whole call
    first_token_seconds: float  # held time up to the first token


def run_side_by_side(
    model, methods: Sequence[Method], batch: PromptBatch, max_new_tokens: int, quantum: float = QUANTUM
) -> list[TurnResult]:
    """Run `methods` on `batch` at once, one thread each, taking turns of `quantum` seconds (0: a token per row
    each); the first method goes first. A method that raises lets the others finish, then its error is raised
    here."""
    turns = TakeTurns(len(methods))
    current = threading.local()  # the streamer of the call this thread runs
    results: list[TurnResult | None] = [None] * len(methods)
    errors: list[BaseException] = []

    def between_layers(module, args, output) -> None:  # a prefill is one long pass: take turns in it too
        streamer = getattr(current, "streamer", None)
        if streamer is not None and streamer.before_first_token:
            streamer.pass_turn()

    def run(party: int, method: Method) -> None:
        streamer = current.streamer = TurnStreamer(turns, party, batch.batch_size, quantum=quantum)
        turns.begin(party)
        try:
            with torch.no_grad():  # grad mode is per thread; not inference_mode: see the transfer engine
                generation = method.generate(model, batch, max_new_tokens, streamer=streamer)
                seconds = turns.running(party)
                first = streamer.first_token_seconds
                results[party] = TurnResult(generation, seconds, seconds if first is None else first)
                turns.timed_ended(party)
                while not turns.all_timed_ended():  # stand in for this call while a timed one runs
                    current.streamer = TurnStreamer(
                        turns, party, batch.batch_size, stand_in=True, quantum=quantum
                    )
                    method.generate(model, batch, max_new_tokens, streamer=current.streamer)
        except _StandInDone:
            pass
        except BaseException as error:  # noqa: BLE001 - raised in the caller once every call has ended
            errors.append(error)
        finally:
            turns.timed_ended(party)
            turns.end(party)

    layers = attention_layers(model) + attention_layers(pass_model(model))  # stock calls', VeriCache's passes
    handles = [module.register_forward_hook(between_layers) for module in layers]
    release_workers()  # the main thread's team, idle while the calls run
    try:
        threads = [
            threading.Thread(target=run, args=(party, method), name=f"bench-turn-{party}")
            for party, method in enumerate(methods)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for handle in handles:
            handle.remove()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
