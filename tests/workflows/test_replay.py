"""Replay recorded histories against today's `AgentRun`: a change that would break runs
already in flight (a command added, dropped or reordered without `workflow.patched`)
fails here, before it reaches a worker.  The histories come from
`python -m tests.workflows.record_histories` (see there for when to re-record)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from datetime import timedelta
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner

from workflows import AgentRun, contract
from workflows.agent_run import (
    DRAIN_PATCH,
    ENDS_PATCH,
    HALT_UNBROKEN_PATCH,
    HISTORY_ROOM_PATCH,
    LATE_CHILD_PATCH,
    LISTING_PATCH,
    ONCE_PATCH,
    REPORTS_PATCH,
    ROUND_PATCH,
    SIGNAL_ROOM_PATCH,
    SPENT_PATCH,
    TOLD_PATCH,
    TOOLS_BY_FUNCTION_PATCH,
    TURN_SIZE_PATCH,
    UNSENT_STOP_PATCH,
    WITHDRAWN_REASON,
)
from workflows.contract import AgentRunInput

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))
# Recorded after LATE_CHILD_PATCH (and so after every earlier patch).
AFTER_LATE = {"late_child-0", "late_child-1"}
# Recorded after TOOLS_BY_FUNCTION_PATCH (and so after every earlier patch); the
# `late_child_unpatched` ones by the `late_child` scenario at the commit before
# LATE_CHILD_PATCH (c8025d5), as a worker of then would have left them.
UNPATCHED_LATE = {"late_child_unpatched-0", "late_child_unpatched-1"}
# Recorded after HALT_UNBROKEN_PATCH (and so after every earlier patch).
AFTER_UNBROKEN = {"cancelled_while_closing", "unsent_stopped"}
# Recorded after UNSENT_STOP_PATCH, to cover a seconds budget's trip and a run that
# continues as new (each execution's history; only the first three end continued).
AFTER_UNSENT = {"seconds_tripped"} | {f"continued_as_new-{i}" for i in range(4)}
# Recorded after TOLD_PATCH: a repeatable call cut at its timeout, one broken off.
AFTER_TOLD = {"told-0", "told-1"}
# Recorded after TURN_SIZE_PATCH, LISTING_PATCH and the withdraw_child signal: a tool
# loop, and a parent whose started child was withdrawn (cancelled) and the child.
AFTER_SIZED = {"sized_loop", "withdrawn-0", "withdrawn-1"}
# A concurrent round one of whose calls failed the run (its server unreachable for
# test_failed_round.UNREACHED_S) while the fake MCP server held the other: recorded
# after ROUND_PATCH, and (`failed_round_unpatched`) by the same scenario at the commit
# before it (0d66cd0).
FAILED_ROUNDS = {"failed_round", "failed_round_unpatched"}
# Recorded after SIGNAL_ROOM_PATCH (and so after every earlier patch): a parent stopped
# at a (lowered) signal limit, and its child.
AFTER_SIGNALS = {"signals_stopped-0", "signals_stopped-1"} | FAILED_ROUNDS
AFTER_ROOM = {"history_stopped-0", "history_stopped-1"} | AFTER_SIGNALS
AFTER_FUNCTIONS = (
    {"tools_by_function"}
    | UNPATCHED_LATE
    | AFTER_LATE
    | AFTER_UNBROKEN
    | AFTER_UNSENT
    | AFTER_TOLD
    | AFTER_SIZED
    | AFTER_ROOM
)
# Recorded after REPORTS_PATCH (and so after every earlier patch).
AFTER_REPORTS = {"reports_held-0", "reports_held-1", "reports_held-2"} | AFTER_FUNCTIONS
# Recorded after ENDS_PATCH (and so after every earlier patch).
AFTER_ENDS = {
    "answer_over_budget-0",
    "answer_over_budget-1",
    "cancelled_tree_waits-0",
    "cancelled_tree_waits-1",
} | AFTER_REPORTS


def _history(path: Path) -> WorkflowHistory:
    return WorkflowHistory.from_json(path.stem, path.read_text(encoding="utf-8"))


def test_the_recorded_histories_cover_the_run_paths() -> None:
    kinds: set[str] = set()
    for path in HISTORIES:
        kinds |= {e["eventType"] for e in json.loads(path.read_text(encoding="utf-8"))["events"]}
    assert {p.stem.split("-")[0] for p in HISTORIES} >= {
        "tool_loop",
        "parallel_calls",
        "tree_with_approval",
        "budget_tripped",
        "budget_drained",
        "budget_spent",
        "cancelled_tree",
        "once_calls",
        "answer_over_budget",
        "cancelled_tree_waits",
        "reports_held",
        "tools_by_function",
        "late_child",
        "cancelled_while_closing",
        "unsent_stopped",
        "seconds_tripped",
        "continued_as_new",
        "told",
        "failed_round",
    }
    for kind in (
        "ACTIVITY_TASK_COMPLETED",  # LLM turns and tool calls
        "MARKER_RECORDED",  # local activities (list_tools, end_run)
        "WORKFLOW_EXECUTION_UPDATE_ACCEPTED",  # approve / spawn_child
        "START_CHILD_WORKFLOW_EXECUTION_INITIATED",
        "SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED",  # usage reported to the parent
        "WORKFLOW_EXECUTION_CANCEL_REQUESTED",
        "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES",
        "WORKFLOW_EXECUTION_CONTINUED_AS_NEW",
        "TIMER_FIRED",  # a seconds budget's
    ):
        assert f"EVENT_TYPE_{kind}" in kinds, kind


def _patches(path: Path) -> set[str]:
    """The `workflow.patched` ids a history's markers carry."""
    ids = set()
    for event in json.loads(path.read_text(encoding="utf-8"))["events"]:
        marker = event.get("markerRecordedEventAttributes")
        if marker and marker["markerName"] == "core_patch":
            (payload,) = marker["details"]["patch-data"]["payloads"]
            ids.add(json.loads(base64.b64decode(payload["data"]))["id"])
    return ids


def test_histories_from_before_and_after_the_drain_patch_are_both_replayed() -> None:
    # Runs started before DRAIN_PATCH must keep replaying the old stop (cancel in-flight
    # work); runs started after it take the new one (in-flight work finishes).
    after = {p.stem for p in HISTORIES if DRAIN_PATCH in _patches(p)}
    assert (
        after
        == {
            "budget_drained-0",
            "budget_drained-1",
            "budget_drained-2",
            "budget_spent",
            "once_calls",
        }
        | AFTER_ENDS
    )
    assert {"budget_tripped", "cancelled_tree-0"} <= {p.stem for p in HISTORIES} - after


def test_histories_from_before_and_after_the_spent_patch_are_both_replayed() -> None:
    # `budget_tripped` was recorded when a run still made a round its tool-call budget
    # had no room for (its second call tripped it); it must replay that way.
    # `budget_spent` was recorded after: of a round of three, two calls ran.
    after = {p.stem for p in HISTORIES if SPENT_PATCH in _patches(p)}
    assert after == {"budget_spent", "once_calls"} | AFTER_ENDS
    tripped = (Path(__file__).parent / "histories" / "budget_tripped.json").read_text("utf-8")
    assert "budget exceeded: tool_calls 2/1" in tripped


def test_histories_from_before_and_after_the_once_patch_are_both_replayed() -> None:
    # Runs started before ONCE_PATCH retried every tool call (the approved
    # delete_record of tree_with_approval's parent); `once_calls`, recorded after, gives
    # a call of a tool that is not repeatable one attempt.
    after = {p.stem for p in HISTORIES if ONCE_PATCH in _patches(p)}
    assert after == {"once_calls"} | AFTER_ENDS

    def call_tool_attempts(stem: str) -> list[int | None]:
        events = json.loads((HISTORIES[0].parent / f"{stem}.json").read_text("utf-8"))["events"]
        return [
            a["retryPolicy"].get("maximumAttempts")
            for e in events
            if (a := e.get("activityTaskScheduledEventAttributes"))
            and a["activityType"]["name"] == "call_tool"
        ]

    assert call_tool_attempts("once_calls") == [1]
    assert call_tool_attempts("tree_with_approval-0") == [None]  # retried without limit


def test_histories_from_before_and_after_the_ends_patch_are_both_replayed() -> None:
    # After ENDS_PATCH: `answer_over_budget`, whose holder's answer trips its budget,
    # and `cancelled_tree_waits`, whose cancelled parent waits (a timer) for its child
    # to end; `cancelled_tree` (before) closed at once.
    after = {p.stem for p in HISTORIES if ENDS_PATCH in _patches(p)}
    assert after == AFTER_ENDS
    holder = (HISTORIES[0].parent / "answer_over_budget-0.json").read_text("utf-8")
    assert '"BudgetExceeded"' in holder
    waits = (HISTORIES[0].parent / "cancelled_tree_waits-0.json").read_text("utf-8")
    before = (HISTORIES[0].parent / "cancelled_tree-0.json").read_text("utf-8")
    assert "EVENT_TYPE_TIMER_STARTED" in waits and "EVENT_TYPE_TIMER_STARTED" not in before


def test_histories_from_before_and_after_the_reports_patch_are_both_replayed() -> None:
    # After REPORTS_PATCH (`reports_held`), a run under no budget holds back reports of
    # totals alone (a timer, cancelled at its next change of state): a kid of three tool
    # calls reports twice, where `tree_with_approval`'s kids of two reported each change.
    assert {p.stem for p in HISTORIES if REPORTS_PATCH in _patches(p)} == AFTER_REPORTS

    def events(stem: str) -> list[str]:
        path = HISTORIES[0].parent / f"{stem}.json"
        return [e["eventType"] for e in json.loads(path.read_text("utf-8"))["events"]]

    sent = "EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED"
    assert "EVENT_TYPE_TIMER_STARTED" in events("reports_held-1")  # the mid
    assert events("reports_held-2").count(sent) == 2  # the kid: its first change, its end
    assert events("tree_with_approval-1").count(sent) > 2


def test_histories_from_before_and_after_the_tools_by_function_patch_are_both_replayed() -> None:
    # Before TOOLS_BY_FUNCTION_PATCH a run's tools and approvals were chosen by the
    # tools' own names only (`tree_with_approval`'s parent asks approval of
    # delete_record that way); after it, by function name too.
    # (`continued_as_new-3`, the last execution, lists no tools (they are carried) and
    # calls none: it never reaches the marker.)
    assert {p.stem for p in HISTORIES if TOOLS_BY_FUNCTION_PATCH in _patches(p)} == (
        AFTER_FUNCTIONS - {"continued_as_new-3"}
    )


def test_histories_from_before_and_after_the_late_child_patch_are_both_replayed() -> None:
    # The same race, a spawn and a cancel taken in one workflow task, before and after
    # LATE_CHILD_PATCH.  Before it, the parent's close did not stop the child that
    # finished starting meanwhile, and the child ran to its end (four turns, three tool
    # calls); after it, the parent cancels it (and the marker is only in the parent).
    assert {p.stem for p in HISTORIES if LATE_CHILD_PATCH in _patches(p)} == {"late_child-0"}

    def events(stem: str) -> list[str]:
        path = HISTORIES[0].parent / f"{stem}.json"
        return [e["eventType"] for e in json.loads(path.read_text("utf-8"))["events"]]

    cancel = "EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED"
    assert events("late_child-0").count(cancel) == 1
    assert events("late_child-1")[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED"
    assert events("late_child_unpatched-0").count(cancel) == 0
    assert events("late_child_unpatched-1")[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"


def test_a_close_cancelled_midway_is_recorded_after_its_patch() -> None:
    # HALT_UNBROKEN_PATCH: a failing run cancelled while its close stops its children
    # still stops every child and reports its end; no history before it has the marker
    # (the old close replays unchanged).
    # (Runs that close after it carry it too: a seconds budget's trip, a withdrawn child.)
    assert {p.stem for p in HISTORIES if HALT_UNBROKEN_PATCH in _patches(p)} == (
        AFTER_UNBROKEN | {"seconds_tripped", "withdrawn-1"} | AFTER_ROOM
    )
    path = HISTORIES[0].parent / "cancelled_while_closing.json"
    kinds = [e["eventType"] for e in json.loads(path.read_text("utf-8"))["events"]]
    requested = kinds.index("EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED")
    cancel = "EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED"
    assert 0 < kinds[:requested].count(cancel) < kinds.count(cancel)  # mid-close
    assert kinds[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"


def test_a_call_not_sent_again_after_a_stop_is_recorded_after_its_patch() -> None:
    # UNSENT_STOP_PATCH: the marker is where a never-sent call is to be sent again; only
    # `unsent_stopped` got that far, and there the stop answered the call.
    assert {p.stem for p in HISTORIES if UNSENT_STOP_PATCH in _patches(p)} == {"unsent_stopped"}
    path = HISTORIES[0].parent / "unsent_stopped.json"
    kinds = [e["eventType"] for e in json.loads(path.read_text("utf-8"))["events"]]
    assert kinds[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"  # budget exceeded


def test_a_failed_round_is_recorded_before_and_after_its_patch() -> None:
    # ROUND_PATCH: the marker is where a call fails the run while others of its round are
    # still going; after it the run cancels them (the held lookup), before it left them.
    assert {p.stem for p in HISTORIES if ROUND_PATCH in _patches(p)} == {"failed_round"}
    requested = "EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED"
    for stem, cancels in (("failed_round", 1), ("failed_round_unpatched", 0)):
        path = HISTORIES[0].parent / f"{stem}.json"
        kinds = [e["eventType"] for e in json.loads(path.read_text("utf-8"))["events"]]
        assert kinds.count(requested) == cancels, stem
        assert kinds[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED", stem


def _payloads(tree: Any) -> Iterator[bytes]:
    """Every payload's data in a history's events, decoded."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "data" and isinstance(value, str):
                yield base64.b64decode(value)
            else:
                yield from _payloads(value)
    elif isinstance(tree, list):
        for item in tree:
            yield from _payloads(item)


def test_a_call_told_to_the_model_is_recorded_after_its_patch() -> None:
    # TOLD_PATCH: every history before it sends its tool calls the old way (Temporal's
    # retries for a repeatable tool); `told` has the marker, and both its runs end
    # completed, the model told of the call with no answer (not sent again after a cut,
    # after TOOL_SENDS sends when it broke off).
    # (`sized_loop`, recorded after, calls tools too.)
    assert {p.stem for p in HISTORIES if TOLD_PATCH in _patches(p)} == (
        AFTER_TOLD | {"sized_loop"} | FAILED_ROUNDS
    )
    told = (
        ("told-0", 1, b"tool 'hang' gave no answer within 0.5 s"),
        ("told-1", 3, b"no answer came back from tool 'breaks'"),
    )
    for stem, sends, said in told:
        events = json.loads((HISTORIES[0].parent / f"{stem}.json").read_text("utf-8"))["events"]
        kinds = [e["eventType"] for e in events]
        assert kinds[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"
        calls = [
            e
            for e in events
            if e.get("activityTaskScheduledEventAttributes", {}).get("activityType", {}).get("name")
            == "call_tool"
        ]
        assert len(calls) == sends, stem
        assert any(said in data for data in _payloads(events)), stem


def test_the_size_and_listing_patches_and_a_withdrawal_are_recorded() -> None:
    # TURN_SIZE_PATCH and LISTING_PATCH: every history before them takes the old paths;
    # the three after carry both markers.  `withdrawn-0` has the withdrawal, and stopped
    # and cancelled its child, which ended cancelled with the reason.
    for patch in (TURN_SIZE_PATCH, LISTING_PATCH):
        assert {p.stem for p in HISTORIES if patch in _patches(p)} == AFTER_SIZED | AFTER_ROOM
    events = json.loads((HISTORIES[0].parent / "withdrawn-0.json").read_text("utf-8"))["events"]
    signals = [
        e["workflowExecutionSignaledEventAttributes"]["signalName"]
        for e in events
        if "workflowExecutionSignaledEventAttributes" in e
    ]
    assert "withdraw_child" in signals
    kinds = [e["eventType"] for e in events]
    assert "EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED" in kinds
    path = HISTORIES[0].parent / "withdrawn-1.json"
    (*_, end) = json.loads(path.read_text("utf-8"))["events"]
    failure = end["workflowExecutionFailedEventAttributes"]["failure"]  # (its status: Cancelled)
    assert failure["message"] == WITHDRAWN_REASON


def test_a_stop_at_the_history_limit_is_recorded_after_its_patch() -> None:
    # HISTORY_ROOM_PATCH: no history before it has the marker; after it, a parent whose
    # history reached the limit stopped its child and ended, the child with its reason.
    assert {p.stem for p in HISTORIES if HISTORY_ROOM_PATCH in _patches(p)} == AFTER_ROOM
    # SIGNAL_ROOM_PATCH: the same at the signal limit.
    assert {p.stem for p in HISTORIES if SIGNAL_ROOM_PATCH in _patches(p)} == AFTER_SIGNALS
    for scenario in ("history_stopped", "signals_stopped"):
        ends = []
        for i in (0, 1):
            path = HISTORIES[0].parent / f"{scenario}-{i}.json"
            events = json.loads(path.read_text("utf-8"))["events"]
            end = events[-1]["workflowExecutionFailedEventAttributes"]["failure"]["message"]
            ends.append(end)
        assert ends[0] == ends[1] and ends[0].endswith("its tree stops, as on a budget")


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_a_recorded_history_replays(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A run replays only with the limits it ran with: a history stopped at a lowered
    # HISTORY_STOP_EVENTS says the value in its reason.
    (*_, end) = json.loads(path.read_text("utf-8"))["events"]
    failure = end.get("workflowExecutionFailedEventAttributes", {}).get("failure", {})
    lowered = re.search(r"Temporal history reached [\d,]+ events, its limit ([\d,]+)",
                        failure.get("message", ""))  # fmt: skip
    if lowered:
        monkeypatch.setattr(contract, "HISTORY_STOP_EVENTS", int(lowered[1].replace(",", "")))
    signals = re.search(r"signals \(its children's reports\), its limit ([\d,]+)",
                        failure.get("message", ""))  # fmt: skip
    if signals:
        monkeypatch.setattr(contract, "SIGNAL_STOP", int(signals[1].replace(",", "")))
    if path.stem in FAILED_ROUNDS:
        # Failed by an unreachable window lowered to this.  (Imported here, not at the
        # top: the sandbox re-imports this module to check `_ChangedAgentRun`, and
        # refuses what that module imports.)
        from tests.workflows.test_failed_round import UNREACHED_S

        monkeypatch.setattr(contract, "TOOL_UNREACHED_S", UNREACHED_S)
    result = await Replayer(workflows=[AgentRun]).replay_workflow(
        _history(path), raise_on_replay_failure=False
    )
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"


@workflow.defn(name="AgentRun")
class _ChangedAgentRun:
    """What an unguarded change looks like: the same workflow type, other commands."""

    @workflow.run
    async def run(self, inp: AgentRunInput) -> None:
        await workflow.sleep(timedelta(seconds=1))


async def test_a_changed_workflow_does_not_replay() -> None:
    result = await Replayer(workflows=[_ChangedAgentRun]).replay_workflow(
        _history(HISTORIES[0]), raise_on_replay_failure=False
    )
    assert result.replay_failure is not None
    assert "nondetermin" in str(result.replay_failure).lower()


# What a run's sandbox may import afresh of this project's packages: AgentRun's module,
# whose state and checks the sandbox keeps per run, and its package, which Python
# imports first.  Anything else of ours is passed through (workflows/__init__.py,
# agent_run.py): executing `workflows.runs` afresh in every run's sandbox was a third
# of the sandbox's start (helper-247).
OURS = {"workflows", "activities", "scheduler", "gateway", "luftpause", "testkit", "worker"}


async def test_a_run_imports_afresh_only_its_own_module(monkeypatch: pytest.MonkeyPatch) -> None:
    executed: list[str] = []
    exec_module = SourceFileLoader.exec_module

    def recorded(loader: SourceFileLoader, module: ModuleType) -> None:
        executed.append(module.__name__)
        exec_module(loader, module)

    monkeypatch.setattr(SourceFileLoader, "exec_module", recorded)
    result = await Replayer(workflows=[AgentRun]).replay_workflow(
        _history(HISTORIES[0]), raise_on_replay_failure=False
    )
    assert result.replay_failure is None, result.replay_failure
    ours = [name for name in executed if name.partition(".")[0] in OURS]
    # Once when the Replayer checks the workflow, once for the replayed run.
    assert sorted(ours) == sorted(["workflows", "workflows.agent_run"] * 2), ours


@pytest.mark.parametrize(
    ("stem", "budgeted"),
    [
        ("tree_with_approval-0", False),  # a root under no budget, 12 reports from below
        ("budget_drained-0", True),  # a tool_calls budget
        ("answer_over_budget-0", True),  # a tokens budget
    ],
)
async def test_a_report_sums_the_subtree_only_for_a_budget_that_reads_it(
    stem: str, budgeted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `_over` runs on every report and every child's end; the subtree it sums adds every
    # child, so a root with 1,000 children under no budget summed some 10^6 of them over
    # its life, and again on every replay (helper-257).  Replayed outside the sandbox,
    # so that the counters below see the calls.
    calls = {"over": 0, "summed": 0}
    inside: list[bool] = []  # [True] while `_over` runs
    over, subtree = AgentRun._over, AgentRun.subtree

    def counted_over(self: AgentRun) -> str | None:
        calls["over"] += 1
        inside.append(True)
        try:
            return over(self)
        finally:
            inside.pop()

    def counted_subtree(self: AgentRun) -> contract.Totals:
        calls["summed"] += bool(inside)
        return subtree(self)

    monkeypatch.setattr(AgentRun, "_over", counted_over)
    monkeypatch.setattr(AgentRun, "subtree", counted_subtree)
    result = await Replayer(
        workflows=[AgentRun], workflow_runner=UnsandboxedWorkflowRunner()
    ).replay_workflow(_history(HISTORIES[0].parent / f"{stem}.json"), raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure
    assert calls["over"] > 1
    assert calls["summed"] == (calls["over"] if budgeted else 0), calls
