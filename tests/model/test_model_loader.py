import json
import subprocess
import sys

import pytest

from pdq.model import eos_token_ids, resolve_model


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model(str(tmp_path / "nope"))


def test_dir_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unknown_builtin_size_is_a_clear_error():
    with pytest.raises(ValueError, match="size"):
        resolve_model("builtin:huge")


def test_local_checkpoint_dir_resolves_to_itself(tiny_dir):
    assert resolve_model(str(tiny_dir)) == tiny_dir.resolve()


def test_eos_ids_of_the_builtin_model(tiny_dir):
    assert eos_token_ids(tiny_dir) == [1]


@pytest.mark.parametrize(
    "generation, config, expected",
    [
        (None, {"eos_token_id": 2}, [2]),
        ({"eos_token_id": [7, 9, 7]}, {"eos_token_id": 2}, [7, 9]),
        ({"do_sample": True}, {"eos_token_id": [3]}, [3]),
        (None, {}, []),
    ],
)
def test_eos_ids_prefer_generation_config_and_accept_int_or_list(tmp_path, generation, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert eos_token_ids(tmp_path) == expected


def test_gateway_side_imports_do_not_import_torch(tiny_dir):
    code = (
        "import sys; import pdq.model as m; p = m.resolve_model(sys.argv[1]); m.load_tokenizer(p); "
        "m.eos_token_ids(p); assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code, str(tiny_dir)], check=True)
