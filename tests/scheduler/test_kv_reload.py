"""Reloads that give, change and take out a replica's `kv_tokens` (c6a4c94): at every
step each replica's pool size is the file's, or, where the file gives none, its
engine's first report since the file stopped giving one.  (The property tests keep
one `kv` for a whole example, so no pool change there gives and then drops it;
written by helper-116.)"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from scheduler import Action, Event, PoolChanged, ReplicaProbed
from tests.scheduler.test_properties import Runner, initial, interleave, ops, policies
from tests.scheduler.test_properties import replays_and_drains as replay_and_drain


class KvRunner(Runner):
    """A Runner whose pool changes each carry their own `kv_tokens` (op[3])."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.kv_expected: dict[str, int | None] = {
            n: r.spec.kv_tokens for n, r in self.state.replicas.items()
        }
        self.kv_given = {n for n, r in self.state.replicas.items() if r.spec.kv_tokens is not None}

    def event(self, op: tuple[Any, ...]) -> Event | None:
        if op[0] == "pool":
            self.kv = op[3]
            return super().event(op[:3])
        return super().event(op)

    def apply(self, event: Event) -> list[Action]:
        before = self.state
        actions = super().apply(event)
        reported = isinstance(event, ReplicaProbed) and event.replica not in before.retired
        if reported and event.kv_tokens and self.kv_expected.get(event.replica) is None:
            self.kv_expected[event.replica] = event.kv_tokens  # taken once
        if isinstance(event, PoolChanged):
            for r in event.replicas:
                if r.kv_tokens is not None:
                    self.kv_expected[r.name] = r.kv_tokens
                    self.kv_given.add(r.name)
                elif r.name in self.kv_given or r.name not in before.replicas:
                    self.kv_expected[r.name] = None  # the file's is gone: asked again
                    self.kv_given.discard(r.name)
        for name in [n for n in self.kv_expected if n not in self.state.replicas]:
            del self.kv_expected[name]
            self.kv_given.discard(name)
        for name, r in self.state.replicas.items():
            assert r.spec.kv_tokens == self.kv_expected.get(name), (name, r.spec.kv_tokens)
        return actions


changes = st.lists(
    st.tuples(
        st.integers(0, 120),
        st.integers(0, 31),
        st.booleans(),
        st.booleans(),
        st.sampled_from([None, 3000, 8000]),
    ),
    min_size=1,
    max_size=6,
)


@given(
    policy=policies,
    kv=st.sampled_from([None, 8000, 20000]),
    script=st.lists(ops, min_size=30, max_size=120),
    changes=changes,
)
def test_a_pool_size_the_file_gives_then_takes_out_is_the_engines_again(
    policy: Any, kv: int | None, script: list[Any], changes: list[Any]
) -> None:
    runner = KvRunner(initial(policy, kv), kv)
    interleave(runner, script, [(c[0], c[3], ("pool", c[1], c[2], c[4])) for c in changes])
    replay_and_drain(runner, initial(policy, kv))
