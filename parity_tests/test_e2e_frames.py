"""Quality of an approximate mode's outputs (part c of the gate; machinery in parity_tests/e2e_frames.py).

`pytest -m parity --device cuda --attention NAME [--e2e-model DIR]` (default for sol_attn: a model folder built for
the run, above its minimum sequence): when NAME is an approximate path (sage2,
ck_int8, sol_attn, kj_head_sliced over sage2, fa3_fp8, ...; `--e2e-path fp8_linear` for the FP8 block linears), one
4-step generation on the device's exact path and one on NAME, same seed and inputs, decoded to frames and audio:
their rel-L2, PSNR / SSIM and SNR against the exact path's, held to NAME's own baseline beside the model folder
(the drift rule, `drift.py`; the first run records it).
For an exact NAME there is no item. Skips: no CUDA device, or `--device cpu` for a GPU-only NAME (with the
reason); on a GPU, a NAME that cannot run there fails. The CPU
machinery tests are in the unit lane (tests/gate/test_e2e_frames_machinery.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity_tests import e2e_frames as E
from parity_tests.plugin import gate_attention

pytestmark = pytest.mark.parity


def pytest_generate_tests(metafunc):
    if "e2e_path" in metafunc.fixturenames:
        c = metafunc.config
        path = c.getoption("--e2e-path") or gate_attention(c).backend
        if E.kind_of(path) == "exact":  # deselected by the plugin: nothing approximate to compare
            metafunc.parametrize("e2e_path", [None], ids=[f"{path}-exact"])
        else:
            metafunc.parametrize("e2e_path", [path], ids=[path])


@pytest.fixture(scope="session")
def e2e_model(request, gate_options, tmp_path_factory):
    """--e2e-model; else, for sol_attn on CUDA, the default model folder built for this run (`e2e_frames.build`:
    head_dim 128, 4,509 tokens, so that its kernel runs, not its fallback); else the bundled tiny models."""
    c = request.config
    given = c.getoption("--e2e-model")
    sol = E.split_path(c.getoption("--e2e-path") or gate_attention(c).backend)[0] == "sol_attn"
    if given is None and sol and torch.device(gate_options["device"]).type == "cuda" and torch.cuda.is_available():
        given = str(tmp_path_factory.mktemp("e2e_model"))
        E.build(Path(given))
    return E.E2EModel.load(given)


def baseline_root(model: E.E2EModel) -> Path:
    """Where a model's e2e baselines live: its folder, or fixtures/ for the bundled models."""
    from parity_tests.discovery import FIXTURES

    return model.root if model.root is not None else FIXTURES


def test_e2e_frames_vs_exact(e2e_path, e2e_model, gate_options, conclude, request):
    device = gate_options["device"]
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    why = E.unavailable(e2e_path, device, gate_options["attention"])
    if why is not None:  # on a GPU the gate was asked for this path: that it cannot run is a failure, not a skip
        if torch.device(device).type == "cuda":
            pytest.fail(f"{e2e_path} cannot run on this GPU: {why}", pytrace=False)
        pytest.skip(f"{e2e_path} needs a GPU: {why}")
    from h3direct.dit.options import changed_options
    from parity_tests.drift import History

    result = E.compare_paths(e2e_model, e2e_path, device=device, options=changed_options(gate_options["attention"]))
    history = History(request.config, baseline_root(e2e_model), e2e_model.id, device, gate_options["budgets"])
    history.judge(result)
    if E.split_path(e2e_path)[0] == "sol_attn":  # (also over FP8 linears) its budget is about the sparse kernel
        calls = result.attention_calls.get("sol_attn", {})
        if not calls.get("kernel", 0):
            result.pending = (f"sol_attn ran only its fallback on {e2e_model.about} ({calls}): use --e2e-model with "
                              f"a head_dim-128 model at >= H3_SOL_MIN_TOKENS tokens")
    conclude(result, history)
