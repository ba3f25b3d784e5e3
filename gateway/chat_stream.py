"""One chat choice as server-sent deltas: its text as `content`, its tool calls as OpenAI streams
them (the first delta of a call carries its id, type and name; a named function's arguments
stream as they come, "required" calls come whole at the end, "auto" calls when their block
closes). Pure: text in, deltas out.
"""

from gateway.tool_calls import HermesStream, ToolChoice, call, calls_of


class ChatDeltas:
    def __init__(self, tools: ToolChoice | None):
        self.tools = tools
        self.mode = tools.mode if tools is not None else "none"
        self.role_sent = False
        self.calls = 0  # tool calls streamed
        self.text = ""  # "required": the output, parsed at the end
        self.hermes = HermesStream() if self.mode == "auto" else None

    def delta(self, delta: dict) -> dict:
        """A delta of this choice (its first says the role)."""
        if not self.role_sent:
            self.role_sent = True
            return {"role": "assistant", **delta}
        return delta

    def _call(self, name: str, arguments: str) -> dict:
        self.calls += 1
        return self.delta({"tool_calls": [{"index": self.calls - 1, **call(name, arguments)}]})

    def _event(self, event: tuple) -> dict | None:
        if event[0] == "content":
            return self.delta({"content": event[1]})
        return self._call(*event[1:]) if self.tools.parallel or not self.calls else None  # one call at most

    def start(self, echo: str) -> list[dict]:
        """The deltas before the first token: the echoed text, if any."""
        return [self.delta({"content": echo})] if echo else []

    def add(self, text: str) -> list[dict]:
        """The deltas a message's text makes (none while text is held back)."""
        if self.mode == "named":
            if not self.calls:
                return [self._call(self.tools.name, text)]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        if self.mode == "required":
            self.text += text
            return []
        if self.hermes is not None:
            return [d for e in self.hermes.feed(text) if (d := self._event(e)) is not None]
        return [self.delta({"content": text}) if text or not self.role_sent else {}]

    def end(self, reason: str) -> tuple[list[dict], str]:
        """-> (the deltas of what was held back, the finish reason: "tool_calls" when "auto" or
        "required" made a call)."""
        out: list[dict] = []
        if self.mode == "required":
            content, calls = calls_of(self.tools, self.text)
            if calls:
                self.calls = len(calls)
                out.append(self.delta({"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}))
            elif content:
                out.append(self.delta({"content": content}))
        elif self.hermes is not None:
            out = [d for e in self.hermes.finish() if (d := self._event(e)) is not None]
        if self.calls and self.mode in ("auto", "required"):
            reason = "tool_calls"
        return out, reason
