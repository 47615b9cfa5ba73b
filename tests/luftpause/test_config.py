"""luftpause.toml: valid files load; bad ones fail with messages that say what to fix."""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.pool import Pool, compare
from luftpause.config import Config, ConfigError, load_config, parse_config
from scheduler import Policy, ReplicaSpec

GOOD = """
[[endpoints]]
name = "sglang-a"
url = "http://127.0.0.1:30000/"
kind = "sglang"
models = ["llama-3.2-1b"]

[[endpoints]]
name = "sglang-b"
url = "http://127.0.0.1:30001"
kind = "sglang"
models = ["llama-3.2-1b"]

[[endpoints]]
name = "router"
url = "http://127.0.0.1:30100"
kind = "router"
models = ["llama-3.2-1b"]
load_from = ["sglang-a", "sglang-b"]
kv_tokens = 112000       # its engines' pools: it keeps each run on one engine

[[endpoints]]
name = "hosted"
url = "https://api.example.test"
kind = "openai"
models = ["big-model"]
api_key_env = "HOSTED_KEY"
slots = 8                # its plan's concurrency limit

[[endpoints]]
name = "judge"
url = "http://127.0.0.1:8001"
kind = "classifier"
models = ["judge"]
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "luftpause.toml"
    p.write_text(text)
    return p


def test_a_good_file_loads_with_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, GOOD))
    assert isinstance(cfg, Config)
    a, _, router, hosted, judge = cfg.endpoints
    assert a.url == "http://127.0.0.1:30000"  # trailing slash dropped
    assert a.health == "/health" and hosted.health == "/v1/models"
    assert a.api_url("chat") == "http://127.0.0.1:30000/v1/chat/completions"
    assert a.reports_load and router.reports_load and not hosted.reports_load
    assert not judge.generative
    # The Anthropic Messages API: engines serve it, routers and hosted APIs by choice.
    assert a.serves("messages") and not router.serves("messages")
    assert not hosted.serves("messages") and hosted.serves("chat") and not judge.serves("chat")
    assert a.api_url("messages") == "http://127.0.0.1:30000/v1/messages"
    # The router's engines are probed for its load; turns go to the router, not to them.
    assert cfg.replica_specs() == [
        ReplicaSpec(name="router", models=frozenset({"llama-3.2-1b"}), kv_tokens=112_000),
        ReplicaSpec(name="hosted", models=frozenset({"big-model"}), slots=8),
    ]


def test_a_hosted_api_whose_openai_path_is_not_v1(tmp_path: Path) -> None:
    cfg = load_config(
        _write(
            tmp_path,
            '[[endpoints]]\nname="gemini"\nurl="https://generativelanguage.googleapis.com"\n'
            'kind="openai"\nmodels=["gemini-2.5-flash"]\napi_path="/v1beta/openai/"\n',
        )
    )
    (gemini,) = cfg.endpoints
    assert gemini.api_path == "/v1beta/openai"  # as a client's base_url ends, slash dropped
    assert gemini.api_url("chat") == (
        "https://generativelanguage.googleapis.com/v1beta/openai/chat/completions"
    )
    assert gemini.health == "/v1beta/openai/models"


def test_the_newer_apis_default_by_kind_and_the_file_decides() -> None:
    def one(kind: str, **kw: object) -> bool:
        e = {"name": "e", "url": "http://h:1", "kind": kind, "models": ["m"], **kw}
        return parse_config({"endpoints": [e]}).endpoints[0].serves("messages")

    assert all(one(k) for k in ("sglang", "vllm", "llamacpp", "ollama"))
    assert not one("router") and not one("openai")
    assert one("router", messages=True) and not one("vllm", messages=False)

    def responses(kind: str, **kw: object) -> bool:
        e = {"name": "e", "url": "http://h:1", "kind": kind, "models": ["m"], **kw}
        endpoint = parse_config({"endpoints": [e]}).endpoints[0]
        assert endpoint.api_url("responses") == "http://h:1/v1/responses"
        return endpoint.serves("responses")

    assert all(responses(k) for k in ("sglang", "vllm", "llamacpp", "ollama"))
    assert not responses("router") and not responses("openai")
    assert responses("openai", responses=True) and not responses("sglang", responses=False)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("endpoints = []", "endpoints: List should have at least 1 item"),
        (
            '[[endpoints]]\nname="a"\nurl="127.0.0.1:1"\nkind="sglang"\nmodels=["m"]',
            "endpoints[0].url: expected an http:// or https:// URL",
        ),
        (  # passed, and the gateway died at startup with httpx's InvalidURL
            '[[endpoints]]\nname="a"\nurl="http://127.0.0.1:abc"\nkind="sglang"\nmodels=["m"]',
            "the port of 'http://127.0.0.1:abc' is not 1-65535",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://127.0.0.1:99999"\nkind="sglang"\nmodels=["m"]',
            "the port of 'http://127.0.0.1:99999' is not 1-65535",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://exa mple.com"\nkind="sglang"\nmodels=["m"]',
            "'http://exa mple.com' is not one",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="https://api.example.com/v1/"\nkind="openai"\n'
            'models=["m"]',
            "endpoints[0].url: expected the server's root, without the trailing "
            "/v1 (luftpause adds /v1/chat/completions): https://api.example.com",
        ),
        (
            '[[endpoints]]\nname="g"\nurl="https://generativelanguage.googleapis.com/v1beta/openai/"'
            '\nkind="openai"\nmodels=["m"]',
            "endpoints[0].url: expected the server's root, without the API's path: url = "
            '"https://generativelanguage.googleapis.com" and api_path = "/v1beta/openai"',
        ),
        (
            '[[endpoints]]\nname="a"\nurl="https://h"\nkind="openai"\nmodels=["m"]\napi_path="v1"',
            "endpoints[0].api_path: expected the path of the OpenAI API under url",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="https://h"\nkind="openai"\nmodels=["m"]\n'
            'api_path="/v1/chat/completions"',
            "luftpause adds /chat/completions",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="vllm"\nmodels=["m"]\napi_path="/v2"',
            "api_path is only for kind = 'openai' (an engine behind a path prefix takes it in url",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="tgi"\nmodels=["m"]',
            "endpoints[0].kind: Input should be 'sglang', 'vllm', 'llamacpp'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=[]',
            "endpoints[0].models: List should have at least 1 item",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\nport=3',
            "endpoints[0].port: unknown field",
        ),
        # A key below a table is that table's (helper-113: "unknown field" said nothing).
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'gateway_url="http://gw:8080"',
            "endpoints[0].gateway_url: unknown field: gateway_url is a top-level key, and TOML "
            "puts a key written below a [[endpoints]] header into that table: write it above "
            "the first table",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[temporal]\nperiod_s=1.0",
            "temporal.period_s: unknown field: period_s is a key of [probes], [discovery]",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'health_path="health"',
            "endpoints[0].health_path: expected a path starting with '/'",
        ),
        # A control character in a URL or path made httpx raise at every probe
        # (helper-143); a TOML escape writes one.
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'health_path="/health\\u0001"',
            "endpoints[0].health_path: expected a path starting with '/', without control",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1/x\\u007f"\nkind="sglang"\nmodels=["m"]',
            "is not one",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="openai"\nmodels=["m"]\n'
            'api_path="/v1\\u0002"',
            "endpoints[0].api_path: expected the path of the OpenAI API",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[[endpoints]]\nname="a"\nurl="http://h:2"\nkind="sglang"\nmodels=["m"]',
            "endpoint names must be unique; repeated: a",
        ),
        (
            '[[endpoints]]\nname="r"\nurl="http://h:1"\nkind="router"\nmodels=["m"]\n'
            'load_from=["nope"]',
            "endpoint 'r': load_from names unknown 'nope'",
        ),
        (
            '[[endpoints]]\nname="o"\nurl="http://h:1"\nkind="ollama"\nmodels=["m"]\n'
            '[[endpoints]]\nname="r"\nurl="http://h:2"\nkind="router"\nmodels=["m"]\n'
            'load_from=["o"]',
            "load_from 'o' is kind 'ollama', which reports no load",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'load_from=["a"]',
            "load_from is only for kind = 'router'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="openai"\nmodels=["m"]\n'
            'api_key_header="x-api-key"',
            "api_key_header is where api_key_env's key goes: set api_key_env too",
        ),
        (
            '[[endpoints]]\nname="e"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[[endpoints]]\nname="r"\nurl="http://h:2"\nkind="router"\nmodels=["m"]\n'
            'load_from=["e", "e"]',
            "endpoint 'r': load_from names 'e' twice; an engine's load is counted for one "
            "router only",
        ),
        (
            '[[endpoints]]\nname="e"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[[endpoints]]\nname="r"\nurl="http://h:2"\nkind="router"\nmodels=["m"]\n'
            'load_from=["e"]\n'
            '[[endpoints]]\nname="s"\nurl="http://h:3"\nkind="router"\nmodels=["m"]\n'
            'load_from=["e"]',
            "endpoint 's': load_from names 'e', which router 'r' names too",
        ),
        (
            '[[endpoints]]\nname="e"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "kv_tokens=56000\n"
            '[[endpoints]]\nname="r"\nurl="http://h:2"\nkind="router"\nmodels=["m"]\n'
            'load_from=["e"]',
            "endpoint 'e': kv_tokens is not used on an engine behind router 'r' (load_from), "
            "which places the turns; give the router kv_tokens instead",
        ),
        (
            '[[endpoints]]\nname="e"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'device="gpu0"\n'
            '[[endpoints]]\nname="r"\nurl="http://h:2"\nkind="router"\nmodels=["m"]\n'
            'load_from=["e"]',
            "endpoint 'e': device is not used on an engine behind router 'r' (load_from)",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\nlabels=["x"]',
            "labels is only for kind = 'classifier'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[[mcp_servers]]\nname="t"',
            "give exactly one of url (streamable HTTP) or command",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="classifier"\nmodels=["m"]\n'
            "messages=true",
            "endpoints[0]: messages is not for kind = 'classifier' (it takes no turns)",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="classifier"\nmodels=["m"]\nslots=4',
            "endpoints[0]: slots is not for kind = 'classifier' (it takes no turns)",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="classifier"\nmodels=["m"]\n'
            "kv_tokens=4000",
            "endpoints[0]: kv_tokens is not for kind = 'classifier' (it takes no turns)",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[temporal]\nadress="x"',
            "temporal.adress: unknown field (did you mean address?)",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="vllm"\nmodels=["m"]\nslots=0',
            "endpoints[0].slots: Input should be greater than 0",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[policy]\nkv_fill=1.5",
            "policy.kv_fill: Input should be less than or equal to 1",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[policy]\nlane_batch_kv_fill="most"',
            "policy.lane_batch_kv_fill: expected a share between 0 and 1, or \"off\"; got 'most'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[policy]\nturn_timeout=5",
            "policy.turn_timeout: unknown field (did you mean turn_timeout_s?)",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "kv_tokens=9000\n[policy]\nlane_batch_kv_fill=false",
            'policy.lane_batch_kv_fill: expected a share between 0 and 1, or "off"; got False',
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="ollama"\nmodels=["m"]\n'
            "[policy]\nlane_batch_kv_fill=0.3",
            "interactive lanes are made of runs holding KV; they need kv_admission = true "
            "and a known KV pool (kv_tokens, or endpoints of kind sglang or vllm",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="ollama"\nmodels=["m"]\n'
            'device="gpu0"\n[policy]\npack_shared_devices=true',
            "policy.pack_shared_devices: it packs new runs beside the interactive runs holding "
            "KV on a shared GPU; it needs kv_admission = true and endpoints that give a "
            "`device` and a known KV pool",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[policy]\npack_shared_devices=true",
            "endpoints that give a `device`",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'dp_size=2\ndevice="gpu0"',
            "endpoints[0]: device is for one engine server on one GPU it shares with other "
            "endpoints; not for kind 'router' or 'classifier', discover or dp_size > 1",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\ndevice=""',
            "endpoints[0].device: String should have at least 1 character",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[policy]\nturn_timeout_s=0.001",
            "policy.turn_timeout_s: Input should be greater than or equal to 1",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[policy]\neject_after_failures="never"',
            'policy.eject_after_failures: expected a number of failed turns, or "off"; '
            "got 'never'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[policy]\nmax_held_per_caller="many"',
            "policy.max_held_per_caller: expected a number of held turns, or \"off\"; got 'many'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[policy]\nmax_held_per_caller=0",
            "policy.max_held_per_caller: Input should be greater than or equal to 1",
        ),
        (
            'gateway_url="127.0.0.1:8080"\n'
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]',
            "gateway_url: expected an http:// or https:// URL, e.g. http://127.0.0.1:8080",
        ),
        (
            'gateway_url="http://gw:8080/v1/"\n'
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]',
            "gateway_url: expected the gateway's root, without the trailing /v1 "
            "(luftpause adds /v1/chat/completions): http://gw:8080",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="https://pods.test:1"\nkind="sglang"\nmodels=["m"]\n'
            'discover="dns"',
            "discover = 'dns' takes an http:// url: turns go to each address the name "
            "resolves to, where a TLS certificate for the name would not verify",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://10.0.0.5:1"\nkind="sglang"\nmodels=["m"]\n'
            'discover="dns"',
            "discover = 'dns' expects a host name to resolve in url, not the address 10.0.0.5",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://pods.test:1"\nkind="sglang"\nmodels=["m"]\n'
            'discover="k8s"',
            "endpoints[0].discover: Input should be 'dns' or 'dns-srv'",
        ),
        (
            '[[endpoints]]\nname="e"\nurl="http://pods.test:1"\nkind="sglang"\nmodels=["m"]\n'
            'discover="dns"\n'
            '[[endpoints]]\nname="r"\nurl="http://h:2"\nkind="router"\nmodels=["m"]\n'
            'load_from=["e"]',
            "endpoint 'r': load_from names 'e', whose engines are discovered",
        ),
        (
            '[[endpoints]]\nname="e"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[[endpoints]]\nname="r"\nurl="http://routers.test:2"\nkind="router"\n'
            'models=["m"]\nload_from=["e"]\ndiscover="dns"',
            "discover is not for kind = 'router' with load_from",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[discovery]\nnameservers=["consul.local:8600"]',
            "discovery.nameservers: expected a nameserver as an IP address with an optional "
            "port, e.g. 127.0.0.1:8600 or [::1]:53, not 'consul.local:8600'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[discovery]\nnameservers=["127.0.0.1:70000"]',
            "not '127.0.0.1:70000'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://pods.test:99999"\nkind="sglang"\n'
            'models=["m"]\ndiscover="dns"',
            "endpoints[0].url: expected an http:// or https:// URL, e.g. "
            "http://127.0.0.1:30000; the port of 'http://pods.test:99999' is not 1-65535",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://' + "x" * 64 + '.test:1"\nkind="sglang"\n'
            'models=["m"]\ndiscover="dns"',
            "has no valid host name and port",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://:8000"\nkind="sglang"\nmodels=["m"]\n'
            'discover="dns"',
            "endpoints[0].url: expected an http:// or https:// URL, e.g. "
            "http://127.0.0.1:30000; 'http://:8000' names no host",
        ),
        # Found by helper-113: each loaded, then failed at every probe or turn.
        (
            '[[endpoints]]\nname="a"\nurl="http://user:pw@10.0.0.1:1"\nkind="sglang"\nmodels=["m"]',
            "credentials in the URL are not sent (give a key with api_key_env): http://10.0.0.1:1",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://10.0.0.1:1?api-version=2"\nkind="sglang"\n'
            'models=["m"]',
            "without a query or fragment (luftpause adds the API's paths to it): http://10.0.0.1:1",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://10.0.0.1:0"\nkind="sglang"\nmodels=["m"]',
            "the port of 'http://10.0.0.1:0' is not 1-65535",
        ),
        (
            'gateway_url="http://h:8080#x"\n'
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]',
            "gateway_url: expected an http:// or https:// URL, e.g. http://127.0.0.1:8080; "
            "without a query or fragment",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[temporal]\naddress="::1:7233"',
            "temporal.address: expected host:port, e.g. 127.0.0.1:7233 (an IPv6 address in "
            "brackets: [::1]:7233), got '::1:7233'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[temporal]\naddress="a:b:7233"',
            "temporal.address: expected host:port",
        ),
        (  # (int() of over 4300 digits raised, naming a sys setting: helper-143)
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            f'[temporal]\naddress="h:{"7" * 5000}"',
            "temporal.address: expected host:port",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[policy]\neject_for_s=inf",
            "policy.eject_for_s: Input should be a finite number",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[policy]\nturn_timeout_s=1e308",
            "policy.turn_timeout_s: Input should be less than or equal to 86400",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "[probes]\nperiod_s=1e-300",
            "probes.period_s: Input should be greater than or equal to 0.05",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[[mcp_servers]]\nname="t"\nurl="https://u:p@tools.test/mcp"',
            "mcp_servers[0].url: expected an http:// or https:// URL, e.g. "
            "http://127.0.0.1:9000/mcp; credentials in the URL are not sent (give a key "
            "with token_env): https://tools.test/mcp",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[[mcp_servers]]\nname="t"\nurl="http://h:9/mcp"\ntool_timeout_s=0',
            "mcp_servers[0].tool_timeout_s: Input should be greater than or equal to 0.05",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'api_key_env=""',
            "endpoints[0].api_key_env: String should match pattern",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            "kv_tokens=" + "9" * 400,
            "endpoints[0].kv_tokens: Input should be less than or equal to 9007199254740992",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://u:p@pods.test:1"\nkind="sglang"\n'
            'models=["m"]\ndiscover="dns"',
            "credentials in the URL are not sent (give a key with api_key_env)",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://_http._tcp.pods.test:1"\nkind="sglang"\n'
            'models=["m"]\ndiscover="dns-srv"',
            "discover = 'dns-srv': the SRV records give each engine's port; url takes none",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://pods.test:0"\nkind="sglang"\nmodels=["m"]\n'
            'discover="dns"',
            "the port of 'http://pods.test:0' is not 1-65535",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://pods.test:1"\nkind="classifier"\n'
            'models=["m"]\ndiscover="dns"',
            "discover is for endpoints that take turns, not kind = 'classifier'",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="llamacpp"\nmodels=["m"]\ndp_size=2',
            "dp_size is for kind 'sglang' or 'vllm', which take the rank of a request in "
            "X-Data-Parallel-Rank; kind 'llamacpp' does not",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\ndp_size=0',
            "endpoints[0].dp_size: Input should be greater than or equal to 1",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\ndp_rank=1',
            "dp_rank is set by luftpause on each rank's replica; give the server's dp_size",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            'dp_size=2\n[[endpoints]]\nname="r"\nurl="http://h:2"\nkind="router"\n'
            'models=["m"]\nload_from=["a"]',
            "endpoint 'r': load_from names 'a', whose ranks are replicas of their own "
            "(dp_size); a router in front of them balances its ranks itself",
        ),
        (
            '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
            '[discovery]\nfamily="ipv4"',
            "discovery.family: Input should be 'v4_preferred', 'v4_only', 'v6_only' or 'all'",
        ),
    ],
)
def test_bad_files_name_the_field_and_the_expectation(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_unreadable_and_non_toml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[[endpoints]\nname="))
    # tomllib recurses into nested arrays: a RecursionError was a traceback (helper-143)
    with pytest.raises(ConfigError, match="not valid TOML here: nested too deeply"):
        load_config(_write(tmp_path, "x = " + "[" * 5000 + "]" * 5000))
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'# caf\xe9\n[[endpoints]]\nname = "a"\n')
    with pytest.raises(ConfigError, match="not valid TOML: not UTF-8 at byte 5"):
        load_config(latin)


def test_parse_config_takes_a_mapping() -> None:
    cfg = parse_config(
        {"endpoints": [{"name": "a", "url": "http://h:1", "kind": "vllm", "models": ["m"]}]}
    )
    assert cfg.endpoints[0].kind == "vllm"


@pytest.mark.parametrize(
    ("setting", "where"),
    [
        ("kv_tokens = true", "endpoints[0].kv_tokens: Input should be a valid integer"),
        ("slots = true", "endpoints[0].slots: Input should be a valid integer"),
        ('dp_size = "2"', "endpoints[0].dp_size: Input should be a valid integer"),
    ],
)
def test_a_value_of_another_type_is_refused_not_converted(
    tmp_path: Path, setting: str, where: str
) -> None:
    # `kv_tokens = true` loaded as a pool of 1 token (helper-101).
    path = _write(
        tmp_path,
        f'[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n{setting}\n',
    )
    with pytest.raises(ConfigError, match=re.escape(where)):
        load_config(path)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ('[mcp]\napprove_tool = "false"', "mcp.approve_tool: Input should be a valid boolean"),
        ("[mcp]\napprove_tool = 0", "mcp.approve_tool: Input should be a valid boolean"),
        ("[mcp]\napprove = false", "mcp.approve: unknown field (did you mean approve_tool?)"),
        (
            '[[mcp_servers]]\nname = "s"\nurl = "http://h:9/mcp"\napprove_tool = false',
            "mcp_servers[0].approve_tool: unknown field: approve_tool is a key of [mcp]",
        ),
    ],
)
def test_the_mcp_doors_approve_tool_is_a_boolean_named_when_wrong(
    tmp_path: Path, setting: str, message: str
) -> None:
    # An operator who wants approvals from people only turns the door's `approve` tool
    # off; "false" as a string would be true to a lax reader, and is refused instead.
    endpoint = '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
    assert load_config(_write(tmp_path, endpoint)).mcp.approve_tool is True  # today's door
    off = load_config(_write(tmp_path, f"{endpoint}[mcp]\napprove_tool = false\n"))
    assert off.mcp.approve_tool is False
    path = _write(tmp_path, f"{endpoint}{setting}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value), err.value


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
        '[temporal]\naddress="file:7233"',
    )
    env = {"LUFTPAUSE_TEMPORAL_ADDRESS": "temporal:7233", "LUFTPAUSE_GATEWAY_URL": "http://gw:8080"}
    config = load_config(path, env)
    assert config.temporal.address == "temporal:7233"
    assert config.gateway_url == "http://gw:8080"
    assert load_config(path).temporal.address == "file:7233"
    # The environment's value is checked as the file's is, and named as its.
    with pytest.raises(
        ConfigError,
        match=r"gateway_url \(from LUFTPAUSE_GATEWAY_URL\): expected an http:// or https:// URL",
    ):
        load_config(path, {"LUFTPAUSE_GATEWAY_URL": "127.0.0.1:8080"})


@pytest.mark.parametrize("address", ["not a host", "http://temporal:7233", "temporal", "t:0"])
def test_a_temporal_address_that_is_no_host_and_port_is_refused_naming_it(
    tmp_path: Path, address: str
) -> None:
    # Accepted, it reached the SDK, whose ValueError ended the worker in a traceback.
    endpoint = '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
    path = _write(tmp_path, endpoint + f"[temporal]\naddress={address!r}")
    said = (
        "temporal.address: expected host:port, e.g. 127.0.0.1:7233 (an IPv6 address in "
        f"brackets: [::1]:7233), got {address!r}"
    )
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(path)
    path = _write(tmp_path, endpoint)
    with pytest.raises(ConfigError, match=re.escape("address (from LUFTPAUSE_TEMPORAL_ADDRESS)")):
        load_config(path, {"LUFTPAUSE_TEMPORAL_ADDRESS": address})
    for fine in ("[::1]:7233", "ns.a1b2.tmprl.cloud:7233"):
        assert load_config(path, {"LUFTPAUSE_TEMPORAL_ADDRESS": fine}).temporal.address == fine


def test_the_token_comes_from_the_file_or_the_environment_stripped_and_unshown(
    tmp_path: Path,
) -> None:
    one = '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
    path = _write(tmp_path, 'token = "from-file"\n' + one)
    assert load_config(path).token == "from-file"
    assert "from-file" not in repr(load_config(path))
    # A secret mounted from a file ends in a newline, which no header can carry: kept,
    # every client would be refused.
    assert load_config(path, {"LUFTPAUSE_TOKEN": "from-env\n"}).token == "from-env"
    assert load_config(_write(tmp_path, one)).token is None
    for bad in ("  ", "two words", "caf\u00e9"):
        with pytest.raises(ConfigError) as err:
            load_config(path, {"LUFTPAUSE_TOKEN": bad})
        assert "token (from LUFTPAUSE_TOKEN): expected a bearer token: printable" in str(err.value)
        assert not bad.strip() or bad.strip() not in str(err.value)


def test_keys_named_but_not_in_the_environment_are_reported() -> None:
    cfg = parse_config(
        {
            "endpoints": [
                {"name": "a", "url": "http://h:1", "kind": "openai", "models": ["m"],
                 "api_key_env": "KEY_A"},
                {"name": "b", "url": "http://h:2", "kind": "openai", "models": ["m"],
                 "api_key_env": "KEY_B"},
                {"name": "c", "url": "http://h:3", "kind": "vllm", "models": ["m"]},
            ],
            "mcp_servers": [{"name": "t", "url": "http://h:4/mcp", "token_env": "TOOL_KEY"}],
        }
    )  # fmt: skip
    assert cfg.unset_keys({"KEY_A": "sk-1", "KEY_B": " \n", "TOOL_KEY": "t"}) == [
        "endpoint b: api_key_env = 'KEY_B', but KEY_B is not set: its requests go without a key"
    ]
    assert len(cfg.unset_keys({})) == 3
    assert cfg.unset_keys({"KEY_A": "1", "KEY_B": "2", "TOOL_KEY": "3"}) == []
    # The worker calls no endpoint (its turns go through the gateway): the endpoints'
    # keys are not its to lack (deploy/compose.hosted.yaml gives the gateway alone one).
    assert cfg.unset_keys({"TOOL_KEY": "t"}, worker=True) == []
    assert cfg.unset_keys({}, worker=True) == [
        "mcp server t: token_env = 'TOOL_KEY', but TOOL_KEY is not set: its requests go "
        "without a key"
    ]


def test_the_policy_section_sets_the_schedulers_constants(tmp_path: Path) -> None:
    endpoint = (
        '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\nkv_tokens=56000\n'
    )
    # Without [policy], the scheduler's own defaults; every Policy field has a key.
    default = load_config(_write(tmp_path, endpoint)).policy
    assert default.to_policy() == Policy()
    assert set(type(default).model_fields) == {f.name for f in fields(Policy)}
    path = _write(
        tmp_path,
        endpoint + '[policy]\nstrict_affinity=false\nbatch_kv_fill="off"\n'
        "lane_batch_kv_fill=0.3\nturn_timeout_s=120\nmax_held_per_caller=64\n",
    )
    policy = load_config(path).policy.to_policy()
    assert policy == Policy(
        strict_affinity=False,
        batch_kv_fill=None,
        lane_batch_kv_fill=0.3,
        turn_timeout_s=120.0,
        max_held_per_caller=64,
    )


def test_endpoints_on_one_gpu_reach_the_core_with_their_device(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
        'device="gpu0"\n[[endpoints]]\nname="b"\nurl="http://h:2"\nkind="sglang"\n'
        'models=["m"]\ndevice="gpu0"\n[[endpoints]]\nname="c"\nurl="http://h:3"\n'
        'kind="vllm"\nmodels=["m"]\n[policy]\npack_shared_devices=true\n',
    )
    config = load_config(path)
    assert config.policy.to_policy().pack_shared_devices
    assert {s.name: s.device for s in config.replica_specs()} == {
        "a": "gpu0",
        "b": "gpu0",
        "c": None,
    }


def test_the_readmes_example_file_is_valid() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Configuration", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    config = parse_config(tomllib.loads(example), "README.md")
    assert {e.kind for e in config.endpoints} >= {"sglang", "vllm", "openai", "classifier"}
    assert config.policy.to_policy() == Policy()  # it lists the defaults


def test_the_modules_example_file_is_valid() -> None:
    # The reference of every key in luftpause/config.py's docstring: it did not load
    # (discover = "dns" on an address; helper-113).
    import luftpause.config

    doc = luftpause.config.__doc__ or ""
    example = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    config = parse_config(tomllib.loads(example), "luftpause/config.py")
    assert config.mcp_servers[0].tool_timeout_s == 300.0
    assert config.policy.to_policy() == Policy()  # it lists the defaults


def test_a_discovered_endpoint_expands_to_one_replica_per_address() -> None:
    cfg = parse_config(
        {
            "endpoints": [
                {"name": "a", "url": "http://h:1", "kind": "vllm", "models": ["m"]},
                {
                    "name": "pod",
                    "url": "http://sglang-headless.llm.svc.cluster.local:30000/engine",
                    "kind": "sglang",
                    "models": ["m", "n"],
                    "kv_tokens": 9000,
                    "discover": "dns",
                },
                {
                    "name": "pod-10.0.0.7:30000",
                    "url": "http://h:2",
                    "kind": "vllm",
                    "models": ["m"],
                },
            ],
            "discovery": {"nameservers": ["[::1]:8600", "10.0.0.10"]},
        }
    )
    assert [e.name for e in cfg.discovered] == ["pod"]
    assert cfg.discovered[0].host == "sglang-headless.llm.svc.cluster.local"
    assert cfg.discovery.period_s == 5.0 and cfg.discovery.nameservers == [
        "[::1]:8600",
        "10.0.0.10",
    ]
    out = cfg.expanded({"pod": ("10.0.0.6:30000", "10.0.0.7:30000", "[fd00::5]:30000")})
    assert [(e.name, e.url) for e in out.endpoints] == [
        ("a", "http://h:1"),
        # named by address and port: a port changed in the file is other engines
        ("pod-10.0.0.6:30000", "http://10.0.0.6:30000/engine"),
        # the file's own endpoint of that name wins over the discovered address
        ("pod-[fd00::5]:30000", "http://[fd00::5]:30000/engine"),
        ("pod-10.0.0.7:30000", "http://h:2"),
    ]
    pod = out.endpoints[1]
    assert pod.discover is None and pod.kv_tokens == 9000 and pod.models == ["m", "n"]
    assert [s.name for s in out.replica_specs()] == [
        "a",
        "pod-10.0.0.6:30000",
        "pod-[fd00::5]:30000",
        "pod-10.0.0.7:30000",
    ]
    # no address: no replica; a file without discovered endpoints is itself
    assert [e.name for e in cfg.expanded({}).endpoints] == ["a", "pod-10.0.0.7:30000"]
    # the port the engines are on: url's, or http's
    assert cfg.discovered[0].port == 30000
    assert cfg.discovered[0].model_copy(update={"url": "http://pods.test"}).port == 80
    plain = parse_config(
        {"endpoints": [{"name": "a", "url": "http://h:1", "kind": "vllm", "models": ["m"]}]}
    )
    assert plain.expanded({"a": ("10.0.0.1",)}) is plain


def test_a_data_parallel_server_expands_to_one_replica_per_rank() -> None:
    sglang = {"name": "dp", "url": "http://h:1", "kind": "sglang", "models": ["m"], "dp_size": 2}
    pod = {**sglang, "name": "pod", "url": "http://pods.test:30000", "discover": "dns"}
    cfg = parse_config({"endpoints": [sglang, pod]})
    out = cfg.expanded({"pod": ("10.0.0.6:30000",)})
    assert [(e.name, e.url, e.dp_rank, e.server) for e in out.endpoints] == [
        ("dp@0", "http://h:1", 0, "dp"),
        ("dp@1", "http://h:1", 1, "dp"),
        ("pod-10.0.0.6:30000@0", "http://10.0.0.6:30000", 0, "pod-10.0.0.6:30000"),
        ("pod-10.0.0.6:30000@1", "http://10.0.0.6:30000", 1, "pod-10.0.0.6:30000"),
    ]
    assert [s.name for s in out.replica_specs()] == [e.name for e in out.endpoints]
    # Without discovery the ranks still expand; one rank is the server itself.
    alone = parse_config({"endpoints": [sglang]})
    assert [e.name for e in alone.expanded({}).endpoints] == ["dp@0", "dp@1"]
    one = parse_config({"endpoints": [{**sglang, "dp_size": 1}]})
    assert one.expanded({}) is one and one.endpoints[0].server == "dp"


def test_callers_tokens_come_from_the_environment_each_its_own() -> None:
    base = {"endpoints": [{"name": "a", "url": "http://h:1", "kind": "vllm", "models": ["m"]}]}
    callers = [
        {"name": "team-a", "token_env": "TEAM_A_TOKEN"},
        {"name": "team-b", "token_env": "TEAM_B_TOKEN"},
    ]
    cfg = parse_config({**base, "token": "op", "callers": callers})
    env = {"TEAM_A_TOKEN": " tok-a\n", "TEAM_B_TOKEN": "tok-b"}
    assert cfg.caller_tokens(env) == {"tok-a": "team-a", "tok-b": "team-b"}
    # An unset variable: no token is that caller's, and the start says so.
    assert cfg.caller_tokens({"TEAM_A_TOKEN": "tok-a"}) == {"tok-a": "team-a"}
    assert cfg.unset_keys({"TEAM_A_TOKEN": "tok-a"}) == [
        "caller team-b: token_env = 'TEAM_B_TOKEN', but TEAM_B_TOKEN is not set: "
        "no token is this caller's"
    ]
    assert cfg.unset_keys({}, worker=True) == []  # callers are the gateway's
    for env, message in [
        ({"TEAM_A_TOKEN": "op"}, "caller team-a: TEAM_A_TOKEN holds the operator's token"),
        (
            {"TEAM_A_TOKEN": "same", "TEAM_B_TOKEN": "same"},
            "callers team-a and team-b: TEAM_B_TOKEN holds the same token as the other's",
        ),
        ({"TEAM_A_TOKEN": "two words"}, "caller team-a: TEAM_A_TOKEN: expected a bearer token"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            cfg.caller_tokens(env)
    # The token the gateway takes (LUFTPAUSE_TOKEN may differ from the file's) counts.
    with pytest.raises(ConfigError, match="TEAM_A_TOKEN holds the operator's token"):
        cfg.caller_tokens({"TEAM_A_TOKEN": "from-env"}, "from-env")
    for data, message in [
        ({**base, "callers": callers}, "callers: callers' tokens need the operator's token"),
        (
            {**base, "token": "op", "callers": [callers[0], {**callers[1], "name": "team-a"}]},
            "caller names must be unique; repeated: team-a",
        ),
        (
            {
                **base,
                "token": "op",
                "callers": [callers[0], {**callers[1], "token_env": "TEAM_A_TOKEN"}],
            },
            "callers' token_env must be unique; repeated: TEAM_A_TOKEN",
        ),
        (
            {**base, "token": "op", "callers": [{"name": "team a", "token_env": "T"}]},
            "callers[0].name: expected letters, digits and _ . : @ - only",
        ),
        *[
            (
                {**base, "token": "op", "callers": [{"name": name, "token_env": "T"}]},
                f"callers[0].name: '{name}' is the name of callers that name none",
            )
            for name in ("anonymous", "token", "mcp-session:abc")
        ],
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)) as raised:
            parse_config(data)
        assert "file:" not in str(raised.value)  # a whole-file check names its field


# Values a TOML file can hold, and the file's own keys, so that a drawn file gets past
# the first check and into each section's.
_TOML = st.recursive(
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=True)
    | st.sampled_from(["", "m", "http://h:1", "h:1", "/v1", "sglang", "router", "dns", "a"])
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
_SECTIONS = {
    "endpoints": [
        "name", "url", "kind", "models", "health_path", "api_key_env", "api_key_header",
        "api_path", "load_from", "kv_tokens", "labels", "messages", "responses", "discover",
        "dp_size", "dp_rank", "slots",
    ],
    "mcp_servers": ["name", "url", "command", "env", "token_env", "protocol"],
    "callers": ["name", "token_env"],
}  # fmt: skip
_TABLES = {
    "mcp": ["approve_tool"],
    "temporal": ["address", "namespace", "task_queue"],
    "probes": ["period_s", "timeout_s", "late_to_unhealthy"],
    "discovery": ["period_s", "timeout_s", "family", "nameservers"],
    "worker": [
        "max_concurrent_activities", "max_cached_workflows",
        "max_concurrent_workflow_tasks", "max_concurrent_workflow_task_polls",
        "max_concurrent_activity_task_polls",
    ],
    "policy": [
        "turn_timeout_s", "batch_kv_fill", "kv_fill", "lane_batch_kv_fill", "kv_admission",
        "eject_after_failures", "max_held_per_caller", "cap_increase",
    ],
}  # fmt: skip


def _entry(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys), _TOML, max_size=len(keys))


_FILES = st.fixed_dictionaries(
    {
        "endpoints": st.lists(
            st.builds(
                lambda base, bent: {**base, **bent},
                st.fixed_dictionaries(
                    {
                        "name": st.sampled_from(["a", "b", "a b"]),
                        "url": st.sampled_from(["http://h:1", "http://g:2", "h"]),
                        "kind": st.sampled_from(
                            ["sglang", "vllm", "llamacpp", "openai", "router", "classifier"]
                        ),
                        "models": st.sampled_from([["m"], [], ["m", "n"]]),
                    }
                ),
                _entry(_SECTIONS["endpoints"]),
            ),
            max_size=3,
        )
    },
    optional={
        "mcp_servers": st.lists(_entry(_SECTIONS["mcp_servers"]), max_size=2),
        "callers": st.lists(_entry(_SECTIONS["callers"]), max_size=2),
        "token": _TOML,
        "gateway_url": _TOML,
        "session_runs": _TOML,
        "max_request_bytes": _TOML,
        **{name: _entry(keys) | _TOML for name, keys in _TABLES.items()},
    },
)


@given(data=_FILES)
def test_a_file_of_any_shape_is_taken_or_refused_with_a_reason(data: dict[str, Any]) -> None:
    """`luftpause up`, the gateway and POST /reload turn a ConfigError into a message
    and a 400; any other exception would be a traceback and a 500."""
    try:
        cfg = parse_config(data)
    except ConfigError as exc:
        assert str(exc).startswith("configuration: ") and len(str(exc)) > len("configuration: ")
        return
    # What the gateway does with a file it took, before it serves and when a reload
    # brings it (over the file it runs, and back).
    cfg.policy.to_policy()
    expanded = cfg.expanded({})
    expanded.replica_specs()
    cfg.unset_keys({})
    cfg.caller_tokens({}, cfg.token)
    pool = Pool.of(cfg)
    pool.awaited("m")
    running = parse_config(tomllib.loads(GOOD))
    for old, new in ((running, pool.config), (pool.config, running)):
        try:
            change = compare(old, new, started=running)
        except ConfigError as exc:
            assert str(exc).startswith("nothing was reloaded: "), exc
        else:
            json.dumps(change.as_json())
            assert str(change)


def test_an_mcp_servers_url_may_carry_a_query() -> None:
    # Used as it is (nothing is added to it): hosted MCP servers take a profile or a
    # key in the query, which da2ef8d refused with the endpoints' rule (helper-116).
    url = "https://server.example/@org/srv/mcp?profile=p1&config=abc"
    cfg = parse_config(
        {
            "endpoints": [{"name": "a", "url": "http://h:1", "kind": "vllm", "models": ["m"]}],
            "mcp_servers": [{"name": "t", "url": url}],
        }
    )
    assert cfg.mcp_servers[0].url == url


def test_endpoints_sharing_a_url_are_named() -> None:
    # helper-113: two endpoints at one URL are one engine the core counts twice (its
    # slots and KV pool each time); it loaded without a word.  The gateway warns.
    cfg = parse_config(
        {
            "endpoints": [
                {"name": "a", "url": "http://h:1", "kind": "ollama", "models": ["m"]},
                {"name": "b", "url": "http://h:1/", "kind": "ollama", "models": ["n"]},
                {"name": "c", "url": "http://h:1", "kind": "classifier", "models": ["k"]},
                {"name": "d", "url": "https://api.test", "kind": "openai", "models": ["x"],
                 "api_path": "/v1"},
                {"name": "e", "url": "https://api.test", "kind": "openai", "models": ["y"],
                 "api_path": "/v1beta/openai"},
            ]
        }
    )  # fmt: skip
    assert cfg.shared_urls() == [
        "endpoints a, b have the same url http://h:1: one engine counted as several "
        "replicas (its slots and KV pool each time); give it one endpoint with all its models"
    ]


def test_the_worker_section_sizes_the_worker_and_unset_keys_keep_the_sdks(
    tmp_path: Path,
) -> None:
    endpoint = '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
    default = load_config(_write(tmp_path, endpoint)).worker
    assert default.max_concurrent_activities == 1000  # luftpause's, not the SDK's 100
    assert default.model_dump(exclude={"max_concurrent_activities"}) == dict.fromkeys(
        [
            "max_concurrent_workflow_tasks",
            "max_cached_workflows",
            "max_concurrent_workflow_task_polls",
            "max_concurrent_activity_task_polls",
        ]
    )
    path = _write(
        tmp_path,
        endpoint + "[worker]\nmax_concurrent_activities=16\nmax_concurrent_workflow_tasks=8\n"
        "max_cached_workflows=5000\nmax_concurrent_workflow_task_polls=2\n"
        "max_concurrent_activity_task_polls=10\n",
    )
    assert load_config(path).worker.model_dump() == {
        "max_concurrent_activities": 16,
        "max_concurrent_workflow_tasks": 8,
        "max_cached_workflows": 5000,
        "max_concurrent_workflow_task_polls": 2,
        "max_concurrent_activity_task_polls": 10,
    }
    # Without a cache, one poll and one workflow-task slot are enough.
    path = _write(
        tmp_path,
        endpoint + "[worker]\nmax_cached_workflows=0\nmax_concurrent_workflow_task_polls=1\n"
        "max_concurrent_workflow_tasks=1\n",
    )
    assert load_config(path).worker.max_concurrent_workflow_task_polls == 1


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        # 0 activities: the SDK would have taken it as its default of 100, without a word.
        ("max_concurrent_activities=0", "worker.max_concurrent_activities: Input should be "
         "greater than or equal to 1"),
        ("max_concurrent_activities=100001", "worker.max_concurrent_activities: Input should "
         "be less than or equal to 100000"),
        ('max_concurrent_activities="64"', "worker.max_concurrent_activities: Input should be "
         "a valid integer"),
        ("max_concurrent_workflow_tasks=true", "worker.max_concurrent_workflow_tasks: "
         "Input should be a valid integer"),
        ("max_concurrent_workflow_tasks=2.0", "worker.max_concurrent_workflow_tasks: "
         "Input should be a valid integer"),
        # The SDK's core sets memory aside for each: 10**12 aborted the process.
        ("max_cached_workflows=1000000000000", "worker.max_cached_workflows: Input should be "
         "less than or equal to 100000"),
        ("max_cached_workflows=-1", "worker.max_cached_workflows: Input should be greater "
         "than or equal to 0"),
        ("max_concurrent_workflow_task_polls=0", "worker.max_concurrent_workflow_task_polls: "
         "Input should be greater than or equal to 1"),
        ("max_concurrent_activity_task_polls=101", "worker.max_concurrent_activity_task_polls: "
         "Input should be less than or equal to 100"),
        # With the cache (the SDK's default), a sticky queue beside the shared one.
        ("max_concurrent_workflow_task_polls=1", "worker: max_concurrent_workflow_task_polls "
         "= 1, but a worker that caches runs (max_cached_workflows above 0; the SDK's default "
         "is 1000) needs at least 2"),
        ("max_cached_workflows=10\nmax_concurrent_workflow_tasks=1", "worker: "
         "max_concurrent_workflow_tasks = 1, but a worker that caches runs"),
        ("max_concurrent_activites=8", "worker.max_concurrent_activites: unknown field (did "
         "you mean max_concurrent_activities?)"),
    ],
)  # fmt: skip
def test_a_worker_setting_out_of_range_is_refused_naming_the_key_and_the_range(
    tmp_path: Path, setting: str, message: str
) -> None:
    path = _write(
        tmp_path,
        '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
        f"[worker]\n{setting}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: worker"), err.value
    assert message in str(err.value)


def test_the_worker_flags_override_the_file_and_are_checked_with_it(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[[endpoints]]\nname="a"\nurl="http://h:1"\nkind="sglang"\nmodels=["m"]\n'
        "[worker]\nmax_concurrent_activities=64\nmax_cached_workflows=0\n"
        "max_concurrent_workflow_task_polls=1\n",
    )
    config = load_config(path)
    flag = {"max_concurrent_activities": "--max-concurrent-activities"}
    changed = config.with_worker({"max_concurrent_activities": 8}, flag)
    assert changed.worker.max_concurrent_activities == 8
    assert changed.worker.max_concurrent_workflow_task_polls == 1  # the file's, kept
    assert config.worker.max_concurrent_activities == 64  # (a copy)
    with pytest.raises(ConfigError) as err:
        config.with_worker({"max_concurrent_activities": 0}, flag)
    assert str(err.value) == (
        "worker.max_concurrent_activities (from --max-concurrent-activities): Input should "
        "be greater than or equal to 1"
    )
    # A cache given by a flag, with the file's one poll: refused together.
    with pytest.raises(ConfigError, match="max_concurrent_workflow_task_polls = 1, but"):
        config.with_worker(
            {"max_cached_workflows": 100}, {"max_cached_workflows": "--max-cached-workflows"}
        )
