"""Progress bars on stderr for one generation (`h3direct generate`): text encode, sampling steps, video decode (per
tile), audio decode and the mp4 write; plain lines when tqdm is missing."""

from __future__ import annotations


class Progress:
    """tqdm bars on stderr for each long stage of one generation: text encode, sampling steps, video decode (per
    tile), audio decode and the mp4 write. `stage(name)` / `step(event)` are the pipeline's hooks; a disabled one
    draws nothing."""

    LABELS = {"text_encode": "text encode", "decode_video": "decode video", "decode_audio": "decode audio",
              "write": "write mp4"}

    def __init__(self, steps: int, enabled: bool):
        self.enabled, self.steps = enabled, steps
        self._bar = None
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm
            except ImportError:  # plain lines instead
                self._tqdm = None

    def _open(self, desc: str, total: int, unit: str):
        import sys

        self.close()
        if self._tqdm is not None:
            self._bar = self._tqdm(total=total, file=sys.stderr, unit=unit, desc=desc, leave=True)
        else:
            print(f"h3direct generate: {desc}", file=sys.stderr, flush=True)

    def stage(self, name: str) -> None:
        if not self.enabled:
            return
        if name == "sample":
            self._open("sampling", self.steps, "step")
        elif name == "decode_video":
            self._open(self.LABELS[name], None, "tile")
        elif name == "decode_video:tile":
            if self._bar is not None:
                self._bar.update(1)
        elif name in self.LABELS:
            self._open(self.LABELS[name], 1, "stage")
        else:
            self.close()

    def step(self, ev) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"σ={ev.sigma:.4f} {ev.seconds:.2f}s", refresh=False)
            self._bar.update(1)
        else:
            import sys

            print(f"step {ev.index + 1}/{ev.total} sigma {ev.sigma:.4f} {ev.seconds:.3f}s", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            if self._bar.unit == "stage" and self._bar.n < self._bar.total:
                self._bar.update(self._bar.total - self._bar.n)
            self._bar.close()
            self._bar = None
