"""Real SGLang 0.5.23 on a CPU-only test machine: a `sitecustomize` for the servers the tests start.

Not shipped: production runs SGLang on GPUs (infra/k8s/sglang-*.yaml), where none of this applies. The
system tests (tests/system/test_sglang_real.py) put this directory on the PYTHONPATH of the server they
start, so Python runs this file at the start of the server and of every process SGLang starts for it (its
scheduler and detokenizer are new interpreters with the same environment); no SGLang file is edited.

What it changes, and why: SGLang's rotary embedding picks a compiled kernel in its constructor unless it
runs on CUDA with a head size it has kernels for, or one of its other platforms
(sglang/srt/layers/rotary_embedding/base.py:122-140). On a CPU it takes the last branch, `from
vllm._custom_ops import rotary_embedding` (base.py:138), and the scheduler dies: there is no vLLM in its
virtualenv. The module flag that skips that branch, `_is_cpu` (base.py:39), is True only under
SGLANG_USE_CPU_ENGINE=1 (srt/utils/common.py:221-224), which also switches SGLang to its CPU engine, whose
ops come from sgl_kernel's CPU build (not installed: `make sglang-venv` leaves the CUDA-only packages out).
So this file sets that one flag, right after the module is first imported. With it the embedding runs
`forward_native`, its plain torch code (forward_cpu, base.py:423-451, calls an sgl_kernel op only on a CPU
with AMX, which this machine has not: `cpu_has_amx_support()`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

ROPE_MODULE = "sglang.srt.layers.rotary_embedding.base"


class _FlagSettingLoader(importlib.abc.Loader):
    """Runs the module's own loader, then sets `_is_cpu` on the module."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        if not hasattr(module, "_is_cpu"):  # SGLang moved it: fail at import, not with vLLM's ImportError
            raise ImportError(f"{ROPE_MODULE} has no _is_cpu flag: harness/sglang_cpu is for SGLang 0.5.23")
        module._is_cpu = True


class _RopeFlagFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ROPE_MODULE it wraps the loader the other finders found."""

    def find_spec(self, fullname, path, target=None):
        if fullname != ROPE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _FlagSettingLoader(spec.loader)
        return spec


sys.meta_path.insert(0, _RopeFlagFinder())
