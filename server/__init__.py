"""The serving runtime: engine, scheduler, HTTP app, CLI."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"
