"""The quantization algorithms on plain tensors: GPTQ against a naive column-by-column version of
the same algorithm, and GPTQ, AWQ and SmoothQuant against round-to-nearest on the output error of
layers whose activations have the structure each method exploits (correlated channels, salient
channels, outlier channels)."""
import pytest
import torch

from llmc.errors import CompileError
from llmc.ir.quant import QuantFormat, codes, int_scales, qlinear_ref, quantize_int_with, quantize_rtn
from llmc.passes.quantize.awq import awq_clip_search, awq_quantize, awq_search, swiglu_row_weights
from llmc.passes.quantize.gptq import gptq_quantize
from llmc.passes.quantize.smoothquant import smoothquant_quantize, smoothquant_scales

N, K, M = 64, 256, 512
INT4_G64 = QuantFormat("int", 4, group_size=64)
INT4_G64_ZP = QuantFormat("int", 4, group_size=64, has_zeros=True)
INT4_CH = QuantFormat("int", 4)
INT8_CH = QuantFormat("int", 8)
W8A8 = QuantFormat("w8a8", 8)
FP8 = QuantFormat("fp8", 8)


def correlated(m: int, seed: int, outliers: int = 4, scale: float = 20.0) -> torch.Tensor:
    """Calibration inputs [m, K] like a transformer's: mixed (correlated) channels, a few of them large."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K ** 0.5
    x = torch.randn(m, K, generator=g) @ mix + 0.3 * torch.randn(m, K, generator=g)
    x[:, torch.randperm(K, generator=torch.Generator().manual_seed(0))[:outliers]] *= scale
    return x


def salient(m: int, seed: int, n: int = 8, scale: float = 10.0) -> torch.Tensor:
    """Inputs [m, K] whose same few channels (fixed across seeds) are much larger than the rest."""
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed))
    x[:, torch.randperm(K, generator=torch.Generator().manual_seed(0))[:n]] *= scale
    return x


def weight(n: int, seed: int) -> torch.Tensor:
    return 0.05 * torch.randn(n, K, generator=torch.Generator().manual_seed(seed))


def naive_gptq(w, h, fmt, damp=0.01, act_order=False, scale_dtype=torch.bfloat16):
    """GPTQ as the OBS update states it, in fp64: one column at a time, each column's error spread
    over the later columns by the explicit inverse Hessian, whose row and column are then removed
    by one Gaussian elimination step; no blocks, no Cholesky."""
    n, k = w.shape
    W, H = w.double().clone(), h.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    gs = fmt.group_size or k
    qmax, half = (1 << fmt.bits) - 1, float(1 << (fmt.bits - 1))
    groups = {}
    if act_order:
        groups = {j: int_scales(W[:, j * gs:(j + 1) * gs].float(), fmt, scale_dtype) for j in range(k // gs)}
    order = torch.argsort(H.diagonal(), descending=True) if act_order else torch.arange(k)
    W, H = W[:, order], H[order][:, order]  # column t of W is input column order[t]
    Hinv = torch.linalg.inv(H + damp * H.diagonal().mean() * torch.eye(k, dtype=torch.float64))
    Q = torch.zeros(n, k, dtype=torch.float64)
    for t, c in enumerate(order.tolist()):
        if not act_order and c % gs == 0:
            groups[c // gs] = int_scales(W[:, t:t + gs].float(), fmt, scale_dtype)
        s, z = groups[c // gs]
        s = s[:, 0].double()
        z = z[:, 0].double() if z is not None else half
        Q[:, c] = torch.clamp(torch.round(W[:, t] / s) + z, 0, qmax)
        err = W[:, t] - (Q[:, c] - z) * s
        W[:, t + 1:] -= err[:, None] * Hinv[0, 1:][None, :] / Hinv[0, 0]
        Hinv = Hinv[1:, 1:] - Hinv[1:, :1] @ Hinv[:1, 1:] / Hinv[0, 0]
    scales = torch.cat([groups[j][0] for j in range(k // gs)], dim=1)
    zeros = torch.cat([groups[j][1] for j in range(k // gs)], dim=1) if fmt.has_zeros else None
    return Q, scales, zeros


def hessian(x):
    return 2 * x.T @ x / x.shape[0]


def out_err(x, w, wq):
    return float((x @ w.T - x @ wq.T).norm())


@pytest.mark.parametrize("fmt,act_order,block_size", [
    *[(f, a, 128) for f in (INT4_G64, INT4_G64_ZP, INT4_CH, INT8_CH) for a in (False, True)],
    (INT4_G64, False, 40), (INT4_G64_ZP, False, 40), (INT4_G64, True, 40), (INT4_CH, False, 40),
], ids=lambda v: v.label if isinstance(v, QuantFormat) else str(v))
def test_gptq_matches_naive_obs(fmt, act_order, block_size):
    """Blocks, lazy updates and the Cholesky rows compute the naive OBS loop (block 40 puts group
    starts inside blocks, whose groups then reach into the next block)."""
    x, w = correlated(M, 0), weight(N, 1)
    h = hessian(x)
    qw = gptq_quantize(w, h, fmt, act_order=act_order, block_size=block_size)
    q_ref, s_ref, z_ref = naive_gptq(w, h, fmt, act_order=act_order)
    q = codes(fmt, qw.qweight)
    assert q.shape == (N, K) and qw.scales.shape == s_ref.shape
    assert (q.double() == q_ref).double().mean() >= 0.99
    assert (qw.scales == s_ref).double().mean() >= 0.99 and torch.allclose(qw.scales.float(), s_ref.float(), rtol=1e-2)
    if fmt.has_zeros:
        assert (qw.zeros.int() - z_ref.int()).abs().max() <= 1
    g = K // s_ref.shape[1]
    z = z_ref.double().repeat_interleave(g, 1) if z_ref is not None else float(1 << (fmt.bits - 1))
    dq_ref = (q_ref - z) * s_ref.double().repeat_interleave(g, 1)
    assert float((qw.dequantize().double() - dq_ref).norm() / dq_ref.norm()) < 1e-2


@pytest.mark.parametrize("fmt", [INT4_G64, INT4_CH, INT8_CH], ids=lambda f: f.label)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_below_rtn(fmt, act_order):
    x, w = correlated(M, 0), weight(N, 1)
    gptq = out_err(x, w, gptq_quantize(w, hessian(x), fmt, act_order=act_order).dequantize())
    rtn = out_err(x, w, quantize_rtn(w, fmt).dequantize())
    assert gptq < 0.85 * rtn


@pytest.mark.parametrize("fmt", [QuantFormat("int", 4, 64), QuantFormat("int", 4, 64, True)])
def test_gptq_scale_search(fmt):
    """Each group's range shrunk by the best factor (p = 1 among them): the H_ii-weighted rounding
    error of the scales chosen never exceeds min-max's, and GPTQ's output error drops with it."""
    from llmc.passes.quantize.gptq import group_scales
    x = correlated(512, 7)
    w, h = weight(64, 8), hessian(x)
    weight_ = h.diagonal().float()

    def rounding_error(s, z):
        q = quantize_int_with(w, fmt, s, z).float()
        zero = z.float().repeat_interleave(64, 1) if z is not None else 8.0
        return float((((q - zero) * s.float().repeat_interleave(64, 1) - w) ** 2 * weight_).sum())
    assert rounding_error(*group_scales(w, fmt, torch.bfloat16, 20, weight_)) <= \
        rounding_error(*group_scales(w, fmt, torch.bfloat16, 0, weight_))
    plain = out_err(x, w, gptq_quantize(w, h, fmt).dequantize())
    searched = out_err(x, w, gptq_quantize(w, h, fmt, search=20).dequantize())
    assert searched < plain


def test_gptq_dead_columns_and_hessian_scale():
    """An input that is always 0 gives a zero weight column; H and any multiple of it give the same codes."""
    x, w = correlated(M, 0), weight(N, 1)
    x[:, [3, 100]] = 0
    h = hessian(x)
    qw = gptq_quantize(w, h, INT4_G64)
    dq = qw.dequantize()
    assert torch.isfinite(dq).all() and dq[:, [3, 100]].eq(0).all() and dq[:, 4].ne(0).any()
    scaled = gptq_quantize(w, 1000 * h, INT4_G64)
    assert (codes(INT4_G64, scaled.qweight) == codes(INT4_G64, qw.qweight)).double().mean() >= 0.99


def test_gptq_indefinite_hessian_asks_for_more_damping():
    h = torch.eye(K)
    h[0, 1] = h[1, 0] = 2.0  # eigenvalue -1: no damping of 1% of the mean diagonal fixes it
    with pytest.raises(CompileError, match="raise the damping"):
        gptq_quantize(weight(N, 1), h, INT4_G64)


def test_awq_below_rtn_on_salient_channels():
    """On fresh tokens of the same distribution, q and a narrower k searched together, stored as the
    pass stores them (scaled, then clip-searched), and scaled alone (scored without the clip search)."""
    x, ws = salient(M, 0), [weight(N, 1), weight(N // 2, 2)]
    xt, gram, x_mean = salient(M, 1), x.T @ x, x.abs().mean(0)
    for fmt in (INT4_G64, INT4_G64_ZP, INT4_CH):
        rtn = sum(out_err(xt, w, quantize_rtn(w, fmt).dequantize()) ** 2 for w in ws)
        for clip in (False, True):
            s, alpha = awq_search(ws, gram, x_mean, fmt, clip=clip)
            assert 0 <= alpha <= 1 and s.shape == (K,)
            expect = x_mean.pow(alpha)
            assert torch.allclose(s, expect / (expect.max() * expect.min()).sqrt(), rtol=1e-5)
            shrink = [awq_clip_search(w, gram, fmt, s=s) if clip else None for w in ws]
            awq = sum(out_err(xt, w, awq_quantize(w, s, fmt, shrink=r).dequantize() / s) ** 2 for w, r in zip(ws, shrink))
            assert awq < 0.9 ** 2 * rtn


def test_awq_row_weights_choose_what_counts():
    """A linear whose rows all weigh 0 drops out of the joint search (and it did change the joint choice)."""
    x = salient(M, 0)
    gram, x_mean = x.T @ x, x.abs().mean(0)
    wide = weight(N, 3)
    wide[:, torch.randperm(K, generator=torch.Generator().manual_seed(0))[:8]] *= 8  # big weights where x is big
    ws = [weight(N, 1), wide]
    alone, _ = awq_search(ws[:1], gram, x_mean, INT4_G64)
    joint, _ = awq_search(ws, gram, x_mean, INT4_G64)
    masked, _ = awq_search(ws, gram, x_mean, INT4_G64, row_weights=[torch.ones(N), torch.zeros(N)])
    assert not torch.equal(joint, alone) and torch.equal(masked, alone)


def test_swiglu_row_weights():
    """Against their definition on the tensors; a gate channel that silu turns off gives its up row ~0 weight."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, 32, generator=g)
    x[:, 0] += 3
    wg, wu, wd = torch.randn(48, 32, generator=g), torch.randn(48, 32, generator=g), torch.randn(32, 48, generator=g)
    wg[0] = 0
    wg[0, 0] = -5  # gate channel 0 at about -15: silu ~ 0, so up's channel 0 hardly reaches down's output
    gate, up = x @ wg.T, x @ wu.T
    h = torch.nn.functional.silu(gate) * up
    rg, ru = swiglu_row_weights(wg, wu, wd, x.T @ x / M, h.T @ h / M)
    c = wd.square().sum(0) * h.square().mean(0)
    torch.testing.assert_close(rg, c / gate.square().mean(0))
    torch.testing.assert_close(ru, c / up.square().mean(0))
    assert ru[0] < 1e-3 * ru[1:].mean()


def test_awq_unit_scales_is_rtn():
    w = weight(N, 1)
    for fmt in (INT4_G64, INT4_G64_ZP, INT8_CH):
        a, r = awq_quantize(w, torch.ones(K), fmt), quantize_rtn(w, fmt)
        assert torch.equal(a.qweight, r.qweight) and torch.equal(a.scales, r.scales)
        assert (a.zeros is None and r.zeros is None) or torch.equal(a.zeros, r.zeros)


def naive_clip_search(w, gram, fmt, s, ratios):
    """Each (row, group) on its own: the shrink factor whose rounding error, weighted by the group's
    diagonal block of X^T X, is least (the reference implementation's search, through `awq_quantize`)."""
    n, k = w.shape
    gs = fmt.group_size
    best = torch.ones(n, k // gs)
    for i in range(n):
        for j in range(k // gs):
            cols = slice(j * gs, (j + 1) * gs)
            errs = []
            for r in ratios:
                shrink = torch.ones(n, k // gs)
                shrink[i, j] = r
                d = (awq_quantize(w, s, fmt, shrink=shrink).dequantize() / s - w)[i, cols]
                errs.append(float(d @ gram[cols, cols] @ d))
            best[i, j] = ratios[min(range(len(ratios)), key=errs.__getitem__)]
    return best


def test_awq_clip_search_lowers_error():
    x, w = salient(M, 0), weight(N, 1)
    gram = x.T @ x
    s, _ = awq_search([w], gram, x.abs().mean(0), INT4_G64)
    shrink = awq_clip_search(w, gram, INT4_G64, s=s)
    assert shrink.shape == (N, K // 64) and (shrink <= 1).all() and (shrink >= 0.5).all() and (shrink < 1).any()
    xt = salient(M, 1)
    clipped = out_err(xt, w, awq_quantize(w, s, INT4_G64, shrink=shrink).dequantize() / s)
    assert clipped < 0.97 * out_err(xt, w, awq_quantize(w, s, INT4_G64).dequantize() / s)

    def calib_err(r):
        return out_err(x, w, awq_quantize(w, s, INT4_G64, shrink=r).dequantize() / s)
    alone = awq_clip_search(w, gram, INT4_G64, s=s, sweeps=0)
    assert calib_err(shrink) < calib_err(alone)  # the groups chosen together, for the row's whole error


def test_awq_clip_search_per_group_matches_naive():
    x, w = correlated(M, 0), weight(8, 1)
    gram, s = x.T @ x, torch.rand(K, generator=torch.Generator().manual_seed(2)) + 0.5
    got = awq_clip_search(w, gram, INT4_G64, s=s, grid=10, sweeps=0)
    torch.testing.assert_close(got, naive_clip_search(w, gram, INT4_G64, s, [1 - 0.05 * i for i in range(11)]))


def test_smoothquant_scales_formula():
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(K, generator=g) * 10
    amax[5] = 0  # a dead channel: s stays positive
    ws = [torch.randn(N, K, generator=g), torch.randn(N // 4, K, generator=g)]
    for alpha in (0.5, 0.8):
        s = smoothquant_scales(amax, ws, alpha)
        for j in range(K):
            wmax = max(float(w[:, j].abs().max()) for w in ws)
            expect = max(max(float(amax[j]), 1e-5) ** alpha / wmax ** (1 - alpha), 1e-5)
            assert abs(float(s[j]) - expect) <= 1e-5 * expect
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_scales(amax, ws, 1.5)


@pytest.mark.parametrize("fmt,ratio", [(W8A8, 0.5), (FP8, 0.85)], ids=["int8", "fp8"])
def test_smoothquant_lowers_w8a8_error(fmt, ratio):
    """Per-token activation quantization loses the small channels to the outliers unless smoothed
    (fp8 less so: its relative precision keeps small values, down to its subnormals)."""
    x, w = salient(M, 0, n=4, scale=50.0), weight(N, 1)
    s = smoothquant_scales(x.abs().amax(0), [w], 0.5)
    xt = salient(M, 1, n=4, scale=50.0)
    plain = quantize_rtn(w, fmt)
    smooth = smoothquant_quantize(w, s, fmt)
    ref = xt @ w.T
    e_plain = (qlinear_ref(xt, fmt, plain.qweight, plain.scales) - ref).norm()
    e_smooth = (qlinear_ref(xt / s, fmt, smooth.qweight, smooth.scales) - ref).norm()
    assert e_smooth < ratio * e_plain


def test_unsupported_formats_and_bad_arguments_are_clear_errors():
    w, x = weight(N, 1), salient(M, 0)
    for fmt in (W8A8, FP8):
        with pytest.raises(ValueError, match="GPTQ quantizes to weight-only int formats"):
            gptq_quantize(w, hessian(x), fmt)
        with pytest.raises(ValueError, match="use SmoothQuant"):
            awq_search([w], x.T @ x, x.abs().mean(0), fmt)
        with pytest.raises(ValueError, match="use SmoothQuant"):
            awq_quantize(w, torch.ones(K), fmt)
    with pytest.raises(ValueError, match="use AWQ or GPTQ"):
        smoothquant_quantize(w, torch.ones(K), INT4_G64)
    with pytest.raises(ValueError, match="at least one grid point"):
        awq_search([w], x.T @ x, x.abs().mean(0), INT4_G64, grid=0)
    with pytest.raises(ValueError, match="Hessian is"):
        gptq_quantize(w, torch.eye(K - 1), INT4_G64)
