"""`/v1/chat/completions` bodies: the messages, the chat template that renders them (as
`transformers` renders it), tools and the template options vLLM's server takes
(`add_generation_prompt`, `continue_final_message`, `echo`). Pure: no IO.
"""

import json
from dataclasses import dataclass
from typing import Any

from gateway.openai_request import MAX_LOGPROBS, ApiError, Parsed, _bad, _bool, _common, _int
from gateway.tool_calls import ToolChoice, tool_choice
from pdq.model.grammar import check

# The chat template of a checkpoint without one (the built-in model's): role-tagged turns, the
# tools as JSON first, an assistant's calls in the Hermes format.
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class ChatRequest:
    """A chat body as pdq runs it: `parsed` (its prompt set by the door once the messages are
    rendered), the messages, and how to render and answer them."""

    parsed: Parsed
    messages: list[dict]
    tools: ToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply goes on from the last (assistant) message
    echo: str = ""  # text each choice's content starts with (vLLM's echo: the last message's, same role)


def _tool_calls(field: str, calls: Any) -> list[dict]:
    """An assistant message's `tool_calls`, their arguments as objects where they are JSON text
    (what chat templates index, as vLLM hands them over)."""
    if not isinstance(calls, list):
        raise _bad(field, "a list of {id, type: function, function: {name, arguments}}", calls)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{field}[{j}]", "{id, type: function, function: {name, arguments}}", c)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({"id": c.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def messages_of(body: dict) -> list[dict]:
    """The chat's messages, each {role, content: str} (content parts of type text joined), with
    an assistant's `tool_calls` (its content may then be null) and a tool's `tool_call_id`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of {role, content}", messages)
    out = []
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{field}.role", f"one of {list(ROLES)}", m.get("role") if isinstance(m, dict) else m)
        content = m.get("content")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if content is None and calls:
            content = ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"{field}.content", "a string or a list of {type: text, text} parts", content)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"{field}.content", "a string or a list of {type: text, text} parts", content)
        message = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = _tool_calls(f"{field}.tool_calls", calls)
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def chat(body: dict, served: str, tiers: tuple[str, ...]) -> ChatRequest:
    """A `/v1/chat/completions` body -> its request without the prompt: the caller renders the
    messages with the chat template and sets the prompt (and, when the body has no max_tokens,
    the room left in the context). A tool choice that constrains the output sets its schema."""
    parsed = _common(body, served, tiers, None)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if _bool(body, "logprobs", False):
        parsed.request.sampling.logprobs = top or 0
    elif top is not None:
        raise ApiError(400, "top_logprobs: only with logprobs: true", param="top_logprobs")
    messages = messages_of(body)
    tools = tool_choice(body)
    schema = tools.schema() if tools is not None else None
    if schema is not None:
        sampling = parsed.request.sampling
        if sampling.json_schema or sampling.regex:
            raise ApiError(400, f"tool_choice: {tools.mode} constrains the output to a call; leave out "
                                "response_format / guided_json / guided_regex, or set tool_choice to auto or none",
                           param="tool_choice")
        sampling.json_schema = json.dumps(schema)
        error = check(sampling.json_schema, "")
        if error:
            raise ApiError(400, f"tools: a function's parameters do not compile: {error}", param="tools")
    generation = _bool(body, "add_generation_prompt", True)
    cont = _bool(body, "continue_final_message", False)
    if generation and cont:
        raise ApiError(400, "continue_final_message: set add_generation_prompt to false with it",
                       param="continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message: the last message must be the assistant's to continue",
                       param="continue_final_message")
    role = "assistant" if generation else messages[-1]["role"]
    echo = messages[-1]["content"] if _bool(body, "echo", False) and messages[-1]["role"] == role else ""
    return ChatRequest(parsed, messages, tools, generation, cont, echo)


class ChatTemplate:
    """A checkpoint's chat template (`tokenizer_config.json`), rendered as `transformers` does:
    Jinja2, sandboxed, with `messages`, `tools`, `add_generation_prompt`, `bos_token`,
    `eos_token`, `raise_exception` and a `tojson` that keeps non-ASCII text as it is."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ApiError(400, f"messages: {message}", param="messages")

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = tojson
        self.template = env.from_string(source or DEFAULT_CHAT_TEMPLATE)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_config(cls, config: dict) -> "ChatTemplate":
        """From a parsed tokenizer_config.json (a named list of templates: the "default" one)."""
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)

        def token(name: str) -> str:
            value = config.get(name) or ""
            return value.get("content", "") if isinstance(value, dict) else str(value)

        return cls(source, token("bos_token"), token("eos_token"))

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:
        """The prompt text. continue_final_message: it ends where the last message's content
        ends (what the template put after it, an end-of-turn, cut off), as transformers does."""
        text = self.template.render(messages=messages, tools=tools or None, bos_token=self.bos_token,
                                    eos_token=self.eos_token,
                                    add_generation_prompt=add_generation_prompt and not continue_final_message)
        if continue_final_message:
            final = messages[-1]["content"].strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ApiError(400, "continue_final_message: the chat template does not render the last "
                                    "message's content as it is", param="continue_final_message")
            text = text[:at + len(final)]
        return text

    def render_request(self, req: ChatRequest) -> str:
        return self.render(req.messages, req.tools.template_tools() if req.tools else None,
                           req.add_generation_prompt, req.continue_final_message)
