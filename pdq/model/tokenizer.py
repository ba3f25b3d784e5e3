"""Loading a checkpoint's tokenizer without torch or transformers (the gateway uses this)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a checkpoint dir (or the file itself) as a
    ``tokenizers.Tokenizer``. ``encode(text).ids`` adds whatever special tokens the file's
    post-processor adds (none for the built-in tokenizer); pass ``add_special_tokens=False``
    to get plain ids for any checkpoint."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"no tokenizer.json at {path}: pdq needs a 'fast' tokenizer file; convert a slow "
            "tokenizer with transformers (AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
        )
    return Tokenizer.from_file(str(file))
