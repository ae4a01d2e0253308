"""Config importers: engine and trainer files -> spec overrides plus a report of the
fields used, ignored and unresolved. They read files; the estimator core does not."""
from vramplan.importers.accelerate_cfg import from_accelerate
from vramplan.importers.cli_args import import_config_files, read_config
from vramplan.importers.deepspeed import from_deepspeed
from vramplan.importers.hf_args import from_training_args
from vramplan.importers.recipes import from_recipe
from vramplan.importers.report import ImportError_, ImportReport

__all__ = ["ImportError_", "ImportReport", "from_accelerate", "from_deepspeed", "from_recipe",
           "from_training_args", "import_config_files", "read_config"]
