// The page's three charts, drawn by Chart.js (bundled: chart.umd.min.js, v4.6.1) from the
// estimate's JSON (what `vramplan estimate --json` prints): the breakdown at the peak by term
// (and by model role for multi-model jobs), live memory over the step's events (`timeline`),
// and allocated / reserved / nvidia-smi with their bounds against the card.
"use strict";

const Charts = (() => {
  const GiB = 2 ** 30;
  const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
                   "#ff9da7", "#9c755f", "#bab0ac"];
  const drawn = {};

  function draw(id, config) {
    if (drawn[id]) drawn[id].destroy();
    config.options = Object.assign({animation: false, responsive: true, maintainAspectRatio: false},
                                   config.options || {});
    drawn[id] = new Chart(document.getElementById(id), config);
  }

  function clear() {
    for (const id of Object.keys(drawn)) { drawn[id].destroy(); delete drawn[id]; }
  }

  const gibAxis = (t, extra) => Object.assign({beginAtZero: true, title: {display: true, text: "GiB"}}, extra || {});
  const inGiB = (bytes) => bytes / GiB;
  const tip = {callbacks: {label: (c) => `${c.dataset.label}: ${Number(c.raw).toFixed(2)} GiB`}};

  // Terms alive at the peak, summed by their first key part; a multi-model job's roles
  // (the keys of model.per_model) are bars of their own, split by their second part.
  function breakdown(est, t) {
    const roles = Object.keys((est.model && est.model.per_model) || {});
    const bars = [], sums = {};
    for (const [key, bytes] of Object.entries(est.components)) {
      const parts = key.split("/");
      const role = roles.includes(parts[0]) ? parts[0] : null;
      const bar = role ? t("role_" + role, role) : (roles.length ? t("shared") : t("at_peak"));
      const term = role ? (parts[1] || parts[0]) : parts[0];
      if (!bars.includes(bar)) bars.push(bar);
      sums[term] = sums[term] || {};
      sums[term][bar] = (sums[term][bar] || 0) + bytes;
    }
    const datasets = Object.keys(sums).map((term, i) => ({
      label: t("term_" + term, term), backgroundColor: PALETTE[i % PALETTE.length],
      data: bars.map((b) => inGiB(sums[term][b] || 0)),
    }));
    draw("chart-breakdown", {type: "bar", data: {labels: bars, datasets},
      options: {plugins: {tooltip: tip}, scales: {x: {stacked: true}, y: gibAxis(t, {stacked: true})}}});
  }

  // Live bytes at each event of the step, in order (the estimate's `timeline`; its `phases`
  // when there is none), with the card's memory as a line.
  function timeline(est, t) {
    const events = est.timeline && est.timeline.length ? est.timeline
      : Object.entries(est.phases).map(([phase, bytes]) => ({phase, label: phase, bytes}));
    const labels = events.map((e) => e.label);
    const datasets = [{label: t("live_memory"), data: events.map((e) => inGiB(e.bytes)), borderColor: PALETTE[0],
                       backgroundColor: PALETTE[0], pointRadius: 3, tension: 0}];
    // the card's line only where it is near enough to read the step's shape beside it
    // (the levels chart always shows it)
    if (est.gpu && est.gpu.memory_bytes < 2 * Math.max(...events.map((e) => e.bytes))) {
      datasets.push({label: t("gpu_memory"), data: events.map(() => inGiB(est.gpu.memory_bytes)),
                     borderColor: "#c00", borderDash: [6, 4], pointRadius: 0});
    }
    draw("chart-timeline", {type: "line", data: {labels, datasets},
      options: {plugins: {tooltip: tip}, scales: {x: {ticks: {autoSkip: true, maxRotation: 60}}, y: gibAxis(t)}}});
  }

  // The three device levels with the interval their measured error spans (est.bounds), as
  // floating bars beside each figure, and the card's memory as a dashed line.
  function levels(est, t) {
    const keys = [["allocated", est.peak_allocated_bytes], ["reserved", est.reserved_bytes],
                  ["device", est.device_bytes]];
    const labels = keys.map(([k]) => t("level_" + k));
    const datasets = [{label: t("estimate"), data: keys.map(([, b]) => inGiB(b)), backgroundColor: PALETTE[0]}];
    if (est.bounds) {
      datasets.push({label: t("bounds"), backgroundColor: "rgba(242, 142, 43, 0.45)",
                     data: keys.map(([k]) => est.bounds[k].map(inGiB))});
    }
    if (est.gpu) {
      datasets.push({type: "line", label: t("gpu_memory"), data: keys.map(() => inGiB(est.gpu.memory_bytes)),
                     borderColor: "#c00", borderDash: [6, 4], pointRadius: 0});
    }
    const label = (c) => Array.isArray(c.raw) ? `${c.dataset.label}: ${c.raw[0].toFixed(2)} - ${c.raw[1].toFixed(2)} GiB`
      : `${c.dataset.label}: ${Number(c.raw).toFixed(2)} GiB`;
    draw("chart-levels", {type: "bar", data: {labels, datasets},
      options: {plugins: {tooltip: {callbacks: {label}}}, scales: {y: gibAxis(t)}}});
  }

  return {breakdown, timeline, levels, clear};
})();
