"""The pool the gateway serves, and changing it without a restart.

A `Pool` is everything the gateway derives from the configuration's endpoints: the
replicas turns go to, the models they serve, the classifiers, which replicas lack an
API.  The gateway holds one at a time and replaces it whole when the file is reloaded
(`SIGHUP`, or `POST /reload`), so a request sees one pool from start to end.

What a reload may change, and what it may not:

- `[[endpoints]]` entries may be added, removed, and changed in place (models, KV pool,
  slots, health path, key variable, which APIs it serves, a router's engines).  The core is told
  the new pool (`scheduler.PoolChanged`, rule 11): an added replica takes turns once a
  probe finds it healthy (the reload probes at once); a removed one finishes the turns
  it runs, and its runs move at their next turn.
- An endpoint's `url`, `kind` and `api_path` may not change under the same name: that is
  another engine, whose cache holds none of the runs bound to the name.  Remove the old
  name and add the new engine under a new one (a Kubernetes pod name does this).  This
  holds too for a name removed earlier whose turns are still finishing.
- `[policy]` applies to the core at once (`scheduler.PolicyChanged`, rule 12): to the
  turns held and the runs known as well as to what comes next (its `turn_timeout_s`
  to the turns admitted from then on, those held across the reload included: a turn
  keeps the one it was admitted with, as its engine wait does).  `[probes]`
  applies from the next probe round, `[discovery]` from its next round (the reload
  resolves the names it gives at once).  Both are listed in `applied`.
- Every other section (`[temporal]`, the token, tool servers, request limits) is read
  at start only.  A reload that finds one changed applies the rest and says which
  sections need a restart (`not_applied`).

A file that does not load, or changes what may not change, changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway._shell import Awaited
from gateway.discovery import Found
from luftpause.config import Api, Config, ConfigError, Endpoint

__all__ = ["RELOADED", "Pool", "PoolChange", "compare"]

# What names an engine: changed under the same name, it is another engine.
_IDENTITY = ("url", "kind", "api_path")
# The sections and settings besides the endpoints that a reload applies.
RELOADED = ("policy", "probes", "discovery", "session_runs")


@dataclass(frozen=True, slots=True)
class Pool:
    file: Config  # as the file says it, discovered endpoints unexpanded
    config: Config  # the file with each discovered endpoint's replicas (Config.expanded)
    found: Mapping[str, Found]  # per discovered endpoint: what its name resolved to
    # Models that only discovered endpoints with no engine now serve: their turns are
    # answered 503 (retry), not 404, by endpoint names.
    awaiting: Mapping[str, tuple[str, ...]]
    replicas: Mapping[str, Endpoint]  # the endpoints turns go to (Config.replicas)
    # In the file's order: the first is the default model of `spawn`, `run` and
    # `/v1/decide` ("the pool's first"), which an operator picks by where it stands.
    models: tuple[str, ...]
    classifiers: tuple[Endpoint, ...]
    # Per API other than Chat Completions, per model: its replicas that do not serve it
    # (a turn may be placed on any replica of its model, so such a model is refused).
    lacking: Mapping[Api, Mapping[str, list[str]]]
    # The kind of engine that answers each replica's turns: its own, or a router's
    # engines' when those it reports the load of (`load_from`) are all of one kind
    # ("router" otherwise).  It says how the answers read: SGLang's Anthropic usage
    # counts cached tokens in `input_tokens` (the others' are net of the cache), vLLM
    # sends a stream's usage unless the client asks it not to.
    answered_by: Mapping[str, str]

    @classmethod
    def of(cls, file: Config, found: Mapping[str, Found] | None = None) -> Pool:
        found = found or {}
        config = file.expanded({name: f.engines for name, f in found.items()})
        replicas = {e.name: e for e in config.replicas}
        models = tuple(dict.fromkeys(m for e in replicas.values() for m in e.models))
        awaiting: dict[str, tuple[str, ...]] = {}
        # Discovered endpoints with no engine now (they take turns: Config allows no
        # other).  Their APIs still decide what a turn for their models may be.
        empty = [e for e in file.discovered if not (e.name in found and found[e.name].engines)]
        for e in empty:
            for m in e.models:
                if m not in models:
                    awaiting[m] = (*awaiting.get(m, ()), e.name)
        by_name = {e.name: e for e in config.endpoints}
        return cls(
            file=file,
            config=config,
            found=dict(found),
            awaiting=awaiting,
            replicas=replicas,
            models=models,
            classifiers=tuple(e for e in config.endpoints if not e.generative),
            lacking={
                api: {
                    m: [
                        e.name
                        for e in (*replicas.values(), *empty)
                        if m in e.models and not e.serves(api)
                    ]
                    for m in (*models, *awaiting)
                }
                for api in ("messages", "responses")
            },
            answered_by={e.name: _answered_by(e, by_name) for e in replicas.values()},
        )

    @property
    def offered(self) -> tuple[str, ...]:
        """The models served and those awaiting their engines, in the file's order:
        `/v1/models`, what a sub-agent or `/v1/decide` may ask for (a turn for an
        awaited one is told to come back), the first the default, whether its
        engines are up or not."""
        return tuple(dict.fromkeys(m for e in self.file.replicas for m in e.models))

    def awaited(self, model: str) -> Awaited | None:
        """Why a model of discovered endpoints has no engine now (None: it has one, or
        is not theirs): a turn for it is answered 503, to be retried."""
        names = self.awaiting.get(model)
        if not names:
            return None
        why = []
        for name in names:
            f = self.found.get(name)
            if f is None or f.resolved_at is None:
                said = f.error if f is not None and f.error else "not resolved yet"
                why.append(f"endpoint {name}: {said}")
            else:
                why.append(f"endpoint {name}: {f.host} resolves to no engine")
        return Awaited(
            f"model '{model}' has no engine now: its endpoints are discovered by name "
            f"(discover) and none was found ({'; '.join(why)}); retry later",
            str(math.ceil(self.file.discovery.period_s)),
        )


@dataclass(frozen=True, slots=True)
class PoolChange:
    """What a reload did: the answer of `POST /reload`, and its log line."""

    added: tuple[str, ...]  # endpoints new in the file
    removed: tuple[str, ...]  # endpoints gone from it (replicas: retired, rule 11)
    changed: tuple[str, ...]  # endpoints changed in place, or in or out of the replicas
    applied: tuple[str, ...]  # other sections that changed and apply now (RELOADED)
    not_applied: tuple[str, ...]  # other sections that changed: they need a restart

    def as_json(self) -> dict[str, Any]:
        return {
            "added": list(self.added),
            "removed": list(self.removed),
            "changed": list(self.changed),
            "applied": list(self.applied),
            "not_applied": list(self.not_applied),
        }

    def __str__(self) -> str:
        parts = [
            f"{what} {', '.join(names)}"
            for what, names in (
                ("added", self.added),
                ("removed", self.removed),
                ("changed", self.changed),
            )
            if names
        ]
        said = "; ".join(parts) or "no endpoint changed"
        if self.applied:
            said += f"; applied {', '.join(f'[{k}]' for k in self.applied)}"
        if self.not_applied:
            later = ", ".join(self.not_applied)
            said += f" (changed but read at start only, restart to apply: {later})"
        return said


def compare(
    old: Config,
    new: Config,
    known: Mapping[str, Endpoint] | None = None,
    started: Config | None = None,
) -> PoolChange:
    """What reloading `new` over `old` changes; what a reload does not apply is told
    against `started` (the configuration the process started with, by default `old`),
    since that is what it still runs.  Raises ConfigError, naming each one,
    when an endpoint would change what names its engine: against `old`, or against
    `known` for a replica removed earlier that the core still knows (its runs would
    come back to a name whose engine holds none of their cache)."""
    before = {e.name: e for e in old.endpoints}
    after = {e.name: e for e in new.endpoints}
    # Runs are bound to replicas' names only: a classifier, or an engine a router stands
    # in front of, may move to another URL (helper-157: refused, as if it held runs).
    serving_before = {e.name for e in old.replicas}
    serving_after = {e.name for e in new.replicas}
    engines = {**(known or {}), **{n: e for n, e in before.items() if n in serving_before}}
    renamed = [
        f"endpoint {name}: {field} {getattr(engines[name], field)!r} -> {getattr(e, field)!r}"
        for name, e in after.items()
        if name in engines and name in serving_after
        for field in _IDENTITY
        if getattr(engines[name], field) != getattr(e, field)
    ]
    if renamed:
        raise ConfigError(
            "nothing was reloaded: an endpoint's url, kind and api_path name its engine, "
            "and another engine does not hold the runs bound to the name; remove the old "
            "name and add the new engine under a new one (" + "; ".join(renamed) + ")"
        )
    rest_old = old.model_dump(exclude={"endpoints"})
    rest_new = new.model_dump(exclude={"endpoints"})
    rest_started = rest_old if started is None else started.model_dump(exclude={"endpoints"})
    return PoolChange(
        added=tuple(n for n in after if n not in before),
        removed=tuple(n for n in before if n not in after),
        # (Also an endpoint that leaves or joins the replicas as its entry stays: moved
        # behind a router, or from behind one: its turns end there, or begin.)
        changed=tuple(
            n
            for n in after
            if n in before
            and (before[n] != after[n] or (n in serving_before) != (n in serving_after))
        ),
        applied=tuple(k for k in rest_new if k in RELOADED and rest_new[k] != rest_old.get(k)),
        not_applied=tuple(
            k for k in rest_new if k not in RELOADED and rest_new[k] != rest_started.get(k)
        ),
    )


def _answered_by(e: Endpoint, by_name: Mapping[str, Endpoint]) -> str:
    """The kind of engine that answers `e`'s turns (see Pool.answered_by)."""
    kinds = {by_name[n].kind for n in e.load_from}
    return kinds.pop() if len(kinds) == 1 else e.kind
