"""The command line: one module per command (main: the parser, `estimate`, `models`, `gpus`;
plan: `compare`, `fit`, `tiers`, `check`, `maximize`, `min-gpus`; measure: `measure`; serve:
`serve`, the web page), with the flag words in flags and the progress bars in progress.
Each module parses, calls the public API and renders; no arithmetic lives here."""
from vramplan.cli.flags import add_format_args, answer_format, dashed, strategy_from_flags
from vramplan.cli.main import UsageError, build_parser, flags_to_data, main, spec_from_args

__all__ = ["UsageError", "add_format_args", "answer_format", "build_parser", "dashed", "flags_to_data",
           "main", "spec_from_args", "strategy_from_flags"]
