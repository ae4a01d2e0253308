"""The JSON API's answers, without a web framework: `answer(name, query, body)` -> (HTTP
status, JSON-able payload). web/app.py serves them over HTTP (Starlette); anything else that
can run Python (a static page under Pyodide) can call them the same way.

Every answer is what the command line's `--json` prints for the same spec, built by the same
functions: `Estimate.to_dict()` (estimate), `plan.answers.compare_answer` +
`compare_to_dict` (compare), `plan.answers.fit_answer` + `FitReport.to_dict()` (fit),
`listing` (models, gpus). A request's body is the spec mapping (what `--spec`
reads); the planning options (`headroom`, `mfu`, `top_k`) and the language of error lines
(`lang`) are query parameters. Bad input is HTTP 400 with the CLI's one line
(`spec.enums.user_error_line`) and the field it names; a bug is 500 with one line.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Mapping

from vramplan.i18n import LANGUAGES, set_language, tr
from vramplan.spec import SpecError
from vramplan.spec.enums import USER_ERRORS, as_spec_error, internal_error_line, user_error_line

IMPORT_KINDS = ("deepspeed", "training_args", "accelerate_config", "recipe")
"""The config files the page reads, as the CLI's --deepspeed, --training-args, ... flags."""
MAX_BODY_BYTES = 4 * 2**20
"""A spec, config.json or training config is a few kilobytes; more is a mistake."""


def answer(name: str, query: Mapping[str, str], body: bytes = b"") -> tuple[int, object]:
    """The endpoint `name` (estimate, compare, fit, import, models, gpus, choices) for a
    query and a request body, in the query's language (`lang`, default en)."""
    handler, spec_body = ENDPOINTS[name]
    lang = query.get("lang", "en")
    set_language(lang if lang in LANGUAGES else "en")
    try:
        if len(body) > MAX_BODY_BYTES:
            raise SpecError("spec", f"the request is {len(body):,} bytes; a spec is at most {MAX_BODY_BYTES:,}")
        return 200, handler(_spec(body) if spec_body else body, query)
    except USER_ERRORS as exc:
        return 400, {"error": user_error_line(exc), "field": as_spec_error(exc).field}
    except Exception as exc:  # a bug, not the input: one line, as the CLI's exit 70
        return 500, {"error": internal_error_line(exc), "field": None}
    finally:
        set_language("en")


def answer_json(name: str, query_json: str, body: str) -> str:
    """answer() with its arguments and result as JSON text, `{"status", "payload"}`: for a
    caller outside Python (the static page, static/pyodide-api.js, under Pyodide)."""
    if name not in ENDPOINTS:
        return json.dumps({"status": 404, "payload": {"error": f"no endpoint {name}", "field": None}})
    status, payload = answer(name, json.loads(query_json), body.encode("utf-8"))
    return json.dumps({"status": status, "payload": payload})


def _spec(body: bytes):
    """The body as a JobSpec, loaded as `vramplan estimate --spec FILE.json` loads it."""
    from vramplan.sources import looks_like_path
    from vramplan.spec import load_spec
    try:
        data = json.loads(body.decode("utf-8") or "{}", object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError("spec", f"the request body is not JSON: {exc}") from None
    except RecursionError:
        raise SpecError("spec", "the request body is not JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise SpecError("spec", f"expected a mapping of spec fields, got {type(data).__name__}")
    spec = load_spec(data)
    named = [(name, getattr(spec, name, None)) for name in ("model", "reference_model", "teacher", "reward_model",
                                                             "critic_model")]
    for name, value in named + [(f"models.{m.role}.model", m.model) for m in spec.models]:
        if isinstance(value, str) and looks_like_path(value):
            # a local path in a request names a file on the server (sources.py reads a
            # config.json or a model folder there): not the caller's to read
            raise SpecError(name, "the web API reads no files on the server; give a catalog name or a "
                                  "Hugging Face id, or send the config.json contents as the value")
    if spec.lengths is not None and spec.lengths.lengths_file is not None:
        # a path in a request is one on the server: reading it would show its lines to the
        # caller (the error names a line that is no token count)
        raise SpecError("lengths.lengths_file", "the web API reads no files on the server; send the "
                                                "lengths as percentiles and max (p50, p90, p99, max)")
    return spec


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are all different: a key given twice (the last one would
    win unseen) is refused, as in a spec file (vramplan.files)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise SpecError("spec", f"the request body gives {key!r} twice; keep one")
        out[key] = value
    return out


def _estimate(spec, query) -> dict:
    from vramplan.estimation import estimate
    return estimate(spec).to_dict()


def _compare(spec, query) -> dict:
    from vramplan.plan.answers import compare_answer
    from vramplan.plan.compare import compare_to_dict
    rows, _ev = compare_answer(spec, headroom=query.get("headroom"), mfu=_number(query, "mfu", float))
    return compare_to_dict(rows)


def _fit(spec, query) -> dict:
    from vramplan.plan.answers import fit_answer
    report, _ev = fit_answer(spec, headroom=query.get("headroom"), mfu=_number(query, "mfu", float),
                             top_k=_number(query, "top_k", int) or 5)
    return report.to_dict()


def _number(query, name: str, kind):
    text = query.get(name)
    if text in (None, ""):
        return None
    try:
        value = kind(text)
    except ValueError:
        raise SpecError(name, f"expected a number, got {text!r}") from None
    if value <= 0:
        raise SpecError(name, f"expected a number > 0, got {text!r}")
    return value


def _models(body, query) -> list[dict]:
    from vramplan.listing import KINDS, model_rows
    kind = query.get("kind") or None
    if kind is not None and kind not in KINDS:
        raise SpecError("kind", f"expected one of {', '.join(KINDS)}; got {kind}")
    return model_rows(kind, query.get("name") or None)


def _gpus(body, query) -> list[dict]:
    from vramplan.listing import gpu_rows
    return gpu_rows()


def _choices(body, query) -> dict:
    """The words of each spec field the page offers as a list (the spec's own enums)."""
    from vramplan.spec import Checkpointing, Method, Optimizer, Precision, Task
    from vramplan.spec.sections import FSDP_MODES
    from vramplan.spec.stack import Framework
    return {"task": [m.value for m in Task], "method": [m.value for m in Method],
            "precision": [m.value for m in Precision], "stack": [m.value for m in Framework],
            "optimizer": [m.value for m in Optimizer],
            "gradient_checkpointing": [m.value for m in Checkpointing], "fsdp": list(FSDP_MODES)}


def _import(body: bytes, query) -> dict:
    """A dropped DeepSpeed JSON / TrainingArguments / accelerate config / recipe, read by the
    importer the CLI's flag of the same name runs: {"spec": overrides, "lines": what was
    used, ignored and left unresolved}. The body goes through a temporary file because the
    importers read files (a TrainingArguments file may name its DeepSpeed JSON beside it)."""
    from vramplan.importers.cli_args import import_config_files
    from vramplan.importers.report import ImportError_
    kind = query.get("kind", "")
    if kind not in IMPORT_KINDS:
        raise SpecError("kind", f"expected one of {', '.join(IMPORT_KINDS)}; got {kind or 'nothing'}")
    name = os.path.basename(query.get("name") or "config.json")
    suffix = ".json" if name.endswith(".json") else ".yaml"
    with tempfile.TemporaryDirectory(prefix="vramplan-web-") as folder:
        path = os.path.join(folder, "config" + suffix)  # the caller's name may be past the file system's limit
        with open(path, "wb") as fh:
            fh.write(body)
        try:
            overrides, lines = import_config_files(**{kind: path}, named_files=False)
        except USER_ERRORS as exc:  # the file named as the caller named it, not by its temporary path here
            error, here = as_spec_error(exc), lambda text: text.replace(path, name).replace(folder + os.sep, "")
            raise ImportError_(here(str(error)), here(error.field)) from None
    return {"spec": overrides, "lines": [tr(line).replace(path, name) for line in lines]}


ENDPOINTS = {"estimate": (_estimate, True), "compare": (_compare, True), "fit": (_fit, True),
             "import": (_import, False), "models": (_models, False), "gpus": (_gpus, False),
             "choices": (_choices, False)}
"""name -> (handler(spec or body, query), whether the body is a spec)."""
