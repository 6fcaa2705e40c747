"""The validation set's structured cases (`parity_tests/validation.py`): at least six above S = 5,000 with local
attention, spread over what the approximate modes see (heads, text width, adaLN form, weights, place in a schedule),
and a case with other sizes builds into a checkpoint whose header says those sizes and an inputs file of its sigma."""

from __future__ import annotations

import json

from parity_tests import validation


def test_the_structured_cases_span_what_the_approximate_modes_see():
    cases = validation.structured()
    assert len(cases) >= 6 and all(validation.seq_len(c) >= 5000 and c.structure == "local" for c in cases)
    cfgs = {c.name: validation.sizes_of(c) for c in cases}
    assert len({v["num_attention_heads"] for v in cfgs.values()}) >= 3
    assert len({v["text_dim"] for v in cfgs.values()}) >= 2
    assert {c.adaln for c in cases} == {"curve", "full"} and {c.quant for c in cases} == {"none", "nvfp4"}
    sigmas = sorted(c.sigma for c in cases)
    assert sigmas[0] <= 0.3 and sigmas[-1] >= 0.9 and any(0.4 <= s <= 0.6 for s in sigmas)


def test_a_case_of_other_sizes_builds_as_described(tmp_path):
    from safetensors import safe_open

    from h3direct.checkpoint.inspect import inspect_checkpoint

    case = next(c for c in validation.structured() if dict(c.sizes).get("num_attention_heads") == 3)
    validation.build(tmp_path, only=[case.name])
    folder = tmp_path / case.name
    cfg = inspect_checkpoint(folder / case.checkpoint)["config"]
    assert cfg["num_attention_heads"] == 3 and cfg["hidden_size"] == 384
    with safe_open(str(folder / case.inputs), "pt") as f:
        meta = json.loads(f.metadata()["h3_inputs"])
        assert abs(meta["sigma"] - case.sigma) < 1e-7 and abs(float(f.get_tensor("sigma")) - case.sigma) < 1e-7
