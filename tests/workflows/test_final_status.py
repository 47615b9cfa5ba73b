"""AgentRun._final: a run's final status (its result, or its failure's details) within
what Temporal carries, the task cut before the answer.  Outside a workflow: the status
is given, and its size read with the default converter, as the workflow reads it."""

from __future__ import annotations

import json

import pytest
from temporalio.converter import DataConverter

import workflows.agent_run as ar
from workflows.contract import ChildSummary, RunStatus, Totals

_CONVERTER = DataConverter.default.payload_converter


def _bytes(value: object) -> int:
    return _CONVERTER.to_payloads([value])[0].ByteSize()


class _Run:
    def __init__(self, status: RunStatus) -> None:
        self._status = status

    def status(self) -> RunStatus:
        return self._status


def _status(task: str, answer: str, children: int = 0) -> RunStatus:
    handle = "run-" + "a" * 20
    return RunStatus(
        handle=handle, state="Completed", task=task, model="m",
        service_class="interactive", caller="c", parent=None, root=handle,
        children=[ChildSummary(f"run-{i:020x}", "Completed", Totals(), True)
                  for i in range(children)],
        usage=Totals(), subtree=Totals(), answer=answer,
    )  # fmt: skip


def _final(status: RunStatus) -> RunStatus:
    return ar.AgentRun._final(_Run(status))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _outside_a_workflow(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker's converter, the default, without a workflow to ask for it.
    monkeypatch.setattr(ar.workflow, "payload_converter", lambda: _CONVERTER)


def test_a_status_that_fits_is_left_whole() -> None:
    status = _status("t" * 400_000, "a" * 1_400_000)
    assert _final(status) == status


def test_the_task_is_cut_before_the_answer_by_its_bytes() -> None:
    # A 495 kB task (80,000 CJK characters, 6 bytes each as JSON, then 15,000 ASCII)
    # and a 1.45 MB answer: a cut by the task's average bytes a character left most of
    # it, and cut the answer (helper-167).
    task = "中" * 80_000 + "x" * 15_000
    answer = "y" * 1_450_000
    assert len(json.dumps(task)) <= 500_000  # gateway/mcp_door.PROMPT_MAX_BYTES
    after = _final(_status(task, answer))
    assert _bytes(after) <= ar.RESULT_MAX_BYTES
    assert after.answer == answer
    kept = after.task.index("\n[luftpause: the task, 95,000 characters, is cut here")
    assert task.startswith(after.task[:kept])
    assert _bytes(after) > ar.RESULT_MAX_BYTES - 100  # as much of it as fits


def test_a_status_too_large_without_its_task_cuts_the_answer() -> None:
    # Both uneven, and a run with 1,000 children (MAX_RUN_CHILDREN).
    task = "中" * 80_000 + "x" * 15_000
    answer = "文" * 200_000 + "y" * 700_000
    after = _final(_status(task, answer, children=1000))
    assert _bytes(after) <= ar.RESULT_MAX_BYTES
    assert after.task.startswith("\n[luftpause: the task, 95,000 characters, is cut here")
    assert after.answer is not None and answer.startswith(after.answer.split("\n[")[0])
    assert "[luftpause: the answer, 900,000 characters, is cut here" in after.answer


def test_an_empty_task_does_not_keep_the_answer_from_being_cut() -> None:
    after = _final(_status("", "y" * 2_000_000))
    assert _bytes(after) <= ar.RESULT_MAX_BYTES
    assert after.task == "" and after.answer is not None and after.answer.endswith("carries]")
