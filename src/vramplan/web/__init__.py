"""The web page (`vramplan serve`): a Starlette app serving one static page (static/: HTML,
JavaScript, CSS, the page's strings per language in static/i18n/, Chart.js 4.6.1 bundled
with its license) and the JSON API it calls, which answers what the CLI's `--json` prints.
Needs the `web` extra (Starlette, uvicorn); nothing here is imported by the estimator."""
