"""benchmarks/schedule_sim.py's least time of a workload under its cost model, on cases worked by hand."""
import pytest

from tests.scripts import BENCHMARKS, load_script

sim = load_script("schedule_sim", BENCHMARKS)

# GEMMs: 1 ms for the weights plus 0.01 ms a row, linear throughout (so the convex minorant is the line)
LINE = dict(gemm_ms={256: 1 + 2.56, 512: 1 + 5.12}, weights_ms=1.0, layers=1, heads=1, kv_heads=1, head_dim=1,
            step_ms=0.1, token_us=0.0)


def test_least_steps_and_time_on_a_line():
    # two requests: 10-token prompt + 3 outputs and 20 + 2; the longest output needs 3 steps (its prompt's and
    # two decodes); 33 tokens are fed (prompts and every output but the last)
    seconds, steps = sim.bound(LINE, [(10, 3), (20, 2)], slots=128)
    assert steps == 3
    kv_tokens = (10 + 1) + (10 + 2) + (20 + 1)  # each decode reads its context: prompt plus the tokens so far
    kv = kv_tokens * sim.kv_bytes_per_token(LINE) / (sim.KV_TB_S * 1e12)
    attn = 4 * (10 * 11 // 2 + 20 * 21 // 2) / (sim.PREFILL_TFLOPS * 1e12)
    assert seconds == pytest.approx((3 * (1.0 + 0.1) + 0.01 * 33) / 1e3 + kv + attn)


def test_slots_bound_the_steps_and_a_convex_curve_spreads_the_rows():
    # 300 requests of one output each over 128 slots: at least ceil(300 / 128) = 3 steps
    assert sim.bound(LINE, [(1, 1)] * 300, slots=128)[1] == 3
    # a curve that costs much more a row past 256 rows: 600 rows run best over more steps than the 1 needed
    steep = dict(LINE, gemm_ms={256: 1 + 2.56, 512: 1 + 2.56 + 25.6})
    seconds, steps = sim.bound(steep, [(600, 1)], slots=128)
    assert steps == 3 and seconds * 1e3 == pytest.approx(3 * 1.1 + 0.01 * 600, rel=1e-3)
