"""Chinese beside English: catalogs complete and compiled, --lang / LANG, same numbers."""
from __future__ import annotations

import copy
import fnmatch
import gettext
import json
import pathlib
import pickle
import re
import string
import tomllib
from collections import Counter

import pytest

from vramplan import i18n
from vramplan.cli import main
from vramplan.i18n import Msg, language_for, language_from_env, normalize, set_language, tr

babel = pytest.importorskip("babel", reason="the i18n checks need Babel (the test extra)")
from vramplan.i18n import babel_tools  # noqa: E402

ROOT = pathlib.Path(__file__).parents[1]
CJK = re.compile(r"[\u4e00-\u9fff]")
NUMBER = re.compile(r"-?\d[\d,]*\.\d+%?")
"""Decimal figures (GiB, GB, shares, parameter counts): what must not change with the language."""


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # rich wraps at the terminal width; keep one line per row


# ------------------------------------------------------------------ catalogs
def _fields(text: str) -> Counter:
    return Counter(name for _, name, _, _ in string.Formatter().parse(text) if name is not None)


def _forms(text) -> tuple:
    """A message's forms: (singular, plural) for ngettext, else the one string."""
    return tuple(text) if isinstance(text, (tuple, list)) else (text,)


def test_every_extracted_message_has_a_zh_translation():
    extracted = [m.id for m in babel_tools.extract() if m.id]
    assert len(extracted) > 150  # the extractor really saw the marked messages
    assert any(isinstance(mid, tuple) for mid in extracted)  # ngettext's plural pairs too
    po = babel_tools.read_po("zh")
    missing = [mid for mid in extracted
               if mid not in po or not all(_forms(po[mid].string)) or po[mid].fuzzy
               or _forms(po[mid].id) != _forms(mid)]
    assert missing == [], f"untranslated: run `python -m vramplan.i18n.babel_tools update`, translate, compile: {missing}"


def test_translations_keep_every_placeholder():
    po = babel_tools.read_po("zh")
    bad = [m.id for m in po if m.id and any(_fields(_forms(m.id)[-1]) != _fields(form) for form in _forms(m.string))]
    assert bad == []


def test_committed_mo_holds_what_the_po_says():
    po = babel_tools.read_po("zh")
    mo_path = babel_tools.po_path("zh").with_suffix(".mo")
    with open(mo_path, "rb") as fh:
        mo = gettext.GNUTranslations(fh)
    entries = {m.id: m.string for m in po if m.id and all(_forms(m.string)) and not m.fuzzy}
    stale = {k: v for k, v in entries.items()
             if _forms(mo.ngettext(k[0], k[1], 2) if isinstance(k, tuple) else mo.gettext(k)) != _forms(v)}
    assert stale == {}, "vramplan.mo is stale: run `python -m vramplan.i18n.babel_tools compile`"
    assert len(mo._catalog) - 1 == len(entries)  # nothing extra in the .mo (one slot is the header)


def test_package_data_ships_the_catalogs():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vramplan"]
    pkg = ROOT / "src" / "vramplan"
    files = [p.relative_to(pkg).as_posix() for p in (pkg / "locale").rglob("*.[mp]o")]
    assert any(f.endswith(".mo") for f in files)
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)] == []


# ------------------------------------------------------------------ choosing the language
@pytest.mark.parametrize("value, lang", [("zh_CN.UTF-8", "zh"), ("zh_TW", "zh"), ("zh", "zh"), ("en_US.UTF-8", "en"),
                                         ("C", "en"), ("POSIX", "en"), ("de_DE.UTF-8", None), ("", None)])
def test_normalize(value, lang):
    assert normalize(value) == lang


def test_environment_order_is_lc_all_then_lc_messages_then_lang():
    assert language_from_env({"LANG": "zh_CN.UTF-8"}) == "zh"
    assert language_from_env({"LC_MESSAGES": "en_US.UTF-8", "LANG": "zh_CN.UTF-8"}) == "en"
    assert language_from_env({"LC_ALL": "zh_CN.UTF-8", "LC_MESSAGES": "en_US.UTF-8"}) == "zh"
    assert language_from_env({"LANG": "fr_FR.UTF-8"}) == "en"
    assert language_from_env({}) == "en"


def test_flag_wins_over_environment():
    env = {"LANG": "zh_CN.UTF-8"}
    assert language_for(["--lang", "en", "estimate", "gpt2"], env) == "en"
    assert language_for(["estimate", "gpt2", "--lang=zh"], {}) == "zh"
    assert language_for(["estimate", "--", "--lang", "zh"], {}) == "en"
    assert language_for(["--lang", "xx"], env) == "zh"  # argparse then refuses xx


# ------------------------------------------------------------------ the estimate answer
ESTIMATE = ("estimate", "qwen2.5-7b", "--gpu", "a100-80gb", "--micro-batch-size", "4", "--seq-len", "4096")
FITS = ("estimate", "qwen2.5-0.5b", "--gpu", "h100-80gb", "--method", "lora", "--seq-len", "512")


@pytest.mark.parametrize("argv, verdict_en, verdict_zh", [(ESTIMATE, "does not fit", "放不下"), (FITS, "fits", "放得下")])
def test_estimate_in_chinese_has_the_same_numbers(capsys, wide, argv, verdict_en, verdict_zh):
    code_en, en, _ = run(capsys, *argv)
    code_zh, zh, _ = run(capsys, "--lang", "zh", *argv)
    assert code_en == code_zh
    assert not CJK.search(en) and "term at the peak" in en and verdict_en in en
    for text in ("峰值时的显存项", "含义", "占比", "峰值分配", "激活值/各层", "优化器状态", "权重", verdict_zh, "各阶段峰值"):
        assert text in zh
    assert "term at the peak" not in zh and "peak allocated" not in zh
    assert Counter(NUMBER.findall(zh)) == Counter(NUMBER.findall(en))
    assert len(NUMBER.findall(en)) > 20


def test_lang_after_the_command_and_from_lang_variable(capsys, wide, monkeypatch):
    _, flag_after, _ = run(capsys, *FITS, "--lang", "zh")
    monkeypatch.setenv("LANG", "zh_CN.UTF-8")
    _, from_env, _ = run(capsys, *FITS)
    _, forced_en, _ = run(capsys, "--lang", "en", *FITS)
    assert "峰值时的显存项" in flag_after and flag_after == from_env
    assert not CJK.search(forced_en)
    monkeypatch.setenv("LC_ALL", "C")
    assert not CJK.search(run(capsys, *FITS)[1])


def test_json_stays_english_and_language_neutral(capsys):
    _, en, _ = run(capsys, *ESTIMATE, "--json")
    _, zh, _ = run(capsys, "--lang", "zh", *ESTIMATE, "--json")
    assert json.loads(en) == json.loads(zh) and not CJK.search(zh)


def test_help_in_chinese(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--lang", "zh", "estimate", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for text in ("用法：", "选项", "显示帮助信息并退出", "微批大小", "序列长度", "张量并行", "流水线并行"):
        assert text in out
    assert "rows per GPU per micro-step" not in out


# ------------------------------------------------------------------ errors and advice
ERRORS = [
    (["estimate", "nosuchmodel"], "未知模型", "'nosuchmodel'"),
    (["estimate", "qwen2.5-0.5b", "--gpu", "a100x"], "未知 GPU", "'a10g'"),
    (["estimate", "qwen2.5-0.5b", "--precision", "bf17"], "无法识别的取值", "'bf16'"),
    (["estimate", "qwen2.5-0.5b", "--micro-batch-size", "0"], "应为 >= 1 的整数", "micro_batch_size"),
    (["estimate", "qwen2.5-0.5b", "--seq-len", "abc"], "无效的 int 值", "'abc'"),
    (["estimate", "qwen2.5-0.5b", "--bogus"], "无法识别的参数", "--bogus"),
    (["nosuchcommand"], "无效的选项", "'nosuchcommand'"),
    (["fit", "qwen2.5-0.5b"], "规划需要指定 GPU", "--gpu"),
    (["compare", "qwen2.5-0.5b", "--gpu", "t4", "--headroom", "lots"], "应为 2GiB", "'lots'"),
    (["estimate"], "必填", "num_params"),
    (["fit", "qwen2.5-0.5b", "--gpu", "t4", "--vary", "nosuch"], "未知的搜索维度", "'nosuch'"),
    (["estimate", "qwen2.5-0.5b", "--num-gpus", "2", "--tp", "3"], "无法按 tp x pp x cp = 3 切分", "num_gpus"),
    (["estimate", "gpt2", "--seq-len", "256", "--task", "kto", "--packing"], "不支持序列打包", "packing"),
    (["estimate", "gpt2", "--seq-len", "256", "--momentum", "0.9"], "只有优化器 sgd 接受 momentum", "momentum"),
    (["estimate", "llama-3.2-1b", "--task", "diffusion"], "不是扩散管线", "'llama-3.2-1b'"),
    (["estimate", "qwen2.5-0.5b", "--zero-stage", "5"], "必须是 0、1、2 或 3", "parallel.zero_stage"),
    (["estimate", "qwen2.5-0.5b", "--lora-dropout", "2", "--method", "lora"], "之间的数", "[0, 0.999]"),
    (["estimate", "--spec", "/nonexistent/job.yaml"], "文件不存在", "/nonexistent/job.yaml"),
    (["estimate", "/nonexistent/config.json"], "文件或文件夹不存在", "/nonexistent/config.json"),
    (["estimate", "gpt2", "--seq-len", "2048"], "个可学习位置", "1,024"),
    (["estimate", "qwen2.5-0.5b", "--gpu", "24"], "需要单位", "24GiB"),
    (["estimate", "qwen2.5-0.5b", "--gpu", "h10"], "有歧义", "h100-80gb"),
    (["estimate", "qwen2.5-0.5b", "--tp", "2", "--num-gpus", "2", "--sp", "maybe"], "应为 true 或 false", "'maybe'"),
    (["estimate", "--num-params", "7x"], "应为 7e9、7B 或 125M", "'7x'"),
    (["estimate", "qwen2.5-0.5b", "--num-params", "7b"], "不能同时给出", "num_params"),
    (["estimate", "--num-params", "7b", "--num-layers", "9999"], "超过任何已发布的模型", "2,048"),
    (["estimate", "qwen2.5-0.5b", "--depth", "0"], "应为 >= 1 的整数", "depth"),
]


@pytest.mark.parametrize("argv, zh_text, value", ERRORS)
def test_common_errors_in_chinese(capsys, argv, zh_text, value):
    code_en, _, en = run(capsys, *argv)
    code_zh, _, zh = run(capsys, "--lang", "zh", *argv)
    assert code_en == code_zh == 2
    assert en.startswith("vramplan: error: ") and value in en and not CJK.search(en)
    assert zh.startswith("vramplan: 错误：") and zh_text in zh and value in zh
    assert len(zh.strip().splitlines()) == 1


def test_config_file_errors_translate_after_the_path(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 7}}))
    code, _, zh = run(capsys, "--lang", "zh", "estimate", "qwen2.5-0.5b", "--deepspeed", str(ds))
    assert code == 2 and zh.startswith("vramplan: 错误：" + str(ds) + ": zero_optimization.stage: ")
    assert "必须是 0、1、2 或 3" in zh and "7" in zh


def test_recipe_errors_translate_after_the_path_and_its_kind(capsys, tmp_path):
    recipe = tmp_path / "train.yaml"  # the path is followed by the recipe's kind: `(llama-factory)`
    recipe.write_text("model_name_or_path: qwen2.5-0.5b\nfinetuning_type: lorra\n")
    code, _, zh = run(capsys, "--lang", "zh", "estimate", "--recipe", str(recipe))
    line = zh.strip().splitlines()[-1]
    assert code == 2 and line.startswith("vramplan: 错误：" + str(recipe) + " (llama-factory): finetuning_type: ")
    assert "之一" in line and "'lorra'" in line and "'lora'" in line


def test_unmatched_error_stays_english():
    from vramplan.i18n.errors import localize
    set_language("zh")
    assert localize("something new went wrong: 42") == "something new went wrong: 42"


def test_check_advice_in_chinese_keeps_the_numbers():
    from vramplan.check import LocalGPU, check
    from vramplan.units import GiB
    gpus = [LocalGPU(0, "NVIDIA GeForce RTX 4090", int(23.99 * GiB), int(20.0 * GiB), "nvml")]
    result = check({"model": "qwen2.5-1.5b", "micro_batch_size": 4, "seq_len": 2048}, gpus=gpus, raise_error=False)
    english = result.message()
    assert not result.fits and result.suggestions and "does not fit. Try:" in english
    set_language("zh")
    chinese = tr(english)
    assert result.message() == english  # the core's text does not depend on the language
    assert "放不下" in chinese and "可以试试" in chinese and "梯度检查点" in chinese
    assert Counter(NUMBER.findall(chinese)) == Counter(NUMBER.findall(english))
    assert json.dumps(result.to_dict()["suggestions"]) == json.dumps([s.to_dict() for s in result.suggestions])
    assert not CJK.search(json.dumps(result.to_dict()))


def test_msg_is_its_english_text():
    m = Msg("{n} GPUs with ZeRO-3", n=8)
    assert m == "8 GPUs with ZeRO-3" and json.dumps({"d": m}) == '{"d": "8 GPUs with ZeRO-3"}'
    back = pickle.loads(pickle.dumps(m))
    assert back == m and back.template == m.template and back.params == {"n": 8}
    braces = Msg("{path}: file not found", path="/data/{run}.yaml")
    joined = Msg.join("; ", [m, braces])
    assert copy.deepcopy(braces) == braces and pickle.loads(pickle.dumps(joined)).joined == joined.joined
    set_language("zh")
    assert tr(m) == "8 张 GPU 并使用 ZeRO-3"
    assert tr(Msg.join("; ", [m, Msg("as given")])) == "8 张 GPU 并使用 ZeRO-3；按当前配置"


# ------------------------------------------------------------------ term labels
JOBS = [
    {"model": "qwen2.5-0.5b", "seq_len": 256},
    {"model": "qwen2.5-0.5b", "seq_len": 256, "method": "qlora"},
    {"model": "qwen2.5-0.5b", "seq_len": 256, "task": "dpo"},
    {"model": "qwen2.5-0.5b", "seq_len": 256, "task": "ppo", "max_new_tokens": 64},
    {"model": "qwen2.5-0.5b", "seq_len": 256, "task": "distill", "teacher": "qwen2.5-1.5b"},
    {"model": "qwen2.5-0.5b", "seq_len": 256, "num_gpus": 8, "parallel": {"zero_stage": 3}},
    {"model": "qwen2.5-0.5b", "seq_len": 256, "num_gpus": 4, "parallel": {"pp": 2}},
    {"model": "flan-t5-large", "seq_len": 256},
    {"model": "gpt2", "seq_len": 256, "optimizer": "adamw-8bit"},
]


@pytest.mark.parametrize("job", JOBS, ids=lambda j: f"{j['model']}-{j.get('task', j.get('method', 'sft'))}")
def test_every_term_group_and_phase_has_a_label(job):
    from vramplan import estimate, load_spec
    from vramplan.i18n.terms import PHASES, TERM_PARTS
    est = estimate(load_spec(job))
    groups = {key.split("/")[0] for key in est.components.groups(1)}
    assert [g for g in groups if g not in TERM_PARTS] == []
    assert [p for p in est.phases if p not in PHASES] == []


def test_chinese_readme_quotes_the_english_readme_figures():
    """README.zh.md restates the measured error and speed; every figure must be one README.md states."""
    en, zh = (ROOT / "README.md").read_text(), (ROOT / "README.zh.md").read_text()
    tail = zh[zh.index("## 实测误差"):zh.index("## 翻译")]
    figures = set(re.findall(r"\d[\d,.]*%?", tail)) - {"1", "2", "3"}
    assert len(figures) > 8
    assert sorted(f for f in figures if f not in en) == []
    assert "README.zh.md" in en


IDENTIFIER = re.compile(r"zero-\d|q?lora")
"""Strategy-name parts that are names of the thing itself and stay as they are."""


def test_every_built_in_strategy_and_tier_has_a_label():
    from vramplan import load_spec
    from vramplan.i18n.terms import _GPUS, STRATEGY_PARTS, TIERS, strategy_label, tier_label
    from vramplan.plan.compare import default_strategies
    from vramplan.plan.tiers import TIERS as PLAN_TIERS
    names = [s.name for s in default_strategies(load_spec({"model": "qwen2.5-0.5b", "seq_len": 512}))]
    parts = {p for n in names for chunk in n.split(", ") for p in chunk.split(" + ")}
    assert [p for p in parts if p not in STRATEGY_PARTS and not _GPUS.fullmatch(p) and not IDENTIFIER.fullmatch(p)] == []
    assert [label for label, _ in PLAN_TIERS if label not in TIERS] == []
    set_language("zh")
    assert strategy_label("zero-2 + cpu offload + checkpointing") == "zero-2 + CPU 卸载 + 梯度检查点"
    assert strategy_label("4 GPUs, zero-3 + checkpointing") == "4 张 GPU, zero-3 + 梯度检查点"
    assert strategy_label("my own idea") == "my own idea" and tier_label("under 24 GB") == "24 GB 以下"


@pytest.mark.parametrize("argv, zh_texts", [
    (("compare", "qwen2.5-0.5b", "--gpu", "t4", "--seq-len", "2048", "--micro-batch-size", "8"),
     ("各种策略", "策略", "基线", "梯度检查点", "放得下")),
    (("fit", "qwen2.5-0.5b", "--gpu", "t4", "--seq-len", "1024", "--top-k", "2"), ("配置", "理由", "放得下的配置中最快的")),
    (("check", "qwen2.5-1.5b", "--gpu", "t4", "--micro-batch-size", "8", "--seq-len", "2048"),
     ("放不下", "可以试试", "梯度检查点")),
])
def test_plan_answers_in_chinese_have_the_same_numbers(capsys, wide, monkeypatch, argv, zh_texts):
    import importlib
    monkeypatch.setattr(importlib.import_module("vramplan.check"), "local_gpus", lambda: [])  # check against the catalog T4, not this machine
    code_en, en, _ = run(capsys, *argv)
    code_zh, zh, _ = run(capsys, "--lang", "zh", *argv)
    assert code_en == code_zh and not CJK.search(en)
    for text in zh_texts:
        assert text in zh
    # fit's title holds the search's wall time, which differs between any two runs
    en, zh = (re.sub(r".*(settled with|种配置中已判定).*", "", t) for t in (en, zh))
    assert Counter(NUMBER.findall(zh)) == Counter(NUMBER.findall(en)) and NUMBER.findall(en)


def _parsers(parser):
    import argparse
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)
            for choice in action._choices_actions:
                yield choice


def test_every_help_text_of_every_command_is_chinese():
    """A flag or command added with English help and no translation fails here, by name.
    Choice lists ('none | full | selective') are the values themselves and stay as they are."""
    from vramplan.cli import build_parser
    from vramplan.i18n.argparse_text import ARGPARSE_TEXT  # translated as the help is printed
    set_language("zh")
    untranslated = []
    for p in _parsers(build_parser()):
        actions = getattr(p, "_actions", [p])
        for a in actions:
            text = a.help
            if text and text not in ARGPARSE_TEXT and " | " not in text and not CJK.search(text):
                untranslated.append(f"{getattr(p, 'prog', '')} {'/'.join(getattr(a, 'option_strings', []) or [a.dest])}: {text}")
    assert untranslated == []
