"""What end-to-end tests check the service against: transformers' own greedy `generate()` of one
request alone, and the samples a process serves on its Prometheus /metrics endpoint."""

import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from pdq.model.loader import load_hf_model, resolve_model


def reference(model: str = "builtin") -> tuple:
    """(HF model, tokenizer) of a built-in model or checkpoint, as every worker loads it."""
    from transformers import AutoTokenizer

    path = resolve_model(model)
    return load_hf_model(path), AutoTokenizer.from_pretrained(path)


def hf_greedy(reference: tuple, prompt: str, n: int) -> list[int]:
    """Exactly `n` greedy tokens after `prompt`, the model alone on this one request."""
    model, tok = reference
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def scrape(url: str) -> dict:
    """{(sample name, frozenset of labels): value}"""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
