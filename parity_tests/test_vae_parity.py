"""The VAE merge gate: every key of every ComfyUI VAE trace (decoded frames report their PSNR / SSIM, decoded audio
its waveform SNR). That the gate can fail is shown in the unit lane (tests/gate/test_vae_gate.py)."""

from __future__ import annotations

import pytest

from parity_tests.vae_gate import run_vae_case

pytestmark = pytest.mark.parity


def test_vae_keys(vae_case, gate_options, conclude):
    conclude(run_vae_case(vae_case, attention=gate_options["attention_label"], budgets=gate_options["budgets"],
                          replay=gate_options["replay"]))
