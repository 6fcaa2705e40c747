"""Clean-room check: h3direct/ shares no run of identical code with ComfyUI's H3 sources.

ComfyUI (GPL-3.0) is this project's oracle, read for facts only. This test normalises both sides to their
logical statements (comments, docstrings, blank lines and line wrapping gone, white space collapsed) and
fails on any run of MIN_RUN or more consecutive identical statements, printing both places. Statements
that any two implementations of the same facts would share are exempt (see `is_trivial`): imports,
constant and config-field assignments, `return x`, `pass`, `else:` and the like.

The comparison needs a ComfyUI checkout (--comfy-root or $H3_COMFY_ROOT, marker `comfy`); the detector's own tests
run everywhere, so the check itself is known to be able to fail.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MIN_RUN = 4

# ComfyUI files holding the H3 model, its VAEs, nodes, text encoder, model sampling, samplers and caches.
COMFY_SOURCES = (
    "comfy/ldm/minimax/*.py",
    "comfy_extras/nodes_minimax_h3.py",
    "comfy/text_encoders/minimax.py",
    "comfy/text_encoders/qwen3vl.py",
    "comfy/text_encoders/qwen_vl.py",
    "comfy/text_encoders/llama.py",
    "comfy/model_base.py",
    "comfy/model_sampling.py",
    "comfy/samplers.py",
    "comfy/sample.py",
    "comfy/k_diffusion/sampling.py",
    "comfy_extras/nodes_easycache.py",
)


@dataclass(frozen=True)
class Statement:
    line: int  # first physical line
    text: str  # normalised: tokens joined by single spaces


def _docstring_lines(tree: ast.AST) -> set[int]:
    """Physical lines of statements that are a bare string (docstrings and string 'comments')."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def statements(source: str) -> list[Statement]:
    """The logical statements of `source`, normalised; docstrings, comments and blank lines dropped."""
    try:
        skip = _docstring_lines(ast.parse(source))
    except SyntaxError:  # a fragment (the detector's tests): no docstrings to drop
        skip = set()
    out: list[Statement] = []
    words: list[str] = []
    first = 0
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
              tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in layout:
            continue
        if tok.type == tokenize.NEWLINE:
            if words and first not in skip:
                out.append(Statement(first, " ".join(words)))
            words = []
            continue
        if not words:
            first = tok.start[0]
        words.append(tok.string)
    if words and first not in skip:
        out.append(Statement(first, " ".join(words)))
    return out


def _literal(node: ast.AST) -> bool:
    """A constant expression: literals, names of constants (UPPER_CASE), tuples/lists of them, arithmetic."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id.isupper()
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    return False


def _parses_to_literal(expr: str) -> bool:
    try:
        return _literal(ast.parse(expr, mode="eval").body)
    except SyntaxError:
        return False


def is_trivial(text: str) -> bool:
    """Statements two independent implementations of the same facts would share anyway."""
    if text.startswith(("import ", "from ", "@")) or text.count(" ") < 2:  # imports, decorators, `return x`
        return True
    if text in {"else :", "try :", "finally :", "pass", "break", "continue", "super ( ) . __init__ ( )"}:
        return True
    if text.startswith("return "):  # return of one name or literal
        value = text[len("return "):]
        return value.isidentifier() or _parses_to_literal(value)
    try:
        node = ast.parse(text + " pass" if text.endswith(":") else text).body[0]
    except SyntaxError:  # a clause header on its own (elif x:, except E:, …) is not trivial
        return False
    if isinstance(node, ast.AnnAssign):  # dataclass / config fields: `name: T` or `name: T = constant`
        return node.value is None or _literal(node.value)
    if isinstance(node, ast.Assign):
        value = node.value
        if _literal(value):  # NAME = constant
            return True
        # config fields copied onto the module: self.heads = heads / self.eps = eps
        return all(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                   for t in node.targets) and isinstance(value, ast.Name | ast.Constant)
    return False


@dataclass(frozen=True)
class Run:
    ours: str
    ours_lines: tuple[int, int]
    theirs: str
    theirs_lines: tuple[int, int]
    length: int

    def __str__(self) -> str:
        (a0, a1), (b0, b1) = self.ours_lines, self.theirs_lines
        return f"{self.length} statements: {self.ours}:{a0}-{a1} == {self.theirs}:{b0}-{b1}"


def shared_runs(ours: dict[str, str], theirs: dict[str, str], min_run: int = MIN_RUN) -> list[Run]:
    """Maximal runs of >= min_run consecutive identical non-trivial statements, {name: source} on each side."""
    def kept(src: str) -> list[Statement]:
        return [s for s in statements(src) if not is_trivial(s.text)]

    index: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    their_seqs = {name: kept(src) for name, src in theirs.items()}
    for name, seq in their_seqs.items():
        for i in range(len(seq) - min_run + 1):
            index.setdefault(tuple(s.text for s in seq[i:i + min_run]), []).append((name, i))
    runs: list[Run] = []
    for name, src in ours.items():
        seq = kept(src)
        covered: set[tuple[str, int, int]] = set()  # (their file, our start, their start) already reported
        for i in range(len(seq) - min_run + 1):
            for other, j in index.get(tuple(s.text for s in seq[i:i + min_run]), ()):
                if (other, i, j) in covered:
                    continue
                rs = their_seqs[other]
                n = min_run
                while i + n < len(seq) and j + n < len(rs) and seq[i + n].text == rs[j + n].text:
                    n += 1
                covered.update((other, i + k, j + k) for k in range(n))
                runs.append(Run(name, (seq[i].line, seq[i + n - 1].line), other, (rs[j].line, rs[j + n - 1].line), n))
    return runs


def _read_tree(root: Path, patterns) -> dict[str, str]:
    files = sorted({p for pat in patterns for p in root.glob(pat) if p.is_file()})
    return {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in files}


# ---- the detector can fail ------------------------------------------------------------------------

_SHARED = [
    "h = self.norm(x[lo:hi])",
    "y = h * (1.0 + scale[row]) + shift[row]",
    "out = self.head(y.to(torch.float32))",
    "total = out.sum(dim=-1, keepdim=True)",
]


def _source(body: list[str], prefix: str) -> str:
    lines = [f'"""{prefix} module."""', "import torch", "", "", f"def {prefix}(x, lo, hi, row, scale, shift):"]
    lines += [f"    {line}" for line in body] + ["    return total", ""]
    return "\n".join(lines)


def test_detector_finds_four_shared_statements_despite_comments_and_wrapping():
    ours = _source(["# our own words", *_SHARED[:2], "", "out = self.head(", "    y.to(torch.float32))  # fp32 head",
                    _SHARED[3]], "ours")
    theirs = _source(["unrelated = 1 + x", *_SHARED, "z = total * 2"], "theirs")
    runs = shared_runs({"ours.py": ours}, {"theirs.py": theirs})
    assert len(runs) == 1, runs
    assert runs[0].length == 4 and runs[0].ours_lines == (7, 12) and runs[0].theirs_lines == (7, 10), str(runs[0])


def test_detector_ignores_three_shared_statements():
    ours = _source([*_SHARED[:3], "total = out.mean(dim=-1)"], "ours")
    theirs = _source(_SHARED, "theirs")
    assert shared_runs({"ours.py": ours}, {"theirs.py": theirs}) == []


def test_detector_exempts_trivial_statements():
    trivial = ["import math", "FPS = 24", "MAX = 768 * 1344", "self.heads = heads", "return out", "return 0.0",
               "pass", "name: int = 3", "else:", "@property"]
    assert [t for t in trivial if not is_trivial(statements(t)[0].text)] == []
    body = ["self.heads = heads", "self.eps = eps", "self.dim = dim", "self.out = out", "FPS = 24"]
    assert shared_runs({"a.py": _source(body, "a")}, {"b.py": _source(body, "b")}) == []
    assert not is_trivial("h = self.norm ( x [ lo : hi ] )")


# ---- the comparison with ComfyUI -----------------------------------------------------------------

@pytest.mark.comfy
def test_no_statement_runs_shared_with_comfyui(comfy_root):
    root = Path(comfy_root)
    theirs = _read_tree(root, COMFY_SOURCES)
    assert "comfy/ldm/minimax/model.py" in theirs, f"{root} does not look like a ComfyUI checkout with H3"
    ours = _read_tree(REPO, ["h3direct/**/*.py"])
    runs = shared_runs(ours, theirs)
    assert not runs, (f"{len(runs)} run(s) of >= {MIN_RUN} statements identical to ComfyUI (GPL-3.0); rewrite them "
                      "from the math in our own words:\n" + "\n".join(map(str, runs)))
