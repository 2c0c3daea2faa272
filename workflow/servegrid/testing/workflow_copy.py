"""A copy of the repository's workflow to run Snakemake in, for the tests and the benchmarks that need a fresh
``results/`` of their own."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ENGINE_ENVIRONMENTS = (".venv-vllm", ".venv-litellm")


def copy_workflow(repo: Path, dest: Path) -> Path:
    """``repo``'s files (tracked and untracked-but-not-ignored) copied to ``dest``. The engines' environments are
    linked, not copied (configs name them by relative path; one that is not built is left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = repo / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    for env in ENGINE_ENVIRONMENTS:
        if (repo / env).exists():
            (dest / env).symlink_to(repo / env)
    return dest
