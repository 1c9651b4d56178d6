"""A model named by its Hugging Face hub id (``meta-llama/Meta-Llama-3-8B``) for the planner.

Users name models the way ``vllm serve`` takes them, by hub id. The planner needs two
small files of the repository, never its weights: ``config.json`` (the shape) and, when
there is one, ``model.safetensors.index.json`` (the checkpoint's size). Both come through
``huggingface_hub`` (which vLLM brings), so they land in the hub's cache, later runs and
``HF_HUB_OFFLINE=1`` read them from there, and ``HF_TOKEN`` opens gated repositories.
Every failure becomes one :class:`ModelConfigError` line that says what to do instead.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ModelConfigError

#: ``org/name`` as the hub spells repository ids (an optional ``@revision`` after it)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_](?:@[\w./-]+)?$")

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_hub_id(model: str) -> bool:
    """Whether ``model`` names a hub repository rather than a local path: a path that
    exists always wins, as does one under a local directory (``models/x``), and a
    ``*.json`` name is a config file that is missing."""
    return (
        not os.path.exists(model)
        and not model.endswith(".json")
        and not os.path.isdir(model.split("/", 1)[0])
        and _HUB_ID.match(model) is not None
    )


@dataclass(frozen=True, slots=True)
class HubModel:
    """A hub model's two files in the hub cache."""

    repo_id: str
    revision: str | None
    #: the cached snapshot directory holding config.json (and the index, when the repo has one)
    directory: str
    #: the checkpoint's bytes: the index's ``metadata.total_size``, or the size of a single
    #: ``model.safetensors`` (asked of the hub online); None when neither is known
    checkpoint_bytes: int | None


def split_revision(model: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``)."""
    repo_id, _, rev = model.partition("@")
    return repo_id, rev or None


@functools.lru_cache(maxsize=8)
def fetch(model: str) -> HubModel:
    """``config.json`` and the safetensors index of hub model ``model`` (cached per process:
    the shape and the weights both ask for them)."""
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors
    except ImportError:
        raise ModelConfigError(
            f"{model} looks like a hub id, and reading it needs huggingface_hub, which is not "
            "installed (pip install huggingface_hub; vLLM brings it): install it, or pass a "
            "local model directory or config.json"
        ) from None
    repo_id, revision = split_revision(model)
    try:
        cfg_path = hub.hf_hub_download(repo_id, CONFIG, revision=revision)
    except errors.GatedRepoError:
        raise ModelConfigError(
            f"{repo_id} is gated on the Hugging Face hub: accept its terms on "
            f"https://huggingface.co/{repo_id} and set HF_TOKEN to a token of that account, "
            "or pass a local model directory"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ModelConfigError(
            f"no model {repo_id} on the Hugging Face hub (or it is private: set HF_TOKEN): "
            "check the id, or pass a local model directory or config.json"
        ) from None
    except errors.RevisionNotFoundError:
        raise ModelConfigError(
            f"{repo_id} has no revision {revision!r} on the Hugging Face hub: check it, or "
            "pass a local model directory or config.json"
        ) from None
    except errors.EntryNotFoundError as e:
        if not isinstance(e, errors.LocalEntryNotFoundError):
            raise ModelConfigError(
                f"{repo_id} has no config.json on the Hugging Face hub: pass a local model "
                "directory or config.json"
            ) from None
        raise ModelConfigError(_not_cached(repo_id)) from None
    except errors.OfflineModeIsEnabled:
        raise ModelConfigError(_not_cached(repo_id)) from None
    except (OSError, ValueError) as e:
        # another HTTP status, a cache it cannot write, an id it refuses (HFValidationError)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelConfigError(
            f"cannot read {repo_id} from the Hugging Face hub ({first}): pass a local model "
            "directory or config.json"
        ) from None
    directory = os.path.dirname(cfg_path)
    return HubModel(
        repo_id, revision, directory, _checkpoint_bytes(hub, repo_id, revision, directory)
    )


def _not_cached(repo_id: str) -> str:
    """The error line when the hub cannot be asked and the cache lacks the model."""
    why = "HF_HUB_OFFLINE is set" if _offline() else "the Hugging Face hub cannot be reached"
    return (
        f"{repo_id}: {why} and its config.json is not in the hub cache "
        f"({_cache_dir()}): go online once (kvtier size then caches config.json and the "
        "safetensors index, never weights), set HF_TOKEN if the model is gated, or pass a "
        "local model directory or config.json"
    )


def _offline() -> bool:
    """HF_HUB_OFFLINE as the hub client reads it (it also honours TRANSFORMERS_OFFLINE)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _checkpoint_bytes(hub: Any, repo_id: str, revision: str | None, directory: str) -> int | None:
    """The index's total_size; without an index, a single file's size (online only).
    Best effort: config.json alone sizes the plan, so a failure here costs one figure."""
    index: str | None = os.path.join(directory, INDEX)
    if not os.path.isfile(str(index)):
        try:
            index = hub.hf_hub_download(repo_id, INDEX, revision=revision)
        except Exception:  # no index, not cached offline, or unreachable
            index = None
    if index is not None:
        return index_total_size(index)
    if _offline():
        return None
    try:
        url = hub.hf_hub_url(repo_id, SINGLE, revision=revision)
        size = hub.get_hf_file_metadata(url).size  # a HEAD request: headers, no weights
    except Exception:  # no such file, or unreachable: the config alone
        return None
    return int(size) if isinstance(size, int) and size > 0 else None


def index_total_size(path: str) -> int | None:
    """``metadata.total_size`` of a ``model.safetensors.index.json``, when it holds one."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f).get("metadata") or {}
        total = meta.get("total_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(total) if isinstance(total, int | float) and total > 0 else None
