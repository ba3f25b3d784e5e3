"""OpenAI request bodies -> pdq requests (pure): defaults as OpenAI's, every bad field named,
features pdq lacks refused unless neutral, chat templates rendered as transformers renders them."""

import pytest

from gateway.chat_request import ChatTemplate, chat, messages_of
from gateway.openai_request import ApiError, completion

TIERS = ("interactive", "batch")


def test_completion_defaults_are_openais():
    p = completion({"model": "m", "prompt": "hi"}, "m", TIERS)
    s = p.request.sampling
    assert (p.request.prompt, s.max_tokens, s.temperature, s.top_p, s.top_k) == ("hi", 16, 1.0, 1.0, 0)
    assert not p.stream and not p.include_usage and not p.request.request_id and not p.request.tier


def test_completion_fields_map_to_the_request():
    p = completion({"model": "m", "prompt": [[4, 5, 6]], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                    "top_k": -1, "seed": -1, "stop": "END", "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "request_id": "r-1", "priority": 1,
                    "n": 1, "logprobs": None, "user": "ignored"}, "m", TIERS)
    s = p.request.sampling
    assert list(p.request.prompt_token_ids) == [4, 5, 6] and s.max_tokens == 7 and s.temperature == 0
    assert (s.top_p, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (0.5, 0, 2**64 - 1, ["END"], True)
    assert p.stream and p.include_usage and p.request.request_id == "r-1" and p.request.tier == "batch"


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "m"}, 400, "prompt"),
    ({"model": "m", "prompt": ""}, 400, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": True}, 400, "top_p"),
    ({"model": "m", "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "m", "prompt": "x", "tier": "gold"}, 400, "tier"),
    ({"model": "m", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ({"model": "m", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": "m", "prompt": "x", "guided_json": {"type": "nonsense"}}, 400, "guided_json"),
    ({"model": "m", "prompt": "x", "guided_json": {}, "guided_regex": "a"}, 400, "guided_regex"),
])
def test_bad_completion_bodies_name_their_field(body, status, param):
    with pytest.raises(ApiError) as info:
        completion(body, "m", TIERS)
    assert (info.value.status, info.value.param) == (status, param) and info.value.message


def test_chat_messages_and_their_errors():
    req = chat({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]}, "m", TIERS)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert req.parsed.request.sampling.max_tokens == 0  # the door fills in the room the context leaves
    for bad, param in (([], "messages"), ([{"role": "user"}], "messages[0].content"),
                       ([{"role": "king", "content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content")):
        with pytest.raises(ApiError) as info:
            messages_of({"messages": bad})
        assert info.value.param == param


def test_chat_templates_render_as_transformers_does():
    default = ChatTemplate.from_config({})
    assert default.render([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    qwen_like = ChatTemplate.from_config({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>",
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]"
                                                          "{{ m['content'] }}{{ eos_token }}{% endfor %}"}]})
    assert qwen_like.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi</s>"
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                          "{% endif %}ok")
    with pytest.raises(ApiError, match="first must be user"):
        strict.render([{"role": "system", "content": "x"}])
    with pytest.raises(Exception):  # the sandbox: no attribute access to Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_echo_and_continuing_the_last_message():
    assert completion({"model": "m", "prompt": "x", "echo": True}, "m", TIERS).echo
    with pytest.raises(ApiError) as info:
        completion({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "m", TIERS)
    assert info.value.param == "echo"
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    cont = chat({"model": "m", "messages": turns, "add_generation_prompt": False, "continue_final_message": True,
                 "echo": True}, "m", TIERS)
    assert cont.echo == "The color is"  # the reply's role is the last message's: it comes back first
    assert ChatTemplate(None).render_request(cont) == "<|user|>\nName a color.\n<|assistant|>\nThe color is"
    assert chat({"model": "m", "messages": turns[:1], "echo": True}, "m", TIERS).echo == ""  # a user's: not echoed
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"add_generation_prompt": "yes"}, "add_generation_prompt")):
        with pytest.raises(ApiError) as info:
            chat({"model": "m", "messages": turns, **body}, "m", TIERS)
        assert info.value.param == param
    with pytest.raises(ApiError, match="last message must be the assistant's"):
        chat({"model": "m", "messages": turns[:1], "add_generation_prompt": False, "continue_final_message": True},
             "m", TIERS)
