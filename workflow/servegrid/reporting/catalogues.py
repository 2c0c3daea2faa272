"""The report's gettext catalogues, one per language and compiled in memory, and its number format.

A language exists when report/locales/<language>/LC_MESSAGES/messages.po does;
the config's report.languages is checked against this list.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from babel import Locale
from babel.dates import format_date, format_datetime
from babel.messages.mofile import write_mo
from babel.messages.pofile import read_po
from babel.numbers import format_currency, format_decimal, format_percent
from babel.support import Translations
from babel.units import format_unit

from servegrid.errors import ConfigError
from servegrid.languages import DOMAIN, catalog_path
from servegrid.stats import intervals


def load_catalog(lang: str) -> tuple[Translations, Locale]:
    """Compile the language's .po catalogue in memory (no generated .mo files in the tree)."""
    path = catalog_path(lang)
    if not path.exists():
        raise ConfigError(f"report.languages: no catalogue for language '{lang}' at {path}")
    with path.open("rb") as handle:
        catalog = read_po(handle, locale=None)
    buffer = io.BytesIO()
    write_mo(buffer, catalog, use_fuzzy=False)
    buffer.seek(0)
    locale = catalog.locale or Locale.parse(lang)
    return Translations(fp=buffer, domain=DOMAIN), locale


def format_number(value: float, digits: int, locale: Locale | str) -> str:
    """``value`` with ``digits`` decimals and the language's own separators (Babel)."""
    return format_decimal(value, format="#,##0" + ("." + "0" * digits if digits > 0 else ""), locale=locale)


@dataclass
class Formatter:
    """Locale-aware number formatting for the template's filters."""

    locale: Locale

    def num(self, value: Any, digits: int = 1) -> str:
        return "–" if intervals.missing(value) else format_number(value, digits, self.locale)

    def integer(self, value: Any) -> str:
        return self.num(value, 0)

    def ratio(self, value: Any, digits: int = 1) -> str:
        text = self.num(value, digits)
        return text if text == "–" else f"{text}×"

    def unit(self, value: Any, unit: str, digits: int) -> str:
        """``value`` in a CLDR unit (``duration-second``), written as the language writes it ("2,50 mp")."""
        if intervals.missing(value):
            return "–"
        pattern = "#,##0" + ("." + "0" * digits if digits > 0 else "")
        return format_unit(value, unit, length="short", format=pattern, locale=self.locale)

    def seconds(self, value: Any) -> str:
        return self.unit(value, "duration-second", 2 if not intervals.missing(value) and abs(value) < 10 else 1)

    def whole_seconds(self, value: Any) -> str:
        """Seconds into a trace: whole where they are whole ("600 s"), else to a tenth."""
        return self.unit(value, "duration-second", self._whole_digits(value))

    def whole_number(self, value: Any) -> str:
        return self.num(value, self._whole_digits(value))

    @staticmethod
    def _whole_digits(value: Any) -> int:
        return 0 if intervals.missing(value) or float(value).is_integer() else 1

    def ms(self, value: Any) -> str:
        return self.unit(None if intervals.missing(value) else value * 1000, "duration-millisecond", 1)

    def money(self, value: Any, currency: str) -> str:
        """An amount in ``currency`` as the language writes one ("US$ 0,42", "0,42 USD"): to the cent, or to three
        significant figures below a cent (a million tokens can cost less)."""
        if intervals.missing(value):
            return "–"
        if abs(value) >= 0.01:
            return format_currency(value, currency, locale=self.locale)
        rounded = float(f"{value:.3g}")
        return format_currency(rounded, currency, locale=self.locale, decimal_quantization=False)

    def percent(self, value: Any) -> str:
        return "–" if intervals.missing(value) else format_percent(value, format="#,##0%", locale=self.locale)

    def date(self, value: datetime | None) -> str:
        return "–" if value is None else format_date(value, format="long", locale=self.locale)

    def datetime(self, value: datetime | None) -> str:
        return "–" if value is None else format_datetime(value, format="medium", locale=self.locale)
