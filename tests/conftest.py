"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    """A bundled-model cache for the whole session (built once), with every H3_* variable the runtime reads unset."""
    from h3direct.app import bundled
    from h3direct.app.env import variables

    root = tmp_path_factory.mktemp("h3cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("H3_CACHE_DIR", str(root))
    for k in variables():
        mp.delenv(k, raising=False)
    bundled.ensure()
    yield root
    mp.undo()


@pytest.fixture
def lane_backend():
    """`lane_backend(name, like)` asserts that an attention backend the GPU test lane needs runs here: on a GPU
    machine a missing package (fa3-fwd, ...) fails the test with the backend's reason, it is never skipped."""
    from h3direct.dit.attention import unavailable_reason

    def need(name, like):
        reason = unavailable_reason(name, like)
        assert reason is None, f"the GPU test lane needs the {name!r} backend (README, 'GPU test lane'): {reason}"

    return need
