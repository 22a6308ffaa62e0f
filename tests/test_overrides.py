"""`--set FIELD=VALUE` as users type it: Python's and JSON's spellings read alike, a value that
cannot be read or cannot stand for its field refused with the field's name, never taken silently."""

from __future__ import annotations

import pytest

import remat
from remat.answers.cli import main
from remat.errors import RematError, UnknownModelError
from remat.models import build, parse_overrides, parse_value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("False", False),
        ("false", False),
        ("TRUE", True),
        ("None", None),
        ("null", None),
        ("2", 2),
        ("1e-5", 1e-5),
        (".5", 0.5),
        ("1_000", 1000),
        ("'8B'", "8B"),
        ('"x y"', "x y"),
        ("[1, 2]", [1, 2]),
        ("(1, 2)", (1, 2)),
        ('{"type": "linear"}', {"type": "linear"}),
        ("CrossEntropyLoss", "CrossEntropyLoss"),
        ("image-classification", "image-classification"),
    ],
)
def test_set_reads_python_and_json_spellings_alike(text, value):
    assert parse_value("field", text) == value
    assert type(parse_value("field", text)) is type(value)


@pytest.mark.parametrize("text", ["2x", "[1, 2", "", "a b", "{'a':"])
def test_set_refuses_a_value_it_cannot_read_naming_the_field(text):
    with pytest.raises(RematError, match="--set my_field="):
        parse_overrides([f"my_field={text}"])


def test_set_false_turns_a_preset_flag_off():
    """`expand_kv=False` (SDPA's enable_gqa, no K/V copies per group) saves less than the default
    True; read as the string "False" it was true and changed nothing."""

    def saved(items):
        model, inputs = build("llama-3.2-1b", tiny=True, seq=32, **parse_overrides(items))
        return remat.estimate(remat.trace(model, *inputs)).activation_bytes

    assert saved(["n_kv_heads=2", "expand_kv=False"]) < saved(["n_kv_heads=2"])
    assert saved(["n_kv_heads=2", "expand_kv=false"]) == saved(["n_kv_heads=2", "expand_kv=False"])


def test_a_preset_refuses_a_value_of_the_wrong_type_naming_the_field():
    with pytest.raises(RematError, match="expand_kv"):
        build("llama-3.2-1b", tiny=True, **parse_overrides(["expand_kv=yes"]))
    with pytest.raises(RematError, match="n_layers"):
        build("llama-3.2-1b", tiny=True, **parse_overrides(["n_layers=two"]))


def test_torchtitan_takes_none_and_false_as_typed():
    pytest.importorskip("torchtitan")
    items = ["n_layers=1", "dim=256", "n_heads=16", "ffn_dim_multiplier=None", "fuse_qkv=False"]
    model, _ = build("torchtitan:llama3:debugmodel", seq=32, **parse_overrides(items))
    names = {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters()}
    assert {"wq", "wk", "wv"} <= names and "wqkv" not in names
    with pytest.raises(RematError, match="fuse_qkv"):
        build("torchtitan:llama3:debugmodel", **parse_overrides(["fuse_qkv=no"]))


def test_hf_config_validation_is_one_line_naming_the_field(capsys):
    pytest.importorskip("transformers")
    for text, tied in (("False", False), ("true", True)):
        model, _ = build("hf:llama", tiny=True, **parse_overrides([f"tie_word_embeddings={text}"]))
        inner = model.model
        assert (inner.lm_head.weight is inner.model.embed_tokens.weight) is tied
    with pytest.raises(UnknownModelError, match="tie_word_embeddings") as err:
        build("hf:llama", tiny=True, tie_word_embeddings="maybe")
    assert "\n" not in str(err.value)
    argv = ["estimate", "--model", "hf:llama", "--tiny", "--set", "tie_word_embeddings=maybe"]
    assert main(argv) == 2
    message = capsys.readouterr().err
    assert "hf:llama:" in message and "Traceback" not in message  # the name, not rich's emoji
