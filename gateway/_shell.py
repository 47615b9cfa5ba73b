"""The admission shell: holds the core's `State`, applies events through `decide` and
carries out its actions.

Rule: every `apply` runs `decide` and executes all of its actions synchronously — no
await in between — so on one asyncio loop no other event can interleave with a
decision.  `Admit` and `Reject` resolve the future of the held turn; `Forget` drops
the tool call ids the proxy remembers for the run.  An observer (the metrics, and the
runs' trace spans) is then told the state before, the event and the actions, in the
same synchronous step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from scheduler import (
    Action,
    Admit,
    Drained,
    Ejected,
    Event,
    Forget,
    Reject,
    State,
    TurnArrived,
    decide,
)

__all__ = [
    "TOOL_CALL_MEMORY_S",
    "Admission",
    "AdmissionShell",
    "Awaited",
    "Observer",
    "Rejected",
]

log = logging.getLogger(__name__)

# How long a tool call id returned to a client still identifies its run.
TOOL_CALL_MEMORY_S = 1800.0


@dataclass(frozen=True, slots=True)
class Rejected:
    """The core answered the turn itself: status and message for the client."""

    status: int
    message: str
    # A 503's Retry-After when it is not the next probe round's (None): for a model
    # whose engines are discovered and none is up, the next discovery round's.
    retry_after: str | None = None


@dataclass(frozen=True, slots=True)
class Awaited:
    """Why a model of discovered endpoints has no engine now (`Pool.awaited`), and
    when to come back: its next discovery round (a name that resolves to engines then
    is probed at once)."""

    message: str
    retry_after: str


Admission = str | Rejected
"""What a held turn's future resolves to: the replica's name, or a rejection."""


def as_answered(
    rejected: Rejected, model: str, awaited: Callable[[str], Awaited | None]
) -> Rejected:
    """The core's refusal as the client is answered (and counted): its 404 for a model
    no replica serves is a 503, to be retried, when the model's endpoints are
    discovered and none has an engine now (`awaited`: `Pool.awaited`)."""
    if rejected.status == 404 and (why := awaited(model)) is not None:
        return Rejected(503, why.message, why.retry_after)
    return rejected


Observer = Callable[[State, Event, Sequence[Action]], None]
"""Told of every decision after its actions ran: (state before, event, actions)."""


class AdmissionShell:
    """The scheduler core in the gateway process, with the turns waiting on it."""

    def __init__(
        self,
        state: State,
        *,
        observer: Observer | None = None,
        why_down: Callable[[str], str | None] = lambda replica: None,
    ) -> None:
        self._state = state
        self._observer = observer
        # Why a replica is unhealthy (its last probe's reason; None: it is not), said
        # in the core's 503 for a model whose replicas are all down.
        self._why_down = why_down
        # The turns whose handlers wait to be admitted: turn id -> (its future, run id,
        # caller); and run id -> caller -> how many, so that whose a run known only by
        # its held turns is costs no walk over every held turn.
        self._waiting: dict[str, tuple[asyncio.Future[Admission], str, str]] = {}
        self._waiting_runs: dict[str, dict[str, int]] = {}
        # (caller, tool_call_id) -> (run id, or None once two runs returned it; expiry);
        # run id -> its keys, for Forget
        self._tool_calls: dict[tuple[str, str], tuple[str | None, float]] = {}
        self._run_tool_calls: dict[str, set[tuple[str, str]]] = {}

    @property
    def state(self) -> State:
        return self._state

    def apply(self, event: Event) -> None:
        """Decide on one event and carry out its actions, synchronously."""
        before = self._state
        self._state, actions = decide(before, event)
        for action in actions:
            if isinstance(action, Admit):
                self._resolve(action.turn_id, action.replica)
            elif isinstance(action, Reject):
                message = action.message
                said = [f"{n}: {why}" for n in action.down if (why := self._why_down(n))]
                if said:
                    message = f"{message}; {'; '.join(said)}"
                self._resolve(action.turn_id, Rejected(action.status, message))
            elif isinstance(action, Forget):
                self._forget(action.run_id)
            elif isinstance(action, Ejected):
                log.warning(
                    "replica %s: its engine failed %d turns in a row; out of rotation for "
                    "%g s (its runs may move)",
                    action.replica,
                    action.failures,
                    round(action.until - event.now, 1),
                )
        if self._observer is not None:
            try:
                self._observer(before, event, actions)
            except Exception:  # metrics must never break admission
                log.exception("observer failed on %r", event)

    def arrive(self, event: TurnArrived) -> asyncio.Future[Admission]:
        """Report a turn; the future resolves when the core admits or rejects it
        (possibly already done on return)."""
        future: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._waiting[event.turn_id] = (future, event.run_id, event.caller)
        by_caller = self._waiting_runs.setdefault(event.run_id, {})
        by_caller[event.caller] = by_caller.get(event.caller, 0) + 1
        try:
            self.apply(event)
        except BaseException:
            self._unwait(event.turn_id)
            raise
        return future

    def drain(self, now: float, message: str) -> int:
        """The gateway is stopping: every turn held now is answered 503 `message` at
        once, instead of waiting out the shutdown's grace for a slot and being cut at
        its end, and so is every turn that arrives from now on, slot free or not (the
        core's rule 14: it admits nothing more).  Turns admitted already go on.
        Returns how many were held."""
        held = self._state.held_count()
        self.apply(Drained(now=now, message=message))
        return held

    def turn_timeout(self, turn_id: str) -> float:
        """How long an admitted turn may go without a sign of life before the core frees
        its slot: the policy's turn_timeout_s at its admission (a reload changes it for
        turns admitted later).  The gateway waits for its engine as long."""
        t = self._state.turns.get(turn_id)
        if t is not None and t.replica is not None:
            return t.timeout_s
        return self._state.policy.turn_timeout_s

    def forget_turn(self, turn_id: str) -> None:
        """The turn's handler no longer waits (its terminal event was reported)."""
        self._unwait(turn_id)

    def callers_of(self, run_id: str) -> frozenset[str]:
        """Whose run `run_id` is: the caller the core knows it by, or (a run known only
        by held turns) the callers of those turns; none for a run the core does not
        know."""
        run = self._state.runs.get(run_id)
        if run is not None:
            return frozenset((run.caller,))
        return frozenset(self._waiting_runs.get(run_id, ()))

    def _unwait(self, turn_id: str) -> asyncio.Future[Admission] | None:
        waiting = self._waiting.pop(turn_id, None)
        if waiting is None:
            return None
        future, run_id, caller = waiting
        by_caller = self._waiting_runs[run_id]
        by_caller[caller] -= 1
        if not by_caller[caller]:
            del by_caller[caller]
            if not by_caller:
                del self._waiting_runs[run_id]
        return future

    def _resolve(self, turn_id: str, outcome: Admission) -> None:
        future = self._unwait(turn_id)
        if future is None or future.done():
            log.warning("no handler waits for turn %s (%r)", turn_id, outcome)
            return
        future.set_result(outcome)

    # ------------------------------------------------------------- tool call ids

    def remember_tool_calls(self, run_id: str, caller: str, ids: Iterable[str], now: float) -> None:
        """Tool call ids returned to a caller: their echo identifies the run.

        An id is a caller's: another caller echoing it is not this run.  An id that a
        second run of the same caller is given while the first still holds it (parsers
        that number calls, e.g. Kimi-K2's `functions.<name>:<n>`, give every run the
        same ids) names neither run until it expires: a turn that echoes only such ids
        is a run of its own, never a turn of somebody else's run."""
        expiry = now + TOOL_CALL_MEMORY_S
        for call_id in ids:
            key = (caller, call_id)
            previous = self._tool_calls.get(key)
            owner: str | None = run_id
            if previous is not None and previous[0] != run_id:
                if previous[0] is not None:
                    self._run_tool_calls.get(previous[0], set()).discard(key)
                if previous[1] > now:
                    owner = None
            self._tool_calls[key] = (owner, expiry)
            if owner is not None:
                self._run_tool_calls.setdefault(owner, set()).add(key)

    def run_for_tool_calls(self, caller: str, ids: Iterable[str], now: float) -> str | None:
        """The caller's run that returned any of these tool call ids, if still
        remembered and returned to that run alone."""
        for call_id in ids:
            known = self._tool_calls.get((caller, call_id))
            if known is not None and known[0] is not None and known[1] > now:
                return known[0]
        return None

    def sweep_tool_calls(self, now: float) -> None:
        """Drop tool call ids older than `TOOL_CALL_MEMORY_S`."""
        expired = [key for key, (_, expiry) in self._tool_calls.items() if expiry <= now]
        for key in expired:
            run_id, _ = self._tool_calls.pop(key)
            if run_id is None:  # an ambiguous id: nobody's
                continue
            ids = self._run_tool_calls.get(run_id)
            if ids is not None:
                ids.discard(key)
                if not ids:
                    del self._run_tool_calls[run_id]

    def remembered_tool_calls(self) -> int:
        return len(self._tool_calls)

    def _forget(self, run_id: str) -> None:
        for key in self._run_tool_calls.pop(run_id, set()):
            self._tool_calls.pop(key, None)
