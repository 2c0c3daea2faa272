"""The report's languages: one gettext catalogue each under ``report/locales/``.

At the bottom of the package: the config checks that every language it names has a catalogue, and the
report loads them (:mod:`servegrid.reporting.catalogues`).
"""

from __future__ import annotations

from pathlib import Path

REPORT_ROOT = Path(__file__).resolve().parents[2] / "report"
LOCALES = REPORT_ROOT / "locales"
DOMAIN = "messages"


def catalog_path(lang: str) -> Path:
    return LOCALES / lang / "LC_MESSAGES" / f"{DOMAIN}.po"


def available_languages() -> list[str]:
    return sorted(p.parent.parent.name for p in LOCALES.glob(f"*/LC_MESSAGES/{DOMAIN}.po"))
