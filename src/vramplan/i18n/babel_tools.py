"""Extract, update and compile the message catalogs with Babel (a development tool).

    python -m vramplan.i18n.babel_tools update    # extract from src/vramplan, merge into every .po
    python -m vramplan.i18n.babel_tools compile   # .po -> the .mo files the package ships

Needs the `i18n` extra (Babel); the installed package reads the compiled .mo files with the
standard library only. tests/test_i18n.py runs the same extraction to find untranslated
messages and checks that each committed .mo holds what its .po says.
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

from vramplan.i18n import BABEL_KEYWORDS, DOMAIN, LANGUAGES, LOCALE_DIR

PACKAGE_DIR = Path(__file__).resolve().parent.parent
TRANSLATED = tuple(lang for lang in LANGUAGES if lang != "en")


def po_path(lang: str) -> Path:
    return Path(LOCALE_DIR) / lang / "LC_MESSAGES" / f"{DOMAIN}.po"


def extract():
    """Every message marked in src/vramplan (`_`, `ngettext`, `N_`, `Msg`) as a Babel Catalog."""
    from babel.messages.catalog import Catalog
    from babel.messages.extract import extract_from_dir
    catalog = Catalog(project="vramplan", domain=DOMAIN, charset="utf-8")
    for filename, lineno, message, comments, context in extract_from_dir(
            str(PACKAGE_DIR), method_map=[("**.py", "python")], keywords=BABEL_KEYWORDS,
            comment_tags=("TRANSLATORS:",), strip_comment_tags=True):
        catalog.add(message, None, [(f"vramplan/{filename}", lineno)], auto_comments=comments, context=context)
    return catalog


def read_po(lang: str):
    from babel.messages.pofile import read_po as _read
    with open(po_path(lang), "rb") as fh:
        return _read(fh, locale=lang, domain=DOMAIN)


def update(lang: str) -> list[str]:
    """Merge the extracted messages into `lang`'s .po; returns the msgids still untranslated."""
    from babel.messages.pofile import write_po
    template = extract()
    catalog = read_po(lang) if po_path(lang).exists() else template
    catalog.update(template, update_header_comment=False)
    catalog.obsolete.clear()
    po_path(lang).parent.mkdir(parents=True, exist_ok=True)
    with open(po_path(lang), "wb") as fh:
        write_po(fh, catalog, width=100, sort_output=False, omit_header=False, ignore_obsolete=True)
    return [m.id for m in catalog if m.id and not m.string]


def compiled(lang: str) -> bytes:
    """The .mo bytes for `lang`'s .po (fuzzy entries left out, as msgfmt does)."""
    from babel.messages.mofile import write_mo
    buf = io.BytesIO()
    write_mo(buf, read_po(lang), use_fuzzy=False)
    return buf.getvalue()


def compile_all() -> None:
    for lang in TRANSLATED:
        po_path(lang).with_suffix(".mo").write_bytes(compiled(lang))


def main(argv: list[str]) -> int:
    if argv[:1] == ["update"]:
        for lang in TRANSLATED:
            missing = update(lang)
            print(f"{po_path(lang)}: {len(missing)} untranslated")
        return 0
    if argv[:1] == ["compile"]:
        compile_all()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
