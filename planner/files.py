"""Reading and writing the pipeline's files: atomic writes, format versions, clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

FORMAT_VERSION = 1
PLAN_FORMAT_VERSION = 2  # 2: weight gradients are tensors with lifetimes, no longer resident bytes


class PlannerError(Exception):
    """An error the user caused (bad file, bad option); the CLI prints it as one line."""

    exit_code = 2


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write through a temporary file in the same folder and rename, so no reader sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_model(model: BaseModel, path: str | os.PathLike) -> None:
    atomic_write_text(path, model.model_dump_json(indent=1) + "\n")


M = TypeVar("M", bound=BaseModel)


def load_model(cls: type[M], path: str | os.PathLike, expect_graph_sha256: str | None = None) -> M:
    """Load a pipeline file, refusing other format versions and files made for another graph."""
    kind = cls.model_fields["kind"].default if "kind" in cls.model_fields else cls.__name__.lower()
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlannerError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlannerError(f"{path}: not a readable JSON {kind} file ({e})") from None
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        found = raw.get("kind") if isinstance(raw, dict) else type(raw).__name__
        raise PlannerError(f"{path}: expected a {kind} file, found {found!r}")
    version, wanted = raw.get("format_version"), cls.model_fields["format_version"].default
    if version != wanted:
        raise PlannerError(f"{path}: {kind} format version {version} is not supported "
                           f"(this planner reads version {wanted})")
    try:
        model = cls.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PlannerError(f"{path}: invalid {kind} file: {where}: {first['msg']}") from None
    got = getattr(model, "graph_sha256", None)
    if expect_graph_sha256 is not None and got is not None and got != expect_graph_sha256:
        raise PlannerError(
            f"{path}: this {kind} belongs to another model graph (sha256 {got[:12]}…, expected {expect_graph_sha256[:12]}…)"
        )
    return model


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
