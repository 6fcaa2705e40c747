"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture(scope="session")
def cache_env(tmp_path_factory):
    """A bundled-model cache for the whole session (built once), with the VAE environment knobs unset."""
    from h3direct.app import bundled

    root = tmp_path_factory.mktemp("h3cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("H3_CACHE_DIR", str(root))
    for k in ("H3_VAE_DTYPE", "H3_VAE_TILE_SIZE"):
        mp.delenv(k, raising=False)
    bundled.ensure()
    yield root
    mp.undo()
