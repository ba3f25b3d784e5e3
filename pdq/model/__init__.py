"""The model package: the built-in model and tokenizer, checkpoint loading, detokenization.

Importing it does not import torch or transformers (the gateway imports it); only building
the built-in model and ``load_hf_model`` do.
"""

from pdq.model.builtin import BUILTIN_SIZES, build_model, build_tokenizer, ensure_builtin, save_builtin
from pdq.model.detokenizer import IncrementalDetokenizer, StopChecker
from pdq.model.loader import eos_token_ids, load_hf_model, resolve_model
from pdq.model.tokenizer import load_tokenizer

__all__ = [
    "BUILTIN_SIZES",
    "IncrementalDetokenizer",
    "StopChecker",
    "build_model",
    "build_tokenizer",
    "ensure_builtin",
    "eos_token_ids",
    "load_hf_model",
    "load_tokenizer",
    "resolve_model",
    "save_builtin",
]
