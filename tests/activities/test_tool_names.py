"""The function names a run's model is offered for MCP tools (activities/tool_names.py)."""

from __future__ import annotations

import random
import re

from activities.tool_names import FUNCTION_NAME, function_names

# What OpenAI and Anthropic take; Gemini wants a letter or "_" first.
OPENAI = re.compile(r"[a-zA-Z0-9_-]{1,64}")
LONG = "synchronize_all_customer_records_across_every_connected_billing_system"


def test_a_name_engines_take_is_kept_and_another_made_one() -> None:
    tools = [
        ("files", "read_file"),
        ("files", "files.read"),
        ("gh", "github/create_issue"),
        ("auth", "2fa-check"),
        ("auth", "get-token"),
        ("crm", LONG),
        ("crm", "é"),
    ]
    names = function_names(tools)
    # (`get-token`: a dash, which the open engines' `pythonic` parsers refuse)
    assert names == {
        ("files", "files.read"): "files_read",
        ("gh", "github/create_issue"): "github_create_issue",
        ("auth", "2fa-check"): "t_2fa_check",
        ("auth", "get-token"): "get_token",
        ("crm", LONG): LONG[:55] + "_" + names[("crm", LONG)][-8:],
        ("crm", "é"): "t__",
    }
    assert all(FUNCTION_NAME.fullmatch(n) and OPENAI.fullmatch(n) for n in names.values())


def test_names_are_unique_and_the_same_whatever_the_order_of_the_listing() -> None:
    # `x.y` would be named as `x_y`, which is a tool's own name: it keeps it, and `x.y`
    # gets a name of its own; so do `a.b` and `a/b`, both `a_b`, and two long ones
    # alike in their first 55 characters.
    tools = [
        ("s", "x.y"),
        ("s", "x_y"),
        ("s", "a.b"),
        ("t", "a/b"),
        ("s", LONG + ".1"),
        ("s", LONG + ".2"),
    ]
    first = function_names(tools)
    assert ("s", "x_y") not in first and first[("s", "x.y")] != "x_y"
    offered = [first.get(k, k[1]) for k in tools]
    assert len(set(offered)) == len(tools)
    assert all(FUNCTION_NAME.fullmatch(n) for n in offered)
    rng = random.Random(7)
    for _ in range(20):
        rng.shuffle(tools)
        assert function_names(tools) == first


def test_a_name_an_earlier_server_has_is_offered_with_its_servers() -> None:
    # `search` of server `web` and `docs.search` of `my-docs` come after other servers'
    # tools of those names; `web__search` is also a tool's own name elsewhere.
    tools = [("a", "search"), ("a", "docs.search"), ("x", "web__search")]
    qualified = [("web", "search"), ("my-docs", "docs.search")]
    names = function_names(tools, qualified)
    assert names[("my-docs", "docs.search")] == "my_docs__docs_search"
    assert names[("a", "docs.search")] == "docs_search"
    assert ("a", "search") not in names and ("x", "web__search") not in names
    assert names[("web", "search")].startswith("web__search_")  # the name was taken
    offered = [names.get(k, k[1]) for k in tools + qualified]
    assert len(set(offered)) == len(offered)
    assert all(FUNCTION_NAME.fullmatch(n) for n in offered)
