"""The documentation stays in step with the code."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import runpy
import subprocess
import sys
import typing
from functools import lru_cache

from tests.conftest import REPO


def test_config_reference_is_up_to_date():
    result = subprocess.run([sys.executable, "tools/config_reference.py", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_opens_with_the_two_commands_and_ci_calls_the_test_one():
    head = (REPO / "README.md").read_text().splitlines()[:15]
    assert any("make train" in line for line in head) and any("make test" in line for line in head)
    assert "make test" in (REPO / ".ci" / "run").read_text()


# --- What the docs name exists in the code: config keys, tools' options, and the tools' own --help text. ---


# The user-facing pages. docs/benchmarks.md and docs/performance.md are measurement records: their commands and
# settings are those of the session that measured, so they are not held to today's code.
USER_DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md")
                                         if p.name not in ("benchmarks.md", "performance.md"))]
TOOLS = [*sorted((REPO / "tools").glob("*.py")), REPO / "launch" / "pretrain.py", REPO / "launch" / "slurm" / "submit.py"]
SECTIONS = "model|parallel|precision|optimizer|data|training|checkpoint|logging"
# `section.key[.key...]` in code spans, not part of a path (`docs/data.md`) or a file name (`model.safetensors`).
CONFIG_KEY = re.compile(rf"(?<![\w/.\-])((?:{SECTIONS})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?!\.\w)")
# Keys the docs name on purpose although they are not (or no longer) config keys: the examples of the errors
# that unknown and moved keys give.
NOT_KEYS = {"model.num_layer", "model.moe_top_k"}
FILE_SUFFIXES = (".safetensors", ".json", ".py", ".md", ".yaml", ".pt")


def config_keys() -> set[str]:
    """Every dotted key of the config, the settings of every kind of a section of several kinds included."""
    from megafp8.config.fields import KindedSection
    from megafp8.config.schema import Config

    def keys(cls: type, value, prefix: str) -> set[str]:
        out, hints = set(), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default, name = getattr(value, f.name), prefix + f.name
            out.add(name)
            if isinstance(default, KindedSection):
                for kind_cls in hints[f.name].kinds().values():
                    out |= keys(kind_cls, kind_cls(), name + ".")
            elif dataclasses.is_dataclass(default):
                out |= keys(type(default), default, name + ".")
        return out

    return keys(Config, Config(), "")


def code_spans(text: str) -> list[str]:
    """The inline code spans and fenced blocks of a Markdown page."""
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M) + re.findall(r"`([^`\n]+)`", text)


def test_every_config_key_the_docs_name_exists():
    known, stale = config_keys(), []
    for page in USER_DOCS:
        for span in code_spans(page.read_text()):
            for key in CONFIG_KEY.findall(span):
                if key not in known and key not in NOT_KEYS and not key.endswith(FILE_SUFFIXES):
                    stale.append(f"{page.relative_to(REPO)}: {key}  (in `{span.strip()[:80]}`)")
    assert not stale, "config keys named in the docs that the schema lacks:\n" + "\n".join(stale)


def test_config_key_pattern():
    spans = "model.moe.top_k=4 docs/data.md model.safetensors.index.json `parallel.ep*` training.steps: 3"
    assert CONFIG_KEY.findall(spans) == ["model.moe.top_k", "model.safetensors.index.json", "parallel.ep",
                                         "training.steps"]
    assert "model.moe.top_k" in config_keys() and "model.attention.kv_lora_rank" in config_keys()


class _Parsed(Exception):
    """Raised instead of parsing: the tool's parser is built, nothing runs."""


@lru_cache(maxsize=None)
def tool_options(tool: str) -> dict[str | None, frozenset[str]]:
    """The option strings of a tool's argparse parser (run as `__main__` up to its `parse_args`), by subcommand
    (None: the top level; a subcommand's own options include the top level's)."""
    parsers: list[argparse.ArgumentParser] = []

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        raise _Parsed

    saved = argparse.ArgumentParser.parse_args, sys.argv, list(sys.path)
    argparse.ArgumentParser.parse_args, sys.argv = capture, [tool]
    try:
        runpy.run_path(str(REPO / tool), run_name="__main__")
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args, sys.argv, sys.path[:] = saved[0], saved[1], saved[2]
    assert parsers, f"{tool} built no argparse parser"
    top = {option for action in parsers[0]._actions for option in action.option_strings}
    options: dict[str | None, frozenset[str]] = {None: frozenset(top)}
    for action in parsers[0]._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                options[name] = frozenset(top | {o for a in sub._actions for o in a.option_strings})
    return options


TOOL_COMMAND = re.compile(r"(?<![\w/])((?:tools|launch|launch/slurm)/\w+\.py)\b(.*)")


def unknown_options(text: str) -> list[str]:
    """`tool --option` uses in `text` (commands in code blocks, code spans, usage lines) whose tool has no such
    option (for a tool with subcommands: the subcommand named first)."""
    bad = []
    for line in text.replace("\\\n", " ").splitlines():
        for segment in re.split(r"`|&&|\|\||;|\|", line):
            match = TOOL_COMMAND.search(segment)
            if match is None or not (REPO / match.group(1)).is_file():
                continue
            options = tool_options(match.group(1))
            words = match.group(2).split()
            sub = words[0] if words and words[0] in options else None
            for word in words:
                if word.startswith("#"):
                    break
                if re.fullmatch(r"--[a-z][\w-]*(=.*)?", word) and word.split("=")[0] not in options[sub]:
                    bad.append(f"{match.group(1)}{' ' + sub if sub else ''} has no {word.split('=')[0]}: "
                               f"`{segment.strip()[:100]}`")
    return bad


def test_every_option_the_docs_give_a_tool_exists():
    bad = [f"{page.relative_to(REPO)}: {problem}" for page in USER_DOCS for problem in unknown_options(page.read_text())]
    bad += [f"{tool.relative_to(REPO)} (docstring): {problem}" for tool in TOOLS
            for problem in unknown_options(ast.get_docstring(ast.parse(tool.read_text())) or "")]
    assert not bad, "options the docs (or a tool's --help) use that the tool does not have:\n" + "\n".join(bad)


def test_unknown_options_reads_commands_and_subcommands():
    assert unknown_options("python tools/plan.py --config x --layouts --gpu-gib 80   # --not-this") == []
    assert unknown_options("`tools/plan.py --dry-run`") == ["tools/plan.py has no --dry-run: `tools/plan.py --dry-run`"]
    assert unknown_options("tools/convert_checkpoint.py to-hf X --out y --fp8 \\\n --shard-gib 2") == []
    assert unknown_options("tools/convert_checkpoint.py inspect X --fp8") != []


def test_tool_docstrings_keep_their_line_continuations():
    """A usage example continued with a backslash in a tool's docstring (its --help text) keeps the backslash: in a
    plain string literal `\\` + newline is a line continuation, which joins the two lines in --help."""
    joined = []
    for tool in TOOLS:
        module = ast.parse(tool.read_text())
        node = module.body[0].value if module.body and isinstance(module.body[0], ast.Expr) else None
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        source = ast.get_source_segment(tool.read_text(), node) or ""
        if not source.lstrip("bBuU").startswith(("r", "R")) and re.search(r"(?<!\\)(?:\\\\)*\\\n", source):
            joined.append(str(tool.relative_to(REPO)))
    assert not joined, f"docstrings whose `\\` + newline joins lines (write `\\\\`): {joined}"


REPO_PATH = re.compile(r"(?<![\w/.])((?:megafp8|tools|launch|benchmarks|tests|configs|docs|\.ci)/[\w/.\-]*\w)")


def test_every_repository_path_the_docs_name_exists():
    missing = [f"{page.relative_to(REPO)}: {path}" for page in USER_DOCS for path in REPO_PATH.findall(page.read_text())
               if not (REPO / path).exists() and not re.search(r"/[A-Z]+(\.\w+)?$", path)]  # configs/NAME: a placeholder
    assert not missing, "paths named in the docs that the repository lacks:\n" + "\n".join(missing)


# Names from other projects that the docs name as such.
FOREIGN_NAMES = {"context_parallel_degree"}


def test_every_code_name_the_docs_give_exists():
    """A code span naming a function, class, constant or module attribute (`Fp8Converter`, `REPEAT_WINDOW_S`,
    `rows_cols_gluon.GATHER_ROWS_FIRST`, `quantize_rows_cols(cols_in_blocks=True)`) names something the code has."""
    sources = [REPO / "Makefile", REPO / "setup.py"] + [p for folder in ("megafp8", "tools", "launch", "benchmarks", "tests")
                                                        for p in (REPO / folder).rglob("*")
                                                        if p.suffix in (".py", ".sh", ".sbatch")]
    words = set(re.findall(r"\w+", "\n".join(p.read_text() for p in sources)))
    missing = []
    for page in USER_DOCS:
        for name in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", page.read_text()):
            for part in name.split("."):
                looks_like_code = "_" in part or re.search(r"[a-z][A-Z]", part)
                if looks_like_code and not part.startswith("_") and part not in words and part not in FOREIGN_NAMES:
                    missing.append(f"{page.relative_to(REPO)}: {part} (in `{name}`)")
    assert not missing, "names in the docs' code spans that no source file has:\n" + "\n".join(missing)


def test_a_tool_whose_reader_stops_early_ends_quietly():
    """`tool | head -1`: the output stops quietly, as a Unix tool's does (tools/convert_checkpoint.py inspect | head
    ended with "error: Broken pipe"; others, and `pretrain.py --print-config | head`, with a traceback). Every tool
    enters through `run_tool`, and a probe
    through it writes far more than a pipe holds, so its reader surely stops first."""
    entries = ("sys.exit(run_tool(", "exit_process(run_tool(")  # training leaves by its own exit (exit_process)
    bare = [str(tool.relative_to(REPO)) for tool in TOOLS if not any(e in tool.read_text() for e in entries)]
    assert not bare, f"tools whose __main__ does not go through megafp8.config.arguments.run_tool: {bare}"
    probe = ("import sys; sys.path.insert(0, '.'); from megafp8.config.arguments import run_tool; "
             "sys.exit(run_tool(lambda: [print('x' * 100) for _ in range(200_000)] and 0))")
    result = subprocess.run(["bash", "-c", f"{sys.executable} -c \"{probe}\" | head -1"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.stderr == "" and result.stdout == "x" * 100 + "\n", result.stderr
