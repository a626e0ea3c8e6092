"""vLLM's own ``buffer_utils.py`` (Model Runner V2), loaded for the serve benchmark's ``vllm+graph`` mode.

Lab code, not library code. ``load()`` executes ``vllm/v1/worker/gpu/buffer_utils.py`` of vLLM
0.33.0 from ``.vllm/`` (extracted from the PyPI wheel; ignored by git, nothing of it is
copied here) as it is: ``UvaBufferPool``, ``UvaBackedTensor``, ``StagedWriteTensor`` and its
Triton kernel ``_apply_write_kernel``.

The four modules it imports are not small or self-contained (``vllm.envs``,
``vllm.platforms``, and a compiled op ``torch.ops._C.get_cuda_view_from_cpu_tensor``), so
a minimal shim stands in for them here, with what the file uses of each:

- ``vllm.logger.init_logger``: structlog's logger;
- ``vllm.triton_utils``: the real ``triton`` and ``triton.language``;
- ``vllm.utils.platform_utils.is_uva_available``: True with CUDA, else False (vLLM's
  ``NonUvaBuffer`` path: explicit copies, which is also what runs on CPU);
- ``vllm.utils.torch_utils``: ``async_tensor_h2d`` as vLLM writes it (a fresh pinned
  temporary, then a non-blocking copy) and ``get_accelerator_view_from_cpu_tensor`` as a
  ``__cuda_array_interface__`` over the pinned bytes (UVA: no copy), where vLLM calls its
  compiled op;
- ``vllm.platforms.current_platform.device_type``: the engine's device type.

On CPU the Triton kernel runs in Triton's interpreter where ``TRITON_INTERPRET=1`` (the
tests); otherwise ``_apply_write_kernel`` is replaced by its torch twin
(``_TorchApplyWrite``), and the table notes say which. Without ``.vllm/`` (CI) ``load()``
returns ``rebuild``: the same classes written here from reading that file, labelled as a
rebuild wherever they are used.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog
import torch

from pinpool.bench.sglang_files import exec_file

_BUFFER_UTILS = Path("vllm/v1/worker/gpu/buffer_utils.py")
VLLM_VERSION = "0.33.0"


def vllm_dir() -> Path | None:
    """``.vllm/`` beside the checkout or in the working directory, if it holds ``buffer_utils.py``."""
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / ".vllm" / _BUFFER_UTILS).is_file():
            return root / ".vllm"
    return None


@attrs.frozen
class VllmBuffers:
    """What the ``vllm+graph`` mode takes from vLLM, and where it came from (for the table note)."""

    staged_write_tensor: Any
    uva_backed_tensor: Any
    async_tensor_h2d: Any
    source: str


def async_tensor_h2d(
    data: Any, device: Any = None, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """vLLM's ``async_tensor_h2d``: a fresh pinned temporary, then a non-blocking copy."""
    if dtype is None and out is not None:
        dtype = out.dtype
    target = torch.device(device or (out.device if out is not None else "cpu"))
    pin = torch.cuda.is_available() and target.type == "cuda"
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if isinstance(data, torch.Tensor):
        t = data
        if pin and not t.is_pinned():
            t = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=True).copy_(t)
    else:
        t = torch.tensor(
            data, dtype=dtype, pin_memory=pin, device="cpu"
        )  # sync-ok: a host tensor, as vLLM's helper makes
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device=device, dtype=dtype, non_blocking=True)


class _HostView:
    """A ``__cuda_array_interface__`` over a pinned host tensor's bytes (UVA); keeps it alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        typestr = np.dtype(host.numpy().dtype).str
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def accelerator_view(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """The device view of pinned ``cpu_tensor`` at its own address: vLLM's compiled op, in Python.

    No ``device=`` argument: torch places the view on the device whose context pinned the
    memory, and a requested device that differed would make ``as_tensor`` copy instead.
    """
    return torch.as_tensor(_HostView(cpu_tensor))


class _TorchApplyWrite:
    """``_apply_write_kernel[grid](...)`` in torch: the CPU twin of vLLM's Triton kernel (one group)."""

    def __getitem__(self, grid: Any) -> Any:
        def launch(
            output: torch.Tensor,
            stride: int,
            indices: torch.Tensor,
            starts: torch.Tensor,
            contents: torch.Tensor,
            cu_lens: torch.Tensor,
            group_ids: Any,
            **_: Any,
        ) -> None:
            flat = output.view(-1)
            begin = 0
            for i in range(int(grid[0])):
                end = int(cu_lens[i])
                at = int(indices[i]) * stride + int(starts[i])
                flat[at : at + end - begin] = contents[begin:end]
                begin = end

        return launch


def _install_shim(device: torch.device) -> None:
    """The four modules ``buffer_utils.py`` imports, as the minimal stand-ins the module doc lists."""
    cuda = device.type == "cuda"

    def module(name: str, **attrs_: Any) -> None:
        mod = sys.modules.get(name) or types.ModuleType(name)
        mod.__dict__.update(attrs_)
        sys.modules[name] = mod

    import triton
    import triton.language as tl

    module("vllm")
    module("vllm.logger", init_logger=lambda name: _Logger(name))
    module("vllm.triton_utils", triton=triton, tl=tl)
    module("vllm.utils")
    module("vllm.utils.platform_utils", is_uva_available=lambda: cuda)
    module(
        "vllm.utils.torch_utils",
        async_tensor_h2d=async_tensor_h2d,
        get_accelerator_view_from_cpu_tensor=accelerator_view,
    )
    module("vllm.platforms", current_platform=types.SimpleNamespace(device_type=device.type))


class _Logger:
    def __init__(self, name: str) -> None:
        self._log = structlog.get_logger(name)
        self._said: set[str] = set()

    def warning_once(self, message: str, *args: Any) -> None:
        if message not in self._said:
            self._said.add(message)
            self._log.info("vllm.warning", message=message)


_loaded: dict[str, VllmBuffers] = {}


def load(device: torch.device) -> VllmBuffers:
    """vLLM's classes from ``.vllm/`` under the shim, else the rebuild (said in ``source``)."""
    hit = _loaded.get(device.type)
    if hit is not None:
        return hit
    root = vllm_dir()
    if root is None:
        found = VllmBuffers(
            RebuiltStagedWriteTensor,
            RebuiltUvaBackedTensor,
            async_tensor_h2d,
            f"rebuild (no .vllm/: written here from vLLM {VLLM_VERSION}'s buffer_utils.py, not its code)",
        )
    else:
        _install_shim(device)
        mod = exec_file(f"vllm.v1.worker.gpu.buffer_utils_{device.type}", root / _BUFFER_UTILS)
        kernel = "its Triton kernel"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            mod._apply_write_kernel = _TorchApplyWrite()
            kernel = "its Triton kernel replaced by a torch twin on CPU"
        elif device.type != "cuda":
            kernel = "its Triton kernel, in Triton's interpreter"
        found = VllmBuffers(
            mod.StagedWriteTensor,
            mod.UvaBackedTensor,
            async_tensor_h2d,
            f"vLLM {VLLM_VERSION}'s own buffer_utils.py ({kernel}; logger, platform and UVA-view imports shimmed)",
        )
    _loaded[device.type] = found
    return found


class RebuiltUvaBackedTensor:
    """vLLM's ``UvaBackedTensor``, rebuilt: a host table copied into the next of two buffers on each ``copy_to_uva``.

    Pinned buffers read in place by the device (UVA) where CUDA is; explicit copies into a
    device buffer elsewhere (vLLM's ``NonUvaBuffer``). Depth 2, no event: the ring depth
    must be >= the steps in flight, as vLLM's comment says.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | None = None) -> None:
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()
        self._cuda = torch.cuda.is_available()
        self._bufs = [torch.zeros(size, dtype=dtype, pin_memory=self._cuda) for _ in range(2)]
        self._views = [accelerator_view(b) if self._cuda else b for b in self._bufs]
        self._curr = 0
        self.gpu = self.copy_to_uva()

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        self._curr ^= 1
        buf = self._bufs[self._curr]
        buf.numpy()[: len(self.np) if n is None else n] = self.np[:n]
        self.gpu = self._views[self._curr][:n]
        return self.gpu


class RebuiltStagedWriteTensor:
    """vLLM's ``StagedWriteTensor``, rebuilt: sparse row writes collected on the host, applied on the device.

    vLLM applies them with one Triton kernel reading UVA index buffers; the rebuild uploads
    the indices and contents in one copy each and scatters with torch (``index_put_``).
    """

    def __init__(self, size: int | Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self.gpu = torch.zeros(size, dtype=dtype, device=device)
        self.device = device
        self._flat: list[int] = []
        self._contents: list[int | float] = []

    def stage_write_elem(self, index: int, x: int) -> None:
        self._flat.append(index * self.gpu.stride(0))
        self._contents.append(x)

    def apply_write(self) -> None:
        if not self._flat:
            return
        at = async_tensor_h2d(self._flat, self.device, torch.int64)
        values = async_tensor_h2d(self._contents, self.device, self.gpu.dtype)
        self.gpu.view(-1).index_put_((at,), values)
        self._flat.clear()
        self._contents.clear()
