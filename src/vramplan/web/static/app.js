// The page: the job spec as one mapping (what `vramplan estimate --spec FILE` reads), edited by
// the inputs, carried whole in the URL's hash (#spec=<JSON>&lang=xx) so an answer can be
// shared, and sent to the JSON API (/api/estimate, /api/compare, /api/fit) whenever it changes.
// Every figure shown is read from the API's answer; nothing is computed here.
"use strict";

const GiB = 2 ** 30;
// No seq_len: left empty, the estimator's default applies (2048, capped at a model's
// learned positions, with a note); typed, it is the user's and checked as such. No
// micro_batch_size either: its default is 1, and TRL's 8 under GRPO (1 would be refused:
// TRL generates whole groups of 8 completions).
const DEFAULT_SPEC = {model: "llama-3.2-1b", gpu: "a100-80gb"};
const $ = (sel) => document.querySelector(sel);
const state = {spec: {}, lang: "en", strings: {}, answers: {}, generation: 0, controller: null, timer: null};

function t(key, fallback) {
  const s = state.strings[key];
  return s === undefined ? (fallback === undefined ? key : fallback) : s;
}
const fmt = (template, values) => template.replace(/\{(\w+)\}/g, (m, k) => (k in values ? values[k] : m));
const gib = (bytes) => (bytes === null || bytes === undefined ? "-" : (bytes / GiB).toFixed(2) + " GiB");

// ------------------------------------------------------------ the spec and the inputs
function getPath(obj, path) {
  return path.split(".").reduce((o, k) => (o && typeof o === "object" ? o[k] : undefined), obj);
}

function setPath(obj, path, value) {
  const keys = path.split(".");
  let o = obj;
  for (const k of keys.slice(0, -1)) {
    if (!o[k] || typeof o[k] !== "object") o[k] = {};
    o = o[k];
  }
  const last = keys[keys.length - 1];
  if (value === undefined) delete o[last]; else o[last] = value;
  if (keys.length > 1 && Object.keys(o).length === 0) delete obj[keys[0]];
}

function merge(into, from) {  // a config file's overrides, section by section
  for (const [k, v] of Object.entries(from)) {
    if (v && typeof v === "object" && !Array.isArray(v) && into[k] && typeof into[k] === "object") merge(into[k], v);
    else into[k] = v;
  }
  return into;
}

function readInput(el) {
  if (el.type === "checkbox") return el.checked ? true : undefined;
  const text = el.value.trim();
  if (text === "") return undefined;
  if (el.type === "number" || el.dataset.type === "int") return Number.parseInt(text, 10);
  return text;
}

function fillInputs() {
  for (const el of document.querySelectorAll("[data-key]")) {
    const value = getPath(state.spec, el.dataset.key);
    if (el.dataset.key === "model" && value && typeof value === "object") {
      el.value = fmt(t("inline_model"), {type: value.model_type || "?"});
      continue;
    }
    if (el.type === "checkbox") { el.checked = value === true; continue; }
    const text = value === undefined || value === null ? "" : String(value);
    if (el.tagName === "SELECT" && ![...el.options].some((o) => o.value === text)) el.add(new Option(text, text));
    el.value = text;
  }
}

function onInput(event) {
  const el = event.target;
  if (!el.dataset.key) return;
  setPath(state.spec, el.dataset.key, readInput(el));
  changed();
}

function changed() {
  writeHash();
  clearTimeout(state.timer);
  state.timer = setTimeout(run, 250);
}

// ------------------------------------------------------------ the URL
function writeHash() {
  const params = new URLSearchParams({spec: JSON.stringify(state.spec), lang: state.lang});
  history.replaceState(null, "", "#" + params.toString());
}

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  let spec = null;
  try { spec = JSON.parse(params.get("spec") || "null"); } catch (e) { spec = null; }
  state.spec = spec && typeof spec === "object" && !Array.isArray(spec) ? spec : {...DEFAULT_SPEC};
  return params.get("lang") === "zh" ? "zh" : "en";
}

// ------------------------------------------------------------ languages
async function setLanguage(lang) {
  state.strings = await getJSON(`static/i18n/${lang}.json`);
  state.lang = lang;
  document.documentElement.lang = lang === "zh" ? "zh-CN" : "en";
  for (const el of document.querySelectorAll("[data-i18n]")) el.textContent = t(el.dataset.i18n);
  for (const b of document.querySelectorAll("[data-lang]")) b.setAttribute("aria-pressed", String(b.dataset.lang === lang));
  document.title = t("title");
  fillInputs();
  writeHash();
  render();
}

// ------------------------------------------------------------ the API
// The static build (no server) sets window.vramplanFetch: the same API answered in the page
// by Python under Pyodide (static/pyodide-api.js).
async function getJSON(url, options) {
  const response = await (window.vramplanFetch || fetch)(url, options);
  const body = await response.json();
  if (!response.ok) throw Object.assign(new Error(body.error || response.statusText), {field: body.field});
  return body;
}

function post(path, signal) {
  return getJSON(`${path}?lang=${state.lang}`, {method: "POST", body: JSON.stringify(state.spec),
                                                 headers: {"Content-Type": "application/json"}, signal});
}

async function run() {
  const generation = ++state.generation;
  if (state.controller) state.controller.abort();
  const controller = state.controller = new AbortController();
  const sent = JSON.stringify(state.spec);
  document.body.dataset.state = "busy";
  state.answers = {};
  try {
    state.answers.estimate = await post("api/estimate", controller.signal);
    state.answers.sent = sent;
    state.answers.error = null;
  } catch (e) {
    if (generation !== state.generation) return;
    state.answers = {error: e.message, field: e.field, sent};
    render();
    document.body.dataset.state = "error";
    return;
  }
  render();
  document.body.dataset.state = "estimated";
  if (!state.spec.gpu) { document.body.dataset.state = "ready"; return; }
  for (const [key, path] of [["compare", "api/compare"], ["fit", "api/fit"]]) {
    try {
      state.answers[key] = await post(path, controller.signal);
    } catch (e) {
      if (generation !== state.generation) return;
      state.answers[key] = {error: e.message};
    }
    if (generation !== state.generation) return;
    render();
  }
  document.body.dataset.state = "ready";
}

// ------------------------------------------------------------ a dropped file
function guessKind(text) {
  if (/"(zero_optimization|train_micro_batch_size_per_gpu|train_batch_size)"/.test(text)) return "deepspeed";
  if (/"(model_type|architectures)"/.test(text)) return "config";
  if (/^\s*(distributed_type|compute_environment)\s*:/m.test(text)) return "accelerate_config";
  if (/_component_|^\s*(base_model|stage|model_name_or_path)\s*:/m.test(text)) return "recipe";
  return "training_args";
}

async function onFile(file) {
  const text = await file.text();
  const chosen = $("#import-kind").value;
  const kind = chosen === "auto" ? guessKind(text) : chosen;
  const lines = $("#import-lines");
  try {
    if (kind === "config") {
      const config = JSON.parse(text);
      state.spec.model = config;
      lines.textContent = fmt(t("read_config"), {name: file.name, type: config.model_type || "?"});
    } else {
      const url = `api/import?kind=${kind}&name=${encodeURIComponent(file.name)}&lang=${state.lang}`;
      const answer = await getJSON(url, {method: "POST", body: text});
      merge(state.spec, answer.spec);
      lines.textContent = answer.lines.join("\n");
    }
  } catch (e) {
    lines.textContent = e.message;
    return;
  }
  fillInputs();
  changed();
}

// ------------------------------------------------------------ start
async function start() {
  const lang = readHash();
  document.querySelector("#inputs").addEventListener("input", onInput);
  document.querySelector("#inputs").addEventListener("change", onInput);
  for (const b of document.querySelectorAll("[data-lang]")) b.addEventListener("click", () => setLanguage(b.dataset.lang));
  $("#share").addEventListener("click", share);
  $("#file").addEventListener("change", (e) => e.target.files[0] && onFile(e.target.files[0]));
  const drop = $("#drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    if (e.dataTransfer.files[0]) onFile(e.dataTransfer.files[0]);
  });
  window.addEventListener("hashchange", () => { setLanguage(readHash()).then(run); });
  const [choices, gpus, models] = await Promise.all([getJSON("api/choices"), getJSON("api/gpus"), getJSON("api/models")]);
  fillChoices(choices, gpus, models);
  await setLanguage(lang);
  run();
}

function fillChoices(choices, gpus, models) {
  for (const el of document.querySelectorAll("[data-choices]")) {
    el.add(new Option("", ""));
    for (const word of choices[el.dataset.choices]) el.add(new Option(word, word));
  }
  const gpu = $("#gpu");
  gpu.add(new Option("", ""));
  for (const g of gpus) gpu.add(new Option(`${g.name} (${g.memory_marketed})`, g.name));
  const list = $("#model-list");
  state.models = {};
  for (const m of models) {
    state.models[m.name] = m;
    list.append(new Option(`${m.kind} · ${(m.num_params / 1e9).toFixed(2)} B${m.hub_id ? " · " + m.hub_id : ""}`, m.name));
  }
}

async function share() {
  writeHash();
  try {
    await navigator.clipboard.writeText(location.href);
    $("#share-done").textContent = t("share_done");
  } catch (e) {
    $("#share-done").textContent = location.href;
  }
}

document.addEventListener("DOMContentLoaded", start);
