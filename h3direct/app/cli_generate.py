"""`h3direct generate`: prompt + references in, mp4 (H.264, 24 fps) with AAC stereo audio out.

With no model arguments at all, the bundled tiny random models are used (`h3direct.app.bundled`), with small
defaults (96×64, 22 frames, 4 steps) that run in seconds on a CPU. Each model argument that is left out falls back
to its bundled counterpart (so `--checkpoint tiny.safetensors` alone works for a tiny DiT). The size flags are
optional: their small defaults hold with --checkpoint too (a note on stderr says so); give --width/--height/--frames/
--steps for a full-size clip.

Task from the inputs: none -> t2va; --first-frame / --last-frame -> fl2va; --ref-images / --ref-videos /
--ref-audios -> ref2va (a reference video's soundtrack is used when the file has one).

This module is the command line's edge: its flags (made from the fields of `GenerateRequest`, `Options` and
`ModelSpec`), the `H3_*` environment (read once, `app/env.py`) and `--from-provenance` become those three objects,
each validated when built: every check runs, and every given file's header is read, before any model is built or
loaded. Then the models load once and `app.generate.clip` makes the clip. Stdout: one JSON line (unless --quiet);
progress bars on stderr when it is a terminal (or --progress); errors: one stderr line, exit 2. An existing --output
(or --save-latent) file is replaced, as it always was on the command line; --no-overwrite refuses it instead.

`--from-provenance clip.mp4` makes a clip again from the provenance in its `comment` tag: the request, every option
and the settings the models were loaded with; its reference files are found by name beside the clip or in the current
folder (and must have the recorded sha256), its weights must be the recorded ones. A flag given as well wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from h3direct.app.cli_flags import (
    FFMPEG_LOGLEVELS,
    HelpFormatter,
    add_fields,
    add_options,
    field_names,
    given,
    option_names,
)
from h3direct.errors import ConfigError, RequestError

MODEL_FILES = ("checkpoint", "vae", "audio_vae", "vae_config", "audio_vae_config", "text_encoder", "tokenizer")
MODEL_RUNTIME = ("compute_dtype", "nvfp4_mode", "device", "threads", "vae_dtype", "vae_tile_size",
                 "text_encoder_policy")
# old spellings, still accepted
ALIASES = {"ref_images": ("--ref-image",), "ref_videos": ("--ref-video",), "ref_audios": ("--ref-audio",)}
REQUEST_FLAGS = ("prompt", "prompt_file", "negative_prompt", "ref_images", "ref_videos", "ref_audios",
                 "ref_image_size", "first_frame", "last_frame", "text_embeds", "width", "height", "frames", "steps",
                 "seed", "sampler", "scheduler", "cfg", "save_latent")
CACHE_FLAGS = ("cache_mode", "cache_threshold", "cache_start_percent", "cache_end_percent", "cache_subsample_factor")
SIZE_NOTE = ("(the size flags are optional: they default to a small clip that takes seconds on a CPU with the bundled "
             "models; give all four for a real one, e.g. 1344 768 124 8)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from h3direct.app.limits import Limits
    from h3direct.app.models import ModelSpec
    from h3direct.app.request import GenerateRequest

    parser.formatter_class = HelpFormatter
    add_fields(parser.add_argument_group("models (each omitted one: the bundled tiny model)"), ModelSpec,
               MODEL_FILES, env=True)
    g = parser.add_argument_group(f"request {SIZE_NOTE}")
    add_fields(g, GenerateRequest, REQUEST_FLAGS, aliases=ALIASES)
    g.add_argument("--output", "-o", "--out", dest="output", default=None, metavar="FILE.mp4",
                   help="mp4 to write (--out is an old spelling) (default: clip.mp4)")
    g.add_argument("--overwrite", action=argparse.BooleanOptionalAction, default=True,
                   help="replace an existing --output / --save-latent file; --no-overwrite refuses one before anything "
                        "loads (the request field `overwrite`, off by default in the service)")
    g.add_argument("--from-provenance", metavar="CLIP.mp4", help="make this clip again from the provenance in its "
                   "comment tag (request, options, settings; flags given as well win)")
    g = parser.add_argument_group("runtime")
    add_fields(g, ModelSpec, MODEL_RUNTIME, env=True)
    g.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="Ulysses sequence parallelism of the DiT over N processes (default under torchrun: its "
                        "whole world): torchrun --nproc-per-node N -m h3direct generate ...; rank 0 writes")
    g = parser.add_argument_group("options (attention backend and its options, kernels; env H3_<NAME> read once at "
                                  "startup; a flag wins, over a tier's too)")
    g.add_argument("--tier", metavar="NAME", help="the options of a tier chosen on this machine (exact, sage_class, "
                   "fastest, ...: `python -m benchmarks.frontier` writes them); options given as flags win")
    g.add_argument("--tiers", metavar="FILE", help="the tiers file --tier reads (env H3_TIERS; default: "
                   "<cache>/tiers.json)")
    add_options(g)
    add_fields(parser.add_argument_group("step cache (opt-in, approximate)"), GenerateRequest, CACHE_FLAGS)
    add_fields(parser.add_argument_group("limits (requests beyond them are refused before any compute)"), Limits)
    g = parser.add_argument_group("output")
    add_fields(g, GenerateRequest, ("progress", "profile_memory"))
    g.add_argument("--ffmpeg-loglevel", choices=FFMPEG_LOGLEVELS, default="error", help="FFmpeg log level")
    g.add_argument("--quiet", "-q", action="store_true", help="print nothing on stdout and no progress (errors only)")


@dataclass
class Job:
    """What one `h3direct generate` runs: the request, its options, the models, and what to tell the user."""

    request: object  # GenerateRequest
    options: object  # Options
    spec: object  # ModelSpec
    notes: list
    weights: dict | None = None  # the weights a --from-provenance clip was made with


def parse(args: argparse.Namespace, *, env=None, output: bool = True) -> Job:
    """The command line (over the environment, over a clip's provenance) as a validated Job; nothing is loaded.
    `output` False: the request writes no mp4 (its caller decodes the latents itself)."""
    from h3direct.app import env as environment
    from h3direct.app.limits import Limits
    from h3direct.app.models import ModelSpec
    from h3direct.app.pipeline import check_text
    from h3direct.app.request import GenerateRequest
    from h3direct.dit.options import Options, check_in_effect

    base = _provenance(args) if args.from_provenance else None
    limits = Limits(**given(args, field_names(Limits)))
    spec = ModelSpec(**{**environment.read_settings(env), **(base["settings"] if base else {}),
                        **given(args, field_names(ModelSpec))})
    tier = _tier(args, spec, env)
    opts = Options.from_flat({**environment.read_options(env), **(base["options"] if base else {}),
                              **(tier["options"] if tier else {}), **given(args, option_names())})
    check_in_effect(opts, given(args, option_names()))  # a flag that this run's backend never reads: one line
    opts = dataclasses.replace(opts, tier=tier)
    fields = {**(base["request"] if base else {}), **given(args, REQUEST_FLAGS + CACHE_FLAGS),
              **given(args, ("progress", "profile_memory"))}
    if "prompt_file" in fields and base is not None and "prompt_file" in given(args, ("prompt_file",)):
        fields.pop("prompt", None)  # a prompt file given with --from-provenance replaces the recorded prompt
    fields["output"] = (args.output or "clip.mp4") if output else None
    fields["overwrite"] = getattr(args, "overwrite", True)  # the command line's own default: its user names the path
    if base is not None and output and Path(fields["output"]).resolve() == Path(args.from_provenance).resolve():
        raise RequestError("output", " is the clip being made again; give another --output")
    request = GenerateRequest(**fields, limits=limits)
    if request.resolved.text_embeds is not None:
        check_text(spec.dit_config(), request.resolved.text_embeds)  # from the header: before anything loads
    check_backend(opts, spec)
    return Job(request, opts, spec, _notes(request, spec), base["weights"] if base else None)


def _tier(args: argparse.Namespace, spec, env) -> dict | None:
    """--tier's provenance (its name, file and options: `app.tiers`), read for the device the models will use; None
    without --tier. A tiers file without --tier is one line."""
    from h3direct.app import env as environment
    from h3direct.app import tiers
    from h3direct.app.pipeline import resolve_device

    path = getattr(args, "tiers", None)
    if not getattr(args, "tier", None):
        if path:
            raise ConfigError("--tiers FILE: give --tier NAME too")
        return None
    tier, found = tiers.resolve(args.tier, path or environment.read_tiers(env), resolve_device(spec.device))
    return tier.provenance(found)


def check_backend(options, spec) -> None:
    """The attention backend (with its options) runs on the device, in the compute dtype, the models will use."""
    import torch

    from h3direct.app.pipeline import resolve_device
    from h3direct.dit import attention
    from h3direct.dit.loader import parse_compute_dtype

    device = resolve_device(spec.device)
    dtype = parse_compute_dtype(spec.compute_dtype_on(device))
    attention.check_backend(options.attention, torch.empty(0, device=device, dtype=dtype))


def _notes(request, spec) -> list[str]:
    from h3direct.sampling.rules import align_frame_count

    notes = []
    missing = request.resolved.defaulted
    if missing and spec.checkpoint is not None:
        notes.append(f"no --{'/--'.join(missing)}: using {request.width}x{request.height}, {request.frames} frames, "
                     f"{request.steps} steps (small defaults; full size is usually 1344x768, 124 frames, 8 steps)")
    snapped = align_frame_count(request.frames)
    if snapped != request.frames:
        notes.append(f"--frames {request.frames} snapped up to {snapped} (the model's 17k+5 frame grid)")
    return notes


def _provenance(args: argparse.Namespace) -> dict:
    """{"request", "options", "settings", "weights"} from a clip's provenance; its files found again by name."""
    from h3direct.app import provenance
    from h3direct.app.paths import check_input

    path = Path(args.from_provenance)
    check_input(path, "from_provenance")
    prov = provenance.read_mp4(path)
    request = {k: prov[k] for k in provenance.REQUEST_FIELDS if k in prov}
    files: dict[str, list[str]] = {}
    for ref in prov.get("references", []):
        if getattr(args, ref["field"], None) is None:  # a flag given for the field wins
            files.setdefault(ref["field"], []).append(_find(ref, path))
    for name, found in files.items():
        request[name] = found if name.startswith("ref_") else found[0]
    settings = {k: v for k, v in prov.get("settings", {}).items() if k != "nvfp4_mode" or v is not None}
    return {"request": request, "options": prov["options"], "settings": settings, "weights": prov.get("weights")}


def _find(ref: dict, clip: Path) -> str:
    """A recorded reference file, beside the clip or in the current folder, with the recorded sha256; a file of that
    name with another sha256 is named in the error."""
    from h3direct.app.provenance import sha256_file

    made_with = f": the clip was made with {ref['name']!r} (sha256 {ref['sha256'][:12]}...)"
    flag = "--" + ref["field"].replace("_", "-")
    other = None  # (path, sha256) of the first file of that name whose bytes are not the recorded ones
    for folder in (clip.parent, Path.cwd()):
        p = folder / ref["name"]
        if not p.is_file():
            continue
        sha = sha256_file(p)
        if sha == ref["sha256"]:
            return str(p)
        other = other or (p, sha)
    if other is not None:
        path, sha = other
        raise RequestError(ref["field"], f"{made_with}, found at {path} but its sha256 differs ({sha[:12]}...); put "
                           f"the recorded file there, or pass a file with {flag} (the clip will differ)", path=clip)
    raise RequestError(ref["field"], f"{made_with}, found neither beside {clip.name} nor here; pass it with {flag}",
                       path=clip)


def check_weights(recorded: dict | None, pipe) -> None:
    """--from-provenance: the loaded weights are the ones the clip was made with."""
    from h3direct.app import provenance

    if not recorded:
        return
    loaded = provenance.weights(pipe.files)
    flags = {"dit": "checkpoint", "video_vae": "vae", "audio_vae": "audio_vae", "text_encoder": "text_encoder"}
    for component, want in recorded.items():
        got = loaded.get(component)
        if got is not None and got["sha256"] != want["sha256"]:
            raise RequestError(flags[component], f": the clip was made with {want['file']!r} (sha256 "
                               f"{want['sha256'][:12]}...), not {got['file']!r} ({got['sha256'][:12]}...); give "
                               "the weights it was made with")


def run(args: argparse.Namespace) -> int:
    """Parse and check everything, load the models once, make the clip (`app.generate.clip`), print the summary."""
    import json
    import time

    import torch

    from h3direct.app.generate import clip, summary_of
    from h3direct.app.models import load_pipeline
    from h3direct.app.progress import Progress
    from h3direct.dit import parallel

    t_start = time.perf_counter()
    job = parse(args)  # every check before any model is built or loaded
    if not args.quiet:
        for n in job.notes:
            print(f"h3direct generate: note: {n}", file=sys.stderr, flush=True)
    threads = torch.get_num_threads()
    sp = parallel.init_from_env(args.sequence_parallel, job.spec.device)  # under torchrun: join its process group
    try:
        spec = job.spec if sp is None else dataclasses.replace(job.spec, device=str(sp.device))
        pipe, sources, seconds, load_mem = load_pipeline(spec, job.options.kernels,
                                                         text_encoder=job.request.text_embeds is None)
        check_weights(job.weights, pipe)
        progress = Progress(job.request.steps, job.request.progress or (not args.quiet and sys.stderr.isatty()))
        try:
            res, out, write_s = clip(pipe, job.request, job.options, callback=progress.step,
                                     on_stage=progress.stage, ffmpeg_loglevel=args.ffmpeg_loglevel)
        finally:
            progress.close()
        timings = {**seconds, **res.timings, "write": round(write_s, 4),
                   "total": round(time.perf_counter() - t_start, 4)}
        summary = summary_of(job.request, pipe.effective(job.options), res, out, pipe, sources, timings, load_mem)
        if sp is not None:
            summary.update(parallel.manifest_fields())
        if not args.quiet and parallel.is_writer():
            print(json.dumps(summary, separators=(",", ":")), flush=True)
        return 0
    finally:
        parallel.shutdown()
        torch.set_num_threads(threads)  # leave the process as found (the CLI may run in-process, e.g. in tests)
