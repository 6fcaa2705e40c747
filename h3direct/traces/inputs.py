"""Self-describing inputs files (`h3_inputs` metadata, schema h3-oracle-inputs/1).

Layout of `../shared/oracle/inputs_*.safetensors`: tensors `video_noise`, `audio_noise`, `video_latent`,
`audio_latent`, `text_states`, `token_tags`, `sigma`, conditioning latents named in the metadata, and
optionally `layout_position_ids_f64`. The metadata JSON gives `task`, `variant`, `sigma`,
`sampler_seed`, `refs`, `keyframes` and `denoise_mask` with tensor names in place of tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3direct.errors import H3Error

SCHEMA = "h3-oracle-inputs/1"
TASKS = ("t2va", "fl2va", "ref2va")


@dataclass
class H3Inputs:
    task: str
    variant: str
    sigma: float
    seed: int
    tensors: dict[str, torch.Tensor]
    refs: list[dict] = field(default_factory=list)  # tensors resolved in place of names
    keyframes: list[dict] = field(default_factory=list)
    denoise_mask: dict[str, torch.Tensor] | None = None  # {"video": [1,1,T,H,W], "audio": [1,1,2,Ta]}
    meta: dict = field(default_factory=dict)
    path: str | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise H3Error(f"inputs file has no tensor {name!r}", path=self.path) from None

    get = __getitem__

    @property
    def sampler_seed(self) -> int:
        """The sampler seed, also the payload seed of the condition-noise augmentation."""
        return self.seed

    @property
    def text_states(self) -> torch.Tensor:
        return self[self.meta.get("text_states", "text_states")]

    @property
    def token_tags(self) -> torch.Tensor:
        return self[self.meta.get("token_tags", "token_tags")]

    @property
    def video_noise(self) -> torch.Tensor:
        return self["video_noise"]

    @property
    def audio_noise(self) -> torch.Tensor:
        return self["audio_noise"]

    @property
    def video_latent(self) -> torch.Tensor:
        return self["video_latent"]

    @property
    def audio_latent(self) -> torch.Tensor:
        return self["audio_latent"]


def load_inputs(path: str | Path) -> H3Inputs:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise H3Error("no such inputs file", path=path)
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            raw = (f.metadata() or {}).get("h3_inputs")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise H3Error(f"cannot read safetensors: {str(exc).splitlines()[0]}", path=path) from None
    if raw is None:
        raise H3Error("no 'h3_inputs' metadata: not a self-describing H3 inputs file", path=path)
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise H3Error(f"'h3_inputs' metadata is not JSON ({exc})", path=path) from None
    if meta.get("schema") != SCHEMA:
        raise H3Error(f"unknown inputs schema {meta.get('schema')!r}, expected {SCHEMA}", path=path)
    if meta.get("task") not in TASKS:
        raise H3Error(f"unknown task {meta.get('task')!r}; known: {', '.join(TASKS)}", path=path)

    def tensor(name):
        if name not in tensors:
            raise H3Error(f"metadata names tensor {name!r}, which the file does not hold", path=path)
        return tensors[name]

    def resolve(entry: dict) -> dict:
        out = dict(entry)
        for key in ("latent", "audio_latent"):
            if isinstance(out.get(key), str):
                out[key] = tensor(out[key])
        return out

    refs = []
    for r in meta.get("refs") or []:
        r = resolve(r)
        r.setdefault("latent_t", r["latent"].shape[2] if r.get("latent") is not None else 0)
        r.setdefault("ref_audio_t", r["audio_latent"].shape[-1] if r.get("audio_latent") is not None else 0)
        if r.get("latent") is not None:
            r.setdefault("latent_h", r["latent"].shape[3])
            r.setdefault("latent_w", r["latent"].shape[4])
        refs.append(r)
    keyframes = [resolve(k) for k in meta.get("keyframes") or []]
    mask = None
    if meta.get("denoise_mask"):
        dm = meta["denoise_mask"]
        mask = {k: tensor(dm[k]) for k in ("video", "audio") if isinstance(dm.get(k), str)}
    for name in ("video_noise", "audio_noise", "video_latent", "audio_latent"):
        tensor(name)
    sigma = float(meta["sigma"]) if "sigma" in meta else float(tensor("sigma").reshape(-1)[0])
    return H3Inputs(task=meta["task"], variant=meta.get("variant", meta["task"]), sigma=sigma,
                    seed=int(meta.get("sampler_seed", 0)), tensors=tensors, refs=refs, keyframes=keyframes,
                    denoise_mask=mask, meta=meta, path=str(path))


def check_fits(inputs: H3Inputs, config, what: str = "--inputs") -> None:
    """H3Error (one line) unless the inputs fit a DiT of `config` (an `H3Config`, e.g. from the checkpoint's header):
    text states [1, L, text_dim] (or already refined, hidden_size), video latents with latents_dim channels, audio
    latents with audio_latents_dim, and the same for every reference and keyframe latent. Checked before any
    compute, so a mismatched pair is this line and not a traceback from a matrix product."""
    c = config
    text = inputs.text_states
    if text.shape[-1] not in (c.text_dim, c.hidden_size):
        raise H3Error(f"{what}: text_states {list(text.shape)} are {text.shape[-1]} wide; the checkpoint takes "
                      f"[1, L, {c.text_dim}] (its text_dim): these inputs are for another model", path=inputs.path)
    latents = [("video_latent", inputs["video_latent"], 5, c.latents_dim),
               ("video_noise", inputs["video_noise"], 5, c.latents_dim),
               ("audio_latent", inputs["audio_latent"], 4, c.audio_latents_dim),
               ("audio_noise", inputs["audio_noise"], 4, c.audio_latents_dim)]
    for kind, items in (("refs", inputs.refs), ("keyframes", inputs.keyframes)):
        for i, item in enumerate(items):
            if item.get("latent") is not None:
                latents.append((f"{kind}[{i}].latent", item["latent"], 5, c.latents_dim))
            if item.get("audio_latent") is not None:
                latents.append((f"{kind}[{i}].audio_latent", item["audio_latent"], 4, c.audio_latents_dim))
    for name, t, ndim, channels in latents:
        if t.ndim != ndim or t.shape[1] != channels:
            raise H3Error(f"{what}: {name} {list(t.shape)} does not fit the checkpoint (needs {ndim} dims with "
                          f"{channels} channels): these inputs are for another model", path=inputs.path)
