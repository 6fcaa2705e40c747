"""`make-checkpoint --attention-structure local`: attention local in (t, h, w) at S of a few thousand tokens, where
the plain random checkpoint attends almost uniformly; comfy-kitchen's eager Sol-Attn is then accurate on it."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from h3direct.app.cli import main as cli_main
from parity_tests import attention_structure as AS

# Ref2VA: video 6 x 16 x 20 tokens (1,920 rows) + a 320-row image reference + 200 audio rows + 32 text tokens
VIDEO, REF, AUDIO, TEXT = (1, 24, 6, 32, 40), (1, 24, 1, 32, 40), (1, 32, 2, 100), 32
S = 1920 + 320 + 200 + TEXT
GRID = (6, 16, 20)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("structure")
    g = torch.Generator().manual_seed(5)
    t = {"video_noise": torch.randn(VIDEO, generator=g), "audio_noise": torch.randn(AUDIO, generator=g),
         "video_latent": torch.randn(VIDEO, generator=g), "audio_latent": torch.randn(AUDIO, generator=g),
         "text_states": torch.randn(1, TEXT, 64, generator=g), "sigma": torch.tensor([0.8]),
         "ref_image_latent": torch.randn(REF, generator=g), "token_tags": torch.ones(TEXT, dtype=torch.int64)}
    desc = {"schema": "h3-oracle-inputs/1", "sigma": 0.800000011920929, "sampler_seed": 0, "task": "ref2va",
            "variant": "structure", "text_states": "text_states", "token_tags": "token_tags",
            "refs": [{"kind": "image", "latent": "ref_image_latent", "latent_h": REF[3], "latent_w": REF[4]}]}
    inputs = d / "inputs.safetensors"
    save_file(t, str(inputs), metadata={"h3_inputs": json.dumps(desc, sort_keys=True)})
    out = {}
    for kind in ("random", "local"):
        ck, tr = d / f"{kind}.safetensors", d / f"trace_{kind}.safetensors"
        assert cli_main(["make-checkpoint", "--preset", "small", "--adaln", "curve", "--attention-structure", kind,
                         "--out", str(ck)]) == 0
        assert cli_main(["trace", "--checkpoint", str(ck), "--inputs", str(inputs), "--out", str(tr)]) == 0
        out[kind] = (ck, tr)
    return out


HAVE_SOL = importlib.util.find_spec("comfy_kitchen.backends.eager.sol_attn") is not None


@pytest.fixture(scope="module")
def stats(traces):
    """Per block: window mass, entropy, ... and (comfy-kitchen >= 0.2.40) the eager Sol-Attn error at tau 1.3."""
    return {kind: AS.trace_stats(traces[kind][1], sol=HAVE_SOL, taus=(1.3,)) for kind in traces}


def test_local_window_mass(stats):
    rnd, loc = stats["random"], stats["local"]
    assert [r["seq_len"] for r in loc] == [S, S] and loc[0]["grid"] == list(GRID)
    uniform = loc[0]["uniform_local"]
    assert 0.02 < uniform < 0.06  # the ±1 frame, ±3 row, ±3 column window is a few % of the keys
    for r in rnd:  # random q/k: near-uniform attention, the window gets its share and no more
        assert r["local"] < 2 * uniform and r["entropy"] > 0.9, r
    for r in loc:  # structured: most of the mass in the window, peaked but not a self-attention spike
        assert r["local"] > 0.35 and r["local"] > 10 * uniform, r
        assert 0.2 < r["entropy"] < 0.75 and r["self"] < 0.3, r


@pytest.mark.skipif(not HAVE_SOL, reason="comfy-kitchen >= 0.2.40 (eager sol_attn reference) is not installed")
def test_sol_reference_error_drops(stats):
    rnd, loc = stats["random"], stats["local"]
    assert min(r["sol_rel_l2"][1.3] for r in rnd) > 0.1  # the case that failed on the H200
    assert max(r["sol_rel_l2"][1.3] for r in loc) < 0.05  # a sparse method is meaningful here (measured 0.031)


def test_local_structure_tensors(traces):
    """The construction of the docstring: k's projection agrees with q's on the block's shift direction, the
    shift bias carries ρ·u, the q/k norm weights follow γ·ψ; everything else is the random checkpoint's."""
    from h3direct.checkpoint.synthetic import LOCAL_SHIFT, LOCAL_STRENGTH, norm_profile, shift_directions
    from h3direct.config import H3Config

    cfg = H3Config.from_name("small-curve")
    u = shift_directions(cfg, 0, "cpu")
    with safe_open(str(traces["random"][0]), "pt") as fr, safe_open(str(traces["local"][0]), "pt") as fl:
        changed = set()
        for key in fr.keys():
            a, b = fr.get_tensor(key), fl.get_tensor(key)
            if not torch.equal(a, b):
                changed.add(key)
        assert changed == {f"blocks.{b}.{n}" for b in range(2) for n in (
            "adaln_proj.linear.bias", "attn.qkv_proj.weight", "attn.q_norm.weight", "attn.k_norm.weight")}
        for b in range(2):
            w = fl.get_tensor(f"blocks.{b}.attn.qkv_proj.weight").float()
            uh = u[b] / u[b].norm()
            wq, wk = w[:256] @ uh, w[256:512] @ uh
            assert torch.allclose(wq, wk, atol=0.02 * wq.abs().max())  # bf16 storage
            wr = fr.get_tensor(f"blocks.{b}.attn.qkv_proj.weight").float()
            perp = torch.eye(256) - torch.outer(uh, uh)
            assert torch.allclose(w[256:512] @ perp, wr[256:512] @ perp, atol=0.02)
            bias = (fl.get_tensor(f"blocks.{b}.adaln_proj.linear.bias").float()
                    - fr.get_tensor(f"blocks.{b}.adaln_proj.linear.bias").float()).view(3, 6, 256)
            assert torch.allclose(bias[:, 0], (LOCAL_SHIFT * u[b]).expand(3, 256), atol=0.05)
            assert bias[:, 1:].abs().max() == 0
            ratio = fl.get_tensor(f"blocks.{b}.attn.q_norm.weight").float() / fr.get_tensor(
                f"blocks.{b}.attn.q_norm.weight").float()
            assert torch.allclose(ratio, LOCAL_STRENGTH * norm_profile(128, 16), rtol=1e-2)
    psi = norm_profile(128, 16)
    assert abs(float(psi.pow(2).mean()) - 1) < 1e-5
    assert float(psi[96:].max()) < float(psi[:96].max()) / 4  # unrotated channels carry only the floor


@pytest.mark.parametrize("argv", [
    ["--attention-structure", "banded"],
    ["--attention-structure", "local", "--attention-strength", "-1"],
    ["--attention-structure", "local", "--attention-shift", "nan"],
    ["--component", "video_vae", "--attention-structure", "local"],
])
def test_bad_structure_arguments(argv, tmp_path, capsys):
    out = tmp_path / "x.safetensors"
    with pytest.raises(SystemExit) as exc:
        rc = cli_main(["make-checkpoint", "--preset", "small", *argv, "--out", str(out)])
        raise SystemExit(rc)
    assert exc.value.code == 2
    assert not out.exists()
