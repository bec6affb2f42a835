#!/usr/bin/env python3
"""Mutation testing of the interposer: does any test notice when the code is wrong?

Each mutant is one small change to one line of one C source of ``interposer/src`` (a comparison
turned around or made strict, ``&&`` for ``||``, ``+`` for ``-``, a ``!`` dropped, a call
statement deleted).  The release library is rebuilt with it and the interposer tests run with
``-x`` (release variant only); a mutant that every test passes *survives*, and each survivor is
a behaviour no test pins down (or an equivalent change: read it).  The run happens in a
throwaway git worktree of HEAD, so the checkout and its build are never touched.

    python scripts/mutants.py list interposer/src/memory.c
    python scripts/mutants.py run --sample 10 --seed 7 --log /tmp/mutants.jsonl memory.c region.c

Comments, strings, preprocessor lines and log calls are never mutated.  ``run`` appends one JSON
line per mutant to the log (file, id, line, op, before, after, result, seconds, the first
failing test) and skips mutants the log already has, so an interrupted run goes on where it
stopped.  A mutant that takes longer than ``--timeout`` is counted as killed (a hang).
It is slow by nature (every survivor runs the whole selection: about 4 minutes on 2 cores), so
it is not part of the test suite; ``tests/interposer/test_mutants_tool.py`` tests the generator.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
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


def apply(text: str, mutant: dict) -> str:
    lines = text.split("\n")
    lines[mutant["line"] - 1] = mutant["text"]
    return "\n".join(lines)


def worktree() -> Path:
    """A worktree of HEAD with the checkout's virtual environment and its own build."""
    wt = Path(tempfile.mkdtemp(prefix="gpuslice-mutants-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(wt), "HEAD"], check=True)
    (wt / ".venv").symlink_to(ROOT / ".venv")
    subprocess.run(["make", "-C", str(wt / "interposer"), "-j2", "lib", "fakes", "tests"], check=True,
                   capture_output=True)
    return wt


def run_one(wt: Path, src: Path, text: str, mutant: dict, timeout: int) -> tuple[str, str]:
    src.write_text(apply(text, mutant))
    build = subprocess.run(["make", "-C", str(wt / "interposer"), "lib"], check=False, capture_output=True, text=True)
    if build.returncode != 0:
        return "invalid", build.stderr[-300:]
    tests = [f"tests/interposer/test_{t}.py" for t in TESTS]
    proc = subprocess.run(["timeout", "-k", "5", str(timeout), str(wt / ".venv/bin/python"), "-m", "pytest", "-x",
                           "-q", "-p", "no:cacheprovider", "-k", "not asan and not tsan", *tests],
                          cwd=wt, check=False, capture_output=True, text=True)
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    detail = (failed or last)[0][:200]
    if proc.returncode == 0:
        return "survived", detail
    return ("timeout" if proc.returncode in (124, 137) else "killed"), detail


def run(files: list[str], sample: int, seed: int, log: Path, timeout: int) -> int:
    done = set()
    if log.exists():
        done = {(r["file"], r["id"]) for r in map(json.loads, log.read_text().splitlines())}
    wt = worktree()
    try:
        for name in files:
            src = wt / "interposer" / "src" / Path(name).name
            text = src.read_text()
            every = mutants(text)
            chosen = every if not sample else sorted(random.Random(seed).sample(every, min(sample, len(every))),
                                                     key=lambda m: m["id"])
            try:
                for m in chosen:
                    if (src.name, m["id"]) in done:
                        continue
                    t0 = time.monotonic()
                    result, detail = run_one(wt, src, text, m, timeout)
                    rec = {"file": src.name, **{k: m[k] for k in ("id", "line", "op", "before", "after")},
                           "result": result, "secs": round(time.monotonic() - t0, 1), "detail": detail}
                    with log.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    print(f"{src.name}:{m['line']} #{m['id']} {m['op']}: {result} ({rec['secs']} s)", flush=True)
            finally:
                src.write_text(text)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False, capture_output=True)
        shutil.rmtree(wt, ignore_errors=True)
    records = [json.loads(ln) for ln in log.read_text().splitlines()]
    survivors = [r for r in records if r["result"] == "survived"]
    print(f"{len(records)} mutants in {log}: {len(survivors)} survived")
    for r in survivors:
        print(f"  {r['file']}:{r['line']} {r['op']}: {r['before']}  =>  {r['after']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="print a source's mutants")
    ls.add_argument("file")
    rn = sub.add_parser("run", help="run mutants of interposer/src files against the interposer tests")
    rn.add_argument("files", nargs="+", help="names in interposer/src (memory.c) or paths")
    rn.add_argument("--sample", type=int, default=0, help="this many mutants per file, chosen at random (0: all)")
    rn.add_argument("--seed", type=int, default=1)
    rn.add_argument("--log", type=Path, default=Path("mutants.jsonl"))
    rn.add_argument("--timeout", type=int, default=420, help="seconds before a mutant counts as a hang")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        every = mutants(Path(args.file).read_text())
        for m in every:
            print(f"#{m['id']} L{m['line']} {m['op']}: {m['before']}  =>  {m['after']}")
        print(f"{len(every)} mutants", file=sys.stderr)
        return 0
    return run(args.files, args.sample, args.seed, args.log, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
