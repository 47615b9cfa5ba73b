"""`POST /v1/decide` end to end over real loopback HTTP: fake engines (generative and
classifier) and tiny upstream apps behind the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import Request
from fastapi.responses import Response
from harness import (
    MODEL,
    RUN,
    answered_health,
    closed_port_url,
    endpoint,
    engine,
    gateway,
    models_only,
    upstream,
)
from starlette.types import Receive, Scope, Send

from gateway.decide import SYSTEM_PROMPT, DecideError, chat_body, decision, parse_decide
from scheduler import Policy
from testkit.loopback import serve

CLF = "clf-model"


def logprobs_answer(top: list[tuple[str, float]]) -> Callable[[Request], Response]:
    def answer(request: Request) -> Response:
        entries = [{"token": t, "logprob": lp, "bytes": []} for t, lp in top]
        content = [{"token": top[0][0], "logprob": top[0][1], "top_logprobs": entries}]
        body = {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": top[0][0]},
                    "logprobs": {"content": content},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21},
        }
        return Response(json.dumps(body), media_type="application/json")

    return answer


# --------------------------------------------------------------------------- labels


async def test_labels_through_a_fake_engine() -> None:
    labels = ["alpha", "beta", "gamma"]
    async with (
        engine(time_scale=20) as (url, recorded),
        gateway(endpoint("a", url)) as (gw, shell),
    ):
        results = []
        for _ in range(2):
            r = await gw.post(
                "/v1/decide",
                json={"input": "Is this a test?", "labels": labels},
                headers={"x-luftpause-caller": "tester"},
            )
            assert r.status_code == 200, r.text
            assert r.headers[RUN]
            results.append(r.json())
        first, again = results
        assert first == again  # deterministic for the same input
        assert first["label"] in labels
        assert first["unscored"] == []
        probs = first["probabilities"]
        assert set(probs) == set(labels)
        assert math.isclose(sum(probs.values()), 1.0)
        assert max(probs, key=lambda k: probs[k]) == first["label"]
        assert 0.9 < first["mass"] <= 1.0  # a probability (helper-127: the fake gave 1.2)

        sent = recorded.bodies[0]
        assert sent["model"] == MODEL  # the pool's first generative model
        assert sent["max_tokens"] == 1
        assert sent["logprobs"] is True and sent["top_logprobs"] == 20
        assert sent["temperature"] == 0 and sent["stream"] is False
        assert sent["messages"] == [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Is this a test?\n\nLabels: alpha, beta, gamma"},
        ]
        # Each decide runs in a run of its own, ended afterwards: nothing is left.
        assert not shell.state.turns
        assert not shell.state.runs

        unknown = await gw.post(
            "/v1/decide", json={"input": "x", "labels": labels, "model": "nope"}
        )
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
        assert unknown.headers[RUN]


async def test_unscored_labels_and_none_matched() -> None:
    top = [(" Pos", -0.1), ("neg", -2.0), ("x", -0.01), ("", -0.5)]
    async with (
        serve(upstream(logprobs_answer(top))) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        r = await gw.post(
            "/v1/decide", json={"input": "hm", "labels": ["neutral", "positive", "negative"]}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["label"] == "positive"
        assert body["unscored"] == ["neutral"]  # "neg" is no prefix of "neutral"
        p, n = math.exp(-0.1), math.exp(-2.0)
        assert body["probabilities"] == pytest.approx(
            {"positive": p / (p + n), "negative": n / (p + n)}
        )

        none = await gw.post("/v1/decide", json={"input": "hm", "labels": ["cat", "dog"]})
        assert none.status_code == 422
        message = none.json()["error"]["message"]
        assert "matched none of the labels" in message and "cat, dog" in message
        assert none.headers[RUN]
        assert not shell.state.runs


def test_a_token_that_is_a_whole_label_scores_that_label_only() -> None:
    # helper-66: "yes" begins "yesterday", so both took the token "yes" (0.5 each), and
    # a label with a space around it never matched the model's (stripped) token.
    top = [{"token": "Yes", "logprob": -0.1}, {"token": " yesterday", "logprob": -3.0}]
    got = decision(["yesterday", "yes"], top)
    yes, yesterday = math.exp(-0.1), math.exp(-3.0)
    assert got["label"] == "yes"
    assert got["probabilities"] == pytest.approx(
        {"yesterday": yesterday / (yes + yesterday), "yes": yes / (yes + yesterday)}
    )
    assert decision([" yes", "no"], [{"token": "yes", "logprob": -0.2}])["label"] == " yes"
    # A token that is no whole label counts for every label it begins: where it is the
    # one that decides, it cannot tell them apart, and says so (helper-115: the first
    # label won, so the answer hung on the labels' order).
    with pytest.raises(DecideError, match="'ye' begins 'yes' and 'yesterday' alike") as e:
        decision(["yes", "yesterday"], [{"token": "ye", "logprob": -0.5}])
    assert e.value.status == 422
    top = [{"token": "Ne", "logprob": math.log(0.9)}, {"token": "Pos", "logprob": math.log(0.1)}]
    for labels in (["Negative", "Neutral", "Positive"], ["Neutral", "Negative", "Positive"]):
        with pytest.raises(DecideError, match="one token cannot tell them apart"):
            decision(labels, top)
    # Not when it decides nothing: "Pos" wins, and "Ne" only adds to the two below.
    top = [{"token": "Pos", "logprob": math.log(0.6)}, {"token": "Ne", "logprob": math.log(0.3)}]
    assert decision(["Negative", "Neutral", "Positive"], top)["label"] == "Positive"


def test_a_labels_spellings_add_up() -> None:
    # helper-115: the model spread "yes" over three tokens, and the best of them alone
    # lost to "no" (0.4 against 0.45): the label is what the first token begins, however
    # spelled, so its tokens' probabilities add up.
    top = [
        {"token": "No", "logprob": math.log(0.45)},
        {"token": "Yes", "logprob": math.log(0.3)},
        {"token": " yes", "logprob": math.log(0.15)},
        {"token": " Y", "logprob": math.log(0.05)},
    ]
    got = decision(["yes", "no"], top)
    assert got["label"] == "yes"
    assert got["probabilities"] == pytest.approx({"yes": 0.5 / 0.95, "no": 0.45 / 0.95})
    assert got["mass"] == pytest.approx(0.95)
    # An engine's rounded logprobs may add up past 1: the mass is a probability still.
    over = [{"token": "Yes", "logprob": -0.01}, {"token": "No", "logprob": math.log(0.02)}]
    assert decision(["yes", "no"], over)["mass"] == 1.0


def test_a_token_that_is_part_of_a_character_matches_by_its_bytes() -> None:
    # helper-115: a byte-fallback token (the first bytes of "是", of "é") has no text of
    # its own: llama.cpp and OpenAI send its bytes, with text up to its last whole
    # character, so a label beginning with such a character never matched.
    shi, bu = "是".encode(), "不".encode()
    top = [
        {"token": "", "logprob": math.log(0.7), "bytes": list(shi[:2])},
        {"token": " ", "logprob": math.log(0.2), "bytes": list(b" " + bu[:1])},
        {"token": "Yes", "logprob": math.log(0.05), "bytes": list(b"Yes")},
    ]
    got = decision(["是", "不是"], top)
    assert got["label"] == "是"
    assert got["probabilities"] == pytest.approx({"是": 0.7 / 0.9, "不是": 0.2 / 0.9})
    # The whole characters before the cut compare without case, as text does; the cut
    # one's bytes may be of its capital (helper-121: " N\xc3" of "Négatif" went to
    # "Positif").
    e_acute = "É".encode()
    top = [
        {"token": " N", "logprob": math.log(0.6), "bytes": list(b" N" + "é".encode()[:1])},
        {"token": "Pos", "logprob": math.log(0.3), "bytes": list(b"Pos")},
    ]
    assert decision(["Négatif", "Positif"], top)["label"] == "Négatif"
    # One byte of a Cyrillic letter begins С (the capital of с) and п alike: no guess.
    top = [
        {"token": "", "logprob": math.log(0.6), "bytes": list("С".encode()[:1])},
        {"token": "Про", "logprob": math.log(0.3), "bytes": list("Про".encode())},
    ]
    with pytest.raises(DecideError, match="one token cannot tell them apart"):
        decision(["согласен", "против"], top)
    top = [{"token": "", "logprob": math.log(0.9), "bytes": list(e_acute[:1])}]
    assert decision(["été", "non"], top)["label"] == "été"
    # Bytes that are a whole character, or no UTF-8 at all, leave the token's text.
    whole = [{"token": "no", "logprob": math.log(0.9), "bytes": list(b"no")}]
    assert decision(["yes", "no"], whole)["label"] == "no"
    bad = [{"token": "no", "logprob": math.log(0.9), "bytes": [0xFF, 0x6E]}]
    assert decision(["yes", "no"], bad)["label"] == "no"
    odd = [{"token": "no", "logprob": math.log(0.9), "bytes": ["x", 300, True]}]
    assert decision(["yes", "no"], odd)["label"] == "no"


def test_tokens_several_labels_share_refuse_a_decision_they_could_swing() -> None:
    # helper-121: with sums, "N" (Negative or Neutral) took Negative's 0.30 past
    # Positive's 0.45, and the answer was Negative with no word of doubt.
    top = [
        {"token": "Negative", "logprob": math.log(0.30)},
        {"token": "N", "logprob": math.log(0.25)},
        {"token": "Positive", "logprob": math.log(0.45)},
    ]
    with pytest.raises(DecideError, match="'n' begins 'Negative' and 'Neutral' alike"):
        decision(["Negative", "Neutral", "Positive"], top)
    # Whatever the tokens' order (a tie used to be decided by it).
    for top in (
        [
            {"token": "Negative", "logprob": math.log(0.3)},
            {"token": "Ne", "logprob": math.log(0.3)},
        ],
        [
            {"token": "Ne", "logprob": math.log(0.3)},
            {"token": "Negative", "logprob": math.log(0.3)},
        ],
    ):
        with pytest.raises(DecideError, match="one token cannot tell them apart"):
            decision(["Negative", "Neutral"], top)
    # Shared tokens too light to swing it: the labels' own tokens decide, and only they
    # count in the probabilities.
    top = [
        {"token": "Negative", "logprob": math.log(0.6)},
        {"token": "N", "logprob": math.log(0.1)},
        {"token": "Positive", "logprob": math.log(0.2)},
    ]
    got = decision(["Negative", "Neutral", "Positive"], top)
    assert got["label"] == "Negative" and got["unscored"] == ["Neutral"]
    assert got["probabilities"] == pytest.approx({"Negative": 0.75, "Positive": 0.25})
    assert got["mass"] == pytest.approx(0.9)


def test_an_answer_that_is_not_a_label_is_no_decision() -> None:
    # helper-115: a reasoning model's first token is <think>; a label it gave 0.05 %
    # came back with probability 1.0.
    top = [{"token": "<think>", "logprob": math.log(0.999)}, {"token": "yes", "logprob": -7.6}]
    with pytest.raises(DecideError, match=r"put 0\.1% of its probability on the labels") as e:
        decision(["yes", "no"], top)
    assert e.value.status == 422 and "'<think>'" in str(e.value)
    got = decision(["yes", "no"], [{"token": "yes", "logprob": math.log(0.6)}])
    assert got["mass"] == pytest.approx(0.6) and got["probabilities"] == {"yes": 1.0}


def test_a_label_that_begins_another_is_refused() -> None:
    for labels, said in (
        (["no", "no idea"], "'no' begins 'no idea'"),
        (["Yes", "No", "yes please"], "'Yes' begins 'yes please'"),
        (["yes", "no", "no, never"], "'no' begins 'no, never'"),  # helper-117
        ([str(i) for i in range(1, 11)], "'1' begins '10'"),  # Qwen splits every digit
        (["1", "1st"], "'1' begins '1st'"),  # helper-118
        (["是", "是的"], "'是' begins '是的'"),  # helper-121: no spaces, no own first token
        (["ใช่", "ใช่แล้ว"], "'ใช่' begins 'ใช่แล้ว'"),
    ):
        with pytest.raises(DecideError, match=said) as e:
            parse_decide(json.dumps({"input": "x", "labels": labels}).encode())
        assert e.value.status == 400
    # Not where the longer goes on with letters: these have first tokens of their own
    # (helper-116: all were refused; "Not", "None" and "All" are one token).
    for labels in (
        ["Yes", "No", "Not sure"],
        ["A", "B", "C", "All of the above"],
        ["Yes", "No", "None"],
        ["yes", "yesterday"],
    ):
        assert parse_decide(json.dumps({"input": "x", "labels": labels}).encode()).labels


def test_labels_with_commas_are_listed_one_per_line() -> None:
    # helper-115: "Labels: yes, definitely, no" reads as three labels.
    def asked(labels: list[str]) -> str:
        request = parse_decide(json.dumps({"input": "Sure?", "labels": labels}).encode())
        return str(json.loads(chat_body(request, "m"))["messages"][1]["content"])

    assert asked(["yes, definitely", "no"]) == (
        "Sure?\n\nLabels (one per line):\nyes, definitely\nno"
    )
    assert asked(["yes", "no"]) == "Sure?\n\nLabels: yes, no"  # as before
    assert asked(["是，当然", "否"]).endswith("(one per line):\n是，当然\n否")  # full-width
    for broken in ("b\nc", "b\u2028c", "b\x85c"):
        with pytest.raises(DecideError, match=r"labels\[1\]: expected one line") as e:
            parse_decide(json.dumps({"input": "x", "labels": ["a", broken]}).encode())
        assert e.value.status == 400
    assert asked(["yes\n", "no"]) == "Sure?\n\nLabels: yes\n, no"  # a trailing break, as before


async def test_labels_with_commas_reach_the_fake_engine_as_labels() -> None:
    labels = ["yes, definitely", "no, never", "maybe"]
    async with (
        engine(time_scale=20) as (url, _),
        gateway(endpoint("a", url)) as (gw, _),
    ):
        r = await gw.post("/v1/decide", json={"input": "Sure?", "labels": labels})
        assert r.status_code == 200, r.text
        assert r.json()["label"] in labels


def test_ties_go_to_the_first_label() -> None:
    top = [{"token": "b", "logprob": -1.0}, {"token": "A", "logprob": -1.0}]
    assert decision(["bb", "aa"], top)["label"] == "bb"
    assert decision(["aa", "bb"], top)["label"] == "aa"


async def test_engine_errors_are_passed_through() -> None:
    def busy(request: Request) -> Response:
        return Response('{"error": "busy"}', 429, headers={"retry-after": "3"})

    async with (
        serve(upstream(busy)) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        r = await gw.post("/v1/decide", json={"input": "hm", "labels": ["a", "b"]})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "3" and r.headers[RUN]
        assert r.content == b'{"error": "busy"}'
        assert not shell.state.turns and not shell.state.runs


@pytest.mark.parametrize("kind", ["openai", "classifier"])
async def test_an_engine_refusing_the_gateways_key_is_a_502(kind: str) -> None:
    # helper-137: as a proxied turn's (a 401 is to luftpause's own credentials), for an
    # LLM's label and for a classifier alike.
    def refuse(request: Request) -> Response:
        return Response('{"error": {"message": "Incorrect API key: sk-ab***yz"}}', 401)

    app = upstream(refuse)
    app.post("/classify")(refuse)
    app.get("/health")(lambda: {})  # a classifier's probe
    models = (CLF,) if kind == "classifier" else (MODEL,)
    async with (
        serve(app) as url,
        gateway(endpoint("a", url, kind=kind, models=models)) as (gw, _),
    ):
        # (labels for a generative endpoint; a classifier has its own)
        ask = {"input": "hm"} | ({"labels": ["a", "b"]} if kind == "openai" else {})
        r = await gw.post("/v1/decide", json=ask)
        assert r.status_code == 502 and "sk-" not in r.text
        assert r.json()["error"]["message"] == (
            "engine a: refused luftpause's credentials for it (401); the gateway's operator "
            "should check the endpoint's api_key_env"
        )


async def test_a_redirect_or_an_answer_that_is_no_json_fails_the_turn_as_the_engines() -> None:
    # Taken as finished turns, neither counted toward ejecting the replica (as a
    # proxied turn's would).
    answers = iter(
        [
            Response(b"", 308, headers={"location": "https://elsewhere.example/v1"}),
            Response(b"<html>upgrade</html>", 200, media_type="text/html"),
        ]
    )
    async with (
        serve(upstream(lambda request: next(answers))) as url,
        gateway(endpoint("a", url, kind="openai")) as (gw, shell),
    ):
        r = await gw.post("/v1/decide", json={"input": "hm", "labels": ["a", "b"]})
        assert r.status_code == 502
        assert r.json()["error"]["message"].startswith(
            "engine a: answered 308 (a redirect to https://elsewhere.example/v1); "
            "luftpause does not follow redirects"
        )
        assert shell.state.replicas["a"].failures == 1
        r = await gw.post("/v1/decide", json={"input": "hm", "labels": ["a", "b"]})
        assert r.status_code == 502
        assert r.json()["error"]["message"] == "engine a: answer is not JSON"
        assert shell.state.replicas["a"].failures == 2
        assert not shell.state.turns and not shell.state.runs


async def test_a_turn_admitted_to_a_data_parallel_rank_is_sent_there() -> None:
    async with (
        engine(dp_size=2, time_scale=20) as (url, recorded),
        gateway(endpoint("a", url, dp_size=2)) as (gw, _shell),
    ):
        r = await gw.post("/v1/decide", json={"input": "good?", "labels": ["yes", "no"]})
        assert r.status_code == 200, r.text
        (sent,) = recorded.headers
        assert sent.get("x-data-parallel-rank") in ("0", "1")


async def test_an_engine_that_never_answers_is_given_up_after_the_idle_limit() -> None:
    released = asyncio.Event()

    async def hung(scope: Scope, receive: Receive, send: Send) -> None:
        if await answered_health(scope, send):
            return
        await released.wait()  # accepts the request, never answers

    # Not the engine's fault: a busy engine that reports no load (Ollama) holds it in
    # its queue, and every turn of its model got 503 once it was ejected (helper-128).
    policy = Policy(turn_timeout_s=0.5, eject_after_failures=1, eject_for_s=60)
    async with (
        serve(hung) as url,
        gateway(
            endpoint("a", url, kind="openai"),
            endpoint("c", url, kind="classifier", models=(CLF,)),
            policy=policy,
        ) as (gw, shell),
    ):
        try:
            r = await gw.post("/v1/decide", json={"input": "hm", "labels": ["a", "b"]})
            assert r.status_code == 504 and r.headers[RUN]
            assert r.json() == {"error": {"message": "engine a: no answer within 0.5 s"}}
            assert not shell.state.turns and not shell.state.runs
            assert shell.state.replicas["a"].healthy  # not ejected
            # Counted as what it was (helper-146: a hung engine read as error_status).
            metrics = (await gw.get("/metrics")).text
            assert 'luftpause_turns_total{outcome="timed_out"} 1.0' in metrics
            assert 'luftpause_turns_total{outcome="error_status"} 0.0' in metrics
            r = await gw.post("/v1/decide", json={"input": "hm"})
            assert r.status_code == 504
            assert r.json() == {"error": {"message": "engine c: no answer within 0.5 s"}}
        finally:
            released.set()


# --------------------------------------------------------------------------- classifier


async def test_a_classifier_the_probe_found_down_is_passed_over() -> None:
    async with (
        engine(models=(CLF,), labels=("no", "yes"), instant=True) as (url, recorded),
        gateway(
            endpoint("down", closed_port_url(), kind="classifier", models=(CLF,)),
            endpoint("up", url, kind="classifier", models=(CLF,)),
        ) as (gw, _),
    ):
        r = await gw.post("/v1/decide", json={"input": "x"})
        assert r.status_code == 200, r.text
        assert recorded.bodies == [{"model": CLF, "input": "x"}]


async def test_classify_requests_spread_over_the_classifiers_and_pass_a_dead_one_over() -> None:
    async with contextlib.AsyncExitStack() as stack:
        one = await stack.enter_async_context(engine(models=(CLF,), labels=("no", "yes")))
        two = await stack.enter_async_context(engine(models=(CLF,), labels=("no", "yes")))
        # Probed once at the start (both up), not again within the test.
        gw, _ = await stack.enter_async_context(
            gateway(
                endpoint("one", one[0], kind="classifier", models=(CLF,)),
                endpoint("two", two[0], kind="classifier", models=(CLF,)),
                probe_period=60,
            )
        )
        for i in range(6):  # one at a time: in turn
            r = await gw.post("/v1/decide", json={"input": f"x{i}"})
            assert r.status_code == 200, r.text
        assert (len(one[1].bodies), len(two[1].bodies)) == (3, 3)
        answers = await asyncio.gather(
            *(gw.post("/v1/decide", json={"input": f"y{i}"}) for i in range(8))
        )
        assert all(r.status_code == 200 for r in answers)
        # Together: the fewest in flight first, so neither takes them all.
        assert min(len(one[1].bodies), len(two[1].bodies)) >= 3 + 2

    async with contextlib.AsyncExitStack() as stack:
        one = await stack.enter_async_context(engine(models=(CLF,), labels=("no", "yes")))
        async with engine(models=(CLF,), labels=("no", "yes")) as (dead_url, _):
            gw, _ = await stack.enter_async_context(
                gateway(
                    endpoint("dead", dead_url, kind="classifier", models=(CLF,)),
                    endpoint("one", one[0], kind="classifier", models=(CLF,)),
                    probe_period=60,
                )
            )
        # "dead" stopped after its probe: a request that cannot reach it goes to "one".
        for i in range(4):
            r = await gw.post("/v1/decide", json={"input": f"z{i}"})
            assert r.status_code == 200, r.text
        assert len(one[1].bodies) == 4


async def test_classifier_endpoint() -> None:
    async with (
        engine(models=(CLF,), labels=("negative", "positive"), instant=True) as (url, recorded),
        gateway(endpoint("c", url, kind="classifier", models=(CLF,))) as (gw, shell),
    ):
        r = await gw.post("/v1/decide", json={"input": "what a lovely day"})
        assert r.status_code == 200, r.text
        assert r.headers[RUN]
        body = r.json()
        assert set(body) == {"label", "probabilities", "unscored"} and body["unscored"] == []
        assert body["label"] in ("negative", "positive")
        assert set(body["probabilities"]) == {"0", "1"}  # vLLM's probs carry no names
        assert math.isclose(sum(body["probabilities"].values()), 1.0)
        assert recorded.bodies == [{"model": CLF, "input": "what a lovely day"}]

        same = await gw.post("/v1/decide", json={"input": "what a lovely day", "model": CLF})
        assert same.json() == body
        other = await gw.post("/v1/decide", json={"input": "x", "model": "other"})
        assert other.status_code == 404
        assert other.json()["error"]["message"] == "no classifier serves model 'other'"
        # Labels need a generative model: with none, the turn is refused as the core
        # refuses an unknown model's, and counted so.
        r = await gw.post("/v1/decide", json={"input": "x", "labels": ["yes", "no"]})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["message"] == "no generative endpoint is configured"
        text = (await gw.get("/metrics")).text
        assert 'luftpause_rejected_turns_total{status="404"} 1.0' in text
        assert not shell.state.runs and not shell.state.turns  # never enters run state


async def test_classifier_labels_name_the_probabilities() -> None:
    named = endpoint("c", "", kind="classifier", models=(CLF,), labels=["neg", "pos"])
    async with engine(models=(CLF,), labels=("negative", "positive"), instant=True) as (url, _):
        async with gateway({**named, "url": url}) as (gw, _):
            body = (await gw.post("/v1/decide", json={"input": "lovely"})).json()
            probs = body["probabilities"]
            assert set(probs) == {"neg", "pos"}
            # The label is one of them, not the engine's own name for it (helper-115:
            # vLLM's id2label, LABEL_1, beside probabilities named neg and pos).
            assert body["label"] == max(probs, key=lambda k: probs[k])
        wrong = {**named, "url": url, "labels": ["a", "b", "c"]}
        async with gateway(wrong) as (gw, _):
            r = await gw.post("/v1/decide", json={"input": "lovely"})
            assert r.status_code == 502
            assert "answered 2 probabilities, but the configuration names 3 labels" in r.text


@pytest.mark.parametrize("probs", ["[NaN, 0.5]", "[Infinity, -3]", "[0.2, 1.5]"])
async def test_a_classifier_answering_no_probabilities_is_a_502(probs: str) -> None:
    # Passed on, NaN and Infinity made an answer no strict JSON parser reads.
    def bad(request: Request) -> Response:
        body = '{"data": [{"index": 0, "label": "spam", "probs": ' + probs + "}]}"
        return Response(body, media_type="application/json")

    app = models_only()
    app.post("/classify")(bad)
    app.get("/health")(lambda: Response("ok"))
    async with (
        serve(app) as url,
        gateway(endpoint("c", url, kind="classifier", models=(CLF,))) as (gw, _),
    ):
        r = await gw.post("/v1/decide", json={"input": "x"})
        assert r.status_code == 502, r.text
        assert "probabilities that are not numbers from 0 to 1" in r.json()["error"]["message"]


async def test_decide_turns_take_the_class_header() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, shell):
        seen: list[str] = []
        original = shell.apply

        def watch(event: Any) -> None:
            if type(event).__name__ == "TurnArrived":
                seen.append(event.service_class.value)
            original(event)

        shell.apply = watch  # type: ignore[method-assign]
        body = {"input": "x", "labels": ["yes", "no"]}
        for cls in ("batch", None):
            headers = {"x-luftpause-class": cls} if cls else {}
            r = await gw.post("/v1/decide", json=body, headers=headers)
            assert r.status_code in (200, 422), r.text
        assert seen == ["batch", "interactive"]
        r = await gw.post("/v1/decide", json=body, headers={"x-luftpause-class": "nonsense"})
        assert r.status_code == 400 and "x-luftpause-class must be" in r.json()["error"]["message"]


async def test_no_classifier_and_unreachable_classifier() -> None:
    async with engine(instant=True) as (url, _), gateway(endpoint("a", url)) as (gw, _):
        r = await gw.post("/v1/decide", json={"input": "x"})
        assert r.status_code == 404 and r.headers[RUN]
        assert r.json() == {"error": {"message": "no classifier endpoint is configured"}}
    dead = closed_port_url()
    async with gateway(endpoint("c", dead, kind="classifier", models=(CLF,))) as (gw, _):
        r = await gw.post("/v1/decide", json={"input": "x"})
        assert r.status_code == 502
        assert r.json()["error"]["message"].startswith("engine c: ")


# --------------------------------------------------------------------------- requests


BAD: list[tuple[Any, str]] = [
    ({"labels": ["a", "b"]}, "input: expected a non-empty string"),
    ({"input": ""}, "input: expected a non-empty string"),
    ({"input": "x", "labels": ["a"]}, "labels: expected 2 to 20 distinct labels, got 1"),
    (
        {"input": "x", "labels": [f"l{i}" for i in range(21)]},
        "labels: expected 2 to 20 distinct labels, got 21",
    ),
    (
        {"input": "x", "labels": ["a", "b", "a"]},
        "labels: expected distinct labels (compared without case and surrounding spaces); "
        "repeated: 'a'",
    ),
    (  # scored alike: always 0.5 each (helper-66)
        {"input": "x", "labels": ["Yes", "no", " yes "]},
        "labels: expected distinct labels (compared without case and surrounding spaces); "
        "repeated: ' yes '",
    ),
    ({"input": "x", "labels": ["a", 3]}, "labels[1]: expected a non-empty string"),
    ({"input": "x", "labels": ["a", ""]}, "labels[1]: expected a non-empty string"),
    ({"input": "x", "labels": "a, b"}, "labels: expected a list of 2 to 20 distinct strings"),
    ({"input": "x", "model": 7}, "model: expected a non-empty string"),
    ({"input": "x", "temperature": 0}, "unknown field(s) 'temperature'"),
    ([1, 2], "request body: expected a JSON object"),
    (b"{nope", "request body is not valid JSON"),
]


async def test_bad_requests_and_auth() -> None:
    async with (
        engine(instant=True) as (url, recorded),
        gateway(endpoint("a", url), token="s3cret") as (gw, _),
    ):
        auth = {"authorization": "Bearer s3cret"}
        for payload, expected in BAD:
            if isinstance(payload, bytes):
                r = await gw.post("/v1/decide", content=payload, headers=auth)
            else:
                r = await gw.post("/v1/decide", json=payload, headers=auth)
            assert r.status_code == 400, payload
            assert expected in r.json()["error"]["message"], (payload, r.text)
            assert r.headers[RUN]
        assert recorded.bodies == []

        body = {"input": "x", "labels": ["yes", "no"]}
        for headers in ({}, {"authorization": "Bearer wrong"}):
            denied = await gw.post("/v1/decide", json=body, headers=headers)
            assert denied.status_code == 401 and denied.headers[RUN]
        ok = await gw.post("/v1/decide", json=body, headers=auth)
        assert ok.status_code == 200 and ok.json()["label"] in ("yes", "no")


async def test_no_healthy_replica_is_a_503_that_says_when_the_next_probe_is() -> None:
    async with gateway(
        endpoint("down", closed_port_url()),
        probe_period=None,
        sections={"probes": {"period_s": 4.2}},
    ) as (gw, _):
        r = await gw.post("/v1/decide", json={"input": "hi", "labels": ["yes", "no"]})
        assert (r.status_code, r.headers["retry-after"]) == (503, "5")
        assert "no healthy replica serves model" in r.json()["error"]["message"]
