import hashlib
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from pdq.model import BUILTIN_SIZES, build_model, load_hf_model

PROMPTS = ["Hello world", "The queue of requests is long today.", "def f(x):\n    return", "日本語 🙂"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model gains nothing from threads, and they crawl on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def file_hashes(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def greedy(model, ids: list[int], n: int = 16) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_sizes_share_the_tokenizer_and_small_is_the_default_shape():
    assert {s["vocab_size"] for s in BUILTIN_SIZES.values()} == {4096}
    small = BUILTIN_SIZES["small"]
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"]) == (512, 8, 8)


def test_unknown_size_is_rejected():
    with pytest.raises(ValueError, match="tiny"):
        build_model("huge")


def test_saved_checkpoint_loads_with_transformers_and_generates_like_the_built_model(tiny_dir):
    built = build_model("tiny")
    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert isinstance(loaded, LlamaForCausalLM) and loaded.dtype == torch.float32
    assert loaded.config.rope_parameters["rope_theta"] == 10000.0
    assert loaded.generation_config.eos_token_id == 1
    for name, tensor in built.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert greedy(loaded.eval(), ids) == greedy(built, ids)


def test_greedy_output_depends_on_the_prompt_and_does_not_repeat_one_token(tiny_dir):
    model = load_hf_model(tiny_dir)
    assert not model.training
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    outputs = [greedy(model, tok.encode(p), 24) for p in PROMPTS]
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)
    assert all(len(set(o)) >= 8 for o in outputs), outputs


def test_two_builds_in_two_processes_write_identical_files(tiny_dir, tmp_path):
    code = "import sys; from pdq.model import save_builtin; save_builtin(sys.argv[1], 'tiny')"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True)
    assert file_hashes(tmp_path) == file_hashes(tiny_dir)
