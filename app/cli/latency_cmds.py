"""``ragbudget calibrate`` and ``ragbudget profiles list|show``: latency profiles from the CLI."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.cli.common import add_json_flag, emit, seed_arg
from foundation.errors import InvalidConfig
from latency_model.predictors import PREFILL_MODELS


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``calibrate`` and ``profiles list|show`` to the top-level subparsers ``sub``."""
    cal = sub.add_parser("calibrate", help="time the generator on this device and fit a latency profile")
    cal.add_argument("--quick", action="store_true",
                     help="prompts up to 2048 tokens (< 2 min for the default model on 2 CPU cores)")
    cal.add_argument("--seed", type=seed_arg, default=0, help="seed of the interleaved order (default 0)")
    cal.add_argument("--cached-tokens", type=int, nargs="+", metavar="N",
                     help="cached-prefix lengths to measure besides 0 (default: the scaffold sizes)")
    cal.add_argument("--prefill-model", choices=sorted(PREFILL_MODELS),
                     help="force a prefill form (default: chosen by held-out error)")
    cal.add_argument("--engine", metavar="ID", help="the configured engine to calibrate (an id of "
                     "RAGBUDGET_ENGINES; default: the first)")
    cal.add_argument("--no-save", action="store_true", help="fit and print, but do not store")
    cal.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_json_flag(cal)
    cal.set_defaults(func=cmd_calibrate)

    prof = sub.add_parser("profiles", help="list and show latency profiles")
    psub = prof.add_subparsers(dest="profiles_command", metavar="ACTION")
    psub.required = True
    ls = psub.add_parser("list", help="every stored profile, newest first")
    add_json_flag(ls)
    ls.set_defaults(func=cmd_list)
    show = psub.add_parser("show", help="one profile (--json: complete, with raw samples)")
    show.add_argument("profile_id", metavar="ID", help="sha256:<hex> or at least 8 hex digits")
    add_json_flag(show)
    show.set_defaults(func=cmd_show)


def scaffold_sizes(services: Any) -> list[int]:
    """Token counts of the scaffolds in use (stored ones plus the default), best effort."""
    try:
        from sqlalchemy import select

        from app.models import Scaffold
        from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder
        from foundation.db import read_session

        builder = PromptBuilder.for_generator(services.generator, services.settings.chat_template)
        with read_session(services.engine) as session:
            texts = set(session.scalars(select(Scaffold.text)))
        texts.add(DEFAULT_SCAFFOLD_TEXT)
        return sorted({len(builder.scaffold_ids(t)) for t in texts})
    except Exception as exc:  # the prompt layer is optional here; calibrate still works without it
        print(f"note: scaffold sizes unavailable ({exc}); measuring cached length 0 only",
              file=sys.stderr)
        return []


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def describe(profile: dict[str, Any]) -> str:
    """A few human-readable lines about a profile (summary dict)."""
    held = profile.get("held_out") or {}
    coef = ", ".join(f"{k}={v:.4g}" for k, v in profile["prefill_coefficients"].items())
    dec = ", ".join(f"{k}={v:.4g}" for k, v in profile["decode_coefficients"].items())
    q = profile["prefill_quantiles"]
    lines = [
        f"profile {profile['id']}  [source: {profile['source']}]",
        f"  device   {profile['device_name']} ({profile['device']}, {profile['dtype']}, "
        f"threads={profile['threads']})",
        f"  model    {profile['model_id']}  weights {profile['weights_hash'][:19]}...",
        f"  prefill  {profile['prefill_model']}: {coef}  (ms; band p50 {q.get('p50', 0):+.1%}, "
        f"p95 {q.get('p95', 0):+.1%})",
        f"  decode   {profile['decode_model']}: {dec}  (ms)",
        f"  created  {profile['created_at']}",
    ]
    if profile["source"] == "fitted":
        lines.append(f"  held-out leave-one-length-out MAPE {_pct(held.get('loo_length_mape'))}; "
                     f"fresh points: MAPE {_pct(held.get('fresh_mape'))}, p95 coverage "
                     f"{_pct(held.get('fresh_p95_coverage'))} of {held.get('fresh_points')}")
        if profile.get("form_comparison"):
            lines.append("  forms    " + ", ".join(f"{k} {_pct(v)}" for k, v in
                                                    sorted(profile["form_comparison"].items())))
    step = profile.get("step_model") or {}
    if step:
        sc = ", ".join(f"{k}={v:.4g}" for k, v in step.get("coefficients", {}).items())
        sq = step.get("quantiles") or {}
        lines.append(f"  step     {step.get('form')}: {step.get('formula')}; {sc}  (ms; band p50 "
                     f"{sq.get('p50', 0):+.1%}, p95 {sq.get('p95', 0):+.1%})")
        lines.append(f"  step     held-out leave-one-point-out MAPE {_pct(step.get('loo_point_mape'))}; "
                     f"fresh steps: MAPE {_pct(step.get('fresh_mape'))}, p95 coverage "
                     f"{_pct(step.get('fresh_p95_coverage'))} of {step.get('fresh_points')}")
    elif profile.get("prior"):
        lines.append(f"  prior    {profile['prior'].get('peaks_source')}")
    lines += [f"  note     {n}" for n in profile.get("notes", [])]
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget calibrate``: fit a profile for this device and generator, print and store it."""
    payload = calibrate_profile(services, quick=args.quick, seed=args.seed, cached_tokens=args.cached_tokens,
                                prefill_model=args.prefill_model, progress=not args.no_progress,
                                save=not args.no_save, engine=args.engine)
    emit(args, payload, lambda p: describe(p) + (f"\n  saved    {p['saved_to']}" if p["saved_to"] else ""))
    return 0


def calibrate_profile(services: Any, *, quick: bool, seed: int = 0, cached_tokens: list[int] | None = None,
                      prefill_model: str | None = None, progress: bool = True,
                      save: bool = True, engine: str | None = None) -> dict[str, Any]:
    """Time the generator on the quick or full grid, fit a profile and (``save``) store it.

    ``cached_tokens`` defaults to the sizes of the scaffolds in use; ``engine``: the id of the
    configured engine to time (default: the first). The profile is keyed by that engine's
    identity, so the answer path finds it for that engine. Returns the profile's summary with
    ``saved_to`` (the JSON file, or None) and ``engine_id``.

    Raises:
        InvalidConfig: the generator cannot be timed (no ``prefill_ms``/``decode_step_ms``).
        NotFound: ``unknown_engine``, ``engine`` is not configured.
    """
    from app.profile_store import save_profile
    from latency_model.calibration import PrefillTimer, calibrate
    from latency_model.grid import engine_chunk_tokens, full_grid, quick_grid

    engine_id = engine if engine is not None else services.engine_ids[0]
    timer = services.engine_generator(engine_id)
    if not isinstance(timer, PrefillTimer):
        raise InvalidConfig("the configured generator cannot be timed (no prefill_ms/decode_step_ms)")
    window = int(timer.identity.get("context_window") or getattr(timer, "context_window", 0) or 2048)
    cached = cached_tokens if cached_tokens is not None else scaffold_sizes(services)
    grid = (quick_grid if quick else full_grid)(window, list(cached),
                                                engine_chunk_tokens(dict(timer.identity)))
    _print_estimate(services, timer, grid, seed, progress)
    profile = calibrate(timer, grid=grid, seed=seed, progress=progress, prefill_model=prefill_model)
    path = save_profile(services.engine, services.data_dir, profile) if save else None
    return {**profile.summary(), "saved_to": str(path) if path else None, "engine_id": engine_id}


def _print_estimate(services: Any, timer: Any, grid: Any, seed: int, progress: bool) -> None:
    """Tell stderr how long the grid should take, when a fitted profile of this generator exists."""
    from app.profile_store import find_profile, key_of
    from latency_model.grid import estimate_seconds

    previous = find_profile(services.engine, key_of(dict(timer.identity)), "fitted")
    if previous is not None and progress:
        print(f"{grid.name} grid: about {estimate_seconds(grid, previous, seed):.0f} s "
              f"(from profile {previous.id[:19]})", file=sys.stderr)


def cmd_list(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget profiles list``: every stored latency profile, newest first (id, source,
    creation time, held-out leave-one-length-out MAPE, device and model). Returns 0."""
    from app.profile_store import list_profiles

    profiles = [p.summary() for p in list_profiles(services.engine, services.data_dir)]

    def human(rows: list[dict[str, Any]]) -> str:
        if not rows:
            return "no latency profiles yet; run `ragbudget calibrate --quick`"
        out = [f"{'id':<21} {'source':<7} {'created':<20} {'loo MAPE':>8}  device / model"]
        for p in rows:
            out.append(f"{p['id'][:21]:<21} {p['source']:<7} {p['created_at'][:19]:<20} "
                       f"{_pct((p.get('held_out') or {}).get('loo_length_mape')):>8}  "
                       f"{p['device_name']} / {p['model_id']} ({p['dtype']}, threads={p['threads']})")
        return "\n".join(out)

    emit(args, profiles, human)
    return 0


def cmd_show(args: argparse.Namespace, services: Any) -> int:
    """``ragbudget profiles show ID``: one profile (id, a unique prefix of >= 8 hex digits, or
    ``sha256:<hex>``) described for people, or its full body with ``--json``. Returns 0;
    raises ``InvalidInput`` (exit 2) on a short or ambiguous prefix, ``UnknownProfile``
    (exit 3) when none matches, ``IntegrityFailure`` (exit 4) when the stored body no longer
    matches its id. With the online correction the serving process last stored for it."""
    from app.profile_store import load_correction_state, load_profile

    profile = load_profile(services.engine, services.data_dir, args.profile_id)
    body = profile.to_dict()
    # The online correction as the serving process last stored it (never part of the fitted profile).
    body["correction"] = load_correction_state(services.data_dir, profile.id)

    def human(p: dict[str, Any]) -> str:
        c = p.get("correction")
        line = ("online correction: none stored (no answers served since this calibration)"
                if not c else
                f"online correction: factor {c['factor']:.3f}, p95 multiplier "
                f"{'-' if c['p95_multiplier'] is None else format(c['p95_multiplier'], '.3f')}, "
                f"{c['n']} of {c['window']} answers, "
                f"{'active' if c['active'] else 'not yet active'}, p95 coverage "
                f"{'-' if c['coverage'] is None else format(c['coverage'], '.0%')}, machine speed "
                f"{'-' if c.get('speed') is None else format(c['speed'], '.2f')}")
        for name, g in sorted((c or {}).get("groups", {}).items()):
            mult = g.get("p95_multiplier")
            line += (f"\n  plans {name}: {g['answers']} answer{'' if g['answers'] == 1 else 's'}, "
                     f"factor {g['factor']:.3f}, p95 "
                     f"multiplier {'-' if mult is None else format(mult, '.3f')} "
                     f"({'its own answers' if g['own'] else 'pooled window'})")
        return describe(p) + "\n" + line

    emit(args, body, human)
    return 0
