"""The end-to-end contract (a contract of kind "e2e", benchmarks/ref2va-960x544-124f-e2e.json), run by run_contract.

    python -m benchmarks.run_contract --contract benchmarks/ref2va-960x544-124f-e2e.json --out R.json \
        [--comfy-root C] [--configs nvfp4] [--tokenizer DIR]
    python -m benchmarks.run_contract --contract benchmarks/ref2va-960x544-124f-e2e.json --merge A.json B.json --out R.json

One whole Ref2VA generation, the contract's prompt and one reference image -> an mp4 on disk, per configuration
(weight format of the DiT and the text encoder), by ComfyUI's own workflow (first, in its own process) and by
h3direct (then, in this one). Each side builds the same full-size synthetic tensors of every component (DiT, text
encoder, video and audio VAE: same recipes, seed and device; `synthetic_gpu.py`), makes one warm-up generation of
`warmup_steps` (kernel choice, compilation, models moved where they run) and then the timed one. Stages, seconds,
the device synchronised around each:

- text_encode_s: the reference image resized and VAE-encoded, the presentation tokenized and run through the text
  encoder (ComfyUI: its MiniMaxH3ReferenceToVideo node; h3direct: the pipeline's conditioning + text_encode);
- denoise_s: the sampling steps (ComfyUI: ModelSamplingMiniMaxH3 + KSampler, cfg 1, the negative a
  ConditioningZeroOut; h3direct: text refine + sample);
- video_decode_s, audio_decode_s: the VAE decodes (ComfyUI: VAEDecode, VAEDecodeAudio);
- mp4_write_s: the write after the decodes (ComfyUI: CreateVideo + SaveVideo, which encode after the decode;
  h3direct: what is left of its encoder thread's work once the decodes are done, plus the mux); h3direct also
  reports mp4_encode_busy_s, the encoder thread's own seconds;
- total_s: the whole generation, wall clock (h3direct: `app.generate.clip`, what the CLI and the service run).

Peak GPU memory of each side: `max_memory_allocated` over the timed generation, every model resident. The mp4 each
side wrote is read back (frames, size, audio). --smoke: tiny sizes on any device (the tiny ComfyUI side too, its
Qwen3-VL and VAE classes built at the tiny sizes); compare refuses it. --merge: one result from runs of disjoint
configurations of the same contract, commit and device (so that each configuration can run in its own device
call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks import _common as C
from benchmarks.compare import e2e_ratios
from h3direct.app.frontier.grid import options_of

DIT_ONLY = {"paths": None, "floor_seconds": None, "no_vae": False, "comfy_rounds": 2}  # run_contract flags of the DiT contract alone
TOKENIZER = "comfy/text_encoders/qwen25_tokenizer"  # the Qwen2 tokenizer's files in a ComfyUI checkout
VIT_FIELDS = ("num_layers", "heads", "dim_head", "rope_theta", "rope_dim_ratio", "bias", "eps", "num_register_tokens",
              "ff_mult")  # VideoVAEConfig fields that are ComfyUI's ViT3DDecoder's, the rest MiniMaxH3VideoVAE's


_fail = C.usage_error


def main(args, contract: dict, argv) -> int:
    for key in ("contract", "workload", "weights", "configs", "h3direct", "comfyui"):
        if key not in contract:
            _fail(f"--contract {args.contract}: missing {key!r}")
    given = [f"--{k.replace('_', '-')}" for k, default in DIT_ONLY.items() if getattr(args, k) != default]
    if given:
        _fail(f"{', '.join(given)}: a flag of the DiT contract, not of the e2e contract {contract['contract']}")
    if args.comfy_only:
        return comfy_worker(args, contract)
    if args.merge:
        return merge(args, contract)
    names, tokenizer = _check_args(args, contract)
    dev = C.run_device(args)
    wl, preset = workload(contract, args)
    result = {**C.result_header(contract, args, argv, dev, wl), "kind": "e2e",
              "weights": {**contract["weights"], "dit_preset": preset.dit_config, "vae": preset.vae_preset,
                          "text_encoder": preset.text_encoder},
              "tokenizer": str(tokenizer), "configs": {}}
    result["comfyui"] = None
    result["comfyui_note"] = ("no ComfyUI configuration ran (each configuration's comfyui status says why)"
                              if args.comfy_root else "no same-run ComfyUI (run with --comfy-root to measure "
                                                      "total_ratio)")
    for name in names:  # the result is written after each side: a run cut short keeps what finished
        entry = result["configs"][name] = {}
        if args.comfy_root:
            entry["comfyui"] = C.run_comfy_process(args, name, dev)
            C.log(f"ComfyUI {name}: {_summary(entry['comfyui'])}")
            if entry["comfyui"].get("status") == "ok" and result["comfyui"] is None:
                c = entry["comfyui"]
                result["comfyui"] = {"commit": c.get("commit"), "version": c.get("version"),
                                     "comfy_kitchen": c.get("environment", {}).get("comfy_kitchen")}
                del result["comfyui_note"]
            C.write_result(args.out, result)
        try:
            entry["h3direct"] = run_h3direct(contract, args, name, wl, preset, dev, tokenizer)
        except Exception as exc:  # noqa: BLE001 - one configuration failing (out of memory, ...) is its status
            traceback.print_exc()
            entry["h3direct"] = {"status": f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"}
        C.free_memory(dev)  # every block of this process back to the device before the next ComfyUI process
        C.log(f"h3direct {name}: {_summary(entry['h3direct'])}")
        entry.update(e2e_ratios(result).get(name, {}))
        C.write_result(args.out, result)
    C.log(f"result: {args.out}")
    return 0


def _summary(side: dict) -> str:
    if side.get("status") != "ok":
        return side.get("status", "?")
    st = side["stages"]
    return ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in st.items()) + f", peak {side['peak_gpu_gib']}"


def _check_args(args, contract: dict) -> tuple[list[str], object]:
    """The configurations to run and the tokenizer; every bad flag is a one-line error here, before any build."""
    from h3direct.errors import H3Error

    names = args.configs.split(",") if args.configs else list(contract["configs"])
    unknown = [n for n in names if n not in contract["configs"]]
    if unknown:
        _fail(f"--configs: {', '.join(unknown)} not a configuration of the contract "
              f"({', '.join(contract['configs'])})")
    C.check_run_flags(args)
    try:
        options_of(contract["h3direct"])
    except H3Error as exc:
        _fail(f"--contract: h3direct: {exc}")
    tokenizer = args.tokenizer or (str(Path(args.comfy_root) / TOKENIZER) if args.comfy_root else None)
    if tokenizer is None:
        if not args.smoke:
            _fail("the text encoder needs the Qwen2 tokenizer: --tokenizer DIR (vocab.json, merges.txt) or "
                  "--comfy-root (its comfy/text_encoders/qwen25_tokenizer)")
        return names, "bytes"  # --smoke without one: UTF-8 bytes as token ids (the bundled tokenizer)
    from h3direct.text.load import find_tokenizer

    try:
        return names, find_tokenizer(None, tokenizer)
    except H3Error as exc:
        _fail(f"--tokenizer: {exc}")


def workload(contract: dict, args) -> tuple[dict, C.Preset]:
    """The generation of the contract (tiny sizes with --smoke; --steps overrides the count, compare refuses it)."""
    w = contract["workload"]
    preset = C.PRESETS["tiny" if args.smoke else "full"]
    size = (preset.width, preset.height, preset.frames) if args.smoke else (w["width"], w["height"], w["frames"])
    from h3direct.sampling.conditioning import latent_shapes

    frame_count = latent_shapes(*size)[0]
    return {"task": w["task"], "width": size[0], "height": size[1], "frames": size[2], "frame_count": frame_count,
            "prompt": w["prompt"], "steps": args.steps or w["steps"], "warmup_steps": contract.get("warmup_steps", 1),
            "sampler": w["sampler"], "scheduler": w["scheduler"], "cfg": w["cfg"], "seed": w["seed"],
            "fps": w["fps"]}, preset


def probe_mp4(path) -> dict:
    """What an mp4 holds: decoded video frames, size, rate, audio streams, bytes."""
    import av

    with av.open(str(path)) as box:
        v = box.streams.video[0]
        frames = sum(1 for _ in box.decode(video=0))
        return {"frames": frames, "width": v.width, "height": v.height, "fps": float(v.average_rate),
                "audio_streams": len(box.streams.audio), "bytes": Path(path).stat().st_size}


# ---------------------------------------------------------------- h3direct

class _Counted:
    """The text encoder, noting how many positions it was given (the DiT's text rows)."""

    def __init__(self, encoder):
        self.encoder, self.tokens = encoder, None

    def encode(self, presentation):
        self.tokens = len(presentation.token_ids)
        return self.encoder.encode(presentation)


def run_h3direct(contract: dict, args, name: str, wl: dict, preset, dev, tokenizer) -> dict:
    """One configuration through `app.generate.clip` (H3Pipeline.generate + the streamed mp4) on synthetic models."""
    import torch

    from benchmarks.synthetic_gpu import build_audio_vae, build_dit, build_text_encoder, build_video_vae
    from h3direct.app.generate import clip
    from h3direct.app.pipeline import H3Pipeline
    from h3direct.app.request import GenerateRequest
    from h3direct.config import H3Config
    from h3direct.dit.attention import unavailable_reason
    from h3direct.dit.loader import apply_load_time
    from h3direct.text.load import make_tokenizer

    spec, side, seed = contract["configs"][name], contract["h3direct"], contract["weights"].get("seed", 0)
    options = options_of(side)
    cuda = C.is_cuda(dev)
    vae_name = side.get("vae_dtype", "fp16") if cuda else "fp32"  # the CPU runs the video VAE in fp32 (ComfyUI too)
    vae_dtype = {"fp16": torch.float16, "fp32": torch.float32}[vae_name]
    like = torch.empty(0, device=dev, dtype=torch.bfloat16)
    reason = unavailable_reason(options.attention, like)
    if reason is not None:
        return {"status": f"unavailable: {reason}", "settings": {"attention": options.attention.backend}}
    builds, models = {}, {}
    try:
        models["text"], builds["text_encoder"] = build_text_encoder(preset.text_encoder, spec["text_encoder"], dev, seed)
        models["dit"], builds["dit"] = build_dit(H3Config.from_name(preset.dit_config), spec["dit"], dev,
                                                 nvfp4_mode=spec.get("nvfp4_mode", "w4a16"), seed=seed,
                                                 fp8_linear=options.kernels.fp8_linear)
        apply_load_time(models["dit"], **options.kernels.load_time())  # the rest of the path's load-time options
        models["video"], builds["video_vae"] = build_video_vae(preset.vae_preset, dev, vae_dtype, seed)
        models["audio"], builds["audio_vae"] = build_audio_vae(preset.vae_preset, dev, seed)
        text = _Counted(models["text"])
        pipe = H3Pipeline(models["dit"], models["video"], models["audio"], text_encoder=text,
                          tokenize=make_tokenizer(tokenizer), device=dev, vae_dtype=vae_dtype,
                          kernels=options.kernels)
        settings = {**C.path_settings(models["dit"], options, builds["dit"], like),
                    "dit": weight_format(models["dit"]), "text_encoder": weight_format(models["text"]),
                    "text_compute_dtype": str(models["text"].compute_dtype).removeprefix("torch."),
                    "vae_dtype": VAE_DTYPES[str(next(models["video"].parameters()).dtype).removeprefix("torch.")],
                    "tokenizer": str(tokenizer)}
        img = C.reference_image(wl, seed)
        with tempfile.TemporaryDirectory() as tmp:
            def request(steps: int, file: str):
                return GenerateRequest(prompt=wl["prompt"], width=wl["width"], height=wl["height"],
                                       frames=wl["frames"], steps=steps, seed=wl["seed"], sampler=wl["sampler"],
                                       scheduler=wl["scheduler"], cfg=wl["cfg"], ref_images=[img],
                                       output=str(Path(tmp) / file))

            t = time.perf_counter()
            clip(pipe, request(wl["warmup_steps"], "warmup.mp4"), options)
            warmup_s = time.perf_counter() - t
            C.sync(dev)
            t = time.perf_counter()
            res, out, write_s = clip(pipe, request(wl["steps"], "clip.mp4"), options)
            C.sync(dev)
            total_s = time.perf_counter() - t
            mp4 = probe_mp4(out)
        s = res.timings
        stages = {"text_encode_s": s["conditioning"] + s["text_encode"], "denoise_s": s["text_preprocess"] + s["sample"],
                  "video_decode_s": s["decode_video"], "audio_decode_s": s["decode_audio"], "mp4_write_s": write_s,
                  "total_s": total_s}
        return {"status": "ok", "settings": settings, "text_tokens": text.tokens, "steps": len(res.step_seconds),
                "step_s": res.step_seconds, "stages": stages, "mp4_encode_busy_s": s["write_busy"],
                "peak_gpu_gib": C.peak_gib(dev), "warmup_s": warmup_s, "builds": builds, "mp4": mp4,
                "attention_calls": res.calls.get("attention")}
    finally:
        models.clear()


# ---------------------------------------------------------------- ComfyUI, one configuration per process

VAE_DTYPES = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}  # torch dtype -> the contract's name


def weight_format(model) -> str:
    """What a built model holds (not what was asked for): "nvfp4" when its linears keep NVFP4's packed bytes, else
    "bf16"."""
    from h3direct.app.footprint import by_dtype

    return "nvfp4" if by_dtype(model).get("uint8") else "bf16"


def comfy_worker(args, contract: dict) -> int:
    """--comfy-only CONFIG: ComfyUI with the contract's settings runs the generation through its own nodes; the
    timing JSON goes to --out."""
    from h3direct.errors import H3Error

    name = args.comfy_only
    if name not in contract["configs"]:
        _fail(f"--comfy-only {name!r}: not a configuration of the contract ({', '.join(contract['configs'])})")
    if not args.comfy_root:
        _fail("--comfy-only needs --comfy-root")
    side = contract["comfyui"]
    device = args.device or "cpu"
    try:
        if side["settings"] == "user" and device == "cuda":
            from oracle.comfy_env import prepare_user_process

            prepare_user_process(args.comfy_root)  # before torch: ComfyUI's CUDA allocator choice
        from oracle.comfy_env import open_comfy

        env = open_comfy(args.comfy_root, device=device, compute_dtype="bf16" if device == "cuda" else "fp32",
                         attention=side["attention"], settings=side["settings"])
        wl, preset = workload(contract, args)
        import torch

        with torch.inference_mode():  # as ComfyUI's executor runs every node, its loaders included
            res = comfy_generation(env, contract, name, wl, preset, device)
    except H3Error as exc:  # a missing package, a checkout without H3: one line for the result's status
        print(f"run_contract: error: {exc}", file=sys.stderr)
        return 2
    res.update(C.comfy_provenance(env))
    C.write_result(args.out, res)
    return 0


def comfy_vae_arguments(video_cfg, audio_cfg) -> dict:
    """ComfyUI constructor arguments of the VAE classes for h3direct VAE configs: the fields that differ from the
    released sizes (none for the full preset)."""

    def changed(cfg) -> dict:
        out = {}
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            if v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    video = changed(video_cfg)
    return {"MiniMaxH3VideoVAE": {k: v for k, v in video.items() if k not in VIT_FIELDS},
            "ViT3DDecoder": {k: v for k, v in video.items() if k in VIT_FIELDS},
            "MiniMaxH3AudioVAE": changed(audio_cfg)}


def _comfy_text_encoder(env, config, weights: str, seed: int, device):
    """ComfyUI's CLIP object of the synthetic text encoder (the tensors h3direct's build draws), through
    `comfy.sd.load_text_encoder_state_dicts` as its CLIPLoader (type minimax) loads a file. A smaller encoder than
    Qwen3-VL-32B (--smoke) is built by setting ComfyUI's Qwen3-VL sizes to it first, and declared H3's for the load
    (ComfyUI tells the H3 encoder by its 50th layer)."""
    import importlib

    from benchmarks.synthetic_gpu import text_encoder_tensors
    from h3direct.text.qwen import PRESETS

    options, detected = {}, contextlib.nullcontext()
    if config != PRESETS["qwen3vl_32b"]:
        detected = _swapped(env.sd, "detect_te_model", lambda sd: env.sd.TEModel.QWEN3VL_32B)
        q3 = importlib.import_module("comfy.text_encoders.qwen3vl")
        v = config.vision
        q3.QWEN3VL_VISION["qwen3vl_32b"] = dict(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                                                depth=v.depth,
                                                deepstack_visual_indexes=list(v.deepstack_visual_indexes))
        q3.QWEN3VL_VISION_COMMON["num_heads"] = v.num_heads
        options["qwen3vl_32b_model_config"] = dict(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads)
    sd = dict(text_encoder_tensors(config, weights, device, seed))
    with detected:
        return env.sd.load_text_encoder_state_dicts([sd], clip_type=env.sd.CLIPType.MINIMAX, model_options=options)


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def comfy_generation(env, contract: dict, name: str, wl: dict, preset, dev) -> dict:
    """The models built, then a warm-up and the timed generation through ComfyUI's nodes, each node timed (under
    the caller's inference mode, as ComfyUI's executor runs them)."""
    import importlib

    import torch

    from benchmarks.synthetic_gpu import build_audio_vae, build_video_vae, text_encoder_config
    from h3direct.config import H3Config
    from h3direct.vae import AUDIO_PRESETS, VIDEO_PRESETS
    from oracle.record_vae import sized_classes

    nodes = importlib.import_module("nodes")
    h3 = importlib.import_module("comfy_extras.nodes_minimax_h3")
    audio_nodes = importlib.import_module("comfy_extras.nodes_audio")
    video_nodes = importlib.import_module("comfy_extras.nodes_video")
    folder_paths = importlib.import_module("folder_paths")
    spec, seed = contract["configs"][name], contract["weights"].get("seed", 0)
    vae_dtype = torch.float16 if C.is_cuda(dev) else torch.float32  # the synthetic VAE files hold fp16 values
    config = H3Config.from_name(preset.dit_config)
    builds = {}
    t = time.perf_counter()
    clip = _comfy_text_encoder(env, text_encoder_config(preset.text_encoder), spec["text_encoder"], seed, dev)
    builds["text_encoder_s"] = time.perf_counter() - t
    C.free_memory(dev)  # the built tensors' blocks back to the device before ComfyUI plans where models go
    patcher, builds["dit_load_s"] = C.comfy_dit(env, config, spec["dit"], seed, dev)
    C.free_memory(dev)
    t = time.perf_counter()
    vaes = {}
    sizes = comfy_vae_arguments(VIDEO_PRESETS[preset.vae_preset], AUDIO_PRESETS[preset.vae_preset])
    for kind, build in (("video", lambda: build_video_vae(preset.vae_preset, dev, vae_dtype, seed)),
                        ("audio", lambda: build_audio_vae(preset.vae_preset, dev, seed))):
        model, _ = build()  # h3direct's synthetic VAE: its tensors are the file's (module paths = file keys)
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        del model
        with sized_classes(sizes):
            vaes[kind] = env.sd.VAE(sd=sd)  # its own dtype choice, as its VAELoader makes it
        del sd
        C.free_memory(dev)
    builds["vae_s"] = time.perf_counter() - t
    img = C.reference_image(wl, seed)
    cond_rows = []

    def v3(node):  # a V3 node's class as ComfyUI's executor calls it (hidden inputs: none)
        return node.PREPARE_CLASS_CLONE(None)

    def out(ret):
        return ret.result if hasattr(ret, "result") else ret

    def generation(steps: int, prefix: str) -> dict:
        stages: dict = {}

        def timed(key, fn):
            C.sync(dev)
            t0 = time.perf_counter()
            value = fn()
            C.sync(dev)
            stages[key] = stages.get(key, 0.0) + time.perf_counter() - t0
            return value

        def denoise():
            model = out(v3(h3.MiniMaxH3SigmaShift).execute(patcher, config.sigma_shift_video,
                                                           config.sigma_shift_audio))[0]
            negative = nodes.ConditioningZeroOut().zero_out(positive)[0]
            return nodes.KSampler().sample(model, wl["seed"], steps, wl["cfg"], wl["sampler"], wl["scheduler"],
                                           positive, negative, latent)[0]

        def write():
            video = out(v3(video_nodes.CreateVideo).execute(images=images, fps=float(wl["fps"]), audio=audio))[0]
            v3(video_nodes.SaveVideo).execute(video=video, filename_prefix=prefix, format="auto",
                                              codec={"codec": "auto"})

        start = time.perf_counter()
        positive, latent = out(timed("text_encode_s", lambda: v3(h3.MiniMaxH3ReferenceToVideo).execute(
            clip=clip, vae=vaes["video"], audio_vae=vaes["audio"], prompt=wl["prompt"], width=wl["width"],
            height=wl["height"], length=wl["frames"], ref_image_size="match", ref_images={"ref_image_1": img})))
        cond_rows.append(int(positive[0][0].shape[1]))
        samples = timed("denoise_s", denoise)
        images = timed("video_decode_s", lambda: nodes.VAEDecode().decode(vaes["video"], samples)[0])
        audio = timed("audio_decode_s", lambda: out(v3(audio_nodes.VAEDecodeAudio).execute(vaes["audio"], samples))[0])
        timed("mp4_write_s", write)
        C.sync(dev)
        stages["total_s"] = time.perf_counter() - start
        return stages

    with tempfile.TemporaryDirectory() as tmp:
        folder_paths.set_output_directory(tmp)
        t = time.perf_counter()
        generation(wl["warmup_steps"], "warmup")
        warmup_s = time.perf_counter() - t
        C.reset_peak(dev)
        stages = generation(wl["steps"], "clip")
        (written,) = sorted(Path(tmp).glob("clip*.mp4"))
        mp4 = probe_mp4(written)
    settings = {"settings": env.settings, "attention": contract["comfyui"]["attention"],
                "dit": spec["dit"], "text_encoder": spec["text_encoder"], "dit_dtype": str(patcher.model_dtype()),
                "vae_dtype": str(vaes["video"].vae_dtype), "shift": [config.sigma_shift_video, config.sigma_shift_audio]}
    return {"status": "ok", "settings": settings, "text_tokens": cond_rows[-1], "steps": wl["steps"],
            "stages": stages, "peak_gpu_gib": C.peak_gib(dev), "warmup_s": warmup_s, "builds": builds, "mp4": mp4}


# ---------------------------------------------------------------- one result from several runs

def merge(args, contract: dict) -> int:
    """--merge A.json B.json ...: the configurations of runs of the same contract, commit, device and smoke flag as
    one result (each configuration from exactly one run)."""
    parts = []
    for path in args.merge:
        try:
            parts.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            _fail(f"--merge {path}: {exc}")
    first = parts[0]
    for path, part in zip(args.merge, parts, strict=True):
        for key in ("contract", "commit", "tree", "device", "smoke", "workload", "weights"):
            if part.get(key) != first.get(key):
                _fail(f"--merge {path}: {key} {part.get(key)!r} differs from {args.merge[0]}'s {first.get(key)!r}")
    if first.get("contract") != contract["contract"]:
        _fail(f"--merge: the runs are of contract {first.get('contract')!r}, not {contract['contract']!r}")
    merged = {**first, "configs": {}, "merged_from": [{"command": p.get("command"), "date": p.get("date"),
                                                       "configs": sorted(p.get("configs", {}))} for p in parts]}
    for path, part in zip(args.merge, parts, strict=True):
        for name, entry in part.get("configs", {}).items():
            if name in merged["configs"]:
                _fail(f"--merge {path}: configuration {name!r} is in two runs")
            merged["configs"][name] = entry
        if part.get("comfyui") and not merged.get("comfyui"):
            merged["comfyui"] = part["comfyui"]
            merged.pop("comfyui_note", None)
    C.write_result(args.out, merged)
    C.log(f"merged {len(parts)} runs ({', '.join(merged['configs'])}): {args.out}")
    return 0
