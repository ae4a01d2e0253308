// The answer on the page, from the API's JSON (state.answers): figures, verdict, charts,
// notes, the compare table with its savings, fit's best layouts and the forms to paste.
"use strict";

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function render() {
  const {estimate, error, field} = state.answers;
  const box = $("#error");
  box.hidden = !error;
  box.textContent = error || "";
  for (const node of document.querySelectorAll("[data-key]")) {  // the input the error names
    node.classList.toggle("invalid", Boolean(error) && node.dataset.key === field);
  }
  renderModelInfo();
  if (!estimate) {
    for (const id of ["#peak", "#reserved", "#device", "#verdict"]) { $(id).textContent = "-"; $(id).dataset.bytes = ""; }
    $("#peak").dataset.spec = "";
    $("#verdict").className = "";
    $("#verdict").dataset.verdict = "";
    $("#notes").replaceChildren();
    $("#peak-where").textContent = "";
    Charts.clear();
    table("#compare", [], []);
    table("#fit", [], []);
    $("#paste").replaceChildren();
    return;
  }
  renderFigures(estimate);
  showDefaults(estimate.spec);
  Charts.breakdown(estimate, t);
  Charts.timeline(estimate, t);
  Charts.levels(estimate, t);
  $("#notes").replaceChildren(...estimate.notes.map((n) => el("li", n)));
  renderCompare(state.answers.compare);
  renderFit(state.answers.fit);
}

// Fields the spec leaves out show the value the estimate took (the answer's resolved spec).
function showDefaults(resolved) {
  for (const node of document.querySelectorAll("[data-key]")) {
    if (node.dataset.key === "model" || node.type === "checkbox") continue;
    let value = getPath(resolved, node.dataset.key);
    if (value && typeof value === "object") value = value.framework;
    const text = value === undefined || value === null ? "" : String(value);
    if (node.tagName === "SELECT") node.options[0].textContent = text ? `(${text})` : "";
    else node.placeholder = text;
  }
}

function renderModelInfo() {
  const model = state.spec.model;
  const m = typeof model === "string" && state.models ? state.models[model] : null;
  $("#model-info").textContent = m ? fmt(t("model_info"), {kind: m.kind, type: m.type,
                                                             params: (m.num_params / 1e9).toFixed(2)}) : "";
}

function renderFigures(est) {
  const bounds = est.bounds || {};
  for (const [id, key, bytes] of [["#peak", "allocated", est.peak_allocated_bytes],
                                  ["#reserved", "reserved", est.reserved_bytes],
                                  ["#device", "device", est.device_bytes]]) {
    const range = bounds[key] ? ` (${(bounds[key][0] / GiB).toFixed(2)} - ${(bounds[key][1] / GiB).toFixed(2)})` : "";
    $(id).textContent = gib(bytes) + range;
    $(id).dataset.bytes = String(bytes);
  }
  $("#peak").dataset.spec = state.answers.sent;
  const verdict = $("#verdict");
  verdict.dataset.verdict = est.verdict || "";
  verdict.textContent = est.verdict ? t("verdict_" + est.verdict.replaceAll(" ", "_"), est.verdict) : t("verdict_none");
  verdict.className = est.verdict === "fits" ? "ok" : est.verdict ? "bad" : "";
  $("#peak-where").textContent = fmt(t("peak_where"), {phase: t("phase_" + est.peak_phase, est.peak_phase),
                                                       event: est.peak_event,
                                                       gpu: est.gpu ? est.gpu.name : "-",
                                                       capacity: est.gpu ? gib(est.gpu.memory_bytes) : "-"});
}

function table(sel, header, rows) {
  const node = $(sel);
  const head = el("tr");
  head.append(...header.map((h) => el("th", h)));
  node.tHead.replaceChildren(...(header.length ? [head] : []));
  node.tBodies[0].replaceChildren(...rows.map((cells) => {
    const tr = el("tr");
    tr.append(...cells.map((c) => el("td", c)));
    return tr;
  }));
}

const yesNo = (fits) => (fits === null || fits === undefined ? "-" : fits ? t("yes") : t("no"));

function renderCompare(answer) {
  const status = $("#compare-status");
  if (!answer) { status.textContent = state.spec.gpu ? t("working") : t("needs_gpu"); table("#compare", [], []); return; }
  if (answer.error) { status.textContent = answer.error; table("#compare", [], []); return; }
  status.textContent = "";
  const rows = answer.rows.map((r) => [
    r.name,
    r.estimate ? gib(r.estimate.device_bytes) : "-",
    r.estimate ? `${gib(r.saving_bytes)} (${(100 * r.saving_pct).toFixed(1)}%)` : "-",
    r.relative_step_time === null ? "-" : `x${r.relative_step_time.toFixed(2)}`,
    yesNo(r.fits),
    r.note,
  ]);
  table("#compare", [t("strategy"), t("level_device"), t("saving"), t("step_time_rel"), t("fits"), t("note")], rows);
}

function layout(changes) {
  return Object.entries(changes).map(([k, v]) => `${k.replace("parallel.", "")}=${v}`).join(" ");
}

function renderFit(answer) {
  const status = $("#fit-status");
  const paste = $("#paste");
  paste.replaceChildren();
  if (!answer || answer.error) {
    status.textContent = answer ? answer.error : state.spec.gpu ? t("working") : t("needs_gpu");
    table("#fit", [], []);
    return;
  }
  status.textContent = fmt(t("fit_searched"), {total: answer.candidates_total, estimates: answer.estimates_computed,
                                               seconds: answer.elapsed_s.toFixed(2), headroom: gib(answer.headroom_bytes)});
  const rows = answer.results.map((r, i) => [String(i + 1), layout(r.changes), gib(r.estimate.device_bytes),
                                             r.step_time_s == null ? "-" : r.step_time_s.toFixed(3)]);
  table("#fit", ["#", t("layout"), t("level_device"), t("step_time_s")], rows);
  if (!answer.results.length) {
    const lines = [t("fit_none")];
    if (answer.closest) lines.push(fmt(t("fit_closest"), {layout: layout(answer.closest.changes),
                                                          device: gib(answer.closest.estimate.device_bytes)}));
    for (const s of answer.suggestions) lines.push(s.description);
    paste.append(...lines.map((line) => el("p", line)));
    return;
  }
  const forms = answer.results[0].paste;
  for (const [key, value] of [["command", forms.command], ["deepspeed", forms.deepspeed],
                              ["training_args", forms.training_args]]) {
    if (value === null) continue;
    const text = typeof value === "string" ? value : JSON.stringify(value, null, 2);
    const copy = el("button", t("copy"), {type: "button"});
    copy.addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText(text));
    const head = el("h3", t("paste_" + key));
    head.append(" ", copy);
    paste.append(head, el("pre", text, {id: "paste-" + key}));
  }
}
