"""comfy-kitchen (Apache-2.0, the kernels ComfyUI itself calls), when installed and loadable."""

from __future__ import annotations

from functools import cache


@cache
def kitchen_op(name: str):
    """`comfy_kitchen.<name>`, or None when comfy-kitchen is absent or its extension does not load here."""
    try:
        import comfy_kitchen
    except Exception:  # not installed, or built against another torch
        return None
    return getattr(comfy_kitchen, name, None)
