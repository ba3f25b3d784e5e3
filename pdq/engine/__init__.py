"""The model runtime: our Llama-family forward, a paged KV pool, the runner, sampling and an in-process engine."""

from pdq.engine.batch_policy import BatchPolicy, Chunk, SeqView, StepPlan
from pdq.engine.engine import Completion, LLMEngine
from pdq.engine.kv_pool import KVPool, KVPoolFull, KVUsage
from pdq.engine.blocks import BlockManager
from pdq.engine.llama import LlamaModel
from pdq.engine.runner import DecodeItem, ModelRunner, PrefillItem
from pdq.engine.sampling import SamplingParams, sample
from pdq.engine.sequence import Sequence
from pdq.model.arch import ModelSpec, UnsupportedModelError

__all__ = [
    "BatchPolicy",
    "BlockManager",
    "Chunk",
    "Completion",
    "DecodeItem",
    "KVPool",
    "KVPoolFull",
    "KVUsage",
    "LLMEngine",
    "LlamaModel",
    "ModelRunner",
    "ModelSpec",
    "PrefillItem",
    "SamplingParams",
    "SeqView",
    "Sequence",
    "StepPlan",
    "UnsupportedModelError",
    "sample",
]
