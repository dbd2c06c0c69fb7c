"""The fan-in dummy weights the GPU check's bench-families serves with.

SGLang's ``--load-format dummy`` fills every tensor in +-1e-3 (norms too), which
gives uniform logits: a greedy output then cannot tell a right KV restore from a
wrong one. ``dummy_weights_hook.fan_in_weights`` replaces it (norms 1, matrices
N(0, 1/fan_in), seeded per tensor name), installed by the GPU start-up shim when
``SGLANG_KVCR_DUMMY_WEIGHTS=fan_in``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cpu_harness.server import REPO

HARNESS = REPO / "test" / "cpu_harness"


def _weights():
    sys.path.insert(0, str(HARNESS / "pythonpath"))
    try:
        import dummy_weights_hook
    finally:
        sys.path.remove(str(HARNESS / "pythonpath"))
    return dummy_weights_hook.fan_in_weights


def _model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(512, 64)
    model.proj = torch.nn.Linear(256, 64, bias=True)
    model.norm = torch.nn.LayerNorm(64)
    model.lm_head = torch.nn.Linear(64, 512, bias=False)
    return model


def test_weights_are_scaled_to_their_fan_in_and_seeded_by_name() -> None:
    fan_in_weights = _weights()
    a, b = _model(), _model()
    fan_in_weights(a)
    fan_in_weights(b)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name  # every process gets the same weights
    assert torch.equal(a.norm.weight, torch.ones(64))
    assert torch.equal(a.proj.bias, torch.ones(64))
    assert abs(a.proj.weight.std().item() - 256**-0.5) < 0.1 * 256**-0.5
    assert abs(a.lm_head.weight.std().item() - 2 * 64**-0.5) < 0.2 * 64**-0.5
    assert abs(a.embed_tokens.weight.std().item() - 1.0) < 0.05
    assert not torch.equal(a.proj.weight[:, :64], a.lm_head.weight[:64, :])
    # Not SGLang's +-1e-3: logits of a normalized hidden state are far from flat.
    hidden = torch.nn.functional.normalize(torch.randn(64), dim=0) * 8
    assert (hidden @ a.lm_head.weight.T).std().item() > 1.0


@pytest.mark.slow  # two SGLang imports in fresh interpreters
def test_the_shim_installs_the_hook_only_when_asked() -> None:
    code = (
        "import sglang.srt.model_loader.loader as loader\n"
        "print(loader.initialize_dummy_weights.__module__)\n"
    )
    for value, want in (("fan_in", "dummy_weights_hook"), ("", "weight_utils")):
        env = {
            **os.environ,
            # As the dry run has it: the CPU harness after the GPU shim.
            "PYTHONPATH": f"{HARNESS / 'gpu_pythonpath'}:{HARNESS / 'pythonpath'}",
            "SGLANG_USE_CPU_ENGINE": "1",
            "SGLANG_KVCR_DUMMY_WEIGHTS": value,
        }
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1].endswith(want), proc.stdout
