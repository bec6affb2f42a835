#!/usr/bin/env python3
"""Mutation testing: does any test notice when the code is wrong?

Each mutant is one small change to one line of one source (a comparison turned around or made
strict, ``&&`` for ``||`` (``and`` for ``or``), ``+`` for ``-``, a ``!`` (``not``) dropped, a call
statement deleted; in Python also ``True`` for ``False``).  For a C source of ``interposer/src``
the release library is rebuilt with it and the interposer tests run with ``-x`` (release variant
only); for a Python source of ``webhook/`` the tests of its package (``tests/placement`` for
``webhook/placement/``, or ``--tests``).  A mutant that every test passes *survives*, and each
survivor is a behaviour no test pins down (or an equivalent change: read it).  The run happens
in a throwaway git worktree of HEAD, so the checkout and its build are never touched.

    python scripts/mutants.py list interposer/src/memory.c
    python scripts/mutants.py run --sample 10 --seed 7 --log /tmp/mutants.jsonl memory.c region.c
    python scripts/mutants.py run --log /tmp/py.jsonl --tests tests/placement/test_fit.py -- webhook/placement/fit.py
    python scripts/mutants.py run --log /tmp/py2.jsonl --recheck /tmp/py.jsonl webhook/placement/fit.py
    python scripts/mutants.py run --since HEAD~3 --log /tmp/review.jsonl --tests tests/interposer/test_reconcile.py -- reconcile.c

Comments, strings, preprocessor lines, docstrings and log calls are never mutated.  ``run`` appends one JSON
line per mutant to the log (file, id, line, op, before, after, result, seconds, the first
failing test) and skips mutants the log already has, so an interrupted run goes on where it
stopped.  A mutant that takes longer than ``--timeout`` is counted as killed (a hang).
Before its first mutant, each test selection runs once on the unchanged code and must pass
(a misspelt test path or a failing test would otherwise kill every mutant); a run whose
pytest reports its own error, a bad command line or no tests is logged as ``error``.
It is slow by nature (every survivor runs the whole selection: about 4 minutes on 2 cores), so
it is not part of the test suite; ``tests/test_mutants_tool.py`` tests the generator.  ``--since REV``
keeps only the mutants of lines HEAD changed since REV: a change's own lines, for its review.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the test files run against each mutant, the quick and the most discriminating first (the
# throttle's timing tests and the GPU-check rehearsal are left out: 15 minutes between them)
TESTS = ["views", "limits_file", "near_cap_growth", "paths", "hook_sweep", "memory", "threads",
         "sharing", "reconcile", "pipeline", "ipc", "graphs", "managed", "cudart", "damaged_region",
         "region_layout", "nonroot", "rehearsal_standins", "multiprocess_fuzz", "outside_check"]

OPS = [
    ("eq", re.compile(r"(?<![<>=!])==(?!=)"), "!="),
    ("ne", re.compile(r"!="), "=="),
    ("le", re.compile(r"(?<![<])<=(?!=)"), "<"),
    ("lt", re.compile(r"(?<![<])<(?![<=])"), "<="),
    ("ge", re.compile(r"(?<![>-])>=(?!=)"), ">"),
    ("gt", re.compile(r"(?<![>-])>(?![>=])"), ">="),
    ("and", re.compile(r"&&"), "||"),
    ("or", re.compile(r"\|\|"), "&&"),
    ("add", re.compile(r"(?<=\w|\)) \+ (?=[\w(])"), " - "),
    ("sub", re.compile(r"(?<=\w|\)) - (?=[\w(])"), " + "),
    ("addeq", re.compile(r" \+= "), " -= "),
    ("subeq", re.compile(r" -= "), " += "),
    ("not", re.compile(r"(?<=\()!(?=[\w(])"), ""),
]
# a whole-line call statement (deleted), not a declaration, assignment or control statement
CALL = re.compile(r"^(\s+)([A-Za-z_][\w.>\-\[\]]*\s*\(.*\)\s*;)\s*$")
NOT_A_CALL = re.compile(r"^(return|if|while|for|switch|sizeof|assert|pthread_mutex_(un)?lock)\b")
LOG_CALL = re.compile(r"\bGS_(INFO|WARN|DEBUG|ERROR|LOG|TRACE|FATAL)\w*\s*\(|\bgs_log\w*\s*\(")


def code_of(lines: list[str]) -> list[str]:
    """Each line with its comments, string and character literals blanked (same length), and
    preprocessor lines blanked whole."""
    out, in_comment = [], False
    for line in lines:
        if not in_comment and line.lstrip().startswith("#"):
            out.append(" " * len(line))
            continue
        chars, i, quote = list(line), 0, None
        while i < len(line):
            if in_comment:
                if line.startswith("*/", i):
                    chars[i:i + 2] = "  "
                    in_comment = False
                    i += 2
                    continue
                chars[i] = " "
            elif quote:
                if line[i] == "\\":
                    chars[i:i + 2] = " " * len(chars[i:i + 2])
                    i += 2
                    continue
                if line[i] == quote:
                    quote = None
                chars[i] = " "
            elif line.startswith("/*", i):
                chars[i:i + 2] = "  "
                in_comment = True
                i += 2
                continue
            elif line.startswith("//", i):
                chars[i:] = " " * (len(line) - i)
                break
            elif line[i] in "\"'":
                quote = line[i]
                chars[i] = " "
            i += 1
        out.append("".join(chars))
    return out


def mutants(text: str) -> list[dict]:
    """Every mutant of a C source, in line order: {id, line (1-based), op, before, after, text}."""
    lines = text.split("\n")
    out: list[dict] = []
    in_log = 0
    for n, (line, code) in enumerate(zip(lines, code_of(lines))):
        if in_log or LOG_CALL.search(code):  # a log call, its continuation lines too
            depth = in_log + code.count("(") - code.count(")")
            in_log = max(depth, 0)
            continue
        if not code.strip():
            continue
        for name, rx, repl in OPS:
            for m in rx.finditer(code):
                new = line[:m.start()] + repl + line[m.end():]
                out.append({"line": n + 1, "op": name, "before": line.strip(), "after": new.strip(), "text": new})
        call = CALL.match(code)
        if call and not NOT_A_CALL.match(call.group(2)) and code.count("(") == code.count(")") \
                and "=" not in call.group(2).split("(")[0]:
            out.append({"line": n + 1, "op": "del", "before": line.strip(), "after": "(deleted)",
                        "text": call.group(1) + "(void)0; /* deleted */"})
    for i, m in enumerate(out):
        m["id"] = i
    return out


PY_OPS = {"==": ("eq", "!="), "!=": ("ne", "=="), "<": ("lt", "<="), "<=": ("le", "<"), ">": ("gt", ">="),
          ">=": ("ge", ">"), "+": ("add", "-"), "-": ("sub", "+"), "+=": ("addeq", "-="), "-=": ("subeq", "+="),
          "and": ("and", "or"), "or": ("or", "and"), "True": ("true", "False"), "False": ("false", "True"),
          "not": ("not", "")}
PY_LOG = re.compile(r"^\s*(log|logger|LOG|_log)\.\w+\(")
PY_CALL = re.compile(r"^(\s*)((?:await\s+)?[A-Za-z_][\w.]*\(.*\))\s*$")
PY_LOGGERS = {"log", "logger", "LOG", "_log"}


def py_log_lines(text: str) -> set[int]:
    """The lines of every log call statement (``log.info(...)`` and its kin), all the lines it
    spans: a message or an ``extra=`` spread over several lines is not behaviour to pin."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {n + 1 for n, line in enumerate(text.split("\n")) if PY_LOG.match(line)}
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Attribute) and isinstance(node.value.func.value, ast.Name) \
                and node.value.func.value.id in PY_LOGGERS:
            out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return out


def py_mutants(text: str) -> list[dict]:
    """Every mutant of a Python source, from its tokens: operators and the keywords above, in
    code only (never in strings or comments), and call statements
    that fit on one line, replaced by ``pass``.  Same records as :func:`mutants`."""
    lines = text.split("\n")
    out: list[dict] = []
    toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    logs = py_log_lines(text)
    unary = {"(", "[", "{", ",", "=", "return", ":", "==", "!=", "<", ">", "<=", ">=", "and", "or", "not", "in",
             "if", "else", "*", "/", "+", "-", "**", "lambda", "yield"}
    prev = None
    for tok in toks:
        kind, string, (row, col), (erow, ecol), _ = tok
        if kind in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            prev = tok if kind != tokenize.COMMENT else prev
            continue
        line = lines[row - 1]
        is_op = kind in (tokenize.OP, tokenize.NAME) and string in PY_OPS
        # a sign, not a subtraction: "-1", "(-x)"
        signed = string in ("+", "-") and (prev is None or prev.string in unary or prev.type in (
            tokenize.NEWLINE, tokenize.NL, tokenize.INDENT))
        if is_op and row == erow and not signed and row not in logs and not line.lstrip().startswith("@"):
            name, repl = PY_OPS[string]
            end = ecol + (1 if string == "not" and line[ecol:ecol + 1] == " " else 0)
            new = line[:col] + repl + line[end:]
            out.append({"line": row, "op": name, "before": line.strip(), "after": new.strip(), "text": new})
        prev = tok
    for n, line in enumerate(lines):
        m = PY_CALL.match(line)
        if m and m.group(2).count("(") == m.group(2).count(")") and n + 1 not in logs \
                and not line.rstrip().endswith((",", "(")) and (n + 1 >= len(lines) or not lines[n + 1].startswith(
                    (m.group(1) + " ", m.group(1) + ")"))):
            out.append({"line": n + 1, "op": "del", "before": line.strip(), "after": "(deleted)",
                        "text": m.group(1) + "pass  # deleted"})
    out.sort(key=lambda m: m["line"])
    for i, m in enumerate(out):
        m["id"] = i
    return out


def mutants_of(path: Path, text: str) -> list[dict]:
    return py_mutants(text) if path.suffix == ".py" else mutants(text)


def apply(text: str, mutant: dict) -> str:
    lines = text.split("\n")
    lines[mutant["line"] - 1] = mutant["text"]
    return "\n".join(lines)


def worktree(build: bool) -> Path:
    """A worktree of HEAD with the checkout's virtual environment and (for C) its own build."""
    wt = Path(tempfile.mkdtemp(prefix="gpuslice-mutants-"))
    wt.chmod(0o755)  # (mkdtemp's 0700: test_nonroot's processes of other users load the library from it)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(wt), "HEAD"], check=True)
    (wt / ".venv").symlink_to(ROOT / ".venv")
    if build:
        subprocess.run(["make", "-C", str(wt / "interposer"), "-j2", "lib", "fakes", "tests"], check=True,
                       capture_output=True)
    return wt


def tests_for(src: Path, wt: Path) -> list[str]:
    """The tests a mutant of ``src`` runs against: the interposer's, or its package's."""
    if src.suffix == ".c":
        return [f"tests/interposer/test_{t}.py" for t in TESTS]
    parts = src.relative_to(wt / "webhook").parts  # ("placement", "fit.py")
    return [f"tests/{parts[0]}"] if len(parts) > 1 and (wt / "tests" / parts[0]).is_dir() else ["tests"]


def run_one(wt: Path, src: Path, text: str, mutant: dict, timeout: int, tests: list[str]) -> tuple[str, str]:
    mutated = apply(text, mutant)
    if src.suffix == ".py":
        try:
            compile(mutated, str(src), "exec")
        except SyntaxError as exc:
            return "invalid", str(exc)[:300]
    src.write_text(mutated)
    if src.suffix == ".c":
        build = subprocess.run(["make", "-C", str(wt / "interposer"), "lib"], check=False, capture_output=True,
                               text=True)
        if build.returncode != 0:
            return "invalid", build.stderr[-300:]
    return verdict(pytest_in(wt, tests, selection(src), timeout))


def selection(src: Path) -> list[str]:
    """The ``-k`` a source's tests run with: the release variant only, for C."""
    return ["-k", "not asan and not tsan"] if src.suffix == ".c" else []


def pytest_in(wt: Path, tests: list[str], select: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["timeout", "-k", "5", str(timeout), str(wt / ".venv/bin/python"), "-m", "pytest", "-x",
                           "-q", "-p", "no:cacheprovider", *select, *tests],
                          check=False, cwd=wt, capture_output=True, text=True)


def verdict(proc: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """What a run of the tests says about a mutant: pytest's exit status, read.

    1 (a test failed) and 2 (collection stopped: the mutant broke an import) kill it; 3, 4 and 5
    (pytest's own error, a bad command line, no tests) say nothing about it and count as an error.
    """
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    last = proc.stdout.strip().splitlines()[-1:] or proc.stderr.strip().splitlines()[-1:] or [""]
    detail = (failed or last)[0][:200]
    if proc.returncode == 0:
        return "survived", detail
    if proc.returncode in (124, 137):
        return "timeout", detail
    return ("killed" if proc.returncode in (1, 2) else "error"), detail


def baseline(wt: Path, tests: list[str], select: list[str], timeout: int) -> None:
    """The selection must pass on the unchanged code, or every mutant would look killed."""
    proc = pytest_in(wt, tests, select, timeout)
    if proc.returncode != 0:
        result, detail = verdict(proc)
        raise SystemExit(f"the tests fail before any mutant ({result}, exit {proc.returncode}): {detail}\n"
                         f"  tests: {' '.join(tests)}")


def source(wt: Path, name: str) -> Path:
    """A source in the worktree: a name in interposer/src (memory.c), or a path from the root."""
    path = Path(name)
    if path.suffix == ".c" and len(path.parts) == 1:
        return wt / "interposer" / "src" / path.name
    return wt / (path.resolve().relative_to(ROOT) if path.is_absolute() else path)


def changed_lines(rev: str, rel: str, root: Path = ROOT) -> set[int]:
    """The lines of ``rel`` (as HEAD has it) that HEAD changed or added since ``rev``."""
    diff = subprocess.run(["git", "-C", str(root), "diff", "-U0", rev, "HEAD", "--", rel],
                          capture_output=True, text=True, check=True).stdout
    lines: set[int] = set()
    for hunk in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.MULTILINE):
        start, count = int(hunk[1]), int(hunk[2] or "1")
        lines.update(range(start, start + count))
    return lines


def change(file: str, mutant: dict) -> tuple[str, str, str, str]:
    """What a mutant changes (file, operator, the line before and after), which an edit elsewhere
    in the file does not move as it moves the mutant's number and line."""
    return file, mutant["op"], mutant["before"], mutant["after"]


def survivors(log: Path) -> set[tuple[str, str, str, str]]:
    """The changes of the mutants an earlier log saw survive (``--recheck``)."""
    return {change(r["file"], r) for r in map(json.loads, log.read_text().splitlines()) if r["result"] == "survived"}


def run(files: list[str], sample: int, seed: int, log: Path, timeout: int, tests: list[str] | None,
        recheck: Path | None = None, since: str | None = None) -> int:
    done = set()
    if log.exists():
        done = {(r["file"], r["id"]) for r in map(json.loads, log.read_text().splitlines())}
    again = survivors(recheck) if recheck else None  # (a quick selection first, then all)
    wt = worktree(build=any(name.endswith(".c") for name in files))
    passed: set[tuple[tuple[str, ...], str]] = set()  # selections seen passing on the unchanged code
    try:
        for name in files:
            src = source(wt, name)
            key = str(src.relative_to(wt / "interposer" / "src" if src.suffix == ".c" else wt))
            text = src.read_text()
            every = mutants_of(src, text)
            if since:  # --since: only what a change wrote
                touched = changed_lines(since, str(src.relative_to(wt)))
                every = [m for m in every if m["line"] in touched]
            chosen = every if not sample else sorted(random.Random(seed).sample(every, min(sample, len(every))),
                                                     key=lambda m: m["id"])
            try:
                for m in chosen:
                    if (key, m["id"]) in done or (again is not None and change(key, m) not in again):
                        continue
                    chosen_tests = tests or tests_for(src, wt)
                    if (key_tests := (tuple(chosen_tests), src.suffix)) not in passed:
                        baseline(wt, chosen_tests, selection(src), timeout)
                        passed.add(key_tests)
                    t0 = time.monotonic()
                    result, detail = run_one(wt, src, text, m, timeout, chosen_tests)
                    rec = {"file": key, **{k: m[k] for k in ("id", "line", "op", "before", "after")},
                           "result": result, "secs": round(time.monotonic() - t0, 1), "detail": detail}
                    with log.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    print(f"{key}:{m['line']} #{m['id']} {m['op']}: {result} ({rec['secs']} s)", flush=True)
            finally:
                src.write_text(text)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False,
                       capture_output=True)
        shutil.rmtree(wt, ignore_errors=True)
    records = [json.loads(ln) for ln in log.read_text().splitlines()]
    alive = [r for r in records if r["result"] == "survived"]
    print(f"{len(records)} mutants in {log}: {len(alive)} survived")
    for r in alive:
        print(f"  {r['file']}:{r['line']} {r['op']}: {r['before']}  =>  {r['after']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="print a source's mutants")
    ls.add_argument("file", help="a name in interposer/src (memory.c), or a path")
    rn = sub.add_parser("run", help="run mutants of sources against their tests")
    rn.add_argument("files", nargs="+", help="names in interposer/src (memory.c), or paths (webhook/placement/fit.py)")
    rn.add_argument("--tests", nargs="+", help="the tests to run (default: the interposer's for C, the package's)")
    rn.add_argument("--sample", type=int, default=0, help="this many mutants per file, chosen at random (0: all)")
    rn.add_argument("--seed", type=int, default=1)
    rn.add_argument("--log", type=Path, default=Path("mutants.jsonl"))
    rn.add_argument("--recheck", type=Path, help="run only the mutants that survived in this earlier log")
    rn.add_argument("--timeout", type=int, default=420, help="seconds before a mutant counts as a hang")
    rn.add_argument("--since", metavar="REV", help="only mutants of lines HEAD changed since REV (a change's review)")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        path = source(ROOT, args.file)
        every = mutants_of(path, path.read_text())
        for m in every:
            print(f"#{m['id']} L{m['line']} {m['op']}: {m['before']}  =>  {m['after']}")
        print(f"{len(every)} mutants", file=sys.stderr)
        return 0
    return run(args.files, args.sample, args.seed, args.log, args.timeout, args.tests, args.recheck, args.since)


if __name__ == "__main__":
    sys.exit(main())
