"""The model zoo: presets build at full size on meta with their published parameter counts, train
tiny on a CPU, and every way to name a model that cannot work says why."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from remat.errors import RematError, UnknownModelError
from remat.models import PRESETS, build, preset_names


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights appear once


PUBLISHED_PARAMS = {
    "gpt2": 124.44e6,
    "gpt2-medium": 354.82e6,
    "gpt2-large": 774.03e6,
    "gpt2-xl": 1557.6e6,
    "llama-2-7b": 6.738e9,
    "llama-3.2-1b": 1.236e9,
    "llama-3.1-8b": 8.030e9,
    "llama-3.1-70b": 70.55e9,
    "llama-3.1-405b": 405.85e9,  # 126 layers, d 16384, 128 heads, 8 K/V heads, FFN 53248
    "resnet50": 25.557e6,
    "resnet18": 11.690e6,  # torchvision's resnet18
    "convnext-t": 28.589e6,  # torchvision's convnext_tiny
    "vit-b-16": 86.57e6,
}


# --- presets ---------------------------------------------------------------------------------


def test_preset_names_are_the_sorted_registry():
    assert preset_names() == sorted(PRESETS)
    assert set(PUBLISHED_PARAMS) < set(PRESETS)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds_full_size_on_meta_in_training_mode(name):
    model, inputs = build(name)
    assert model.training
    assert all(p.device.type == "meta" for p in model.parameters())
    assert isinstance(inputs, tuple) and inputs
    assert all(x.device.type == "meta" and not x.requires_grad for x in inputs)


@pytest.mark.parametrize("name, count", PUBLISHED_PARAMS.items())
def test_presets_have_their_published_parameter_counts(name, count):
    model, _ = build(name)
    assert n_params(model) == pytest.approx(count, rel=2e-3)


def test_llama_70b_builds_on_meta_without_memory():
    # its speed (under 2 s) is a target in benchmarks/solver_speed.py, not a test
    model, _ = build("llama-3.1-70b")
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.parametrize("name", preset_names())
def test_every_tiny_preset_trains_on_cpu_with_finite_grads(name):
    model, inputs = build(name, tiny=True, device="cpu", batch=2, seq=32)
    assert n_params(model) < 2e6
    model(*inputs).float().sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize(
    "name, shape, dtype",
    [
        ("gpt2", (3, 64), torch.long),
        ("llama-3.1-8b", (3, 64), torch.long),
        ("resnet50", (3, 3, 224, 224), torch.bfloat16),
        ("vit-b-16", (3, 3, 224, 224), torch.bfloat16),
        ("mlp-chain-16", (3, 512), torch.bfloat16),
        ("megatron-gpt", (64, 3, 1024), torch.bfloat16),
    ],
)
def test_example_inputs_have_the_documented_layout_and_dtype(name, shape, dtype):
    model, (x, *labels) = build(name, batch=3, seq=64, dtype="bf16")
    assert (tuple(x.shape), x.dtype) == (shape, dtype)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # the presets trained on a loss take labels: next-token ids, or one class an image
    expected = {"gpt2": (3, 64), "llama-3.1-8b": (3, 64), "resnet50": (3,), "vit-b-16": (3,)}
    assert [(tuple(t.shape), t.dtype) for t in labels] == (
        [(expected[name], torch.long)] if name in expected else []
    )


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_accepts_torch_dtypes_and_their_short_and_long_names(dtype, expected):
    model, (x,) = build("mlp-chain-2", dtype=dtype)
    assert model.layers[0].linear.weight.dtype == expected == x.dtype


def test_non_float_dtype_is_refused():
    with pytest.raises(RematError, match="'int8' is not a float type"):
        build("gpt2", dtype="int8")


def test_token_inputs_are_ids_inside_the_vocabulary():
    _, (ids, labels) = build("gpt2", tiny=True, device="cpu", batch=4, seq=256)
    for t in (ids, labels):
        assert t.dtype == torch.long and t.min() >= 0 and t.max() < 512


@pytest.mark.parametrize(
    "name, modules",
    [
        (
            "gpt2",
            "wte wpe drop h.11 h.0.ln_1 h.0.attn.c_attn h.0.attn.c_proj h.0.ln_2 h.0.mlp.c_fc "
            "h.0.mlp.gelu h.0.mlp.c_proj ln_f lm_head",
        ),
        (
            "llama-3.1-8b",
            "embed_tokens layers.31 layers.0.input_layernorm layers.0.self_attn.q_proj "
            "layers.0.self_attn.k_proj layers.0.self_attn.v_proj layers.0.self_attn.o_proj "
            "layers.0.post_attention_layernorm layers.0.mlp.gate_proj layers.0.mlp.up_proj "
            "layers.0.mlp.down_proj norm lm_head",
        ),
        (
            "resnet50",
            "conv1 bn1 relu maxpool layer1.2.conv3 layer2.3 layer3.5 layer4.0.downsample avgpool fc",
        ),
        ("vit-b-16", "patch_embed blocks.11.ln_1 blocks.0.attn.qkv blocks.0.mlp.fc2 norm head"),
        ("mlp-chain-16", "layers.15.linear layers.15.relu"),
        (
            "megatron-gpt",
            "layers.3.ln_1 layers.3.qkv layers.3.attn_dropout layers.3.proj layers.3.out_dropout "
            "layers.3.ln_2 layers.3.fc1 layers.3.gelu layers.3.fc2 layers.3.mlp_dropout",
        ),
    ],
)
def test_modules_carry_the_documented_names(name, modules):
    model, _ = build(name)
    assert set(modules.split()) <= dict(model.named_modules()).keys()


def test_embeddings_are_tied_where_the_published_model_ties_them():
    def tied(name):
        model, _ = build(name)
        embedding = model.wte if name == "gpt2" else model.embed_tokens
        return model.lm_head.weight is embedding.weight

    assert tied("gpt2") and tied("llama-3.2-1b")
    assert not tied("llama-3.1-8b") and not tied("llama-2-7b")


def test_llama_rope_tables_cover_seq_and_stay_out_of_the_state_dict():
    # sized to the run's sequence as torchtitan sizes it, not to the preset's 8192 positions
    # (which a pipeline's every stage held unseen: +22-24% on a tiny stage, issue 39)
    model, _ = build("llama-3.1-8b", seq=128)
    assert model.freqs_cis.shape == (128, 64) and model.freqs_cis.dtype == torch.complex64
    model, _ = build("llama-3.1-8b", seq=128, max_seq_len=8192)  # a length given is kept
    assert model.freqs_cis.shape == (8192, 64)
    model, _ = build("llama-3.1-8b", seq=20000, dtype="bf16")
    assert model.freqs_cis.shape == (20000, 64) and model.freqs_cis.dtype == torch.complex64
    assert not any("freqs" in key for key in model.state_dict())


def test_gpt_refuses_seq_beyond_its_learned_positions():
    with pytest.raises(RematError, match="block_size=2048"):
        build("gpt2", seq=2048)
    model, (ids, _) = build("gpt2", seq=2048, block_size=2048)
    assert model.wpe.weight.shape[0] == ids.shape[1] == 2048


@pytest.mark.parametrize(
    ("name", "field", "limit"),
    [("hf:gpt2", "n_positions", 1024), ("hf:bert", "max_position_embeddings", 512)],
)
def test_hugging_face_learned_positions_end_the_sequence(name, field, limit):
    """A fake trace reads an embedding past its table unchecked (a GPU asserts): a model with a
    learned position table refuses a longer sequence, naming the field; rotary positions
    (Llama) have no table and no such limit."""
    pytest.importorskip("transformers")
    from remat.errors import SequenceLimitError

    with pytest.raises(SequenceLimitError, match=f"--set {field}={limit + 64}") as raised:
        build(name, batch=1, seq=limit + 64)
    assert (raised.value.limit, raised.value.lever) == (limit, f"--set {field}=N")
    build(name, batch=1, seq=limit)
    model, _ = build(name, batch=1, seq=limit + 64, **{field: limit + 64})
    build("hf:llama", batch=1, seq=4096, tiny=True, max_position_embeddings=2048)


@pytest.mark.parametrize("name", ["hf:t5", "hf:plbart"])
def test_a_hugging_face_encoder_decoder_traces_on_token_ids_alone(name):
    """hf:t5's T5Model needs decoder ids: the same ids go to the decoder, as teacher forcing over
    an equal-length target (it failed before: "You must specify exactly one of input_ids").
    tiny shrinks the stacks encoder-decoders name apart (PLBart's 12 heads did not divide 64)."""
    pytest.importorskip("transformers")
    import remat

    model, inputs = build(name, batch=2, seq=32, tiny=True)
    config = model.model.config
    assert getattr(config, "encoder_layers", 2) == getattr(config, "decoder_layers", 2) == 2
    graph = remat.trace(model, *inputs)
    assert any(".decoder." in f".{op.module}." for op in graph.ops)


def test_mlp_chain_takes_any_layer_count_from_its_name():
    model, _ = build("mlp-chain-3")
    assert len(model.layers) == 3
    assert "mlp-chain-3" not in preset_names()


@pytest.mark.parametrize("name", ["mlp-chain-0", "mlp-chain-x", "mlp-chain-", "mlp-chain--2"])
def test_mlp_chain_with_a_bad_count_says_what_n_must_be(name):
    with pytest.raises(UnknownModelError, match="'mlp-chain-N' with N an integer >= 1"):
        build(name)


def test_unknown_preset_lists_the_known_names_and_the_other_forms():
    with pytest.raises(UnknownModelError) as err:
        build("llama-3.1-7b")
    message = str(err.value)
    assert "Did you mean 'llama-3.1-70b'?" in message
    assert all(name in message for name in preset_names())
    assert "'pkg.module:factory'" in message and "'hf:<model_type>'" in message


def test_module_path_without_factory_is_told_to_name_one():
    with pytest.raises(UnknownModelError, match=r"'mypkg.models:<function>'"):
        build("mypkg.models")


def test_overrides_replace_config_fields_after_tiny():
    model, _ = build("gpt2", tiny=True, n_layer=3)
    assert len(model.h) == 3 and model.wte.weight.shape == (512, 64)
    model, _ = build("megatron-gpt", attention="sdpa")
    assert not hasattr(model.layers[0], "attn_dropout")


def test_bad_override_names_the_field_and_lists_the_valid_ones():
    with pytest.raises(UnknownModelError, match="gpt2 has no config field 'n_layers'") as err:
        build("gpt2", n_layers=3)
    assert "n_layer, n_head, n_embd" in str(err.value)


def test_inconsistent_override_is_refused_with_the_values():
    with pytest.raises(RematError, match="n_embd=30 is not divisible by n_head=4"):
        build("gpt2", tiny=True, n_embd=30)


# --- megatron-gpt: Korthikanti et al. 2022, section 4.1 -------------------------------------------


def saved_bytes(model: nn.Module, inputs: tuple) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the distinct storages autograd keeps for backward, parameters excluded, and the
    shapes of the saved tensors."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
            shapes.append(tuple(t.shape))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(storages.values()), shapes


S, B, H, A, LAYERS = 128, 2, 256, 4, 2


def build_megatron(attention: str) -> tuple[nn.Module, tuple]:
    return build(
        "megatron-gpt",
        batch=B,
        seq=S,
        dtype="bf16",
        device="cpu",
        n_layers=LAYERS,
        d_model=H,
        n_heads=A,
        attention=attention,
    )


def test_megatron_layer_saves_the_papers_sbh_34_plus_5as_over_h_bytes():
    total, _ = saved_bytes(*build_megatron("softmax"))
    assert total / LAYERS == pytest.approx(S * B * H * (34 + 5 * A * S / H), rel=0.03)


def test_megatron_sdpa_variant_saves_no_attention_matrix_only_34sbh():
    total, shapes = saved_bytes(*build_megatron("sdpa"))
    assert not any(shape[-2:] == (S, S) for shape in shapes)
    assert total / LAYERS == pytest.approx(S * B * H * 34, rel=0.03)


# --- pkg.module:factory -----------------------------------------------------------------------

FACTORIES = """
import torch
from torch import nn


def one_tensor():
    return nn.Linear(4, 2), torch.zeros(3, 4)


def everything(batch, seq, dtype, device):
    with torch.device(device):
        model = nn.Linear(seq, 2).to(dtype)
    return model.eval(), (torch.zeros(batch, seq, dtype=dtype, device=device),)


def sized(width=4, **kwargs):
    return nn.Linear(width, 2), (torch.zeros(1, width),)


def model_only():
    return nn.Linear(4, 2)


NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = "remat_test_user_factories"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_factory_gets_the_arguments_its_signature_names(user_module):
    model, (x,) = build(f"{user_module}:everything", batch=3, seq=5, dtype="bf16", device="cpu")
    assert model.training and model.weight.dtype == torch.bfloat16
    assert (tuple(x.shape), x.dtype, x.device.type) == ((3, 5), torch.bfloat16, "cpu")


def test_factory_returning_one_tensor_gets_a_one_tuple(user_module):
    model, inputs = build(f"{user_module}:one_tensor")
    assert isinstance(inputs, tuple) and len(inputs) == 1
    assert model(*inputs).shape == (3, 2)


def test_factory_gets_tiny_and_overrides_only_if_it_takes_them(user_module):
    model, _ = build(f"{user_module}:sized", tiny=True, width=8)
    assert model.in_features == 8
    with pytest.raises(UnknownModelError, match="takes no 'width' argument"):
        build(f"{user_module}:one_tensor", width=8)
    with pytest.raises(UnknownModelError, match="takes no 'tiny' argument"):
        build(f"{user_module}:one_tensor", tiny=True)


@pytest.mark.parametrize(
    "spec, problem",
    [
        (":one_tensor", "names no module before ':'"),
        ("{m}:", "names no factory after ':'"),
        ("a b:c", "'a b' before ':', which is not a dotted module name"),
        ("remat_test_no_such_module:f", "cannot import module 'remat_test_no_such_module'"),
        ("{m}:missing", "has no attribute 'missing'; the functions and classes it defines: "),
        ("{m}:NOT_CALLABLE", "is not callable (its type is int)"),
        ("{m}:model_only", "returned a value of type Linear; it must return (model, inputs)"),
    ],
)
def test_malformed_factory_spec_names_the_spec_and_the_problem(user_module, spec, problem):
    spec = spec.format(m=user_module)
    with pytest.raises(UnknownModelError) as err:
        build(spec)
    message = str(err.value)
    assert f"model spec {spec!r}" in message and problem in message
    if spec.endswith(":missing"):
        assert "everything, model_only, one_tensor, sized" in message


# --- hf:<model_type> --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_hf_tiny_model_trains_on_cpu_and_returns_logits(transformers, model_type):
    model, inputs = build(f"hf:{model_type}", tiny=True, device="cpu", batch=2, seq=16)
    logits = model(*inputs)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 16, 512)
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("model_type, preset", [("gpt2", "gpt2"), ("llama", "llama-2-7b")])
def test_hf_default_config_builds_on_meta_with_the_presets_parameter_count(
    transformers, model_type, preset
):
    model, (ids,) = build(f"hf:{model_type}")
    assert model.training and ids.device.type == "meta"
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert n_params(model) == n_params(build(preset)[0])


def _meta_rope_layout(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the permutation Hugging Face's `convert_llama_weights_to_hf.py` applies to q and k
    projections: HF rotates the two halves of each head, Meta's and torchtitan's code consecutive
    pairs."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def test_llama_computes_what_hugging_face_llama_computes(transformers):
    theirs, (ids,) = build("hf:llama", tiny=True, device="cpu", seq=16, rms_norm_eps=1e-5)
    ours, _ = build("llama-2-7b", tiny=True, device="cpu", seq=16)
    state = {
        k.removeprefix("model.model.").removeprefix("model."): v
        for k, v in theirs.state_dict().items()
    }
    heads = {"q_proj": 4, "k_proj": 2}  # tiny Llama: 4 query heads, 2 K/V heads
    for key in state:
        proj = key.split(".")[-2]
        if proj in heads:
            state[key] = _meta_rope_layout(state[key], heads[proj])
    ours.load_state_dict(state)
    torch.testing.assert_close(ours(ids), theirs(ids))


def test_gpt_computes_what_hugging_face_gpt2_computes(transformers):
    # nanoGPT's GELU is the exact one; Hugging Face's GPT-2 defaults to the tanh approximation.
    theirs, (ids,) = build("hf:gpt2", tiny=True, device="cpu", seq=16, activation_function="gelu")
    ours, _ = build("gpt2", tiny=True, device="cpu", seq=16, block_size=16)
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # stored transposed by HF's Conv1D
    state = {
        k.removeprefix("model.transformer.").removeprefix("model."): v.t()
        if k.endswith(conv1d)
        else v
        for k, v in theirs.state_dict().items()
    }
    ours.load_state_dict(state)
    torch.testing.assert_close(ours(ids), theirs(ids))


def test_hf_tiny_sizes_and_training_settings(transformers):
    gpt2 = build("hf:gpt2", tiny=True, seq=200)[0].model.config
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.n_head, gpt2.vocab_size) == (2, 64, 4, 512)
    assert gpt2.n_positions >= 200 and gpt2.eos_token_id < 512
    assert gpt2.resid_pdrop == gpt2.attn_pdrop == gpt2.embd_pdrop == 0.0
    assert not gpt2.use_cache and gpt2._attn_implementation == "sdpa"
    llama = build("hf:llama", tiny=True)[0].model.config
    sizes = (
        llama.num_hidden_layers,
        llama.hidden_size,
        llama.intermediate_size,
        llama.num_attention_heads,
        llama.num_key_value_heads,
        llama.head_dim,
        llama.vocab_size,
    )
    assert sizes == (2, 64, 128, 4, 2, 16, 512) and llama.max_position_embeddings >= 128


def test_hf_overrides_reach_the_config_and_can_turn_dropout_back_on(transformers):
    config = build("hf:gpt2", tiny=True, resid_pdrop=0.1, n_layer=3)[0].model.config
    assert (config.resid_pdrop, config.attn_pdrop, config.n_layer) == (0.1, 0.0, 3)


def test_hf_architecture_without_sdpa_falls_back_to_eager(transformers):
    model, _ = build("hf:gemma2", tiny=True)
    assert model.model.config._attn_implementation == "eager"


def test_hf_unknown_model_type_says_how_to_list_them(transformers):
    with pytest.raises(UnknownModelError, match="no model type 'gtp2' \\(close: gpt2") as err:
        build("hf:gtp2")
    assert "CONFIG_MAPPING" in str(err.value)


def test_hf_unknown_config_field_is_named(transformers):
    with pytest.raises(UnknownModelError, match="hf:gpt2: its config has no field 'n_layers'"):
        build("hf:gpt2", n_layers=3)


def test_hf_without_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UnknownModelError, match=r"pip install 'remat\[hf\]'"):
        build("hf:gpt2")


# -- the loss each preset trains on, as its reference trainer computes it -------------------------
def _llama(**overrides):
    torch.manual_seed(0)
    return build("llama-3.2-1b", batch=2, seq=16, tiny=True, device="cpu", **overrides)


def _rope_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding as a rotation of consecutive pairs (Su et al.), written out in fp64."""
    b, t, h, d = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :]  # (t, d/2)
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    pairs = x.double().reshape(b, t, h, d // 2, 2)
    even = pairs[..., 0] * cos - pairs[..., 1] * sin
    odd = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack((even, odd), -1).reshape(b, t, h, d)


def test_llama_trains_on_torchtitans_loss():
    """The preset's loss equals one computed here from its own weights: the blocks run with RoPE
    as a pair rotation, grouped K/V heads repeated, causal softmax attention, then cross-entropy
    on the fp32 logits (torchtitan's `cross_entropy_loss`)."""
    model, (ids, labels) = _llama()
    loss = model(ids, labels)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    x = model.embed_tokens(ids).double()
    for layer in model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x.float()).double()
        b, t, _ = h.shape
        q = (h @ attn.q_proj.weight.double().T).view(b, t, attn.n_heads, attn.head_dim)
        k = (h @ attn.k_proj.weight.double().T).view(b, t, attn.n_kv_heads, attn.head_dim)
        v = (h @ attn.v_proj.weight.double().T).view(b, t, attn.n_kv_heads, attn.head_dim)
        q, k = _rope_reference(q, 500000.0), _rope_reference(k, 500000.0)
        rep = attn.n_heads // attn.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / attn.head_dim**0.5
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, -1)
        x = x + y @ attn.o_proj.weight.double().T
        x = x + layer.mlp(layer.post_attention_layernorm(x.float())).double()
    logits = model.lm_head(model.norm(x.float()))
    expected = nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(0, 1))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-4)


def test_llama_chunked_cross_entropy_equals_the_whole_one():
    model, (ids, labels) = _llama(loss_chunks=4)
    chunked = model(ids, labels)
    from remat.models.llama import CrossEntropy

    model.loss_chunks, model.loss = 0, CrossEntropy()
    torch.testing.assert_close(chunked, model(ids, labels))


def test_llama_saves_the_fp32_log_softmax_of_its_logits():
    """Cross-entropy on fp32-upcast logits saves its log-softmax output: batch x seq x vocab x 4
    bytes (2 x 16 x 512 x 4 = 65,536), here in a bf16 model."""
    import remat

    model, inputs = build("llama-3.2-1b", batch=2, seq=16, tiny=True, dtype="bf16")
    graph = remat.trace(model, *inputs)
    by_op = {o.op: o.activation_bytes for o in remat.estimate(graph).by_op}
    assert by_op["_log_softmax"] == 2 * 16 * 512 * 4


def test_llama_repeat_kv_saves_the_expanded_heads():
    """With repeat_kv, SDPA saves K and V with every Q head's copy: per layer 2 x (n_heads -
    n_kv_heads) x batch x seq x head_dim x 4 bytes more than SDPA with enable_gqa: tiny Llama
    (4 heads, 2 K/V heads, head_dim 16), 2 x 16 tokens, fp32: 2 x 2 x 32 x 16 x 4 = 8,192 B a
    layer, 2 layers."""
    import remat

    expanded = remat.trace(*_flat(_llama()))
    in_place = remat.trace(*_flat(_llama(expand_kv=False)))
    assert expanded.activation_bytes - in_place.activation_bytes == 2 * 8192


def _flat(built):
    model, inputs = built
    return (model, *inputs)


def test_gpt2_trains_on_nanogpts_loss():
    torch.manual_seed(0)
    model, (ids, labels) = build("gpt2", batch=2, seq=16, tiny=True, device="cpu")
    logits = model(ids)
    expected = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
    torch.testing.assert_close(model(ids, labels), expected)
    assert logits.shape == (2, 16, 512)


@pytest.mark.parametrize("name", ["vit-b-16", "resnet50"])
def test_image_presets_train_on_class_cross_entropy(name):
    torch.manual_seed(0)
    model, (images, labels) = build(name, batch=3, tiny=True, device="cpu")
    model.eval()  # the same forward twice (no dropout, BatchNorm's running statistics)
    expected = nn.functional.cross_entropy(model(images), labels)
    torch.testing.assert_close(model(images, labels), expected)
    assert labels.shape == (3,) and labels.dtype == torch.long


def test_a_causal_lm_head_that_asserts_is_decoder_is_built_as_a_decoder():
    # `remat estimate --model hf:reformer` ended in transformers' AssertionError traceback
    # ("make sure that is_decoder=True"); a model its own config check refuses at --tiny's
    # sizes ended in a ValueError traceback
    pytest.importorskip("transformers")
    model, _ = build("hf:reformer", device="meta", batch=1, seq=4096)
    assert type(model.model).__name__ == "ReformerModelWithLMHead"
    assert model.model.config.is_decoder
    with pytest.raises(UnknownModelError, match="does not build it at --tiny's sizes: .*axial"):
        build("hf:reformer", device="meta", tiny=True, batch=1, seq=64)
