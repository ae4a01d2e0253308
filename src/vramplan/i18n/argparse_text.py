"""argparse's own words (usage, section titles, -h/--version help) in the current language.

argparse translates through the process-wide default gettext domain, which vramplan does
not own; the CLI's parser class applies these instead, from vramplan's own catalog.
"""
from __future__ import annotations

import argparse

from vramplan.i18n import N_, _

ARGPARSE_TEXT = (
    N_("usage: "), N_("positional arguments"), N_("options"),
    N_("show this help message and exit"), N_("show program's version number and exit"),
)


class LocalizedHelpFormatter(argparse.HelpFormatter):
    """The usage prefix and argparse's stock help lines from vramplan's catalog."""

    def add_usage(self, usage, actions, groups, prefix=None):
        return super().add_usage(usage, actions, groups, _("usage: ") if prefix is None else prefix)

    def _get_help_string(self, action):
        return _(action.help) if action.help in ARGPARSE_TEXT else action.help


def localize_parser(parser: argparse.ArgumentParser) -> None:
    """Translate the section titles argparse set when `parser` was made."""
    parser._positionals.title = _("positional arguments")
    parser._optionals.title = _("options")
