"""The package's shape: modes are one module each, imports flow one way, heavy libraries stay where they belong."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, synthetic_cell, with_changes
from servegrid import modes
from servegrid.analysis import aggregation
from servegrid.config import Experiment
from servegrid.modes.base import N_, FigureSpec, Mode, Primary
from servegrid.paths import RunTables
from servegrid.reporting import document, figure_files, figures

PACKAGE = REPO / "workflow" / "servegrid"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """servegrid module → the servegrid modules it imports: anywhere in it (functions too), and for annotations
    only (``if TYPE_CHECKING:``) too. ``from servegrid.x import y`` is an edge to the module ``servegrid.x.y`` when
    there is one, else to ``servegrid.x``."""
    modules = {module_name(path): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path}: relative import (the package imports absolutely)"
                base = node.module or ""
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """The first import circle found, as a path that ends where it starts; None if there is none."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_the_import_graph_has_no_circle_of_any_kind():
    """Not even through a type-only import, or a package's own ``__init__`` (which would make one)."""
    graph = import_graph()
    assert "servegrid.modes.decode" in graph and "servegrid.modes.runner" in graph["servegrid.measuring.measured_phase"]
    assert cycle_in(graph) is None, " → ".join(cycle_in(graph) or [])


def lint_imports(package_parent: Path = PACKAGE.parent) -> subprocess.CompletedProcess[str]:
    """import-linter's contracts (pyproject.toml) over the package found in ``package_parent``."""
    command = [
        str(Path(sys.executable).parent / "lint-imports"),
        "--config",
        str(REPO / "pyproject.toml"),
        "--no-cache",
    ]
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(command, capture_output=True, text=True, cwd=package_parent, env=env, timeout=120)


def test_imports_go_down_the_layers_only():
    """pipeline → reporting → analysis | serving | measuring → config → modes → records | stats | engines → the
    root's modules, siblings never importing each other, the package never importing ``testing``: no exception."""
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        # an upward import, only for annotations
        (
            "records/request.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from servegrid.analysis import verdict",
            "records",
        ),
        # a sibling's, inside a function
        ("serving/state.py", "def _planted():\n    from servegrid.measuring import client", "serving"),
        # the test tools, from the pipeline
        ("pipeline/cli.py", "import servegrid.testing.calibration", "testing"),
    ],
)
def test_a_planted_upward_import_breaks_the_layers(tmp_path, module, planted, broken):
    copy = tmp_path / "servegrid"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    source = target.read_text(encoding="utf-8")
    target.write_text(f"{source}\n\nfrom typing import TYPE_CHECKING\n\n{planted}\n", encoding="utf-8")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "broken" in result.stdout, result.stdout + result.stderr
    assert f"servegrid.{broken}" in result.stdout.split("Broken contracts", 1)[1]


# Modules the measuring client, the plots and the PDF are not for: importing one must not load them.
LIGHT = [
    "servegrid.config",
    "servegrid.modes",
    "servegrid.engines",
    "servegrid.engines.vllm",
    "servegrid.records.cell_file",
    "servegrid.analysis.aggregation",
    "servegrid.analysis.verdict",
    "servegrid.reporting.figure_files",
    "servegrid.engines.metrics",
    "servegrid.serving.state",
    "servegrid.serving.server",
    "servegrid.serving.supervisor",
    "servegrid.errors",
    "servegrid.modes.runner",
    "servegrid.config.checks",
    "servegrid.analysis.summary_table",
    "servegrid.reporting.contents",
    "servegrid.paths",
]
HEAVY = ["aiohttp", "seaborn", "matplotlib", "weasyprint", "servegrid.testing"]


@pytest.mark.parametrize("module", LIGHT)
def test_light_modules_do_not_load_the_client_the_plots_or_the_pdf(module):
    loaded = f"sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith('servegrid.testing'))"
    code = f"import sys, json, {module}; print(json.dumps({loaded}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout) == [], f"{module} loads {out.stdout}"


# What every Snakemake job process (spec, cell, stop) and every calibration server imports at start: scipy.stats alone
# would add 0.7 s to each start (measured 2026-12-04: a cell job's imports 1.36 s with it, 0.61 s without), and the
# suite starts hundreds of them.
@pytest.mark.parametrize("module", ["servegrid.pipeline.snakemake_jobs", "servegrid.testing.calibration_app"])
def test_job_and_stand_in_start_ups_do_not_import_scipy_stats(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('scipy.stats')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", f"{module} loads {out.stdout}"


def test_test_files_have_unique_names():
    # The test folders are not packages (rootdir import mode): two test files of one name in two folders make
    # pytest refuse the whole collection ("import file mismatch"), which a run of one folder never shows.
    names: dict[str, list[str]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


# ---- a fourth mode is one module: registered at test time, through aggregate → verdict → figures → report ----


@pytest.fixture
def toy_mode():
    """decode_short: the decode runner under another name, as a new module would register it."""
    decode = modes.get("decode")
    mode = Mode(
        name="decode_short",
        run=decode.run,
        primary=Primary(
            "decode_tps",
            higher_is_better=True,
            unit="rate",
            axis_label=N_("short decode tokens/s"),
            header=N_("tok/s"),
            verdict_word=N_("short decode"),
        ),
        title=N_("Short decode"),
        short_title=N_("Short decode, cold prompts"),
        class_title=N_("Short generations on cold prompts"),
        section_title=N_("Short decode: a toy mode registered by a test"),
        description=N_("Prompts of %(prompt)s tokens, %(output)s tokens out."),
        context_title=N_("prompt of %(tokens)s tokens"),
        context_header=N_("Prompt"),
        schema={"burst": {"type": "integer", "minimum": 1, "default": 2}},
        defaults={"output_tokens": 16},
        figures=(FigureSpec("decode_short_tps", "primary_by_concurrency", N_("Short decode"), N_("Toy figure.")),),
        describe=lambda w: {"prompt": list(w["contexts"]), "output": w["output_tokens"]},
    )
    modes.register(mode)
    yield mode
    modes.unregister("decode_short")


def test_a_mode_registered_at_run_time_flows_through_every_stage(toy_mode, tmp_path, monkeypatch, demo_raw):
    monkeypatch.chdir(tmp_path)
    raw = with_changes(demo_raw)
    raw["workloads"] = {
        "decode": {"contexts": [512], "concurrency": [1, 2]},
        "decode_short": {"contexts": [256], "concurrency": [1, 2], "burst": 3},
    }
    experiment = Experiment(raw)
    assert experiment.modes() == ["decode", "decode_short"]
    assert experiment.workload("decode_short").settings["burst"] == 3  # its own schema, its own default filled
    assert experiment.workload("decode_short").settings["output_tokens"] == 16
    assert [c.id for c in experiment.verdict.classes][-1] == "decode_short"  # a verdict class of its own
    speeds = {"prefix_cache": 0.004, "ngram": 0.002, "both": 0.0025}  # the demo's three configurations
    for cell in experiment.cells():
        synthetic_cell(
            tmp_path / cell.path,
            cell.configuration,
            cell.mode,
            cell.context,
            cell.sessions,
            ttft_s=0.05,
            interval_s=speeds[cell.configuration],
            output_tokens=16,
        )
    tables = RunTables.under(tmp_path)
    summary = aggregation.aggregate(experiment, [c.path for c in experiment.cells()], tables)
    toy_rows = summary[summary["mode"] == "decode_short"]
    assert len(toy_rows) == 3 * 2 and set(toy_rows["primary_metric"]) == {"decode_tps"}
    import pandas as pd

    verdict = pd.read_parquet(tables.verdict).set_index("class_id")
    assert verdict.loc["decode_short", "outcome"] == "win" and verdict.loc["decode_short", "winner"] == "ngram"
    names = [spec.name for _, spec in figure_files.figure_specs(experiment)]
    assert "decode_short_tps" in names
    figures_dir = tmp_path / "figures"
    figures.draw_all(experiment, tables, figures_dir, "pt")
    assert (figures_dir / "decode_short_tps.png").stat().st_size > 1000
    html = tmp_path / "r.html"
    document.render(experiment, "pt", tables, figures_dir, str(html), str(tmp_path / "r.pdf"))
    text = html.read_text(encoding="utf-8")
    assert '<section id="decode-short">' in text
    assert "Short decode: a toy mode registered by a test" in text
    assert "Prompts of 256 tokens, 16 tokens out." in text
    assert "Short generations on cold prompts" in text  # its verdict row
    assert text.count('src="data:image/png;base64,') == len(names)


ENGINE_WORDS = (
    "vllm:",
    "VLLM_",
    "--enable-prefix-caching",
    "--speculative-config",
    "/tokenize",
    "/detokenize",
    "/reset_prefix_cache",
    "continuous_usage_stats",
    "min_tokens",
    "ignore_eos",
    "/v1/",
)


def test_only_the_engines_speak_an_engines_language():
    """No string in the package outside engines/ (and the test tools, and gateway.py: LiteLLM's proxy speaks the
    same OpenAI routes) names an engine's flag, route, variable or metric: the client, the modes, the cell and the
    server lifecycle reach the server through the Engine protocol."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if {"engines", "testing"} & set(path.relative_to(PACKAGE).parts) or path.name == "gateway.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        documented = [n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)]
        docstrings = {id(n.body[0].value) for n in documented if n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                offenders += [f"{path.name}:{node.lineno}: {word}" for word in ENGINE_WORDS if word in node.value]
    assert offenders == []


def test_no_layout_is_pinned_against_the_formatter():
    """``# fmt: skip`` hid hand-aligned layouts from ruff format (111 of them, none saying why): the code's layout
    is the formatter's. A line that truly needs its own layout says why on it (``# fmt: skip - <why>``)."""
    pinned = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in ("workflow", "tests", "benchmarks", "tools")
        for path in (REPO / folder).rglob("*.py")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if line.rstrip().endswith("# fmt: skip")
    ]
    assert not pinned, f"layouts pinned against the formatter without a reason: {pinned[:5]}"
