"""The digest covers the dtype a worker's model computes in, as SGLang resolves it.

Workers are real ``ServerArgs`` over copies of the tiny checkpoint; SGLang's own
``ModelConfig`` resolves ``--dtype`` (Llava architectures run float16 under
``auto``, a sub-config dict decides a multimodal model's dtype, a separate
draft model resolves its own), and on a CUDA device below sm80 every dtype runs
as float16 (the capability query is monkeypatched: no GPU here). The pools are
the same bfloat16 pool throughout, as with a quantized KV cache, whose pool
dtype does not tell the compute dtypes apart. Where SGLang cannot resolve,
``auto`` stays apart from every dtype.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.server_args import ServerArgs

from cpu_harness import tiny_model
from sglang.srt.mem_cache.storage.kvcr.layout import model_dtype
from sglang.srt.mem_cache.storage.kvcr.layout.page_layout import PageLayout
from sglang.srt.mem_cache.storage.kvcr.rank_setup import kvcache_layout_identity

PAGE = 16
DTYPES = ("bfloat16", "float16", "float32")


def _args(model_path: Any, dtype: str, **kw: Any) -> ServerArgs:
    args = ServerArgs(model_path=str(model_path), device="cpu", dtype=dtype)
    for name, value in kw.items():  # as the harness sets them: after resolution
        setattr(args, name, value)
    return args


def _digest(args: Any, device: Any = None, kv_dtype: Any = torch.bfloat16) -> str:
    pool = MHATokenToKVPool(
        64, PAGE, kv_dtype, 2, 8, 2, device="cpu", enable_memory_saver=False
    )
    identity = kvcache_layout_identity(args, 0, 1, device)
    return PageLayout.from_kv_pool(pool, PAGE, identity=identity).compatibility_digest


def _checkpoint(tmp_path: Any, name: str, **fields: Any) -> Any:
    """A copy of the tiny checkpoint whose config has ``fields`` as its dtype
    fields (each copy its own path: SGLang caches a config by path)."""
    path = shutil.copytree(tiny_model.ensure_tiny_model(), tmp_path / name)
    config = path / "config.json"
    data = json.loads(config.read_text())
    data.pop("dtype", None)
    data.pop("torch_dtype", None)
    config.write_text(json.dumps({**data, **fields}))
    return path


def _text_config() -> dict[str, Any]:
    """The tiny model's shape as a sub-config dict (no ``model_type``)."""
    data = json.loads((tiny_model.ensure_tiny_model() / "config.json").read_text())
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
    )
    return {key: data[key] for key in keys}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_KVCR_CACHE_DIR", str(tmp_path / "cache"))


def _only_this_runs_as(tmp_path, config: dict[str, Any], runs_as: str) -> None:
    """``--dtype auto`` over ``config`` shares with exactly ``runs_as``."""
    model = _checkpoint(tmp_path, "model", **config)
    auto = _digest(_args(model, "auto"))
    for dtype in DTYPES:
        assert (_digest(_args(model, dtype)) == auto) is (dtype == runs_as), dtype


@pytest.mark.parametrize(
    ("config", "runs_as"),
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),
        ({"torch_dtype": "float32"}, "float16"),  # SGLang runs float32 as float16
        ({}, "float16"),  # no dtype given: float32
        ({"dtype": "float32", "model_type": "gemma2"}, "bfloat16"),
    ],
    ids=["bf16", "fp16-torch_dtype", "fp32", "none", "gemma-fp32"],
)
def test_dtype_auto_shares_with_the_dtype_sglang_resolves(tmp_path, config, runs_as):
    _only_this_runs_as(tmp_path, config, runs_as)


def test_a_llava_architecture_runs_auto_as_float16(tmp_path):
    """SGLang forces float16 for any ``Llava*ForCausalLM`` under ``auto``,
    whatever the config says (an explicit bfloat16 still runs bfloat16)."""
    config = {"architectures": ["LlavaLlamaForCausalLM"], "torch_dtype": "bfloat16"}
    _only_this_runs_as(tmp_path, config, "float16")


@pytest.mark.parametrize("key", ["text_config", "language_config", "llm_config"])
def test_a_sub_config_without_model_type_decides_auto(tmp_path, key):
    """A multimodal config's text model (a plain dict, no ``model_type``) is
    what SGLang reads the dtype from, not the top level."""
    sub = {**_text_config(), "torch_dtype": "float16"}
    _only_this_runs_as(tmp_path, {"torch_dtype": "bfloat16", key: sub}, "float16")


def test_a_dtype_override_is_resolved_as_sglang_resolves_it(tmp_path):
    override = {"json_model_override_args": '{"torch_dtype": "float16"}'}
    model = _checkpoint(tmp_path, "model", torch_dtype="bfloat16")
    auto = _digest(_args(model, "auto", **override))
    assert _digest(_args(model, "float16", **override)) == auto
    assert _digest(_args(model, "bfloat16", **override)) != auto


def test_a_separate_draft_models_own_dtype_is_covered(tmp_path):
    """Under ``auto`` the draft resolves its own config's dtype; an explicit
    dtype runs both models in it."""
    target = _checkpoint(tmp_path, "target", torch_dtype="bfloat16")
    draft = _checkpoint(tmp_path, "draft", torch_dtype="float16")
    spec = {
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": str(draft),
    }
    auto = _digest(_args(target, "auto", **spec))
    assert _digest(_args(target, "auto", **spec)) == auto
    for dtype in DTYPES:
        assert _digest(_args(target, dtype, **spec)) != auto, dtype


def test_dtype_names_of_one_dtype_keep_the_digest(tmp_path):
    """Resolved by SGLang, and where it cannot be asked (not its arguments)."""
    model = _checkpoint(tmp_path, "model", torch_dtype="bfloat16")
    for args in (
        lambda dtype: _args(model, dtype),
        lambda dtype: SimpleNamespace(model_path=str(model), dtype=dtype),
    ):
        assert _digest(args("half")) == _digest(args("float16"))
        assert _digest(args("float")) == _digest(args("float32"))


# ---- below sm80 every dtype runs as float16 ---------------------------------------


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device whose compute capability the test sets (``gpu.capability``)."""
    state = SimpleNamespace(capability=(8, 0), asked=0)

    def capability(device=None):
        state.asked += 1
        return state.capability

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    return state


def test_below_sm80_every_dtype_runs_as_float16(tmp_path, gpu):
    """A T4 (sm75) on ``auto`` or bfloat16 computes in float16: it shares with an
    A100 (sm80) on float16, never with an A100 on bfloat16. Their KV caches are
    fp8 (one pool layout): only the compute dtype tells them apart."""
    model = _checkpoint(tmp_path, "model", torch_dtype="bfloat16")
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}

    def digest(dtype: str) -> str:
        args = _args(model, dtype, **fp8)
        return _digest(args, torch.device("cuda"), torch.float8_e4m3fn)

    gpu.capability = (8, 0)
    a100 = {dtype: digest(dtype) for dtype in DTYPES}
    assert digest("auto") == a100["bfloat16"]
    gpu.capability = (7, 5)
    for dtype in ("auto", *DTYPES):
        assert digest(dtype) == a100["float16"], dtype
        assert digest(dtype) != a100["bfloat16"], dtype


def test_the_capability_is_asked_only_of_an_available_cuda_device(
    tmp_path, gpu, monkeypatch
):
    model = _checkpoint(tmp_path, "model", torch_dtype="bfloat16")
    gpu.capability = (7, 5)
    on_cpu = _digest(_args(model, "bfloat16"), torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _digest(_args(model, "bfloat16"), torch.device("cuda")) == on_cpu
    assert gpu.asked == 0


# ---- where SGLang cannot resolve: auto stays apart ---------------------------------


def test_arguments_sglang_cannot_resolve_keep_auto_apart(tmp_path):
    model = _checkpoint(tmp_path, "model", torch_dtype="bfloat16")
    args = SimpleNamespace(model_path=str(model), revision=None, dtype="auto")
    auto = _digest(args)
    for dtype in DTYPES:
        assert _digest(SimpleNamespace(**{**vars(args), "dtype": dtype})) != auto


def test_a_model_without_local_files_is_not_resolved(monkeypatch):
    """SGLang is not asked about a checkpoint with no local files (it would go
    out for them): ``auto`` stays ``auto``."""
    asked = []
    monkeypatch.setattr(
        ModelConfig,
        "from_server_args",
        classmethod(lambda cls, *a, **kw: asked.append(a) or None),
    )
    args = _args("org/not-downloaded", "auto")
    assert model_dtype.served_dtype(args) == "auto"
    assert asked == []
