"""Where fqr's part of a cold first call goes (issue 37): one fresh process, the CUDA context
made first (as ``fqr bench --cold-start`` does), then the first call of a preset's public op
under cProfile. Run it twice with the same ``TRITON_CACHE_DIR`` and a fresh ``FQR_CACHE_DIR``
(the first run leaves Triton's runtime pieces, as the cold start's untimed warm-up does) and
``FQR_KERNEL_BUNDLE`` set to a bundle holding the preset's kernels (``fqr build``).

    python scripts/profile_first_call.py qwen3-8b [tokens] [lines]
"""

import cProfile
import io
import pstats
import sys
import time

import torch
import triton  # noqa: F401  (imported before the clock starts, as in the cold start)

from fqr.presets import get_preset
from fqr.prologue import variant_of

name = sys.argv[1]
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1
lines = int(sys.argv[3]) if len(sys.argv) > 3 else 35
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
from triton.runtime import driver  # noqa: E402

driver.active.get_current_device()
driver.active.utils  # noqa: B018  (Triton's CUDA utilities, loaded once per process)
preset = get_preset(name)
variant = variant_of(preset)
gen = torch.Generator(device="cuda").manual_seed(0)
inputs = variant.draw(preset, tokens, torch.bfloat16, gen, max_position=preset.max_position)
table = preset.cos_sin_cache(preset.max_position).cuda()
torch.cuda.synchronize()
profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
variant.run_in_place(preset, inputs, table, backend="triton")
torch.cuda.synchronize()
profile.disable()
took = time.perf_counter() - start
for order in ("cumulative", "tottime"):
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(order).print_stats(lines)
    print(text.getvalue())
print(f"first call of {name} (T={tokens}) under cProfile: {took * 1e3:.1f} ms")
from fqr.lowering.bundle import STATS  # noqa: E402

print(f"kernels loaded from the bundle: {STATS.loaded}, compiled: {STATS.compiled}")
