"""Shared test setup."""
import pytest


@pytest.fixture(autouse=True)
def _english_answers(monkeypatch):
    """The CLI takes its language from LC_ALL / LC_MESSAGES / LANG; tests that read English
    text must not turn Chinese on a machine set to zh_CN. Each test starts and ends in English."""
    from vramplan import i18n
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(var, raising=False)
    i18n.set_language("en")
    yield
    i18n.set_language("en")
