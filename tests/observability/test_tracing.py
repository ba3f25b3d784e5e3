"""One trace per request across the gateway, scheduler, prefill and decode processes, as an
OTLP collector receives it; and a cancelled request's trace shows the cancellation."""

import json
import secrets
import urllib.request

import grpc
import pytest

from tests.streams import streamed

SERVICES = {"pdq-gateway", "pdq-scheduler", "pdq-prefill", "pdq-decode"}
HOPS = ("pdq.v1.Generation/GenerateStream", "pdq.stream", "pdq.v1.Scheduler/Submit", "pdq.enqueue",
        "pdq.queue_wait", "pdq.prefill", "pdq.kv_transfer", "pdq.kv_receive", "pdq.decode")


def _has(trace_id: str, names, spans) -> bool:
    got = {s.name for s in spans if s.trace_id == trace_id}
    return all(n in got for n in names)


def _one(spans, name):
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {found}"
    return found[0]


def test_one_trace_spans_every_hop(client, collector):
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    client.metadata.append(("traceparent", f"00-{trace_id}-{caller_span}-01"))
    prompt = "a secret prompt about observability"
    msgs = list(client.generate_stream(prompt, max_tokens=6, ignore_eos=True))
    rid = msgs[0].request_id
    assert streamed(msgs)[0] == list(range(6))

    collector.wait_for(lambda spans: _has(trace_id, HOPS, spans))
    spans = collector.trace(trace_id)
    assert {s.service for s in spans} == SERVICES

    gw = _one(spans, "pdq.v1.Generation/GenerateStream")
    assert (gw.service, gw.kind, gw.parent_id) == ("pdq-gateway", "SERVER", caller_span)  # continued the caller's trace
    assert gw.attributes["pdq.request_id"] == rid
    assert gw.attributes["pdq.tenant"] == "default" and gw.attributes["pdq.tier"] == "interactive"
    assert gw.attributes["gen_ai.request.max_tokens"] == 6
    assert gw.attributes["gen_ai.usage.output_tokens"] == 6
    assert gw.attributes["gen_ai.usage.input_tokens"] > 0
    assert gw.status != "ERROR"

    stream = _one(spans, "pdq.stream")
    assert stream.parent_id == gw.span_id and stream.event("first_token") is not None

    submit = _one(spans, "pdq.v1.Scheduler/Submit")
    assert (submit.service, submit.kind, submit.parent_id) == ("pdq-scheduler", "SERVER", gw.span_id)
    enqueue = _one(spans, "pdq.enqueue")
    assert enqueue.parent_id == submit.span_id

    wait = _one(spans, "pdq.queue_wait")
    assert wait.service == "pdq-scheduler" and wait.parent_id == gw.span_id
    prefill = _one(spans, "pdq.prefill")
    assert prefill.service == "pdq-prefill" and prefill.parent_id == gw.span_id
    assert prefill.attributes["pdq.request_id"] == rid and prefill.event("first_token") is not None
    assert wait.start_ns <= enqueue.end_ns and wait.end_ns <= prefill.start_ns

    kv = _one(spans, "pdq.kv_transfer")
    assert kv.parent_id == gw.span_id and kv.kind == "CLIENT"
    assert kv.attributes["pdq.kv.bytes"] > 0 and kv.attributes["pdq.kv.chunks"] >= 3
    assert kv.attributes["pdq.kv.transport"] == "tcp"  # the default: the decode worker's TCP data plane
    receive = _one(spans, "pdq.kv_receive")
    assert (receive.service, receive.kind, receive.parent_id) == ("pdq-decode", "SERVER", kv.span_id)
    assert receive.attributes["pdq.request_id"] == rid and receive.attributes["pdq.kv.bytes"] == kv.attributes["pdq.kv.bytes"]

    decode = _one(spans, "pdq.decode")
    assert decode.service == "pdq-decode" and decode.parent_id == gw.span_id
    assert [n for n, _ in decode.events if n in ("first_token", "finish")] == ["first_token", "finish"]
    assert decode.event("finish")["pdq.reason"] == "length"
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6

    # the request's prefill ran in a batch: each links to the other, across traces
    assert len(prefill.links) == 1
    batch_trace, batch_span = prefill.links[0]
    everything = collector.wait_for(lambda all_: any(s.span_id == batch_span for s in all_))
    batch = next(s for s in everything if s.span_id == batch_span)
    assert batch.name == "pdq.prefill_batch" and batch.trace_id == batch_trace != trace_id
    assert (trace_id, gw.span_id) in batch.links
    dispatch = collector.wait_for(lambda all_: any(s.name == "pdq.dispatch" and (trace_id, gw.span_id) in s.links
                                                   for s in all_))
    dispatch = next(s for s in dispatch if s.name == "pdq.dispatch" and (trace_id, gw.span_id) in s.links)
    assert dispatch.service == "pdq-scheduler" and dispatch.trace_id == batch.trace_id  # the batch's own trace

    # no prompt or output text unless PDQ_TRACE_CONTENT=1
    text = "".join(m.text for m in msgs)
    for s in spans:
        for value in list(s.attributes.values()) + [v for _, a in s.events for v in a.values()]:
            assert "secret prompt" not in str(value) and (not text.strip() or text not in str(value))


def test_cancelled_request_trace_shows_the_cancellation(client, collector):
    stream = client.generate_stream("cancel me", max_tokens=1500, ignore_eos=True)
    rid, tokens = "", 0
    for msg in stream:
        rid = msg.request_id
        tokens += len(streamed([msg])[1])
        if tokens >= 3:
            break
    stream.close()  # closing the stream cancels the request

    def gateway_span(spans):
        return next((s for s in spans if s.name == "pdq.v1.Generation/GenerateStream"
                     and s.attributes.get("pdq.request_id") == rid), None)

    collector.wait_for(lambda spans: gateway_span(spans) is not None)
    gw = gateway_span(collector.spans)
    collector.wait_for(lambda spans: _has(gw.trace_id, ("pdq.cancel", "pdq.decode"), spans))
    spans = collector.trace(gw.trace_id)

    assert gw.status == "ERROR" and gw.event("cancelled")["pdq.reason"] == "client disconnected"
    cancel = _one(spans, "pdq.cancel")
    assert cancel.service == "pdq-scheduler" and cancel.parent_id == gw.span_id
    assert cancel.event("cancelled")["pdq.state"] == "CANCELLED"
    decode = _one(spans, "pdq.decode")
    assert decode.event("dropped") is not None and decode.event("finish") is None


def test_rejected_request_is_an_error_span(client, collector):
    trace_id = secrets.token_hex(16)
    client.metadata.append(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"))
    with pytest.raises(grpc.RpcError) as err:
        client.generate("too long", max_tokens=100_000)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    collector.wait_for(lambda spans: _has(trace_id, ("pdq.v1.Generation/Generate",), spans))
    gw = _one(collector.trace(trace_id), "pdq.v1.Generation/Generate")
    assert gw.status == "ERROR" and gw.event("rejected")["pdq.reason"] == "MAX_TOKENS_TOO_LARGE"


def test_a_request_through_the_http_door_is_one_trace_too(traced_cluster, collector):
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    body = json.dumps({"model": "builtin", "prompt": "traced over HTTP", "max_tokens": 5, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(traced_cluster.base_url + "/completions", data=body, headers={
        "Authorization": f"Bearer {traced_cluster.client_key}", "Content-Type": "application/json",
        "traceparent": f"00-{trace_id}-{caller_span}-01"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        rid = json.loads(resp.read())["id"].removeprefix("cmpl-")
    hops = ("POST /v1/completions", "pdq.stream", "pdq.v1.Scheduler/Submit", "pdq.queue_wait", "pdq.prefill",
            "pdq.decode")
    collector.wait_for(lambda spans: _has(trace_id, hops, spans))
    spans = collector.trace(trace_id)
    door = _one(spans, "POST /v1/completions")
    assert (door.service, door.kind, door.parent_id) == ("pdq-gateway", "SERVER", caller_span)
    assert door.attributes["pdq.request_id"] == rid and door.attributes["gen_ai.usage.output_tokens"] == 5
    assert _one(spans, "pdq.v1.Scheduler/Submit").parent_id == door.span_id
    assert _one(spans, "pdq.decode").parent_id == door.span_id


def test_requests_submitted_together_each_keep_one_whole_trace(traced_cluster, collector):
    """Submits at hand together go to the scheduler in one SubmitMany (gateway.submits): each
    request's enqueue span is still in its own trace, under its gateway span or its Submit's."""
    import asyncio

    from pdq.client import AsyncClient, Client

    traces = [(secrets.token_hex(16), secrets.token_hex(8)) for _ in range(8)]

    async def one(client, trace_id, parent):
        return await client.stub.Generate(Client.request("together", max_tokens=2, ignore_eos=True), timeout=60,
                                          metadata=(*client.metadata, ("traceparent", f"00-{trace_id}-{parent}-01")))

    async def burst():
        client = AsyncClient(traced_cluster.target)
        try:
            return await asyncio.gather(*(one(client, t, p) for t, p in traces))
        finally:
            await client.close()

    assert [len(r.token_ids) for r in asyncio.run(burst())] == [2] * len(traces)
    for trace_id, parent in traces:
        collector.wait_for(lambda spans: _has(trace_id, ("pdq.v1.Generation/Generate", "pdq.enqueue", "pdq.decode"),
                                              spans))
        spans = collector.trace(trace_id)
        gw, enqueue = _one(spans, "pdq.v1.Generation/Generate"), _one(spans, "pdq.enqueue")
        assert gw.parent_id == parent
        submit = [s for s in spans if s.name == "pdq.v1.Scheduler/Submit"]
        assert enqueue.parent_id == (submit[0].span_id if submit else gw.span_id)
