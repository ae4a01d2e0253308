// The static build (`vramplan serve --static-build OUT --pyodide DIR`): no server, the JSON API
// answered inside the page by the same Python function the server calls
// (vramplan.web.api.answer_json), running under Pyodide from the files beside this page
// (pyodide/, vramplan.zip). Nothing is fetched from anywhere else.
"use strict";

(() => {
  let api = null;

  function python() {
    api = api || (async () => {
      const {loadPyodide} = await import(new URL("pyodide/pyodide.mjs", document.baseURI).href);
      const py = await loadPyodide({indexURL: new URL("pyodide/", document.baseURI).href});
      const zip = await (await fetch(new URL("vramplan.zip", document.baseURI))).arrayBuffer();
      py.unpackArchive(new Uint8Array(zip), "zip", {extractDir: "/home/pyodide/vramplan-lib"});
      py.runPython("import sys; sys.path.insert(0, '/home/pyodide/vramplan-lib')");
      return py.pyimport("vramplan.web.api");
    })();
    return api;
  }

  window.vramplanFetch = async (url, options) => {
    const target = new URL(url, document.baseURI);
    const match = target.pathname.match(/\/api\/(\w+)$/);
    if (!match) return fetch(url, options);
    const web = await python();
    const query = JSON.stringify(Object.fromEntries(target.searchParams));
    const body = options && typeof options.body === "string" ? options.body : "";
    const {status, payload} = JSON.parse(web.answer_json(match[1], query, body));
    return new Response(JSON.stringify(payload), {status, headers: {"Content-Type": "application/json"}});
  };
})();
