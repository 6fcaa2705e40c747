"""The service without HTTP: its settings, the resident models, requests checked at the door, and the jobs.

A request body (already type-checked by the schema) becomes a `GenerateRequest` (its files resolved under
--input-root or written from the uploads into a private folder, its output under --output-root) and the server's
`Options` with the request's per-request options over them; both validate themselves, and the attention backend
must be able to run on the resident models. Only then is a job queued. Each job runs `app.generate.clip` with its
own request and options (nothing of the pipeline changes per request), and its summary counts its own calls.

Outputs are never replaced unasked: a request whose `output` or `save_latent` exists is refused unless it sets
`overwrite` (checked when the request is built, and again as its job is queued), and a file that a queued or running
job will write is that job's until it is over (a second request naming it is refused, overwrite or not): 409.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from h3direct.app.cli_flags import FFMPEG_LOGLEVELS
from h3direct.app.jobs import Job, JobQueue
from h3direct.counts import CallCounts
from h3direct.errors import RequestError
from h3direct.fields import check, field

DEFAULT_PORT = 8188
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def _port_ok(v: int) -> bool:
    return 0 <= v <= 65535


@dataclass(frozen=True)
class ServerSettings:
    host: str = field("127.0.0.1", "address to bind (127.0.0.1: this machine only; any other needs "
                      "--auth-token-file, or --insecure)")
    port: int = field(DEFAULT_PORT, "TCP port (0 = any free)", rule=_port_ok, expect="a port number (0..65535; 0 = "
                      "any free port)")
    output_root: str = field("output", "the folder every mp4 is written under (--output-dir is an old spelling)")
    input_root: str | None = field(None, "the folder requests may read reference and text-embedding files from "
                                   "(relative names); none: requests name no files", kind=str)
    queue_size: int = field(8, "jobs that may wait behind the running one; more get 429 + Retry-After",
                            rule=lambda v: v >= 0, expect=">= 0")
    job_timeout: float = field(600.0, "a job running longer is stopped at its next step (504)",
                               rule=lambda v: v > 0, expect="> 0 seconds")
    max_body_mb: int = field(16, "largest request body (uploads included); larger ones get 413",
                             rule=lambda v: v >= 1, expect=">= 1")
    auth_token_file: str | None = field(None, "a file holding the bearer token every route but /health needs "
                                        "(Authorization: Bearer <token>)", kind=str)
    insecure: bool = field(False, "serve beyond this machine without a token (anyone who reaches the port may "
                           "generate and read the outputs)")
    ffmpeg_loglevel: str = field("error", "FFmpeg log level", choices=FFMPEG_LOGLEVELS)
    quiet: bool = field(False, "no access log on stderr")

    def __post_init__(self):
        check(self)
        from h3direct.app.paths import check_output_dir

        if self.input_root is not None and not Path(self.input_root).is_dir():
            raise RequestError("input_root", ": folder not found", path=self.input_root)
        check_output_dir(self.output_root, "output_root")  # the folder, or where it will be made
        token = self.token()
        if token is None and not self.insecure and not is_loopback(self.host):
            raise RequestError("host", f" {self.host!r} reaches beyond this machine: give --auth-token-file FILE "
                               "(every route but /health then needs Authorization: Bearer <token>), or --insecure")

    def token(self) -> str | None:
        """The bearer token (read from --auth-token-file; None without one)."""
        if self.auth_token_file is None:
            return None
        from h3direct.app.paths import check_input

        p = check_input(self.auth_token_file, "auth_token_file")
        token = p.read_text(errors="replace").strip()
        if not token or len(token) < 16 or any(c.isspace() for c in token):
            raise RequestError("auth_token_file", ": the token must be one word of at least 16 characters",
                               path=p)
        return token


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class NotReady(Exception):
    def __init__(self, status: str):
        super().__init__(f"the server is {status}")
        self.status = status


@dataclass
class Work:
    """What a queued job runs: its request and options, and the folder its uploads were written to."""

    request: object
    options: object
    uploads: Path | None
    job_id: str | None = None  # once queued


TIER_FIGURES = ("s_per_step", "x_comfyui_sage", "error_x_comfyui_sage", "error_x_comfyui_bf16", "margin")


class Service:
    def __init__(self, settings: ServerSettings, spec, options, limits, *, tiers=None, tiers_note: str | None = None):
        self.settings, self.spec, self.options, self.limits = settings, spec, options, limits
        self.tiers, self.tiers_note = tiers, tiers_note  # `app.tiers.Tiers` a request's `tier` names, or why none
        self.output_root = Path(settings.output_root).resolve()
        self.input_root = Path(settings.input_root).resolve() if settings.input_root else None
        self.token = settings.token()
        self.state = "loading"
        self.error: str | None = None
        self.pipe = None
        self.sources: dict = {}
        self.load_seconds: dict = {}
        self.load_memory = 0
        self.weight_loads = 0
        self.weights: dict = {}  # component -> {"file", "sha256"}
        self.calls = CallCounts()  # every finished job's counted calls, summed
        self.queue = JobQueue(self._run_job, size=settings.queue_size, timeout_s=settings.job_timeout,
                              on_finish=self._forget)
        self.max_body_bytes = settings.max_body_mb << 20
        self._uploads: Path | None = None  # a private temporary folder, made on the first upload
        self._lock = threading.Lock()
        self._counter = 0
        # the files the queued and running jobs will write -> their Work; its own lock, never held while the queue's
        # is taken (the queue releases a finished job's files under its lock, `_forget`)
        self._writing: dict[Path, Work] = {}
        self._writing_lock = threading.Lock()

    # ---- startup ----
    def prepare(self) -> None:
        """Make the output folder (the settings were checked when built)."""
        try:
            self.output_root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RequestError("output_root", f": cannot create it ({e.strerror})", path=self.output_root) from None

    def load(self) -> None:
        from h3direct.app import provenance
        from h3direct.app.models import load_pipeline

        pipe, sources, seconds, load_memory = load_pipeline(self.spec, self.options.kernels)
        self.options = pipe.check_options(self.options)  # the server's default backend runs here
        self.weight_loads += 1
        t = time.perf_counter()
        self.weights = provenance.weights(pipe.files)  # hashed once here (and remembered on disk), not per request
        seconds["sha256"] = round(time.perf_counter() - t, 4)
        t = time.perf_counter()
        pipe.footprint()  # the weights held, from the files' headers (once; GET /ready shows them)
        seconds["footprint"] = round(time.perf_counter() - t, 4)
        self.pipe, self.sources, self.load_seconds, self.load_memory = pipe, sources, seconds, load_memory
        with self._lock:
            if self.state != "loading":  # a signal came while loading: stay stopping, run nothing
                return
            self.state = "ready"
        self.queue.start()

    def stop(self) -> None:
        with self._lock:
            if self.state != "failed":
                self.state = "stopping"
        self.queue.stop()

    def close(self) -> None:
        """After the worker has stopped: remove the uploads folder."""
        import shutil

        if self._uploads is not None:
            shutil.rmtree(self._uploads, ignore_errors=True)

    # ---- a request at the door ----
    def admit(self, body: dict) -> Job:
        """Check a request completely (types were checked by the schema), then queue it. Raises RequestError (400
        or 422), NotReady (503), Full (429) or Stopping (503)."""
        if self.state != "ready":
            raise NotReady(self.state)
        work = Work(None, None, None)
        try:
            work.request, work.options = self.build(body, work)
            self._claim_outputs(work)
            try:
                job = self.queue.submit(work, work.request.resolved.output, work.request.steps)
            except BaseException:
                self._release_outputs(work)
                raise
            work.job_id = job.id
            return job
        except BaseException:
            self._remove_uploads(work)
            raise

    def _claim_outputs(self, work: Work) -> None:
        """The request's output files become this work's, or a 'conflict' RequestError: a queued or running job
        will write one, or one has appeared since the request was built (and it does not ask to overwrite)."""
        req = work.request
        files = {name: getattr(req.resolved, name) for name in ("output", "save_latent")}
        with self._writing_lock:
            for name, path in files.items():
                owner = self._writing.get(path)
                if path is not None and owner is not None:
                    job = f"job {owner.job_id}" if owner.job_id else "another request being queued"
                    raise RequestError(name, f" {getattr(req, name)!r} will be written by {job}, which is not over "
                                       "yet; choose another name, or wait for it", kind="conflict")
            req.check_outputs_free()
            for path in files.values():
                if path is not None:
                    self._writing[path] = work

    def _release_outputs(self, work) -> None:
        with self._writing_lock:
            for path in [p for p, w in self._writing.items() if w is work]:
                del self._writing[path]

    def build(self, body: dict, work: Work | None = None):
        """(GenerateRequest, Options) of a request body; uploads are written under `work.uploads` (the caller
        removes it if this raises)."""
        from h3direct.app.request import GenerateRequest, Roots
        from h3direct.app.serve.schema import request_fields
        from h3direct.dit.options import Options

        work = work or Work(None, None, None)
        names = request_fields()
        fields = {k: v for k, v in body.items() if k in names and v is not None}
        uploads = {}
        for name in ("ref_images", "ref_videos", "ref_audios", "first_frame", "last_frame", "text_embeds",
                     "prompt_file"):
            if name in fields:
                fields[name] = self._names(name, fields[name], work, uploads)
        fields["output"] = fields.get("output") or self._auto_name()
        request = GenerateRequest(**fields, roots=Roots(self.input_root, self.output_root, uploads),
                                  limits=self.limits)
        given = {k: v for k, v in body.items() if k not in names and k != "tier"}
        tier = self._tier(body["tier"]) if body.get("tier") is not None else None
        options = Options.from_flat({**(tier.options if tier else {}), **given}, base=self.options)
        options = self.pipe.check_options(dataclasses.replace(
            options, tier=tier.provenance(self.tiers) if tier else None))
        if request.resolved.text_embeds is not None:
            self.pipe.check_text(request.resolved.text_embeds)  # the pipeline's own check, here before queueing
        return request, options

    def _tier(self, name: str):
        """The tier a request names, if this server can run it: its options that are fixed when the models load
        (the 8-bit linears) must be the server's."""
        if self.tiers is None:
            raise RequestError("tier", f" {name!r}: this server has no tiers ({self.tiers_note})")
        missing = self.tiers.missing(name)
        if missing is not None:
            raise RequestError("tier", f" {name!r}: {missing}")
        tier = self.tiers.tiers[name]
        why = self._unservable(tier)
        if why:
            raise RequestError("tier", f" {name!r}: {why}")
        return tier

    def _unservable(self, tier) -> str | None:
        """Why this server cannot run `tier` (None: it can): a load-time option of the tier differs from the
        server's."""
        from h3direct.dit.options import Options

        loaded = self.options.kernels.load_time()
        wanted = Options.from_flat(tier.options).kernels.load_time()
        differ = {k: v for k, v in wanted.items() if v != loaded[k] and k in tier.options}
        if differ:
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in differ.items())
            return f"it needs the models loaded with {flags} (a server flag; this server runs " \
                   f"{', '.join(f'{k}={loaded[k]}' for k in differ)})"
        return None

    def _names(self, name: str, value, work: Work, uploads: dict):
        """A file field's names under --input-root, with each upload written to this request's folder and named
        `upload:NN-name` (`uploads` maps those names to the files)."""
        if isinstance(value, list):
            return [self._name(f"{name}[{i}]", v, work, uploads) for i, v in enumerate(value)]
        return self._name(name, value, work, uploads)

    def _name(self, field_label: str, value, work: Work, uploads: dict) -> str:
        import base64
        import binascii
        import re
        import tempfile

        if isinstance(value, str):
            if self.input_root is None:
                raise RequestError(field_label, ": this server reads no input files by name (it was started "
                                   "without --input-root); send the file itself: {\"filename\": ..., \"base64\": ...}")
            return value
        try:
            data = base64.b64decode(value["base64"], validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(field_label, ": the upload is not valid base64") from None
        if not data:
            raise RequestError(field_label, ": the upload is empty")
        with self._lock:
            if self._uploads is None:
                self._uploads = Path(tempfile.mkdtemp(prefix="h3direct-uploads-"))
        if work.uploads is None:
            work.uploads = Path(tempfile.mkdtemp(prefix="request-", dir=self._uploads))
        given = Path(value.get("filename") or "upload").name
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", given).lstrip(".")[-100:] or "upload"
        stored = f"{len(os.listdir(work.uploads)):02d}-{safe}"
        (work.uploads / stored).write_bytes(data)
        uploads[f"upload:{stored}"] = work.uploads / stored
        return f"upload:{stored}"

    def _auto_name(self) -> str:
        with self._lock:
            self._counter += 1
            return f"h3-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._counter:05d}.mp4"

    def _forget(self, job: Job) -> None:
        """A job is over (done, failed, cancelled; its mp4 is in place or gone): its uploads go, its output files are
        no longer reserved."""
        self._remove_uploads(job.work)
        self._release_outputs(job.work)

    @staticmethod
    def _remove_uploads(work) -> None:
        import shutil

        if work is not None and work.uploads is not None:
            shutil.rmtree(work.uploads, ignore_errors=True)

    # ---- a job on the worker ----
    def _run_job(self, job: Job, check) -> dict:
        import torch

        from h3direct.app.generate import clip, summary_of

        work, pipe = job.work, self.pipe
        t_start = time.perf_counter()
        queue_s = max(0.0, (job.started or time.time()) - job.created)
        check(stage="conditioning")

        def on_stage(name: str) -> None:
            if name.endswith(":tile"):  # within a stage: only a chance to stop
                check()
            elif name != "done":  # (done: the mp4 is in place, too late to cancel)
                check(stage=name)

        try:
            res, out, write_s = clip(pipe, work.request, work.options, callback=lambda ev: check(step=ev.index + 1),
                                     on_stage=on_stage, ffmpeg_loglevel=self.settings.ffmpeg_loglevel)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()  # give the cached blocks back, so the next (smaller) job can run
            raise
        self._add_calls(res.calls)
        timings = {"queue": round(queue_s, 4), **res.timings, "write": round(write_s, 4),
                   "total": round(queue_s + time.perf_counter() - t_start, 4)}
        job.timings = timings
        return summary_of(work.request, work.options, res, out, pipe, self.sources, timings, self.load_memory)

    def _add_calls(self, calls: dict) -> None:
        with self._lock:
            self.calls.add(calls)

    # ---- /ready ----
    def ready(self) -> dict:
        from h3direct.app.provenance import version

        pipe, running = self.pipe, self.queue.running
        text = pipe.text_encoder  # (None while its policy has it unloaded)
        components = {k: {"source": self.sources.get(k), **self.weights.get(k, {}), **_describe(m)}
                      for k, m in (("dit", pipe.dit), ("video_vae", pipe.video_vae), ("audio_vae", pipe.audio_vae),
                                   ("text_encoder", text)) if m is not None}
        if pipe.text.present and text is None:
            components["text_encoder"] = {"source": self.sources.get("text_encoder"),
                                          **self.weights.get("text_encoder", {}), "device": None}
        components["dit"]["compute_dtype"] = str(pipe.dit.compute_dtype).removeprefix("torch.")
        with self._lock:
            calls = {"attention": {}, "fp8_linear": {}, **self.calls.as_dict()}
        if pipe.kernels.fp8_linear != "off":  # opt-in approximate block linears, chosen when the weights loaded
            components["dit"]["fp8_linear"] = {"mode": pipe.kernels.fp8_linear, "calls": calls["fp8_linear"]}
        return {"status": "ready", "version": version(), "device": str(pipe.device), "components": components,
                "memory": {**_memory(pipe.device), "weights": self._weights_held()},
                "text_encoder_residency": pipe.text.view() if pipe.text.present else None,
                "attention": {**self._attention(), "calls": calls["attention"]},
                "options": self._options(),
                "tiers": self._tiers(),
                "limits": {**self.limits.as_dict(), "max_body_bytes": self.max_body_bytes,
                           "job_timeout_s": self.queue.timeout_s},
                "queue": {"depth": self.queue.depth(), "size": self.queue.size,
                          "running": running.id if running is not None else None, "completed": self.queue.completed},
                "weight_loads": self.weight_loads, "load_seconds": self.load_seconds,
                "output_root": str(self.output_root),
                "input_root": str(self.input_root) if self.input_root else None,
                "auth": "bearer" if self.token else "none"}

    def _weights_held(self) -> dict | None:
        """{component: bytes, "total"} of the weights the models hold once loaded (`app/footprint.py`)."""
        held = self.pipe.footprint()
        return None if held is None else {**held, "total": sum(held.values())}

    def _attention(self) -> dict:
        import torch

        from h3direct.dit.attention import backends, unavailable_reason

        like = torch.empty(0, device=self.pipe.device, dtype=self.pipe.dit.compute_dtype)
        reasons = {b: unavailable_reason(self.options.attention.using(b), like) for b in backends()}
        return {"default": self.options.attention.backend,
                "available": [b for b, r in reasons.items() if r is None],
                "unavailable": {b: r for b, r in reasons.items() if r is not None}}

    def _tiers(self) -> dict:
        """The tiers a request may name, with what they measured where they were chosen, and whether this server
        runs each (its load-time options)."""
        if self.tiers is None:
            return {"file": None, "note": self.tiers_note, "tiers": {}}
        out = {}
        for name, t in self.tiers.tiers.items():
            why = self._unservable(t)
            out[name] = {"options": t.options, "rule": t.rule, "bound": t.bound,
                         **{k: t.figures[k] for k in TIER_FIGURES if k in t.figures},
                         "servable": why is None, **({"why": why} if why else {})}
        return {"file": str(self.tiers.path), "device_name": self.tiers.machine.get("device_name"), "tiers": out}

    def _options(self) -> dict:
        """Which options a request may set (its fields), their server defaults, and those fixed at load."""
        from h3direct.dit.options import flat_options

        flat = self.options.flat()
        per_request = [o.flat for o in flat_options() if o.spec.per_request]
        return {"per_request": per_request, "defaults": {k: flat[k] for k in per_request},
                "fixed_at_load": {o.flat: flat[o.flat] for o in flat_options() if not o.spec.per_request}}


def _memory(device) -> dict:
    import torch

    from h3direct.app.pipeline import peak_memory

    peak, _ = peak_memory(device)
    if device.type == "cuda":
        return {"kind": "cuda", "allocated_bytes": int(torch.cuda.memory_allocated(device)),
                "reserved_bytes": int(torch.cuda.memory_reserved(device)), "peak_bytes": peak}
    return {"kind": "cpu_rss", "rss_bytes": _rss_bytes(), "peak_bytes": peak}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _describe(module) -> dict:
    """dtype (by bytes), quantization, device, parameter count and bytes of a loaded model."""
    from h3direct.app.footprint import by_dtype, tensors

    module = getattr(module, "net", module)  # the text encoder wraps its torch module
    held = tensors(module)
    by = by_dtype(module)
    modes = sorted({getattr(m, "mode", "?") for m in module.modules() if type(m).__name__ == "NVFP4Linear"})
    return {"dtype": max(by, key=by.get) if by else None, "dtypes": by,
            "quantization": f"nvfp4 ({', '.join(modes)})" if modes else "none",
            "device": ",".join(sorted({str(t.device) for t in held})), "parameters": sum(t.numel() for t in held),
            "bytes": sum(by.values())}
