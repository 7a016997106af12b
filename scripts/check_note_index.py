#!/usr/bin/env python3
"""Checks docs/architecture.md's table of Notes (§11): every Note named in a file git
tracks is listed there, and each listed Note is in the file the table names. Exit 1 with
what is missing."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTE = re.compile(r"Note \[([^\]]+)\]")
WRAP = re.compile(r"\s*\n\s*(?://|#|\*)?\s*")  # a name wrapped onto a comment's next line
ROW = re.compile(r"^\| ([^|]+?) \| `([^`]+)` \|")


def main():
    files = subprocess.run(["git", "-C", ROOT, "ls-files"], check=True, capture_output=True,
                           text=True).stdout.split()
    named = {}
    for path in files:
        if path.startswith("third_party/"):
            continue
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        for name in NOTE.findall(text):
            if "{" not in name:  # a format string's placeholder, not a Note
                named.setdefault(WRAP.sub(" ", name), path)
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        doc = f.read()
    table = doc[doc.index("## 11. The Notes"):] if "## 11. The Notes" in doc else ""
    listed = dict(m.groups() for m in map(ROW.match, table.splitlines()) if m and m.group(1) != "Note")
    problems = [f"Note [{n}] (named in {p}) is not in docs/architecture.md's table of Notes"
                for n, p in sorted(named.items()) if n not in listed]
    for name, path in sorted(listed.items()):
        full = os.path.join(ROOT, path)
        text = open(full, encoding="utf-8").read() if os.path.exists(full) else ""
        if name not in {WRAP.sub(" ", n) for n in NOTE.findall(text)}:
            problems.append(f"Note [{name}]: the table says {path}, which does not hold it")
    for p in problems:
        print(p, file=sys.stderr)
    print(f"check_note_index: {len(listed)} Notes listed, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
