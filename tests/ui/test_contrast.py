"""The console's colour pairs meet WCAG 2.x AA contrast for normal text (4.5:1)."""

from __future__ import annotations

import re

import pytest

from app.ui.web import STATIC

CSS = (STATIC / "console.css").read_text()
VARS = dict(re.findall(r"--([a-z-]+):\s*(#[0-9a-fA-F]{6})", CSS))
# (foreground, background) as used in console.css: text on page and panels, links, badges,
# buttons, error/notice boxes, the chosen plan row.
PAIRS = [("fg", "bg"), ("fg", "panel"), ("muted", "bg"), ("muted", "panel"), ("link", "bg"),
         ("link", "panel"), ("ok-fg", "ok-bg"), ("warn-fg", "warn-bg"), ("bad-fg", "bad-bg"),
         ("info-fg", "info-bg"), ("fg", "chosen"), ("#ffffff", "accent"), ("accent", "bg")]


def _luminance(hex_colour: str) -> float:
    """Relative luminance (WCAG 2.x, sRGB)."""
    channels = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a: str, b: str) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _colour(name: str) -> str:
    return name if name.startswith("#") else VARS[name]


@pytest.mark.parametrize(("fg", "bg"), PAIRS)
def test_text_colour_pair_meets_aa(fg: str, bg: str) -> None:
    assert _contrast(_colour(fg), _colour(bg)) >= 4.5


def test_contrast_formula_matches_the_known_extremes() -> None:
    assert round(_contrast("#000000", "#ffffff"), 1) == 21.0 and _contrast("#777777", "#777777") == 1.0
