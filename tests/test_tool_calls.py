"""Tools on the chat door (pure): tools and tool_choice checked, the constraint a choice sets, and
outputs split into content and calls, whole or as stream deltas."""

import json

import pytest

from gateway.chat_request import ChatTemplate, chat
from gateway.chat_stream import ChatDeltas
from gateway.openai_request import ApiError
from gateway.tool_calls import HermesStream, calls_of, tool_choice

WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}
BODY = {"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}]}


def test_tool_choice_modes_and_the_schema_each_constrains_to():
    assert tool_choice({}) is None and tool_choice({"tools": [], "tool_choice": "none"}) is None
    auto = tool_choice({"tools": [WEATHER, CLOCK]})
    assert auto.mode == "auto" and auto.schema() is None and auto.template_tools() == [WEATHER, CLOCK]
    named = tool_choice({"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    assert named.mode == "named" and named.schema() == WEATHER["function"]["parameters"]
    required = tool_choice({"tools": [WEATHER, CLOCK], "tool_choice": "required"}).schema()
    assert required["type"] == "array" and required["minItems"] == 1
    assert [v["properties"]["name"]["const"] for v in required["items"]["anyOf"]] == ["weather", "clock"]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}  # none given
    assert "maxItems" not in required
    assert tool_choice({"tools": [CLOCK], "tool_choice": "required", "parallel_tool_calls": False}).schema()["maxItems"] == 1
    one = tool_choice({"tools": [CLOCK], "parallel_tool_calls": False})
    assert len(calls_of(one, '<tool_call>{"name": "clock"}</tool_call>' * 2)[1]) == 1


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [CLOCK, CLOCK]}, "tools"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice"),
    ({"tools": [CLOCK], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_name_their_field(body, param):
    with pytest.raises(ApiError) as info:
        tool_choice(body)
    assert info.value.status == 400 and info.value.param == param


def test_a_tool_choice_that_constrains_sets_the_requests_schema():
    req = chat({**BODY, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}}},
               "m", ("interactive",))
    assert json.loads(req.parsed.request.sampling.json_schema) == WEATHER["function"]["parameters"]
    assert chat({**BODY, "tools": [WEATHER]}, "m", ("interactive",)).parsed.request.sampling.json_schema == ""
    with pytest.raises(ApiError, match="tool_choice") as info:
        chat({**BODY, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
             "m", ("interactive",))
    assert info.value.param == "tool_choice"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(ApiError) as info:
        chat({**BODY, "tools": [bad], "tool_choice": "required"}, "m", ("interactive",))
    assert info.value.param == "tools"


def test_hermes_calls_are_split_from_content_however_the_text_is_cut():
    text = 'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call> <tool_call>oops'
    for cut in range(1, len(text) + 1):  # every split into two pieces
        stream = HermesStream()
        events = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert "".join(e[1] for e in events if e[0] == "content") == "Let me look. <tool_call>oops"
        assert [e[1:] for e in events if e[0] == "call"] == [("weather", '{"city": "Oslo"}')]
    stream = HermesStream()
    assert stream.feed("a <tool_call>not json</tool_call> b") + stream.finish() == [
        ("content", "a "), ("content", "<tool_call>not json</tool_call>"), ("content", " b")]


def test_whole_outputs_become_calls():
    auto, named, required = (tool_choice({"tools": [WEATHER, CLOCK], "tool_choice": c}) for c in
                             ("auto", {"type": "function", "function": {"name": "clock"}}, "required"))
    assert calls_of(auto, "just text") == ("just text", [])
    content, calls = calls_of(auto, '<tool_call>{"name": "clock", "arguments": {}}</tool_call>')
    assert content is None and [(c["type"], c["function"]) for c in calls] == [("function", {"name": "clock",
                                                                                             "arguments": "{}"})]
    assert calls[0]["id"].startswith("call_")
    content, calls = calls_of(named, '{"tz":"UTC"}')
    assert content is None and calls[0]["function"] == {"name": "clock", "arguments": '{"tz":"UTC"}'}
    content, calls = calls_of(required, '[{"name":"weather","parameters":{"city":"Oslo"}},{"name":"clock","parameters":{}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("clock", {})]
    assert calls_of(required, '[{"name":"wea') == ('[{"name":"wea', [])  # cut by max_tokens: no call


def test_stream_deltas_carry_calls_as_openai_streams_them():
    named = ChatDeltas(tool_choice({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "clock"}}}))
    first, = named.add('{"tz"')
    assert first["role"] == "assistant" and first["tool_calls"][0]["function"] == {"name": "clock", "arguments": '{"tz"'}
    assert named.add(':"UTC"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": ':"UTC"}'}}]}]
    assert named.end("stop") == ([], "stop")
    required = ChatDeltas(tool_choice({"tools": [CLOCK], "tool_choice": "required"}))
    assert required.add('[{"name":"clock",') == [] and required.add('"parameters":{}}]') == []
    held, reason = required.end("stop")
    assert reason == "tool_calls" and held[0]["tool_calls"][0]["function"] == {"name": "clock", "arguments": "{}"}
    auto = ChatDeltas(tool_choice({"tools": [CLOCK]}))
    assert auto.add("Hi <tool") == [{"role": "assistant", "content": "Hi "}]
    out = auto.add('_call>{"name": "clock"}</tool_call>')
    assert out[0]["tool_calls"][0]["function"] == {"name": "clock", "arguments": "{}"}
    assert auto.end("stop") == ([], "tool_calls")
    plain = ChatDeltas(None)
    assert plain.start("Sure: ") == [{"role": "assistant", "content": "Sure: "}]
    assert plain.add("x") == [{"content": "x"}] and plain.add("") == [{}] and plain.end("length") == ([], "length")


def test_the_default_template_renders_tools_and_calls():
    rendered = ChatTemplate(None).render(
        [{"role": "user", "content": "Oslo?"},
         {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], tools=[WEATHER])
    assert rendered.startswith("<|tools|>\n" + json.dumps([WEATHER]) + "\n<|user|>\nOslo?\n")
    assert '<|assistant|>\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n' in rendered
    assert rendered.endswith("<|tool|>\nsunny\n<|assistant|>\n")
