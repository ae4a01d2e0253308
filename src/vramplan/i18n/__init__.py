"""Translation of what a user reads: gettext catalogs, one language per process.

A leaf module (stdlib only). The estimator core never translates: it keeps English text
and, where a sentence carries values, builds it as a `Msg` (an English `str` that remembers
its template and values). The report and CLI edges call `_()`, `ngettext()` and `tr()`,
which read the language chosen once at the CLI edge by `set_language()`.

Catalogs are compiled gettext files shipped in the package,
`vramplan/locale/<lang>/LC_MESSAGES/vramplan.mo`, read by the standard library's
`gettext`; Babel is needed only to extract and compile them (the `i18n` extra). English is
the source language and the fallback for any message a catalog lacks.

Extraction keywords (Babel): `_`, `ngettext` (1, 2), `N_` (a marker for strings translated
later, e.g. table entries) and `Msg` (its template).
"""
from __future__ import annotations

import gettext as _gettext
import os
import re
from collections.abc import Mapping, Sequence

DOMAIN = "vramplan"
LOCALE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "locale")
LANGUAGES = ("en", "zh")
"""Languages the CLI offers; `en` is the source language and the default."""
DEFAULT_LANGUAGE = "en"
BABEL_KEYWORDS = {"_": None, "ngettext": (1, 2), "N_": None, "Msg": None}
"""What Babel's extractor treats as a message: the same names this module exports."""

_current = DEFAULT_LANGUAGE
_catalogs: dict[str, _gettext.NullTranslations] = {}


def N_(message: str) -> str:
    """Mark a string for extraction without translating it now (table entries, defaults)."""
    return message


class Msg(str):
    """An English sentence built from a template and values, translatable later.

    It *is* the English text (so JSON, logs and the Python API see plain English); `tr()`
    at the report edge formats the translated template with the same values, so numbers are
    identical in every language. Values that are themselves `Msg` are translated too.
    """

    template: str
    params: dict

    def __new__(cls, template: str, **params):
        self = super().__new__(cls, template.format(**params))
        self.template = template
        self.params = params
        return self

    @classmethod
    def join(cls, sep: str, items) -> "Msg":
        """The items joined by `sep`, each still translatable."""
        items = list(items)
        out = cls(sep.join(f"{{i{n}}}" for n in range(len(items))), **{f"i{n}": v for n, v in enumerate(items)})
        out.joined = (sep, items)
        return out

    def __reduce__(self):  # pickle/copy: rebuild from the template and values
        if hasattr(self, "joined"):
            return (_rejoin, self.joined)
        return (_rebuild, (self.template, self.params))


def _rebuild(template: str, params: dict) -> Msg:
    return Msg(template, **params)


def _rejoin(sep: str, items) -> Msg:
    return Msg.join(sep, items)


def _catalog(lang: str) -> _gettext.NullTranslations:
    if lang not in _catalogs:
        _catalogs[lang] = (_gettext.NullTranslations() if lang == DEFAULT_LANGUAGE else
                           _gettext.translation(DOMAIN, LOCALE_DIR, languages=[lang], fallback=True))
    return _catalogs[lang]


def set_language(lang: str | None) -> str:
    """Use `lang` (one of LANGUAGES; None means the default) for every later `_()` call."""
    global _current
    lang = normalize(lang) if lang else DEFAULT_LANGUAGE
    if lang is None:
        raise ValueError(f"lang: unknown language; choose one of {', '.join(LANGUAGES)}")
    _current = lang
    return lang


def get_language() -> str:
    return _current


def _(message: str) -> str:
    """The message in the current language (the English message when not translated)."""
    return _catalog(_current).gettext(message)


gettext = _


def ngettext(singular: str, plural: str, n: int) -> str:
    """Singular or plural form for `n` in the current language."""
    return _catalog(_current).ngettext(singular, plural, n)


def tr(text) -> str:
    """Translate a `Msg` (template and values) or a plain message; other values pass as str."""
    if isinstance(text, Msg) and hasattr(text, "joined"):
        sep, items = text.joined
        return _(sep).join(tr(item) for item in items)
    if isinstance(text, Msg):
        params = {k: tr(v) if isinstance(v, Msg) else v for k, v in text.params.items()}
        return _(text.template).format(**params)
    return _(text) if isinstance(text, str) else str(text)


# ---------------------------------------------------------------- choosing the language
_LOCALE_VARS = ("LC_ALL", "LC_MESSAGES", "LANG")
"""POSIX order: the first one set and non-empty decides the messages' locale."""


def normalize(value: str | None) -> str | None:
    """'zh', 'zh_CN.UTF-8', 'zh-Hans', 'ZH_tw' -> 'zh'; 'en_US.UTF-8', 'C', 'POSIX' -> 'en';
    None for a language we do not offer."""
    if not value:
        return None
    base = re.split(r"[_.@-]", value.strip().lower(), maxsplit=1)[0]
    if base in ("c", "posix"):
        return DEFAULT_LANGUAGE
    return base if base in LANGUAGES else None


def language_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The language the environment asks for (LC_ALL, then LC_MESSAGES, then LANG), or en."""
    environ = os.environ if environ is None else environ
    for var in _LOCALE_VARS:
        value = environ.get(var)
        if value:
            return normalize(value) or DEFAULT_LANGUAGE
    return DEFAULT_LANGUAGE


def language_for(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
    """`--lang X` / `--lang=X` from the command line when valid, else the environment's.

    Read before argparse runs, because the help texts are translated when the parser is
    built; an invalid value falls back here and argparse then reports it with the choices.
    """
    args = list(argv)
    for i, arg in enumerate(args):
        if arg == "--":
            break
        value = None
        if arg == "--lang" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--lang="):
            value = arg.split("=", 1)[1]
        if value is not None and value in LANGUAGES:
            return value
    return language_from_env(environ)
