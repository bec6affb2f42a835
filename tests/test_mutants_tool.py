"""scripts/mutants.py's generator: which changes it makes, and where it makes none."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
assert spec and spec.loader
mutants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)

SOURCE = r'''#include <stdio.h>
#define LIMIT(a, b) ((a) < (b) ? (a) : (b))
/* a comment with a < b && c || d == e, spread
 * over two lines: x - y */
static int f(struct s *p, int a, int b)
{
    if (!p || p->n >= a) return -1; // a - b
    GS_INFO("refused: %d < %d && %s", a,
            b - 1, "x || y");
    release(p, a - b);
    p->n += a;
    return a == b && b != 0 ? printf("<%d>", a) : 0;
}'''


def test_each_operator_gives_one_mutant_in_code_and_none_in_comments_strings_logs_or_macros() -> None:
    got = [(m["line"], m["op"], m["after"]) for m in mutants.mutants(SOURCE)]
    assert got == [
        (7, "ge", "if (!p || p->n > a) return -1; // a - b"),
        (7, "or", "if (!p && p->n >= a) return -1; // a - b"),
        (7, "not", "if (p || p->n >= a) return -1; // a - b"),
        (10, "sub", "release(p, a + b);"),
        (10, "del", "(deleted)"),
        (11, "addeq", "p->n -= a;"),
        (12, "eq", 'return a != b && b != 0 ? printf("<%d>", a) : 0;'),
        (12, "ne", 'return a == b && b == 0 ? printf("<%d>", a) : 0;'),
        (12, "and", 'return a == b || b != 0 ? printf("<%d>", a) : 0;'),
    ]
    assert [m["id"] for m in mutants.mutants(SOURCE)] == list(range(len(got)))


def test_a_mutant_changes_its_one_line_and_nothing_else() -> None:
    for m in mutants.mutants(SOURCE):
        before, after = SOURCE.split("\n"), mutants.apply(SOURCE, m).split("\n")
        assert len(before) == len(after)
        assert [i + 1 for i, (x, y) in enumerate(zip(before, after)) if x != y] == [m["line"]]


def test_every_source_of_the_library_has_mutants_and_list_prints_them() -> None:
    sources = sorted((ROOT / "interposer" / "src").glob("*.c"))
    counts = {src.name: len(mutants.mutants(src.read_text())) for src in sources}
    assert all(counts.values()), counts
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py"), "list",
                          str(ROOT / "interposer" / "src" / "budget.c")], capture_output=True, text=True, check=True)
    assert len(out.stdout.splitlines()) == counts["budget.c"]
    assert out.stderr.strip() == f"{counts['budget.c']} mutants"
    # a bare name of interposer/src, as `run` takes it
    named = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py"), "list", "budget.c"],
                           capture_output=True, text=True, check=True, cwd=ROOT / "tests")
    assert named.stdout == out.stdout


PY_SOURCE = '''"""A docstring: a < b and c == d."""
import logging

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class C:
    def f(self, a, b):
        if not a or b >= -1:  # a comment: x - y
            log.info("refused: %s < %s", a, b - 1)
            self.release(a - b)
            return True
        total = sum(
            x for x in a)
        return "a == b" if a is not b else total

    def g(self, a, b):
        log.warning("over by %d",
                    a - b, extra={"gone": a == b})
        return a - b
'''


def test_python_mutants_come_from_tokens_in_code_only() -> None:
    got = [(m["line"], m["op"], m["after"]) for m in mutants.py_mutants(PY_SOURCE)]
    assert got == [
        (10, "not", "if a or b >= -1:  # a comment: x - y"),
        (10, "or", "if not a and b >= -1:  # a comment: x - y"),
        (10, "ge", "if not a or b > -1:  # a comment: x - y"),
        (12, "sub", "self.release(a + b)"),
        (12, "del", "(deleted)"),
        (13, "true", "return False"),
        (16, "not", 'return "a == b" if a is b else total'),
        (21, "sub", "return a + b"),  # a log call's lines, all of them, are not mutated
    ]
    for m in mutants.py_mutants(PY_SOURCE):
        compile(mutants.apply(PY_SOURCE, m), "x.py", "exec")  # each one a program


def test_since_picks_the_lines_a_change_wrote(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    src = tmp_path / "a.c"
    src.write_text("".join(f"int v{i} = {i};\n" for i in range(1, 9)))
    git("add", "a.c")
    git("commit", "-qm", "one")
    lines = src.read_text().splitlines()
    lines[1] = "int v2 = 20;"                         # changed: line 2
    del lines[3]                                     # removed: nothing of HEAD's to mutate
    lines[4:6] = ["int v6 = 6 + 1;", "int v7 = 7 * 2;", "int w = 0;"]  # changed and added: 5-7
    src.write_text("\n".join(lines) + "\n")
    git("commit", "-qam", "two")
    assert mutants.changed_lines("HEAD~1", "a.c", tmp_path) == {2, 5, 6, 7}


def test_a_selection_must_pass_unchanged_and_pytest_errors_kill_no_mutant(tmp_path: Path) -> None:
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert 1 + 1 == 3\n")
    (tmp_path / "test_imports.py").write_text("import no_such_module_here\n\ndef test_x():\n    pass\n")

    def run(*tests: str, select: tuple[str, ...] = ()) -> tuple[str, str]:
        return mutants.verdict(mutants.pytest_in(tmp_path, list(tests), list(select), 60))

    assert run("test_ok.py")[0] == "survived"
    result, detail = run("test_bad.py")
    assert result == "killed" and "test_bad" in detail
    assert run("test_imports.py")[0] == "killed"          # a mutant that breaks an import
    assert run("test_missing.py")[0] == "error"           # a misspelt path: pytest exits 4
    assert run("test_ok.py", select=("-k", "nothing_matches"))[0] == "error"  # no tests: exit 5

    mutants.baseline(tmp_path, ["test_ok.py"], [], 60)    # passes: returns
    for tests in (["test_ok.py", "test_bad.py"], ["test_missing.py"]):
        try:
            mutants.baseline(tmp_path, tests, [], 60)
        except SystemExit as exc:
            assert "fail before any mutant" in str(exc) and tests[-1] in str(exc)
        else:
            raise AssertionError(f"{tests} failing unchanged let the mutants run")


def test_a_recheck_finds_its_survivors_in_a_source_edited_since(tmp_path: Path) -> None:
    # the survivors' tests were written, and the source was touched too: the mutants' numbers
    # and lines moved, what they change did not
    before = mutants.py_mutants(PY_SOURCE)
    survived = [m for m in before if m["op"] in ("sub", "true")]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"file": "x.py", **{k: m[k] for k in ("id", "line", "op", "before", "after")},
                                       "result": "survived"}) + "\n" for m in survived)
                   + json.dumps({"file": "x.py", **{k: before[0][k] for k in ("id", "line", "op", "before", "after")},
                                 "result": "killed"}) + "\n")
    edited = PY_SOURCE.replace("import logging\n", "import logging\nTWO = 1 + 1\n")  # a mutant more, first
    again = mutants.survivors(log)
    found = [m for m in mutants.py_mutants(edited) if mutants.change("x.py", m) in again]
    assert [(m["line"], m["op"]) for m in found] == [(m["line"] + 1, m["op"]) for m in survived]
    assert [m["id"] for m in found] != [m["id"] for m in survived]  # numbered otherwise now
