"""The HTTP request schema, made from `GenerateRequest`'s fields and the per-request options (`dit.options`), field
for field under the same names: types are checked here (422 with the field), every value rule by the request and
the options themselves when they are built (`service.Service.admit`). A file field takes a name under the server's
--input-root or an upload sent with the request, {"filename": "cat.png", "base64": "..."}.
"""

from __future__ import annotations

import dataclasses
import functools
import json

from h3direct.app.jobs import one_line


@functools.cache
def request_model():
    """The pydantic model of a request body (and of the OpenAPI schema)."""
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model

    from h3direct.app.request import GenerateRequest
    from h3direct.dit.options import BACKENDS, flat_options
    from h3direct.fields import kind_of, spec_of

    class Upload(BaseModel):
        """A file sent with the request (instead of a name under the server's --input-root)."""

        model_config = ConfigDict(extra="forbid", strict=True)
        filename: StrictStr = Field("upload", max_length=255, description="its name (extension kept)")
        base64: StrictStr = Field(description="the file's bytes, base64-encoded")

    file = StrictStr | Upload
    types = {bool: StrictBool, int: StrictInt, float: float | StrictInt, str: StrictStr, "file": file,
             "files": list[file]}

    def one(kind, default, spec):
        typ = types[kind]
        extra = {"enum": list(spec.choices)} if spec.choices else None
        if kind == "files":
            return typ, Field(default_factory=list, description=spec.help)
        return (typ | None if default is None else typ), Field(default, description=spec.help,
                                                               json_schema_extra=extra)

    fields = {}
    for f in dataclasses.fields(GenerateRequest):
        spec = spec_of(f)
        if spec is not None:
            fields[f.name] = one(kind_of(f.default, spec), f.default, spec)
    for o in flat_options():
        if o.spec.per_request:
            spec = dataclasses.replace(o.spec, choices=BACKENDS) if o.flat == "attention" else o.spec
            fields[o.flat] = one(o.kind, o.default, spec)
    fields["tier"] = (StrictStr | None, Field(None, description="the options of a tier of the server's tiers file "
                                              "(GET /ready lists them); options given in the request win"))
    config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model = create_model("GenerateRequest", __config__=config, **fields)
    model.__doc__ = ("One generation: the fields of `h3direct generate` and the per-request options; omitted ones "
                     "take its defaults (the options: the server's). File fields are names relative to the server's "
                     "--input-root (or uploads); `output` is relative to its --output-root.")
    return model


def request_fields() -> set[str]:
    """The request's own fields (the rest of a body are options)."""
    from h3direct.app.request import GenerateRequest
    from h3direct.fields import spec_of

    return {f.name for f in dataclasses.fields(GenerateRequest) if spec_of(f) is not None}


def validation_message(errors) -> tuple[int, str]:
    """FastAPI's validation errors as (status, one line): 400 for a body that is not JSON, else 422 naming the
    field and, for a bad type, the value given."""
    e = errors[0]
    if e.get("type") == "json_invalid":
        return 400, f"the body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})"
    loc = list(e.get("loc", ()))
    loc = loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc
    # the field, and an index into a list field; not the union member names pydantic appends (cfg.float)
    where = "".join([str(loc[0])] + [f"[{x}]" for x in loc[1:2] if isinstance(x, int)]) if loc else "body"
    msg = e.get("msg", "invalid")
    if e.get("type") == "extra_forbidden":
        import difflib

        near = difflib.get_close_matches(str(loc[-1]) if loc else "", list(request_model().model_fields), n=1)
        return 422, f"unknown field {where!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
    if e.get("type") == "model_attributes_type" or where == "body":
        return 422, f"the body must be a JSON object of request fields: {msg}"
    given = e.get("input")
    shown = "" if isinstance(given, dict) else f", got {one_line(json.dumps(given, default=str), 60)}"
    return 422, f"field {where!r}: {msg}{shown}"
