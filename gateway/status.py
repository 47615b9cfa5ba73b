"""`GET /status` and `GET /`: what the admission shell sees, as JSON and as a small HTML
page.  `status_snapshot` is a pure function of the core's `State`, the last probe
results and the shell's own counts, so it is tested without HTTP; it reads every held
turn and every run once (O(turns + runs)), which is fine for a status call.
"""

from __future__ import annotations

import heapq
import html
from collections.abc import Container, Mapping, Sequence
from typing import Any

from gateway.prober import ProbeResult
from scheduler import RunPhase, RunState, ServiceClass, State, TurnState

__all__ = [
    "RUNS_LIMIT",
    "RUNS_MAX",
    "TOP_CALLERS",
    "WAITING",
    "claims_of",
    "render_status_page",
    "run_view",
    "runs_listing",
    "status_snapshot",
    "waiting_view",
]

# GET /v1/runs: this many runs by default, at most RUNS_MAX.
RUNS_LIMIT = 100
RUNS_MAX = 1000
# The phase GET /v1/runs gives a run none of whose turns was admitted yet.
WAITING = "waiting"

# The held-turn table lists the callers with the most held turns, at most this many.
TOP_CALLERS = 50
PAGE_REFRESH_S = 2
PAGE_RUNS = 20  # the runs the page lists (GET /v1/runs lists them all)
_MAX_TREE_DEPTH = 16


def status_snapshot(
    state: State,
    probes: Mapping[str, ProbeResult],
    shell_counts: Mapping[str, int],
    now: float,
) -> dict[str, Any]:
    """The `/status` document: replicas, held turns by class and caller, runs by phase
    and class, plus the shell's counts (e.g. `tool_call_ids_remembered`) at top level."""
    replicas = []
    for name in sorted(state.replicas.keys()):
        r = state.replicas[name]
        probe = probes.get(name)
        kv_limit = state.kv_limit(name)
        batch_limit = state.kv_limit(name, ServiceClass.BATCH)
        # the runs' claims, and the prefix their models' runs share, once
        working_set = r.ws_tokens + state.shared_once(name) if r.ws_tokens else 0
        replicas.append(
            {
                "name": name,
                "healthy": r.healthy,
                # gone from the pool (a reload): finishing its turns, then forgotten
                "retired": name in state.retired,
                "probe_error": probe.error if probe is not None else None,
                # out of rotation this long yet: its engine failed turns in a row (rule 10)
                "ejected_s": (
                    round(max(0.0, r.ejected_until - now), 1)
                    if r.ejected_until is not None
                    else None
                ),
                "failures_in_a_row": r.failures,
                # (none for a retired one: unprobed, its last reading is stale)
                "engine_queued": None if name in state.retired else r.queued,
                "engine_running": None if name in state.retired else r.running,
                "cap": r.cap,
                # the requests its engine runs at once (configured or reported): no
                # more turns than these are in flight there (rule 2)
                "slots": r.spec.slots,
                "in_flight": r.in_flight,
                "paused_interactive": r.paused_interactive,
                "bound_runs": r.bound_runs,
                "kv_working_set_tokens": working_set,
                "kv_limit_tokens": int(kv_limit) if kv_limit is not None else None,
                # new batch runs stop here (lower on an interactive lane, rule 9)
                "kv_batch_limit_tokens": int(batch_limit) if batch_limit is not None else None,
                "interactive_lane": (
                    state.policy.lane_batch_kv_fill is not None and r.interactive_runs > 0
                ),
                # the GPU it shares, and the replica there that takes the device's new
                # runs while this one takes none and drains (rule 13)
                "device": r.spec.device,
                "led_by": state.led_by(name),
            }
        )

    by_class = {c.value: 0 for c in ServiceClass}
    class_earliest: dict[str, float] = {}
    # caller -> [held turns, earliest arrival]
    callers: dict[str, list[Any]] = {}
    total = 0
    earliest: float | None = None
    waiting: dict[str, str] = {}  # runs known only by held turns (WAITING) -> class
    known = state.runs
    for t in state.held():
        total += 1
        by_class[t.service_class.value] += 1
        if t.run_id not in known:
            waiting.setdefault(t.run_id, t.service_class.value)
        cls = t.service_class.value
        if cls not in class_earliest or t.arrived < class_earliest[cls]:
            class_earliest[cls] = t.arrived
        entry = callers.get(t.caller)
        if entry is None:
            callers[t.caller] = [1, t.arrived]
        else:
            entry[0] += 1
            entry[1] = min(entry[1], t.arrived)
        if earliest is None or t.arrived < earliest:
            earliest = t.arrived
    top = heapq.nsmallest(TOP_CALLERS, callers.items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[0]))
    by_caller = [
        {
            "caller": caller,
            "held": held,
            "in_flight": state.caller_in_flight(caller),
            "oldest_wait_s": _wait(now, arrived),
        }
        for caller, (held, arrived) in top
    ]

    runs = {p: {c.value: 0 for c in ServiceClass} for p in (*(p.value for p in RunPhase), WAITING)}
    for run in state.runs.values():
        runs[run.phase.value][run.service_class.value] += 1
    for cls in waiting.values():  # as GET /v1/runs lists them
        runs[WAITING][cls] += 1

    return {
        "replicas": replicas,
        "held": {
            "total": total,
            "by_class": by_class,
            "oldest_wait_by_class_s": {
                c.value: _wait(now, class_earliest[c.value]) if c.value in class_earliest else 0.0
                for c in ServiceClass
            },
            "callers": len(callers),  # with held turns; by_caller lists the top TOP_CALLERS
            "by_caller": by_caller,
            "oldest_wait_s": _wait(now, earliest) if earliest is not None else 0.0,
        },
        "runs": {"by_phase_and_class": runs, "total": len(state.runs) + len(waiting)},
        # Per model: engine count / the gateway's estimate of a prompt, as learned
        # (Policy.learn_prompt_scale); a model not listed is taken at its estimate.
        "prompt_scale": {m: round(s, 3) for m, s in sorted(state.prompt_scale.items())},
        # The prefix each model's runs share, in tokens (Policy.learn_shared_prefix):
        # program-level admission counts it once per replica, not once per run.
        "shared_prefix": {m: v[0] for m, v in sorted(state.shared_prefixes.items())},
        **shell_counts,
    }


def run_view(
    run: RunState, now: float, known: Container[str], held: int = 0, turn_claims: int = 0
) -> dict[str, Any]:
    """One run as GET /v1/runs shows it: what the core knows of it.  `known`: the
    replicas the core knows (an idle run's last one may be forgotten since).
    `turn_claims`: the KV its running turns claim by themselves (`claims_of`)."""
    return {
        "run_id": run.run_id,
        "caller": run.caller,
        "class": run.service_class.value,
        "model": run.model,
        "phase": run.phase.value,
        # its last turn's replica: where it goes back to while generating or paused
        "replica": run.replica if run.replica in known else None,
        "turns_in_flight": run.in_flight,
        "turns_held": held,
        "context_tokens": run.context_tokens,  # prompt + reply of its last turn
        # Counted against the pools now: its claim on its replica, and what its turns
        # claim by themselves (a turn away, or a reply beside a later turn: rules 3, 6).
        "kv_claim_tokens": run.ws_claim + turn_claims,
        "since_s": _wait(now, run.last_active),  # in this phase for so long
    }


def waiting_view(turns: list[TurnState], now: float) -> dict[str, Any]:
    """A run the core does not know yet: its first turns are held."""
    t = turns[0]
    return {
        "run_id": t.run_id,
        "caller": t.caller,
        "class": t.service_class.value,
        "model": t.model,
        "phase": WAITING,
        "replica": None,
        "turns_in_flight": 0,
        "turns_held": len(turns),
        "context_tokens": 0,
        "kv_claim_tokens": 0,
        "since_s": _wait(now, min(x.arrived for x in turns)),
    }


def _callers(found: RunState | list[TurnState]) -> set[str]:
    """Whose a run is: its caller; a run known by its held turns only, theirs (one
    caller, as gateway.app.owns has it, or it is no one caller's alone)."""
    if isinstance(found, RunState):
        return {found.caller}
    return {t.caller for t in found}


def runs_listing(
    state: State,
    now: float,
    *,
    caller: str | None = None,
    phase: str | None = None,
    service_class: ServiceClass | None = None,
    limit: int = RUNS_LIMIT,
) -> dict[str, Any]:
    """GET /v1/runs: the runs luftpause knows (proxied and sub-agents' alike), the most
    recently active first, filtered by caller, phase (a RunPhase or WAITING) and
    class; `total` counts every match.  One walk over the runs and held turns."""
    held: dict[str, list[TurnState]] = {}
    claims: dict[str, int] = {}
    for t in state.turns.values():
        if t.replica is None:
            held.setdefault(t.run_id, []).append(t)
        elif t.claim:
            claims[t.run_id] = claims.get(t.run_id, 0) + t.claim
    # (last activity, run id, caller, class, phase, the run or its held turns)
    found: list[tuple[float, str, str, ServiceClass, str, RunState | list[TurnState]]] = [
        (run.last_active, run_id, run.caller, run.service_class, run.phase.value, run)
        for run_id, run in state.runs.items()
    ]
    found += [
        (
            max(t.arrived for t in turns),
            run_id,
            turns[0].caller,
            turns[0].service_class,
            WAITING,
            turns,
        )
        for run_id, turns in held.items()
        if run_id not in state.runs
    ]
    found = [
        f
        for f in found
        if (caller is None or _callers(f[5]) == {caller})
        and (service_class is None or f[3] is service_class)
        and (phase is None or f[4] == phase)
    ]
    views = [
        run_view(x, now, state.replicas, len(held.get(run_id, ())), claims.get(run_id, 0))
        if isinstance(x, RunState)
        else waiting_view(x, now)
        for _, run_id, _, _, _, x in heapq.nlargest(limit, found, key=lambda f: (f[0], f[1]))
    ]
    return {"runs": views, "total": len(found), "limit": limit}


def claims_of(state: State, run_id: str) -> int:
    """The KV a run's running turns claim by themselves (one walk over the turns: the
    core keeps no index of a run's admitted turns)."""
    return sum(t.claim for t in state.turns.values() if t.claim and t.run_id == run_id)


def _wait(now: float, arrived: float) -> float:
    return round(max(0.0, now - arrived), 3)


# --------------------------------------------------------------------------- the page

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
"""


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    return f"<td>{html.escape(text)}</td>"


def _table(headers: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    if not rows:
        body = f'<tr><td colspan="{len(headers)}">none</td></tr>'
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def sub_agent_tree(statuses: Sequence[Any]) -> list[dict[str, Any]]:
    """Recent sub-agent runs (`workflows.RunStatus`) as trees, roots first, each with
    its subtree's costs: the JSON of `/status` and the table of `/`."""
    by_handle = {s.handle: s for s in statuses}

    def node(s: Any, depth: int) -> dict[str, Any]:
        sub = s.subtree
        pending = s.pending_approval
        return {
            "handle": s.handle,
            "depth": depth,
            "state": s.state,
            "caller": s.caller,
            "model": s.model,
            "turns": sub.turns,
            "tool_calls": sub.tool_calls,
            "failed_tool_calls": sub.failed_tool_calls,
            "tokens": sub.prompt_tokens + sub.completion_tokens,
            "turn_seconds": round(sub.turn_seconds, 2),
            "tool_seconds": round(sub.tool_seconds, 2),
            "note": (
                f"waits for approval of {pending.described}"
                if pending is not None
                else s.error or ""
            ),
            "children": [
                node(by_handle[c.handle], depth + 1)
                for c in s.children
                if c.handle in by_handle and depth < _MAX_TREE_DEPTH
            ],
        }

    roots = [s for s in statuses if s.parent is None or s.parent not in by_handle]
    return [node(s, 0) for s in roots]


def _tree_rows(nodes: Sequence[Mapping[str, Any]]) -> list[list[object]]:
    rows: list[list[object]] = []
    for n in nodes:
        label = ("\u00a0\u00a0" * n["depth"]) + ("\u21b3 " if n["depth"] else "") + n["handle"]
        rows.append(
            [
                label,
                n["state"],
                n["caller"],
                n["turns"],
                f"{n['tool_calls']} ({n['failed_tool_calls']} failed)",
                n["tokens"],
                n["turn_seconds"],
                n["tool_seconds"],
                n["note"],
            ]
        )
        rows += _tree_rows(n["children"])
    return rows


def _sub_agents(snapshot: Mapping[str, Any]) -> str:
    tree = snapshot.get("sub_agents")
    if tree is None:
        return ""
    if isinstance(tree, str):  # why the runs could not be read
        return f"<h2>Sub-agent runs</h2><p>{html.escape(tree)}</p>"
    headers = [
        "run (subtree costs)",
        "state",
        "caller",
        "turns",
        "tool calls",
        "tokens",
        "turn s",
        "tool s",
        "",
    ]
    return f"<h2>Sub-agent runs (recent)</h2>{_table(headers, _tree_rows(tree))}"


def _discovery(snapshot: Mapping[str, Any]) -> str:
    found = snapshot.get("discovery")
    if not found:
        return ""
    keys = ["host", "engines", "answered_s_ago", "error"]
    rows = [[name, *(f.get(k) for k in keys)] for name, f in found.items()]
    for row in rows:
        row[2] = ", ".join(row[2])
    return f"<h2>Engines found by name</h2>{_table(['endpoint', *keys], rows)}"


def render_status_page(snapshot: Mapping[str, Any]) -> str:
    """The snapshot as a self-contained HTML page that reloads itself every 2 s; every
    value is escaped (callers are whatever clients sent)."""
    replica_keys = [
        "name",
        "healthy",
        "retired",
        "probe_error",
        "ejected_s",
        "failures_in_a_row",
        "engine_queued",
        "engine_running",
        "cap",
        "slots",
        "in_flight",
        "paused_interactive",
        "bound_runs",
        "kv_working_set_tokens",
        "kv_limit_tokens",
        "kv_batch_limit_tokens",
        "interactive_lane",
    ]
    replicas = _table(replica_keys, [[r[k] for k in replica_keys] for r in snapshot["replicas"]])
    held = snapshot["held"]
    classes = [c.value for c in ServiceClass]
    held_by_class = _table(
        ["class", "held", "oldest_wait_s"],
        [[c, held["by_class"].get(c, 0), held["oldest_wait_by_class_s"][c]] for c in classes],
    )
    n = held["callers"]
    part = f" (the {TOP_CALLERS} with the most, of {n})" if n > TOP_CALLERS else ""
    held_by_caller = _table(
        ["caller", "held", "in_flight", "oldest_wait_s"],
        [[c["caller"], c["held"], c["in_flight"], c["oldest_wait_s"]] for c in held["by_caller"]],
    )
    runs = snapshot["runs"]
    runs_table = _table(
        ["phase", *classes],
        [[p, *(n.get(c, 0) for c in classes)] for p, n in runs["by_phase_and_class"].items()],
    )
    run_keys = [
        "run_id",
        "caller",
        "class",
        "model",
        "phase",
        "replica",
        "turns_in_flight",
        "turns_held",
        "context_tokens",
        "kv_claim_tokens",
        "since_s",
    ]
    recent = snapshot.get("recent_runs")
    recent_table = (
        ""
        if recent is None
        else f"<h2>Runs, the most recently active first (top {PAGE_RUNS}; all: "
        f"GET /v1/runs)</h2>{_table(run_keys, [[r[k] for k in run_keys] for r in recent])}"
    )
    summary = (
        f"held {held['total']} (oldest {held['oldest_wait_s']} s), runs {runs['total']}, "
        f"tool call ids remembered {snapshot.get('tool_call_ids_remembered', 0)}"
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{PAGE_REFRESH_S}">'
        "<title>luftpause status</title>"
        f"<style>{_STYLE}</style></head><body>"
        "<h1>luftpause</h1>"
        f"<p>{html.escape(summary)}</p>"
        f"<h2>Replicas</h2>{replicas}"
        f"{_discovery(snapshot)}"
        f"<h2>Held turns by class</h2>{held_by_class}"
        f"<h2>Held turns by caller{part}</h2>{held_by_caller}"
        f"<h2>Runs by phase and class</h2>{runs_table}"
        f"{recent_table}"
        f"{_sub_agents(snapshot)}"
        "</body></html>\n"
    )
