"""Write outputs so that a reader sees either nothing or the complete file.

A killed job leaves at most a dot-file with ``.partial`` in its name next to
the target: nothing that looks like a finished output. The file's bytes reach
the disk (fsync) before the rename, and the rename before the function returns,
so a power cut cannot leave a complete-looking file with missing content.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from servegrid.errors import OutputError


@contextlib.contextmanager
def atomic_path(target: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it over ``target`` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    # mkstemp creates 0600; a finished output gets the usual umask-based mode.
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, target)
        _fsync(target.parent)
    except OSError as exc:  # disk full, file too large (RLIMIT_FSIZE), permissions
        raise OutputError(f"{target}: cannot write it ({exc}); nothing was written") from exc
    finally:
        tmp.unlink(missing_ok=True)


def write_text(target: Path | str, content: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(content, encoding="utf-8")


def write_json(target: Path | str, obj: Any) -> None:
    write_text(target, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_json_if_absent(target: Path | str, obj: Any) -> bool:
    """Write ``obj`` to ``target`` unless ``target`` exists; whether it was written. Atomic and exclusive (a
    hard link fails where the name is taken): a first record never overwrites a later one written in between."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        _fsync(target.parent)
        return True
    except OSError as exc:
        raise OutputError(f"{target}: cannot write it ({exc}); nothing was written") from exc
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; it replaces ``target`` on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        for path in sorted(tmp.rglob("*"), reverse=True):  # contents before the folders that list them
            _fsync(path)
        _fsync(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        _fsync(target.parent)
    except OSError as exc:
        raise OutputError(f"{target}: cannot write it ({exc}); nothing was written") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
