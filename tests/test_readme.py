"""README.md says what is true: its test command installs Chromium as root (no sudo) and as a user (sudo), and its
Layout table names files that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


# ---- the test command ----------------------------------------------------------------------------------------------

def readme_test_command() -> str:
    """The second line of README's first code block: installs what the tests need, then runs them."""
    block = re.search(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert block, "README.md has no ```sh code block"
    return block.group(1).splitlines()[1]


def _sandbox(tmp_path: Path, uid: int, *, sudo: bool = False, chromium: bool = False) -> tuple[Path, Path]:
    """A PATH of one folder: bash (linked), stubs of `apt-get` (logs its arguments), `id` (prints `uid` for -u, so
    both branches run whoever runs the test), optionally `sudo` (logs, then runs its command) and `chromium`."""
    bash = shutil.which("bash")
    assert bash, "bash is not on PATH"
    bin_, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_.mkdir()
    (bin_ / "bash").symlink_to(bash)
    stubs = {"apt-get": f'echo "apt-get $*" >> {log}', "id": f'[ "$1" = -u ] && echo {uid}'}
    if sudo:
        stubs["sudo"] = f'echo "sudo $*" >> {log}; exec "$@"'
    if chromium:
        stubs["chromium"] = "exit 0"
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!{bash}\n{body}\n")
        (bin_ / name).chmod(0o755)
    return bin_, log


def _install(tmp_path: Path, **sandbox) -> list[str]:
    """Run the command's install part (all before `python -m pytest`) in the sandbox: the logged calls."""
    install, sep, _ = readme_test_command().partition("python -m pytest")
    assert sep, f"README's test command runs no `python -m pytest`: {readme_test_command()!r}"
    bin_, log = _sandbox(tmp_path, **sandbox)
    r = subprocess.run([str(bin_ / "bash"), "-c", install], env={"PATH": str(bin_), "HOME": str(tmp_path)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_readme_installs_chromium_as_root_without_sudo(tmp_path):
    calls = _install(tmp_path, uid=0)
    assert len(calls) == 2, calls
    update, install = (c.split() for c in calls)
    assert update[:2] == ["apt-get", "update"], calls
    assert install[:2] == ["apt-get", "install"] and "-y" in install and install[-1] == "chromium", calls


def test_readme_installs_chromium_as_a_user_through_sudo(tmp_path):
    words = [c.split() for c in _install(tmp_path, uid=1000, sudo=True)]
    assert [w[:2] for w in words] == [["sudo", "apt-get"], ["apt-get", "update"], ["sudo", "apt-get"],
                                      ["apt-get", "install"]], words
    assert words[0][1:] == words[1] and words[2][1:] == words[3] and words[3][-1] == "chromium", words


@pytest.mark.parametrize("uid", [0, 1000])
def test_readme_installs_nothing_where_chromium_is(tmp_path, uid):
    assert _install(tmp_path, uid=uid, sudo=True, chromium=True) == []


# ---- the Layout table ----------------------------------------------------------------------------------------------

# a backticked token that names a file (by its extension) or a folder (trailing slash); not `h3-trace/1`, `H3Config`
PATH_TOKEN = re.compile(r"[\w.-]+(/[\w.-]+)*(/|\.(py|toml|md|json|sh|npz|safetensors))")


def layout_table(text: str) -> str:
    """The table under README's `## Layout` heading."""
    after = text.split("\n## Layout\n", 1)[1]
    lines = after[after.index("\n|"):].splitlines()[1:]
    return "\n".join(line for line in lines[:next((i for i, s in enumerate(lines) if not s.startswith("|")),
                                                  len(lines))])


def table_paths(table: str) -> list[tuple[str, tuple[str, ...]]]:
    """(token, candidate paths from the repository root; one must exist) for every path a Layout table names.

    A row's first cell starts with a path from the root (`h3direct/dit/`, `h3direct/config.py`): the row's folder
    is that folder, or that file's folder; further names there are in the row's folder. In the description a file
    name (`inspect.py`) is in the row's folder, or, inside the parentheses right after a folder's name (`serve/`
    (`schema.py`, ...)), in that folder; a name with a slash (`quant/`, `quant/kitchen.py`, `oracle/FORMAT.md`)
    is from the row's folder or from the root."""
    out = []
    for row in table.splitlines()[2:]:
        first, desc = row.strip().strip("|").split("|", 1)
        firsts = re.findall(r"`([^`]+)`", first)
        assert firsts and "/" in firsts[0], f"a Layout row starts with no path from the root: {row!r}"
        folder = firsts[0] if firsts[0].endswith("/") else firsts[0].rsplit("/", 1)[0] + "/"
        out.append((firsts[0], (firsts[0],)))
        out += [(t, (folder + t,)) for t in firsts[1:]]
        scopes, last_dir, last_end = [folder], None, 0
        for m in re.finditer(r"`([^`]+)`|\(|\)", desc):
            tok, between = m.group(1), desc[last_end:m.start()].strip()
            last_end = m.end()
            if m.group(0) == "(":
                scopes.append(last_dir if last_dir and not between else scopes[-1])
            elif m.group(0) == ")":
                scopes = scopes[:-1] or [folder]
            if tok is None or not PATH_TOKEN.fullmatch(tok):
                last_dir = None
                continue
            out.append((tok, (folder + tok, tok) if "/" in tok else (scopes[-1] + tok,)))
            last_dir = folder + tok if tok.endswith("/") else None
    return out


def missing_paths(root: Path, table: str) -> list[str]:
    return [f"`{tok}` (looked for {' or '.join(cands)})" for tok, cands in table_paths(table)
            if not any((root / c).exists() for c in cands)]


def test_readme_layout_table_names_existing_paths():
    table = layout_table(README.read_text(encoding="utf-8"))
    found = table_paths(table)
    rows = table.splitlines()[2:]
    assert rows and {tok for tok, _ in found} >= {re.findall(r"`([^`]+)`", r)[0] for r in rows}
    missing = missing_paths(REPO, table)
    assert not missing, "README's Layout table names paths that do not exist:\n" + "\n".join(missing)


def test_layout_check_catches_a_wrong_path(tmp_path):
    for f in ("pkg/a.py", "pkg/b.py", "pkg/sub/c.py", "pkg/sub/deep/d.py", "pkg/sub/e.py", "top/f.md",
              "gate/budgets.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    table = ("| path | what |\n|---|---|\n"
             "| `pkg/a.py`, `b.py` | `H3Config`, the `h3-trace/1` format, `make-checkpoint` |\n"
             "| `pkg/sub/` | `c.py`, `deep/` (its part: `d.py`, `e.py`) + `e.py`, `deep/d.py` (`top/f.md`) |\n"
             "| `pkg/` | `budgets.py` (now in `gate/`), `sub/` (`nope.py`) |\n")
    assert table_paths(table) == [
        ("pkg/a.py", ("pkg/a.py",)), ("b.py", ("pkg/b.py",)),
        ("pkg/sub/", ("pkg/sub/",)), ("c.py", ("pkg/sub/c.py",)), ("deep/", ("pkg/sub/deep/", "deep/")),
        ("d.py", ("pkg/sub/deep/d.py",)), ("e.py", ("pkg/sub/deep/e.py",)), ("e.py", ("pkg/sub/e.py",)),
        ("deep/d.py", ("pkg/sub/deep/d.py", "deep/d.py")), ("top/f.md", ("pkg/sub/top/f.md", "top/f.md")),
        ("pkg/", ("pkg/",)), ("budgets.py", ("pkg/budgets.py",)), ("gate/", ("pkg/gate/", "gate/")),
        ("sub/", ("pkg/sub/", "sub/")), ("nope.py", ("pkg/sub/nope.py",)),
    ]
    assert [m.split()[0] for m in missing_paths(tmp_path, table)] == ["`e.py`", "`budgets.py`", "`nope.py`"]
