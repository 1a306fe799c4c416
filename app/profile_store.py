"""Latency profiles on disk and in the database, and the profile in force for the generator.

Every profile is saved twice, byte-identical: ``<data_dir>/profiles/<hex>.json``
(a portable copy) and the ``latency_profiles`` table (the index). Files found
in the folder but not in the table (e.g. copied from another machine) are
imported by :func:`sync_profiles`.

Selection (:func:`current_profile`): the newest *fitted* profile whose key
``(device_name, model_id, weights_hash, dtype, threads on CPU)`` matches the
generator's identity wins; otherwise the newest stored prior for that key;
otherwise a roofline prior is built from the generator's config, saved (so a
receipt's profile id always resolves) and returned.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError

from app.models import LatencyProfileRow
from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import InvalidInput, RagBudgetError, UnknownProfile
from latency_model.profile import Profile, profile_dtype

ProfileKey = tuple[str, str, str, str, int | None]

_PARSED: dict[str, Profile] = {}  # id -> verified profile (content-addressed, so never stale)
_SYNCED: set[tuple[str, str]] = set()  # (database url, profiles dir) already synced this process
_LOCK = threading.Lock()


def profiles_dir(data_dir: Path) -> Path:
    """``<data_dir>/profiles`` (not created here)."""
    return Path(data_dir) / "profiles"


def key_of(identity: dict[str, Any]) -> ProfileKey:
    """The profile key of a generator identity (threads only count on CPU)."""
    device = str(identity.get("device") or "")
    dtype = profile_dtype(identity)  # qualified by the compute precision (bf16 tiles)
    threads = identity.get("threads") if device.startswith("cpu") else None
    return (str(identity.get("device_name") or device), str(identity.get("model_id") or "unknown"),
            str(identity.get("weights_hash") or ""), dtype, int(threads) if threads is not None else None)


def _parse(body: str) -> Profile:
    profile = Profile.from_json(body)
    with _LOCK:
        return _PARSED.setdefault(profile.id, profile)


def _parse_cached(profile_id: str, body: str) -> Profile:
    with _LOCK:
        hit = _PARSED.get(profile_id)
    return hit if hit is not None else _parse(body)


def _write_file(directory: Path, profile: Profile, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{profile.id.removeprefix('sha256:')}.json"
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    fd, tmp = tempfile.mkstemp(prefix=".profile-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _insert_row(engine: Engine, profile: Profile, text: str) -> None:
    try:
        with write_transaction(engine, WriterLock.PROFILES) as session:
            if session.get(LatencyProfileRow, profile.id) is None:
                session.add(LatencyProfileRow(
                    id=profile.id, device=profile.device_name, model_id=profile.model_id,
                    weights_hash=profile.weights_hash, dtype=profile.dtype,
                    threads=profile.key[-1], created_at=profile.created_at, body=text))
    except IntegrityError:  # the same content was saved concurrently: nothing to do
        pass


def save_profile(engine: Engine, data_dir: Path, profile: Profile) -> Path:
    """Save ``profile`` as JSON under ``<data_dir>/profiles`` and in ``latency_profiles``.

    Idempotent (the id is a content hash). Returns the file path.
    """
    text = profile.to_json()
    path = _write_file(profiles_dir(data_dir), profile, text)
    _insert_row(engine, profile, text)
    with _LOCK:
        _PARSED.setdefault(profile.id, profile)
    return path


def sync_profiles(engine: Engine, data_dir: Path, *, force: bool = False) -> int:
    """Import profile files missing from the database (once per process unless ``force``).

    Files that do not parse or verify are skipped (they never enter the index).
    Returns the number imported.
    """
    directory = profiles_dir(data_dir)
    marker = (engine.url.render_as_string(hide_password=True), str(directory.resolve()))
    if (marker in _SYNCED and not force) or not directory.is_dir():
        _SYNCED.add(marker)
        return 0
    with read_session(engine) as session:
        known = set(session.scalars(select(LatencyProfileRow.id)))
    imported = 0
    for path in sorted(directory.glob("*.json")):
        if "sha256:" + path.stem in known:
            continue
        try:
            profile = _parse(path.read_text(encoding="utf-8"))
        except (OSError, RagBudgetError):
            continue
        _insert_row(engine, profile, profile.to_json())
        imported += 1
    _SYNCED.add(marker)
    return imported


def list_profiles(engine: Engine, data_dir: Path) -> list[Profile]:
    """Every stored profile, newest first (files not yet indexed are imported first)."""
    sync_profiles(engine, data_dir, force=True)
    with read_session(engine) as session:
        rows = session.execute(select(LatencyProfileRow.id, LatencyProfileRow.body)
                               .order_by(LatencyProfileRow.created_at.desc(),
                                         LatencyProfileRow.id)).all()
    return [_parse_cached(pid, body) for pid, body in rows]


def load_profile(engine: Engine, data_dir: Path, profile_id: str) -> Profile:
    """The profile with this id: ``sha256:<hex>``, the bare hex, or a unique prefix of >= 8 hex digits.

    Raises:
        InvalidInput: the prefix is shorter than 8 characters or matches several profiles.
        UnknownProfile: no such profile.
        IntegrityFailure: the stored body no longer matches its id.
    """
    hexpart = profile_id.strip().lower().removeprefix("sha256:")
    if len(hexpart) < 8 or any(ch not in "0123456789abcdef" for ch in hexpart):
        raise InvalidInput("a profile id is sha256:<hex> or at least 8 of its hex digits",
                           profile_id=profile_id)
    sync_profiles(engine, data_dir)
    with read_session(engine) as session:
        rows = session.execute(select(LatencyProfileRow.id, LatencyProfileRow.body)
                               .where(LatencyProfileRow.id.startswith("sha256:" + hexpart))
                               .limit(2)).all()
    if not rows:
        raise UnknownProfile(f"no latency profile {profile_id}", profile_id=profile_id)
    if len(rows) > 1:
        raise InvalidInput(f"profile id prefix {profile_id} is ambiguous", profile_id=profile_id)
    return _parse_cached(rows[0][0], rows[0][1])


def find_profile(engine: Engine, key: ProfileKey, source: str | None = None) -> Profile | None:
    """The newest stored profile with ``key`` (and ``source``, when given), or ``None``."""
    device_name, model_id, weights_hash, dtype, threads = key
    query = (select(LatencyProfileRow.id, LatencyProfileRow.body)
             .where(LatencyProfileRow.device == device_name, LatencyProfileRow.model_id == model_id,
                    LatencyProfileRow.weights_hash == weights_hash, LatencyProfileRow.dtype == dtype)
             .order_by(LatencyProfileRow.created_at.desc(), LatencyProfileRow.id))
    query = query.where(LatencyProfileRow.threads.is_(None) if threads is None
                        else LatencyProfileRow.threads == threads)
    with read_session(engine) as session:
        rows = session.execute(query).all()
    for pid, body in rows:
        profile = _parse_cached(pid, body)
        if source is None or profile.source == source:
            return profile
    return None


def generator_config(generator: Any) -> dict[str, Any]:
    """The generator's model config as a dict (``config_dict()``, ``hf_config`` or ``config``)."""
    cfg = getattr(generator, "config_dict", None)
    if callable(cfg):
        cfg = cfg()
    if isinstance(cfg, dict) and cfg:
        return cfg
    for attr in ("hf_config", "config"):
        obj = getattr(generator, attr, None)
        if obj is not None and hasattr(obj, "to_dict"):
            return dict(obj.to_dict())
        if isinstance(obj, dict) and obj:
            return obj
    return {}


def current_profile(services: Any, generator: Any = None) -> Profile:
    """The profile in force for ``generator`` (default ``services.generator``; one engine of a
    fleet: ``services.engine_generator(id)``): newest fitted, else a (stored) prior.

    Raises:
        UnknownProfile: no fitted profile and no prior possible (e.g. a remote engine
            whose device and model shape are unknown; run ``ragbudget calibrate``).
        InvalidConfig: the config lacks fields a prior needs, or a GPU is not in the datasheet table.
    """
    from latency_model.calibration import make_prior

    generator = generator if generator is not None else services.generator
    identity = dict(generator.identity)
    engine, data_dir = services.engine, services.data_dir
    sync_profiles(engine, data_dir)
    key = key_of(identity)
    found = find_profile(engine, key, "fitted") or find_profile(engine, key, "prior")
    if found is not None:
        return found
    config = generator_config(generator)
    device = str(identity.get("device") or "")
    if not config or not (device.startswith("cpu") or device.startswith("cuda")):
        raise UnknownProfile(
            f"no latency profile for {key[1]} on {key[0]}, and no roofline prior is possible for "
            f"device {device or 'unknown'!r}; run `ragbudget calibrate`", key=list(key))
    prior = make_prior(identity, config)
    save_profile(engine, data_dir, prior)
    return prior


def correction_path(data_dir: Path, profile_id: str) -> Path:
    """``<data_dir>/profiles/corrections/<hex>.json``: a profile's online correction, as last stored."""
    return profiles_dir(data_dir) / "corrections" / (profile_id.removeprefix("sha256:") + ".json")


def save_correction_state(data_dir: Path, state: Any, window: Sequence[Sequence[Any]] | None = None,
                          groups: dict[str, Any] | None = None) -> Path:
    """Store a :class:`latency_model.correction.CorrectionState` (atomically: write, then rename),
    with the correction's window pairs when given (``window``: what a restarted process
    reloads, :func:`load_correction_window`) and its per-group figures (``groups``:
    :meth:`latency_model.correction.OnlineCorrection.groups`).

    The serving process writes it after each answer; ``ragbudget profiles show`` reads it.
    The profile file itself (its fitted coefficients) is never touched.

    Raises:
        OSError: the directory cannot be written.
    """
    path = correction_path(data_dir, state.profile_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = state.to_dict()
    if window is not None:
        body["window_pairs"] = [list(pair) for pair in window]
    if groups is not None:
        body["groups"] = groups
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(body, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_correction_window(data_dir: Path, profile_id: str) -> list[list[Any]]:
    """The stored window pairs ``[fitted p50 ms, measured ms, covered, machine speed or null,
    group or null]`` of ``profile_id``'s online correction (three or four fields when stored
    before speeds, or groups, were), oldest
    first; ``[]`` when none are stored (or the file is unreadable)."""
    data = load_correction_state(data_dir, profile_id) or {}
    pairs = data.get("window_pairs")
    return [p for p in pairs if isinstance(p, list)] if isinstance(pairs, list) else []


def load_correction_state(data_dir: Path, profile_id: str) -> dict[str, Any] | None:
    """The stored online correction of ``profile_id`` (a dict), or None when there is none."""
    try:
        data = json.loads(correction_path(data_dir, profile_id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
