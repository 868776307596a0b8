"""Draws docs/residency_timeline.png, the residency timeline of docs/architecture.md: a 6-layer decoder
(builder layout, random weights) under a budget of 60% of its weights on the CPU host
backend, generating 6 tokens. Needs matplotlib (pip install 'onnx-offload[plot]')."""
import os

import numpy as np

from onnx_offload import OffloadSession
from onnx_offload.models import weight_bytes
from onnx_offload.models.decoder import decoder_lm

model = decoder_lm("gqa", layers=6, hidden=128, intermediate=384, vocab=512, max_length=256)
budget = int(weight_bytes(model) * 0.6) // 4096 * 4096
with OffloadSession(model.SerializeToString(), providers=["CPUExecutionProvider"], offload=True, vmm=True,
                    vram_limit=budget, host_granularity=4096, cache_dir="off", record_timeline=True) as s:
    s.generate(np.arange(8)[None], 6)
    s._model_name = "a 6-layer decoder (builder layout)"
    print(s.timeline_png(os.path.join(os.path.dirname(os.path.abspath(__file__)), "residency_timeline.png")))
