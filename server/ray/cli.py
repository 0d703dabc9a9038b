"""Serve gptserve on Ray Serve: engine replicas behind Ray Serve's HTTP proxy, autoscaled on
queue depth. Needs the `ray` extra (`pip install -e '.[ray]'`).

    serve run server.ray:app                                  # the bundled model, 1-2 replicas
    serve run server.ray:build_app model=/abs/DIR num_replicas=2
    gptserve ray --model DIR --replicas 2 --port 8000  # starts a local Ray itself
    gptserve ray --models-dir DIR --replicas 2 --max-models-per-replica 2  # several models

`build_app` takes Ray Serve's application arguments (`key=value` after `serve run`, or `args:`
in a Serve config file): every `gptserve serve` flag by its name (`model`, `api_key`,
`max_num_seqs`, ...; dashes or underscores) and the ScaleOptions of gptserve.server.ray.deployment
(`num_replicas`, or `min_replicas`/`max_replicas`/`target_ongoing_requests` to autoscale,
`num_cpus` per replica, ...). See docs/DEPLOY.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import ray
from gptserve.model.known_models import known_name
from gptserve.server.cli import bind
from gptserve.server.logging_setup import setup_logging
from gptserve.server.ray.deployment import SCALE_FIELDS, ScaleOptions, check_settings, deployment
from gptserve.server.ray.proxy_middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from gptserve.server.runtime import ModelLoadError, preflight
from gptserve.server.settings import (
    Settings,
    SettingsError,
    build_parser,
    flag_name,
    settings_from_args,
    split_named,
)
from gptserve.server.tracing import TracingUnavailable, check_tracing
from ray import serve
from ray.serve.deployment import Application

APP_NAME = "gptserve"
_ALIASES = {"api_key": "api_keys", "replicas": "num_replicas"}
_SWITCH_TRUE = ("1", "true", "yes", "on")
# where Ray's defaults differ from `gptserve serve`'s: each SSE chunk crosses the proxy as a Ray
# object, so a chunk carries 4 tokens (after the first); `stream_interval=1` streams every token
RAY_DEFAULTS = ("--stream-interval", "4")
_SCALE_HELP = {
    "num_replicas": "a fixed number of replicas (default: autoscale between the two below)",
    "min_replicas": "fewest replicas when autoscaling",
    "max_replicas": "most replicas when autoscaling",
    "target_ongoing_requests": "autoscaling target: ongoing requests per replica (running, "
    "waiting in its engine, or queued for it in the proxy)",
    "max_ongoing_requests": "requests one replica takes at once; more wait in the proxy",
    "upscale_delay_s": "seconds the load must stay above target before a replica is added",
    "downscale_delay_s": "seconds the load must stay below target before one is removed",
    "look_back_period_s": "seconds of load that autoscaling averages over",
    "num_cpus": "CPUs each replica reserves (also its torch threads)",
    "num_gpus": "GPUs each replica reserves",
    "load_timeout": "seconds a replica may take to load the checkpoint",
    "health_check_period_s": "seconds between Ray's health checks of a running replica",
    "health_check_timeout_s": "seconds a health check may take before it counts as failed "
    "(3 failures in a row: the replica is replaced)",
    "metrics_interval": "seconds between copies of a replica's metrics into Ray's",
    "max_models_per_replica": "with several models: models one replica holds at once (Ray "
    "evicts its least recently used to load another)",
}


def build_app(args: Mapping[str, Any] | None = None) -> Application:
    """Ray Serve's application builder: `serve run server.ray:build_app key=value ...`."""
    settings, options = parse_app_args(args or {})
    return deployment(settings, options)


def parse_app_args(args: Mapping[str, Any]) -> tuple[Settings, ScaleOptions]:
    """Server settings and scale options from application arguments (values may be strings, as
    `serve run` passes them). Raises SettingsError for an unknown key or a bad value."""
    setting_flags = {f.name: f for f in fields(Settings)}
    scale_types = typing.get_type_hints(ScaleOptions)
    argv: list[str] = list(RAY_DEFAULTS)  # a later value for the same flag wins
    scale: dict[str, Any] = {}
    for raw_key, value in args.items():
        key = raw_key.replace("-", "_")
        key = _ALIASES.get(key, key)
        if key in SCALE_FIELDS:
            scale[key] = _scale_value(key, value, scale_types[key])
        elif key in setting_flags:
            argv += _setting_argv(setting_flags[key], value)
        else:
            raise SettingsError(f"unknown application argument {raw_key!r}")
    try:
        settings = settings_from_args(argv)
    except SystemExit:  # argparse has printed what it could not parse
        raise SettingsError(f"invalid application arguments: {dict(args)}") from None
    absolute_paths(check_settings(settings))
    return settings, ScaleOptions(**scale).validate()


def absolute_paths(settings: Settings) -> None:
    """Make the models' paths absolute (replicas may run elsewhere; a known model's name
    stays): each --model (`NAME=PATH` keeps its name) and --models-dir."""

    def absolute(flag: str) -> str:
        name, source = split_named(flag)
        if known_name(source) is None:
            source = str(Path(source).expanduser().resolve())
        return source if name is None else f"{name}={source}"

    if settings.model is not None:
        settings.model = absolute(settings.model)
    settings.extra_models = [absolute(flag) for flag in settings.extra_models]
    if settings.models_dir is not None:
        settings.models_dir = str(Path(settings.models_dir).expanduser().resolve())


def _scale_value(key: str, value: Any, hint: Any) -> Any:
    if value is None or (isinstance(value, str) and value.lower() in ("", "none")):
        return None
    kind = int if hint in (int, int | None) else float
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise SettingsError(f"{key} must be a number, not {value!r}") from None


def _setting_argv(f: Field, value: Any) -> list[str]:
    """A Settings field's value as `gptserve serve` flags."""
    flag = f"--{flag_name(f)}"
    if f.default_factory is not MISSING or f.name == "model":  # repeated, or comma-separated
        items = value.split(",") if isinstance(value, str) else list(value)
        return [part for item in items if str(item).strip() for part in (flag, str(item).strip())]
    if isinstance(f.default, bool):
        on = value if isinstance(value, bool) else str(value).lower() in _SWITCH_TRUE
        return [flag] if on else []
    return [flag, str(value)]


# ---- gptserve ray ----------------------------------------------------------------


def _add_scale_flags(add_argument: Callable[..., Any]) -> None:
    """The scale flags, through a parser's or an argument group's `add_argument`."""
    hints = typing.get_type_hints(ScaleOptions)
    for f in fields(ScaleOptions):
        names = [f"--{f.name.replace('_', '-')}"]
        if f.name == "num_replicas":
            names.insert(0, "--replicas")
        kind = int if hints[f.name] in (int, int | None) else float
        add_argument(*names, dest=f.name, type=kind, default=f.default, metavar="N",
                     help=_SCALE_HELP[f.name])  # fmt: skip
    add_argument(
        "--address",
        help="Ray cluster to join ('auto': the one this node belongs to); default: start a "
        "local Ray on this machine",
    )


def parse_cli(argv: list[str] | None = None) -> tuple[Settings, ScaleOptions, str | None]:
    """`gptserve ray` flags: every `gptserve serve` flag plus the scale flags.
    argparse exits 2 on a bad flag; raises SettingsError for a bad value."""
    argv = sys.argv[1:] if argv is None else argv
    full = build_parser()
    full.prog = "gptserve ray"
    full.description = "Serve a checkpoint on Ray Serve: engine replicas behind Ray's proxy."
    _add_scale_flags(full.add_argument_group("ray serve").add_argument)
    full.parse_args(argv)  # --help, unknown flags and bad types, with every flag listed
    scale_parser = argparse.ArgumentParser(add_help=False)
    _add_scale_flags(scale_parser.add_argument)
    scale, rest = scale_parser.parse_known_args(argv)
    values = vars(scale)
    address = values.pop("address")
    settings = settings_from_args([*RAY_DEFAULTS, *rest])
    absolute_paths(check_settings(settings))
    return settings, ScaleOptions(**values).validate(), address


def main(argv: list[str] | None = None) -> int:
    try:
        settings, options, address = parse_cli(argv)
        check_tracing(settings.otlp_traces_endpoint)  # the replicas import it
        if address is None:  # a local Ray: the checkpoint must be here
            preflight(settings)
    except (SettingsError, ModelLoadError, TracingUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if address is None:
        try:
            bind(settings).close()
        except OSError as exc:
            print(f"error: cannot bind {settings.host}:{settings.port}: {exc}", file=sys.stderr)
            return 2
    setup_logging(settings.log_level, settings.log_format)
    log = logging.getLogger("server")
    # the proxy started below inherits this environment: its own errors get OpenAI's shape
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    if address is None:  # a Ray of its own, reached from this machine only unless --host says
        local = settings.host in ("127.0.0.1", "localhost", "::1")
        node_ip = "127.0.0.1" if local else None
        ray.init(address="local", include_dashboard=False, _node_ip_address=node_ip)
    else:
        ray.init(address=address)
    for sig in (signal.SIGTERM, signal.SIGINT):  # from here on, a signal stops it cleanly
        signal.signal(sig, _stop)
    code = 0
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(deployment(settings, options), name=APP_NAME, route_prefix="/")
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        served = settings.models_dir or ", ".join(
            filter(None, [settings.model, *settings.extra_models])
        )
        log.info("serving %s on http://%s:%d through Ray Serve", served or settings.model_path,
                 host, settings.port)  # fmt: skip
        threading.Event().wait()  # until a signal
    except _Stopped:
        log.info("shutting down")
    except RuntimeError as exc:  # a replica that cannot start, say
        print(f"error: the deployment did not start: {exc}", file=sys.stderr)
        code = 2
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal ends it at once
        signal.signal(sig, signal.SIG_DFL)
    _shutdown(address)
    return code


class _Stopped(Exception):
    """SIGTERM or SIGINT arrived."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped()


def _shutdown(address: str | None) -> None:
    """Remove the application; a Ray this process started goes with it."""
    try:
        serve.delete(APP_NAME)
    finally:
        if address is None:
            serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
