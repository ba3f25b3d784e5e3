"""Turning a ``--model`` spec into a checkpoint dir, and loading what is in it.

Importing this module does not import torch or transformers: ``resolve_model`` of a cached
built-in model and ``eos_token_ids`` stay torch-free (the gateway uses them). Only
``load_hf_model``, and ``resolve_model`` when it must build the built-in model the first
time, import torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pdq.model.builtin import ensure_builtin
from pdq.model.null import ensure_null, is_null_spec

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

BUILTIN = "builtin"


def resolve_model(spec: str) -> Path:
    """``"builtin"`` -> the cached built-in ``small`` checkpoint (built on first use);
    ``"builtin:SIZE"`` -> that size; ``"null"`` / ``"null:STEP_MS"`` -> the cached null model's
    dir (`pdq.model.null`: no compute, STEP_MS per forward pass); anything else must be a local
    Hugging Face checkpoint dir with a config.json (``ValueError`` otherwise; nothing is downloaded)."""
    if is_null_spec(spec):
        return ensure_null(spec)
    if spec == BUILTIN or spec.startswith(BUILTIN + ":"):
        return ensure_builtin(spec.partition(":")[2] or "small")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {spec!r} is not a directory; expected 'builtin', 'builtin:SIZE', "
            "'null', 'null:STEP_MS' or the path of a local Hugging Face checkpoint dir"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model dir {str(path)!r} has no config.json; is it a Hugging Face checkpoint?")
    return path.resolve()


def load_hf_model(path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None) -> PreTrainedModel:
    """Load a causal LM in eval mode on ``device``. ``dtype`` None means float32 (not the
    checkpoint's own dtype); a string such as ``"bfloat16"`` names a torch dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def eos_token_ids(path: str | Path) -> list[int]:
    """The checkpoint's end-of-sequence ids: generation_config.json's ``eos_token_id`` if
    set, else config.json's (either may be an int or a list); ``[]`` if neither has one."""
    path = Path(path)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        if eos is not None:
            ids = [eos] if isinstance(eos, int) else list(eos)
            return list(dict.fromkeys(ids))
    return []
