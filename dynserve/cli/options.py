"""What every `dynctl` subcommand shares: its flags generated from `Settings`, the settings built back from
them, and the exit codes.

Every flag made here has an environment twin (`--kv-blocks` / `DYN_KV_BLOCKS`), shown in `--help`; a flag
that was not given leaves its field to the environment and the default. Exit codes: 0 success, 1 runtime
failure, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import signal
from typing import Any, get_args, get_origin

import pydantic

from dynserve.config import Settings
from dynserve.errors import InvalidRequestError

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "add_settings_group", "settings_from", "with_models_file"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def dump_stacks_on_sigusr1() -> None:
    """From now on SIGUSR1 makes this process write every thread's Python stack to stderr and go on: where a
    process that seems stuck (a shutdown that does not end) is. Every `dynctl` command calls it; where stderr
    is not a file (`main` called with stderr captured in memory) or missing, it does nothing."""
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, RuntimeError, io.UnsupportedOperation):  # stderr none, or not a file
        pass


def add_settings_group(parser: argparse.ArgumentParser, group_name: str, *, only: set[str] | None = None,
                       aliases: dict[str, list[str]] | None = None) -> None:
    """One flag per `Settings` field of `group_name` (or of those in `only`), each showing its env twin;
    `aliases` gives a field more flag names (e.g. {"port": ["--http-port"]})."""
    group = parser.add_argument_group(f"{group_name} (each flag has an env twin)")
    for name in Settings.field_names(group_name):
        if only is not None and name not in only:
            continue
        field = Settings.model_fields[name]
        flags = ["--" + name.replace("_", "-"), *(aliases or {}).get(name, [])]
        env = f"DYN_{name.upper()}"
        help_text = f"{field.description} [env: {env}; default: {field.default}]".replace("%", "%%")
        if field.annotation is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
            continue
        if get_origin(field.annotation) is list:  # repeated: --flag A --flag B (also named in the singular)
            flags += ["--" + name.removesuffix("s").replace("_", "-")] if name.endswith("s") else []
            group.add_argument(*flags, dest=name, action="append", default=None, metavar=name.upper().rstrip("S"),
                               help=help_text)
            continue
        choices = [c for c in get_args(field.annotation) if isinstance(c, str)] or None
        # --model may be repeated: the first is the model, the others extra_models (see settings_from)
        action = "append" if name == "model" else "store"
        group.add_argument(*flags, dest=name, default=None, choices=choices, metavar=name.upper(), help=help_text,
                           action=action)


def settings_from(args: argparse.Namespace) -> Settings:
    """`Settings` from the flags given (the rest from `DYN_*` variables and defaults); InvalidRequestError
    names each bad flag."""
    given: dict[str, Any] = {n: getattr(args, n) for n in Settings.model_fields
                             if getattr(args, n, None) is not None}
    if isinstance(given.get("model"), list):  # --model A --model B: A, then B among the extra models
        first, *more = given["model"]
        given["model"] = first
        if more:
            given["extra_models"] = [*more, *given.get("extra_models", [])]
    try:
        settings = Settings(**given)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())
        raise InvalidRequestError(problems) from None
    return with_models_file(settings) if settings.models_file is not None else settings


def with_models_file(settings: Settings) -> Settings:
    """`settings` with the models of its `models_file` as `--model` and `--served-model-name` would give them
    (the first model's names plain, another's as NAME=MODEL_ID); InvalidRequestError for a file that cannot be
    read or names none, or beside those flags."""
    from pathlib import Path

    from dynserve.config import read_models_file
    from dynserve.model.resolve import model_id_of

    path = Path(str(settings.models_file)).expanduser()
    if settings.model is not None or settings.extra_models or settings.served_model_names:
        raise InvalidRequestError("--models-file lists the models and their names: give it, or --model and "
                                  "--served-model-name (DYN_MODEL, DYN_EXTRA_MODELS, DYN_SERVED_MODEL_NAMES), not "
                                  "both", param="models_file")
    try:
        first, *more = read_models_file(path.read_text())
    except OSError as exc:
        raise InvalidRequestError(f"--models-file: cannot read {path}: {exc.strerror}", param="models_file") from None
    except ValueError as exc:
        raise InvalidRequestError(f"--models-file {path}: {exc}", param="models_file") from None
    names = [*first.served_model_names, *(f"{name}={model_id_of(Path(entry.model).expanduser())}"
                                          for entry in more for name in entry.served_model_names)]
    return settings.model_copy(update={"model": first.model, "extra_models": [entry.model for entry in more],
                                       "served_model_names": names})
