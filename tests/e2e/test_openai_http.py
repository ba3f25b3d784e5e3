"""The OpenAI-compatible HTTP door, driven by the official `openai` client: completions and chat,
whole and streamed, the same greedy text as the gRPC door, tenancy from the key, errors as OpenAI
error objects with the right status, and a client that disconnects cancels its request."""

import json
import re
import time
import urllib.error
import urllib.request

import openai
import pytest

from gateway.chat_request import ChatTemplate
from tests.e2e.conftest import KEYS


@pytest.fixture
def oa(cluster):
    with openai.OpenAI(base_url=cluster.base_url, api_key=KEYS["acme"], max_retries=0, timeout=120) as c:
        yield c


def raw(cluster, path: str, body: bytes | None = None, key: str = KEYS["acme"]) -> tuple[int, dict, dict]:
    """-> (status, headers, JSON body) of a hand-made request (for what the client cannot send)."""
    req = urllib.request.Request(cluster.base_url.removesuffix("/v1") + path, data=body,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_health_and_models(cluster, oa):
    assert raw(cluster, "/health")[0] == 200
    assert [m.id for m in oa.models.list().data] == ["builtin"]


def test_a_greedy_completion_is_the_grpc_doors_text(oa, client):
    got = oa.completions.create(model="builtin", prompt="The weather today", max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True})
    want = client.generate("The weather today", max_tokens=12, temperature=0.0, ignore_eos=True)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.id.startswith("cmpl-") and got.model == "builtin"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_tokens, 12)
    assert got.usage.total_tokens == want.prompt_tokens + 12


def test_a_streamed_completion_sends_the_same_text_then_its_usage(oa):
    kw = dict(model="builtin", prompt=[5, 9, 200, 31, 7], max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = oa.completions.create(**kw).choices[0].text
    chunks = list(oa.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_renders_the_template_and_streams_the_same_reply(oa, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    got = oa.chat.completions.create(model="builtin", messages=messages, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    prompt = ChatTemplate(None).render(messages)  # the built-in model's template
    assert got.choices[0].message.role == "assistant" and got.object == "chat.completion"
    assert got.choices[0].message.content == client.generate(prompt, max_tokens=8, temperature=0.0,
                                                             ignore_eos=True).text
    chunks = list(oa.chat.completions.create(model="builtin", messages=messages, max_tokens=8, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content


def test_an_idempotency_key_names_one_request(oa):
    kw = dict(model="builtin", prompt="once", max_tokens=4, temperature=0)
    a = oa.completions.create(**kw, extra_headers={"Idempotency-Key": "http-idem-1"})
    b = oa.completions.create(**kw, extra_headers={"Idempotency-Key": "http-idem-1"})
    assert a.id == b.id and a.choices[0].text == b.choices[0].text
    with pytest.raises(openai.ConflictError):  # the same key for a different request
        oa.completions.create(**{**kw, "prompt": "twice"}, extra_headers={"Idempotency-Key": "http-idem-1"})


@pytest.mark.parametrize("kw, status, param", [
    (dict(temperature=3), 400, "temperature"),
    (dict(n=17), 400, "n"),
    (dict(n=2, best_of=3), 400, "best_of"),
    (dict(logprobs=21), 400, "logprobs"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(prompt=["one", "two"]), 400, "prompt"),
    (dict(prompt=[1, 2, 99999]), 400, "prompt_token_ids[2]"),
    (dict(model="gpt-4"), 404, "model"),
])
def test_bad_fields_are_refused_naming_the_field(oa, kw, status, param):
    with pytest.raises(openai.APIStatusError) as info:
        oa.completions.create(**{"model": "builtin", "prompt": "x", "max_tokens": 4, **kw})
    assert info.value.status_code == status
    assert info.value.body["param"] == param and info.value.body["message"]


def test_a_wrong_key_is_401_and_malformed_bodies_are_400(cluster):
    status, _, body = raw(cluster, "/v1/completions", b'{"model": "builtin", "prompt": "x"}', key="sk-not-a-key")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, _, body = raw(cluster, "/v1/completions", b'{"model": "builtin", "prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = raw(cluster, "/v1/chat/completions",
                          json.dumps({"model": "builtin", "messages": [{"role": "user"}]}).encode())
    assert status == 400 and body["error"]["param"] == "messages[0].content"


def test_a_client_that_disconnects_cancels_its_request(cluster, oa, client):
    stream = oa.completions.create(model="builtin", prompt="a long story", max_tokens=1500, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    rid = first.id.removeprefix("cmpl-")
    stream.close()  # the connection goes: the gateway cancels the request at every hop
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        state = client.get_result(rid, wait_ms=2000).state
        if state != "DECODING" and state != "PREFILLING" and state != "QUEUED":
            break
    assert state == "CANCELLED"


PROMPT_IDS = [5, 9, 200, 31, 7, 5, 9]


def test_stop_token_ids_and_logit_bias_through_both_doors(oa, client):
    ref = client.generate(PROMPT_IDS, max_tokens=10, temperature=0.0, ignore_eos=True)
    stop_at = ref.token_ids[3]
    cut = ref.token_ids.index(stop_at) + 1
    stopped = client.generate(PROMPT_IDS, max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    assert stopped.token_ids == ref.token_ids[:cut] and stopped.finish_reason == "eos"
    http = oa.completions.create(model="builtin", prompt=PROMPT_IDS, max_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True, "stop_token_ids": [stop_at]})
    assert http.choices[0].text == stopped.text and http.usage.completion_tokens == cut
    forced = client.generate(PROMPT_IDS, max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={42: 100.0})
    assert forced.token_ids == [42] * 6
    http = oa.completions.create(model="builtin", prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                 logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert http.choices[0].text == forced.text


def test_min_tokens_holds_back_a_stop_token_through_both_doors(oa, client):
    """The first greedy token made a stop token id ends the output at once; with min_tokens 4 it
    is held back from the first four tokens (prefill's pick and decode's alike)."""
    ref = client.generate(PROMPT_IDS, max_tokens=10, temperature=0.0, ignore_eos=True)
    stop_at = ref.token_ids[0]
    assert client.generate(PROMPT_IDS, max_tokens=10, temperature=0.0, ignore_eos=True,
                           stop_token_ids=[stop_at]).token_ids == [stop_at]
    got = client.generate(PROMPT_IDS, max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at],
                          min_tokens=4)
    assert len(got.token_ids) >= 4 and stop_at not in got.token_ids[:4]
    assert got.finish_reason == "length" or got.token_ids[-1] == stop_at
    http = oa.completions.create(model="builtin", prompt=PROMPT_IDS, max_tokens=10, temperature=0,
                                 extra_body={"ignore_eos": True, "stop_token_ids": [stop_at], "min_tokens": 4})
    assert http.choices[0].text == got.text
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        oa.completions.create(model="builtin", prompt=PROMPT_IDS, max_tokens=3, extra_body={"min_tokens": 4})


def test_penalties_sample_as_the_engine_does(oa, client):
    """The service's greedy tokens with penalties are the in-process engine's with the same ones
    (the same built-in weights): the fields reached the workers, prefill and decode alike."""
    from pdq.engine import LLMEngine, SamplingParams
    from pdq.model.builtin import ensure_builtin

    kw = dict(repetition_penalty=0.2, presence_penalty=-2.0, frequency_penalty=-1.0)  # they favour repeats
    engine = LLMEngine.from_pretrained(str(ensure_builtin("small")), kv_budget_tokens=4096, max_seq_len=2048)
    want = engine.generate([PROMPT_IDS], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, **kw))[0]
    plain = engine.generate([PROMPT_IDS], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert want != plain  # the penalties change this output
    got = client.generate(PROMPT_IDS, max_tokens=24, temperature=0.0, ignore_eos=True, **kw)
    assert got.token_ids == want
    http = oa.completions.create(model="builtin", prompt=PROMPT_IDS, max_tokens=24, temperature=0,
                                 presence_penalty=-2.0, frequency_penalty=-1.0,
                                 extra_body={"ignore_eos": True, "repetition_penalty": 0.2})
    assert http.choices[0].text == got.text


def test_logprobs_come_with_every_token_through_both_doors(oa, client):
    got = client.generate(PROMPT_IDS, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    assert [lp.token_id for lp in got.logprobs] == list(got.token_ids)
    for lp in got.logprobs:  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id and lp.top[0].logprob == lp.logprob <= 0
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
    streamed = [lp for m in client.generate_stream(PROMPT_IDS, max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   logprobs=3) for lp in m.logprobs]
    assert [(lp.token_id, lp.logprob) for lp in streamed] == [(lp.token_id, lp.logprob) for lp in got.logprobs]
    assert not client.generate(PROMPT_IDS, max_tokens=2, temperature=0.0).logprobs  # none unless asked

    http = oa.completions.create(model="builtin", prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True}).choices[0].logprobs
    assert http.token_logprobs == pytest.approx([lp.logprob for lp in got.logprobs], abs=1e-5)
    assert "".join(http.tokens) == got.text and len(http.top_logprobs) == 6 and len(http.top_logprobs[0]) <= 2
    assert http.text_offset[0] == 0 and http.text_offset == sorted(http.text_offset)
    chat = oa.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      temperature=0, logprobs=True, top_logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert len(chat) == 4 and all(len(c.top_logprobs) == 2 and c.logprob == c.top_logprobs[0].logprob for c in chat)
    chunks = list(oa.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4, temperature=0, logprobs=True, stream=True,
                                             extra_body={"ignore_eos": True}))
    assert [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == pytest.approx([c.logprob for c in chat], abs=1e-5)
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


def test_a_full_tenant_queue_is_429_with_retry_after(cluster, other_tenant):
    from pdq.client import OperatorClient
    from tests.e2e.test_operator import paused

    with OperatorClient(cluster.target, api_key=KEYS["ops"]) as op:
        before = {t.tenant: t for t in op.list_tenants()}["globex"]
        op.set_tenant_policy("globex", weight=before.weight, tier=before.tier, max_queued=1)
        try:
            with paused(op, tenant="globex"):
                first = other_tenant.submit("one", max_tokens=2)
                with openai.OpenAI(base_url=cluster.base_url, api_key=KEYS["globex"], max_retries=0) as oa:
                    with pytest.raises(openai.RateLimitError) as info:
                        oa.completions.create(model="builtin", prompt="two", max_tokens=2)
                op.cancel(first)
        finally:
            op.set_tenant_policy("globex", before.weight, before.tier, before.max_queued, before.max_queued_tokens)
    resp = info.value.response
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1
    assert info.value.body["type"] == "rate_limit_error" and "TENANT_QUEUE_FULL" in info.value.body["message"]


def test_n_choices_each_a_completion_of_the_prompt(oa):
    kw = dict(model="builtin", prompt=PROMPT_IDS, max_tokens=8, extra_body={"ignore_eos": True})
    greedy = oa.completions.create(n=3, temperature=0, **kw)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 24 and greedy.usage.prompt_tokens == len(PROMPT_IDS)
    sampled = oa.completions.create(n=3, temperature=1.0, seed=11, **kw)
    again = oa.completions.create(n=3, temperature=1.0, seed=11, **kw)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in sampled.choices}) > 1  # choice i samples with seed + i
    chunks = list(oa.completions.create(n=2, temperature=1.0, seed=11, stream=True,
                                        stream_options={"include_usage": True}, **kw))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in sampled.choices[:2]]
    assert chunks[-1].usage.completion_tokens == 16
    chat = oa.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "hi"}], n=2,
                                      max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content


STRUCT = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


def test_structured_output_parses_and_validates_even_from_a_random_model(oa, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": STRUCT}}
    for seed in range(3):
        got = oa.chat.completions.create(model="builtin", messages=[{"role": "user", "content": f"pick {seed}"}],
                                         max_tokens=64, temperature=1.0, seed=seed, response_format=fmt)
        value = json.loads(got.choices[0].message.content)
        assert set(value) == {"color", "n"} and value["color"] in ("red", "green") and 0 <= value["n"] <= 9
        assert got.choices[0].finish_reason == "stop"
    regex = oa.completions.create(model="builtin", prompt="code:", max_tokens=16, temperature=1.0, seed=3,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}).choices[0].text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex)
    streamed = "".join(c.choices[0].text for c in oa.completions.create(
        model="builtin", prompt="code:", max_tokens=16, temperature=1.0, seed=3, stream=True,
        extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}) if c.choices)
    assert streamed == regex  # the decode worker replays the first token into its own matcher
    grpc_side = client.generate("pick", max_tokens=64, temperature=1.0, seed=5, json_schema=json.dumps(STRUCT))
    assert json.loads(grpc_side.text)["color"] in ("red", "green")


def test_echo_returns_the_prompt_before_the_completion(oa):
    kw = dict(model="builtin", prompt="Echo me", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = oa.completions.create(**kw).choices[0].text
    assert oa.completions.create(echo=True, **kw).choices[0].text == "Echo me" + plain
    assert "".join(c.choices[0].text for c in oa.completions.create(echo=True, stream=True, **kw)) == "Echo me" + plain
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    got = oa.chat.completions.create(model="builtin", messages=turns, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True, "echo": True, "add_generation_prompt": False,
                                                 "continue_final_message": True})
    assert got.choices[0].message.content.startswith("The color is")


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}


def test_tool_calls_named_required_and_auto_even_from_a_random_model(oa):
    """A named function's arguments and "required" calls are constrained to the tools' schemas;
    "auto" parses Hermes calls the model writes (here forced by a regex, as a trained model would)."""
    messages = [{"role": "user", "content": "Weather in Oslo this week?"}]
    kw = dict(model="builtin", messages=messages, tools=[WEATHER, CLOCK], max_tokens=64, temperature=1.0, seed=5)
    named = oa.chat.completions.create(tool_choice={"type": "function", "function": {"name": "weather"}}, **kw)
    call = named.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "weather" and call.type == "function" and call.id.startswith("call_")
    assert args["city"] in ("Oslo", "Lima") and 1 <= args["days"] <= 7 and named.choices[0].message.content is None
    streamed = list(oa.chat.completions.create(tool_choice={"type": "function", "function": {"name": "weather"}},
                                               stream=True, **kw))
    parts = [c.choices[0].delta.tool_calls[0] for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert parts[0].function.name == "weather" and parts[0].id.startswith("call_")
    assert "".join(p.function.arguments for p in parts) == call.function.arguments  # seeded: the same call
    required = oa.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    c = required.message.tool_calls[0]
    assert c.function.name in ("weather", "clock") and isinstance(json.loads(c.function.arguments), dict)
    forced = r'Checking\.<tool_call>\{"name": "clock", "arguments": \{\}\}</tool_call>'
    auto = oa.chat.completions.create(extra_body={"guided_regex": forced}, **kw).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in auto.message.tool_calls] == [("clock", "{}")]
    chunks = list(oa.chat.completions.create(extra_body={"guided_regex": forced}, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(tool_choice={"type": "function", "function": {"name": "nope"}}, **kw)
    assert info.value.body["param"] == "tool_choice"


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(oa):
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model="builtin", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert info.value.body["param"] == "response_format" and "nonsense" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oa.completions.create(model="builtin", prompt="x", max_tokens=4, extra_body={"guided_regex": "("})
    assert info.value.body["param"] == "guided_regex"


def test_a_deadline_that_passes_is_504_and_ends_the_request(oa):
    with pytest.raises(openai.APIStatusError) as info:
        oa.completions.create(model="builtin", prompt="a long story", max_tokens=1500, temperature=0,
                              extra_body={"ignore_eos": True, "timeout_ms": 300})
    assert info.value.status_code == 504 and info.value.body["code"]
