"""What an engine runs on, read from its own start-up log.

The compute check: the compute a
replica runs on is the engine's own report — for llama.cpp its start-up log
at the moment the shard becomes READY (devices, backend, layers offloaded) —
sent in ``ShardStatus.compute`` and ``RunningShard.compute``.

:class:`ComputeReport` is fed the engine's output lines as they come and
says, at any time, what they show. The text it gives (the control plane's
compute check relies on the first word):

- ``"CUDA0 (NVIDIA GeForce RTX 4090): 33/33 layers"`` — layers offloaded to
  the devices named; ``", rest on CPU"`` is added when only some are;
- ``"GPU: 20/33 layers, rest on CPU"`` — offloaded, devices not named;
- ``"CPU"`` — a CPU-only run: no GPU device, or a shard given no cards whose
  log names none;
- ``"CPU (0/33 layers offloaded; GPU found: CUDA0 (…))"`` — GPUs were seen but
  nothing was offloaded (the control plane fails such a shard if it was
  placed on cards);
- ``"CPU (no usable GPU: <the engine's words>)"`` — the engine said so;
- ``""`` — not known: cards were given but the log says nothing (llama.cpp
  prints its devices only from verbosity 4, ``-lv 4``).

The sim engine answers ``"CPU (sim)"`` unless it printed a start-up log in
llama.cpp's format (its compute-check fault injection), which is read the
same way.

Lines are matched anywhere (llama.cpp prefixes them with a time and a level,
``0.00.006.013 I cmn  common_param: …``). Recognised:

- ``using device CUDA0 (NVIDIA …) …`` (``llama_model_load_from_file_impl``);
- the ``device_info:`` list: ``  - CUDA0   : NVIDIA … (24080 MiB, 23500 MiB free)``;
- ``ggml_cuda_init: found 1 CUDA devices`` / ``ggml_vulkan: Found 1 Vulkan devices``;
- ``offloaded 33/33 layers to GPU``;
- ``CUDA0 model buffer size = …``;
- ``no usable GPU found`` / ``failed to initialize CUDA: …``.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["SIM_COMPUTE", "ComputeReport", "progress_text"]

#: What a sim engine runs on when its log names nothing.
SIM_COMPUTE: Final = "CPU (sim)"
#: The longest progress text sent, in characters.
MAX_PROGRESS_CHARS: Final = 200

_USING_DEVICE: Final = re.compile(r"using device (\S+) \(([^)]*)\)")
_DEVICE_INFO: Final = re.compile(r"^\s*-\s+(\S+)\s*:\s*(.*?)\s*\(\d+ MiB")
_FOUND_DEVICES: Final = re.compile(
    r"(?:found|Found) (\d+) (CUDA|Vulkan|ROCm|HIP|SYCL|Metal) devices?"
)
_OFFLOADED: Final = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER: Final = re.compile(r"\b([A-Za-z]+\d+) model buffer size")
_NO_GPU: Final = re.compile(
    r"(no usable GPU found[^\n]*|failed to initialize (?:CUDA|Vulkan)[^\n]*)", re.IGNORECASE
)
#: A leading llama.cpp log prefix: ``0.00.006.013 I srv    load_model: ``.
_LOG_PREFIX: Final = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] (?:[A-Za-z]{1,6}\s+(?=\S+:\s))?")


def _is_cpu(device: str) -> bool:
    return device.upper().startswith("CPU")


class ComputeReport:
    """What an engine's start-up output says it runs on.

    Args:
        engine: the adapter name; ``sim`` defaults to :data:`SIM_COMPUTE`.
        gpu_indices: the cards the shard was given (none: CPU by default).
    """

    def __init__(self, engine: str, gpu_indices: tuple[int, ...] = ()) -> None:
        self._engine = engine
        self._has_cards = bool(gpu_indices)
        #: device name → description, in the order first seen.
        self._used: dict[str, str] = {}
        self._found: dict[str, str] = {}
        self._found_count = 0
        self._offloaded: tuple[int, int] | None = None
        self._buffers: list[str] = []
        self._no_gpu = ""

    def feed(self, line: str) -> None:
        """Take one output line into account."""
        if (match := _USING_DEVICE.search(line)) is not None:
            name, desc = match.groups()
            if not _is_cpu(name):
                self._used.setdefault(name, desc.strip())
        elif (match := _OFFLOADED.search(line)) is not None:
            self._offloaded = (int(match.group(1)), int(match.group(2)))
        elif (match := _BUFFER.search(line)) is not None:
            name = match.group(1)
            if not _is_cpu(name) and name not in self._buffers:
                self._buffers.append(name)
        elif (match := _FOUND_DEVICES.search(line)) is not None:
            self._found_count = max(self._found_count, int(match.group(1)))
        elif (match := _NO_GPU.search(line)) is not None:
            self._no_gpu = match.group(1).strip()
        else:
            body = _LOG_PREFIX.sub("", line)
            body = body.split(": ", 1)[1] if body.startswith("common_param: ") else body
            if (match := _DEVICE_INFO.match(body)) is not None:
                name, desc = match.groups()
                if not _is_cpu(name):
                    self._found.setdefault(name, desc.strip())

    @property
    def text(self) -> str:
        """The report as sent in ``ShardStatus.compute`` (see the module docstring)."""
        used = self._used or {name: self._found.get(name, "") for name in self._buffers}
        names = ", ".join(f"{n} ({d})" if d else n for n, d in used.items())
        if self._offloaded is not None:
            done, total = self._offloaded
            if done > 0:
                where = names or "GPU"
                rest = ", rest on CPU" if done < total else ""
                return f"{where}: {done}/{total} layers{rest}"
            seen = names or ", ".join(f"{n} ({d})" if d else n for n, d in self._found.items())
            found = f"; GPU found: {seen}" if seen else ""
            return f"CPU (0/{total} layers offloaded{found})"
        if self._no_gpu:
            return f"CPU (no usable GPU: {self._no_gpu})"
        if names:
            return names
        if self._engine == "sim":
            return SIM_COMPUTE
        if self._found or self._found_count:
            return ""  # GPUs seen, nothing said about layers yet
        return "" if self._has_cards else "CPU"


def progress_text(line: str) -> str:
    """A loading-progress text from an engine output line: the line without
    llama.cpp's time/level prefix, at most :data:`MAX_PROGRESS_CHARS`
    characters; "" when nothing readable is left (a row of dots)."""
    text = _LOG_PREFIX.sub("", line).strip()
    if not any(c.isalnum() for c in text):
        return ""
    if len(text) > MAX_PROGRESS_CHARS:
        text = text[: MAX_PROGRESS_CHARS - 1] + "…"
    return text
