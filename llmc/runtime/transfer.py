"""Host arrays to the device without waiting for it."""
from __future__ import annotations

import numpy as np
import torch


def to_device(a, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`a` (a numpy array or a list) as a tensor on `device`. To a GPU through pinned memory without waiting:
    a plain copy from pageable memory waits for every kernel queued before it, and the host could not
    prepare a step while the device runs the last one."""
    t = torch.from_numpy(np.asarray(a)).to(dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
