"""`h3direct serve`: the command line's edge of the service (`app/serve/`).

    h3direct serve [--host 127.0.0.1] [--port 8188] [--output-root output] [--input-root DIR] [--queue-size 8]
                   [--job-timeout 600] [--auth-token-file F | --insecure] [--max-steps 100 ...]
                   [model flags and options of `h3direct generate`]

Its flags (made from `ServerSettings`, `Limits`, `ModelSpec` and `Options` fields) and the `H3_*` environment (read
once here) become those objects, each validated when built: the server's own settings, every model file's header
and the options are checked before the socket is bound or any model loads. The options are the defaults of every
request; a request may set those that need no reload (its fields; GET /ready lists them), not those fixed when the
weights load (`--fp8-linear`, `--nvfp4-dequant`, `--fp8-strict`).
"""

from __future__ import annotations

import argparse

from h3direct.app.cli_flags import HelpFormatter, add_fields, add_options, field_names, given, option_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from h3direct.app.limits import Limits
    from h3direct.app.models import ModelSpec
    from h3direct.app.serve.service import ServerSettings

    parser.formatter_class = HelpFormatter
    g = parser.add_argument_group("server")
    add_fields(g, ServerSettings, aliases={"output_root": ("--output-dir",)})
    g.add_argument("--no-queue", action="store_true", help="same as --queue-size 0")
    add_fields(parser.add_argument_group("limits (requests beyond them are refused before any compute)"), Limits)
    add_fields(parser.add_argument_group("models (as `h3direct generate`; each omitted model: bundled tiny)"),
               ModelSpec, env=True)
    g = parser.add_argument_group("options: every request's defaults (a request may set those that need no reload; "
                                  "env H3_<NAME> read once at startup; a flag wins)")
    g.add_argument("--tiers", metavar="FILE", help="the tiers file a request's `tier` reads, checked at startup (env "
                   "H3_TIERS; default: <cache>/tiers.json where it exists and was chosen on this device)")
    add_options(g)


def run(args: argparse.Namespace) -> int:
    from h3direct.app.serve import server

    return server.run(service_of(args))


def service_of(args: argparse.Namespace, *, env=None):
    """The Service the flags (over the environment) describe; every check, no model loaded, no socket bound."""
    from h3direct.app import env as environment
    from h3direct.app.limits import Limits
    from h3direct.app.models import ModelSpec
    from h3direct.app.serve.service import ServerSettings, Service
    from h3direct.dit.options import Options

    server = given(args, field_names(ServerSettings))
    if args.no_queue:
        server["queue_size"] = 0
    settings = ServerSettings(**server)
    limits = Limits(**given(args, field_names(Limits)))
    spec = ModelSpec(**{**environment.read_settings(env), **given(args, field_names(ModelSpec))})
    options = Options.from_flat({**environment.read_options(env), **given(args, option_names())})
    tiers, note = tiers_of(getattr(args, "tiers", None) or environment.read_tiers(env), spec)
    return Service(settings, spec, options, limits, tiers=tiers, tiers_note=note)


def tiers_of(path, spec):
    """(the tiers a request may name, a note on why there are none): a file given (--tiers, H3_TIERS) is read and
    checked for this device now (a problem stops the start, one line); the default one only where it exists, and
    set aside with its reason when it cannot serve here."""
    from h3direct.app import tiers
    from h3direct.app.pipeline import resolve_device
    from h3direct.errors import H3Error

    given = path is not None
    path = path if given else tiers.default_path()
    if not given and not path.is_file():
        return None, f"no tiers file ({path}): {tiers.MAKE_IT}"
    try:
        found = tiers.load_for(path, resolve_device(spec.device))
    except H3Error as exc:
        if given:
            raise
        return None, str(exc)
    return found, None
