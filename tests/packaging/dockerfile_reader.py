"""A small Dockerfile reader: enough to check what can be checked without a Docker daemon.

Reads instructions (continuations joined, comments dropped), global ARG defaults, and stages
(`FROM image AS name`) with their instructions; resolves `${ARG}` in FROM lines; answers
inherited settings (USER, ENTRYPOINT, HEALTHCHECK) by walking a stage's FROM chain; and matches
paths against a `.dockerignore` the way Docker does (last pattern wins, `!` re-includes, a
pattern that matches a parent directory matches everything under it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str
    value: str
    line: int

    def flags(self) -> dict[str, str]:
        """Leading `--name=value` flags (COPY --from=, --chown=, FROM --platform=)."""
        out = {}
        for tok in self.value.split():
            if not tok.startswith("--"):
                break
            name, _, val = tok[2:].partition("=")
            out[name] = val
        return out

    def args(self) -> list[str]:
        """Arguments after the flags; exec (JSON) form is decoded."""
        rest = self.value
        while rest.startswith("--"):
            rest = rest.split(None, 1)[1] if " " in rest else ""
        rest = rest.strip()
        if rest.startswith("["):
            return json.loads(rest)
        return rest.split()


@dataclass
class Stage:
    index: int
    name: str | None
    base: str  # image reference with ARGs resolved, or an earlier stage's name
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def last(self, keyword: str) -> Instruction | None:
        found = [i for i in self.instructions if i.keyword == keyword]
        return found[-1] if found else None


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def parent(self, stage: Stage) -> Stage | None:
        return self.stage(stage.base)

    def chain(self, stage: Stage) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        out = [stage]
        while (p := self.parent(out[-1])) is not None:
            out.append(p)
        return out

    def inherited(self, stage: Stage, keyword: str) -> Instruction | None:
        for s in self.chain(stage):
            if (found := s.last(keyword)) is not None:
                return found
        return None

    def depends_on(self, stage: Stage) -> list[Stage]:
        """Every stage whose files end up in `stage`: its FROM chain and COPY --from sources."""
        seen: list[Stage] = []
        todo = [stage]
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.append(s)
            if (p := self.parent(s)) is not None:
                todo.append(p)
            for ins in s.instructions:
                src = ins.flags().get("from") if ins.keyword == "COPY" else None
                if src and (dep := self.stage(src)) is not None:
                    todo.append(dep)
        return seen


def _logical_lines(text: str):
    buf, start = "", None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment inside a continued instruction
        if start is None:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield start, (buf + line).strip()
        buf, start = "", None
    if buf:
        yield start, buf.strip()


def substitute(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def parse(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, logical in _logical_lines(path.read_text()):
        keyword, _, value = logical.partition(" ")
        ins = Instruction(keyword.upper(), value.strip(), line)
        if ins.keyword == "FROM":
            toks = ins.args()
            name = toks[2] if len(toks) >= 3 and toks[1].upper() == "AS" else None
            stages.append(Stage(len(stages), name, substitute(toks[0], global_args), line))
        elif not stages:
            if ins.keyword != "ARG":
                raise ValueError(f"{path}:{line}: only ARG may come before the first FROM")
            k, _, v = ins.value.partition("=")
            global_args[k.strip()] = v.strip().strip('"')
        else:
            stages[-1].instructions.append(ins)
    return Dockerfile(path, global_args, stages)


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore(path: Path):
    """A predicate: is this context-relative path excluded by the .dockerignore at `path`?"""
    rules = []
    if path.exists():
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pat = line[1:].strip() if negate else line
            rules.append((negate, _pattern_regex(pat.strip("/"))))

    def excluded(rel: str) -> bool:
        parts = rel.strip("/").split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for negate, rx in rules:
            if any(rx.match(p) for p in prefixes):
                result = not negate
        return result

    return excluded
