"""Root conftest: loads the project's pytest plugin (`parity_tests/plugin.py`: the parity options and markers).

The plugin is also installed as a `pytest11` entry point, so `pytest -m parity --trace-dir DIR` works from any
working directory; listing it here keeps a checkout without the editable install working. Both routes use the name
`parity_tests.plugin`, so pytest registers it once.
"""

pytest_plugins = ["parity_tests.plugin"]
