"""A vLLM server's argv checked by that vLLM's own code, without loading weights or touching a GPU's memory.

servegrid's preflight (:mod:`servegrid.engines.vllm_preflight`) runs this file with the *user's* engine interpreter
(the one ``engine.command`` starts), where servegrid is not installed: it imports only the standard library and
vLLM. Two steps, as the server takes them:

1. the argument parser ``vllm serve`` builds (``make_arg_parser`` on a ``FlexibleArgumentParser``; for
   ``python -m vllm.entrypoints.openai.api_server`` the same parser without the ``serve`` subcommand) and
   ``validate_parsed_serve_args``: every unknown flag and refused value;
2. where the checkpoint's config.json is on this machine (``HF_HUB_OFFLINE``: never a download), the engine's
   configuration as the server builds it before loading weights (``AsyncEngineArgs.create_engine_config``): the
   model's architecture, the parallel layout against the visible GPUs, the speculative method against the
   checkpoint. The warnings vLLM logs meanwhile are passed on as vLLM wrote them.

    python vllm_probe.py REQUEST.json RESULT.json

REQUEST: ``{NAME: {"style": "serve" | "api_server", "argv": [...], "deep": true, "server_offline": false}}``, one
entry per server, where ``argv`` follows the program (``["serve", MODEL, ...]`` or ``["--model", MODEL, ...]``) and
``server_offline`` says whether the server itself will run with ``HF_HUB_OFFLINE`` (the probe always does).
RESULT: ``{NAME: {"facts": {...}, "findings": [{"level", "message", "flag"}], "checked": [...]}}``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any, NoReturn

FLAG_RE = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


class Refused(Exception):
    """argparse's error, raised instead of exiting."""


def main(request_path: str, result_path: str) -> None:
    with open(request_path, encoding="utf-8") as handle:
        requests = json.load(handle)
    results: dict[str, dict[str, Any]] = {name: {"facts": {}, "findings": [], "checked": []} for name in requests}
    try:
        probe(requests, results)
    except Exception as exc:  # noqa: BLE001 - a vLLM this probe does not know: a result, never a traceback
        for result in results.values():
            add(result, "warning", f"the probe stopped early ({type(exc).__name__}: {exc}); the rest is unchecked")
    with open(result_path, "w", encoding="utf-8") as handle:
        json.dump(results, handle)


def add(result: dict, level: str, message: str, flag: str | None = None) -> None:
    result["findings"].append({"level": level, "message": message, "flag": flag})


def probe(requests: dict, results: dict) -> None:
    """Each server of ``requests`` (name → request) into ``results`` (name → result): vLLM imported once."""
    started = time.monotonic()
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
        for result in results.values():
            add(result, "error", f"vLLM does not import in {sys.executable}: {type(exc).__name__}: {exc}")
        return
    parser_parts = _parser_parts()
    imported_s = round(time.monotonic() - started, 1)
    devices = _cuda_devices()  # the servers of one probe share their environment, so their GPUs
    for name, request in requests.items():
        result = results[name]
        result["facts"].update(
            vllm_version=getattr(vllm, "__version__", "unknown"),
            python=sys.executable,
            import_s=imported_s,
            cuda_devices=devices,
        )
        if parser_parts is None:
            version = result["facts"]["vllm_version"]
            add(
                result, "note", f"vLLM {version} keeps its serve parser where this probe does not look: flags unchecked"
            )
            continue
        args = _parse(request, parser_parts, result)
        if args is not None and request.get("deep", True):
            _engine_config(args, result, bool(request.get("server_offline")))


def _cuda_devices() -> list | None:
    """The GPUs a CUDA process sees in this environment (CUDA_VISIBLE_DEVICES applied), by name and UUID; None
    without CUDA. Compared by servegrid with the GPUs nvidia-smi lists under the configuration's indices."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return [
            {"name": torch.cuda.get_device_name(i), "uuid": "GPU-" + str(torch.cuda.get_device_properties(i).uuid)}
            for i in range(torch.cuda.device_count())
        ]
    except Exception:  # noqa: BLE001 - a broken CUDA set-up: the engine configuration says more
        return None


def _parser_parts() -> tuple[Any, Any, Any] | None:  # vLLM's own, untyped here (no vLLM in the lint venv)
    """(FlexibleArgumentParser, make_arg_parser, validate_parsed_serve_args) where this vLLM keeps them."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        try:
            from vllm.utils import FlexibleArgumentParser  # before 0.11
        except ImportError:
            return None
    for module in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        try:
            imported = __import__(module, fromlist=["make_arg_parser", "validate_parsed_serve_args"])
            return FlexibleArgumentParser, imported.make_arg_parser, imported.validate_parsed_serve_args
        except (ImportError, AttributeError):
            continue
    return None


def _parse(request: dict[str, Any], parts: tuple[Any, Any, Any], result: dict[str, Any]) -> Any:
    flexible, make_arg_parser, validate = parts

    class NoExit(flexible):  # type: ignore[misc,valid-type]  # a base found at run time, in whichever vLLM
        # argparse sends every user error (unknown flag, bad type or choice) through error(), which exits.
        def error(self, message: str) -> NoReturn:
            raise Refused(message)

        def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
            raise Refused(message or f"exit status {status}")

    argv = list(request["argv"])
    if request["style"] == "serve":  # vllm/entrypoints/cli/main.py and serve.py
        top = NoExit(description="vLLM CLI")
        make_arg_parser(top.add_subparsers(dest="subparser").add_parser("serve"))
        parser = top
    else:  # vllm/entrypoints/launchers/api_server/entry.py
        parser = make_arg_parser(NoExit(description="vLLM OpenAI-Compatible RESTful API server."))
    result["checked"].append("flags: vLLM's own serve parser")
    try:
        args = parser.parse_args(argv)
    except (Refused, ValueError) as exc:
        flags = FLAG_RE.findall(str(exc))
        add(result, "error", f"vLLM's parser refuses the argv: {exc}", flags[-1] if flags else None)
        return None
    if request["style"] == "serve" and getattr(args, "model_tag", None):
        args.model = args.model_tag  # what the serve subcommand does before it starts
    try:
        validate(args)
    except (TypeError, ValueError) as exc:
        flags = FLAG_RE.findall(str(exc))
        add(result, "error", f"vLLM refuses the flags: {exc}", flags[0] if flags else None)
        return None
    result["checked"].append("flags: validate_parsed_serve_args")
    return args


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().strip()
        if message not in self.messages:
            self.messages.append(message)


# What huggingface_hub raises for a file the offline cache does not hold (its classes, by name: the probe imports
# nothing of servegrid's and only what vLLM brings).
OFFLINE_MISSES = ("LocalEntryNotFoundError", "OfflineModeIsEnabled")


def _offline_miss(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a file the offline cache lacks."""
    seen: BaseException | None = exc
    while seen is not None:
        if any(cls.__name__ in OFFLINE_MISSES for cls in type(seen).__mro__):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _refused(exc: Exception, result: dict[str, Any], server_offline: bool) -> None:
    """What building the engine's configuration raised, as a finding: vLLM's refusal in its words, or a warning where
    it only lacked a file the server will download."""
    text = " ".join(str(exc).split())
    flags = FLAG_RE.findall(text)
    if _offline_miss(exc) and not server_offline:
        # The probe never downloads; the server will fetch what it lacks (issue 42: a cache holding only the
        # config.json an earlier preflight fetched failed the preflight of a server that would have started).
        add(
            result,
            "warning",
            "the engine's configuration needs a file the offline cache does not hold, which the server will "
            f"download ({type(exc).__name__}: {text[:300]}): unchecked until then",
        )
        return
    offline = " (the servers run offline too, HF_HUB_OFFLINE: they would fail the same way)" if server_offline else ""
    add(
        result,
        "error",
        f"vLLM refuses this configuration before loading weights{offline}: {type(exc).__name__}: {text[:600]}",
        flags[0] if flags else None,
    )


def _engine_config(args: Any, result: dict[str, Any], server_offline: bool) -> None:  # args: vLLM's parsed ones
    from vllm.engine.arg_utils import AsyncEngineArgs

    model = str(args.model)
    if not os.path.isdir(model):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # noqa: BLE001 - an older huggingface_hub, an odd id: not in the cache
            cached = None
        if not isinstance(cached, str):
            add(
                result,
                "note",
                f"{model}: not on this machine (no folder, not in the Hugging Face cache): the engine's "
                "configuration is not built, since that would download it",
            )
            return
    try:  # vLLM says some warnings once per process: again for each server, as each would log them
        import vllm.logger

        for once in ("_print_warning_once", "_print_info_once", "_print_debug_once"):
            getattr(getattr(vllm.logger, once, None), "cache_clear", lambda: None)()
    except ImportError:
        pass
    warnings = _Warnings()
    logging.getLogger("vllm").addHandler(warnings)
    try:
        from vllm.usage.usage_lib import UsageContext

        config = AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises here is its refusal, said in its words
        _refused(exc, result, server_offline)
        return
    finally:
        logging.getLogger("vllm").removeHandler(warnings)
    result["checked"].append("engine configuration: create_engine_config")
    for message in warnings.messages:
        add(
            result,
            "warning",
            f"vLLM: {message}",
            "--speculative-config" if "speculative" in message.lower() or "mtp" in message.lower() else None,
        )
    model_config, speculative = config.model_config, config.speculative_config
    facts = result["facts"]
    facts.update(
        device=str(getattr(config.device_config, "device_type", None) or getattr(config.device_config, "device", "")),
        architecture=getattr(model_config, "architecture", None),
        hybrid=bool(getattr(model_config, "is_hybrid", False)),
        max_model_len=getattr(model_config, "max_model_len", None),
        block_size=getattr(config.cache_config, "block_size", None),
        mamba_cache_mode=str(getattr(config.cache_config, "mamba_cache_mode", None)),
        prefix_caching=bool(getattr(config.cache_config, "enable_prefix_caching", False)),
        world_size=getattr(config.parallel_config, "world_size", None),
    )
    if speculative is not None:
        draft = getattr(speculative, "draft_model_config", None)
        facts["speculative"] = {
            "method": getattr(speculative, "method", None),
            "num_speculative_tokens": getattr(speculative, "num_speculative_tokens", None),
            "mtp_layers": getattr(getattr(draft, "hf_config", None), "n_predict", None),
        }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
