"""The validation set's structured cases (`parity_tests/validation.py`): at least 24 above S = 5,000 with local
attention, spread over what the approximate modes see (the local window, heads of 128, S up to the workload's,
text length, references, adaLN form, weights, place in a schedule, more than one case of v4's form), and a case with
other sizes builds into a checkpoint whose header says those sizes and an inputs file of its sigma, and one of
another window into a checkpoint whose header records its structure."""

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
    assert len(cases) >= 24, "enough cases to tell an outlier from a pattern"
    assert {v["attention_head_dim"] for v in cfgs.values()} == {128}
    assert {2, 3, 4, 6, 8} <= {v["num_attention_heads"] for v in cfgs.values()}
    assert max(validation.seq_len(c) for c in cases) >= 20000, "S up to the workload's 20,050"
    assert min(c.strength for c in cases) < 1.5 < max(c.strength for c in cases), "wider and narrower windows"
    assert len({c.shift for c in cases}) >= 3
    texts = {c.text_len for c in cases}
    assert min(texts) <= 16 and max(texts) >= 256
    assert len({c.ref for c in cases if c.ref}) >= 3 and any(c.ref is None for c in cases)
    v4_form = [c for c in cases if (c.quant, c.adaln, c.task) == ("nvfp4", "curve", "ref2va")]
    assert len(v4_form) >= 3, "a case like v4 is not one of a kind"


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


def test_a_case_of_another_window_builds_with_it(tmp_path):
    from safetensors import safe_open

    case = next(c for c in validation.structured()
                if c.strength != validation.LOCAL_STRENGTH and c.shift != validation.LOCAL_SHIFT)
    validation.build(tmp_path, only=[case.name])
    with safe_open(str(tmp_path / case.name / case.checkpoint), "pt") as f:
        made = json.loads(f.metadata()["h3direct"])["attention_structure"]
    assert made["kind"] == "local" and abs(made["strength"] - case.strength) < 1e-9, made
    assert abs(made["shift"] - case.shift) < 1e-9, made
