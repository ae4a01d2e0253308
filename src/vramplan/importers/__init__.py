"""Config importers: engine and trainer files -> spec overrides plus a report of the
fields used, ignored and unresolved. They read files; the estimator core does not.

The names load on first use (PEP 562): `vramplan estimate` without a config file should not
import every importer."""

_WHERE = {"from_accelerate": "accelerate_cfg", "import_config_files": "cli_args", "read_config": "cli_args",
          "from_deepspeed": "deepspeed", "from_training_args": "hf_args", "from_recipe": "recipes",
          "ImportError_": "report", "ImportReport": "report"}

__all__ = ["ImportError_", "ImportReport", "from_accelerate", "from_deepspeed", "from_recipe",
           "from_training_args", "import_config_files", "read_config"]


def __getattr__(name: str):
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(f"vramplan.importers.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
