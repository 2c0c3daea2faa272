"""Where a configuration's checkpoint is, what its config.json says, and what it weighs: on this machine (a folder,
or the Hugging Face cache), or on the Hub (its download size, where the Hub answers). Never downloads a weight."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class Checkpoint:
    source: str  # model.path as written
    folder: Path | None  # the folder holding config.json here (a local path or a Hugging Face cache snapshot)
    config: dict[str, Any] | None  # its config.json
    weights_bytes: int | None  # the weight files' size (on disk here, or on the Hub)
    local: bool  # present on this machine
    built_by_pipeline: bool = False  # model.tiny: the pipeline writes it before the first server starts
    why_unknown: str = ""  # what could not be learned, in words
    refused: str = ""  # the Hub's answer that no server here could load it (missing, gated, not authorised)


def weight_files(names: list[str]) -> list[str]:
    """The files a server loads: the top folder's safetensors where there are any (as vLLM prefers them), else its
    other weight files; never a second copy in another format, a subfolder's (``original/``) or training state."""
    top = [n for n in names if "/" not in n and n.endswith(WEIGHT_SUFFIXES) and not n.startswith("training_")]
    safetensors = [n for n in top if n.endswith(".safetensors")]
    return safetensors or top


def weights_in(folder: Path) -> int:
    """Bytes of the weight files in ``folder`` (the cache's symlinks followed)."""
    names = [p.name for p in folder.iterdir() if p.is_file()]
    return sum((folder / n).stat().st_size for n in weight_files(names))


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _read_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return config
    except (OSError, ValueError):
        return None


def is_repo_id(path: str) -> bool:
    """``org/name`` as the Hub names a model, not a path on this machine."""
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1 and not Path(path).exists()


def locate(path: str, built_by_pipeline: bool, hub_timeout_s: float = 20.0) -> Checkpoint:
    """The checkpoint at ``path`` (a folder or a Hub repo id): here, or its size on the Hub."""
    if Path(path).expanduser().is_dir():
        folder = Path(path).expanduser()
        return Checkpoint(path, folder, _read_config(folder), weights_in(folder), local=True)
    if built_by_pipeline:
        return Checkpoint(path, None, None, None, local=False, built_by_pipeline=True)
    if not is_repo_id(path):
        return Checkpoint(path, None, None, None, local=False, why_unknown=f"{path} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(path, local_files_only=True))
        weights = weights_in(folder)
        # A snapshot of config.json alone (an earlier preflight fetched it) is not the checkpoint.
        if weights:
            return Checkpoint(path, folder, _read_config(folder), weights, local=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if offline():
        return Checkpoint(
            path, None, None, None, local=False, why_unknown="HF_HUB_OFFLINE is set: the Hub is not asked"
        )
    return _on_the_hub(path, hub_timeout_s)


def _on_the_hub(repo: str, timeout_s: float) -> Checkpoint:
    from huggingface_hub import HfApi, hf_hub_download

    try:
        api = HfApi()
        info = api.model_info(repo, files_metadata=True, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - network and the like: said, not fatal here
        refused = _hub_refusal(repo, exc)
        if refused:
            return Checkpoint(repo, None, None, None, local=False, why_unknown=refused, refused=refused)
        return Checkpoint(
            repo,
            None,
            None,
            None,
            local=False,
            why_unknown=f"the Hub did not say ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
        )
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
    size = sum(sizes[n] for n in weight_files(list(sizes)))
    config = None
    # A few kilobytes, into the cache the server would use anyway; without it the size is still worth saying.
    with contextlib.suppress(Exception):
        config = _read_config(Path(hf_hub_download(repo, "config.json", endpoint=api.endpoint)).parent)
    return Checkpoint(repo, None, config, size or None, local=False)


def _hub_refusal(repo: str, exc: Exception) -> str:
    """The Hub's definite no, in words naming what to do (issue 42: a gated repo was a warning, and the servers
    failed at start-up after the run had begun); "" for anything else (the network, a timeout)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "HF_TOKEN is not set"
    if isinstance(exc, GatedRepoError):
        return (
            f"{repo} is gated on the Hugging Face Hub and this machine's token has no access ({token}): accept its "
            "terms on the Hub with your account, then export HF_TOKEN with a token of that account before the run"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{repo} is not on the Hugging Face Hub, or it is private and the token gives no access ({token}): check "
            "model.path, or export HF_TOKEN with a token that can read it"
        )
    status = getattr(getattr(exc, "response", None), "status_code", None) if isinstance(exc, HfHubHTTPError) else None
    if status in (401, 403):
        return f"the Hugging Face Hub refused to show {repo} (HTTP {status}; {token}): export a valid HF_TOKEN"
    return ""


def has_chat_template(folder: Path) -> bool:
    """Whether the checkpoint carries a chat template where transformers looks: ``chat_template.jinja``,
    ``chat_template.json``, or ``tokenizer_config.json``'s ``chat_template``."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def cache_free_bytes() -> tuple[Path, int]:
    """The Hugging Face cache folder a download would fill, and the free bytes on its disk."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return folder, shutil.disk_usage(probe).free
