"""Model references: a local directory, or a Hugging Face Hub id `ORG/NAME[@REVISION]`.

    resolve_model("path/to/dir")            -> that directory (a local directory always wins)
    resolve_model("Qwen/Qwen3.5-0.8B")      -> the snapshot directory in the hub cache
    resolve_model("Qwen/Qwen3.5-0.8B@main") -> a branch, tag or commit

Hub ids go through `huggingface_hub.snapshot_download`, which honours HF_HOME / HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_TOKEN (or a `hf auth login` token) and HF_ENDPOINT, reuses the cache, and shows
its own progress bar. Only what the loader reads is downloaded: config.json, the tokenizer and
chat-template files, the safetensors shards and their index. Every failure is a CheckpointError of
one line that says what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridjax.conversion.hf import CheckpointError

# What the loaders read (conversion.checkpoint.AUX_FILES are the side files; keep them in step).
HUB_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
    "*.safetensors", "model.safetensors.index.json",
)
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


def parse_hub_id(ref: str) -> tuple[str, str | None] | None:
    """("ORG/NAME", revision or None) when `ref` has the shape of a hub id, else None."""
    m = _HUB_ID.fullmatch(str(ref))
    if not m or ".." in m.group("repo") or m.group("repo").endswith((".", "-")):
        return None
    return m.group("repo"), m.group("revision")


def resolve_model(ref: str | Path, *, cache_dir: str | Path | None = None, offline: bool | None = None) -> Path:
    """The local directory `ref` names: itself when it is a directory, else the hub snapshot of
    the id `ORG/NAME[@REVISION]`. `cache_dir` / `offline` override HF_HUB_CACHE / HF_HUB_OFFLINE."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    hub = parse_hub_id(str(ref))
    if hub is None or path.exists():
        raise CheckpointError(f"model directory not found: {ref} (pass a model directory or a Hugging Face id ORG/NAME)")
    return _download(*hub, cache_dir=cache_dir, offline=offline)


def _download(repo: str, revision: str | None, *, cache_dir, offline: bool | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub_errors

    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    where = cache_dir or constants.HF_HUB_CACHE
    name = f"{repo}@{revision}" if revision else repo
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                   allow_patterns=list(HUB_FILES))
    except hub_errors.GatedRepoError:
        raise CheckpointError(f"{name}: the model is gated on the Hugging Face Hub: accept its terms on the model page, "
                              "then log in (`hf auth login`) or set HF_TOKEN") from None
    except hub_errors.RepositoryNotFoundError:
        raise CheckpointError(f"{name}: no such model on the Hugging Face Hub (or it is private: log in with "
                              "`hf auth login` or set HF_TOKEN); for a local directory, check the path") from None
    except hub_errors.RevisionNotFoundError:
        raise CheckpointError(f"{name}: the model has no revision {revision!r} (a branch, tag or commit)") from None
    except hub_errors.LocalEntryNotFoundError:
        if offline:
            raise CheckpointError(f"{name}: not in the Hugging Face cache ({where}) and downloads are off "
                                  "(HF_HUB_OFFLINE=1): unset HF_HUB_OFFLINE to download it, or pass a local "
                                  "model directory") from None
        raise CheckpointError(f"{name}: cannot reach the Hugging Face Hub and the model is not in the cache ({where}): "
                              "check the network (or HF_ENDPOINT), or pass a local model directory") from None
    except (hub_errors.HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{name}: download from the Hugging Face Hub failed: {' '.join(str(e).split())[:300]}") from None
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{name}: the snapshot at {folder} has no config.json: not a model this loader reads")
    return folder
