"""`bench.real_engines` itself needs llama-server (a 15-minute build), so CI checks
what it hands the gateway: a file that loads and leaves the slots to the engines."""

from __future__ import annotations

import tomllib

from bench.real_engines import _config
from luftpause.config import parse_config


def test_the_bench_gives_the_gateway_its_engines_and_leaves_their_slots_to_them() -> None:
    engines = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    direct = parse_config(tomllib.loads(_config(engines, None)))
    assert [(e.name, e.url, e.kind) for e in direct.replicas] == [
        ("e0", engines[0], "llamacpp"),
        ("e1", engines[1], "llamacpp"),
    ]
    routed = parse_config(tomllib.loads(_config(engines, "http://127.0.0.1:3")))
    (router,) = routed.replicas
    assert (router.kind, router.load_from) == ("router", ["e0", "e1"])
    # No slots in the file: the gateway must learn them from /props, which is the point.
    assert all(e.slots is None for e in routed.endpoints)
    assert routed.slots_of(router) is None
