"""Package code states no machine's timings: a figure measured on one machine ("~6 ms of a
33.5 ms step on a 2-core EPYC", "2.4x faster", "158 vs 118 tok/s") goes stale as the code
and the machines change, and soon contradicts the README's tables. Comments and docstrings
keep the reason ("the products dominate at batch 32"); the figure belongs to the script
that measures it (scripts/bench_*.py) and to the README's tables that quote the script.

Checked on the source: every comment (tokenize) and every docstring or bare string statement
(ast) of the package folders' Python, and every `//` comment of their C++ kernels. Code and the strings code uses (error messages, defaults) are
not read: `timeout: float = 5.0` and an f-string reporting "{elapsed:.1f} s" state no
measurement. What counts as a figure:

- a number with a unit of time (`12 s`, `0.4-2 s`, `~6 ms`, `4 us`);
- a number with a unit of rate (`tok/s`, `GB/s`, `GFLOP/s`, ...);
- a speed-up or share (`2.4x`, `~3%`);
- two figures set against each other (`36.25 vs 36.14`);
- a machine (`EPYC`, `Xeon`, `Ice Lake`, `H200`, `2-core`).

Sizes are not figures of a machine (`4 KB pages`, `16 MiB`), nor is a unit without a number
("timeout in s", "seconds a request waits"), nor a product of shapes (`576 x 3072`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["configs", "comm", "parallel", "layers", "engine", "launcher", "client"]

_NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?"
FIGURES = {
    # a bare "s" only after a space: "401s" are status codes
    "a duration": re.compile(_NUMBER + r"(?:\s*(?:ms|us|µs|ns|secs?|seconds?|minutes?)|\s+s)(?![\w/])"),
    "a rate": re.compile(_NUMBER + r"\s*(?:tok|tokens|[KMGT]i?B|[KMGT]?FLOP)/s\b|" + _NUMBER + r"\s*[GT]FLOPS\b"),
    "a ratio": re.compile(_NUMBER + r"x(?!\w)|" + _NUMBER + r"\s*%"),
    "a comparison": re.compile(_NUMBER + r"\s+(?:vs\.?|against)\s+~?\d"),
    "a machine": re.compile(r"\b(?:EPYC|Xeon|Ice Lake|Sapphire Rapids|Cascade Lake|Skylake|Zen ?\d|Graviton|"
                            r"[AHV]100|H200|B200|\d+-core|on \d+ (?:busy )?cores)\b"),
}


def prose(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment line and docstring line of a module's source."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        # docstrings, and the bare strings that document a module constant or a field
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return sorted(out)


def cpp_prose(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every `//` comment of a C++ source."""
    return [(number, line[line.index("//"):]) for number, line in enumerate(source.splitlines(), 1) if "//" in line]


def figures(source: str, cpp: bool = False) -> list[tuple[int, str, str]]:
    """(line, kind, text) of each comment or docstring line that states a figure."""
    return [(line, kind, text.strip()) for line, text in (cpp_prose(source) if cpp else prose(source))
            for kind, pattern in FIGURES.items() if pattern.search(text)]


CPP = (".cpp", ".h")


def package_files() -> list[Path]:
    return [path for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*"))
            if path.suffix in (".py", *CPP)]


def test_package_code_states_no_timings():
    found = [f"{path.relative_to(ROOT)}:{line}: {kind}: {text}"
             for path in package_files() for line, kind, text in figures(path.read_text(), path.suffix in CPP)]
    assert any(path.suffix == ".cpp" for path in package_files())
    assert not found, ("comments and docstrings state measured figures; keep the reason, move the figure "
                       "to the benchmark script and README:\n" + "\n".join(found))


@pytest.mark.parametrize("text", [
    "# ~6 ms of a 33.5 ms step at batch 1", "# 7.5 -> 2.1 ms", "# 158-168 vs 118 tok/s",
    "# the first compile took 166 s", "# ~3% of the step loop at 32 streams", "# 2.4x / 2.3x faster",
    "# 127 vs 155 GFLOP/s", "# on a 2-core EPYC", "# an Ice Lake Xeon", "# 0.6-1 s each, on an H200",
    "# a mask takes ~4 us", "# ~1 µs per block", "# at 1,700x slower", "# took 40 ms on 2 busy cores",
    "# measured on 2 cores", "# perplexity 36.25 vs 36.14", '"""Reads at 12 GB/s."""',
    'def f():\n    """Loads the table.\n\n    That takes ~9 s."""', 'LIMIT = 3\n"""Past it, a step costs 5% more."""',
])
def test_figures_are_found(text):
    assert figures(text + "\n")


@pytest.mark.parametrize("text", [
    "timeout: float = 5.0  # in s", "# seconds a request waits for a connection", "# 4 KB pages",
    "# a 16 MiB body", "# tp 3 x pp 2 on two nodes", "# the 576 x 3072 gate/up", "# 0x8915: an ioctl",
    "raise ValueError(f'no heartbeat for {t:.0f} s')", "x = 10  # ms", "# 4-D inputs", "# layers 0-3",
    "# every answer, 401s included", '"""Waits up to `timeout_s` seconds."""', "# milliseconds per call on a small CPU",
    'log.info("ready in %.1f s", 2.5)',
])
def test_no_false_figures(text):
    assert not figures(text + "\n")


def test_cpp_comments_are_read():
    source = "int x = 4;  // 12 us a call\n// on a 2-core EPYC\nfloat y = 0.5f;  // the 16 lanes\n"
    assert [(line, kind) for line, kind, _ in figures(source, cpp=True)] == [(1, "a duration"), (2, "a machine")]
