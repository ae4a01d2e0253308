"""`vramplan serve`: the web page and its JSON API on a local port (vramplan.web).

Binds 127.0.0.1 unless --host says otherwise; opens a browser only with --open. Needs the
`web` extra (Starlette, uvicorn): without it, one line says what to install (exit 2).
"""
from __future__ import annotations

import sys

from vramplan.i18n import _
from vramplan.i18n.errors import error_line


def register(sub) -> None:
    s = sub.add_parser("serve", help=_("serve the web page and its JSON API (the `web` extra)"))
    s.add_argument("--host", default="127.0.0.1", help=_("address to bind (default 127.0.0.1: this machine only)"))
    s.add_argument("--port", type=int, default=8000, help=_("port to listen on (default 8000)"))
    s.add_argument("--open", action="store_true", help=_("open the page in a web browser"))
    s.add_argument("--static-build", metavar="OUT",
                   help=_("write the page as static files to OUT instead (no server: the API runs in the "
                          "browser under Pyodide); needs --pyodide"))
    s.add_argument("--pyodide", metavar="DIR", help=_("the npm package pyodide's folder, for --static-build"))
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    if args.static_build or args.pyodide:
        return _static_build(args)
    if not 1 <= args.port <= 65535:  # else uvicorn's bind() fails with a traceback; 0 (a port the
        # system picks) printed "serving the page at http://127.0.0.1:0/", an address that answers nothing
        from vramplan.spec import SpecError
        raise SpecError("port", f"expected a port number from 1 to 65535, got {args.port}")
    try:
        import uvicorn

        from vramplan.web.app import create_app
    except ImportError as exc:
        print(error_line(f"{exc.name or exc} is not installed; pip install 'vramplan[web]'"), file=sys.stderr)
        return 2
    _check_bind(args.host, args.port)
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/"
    print(_("vramplan: serving the page at {url} (Ctrl+C stops)").format(url=url), file=sys.stderr)
    config = uvicorn.Config(create_app(), host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    if args.open:
        import threading
        import webbrowser
        threading.Timer(1.0, webbrowser.open, (url,)).start()
    server.run()
    return 0


def _check_bind(host: str, port: int) -> None:
    """Bind the address once before uvicorn does: its failure (an unknown host, a port in
    use or not ours to take) is a logged "ERROR: [Errno 98] ..." and exit status 3."""
    import socket

    from vramplan.spec import SpecError
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        raise SpecError("host", f"cannot resolve {host!r} ({getattr(exc, 'strerror', None) or exc}); "
                                "use an address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as exc:
        field = "host" if exc.errno == getattr(__import__("errno"), "EADDRNOTAVAIL", -1) else "port"
        raise SpecError(field, f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                               + ("use an address of this machine, e.g. 127.0.0.1" if field == "host"
                                  else "pick another port, e.g. --port 8080")) from None


def _static_build(args) -> int:
    from vramplan.spec import SpecError
    from vramplan.web.static_build import build
    if not (args.static_build and args.pyodide):
        raise SpecError("static_build", "--static-build OUT and --pyodide DIR go together")
    files = build(args.static_build, args.pyodide)
    print(_("vramplan: wrote {n} files to {out}; serve that folder with any static web server").format(
        n=len(files), out=args.static_build), file=sys.stderr)
    return 0
